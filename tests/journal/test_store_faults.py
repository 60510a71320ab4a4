"""The journal store's conformance suite, and what it does when the disk fails.

Part one runs the same behaviour checks against every file-system backend the
store can sit on (the real one, and the in-memory power-loss model restarted
through a crash between sessions). Part two injects faults with
:class:`tests.faultfs.FaultyFileSystem` over the real file system: the N-th
write / sync / rename / truncate fails before, after or short, during a
concurrent workload, and the store must poison exactly the log it hit, report
the disk, and reopen to exactly the acknowledged records. Part two runs the store with
every log syncing its own file (``sync_log=False``): a fault aimed at one log's file must hit
that file. What the sync log does with a fault (J15) is ``test_sync_log.py``'s. Part three
damages real log files byte by byte: only a torn final frame is forgiven.
"""

from __future__ import annotations

import contextlib
import errno
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

from runtime import DiskFailedError, Journal, JournalError, ReasonCode, Store, open_store
from runtime._journal._frame import HEADER_SIZE, encode_frame, scan
from runtime._journal._journal import decode_log, encode_record, read_log
from runtime._journal._store import ADMISSIONS, RESULTS
from runtime._linux._fs import FileSystem, OsFileSystem
from runtime._records import (
    SCHEMA_VERSION,
    Admission,
    Fingerprints,
    Header,
    LogKind,
    OutboxAction,
    Poison,
    Record,
)

from ..faultfs import Fault, FaultyFileSystem, OpKind, PowerLossFileSystem, When

LANE = "guild:1:2"
DELIVERIES = ("d0", "d1")
DOC = "lanes/state.json"


def _action(log: str, n: int) -> OutboxAction:
    return OutboxAction(
        action_id=f"{log}:{n}", kind="test", state="done", detail={"n": n, "pad": "x" * (n % 5)}
    )


def _admission(producer: int, n: int) -> Admission:
    return Admission(
        delivery_id=f"p{producer}-{n}",
        lane=LANE,
        request={"text": f"message {n} from {producer}"},
        fingerprints=Fingerprints(request="r", authority="a", settings="s"),
        rendered_prompt=f"prompt {producer}/{n}",
        admitted_ms=1_000 + n,
    )


def _header(kind: LogKind, subject: str, version: int = SCHEMA_VERSION) -> Header:
    return Header(schema_version=version, kind=kind, subject=subject, created_ms=1)


# -- backends -----------------------------------------------------------------------------


@dataclass
class Backend:
    """A file system the store runs on, with raw byte access for damage."""

    name: str
    root: Path
    fs: FileSystem
    restarts: int = 0

    def open(self) -> contextlib.AbstractAsyncContextManager[Store]:
        return open_store(self.root, fs=self.fs)

    def restart(self) -> None:
        """Between two store sessions: a power loss for the in-memory backend."""
        self.restarts += 1
        if isinstance(self.fs, PowerLossFileSystem):
            self.fs.crash(random.Random(self.restarts))

    def path(self, rel: str) -> str:
        return str(self.root / rel)

    def read(self, rel: str) -> bytes:
        return self.fs.read(self.path(rel))

    def rewrite(self, rel: str, data: bytes) -> None:
        handle = self.fs.open_append(self.path(rel))
        try:
            self.fs.truncate(handle, 0)
            self.fs.write(handle, data)
            self.fs.fdatasync(handle)
        finally:
            self.fs.close(handle)

    def append(self, rel: str, data: bytes) -> None:
        """Append ``data`` right after the log's last frame."""
        whole = self.read(rel)
        self.rewrite(rel, whole[: scan(whole).good_length] + data)

    def frames(self, rel: str) -> bytes:
        """The file's bytes up to the end of its last frame."""
        whole = self.read(rel)
        return whole[: scan(whole).good_length]

    def assert_whole(self, rel: str, good_length: int) -> None:
        """The file holds its frames alone — or, after a power loss, its frames and then
        zeros: a delivery log's space allocated ahead, whose cut at a clean close was not
        synced (J19: never acknowledged, cut at the next open for appending)."""
        tail = self.read(rel)[good_length:]
        if isinstance(self.fs, PowerLossFileSystem):
            assert tail.count(0) == len(tail), "only zeros after the frames"
        else:
            assert tail == b"", "a clean close leaves the frames alone"

    def listdir(self, rel: str) -> list[str]:
        return self.fs.listdir(self.path(rel))


@pytest.fixture(params=["os", "power-loss"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    root = tmp_path / "state"
    if request.param == "os":
        return Backend("os", root, OsFileSystem())
    return Backend("power-loss", root, PowerLossFileSystem(root))


# -- conformance: every backend ----------------------------------------------------------


async def test_append_and_reopen_exact_records(backend: Backend) -> None:
    """J2: after a restart every log holds exactly its acknowledged records,
    by sequence number, byte for byte, and appending continues after them."""
    delivery = [_action("d", i) for i in range(1, 6)]
    lane = [_action("lane", i) for i in range(1, 4)]
    admissions = [_admission(0, i) for i in range(1, 4)]
    with trio.fail_after(10):
        async with backend.open() as store:
            log = await store.create_delivery_log("d0")
            assert [await log.append(r) for r in delivery] == [1, 2, 3, 4, 5]
            lane_log = await store.open_lane_log(LANE)
            assert [await lane_log.append(r) for r in lane] == [1, 2, 3]
            assert [await store.admissions.append(r) for r in admissions] == [1, 2, 3]
        backend.restart()
        async with backend.open() as store:
            contents = await store.read_delivery_log("d0")
            assert contents.records[1:] == tuple(delivery)
            assert [encode_record(r) for r in contents.records[1:]] == [
                encode_record(r) for r in delivery
            ]
            assert contents.header.subject == "d0"
            backend.assert_whole(contents.rel, contents.good_length)
            reopened = await store.open_delivery_log("d0")
            assert await reopened.append(_action("d", 6)) == 6
            lane_log = await store.open_lane_log(LANE)
            assert lane_log.contents.records[1:] == tuple(lane)
            assert await lane_log.append(_action("lane", 4)) == 4
            assert store.admissions.contents.records[1:] == tuple(admissions)
            assert await store.admissions.append(_admission(0, 4)) == 4
        backend.restart()
        async with backend.open() as store:
            contents = await store.read_delivery_log("d0")
            assert contents.records[1:] == (*delivery, _action("d", 6))
            assert store.admissions.next_seq == 5


@pytest.mark.parametrize("log", ["delivery", "admissions", "lane"])
@pytest.mark.parametrize("damage", ["cut-mid-frame", "cut-mid-header", "zeros", "garbage"])
async def test_torn_final_frame_is_discarded(backend: Backend, log: str, damage: str) -> None:
    """J3: a torn final frame (interrupted write, zeros, garbage) is silently
    discarded, cut off durably on reopen, and appending continues at the next seq."""
    records = [_action(log, i) for i in range(1, 4)]
    with trio.fail_after(10):
        async with backend.open() as store:
            journal: Journal
            if log == "delivery":
                journal = await store.create_delivery_log("d0")
            elif log == "lane":
                journal = await store.open_lane_log(LANE)
            else:
                journal = store.admissions
            for r in records:
                await journal.append(r)
            rel = journal.rel
        good = backend.frames(rel)
        next_frame = encode_frame(4, [encode_record(_action(log, 4))])
        tail = {
            "cut-mid-frame": next_frame[:-7],
            "cut-mid-header": next_frame[: HEADER_SIZE // 2],
            "zeros": bytes(64),
            "garbage": random.Random(7).randbytes(64),
        }[damage]
        backend.append(rel, tail)
        backend.restart()
        contents = read_log(backend.fs, str(backend.root), rel)
        assert contents.records[1:] == tuple(records)
        assert contents.good_length == len(good)
        assert contents.torn_bytes == len(tail)
        async with backend.open() as store:
            if log == "delivery":
                journal = await store.open_delivery_log("d0")
            elif log == "lane":
                journal = await store.open_lane_log(LANE)
            else:
                journal = store.admissions
            assert backend.read(rel) == good, "the torn tail is cut off on reopen"
            assert await journal.append(_action(log, 5)) == 4
        backend.restart()
        async with backend.open() as store:
            contents = await store.read(rel)
            assert contents.records[1:] == (*records, _action(log, 5))
            backend.assert_whole(rel, contents.good_length)


async def test_documents_replace_atomically(backend: Backend) -> None:
    """J7: a document is replaced whole and durably; no temporary file remains."""
    with trio.fail_after(10):
        async with backend.open() as store:
            assert await store.read_document(DOC) is None
            for version in (b"one", b"two" * 100, b"three"):
                await store.write_document(DOC, version)
                assert await store.read_document(DOC) == version
        backend.restart()
        async with backend.open() as store:
            assert await store.read_document(DOC) == b"three"
    assert backend.listdir("lanes") == ["state.json"]


async def test_group_commit_shares_syncs(backend: Backend) -> None:
    """J8: concurrent admissions are written as shared frames with one sync per
    batch, and no producer is acknowledged before its batch is durable."""
    probe = _SyncProbe(backend.fs, watch=ADMISSIONS)
    producers = 100
    acked: list[tuple[int, Admission]] = []

    async def produce(store: Store, p: int) -> None:
        record = _admission(p, 0)
        seq = await store.admissions.append(record)
        durable = decode_log(probe.durable(backend.path(ADMISSIONS)), rel=ADMISSIONS)
        assert durable.records[seq] == record, f"seq {seq} acknowledged before durable"
        acked.append((seq, record))

    with trio.fail_after(20):
        async with open_store(backend.root, fs=probe) as store:
            header_syncs = probe.syncs
            probe.hold()
            async with trio.open_nursery() as nursery:
                try:
                    for p in range(producers):
                        nursery.start_soon(produce, store, p)
                    await trio.testing.wait_all_tasks_blocked()
                    acked_while_held = list(acked)
                finally:
                    probe.release()  # never leave a writer thread (and its producers) stuck
            batch_syncs = probe.syncs - header_syncs
        assert acked_while_held == [], "acknowledged while the sync was held"
        backend.restart()
        async with backend.open() as store:
            records = store.admissions.contents.records
    assert sorted(seq for seq, _ in acked) == list(range(1, producers + 1))
    assert all(records[seq] == record for seq, record in acked)
    # the first batch was held at its sync while every other producer queued
    # behind it: they are all written as one more frame, with one more sync
    assert batch_syncs <= 2, f"{producers} concurrent appends took {batch_syncs} syncs"
    assert len(scan(backend.read(ADMISSIONS)).frames) == probe.syncs


class _SyncProbe(FaultyFileSystem):
    """Counts syncs of one log, can hold the first one, and tracks what is durable."""

    def __init__(self, inner: FileSystem, *, watch: str) -> None:
        super().__init__(inner)
        self.watch = watch
        self.syncs = 0
        self._gate = threading.Event()
        self._gate.set()
        self._durable: dict[str, bytes] = {}
        self._count_lock = threading.Lock()

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def durable(self, path: str) -> bytes:
        """The content of ``path`` as of its last completed sync through this probe."""
        if isinstance(self.inner, PowerLossFileSystem):
            return self.inner.durable_read(path) or b""
        with self._count_lock:
            return self._durable.get(path, b"")

    def fdatasync(self, handle: int) -> None:
        path = self.path_of(handle)
        if self.watch not in path:
            self.inner.fdatasync(handle)
            return
        self._gate.wait(timeout=15)  # a bound, not a check: this runs on a writer thread
        content = self.inner.read(path)
        self.inner.fdatasync(handle)
        with self._count_lock:
            self.syncs += 1
            self._durable[path] = content


async def test_create_existing_delivery_log_is_refused(backend: Backend) -> None:
    """J2: a delivery log is created once; its header is never rewritten."""
    with trio.fail_after(10):
        async with backend.open() as store:
            await store.create_delivery_log("d0")
        backend.restart()
        async with backend.open() as store:
            with pytest.raises(FileExistsError):
                await store.create_delivery_log("d0")
            assert (await store.read_delivery_log("d0")).next_seq == 1


# -- damage: fails closed ---------------------------------------------------------------


async def _store_with_logs(backend: Backend) -> str:
    """A store with four admission frames and a delivery log of three frames."""
    async with backend.open() as store:
        for i in range(1, 4):
            await store.admissions.append(_admission(0, i))
        log = await store.create_delivery_log("d0")
        for i in range(1, 3):
            await log.append(_action("d0", i))
        return log.rel


async def _expect_open_refused(backend: Backend, code: ReasonCode, rel: str, offset: int) -> None:
    with pytest.raises(JournalError) as info:
        async with backend.open():
            pass
    _expect(info.value, code, rel, offset)


def _expect(error: JournalError, code: ReasonCode, rel: str, offset: int) -> None:
    assert error.code is code
    assert error.path == rel
    assert error.offset == offset
    assert rel in str(error)
    assert f"offset {offset}" in str(error)


async def test_flipped_byte_in_shared_log_stops_open(backend: Backend) -> None:
    """J4: a flipped byte in the middle of admissions.log stops open_store with
    journal_corrupt naming the file and the offset of the damaged frame."""
    with trio.fail_after(10):
        await _store_with_logs(backend)
        data = backend.read(ADMISSIONS)
        frames = scan(data).frames
        assert len(frames) == 4
        damaged = frames[1]
        pos = damaged.offset + HEADER_SIZE + len(damaged.body) // 2
        backend.rewrite(ADMISSIONS, data[:pos] + bytes([data[pos] ^ 0x40]) + data[pos + 1 :])
        await _expect_open_refused(backend, ReasonCode.JOURNAL_CORRUPT, ADMISSIONS, damaged.offset)


async def test_flipped_byte_in_delivery_log_fails_closed(backend: Backend) -> None:
    """J4: damage in the middle of a delivery log refuses it (read and open)
    with journal_corrupt at the damaged frame's offset."""
    with trio.fail_after(10):
        rel = await _store_with_logs(backend)
        data = backend.read(rel)
        frames = scan(data).frames
        backend.rewrite(rel, data[: frames[1].offset + 3] + b"\xff" + data[frames[1].offset + 4 :])
        async with backend.open() as store:
            with pytest.raises(JournalError) as info:
                await store.read_delivery_log("d0")
            _expect(info.value, ReasonCode.JOURNAL_CORRUPT, rel, frames[1].offset)
            with pytest.raises(JournalError) as info:
                await store.open_delivery_log("d0")
            _expect(info.value, ReasonCode.JOURNAL_CORRUPT, rel, frames[1].offset)


@pytest.mark.parametrize("where", ["delivery", "admissions"])
async def test_future_schema_version_is_refused(backend: Backend, where: str) -> None:
    """J4: a log whose header names a newer schema is refused with
    journal_version_unsupported at offset 0."""
    with trio.fail_after(10):
        rel = await _store_with_logs(backend)
        kind, subject = (
            (LogKind.DELIVERY, "d0") if where == "delivery" else (LogKind.ADMISSIONS, "")
        )
        target = rel if where == "delivery" else ADMISSIONS
        future = _header(kind, subject, version=SCHEMA_VERSION + 1)
        backend.rewrite(target, encode_frame(0, [encode_record(future)]))
        if where == "admissions":
            await _expect_open_refused(backend, ReasonCode.JOURNAL_VERSION_UNSUPPORTED, target, 0)
            return
        async with backend.open() as store:
            with pytest.raises(JournalError) as info:
                await store.open_delivery_log("d0")
            _expect(info.value, ReasonCode.JOURNAL_VERSION_UNSUPPORTED, target, 0)


async def test_unknown_record_tag_is_refused(backend: Backend) -> None:
    """J4: a valid frame holding a record type this version does not know is
    refused with journal_unknown_record at that frame's offset, never skipped."""
    with trio.fail_after(10):
        rel = await _store_with_logs(backend)
        before = backend.read(rel)
        future = encode_frame(3, [b'{"type":"from_the_future","x":1}'])
        backend.append(rel, future + encode_frame(4, [encode_record(_action("d0", 4))]))
        async with backend.open() as store:
            for attempt in (store.read_delivery_log, store.open_delivery_log):
                with pytest.raises(JournalError) as info:
                    await attempt("d0")
                _expect(info.value, ReasonCode.JOURNAL_UNKNOWN_RECORD, rel, len(before))


@pytest.mark.parametrize("where", ["delivery", "results"])
async def test_sequence_gap_is_refused(backend: Backend, where: str) -> None:
    """J4: a valid frame that does not continue the sequence is refused with
    journal_sequence_gap at its offset (a shared log stops open_store)."""
    with trio.fail_after(10):
        rel = await _store_with_logs(backend)
        target = rel if where == "delivery" else RESULTS
        before = backend.read(target)
        gap_seq = scan(before).next_seq + 2
        backend.append(target, encode_frame(gap_seq, [encode_record(_action("x", 9))]))
        if where == "results":
            await _expect_open_refused(
                backend, ReasonCode.JOURNAL_SEQUENCE_GAP, target, len(before)
            )
            return
        async with backend.open() as store:
            with pytest.raises(JournalError) as info:
                await store.read_delivery_log("d0")
            _expect(info.value, ReasonCode.JOURNAL_SEQUENCE_GAP, target, len(before))


# -- fault injection: the N-th operation fails -------------------------------------------


@dataclass
class LogRun:
    """What a workload did to one log."""

    rel: str
    records: int
    journal: Journal | None = None
    acked: dict[int, Record] = field(default_factory=dict)
    errors: list[JournalError] = field(default_factory=list)
    header_acked: bool = False


@dataclass
class Workload:
    """Two delivery logs created and appended, the lane log, and the shared
    admissions log from three concurrent producers, all at once."""

    root: Path
    logs: dict[str, LogRun] = field(default_factory=dict)
    admission_producers: int = 3
    per_producer: int = 4

    async def run(self, store: Store, faulty: FaultyFileSystem) -> None:
        lane = await store.open_lane_log(LANE)  # its directory exists before the faults
        lane_run = self.logs["lane"] = LogRun(lane.rel, 5, lane, header_acked=True)
        admissions = self.logs["admissions"] = LogRun(
            ADMISSIONS, self.admission_producers * self.per_producer, store.admissions
        )
        admissions.header_acked = True
        faulty.arm()
        async with trio.open_nursery() as nursery:
            for delivery in DELIVERIES:
                run = self.logs[delivery] = LogRun(Store.delivery_rel(delivery), 5)
                nursery.start_soon(self._delivery, store, delivery, run)
            nursery.start_soon(self._append, lane_run, lane, [_action("lane", i) for i in range(5)])
            for p in range(self.admission_producers):
                records = [_admission(p, i) for i in range(self.per_producer)]
                nursery.start_soon(self._append, admissions, store.admissions, records)
        faulty.disarm()

    async def _delivery(self, store: Store, delivery: str, run: LogRun) -> None:
        try:
            run.journal = await store.create_delivery_log(delivery)
        except JournalError as exc:
            run.errors.append(exc)
            return
        run.header_acked = True
        await self._append(run, run.journal, [_action(delivery, i) for i in range(run.records)])

    @staticmethod
    async def _append(run: LogRun, journal: Journal, records: Sequence[Record]) -> None:
        for record in records:
            try:
                seq = await journal.append(record)
            except JournalError as exc:
                run.errors.append(exc)
                return
            assert seq not in run.acked
            run.acked[seq] = record

    def expected(self, name: str) -> tuple[Record, ...]:
        """The acknowledged records after the header, in seq order (no gaps)."""
        run = self.logs[name]
        seqs = sorted(run.acked)
        assert seqs == list(range(1, len(seqs) + 1)), f"{name}: acknowledged seqs {seqs}"
        return tuple(run.acked[s] for s in seqs)


def _expected_code(kind: OpKind, when: When, error_number: int) -> ReasonCode:
    if kind == "write" and when == "short":
        return ReasonCode.DISK_FAILED  # the writer reports a short write as EIO
    return {
        errno.EIO: ReasonCode.DISK_FAILED,
        errno.ENOSPC: ReasonCode.DISK_FULL,
    }.get(error_number, ReasonCode.JOURNAL_POISONED)


async def _check_poisoned_in_process(
    store: Store,
    workload: Workload,
    name: str,
    code: ReasonCode,
    *,
    refused: ReasonCode | None = ReasonCode.JOURNAL_POISONED,
) -> None:
    """The failing append raised ``code``; every later append is refused.

    ``refused=None``: the log's creation failed and left no poison document, so
    it holds no acknowledged record and opening it finds nothing (J3)."""
    run = workload.logs[name]
    codes = {e.code for e in run.errors}
    assert code in codes, f"{name}: {run.errors}"
    assert codes <= {code, ReasonCode.JOURNAL_POISONED}, f"{name}: {run.errors}"
    first = next(e for e in run.errors if e.code is code)
    assert first.path == run.rel
    assert isinstance(first, DiskFailedError) == (code is not ReasonCode.JOURNAL_POISONED)
    journal = run.journal
    if journal is None and refused is None:
        with pytest.raises(FileNotFoundError, match="holds no acknowledged record"):
            await store.open_delivery_log(name)
        return
    if journal is None:  # its creation failed: reopening it is refused
        with pytest.raises(JournalError) as info:
            await store.open_delivery_log(name)
        assert info.value.code is refused
    else:
        with pytest.raises(JournalError) as info:
            await journal.append(_action(name, 99))
        assert info.value.code is ReasonCode.JOURNAL_POISONED
    assert info.value.path == run.rel


def _read_poison(root: Path, rel: str) -> Poison | None:
    try:
        data = (root / f"{rel}.poison").read_bytes()
    except FileNotFoundError:
        return None
    return msgspec.json.decode(data, type=Poison)


def _temp_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp-*"))


async def _open_log(store: Store, name: str) -> Journal:
    if name == "lane":
        return await store.open_lane_log(LANE)
    if name == "admissions":
        return store.admissions
    return await store.open_delivery_log(name)


async def _check_reopened(workload: Workload, poisoned: set[str]) -> None:
    """After a restart (plain file system): every log holds exactly its
    acknowledged records; a poisoned log is refused for appending but can still
    be read up to its good length; the others continue at the next seq."""
    root = workload.root
    if "admissions" in poisoned:
        # a poisoned shared log stops the whole store: it is not replayed
        with pytest.raises(JournalError) as info:
            async with open_store(root):
                pass
        assert info.value.code is ReasonCode.JOURNAL_POISONED
        assert info.value.path == ADMISSIONS
        for name, run in workload.logs.items():
            contents = read_log(OsFileSystem(), str(root), run.rel)
            assert contents.records[1:] == workload.expected(name), name
            assert (contents.poison is not None) == (name in poisoned), name
        return
    async with open_store(root) as store:
        for name, run in workload.logs.items():
            expected = workload.expected(name)
            contents = await store.read(run.rel)
            if not run.header_acked:
                assert contents.records == (), f"{name}: its creation failed, it holds nothing"
            else:
                assert contents.records[1:] == expected, name
                assert [encode_record(r) for r in contents.records[1:]] == [
                    encode_record(r) for r in expected
                ], name
            if name in poisoned:
                with pytest.raises(JournalError) as info:
                    await _open_log(store, name)
                assert info.value.code is ReasonCode.JOURNAL_POISONED, name
                assert info.value.path == run.rel
            else:
                journal = await _open_log(store, name)
                assert await journal.append(_action(name, 100)) == len(expected) + 1, name


async def _run_fault(root: Path, fault: Fault) -> None:
    faulty = FaultyFileSystem(OsFileSystem(), fault, armed=False)
    workload = Workload(root)
    code = _expected_code(fault.kind, fault.when, fault.errno)
    with trio.fail_after(20):
        async with open_store(root, fs=faulty, sync_log=False) as store:
            await workload.run(store, faulty)
            assert len(faulty.hits) == 1, faulty.hits
            hit = [name for name, run in workload.logs.items() if run.errors]
            assert len(hit) == 1, f"one fault poisons one log, not {hit} ({faulty.hits})"
            name = hit[0]
            await _check_poisoned_in_process(store, workload, name, code)
            if code is ReasonCode.JOURNAL_POISONED:
                assert store.disk_failure is None
            else:
                assert store.disk_failure is not None
                assert store.disk_failure.code is code
                assert store.disk_failure.path == workload.logs[name].rel
            for other, run in workload.logs.items():
                if other != name:
                    assert len(run.acked) == run.records, other
        run = workload.logs[name]
        poison = _read_poison(root, run.rel)
        assert poison is not None, "a poison document records the failure"
        assert poison.log_path == run.rel
        assert poison.errno == (errno.EIO if code is ReasonCode.DISK_FAILED else fault.errno)
        data = (root / run.rel).read_bytes()
        assert poison.good_length == len(data), "truncated back to the last good frame"
        if run.header_acked:
            assert decode_log(data, rel=run.rel).records[1:] == workload.expected(name)
        else:
            assert data == b""
        assert _temp_files(root) == []
        await _check_reopened(workload, {name})


MATRIX = [
    (kind, when, nth)
    for kind in ("write", "sync")
    for when in ("before", "after", "short")
    for nth in (1, 2, 4, 7)
]


@pytest.mark.parametrize(("kind", "when", "nth"), MATRIX)
async def test_nth_operation_fails(tmp_path: Path, kind: OpKind, when: When, nth: int) -> None:
    """J5, J6, J2: the N-th write/sync fails (before, after or short) during
    concurrent appends to delivery, lane and admissions logs: the failing append
    raises disk_failed and sets disk_failure, only that log is poisoned (later
    appends refused, poison document written, file truncated to the last good
    frame), and after a restart every log holds exactly its acknowledged
    records; the poisoned one is refused for appending but still readable."""
    await _run_fault(tmp_path / "state", Fault(kind, nth, when))


@pytest.mark.parametrize("when", ["before", "after", "short"])
@pytest.mark.parametrize("kind", ["write", "sync"])
@pytest.mark.parametrize("target", ["deliveries/", "lane.log", "admissions.log"])
async def test_fault_in_the_middle_of_a_log(
    tmp_path: Path, target: str, kind: OpKind, when: When
) -> None:
    """J5, J6, J2: as above, aimed at the third write/sync of one kind of log,
    so the log is poisoned after its header (and often records) were
    acknowledged: exactly those are read back, the failed record is not."""
    await _run_fault(tmp_path / "state", Fault(kind, 3, when, path_contains=target))


@pytest.mark.parametrize(
    "fault",
    [
        Fault("write", 2, "before", errno.ENOSPC),
        Fault("sync", 3, "after", errno.ENOSPC),
        Fault("write", 3, "before", errno.EINVAL),
        Fault("sync", 1, "after", errno.EINVAL),
    ],
    ids=["write-enospc", "sync-enospc", "write-einval", "sync-einval"],
)
async def test_errno_decides_the_reason(tmp_path: Path, fault: Fault) -> None:
    """J6, J5: ENOSPC is disk_full (and sets disk_failure); an errno that is not
    a disk failure still poisons the log (journal_poisoned) but leaves
    disk_failure unset."""
    await _run_fault(tmp_path / "state", fault)


@pytest.mark.parametrize("kind", ["write", "sync"])
async def test_a_dying_disk_keeps_failing(tmp_path: Path, kind: OpKind) -> None:
    """J5, J6, J2: from the third write/sync on every one fails, so even the
    poison documents cannot be written: the in-memory poison still refuses later
    appends, and after a restart every log holds exactly its acknowledged records
    (the truncation, not a poison document, bounds them)."""
    root = tmp_path / "state"
    faulty = FaultyFileSystem(OsFileSystem(), Fault(kind, 3, "before", sticky=True), armed=False)
    workload = Workload(root)
    with trio.fail_after(20):
        async with open_store(root, fs=faulty, sync_log=False) as store:
            await workload.run(store, faulty)
            hit = {name for name, run in workload.logs.items() if run.errors}
            assert hit, faulty.hits
            for name in hit:
                # a log whose creation failed has no header and, on this disk, no
                # poison document either: it holds no acknowledged record
                await _check_poisoned_in_process(
                    store, workload, name, ReasonCode.DISK_FAILED, refused=None
                )
            assert store.disk_failure is not None
            assert store.disk_failure.code is ReasonCode.DISK_FAILED
        for name in hit:
            run = workload.logs[name]
            assert _read_poison(root, run.rel) is None, "the dying disk took no poison document"
            data = (root / run.rel).read_bytes()
            if run.header_acked:
                assert decode_log(data, rel=run.rel).records[1:] == workload.expected(name)
            else:
                assert data == b""
        assert _temp_files(root) == []
        async with open_store(root) as store:
            for name, run in workload.logs.items():
                if not run.header_acked:
                    assert (await store.read(run.rel)).next_seq == 0, name
                    continue
                contents = await store.read(run.rel)
                assert contents.records[1:] == workload.expected(name), name


@pytest.mark.parametrize("when", ["before", "after"])
async def test_failed_truncate_is_bounded_by_the_poison_document(
    tmp_path: Path, when: When
) -> None:
    """J5, J2: when the failed frame cannot even be truncated away, the poison
    document's good length still bounds what is read: the unacknowledged record
    is never read back, and the log is refused for appending."""
    root = tmp_path / "state"
    faulty = FaultyFileSystem(
        OsFileSystem(),
        [Fault("write", 3, "after"), Fault("truncate", 1, when)],
        armed=False,
    )
    with trio.fail_after(10):
        async with open_store(root, fs=faulty, sync_log=False) as store:
            faulty.arm()
            log = await store.create_delivery_log("d0")  # write 1
            assert await log.append(_action("d0", 1)) == 1  # write 2
            with pytest.raises(DiskFailedError):
                await log.append(_action("d0", 2))  # write 3 lands, then fails
            assert [h.fault.kind for h in faulty.hits] == ["write", "truncate"]
            with pytest.raises(JournalError) as info:
                await log.append(_action("d0", 3))
            assert info.value.code is ReasonCode.JOURNAL_POISONED
        poison = _read_poison(root, log.rel)
        assert poison is not None
        size = (root / log.rel).stat().st_size
        assert size > poison.good_length if when == "before" else size == poison.good_length
        async with open_store(root) as store:
            contents = await store.read_delivery_log("d0")
            assert contents.records[1:] == (_action("d0", 1),)
            with pytest.raises(JournalError) as info:
                await store.open_delivery_log("d0")
            assert info.value.code is ReasonCode.JOURNAL_POISONED


async def test_poison_document_that_cannot_be_renamed_in(tmp_path: Path) -> None:
    """J2, J5: if even the poison document's rename fails, the truncation still
    leaves exactly the acknowledged records (journal.md, "Poisoning and the disk")."""
    root = tmp_path / "state"
    faulty = FaultyFileSystem(
        OsFileSystem(),
        [Fault("write", 2, "after"), Fault("rename", 1, "before")],
        armed=False,
    )
    with trio.fail_after(10):
        async with open_store(root, fs=faulty, sync_log=False) as store:
            faulty.arm()
            log = await store.create_delivery_log("d0")
            with pytest.raises(DiskFailedError):
                await log.append(_action("d0", 1))
            assert [h.fault.kind for h in faulty.hits] == ["write", "rename"]
        assert _read_poison(root, log.rel) is None
        async with open_store(root) as store:
            contents = await store.read_delivery_log("d0")
            assert contents.records[1:] == ()
            assert contents.torn_bytes == 0


# -- documents under faults ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "when", "nth"),
    [
        (kind, when, nth)
        for kind in ("write", "sync", "rename")
        for when in ("before", "after", "short")
        for nth in (1, 2)
    ],
)
async def test_document_replace_under_faults(
    tmp_path: Path, kind: OpKind, when: When, nth: int
) -> None:
    """J7: a replace that fails leaves the old or the new document, never a mix
    and never a temporary file, and the next replace succeeds. A short write is
    not a failure: the rest is written."""
    root = tmp_path / "state"
    versions = [f"version {v} ".encode() * (v + 1) for v in range(4)]
    faulty = FaultyFileSystem(OsFileSystem(), Fault(kind, nth, when), armed=False)
    with trio.fail_after(10):
        async with open_store(root, fs=faulty, sync_log=False) as store:
            await store.write_document(DOC, versions[0])
            faulty.arm()
            failed: int | None = None
            for v in range(1, 4):
                try:
                    await store.write_document(DOC, versions[v])
                except (OSError, DiskFailedError):
                    failed = v
                    break
            faulty.disarm()
            assert faulty.fired
            content = await store.read_document(DOC)
            if failed is None:
                assert (kind, when) == ("write", "short")
                assert content == versions[3]
            else:
                assert content in (versions[failed - 1], versions[failed])
            assert _temp_files(root) == [], "a failed replace leaves no temporary file"
            await store.write_document(DOC, b"after")
            assert await store.read_document(DOC) == b"after"


async def test_document_disk_failure_is_a_disk_failure(tmp_path: Path) -> None:
    """J6: EIO while replacing a document is a disk failure like any other: it
    sets Store.disk_failure so the host stops admitting."""
    root = tmp_path / "state"
    faulty = FaultyFileSystem(OsFileSystem(), Fault("sync", 1, "before"), armed=False)
    with trio.fail_after(10):
        async with open_store(root, fs=faulty, sync_log=False) as store:
            faulty.arm()
            with pytest.raises((OSError, JournalError)):
                await store.write_document(DOC, b"x")
            assert store.disk_failure is not None
            assert store.disk_failure.code is ReasonCode.DISK_FAILED


async def test_store_releases_its_writers_when_a_close_fails(tmp_path: Path) -> None:
    """J11 (open_store's resource handling): the writer threads stop and every
    log is closed however the block ends, even when closing one log fails."""
    root = tmp_path / "state"
    faulty = FaultyFileSystem(OsFileSystem(), Fault("close", 1, "after"), armed=False)

    def writers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("pi-runtime-writer-")}

    before = writers()
    with trio.fail_after(10):
        with pytest.raises(OSError, match="injected into close"):  # noqa: PT012
            async with open_store(root, fs=faulty, sync_log=False) as store:
                for d in DELIVERIES:
                    log = await store.create_delivery_log(d)
                    await log.append(_action(d, 1))
                faulty.arm()
        assert faulty.fired
        leaked = writers() - before
        assert not leaked, f"{len(leaked)} writer threads still running after open_store exited"


async def test_j6_a_failed_directory_sync_after_a_shared_log_is_replaced_is_a_disk_failure(
    tmp_path: Path,
) -> None:
    """J6, RT7: compaction renamed the new admissions file over the old one, and the
    directory sync after it failed — with an errno that is not a disk one (EINVAL). The new
    file is the log from then on, but its name may not survive a power loss, and with it
    every record appended to it: the store reports a disk failure (it stops admitting)
    instead of going on appending to it."""
    root = tmp_path / "state"
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    with trio.fail_after(10):
        async with open_store(root, fs=faulty) as store:
            for i in range(1, 4):
                await store.admissions.append(_admission(0, i))
            records = list(store.admissions.contents.records[1:])
            directory = str(root / "admissions")
            # the first sync under it is the new file's fsync, the second the directory's
            faulty.arm(Fault("sync", 2, "before", errno.EINVAL, path_contains=directory))
            with pytest.raises(DiskFailedError) as failed:
                await store.rewrite_shared(store.admissions, records)
            assert [hit.path for hit in faulty.hits] == [directory]
            assert failed.value.path == ADMISSIONS
            assert store.disk_failure is not None
            assert store.disk_failure.path == ADMISSIONS


async def test_j6_a_disk_failure_while_removing_logs_is_reported(tmp_path: Path) -> None:
    """J6, RT2: retention removes a delivery's log and the directory sync after the unlink
    fails (EIO): the removal raises ``disk_failed`` naming the directory, and the store has
    reported it (it stops admitting) — not a bare ``OSError`` the store never hears of."""
    root = tmp_path / "state"
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    with trio.fail_after(10):
        async with open_store(root, fs=faulty) as store:
            log = await store.create_delivery_log("d0")
            await store.close_log(log)
            faulty.arm(Fault("sync", 1, "before", errno.EIO, path_contains="/deliveries"))
            with pytest.raises(DiskFailedError) as failed:
                await store.remove_logs([log.rel])
            assert failed.value.path == "deliveries"
            assert store.disk_failure is not None
