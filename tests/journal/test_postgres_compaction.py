"""The shared logs' compaction on PostgreSQL (docs/design/retention.md RT11), at the store:
rows deleted and rewritten in one transaction under the compaction's lease, the holes every
host then reads through, and the guard that keeps a host that has not yet heard of an expiry
from admitting the expired delivery again as new. The room worker's side (what it plans,
what each host forgets) is in ``tests/rooms/test_room_retention_pg.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import trio

from runtime._journal._postgres import PgStore, open_pg_store
from runtime._journal._store import ADMISSIONS, RESULTS
from runtime._records import Admission, Fingerprints, Header, ResultAcked, Settled

from .pg_fixtures import execute

LIMIT: Final = 30.0
LEASE: Final = "retention:shared"
FAR: Final = 2**62


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
            )
            assert generation == 1
            assert await _rows(pg_dsn, ADMISSIONS) == [0, 2, 4]
            assert await _rows(pg_dsn, RESULTS) == [0, 2, 4]
            told: list[dict[str, int]] = []
            b.on_expired = lambda learned: told.append(dict(learned))
            assert await b.admissions.refresh() == []  # nothing new: the holes are below
            assert told == [{"d0": FAR, "d2": FAR}]
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
            assert await c.expired_among(["d0", "d1", "d2"]) == {"d0": FAR, "d2": FAR}
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
                fence, slim={}, admissions=[1], results=[1], expire={"d0": FAR}
            )
            before = await _rows(pg_dsn, ADMISSIONS)
            assert await b.admissions.try_append(_settled("d0")) is None
            assert await _rows(pg_dsn, ADMISSIONS) == before
            # the refusal taught it what the compaction expired: it decides again knowing it
            assert (b.generation, b.expired) == (1, {"d0": FAR})
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
                stale, slim={}, admissions=[1], results=[1], expire={"d0": FAR}
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
                fence, slim={}, admissions=[1], results=[], expire={"old": FAR}
            )
        async with open_pg_store(pg_dsn, root=tmp_path / "b") as b:
            assert b.expired == {}
            told: list[dict[str, int]] = []
            b.on_expired = lambda learned: told.append(dict(learned))
            refused = await b.admissions.try_append(_admission("old"))
            rows = await _rows(pg_dsn, ADMISSIONS)
            fresh = await b.admissions.try_append(_admission("new"))
    assert refused is None
    assert told == [{"old": FAR}]
    assert b.expired == {"old": FAR}
    assert rows == [0, 2]  # nothing was written
    assert fresh == 3
