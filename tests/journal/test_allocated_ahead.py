"""J19: a delivery's log is allocated ahead of its frames and written in place.

Each frame of a delivery's log is written (``pwrite``) over zeros the file already holds,
so a step's ``fdatasync`` commits no size change; only each growth does. These tests check
what that must not change: the frames read back whole and in order, nothing but zeros
ever lies after them, a clean close leaves the frames alone, the space running out is the
log's own disk failure, and a flipped bit in the last frame is damage even with zeros
after it (J4). The power-loss sweep with logs that grow on nearly every append is in
``test_power_loss.py`` (``test_power_loss_while_delivery_logs_grow``).
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Final

import pytest
import trio

from runtime import DiskFailedError, JournalError, ReasonCode, Store, open_store
from runtime._journal._frame import encode_frame, scan
from runtime._journal._store import DELIVERY_AHEAD
from runtime._journal._writer import LogTarget, WriterPool
from runtime._linux._fs import OsFileSystem
from runtime._records import OutboxAction

from ..faultfs import Fault, FaultyFileSystem

BIG: Final = DELIVERY_AHEAD + DELIVERY_AHEAD // 2
"""A record that does not fit in the space allocated ahead of a fresh log."""


def _action(n: int, pad: int = 0) -> OutboxAction:
    return OutboxAction(action_id=f"a:{n}", kind="test", state="done", detail={"pad": "x" * pad})


class Counting(OsFileSystem):
    """The real file system, counting how frames reach the files."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def allocate(self, handle: int, offset: int, length: int) -> None:
        self.calls.append("allocate")
        super().allocate(handle, offset, length)

    def write(self, handle: int, data: bytes) -> int:
        self.calls.append("write")
        return super().write(handle, data)

    def pwrite(self, handle: int, data: bytes, offset: int) -> int:
        self.calls.append("pwrite")
        return super().pwrite(handle, data, offset)


def _disk_failure(store: Store) -> DiskFailedError | None:
    return store.disk_failure


def _only_frames_then_zeros(data: bytes) -> int:
    """The good length of a log's bytes, asserting that only zeros follow it."""
    found = scan(data)
    assert data.count(0, found.good_length) == len(data) - found.good_length, "not zeros"
    return found.good_length


async def test_j19_steps_are_written_over_space_allocated_ahead(tmp_path: Path) -> None:
    """J19: the file is allocated ahead once, each frame is a positional write over its
    zeros (no append), only zeros follow the last frame, and a clean close cuts them."""
    fs = Counting()
    root = tmp_path / "state"
    async with open_store(root, fs=fs) as store:
        log = await store.create_delivery_log("d0")
        fs.calls.clear()
        for n in range(1, 41):
            assert await log.append(_action(n)) == n
        path = root / log.rel
        data = path.read_bytes()
        good = _only_frames_then_zeros(data)
        assert len(data) > good, "space allocated ahead of the frames"
        assert fs.calls.count("pwrite") == 40
        assert "write" not in fs.calls, "a delivery's frame is never appended"
        assert "allocate" not in fs.calls, "the header's allocation holds 40 small steps"
        assert [r.action_id for r in (await store.read(log.rel)).records[1:]] == [  # type: ignore[union-attr]
            f"a:{n}" for n in range(1, 41)
        ]
        await store.close_log(log)
        assert path.read_bytes() == data[:good], "a clean close leaves the frames alone"


async def test_j19_a_frame_larger_than_the_space_ahead_grows_the_file(tmp_path: Path) -> None:
    """J19: a record that does not fit in what is allocated grows the file first; it and
    the records around it read back whole, and the log reopens and continues after them."""
    fs = Counting()
    root = tmp_path / "state"
    async with open_store(root, fs=fs) as store:
        log = await store.create_delivery_log("d0")
        fs.calls.clear()
        await log.append(_action(1))
        await log.append(_action(2, pad=BIG))
        await log.append(_action(3))
        assert fs.calls.count("allocate") == 1
        _only_frames_then_zeros((root / log.rel).read_bytes())
    async with open_store(root) as store:
        reopened = await store.open_delivery_log("d0")
        assert await reopened.append(_action(4)) == 4
        records = (await store.read(reopened.rel)).records[1:]
        assert [r.action_id for r in records] == ["a:1", "a:2", "a:3", "a:4"]  # type: ignore[union-attr]


async def test_j19_the_writer_cuts_what_lies_past_the_good_length_before_writing(
    tmp_path: Path,
) -> None:
    """J19: a file that holds bytes past its good length when the writer first opens it
    (never acknowledged) is cut back first, so the frames written over allocated space are
    followed by zeros, never by what an older write left — a shorter frame written over
    a longer torn one would otherwise leave that one's end after it."""
    path = tmp_path / "log"
    frames = encode_frame(0, [b'{"n":0}'])
    path.write_bytes(frames + b"\x7f" * 4096)
    pool = WriterPool(
        OsFileSystem(),
        shards=1,
        poison_document=lambda *_: b"{}",
        on_disk_failure=lambda _: None,
    )
    target = LogTarget(
        path=str(path),
        rel="log",
        good_length=len(frames),
        next_seq=1,
        poison_path=str(path) + ".poison",
        create=False,
    )
    target.ahead = 4096
    try:
        assert await pool.append(target, b'{"n":1}') == 1
    finally:
        await pool.aclose()
    data = path.read_bytes()
    assert _only_frames_then_zeros(data) == len(frames) + len(encode_frame(1, [b'{"n":1}']))
    assert [frame.first_seq for frame in scan(data).frames] == [0, 1]


async def test_j19_no_room_to_allocate_ahead_still_writes_a_frame_that_fits(
    tmp_path: Path,
) -> None:
    """J19, J5, J6: when the file cannot be allocated ahead (``ENOSPC`` from the allocation,
    every time), a frame that fits is still written, extending the file as an append does:
    the disk is short of room to reserve, not of room for the step. Only a frame that does
    not fit fails: ``disk_full``, the log poisoned, the records acknowledged before whole."""
    root = tmp_path / "state"
    fs = FaultyFileSystem(OsFileSystem(), armed=False)
    async with open_store(root, fs=fs) as store:
        log = await store.create_delivery_log("d0")
        fs.arm(Fault("allocate", errno=errno.ENOSPC, sticky=True, path_contains=log.rel))
        assert await log.append(_action(1)) == 1
        assert await log.append(_action(2, pad=BIG)) == 2
        assert fs.fired
        assert _disk_failure(store) is None
        data = (root / log.rel).read_bytes()
        assert _only_frames_then_zeros(data) == len(data), "the frames alone: nothing ahead"
        fs.arm(Fault("write", errno=errno.ENOSPC, path_contains=log.rel))
        with pytest.raises(DiskFailedError) as failed:
            await log.append(_action(3))
        assert failed.value.code is ReasonCode.DISK_FULL
        assert _disk_failure(store) is not None  # J6: the host stops admitting
        with pytest.raises(JournalError) as refused:
            await log.append(_action(4))
        assert refused.value.code is ReasonCode.JOURNAL_POISONED
        contents = await store.read(log.rel)
        assert [r.action_id for r in contents.records[1:]] == ["a:1", "a:2"]  # type: ignore[union-attr]


async def test_j19_a_closed_log_refuses_appends(tmp_path: Path) -> None:
    """J19: a journal used after its log was closed is refused ``journal_closed`` — the log's
    next opening writes at the end it reads, and a stale journal writing at its own older
    end would overwrite that opening's acknowledged frames."""
    async with open_store(tmp_path / "state") as store:
        log = await store.create_delivery_log("d0")
        await log.append(_action(1))
        await store.close_log(log)
        reopened = await store.open_delivery_log("d0")
        assert await reopened.append(_action(2)) == 2
        with pytest.raises(JournalError) as refused:
            await log.append(_action(99))
        assert refused.value.code is ReasonCode.JOURNAL_CLOSED
        assert await reopened.append(_action(3)) == 3
        records = (await store.read(reopened.rel)).records[1:]
        assert [r.action_id for r in records] == ["a:1", "a:2", "a:3"]  # type: ignore[union-attr]


async def test_j19_two_tasks_opening_a_log_at_once_share_one_journal(tmp_path: Path) -> None:
    """J19: two tasks opening one delivery's log at once (after a crash left zeros to cut)
    get one journal, so their frames take successive offsets instead of one."""
    root = tmp_path / "state"
    async with open_store(root, sync_log=False) as store:
        log = await store.create_delivery_log("d0")
        await log.append(_action(1))
        path = root / log.rel
        left = path.read_bytes()
    path.write_bytes(left)  # what a crash would leave: the frames, then zeros
    # (no sync log: each log on its own path, nothing else orders the two openings' reads)
    async with open_store(root, sync_log=False) as store:
        opened: list[object] = []

        async def open_and_append(n: int) -> None:
            journal = await store.open_delivery_log("d0")
            opened.append(journal)
            await journal.append(_action(n))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_and_append, 2)
            nursery.start_soon(open_and_append, 3)
        assert opened[0] is opened[1]
        records = (await store.read(log.rel)).records[1:]
        assert sorted(r.action_id for r in records) == ["a:1", "a:2", "a:3"]  # type: ignore[union-attr]


async def test_j19_j4_a_flipped_bit_in_the_last_frame_before_the_zeros_is_damage(
    tmp_path: Path,
) -> None:
    """J19, J4: the file a crash leaves (frames, then the zeros allocated ahead) with one
    bit flipped in the body of its last, acknowledged frame fails closed with
    ``journal_corrupt`` at that frame: the zeros after it are not the torn write that would
    make its record vanish."""
    root = tmp_path / "state"
    async with open_store(root) as store:
        log = await store.create_delivery_log("d0")
        for n in range(1, 4):
            await log.append(_action(n))
        path = root / log.rel
        left = bytearray(path.read_bytes())  # what a crash now would leave
    last = scan(bytes(left)).frames[-1]
    good = _only_frames_then_zeros(bytes(left))
    assert len(left) > good
    left[last.offset + 30] ^= 0x04
    path.write_bytes(bytes(left))
    async with open_store(root) as store:
        with pytest.raises(JournalError) as damaged:
            await store.read(log.rel)
    assert damaged.value.code is ReasonCode.JOURNAL_CORRUPT
    assert damaged.value.offset == last.offset


async def test_j19_a_crash_leaves_zeros_that_the_next_open_cuts(tmp_path: Path) -> None:
    """J19, J3: the zeros a crash leaves after the frames read as a torn tail (never
    acknowledged), are cut durably when the log is opened for appending, and the log goes
    on at its next number."""
    root = tmp_path / "state"
    async with open_store(root) as store:
        log = await store.create_delivery_log("d0")
        await log.append(_action(1))
        path = root / log.rel
        left = path.read_bytes()
    path.write_bytes(left)  # the store closed cleanly; put back what a crash would leave
    good = _only_frames_then_zeros(left)
    with trio.fail_after(10):
        async with open_store(root) as store:
            contents = await store.read(log.rel)
            assert contents.good_length == good
            assert contents.torn_bytes == len(left) - good
            reopened = await store.open_delivery_log("d0")
            assert path.stat().st_size == good
            assert await reopened.append(_action(2)) == 2
