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

from runtime import Journal, JournalError, ReasonCode, Store, open_store
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


# -- J23: the next start makes what the killed process left durable before it reads it -------


async def _log_of(store: Store, which: str) -> Journal:
    if which == "admissions":
        return store.admissions
    if which == "lane":
        return await store.open_lane_log("dm:1")
    return await store.create_delivery_log("d0")


@pytest.mark.parametrize("which", ["admissions", "lane", "delivery"])
async def test_j23_a_record_a_killed_writer_never_synced_survives_a_power_loss_once_read(
    tmp_path: Path, which: str
) -> None:
    """J23, J2: a process writes a record to a log — the shared admissions log, a lane's
    log, a delivery's own log — and is killed before that file's sync: never acknowledged.
    A SIGKILL keeps the page cache, so the next process reads the record as if it were on the
    disk and acts on it (an admission answered, a tool intent read as "the tool may have
    run"). A power loss afterwards must not take it back: the start would then have acted on
    a record that the one after it never sees (the tool run again, nobody told). So the
    start makes everything in the state directory durable before it reads any of it."""
    root = tmp_path / "state"
    fs = PowerLossFileSystem(root)
    with trio.fail_after(20):
        async with open_store(root, fs=fs) as store:
            journal = await _log_of(store, which)
            await journal.append(_record("synced"))
            rel = journal.rel
            fs.cut_at_sync(rel)  # killed between the record's write and its sync
            with pytest.raises((JournalError, OSError)):
                await journal.append(_record("written"))
        fs.kill()
        async with open_store(root, fs=fs) as store:
            read = (await store.read(rel)).records[1:]
        assert read == (_record("synced"), _record("written")), "the page cache shows it"
        assert _after_any_power_loss(fs, root, rel)[1:] == read
        fs.crash(random.Random(0))
        async with open_store(root, fs=fs) as store:
            assert (await store.read(rel)).records[1:] == read


async def test_j23_a_log_a_killed_writer_created_stays_created_once_a_start_read_it(
    tmp_path: Path,
) -> None:
    """J23, J13: a process creates a lane's log — its directory, its file, its header —
    and is killed at the header's sync, before any directory entry of it was synced. The
    next start finds the lane and reads its header; a power loss afterwards must not leave
    a state directory without it (the directory entries are made durable too)."""
    root = tmp_path / "state"
    fs = PowerLossFileSystem(root)
    with trio.fail_after(20):
        async with open_store(root, fs=fs) as store:
            rel = store.lane_rel("dm:1")
            fs.cut_at_sync(rel)
            with pytest.raises((JournalError, OSError)):
                await store.open_lane_log("dm:1")
        fs.kill()
        async with open_store(root, fs=fs) as store:
            assert await store.lane_logs() == [rel]
            header = (await store.read(rel)).records
        assert len(header) == 1
        assert fs.durable_read(str(root / rel)) is not None, "a power loss would remove it"
        assert _after_any_power_loss(fs, root, rel) == header


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errno.EIO, ReasonCode.DISK_FAILED),
        (errno.ENOSPC, ReasonCode.DISK_FULL),
        (errno.EBADF, ReasonCode.DISK_FAILED),
    ],
    ids=["EIO", "ENOSPC", "EBADF"],
)
async def test_j23_j6_a_start_whose_sync_fails_is_refused_as_a_disk_failure(
    tmp_path: Path, error: int, code: ReasonCode
) -> None:
    """J23, J6: the sync that makes the state directory durable at the start fails (a
    writeback error of what the killed process left, a dying disk). What the start would
    read may be what no disk holds: it is refused with the disk failure's code, whatever
    the errno, before it reads, writes or creates anything (not even its owner record)."""
    root = tmp_path / "state"
    power = PowerLossFileSystem(root)
    with trio.fail_after(20):
        async with open_store(root, fs=power) as store:
            await store.admissions.append(_record("a"))
        ops = power.ops
        faulty = FaultyFileSystem(power, Fault("sync_tree", errno=error))
        with pytest.raises(DiskFailedError) as info:
            async with open_store(root, fs=faulty):
                pass
        assert info.value.code is code
        assert [hit.op for hit in faulty.hits] == ["sync_tree"]
        assert power.ops == ops, "the start went on after its sync failed"
        async with open_store(root, fs=power) as store:  # the disk is back: it starts
            assert store.admissions.contents.records[1:] == (_record("a"),)
