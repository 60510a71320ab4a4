"""How an append's task is woken once its record is durable (journal.md J8b).

The writer thread reschedules a batch's tasks with one ``run_sync_soon`` callback. The wait
refuses cancellation (a record handed over always reports its fate to its caller; the cancel
comes after), and a batch's disk failure is reported before any of its tasks runs on.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from runtime import DiskFailedError, JournalError, ReasonCode, open_store
from runtime._journal._sync_log import SYNC_DIR
from runtime._journal._writer import handoffs_in_flight
from runtime._linux._fs import FileSystem, OsFileSystem
from runtime._records import OutboxAction

from ..faultfs import Fault, FaultyFileSystem
from .test_sync_log import Holding


def _record(name: str) -> OutboxAction:
    return OutboxAction(action_id=name, kind="step", state="done")


class _HeldWrite:
    """Holds the next ``write`` or ``pwrite`` on the writer thread until released."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.held = threading.Event()
        self.go = threading.Event()
        self.holding = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _hold(self) -> None:
        if self.holding:
            self.holding = False
            self.held.set()
            self.go.wait(10)

    def write(self, handle: int, data: bytes) -> int:
        self._hold()
        return int(self.inner.write(handle, data))

    def pwrite(self, handle: int, data: bytes, offset: int) -> int:
        self._hold()
        return int(self.inner.pwrite(handle, data, offset))


@pytest.mark.parametrize("others", [0, 3], ids=["alone", "with-others"])
async def test_j8b_an_append_cancelled_while_it_waits_gets_its_number_then_the_cancel(
    tmp_path: Path, others: int
) -> None:
    """J8b: a caller cancelled while its record is being made durable still gets its
    number (the record is in the log), and the cancel arrives at its next checkpoint — alone
    in its batch, or with other logs' records queued behind it (one sync log batch)."""
    fs = _HeldWrite(OsFileSystem())
    got: list[object] = []
    with trio.fail_after(20):
        async with open_store(tmp_path / "state", fs=cast(FileSystem, fs)) as store:
            log = await store.create_delivery_log("d")
            extra = [await store.create_delivery_log(f"e{i}") for i in range(others)]
            fs.holding = True
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()

                async def append() -> None:
                    with scope:
                        got.append(await log.append(_record("mine")))
                        await trio.lowlevel.checkpoint()
                        got.append("not cancelled")

                nursery.start_soon(append)
                await trio.to_thread.run_sync(fs.held.wait, 10)
                for i, other in enumerate(extra):  # queued behind the held batch
                    nursery.start_soon(other.append, _record(f"other-{i}"))
                while handoffs_in_flight() < 1 + others:
                    await trio.testing.wait_all_tasks_blocked(cushion=0.005)
                scope.cancel()
                await trio.testing.wait_all_tasks_blocked(cushion=0.01)
                assert got == []  # still waiting: the cancel does not end the wait
                fs.go.set()
            assert got == [1]
            assert scope.cancelled_caught
            assert (await store.read(log.rel)).records[1:] == (_record("mine"),)


async def test_j8b_an_appends_disk_failure_is_reported_before_it_runs_on(
    tmp_path: Path,
) -> None:
    """J8b, J6: an append whose record cannot be made durable (its file's write fails: EIO;
    a sync log write before it too) raises the disk failure, and the store has reported it
    (it stops admitting) before that task runs on."""
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    with trio.fail_after(20):
        async with open_store(tmp_path / "state", fs=faulty) as store:
            log = await store.create_delivery_log("d")
            faulty.arm(
                [
                    Fault("write", 1, "before", errno.EIO, path_contains=f"/{SYNC_DIR}/"),
                    Fault("write", 1, "before", errno.EIO, path_contains="/deliveries/"),
                ]
            )
            with pytest.raises(DiskFailedError):
                await log.append(_record("lost"))
            assert store.disk_failure is not None
            assert log.poisoned


class _BrokenSync(Holding):
    """The next ``fdatasync`` of a path containing :attr:`part` raises an error that is not
    an ``OSError`` (a bug below the writer, say)."""

    part: str | None = None

    def fdatasync(self, handle: int) -> None:
        if self.part is not None and self.part in self._paths.get(handle, ""):
            self.part = None
            raise RuntimeError("injected: not an OSError")
        super().fdatasync(handle)


async def test_j5_j8b_an_error_that_is_not_the_disks_poisons_its_log_and_hangs_no_one(
    tmp_path: Path,
) -> None:
    """J5, J8b: an exception that is not an ``OSError`` while a writer thread writes a batch
    (a bug, or a frame past the largest body) leaves no caller waiting forever: what reached
    the disk is unknown, so the batch's log is poisoned and its append refused
    (``journal_poisoned``); the thread goes on, so the next append to another log of the same
    shard is acknowledged; after a restart the log is refused for appending and reads only
    what was acknowledged."""
    fs = _BrokenSync(OsFileSystem())
    root = tmp_path / "state"
    with trio.fail_after(20):
        async with open_store(root, fs=cast(FileSystem, fs)) as store:
            broken = await store.create_delivery_log("broken")
            other = await store.create_delivery_log("other")
            fs.part = broken.rel
            with pytest.raises(JournalError) as refused:
                await broken.append(_record("lost"))
            assert refused.value.code is ReasonCode.JOURNAL_POISONED
            assert broken.poisoned
            assert await other.append(_record("kept")) == 1
            assert store.disk_failure is None  # not the disk's
        async with open_store(root) as store:
            with pytest.raises(JournalError) as refused:
                await store.open_delivery_log("broken")
            assert refused.value.code is ReasonCode.JOURNAL_POISONED
            assert (await store.read_delivery_log("broken")).records[1:] == ()
            assert (await store.read_delivery_log("other")).records[1:] == (_record("kept"),)
