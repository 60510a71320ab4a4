"""Retention of finished deliveries' step journals (docs/design/retention.md RT1-RT3), the slice
built so far: a real room worker on a real state directory, its wall clock a virtual one moved
past the retention period."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import pytest
import trio

from fake_pi.scenario import Hang, Step, Text
from runtime._cli import main
from runtime._clock import Clocks, MockWallClock, SystemSilenceClock
from runtime._config import ModelConfig, RetentionConfig, RoomWorkerConfig, StoreConfig
from runtime._errors import DeliveryError, DiskFailedError, JournalError, ReasonCode
from runtime._journal._inspect import verify_journal
from runtime._journal._store import Store, delivery_key, lane_key, open_store
from runtime._records import Admission, Settled
from runtime._rooms._retention import remove_step_journals, room_of
from runtime._rooms._worker import RoomWorker, open_room_worker

from .._workers import scripted_upstream
from ..journal.pg_fixtures import pg_dsn, pg_server
from .test_room_compaction import asked
from .test_room_worker import message, next_results

__all__ = ["pg_dsn", "pg_server"]  # the fixtures the PostgreSQL cases use
LIMIT: Final = 60.0
DAY: Final = 86_400.0
A, B = "dm:1", "dm:2"


async def test_rt1_rt2_rt3_a_finished_acknowledged_journal_goes_after_its_days(
    tmp_path: Path,
) -> None:
    """RT2: a delivery answered and acknowledged eight days ago has its step journal removed
    (journal_days = 7), durably; RT3: a duplicate still gets its result, with its seq, and no
    model request; RT1: kept whatever their age are an unacknowledged result's journal and
    every journal of a room with a delivery still running. The state directory verifies, and
    a host restarted on it replays the running delivery and still knows the expired one."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    steps: list[Step] = [Text(text="old"), Text(text="old"), Text(text="a new"), Hang(seconds=3600)]
    hanging = trio.Event()

    async def arrived(n: int) -> None:
        if n == 4:
            hanging.set()  # b2's request: it hangs

    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=arrived) as (model, url):
            config = RoomWorkerConfig(
                model=ModelConfig(base_url=url), retention=RetentionConfig(journal_days=7)
            )
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                store = worker.store
                await worker.deliver(message("b1", room=B))
                await worker.deliver(message("a1", room=A))
                first = await next_results(worker, 2)
                await worker.ack(max(r.seq for r in first))  # b1 and a1 acknowledged
                await worker.deliver(message("a2", room=A))
                (unacked,) = await next_results(worker, 1, after=max(r.seq for r in first))
                await worker.deliver(message("b2", room=B))  # B stays busy: its model hangs
                await hanging.wait()
                wall.advance(6 * DAY)
                assert await worker.expire_journals() == 0  # not old enough yet
                wall.advance(2 * DAY)
                removed = await worker.expire_journals()
                kept = {d: await store.exists(store.delivery_rel(d)) for d in ("a1", "a2", "b1")}
                duplicate = await worker.deliver(message("a1", room=A))
                again = worker.result_of("a1")
                asked = [
                    r for r in model.requests if "(message m-a1)" in str(r.body["messages"][-1])
                ]
            # a restart on what retention left: the running b2 is replayed (the scenario is
            # spent: a plain answer) and a1 is still known (RT3)
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                after_restart = worker.result_of("a1")
                later = await next_results(worker, 2)  # a2 again (unacknowledged), and b2
    assert removed == 1
    assert kept == {"a1": False, "a2": True, "b1": True}  # a2 unacked; b1's room is busy
    assert duplicate.disposition == "duplicate"
    assert again == {r.delivery_id: r for r in first}["a1"]
    assert len(asked) == 1  # the duplicate asked nothing
    assert unacked.delivery_id == "a2"
    assert after_restart == again
    assert {(r.delivery_id, r.outcome) for r in later} == {("a2", "reply"), ("b2", "reply")}
    _, findings = verify_journal(tmp_path / "state")
    assert [f for f in findings if f.problem] == []


async def test_rt10_journal_compact_removes_them_on_demand_and_waits_for_no_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """RT10 (the built part): ``pi-runtime journal compact`` removes the step journals past
    ``journal_days`` of a state directory no server holds — here, results published ten days
    ago (the host's wall clock was set back) — and is refused ``state_dir_locked`` while a
    room worker holds it."""
    ten_days_ago = MockWallClock.reading(time.time_ns() // 1_000_000 - int(10 * DAY * 1000))
    clocks = Clocks(silence=SystemSilenceClock(), wall=ten_days_ago)
    compact = ["journal", "compact", "--state-dir", str(tmp_path / "state")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="old")]) as (_model, url):
            config = RoomWorkerConfig(model=ModelConfig(base_url=url))
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                await worker.deliver(message("a1", room=A))
                (result,) = await next_results(worker, 1)
                await worker.ack(result.seq)
                refused = await trio.to_thread.run_sync(main, compact)
                log = tmp_path / "state" / worker.store.delivery_rel("a1")
            kept = await trio.to_thread.run_sync(log.exists)
            compacted = await trio.to_thread.run_sync(main, compact)
            gone = not await trio.to_thread.run_sync(log.exists)
    assert refused == 1
    assert "is in use by pid" in caplog.text
    assert kept
    assert compacted == 0
    assert "removed 1 step journal older than 7 days" in capsys.readouterr().out
    assert gone
    elsewhere = ["journal", "compact", "--state-dir", str(tmp_path / "elsewhere")]
    assert await trio.to_thread.run_sync(main, elsewhere) == 1
    assert "holds no file-store journal" in caplog.text
    assert not await trio.to_thread.run_sync((tmp_path / "elsewhere").exists)  # not created


def shared_admissions(store: Store) -> list[Admission | Settled]:
    """What the admission log holds of the deliveries, as the host last rewrote it."""
    records = store.admissions.contents.records
    return [r for r in records if isinstance(r, Admission | Settled)]


async def _answer(worker: RoomWorker, delivery_id: str) -> str:
    """How a delivery of ``delivery_id`` to room A is answered: its disposition, or the
    refusal's code."""
    try:
        return (await worker.deliver(message(delivery_id, room=A))).disposition
    except DeliveryError as error:
        return str(error.code)


@pytest.fixture(params=["file", "postgresql"])
def store_config(request: pytest.FixtureRequest) -> StoreConfig:
    """A room worker's store: the file store in its state directory, or a fresh PostgreSQL
    database (``tests/journal/pg_fixtures.py``)."""
    if request.param == "file":
        return StoreConfig()
    return StoreConfig(url=request.getfixturevalue("pg_dsn"), lease_seconds=60, poll_seconds=0.05)


@pytest.mark.parametrize(
    ("first_days", "then_days"),
    [(40, 40), (400, 40), (40, 400)],
    ids=["unchanged", "lowered", "raised"],
)
async def test_rt4_the_expired_id_filter_follows_forget_days_at_once(
    tmp_path: Path, store_config: StoreConfig, first_days: int, then_days: int
) -> None:
    """RT4: a1's idempotency record expires at day 31 (``idempotency_days`` 30) under
    ``forget_days`` = ``first_days``; the host is restarted at day 41 with ``forget_days`` =
    ``then_days`` and a duplicate of a1 comes at once, then again at day 62 after a
    compaction that expires another delivery (a rewrite of the filter). Past its
    ``forget_days`` (40, counted from its result at day 0) a1 is let go at once — admitted
    and run again, the documented bound — and within them (400) it is ``delivery_expired``,
    never run again, whenever the filter was last rewritten. Before, an entry was let go
    only by a rewrite of the filter, at the forget-after time it was written with: past its
    time it was still refused until some other delivery expired, a lowered ``forget_days``
    held it to the old one, and a raised one did not keep it — the next rewrite let it go
    at day 40, and a duplicate inside the configured window ran again. The same on
    PostgreSQL (RT11: the ``expired_deliveries`` rows, the host's memory of them and the
    admission's guard), where each of those three happened until the rows counted
    ``forget_days`` at lookup too."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    steps: list[Step] = [Text(text=f"answer {n}") for n in range(6)]

    def config(url: str, forget_days: int) -> RoomWorkerConfig:
        retention = RetentionConfig(journal_days=7, idempotency_days=30, forget_days=forget_days)
        return RoomWorkerConfig(
            model=ModelConfig(base_url=url), retention=retention, store=store_config
        )

    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            async with open_room_worker(
                config(url, first_days), base_dir=tmp_path, clocks=clocks
            ) as worker:
                for delivery_id in ("a1", "a2"):
                    await worker.deliver(message(delivery_id, room=A))
                first = await next_results(worker, 2)
                await worker.ack(max(r.seq for r in first))
                wall.advance(31 * DAY)
                expired = set((await worker.compact()).expired)
            wall.advance(10 * DAY)  # day 41
            async with open_room_worker(
                config(url, then_days), base_dir=tmp_path, clocks=clocks
            ) as worker:
                day41 = await _answer(worker, "a1")
                await worker.deliver(message("a3", room=A))
                again = 2 if day41 == "started" else 1  # a1 again (if run), a3
                done = await next_results(worker, again, after=max(r.seq for r in first))
                await worker.ack(max(r.seq for r in done))
                wall.advance(21 * DAY)  # day 62: a2 (no longer room A's latest) expires
                later = set((await worker.compact()).expired)
                day62 = await _answer(worker, "a1")
    assert expired == {"a1"}
    assert later == {"a2"}
    if then_days > 62:  # within its forget_days throughout: never run again
        assert (day41, day62) == ("delivery_expired", "delivery_expired")
        assert asked(model, "a1") == 1
    else:  # let go at once at day 41: admitted again, then a duplicate of that one
        assert (day41, day62) == ("started", "duplicate")
        assert asked(model, "a1") == 2


async def test_rt18_a_fault_in_one_rooms_retention_stays_in_that_room(tmp_path: Path) -> None:
    """RT18: room A's finished delivery a1 cannot have its files removed (a directory stands
    where its one-shot session would be: the unlink fails ``EISDIR``, as an unwritable room
    directory would with ``EACCES``). At day 8 the sweep removes every other journal — room
    B's and A's a2 — and leaves a1's whole, the compaction slims room B and leaves room A as
    it was, both saying which room they left; once the fault is gone, the next sweep and
    compaction finish room A. A duplicate of a1 is answered from its record throughout.
    Before, the first failing unlink ended the whole pass: no room's journals went and no
    compaction ran — at every sweep again, for as long as the fault lasted."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    steps: list[Step] = [Text(text=f"answer {n}") for n in range(4)]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (_model, url):
            config = RoomWorkerConfig(
                model=ModelConfig(base_url=url),
                retention=RetentionConfig(journal_days=7, idempotency_days=30),
            )
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                store = worker.store
                assert isinstance(store, Store)
                for delivery_id, room in (("a1", A), ("b1", B), ("a2", A), ("b2", B)):
                    await worker.deliver(message(delivery_id, room=room))
                done = await next_results(worker, 4)
                await worker.ack(max(r.seq for r in done))
                session = (
                    store.root / "lanes" / lane_key(A) / "oneshot" / f"{delivery_key('a1')}.jsonl"
                )
                (session / "in-the-way").mkdir(parents=True)
                wall.advance(8 * DAY)
                removed = await worker.expire_journals()
                kept = {d: await store.exists(store.delivery_rel(d)) for d in ("a1", "a2", "b1")}
                plan = await worker.compact()
                duplicate = (await worker.deliver(message("a1", room=A))).disposition
                admissions = {type(r).__name__ for r in shared_admissions(store) if room_of(r) == A}
                await trio.to_thread.run_sync(shutil.rmtree, session)
                removed_after = await worker.expire_journals()
                plan_after = await worker.compact()
                a1_gone = not await store.exists(store.delivery_rel("a1"))
    assert removed == 3
    assert kept == {"a1": True, "a2": False, "b1": False}
    assert set(plan.settled) == {"b1", "b2"}  # room A left as it was
    assert [room for room, _why in plan.left] == [A]
    assert duplicate == "duplicate"
    assert admissions == {"Admission"}
    assert removed_after == 1
    assert set(plan_after.settled) == {"a1", "a2"}
    assert plan_after.left == ()
    assert a1_gone


@pytest.mark.parametrize("refusal", ["too_many_open_files", "disk_failed"])
async def test_rt18_l21_a_removal_refused_for_want_of_a_descriptor_stays_with_that_delivery(
    tmp_path: Path, refusal: str
) -> None:
    """RT18, L21, J18: one delivery's journal cannot be removed now because the sync log
    generation that names it wanted a file descriptor to go (the store refuses it
    ``too_many_open_files``, no disk failure). Tries to break: that refusal, which is not an
    ``OSError``, ending the whole sweep (no other journal removed, the pass skipped until the
    next). Expected: the others are removed, that one is noted and kept for the next sweep —
    while a disk failure (``disk_failed``) still ends the pass (J6)."""
    async with open_store(tmp_path / "state") as store:
        for delivery_id in ("d1", "d2", "d3"):
            await store.close_log(await store.create_delivery_log(delivery_id))
        stuck = store.delivery_rel("d2")
        remove = store.remove_logs

        async def refusing(rels: Sequence[str]) -> int:
            if stuck in rels:
                if refusal == "disk_failed":
                    raise DiskFailedError(ReasonCode.DISK_FAILED, "the disk failed", path=stuck)
                raise JournalError(ReasonCode.TOO_MANY_OPEN_FILES, "no descriptor", path=stuck)
            return await remove(rels)

        store.remove_logs = refusing  # type: ignore[method-assign]
        left: dict[str, str] = {}
        going = [(d, A) for d in ("d1", "d2", "d3")]
        if refusal == "disk_failed":
            with pytest.raises(DiskFailedError):
                await remove_step_journals(store, going, left=left)
            return
        removed = await remove_step_journals(store, going, left=left)
        kept = {d: await store.exists(store.delivery_rel(d)) for d in ("d1", "d2", "d3")}
    assert removed == 2
    assert list(left) == ["d2"]
    assert kept == {"d1": False, "d2": True, "d3": False}
