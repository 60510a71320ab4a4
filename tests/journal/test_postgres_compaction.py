"""The shared logs' compaction on PostgreSQL (docs/design/retention.md RT11), at the store:
rows deleted and rewritten in one transaction under the compaction's lease, the holes every
host then reads through, and the guard that keeps a host that has not yet heard of an expiry
from admitting the expired delivery again as new; the expired rows counting the
deployment's ``forget_days`` at every lookup (RT4, RT13). The room worker's side (what it
plans, what each host forgets) is in ``tests/rooms/test_room_retention_pg.py``; the same
answers as the file store's in ``test_conformance_stores.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import trio

from runtime._clock import Clocks, MockWallClock, SystemSilenceClock
from runtime._journal._postgres import PgStore, migrate, open_pg_store
from runtime._journal._store import ADMISSIONS, RESULTS, lane_key
from runtime._records import Admission, Fingerprints, Header, ResultAcked, Settled

from .pg_fixtures import execute

LIMIT: Final = 30.0
LEASE: Final = "retention:shared"
FAR: Final = 2**62
"""A publication time far ahead: held back whatever the clock says."""
FORGET: Final = 365 * 86_400_000
UNTIL: Final = FAR + FORGET


def _settled(delivery_id: str) -> Settled:
    return Settled(delivery_id=delivery_id, room="dm:1", request="f" * 64, admitted_ms=1)


async def _fill(store: PgStore, count: int) -> list[int]:
    """``count`` records in each shared log (their content does not matter to the store)."""
    seqs = []
    for n in range(count):
        seq = await store.admissions.try_append(_settled(f"d{n}"))
        assert seq is not None
        seqs.append(seq)
        assert await store.results.try_append(ResultAcked(seq=n + 1)) is not None
    return seqs


async def _rows(dsn: str, rel: str) -> list[int]:
    found = await execute(
        dsn, "SELECT seq FROM pi_runtime.log_records WHERE log = %s ORDER BY seq", [rel]
    )
    return [int(seq) for (seq,) in found]


async def test_rt11_a_compaction_leaves_holes_every_host_reads_through(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT11: one compaction rewrites admission rows in place, deletes others from both logs
    and records the expired deliveries, in one transaction; a host that was open meanwhile
    learns the expiry at its next look and appends at the number it expected; a host opened
    afterwards reads the live records through the holes and appends after the last row."""
    with trio.fail_after(LIMIT):
        async with (
            open_pg_store(pg_dsn, root=tmp_path / "a") as a,
            open_pg_store(pg_dsn, root=tmp_path / "b") as b,
        ):
            seqs = await _fill(a, 4)  # admission rows 1..4, result rows 1..4
            await b.admissions.refresh()
            await b.results.refresh()
            fence = await a.claim(LEASE, 60)
            assert fence is not None
            generation = await a.compact_shared(
                fence,
                slim={seqs[1]: _settled("d1-slim")},
                admissions=[seqs[0], seqs[2]],
                results=[1, 3],
                expire={"d0": FAR, "d2": FAR},
                forget_ms=FORGET,
            )
            assert generation == 1
            assert await _rows(pg_dsn, ADMISSIONS) == [0, 2, 4]
            assert await _rows(pg_dsn, RESULTS) == [0, 2, 4]
            told: list[dict[str, int]] = []
            b.on_expired = lambda learned: told.append(dict(learned))
            assert await b.admissions.refresh() == []  # nothing new: the holes are below
            assert told == [{"d0": UNTIL, "d2": UNTIL}]
            assert (b.generation, set(b.expired)) == (1, {"d0", "d2"})
            assert await b.admissions.try_append(_settled("d5")) == 5
        async with open_pg_store(pg_dsn, root=tmp_path / "c") as c:
            admitted = c.admissions.contents.records
            assert isinstance(admitted[0], Header)
            assert [r.delivery_id for r in admitted[1:] if isinstance(r, Settled)] == [
                "d1-slim",
                "d3",
                "d5",
            ]
            assert (c.admissions.next_seq, c.results.next_seq) == (6, 5)
            # what expired before it opened is not held in memory: the database answers
            assert (c.expired, c.generation) == ({}, 1)
            assert await c.expired_among(["d0", "d1", "d2"]) == {"d0": UNTIL, "d2": UNTIL}
            assert await c.results.try_append(ResultAcked(seq=9)) == 5


async def test_rt11_an_admission_under_a_stale_generation_writes_nothing(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT11: a host that has not learned the latest compaction cannot admit: its append is
    refused as a lost number is (nothing written), and the refusal teaches it the expired
    deliveries — so it decides again knowing them."""
    with trio.fail_after(LIMIT):
        async with (
            open_pg_store(pg_dsn, root=tmp_path / "a") as a,
            open_pg_store(pg_dsn, root=tmp_path / "b") as b,
        ):
            await _fill(a, 2)
            await b.admissions.refresh()
            fence = await a.claim(LEASE, 60)
            assert fence is not None
            assert await a.compact_shared(
                fence,
                slim={},
                admissions=[1],
                results=[1],
                expire={"d0": FAR},
                forget_ms=FORGET,
            )
            before = await _rows(pg_dsn, ADMISSIONS)
            assert await b.admissions.try_append(_settled("d0")) is None
            assert await _rows(pg_dsn, ADMISSIONS) == before
            # the refusal taught it what the compaction expired: it decides again knowing it
            assert (b.generation, b.expired) == (1, {"d0": UNTIL})
            assert await b.admissions.try_append(_settled("new")) == 3


async def test_rt11_a_compaction_whose_lease_was_taken_over_changes_nothing(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT11: a compaction runs only while its host holds the compaction's lease: one whose
    lease another host took over meanwhile deletes nothing, expires nothing."""
    with trio.fail_after(LIMIT):
        async with (
            open_pg_store(pg_dsn, root=tmp_path / "a") as a,
            open_pg_store(pg_dsn, root=tmp_path / "b") as b,
        ):
            await _fill(a, 2)
            stale = await a.claim(LEASE, 60)
            assert stale is not None
            await execute(
                pg_dsn,
                "UPDATE pi_runtime.lanes SET lease_until = now() WHERE lane = %s",
                [stale.lane],
            )
            assert await b.claim(LEASE, 60) is not None
            done = await a.compact_shared(
                stale,
                slim={},
                admissions=[1],
                results=[1],
                expire={"d0": FAR},
                forget_ms=FORGET,
            )
            assert done is None
            assert await _rows(pg_dsn, ADMISSIONS) == [0, 1, 2]
            assert await execute(pg_dsn, "SELECT count(*) FROM pi_runtime.expired_deliveries") == [
                (0,)
            ]


def _admission(delivery_id: str) -> Admission:
    return Admission(
        delivery_id=delivery_id,
        lane="dm:1",
        request={"delivery_id": delivery_id, "room": "dm:1"},
        fingerprints=Fingerprints(request="r", authority="a", settings="s"),
        rendered_prompt="hi",
        admitted_ms=1,
    )


async def test_rt11_a_host_started_after_an_expiry_cannot_admit_the_expired_delivery(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT11: a host opened after a compaction holds none of the deliveries expired before
    (a year of them would be millions); its admission of one is refused by the database in
    the insert itself, and the refusal teaches it the expiry."""
    with trio.fail_after(LIMIT):
        async with open_pg_store(pg_dsn, root=tmp_path / "a") as a:
            assert await a.admissions.try_append(_admission("old")) == 1
            assert await a.admissions.try_append(_admission("keep")) == 2
            fence = await a.claim(LEASE, 60)
            assert fence is not None
            assert await a.compact_shared(
                fence,
                slim={},
                admissions=[1],
                results=[],
                expire={"old": FAR},
                forget_ms=FORGET,
            )
        async with open_pg_store(pg_dsn, root=tmp_path / "b") as b:
            assert b.expired == {}
            told: list[dict[str, int]] = []
            b.on_expired = lambda learned: told.append(dict(learned))
            refused = await b.admissions.try_append(_admission("old"))
            rows = await _rows(pg_dsn, ADMISSIONS)
            fresh = await b.admissions.try_append(_admission("new"))
    assert refused is None
    assert told == [{"old": UNTIL}]
    assert b.expired == {"old": UNTIL}
    assert rows == [0, 2]  # nothing was written
    assert fresh == 3


# -- RT4, RT11, RT13: every lookup counts the deployment's forget_days ----------------------

DAY: Final = 86_400_000
T0: Final = 1_795_000_000_000


async def _compact_expiring(store: PgStore, since: dict[str, int], forget_days: int) -> None:
    """A compaction that only records ``since``'s deliveries expired, by a host configured
    with ``forget_days``."""
    fence = await store.claim(LEASE, 60)
    assert fence is not None
    done = await store.compact_shared(
        fence, slim={}, admissions=[], results=[], expire=since, forget_ms=forget_days * DAY
    )
    assert done is not None
    await store.release(fence)


async def _expire_task(store: PgStore, task_id: str, since_ms: int, forget_days: int) -> bool:
    fence = await store.claim(f"task:{task_id}", 60)
    assert fence is not None
    try:
        return await store.expire_task(task_id, since_ms, forget_ms=forget_days * DAY, fence=fence)
    finally:
        await store.release(fence)


async def test_rt4_rt11_every_host_counts_the_forget_days_the_last_one_started_with(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT4, RT11: a deployment whose hosts were started with ``forget_days`` 400 holds d0
    (published at day 0, expired at day 31) back; a host started at day 41 with 40 sets the
    count for all: at once every host's lookup in the database and its admission's guard
    let d0 go (the others' own memory at their next look, told by the start), with no
    compaction in between; a host started afterwards with 400 sets it back, and d0 — whose
    row no compaction removed yet — is held again, by every host. Before, each row kept the
    forget-after time the compacting host wrote: the host started with 40 changed nothing."""
    wall = MockWallClock.reading(T0 + 31 * DAY)  # day 31
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    with trio.fail_after(LIMIT):
        async with (
            open_pg_store(pg_dsn, root=tmp_path / "a", clocks=clocks) as a,
            open_pg_store(pg_dsn, root=tmp_path / "b", clocks=clocks) as b,
        ):
            first = await a.follow_forget_days(400 * DAY)
            await _compact_expiring(a, {"d0": T0}, 400)
            await a.sync_expired()  # as a host does after its compaction
            await b.sync_expired()
            held31 = dict(b.expired)
            wall.advance(10 * DAY / 1000)  # day 41
            async with open_pg_store(pg_dsn, root=tmp_path / "c", clocks=clocks) as c:
                replaced = await c.follow_forget_days(40 * DAY)
            asked = await b.expired_among(["d0"])
            listed = dict(b.expired)  # as of b's last look
            await b.sync_expired()
            looked = (b.forget_ms, dict(b.expired))
            admitted = await a.admissions.try_append(_admission("d0"))  # the guard, at once
            async with open_pg_store(pg_dsn, root=tmp_path / "d", clocks=clocks) as d:
                back = await d.follow_forget_days(400 * DAY)
                again = await d.expired_among(["d0"])
            refused = await a.admissions.try_append(_admission("d0"))
    assert first is None
    assert held31 == {"d0": T0 + 400 * DAY}
    assert replaced == 400 * DAY
    assert asked == {}
    assert listed == held31
    assert looked == (40 * DAY, {})
    assert admitted == 1
    assert back == 40 * DAY
    assert again == {"d0": T0 + 400 * DAY}
    assert refused is None


async def test_rt4_rt11_rt13_an_id_let_go_and_expired_again_is_held_from_its_new_time(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT4, RT11, RT13: d0 and t0, expired from day 0 with ``forget_days`` 40, are let go at
    day 41 while their rows are still there; the id is used again, and its second expiry
    (from day 41) holds it back to day 81 — the row past its days is replaced, not kept.
    (With the rows kept until a pass removed them, an insert that did nothing on a key
    already there would leave the old row, let go, and the second life's duplicate would
    run again as new.)"""
    wall = MockWallClock.reading(T0 + 31 * DAY)  # day 31
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    task = lane_key("task:t0")
    with trio.fail_after(LIMIT):
        async with open_pg_store(pg_dsn, root=tmp_path / "a", clocks=clocks) as a:
            await a.follow_forget_days(40 * DAY)
            await _compact_expiring(a, {"d0": T0}, 40)
            first_task = await _expire_task(a, "t0", T0, 40)
            wall.advance(10 * DAY / 1000)  # day 41
            gone = (await a.expired_among(["d0"]), await a.expired_task_keys([task]))
            await _compact_expiring(a, {"d0": T0 + 41 * DAY}, 40)
            second_task = await _expire_task(a, "t0", T0 + 41 * DAY, 40)
            wall.advance(39 * DAY / 1000)  # day 80
            held = (await a.expired_among(["d0"]), await a.expired_task_keys([task]))
    assert (first_task, second_task) == (True, True)
    assert gone == ({}, {})
    assert held == ({"d0": T0 + 81 * DAY}, {task: T0 + 81 * DAY})


async def test_rt4_rt11_rt13_rows_an_earlier_version_wrote_keep_their_forget_after_time(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT4, RT11, RT13, PG1: a database at store schema 6 holds an expired delivery and an
    expired task as that version wrote them — a forget-after time (day 40), no time of their
    own — and is migrated to 7 (``since_ms``, the count). Nothing says which ``forget_days``
    those times were counted with, so each row keeps its time whatever count a host of this
    version records (400 here): held at day 39, let go at day 41; a row this version writes
    follows the count."""
    for statement in (
        "DROP TABLE pi_runtime.retention",
        "ALTER TABLE pi_runtime.expired_deliveries DROP COLUMN since_ms",
        "ALTER TABLE pi_runtime.expired_tasks DROP COLUMN since_ms",
        "UPDATE pi_runtime.schema_version SET version = 6",
        "INSERT INTO pi_runtime.expired_deliveries (delivery_id, forget_after_ms, generation) "
        f"VALUES ('old', {T0 + 40 * DAY}, 0)",
        "INSERT INTO pi_runtime.expired_tasks (lane_key, task_id, forget_after_ms) "
        f"VALUES ('{lane_key('task:old')}', 'old', {T0 + 40 * DAY})",
    ):
        await execute(pg_dsn, statement)
    wall = MockWallClock.reading(T0 + 31 * DAY)  # day 31
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    task = lane_key("task:old")
    with trio.fail_after(LIMIT):
        assert await migrate(pg_dsn) == 7
        async with open_pg_store(pg_dsn, root=tmp_path / "a", clocks=clocks) as a:
            await a.follow_forget_days(400 * DAY)
            await _compact_expiring(a, {"new": T0}, 400)
            wall.advance(8 * DAY / 1000)  # day 39
            day39 = await a.expired_among(["old", "new"]), await a.expired_task_keys([task])
            wall.advance(2 * DAY / 1000)  # day 41
            day41 = await a.expired_among(["old", "new"]), await a.expired_task_keys([task])
    assert day39 == ({"old": T0 + 40 * DAY, "new": T0 + 400 * DAY}, {task: T0 + 40 * DAY})
    assert day41 == ({"new": T0 + 400 * DAY}, {})
