"""The start's sync of the whole state directory on the real file system (journal.md J23).

What it is for — a record a killed process wrote and never synced, read by the next start,
must survive a power loss afterwards — can only be shown on the power-loss model
(``test_kill_then_power_loss.py``): a real machine cannot lose power inside a test, and a
SIGKILL keeps the page cache. These tests check the real half: every start asks the kernel
for it (``syncfs(2)``), off the Trio loop, and where the kernel or the C library has no
``syncfs`` the fallback reaches every file and directory under the state directory.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from runtime import open_store
from runtime._linux import _fs
from runtime._linux._fs import OsFileSystem, syncfs_available
from runtime._records import OutboxAction


class _SyncsTree(OsFileSystem):
    """The real file system, noting where and on which thread each ``sync_tree`` ran."""

    def __init__(self) -> None:
        self.synced: list[tuple[str, threading.Thread]] = []

    def sync_tree(self, path: str) -> None:
        self.synced.append((path, threading.current_thread()))
        super().sync_tree(path)


async def test_j23_j11_every_start_syncs_the_state_directory_off_the_loop(
    tmp_path: Path,
) -> None:
    """J23, J11: a clean stop leaves nothing unsynced of the store's own, but the state
    directory holds files others write (a lane's Pi session, the receipt store) whose last
    writer may have been killed: every start syncs the whole state directory — with the
    real ``syncfs``, found in the C library — once, on a worker thread: a sync of a busy
    file system can take seconds, and the Trio loop must not wait on it."""
    assert syncfs_available(), "the C library's syncfs was not found: every start walks"
    root = tmp_path / "state"
    fs = _SyncsTree()
    loop = threading.current_thread()
    with trio.fail_after(20):
        for n in range(2):
            async with open_store(root, fs=fs) as store:
                await store.admissions.append(OutboxAction(action_id=f"{n}", kind="t", state="d"))
    assert [path for path, _ in fs.synced] == [str(root), str(root)]
    assert all(thread is not loop for _, thread in fs.synced)


def _failing_syncfs(code: int) -> Callable[[int], int]:
    def syncfs(fd: int) -> int:
        ctypes.set_errno(code)
        return -1

    return syncfs


@pytest.mark.parametrize("syncfs", ["missing", "ENOSYS"])
def test_j23_without_syncfs_every_file_and_directory_under_the_state_directory_is_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, syncfs: str
) -> None:
    """J23: where the C library has no ``syncfs``, or the kernel answers ``ENOSYS``, the
    sync falls back to ``fsync`` of every regular file and directory under the state
    directory, each file before the directory holding it — none left out, however deep —
    and follows no symbolic link out of it, nor waits on a FIFO."""
    root = tmp_path / "state"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a").write_bytes(b"a")
    (root / "sub" / "b").write_bytes(b"b")
    outside = tmp_path / "outside"
    outside.write_bytes(b"not ours")
    (root / "link").symlink_to(outside)
    os.mkfifo(root / "sub" / "fifo")
    monkeypatch.setattr(
        _fs, "_SYNCFS", None if syncfs == "missing" else _failing_syncfs(errno.ENOSYS)
    )
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    OsFileSystem().sync_tree(str(root))
    expected = {root, root / "a", root / "sub", root / "sub" / "b", root / "sub" / "deeper"}
    assert sorted(synced) == sorted(str(p) for p in expected)
    for path in expected - {root}:
        assert synced.index(str(path)) < synced.index(str(path.parent)), path


def test_j23_a_failed_syncfs_raises_its_errno(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """J23, J6: ``syncfs`` failing with anything but ``ENOSYS`` (a writeback error: ``EIO``)
    is raised, never taken for a missing ``syncfs`` and walked around — a walk's ``fsync``
    on a fresh descriptor may report success for pages the failed writeback dropped."""
    monkeypatch.setattr(_fs, "_SYNCFS", _failing_syncfs(errno.EIO))
    with pytest.raises(OSError, match="syncfs") as info:
        OsFileSystem().sync_tree(str(tmp_path))
    assert info.value.errno == errno.EIO
