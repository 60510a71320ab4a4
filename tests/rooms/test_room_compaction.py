"""Compaction of the shared logs and the expiry of idempotency records
(docs/design/retention.md RT3-RT8, RT10): a real room worker on a real state directory, its
wall clock a virtual one moved past the retention periods; crashes by SIGKILL of a real host
at each step of a compaction, and by power loss at every file operation of one."""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi.scenario import Step, Text
from runtime._cli import main
from runtime._clock import Clocks, MockWallClock, SystemSilenceClock
from runtime._config import ModelConfig, RetentionConfig, RoomConfig, RoomWorkerConfig
from runtime._errors import DeliveryError, JournalError, ReasonCode
from runtime._journal._expired import EXPIRED, read_expired
from runtime._journal._inspect import verify_journal
from runtime._journal._journal import read_log
from runtime._journal._store import (
    ADMISSIONS,
    COMPACT_CHUNK,
    RESULTS,
    Store,
    delivery_key,
    open_store,
)
from runtime._linux._fs import FileSystem, OsFileSystem
from runtime._records import (
    Admission,
    Compacted,
    Fingerprints,
    LogKind,
    Outcome,
    Record,
    ResultAcked,
    ResultPublished,
    Settled,
)
from runtime._rooms._outbox import ResultOutbox
from runtime._rooms._retention import compact_store
from runtime._rooms._worker import open_room_worker
from runtime._wire import DeliveryResult

from .._workers import scripted_upstream
from ..faultfs import PowerLossFileSystem
from .test_room_worker import message, next_results

LIMIT: Final = 60.0
DAY: Final = 86_400.0
A, B = "dm:1", "dm:2"


def asked(model: Any, delivery_id: str) -> int:
    """How many model requests carried ``delivery_id``'s message."""
    return sum(f"(message m-{delivery_id})" in str(r.body["messages"][-1]) for r in model.requests)


def shared(root: Path, fs: FileSystem | None = None) -> tuple[list[Any], list[Any]]:
    """The records of the admission and result logs, as a start reads them."""
    fs = fs or OsFileSystem()
    admissions = read_log(fs, str(root), ADMISSIONS, kind=LogKind.ADMISSIONS).records
    results = read_log(fs, str(root), RESULTS, kind=LogKind.RESULTS).records
    return list(admissions[1:]), list(results[1:])


async def test_rt3_rt4_rt6_rt8_a_finished_delivery_is_slimmed_then_expires(
    tmp_path: Path,
) -> None:
    """Day 8 (RT3): a compaction keeps an idempotency record in place of each finished
    admission, and a duplicate still gets its result, with its seq, asking the model nothing.
    Day 31 (RT4): the older one expires — its duplicate, even with a changed text, is
    ``delivery_expired`` and is never run; a room's latest result stays (RT1). The logs then
    hold only what is kept (RT6), the next result is numbered after the last one ever
    published (RT8), a restart knows all of it, and the state directory verifies."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    steps: list[Step] = [Text(text=f"answer {n}") for n in range(6)]
    retention = RetentionConfig(journal_days=7, idempotency_days=30)
    root = tmp_path / "state"
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            config = RoomWorkerConfig(model=ModelConfig(base_url=url), retention=retention)
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                for delivery_id, room in (("a1", A), ("a2", A), ("b1", B)):
                    await worker.deliver(message(delivery_id, room=room))
                first = {r.delivery_id: r for r in await next_results(worker, 3)}
                await worker.ack(max(r.seq for r in first.values()))
                wall.advance(8 * DAY)
                slimmed = await worker.compact()
                day8_records = shared(root)
                day8 = await worker.deliver(message("a1", room=A))
                day8_result = worker.result_of("a1")
                with pytest.raises(DeliveryError) as conflict8:
                    await worker.deliver(message("a1", "changed", room=A))
                wall.advance(23 * DAY)
                expired = await worker.compact()
                with pytest.raises(DeliveryError) as day31:
                    await worker.deliver(message("a1", room=A))
                with pytest.raises(DeliveryError) as changed31:
                    await worker.deliver(message("a1", "changed", room=A))
                with pytest.raises(DeliveryError) as cancel31:
                    await worker.cancel("a1")
                latest = worker.result_of("a2")
                await worker.deliver(message("a3", room=A))
                (a3,) = await next_results(worker, 1, after=max(r.seq for r in first.values()))
            admissions, results = shared(root)
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                with pytest.raises(DeliveryError) as after_restart:
                    await worker.deliver(message("a1", room=A))
                a2_again = await worker.deliver(message("a2", room=A))
                kept_result = worker.result_of("a2")
                last_seq = worker.last_seq
    assert set(slimmed.settled) == {"a1", "a2", "b1"}
    assert not slimmed.expired
    day8_admissions, _ = day8_records
    assert all(isinstance(r, Settled) for r in day8_admissions[1:])
    assert day8.disposition == "duplicate"
    assert day8_result == first["a1"]
    assert conflict8.value.code is ReasonCode.DELIVERY_CONFLICT
    assert set(expired.expired) == {"a1"}  # a2 is room A's latest, b1 room B's
    assert day31.value.code is changed31.value.code is ReasonCode.DELIVERY_EXPIRED
    assert cancel31.value.code is ReasonCode.DELIVERY_EXPIRED
    assert asked(model, "a1") == 1
    assert latest == first["a2"]
    assert a3.seq == max(r.seq for r in first.values()) + 1  # RT8
    assert isinstance(admissions[0], Compacted)
    assert {r.delivery_id for r in admissions[1:]} == {"a2", "b1", "a3"}
    assert isinstance(results[0], Compacted)
    published = [r for r in results if isinstance(r, ResultPublished)]
    assert {r.delivery_id for r in published} == {"a2", "b1", "a3"}
    assert [r.seq for r in published] == sorted(r.seq for r in published)
    assert ResultAcked(seq=max(r.seq for r in first.values())) in results
    assert after_restart.value.code is ReasonCode.DELIVERY_EXPIRED
    assert a2_again.disposition == "duplicate"
    assert kept_result == first["a2"]
    assert last_seq == a3.seq
    assert not (root / "deliveries" / f"{delivery_key('a1')}.log").exists()
    _, findings = verify_journal(root)
    assert [f for f in findings if f.problem] == []


async def test_rt1_rt8_what_is_live_is_kept_whatever_its_age(tmp_path: Path) -> None:
    """RT1: a compaction 40 days on keeps, in full, an unacknowledged result's admission and
    every delivery of a room with one still running (only an acknowledged delivery of an
    idle room, not its latest, expires); RT8: an acknowledgement of a result
    published before the compaction applies after it, and nothing is delivered again after a
    restart."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    release, waiting = trio.Event(), trio.Event()

    async def held(n: int) -> None:
        if n == 4:
            waiting.set()
            await release.wait()  # b2's model request waits: room B stays busy

    steps: list[Step] = [Text(text=f"answer {n}") for n in range(6)]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=held) as (_model, url):
            config = RoomWorkerConfig(model=ModelConfig(base_url=url))
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                first: dict[str, DeliveryResult] = {}
                for delivery_id, room in (("a1", A), ("b1", B), ("a2", A)):  # seqs 1, 2, 3
                    await worker.deliver(message(delivery_id, room=room))
                    (first[delivery_id],) = await next_results(worker, 1, after=len(first))
                await worker.ack(first["b1"].seq)  # a1 and b1; a2 is not acknowledged yet
                await worker.deliver(message("b2", room=B))
                await waiting.wait()
                wall.advance(40 * DAY)
                plan = await worker.compact()
                admissions, _ = shared(tmp_path / "state")
                await worker.ack(first["a2"].seq)
                acked = worker._host.outbox.acked
                release.set()
                await next_results(worker, 1, after=max(r.seq for r in first.values()))
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                again = worker._host.outbox.unacknowledged()
    full = {r.delivery_id for r in admissions if isinstance(r, Admission)}
    assert set(plan.expired) == {"a1"}  # acknowledged, its room idle, not its latest
    assert not plan.settled
    assert {"a2", "b1", "b2"} <= full  # a2 unacknowledged; b1 in a busy room
    assert acked == first["a2"].seq
    assert [r.delivery_id for r in again] == ["b2"]


# -- crashes ---------------------------------------------------------------------------


POINTS: Final = ("compaction:journal", "compaction:expired", "compaction:admissions")


@pytest.mark.parametrize("point", POINTS)
async def test_rt5_a_host_killed_in_a_compaction_loses_nothing_and_runs_nothing_again(
    point: str, tmp_path: Path
) -> None:
    """RT5: a host SIGKILLed at each step of a compaction — after a step journal went, after
    the expired-id filter is durable, between the two logs' rewrites — leaves every delivery
    either known (its admission or idempotency record) or expired, never neither; the next
    host finishes the compaction: the old delivery's duplicate is ``delivery_expired`` or a
    duplicate, never run again, the kept one still a duplicate, a new one answered once."""
    from .test_room_crash import config, host, message, results

    steps: list[Step] = [Text(text=f"answer {n}") for n in range(6)]
    root = tmp_path / "state"
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec: dict[str, Any] = {"config": config("fake", url)}
            old = {**spec, "wall_days": -40, "deliver": [message("d1"), message("d2")]}
            async with host(tmp_path, {**old, "expect": 2, "ack": True}, "a") as h:
                answered = results(await h.finish())
            killed = {**spec, "compact": True, "pause": {"point": point}}
            async with host(tmp_path, killed, "b") as h:
                await h.until(lambda f: "paused" in f)
                await h.stopped()  # whole: nothing of it goes on until the kill
                await h.kill()
            admissions, _ = shared(root)
            known = {r.delivery_id for r in admissions if isinstance(r, Admission | Settled)}
            expired = read_expired(OsFileSystem(), str(root / EXPIRED))
            kept = {d: d in known or delivery_key(d) in expired for d in ("d1", "d2")}
            after = {**spec, "deliver": [message("d1"), message("d2"), message("d3")]}
            async with host(tmp_path, {**after, "expect": 1, "ack": True}, "c") as h:
                facts = await h.finish()
            async with host(tmp_path, {**spec, "compact": True}, "d") as h:
                await h.until(lambda f: "compacted" in f)
            admissions, results_after = shared(root)
            expired = read_expired(OsFileSystem(), str(root / EXPIRED))
    assert len(answered) == 2
    assert kept == {"d1": True, "d2": True}, point
    replies = [
        f.get("accepted") or f.get("refused") for f in facts if "accepted" in f or "refused" in f
    ]
    duplicate = {
        "type": "accepted",
        "delivery_id": "d1",
        "room": "dm:7",
        "disposition": "duplicate",
    }
    assert replies[0] in ("delivery_expired", duplicate)
    assert replies[1] == {**duplicate, "delivery_id": "d2"}
    assert [r["delivery_id"] for r in results(facts)] == ["d3"]
    assert [asked(model, d) for d in ("d1", "d2", "d3")] == [1, 1, 1]
    # the compaction was finished; d2, no longer its room's latest, went too
    assert delivery_key("d1") in expired
    assert delivery_key("d2") in expired
    assert {r.delivery_id for r in admissions if isinstance(r, Admission | Settled)} == {"d3"}
    assert [r.delivery_id for r in results_after if isinstance(r, ResultPublished)] == ["d3"]
    _, findings = verify_journal(root)
    assert [f for f in findings if f.problem] == []


# -- power loss ------------------------------------------------------------------------

OLD: Final = 40 * DAY
HISTORY: Final = {  # delivery: (room, days since its result, acknowledged); None: no result
    "a1": ("dm:a", OLD, True),
    "a2": ("dm:a", OLD, True),
    "a3": ("dm:a", OLD, True),  # room a's latest: slimmed, never expired
    "b1": ("dm:b", 10 * DAY, True),  # slimmed
    "c0": ("dm:c", OLD, True),  # room c is busy: kept in full
    "b2": ("dm:b", OLD, False),  # not acknowledged: kept in full
    "c1": ("dm:c", None, False),  # no result yet
}


async def _history(root: Path, fs: Any, now_ms: int) -> None:
    """The deliveries of :data:`HISTORY`, each with a step journal, their results published
    when it says, the acknowledged ones acknowledged."""
    wall = MockWallClock.reading(now_ms)
    async with open_store(
        root, fs=fs, clocks=Clocks(silence=SystemSilenceClock(), wall=wall)
    ) as store:
        when = 0
        outbox = ResultOutbox(store.results, now_ms=lambda: when)
        prints = Fingerprints(request="r", authority="a", settings="s")
        for delivery_id, (room, age, acked) in HISTORY.items():
            request = {"delivery_id": delivery_id, "room": room}
            admission = Admission(
                delivery_id=delivery_id,
                lane=room,
                request=request,
                fingerprints=prints,
                rendered_prompt="hi",
                admitted_ms=now_ms - int(OLD * 1000),
            )
            await store.admissions.append(admission)
            await store.close_log(await store.create_delivery_log(delivery_id))
            if age is not None:
                when = now_ms - int(age * 1000)
                published = await outbox.publish(
                    delivery_id=delivery_id, room=room, outcome=Outcome.REPLY, text="t"
                )
                if acked:
                    await outbox.ack(published.seq)


def _check_after_crash(root: Path, fs: FileSystem, cut: int) -> tuple[set[str], set[str]]:
    """RT5, RT7: the crashed image opens, and every delivery is known or expired, never
    neither; every known finished one still has its result; what is live is kept in full;
    no seq is lost. What is known and what is expired."""
    where = f"power cut after {cut} operations"
    admissions, results = shared(root, fs)
    known = {r.delivery_id for r in admissions if isinstance(r, Admission | Settled)}
    full = {r.delivery_id for r in admissions if isinstance(r, Admission)}
    filter_ = read_expired(fs, str(root / EXPIRED))
    expired = {d for d in HISTORY if delivery_key(d) in filter_}
    published = {r.delivery_id: r for r in results if isinstance(r, ResultPublished)}
    acked = max((r.seq for r in results if isinstance(r, ResultAcked)), default=0)
    assert known | expired == set(HISTORY), where
    for delivery_id in known:
        if HISTORY[delivery_id][1] is not None:
            assert delivery_id in published, f"{where}: {delivery_id}'s result is lost"
    assert {"b2", "c0", "c1"} <= full, where
    assert acked == 5, where
    assert published["b2"].seq == 6, where
    return known, expired


RETENTION: Final = RetentionConfig(journal_days=7, idempotency_days=30)


async def _compaction(
    root: Path, fs: PowerLossFileSystem, now_ms: int, cut: int | None = None
) -> None:
    """A compaction at ``now_ms``; ``cut``: the power goes after that many operations of it."""
    wall = MockWallClock.reading(now_ms)
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    async with open_store(root, fs=fs, clocks=clocks) as store:
        if cut is not None:
            fs.cut_after(cut)
        await compact_store(store, retention=RETENTION)


async def test_rt5_rt7_power_loss_at_every_operation_of_a_compaction(tmp_path: Path) -> None:
    """RT5, RT7: the power is cut after each operation of a compaction in turn (the step
    journals' removal, the expired-id filter's replace, each log's rewrite — temp file,
    write, sync, rename, directory sync) and the disk image a machine could find is built
    (:meth:`~tests.faultfs.PowerLossFileSystem.crash`, two draws each): it opens, every
    delivery is known or expired and never neither, every known finished one keeps its
    result, what is live is kept in full, no seq is lost; the next compaction finishes the
    job and the outcome is the one an uncut compaction reaches."""
    now = time.time_ns() // 1_000_000
    probe = PowerLossFileSystem(tmp_path / "probe")
    await _history(tmp_path / "probe", probe, now)
    probe.cut_after(10**9)  # counts from here
    start = probe.ops
    await _compaction(tmp_path / "probe", probe, now, cut=10**9)
    operations = probe.ops - start
    wanted = _check_after_crash(tmp_path / "probe", probe, -1)
    assert wanted == ({"a3", "b1", "b2", "c0", "c1"}, {"a1", "a2"})
    assert operations > 20  # the store's open and close, then every step of the compaction
    for cut in range(operations + 1):
        for draw in range(2):
            # each image bounded on its own: the whole loop (some 70 images, 20 s on a quiet
            # machine) outran one bound on a machine running three suites at once
            with trio.fail_after(LIMIT):
                root = tmp_path / f"cut{cut}-{draw}"
                fs = PowerLossFileSystem(root)
                await _history(root, fs, now)
                with contextlib.suppress(OSError, JournalError):
                    await _compaction(root, fs, now, cut)
                fs.crash(random.Random(cut * 2 + draw))
                _check_after_crash(root, fs, cut)
                await _compaction(root, fs, now)
                assert _check_after_crash(root, fs, cut) == wanted, f"cut {cut}"


async def test_rt10_journal_compact_expires_on_demand_and_verify_checks_the_filter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """RT10: ``pi-runtime journal compact`` on a state directory whose results were
    published 40 days ago (the host's wall clock was set back) expires the older one and
    keeps the room's latest (``journal show`` of the expired one says so); ``journal
    verify`` passes on the compacted logs, and a flipped
    bit in the expired-id filter is a ``journal_corrupt`` problem there — and a start refuses
    the directory with that code rather than take an expired delivery for a new one (RT4)."""
    forty_days_ago = MockWallClock.reading(time.time_ns() // 1_000_000 - int(40 * DAY * 1000))
    clocks = Clocks(silence=SystemSilenceClock(), wall=forty_days_ago)
    root = tmp_path / "state"
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="one"), Text(text="two")]) as (_model, url):
            config = RoomWorkerConfig(model=ModelConfig(base_url=url))
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                await worker.deliver(message("a1", room=A))
                (one,) = await next_results(worker, 1)
                await worker.deliver(message("a2", room=A))
                (two,) = await next_results(worker, 1, after=one.seq)
                await worker.ack(two.seq)
            compact = ["journal", "compact", "--state-dir", str(root)]
            assert await trio.to_thread.run_sync(main, compact) == 0
            printed = capsys.readouterr().out
            verify = ["journal", "verify", "--state-dir", str(root)]
            assert await trio.to_thread.run_sync(main, verify) == 0
            show = ["journal", "show", "a1", "--state-dir", str(root)]
            assert await trio.to_thread.run_sync(main, show) == 1
            capsys.readouterr()
            data = bytearray((root / EXPIRED).read_bytes())
            data[-3] ^= 0x10
            (root / EXPIRED).write_bytes(bytes(data))
            assert await trio.to_thread.run_sync(main, verify) == 1
            damaged = capsys.readouterr().out
            with pytest.raises(JournalError) as refused:
                async with open_room_worker(config, base_dir=tmp_path, clocks=clocks):
                    pass
    assert "removed 2 step journals" in printed
    assert "kept 1 idempotency record" in printed
    assert "expired 1 delivery older than 30 days" in printed
    assert f"problem: {EXPIRED}: journal_corrupt: expired-id filter fails its checksum" in damaged
    assert refused.value.code is ReasonCode.JOURNAL_CORRUPT
    assert "'a1' finished longer ago than [retention] idempotency_days" in caplog.text


async def test_rt7_admissions_during_a_compaction_are_neither_lost_nor_doubled(
    tmp_path: Path,
) -> None:
    """RT7: deliveries admitted while compactions rewrite the admission log — twenty at once
    on ten rooms, compactions back to back meanwhile, the first expiring five idle rooms'
    old deliveries — are each accepted once, durably: all
    are answered once, the compacted logs hold every one of them exactly once, and a restart
    knows them (a repeat is ``duplicate``)."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    rooms = [f"dm:{n}" for n in range(10)]
    idle = [f"dm:idle-{n}" for n in range(5)]  # nothing new there: compacted mid-burst
    with trio.fail_after(LIMIT):
        async with scripted_upstream([]) as (_model, url):
            config = RoomWorkerConfig(model=ModelConfig(base_url=url))
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                for room in [*rooms, *idle]:  # an old history for the compactions to remove
                    for n in (1, 2):
                        await worker.deliver(message(f"old-{room}-{n}", room=room))
                old = await next_results(worker, 30)
                await worker.ack(max(r.seq for r in old))
                wall.advance(40 * DAY)
                accepted: dict[str, str] = {}
                plans = []
                missing: list[set[str]] = []

                async def admit(delivery_id: str, room: str) -> None:
                    accepted[delivery_id] = (
                        await worker.deliver(message(delivery_id, room=room))
                    ).disposition

                async def compact_repeatedly() -> None:
                    for _ in range(5):
                        plans.append(await worker.compact())
                        # L1, L5 at every moment: what was accepted, and every result
                        # published, is in its log on disk
                        durable = set(accepted)
                        outbox = worker._host.outbox
                        durable |= {f"result:{r.delivery_id}" for r in outbox.published()}
                        on_disk, on_disk_results = await trio.to_thread.run_sync(
                            shared, tmp_path / "state"
                        )
                        known = {
                            r.delivery_id for r in on_disk if isinstance(r, Admission | Settled)
                        }
                        known |= {
                            f"result:{r.delivery_id}"
                            for r in on_disk_results
                            if isinstance(r, ResultPublished)
                        }
                        missing.append(durable - known)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(compact_repeatedly)
                    for room in rooms:
                        for n in (1, 2):
                            nursery.start_soon(admit, f"new-{room}-{n}", room)
                new = await next_results(worker, 20, after=max(r.seq for r in old))
                await worker.ack(max(r.seq for r in new))
                final = await worker.compact()  # the rooms idle again: the old ones go
            admissions, results = shared(tmp_path / "state")
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                again = await worker.deliver(message("new-dm:3-2", room="dm:3"))
    fresh = {f"new-{room}-{n}" for room in rooms for n in (1, 2)}
    assert len(accepted) == 20
    assert "duplicate" not in accepted.values()
    assert missing == [set()] * 5
    assert {r.delivery_id for r in new} == fresh
    assert len(plans) == 5
    assert {d for p in plans for d in p.expired} >= {f"old-{room}-1" for room in idle}
    assert set(final.expired) | {d for p in plans for d in p.expired} == {
        f"old-{room}-{n}" for room in rooms for n in (1, 2)
    } | {f"old-{room}-1" for room in idle}
    admitted = [r.delivery_id for r in admissions if isinstance(r, Admission | Settled)]
    assert len(admitted) == len(set(admitted))
    assert fresh <= set(admitted)
    published = [r.delivery_id for r in results if isinstance(r, ResultPublished)]
    assert len(published) == len(set(published))
    assert fresh <= set(published)
    assert again.disposition == "duplicate"


async def test_rt7_rt8_a_result_published_during_the_rewrite_is_carried_over(
    tmp_path: Path,
) -> None:
    """RT7, RT8: a result published while the result log is being rewritten — after the
    records to keep were taken, before the new file replaces the old — is in the new file
    (with its seq, after the last one kept), and so is an acknowledgement made meanwhile; a
    reopened store reads exactly that."""
    root = tmp_path / "state"
    async with open_store(root) as store:
        outbox = ResultOutbox(store.results)
        for n in (1, 2, 3):
            await outbox.publish(delivery_id=f"d{n}", room="dm:1", outcome=Outcome.REPLY)
        await outbox.ack(1)

        async def replace(records: list[Any], last_seq: int, held: Any) -> object:
            late = await outbox.publish(delivery_id="late", room="dm:1", outcome=Outcome.REPLY)
            await outbox.ack(late.seq)
            return await store.rewrite_shared(store.results, records, last_seq=last_seq, held=held)

        removed = await outbox.rewrite({"d1"}, replace, lambda: store.results)
        after = [(r.delivery_id, r.seq) for r in outbox.published()]
        next_seq = (
            await outbox.publish(delivery_id="next", room="dm:1", outcome=Outcome.REPLY)
        ).seq
    async with open_store(root) as store:
        reopened = ResultOutbox(store.results)
        on_disk = [(r.delivery_id, r.seq) for r in reopened.published()]
        acked = reopened.acked
    assert removed == 1
    assert after == [("d2", 2), ("d3", 3), ("late", 4)]
    assert next_seq == 5
    assert on_disk == [("d2", 2), ("d3", 3), ("late", 4), ("next", 5)]
    assert acked == 4


async def test_rt10_a_servers_compaction_keeps_to_its_byte_budget(
    tmp_path: Path, io_autojump_clock: trio.testing.MockClock
) -> None:
    """RT10's byte budget: the same rewrite of a 3 MiB admission log at 512 KiB/s takes the
    (virtual) seconds its size asks — a sleep after each 1 MiB piece — and writes the very
    bytes the unbounded one writes, which sleeps not at all."""
    clocks = Clocks(silence=SystemSilenceClock(), wall=MockWallClock())
    prints = Fingerprints(request="r", authority="a", settings="s")
    records: list[Record] = [
        Admission(
            delivery_id=f"d{n}",
            lane=f"dm:{n % 7}",
            request={"delivery_id": f"d{n}", "text": "x"},
            fingerprints=prints,
            rendered_prompt="p" * 1000,
            admitted_ms=n,
        )
        for n in range(3000)
    ]
    rate = 512 * 1024
    took, files = [], []
    for name, budget in (("paced", rate), ("unbounded", 0)):
        async with open_store(tmp_path / name, clocks=clocks) as store:
            async with trio.open_nursery() as nursery:
                for record in records:
                    nursery.start_soon(store.admissions.append, record)
            started = trio.current_time()
            await store.rewrite_shared(store.admissions, records, bytes_per_second=budget)
            took.append(trio.current_time() - started)
        files.append((tmp_path / name / ADMISSIONS).read_bytes())
    size = len(files[0])
    assert size > 3 * COMPACT_CHUNK
    assert took[0] == pytest.approx(size / rate, rel=0.01)
    assert took[1] < 0.01
    assert len(files[1]) == size
    paced, unbounded = (shared(tmp_path / name)[0] for name in ("paced", "unbounded"))
    compacted = [r for r in paced if isinstance(r, Compacted)]
    assert len(compacted) == 1
    rest = [r for r in paced if isinstance(r, Admission)]
    assert rest == [r for r in unbounded if isinstance(r, Admission)] == records  # whole, in order


# -- a room's warmth (L3) --------------------------------------------------------------

BACKLOG: Final = [{"author": {"id": "u9", "name": "Bob"}, "text": "BACKLOG-LINE"}]


@pytest.mark.parametrize("case", ["slimmed-privileged", "expired-ordinary"])
async def test_rt16_a_rooms_warmth_survives_the_compaction_of_its_history(
    case: str, tmp_path: Path
) -> None:
    """RT16, L3: whether a room's session holds the conversation is read, at a start, from
    its admissions — only an ordinary one warms it (a privileged one runs in a one-shot
    session, L6). A compaction must not change that answer. *slimmed-privileged*: a room
    whose only delivery was privileged, slimmed to its idempotency record on day 8 — after a
    restart the next ordinary delivery is still the room session's first, so cold: it gets
    the backlog (the ``Settled`` record warmed the room, and the prompt went out without
    it). *expired-ordinary*: a room's ordinary delivery expires on day 31 while a
    privileged one is the room's latest — after a restart the next ordinary delivery is
    warm: the room's session holds the first turns, and the backlog is not sent into it a
    second time (the room's last ordinary delivery stays, RT16; it had expired with the
    older one, and no record said the room was warm any more)."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    room = "dm:9"
    rooms = {room: RoomConfig(actors={"boss": frozenset({"bash"})})}
    steps: list[Step] = [Text(text=f"answer {n}") for n in range(4)]
    retention = RetentionConfig(journal_days=7, idempotency_days=30)
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            config = RoomWorkerConfig(
                model=ModelConfig(base_url=url), rooms=rooms, retention=retention
            )
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                if case == "slimmed-privileged":
                    await worker.deliver(message("p1", room=room, author_id="boss"))
                    (done,) = await next_results(worker, 1)
                    await worker.ack(done.seq)
                    wall.advance(8 * DAY)
                    plan = await worker.compact()
                    assert set(plan.settled) == {"p1"}
                else:
                    await worker.deliver(message("d0", room=room))
                    await worker.deliver(message("d1", room=room))
                    first = await next_results(worker, 2)
                    wall.advance(25 * DAY)
                    await worker.deliver(message("p2", room=room, author_id="boss"))
                    (done,) = await next_results(worker, 1, after=first[-1].seq)
                    await worker.ack(done.seq)
                    wall.advance(6 * DAY)
                    plan = await worker.compact()
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                await worker.deliver(message("d3", "now", room=room, history=BACKLOG))
                await next_results(worker, 1, after=done.seq)
    messages = model.requests[-1].body["messages"]
    if case == "slimmed-privileged":
        assert [m["role"] for m in messages] == ["system", "user"]  # the session's first
        assert "BACKLOG-LINE" in str(messages[-1])  # cold: the backlog goes with it
    else:
        assert "(message m-d1)" in str(messages)  # the room session holds the first turns
        assert "BACKLOG-LINE" not in str(messages[-1])  # warm: not sent a second time
        assert set(plan.expired) == {"d0"}  # d1 stays: the room's last ordinary delivery


async def test_rt4_a_duplicate_while_a_compaction_ends_is_expired_never_left_waiting(
    tmp_path: Path,
) -> None:
    """RT4: a duplicate of a delivery a compaction expires, arriving as the compaction ends
    — the result log already rewritten without its result, the compaction not yet returned
    (the rewrite's last step is an await: its temporary file's clean-up) — is
    ``delivery_expired``. It was ``duplicate``: the host still knew the id while its result
    was gone, so the client was told to wait for a result that no one would ever send."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    steps: list[Step] = [Text(text=f"answer {n}") for n in range(2)]
    retention = RetentionConfig(journal_days=7, idempotency_days=30)
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            config = RoomWorkerConfig(model=ModelConfig(base_url=url), retention=retention)
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                for delivery_id in ("a1", "a2"):
                    await worker.deliver(message(delivery_id, room=A))
                done = await next_results(worker, 2)
                await worker.ack(max(r.seq for r in done))
                wall.advance(31 * DAY)
                store = worker.store
                assert isinstance(store, Store)
                rewrite = store.rewrite_shared
                reached, go = trio.Event(), trio.Event()

                async def rewrite_then_pause(journal: Any, records: Any, **kwargs: Any) -> Any:
                    rewritten = await rewrite(journal, records, **kwargs)
                    if journal.rel == RESULTS:  # the log is replaced: the last await
                        reached.set()
                        await go.wait()
                    return rewritten

                store.rewrite_shared = rewrite_then_pause  # type: ignore[method-assign]
                plans = []
                async with trio.open_nursery() as nursery:

                    async def compact() -> None:
                        plans.append(await worker.compact())

                    nursery.start_soon(compact)
                    await reached.wait()
                    gone = worker.result_of("a1")
                    try:
                        answer: Any = await worker.deliver(message("a1", room=A))
                    except DeliveryError as error:
                        answer = error.code
                    go.set()
    assert set(plans[0].expired) == {"a1"}
    assert gone is None  # its result is gone from the log, and from the host's memory
    assert answer is ReasonCode.DELIVERY_EXPIRED
    assert asked(model, "a1") == 1
