"""Retention on PostgreSQL (docs/design/retention.md RT11, the built part): finished
deliveries' step journals removed from the database after ``journal_days``, by a real room
worker on a real PostgreSQL (``pgserver``), its wall clock a virtual one moved on."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi.scenario import TINY_PNG, Attach, Hang, Step, Text
from runtime._clock import Clocks, MockWallClock, SystemSilenceClock
from runtime._config import (
    ModelConfig,
    RetentionConfig,
    RoomConfig,
    RoomWorkerConfig,
    StoreConfig,
)
from runtime._errors import DeliveryError, PiRuntimeError, ReasonCode
from runtime._journal._inspect import delivery_records_in_database, verify_database
from runtime._journal._store import ADMISSIONS
from runtime._rooms._worker import open_room_worker

from .._workers import scripted_upstream
from ..journal.pg_fixtures import execute, pg_dsn, pg_server
from .test_room_worker import message, next_results

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses
LIMIT: Final = 60.0
DAY: Final = 86_400.0
A, B, C = "dm:1", "dm:2", "dm:3"


def _week(tmp_path: Path, url: str, dsn: str) -> RoomWorkerConfig:
    """One host on the database, step journals kept seven days."""
    return RoomWorkerConfig(
        state_dir=str(tmp_path / "state"),
        work_root=str(tmp_path / "work"),
        model=ModelConfig(base_url=url),
        store=StoreConfig(url=dsn, lease_seconds=60, poll_seconds=0.05, host_name="h1"),
        retention=RetentionConfig(journal_days=7),
    )


async def _answered_and_acked(worker: Any, deliveries: list[tuple[str, str]]) -> int:
    """Deliver each ``(delivery id, room)``, one answer at a time, then acknowledge every
    result; the last result's number."""
    seen = 0
    for delivery_id, room in deliveries:
        await worker.deliver(message(delivery_id, room=room))
        (result,) = await next_results(worker, 1, after=seen)
        seen = result.seq
    await worker.ack(seen)
    return int(seen)


async def test_rt11_step_journals_leave_the_database_after_their_days(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT11: eight days after their results were published and acknowledged, the step
    journals of a room's older deliveries are deleted from the database (their rows gone);
    kept are the room's latest one (another host may be about to recover from it), an
    unacknowledged one, and every one of a room with a delivery still running. A duplicate
    of a removed one still gets its result from the shared log, and asks the model
    nothing."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    steps: list[Step] = [*(Text(text=f"answer {n}") for n in range(4)), Hang(seconds=3600)]
    hanging = trio.Event()

    async def arrived(n: int) -> None:
        if n == 5:
            hanging.set()  # b2's request: room B stays busy

    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps, on_request=arrived) as (model, url),
            open_room_worker(_week(tmp_path, url, pg_dsn), clocks=clocks) as worker,
        ):
            store = worker.store
            seen = await _answered_and_acked(worker, [("a1", A), ("a2", A), ("b1", B)])
            await worker.deliver(message("c1", room=C))  # published, not acknowledged
            await next_results(worker, 1, after=seen)
            await worker.deliver(message("b2", room=B))
            await hanging.wait()
            wall.advance(8 * DAY)
            removed = await worker.expire_journals()
            kept = {d: await store.exists(store.delivery_rel(d)) for d in ("a1", "a2", "b1", "c1")}
            rows = await execute(
                pg_dsn,
                "SELECT count(*) FROM pi_runtime.log_records WHERE log = %s",
                [store.delivery_rel("a1")],
            )
            duplicate = await worker.deliver(message("a1", room=A))
            again = worker.result_of("a1")
    assert removed == 1  # a1: a2 is room A's latest acknowledged, b1's room is busy
    assert kept == {"a1": False, "a2": True, "b1": True, "c1": True}
    assert rows == [(0,)]
    assert duplicate.disposition == "duplicate"
    assert again is not None
    assert again.text == "answer 0"
    assert sum("(message m-a1)" in str(r.body["messages"][-1]) for r in model.requests) == 1


async def test_rt11_a_journal_removed_is_not_removed_again_at_every_sweep(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RT11, a service that runs for months: room A's only result is its latest, so it
    holds back the position the next look starts from; room B's older result after it is
    removed at the first sweep — and not asked for again at the next one (before, every
    sweep sent every such delivery's removal to the database again, and a statement that
    failed there stopped the host admitting)."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    steps: list[Step] = [Text(text=f"answer {n}") for n in range(3)]
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (_model, url),
            open_room_worker(_week(tmp_path, url, pg_dsn), clocks=clocks) as worker,
        ):
            store = worker.store
            await _answered_and_acked(worker, [("a1", A), ("b1", B), ("b2", B)])
            asked: list[list[str]] = []
            remove_logs = store.remove_logs

            async def spied(rels: Any) -> int:
                asked.append(sorted(rels))
                return await remove_logs(rels)

            monkeypatch.setattr(store, "remove_logs", spied)
            wall.advance(8 * DAY)
            first = await worker.expire_journals()
            second = await worker.expire_journals()
    assert first == 1
    assert second == 0
    assert asked == [[store.delivery_rel("b1")]]  # once: not again at the second sweep


def _host(root: Path, name: str, dsn: str, url: str, clocks: Clocks, **extra: Any) -> Any:
    config = RoomWorkerConfig(
        state_dir=str(root / name / "state"),
        work_root=str(root / name / "work"),
        model=ModelConfig(base_url=url),
        store=StoreConfig(url=dsn, lease_seconds=60, poll_seconds=0.05, host_name=name),
        retention=RetentionConfig(journal_days=7, idempotency_days=30),
        **extra,
    )
    return open_room_worker(config, clocks=clocks)


async def _admitted(dsn: str) -> list[tuple[int, str]]:
    """The admission log's rows: their numbers and record kinds (``admission``, ``settled``),
    as a reader decodes them."""
    rows = await execute(
        dsn,
        "SELECT seq, frame FROM pi_runtime.log_records WHERE log = %s ORDER BY seq",
        [ADMISSIONS],
    )
    return [(int(seq), json.loads(bytes(frame)[20:])[0]["type"]) for seq, frame in rows[1:]]


async def test_rt11_the_shared_rows_are_compacted_and_every_host_forgets_what_expired(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT11 on two hosts: eight days on, h1's compaction rewrites a finished delivery's
    admission row as its idempotency record (a room's latest is kept whole, its journal
    too); thirty-one days on, the next one deletes that delivery's admission and result rows
    and records it expired. h2, open all along, forgets it as soon as it looks (a duplicate
    is ``delivery_expired`` there, and nothing runs), still answers the others' duplicates,
    and admits a new delivery after the holes, numbered after every result ever published.
    A host started afterwards reads the same."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    steps: list[Step] = [Text(text=f"answer {n}") for n in range(5)]
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (model, url),
            _host(tmp_path, "h1", pg_dsn, url, clocks) as h1,
            _host(tmp_path, "h2", pg_dsn, url, clocks) as h2,
        ):
            seen = 0
            for delivery_id, room in (("a1", A), ("a2", A), ("b1", B)):
                await h1.deliver(message(delivery_id, room=room))
                (result,) = await next_results(h1, 1, after=seen)
                seen = result.seq
            await h1.ack(seen)
            await h2._sync()
            wall.advance(8 * DAY)
            slimmed = await h1.compact()
            rows_at_8 = await _admitted(pg_dsn)
            journal_a1 = await h1.store.exists(h1.store.delivery_rel("a1"))
            wall.advance(23 * DAY)
            expired = await h1.compact()
            rows_at_31 = await _admitted(pg_dsn)
            results_at_31 = await execute(
                pg_dsn, "SELECT count(*) FROM pi_runtime.log_records WHERE log = 'results.log'"
            )
            await h2._sync()
            with pytest.raises(DeliveryError) as refused:
                await h2.deliver(message("a1", room=A))
            again = await h2.deliver(message("a2", room=A))
            known_on_h2 = (h2.result_of("a1"), h2.result_of("a2"))
            fresh = await h2.deliver(message("c1", room=C))
            (c1,) = await next_results(h2, 1, after=seen)
        async with (
            scripted_upstream([]) as (_unused, url),
            _host(tmp_path, "h3", pg_dsn, url, clocks) as h3,
        ):
            with pytest.raises(DeliveryError) as refused_later:
                await h3.deliver(message("a1", room=A))
            later = (h3.result_of("a1"), h3.result_of("a2"), h3.result_of("c1"))
    assert set(slimmed.settled) == {"a1"}  # a2, b1: their rooms' latest
    assert rows_at_8 == [(1, "settled"), (2, "admission"), (3, "admission")]
    assert not journal_a1
    assert set(expired.expired) == {"a1"}
    assert rows_at_31 == [(2, "admission"), (3, "admission")]
    assert results_at_31 == [(4,)]  # header, a2's, b1's results, the last acknowledgement
    assert refused.value.code is ReasonCode.DELIVERY_EXPIRED
    assert again.disposition == "duplicate"
    assert known_on_h2[0] is None
    assert known_on_h2[1] is not None
    assert fresh.disposition in ("started", "queued")  # h1, up too, may claim room C (S10)
    assert (c1.seq, c1.text) == (seen + 1, "answer 3")
    assert refused_later.value.code is ReasonCode.DELIVERY_EXPIRED
    _, findings = await verify_database(pg_dsn)  # the holes are no damage to journal verify
    assert [f for f in findings if f.problem] == []
    with pytest.raises(PiRuntimeError) as shown:  # `journal show a1 --store …`
        await delivery_records_in_database(pg_dsn, "a1")
    assert shown.value.code is ReasonCode.DELIVERY_EXPIRED
    assert later[0] is None
    assert later[1] is not None
    assert later[2] == c1
    assert sum("(message m-a1)" in str(r.body["messages"][-1]) for r in model.requests) == 1


@pytest.mark.parametrize("point", ["compaction:journal", "compaction:rows"])
async def test_rt11_a_host_killed_in_a_compaction_of_the_shared_rows_loses_nothing(
    point: str, tmp_path: Path, pg_dsn: str
) -> None:
    """RT5 on PostgreSQL: a host SIGKILLed in a compaction — after the step journals went
    (the rows not yet touched), or right after the compaction's transaction committed —
    leaves every delivery known or expired, never neither; the next host's compaction
    finishes it. A duplicate of the old delivery is a duplicate or ``delivery_expired``,
    never run again; a new one is answered once."""
    from .test_room_crash import config, host, message, results

    steps: list[Step] = [Text(text=f"answer {n}") for n in range(6)]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec: dict[str, Any] = {"config": {**config("fake", url), "store": {"url": pg_dsn}}}
            old = {**spec, "wall_days": -40, "deliver": [message("d1"), message("d2")]}
            async with host(tmp_path, {**old, "expect": 2, "ack": True}, "a") as h:
                answered = results(await h.finish())
            killed = {**spec, "compact": True, "pause": {"point": point}}
            async with host(tmp_path, killed, "b") as h:
                await h.until(lambda f: "paused" in f)
                await h.stopped()  # whole: nothing of it goes on until the kill
                await h.kill()
            # its compaction lease would run out in a minute: now
            await execute(pg_dsn, "UPDATE pi_runtime.lanes SET lease_until = now()")
            kinds = dict(await _kinds(pg_dsn))
            expired = {d for (d,) in await execute(pg_dsn, _EXPIRED)}
            kept = {d: d in kinds or d in expired for d in ("d1", "d2")}
            after = {**spec, "deliver": [message("d1"), message("d2"), message("d3")]}
            async with host(tmp_path, {**after, "expect": 1, "ack": True}, "c") as h:
                facts = await h.finish()
            async with host(tmp_path, {**spec, "compact": True}, "d") as h:
                await h.until(lambda f: "compacted" in f)
            kinds_after = dict(await _kinds(pg_dsn))
            expired_after = {d for (d,) in await execute(pg_dsn, _EXPIRED)}
    assert len(answered) == 2
    assert kept == {"d1": True, "d2": True}, point
    replies = [
        f.get("accepted") or f.get("refused") for f in facts if {"accepted", "refused"} & {*f}
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
    asked = [
        sum(f"(message m-{d})" in str(r.body["messages"][-1]) for r in model.requests)
        for d in ("d1", "d2", "d3")
    ]
    assert asked == [1, 1, 1]
    assert expired_after == {"d1", "d2"}  # d2, no longer its room's latest, went too
    assert set(kinds_after) == {"d3"}


_EXPIRED: Final = "SELECT delivery_id FROM pi_runtime.expired_deliveries"


async def _kinds(dsn: str) -> list[tuple[str, str]]:
    """The admission log's records, as ``(delivery id, record type)``."""
    rows = await execute(
        dsn,
        "SELECT frame FROM pi_runtime.log_records WHERE log = %s AND seq > 0 ORDER BY seq",
        [ADMISSIONS],
    )
    records = [json.loads(bytes(frame)[20:])[0] for (frame,) in rows]
    return [(r["delivery_id"], r["type"]) for r in records]


async def test_rt11_an_attachments_document_goes_once_no_result_that_stays_names_it(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT11, A11: a1 and b1 attach the same picture (one document, ``attachments/<sha>``).
    When a1 expires the document stays — b1, room B's latest, still names it; when b1
    expires too it stays while it was written in the last ``idempotency_days`` (an attach on
    another host may have just written it again), and goes at the next compaction after."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    steps: list[Step] = [
        Attach(path="out/chart.png"),
        Text(text="a1's chart"),
        Attach(path="out/chart.png"),
        Text(text="b1's chart"),
        Text(text="a2"),
        Text(text="b2"),
    ]
    name = "attachments/" + hashlib.sha256(base64.b64decode(TINY_PNG)).hexdigest()
    grants = frozenset({"bash", "attach"})
    rooms = {A: RoomConfig(grants=grants), B: RoomConfig(grants=grants)}

    async def documents() -> list[str]:
        found = await execute(
            pg_dsn, "SELECT name FROM pi_runtime.documents WHERE name = %s", [name]
        )
        return [n for (n,) in found]

    async def age_documents() -> None:
        await execute(
            pg_dsn, "UPDATE pi_runtime.documents SET updated_at = now() - '40 days'::interval"
        )

    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (_model, url),
            _host(tmp_path, "h1", pg_dsn, url, clocks, rooms=rooms) as h1,
        ):
            seen = 0
            for delivery_id, room in (("a1", A), ("b1", B), ("a2", A)):
                await h1.deliver(message(delivery_id, room=room))
                (result,) = await next_results(h1, 1, after=seen)
                seen = result.seq
            await h1.ack(seen)
            wall.advance(31 * DAY)
            await age_documents()
            first = await h1.compact()
            after_a1 = await documents()
            await h1.deliver(message("b2", room=B))
            (result,) = await next_results(h1, 1, after=seen)
            await h1.ack(result.seq)
            wall.advance(31 * DAY)
            # an attach of the same bytes on another host writes the document again now
            await execute(pg_dsn, "UPDATE pi_runtime.documents SET updated_at = now()")
            second = await h1.compact()
            after_b1_fresh = await documents()
            await age_documents()
            wall.advance(1 * DAY)
            third = await h1.compact()
            after_b1 = await documents()
    assert set(first.expired) == {"a1"}
    assert after_a1 == [name]
    assert set(second.expired) == {"b1"}  # a2: room A's latest
    assert after_b1_fresh == [name]
    assert not third.changes
    assert after_b1 == []
