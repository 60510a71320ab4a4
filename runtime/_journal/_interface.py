"""What a journal store is, whatever keeps it: the interface both stores implement.

The file store (``_store.py``: a state directory of append-only logs, the embedded default)
and the PostgreSQL store (``_postgres.py``, docs/design/scale-out.md) are two implementations
of :class:`JournalStore`; a log of either is a :class:`Log`. The storage conformance suite
(``tests/journal/test_conformance_stores.py``) runs the journal invariants of
``docs/design/journal.md`` against both, through this interface only.

A log has a *name* (``rel``): the state-directory-relative path of the file store
(``deliveries/<hash>.log``, ``lanes/<hash>/lane.log``, ``admissions/admissions.log``,
``results.log``), used as the log's key by every store, so records that name a log mean the
same thing on both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, NoReturn, Protocol

from .._clock import Clocks
from .._errors import DiskFailedError
from .._records import LogKind, Record
from ._fence import Fence, Lease
from ._journal import LogContents

__all__ = ["Fence", "JournalStore", "Lease", "LeaseStore", "Log"]


class Log(Protocol):
    """An open log: what it held when it was opened, and durable appends."""

    contents: LogContents
    """The records the log held when it was opened (``records[0]`` is the header)."""

    @property
    def rel(self) -> str:
        """The log's name (see the module doc)."""
        ...

    @property
    def next_seq(self) -> int:
        """The sequence number the next append gets."""
        ...

    @property
    def poisoned(self) -> bool:
        """An append failed: every later one is refused (``journal_poisoned``, J5)."""
        ...

    async def append(self, record: Record, *, fence: Fence | None = None) -> int:
        """Append ``record``; return its sequence number once it is durable (J1). Fenced
        by ``fence`` (default: the fence the log was opened with): ``lane_fenced`` once
        another host claimed the lane, and nothing is written (S11)."""
        ...

    async def try_append(
        self,
        record: Record,
        *,
        fence: Fence | None = None,
        unless: Callable[[], bool] | None = None,
    ) -> int | None:
        """As :meth:`append`, for a log other hosts append to too: ``None`` when another
        writer took the next sequence number first (:meth:`refresh`, decide again), or when
        ``unless()`` is true at the moment the record would be written (checked under the
        log's lock, after every refresh made before it)."""
        ...

    async def refresh(self) -> list[Record]:
        """The records other writers appended since this process last read or wrote the
        log (none, where this process is the only writer)."""
        ...

    async def aclose(self) -> None:
        """Stop appending; idempotent."""
        ...


class JournalStore(Protocol):
    """An open journal store, owned by this process."""

    @property
    def root(self) -> Path:
        """This host's local state directory (sessions, worktrees, sockets live below it)."""
        ...

    @property
    def clocks(self) -> Clocks: ...

    @property
    def admissions(self) -> Log:
        """The shared, group-committed admission log."""
        ...

    @property
    def results(self) -> Log:
        """The shared, numbered result outbox."""
        ...

    @property
    def disk_failure(self) -> DiskFailedError | None:
        """The first failure of the storage itself; once set the host stops admitting."""
        ...

    @staticmethod
    def delivery_rel(delivery_id: str) -> str: ...

    @staticmethod
    def lane_rel(lane: str) -> str: ...

    async def create_delivery_log(self, delivery_id: str, *, fence: Fence | None = None) -> Log:
        """``fence``: every append to the log is fenced by it (S11). A store with one owner
        (the file store: its directory lock) has nothing to check and ignores it."""
        ...

    async def open_or_create_delivery_log(
        self, delivery_id: str, *, fence: Fence | None = None
    ) -> Log: ...

    async def open_delivery_log(self, delivery_id: str, *, fence: Fence | None = None) -> Log: ...

    async def read_delivery_log(self, delivery_id: str) -> LogContents: ...

    async def open_lane_log(self, lane: str, *, fence: Fence | None = None) -> Log: ...

    async def read(self, rel: str, kind: LogKind | None = None) -> LogContents: ...

    async def exists(self, rel: str) -> bool:
        """Whether the log ``rel`` was ever created."""
        ...

    async def lane_logs(self) -> list[str]:
        """The names of every lane log, sorted."""
        ...

    async def close_log(self, journal: Log) -> None: ...

    async def remove_logs(self, rels: Sequence[str]) -> int:
        """Remove the logs ``rels`` durably, nothing else of them kept (retention of logs
        nothing will read again, docs/design/retention.md RT2, RT11); how many were there."""
        ...

    async def write_document(
        self, rel: str, data: bytes, *, fence: Fence | None = None
    ) -> None: ...

    async def read_document(self, rel: str) -> bytes | None: ...


class SharedRows(NamedTuple):
    """The shared logs' records, each with its number (:meth:`LeaseStore.read_shared`)."""

    admissions: list[tuple[int, Record]]
    results: list[tuple[int, Record]]


class LeaseStore(JournalStore, Protocol):
    """A journal store several hosts share, whose lanes are owned under leases (the
    PostgreSQL store; docs/design/scale-out.md S10-S12, S23)."""

    @property
    def owner(self) -> str:
        """This host's name in the lease rows."""
        ...

    async def claim(self, lane: str, ttl: float) -> Fence | None:
        """The lane's lease for ``ttl`` seconds under a new epoch, or ``None`` while
        another owner's lease runs."""
        ...

    async def renew(self, fences: Sequence[Fence], ttl: float) -> set[Fence]:
        """Extend the leases still held; the ones returned are, the others are lost."""
        ...

    async def release(self, fence: Fence) -> None: ...

    async def lease(self, lane: str) -> Lease | None: ...

    async def documents(self, prefix: str) -> dict[str, bytes]:
        """Every document whose name starts with ``prefix``, by name."""
        ...

    async def delete_documents(self, names: Sequence[str], *, with_parts: bool = False) -> None:
        """Remove the named documents (those absent are no matter); ``with_parts``: and the
        parts of each (``<name>@…``, docs/design/scale-out.md S36)."""
        ...

    async def sweep_documents(
        self, prefix: str, *, keep: Sequence[str], idle_seconds: float
    ) -> int:
        """Remove the documents named ``prefix…`` but ``keep``'s and those written in the last
        ``idle_seconds``; how many went."""
        ...

    async def announce(self) -> None:
        """Make every host's :meth:`watch_shared` call its ``changed`` (a document written
        for the others to read)."""
        ...

    # the shared logs' retention (docs/design/retention.md RT11)

    generation: int
    """The compaction generation whose expired deliveries this store has learned."""
    expired: dict[str, int]
    """The deliveries expired since the store was opened (id to the time a duplicate is no
    longer refused for it: a decision compares it with the wall clock); those before:
    :meth:`expired_among`."""
    forget_ms: int | None
    """The ``forget_days`` (ms) the expired ids count with, as of the last look."""
    on_expired: Callable[[Mapping[str, int]], object] | None
    """Told the deliveries each :meth:`sync_expired` learned."""

    async def sync_expired(self) -> dict[str, int]:
        """Learn the deliveries expired since :attr:`generation`; the new ones."""
        ...

    async def expired_among(self, delivery_ids: Sequence[str]) -> dict[str, int]:
        """Which of ``delivery_ids`` the database holds as expired now, at this host's wall
        clock (with the times they are let go)."""
        ...

    async def learn_expired(self, delivery_ids: Sequence[str]) -> dict[str, int]:
        """:meth:`sync_expired`, and those of ``delivery_ids`` the database holds as expired
        from before, now in :attr:`expired`; what was learned."""
        ...

    async def follow_forget_days(self, forget_ms: int) -> int | None:
        """Make every expired id count with ``forget_ms`` from its own time (a host's start,
        RT4); the count it replaced."""
        ...

    async def read_shared(self) -> SharedRows:
        """The shared logs' records with their numbers, the result log read first."""
        ...

    async def compact_shared(
        self,
        fence: Fence,
        *,
        slim: Mapping[int, Record],
        admissions: Sequence[int],
        results: Sequence[int],
        expire: Mapping[str, int],
        forget_ms: int,
    ) -> int | None:
        """One compaction in one transaction under ``fence`` (``expire``: each delivery's
        publication time): its generation, or ``None`` when the fence no longer held
        (nothing changed)."""
        ...

    # ended task lanes' retention (docs/design/retention.md RT13)

    async def slim_log(self, rel: str, records: Sequence[Record], *, fence: Fence) -> bool:
        """Rewrite an ended task's lane log as a header, a ``Compacted`` mark and ``records``
        in one transaction under ``fence``; whether it was (the fence and the log held)."""
        ...

    async def expire_task(
        self, task_id: str, since_ms: int, *, forget_ms: int, fence: Fence
    ) -> bool:
        """Record the task expired from ``since_ms`` (its end) and remove its lane log in one
        transaction under ``fence``; whether this call recorded it."""
        ...

    async def forget_expired_tasks(self) -> int:
        """Remove the expired tasks' rows past their days; how many."""
        ...

    async def expired_task_keys(self, keys: Sequence[str]) -> dict[str, int]:
        """Which of these task lane keys the database holds as expired, each with the time
        it is let go."""
        ...

    # task worktrees across hosts (docs/design/scale-out.md S33)

    async def lease_worktree(self, task_id: str, worktree: str) -> list[str]:
        """Record the task's worktree, unless other tasks hold it, one around it or one in
        it: their ids (nothing recorded)."""
        ...

    async def release_worktree(self, task_id: str) -> None:
        """The task holds no worktree any more."""
        ...

    async def watch_shared(self, changed: Callable[[bool], None], *, poll: float) -> NoReturn:
        """Call ``changed(released)`` when another host may have appended to a shared log,
        or given a lease up (``released``)."""
        ...
