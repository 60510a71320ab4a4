"""J8a: a shared log's hand-offs of one scheduler pass reach the writer thread together —
one frame, one ``fdatasync`` — in the order they were appended; a delivery's own log keeps one
hand-off per append (runtime._journal._writer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from runtime import open_store
from runtime._journal import _writer
from runtime._journal._frame import scan
from runtime._journal._writer import LogTarget, WriterPool, handoffs_in_flight
from runtime._linux._fs import OsFileSystem
from runtime._records import StepAbandoned


def _step(n: int) -> StepAbandoned:
    return StepAbandoned(step=n, reason="test", epoch=1)


def shared_target(path: Path) -> LogTarget:
    """A new shared (grouped) log at ``path``, for a bare :class:`WriterPool`."""
    target = LogTarget(
        path=str(path),
        rel=path.name,
        good_length=0,
        next_seq=0,
        poison_path=str(path) + ".poison",
        create=True,
    )
    target.grouped = True
    return target


def _frames(path: Path) -> list[tuple[int, int]]:
    """``(first_seq, count)`` of every frame in the file; the file must be whole: its frames,
    then at most the zeros a delivery's log holds allocated ahead (J19)."""
    data = path.read_bytes()
    found = scan(data)
    assert data.count(0, found.good_length) == found.torn_bytes
    return [(frame.first_seq, frame.count) for frame in found.frames]


async def test_one_pass_of_shared_appends_is_one_frame(tmp_path: Path) -> None:
    """J8a: 40 appends to the shared admission log started in one pass are one frame after
    the header's, each acknowledged with its own number."""
    root = tmp_path / "state"
    done: list[tuple[int, int]] = []
    with trio.fail_after(30):
        async with open_store(root) as store:
            log = store.admissions

            async def append(n: int) -> None:
                done.append((n, await log.append(_step(n))))

            async with trio.open_nursery() as nursery:
                for n in range(40):
                    nursery.start_soon(append, n)
            # each its own number (in the order the pass ran them: Trio may shuffle a pass)
            assert sorted(number for _, number in done) == list(range(1, 41))
            assert len({n for n, _ in done}) == 40
            assert handoffs_in_flight() == 0
    assert _frames(root / "admissions" / "admissions.log") == [(0, 1), (1, 40)]


async def test_passes_keep_their_order_and_a_close_comes_after_them(tmp_path: Path) -> None:
    """J8a: appends of successive passes, interleaved with a delivery's own log, keep the
    shared log's sequence (no gap, no reordering: the reader would refuse either), and a
    close handed over in a pass settles after that pass's appends."""
    root = tmp_path / "state"
    with trio.fail_after(30):
        async with open_store(root) as store:
            own = await store.create_delivery_log("d-1")
            log = store.results
            numbers: list[int] = []

            async def shared(n: int) -> None:
                numbers.append(await log.append(_step(n)))

            for wave in range(5):
                async with trio.open_nursery() as nursery:
                    for n in range(wave + 1):
                        nursery.start_soon(shared, n)
                        nursery.start_soon(own.append, _step(n))
            assert sorted(numbers) == list(range(1, 16))
            frames = _frames(root / "results.log")
            assert frames == [(0, 1), (1, 1), (2, 2), (4, 3), (7, 4), (11, 5)]
            # the delivery's own log (not grouped, the same writer pool): whole, in sequence
            assert sum(count for _, count in _frames(root / own.rel)) == 16
            async with trio.open_nursery() as nursery:

                async def append_then_close() -> None:
                    # the close starts in the pass the append's stager ends, so it is staged
                    # behind the append (a close begun first refuses a later append: J19)
                    nursery.start_soon(store.close_log, log)
                    await log.append(_step(99))

                nursery.start_soon(append_then_close)
    assert _frames(root / "results.log")[-1] == (16, 1)


async def test_a_pass_staged_when_the_pool_closes_is_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """J8a: the pool's close hands over what a pass staged before it stops its threads:
    every staged append is written and acknowledged, none waits forever. (The pass's end is
    held until the close ran, so the close surely finds them staged.)"""
    closed = trio.Event()

    async def pass_ends_after_the_close() -> None:
        with trio.CancelScope(shield=True):
            await closed.wait()

    monkeypatch.setattr(_writer, "_end_of_pass", pass_ends_after_the_close)
    fs = OsFileSystem()
    path = tmp_path / "shared.log"
    failures: list[object] = []
    with trio.fail_after(30):
        pool = WriterPool(
            fs,
            shards=2,
            poison_document=lambda *_: b"{}",
            on_disk_failure=failures.append,
        )
        target = shared_target(path)
        numbers: list[int] = []

        async def append(n: int) -> None:
            numbers.append(await pool.append(target, b"record %d" % n))

        async with trio.open_nursery() as nursery:
            for n in range(10):
                nursery.start_soon(append, n)
            await trio.testing.wait_all_tasks_blocked()
            assert sum(map(len, pool._staged)) == 10  # staged, not handed over
            stopped = trio.Event()

            async def close() -> None:
                await pool.aclose()
                stopped.set()

            nursery.start_soon(close)
            await trio.testing.wait_all_tasks_blocked()
            assert not stopped.is_set()  # the close waits for the pass's end
            assert not numbers
            closed.set()
        assert stopped.is_set()
        assert sorted(numbers) == list(range(10))
        assert failures == []
        await pool.close_target(target)  # closed: nothing to do
    assert _frames(path) == [(0, 10)]
