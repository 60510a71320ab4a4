"""The state directory: its lock, its layout, and the logs and documents in it.

Layout (docs/design/journal.md)::

    state/                     0700, checked at every open
      LOCK                     flock'd by the single owner for its whole life
      owner.json               the owner record (pid, start time, boot id, nonce)
      token                    the websocket token (0600; written by the server)
      admissions/admissions.log   group-committed admission log (shared)
      deliveries/<hash>.log    one append-only log per delivery
      deliveries/<hash>.log.poison   present only if that log was poisoned
      sync/<generation>.log    the step sync log: delivery records made durable together,
                               owed to their files (J12-J18; replayed at open)
      lanes/<hash>/lane.log    one log per lane (epochs, outbox, receipts)
      lanes/<hash>/session.jsonl    the lane's Pi session
      results.log              the numbered result outbox (shared)
      expired.ids              the expired-id filter (docs/design/retention.md RT4)
      tasks-expired.ids        the expired task ids, the same format (RT12)
      trash/<name>.gone-<hex>  a directory retention is removing, renamed here first (RT15)
      receipts.sqlite          the receipt store

File names derive from hashes of client-chosen ids, never the raw ids, and
records store paths relative to the state directory, so a state directory can
be moved or restored as a whole. Sockets live in a short runtime directory
(:func:`runtime_dir`) because a socket path is limited to 107 bytes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import secrets
import stat
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec
import trio

from .._clock import Clocks
from .._errors import (
    DiskFailedError,
    JournalError,
    ReasonCode,
    StateDirError,
    StateDirLockedError,
    descriptors_exhausted,
)
from .._linux._fs import FileSystem, OsFileSystem
from .._linux._proc import ProcessIdentity, current_identity, is_alive
from .._records import SCHEMA_VERSION, Compacted, Header, LogKind, Poison, Record
from ._expired import EXPIRED, ExpiredIds, read_expired
from ._fence import Fence
from ._frame import encode_frame
from ._interface import Log
from ._journal import Journal, LogContents, decode_log, encode_record, read_log, slimmed
from ._sync_log import SYNC_DIR, Redone, redo
from ._trash import TRASH, discard_tree, sweep_trash
from ._writer import TMP_MARK, LogTarget, StagedFile, WriterPool, atomic_write, disk_error

__all__ = [
    "OwnerRecord",
    "Store",
    "acquire_lock",
    "delivery_key",
    "lane_key",
    "open_store",
    "require_journal",
    "runtime_dir",
]

_T = TypeVar("_T")

ADMISSIONS: Final = "admissions/admissions.log"
RESULTS: Final = "results.log"
TASKS_EXPIRED: Final = "tasks-expired.ids"
"""The expired task ids (docs/design/retention.md RT12), in the expired-id filter's format."""
OWNER: Final = "owner.json"
_FRAME_RECORDS: Final = 1024
"""Records per frame of a compacted log."""
LOCK: Final = "LOCK"


DELIVERY_AHEAD: Final = 1024 * 1024
"""A delivery's log is allocated this far ahead of its frames (J19): a step's sync then
commits no size change, only each growth does (performance.md, "Item 2: a log allocated
ahead"). Cut back to the frames when the log is closed."""
COMPACT_CHUNK: Final = 1024 * 1024
"""The piece a compaction writes at a time (:meth:`Store.rewrite_shared`)."""
DIR_SYNC_RETRY: Final = 0.05
"""The first wait before a replacement's directory sync, refused for want of a file
descriptor, is tried again (doubling, seven tries: about 6 s in all; lanes.md L21)."""


class OwnerRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Who holds the state directory: an exact process plus a random nonce."""

    pid: int
    start_time: int
    boot_id: str
    nonce: str
    started_ms: int

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(pid=self.pid, start_time=self.start_time, boot_id=self.boot_id)


def _key(kind: str, client_id: str) -> str:
    return hashlib.sha256(f"{kind}\0{client_id}".encode()).hexdigest()[:32]


def delivery_key(delivery_id: str) -> str:
    """The file-name key of a delivery (a hash; never the raw id)."""
    return _key("delivery", delivery_id)


@functools.lru_cache(maxsize=4096)
def lane_key(lane: str) -> str:
    """The directory key of a lane (a hash; never the raw room id). Remembered for the
    rooms used most: every admission asks for its room's."""
    return _key("lane", lane)


def runtime_dir(state_dir: Path) -> Path:
    """The short private directory (0700) for this state directory's sockets."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    base = (
        Path(xdg) / "pi-runtime"
        if xdg and os.path.isdir(xdg)
        else Path(f"/tmp/pi-runtime-{os.geteuid()}")
    )
    digest = hashlib.sha256(os.fsencode(state_dir.resolve())).hexdigest()[:8]
    path = base / digest
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    base.chmod(0o700)
    _check_private(base)
    _check_private(path)
    return path


def require_journal(state_dir: Path) -> None:
    """Refuse ``state_dir_invalid`` a directory that holds no file-store journal (a host of a
    PostgreSQL deployment, a typo) — before a command with no server opens it and so creates
    one there."""
    if not (state_dir / ADMISSIONS).exists():
        raise StateDirError(
            ReasonCode.STATE_DIR_INVALID,
            f"{state_dir} holds no file-store journal (no {ADMISSIONS}); check --state-dir",
        )


def _check_private(path: Path) -> None:
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise StateDirError(ReasonCode.STATE_DIR_INVALID, f"{path} is not a directory")
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        fix = f"chmod 700 {path}"  # another user's directory needs its owner changed first
        if info.st_uid != os.geteuid():
            fix = f"chown {os.geteuid()} {path} (as root), then {fix}"
        raise StateDirError(
            ReasonCode.STATE_DIR_INSECURE,
            f"{path} must be owned by uid {os.geteuid()} with mode 0700 "
            f"(it is uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}); "
            f"fix it with: {fix}",
        )


class Store:
    """An open state directory, owned by this process. Use :func:`open_store`."""

    def __init__(
        self,
        root: Path,
        fs: FileSystem,
        clocks: Clocks,
        pool: WriterPool,
        owner: OwnerRecord,
        previous_owner: OwnerRecord | None,
    ) -> None:
        self.root = root
        self.fs = fs
        self.clocks = clocks
        self.owner = owner
        self.previous_owner = previous_owner
        """The proven-dead owner this process took over from, if any."""
        self._pool = pool
        self._open: dict[str, Journal] = {}
        self._unrecorded: dict[str, Poison] = {}
        """Logs poisoned in this run whose poison document could not be written (J15)."""
        self._opening: dict[str, trio.Lock] = {}
        """Per log being opened or created by :meth:`_open_or_create`: one at a time."""
        self._disk_failure: DiskFailedError | None = None
        self.admissions: Journal
        self.results: Journal
        self.expired = ExpiredIds()
        """The expired-id filter (RT4): ``store.expired.holds(delivery_key(id), now_ms=…)``."""
        self.expired_tasks = ExpiredIds()
        """The expired task ids (RT12): ``store.expired_tasks.holds(lane_key(…), now_ms=…)``."""
        self._expiring = trio.Lock()
        """One expiry at a time: each reads the filter it adds to, and replaces the file."""
        self.redone = Redone(0, 0, (), ())
        """What the open replayed from the sync log (J14)."""

    # -- health --------------------------------------------------------------------

    @property
    def disk_failure(self) -> DiskFailedError | None:
        """The first disk-level failure; once set the host must stop admitting."""
        return self._disk_failure

    def _on_disk_failure(self, error: DiskFailedError) -> None:
        if self._disk_failure is None:
            self._disk_failure = error

    async def _blocking(self, rel: str, fn: Callable[..., _T], *args: Any) -> _T:
        """Run blocking file work off the loop; a failing disk stops admissions (J6)."""
        try:
            return await trio.to_thread.run_sync(fn, *args)
        except OSError as exc:
            error = self._disk_failed(exc, rel)
            if error is None:
                raise
            raise error from exc

    def _disk_failed(self, exc: OSError, rel: str) -> DiskFailedError | None:
        """The disk failure ``exc`` amounts to, reported (J6); ``None`` if it is not one."""
        error = disk_error(exc, rel)
        if error is not None:
            self._on_disk_failure(error)
        return error

    async def remove_logs(self, rels: Sequence[str]) -> int:
        """Remove the logs ``rels`` (retention, RT2), durably: :meth:`remove_files`."""
        return await self.remove_files(rels)

    async def remove_files(self, rels: Sequence[str]) -> int:
        """Remove the files ``rels`` (logs nothing will read again, their sessions) durably —
        unlink, then one fsync of each directory they were in — in one trip off the loop:
        retention (RT2). How many were there. A sync log generation holding records of any
        of them is drained first (J18: a log made again under a removed one's name must not
        gain its records at the next open), and a log's poison document goes with it (J22:
        nor its poison)."""
        await self._pool.retire(rels)
        at = [""]  # what the work was on when it failed (the error names it)

        def remove() -> int:
            removed, directories = 0, set()
            for rel in rels:
                at[0] = rel
                path = self.path(rel)
                try:
                    self.fs.unlink(path)
                except FileNotFoundError:
                    continue
                removed += 1
                directories.add(os.path.dirname(path))
                with contextlib.suppress(FileNotFoundError):  # J22: its poison goes with it
                    self.fs.unlink(path + ".poison")
            for directory in sorted(directories):
                at[0] = os.path.relpath(directory, self.root)
                self.fs.fsync_dir(directory)
            return removed

        try:
            removed = await trio.to_thread.run_sync(remove)
        except OSError as exc:
            error = self._disk_failed(exc, at[0])
            if error is None:
                raise
            raise error from exc
        for rel in rels:  # a log made again under the name is a new one
            self._unrecorded.pop(rel, None)
        return removed

    # -- compaction (docs/design/retention.md RT4-RT7) -----------------------------------

    async def expire(self, since_ms: Mapping[str, int], *, forget_ms: int) -> None:
        """Add deliveries to the expired-id filter, each held back ``forget_ms`` (``[retention]
        forget_days``) from its time in ``since_ms`` (RT4), durably (the file replaced
        atomically), every entry counted with ``forget_ms`` from then on; those past it are
        dropped."""
        async with self._expiring:  # never two built on the same filter (the last would win)
            now = self.clocks.wall.time_ms()
            keyed = {delivery_key(d): when for d, when in since_ms.items()}
            # off the loop: the whole filter is decoded, sorted and joined (a million
            # entries take seconds, and admissions would wait that long)
            merge = functools.partial(self.expired.merged, keyed, now_ms=now, forget_ms=forget_ms)
            data = await trio.to_thread.run_sync(merge)
            await self._blocking(EXPIRED, atomic_write, self.fs, self.path(EXPIRED), data)
            # what is on disk now, checked as a start would check it
            self.expired = await trio.to_thread.run_sync(read_expired, self.fs, self.path(EXPIRED))

    async def expire_tasks(self, since_ms: Mapping[str, int], *, forget_ms: int) -> None:
        """Add tasks (by id) to the expired-task filter (``tasks-expired.ids``, RT12), as
        :meth:`expire` does deliveries. A filter of its own: the room compaction replaces
        ``expired.ids`` on its own schedule."""
        async with self._expiring:  # the periodic retention and a ``task forget`` at once
            now = self.clocks.wall.time_ms()
            keyed = {lane_key(f"task:{t}"): when for t, when in since_ms.items()}
            merge = functools.partial(
                self.expired_tasks.merged, keyed, now_ms=now, forget_ms=forget_ms
            )
            data = await trio.to_thread.run_sync(merge)
            path = self.path(TASKS_EXPIRED)
            await self._blocking(TASKS_EXPIRED, atomic_write, self.fs, path, data)
            self.expired_tasks = await trio.to_thread.run_sync(
                functools.partial(read_expired, self.fs, path, rel=TASKS_EXPIRED)
            )

    async def slim_log(self, rel: str, records: list[Record]) -> None:
        """Replace the log ``rel`` — one nothing appends to any more (an ended task's lane
        log, RT12) — by a file holding a new header, a :class:`Compacted` record and
        ``records``, atomically (temp file, fsync, rename, directory fsync)."""
        journal = self._open.get(rel)
        if journal is not None:
            await self.close_log(journal)
        contents = await self.read(rel)
        new = slimmed(contents, records, now_ms=self.clocks.wall.time_ms())
        data = await trio.to_thread.run_sync(_framed, new)
        await self._blocking(rel, atomic_write, self.fs, self.path(rel), data)

    async def remove_tree(self, rel: str) -> bool:
        """Remove the directory ``rel`` and everything in it (an expired task's lane
        directory, RT12), crash-safe (RT15, :func:`~runtime._journal._trash.discard_tree`):
        renamed into ``trash/`` first, durably, then removed there. Whether it was there.
        What a crash left in the trash goes at the next :meth:`sweep_trash`."""
        return await self._blocking(rel, discard_tree, self.fs, str(self.root), rel)

    async def sweep_trash(self) -> list[str]:
        """Remove what a crash left in ``trash/`` (RT15): the names removed."""
        return await self._blocking(TRASH, sweep_trash, self.fs, str(self.root))

    async def rewrite_shared(
        self,
        journal: Journal,
        records: list[Record],
        *,
        last_seq: int = 0,
        held: Callable[[], AbstractAsyncContextManager[list[Record]]] | None = None,
        bytes_per_second: int = 0,
    ) -> Journal:
        """Replace the shared log ``journal`` (:attr:`admissions` or :attr:`results`) by a
        file holding ``records`` (RT7): a new header and a :class:`Compacted` record first,
        same framing, written to a temp file beside it; then, while ``held()`` holds back
        whatever appends to the log and yields what was appended since ``records`` was taken
        (none without it: the caller guarantees nothing appends), those are written after
        them, the file synced, renamed over the log, the directory synced — so the old file
        is whole until the new one is durable, a crash leaves one or the other, and appends
        wait only for the catch-up and the rename, not for the bulk of the file. What is
        then the log: the new file; after a failed rewrite, whichever file is there (the old
        one, unless only the directory sync failed), read back from disk. A failed directory
        sync after the rename is a disk failure whatever its errno (J6): the new name may not
        survive a power loss, nor what is appended to it.

        With ``bytes_per_second``, the bulk is written in :data:`COMPACT_CHUNK` pieces at no
        more than that rate (RT10's byte budget: a sleep after each piece, nothing held
        meanwhile); the catch-up, while appends wait, is written at once.

        The :class:`Compacted` mark counts exactly the records the old file holds as it is
        replaced (after its header and any mark of its own) and the new one does not carry
        over (RT6) — ``records`` and the catch-up, each standing for one record of the old
        file (an admission slimmed to its idempotency record counts as carried over). That
        is known only once appends wait, so the mark is written last, in place: the new
        file's first frame (its header and the mark) is padded to a size the count never
        outgrows (:func:`_head`) and overwritten before the file is synced."""
        rel, contents = journal.rel, journal.contents
        kind = contents.header.kind
        marked = len(contents.records) > 1 and isinstance(contents.records[1], Compacted)
        header = Header(
            schema_version=SCHEMA_VERSION,
            kind=kind,
            subject=contents.header.subject,
            created_ms=self.clocks.wall.time_ms(),
        )
        mark = Compacted(compacted_ms=header.created_ms, removed=0, last_seq=last_seq)
        written: list[Record] = [header, mark, *records]
        head = _head(header, mark)
        data = head + await trio.to_thread.run_sync(functools.partial(_framed, records, first=2))
        path = self.path(rel)
        staged = await self._blocking(rel, StagedFile, self.fs, path)
        try:
            for start in range(0, len(data), COMPACT_CHUNK):
                piece = data[start : start + COMPACT_CHUNK]
                await self._blocking(rel, staged.write, piece)
                if bytes_per_second:
                    await trio.sleep(len(piece) / bytes_per_second)
            async with held() if held is not None else _nothing_since() as since:
                if since:
                    tail = _framed(since, first=len(written))
                    await self._blocking(rel, staged.write, tail)
                    written += since
                    data += tail
                await self.close_log(journal)  # nothing appends to it now
                before = journal.next_seq - 1 - marked  # what the old file holds, all of it
                carried = len(written) - 2
                mark = msgspec.structs.replace(mark, removed=max(0, before - carried))
                written[1] = mark
                try:
                    await self._blocking(
                        rel, _commit_with_head, self.fs, staged, _head(header, mark)
                    )
                except BaseException as exc:
                    if staged.renamed and await self._dir_synced_after_all(exc, path):
                        pass  # (L21) the new file is the log, its name durable: go on
                    else:
                        await self._failed_rewrite(rel, kind, staged, exc)
                        raise
                # the file holds exactly what was framed and synced: not read back
                target = LogTarget(
                    path=path,
                    rel=rel,
                    good_length=len(data),
                    next_seq=len(written),
                    poison_path=path + ".poison",
                    create=False,
                )
                contents = LogContents(rel, tuple(written), len(data), 0)
                adopted = self._adopt(Journal(self._pool, target, contents))
                # L21: opened while appends still wait, in the descriptor the old file's
                # close just gave back — so no admission opens it (refused: at its next)
                with contextlib.suppress(JournalError):
                    await adopted.hold_open()
                return adopted
        finally:
            await trio.to_thread.run_sync(staged.discard)

    async def _dir_synced_after_all(self, exc: BaseException, path: str) -> bool:
        """A replacement's directory sync after its rename met a want of file descriptors
        (the sync opens the directory): tried again a few times over about 6 s while appends
        still wait (L21). Whether it worked — the new name is then durable, as if the first
        had."""
        if not descriptors_exhausted(exc):
            return False
        delay = DIR_SYNC_RETRY
        for _ in range(7):
            await trio.sleep(delay)
            delay *= 2
            try:
                await trio.to_thread.run_sync(self.fs.fsync_dir, os.path.dirname(path))
            except OSError as again:
                if not descriptors_exhausted(again):
                    return False
                continue
            return True
        return False

    async def _failed_rewrite(
        self, rel: str, kind: LogKind, staged: StagedFile, exc: BaseException
    ) -> None:
        """A replacement of the shared log ``rel`` failed: what is there now is the log —
        the old file, unless only the directory sync after the rename failed — held open
        again (L21). That directory sync's failure is a disk failure whatever its errno (J6):
        the new name may not survive a power loss, nor what is appended to it."""
        adopted = self._adopt(await self._open_existing(rel, kind))
        with contextlib.suppress(JournalError):  # (refused: opened at its next append)
            await adopted.hold_open()
        if staged.renamed and isinstance(exc, OSError):
            error = DiskFailedError(
                ReasonCode.DISK_FAILED,
                f"the directory sync after replacing the log failed: {exc}",
                path=rel,
            )
            self._on_disk_failure(error)
            raise error from exc

    def _adopt(self, journal: Journal) -> Journal:
        """``journal`` is the shared log of its kind from now on (its hand-offs grouped)."""
        journal.group_handoffs()
        self._open[journal.rel] = journal
        if journal.contents.header.kind is LogKind.ADMISSIONS:
            self.admissions = journal
        else:
            self.results = journal
        return journal

    # -- paths ---------------------------------------------------------------------

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    @staticmethod
    def delivery_rel(delivery_id: str) -> str:
        return f"deliveries/{delivery_key(delivery_id)}.log"

    @staticmethod
    def lane_rel(lane: str) -> str:
        return f"lanes/{lane_key(lane)}/lane.log"

    # -- logs ----------------------------------------------------------------------

    async def create_delivery_log(self, delivery_id: str, *, fence: Fence | None = None) -> Journal:
        """Create a delivery's log (its header durable). Fails if it exists. A file store
        has one owner (its directory lock): a ``fence`` has nothing to check here. One
        opening at a time per log, as :meth:`_open_or_create`: two creates at once would
        both write a header at offset 0 and their records over each other's (J19)."""
        rel = self.delivery_rel(delivery_id)
        async with self._one_opening(rel):
            return await self._create(rel, LogKind.DELIVERY, delivery_id)

    async def open_or_create_delivery_log(
        self, delivery_id: str, *, fence: Fence | None = None
    ) -> Journal:
        """Open a delivery's log, creating it if missing (a delivery whose turn starts, or
        that ends without one)."""
        return await self._open_or_create(
            self.delivery_rel(delivery_id), LogKind.DELIVERY, delivery_id
        )

    async def open_delivery_log(self, delivery_id: str, *, fence: Fence | None = None) -> Journal:
        """Open an existing delivery's log for appending (torn tail cut off); one opening at
        a time per log, as :meth:`_open_or_create`, so two tasks opening it at once share one
        journal (two would both write their next frame at the same offset, J19)."""
        rel = self.delivery_rel(delivery_id)
        async with self._one_opening(rel):
            return await self._open_existing(rel, LogKind.DELIVERY)

    async def read_delivery_log(self, delivery_id: str) -> LogContents:
        """Read a delivery's log without opening it for appends (even if poisoned)."""
        return await self.read(self.delivery_rel(delivery_id), LogKind.DELIVERY)

    async def open_lane_log(self, lane: str, *, fence: Fence | None = None) -> Journal:
        """Open a lane's log, creating it (and its directory) if missing."""
        rel = self.lane_rel(lane)
        return await self._open_or_create(rel, LogKind.LANE, lane)

    async def _open_or_create(self, rel: str, kind: LogKind, subject: str) -> Journal:
        """Open the log, or create it; one at a time per log, so two tasks opening it at
        once share one journal (two would number their records independently)."""
        async with self._one_opening(rel):
            if rel in self._open:
                return self._open[rel]
            if await trio.to_thread.run_sync(self.fs.exists, self.path(rel)):
                with contextlib.suppress(FileNotFoundError):
                    return await self._open_existing(rel, kind)
            await self._blocking(rel, self._makedirs_durable, os.path.dirname(rel))
            return await self._create(rel, kind, subject)

    @contextlib.asynccontextmanager
    async def _one_opening(self, rel: str) -> AsyncIterator[None]:
        """Hold the log's opening lock: one task at a time opens or creates ``rel``."""
        lock = self._opening.setdefault(rel, trio.Lock())
        async with lock:
            try:
                yield
            finally:
                if not lock.statistics().tasks_waiting:
                    self._opening.pop(rel, None)

    async def exists(self, rel: str) -> bool:
        return await trio.to_thread.run_sync(self.fs.exists, self.path(rel))

    async def lane_logs(self) -> list[str]:
        fs, lanes = self.fs, self.path("lanes")

        def names() -> list[str]:
            found = sorted(fs.listdir(lanes)) if fs.exists(lanes) else []
            rels = [f"lanes/{name}/lane.log" for name in found]
            return [rel for rel in rels if fs.exists(self.path(rel))]

        return await trio.to_thread.run_sync(names)

    async def read(self, rel: str, kind: LogKind | None = None) -> LogContents:
        """Read a log whole; an open delivery log's records still owed to its file are
        written there first (J12). A log poisoned in this run whose poison document could
        not be written reads as if it had been (J5, J15)."""
        journal = self._open.get(rel)
        if journal is not None:
            await journal.flush()
            self._remember_unrecorded(journal)
        root = str(self.root)
        poison = self._unrecorded.get(rel)
        if poison is not None:
            data = await trio.to_thread.run_sync(self.fs.read, self.path(rel))
            return decode_log(data, rel=rel, kind=kind, poison=poison)
        return await trio.to_thread.run_sync(lambda: read_log(self.fs, root, rel, kind=kind))

    def _remember_unrecorded(self, journal: Log) -> None:
        """Remember a log poisoned without a poison document on disk, for the rest of the
        run: it is read as poisoned — with the records it owed — and refused for appending
        (J15: a log reopened as healthy would number a new record as an acknowledged one,
        which the next start's redo could then not put back)."""
        unrecorded = journal.unrecorded if isinstance(journal, Journal) else None
        if unrecorded is None or journal.rel in self._unrecorded:
            return
        good_length, owed, reason = unrecorded
        self._unrecorded[journal.rel] = Poison(
            log_path=journal.rel,
            good_length=good_length,
            reason=reason,
            poisoned_ms=self.clocks.wall.time_ms(),
            owed=owed,
        )

    async def _create(self, rel: str, kind: LogKind, subject: str) -> Journal:
        """Create a log whose header is durable before this returns.

        A file already there that holds no acknowledged record (empty, or only a
        torn header: a crash between creating the file and syncing its header)
        is removed first; one that holds records raises ``FileExistsError``. A poison
        document with no file is a removed log's (J22): removed first too.
        """
        if rel in self._open:
            raise JournalError(
                ReasonCode.JOURNAL_IN_USE,
                "log is already open: it is not created a second time",
                path=rel,
            )
        path = self.path(rel)
        fs = self.fs
        found, poisoned = await trio.to_thread.run_sync(  # one trip off the loop for both
            lambda: (fs.exists(path), fs.exists(path + ".poison"))
        )
        if found:
            existing = await self.read(rel, kind)
            if existing.next_seq > 0 or existing.poison is not None:
                raise FileExistsError(f"{rel} already exists")
            await self._pool.retire([rel])  # J18, as for every removal of a log's file
            await self._blocking(rel, self._unlink_durably, rel)
        elif poisoned:
            # J22: the poison of a log removed before it (a crash between the two unlinks
            # of a removal): it vouches for nothing of the new log, which must not read as it
            await self._blocking(rel, self._unlink_durably, rel + ".poison")
        header = Header(
            schema_version=SCHEMA_VERSION,
            kind=kind,
            subject=subject,
            created_ms=self.clocks.wall.time_ms(),
        )
        target = LogTarget(
            path=path, rel=rel, good_length=0, next_seq=0, poison_path=path + ".poison", create=True
        )
        _shape(target, kind)
        journal = Journal(self._pool, target, LogContents(rel, (header,), 0, 0))
        self._unrecorded.pop(rel, None)  # a new log under the name: not the poisoned one
        self._open[rel] = journal
        try:
            await self._pool.append(target, encode_record(header))
        except BaseException:
            del self._open[rel]
            raise
        journal.contents = LogContents(rel, (header,), target.good_length, 0)
        return journal

    async def _open_existing(self, rel: str, kind: LogKind) -> Journal:
        """Open a log for appending; ``FileNotFoundError`` if it holds no record."""
        if rel in self._open:
            return self._open[rel]
        contents = await self.read(rel, kind)
        if rel in self._open:  # opened by another task meanwhile: one journal per log
            return self._open[rel]
        if contents.next_seq == 0 and contents.poison is None:
            # empty or a torn header: its creation was never acknowledged
            raise FileNotFoundError(f"{rel} holds no acknowledged record")
        if contents.poison is not None:
            raise JournalError(
                ReasonCode.JOURNAL_POISONED,
                f"log was poisoned ({contents.poison.reason}); it is not replayed",
                path=rel,
            )
        if contents.torn_bytes:
            await self._blocking(rel, self._truncate_durably, rel, contents.good_length)
        path = self.path(rel)
        target = LogTarget(
            path=path,
            rel=rel,
            good_length=contents.good_length,
            next_seq=contents.next_seq,
            poison_path=path + ".poison",
            create=contents.next_seq == 0,
        )
        _shape(target, kind)
        journal = Journal(self._pool, target, contents)
        self._open[rel] = journal
        return journal

    async def _release(self) -> None:
        """Close every log, stop the writers, remove the owner record."""
        first: BaseException | None = None
        for journal in list(self._open.values()):
            try:
                await journal.aclose()
            except Exception as exc:
                first = first or exc
        self._open.clear()
        await self._pool.aclose()
        # best effort: if the disk is failing, the record stays and a later owner
        # proves this process dead by its identity instead (J9)
        with contextlib.suppress(OSError):
            await trio.to_thread.run_sync(self._unlink_durably, OWNER)
        if first is not None:
            raise first

    async def close_log(self, journal: Log) -> None:
        """Close a log; a read meanwhile still finds it open, so it writes what the log owes
        its file before reading it (J12). An opening of the log meanwhile waits for the
        close and opens it anew: it is never handed the journal being closed (TL9, J19).
        Once called it closes, cancelled or not (the wait for an opening too, as the close's
        own hand-off): a cancellation comes after."""
        with trio.CancelScope(shield=True):
            async with self._one_opening(journal.rel):
                try:
                    await journal.aclose()
                finally:
                    self._remember_unrecorded(journal)
                    if self._open.get(journal.rel) is journal:
                        del self._open[journal.rel]

    def _truncate_durably(self, rel: str, length: int) -> None:
        handle = self.fs.open_append(self.path(rel))
        try:
            self.fs.truncate(handle, length)
            self.fs.fdatasync(handle)
        finally:
            self.fs.close(handle)

    def _unlink_durably(self, rel: str) -> None:
        path = self.path(rel)
        self.fs.unlink(path)
        self.fs.fsync_dir(os.path.dirname(path))

    def _makedirs_durable(self, rel_dir: str) -> None:
        """Create a directory below the root and make its entry durable — also one found
        there: an earlier creation whose sync failed (the want of a descriptor, L21) left
        it made but its entry perhaps not durable."""
        path = self.path(rel_dir)
        if not self.fs.exists(path):
            self.fs.makedirs(path)
        self.fs.fsync_dir(os.path.dirname(path))

    # -- documents -----------------------------------------------------------------

    async def write_document(self, rel: str, data: bytes, *, fence: Fence | None = None) -> None:
        """Replace a small document atomically and durably."""
        await self._blocking(rel, atomic_write, self.fs, self.path(rel), data)

    async def read_document(self, rel: str) -> bytes | None:
        def read() -> bytes | None:
            try:
                return self.fs.read(self.path(rel))
            except FileNotFoundError:
                return None

        return await trio.to_thread.run_sync(read)

    def _poison_document(
        self, target: LogTarget, reason: str, errno: int | None, owed: bytes
    ) -> bytes:
        return encode_record(
            Poison(
                log_path=target.rel,
                good_length=target.good_length,
                reason=reason,
                errno=errno,
                poisoned_ms=self.clocks.wall.time_ms(),
                owed=owed,
            )
        )


def _framed(records: list[Record], *, first: int = 0) -> bytes:
    """``records`` as a log file's bytes, numbered from ``first``, in frames of
    :data:`_FRAME_RECORDS`."""
    encoded = [encode_record(r) for r in records]
    return b"".join(
        encode_frame(first + at, encoded[at : at + _FRAME_RECORDS])
        for at in range(0, len(encoded), _FRAME_RECORDS)
    )


_MOST: Final = 2**64 - 1
"""More records than a log can number (a frame's first seq is a u64): a count's widest."""


def _head(header: Header, mark: Compacted) -> bytes:
    """A rewritten shared log's first frame — its header and its :class:`Compacted` mark —
    the same size whatever the mark's count (:meth:`Store.rewrite_shared`): the mark's
    encoding is followed by the JSON whitespace the widest count would fill."""
    widest = len(encode_record(msgspec.structs.replace(mark, removed=_MOST)))
    encoded = encode_record(mark)
    return encode_frame(0, [encode_record(header), encoded + b" " * (widest - len(encoded))])


def _commit_with_head(fs: FileSystem, staged: StagedFile, head: bytes) -> None:
    """Write ``head`` over the staged file's first frame (as long as it), then commit the
    file (blocking; :meth:`Store.rewrite_shared`). One sync covers both: the temp file's."""
    handle = fs.open_write(staged.tmp)
    try:
        view = memoryview(head)
        while view:
            n = fs.pwrite(handle, bytes(view), len(head) - len(view))
            if n <= 0:
                raise OSError(errno.EIO, "write made no progress")
            view = view[n:]
    finally:
        fs.close(handle)
    staged.commit()


@contextlib.asynccontextmanager
async def _nothing_since() -> AsyncIterator[list[Record]]:
    yield []


# -- opening -------------------------------------------------------------------------


def _prepare_root(root: Path) -> None:
    if not root.exists():
        root.mkdir(mode=0o700, parents=True)
    _check_private(root)


def acquire_lock(root: Path) -> int:
    """The state directory's exclusive lock (J9), taken without waiting: its descriptor
    (close it to let go), or :class:`StateDirLockedError` naming the process that holds it."""
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        owner = _read_owner(root)
        pid = owner.pid if owner else -1
        raise StateDirLockedError(
            f"state directory {root} is in use by pid {pid}"
            + (f" (nonce {owner.nonce[:8]}…)" if owner else "")
            + "; stop that process or choose another state directory",
            owner_pid=pid,
        ) from None
    return fd


def _read_owner(root: Path) -> OwnerRecord | None:
    try:
        data = (root / OWNER).read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(data, type=OwnerRecord)
    except msgspec.DecodeError as exc:
        raise StateDirError(
            ReasonCode.STATE_DIR_INVALID, f"unreadable owner record {root / OWNER}: {exc}"
        ) from exc


def _sweep_temporaries(fs: FileSystem, root: Path) -> None:
    """Remove temp files that crashed :func:`atomic_write` calls left behind."""
    lanes = str(root / "lanes")
    directories = [str(root), str(root / "admissions"), str(root / "deliveries"), lanes]
    directories += [os.path.join(lanes, name) for name in fs.listdir(lanes)]
    for directory in directories:
        try:
            names = fs.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            if TMP_MARK in name:
                with contextlib.suppress(FileNotFoundError):
                    fs.unlink(os.path.join(directory, name))


def _sync_what_was_left(fs: FileSystem, root: Path) -> None:
    """Make everything in the state directory durable before anything reads it (J23): what a
    killed process wrote and never synced is in the page cache, where this start would read
    it and act on it, and a power loss afterwards would take it back. A failed sync is a
    disk failure whatever its errno (J6): what would be read may be on no disk."""
    try:
        fs.sync_tree(str(root))
    except OSError as exc:
        known = disk_error(exc, ".")
        raise DiskFailedError(
            known.code if known is not None else ReasonCode.DISK_FAILED,
            f"the state directory {root} could not be made durable before it is read "
            f"({exc.strerror or exc}); nothing was read: check the disk, then start again",
        ) from exc


def _take_over(
    root: Path | str, fs: FileSystem, clocks: Clocks
) -> tuple[Path, int, OwnerRecord, OwnerRecord | None, Redone]:
    """Lock the directory, prove the previous owner dead, make what it left durable (J23),
    write our owner record, replay the sync log (J14)."""
    root = Path(root).absolute()
    _prepare_root(root)
    fd = acquire_lock(root)
    try:
        previous = _read_owner(root)
        me = current_identity()
        if previous is not None and previous.pid != me.pid and is_alive(previous.identity):
            raise StateDirLockedError(
                f"state directory {root}: its recorded owner pid {previous.pid} is still alive "
                "although it no longer holds the lock; stop it before taking over",
                owner_pid=previous.pid,
            )
        _sync_what_was_left(fs, root)
        owner = OwnerRecord(
            pid=me.pid,
            start_time=me.start_time,
            boot_id=me.boot_id,
            nonce=secrets.token_hex(16),
            started_ms=clocks.wall.time_ms(),
        )
        atomic_write(fs, str(root / OWNER), msgspec.json.encode(owner))
        for sub in ("admissions", "deliveries", "lanes", SYNC_DIR):
            path = str(root / sub)
            if not fs.exists(path):
                fs.makedirs(path)
                fs.fsync_dir(str(root))
        _sweep_temporaries(fs, root)
        redone = redo(
            fs,
            str(root),
            now_ms=clocks.wall.time_ms(),
            write_document=functools.partial(atomic_write, fs),
        )
    except BaseException:
        os.close(fd)
        raise
    return root, fd, owner, previous, redone


@contextlib.asynccontextmanager
async def open_store(
    root: Path | str,
    *,
    clocks: Clocks | None = None,
    fs: FileSystem | None = None,
    writer_shards: int = 8,
    sync_log: bool = True,
) -> AsyncIterator[Store]:
    """Own the state directory at ``root`` for the duration of the block.

    Creates it (0700) if missing and refuses one that others can read. Takes
    the directory lock; raises :class:`StateDirLockedError` naming the owner
    when a live process holds it. Makes everything in the directory durable
    before it reads any of it (J23: what a killed process left unsynced); a
    failed sync raises :class:`DiskFailedError` and nothing is read. Reads the
    shared logs: damage in the middle of one raises :class:`JournalError`
    (``journal_corrupt``) naming the file and offset, and nothing starts.

    Resource handling: on exit, however the block ends, every open log is
    closed, the writer threads stop, the owner record is removed (a clean
    release) and the lock is let go. The first error of that cleanup is
    raised after all of it ran.

    ``sync_log=False`` makes every delivery log sync its own file, as before J12 (for
    benchmarks and tests of the per-file path); the sync log a previous run left is still
    replayed first (J14).
    """
    clocks = clocks or Clocks.system()
    fs = fs or OsFileSystem()
    path, lock_fd, owner, previous, redone = await trio.to_thread.run_sync(
        _take_over, root, fs, clocks
    )
    store: Store | None = None

    def poison_document(target: LogTarget, reason: str, errno: int | None, owed: bytes) -> bytes:
        assert store is not None
        return store._poison_document(target, reason, errno, owed)

    def on_disk_failure(error: DiskFailedError) -> None:
        assert store is not None
        store._on_disk_failure(error)

    try:
        pool = WriterPool(
            fs,
            shards=writer_shards,
            poison_document=poison_document,
            on_disk_failure=on_disk_failure,
            sync_dir=str(path / SYNC_DIR) if sync_log else None,
        )
        store = Store(path, fs, clocks, pool, owner, previous)
        store.redone = redone
        try:
            store._adopt(await store._open_or_create(ADMISSIONS, LogKind.ADMISSIONS, "admissions"))
            store._adopt(await store._open_or_create(RESULTS, LogKind.RESULTS, "results"))
            for shared in (store.admissions, store.results):  # L21: no append of theirs
                await shared.hold_open()  # ever waits for a descriptor
            store.expired = await trio.to_thread.run_sync(
                read_expired, store.fs, store.path(EXPIRED)
            )
            store.expired_tasks = await trio.to_thread.run_sync(
                functools.partial(
                    read_expired, store.fs, store.path(TASKS_EXPIRED), rel=TASKS_EXPIRED
                )
            )
            yield store
        finally:
            with trio.CancelScope(shield=True):
                await store._release()
    finally:
        os.close(lock_fd)


def _shape(target: LogTarget, kind: LogKind) -> None:
    """A delivery's log may be made durable through the sync log (J12) and is allocated
    ahead (J19); a lane's or a shared log is appended and synced on its own."""
    target.deferred = kind is LogKind.DELIVERY
    target.ahead = DELIVERY_AHEAD if target.deferred else 0
