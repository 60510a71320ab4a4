"""Writer threads: where appended records become durable, off the Trio loop.

Each log file belongs to one writer thread (a *shard*, chosen by the file's
path), so its appends stay in order. A Trio task hands a record over (one
hand-off per record), and waits; the thread takes everything queued for it,
writes each file's pending records as **one frame** with a single ``write``,
``fdatasync``\\ s the file once (plus a directory fsync when it created the
file) and only then acknowledges every record of the batch back on the Trio
loop. So:

* an append is acknowledged only once its record is durable;
* many producers appending to one shared log (admissions) share one
  ``fdatasync`` per batch — group commit;
* several lanes' logs on different shards sync concurrently;
* a task that hands its item over while nothing else of its shard is in flight (one lane's
  step) is woken through the shard's eventfd, not a loop callback: one scheduler pass fewer
  (journal.md J20);
* every other settled batch goes to the pool's *acker*, a Trio task waiting on one eventfd,
  which reports the batch's disk failure and then wakes its tasks — no loop callback, no
  wake-up socket (journal.md J21);
* a *grouped* log's hand-offs (the shared admission and result logs, where many tasks append
  at once) are gathered on the Trio side for one scheduler pass and handed over as one item:
  one queue ``put`` and one writer wake-up for everything appended in that pass, instead of one
  per record (the first task to stage one in a pass yields once, then hands over the lot).

A failed write, short write or sync **poisons** the file: it is truncated back
to its last good frame, a poison document is written beside it, and every
later append is refused (``journal_poisoned``). ``EIO``/``ENOSPC`` are reported
as :class:`~runtime._errors.DiskFailedError`, so the host can stop admitting.
A log whose file cannot be *opened* for want of a file descriptor (``EMFILE``/``ENFILE``)
before anything was written to it is not poisoned: nothing reached its file, so there is
nothing to bound; its appends are refused ``too_many_open_files`` and the log must be opened
anew (:func:`~runtime._errors.descriptors_exhausted`, lanes.md L21).
After a failed ``fdatasync`` nothing is retried: the page cache can no longer
be trusted (the kernel may have dropped the dirty pages).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import queue
import secrets
import threading
import zlib
from collections.abc import Callable, Iterable
from typing import Final

import trio

from .._clock import perf_seconds
from .._errors import DiskFailedError, JournalError, ReasonCode, descriptors_exhausted
from .._linux._fs import FileSystem
from .._metrics import JOURNAL_APPEND_SECONDS, JOURNAL_BATCH_RECORDS, JOURNAL_FDATASYNC_SECONDS
from ._frame import encode_frame
from ._sync_log import ROTATE_BYTES, SYNC_DIR, encode_entry, generation_name

__all__ = [
    "TMP_MARK",
    "LogTarget",
    "StagedFile",
    "WriterPool",
    "atomic_write",
    "disk_error",
    "handoffs_in_flight",
]

_in_flight = 0
"""Records and closes handed to writer threads and not yet settled, in this process."""


def handoffs_in_flight() -> int:
    """How many hand-offs to writer threads are waiting to settle (for an I/O-aware test
    clock, ``runtime.testing.IoAwareMockClock``: virtual time must not jump meanwhile)."""
    return _in_flight


_MAX_BATCH: Final = 4096
_RETIRING: Final = 2
"""Full generations waiting for their logs at most; a switch past it catches up at once."""
_SLACK: Final = 64 * 1024
"""A sync log generation's room past the size that fills it (one more batch fits)."""
_DISK_ERRNOS: Final = {
    errno.EIO: ReasonCode.DISK_FAILED,
    errno.ENOSPC: ReasonCode.DISK_FULL,
    errno.EDQUOT: ReasonCode.DISK_FULL,
    errno.EROFS: ReasonCode.DISK_FAILED,
}


class LogTarget:
    """The writer-side state of one log file.

    Owned by its shard thread once handed to the pool: only that thread opens,
    writes, syncs, truncates or closes it.
    """

    def __init__(
        self,
        *,
        path: str,
        rel: str,
        good_length: int,
        next_seq: int,
        poison_path: str,
        create: bool,
    ) -> None:
        self.path = path
        self.rel = rel
        self.good_length = good_length
        self.next_seq = next_seq
        """Next sequence number to assign (Trio side)."""
        self.poison_path = poison_path
        self.poisoned: JournalError | None = None
        self.unrecorded: bytes | None = None
        """Set (by the writer) when the log was poisoned and its poison document could not be
        written: the frame of the records it owed (J5; kept in the sync log for the next
        start, J15). Nothing on disk says the log is poisoned, so the store remembers it for
        the rest of the run."""
        self.grouped = False
        """Many tasks append at once (a shared log): hand-offs are gathered per scheduler pass.
        Changed only while no append of this target is in flight (the writer assumes a
        target's records reach it in sequence order, so they must all take one path)."""
        self.deferred = False
        """A delivery's log: its records may be made durable through its shard's sync log and
        written to the file later (J12). Set once, before the first append."""
        self.closed = False
        """Closed (Trio side). A log allocated ahead then refuses every append
        (``journal_closed``): its next opening has a target of its own, and two would write
        at one offset (J19). An appended log still takes one, reopened by the writer at the
        file's end (a task lane's log appended while it parks, TL9)."""
        self.ahead = 0
        """Bytes to allocate ahead of the frames (J19): each frame then overwrites allocated
        zeros at :attr:`good_length` (a ``pwrite``) and its ``fdatasync`` has no size change
        to commit, only each growth has. 0: frames are appended. Set before the first
        append."""
        self._create = create
        self._shard: int | None = None
        """Its writer shard, chosen at its first hand-off (Trio side)."""
        self._handle: int | None = None
        self._allocated = 0
        """Writer side: the file's size while :attr:`ahead` is set (frames, then zeros)."""
        self._pending: list[bytes] = []
        """Writer side: acknowledged records durable in the sync log, owed to the file."""
        self._pending_first = 0
        """The sequence number of ``_pending[0]``."""

    def __repr__(self) -> str:
        return f"<LogTarget {self.rel} length={self.good_length} next_seq={self.next_seq}>"


class _Settled:
    """One unit of work handed to a writer thread by one waiting Trio task."""

    __slots__ = ("error", "signal", "task")

    def __init__(self) -> None:
        self.task = trio.lowlevel.current_task()
        self.error: BaseException | None = None
        self.signal: int | None = None
        """The eventfd its task waits on, if it was handed over alone (J20): the writer
        writes it instead of waking the task through a loop callback."""

    async def settled(self) -> None:
        """Wait until the writer thread settled this item; not cancellable.

        Once a record is handed over its fate must reach the caller, so the
        wait refuses cancellation (a pending cancel is delivered at the next
        checkpoint). Cheaper than an Event in a shielded scope: this is on
        the path of every durable step.
        """
        await trio.lowlevel.wait_task_rescheduled(_refuse_abort)
        if self.error is not None:
            raise self.error


def _refuse_abort(_: object) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


async def _signalled(efd: int) -> None:
    """Wait until the writer thread writes ``efd`` (and consume it); not cancellable, as
    :meth:`_Settled.settled`. The shield is only paid when a cancellation arrives."""
    try:
        await trio.lowlevel.wait_readable(efd)
    except trio.Cancelled:  # delivered again at the caller's next checkpoint
        pass
    else:
        try:
            os.eventfd_read(efd)
            return
        except BlockingIOError:  # woken with nothing written: wait on
            pass
    with trio.CancelScope(shield=True):
        while True:
            try:
                os.eventfd_read(efd)
                return
            except BlockingIOError:
                await trio.lowlevel.wait_readable(efd)


class _Handoff(_Settled):
    """Work on one log."""

    __slots__ = ("target",)

    def __init__(self, target: LogTarget) -> None:
        super().__init__()
        self.target = target


class _Append(_Handoff):
    __slots__ = ("payload", "seq")

    def __init__(self, target: LogTarget, seq: int, payload: bytes) -> None:
        super().__init__(target)
        self.seq = seq
        self.payload = payload


class _Close(_Handoff):
    __slots__ = ()


class _Open(_Handoff):
    """Open a log's file now (a log that lives as long as the store, L21)."""

    __slots__ = ()


class _Flush(_Handoff):
    """Write a log's pending records to its file (and sync it) before it is read (J12)."""

    __slots__ = ()


class _Retire(_Settled):
    """Logs about to be removed: no sync log generation may go on holding records of theirs
    (J18), so while a generation does, every owed record is written and the generations
    removed first."""

    __slots__ = ("rels",)

    def __init__(self, rels: frozenset[str]) -> None:
        super().__init__()
        self.rels = rels


_end_of_pass = trio.lowlevel.cancel_shielded_checkpoint
"""Yield once, uncancellably, so every task runnable in this scheduler pass runs first (a
test may hold it longer)."""

_LogWork = _Append | _Close | _Flush | _Open
_Work = _LogWork | _Retire
_Item = _Work | list[_Work] | None


class _Generation:
    """One sync log file (J12) and what its removal waits for."""

    __slots__ = ("kept", "path", "rels", "waiting")

    def __init__(self, path: str) -> None:
        self.path = path
        self.rels: set[str] = set()
        """Every log with an entry in it, owed or not (J18)."""
        self.waiting: dict[int, LogTarget] = {}
        """The logs, by ``id``, that still owe their files records it holds: it is removed
        once none is left."""
        self.kept = False
        """It holds acknowledged records of a log poisoned with no poison document (the
        disk full, J15): it stays for the next start's redo to write them (J14)."""


class _SyncLog:
    """A writer shard's sync log (J12): the generation being appended, and the earlier ones
    not yet removed, owned by the shard."""

    __slots__ = (
        "capacity",
        "current",
        "directory",
        "generation",
        "handle",
        "left_error",
        "next_seq",
        "owed",
        "retiring",
        "size",
    )

    def __init__(self, directory: str, generation: int) -> None:
        self.directory = directory
        self.generation = generation
        """The number of the generation being appended, or of the next one to begin."""
        self.current: _Generation | None = None
        """The generation being appended (``None`` until a batch begins one)."""
        self.handle: int | None = None
        self.capacity = 0
        """Bytes zero-filled and synced when the generation began (J12)."""
        self.size = 0
        """Bytes written: where the next frame goes."""
        self.next_seq = 0
        self.retiring: list[_Generation] = []
        """Earlier generations, oldest first: waiting for their logs' records to reach their
        files (written a log at a time between batches), or left by a removal that failed."""
        self.owed: dict[int, LogTarget] = {}
        """The logs with pending records, by ``id``."""
        self.left_error: OSError | None = None
        """Why the last removal of a generation failed."""

    @property
    def path(self) -> str:
        return os.path.join(self.directory, generation_name(self.generation))

    def generations(self) -> list[_Generation]:
        return [*self.retiring, self.current] if self.current is not None else self.retiring

    def written(self, target: LogTarget) -> None:
        """``target`` owes nothing any more (its records reached its file, or it was
        poisoned and is never replayed)."""
        self.owed.pop(id(target), None)
        for generation in self.generations():
            generation.waiting.pop(id(target), None)

    def keep_for_redo(self, target: LogTarget) -> None:
        """``target`` was poisoned with no poison document (a full disk, J15): the records
        it owes are only here now, so every generation holding some stays until the next
        start's redo writes them into its file (J14) — never a log that opens healthy
        without them."""
        for generation in self.generations():
            if id(target) in generation.waiting:
                generation.kept = True


class WriterPool:
    """A fixed set of writer threads; use inside one Trio run.

    ``poison_document(target, reason, errno, owed)`` must return the bytes of the
    poison document (``owed``: the frame of the records the log acknowledged through the sync
    log and its file lacks, J5); ``on_disk_failure`` is called on the Trio
    loop with the first disk-level failure. With ``sync_dir`` (a directory :func:`redo`
    emptied), the logs marked ``deferred`` all belong to shard 0, which makes a batch of
    several of them durable with one frame and one ``fdatasync`` of its sync log there (J12).
    """

    def __init__(
        self,
        fs: FileSystem,
        *,
        shards: int,
        poison_document: Callable[[LogTarget, str, int | None, bytes], bytes],
        on_disk_failure: Callable[[DiskFailedError], None],
        sync_dir: str | None = None,
        rotate_bytes: int = ROTATE_BYTES,
    ) -> None:
        if shards < 1:
            raise ValueError("a writer pool needs at least one shard")
        self._fs = fs
        self._poison_document = poison_document
        self._on_disk_failure = on_disk_failure
        self._queues: list[queue.SimpleQueue[_Item]] = [queue.SimpleQueue() for _ in range(shards)]
        self._sync = _SyncLog(sync_dir, 0) if sync_dir is not None else None
        self._rotate_bytes = rotate_bytes
        self._threads = [
            threading.Thread(
                target=self._run, args=(i, q), name=f"pi-runtime-writer-{i}", daemon=True
            )
            for i, q in enumerate(self._queues)
        ]
        self._signals = [os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) for _ in range(shards)]
        """Per shard, the eventfd a task handed over alone waits on (J20)."""
        self._spent: list[int] = []
        """Eventfds given up by a wait that ended with an exception (closed with the pool)."""
        self._busy = [0] * shards
        """Per shard, the hand-offs not yet settled (Trio side)."""
        self._staged: list[list[_Work]] = [[] for _ in range(shards)]
        """Grouped hand-offs of the current scheduler pass, per shard, not yet handed over:
        only the pass's first stager (waiting for the pass to end) hands them over."""
        self._handed_over = trio.lowlevel.ParkingLot()
        self._quiet = trio.lowlevel.ParkingLot()
        """Closing: woken as each shard's last hand-off settles."""
        self._acked: collections.deque[tuple[list[_Work], JournalError | None]] = (
            collections.deque()
        )
        """Settled batches (and failures met between batches, with no items), in the order
        the writers settled them, for the acker to deliver (J21)."""
        self._ack_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        """Written by a writer after each entry it adds to ``_acked``; the acker waits on it."""
        self._acker_stopped = trio.Event()
        self._stopping = False
        """Set once the threads have ended and every task has been woken: the acker's last
        wake-up."""
        self._closed = False
        trio.lowlevel.spawn_system_task(self._acker, name="pi-runtime-writer-acker")
        for thread in self._threads:
            thread.start()

    # -- Trio side -----------------------------------------------------------------

    def _shard_of(self, target: LogTarget) -> int:
        shard = target._shard
        if shard is None:  # its kind is set before its first hand-off, and stays
            shard = target._shard = self._choose_shard(target)
        return shard

    def _choose_shard(self, target: LogTarget) -> int:
        shards = len(self._queues)
        if self._sync is not None:
            if target.deferred:
                return 0
            if shards > 1:
                return 1 + zlib.crc32(os.fsencode(target.path)) % (shards - 1)
        return zlib.crc32(os.fsencode(target.path)) % shards

    async def append(self, target: LogTarget, payload: bytes) -> int:
        """Append one encoded record; return its sequence number once durable.

        The wait is shielded: once handed over, a record's fate is always
        reported to the caller (a cancellation arrives after it).
        """
        if self._closed:
            raise JournalError(ReasonCode.JOURNAL_CLOSED, "the store is closed", path=target.rel)
        if target.poisoned is not None:
            raise target.poisoned
        if target.closed and target.ahead:
            raise JournalError(ReasonCode.JOURNAL_CLOSED, "the log is closed", path=target.rel)
        item = _Append(target, target.next_seq, payload)
        target.next_seq += 1
        handed = perf_seconds()
        await self._handoff(item)
        JOURNAL_APPEND_SECONDS.observe(perf_seconds() - handed)
        return item.seq

    async def _handoff(self, item: _LogWork) -> None:
        target = item.target
        await self._settle(item, self._shard_of(target), staged=target.grouped)

    async def _settle(self, item: _Work, shard: int, *, staged: bool) -> None:
        """Hand ``item`` to ``shard`` (``staged``: with its scheduler pass's) and wait until
        it is settled."""
        global _in_flight
        _in_flight += 1
        alone = not self._busy[shard]
        self._busy[shard] += 1
        try:
            if staged:
                await self._stage(item, shard)
            elif alone:
                # nothing else of this shard in flight: the writer signals this task's
                # eventfd, which wakes it in one scheduler pass (J20)
                item.signal = efd = self._signals[shard]
                self._queues[shard].put(item)
                try:
                    await _signalled(efd)
                except BaseException:  # (not a cancellation: that one waits) its signal may
                    # still come, to wake the shard's next lone task early: never wait on it
                    self._signals[shard] = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
                    self._spent.append(efd)
                    raise
                if item.error is not None:
                    raise item.error
                return
            else:
                self._queues[shard].put(item)
            await item.settled()
        finally:
            self._busy[shard] -= 1
            _in_flight -= 1
            if self._closed and not self._busy[shard]:
                self._quiet.unpark_all()

    async def _stage(self, item: _Work, shard: int) -> None:
        """Add a grouped hand-off to this pass's for its shard. The pass's first stager waits
        for the pass to end, then hands everything staged to the thread as one queue item."""
        staged = self._staged[shard]
        staged.append(item)
        if len(staged) > 1:
            return  # the pass's first stager hands it over
        try:
            await _end_of_pass()
        finally:
            self._staged[shard] = []
            self._queues[shard].put(staged)
            self._handed_over.unpark_all()

    async def close_target(self, target: LogTarget) -> None:
        """Close the file after every append handed over before this call (its pending
        records written and synced first, J12)."""
        target.closed = True
        if self._closed:
            return
        await self._handoff(_Close(target))

    async def open_target(self, target: LogTarget) -> None:
        """Open the log's file now, not at its first append: a log the store keeps open for
        its whole life (the shared logs) then never needs a file descriptor to append, and
        a want of one is met here, at the store's start (L21), where it fails the start
        (``too_many_open_files``) instead of every later append."""
        if self._closed:
            raise JournalError(ReasonCode.JOURNAL_CLOSED, "the store is closed", path=target.rel)
        await self._handoff(_Open(target))

    async def flush_target(self, target: LogTarget) -> None:
        """Write the log's pending records to its file, synced, so that reading the file
        finds every record acknowledged before this call (J12)."""
        if self._closed or not target.deferred:
            return
        await self._handoff(_Flush(target))

    async def retire(self, rels: Iterable[str]) -> None:
        """Before the logs ``rels`` are removed: if a sync log generation holds records of
        any of them, drain the sync log (every owed record written to its file, the
        generations removed), so that no sync log outlives a file it has records of — a log
        made again under the same name would otherwise gain the old one's records at the
        next redo (J18). A disk failure met while draining is reported as any other."""
        if self._closed or self._sync is None:
            return
        await self._settle(_Retire(frozenset(rels)), 0, staged=False)

    async def aclose(self) -> None:
        """Stop every thread after the work already queued. Idempotent."""
        if self._closed:
            return
        self._closed = True
        while any(self._staged):  # a pass's staged items go before the stop, by their stager
            await self._handed_over.park()
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            await trio.to_thread.run_sync(thread.join)
        # a task may still be waiting to be woken by an eventfd its writer wrote, or by the
        # acker: an fd closed under its wait would never wake it
        while any(self._busy):
            await self._quiet.park()
        self._stopping = True
        os.eventfd_write(self._ack_fd, 1)  # the acker delivers what is left, then stops
        await self._acker_stopped.wait()
        for efd in [self._ack_fd, *self._signals, *self._spent]:
            os.close(efd)

    async def _acker(self) -> None:
        """Deliver settled batches as the writers hand them over, in order (J21); stops once
        the pool is closed and nothing is left to deliver (or when the run ends)."""
        acked, fd = self._acked, self._ack_fd
        try:
            while True:
                await trio.lowlevel.wait_readable(fd)
                try:
                    os.eventfd_read(fd)  # (before the deque is read: no hand-over is missed)
                except BlockingIOError:
                    continue
                while acked:
                    self._deliver(*acked.popleft())
                if self._stopping:
                    return
        except trio.Cancelled:  # the run is ending: no task waits any more
            pass
        finally:
            self._acker_stopped.set()

    def _deliver(self, items: list[_Work], failure: JournalError | None) -> None:
        """Wake each item's task (on the loop), once a disk failure is reported."""
        if isinstance(failure, DiskFailedError):
            self._on_disk_failure(failure)
        for item in items:
            if item.signal is None:
                trio.lowlevel.reschedule(item.task)
            else:
                os.eventfd_write(item.signal, 1)

    def _hand_over(self, items: list[_Work], failure: JournalError | None) -> None:
        """(Writer thread) pass settled ``items``, and the disk failure to report before any
        of their tasks runs on, to the acker (J21)."""
        self._acked.append((items, failure))
        os.eventfd_write(self._ack_fd, 1)

    # -- writer threads ------------------------------------------------------------

    def _run(self, shard: int, q: queue.SimpleQueue[_Item]) -> None:
        sync = self._sync if shard == 0 else None
        stopping = False
        while not stopping:
            batch: list[_Work] = []
            item = q.get()
            while True:
                if item is None:
                    stopping = True
                    break
                if isinstance(item, list):
                    batch.extend(item)
                else:
                    batch.append(item)
                if len(batch) >= _MAX_BATCH:
                    break
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
            if batch:
                failure: DiskFailedError | None = None
                try:
                    failure = self._commit(batch)
                except Exception as exc:  # not the disk's: no waiter may be left hanging
                    self._abandon(batch, exc)
                if failure is None and batch[0].signal is not None:
                    # a task handed its item over alone: it waits on the shard's eventfd,
                    # not for the acker (J20); the rest of its batch came after it
                    os.eventfd_write(batch[0].signal, 1)
                    batch = batch[1:]
                if batch:
                    self._hand_over(batch, failure)
            # a full generation's logs get their records after the batch is acknowledged:
            # one log per batch, and more while nothing is queued
            while sync is not None and self._trickle(sync) and q.empty():
                pass
        if sync is not None:
            # every log is closed by now: this removes the generations (the run has ended,
            # so a disk failure here is the next open's to find, J14)
            self._drain(sync)

    def _commit(self, batch: list[_Work]) -> DiskFailedError | None:
        """Write, sync and settle a batch; return a disk failure to report."""
        if len(batch) == 1 and isinstance(lone := batch[0], _Append):  # one lane's step
            error = self._write_group(lone.target, [lone])
            return error if isinstance(error, DiskFailedError) else None
        failure: DiskFailedError | None = None
        pending: dict[int, list[_Append]] = {}
        order: list[LogTarget] = []

        def note(error: JournalError | None) -> None:
            nonlocal failure
            if isinstance(error, DiskFailedError) and failure is None:
                failure = error

        def flush() -> None:
            deferred = [t for t in order if t.deferred and t.poisoned is None]
            if self._sync is not None and len(deferred) > 1:
                order[:] = [t for t in order if not t.deferred or t.poisoned is not None]
                note(self._sync_group(self._sync, [(t, pending[id(t)]) for t in deferred]))
            for target in order:
                note(self._write_group(target, pending[id(target)]))
            pending.clear()
            order.clear()

        for item in batch:
            if isinstance(item, _Append):
                group = pending.get(id(item.target))
                if group is None:
                    group = pending[id(item.target)] = []
                    order.append(item.target)
                group.append(item)
                continue
            flush()
            if isinstance(item, _Retire):
                note(self._retire(item))
                continue
            if isinstance(item, _Open):
                if item.target.poisoned is None:
                    try:
                        self._ready(item.target)
                    except OSError as exc:
                        item.error = self._not_opened(item.target, exc)
                        note(item.error)
                continue
            if item.target._pending:  # a close or a flush: the file first gets its records
                note(self._write_group(item.target, []))
            if isinstance(item, _Close):
                self._close(item)
        flush()
        return failure

    def _abandon(self, batch: list[_Work], exc: Exception) -> None:
        """J5, J8b: an exception that is not an ``OSError`` (a bug, a frame past
        ``MAX_BODY``) while ``batch`` was written. What reached the disk is unknown, so every
        log of the batch is poisoned, as for a failed write, and every item gets an error —
        even one whose record may have reached the disk, which its poisoned log then bounds
        (J5): no caller waits forever, and the thread goes on with the next batch."""
        for item in batch:
            target = item.target if isinstance(item, _Handoff) else None
            if item.error is None:
                item.error = (
                    self._poison_unknown(target, exc)
                    if target is not None
                    else JournalError(ReasonCode.JOURNAL_POISONED, f"the writer failed: {exc!r}")
                )

    def _poison_unknown(self, target: LogTarget, exc: Exception) -> JournalError:
        """Poison ``target`` after ``exc``, an exception that is not an ``OSError``, met
        while its records were written: what reached its file is unknown (J5, J8b)."""
        if target.poisoned is None:
            error = OSError(errno.EINVAL, f"the writer failed: {exc!r}")
            first, owed = target._pending_first, target._pending
            try:
                self._poison(target, error)
            except Exception:  # no poison document: the in-memory poison refuses appends,
                target.poisoned = JournalError(  # and what it owes stays as on a full disk
                    ReasonCode.JOURNAL_POISONED, str(error), path=target.rel
                )
                with contextlib.suppress(Exception):
                    target.unrecorded = encode_frame(first, owed) if owed else b""
                if self._sync is not None:  # (J15: kept for the next start's redo, J14)
                    self._sync.keep_for_redo(target)
                    self._sync.written(target)
        assert target.poisoned is not None
        return target.poisoned

    def _retire(self, item: _Retire) -> DiskFailedError | None:
        """J18: drain the sync log if a generation names any of ``item.rels``; if one that does
        cannot be removed, the removal of those logs is refused. Returns a disk failure met
        while draining, to be reported."""
        sync = self._sync
        if sync is None or all(g.rels.isdisjoint(item.rels) for g in sync.generations()):
            return None
        failure = self._drain(sync)
        stays = [g for g in sync.retiring if not g.rels.isdisjoint(item.rels)]
        if stays:
            exc = sync.left_error or OSError(errno.EIO, "a sync log generation stays")
            rel = os.path.relpath(stays[0].path, os.path.dirname(sync.directory))
            if descriptors_exhausted(exc):  # L21: not the disk's (J6); asked again, tried again
                item.error = JournalError(
                    ReasonCode.TOO_MANY_OPEN_FILES,
                    "a sync log generation holding these logs' records could not be removed "
                    f"for want of a file descriptor ({exc.strerror or exc}); the removal is "
                    "refused, and tried again when asked again",
                    path=rel,
                )
                return failure
            refused = disk_error(exc, rel) or DiskFailedError(
                ReasonCode.DISK_FAILED,
                f"a sync log generation holding these logs' records cannot be removed: {exc}",
                path=rel,
            )
            item.error = refused
            return failure or refused  # reported too: the host stops admitting (J6)
        return failure

    def _write_group(self, target: LogTarget, group: list[_Append]) -> JournalError | None:
        """Write the log's pending records (J12) and ``group`` as one frame, and sync it."""
        if target.poisoned is not None:
            for item in group:
                item.error = target.poisoned
            return None
        fs = self._fs
        owed = target._pending
        if owed:
            first = target._pending_first
            payloads = [*owed, *(item.payload for item in group)]
        else:
            first = group[0].seq
            payloads = [item.payload for item in group]
        frame = encode_frame(first, payloads)
        try:
            handle = self._ready(target)
        except OSError as exc:
            error = self._open_failed(target, exc)
            for item in group:
                item.error = error
            return error
        try:
            written = self._put(target, handle, frame)
            if written != len(frame):
                raise OSError(errno.EIO, f"short write: {written} of {len(frame)} bytes")
            synced = perf_seconds()
            fs.fdatasync(handle)
            JOURNAL_FDATASYNC_SECONDS.observe(perf_seconds() - synced)
            JOURNAL_BATCH_RECORDS.observe(len(payloads))
        except OSError as exc:
            error = self._poison(target, exc)
            for item in group:
                item.error = error
            return error
        target.good_length += len(frame)
        if owed:
            target._pending = []
            if self._sync is not None:
                self._sync.written(target)
        return None

    def _open_failed(self, target: LogTarget, exc: OSError) -> JournalError:
        """Making ``target`` ready for a write (:meth:`_ready`) failed: nothing of this write
        reached its file. For want of a file descriptor (L21), with nothing owed to the file,
        the log is not poisoned (no write failed, J5) but refused ``too_many_open_files`` in
        memory, its handle (if it was opened) closed — its next opening reads the file anew
        (its numbering too: the refused records took sequence numbers). Any other failure
        poisons it, as a failed write does."""
        if descriptors_exhausted(exc) and not target._pending:
            target.poisoned = self._refused(
                target, exc, "; it is opened again once descriptors are free"
            )
            return target.poisoned
        return self._poison(target, exc)

    def _not_opened(self, target: LogTarget, exc: OSError) -> JournalError:
        """An :class:`_Open` failed. For want of a file descriptor, with nothing owed, the log
        is refused this once only — no record took a number — and opened at its next
        append; any other failure as :meth:`_open_failed`."""
        if not descriptors_exhausted(exc) or target._pending:
            return self._open_failed(target, exc)
        return self._refused(target, exc)

    def _refused(self, target: LogTarget, exc: OSError, then: str = "") -> JournalError:
        """``target`` could not be made ready for want of a file descriptor: its handle, if
        it was opened, closed (a refused log holds none); the refusal (L21)."""
        if target._handle is not None:
            with contextlib.suppress(OSError):
                self._fs.close(target._handle)
            target._handle = None
        return JournalError(
            ReasonCode.TOO_MANY_OPEN_FILES,
            f"the log's file could not be opened: {exc.strerror or exc}{then}",
            path=target.rel,
        )

    def _ready(self, target: LogTarget) -> int:
        """The log's handle (:meth:`_open`), and for a file it created, its directory entry
        synced before any record goes in (J13): a sync of the directory takes a descriptor
        too, so a want of one meets the log before anything is written to it (L21)."""
        handle = self._open(target)
        if target._create:
            self._fs.fsync_dir(os.path.dirname(target.path))
            target._create = False
        return handle

    def _open(self, target: LogTarget) -> int:
        """The log's handle, opened (and the file created) on first use. A log allocated
        ahead starts with its frames alone: a tail past them (never acknowledged) is cut,
        so the zeros after the last frame are all it ever holds there (J19)."""
        if target._handle is not None:
            return target._handle
        fs = self._fs
        if not target.ahead:
            target._handle = fs.open_append(target.path)
            return target._handle
        handle = fs.open_write(target.path)
        try:
            if fs.size(handle) != target.good_length:
                # synced before any frame is written over the cut: blocks a truncate freed
                # but had not committed could otherwise keep their old bytes past that frame
                fs.truncate(handle, target.good_length)
                fs.fdatasync(handle)
        except OSError:
            fs.close(handle)
            raise
        target._handle = handle
        target._allocated = target.good_length
        return handle

    def _put(self, target: LogTarget, handle: int, frame: bytes) -> int:
        """Write ``frame`` at the log's end: appended, or over the zeros allocated ahead,
        allocating more first when it does not fit (J19). Returns the bytes written.

        A short write still poisons the log (J5), but Linux writes what fits and returns the
        short count, and only a write of the rest says why: that one is made, so that a disk
        that filled up in the middle of a frame raises ``ENOSPC`` — ``disk_full`` — and is not
        reported as a failed disk (J6a). What it wrote is cut with the rest (J5)."""
        fs = self._fs
        if not target.ahead:
            written = fs.write(handle, frame)
            if 0 < written < len(frame):
                fs.write(handle, frame[written:])  # raises why, if the disk says
            return written
        end = target.good_length + len(frame)
        if end > target._allocated:
            try:
                fs.allocate(handle, target._allocated, end + target.ahead - target._allocated)
                target._allocated = end + target.ahead
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # no room to allocate ahead: the frame alone extends the file, as an append
                # does; only a frame that does not fit fails (and poisons the log, J5)
                target._allocated = end
        written = fs.pwrite(handle, frame, target.good_length)
        if 0 < written < len(frame):
            fs.pwrite(handle, frame[written:], target.good_length + written)  # (as above)
        return written

    def _sync_group(
        self, sync: _SyncLog, groups: list[tuple[LogTarget, list[_Append]]]
    ) -> JournalError | None:
        """Make the records of several logs durable with one frame of the sync log and one
        ``fdatasync`` (J12, J13); they stay owed to their files (``_pending``)."""
        fs = self._fs
        failure: JournalError | None = None
        ready: list[tuple[LogTarget, list[_Append]]] = []
        for target, group in groups:
            try:
                self._ready(target)  # J13: the file is durable before its records
            except OSError as exc:  # this log's own fault (J15)
                error = self._open_failed(target, exc)
                for item in group:
                    item.error = error
                if failure is None and isinstance(error, DiskFailedError):
                    failure = error
                continue
            ready.append((target, group))
        if not ready:
            return failure
        entries = [
            encode_entry(target.rel, group[0].seq, [item.payload for item in group])
            for target, group in ready
        ]
        try:
            if sync.handle is not None and sync.size + sum(map(len, entries)) > sync.capacity:
                self._switch(sync)  # (a frame may outgrow a fresh one: it grows)
                # a switch may catch up a full generation and poison a log of this batch
                # whose file failed: its records are refused, never acknowledged (J5)
                refused = [(t, g) for t, g in ready if t.poisoned is not None]
                for target, group in refused:
                    for item in group:
                        item.error = target.poisoned
                if refused:
                    kept = [i for i, (t, _) in enumerate(ready) if t.poisoned is None]
                    ready = [ready[i] for i in kept]
                    entries = [entries[i] for i in kept]
                    if not ready:
                        return failure
            if sync.handle is None:
                self._begin(sync)
            assert sync.handle is not None
            assert sync.current is not None
            frame = encode_frame(sync.next_seq, entries)
            written = fs.pwrite(sync.handle, frame, sync.size)
            if written != len(frame):
                raise OSError(errno.EIO, f"short write: {written} of {len(frame)} bytes")
            synced = perf_seconds()
            fs.fdatasync(sync.handle)
            JOURNAL_FDATASYNC_SECONDS.observe(perf_seconds() - synced)
            JOURNAL_BATCH_RECORDS.observe(sum(len(group) for _, group in ready))
        except OSError as exc:
            fallback = self._sync_failed(sync, ready, exc)
            return failure or fallback
        sync.next_seq += len(entries)
        sync.size += len(frame)
        current = sync.current
        for target, group in ready:
            current.rels.add(target.rel)
            current.waiting[id(target)] = target
            if not target._pending:
                target._pending_first = group[0].seq
                sync.owed[id(target)] = target
            target._pending.extend(item.payload for item in group)
        if sync.size >= self._rotate_bytes:
            self._switch(sync)
        return failure

    def _sync_failed(
        self, sync: _SyncLog, groups: list[tuple[LogTarget, list[_Append]]], exc: OSError
    ) -> JournalError | None:
        """J15: the sync log's write or sync failed. Its generation is abandoned (after a
        failed ``fdatasync`` its pages cannot be trusted) and every log of the batch takes
        its own path instead — its owed and new records written to its file and synced —
        so only a log whose own file then fails is poisoned. The sync log's error is still a
        disk failure when its errno says so (J6)."""
        rel = f"{SYNC_DIR}/{generation_name(sync.generation)}"
        first: JournalError | None = disk_error(exc, rel)
        for target, group in groups:
            error = self._write_group(target, group)
            if first is None and isinstance(error, DiskFailedError):
                first = error
        drained = self._drain(sync)
        return first or drained

    def _begin(self, sync: _SyncLog) -> None:
        """Start a generation: a new file zero-filled to its capacity and synced, with its
        directory entry, so that each frame then overwrites zeros in place and its
        ``fdatasync`` carries no size change (J12: 25-40 % cheaper on this disk than a sync
        after an append). A name a failed removal left is skipped."""
        fs = self._fs
        while True:
            try:
                handle = fs.open_exclusive(sync.path)
                break
            except FileExistsError:
                sync.generation += 1
        sync.handle = handle
        sync.current = _Generation(sync.path)
        capacity = self._rotate_bytes + _SLACK
        zeros = bytes(min(capacity, 1 << 20))
        filled = 0
        while filled < capacity:
            written = fs.write(handle, zeros[: capacity - filled])
            if written <= 0:
                raise OSError(errno.EIO, "a zero fill made no progress")
            filled += written
        fs.fsync(handle)
        fs.fsync_dir(sync.directory)
        sync.capacity = capacity

    def _switch(self, sync: _SyncLog) -> None:
        """The generation is full: the next batch begins the next one. Its logs' owed
        records reach their files a log at a time between batches (:meth:`_trickle`), or
        sooner by a read, a close or a single-log append; it is removed once none is left
        (J12). So a full generation costs no batch a stall of a sync per owed log."""
        current = sync.current
        if current is None:
            return
        if sync.handle is not None:
            with contextlib.suppress(OSError):
                self._fs.close(sync.handle)
            sync.handle = None
        sync.current = None
        sync.retiring.append(current)
        sync.generation += 1
        sync.capacity = 0
        sync.size = 0
        sync.next_seq = 0
        waiting = [g for g in sync.retiring if g.waiting]  # (not one that only stays)
        if len(waiting) > _RETIRING:  # the trickle fell behind: catch up now
            oldest = waiting[0]
            for target in list(oldest.waiting.values()):
                self._report(self._write_group(target, []))
            oldest.waiting.clear()
        self._remove_done(sync)

    def _trickle(self, sync: _SyncLog) -> bool:
        """Write one log's owed records to its file, for the oldest generation that waits
        for any, and remove what no longer waits; whether there is more to do."""
        for generation in sync.retiring:
            if generation.waiting:
                target = next(iter(generation.waiting.values()))
                try:
                    self._report(self._write_group(target, []))
                except Exception as exc:  # not the disk's: the thread must go on (J8b)
                    self._poison_unknown(target, exc)
                generation.waiting.pop(id(target), None)  # (a poisoned log is never replayed)
                self._remove_done(sync)
                return any(generation.waiting for generation in sync.retiring)
        return False

    def _drain(self, sync: _SyncLog) -> DiskFailedError | None:
        """Write every owed record to its file, synced, then remove every generation (a
        clean close, a failed sync log, J18). A log whose write fails is poisoned (J5); the
        first disk failure among them is returned, to be reported (J6)."""
        failure: DiskFailedError | None = None
        for target in list(sync.owed.values()):
            error = self._write_group(target, [])
            if failure is None and isinstance(error, DiskFailedError):
                failure = error
        sync.owed.clear()
        self._switch(sync)
        for generation in sync.retiring:
            generation.waiting.clear()
        self._remove_done(sync)
        return failure

    def _remove_done(self, sync: _SyncLog) -> None:
        """Remove the earlier generations no log waits for and none is kept for (J15),
        durably. A generation that stays because its removal failed holds nothing a file
        lacks, so the next open's redo finds it done; but it still names its logs, so until
        it is gone none of them may be removed (J18), and each call tries to remove it
        again. A kept one stays for that redo."""
        done = [g for g in sync.retiring if not g.waiting and not g.kept]
        if not done:
            return
        fs = self._fs
        kept: list[_Generation] = []
        for generation in done:
            try:
                fs.unlink(generation.path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                kept.append(generation)
                sync.left_error = exc
        try:
            fs.fsync_dir(sync.directory)
        except OSError as exc:  # removed, but not durably
            kept = done
            sync.left_error = exc
        sync.retiring = [g for g in sync.retiring if g.waiting or g.kept or g in kept]

    def _report(self, error: JournalError | None) -> None:
        """Report a disk failure met outside a batch (writing owed records between
        batches) on the Trio loop, in order with the batches (J21)."""
        if isinstance(error, DiskFailedError):
            self._hand_over([], error)

    def _poison(self, target: LogTarget, exc: OSError) -> JournalError:
        """Truncate back to the last good frame, record the poison, refuse more."""
        reason = f"{exc.strerror or exc}"
        error: JournalError | None = disk_error(exc, target.rel)
        if error is None:
            error = JournalError(
                ReasonCode.JOURNAL_POISONED, f"an append failed: {reason}", path=target.rel
            )
        target.poisoned = JournalError(
            ReasonCode.JOURNAL_POISONED,
            f"an earlier append failed ({reason}); the log accepts no more records",
            path=target.rel,
        )
        owed = encode_frame(target._pending_first, target._pending) if target._pending else b""
        target._pending = []
        fs = self._fs
        try:
            if target._handle is not None:
                fs.truncate(target._handle, target.good_length)
                fs.fdatasync(target._handle)
        except OSError:
            pass  # the poison document below still bounds what a reader accepts
        recorded = False
        try:
            document = self._poison_document(target, reason, exc.errno, owed)
            atomic_write(fs, target.poison_path, document)
            recorded = True
        except OSError:
            pass  # nothing more can be made durable; the in-memory poison holds
        if not recorded:
            target.unrecorded = owed
        if self._sync is not None:
            if not recorded:
                self._sync.keep_for_redo(target)
            self._sync.written(target)
        return error

    def _close(self, item: _Close) -> None:
        target = item.target
        if target._handle is not None:
            if target._allocated > target.good_length and target.poisoned is None:
                # the zeros allocated ahead go with the last append: a closed log holds its
                # frames alone (not synced: zeros a crash keeps are a torn tail, J3, J19)
                with contextlib.suppress(OSError):
                    self._fs.truncate(target._handle, target.good_length)
                target._allocated = target.good_length
            try:
                self._fs.close(target._handle)
            except OSError as exc:  # pragma: no cover - close on a local fs
                item.error = exc
            target._handle = None


TMP_MARK: Final = ".tmp-"
"""Temporary files of :func:`atomic_write` carry this in their name (swept at takeover)."""


class StagedFile:
    """A replacement of ``path`` written in parts (blocking): an exclusive temp file beside
    it (:data:`TMP_MARK` in its name, swept at takeover); :meth:`commit` syncs it, renames it
    over ``path`` and syncs the directory, so ``path`` is the old file or the new one whole;
    :meth:`discard` removes it (after any failure before the rename)."""

    def __init__(self, fs: FileSystem, path: str) -> None:
        self._fs = fs
        self.path = path
        self.tmp = f"{path}{TMP_MARK}{secrets.token_hex(8)}"
        self._handle = fs.open_exclusive(self.tmp)
        self.renamed = False

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = self._fs.write(self._handle, bytes(view))
            if n <= 0:
                raise OSError(errno.EIO, "write made no progress")
            view = view[n:]

    def commit(self) -> None:
        fs = self._fs
        fs.fsync(self._handle)
        fs.close(self._handle)
        self._handle = -1
        fs.rename(self.tmp, self.path)
        self.renamed = True
        fs.fsync_dir(os.path.dirname(self.path))

    def discard(self) -> None:
        if self._handle != -1:
            with contextlib.suppress(OSError):
                self._fs.close(self._handle)
            self._handle = -1
        if not self.renamed:
            with contextlib.suppress(OSError):
                self._fs.unlink(self.tmp)


def atomic_write(fs: FileSystem, path: str, data: bytes) -> None:
    """Exclusive temp file, write, fsync, rename over ``path``, directory fsync
    (:class:`StagedFile`). The temp name is unique (random), so a file left by a crash never
    blocks a later replace; on any failure before the rename the temp file is removed."""
    staged = StagedFile(fs, path)
    try:
        staged.write(data)
        staged.commit()
    finally:
        staged.discard()


def disk_error(exc: OSError, rel: str) -> DiskFailedError | None:
    """The :class:`DiskFailedError` an ``OSError`` amounts to, if the disk failed."""
    code = _DISK_ERRNOS.get(exc.errno or 0)
    if code is None:
        return None
    return DiskFailedError(code, f"the disk failed: {exc.strerror or exc}", path=rel)
