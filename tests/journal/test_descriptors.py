"""The journal out of file descriptors (``EMFILE``/``ENFILE``): a resource, not the disk
(docs/design/journal.md J5, docs/design/lanes.md L21).

The want is injected where the store opens files and syncs directories (its ``FileSystem``):
the kernel's errno, raised before anything was done.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio

from runtime import DiskFailedError, JournalError, ReasonCode, open_store
from runtime._journal import _store
from runtime._linux._fs import OsFileSystem
from runtime._records import OutboxAction

from ..faultfs import Fault, FaultyFileSystem


def _action(n: int) -> OutboxAction:
    return OutboxAction(action_id=f"a:{n}", kind="test", state="done", detail={})


class Exhausted(OsFileSystem):
    """Out of descriptors on demand: ``dir_syncs`` directory syncs of a path holding
    ``marker`` fail, and while ``opens`` is set every open of a file fails."""

    def __init__(self, marker: str = "", dir_syncs: int = 0, code: int = errno.EMFILE) -> None:
        self.marker, self.dir_syncs, self.code = marker, dir_syncs, code
        self.opens = False
        self.refused: list[str] = []

    def _refuse(self, path: str) -> None:
        self.refused.append(path)
        raise OSError(self.code, os.strerror(self.code), path)

    def fsync_dir(self, path: str) -> None:
        if self.dir_syncs and self.marker in path:
            self.dir_syncs -= 1
            self._refuse(path)
        super().fsync_dir(path)

    def open_append(self, path: str) -> int:
        if self.opens:
            self._refuse(path)
        return super().open_append(path)

    def open_write(self, path: str) -> int:
        if self.opens:
            self._refuse(path)
        return super().open_write(path)


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
@pytest.mark.parametrize("sync_log", [True, False], ids=["through_the_sync_log", "own_sync"])
async def test_j5_l21_a_new_logs_directory_sync_out_of_descriptors_poisons_nothing(
    tmp_path: Path, sync_log: bool, code: int
) -> None:
    """J5/L21: a new log's file was opened (created) but the sync of its directory entry —
    which takes a descriptor too — found none. Tries to break: the log poisoned (a poison
    document for a log nothing was written to, the lane's host stopped), the store taking it
    for a failed disk, the refused log keeping its file's descriptor, the next creation of
    the same log refused as existing. Expected: refused ``too_many_open_files``, no poison,
    no disk failure, no descriptor kept; the same log created again takes its records, and
    a restart reads them whole."""
    fs = Exhausted("deliveries", dir_syncs=1, code=code)
    root = tmp_path / "state"
    with trio.fail_after(20):
        async with open_store(root, fs=fs, sync_log=sync_log) as store:
            before = _descriptors()
            with pytest.raises(JournalError) as info:
                await store.create_delivery_log("d1")
            assert info.value.code is ReasonCode.TOO_MANY_OPEN_FILES
            assert len(fs.refused) == 1
            assert store.disk_failure is None
            assert _descriptors() == before, "the refused log holds no descriptor"
            assert sorted(p.name for p in root.rglob("*.poison")) == []
            log = await store.create_delivery_log("d1")  # its empty file is no record
            assert await log.append(_action(1)) == 1
            await store.close_log(log)
        async with open_store(root) as store:
            contents = await store.read_delivery_log("d1")
            assert contents.records[1:] == (_action(1),)
            assert contents.poison is None


async def test_l21_the_shared_logs_never_need_a_descriptor_to_append(tmp_path: Path) -> None:
    """L21: after a restart the shared logs are opened for reading; their files are held
    open from the store's start. Tries to break: the first admission after a restart
    opening the admission log's file, refused for want of a descriptor — and, the refusal
    holding for the log, every admission of the host refused after it. Expected: with
    every open of a file refused, admissions and results are still appended."""
    root = tmp_path / "state"
    async with open_store(root) as store:
        await store.admissions.append(_action(1))
        await store.results.append(_action(1))
    fs = Exhausted()
    with trio.fail_after(20):
        async with open_store(root, fs=fs) as store:
            fs.opens = True
            assert await store.admissions.append(_action(2)) == 2
            assert await store.results.append(_action(2)) == 2
            fs.opens = False
            assert fs.refused == []
        async with open_store(root) as store:
            assert [r for r in (await store.read(store.admissions.rel)).records[1:]] == [
                _action(1),
                _action(2),
            ]


@pytest.mark.parametrize("refusals", ["once", "always"])
async def test_l21_j6_a_compactions_directory_sync_out_of_descriptors(
    tmp_path: Path, refusals: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L21, J6, RT7: a compaction renamed the new admission log over the old one, and the
    directory sync after it (which opens the directory) found no descriptor. Tries to
    break: a want of a descriptor for an instant taken for a failed disk — the host stops
    admitting. Expected: the sync is tried again while admissions still wait; once it works
    the new file is the log, no disk failure, and appends go on; if it never does, it is a
    disk failure as any failed directory sync after a rename is (the name may not survive a
    power loss)."""
    monkeypatch.setattr(_store, "DIR_SYNC_RETRY", 0.001)  # (how long is not tested)
    root = tmp_path / "state"
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    with trio.fail_after(20):
        async with open_store(root, fs=faulty) as store:
            for i in range(1, 4):
                await store.admissions.append(_action(i))
            records = list(store.admissions.contents.records[1:3])
            directory = str(root / "admissions")
            # the first sync under it is the new file's fsync, the second the directory's
            faulty.arm(
                Fault("sync", 2, "before", errno.EMFILE, path_contains=directory, sticky=True)
                if refusals == "always"
                else Fault("sync", 2, "before", errno.EMFILE, path_contains=directory)
            )
            if refusals == "always":
                with pytest.raises(DiskFailedError):
                    await store.rewrite_shared(store.admissions, records)
                assert len(faulty.hits) == 8  # the first and seven tries
                assert store.disk_failure is not None
                return
            journal = await store.rewrite_shared(store.admissions, records)
            assert [hit.path for hit in faulty.hits] == [directory]
            assert store.disk_failure is None
            faulty.disarm()
            assert await journal.append(_action(9)) == len(records) + 2
        async with open_store(root) as store:
            kept = (await store.read(store.admissions.rel)).records[2:]
            assert list(kept) == [*records, _action(9)]
