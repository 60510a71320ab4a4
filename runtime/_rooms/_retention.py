"""Retention of room deliveries (docs/design/retention.md RT1-RT8), shared by the room worker
(at its start, every ``[retention] sweep_hours`` and ``compact_hours``) and ``pi-runtime
journal compact`` (on demand, with no server running) — and, on a shared store (RT11), the
row-by-row plan of :func:`plan_shared_compaction` the room worker carries out.

A finished delivery — its result acknowledged, its room idle — passes through three stages:

* ``journal_days`` after its result was published, its step journal (``deliveries/<key>.log``)
  and one-shot session are removed (:func:`expire_step_journals`), and at the next compaction
  its admission is slimmed to a :class:`~runtime._records.Settled` idempotency record;
* ``idempotency_days`` after, a compaction removes that record and its result, and its id goes
  into the expired-id filter: a duplicate is then ``delivery_expired`` (RT4);
* ``forget_days`` after, the filter lets it go.

A room's latest result is never removed (its lane's recovery reads it, and it keeps the room
warm). What is not finished is never touched, whatever its age (RT1). Removal is ordered so a
crash between any two steps leaves more, never less (RT5): the step journal, then the
filter, then the admission log, then the result log (:func:`compact_shared`). A delivery
whose files cannot be removed is left as it is, and its room with it in a compaction, while
the others go on (RT18): a fault of one room's retention stays in that room.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, NamedTuple, cast

import trio

from .._clock import Clocks
from .._config import RetentionConfig
from .._errors import JournalError, descriptors_exhausted
from .._journal._interface import JournalStore, LeaseStore, SharedRows
from .._journal._store import Store, delivery_key, lane_key, open_store, require_journal
from .._journal._writer import disk_error
from .._logs import fields
from .._records import Admission, Record, ResultAcked, ResultPublished, Settled
from .._retention import RetentionSettings, check_settings
from .._wire import DeliveryResult
from ._lane import SESSIONS
from ._outbox import ResultOutbox

__all__ = [
    "Compaction",
    "SharedCompaction",
    "compact_journals",
    "compact_shared",
    "compact_store",
    "expire_step_journals",
    "plan_compaction",
    "plan_shared_compaction",
]

DAY_MS: Final = 86_400_000

logger = logging.getLogger("pi_runtime.retention")

Admitted = Admission | Settled
"""What the admission log holds of a delivery: its admission, or its idempotency record."""


def room_of(record: Admitted) -> str:
    return record.room if isinstance(record, Settled) else str(record.request.get("room"))


class Expiry(NamedTuple):
    room: str
    published_ms: int


@dataclass(frozen=True, slots=True)
class Compaction:
    """What one compaction of the shared logs keeps and removes (:func:`plan_compaction`)."""

    admissions: list[Admitted] = field(default_factory=list)
    """The admission log's records after it, in their order."""
    settled: dict[str, Settled] = field(default_factory=dict)
    """The admissions slimmed to idempotency records now."""
    expired: dict[str, Expiry] = field(default_factory=dict)
    """The deliveries expired now (RT4)."""
    orphaned: set[str] = field(default_factory=set)
    """Results whose delivery the admission log no longer holds (an earlier compaction
    stopped between its two rewrites): left out of the result log."""
    left: tuple[tuple[str, str], ...] = ()
    """The rooms left as they were, with why: a delivery's files there could not be
    removed (RT18). The next compaction tries them again."""

    @property
    def changes(self) -> bool:
        return bool(self.settled or self.expired or self.orphaned)


def recorded_privileged(record: Admission) -> bool | None:
    """What the admission says of itself (:attr:`Admission.privileged`)."""
    return record.privileged


def plan_compaction(
    admitted: Iterable[Admitted],
    published: Sequence[ResultPublished],
    *,
    acked: int,
    busy: Callable[[str], bool],
    latest: Mapping[str, DeliveryResult],
    journal_cutoff_ms: int,
    idempotency_cutoff_ms: int,
    slim_latest: bool = True,
    privileged: Callable[[Admission], bool | None] = recorded_privileged,
) -> Compaction:
    """Decide a compaction (pure). A delivery is touched only when its result is
    acknowledged (seq ≤ ``acked``), its room is not ``busy`` and the result is not its room's
    ``latest`` (RT1); then, by when it was published (its admission time for a result older
    than that field): before ``idempotency_cutoff_ms`` it expires, before
    ``journal_cutoff_ms`` its admission is slimmed to a :class:`Settled` — a room's latest
    too unless ``slim_latest`` is false (a shared store keeps its journal, RT11). A record
    that warms its room — an ordinary delivery's, not a ``privileged`` one's — is kept for
    each room (its latest result's when that one warms it, else its last such record), and
    a slimmed record keeps whether its delivery was privileged (RT16, L3): they are what
    tells a start that the room's session holds the conversation.
    ``privileged``: an admission's (``None``: not known, it warms)."""
    admitted = list(admitted)
    records = {r.delivery_id: r for r in admitted}
    results = {r.delivery_id: r for r in published}
    # RT16: room → the record that keeps it warm — its latest result's, kept anyway, when
    # that one warms it; else its last record that does
    warm_keeper = {
        room: result.delivery_id
        for room, result in latest.items()
        if (record := records.get(result.delivery_id)) is not None and _warms(record, privileged)
    }
    for record in reversed(admitted):
        room = room_of(record)
        if room not in warm_keeper and _warms(record, privileged):
            warm_keeper[room] = record.delivery_id
    kept: list[Admitted] = []
    plan = Compaction(admissions=kept)
    for record in admitted:
        delivery_id = record.delivery_id
        result = results.pop(delivery_id, None)
        room = room_of(record)
        if result is None or result.seq > acked or busy(room):
            kept.append(record)  # RT1: not finished, or its room is not idle
            continue
        when = result.published_ms or record.admitted_ms
        last = latest.get(room)
        keeps_warm = warm_keeper.get(room) == delivery_id
        if (
            when <= idempotency_cutoff_ms
            and (last is None or last.delivery_id != delivery_id)
            and not keeps_warm
        ):
            plan.expired[delivery_id] = Expiry(room, when)
            continue
        latest_here = last is not None and last.delivery_id == delivery_id
        if (
            when <= journal_cutoff_ms
            and isinstance(record, Admission)
            and (slim_latest or not latest_here)
        ):
            record = plan.settled[delivery_id] = _settled(record, room, privileged(record))
        kept.append(record)
    plan.orphaned.update(results)  # a result no record of the admission log names
    return plan


def _warms(record: Admitted, privileged: Callable[[Admission], bool | None]) -> bool:
    """Whether ``record`` tells a start that its room's session holds the conversation
    (L3): an ordinary delivery's does, a privileged one's (a one-shot session) does not;
    one that does not say (``None``) does, as it did before this was kept."""
    said = record.privileged if isinstance(record, Settled) else privileged(record)
    return said is not True


def _settled(record: Admission, room: str, privileged: bool | None) -> Settled:
    return Settled(
        delivery_id=record.delivery_id,
        room=room,
        request=record.fingerprints.request,
        admitted_ms=record.admitted_ms,
        privileged=privileged,
    )


async def compact_shared(
    store: Store,
    outbox: ResultOutbox,
    admitted: Callable[[], Iterable[Admitted]],
    *,
    busy: Callable[[str], bool],
    retention: RetentionConfig,
    held: Callable[[], AbstractAsyncContextManager[list[Record]]] | None = None,
    bytes_per_second: int = 0,
    privileged: Callable[[Admission], bool | None] = recorded_privileged,
    admissions_rewritten: Callable[[Compaction], None] = lambda plan: None,
) -> Compaction:
    """Compact the shared logs now (RT4-RT8), in steps each durable before the next begins
    (RT5): plan it (:func:`plan_compaction`) on what ``admitted()`` returns; remove the step
    journals of what it slims or expires; add what it expires to the expired-id filter;
    rewrite the admission log — ``held()`` holds admissions back only for the end of that,
    yielding those admitted since ``admitted()`` was called, which are carried over as they
    are (:meth:`Store.rewrite_shared`) — and tell ``admissions_rewritten`` (what the host
    knows of the deliveries follows that log before the result log drops a result: a
    duplicate of an expired one is ``delivery_expired`` from here on, as after a restart,
    never ``duplicate`` with its result gone); then the result log, the same way under the
    outbox's lock. Both rewrites write at most ``bytes_per_second`` (``0``: at once; RT10).
    What it did (nothing, when nothing was due)."""
    now = store.clocks.wall.time_ms()
    records, published, acked, latest = (
        list(admitted()),
        outbox.published(),
        outbox.acked,
        {**outbox.last_of_room},
    )

    def planned(busy: Callable[[str], bool]) -> Compaction:
        return plan_compaction(
            records,
            published,
            acked=acked,
            busy=busy,
            latest=latest,
            journal_cutoff_ms=int(now - retention.journal_days * DAY_MS),
            idempotency_cutoff_ms=int(now - retention.idempotency_days * DAY_MS),
            privileged=privileged,
        )

    plan = planned(busy)
    if not plan.changes:
        return plan
    going = [(s.delivery_id, s.room) for s in plan.settled.values()]
    going += [(d, e.room) for d, e in plan.expired.items()]
    faults: dict[str, str] = {}
    await remove_step_journals(store, going, left=faults)
    if faults:  # RT18: those rooms as they were (a busy room's way), the others go on
        rooms = {room: faults[d] for d, room in going if d in faults}
        plan = planned(lambda room: room in rooms or busy(room))
        plan = dataclasses.replace(plan, left=tuple(sorted(rooms.items())))
        _report_left(plan.left, "compaction")
        if not plan.changes:
            return plan
    if plan.expired:
        await store.expire(
            {d: e.published_ms for d, e in plan.expired.items()},
            forget_ms=int(retention.forget_days * DAY_MS),
        )
    await store.rewrite_shared(
        store.admissions, list(plan.admissions), held=held, bytes_per_second=bytes_per_second
    )
    admissions_rewritten(plan)  # RT4: before any result goes

    async def replace(
        records: list[Record],
        last_seq: int,
        held: Callable[[], AbstractAsyncContextManager[list[Record]]],
    ) -> object:
        return await store.rewrite_shared(
            store.results,
            records,
            last_seq=last_seq,
            held=held,
            bytes_per_second=bytes_per_second,
        )

    await outbox.rewrite(set(plan.expired) | plan.orphaned, replace, lambda: store.results)
    return plan


@dataclass(frozen=True, slots=True)
class SharedCompaction:
    """One compaction of a shared store's logs, row by row (:func:`plan_shared_compaction`)."""

    plan: Compaction
    slim: dict[int, Settled] = field(default_factory=dict)
    """The admission rows to rewrite as idempotency records, by number."""
    admissions: list[int] = field(default_factory=list)
    """The admission rows to delete (the expired deliveries')."""
    results: list[int] = field(default_factory=list)
    """The result rows to delete: the expired deliveries' results, and every acknowledgement
    but the last."""
    expire: dict[str, int] = field(default_factory=dict)
    """The deliveries to record as expired, each with its publication time: held back
    ``forget_days`` from it (RT4)."""
    forget_ms: int = 0
    """``[retention] forget_days`` in ms, as planned (what the rows count with while no host
    has recorded a count: :meth:`~runtime._journal._interface.LeaseStore.follow_forget_days`)."""
    named: set[str] = field(default_factory=set)
    """The sha256 of every attachment a result that stays names (their documents stay, and
    those an unfinished delivery's log names: :attr:`unfinished`)."""
    unfinished: list[str] = field(default_factory=list)
    """The deliveries the rows hold without a result."""

    @property
    def changes(self) -> bool:
        return bool(self.slim or self.admissions or self.results)


def plan_shared_compaction(
    rows: SharedRows,
    *,
    busy: Callable[[str], bool],
    retention: RetentionConfig,
    now_ms: int,
    privileged: Callable[[Admission], bool | None] = recorded_privileged,
) -> SharedCompaction:
    """Decide a compaction of a shared store's logs (RT11; pure) on what
    :meth:`~runtime._journal._interface.LeaseStore.read_shared` read — results first, so
    every result has its admission among the rows. :func:`plan_compaction` decides, with a
    room busy when ``busy`` says so or the rows hold an admission of it with no result (it
    may run on another host), and a room's latest delivery's admission never slimmed (its
    journal is kept: another host's recovery may read it). A log's last row is never
    deleted: its number is where every host appends next."""
    published = [(n, r) for n, r in rows.results if isinstance(r, ResultPublished)]
    acks = [(n, r.seq) for n, r in rows.results if isinstance(r, ResultAcked)]
    admitted = [(n, r) for n, r in rows.admissions if isinstance(r, Admitted)]
    finished = {r.delivery_id for _n, r in published}
    running = {room_of(r) for _n, r in admitted if r.delivery_id not in finished}
    latest: dict[str, DeliveryResult] = {}
    for _n, record in published:
        latest[record.room] = DeliveryResult.of(record)
    plan = plan_compaction(
        (r for _n, r in admitted),
        [r for _n, r in published],
        acked=max((seq for _n, seq in acks), default=0),
        busy=lambda room: room in running or busy(room),
        latest=latest,
        journal_cutoff_ms=int(now_ms - retention.journal_days * DAY_MS),
        idempotency_cutoff_ms=int(now_ms - retention.idempotency_days * DAY_MS),
        slim_latest=False,
        privileged=privileged,
    )
    at = {r.delivery_id: n for n, r in admitted}
    last_admission = rows.admissions[-1][0] if rows.admissions else 0
    last_result = rows.results[-1][0] if rows.results else 0
    # the log's last row stays: a delivery admitted there expires at a later compaction
    expired = {d: e for d, e in plan.expired.items() if at[d] != last_admission}
    plan = Compaction(settled=plan.settled, expired=expired)
    gone = [n for n, r in published if r.delivery_id in expired]
    last_ack = max(acks, default=(0, 0))[0]
    acked_before = [n for n, _seq in acks if n != last_ack]
    forget = int(retention.forget_days * DAY_MS)
    named = {
        ref.sha256
        for _n, record in published
        if record.delivery_id not in expired
        for ref in record.attachments
    }
    return SharedCompaction(
        plan=plan,
        slim={at[d]: settled for d, settled in plan.settled.items()},
        admissions=sorted(at[d] for d in expired),
        results=sorted(n for n in [*gone, *acked_before] if n != last_result),
        expire={d: e.published_ms for d, e in expired.items()},
        forget_ms=forget,
        named=named,
        unfinished=[r.delivery_id for _n, r in admitted if r.delivery_id not in finished],
    )


async def remove_step_journals(
    store: JournalStore,
    deliveries: Sequence[tuple[str, str]],
    *,
    left: dict[str, str] | None = None,
) -> int:
    """Remove the step journal and one-shot session of each ``(delivery id, room)``, durably
    and in one trip to the store (on a shared store, the session's document too); how many
    had a journal left. With ``left`` (a file store), a delivery whose files cannot be
    removed is noted there (delivery id → why), its journal kept, and the others go on
    (RT18); a disk failure still ends it all (J6)."""
    if not deliveries:
        return 0
    sessions = {d: _oneshot_rel(d, room) for d, room in deliveries}
    if left is None or not isinstance(store, Store):
        removed = await store.remove_logs([store.delivery_rel(d) for d, _ in deliveries])
        await trio.to_thread.run_sync(_unlink_all, [store.root / rel for rel in sessions.values()])
        if not isinstance(store, Store):  # S13: shared, a one-shot session travels as a document
            await cast(LeaseStore, store).delete_documents(
                [SESSIONS + rel for rel in sessions.values()], with_parts=True
            )
        return removed
    # the session first: a delivery whose session stays keeps its journal, and is tried again
    left.update(await trio.to_thread.run_sync(_unlink_each, store.root, sessions))
    rels = {d: store.delivery_rel(d) for d, _ in deliveries if d not in left}
    try:
        return await store.remove_logs(list(rels.values()))
    except (OSError, JournalError) as exc:  # (a disk failure ends the pass, J6)
        if not _one_logs(exc):
            raise
    removed = 0  # one of them cannot go: each on its own, so that the others do
    for delivery_id, rel in rels.items():
        try:
            removed += await store.remove_logs([rel])
        except (OSError, JournalError) as exc:
            if not _one_logs(exc):
                raise
            left[delivery_id] = f"{rel}: {getattr(exc, 'strerror', None) or exc}"
    return removed


def _one_logs(error: BaseException) -> bool:
    """A removal refused for the log's own sake (a file in the way, no permission) or for
    want of a file descriptor (L21, J18: asked again, tried again) — not the disk's failure,
    which ends the pass (J6)."""
    return isinstance(error, OSError) or descriptors_exhausted(error)


def _oneshot_rel(delivery_id: str, room: str) -> str:
    return f"lanes/{lane_key(room)}/oneshot/{delivery_key(delivery_id)}.jsonl"


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _unlink_each(root: Path, rels: Mapping[str, str]) -> dict[str, str]:
    """Unlink each file (blocking); those that could not go, by key, with why. A disk
    failure is raised (it is no one file's fault)."""
    failed: dict[str, str] = {}
    for key, rel in rels.items():
        try:
            (root / rel).unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            if disk_error(exc, rel) is not None:
                raise
            failed[key] = f"{rel}: {exc.strerror or exc}"
    return failed


def _report_left(left: Iterable[tuple[str, str]], what: str) -> None:
    for room, why in left:
        logger.warning(
            "retention (%s) left room %s as it is, for the next pass: %s",
            what,
            room,
            why,
            extra=fields("retention_left", room=room),
        )


async def expire_step_journals(
    store: JournalStore,
    outbox: ResultOutbox,
    busy: Callable[[str], bool],
    *,
    cutoff_ms: int,
    start: int = 0,
    removed_ahead: dict[str, int] | None = None,
) -> tuple[int, int]:
    """Remove the expired step journals among the results from index ``start`` of the
    publication order on: ``(journals removed, where the next look may start)`` — the index
    after the last result before which every one is expired (a result of a room ``busy``
    says has an unfinished delivery holds it back, so it is looked at again). ``busy`` is
    asked after the last await before the removal. ``removed_ahead`` (delivery id → index),
    kept by the caller across looks: the journals removed past the start, not asked for
    again while a result before them holds the start back (each would be another trip to
    the store at every sweep); updated here."""
    due: list[tuple[int, DeliveryResult, int | None]] = []
    for index, result, published_ms in outbox.acknowledged_since(start):
        when: int | None = published_ms
        if not when and isinstance(store, Store):  # older than the field: its log's time
            when = await _modified_ms(store.path(store.delivery_rel(result.delivery_id)))
        if when is not None and when > cutoff_ms:
            break  # published in order: the rest are younger
        due.append((index, result, when))
    going: list[tuple[str, str]] = []
    indexes: dict[str, int] = {}
    position, settled = start, True
    shared = not isinstance(store, Store)
    for index, result, when in due:
        if when is not None and busy(result.room):
            settled = False  # RT1: looked at again once the room is idle
            continue
        latest = outbox.last_of_room.get(result.room)
        if shared and latest is not None and latest.delivery_id == result.delivery_id:
            # RT11: another host may admit into the room before this one hears of it, and
            # its recovery reads the room's latest owner's log: kept while it is the latest
            settled = False
            continue
        if when is not None and (removed_ahead is None or result.delivery_id not in removed_ahead):
            going.append((result.delivery_id, result.room))
            indexes[result.delivery_id] = index
        if settled:
            position = index + 1
    faults: dict[str, str] = {}
    removed = await remove_step_journals(store, going, left=faults)
    if faults:  # RT18: each tried again at the next look; the others went
        position = min([position, *(indexes.pop(d) for d in faults)])
        rooms = dict(going)
        _report_left(((rooms[d], why) for d, why in sorted(faults.items())), "step journals")
    if removed_ahead is not None:
        removed_ahead.update(indexes)
        for delivery_id in [d for d, i in removed_ahead.items() if i < position]:
            del removed_ahead[delivery_id]  # behind the next start: never looked at again
    return removed, position


async def _modified_ms(path: str) -> int | None:
    """A log's last write (its result's), for a result published before the publication time
    was recorded; ``None`` when there is no log (already removed, or never written)."""
    try:
        info = await trio.to_thread.run_sync(os.stat, path)
    except FileNotFoundError:
        return None
    return info.st_mtime_ns // 1_000_000


async def compact_journals(
    state_dir: Path, *, settings: RetentionSettings, clocks: Clocks
) -> tuple[int, Compaction]:
    """``pi-runtime journal compact``: :func:`expire_step_journals`, then :func:`compact_shared`,
    over a state directory no server holds (its lock is taken: ``state_dir_locked`` while one
    runs — it does the same every ``[retention] sweep_hours`` and ``compact_hours``): how many
    step journals were removed, and what the compaction did. A directory that holds no
    file-store journal (a host of a PostgreSQL deployment, a typo) is refused
    ``state_dir_invalid``, and nothing is created there."""
    await trio.to_thread.run_sync(require_journal, state_dir)
    async with open_store(state_dir, clocks=clocks) as store:
        await check_settings(store, settings)  # RT14, under the lock
        return await compact_store(store, retention=settings.retention)


async def compact_store(store: Store, *, retention: RetentionConfig) -> tuple[int, Compaction]:
    """:func:`compact_journals` on a store this process holds and nothing else uses (no
    worker runs on it: what the logs held at open is all there is)."""
    outbox = ResultOutbox(store.results)
    admitted = [r for r in store.admissions.contents.records if isinstance(r, Admitted)]
    busy = {room_of(r) for r in admitted if outbox.result_of(r.delivery_id) is None}
    cutoff = store.clocks.wall.time_ms() - retention.journal_days * DAY_MS
    removed, _ = await expire_step_journals(store, outbox, busy.__contains__, cutoff_ms=int(cutoff))
    plan = await compact_shared(
        store, outbox, lambda: admitted, busy=busy.__contains__, retention=retention
    )
    return removed, plan
