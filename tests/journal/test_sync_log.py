"""The step sync log (docs/design/journal.md J12-J17): the records of several delivery logs
made durable by one frame and one ``fdatasync`` of ``sync/<generation>.log``, owed to their
files until a read, a close or a rotation writes them there, and replayed after a crash.

Each test makes the writer take one batch of several logs on purpose: the first append, to a
log of its own, is held inside its ``write`` until the other appends are queued behind it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from runtime import JournalError, ReasonCode, Store, open_store
from runtime._journal._frame import encode_frame
from runtime._journal._inspect import delivery_records, verify_journal
from runtime._journal._journal import Journal, encode_record, read_log
from runtime._journal._sync_log import SYNC_DIR, encode_entry, generation_name, read_owed, redo
from runtime._journal._writer import atomic_write, handoffs_in_flight
from runtime._linux._fs import FileSystem, OsFileSystem
from runtime._records import OutboxAction, Record
from tests.faultfs import Fault, FaultyFileSystem, OpKind, PowerLossFileSystem, When

LOGS = 4


def _record(name: str) -> Record:
    return OutboxAction(action_id=name, kind="step", state="done")


class Holding:
    """Wraps a file system; :meth:`hold` makes the next ``write`` to a path containing a
    string wait (on the writer thread) until :meth:`release`. Counts ``fdatasync`` by path."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.syncs: list[str] = []
        self._paths: dict[int, str] = {}
        self._hold: str | None = None
        self.held = threading.Event()
        self._released = threading.Event()
        self.removed = threading.Event()
        """Set when a sync log generation is removed."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open_append(self, path: str) -> int:
        handle = int(self.inner.open_append(path))
        self._paths[handle] = path
        return handle

    def open_exclusive(self, path: str) -> int:
        handle = int(self.inner.open_exclusive(path))
        self._paths[handle] = path
        return handle

    def open_write(self, path: str) -> int:
        handle = int(self.inner.open_write(path))
        self._paths[handle] = path
        return handle

    def _maybe_hold(self, handle: int) -> None:
        path = self._paths.get(handle, "")
        if self._hold is not None and self._hold in path:
            self._hold = None
            self.held.set()
            self._released.wait(10)

    def write(self, handle: int, data: bytes) -> int:
        self._maybe_hold(handle)
        return int(self.inner.write(handle, data))

    def pwrite(self, handle: int, data: bytes, offset: int) -> int:
        """Held like :meth:`write` (a delivery's log is written in place, J19)."""
        self._maybe_hold(handle)
        return int(self.inner.pwrite(handle, data, offset))

    def fdatasync(self, handle: int) -> None:
        self.syncs.append(self._paths.get(handle, "?"))
        self.inner.fdatasync(handle)

    def unlink(self, path: str) -> None:
        self.inner.unlink(path)
        if f"/{SYNC_DIR}/" in path:
            self.removed.set()

    def hold(self, part: str) -> None:
        self.held.clear()
        self._released.clear()
        self._hold = part

    def release(self) -> None:
        self._released.set()


def _fs(fs: Holding) -> FileSystem:
    return cast(FileSystem, fs)


async def _one_batch(fs: Holding, store: Store, logs: list[Journal], tag: str) -> list[int]:
    """Append one record to each of ``logs`` so that the writer takes them as one batch:
    behind an append to a log of its own (``hold-<tag>``) held in its ``write``."""
    holder = await store.create_delivery_log(f"hold-{tag}")
    fs.hold(holder.rel)
    seqs: list[int] = [0] * len(logs)

    async def append(i: int) -> None:
        seqs[i] = await logs[i].append(_record(f"{tag}-{i}"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder.append, _record(f"{tag}-hold"))
        await trio.to_thread.run_sync(fs.held.wait, 10)
        for i in range(len(logs)):
            nursery.start_soon(append, i)
        await trio.testing.wait_all_tasks_blocked()
        fs.syncs.clear()
        fs.release()
    return seqs


async def _refused_as_poisoned(store: Store, delivery_id: str) -> None:
    """The delivery's log is refused for appending: ``journal_poisoned``."""
    with pytest.raises(JournalError) as refused:
        await store.open_delivery_log(delivery_id)
    assert refused.value.code is ReasonCode.JOURNAL_POISONED


def _file_records(root: Path, rel: str) -> int:
    return read_log(OsFileSystem(), str(root), rel).next_seq


async def test_j12_a_batch_of_several_logs_is_one_sync_and_its_records_owed_to_the_files(
    tmp_path: Path,
) -> None:
    """J12: the batch costs one ``fdatasync`` (the sync log's) for every log in it; each
    file lacks its new record until it is read (then it holds it), and a clean close leaves
    every record in its file and nothing in ``sync/``."""
    root = tmp_path / "state"
    fs = Holding(OsFileSystem())
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            logs = [await store.create_delivery_log(f"d{i}") for i in range(LOGS)]
            assert await _one_batch(fs, store, logs, "a") == [1] * LOGS
            synced = [path for path in fs.syncs if "/deliveries/" in path]
            assert len(synced) == 1, fs.syncs  # the held log's own, not one per log
            assert [p for p in fs.syncs if f"/{SYNC_DIR}/" in p] == [
                str(root / SYNC_DIR / generation_name(0))
            ]
            for log in logs[1:]:
                assert _file_records(root, log.rel) == 1  # the header only: owed
            contents = await store.read(logs[0].rel)  # a read writes what is owed first
            assert contents.records[1] == _record("a-0")
            assert _file_records(root, logs[0].rel) == 2
        assert not os.listdir(root / SYNC_DIR)
        for i, log in enumerate(logs):
            assert read_log(OsFileSystem(), str(root), log.rel).records[1] == _record(f"a-{i}")


async def test_j14_after_a_power_loss_the_open_writes_the_owed_records_to_their_files(
    tmp_path: Path,
) -> None:
    """J14, J1, J2: records acknowledged through the sync log survive a power loss that
    takes every unsynced byte of their files: the next open appends them, syncs the files
    and removes the generation; a second power loss right after loses nothing."""
    root = tmp_path / "state"
    power = PowerLossFileSystem(root)
    fs = Holding(power)
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            logs = [await store.create_delivery_log(f"d{i}") for i in range(LOGS)]
            await _one_batch(fs, store, logs, "a")
            rels = [log.rel for log in logs]
            power.cut_after(0)  # the power goes: the store's exit writes nothing more
        power.crash(random.Random(2))
        async with open_store(root, fs=_fs(fs)) as store:
            assert store.redone.records == LOGS
            assert sorted(store.redone.logs) == sorted(rels)
            assert not power.listdir(str(root / SYNC_DIR))
        power.crash(random.Random(3))
        async with open_store(root, fs=_fs(fs)) as store:
            assert store.redone.generations == 0
            for i, rel in enumerate(rels):
                assert (await store.read(rel)).records[1:] == (_record(f"a-{i}"),)


@pytest.mark.parametrize(
    ("kind", "when", "nth"),
    [
        ("write", "before", 1),  # the new generation's zero fill
        ("sync", "before", 1),  # its sync
        ("write", "before", 2),  # the frame
        ("write", "after", 2),
        ("write", "short", 2),
        ("sync", "before", 2),  # the frame's fdatasync
        ("sync", "after", 2),
    ],
)
async def test_j15_a_failed_sync_log_append_poisons_no_log(
    tmp_path: Path, kind: OpKind, when: When, nth: int
) -> None:
    """J15, J6: when the sync log's write or sync fails — beginning a generation or
    appending a frame — every log of the batch takes its own path (its records written to
    its file and synced): each append is acknowledged, no log is poisoned, the disk failure
    is reported (EIO), and the logs read whole after a restart."""
    root = tmp_path / "state"
    faulty = FaultyFileSystem(
        OsFileSystem(),
        Fault(kind, nth, when, path_contains=f"/{SYNC_DIR}/"),
        armed=False,
    )
    fs = Holding(faulty)
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            store._pool._rotate_bytes = 1000  # a generation's zero fill is one write
            logs = [await store.create_delivery_log(f"d{i}") for i in range(LOGS)]
            faulty.arm()
            assert await _one_batch(fs, store, logs, "a") == [1] * LOGS
            assert len(faulty.hits) == 1, faulty.hits
            assert store.disk_failure is not None
            assert store.disk_failure.code is ReasonCode.DISK_FAILED
            assert not any(log.poisoned for log in logs)
            faulty.disarm()
            for i, log in enumerate(logs):  # they go on appending
                assert await log.append(_record(f"b-{i}")) == 2
        assert not list((root / "deliveries").glob("*.poison"))
        async with open_store(root) as store:
            for i, log in enumerate(logs):
                records = (await store.read(log.rel)).records[1:]
                assert records == (_record(f"a-{i}"), _record(f"b-{i}"))


@contextlib.asynccontextmanager
async def one_owed_record_each(
    root: Path,
) -> AsyncIterator[tuple[FaultyFileSystem, Store, list[Journal]]]:
    """A store whose :data:`LOGS` delivery logs each owe their file one record (``a-<i>``),
    durable in the sync log; the file system's faults not armed yet."""
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    fs = Holding(faulty)
    async with open_store(root, fs=_fs(fs)) as store:
        logs = [await store.create_delivery_log(f"d{i}") for i in range(LOGS)]
        await _one_batch(fs, store, logs, "a")
        yield faulty, store, logs


def _disk_full_for(log: Journal) -> list[Fault]:
    """The disk is full for ``log``'s next write and for its poison document's."""
    return [
        Fault("write", 1, "before", errno.ENOSPC, path_contains=log.rel),
        Fault("write", 1, "before", errno.ENOSPC, path_contains=".poison"),
    ]


async def test_j15_a_log_whose_file_fails_when_its_owed_records_are_written_alone_is_poisoned(
    tmp_path: Path,
) -> None:
    """J15, J5: writing a log's owed records to its file fails: that log alone is poisoned
    (its later appends refused, a poison document written), every other log of the same
    sync log batch reads whole, now and after a restart."""
    root = tmp_path / "state"
    with trio.fail_after(20):
        async with one_owed_record_each(root) as (faulty, store, logs):
            faulty.arm(Fault("write", 1, "before", errno.EIO, path_contains=logs[0].rel))
            await store.read(logs[0].rel)  # its owed record's write fails
            assert logs[0].poisoned
            with pytest.raises(JournalError) as refused:
                await logs[0].append(_record("after"))
            assert refused.value.code is ReasonCode.JOURNAL_POISONED
            for i, log in enumerate(logs[1:], start=1):
                assert (await store.read(log.rel)).records[1:] == (_record(f"a-{i}"),)
        assert (root / (logs[0].rel + ".poison")).exists()
        async with open_store(root) as store:
            for i, log in enumerate(logs[1:], start=1):
                assert (await store.read(log.rel)).records[1:] == (_record(f"a-{i}"),)
            await _refused_as_poisoned(store, "d0")


async def test_j5_j15_a_poisoned_log_still_reads_what_the_sync_log_acknowledged_for_it(
    tmp_path: Path,
) -> None:
    """J5, J15: a log is poisoned when its owed records cannot be written to its file. Those
    records were acknowledged (durable in the sync log), so the log still reads them back —
    the poison document carries them — now, after the generation is gone, and after a
    restart; ``journal show`` finds them too. A record acknowledged is never lost from a
    read, poisoned or not (an operator would otherwise not see that a tool's intent was
    recorded)."""
    root = tmp_path / "state"
    with trio.fail_after(20):
        async with one_owed_record_each(root) as (faulty, store, logs):
            faulty.arm(Fault("write", 1, "before", errno.EIO, path_contains=logs[0].rel))
            with contextlib.suppress(JournalError):
                await store.read(logs[0].rel)  # its owed record's write fails
            assert logs[0].poisoned
            faulty.disarm()
            assert (await store.read(logs[0].rel)).records[1:] == (_record("a-0"),)
        assert not os.listdir(root / SYNC_DIR)
        records, _note = await trio.to_thread.run_sync(delivery_records, root, "d0")
        assert _record("a-0") in records
        async with open_store(root) as store:
            assert (await store.read(logs[0].rel)).records[1:] == (_record("a-0"),)
            await _refused_as_poisoned(store, "d0")


async def test_j15_a_poison_that_cannot_be_recorded_keeps_the_sync_log_for_the_next_start(
    tmp_path: Path,
) -> None:
    """J15, J5, J14 on a full disk: writing a log's owed records to its file fails, and so
    does writing its poison document. Its acknowledged records are then only in the sync
    log: that generation is kept, never removed, so the next start's redo writes them into
    the file — not a log that opens healthy with acknowledged records gone (a tool whose
    intent and outcome were acknowledged would run again)."""
    root = tmp_path / "state"
    with trio.fail_after(20):
        async with one_owed_record_each(root) as (faulty, store, logs):
            faulty.arm(_disk_full_for(logs[0]))
            await store.read(logs[0].rel)  # its owed record's write fails, then its poison's
            assert logs[0].poisoned
            assert len(faulty.hits) == 2, faulty.hits
            faulty.disarm()
        assert not (root / (logs[0].rel + ".poison")).exists()
        async with open_store(root) as store:  # the space is back
            for i, log in enumerate(logs):
                assert (await store.read(log.rel)).records[1:] == (_record(f"a-{i}"),)


async def test_j5_j12_a_log_poisoned_by_a_catch_up_in_its_own_batch_is_not_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """J5, J12: a batch that does not fit its generation switches to the next one, and that
    switch catches up a full generation: it writes the owed records of a log that is in the
    batch itself, its file fails (EIO) and the log is poisoned. That log's record in the
    batch is then refused (``journal_poisoned``), never acknowledged — it would be durable
    only in a sync log the poisoned log's reads do not consult, and an append acknowledged
    to a poisoned log breaks J5. The batch's other logs are acknowledged and read whole."""
    import runtime._journal._writer as writer

    monkeypatch.setattr(writer, "_SLACK", 0)  # a generation holds exactly its size
    monkeypatch.setattr(writer, "_RETIRING", 0)  # a switch catches up at once
    root = tmp_path / "state"
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    fs = Holding(faulty)
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            store._pool._trickle = lambda sync: False  # type: ignore[method-assign]
            logs = [await store.create_delivery_log(f"d{i}") for i in range(LOGS)]
            one = len(
                encode_frame(
                    0,
                    [
                        encode_entry(log.rel, 1, [encode_record(_record(f"a-{i}"))])
                        for i, log in enumerate(logs)
                    ],
                )
            )
            store._pool._rotate_bytes = one + one // 2  # one batch fits, two do not
            await _one_batch(fs, store, logs, "a")
            faulty.arm(Fault("write", 1, "before", errno.EIO, path_contains=logs[0].rel))
            outcomes: dict[int, object] = {}

            async def append(i: int) -> None:
                try:
                    outcomes[i] = await logs[i].append(_record(f"b-{i}"))
                except JournalError as error:
                    outcomes[i] = error.code

            holder = await store.create_delivery_log("hold-b")
            fs.hold(holder.rel)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(holder.append, _record("b-hold"))
                await trio.to_thread.run_sync(fs.held.wait, 10)
                for i in range(LOGS):
                    nursery.start_soon(append, i)
                await trio.testing.wait_all_tasks_blocked()
                fs.release()
            assert [hit.path for hit in faulty.hits] == [str(root / logs[0].rel)]
            assert logs[0].poisoned
            assert outcomes == {0: ReasonCode.JOURNAL_POISONED, 1: 2, 2: 2, 3: 2}
            faulty.disarm()
            assert (await store.read(logs[0].rel)).records[1:] == (_record("a-0"),)
            for i, log in enumerate(logs[1:], start=1):
                assert (await store.read(log.rel)).records[1:] == (
                    _record(f"a-{i}"),
                    _record(f"b-{i}"),
                )


async def test_j15_a_log_whose_poison_cannot_be_recorded_stays_refused_and_whole_this_run(
    tmp_path: Path,
) -> None:
    """J15, J5 on a full disk, within the same run: a log's owed record cannot be written
    to its file, nor its poison document. The store still knows the log is poisoned, with
    nothing on disk to say so: a read finds the acknowledged record and the poison, and
    after the log is closed it is refused for appending — reopened as healthy it would
    number a new record as the lost one, and the next start's redo would then keep the new
    one in its place (a tool whose intent was acknowledged could run again)."""
    root = tmp_path / "state"
    with trio.fail_after(20):
        async with one_owed_record_each(root) as (faulty, store, logs):
            faulty.arm(_disk_full_for(logs[0]))
            with contextlib.suppress(JournalError):
                await store.read(logs[0].rel)  # its owed record's write fails, then its poison's
            assert len(faulty.hits) == 2, faulty.hits
            faulty.disarm()
            contents = await store.read(logs[0].rel)
            assert contents.records[1:] == (_record("a-0"),)
            assert contents.poison is not None
            await store.close_log(logs[0])
            await _refused_as_poisoned(store, "d0")
            assert (await store.read(logs[0].rel)).records[1:] == (_record("a-0"),)
        async with open_store(root) as store:  # the space is back: the redo wrote it
            assert (await store.read(logs[0].rel)).records[1:] == (_record("a-0"),)


async def test_j12_a_full_generation_is_written_into_the_files_then_removed(
    tmp_path: Path,
) -> None:
    """J12: once a generation passes its size, the batch is acknowledged and the next batch
    starts the next generation; the full one's owed records are written to their files and
    synced, a log at a time, and then it is removed."""
    root = tmp_path / "state"
    fs = Holding(OsFileSystem())
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            store._pool._rotate_bytes = 1  # every batch fills its generation
            logs = [await store.create_delivery_log(f"d{i}") for i in range(LOGS)]
            fs.removed.clear()
            await _one_batch(fs, store, logs, "a")
            await trio.to_thread.run_sync(fs.removed.wait, 10)
            assert os.listdir(root / SYNC_DIR) == []
            for i, log in enumerate(logs):
                assert read_log(OsFileSystem(), str(root), log.rel).records[1] == _record(f"a-{i}")
            await _one_batch(fs, store, logs, "b")
            assert str(root / SYNC_DIR / generation_name(1)) in fs.syncs


async def test_j12_full_generations_waiting_are_bounded(tmp_path: Path) -> None:
    """J12: when the logs' records do not trickle out as fast as generations fill, a switch
    past two full generations writes the oldest one's logs at once and removes it: the sync
    log stays bounded, and every record is still read back."""
    root = tmp_path / "state"
    fs = Holding(OsFileSystem())
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            store._pool._rotate_bytes = 1
            store._pool._trickle = lambda sync: False  # type: ignore[method-assign]
            logs = [await store.create_delivery_log(f"d{i}") for i in range(LOGS)]
            for tag in "abcdef":
                await _one_batch(fs, store, logs, tag)
                assert len(os.listdir(root / SYNC_DIR)) <= 2
            assert _file_records(root, logs[0].rel) >= 4  # the oldest were written at once
            for i, log in enumerate(logs):
                records = (await store.read(log.rel)).records[1:]
                assert records == tuple(_record(f"{tag}-{i}") for tag in "abcdef")


def _state_with_logs(root: Path, names: list[str]) -> list[str]:
    """A closed state directory whose delivery logs ``names`` hold their header only."""

    async def make() -> list[str]:
        async with open_store(root) as store:
            return [(await store.create_delivery_log(name)).rel for name in names]

    return trio.run(make)


def _generation(root: Path, frames: list[bytes], number: int = 0) -> None:
    (root / SYNC_DIR / generation_name(number)).write_bytes(b"".join(frames))


def _entry_frame(seq: int, entries: list[tuple[str, int, list[Record]]]) -> bytes:
    return encode_frame(
        seq,
        [
            encode_entry(rel, first, [encode_record(r) for r in records])
            for rel, first, records in entries
        ],
    )


def test_j14_a_torn_final_frame_of_the_sync_log_is_forgiven(tmp_path: Path) -> None:
    """J14, J3: the sync log's torn final frame held nothing acknowledged: the open applies
    the frames before it and drops it."""
    root = tmp_path / "state"
    rel0, rel1 = _state_with_logs(root, ["d0", "d1"])
    good = _entry_frame(0, [(rel0, 1, [_record("x")])])
    torn = _entry_frame(1, [(rel1, 1, [_record("y")])])
    _generation(root, [good, torn[: len(torn) // 2]])

    async def check() -> None:
        async with open_store(root) as store:
            assert store.redone.records == 1
            assert (await store.read(rel0)).records[1:] == (_record("x"),)
            assert (await store.read(rel1)).next_seq == 1

    trio.run(check)


def test_j14_damage_in_the_sync_log_stops_the_open(tmp_path: Path) -> None:
    """J14, J4: a damaged frame followed by a good one: what the sync log acknowledged
    cannot be known, so nothing starts; the error names the generation and the offset."""
    root = tmp_path / "state"
    rel0, rel1 = _state_with_logs(root, ["d0", "d1"])
    first = bytearray(_entry_frame(0, [(rel0, 1, [_record("x")])]))
    first[-3] ^= 0x01
    _generation(root, [bytes(first), _entry_frame(1, [(rel1, 1, [_record("y")])])])

    async def check() -> None:
        async with open_store(root):
            pass

    with pytest.raises(JournalError) as refused:
        trio.run(check)
    assert refused.value.code is ReasonCode.JOURNAL_CORRUPT
    assert refused.value.path == f"{SYNC_DIR}/{generation_name(0)}"
    assert refused.value.offset == 0


def test_j16_a_gap_below_the_sync_logs_records_poisons_that_log_alone(tmp_path: Path) -> None:
    """J16: the sync log holds a log's records from seq 2 on, its file ends at 1: the records
    between are lost, so the log is poisoned (never replayed, never read short as whole); the
    other log's entry is applied; a log whose file is gone is left gone (J13)."""
    root = tmp_path / "state"
    rel0, rel1 = _state_with_logs(root, ["d0", "d1"])
    gone = Store.delivery_rel("gone")
    _generation(
        root,
        [
            _entry_frame(
                0,
                [
                    (rel0, 2, [_record("late")]),
                    (rel1, 1, [_record("y")]),
                    (gone, 1, [_record("z")]),
                ],
            )
        ],
    )

    async def check() -> None:
        async with open_store(root) as store:
            assert store.redone.poisoned == (rel0,)
            assert store.redone.logs == (rel1,)
            assert (await store.read(rel1)).records[1:] == (_record("y"),)
            await _refused_as_poisoned(store, "d0")
            assert not await store.exists(gone)

    trio.run(check)


def test_j16_records_the_redo_appended_before_a_gap_are_synced_before_the_poison(
    tmp_path: Path,
) -> None:
    """J16, J14: the sync log holds a log's record 1 (which continues its file) and record 3
    (after a gap). The redo appends record 1 and poisons the log at the gap; the poison
    document's good length counts record 1, so record 1 must be durable in the file before
    that document is written and the generation removed — else a power loss would leave
    an acknowledged record in neither the file nor the sync log."""
    root = tmp_path / "state"
    (rel0,) = _state_with_logs(root, ["d0"])
    path0 = str(root / rel0)
    _generation(
        root,
        [
            _entry_frame(0, [(rel0, 1, [_record("one")])]),
            _entry_frame(1, [(rel0, 3, [_record("three")])]),
        ],
    )
    events: list[tuple[str, str]] = []

    class Recording(OsFileSystem):
        def __init__(self) -> None:
            self.paths: dict[int, str] = {}

        def open_append(self, path: str) -> int:
            handle = super().open_append(path)
            self.paths[handle] = path
            return handle

        def fdatasync(self, handle: int) -> None:
            events.append(("sync", self.paths.get(handle, "?")))
            super().fdatasync(handle)

        def unlink(self, path: str) -> None:
            events.append(("unlink", path))
            super().unlink(path)

    fs = Recording()

    def write_document(path: str, data: bytes) -> None:
        events.append(("poison", path))
        atomic_write(OsFileSystem(), path, data)

    done = redo(fs, str(root), now_ms=1, write_document=write_document)
    assert done.poisoned == (rel0,)
    assert events.index(("sync", path0)) < events.index(("poison", path0 + ".poison"))
    assert events.index(("sync", path0)) < min(i for i, e in enumerate(events) if e[0] == "unlink")
    assert read_log(OsFileSystem(), str(root), rel0).records[1:] == (_record("one"),)


def test_j14_entries_a_file_already_holds_are_not_written_again(tmp_path: Path) -> None:
    """J14: redo is idempotent: an entry whose records the file holds (a crash after they
    were written, before the generation was removed) changes nothing; one that overlaps the
    file's end adds only what it lacks."""
    root = tmp_path / "state"
    (rel0,) = _state_with_logs(root, ["d0"])
    _generation(root, [_entry_frame(0, [(rel0, 1, [_record("x")])])], number=0)
    _generation(root, [_entry_frame(0, [(rel0, 1, [_record("x"), _record("y")])])], number=1)

    async def check() -> None:
        async with open_store(root) as store:
            assert store.redone.records == 2
            assert (await store.read(rel0)).records[1:] == (_record("x"), _record("y"))

    trio.run(check)


async def test_j17_a_read_only_view_finds_the_owed_records(tmp_path: Path) -> None:
    """J17: while the server runs (its records owed to their files), ``journal verify`` and
    ``journal show`` read the sync log first and find every acknowledged record."""
    root = tmp_path / "state"
    fs = Holding(OsFileSystem())
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            logs = [await store.create_delivery_log(f"d{i}") for i in range(LOGS)]
            await _one_batch(fs, store, logs, "a")
            assert _file_records(root, logs[1].rel) == 1
            owed = read_owed(OsFileSystem(), str(root))
            assert sorted(owed) == sorted(log.rel for log in logs)
            _logs, findings = await trio.to_thread.run_sync(verify_journal, root)
            assert not [f for f in findings if f.problem], findings
            assert any(f.rel == SYNC_DIR and not f.problem for f in findings)
            records, _note = await trio.to_thread.run_sync(delivery_records, root, "d1")
            assert _record("a-1") in records


async def test_j15_a_new_log_whose_file_cannot_be_made_durable_fails_alone(
    tmp_path: Path,
) -> None:
    """J15, J13: three logs are created in one sync log batch and the directory sync that
    makes the first one's file durable fails: that creation fails (disk_failed), the other
    two are acknowledged through the sync log and hold their headers after a restart."""
    root = tmp_path / "state"
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    fs = Holding(faulty)
    names = ["n0", "n1", "n2"]
    outcomes: dict[str, str] = {}
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            holder = await store.create_delivery_log("hold")
            # sync #1: the held record's fdatasync; #2: the first new file's directory sync
            faulty.arm(Fault("sync", 2, "before", errno.EIO, path_contains="/deliveries"))
            fs.hold(holder.rel)

            async def create(name: str) -> None:
                try:
                    await store.create_delivery_log(name)
                    outcomes[name] = "created"
                except JournalError as error:
                    outcomes[name] = str(error.code)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(holder.append, _record("held"))
                await trio.to_thread.run_sync(fs.held.wait, 10)
                for name in names:
                    nursery.start_soon(create, name)
                # each creation first looks for its file in a thread: wait until all three
                # headers are handed over behind the held append, so they are one batch
                while handoffs_in_flight() < 1 + len(names):
                    await trio.testing.wait_all_tasks_blocked(cushion=0.005)
                fs.release()
            assert len(faulty.hits) == 1, faulty.hits
            assert sorted(outcomes.values()) == ["created", "created", "disk_failed"], outcomes
            assert any(f"/{SYNC_DIR}/" in path for path in fs.syncs)
        async with open_store(root) as store:
            for name in names:
                rel = Store.delivery_rel(name)
                if outcomes[name] == "created":
                    assert (await store.read(rel)).header.subject == name


def test_j17_journal_verify_names_a_damaged_generation(tmp_path: Path) -> None:
    """J17, J14: ``journal verify`` fails on a damaged sync log generation, naming it."""
    root = tmp_path / "state"
    rel0, rel1 = _state_with_logs(root, ["d0", "d1"])
    first = bytearray(_entry_frame(0, [(rel0, 1, [_record("x")])]))
    first[-3] ^= 0x01
    _generation(root, [bytes(first), _entry_frame(1, [(rel1, 1, [_record("y")])])])
    _logs, findings = verify_journal(root)
    problems = [f for f in findings if f.problem]
    assert [(f.rel, f.code) for f in problems] == [
        (f"{SYNC_DIR}/{generation_name(0)}", str(ReasonCode.JOURNAL_CORRUPT))
    ]


async def test_j15_j6_a_disk_failure_while_rotating_is_reported(tmp_path: Path) -> None:
    """J15, J6: after a batch that fills its generation, each owed record is written to its
    file; the write of one fails (EIO): that log alone is poisoned and the store reports the
    disk failure, so the host stops admitting."""
    root = tmp_path / "state"
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    fs = Holding(faulty)
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            store._pool._rotate_bytes = 1  # every batch rotates
            logs = [await store.create_delivery_log(f"d{i}") for i in range(LOGS)]
            faulty.arm(Fault("write", 1, "before", errno.EIO, path_contains=logs[0].rel))
            fs.removed.clear()
            assert await _one_batch(fs, store, logs, "a") == [1] * LOGS
            await trio.to_thread.run_sync(fs.removed.wait, 10)  # (its report came before)
            assert len(faulty.hits) == 1, faulty.hits
            assert logs[0].poisoned
            assert not any(log.poisoned for log in logs[1:])
            assert store.disk_failure is not None
            assert store.disk_failure.code is ReasonCode.DISK_FAILED
            assert store.disk_failure.path == logs[0].rel


@pytest.mark.parametrize("full", [False, True], ids=["current", "full"])
async def test_j18_a_log_removed_and_made_again_never_gains_its_old_records(
    tmp_path: Path, full: bool
) -> None:
    """J18: retention removes a delivery's log while a sync log generation still holds
    that log's old entries — the one being appended, or a full one whose other logs still
    owe their files records — and the same delivery id later makes a log of the same name
    (a re-admission after its id was forgotten). After a crash, the new file gains nothing
    of the old one's: its records are its own."""
    root = tmp_path / "state"
    power = PowerLossFileSystem(root)
    fs = Holding(power)
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            if full:  # every batch fills its generation, and no log's records trickle out
                store._pool._rotate_bytes = 1
                store._pool._trickle = lambda sync: False  # type: ignore[method-assign]
            logs = [await store.create_delivery_log(f"d{i}") for i in range(LOGS)]
            await _one_batch(fs, store, logs, "old")
            rel = logs[0].rel
            await store.close_log(logs[0])  # its owed record written to its file
            assert await store.remove_logs([rel]) == 1
            again = await store.create_delivery_log("d0")
            assert again.rel == rel
            power.cut_after(0)  # the power goes: the store's exit writes nothing more
        power.crash(random.Random(5))
        async with open_store(root, fs=_fs(fs)) as store:
            assert rel not in store.redone.logs
            assert (await store.read(rel)).records[1:] == ()
            assert not power.listdir(str(root / SYNC_DIR))


class FailingUnlink(Holding):
    """Removing a sync log generation fails with EIO while :attr:`failing`."""

    failing = False

    def unlink(self, path: str) -> None:
        if self.failing and f"/{SYNC_DIR}/" in path:
            raise OSError(errno.EIO, "injected: the unlink failed")
        self.inner.unlink(path)


class DirSyncOutOfDescriptors(Holding):
    """The sync log's directory sync fails for want of a file descriptor while
    :attr:`failing` (a directory's sync opens it: ``EMFILE``)."""

    failing = False

    def fsync_dir(self, path: str) -> None:
        if self.failing and path.rstrip("/").endswith(SYNC_DIR):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), path)
        self.inner.fsync_dir(path)


@pytest.mark.parametrize("fault", ["unlink_eio", "dir_sync_emfile"])
async def test_j18_a_log_is_not_removed_while_a_generation_holding_it_stays(
    tmp_path: Path, fault: str
) -> None:
    """J18: when the generation holding a log's records cannot be removed, the log's
    removal is refused (the file left in place); once the generation can be removed, the
    next removal removes both. The removal's unlink failing (``EIO``) is a disk failure,
    reported (J6: the host stops admitting); its directory's sync wanting a file descriptor
    (``EMFILE``, L21) is not — tries to break: that reported as a disk failure too — it is
    refused ``too_many_open_files`` and nothing is reported."""
    root = tmp_path / "state"
    inner = OsFileSystem()
    fs = FailingUnlink(inner) if fault == "unlink_eio" else DirSyncOutOfDescriptors(inner)
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            logs = [await store.create_delivery_log(f"d{i}") for i in range(LOGS)]
            await _one_batch(fs, store, logs, "old")
            rel = logs[0].rel
            await store.close_log(logs[0])
            fs.failing = True
            with pytest.raises(JournalError) as refused:
                await store.remove_logs([rel])
            assert refused.value.path == f"{SYNC_DIR}/{generation_name(0)}"
            if fault == "unlink_eio":
                assert refused.value.code is ReasonCode.DISK_FAILED
                assert store.disk_failure is not None  # reported: the host stops admitting
            else:
                assert refused.value.code is ReasonCode.TOO_MANY_OPEN_FILES, refused.value
                assert store.disk_failure is None  # J6: a want of descriptors is not the disk's
            assert (root / rel).exists()
            assert (root / SYNC_DIR / generation_name(0)).exists() is (fault == "unlink_eio")
            fs.failing = False
            assert await store.remove_logs([rel]) == 1
            assert not (root / rel).exists()
            assert not (root / SYNC_DIR / generation_name(0)).exists()
            for i, log in enumerate(logs[1:], 1):  # the others' records reached their files
                assert _file_records(root, log.rel) == 2
                assert (await store.read(log.rel)).records[1:] == (_record(f"old-{i}"),)


async def test_j12_the_bound_on_full_generations_counts_those_that_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """J12: a full generation whose logs got their records but whose removal failed stays
    at the head of the full ones, owing nothing. The bound on full generations waiting
    counts the ones logs still wait for: a switch past it writes the oldest of those into
    their files — not the stuck one again, which would leave the sync log unbounded."""
    import runtime._journal._writer as writer

    monkeypatch.setattr(writer, "_RETIRING", 1)
    root = tmp_path / "state"
    fs = FailingUnlink(OsFileSystem())
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            store._pool._rotate_bytes = 1  # every batch fills its generation
            store._pool._trickle = lambda sync: False  # type: ignore[method-assign]
            logs = [await store.create_delivery_log(f"d{i}") for i in range(LOGS)]
            fs.failing = True
            await _one_batch(fs, store, logs, "a")
            for log in logs:
                await log.flush()  # their records in their files: the generation stays
            assert _file_records(root, logs[1].rel) == 2
            await _one_batch(fs, store, logs, "b")
            assert _file_records(root, logs[1].rel) == 2  # one generation waits: within
            await _one_batch(fs, store, logs, "c")
            # two wait: the older one's logs get what they owe (its records and later ones)
            assert _file_records(root, logs[1].rel) == 4
            fs.failing = False
