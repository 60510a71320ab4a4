"""The ``Compacted`` mark of a rewritten shared log counts exactly what the old file held and
the new one does not (docs/design/retention.md RT6), whatever was appended while the rewrite
ran (RT7): on a real file store, on virtual time — the rewrite is paced (RT10) so appends
land in the middle of it, and before it began."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
import trio
import trio.testing

from runtime._journal._journal import read_log
from runtime._journal._store import ADMISSIONS, RESULTS, open_store
from runtime._linux._fs import OsFileSystem
from runtime._records import Admission, Compacted, Fingerprints, Header, Outcome, Record
from runtime._rooms._outbox import ResultOutbox

pytestmark = pytest.mark.trio

PACE = 1
"""Bytes per second: each piece of the new file is followed by a sleep of minutes."""


def admission(n: int) -> Admission:
    return Admission(
        delivery_id=f"d{n}",
        lane="dm:1",
        request={"delivery_id": f"d{n}", "text": "x"},
        fingerprints=Fingerprints(request="r", authority="a", settings="s"),
        rendered_prompt="p",
        admitted_ms=n,
    )


def on_disk(root: Path, rel: str) -> list[Record]:
    return list(read_log(OsFileSystem(), str(root), rel).records)


def left_out(old: Sequence[Record], new: Sequence[Record]) -> int:
    """How many records of the old file (after its header and any mark of its own) the new
    one does not hold."""
    kept = list(new[2:])
    count = 0
    for record in old:
        if isinstance(record, Header | Compacted):
            continue
        if record in kept:
            kept.remove(record)
        else:
            count += 1
    return count


def replaced_by(
    held: Callable[[], AbstractAsyncContextManager[list[Record]]],
    root: Path,
    rel: str,
    replaced: list[Record],
) -> Callable[[], AbstractAsyncContextManager[list[Record]]]:
    """``held``, reading the old file into ``replaced`` once it holds appends back: the file
    as the rename will replace it."""

    @contextlib.asynccontextmanager
    async def reading() -> AsyncIterator[list[Record]]:
        async with held() as since:
            replaced[:] = await trio.to_thread.run_sync(on_disk, root, rel)
            yield since

    return reading


async def test_rt6_the_mark_counts_what_was_left_out_of_the_admission_log_exactly(
    tmp_path: Path, io_autojump_clock: trio.testing.MockClock
) -> None:
    """RT6, RT7: five admissions, the records to keep taken (the first two left out); two
    more admitted before the rewrite begins, one more while its new file is being written;
    all three carried over by the catch-up. The mark counts the two left out — not the
    admissions the log gained while the compaction ran."""
    root = tmp_path / "state"
    appending = trio.Lock()
    appended: list[Record] = []
    replaced: list[Record] = []

    async def admit(n: int) -> None:
        async with appending:
            await store.admissions.append(admission(n))
            appended.append(admission(n))

    @contextlib.asynccontextmanager
    async def held() -> AsyncIterator[list[Record]]:
        async with appending:  # admissions wait, those under way finish first
            yield appended[taken:]

    async def admit_meanwhile() -> None:
        await trio.sleep(1)  # the rewrite sleeps for minutes after its first piece
        await admit(7)

    async with open_store(root) as store:
        for n in range(5):
            await admit(n)
        records, taken = list(appended[2:]), len(appended)
        await admit(5)  # after the records were taken, before the rewrite began
        await admit(6)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(admit_meanwhile)
            await store.rewrite_shared(
                store.admissions,
                records,
                held=replaced_by(held, root, ADMISSIONS, replaced),
                bytes_per_second=PACE,
            )
    new = on_disk(root, ADMISSIONS)
    assert replaced[1:] == appended  # the old file held all eight
    assert [type(r) for r in new[:2]] == [Header, Compacted]
    assert new[2:] == appended[2:]
    mark = new[1]
    assert isinstance(mark, Compacted)
    assert mark.removed == left_out(replaced, new) == 2


async def test_rt6_the_mark_counts_what_was_left_out_of_the_result_log_exactly(
    tmp_path: Path, io_autojump_clock: trio.testing.MockClock
) -> None:
    """RT6, RT7, RT8: three results published and the first acknowledged; the compaction
    leaves the first out; one more result published and acknowledged after the records to
    keep were taken, before the rewrite began, and another while its new file is being
    written. The new file keeps the acknowledged seq (RT8) and the catch-up carries the late
    results and the last acknowledgement over — not the one that supersedes — and the mark
    counts exactly what the old file held and the new one does not: the first result and
    the superseded acknowledgement, not what the log gained while the compaction ran."""
    root = tmp_path / "state"
    replaced: list[Record] = []
    async with open_store(root) as store:
        outbox = ResultOutbox(store.results)
        for n in (1, 2, 3):
            await outbox.publish(delivery_id=f"d{n}", room="dm:1", outcome=Outcome.REPLY)
        await outbox.ack(1)

        async def publish_meanwhile() -> None:
            await trio.sleep(1)  # the rewrite sleeps for minutes after its first piece
            later = await outbox.publish(delivery_id="later", room="dm:1", outcome=Outcome.REPLY)
            await outbox.ack(later.seq)

        async def replace(
            records: list[Record],
            last_seq: int,
            held: Callable[[], AbstractAsyncContextManager[list[Record]]],
        ) -> object:
            late = await outbox.publish(delivery_id="late", room="dm:1", outcome=Outcome.REPLY)
            await outbox.ack(late.seq)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(publish_meanwhile)
                return await store.rewrite_shared(
                    store.results,
                    records,
                    last_seq=last_seq,
                    held=replaced_by(held, root, RESULTS, replaced),
                    bytes_per_second=PACE,
                )

        await outbox.rewrite({"d1"}, replace, lambda: store.results)
        published = [(r.delivery_id, r.seq) for r in outbox.published()]
    new = on_disk(root, RESULTS)
    assert published == [("d2", 2), ("d3", 3), ("late", 4), ("later", 5)]
    assert len(replaced) == 1 + 8  # d1-d3, ack 1, late, ack 4, later, ack 5
    mark = new[1]
    assert isinstance(mark, Compacted)
    assert mark.last_seq == 3
    assert mark.removed == left_out(replaced, new) == 2
