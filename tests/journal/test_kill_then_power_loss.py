"""A process killed, restarted on the same machine, and only then a power loss (J14, J1).

A SIGKILL keeps the page cache: what the killed writer wrote and never synced is still read
by the next process, as if it were on the disk. A power loss later drops it. These tests run
the store on :class:`tests.faultfs.PowerLossFileSystem`, stop the process at a chosen
instant (:meth:`~tests.faultfs.PowerLossFileSystem.kill`: handles gone, page cache kept),
open the store again — its replay of the sync log (J14) runs on what the page cache shows —
and then ask what a power loss would leave: every acknowledged record must be on the disk,
in its file or in a sync log generation still there.
"""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest
import trio

from runtime import JournalError, open_store
from runtime._errors import DiskFailedError
from runtime._journal._journal import decode_log
from runtime._journal._sync_log import SYNC_DIR, generation_name, owed_in, with_owed
from runtime._records import Record

from ..faultfs import Fault, FaultyFileSystem, PowerLossFileSystem
from .test_sync_log import Holding, _entry_frame, _fs, _one_batch, _record


def _after_any_power_loss(fs: PowerLossFileSystem, root: Path, rel: str) -> tuple[Record, ...]:
    """The records a log would be read with after a power loss now: its file's durable bytes,
    with what the durable sync log generations hold for it (as the next open's replay would
    add them, J14)."""
    data = fs.durable_read(str(root / rel))
    assert data is not None, f"{rel} is not durable"
    generations = [
        (os.path.basename(path), content)
        for path, content in sorted(fs.durable_snapshot().items())
        if os.path.dirname(path) == str(root / SYNC_DIR)
    ]
    owed = owed_in(generations).get(rel, [])
    return decode_log(with_owed(data, owed), rel=rel).records


async def test_j14_owed_records_a_killed_writer_left_unsynced_in_their_file_survive_a_power_loss(
    tmp_path: Path,
) -> None:
    """J14, J1: two delivery logs' records are acknowledged through the sync log (J12); the
    writer writes the first log's owed records into its file and the process is killed
    before that file's sync. The next process's replay finds them in the file — the page
    cache shows them — and must still make them durable there before it removes the
    generation: else a power loss afterwards leaves acknowledged records in neither place.
    The disk is too full to allocate the log ahead (J19: its frames extend the file), so no
    zeros follow them that the replay would cut (and sync) as a torn tail anyway."""
    root = tmp_path / "state"
    fs = PowerLossFileSystem(root)
    no_room = Fault("allocate", errno=errno.ENOSPC, sticky=True, path_contains="/deliveries/")
    holding = Holding(FaultyFileSystem(fs, no_room))
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(holding)) as store:
            logs = [await store.create_delivery_log(f"d{i}") for i in range(2)]
            await _one_batch(holding, store, logs, "a")
            assert fs.unsynced() == []  # acknowledged: durable in the sync log
            fs.cut_at_sync(logs[0].rel)  # killed between the file's write and its sync
            with pytest.raises((JournalError, OSError)):
                await store.read(logs[0].rel)
            rels = [log.rel for log in logs]
        fs.kill()
        async with open_store(root, fs=fs) as store:
            assert (await store.read(rels[0])).records[1:] == (_record("a-0"),)
        for i, rel in enumerate(rels):
            assert _after_any_power_loss(fs, root, rel)[1:] == (_record(f"a-{i}"),), rel
        fs.crash(random.Random(0))
        async with open_store(root, fs=fs) as store:
            for i, rel in enumerate(rels):
                assert (await store.read(rel)).records[1:] == (_record(f"a-{i}"),)


async def test_j14_a_replay_whose_sync_failed_never_trusts_the_page_cache_at_the_next_start(
    tmp_path: Path,
) -> None:
    """J14, J5 (fsyncgate): the replay appends a log's owed record and that file's
    ``fdatasync`` fails — Linux marks the pages clean, the disk never gets them — so the
    open fails. The next start reads the file through the page cache, which still shows the
    record, and a sync of it now reports success without writing anything: the replay must
    write the records the sync log vouches for again before it syncs and removes the
    generation, never trust what the file seems to hold."""
    root = tmp_path / "state"
    fs = PowerLossFileSystem(root)
    with trio.fail_after(20):
        async with open_store(root, fs=fs) as store:
            rel = (await store.create_delivery_log("d0")).rel
        path = str(root / SYNC_DIR / generation_name(0))
        frame = _entry_frame(0, [(rel, 1, [_record("x")])])
        fs.makedirs(str(root / SYNC_DIR))
        handle = fs.open_exclusive(path)
        fs.write(handle, frame)
        fs.fsync(handle)
        fs.close(handle)
        fs.fsync_dir(str(root / SYNC_DIR))
        fs.fsync_dir(str(root))
        fs.fail_next_sync(rel)
        with pytest.raises((DiskFailedError, OSError)):
            async with open_store(root, fs=fs):
                pass
        fs.kill()
        async with open_store(root, fs=fs) as store:
            assert (await store.read(rel)).records[1:] == (_record("x"),)
        assert _after_any_power_loss(fs, root, rel)[1:] == (_record("x"),)
