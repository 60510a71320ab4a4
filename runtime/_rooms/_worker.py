"""The room worker: admits deliveries durably, runs them in room lanes, publishes results.

:func:`open_room_worker` is the embedding API (docs/design/index.md "Bot authors"; issue #5): it
owns the
state directory, recovers what a previous owner left unfinished, runs one lane per room and
yields a :class:`RoomWorker` with :meth:`~RoomWorker.deliver`, :meth:`~RoomWorker.cancel`,
:meth:`~RoomWorker.drain`, :meth:`~RoomWorker.events`, :meth:`~RoomWorker.results` and
:meth:`~RoomWorker.ack`. The invariants are in ``docs/design/lanes.md`` and
``docs/design/recovery.md``.

Resource handling: everything runs in the worker's nursery — the upstream model Fake-Pi
serves when no model endpoint is configured, one task per lane, inside each lane its epochs.
Leaving the block stops admitting, cancels every lane (each live epoch's tree is stopped) and
releases the state directory; deliveries that did not finish stay pending and are recovered
by the next :func:`open_room_worker` on the same state directory.

Error handling: a refused delivery raises :class:`~runtime._errors.DeliveryError` with a
stable code and admits nothing; invalid configuration raises
:class:`~runtime._errors.ConfigError` before anything starts.

On a store several hosts share (``[store] url``, docs/design/scale-out.md) the worker is one
host of a deployment: it knows every admission and every result (it reads what the others
append when told of it, S23), admits into the shared log (S21), runs a room's deliveries only
while it holds the room lane's lease (S10-S12: :class:`~runtime._journal._leases.LaneLeases`) —
claiming a lane when it admits into a room nobody holds, and claiming a lane whose holder's
lease ran out while deliveries wait in it, which it then recovers as a restart would (S13) —
and gives a lane up when another host has claimed it (S11). Results of every host reach its
readers in one ``seq`` order.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import socket
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Literal, cast

import msgspec
import trio

from .._backoff import RouteBreaker
from .._boundary._attach import AttachTool
from .._boundary._gate import replay_class_of
from .._boundary._gateway import GatewayConfig
from .._boundary._receipts import ReceiptStore, receipt_store
from .._boundary._tools import RUNTIME_TOOLS
from .._clock import Clocks
from .._config import RoomWorkerConfig, validate_config
from .._errors import (
    ConfigError,
    DeliveryError,
    DiskFailedError,
    JournalError,
    ReasonCode,
    StateDirError,
    raises_one_error,
)
from .._hosting import start_model, worker_program
from .._journal._attachments import SHARED_ATTACHMENTS, AttachmentStore
from .._journal._fence import Fence
from .._journal._inspect import offline_status
from .._journal._interface import JournalStore, LeaseStore
from .._journal._leases import LaneLeases, fenced_out
from .._journal._store import (
    ADMISSIONS,
    Store,
    acquire_lock,
    delivery_key,
    lane_key,
    open_store,
    require_journal,
    runtime_dir,
)
from .._linux._fs import FileSystem
from .._logs import fields
from .._metrics import DELIVERIES_ADMITTED, RECOVERY_REFUSALS, labelled
from .._pi._worker import kill_epoch_leftovers, kill_launch_leftovers
from .._records import (
    AbsorbedInput,
    Admission,
    AttachmentRef,
    EpochFenced,
    EpochLaunching,
    EpochStarted,
    ModelResponse,
    Outcome,
    Parked,
    Record,
    Result,
    ResultPublished,
    Settled,
    ToolOutcome,
)
from .._retention import RetentionSettings, follow_forget_days, read_settings, record_settings
from .._wire import Accepted, DeliveryResult, RoomEvent, RoomStatus
from ._admission import (
    Delivery,
    changed_settings,
    digest,
    fingerprints,
    parse_delivery,
    render_prompt,
    route_endpoint,
    settings_fingerprint,
)
from ._lane import Lane, LaneHost
from ._outbox import ResultOutbox
from ._pending import Absorbed, Pending
from ._retention import (
    Compaction,
    SharedCompaction,
    compact_shared,
    expire_step_journals,
    plan_shared_compaction,
    remove_step_journals,
    room_of,
)
from ._slot import Slot

__all__ = ["Accepted", "RoomStatus", "RoomWorker", "open_room_worker", "request_cancel"]

logger = logging.getLogger("runtime.rooms")

EVENT_BUFFER = 1024
"""Signals kept for a slow events reader; older ones are dropped (they are not durable)."""


Known = tuple[str, str]
"""A delivery this host knows was admitted: ``(its request fingerprint, its room)``. A plain
tuple of two strings, one per delivery admitted: the collector stops tracking an exact tuple
of untracked values at its first pass (not a NamedTuple, which it always tracks)."""

_Steered = tuple[str, str, int | None, int]
"""A delivery steered into an owner, as recovery reads it (L10): ``(the owner, its text, the
step that first carried it or None, the last step answered before that one or -1, L26)``."""


@dataclasses.dataclass(eq=False, slots=True)
class _InFlight:
    """An admission being appended (:meth:`RoomWorker.deliver`): set ``done`` once its
    append ended; ``error`` is why it failed, when it did."""

    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    error: Exception | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Recovered:
    """How recovery takes up one unfinished admission (:meth:`RoomWorker._decide`)."""

    record: Admission
    delivery: Delivery
    grants: frozenset[str] | None
    refused: str | None
    """``recovery_refused:<what>`` (L11), or ``None``."""
    cancelled: bool


def _storage_fault(error: BaseException) -> BaseException | None:
    """``error`` if it is a fault of a lane's own storage — a :class:`JournalError` or an
    :class:`OSError` — or, for a group holding only such faults, its first; else ``None``
    (S13)."""
    if not isinstance(error, BaseExceptionGroup):
        return error if isinstance(error, JournalError | OSError) else None
    faults = [_storage_fault(inner) for inner in error.exceptions]
    return faults[0] if all(fault is not None for fault in faults) else None


class RoomWorker:
    """A running room worker; obtain it from :func:`open_room_worker`."""

    def __init__(
        self,
        config: RoomWorkerConfig,
        store: JournalStore,
        host: LaneHost,
        nursery: trio.Nursery,
    ) -> None:
        self.config = config
        self.store = store
        self._host = host
        self._nursery = nursery
        self._lanes: dict[str, Lane] = {}
        self._names: list[str] = []
        """The rooms of :attr:`_lanes`, kept sorted: a page of statuses costs its own size,
        whatever the number of rooms (operations.md OP6, protocol.md P15)."""
        self._known: dict[str, Known] = {}
        self._pending: dict[str, Pending] = {}
        self._admitting = True
        self._events_in, self._events_out = trio.open_memory_channel[RoomEvent](EVENT_BUFFER)
        self.dropped_events = 0
        self._live: dict[Slot, Lane] = {}
        """Each live worker's slot (L8), and its lane: a lane may have two, its room's
        worker and a privileged delivery's one-shot one."""
        self._live_changed = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self._warm: set[str] = set()
        self._settings_prints: dict[frozenset[str], str] = {}
        self._admissions: dict[str, Admission] = {}
        """Every admission this host knows, in admission order (of every host, when shared),
        but those a compaction slimmed (:attr:`_settled`) or expired."""
        self._settled: dict[str, Settled] = {}
        """The idempotency records of finished deliveries whose admission was slimmed (RT3)."""
        self._paused: trio.Event | None = None
        """Set while a compaction rewrites the admission log: appends wait for it (RT7)."""
        self._appending = 0
        """Admission appends under way."""
        self._drained = trio.Event()
        self._retaining = trio.Lock()
        """One retention pass at a time (step journals or compaction)."""
        self._unfinished: dict[str, dict[str, None]] = {}
        """Per room, the deliveries admitted (anywhere) without a published result, in order."""
        self._being_admitted: dict[str, int] = {}
        """Per room, this host's admissions between their queue-limit check and the end of
        their append: the limit counts them, so admissions at once cannot pass it together."""
        self._ordinary_admitting: dict[str, int] = {}
        """Per room, those of :attr:`_being_admitted` that are not privileged: they will run
        in the room's session, so a delivery after them is warm (L3)."""
        self._expired_upto = 0
        """Retention (RT2): every result before this index of the publication order has no
        step journal left."""
        self._removed_ahead: dict[str, int] = {}
        """Retention (RT2): deliveries past ``_expired_upto`` whose step journal was removed
        (delivery id → index), so a later look does not ask for it again."""
        self._renumbered = 0
        """How often the publication order was renumbered (a compaction, RT11)."""
        self.leases: LaneLeases | None = None
        """This host's lane leases; ``None`` where it owns every lane (one host per store)."""
        self._ready: set[str] = set()
        """Rooms whose lane this host holds and has recovered: new admissions go to them."""
        self._taking: dict[str, trio.Event] = {}
        """Rooms whose lane is being claimed and recovered (set when that ends)."""
        self._not_before: dict[str, float] = {}
        """Rooms whose lane another host's lease holds, and until when (Trio's clock): no
        claim is tried before."""
        self._failed_until: dict[str, float] = {}
        """Rooms whose lane failed to run here (S13: its session or log could not be read
        back), and until when (Trio's clock) this host does not claim it again: a lasting
        fault is not retried in a loop (a release heard does not shorten it)."""
        self._poked = trio.Event()
        self._releases_heard = 0
        """How many times a lease given up (or a reconnect, which may have missed one) was
        heard: a refused claim's wait is kept only if none was heard while it was read."""
        self._cancels: set[str] = set()
        """Deliveries another host was asked to cancel (S26), not finished when last read."""
        self._in_flight: dict[str, _InFlight] = {}
        """Admissions of this host whose append is under way, by delivery id: a duplicate
        waits for the append and gets its outcome (L1, L2)."""

    # -- the API -----------------------------------------------------------------------

    async def deliver(self, delivery: Delivery | Mapping[str, Any]) -> Accepted:
        """Admit a room message; returns once its admission is durable (L1).

        The same ``delivery_id`` with the same request is ``duplicate`` (L2); with a
        different one it raises ``delivery_conflict``. Other refusals: ``room_invalid``,
        ``room_refused``, ``delivery_invalid``, ``queue_full``, ``not_admitting``.
        """
        caps = self.config.caps
        if not isinstance(delivery, Delivery):
            delivery = parse_delivery(
                delivery, max_text=caps.max_text_chars, max_history=caps.max_history_items
            )
        if (disk := self.store.disk_failure) is not None:  # L17: host-wide, and says why
            raise DeliveryError(
                ReasonCode.NOT_ADMITTING, f"this worker stopped admitting, its disk failed: {disk}"
            )
        if not self._admitting:
            raise DeliveryError(ReasonCode.NOT_ADMITTING, "this worker is not admitting")
        authority = self.config.authority_of(delivery.room, delivery.author.id)
        if authority is None:
            raise DeliveryError(ReasonCode.ROOM_REFUSED, f"room {delivery.room} is not served here")
        grants, privileged = authority
        prints = fingerprints(delivery, grants=grants, settings=self._settings_print(grants))
        while (flight := self._in_flight.get(delivery.delivery_id)) is not None:
            # L1, L2: the same id is being admitted right now. Nothing is admitted until that
            # append is durable, so this one is not "duplicate" yet: it waits, and gets the
            # append's failure too — else a client is told "accepted" for nothing admitted.
            # (The first caller cancelled: nothing decided, so this one admits it itself.)
            await flight.done.wait()
            if flight.error is not None:
                raise flight.error
        known = self._known.get(delivery.delivery_id)
        if known is None:
            self._check_not_expired(delivery.delivery_id)
        else:
            if known[0] != prints.request:
                raise DeliveryError(
                    ReasonCode.DELIVERY_CONFLICT,
                    f"delivery {delivery.delivery_id} was admitted with a different request",
                )
            return Accepted(
                delivery_id=delivery.delivery_id, room=known[1], disposition="duplicate"
            )
        room = delivery.room
        lane = self._lanes.get(room) if self.leases is not None else self._lane(room)
        waiting = len(self._unfinished.get(room, ())) if lane is None else lane.waiting
        waiting += self._being_admitted.get(room, 0)
        if waiting >= caps.queue_limit:
            raise DeliveryError(
                ReasonCode.QUEUE_FULL,
                f"room {delivery.room} already has {caps.queue_limit} deliveries waiting",
            )
        # L3: warm only when the room's session holds (or an ordinary delivery before this
        # one will bring it) the conversation. A privileged delivery runs in a one-shot
        # session (L6): it warms nothing, so one waiting or admitted meanwhile does not count
        ordinary_ahead = self._ordinary_admitting.get(room, 0) > 0
        cold = privileged or (room not in self._warm and not ordinary_ahead)
        admission = Admission(
            delivery_id=delivery.delivery_id,
            lane=lane_key(room),
            request=msgspec.to_builtins(delivery),
            fingerprints=prints,
            rendered_prompt=render_prompt(delivery, cold=cold),
            admitted_ms=self._host.clocks.wall.time_ms(),
            privileged=privileged,  # L3, RT16: warms nothing, now or after a compaction
        )
        self._known[delivery.delivery_id] = (prints.request, delivery.room)
        self._being_admitted[room] = self._being_admitted.get(room, 0) + 1
        if not privileged:
            self._ordinary_admitting[room] = self._ordinary_admitting.get(room, 0) + 1
        flight = self._in_flight[delivery.delivery_id] = _InFlight()
        try:
            first = await self._append_admission(admission, room, privileged)
        except BaseException as error:
            if delivery.delivery_id not in self._admissions:  # (RT11: or forgotten as expired)
                self._known.pop(delivery.delivery_id, None)
                if isinstance(error, Exception):  # (not a cancel of this caller's own)
                    flight.error = error
            raise
        finally:  # (counted from here on as the lane's, or as unfinished when shared)
            del self._in_flight[delivery.delivery_id]
            flight.done.set()
            _count_down(self._being_admitted, room)
            if not privileged:  # (a room warm from now on, when admitted: _learn_admission)
                _count_down(self._ordinary_admitting, room)
        if first is not admission:  # another host admitted it first (S21)
            if first.fingerprints.request != prints.request:
                raise DeliveryError(
                    ReasonCode.DELIVERY_CONFLICT,
                    f"delivery {delivery.delivery_id} was admitted with a different request",
                )
            return Accepted(delivery_id=delivery.delivery_id, room=room, disposition="duplicate")
        DELIVERIES_ADMITTED.inc()
        if logger.isEnabledFor(logging.DEBUG):  # its fields hash the id: not for nothing
            logger.debug(
                "admitted a delivery in %s",
                room,
                extra=fields("delivery_admitted", delivery_id=delivery.delivery_id, room=room),
            )
        if self.leases is not None:
            return await self._admitted_shared(admission)
        assert lane is not None
        started = not lane.busy and not lane.queue
        pending = Pending(delivery, admission, grants, privileged)
        routed = await self._route(lane, pending)
        disposition: Literal["started", "steered", "queued"] = routed
        if routed == "queued" and started:
            disposition = "started"
        return Accepted(delivery_id=delivery.delivery_id, room=room, disposition=disposition)

    async def _route(self, lane: Lane, pending: Pending) -> Literal["steered", "queued"]:
        """Hand an admitted delivery to its lane: steered into the live run of the same
        authority (L10), else queued. Whoever cancels the caller (a client gone), it is one
        or the other: admitted and pending here, it would otherwise neither run nor end
        until a restart (L1)."""
        self._pending[pending.delivery_id] = pending
        if lane.may_steer(pending):  # (the shield costs every admission a few µs: only here)
            with trio.CancelScope(shield=True):  # bounded: a wedged worker's steer is fenced (L20)
                if await lane.steer(pending):
                    return "steered"
        if lane.lost:  # given up during the steer (S11): another host runs it
            self._pending.pop(pending.delivery_id, None)
            return "queued"
        self._enqueue(lane, pending)
        return "queued"

    async def _append_admission(
        self, admission: Admission, room: str, privileged: bool
    ) -> Admission:
        """Make ``admission`` (of ``room``, ``privileged`` or not) durable in the shared
        admission log; what is then the delivery's admission: ``admission``, or the one another
        host appended first (S21)."""
        delivery_id = admission.delivery_id

        def learned() -> bool:  # another host's admission of it, taken in by any refresh
            return delivery_id in self._admissions or self._expired(delivery_id)

        while self._paused is not None:  # a compaction rewrites the log (RT7)
            await self._paused.wait()
        self._appending += 1
        try:
            log = self.store.admissions
            while await log.try_append(admission, unless=learned) is None:  # lost the number
                self._learn_admissions(await log.refresh())  # (or a compaction came first)
                if (first := self._admissions.get(delivery_id)) is not None:
                    return first
                self._check_not_expired(delivery_id)
        finally:
            self._appending -= 1
            if not self._appending:
                self._drained.set()
        if delivery_id not in self._admissions:  # (or a refresh meanwhile took it in)
            self._learn_admission(admission, room, privileged)
        return admission

    def _expired(self, delivery_id: str) -> bool:
        """RT4, RT11: whether retention removed the delivery's idempotency record."""
        now = self._host.clocks.wall.time_ms()  # RT4: held back until its forget_days
        if self.leases is not None:  # a shared store: as of its last look (RT11)
            return self.leases.store.expired.get(delivery_id, 0) > now
        expired = self.store.expired if isinstance(self.store, Store) else None
        return expired is not None and expired.holds(delivery_key(delivery_id), now_ms=now)

    def _check_not_expired(self, delivery_id: str) -> None:
        """RT4: a delivery whose idempotency record retention removed is never run again."""
        if self._expired(delivery_id):
            raise DeliveryError(
                ReasonCode.DELIVERY_EXPIRED,
                f"delivery {delivery_id} finished longer ago than [retention] "
                "idempotency_days; its result is no longer kept, and it is not run again",
            )

    async def cancel(self, delivery_id: str) -> None:
        """Cancel a queued or running delivery (its result: ``cancelled``); a finished one
        is left as it is; an unknown one raises ``delivery_unknown``."""
        pending = self._pending.get(delivery_id)
        if pending is None:
            if delivery_id not in self._known:
                if self.leases is not None:  # RT11: one that expired before this host began
                    await self.leases.store.learn_expired([delivery_id])
                self._check_not_expired(delivery_id)
                raise DeliveryError(ReasonCode.DELIVERY_UNKNOWN, f"no delivery {delivery_id}")
            if self._host.outbox.result_of(delivery_id) is not None or self.leases is None:
                return  # already finished
            # S26: it runs, or waits, on another host (or on none): the request is made
            # durable in the database and announced; its lane's holder — or the next one,
            # at its recovery — ends it ``cancelled``
            leased = self.leases.store
            await leased.write_document(_cancel_rel(delivery_id), delivery_id.encode())
            await leased.announce()
            return
        lane = self._lanes[pending.delivery.room]
        await lane.cancel(delivery_id)

    def stop_admitting(self) -> None:
        """Refuse every delivery from now on (``not_admitting``); what is admitted goes on."""
        self._admitting = False

    async def drain(self, seconds: float | None = None) -> None:
        """Stop admitting and let running turns finish, for up to ``seconds`` (default: the
        configured drain timeout). What has not finished stays pending (docs/design/recovery.md)."""
        self.stop_admitting()
        limit = self.config.thresholds.drain_timeout_seconds if seconds is None else seconds
        with trio.move_on_after(limit):
            while any(lane.busy for lane in self._lanes.values()):
                self._idle = trio.Event()
                await self._idle.wait()

    @property
    def admitting(self) -> bool:
        return self._admitting

    @property
    def receipts(self) -> ReceiptStore | None:
        """The receipt and document store (task lanes on this state directory share it)."""
        return self._host.receipts

    def pending(self) -> list[str]:
        """The delivery ids admitted and not finished, in no particular order."""
        return list(self._pending)

    def status(self, room: str | None = None, *, limit: int | None = None) -> list[RoomStatus]:
        """Each room lane this host has (or only ``room``), sorted by room; with ``limit``,
        the first ``limit`` of them only, the others' statuses not built (the operator page
        lists 500 of any number: operations.md OP6)."""
        if room is not None:
            found = room in self._lanes and (limit is None or limit > 0)
            return [self._status_of(room)] if found else []
        return list(itertools.islice(self.statuses(), limit))

    def statuses(self, *, after: str | None = None) -> Iterator[RoomStatus]:
        """The rooms' statuses sorted by room, from the first after ``after``, each built
        as it is taken: a caller that takes a page builds that page only (P15). Taken
        without an await between (the rooms may change at one)."""
        names = self._names
        start = 0 if after is None else bisect.bisect_right(names, after)
        return (self._status_of(names[i]) for i in range(start, len(names)))

    def rooms_after(self, after: str | None) -> int:
        """How many rooms sort after ``after`` (all for ``None``), no status built."""
        return len(self._names) - (0 if after is None else bisect.bisect_right(self._names, after))

    def _status_of(self, name: str) -> RoomStatus:
        lane = self._lanes[name]
        last = self._host.outbox.last_of_room.get(name)
        return RoomStatus(
            room=name,
            state="running" if lane.current is not None else "idle",
            queued=len(lane.queue),
            live_worker=lane.live_worker,
            last_result_seq=last.seq if last is not None else 0,
        )

    @property
    def room_count(self) -> int:
        """How many room lanes this host has: ``len(status())``, no status built."""
        return len(self._lanes)

    @property
    def last_seq(self) -> int:
        """The seq of the latest published result (0 before the first)."""
        return self._host.outbox.last_seq

    @property
    def acked_seq(self) -> int:
        """The seq every result up to which is acknowledged (a follow starts above it)."""
        return self._host.outbox.acked

    @property
    def unacknowledged(self) -> int:
        """Published results no client has acknowledged yet (seqs above the acknowledged
        one are never compacted away, so the difference counts them exactly)."""
        outbox = self._host.outbox
        return max(0, outbox.last_seq - outbox.acked)

    def result_of(self, delivery_id: str) -> DeliveryResult | None:
        return self._host.outbox.result_of(delivery_id)

    def last_result(self, room: str) -> DeliveryResult | None:
        """The room's latest published result, if it has one."""
        return self._host.outbox.last_of_room.get(room)

    def attachment(self, attachment_id: str) -> AttachmentRef | None:
        """The attachment ``attachment_id`` when a published result names it (what a client
        may fetch); ``None`` otherwise."""
        return self._host.outbox.attachment(attachment_id)

    def results(self, after: int | None = None) -> AsyncIterator[DeliveryResult]:
        """Every result above ``after`` (default: the last acknowledged seq), in seq order,
        then each new one; results not acknowledged come again after a restart (L5)."""
        return self._host.outbox.follow(after)

    async def ack(self, seq: int) -> None:
        """Acknowledge every result up to ``seq`` (cumulative, durable)."""
        await self._host.outbox.ack(seq)

    async def events(self) -> AsyncIterator[RoomEvent]:
        """Typing, text updates and tool activity as they happen (one reader)."""
        async for event in self._events_out:
            yield event

    # -- lanes -------------------------------------------------------------------------

    def _lane(self, room: str, fence: Fence | None = None) -> Lane:
        lane = self._lanes.get(room)
        if lane is None:
            assert self.leases is None or fence is not None, "a shared lane runs under a lease"
            lane = Lane(self._host, room, fence)
            self._lanes[room] = lane
            bisect.insort(self._names, room)
            self._nursery.start_soon(self._run_lane, lane)
        return lane

    async def _run_lane(self, lane: Lane) -> None:
        """Run ``lane`` until it stops. On a shared store, a lane that fails — a claimed
        lane whose session or log cannot be read back from the database (damaged, or the
        database out of reach), its directory not writable — stops alone (S13): its
        workers stopped, it is given up here like a lost lane (its deliveries left to a
        later claim, its lease left to run out) and not claimed here again for a lease's
        time. The fault is that room's, never the host's (nor, in turn, every host's that
        claims the room). A fault met in a task of the lane's own nursery (its epoch, its
        boundaries) comes as an exception group: one holding only such faults is the lane's
        too; one holding anything else (a cancellation, a bug) is not."""
        try:
            await lane.run()
        except (JournalError, OSError, ExceptionGroup) as error:
            fault = _storage_fault(error)
            if self.leases is None or fault is None:
                raise
            self._failed_until[lane.room] = trio.current_time() + self.leases.ttl
            if not lane.lost:  # (a lane lost meanwhile was given up as it stopped)
                lane.lose(f"it failed here: {fault}")
                self._lane_gone(lane)

    def _enqueue(self, lane: Lane, pending: Pending, *, front: bool = False) -> None:
        self._pending[pending.delivery_id] = pending
        lane.submit(pending, front=front)

    def _finished(self, pending: Pending) -> None:
        self._pending.pop(pending.delivery_id, None)
        self._unfinished.get(pending.delivery.room, {}).pop(pending.delivery_id, None)
        self._idle.set()

    def _emit(self, event: RoomEvent) -> None:
        try:
            self._events_in.send_nowait(event)
        except trio.WouldBlock:
            self.dropped_events += 1

    async def _reserve_worker(self, lane: Lane, slot: Slot) -> None:
        """Wait for a live-worker place for ``slot`` of ``lane`` (L8): the least recently
        used idle worker stops. Counted per worker, not per lane: a privileged delivery's
        one-shot worker beside its room's warm one is a second worker, and its end must not
        free the place of the one still running."""
        cap = self.config.caps.max_live_workers
        while slot not in self._live and len(self._live) >= cap:
            idle = [other for held, other in self._live.items() if other.idle_worker(held)]
            if idle:
                min(idle, key=lambda other: other.last_used).stop_worker()
            changed = self._live_changed
            await changed.wait()
        self._live[slot] = lane

    def _release_worker(self, lane: Lane, slot: Slot | None = None) -> None:
        """``slot``'s worker ended (L8); ``None``: every worker of ``lane`` (it is gone)."""
        for held in [s for s, owner in self._live.items() if owner is lane]:
            if slot is None or held is slot:
                del self._live[held]
        self._wake_reservations()

    def _lane_idle(self, lane: Lane) -> None:
        """A lane is done with a delivery — finished, or left pending by a failed write
        (L17): a reservation waiting for a slot may stop its worker, a drain look again."""
        self._idle.set()
        if lane in self._live.values():
            self._wake_reservations()

    def _wake_reservations(self) -> None:
        self._live_changed.set()
        self._live_changed = trio.Event()

    def _settings_print(self, grants: frozenset[str]) -> str:
        """The settings fingerprint for deliveries with ``grants`` (computed once per set)."""
        found = self._settings_prints.get(grants)
        if found is None:
            found = self._settings_prints[grants] = settings_fingerprint(self._settings(grants))
        return found

    def _settings(self, grants: frozenset[str]) -> dict[str, Any]:
        """What the settings fingerprint covers (docs/design/boundaries.md, journal.md), as named
        parts."""
        program = self._host.program
        route = self._host.route

        def tool(name: str) -> Any:  # L14: the effective class, as the gate applies it
            cls = str(replay_class_of(name, self._host.classes))
            spec = RUNTIME_TOOLS.get(name)
            return cls if spec is None else {**spec.declaration(), "replay_class": cls}

        tools = {name: tool(name) for name in sorted(grants)}
        return {
            "route": {
                "provider": route.provider,
                "model": route.model,
                "endpoint": route_endpoint(self.config.model.base_url),  # L15
                "context_window": route.context_window,
                "max_tokens": route.max_tokens,
            },
            "tools": tools,
            "worker": [str(program.kind), program.version, program.install_path],
            "persona": digest(self._host.persona or ""),
        }

    # -- recovery ----------------------------------------------------------------------

    # -- one host of many (a shared store; docs/design/scale-out.md) --------------------

    async def _admitted_shared(self, admission: Admission) -> Accepted:
        """Where a delivery admitted here goes on a shared store (S20): into its lane if
        this host holds it or can claim it; else the lane's holder is told (S23) and runs
        it (``queued``)."""
        room = str(admission.request["room"])
        delivery_id = admission.delivery_id
        ahead = any(d != delivery_id for d in self._unfinished.get(room, ()))
        lane = await self._take(room)
        if lane is not None:
            await self._reconcile(room)
        pending = self._pending.get(delivery_id)
        result = self._host.outbox.result_of(delivery_id)  # it may have run meanwhile
        disposition: Literal["started", "steered", "queued"] = "queued"
        if (pending is not None and pending.absorbed_into is not None) or (
            result is not None and result.outcome is Outcome.ABSORBED
        ):
            disposition = "steered"
        elif lane is not None and not ahead:
            disposition = "started"  # this host runs it, and nothing of the room was before it
        return Accepted(delivery_id=delivery_id, room=room, disposition=disposition)

    async def _take(self, room: str) -> Lane | None:
        """The room's lane, held and recovered by this host: claimed now if nobody holds it
        (S10) and recovered as a restart would (S13: leftovers killed, the session restored
        from the database, unfinished deliveries replayed). ``None`` while another host
        holds it, or when the claim or the recovery failed (the database, a damaged log):
        that stays in this room — the lane is given up and claimed again later; so is a
        lane whose caller was cancelled (a client gone) before it was ready: held and never
        ready, it would run nothing anywhere while this host lives."""
        while (taking := self._taking.get(room)) is not None:  # (a new take may begin
            await taking.wait()  # between its end and this task's turn: wait for that too)
        if room in self._lanes:  # held (or being given up: claimed again once it is gone)
            lane = self._lanes[room]
            return lane if room in self._ready and not lane.lost else None
        if trio.current_time() < self._not_before.get(room, -math.inf):
            return None  # another host's lease on it runs until then
        if trio.current_time() < self._failed_until.get(room, -math.inf):
            return None  # its lane failed here a moment ago (S13)
        assert self.leases is not None
        done = self._taking[room] = trio.Event()
        fence: Fence | None = None
        heard = self._releases_heard
        try:
            fence = await self.leases.claim(room)
            if fence is None:
                lease = await self.leases.store.lease(room)
                if self._releases_heard == heard:  # else the read may be stale: look again
                    remaining = lease.remaining if lease is not None and lease.live else 0.0
                    self._not_before[room] = trio.current_time() + remaining
                return None
            await self._sync()  # everything admitted before the claim is known now
            if self.leases.fence(room) != fence:
                return None  # lost again meanwhile
            logger.info(
                "lane %s claimed at epoch %d",
                room,
                fence.epoch,
                extra=fields("lane_claimed", room=room, epoch=fence.epoch),
            )
            lane = self._lane(room, fence)
            await self._recover({room})
            if self._lanes.get(room) is not lane or lane.lost:
                return None  # lost while it recovered: claimed again once it is gone
            self._ready.add(room)
            await self._reconcile(room)  # what was learned while it recovered
            return lane
        except BaseException as error:
            if fence is not None:
                with trio.CancelScope(shield=True):  # given up whole, whoever cancels
                    if (taken := self._lanes.get(room)) is not None and taken.fence == fence:
                        taken.lose("its claim was given up before the lane was ready")
                        # S12: released only once nothing of it runs here (its stop is
                        # bounded); renewed meanwhile, as a lane's lease is until it stops
                        await taken.stopped.wait()
                    await self.leases.release(fence)
            if isinstance(error, DiskFailedError | JournalError):
                return None
            raise
        finally:
            del self._taking[room]
            done.set()

    async def _reconcile(self, room: str) -> None:
        """Hand every unfinished delivery of ``room`` that this host has not taken yet —
        admitted by another host, or learned while the lane was being recovered — to the
        room's lane, if this host holds it. What the admitting host pinned is checked
        here as at a recovery (its grants and settings must be this host's too)."""
        lane = self._lanes.get(room)
        if lane is None or room not in self._ready:
            return
        for delivery_id in list(self._unfinished.get(room, ())):
            if lane.lost:  # given up during an earlier steer: the new holder runs the rest
                return
            if delivery_id in self._pending:
                continue
            record = self._admissions[delivery_id]
            delivery = msgspec.convert(record.request, Delivery)
            grants = self.config.grants_for(room, delivery.author.id)
            privileged = self.config.is_privileged(room, delivery.author.id)
            pending = Pending(delivery, record, grants or frozenset(), privileged)
            refused = self._refusal(record, delivery, grants)
            if refused is not None or delivery_id in self._cancels:  # S26: cancelled first
                self._pending[delivery_id] = pending
                self._nursery.start_soon(self._refuse, lane, pending, refused)
                continue
            await self._route(lane, pending)

    def _poke(self, released: bool) -> None:
        """Another host may have appended to a shared log, or given a lease up (S23)."""
        if released:
            self._releases_heard += 1
            self._not_before.clear()
        self._poked.set()

    async def _sync(self) -> None:
        """Learn what the other hosts appended to the shared logs, and hand new deliveries
        of the rooms this host holds to their lanes."""
        self._learn_admissions(await self.store.admissions.refresh())  # handed over there
        self._learn_results(await self._host.outbox.sync())
        if self.leases is not None:  # RT11: after the results, so a result a compaction
            await self.leases.store.sync_expired()  # removed unread is known as expired
        await self._learn_cancels()

    async def _learn_cancels(self) -> None:
        """S26: the cancel requests in the database; each of a delivery pending here is
        carried out (the others wait for their lane's holder, or its next one)."""
        if self.leases is None:
            return
        outbox = self._host.outbox
        found = await self.leases.store.documents(CANCELS)
        requested = {name: data.decode() for name, data in found.items()}
        done = [name for name, d in requested.items() if outbox.result_of(d) is not None]
        self._cancels = {d for d in requested.values() if outbox.result_of(d) is None}
        await self.leases.store.delete_documents(done)  # carried out, or moot: finished
        for delivery_id in sorted(self._cancels):
            pending = self._pending.get(delivery_id)
            if pending is None or pending.cancelled:
                continue
            lane = self._lanes.get(pending.delivery.room)
            if lane is not None and not lane.lost:
                self._nursery.start_soon(self._cancel_in, lane, delivery_id)

    async def _cancel_in(self, lane: Lane, delivery_id: str) -> None:
        """``lane.cancel`` from outside the lane's own task (S26): the lane is checked again
        when this task runs, and one lost to another host meanwhile (S11) publishes nothing
        — the new holder reads the request — which is not this task's failure."""
        if lane.lost:
            return
        try:
            await lane.cancel(delivery_id)
        except JournalError as error:
            if not fenced_out(error):
                raise

    async def _follow_shared(self) -> None:
        """Read the shared logs whenever told (S23), until cancelled. A database that cannot
        be reached is the store's failure (the host stops admitting, PG7); reading goes on.
        So it does after any other failure of a read (PG13: a log that refuses appends is
        still read): it is logged — once, until a read works again — and the next poke
        reads again; it never stops the host."""
        failed: str | None = None
        while True:
            await self._poked.wait()
            self._poked = trio.Event()
            try:
                await self._sync()
            except DiskFailedError:
                continue  # (the store's disk_failure says so)
            except JournalError as error:
                if str(error) != failed:
                    logger.warning(
                        "reading the shared logs failed: %s; reading goes on",
                        error,
                        extra=fields("shared_read_failed", code=error.code),
                    )
                failed = str(error)
                continue
            failed = None

    async def _claim_waiting(self, interval: float) -> None:
        """Claim the lanes whose deliveries wait while nobody here holds them — their holder
        died or stopped renewing (S12, S13) — every ``interval`` seconds, until cancelled."""
        seen: set[str] = set()
        while True:
            waiting = {
                room
                for room, ids in self._unfinished.items()
                if ids and room not in self._lanes and room not in self._taking
            }
            # a room is taken only once it waited a whole interval: the host that admitted
            # into it claims it itself right after the admission (S20)
            for room in sorted(waiting & seen):
                await self._take(room)
            seen = waiting
            # and at the moment a lease another host held can have run out, if sooner
            now = trio.current_time()
            until = [self._not_before[r] for r in waiting if self._not_before.get(r, 0) > now]
            await trio.sleep_until(min([now + interval, *until]))

    def _lane_lost(self, room: str, fence: Fence, why: str) -> None:
        """The lease ``fence`` is lost (S12: taken over, or not renewed in time): stop the
        lane — its workers first."""
        lane = self._lanes.get(room)
        if lane is not None and lane.fence == fence:
            lane.lose(why)

    def _lane_gone(self, lane: Lane) -> None:
        """A lost lane has stopped: forget it and its deliveries (another host runs them)."""
        if self._lanes.get(lane.room) is lane:
            del self._lanes[lane.room]
            del self._names[bisect.bisect_left(self._names, lane.room)]
        self._ready.discard(lane.room)
        for delivery_id, pending in list(self._pending.items()):
            if pending.delivery.room == lane.room:
                del self._pending[delivery_id]
        self._release_worker(lane)
        if self.leases is not None and lane.fence is not None:
            self.leases.drop(lane.room, lane.fence)
            logger.warning(
                "lane %s given up at epoch %d (%s); its workers are stopped",
                lane.room,
                lane.fence.epoch,
                lane.lost_why,
                extra=fields("lane_given_up", room=lane.room, epoch=lane.fence.epoch),
            )
        self._idle.set()

    # -- what this host knows -----------------------------------------------------------

    def _learn_admissions(self, records: list[Record]) -> list[Admission]:
        """Take in admissions (this host's, or read from the shared log — by a refresh of
        any path: a sync, or an append that lost the race for a number); the new ones. A
        new one in a room whose lane this host holds is handed to it (:meth:`_reconcile`)."""
        new = []
        for record in records:
            if isinstance(record, Settled):  # a finished delivery's idempotency record
                self._settled[record.delivery_id] = record
                self._known[record.delivery_id] = (record.request, record.room)
                if record.privileged is not True:  # L3, RT16: a one-shot one warms nothing
                    self._warm.add(record.room)
                continue
            if not isinstance(record, Admission) or record.delivery_id in self._admissions:
                continue
            room = room_of(record)
            self._learn_admission(record, room, self._admitted_privileged(record))
            new.append(record)
        return new

    def _admitted_privileged(self, record: Admission) -> bool:
        """Whether ``record``'s delivery was admitted privileged (a one-shot session, L6):
        as it says, or — written before that was recorded — as the configuration says."""
        if record.privileged is not None:
            return record.privileged
        delivery = msgspec.convert(record.request, Delivery)
        return self.config.is_privileged(delivery.room, delivery.author.id)

    def _learn_admission(self, record: Admission, room: str, privileged: bool) -> None:
        """Take in one new admission of ``room`` (:meth:`_learn_admissions`; an append of
        this host's passes what it already knows of the delivery)."""
        self._admissions[record.delivery_id] = record
        self._known[record.delivery_id] = (record.fingerprints.request, room)
        if self._host.outbox.result_of(record.delivery_id) is None:
            self._unfinished.setdefault(room, {})[record.delivery_id] = None
        if not privileged:  # L3: a privileged one ran in a one-shot session (L6)
            self._warm.add(room)
        if room in self._ready:  # another host admitted into a lane held here
            self._nursery.start_soon(self._reconcile, room)

    def _forget_expired(self, expired: Iterable[str]) -> None:
        """RT11: let go of what this host knows of deliveries a compaction expired (here or on
        another host): they finished, were acknowledged, and are no longer in the shared logs
        — a duplicate of one is ``delivery_expired`` from now on."""
        gone = [d for d in expired if d in self._known]
        for delivery_id in gone:
            room = self._known.pop(delivery_id)[1]
            self._admissions.pop(delivery_id, None)
            self._settled.pop(delivery_id, None)
            if (unfinished := self._unfinished.get(room)) is not None:
                unfinished.pop(delivery_id, None)
        if gone:
            self._host.outbox.forget(set(gone))
            self._expired_upto = 0  # the publication order was renumbered
            self._removed_ahead.clear()
            self._renumbered += 1

    def _learn_results(self, results: list[DeliveryResult]) -> None:
        for result in results:
            self._unfinished.get(result.room, {}).pop(result.delivery_id, None)

    # -- recovery ----------------------------------------------------------------------

    async def _recover(self, rooms: set[str] | None = None) -> None:
        """Pick up what a previous owner left: kill its epochs' trees, then requeue every
        admitted delivery without a published result, in admission order
        (docs/design/recovery.md) — of every room, or (a shared store, S13) of ``rooms``,
        whose lanes this host has just claimed. A delivery whose turn never began (it has
        no log) is not charged a recovery attempt (L19)."""
        await self._kill_leftover_epochs(rooms)
        published = self._host.outbox
        chosen = self._unfinished.keys() if rooms is None else rooms
        ids = {d for room in chosen for d in self._unfinished.get(room, ())}
        running = [a for d, a in self._admissions.items() if d in ids and d not in self._pending]
        steered = await self._steered(
            [a.delivery_id for a in running] + self._finished_owners(running)
        )
        cancels = await _read_cancel_requests(self.store)
        if any(published.result_of(d) is not None for d in cancels):  # applied: forget them
            unfinished = [d for d in cancels if published.result_of(d) is None]
            await self.store.write_document(CANCEL_REQUESTS, _encode_ids(unfinished))
        if rooms is not None:  # a claimed lane: the cancels other hosts took (S26)
            await self._learn_cancels()
        # Everything read from the store is read before the loop: between a lane's start (its
        # first delivery may run at once) and the riders attached to that delivery (L10),
        # nothing is awaited. L19: whose turn began in a run before this start (its log is
        # made as it begins); one only queued at the crash, here or on any host, is charged
        # nothing
        began = {
            r.delivery_id: await self.store.exists(self.store.delivery_rel(r.delivery_id))
            for r in running
        }
        await self._resume_schedules([d for d, logged in began.items() if logged])
        # a refused or cancelled delivery whose result is recorded in its log already is
        # published with that one (L5): read for each such one, again while the reads let a
        # cancel arrive (S26) that makes one more such
        recorded: dict[str, bool] = {}
        while True:
            decided = [self._decide(record, cancels, steered) for record in running]
            unread = [
                d.record.delivery_id
                for d in decided
                if (d.refused is not None or d.cancelled) and d.record.delivery_id not in recorded
            ]
            if not unread:
                break
            for delivery_id in unread:
                recorded[delivery_id] = await self._recorded_result(delivery_id)
        replaying: set[str] = set()
        for decision in decided:
            record, delivery, grants = decision.record, decision.delivery, decision.grants
            refused, cancelled = decision.refused, decision.cancelled
            if recorded.get(record.delivery_id):
                refused, cancelled = None, False  # its lane publishes the recorded one
            privileged = self.config.is_privileged(delivery.room, delivery.author.id)
            recovering = began[record.delivery_id]
            if rooms is None:
                lane = self._lane(delivery.room)
            else:  # claimed just now: still held after the last await? (else: claimed later)
                held = self._lanes.get(delivery.room)
                if held is None or held.lost:
                    continue
                lane = held
            pending = Pending(delivery, record, grants or frozenset(), privileged, recovering)
            if refused is not None or cancelled:
                self._pending[record.delivery_id] = pending
                self._nursery.start_soon(self._refuse, lane, pending, refused)
                continue
            owner_id = steered.get(record.delivery_id)
            if owner_id is not None and self._absorbed_at_recovery(lane, pending, owner_id):
                continue
            owner = self._pending.get(owner_id[0]) if owner_id is not None else None
            if owner is not None and owner_id is not None and owner_id[0] in replaying:
                self._pending[record.delivery_id] = pending  # it rides its owner's replay
                pending.absorbed_into = owner.delivery_id
                lane.ride(owner, Absorbed(pending, owner_id[1], owner_id[2], owner_id[3]))
                continue
            replaying.add(record.delivery_id)  # an owner refused or cancelled: its own turn
            self._enqueue(lane, pending)

    async def _resume_schedules(self, delivery_ids: list[str]) -> None:
        """PB2: the route's breaker takes the schedule of every delivery found parked (its log
        ends in a :class:`Parked`: nothing ran since) before any lane runs — so no delivery
        admitted after the start, nor another recovered one, asks the provider sooner than
        the schedule recorded, nor restarts the route's failures in a row, whichever lane
        reads its log first. (The lanes' own look at their park changes nothing after it.)"""
        breaker = self._host.breaker
        if breaker is None:
            return
        for delivery_id in delivery_ids:
            records = await self._log_records(delivery_id)
            if records and isinstance(last := records[-1], Parked):
                breaker.resume(last)

    def _decide(
        self,
        record: Admission,
        cancels: Collection[str],
        steered: Mapping[str, _Steered],
    ) -> _Recovered:
        """How recovery takes up ``record`` on what is known now (no I/O): refused for what
        changed (L11), or cancelled — by `pi-runtime cancel` while no server ran, or by
        another host (S26) — unless it was steered into a run: it rides its owner's replay,
        as a live cancel leaves it (L10)."""
        delivery = msgspec.convert(record.request, Delivery)
        grants = self.config.grants_for(delivery.room, delivery.author.id)
        asked = record.delivery_id in cancels or record.delivery_id in self._cancels
        cancelled = asked and record.delivery_id not in steered
        refused = None if cancelled else self._refusal(record, delivery, grants)
        return _Recovered(record, delivery, grants, refused, cancelled)

    def _finished_owners(self, unfinished: list[Admission]) -> list[str]:
        """Owners that finished while deliveries steered into them did not: the host died
        between the owner's result and theirs. Since L22 those are recorded before the owner
        is published, so what is found here is an owner whose result was durable but not
        yet published, its absorbed ones not yet recorded. Only the latest owner
        of a room can be one — the room's latest result, or the owner that one was absorbed
        into — so one log per room with unfinished deliveries is read, not every log."""
        owners = []
        for room in {a.request.get("room") for a in unfinished}:
            last = self._host.outbox.last_of_room.get(str(room))
            if last is not None:
                owners.append(last.absorbed_into or last.delivery_id)
        return owners

    def _absorbed_at_recovery(self, lane: Lane, pending: Pending, owner: _Steered) -> bool:
        """A steered delivery whose owner's result is already durable ends as it would have
        (L10): ``absorbed`` when a model request carried it and the owner answered; else it
        runs as its own turn (False)."""
        result = self._host.outbox.result_of(owner[0])
        if result is None:
            return False
        if owner[2] is None or result.outcome not in (Outcome.REPLY, Outcome.SILENT):
            return False
        self._pending[pending.delivery_id] = pending
        absorbed = Result(
            outcome=Outcome.ABSORBED,
            absorbed_into=owner[0],
            finished_ms=self._host.clocks.wall.time_ms(),
        )
        self._nursery.start_soon(self._write_result, lane, pending, absorbed)
        return True

    async def _write_result(self, lane: Lane, pending: Pending, result: Result) -> None:
        """``lane.write_result`` from outside the lane's own task: a lane lost to another
        host meanwhile (S11) publishes nothing, and that is not this task's failure."""
        try:
            await lane.write_result(pending, result)
        except JournalError as error:
            if not fenced_out(error):
                raise

    # -- retention (docs/design/retention.md) --------------------------------------------

    async def expire_journals(self) -> int:
        """Remove the step journal (and one-shot session) of every delivery whose result was
        acknowledged and published more than ``[retention] journal_days`` ago (RT2); how many
        were removed. Kept whatever their age (RT1): unacknowledged results, and every
        delivery of a room that has one unfinished (a replay there may read its owners' logs).
        The delivery's admission and result stay in the shared logs, so a duplicate still gets
        its result (RT3). On PostgreSQL too (RT11; there a room's latest result's journal is
        kept while it is the latest)."""
        store = self.store
        cutoff = self._host.clocks.wall.time_ms() - self.config.retention.journal_days * 86_400_000
        async with self._retaining:
            renumbered = self._renumbered
            removed, upto = await expire_step_journals(
                store,
                self._host.outbox,
                self._busy,
                cutoff_ms=int(cutoff),
                start=self._expired_upto,
                removed_ahead=self._removed_ahead,
            )
            if renumbered == self._renumbered:  # else the next look starts over
                self._expired_upto = upto
            else:
                self._removed_ahead.clear()
        return removed

    def _busy(self, room: str) -> bool:
        return bool(self._unfinished.get(room))

    async def compact(self) -> Compaction:
        """Compact the shared logs now (RT4-RT8, :func:`compact_shared`): slim the admissions
        of deliveries past ``journal_days`` to idempotency records, expire those past
        ``idempotency_days`` (a duplicate is then ``delivery_expired``), rewrite both logs
        with what is left. Admissions wait only for the end of the admission log's rewrite
        (those admitted meanwhile are carried over), results for the end of the result
        log's. What it did. On a shared store: :meth:`_compact_rows`."""
        store = self.store
        if self.leases is not None:
            return await self._compact_rows()
        if not isinstance(store, Store):
            return Compaction()
        taken = 0

        def admitted() -> list[Admission | Settled]:
            nonlocal taken
            taken = len(self._admissions)
            return [*self._settled.values(), *self._admissions.values()]

        @contextlib.asynccontextmanager
        async def held() -> AsyncIterator[list[Record]]:
            async with self._admissions_paused():  # only admissions append to the log
                yield list(itertools.islice(self._admissions.values(), taken, None))

        def rewritten(plan: Compaction) -> None:
            """The admission log is durable without them: what this host knows follows it
            at once, as a restart would (RT4: before the result log drops a result, a
            duplicate of an expired delivery is ``delivery_expired``, never ``duplicate``
            with its result gone)."""
            for delivery_id in plan.expired:
                self._settled.pop(delivery_id, None)
                self._admissions.pop(delivery_id, None)
                self._known.pop(delivery_id, None)
            for delivery_id, settled in plan.settled.items():
                self._admissions.pop(delivery_id, None)
                self._settled[delivery_id] = settled

        async with self._retaining:
            plan = await compact_shared(
                store,
                self._host.outbox,
                admitted,
                busy=self._busy,
                retention=self.config.retention,
                held=held,
                bytes_per_second=self.config.retention.compact_bytes_per_second,
                privileged=self._admitted_privileged,  # RT16
                admissions_rewritten=rewritten,
            )
            if plan.changes:  # both logs are durable
                self._expired_upto = 0  # the publication order was renumbered
                self._removed_ahead.clear()
        return plan

    async def _compact_rows(self) -> Compaction:
        """RT11: compact a shared store's logs — one host at a time, under the compaction's
        own lease (another host holding it: nothing done here). On the logs as the database
        holds them now (:func:`plan_shared_compaction`): the step journals of what is
        slimmed or expired removed first, then one transaction rewrites and deletes the rows
        and records the expired deliveries, and every host — this one too, by the same
        :meth:`~runtime._journal._interface.LeaseStore.sync_expired` — forgets them. No
        admission or result waits for it. What it did."""
        assert self.leases is not None
        leased = self.leases.store
        async with self._retaining:  # one here at a time: a second claim would fence the first
            fence = await leased.claim(COMPACTION_LEASE, self.config.store.lease_seconds)
            if fence is None:
                return Compaction()
            try:
                await self._sync()  # what this host knows is busy, as of now
                planned = plan_shared_compaction(
                    await leased.read_shared(),
                    busy=self._busy,
                    retention=self.config.retention,
                    now_ms=self._host.clocks.wall.time_ms(),
                    privileged=self._admitted_privileged,  # RT16
                )
                if not planned.changes:
                    await self._drop_attachment_documents(planned)  # left by earlier ones
                    return Compaction()
                plan = planned.plan
                going = [(s.delivery_id, s.room) for s in plan.settled.values()]
                going += [(d, e.room) for d, e in plan.expired.items()]
                await remove_step_journals(leased, going)
                done = await leased.compact_shared(
                    fence,
                    slim=planned.slim,
                    admissions=planned.admissions,
                    results=planned.results,
                    expire=planned.expire,
                    forget_ms=planned.forget_ms,
                )
                if done is None:  # the lease was lost meanwhile: the next holder does it
                    return Compaction()
                await leased.sync_expired()  # forgets what expired, as every host does
                await self._drop_attachment_documents(planned)
                for delivery_id, settled in plan.settled.items():
                    if self._admissions.pop(delivery_id, None) is not None:
                        self._settled[delivery_id] = settled
                return plan
            finally:
                with trio.CancelScope(shield=True):
                    await leased.release(fence)

    async def _drop_attachment_documents(self, planned: SharedCompaction) -> int:
        """RT11, A11: remove every attachment document no result that stays names, nor an
        unfinished delivery's log (its result will carry it), and that was not written in
        the last ``idempotency_days`` (an ``attach`` writes its document again, so one on
        another host now, its outcome not yet recorded, keeps it): those of expired results,
        and any an ``attach`` left when its host died before the outcome. How many went."""
        assert self.leases is not None
        keep = set(planned.named)
        for delivery_id in planned.unfinished:
            for record in await self._log_records(delivery_id):
                if isinstance(record, ToolOutcome):
                    keep.update(ref.sha256 for ref in record.attachments)
        idle = self.config.retention.idempotency_days * 86_400
        return await self.leases.store.sweep_documents(
            SHARED_ATTACHMENTS, keep=[SHARED_ATTACHMENTS + sha for sha in keep], idle_seconds=idle
        )

    @contextlib.asynccontextmanager
    async def _admissions_paused(self) -> AsyncIterator[None]:
        """Hold every admission append back, once those under way are durable."""
        resume = self._paused = trio.Event()
        try:
            while self._appending:
                self._drained = trio.Event()
                await self._drained.wait()
            yield
        finally:
            self._paused = None
            resume.set()

    async def _retain_periodically(self, sweep_hours: float, compact_hours: float) -> None:
        """:meth:`expire_journals` now and every ``sweep_hours``, :meth:`compact` now and
        every ``compact_hours``; a failure is logged and the next look
        tries again (a fault of retention stays in retention)."""
        next_compaction = trio.current_time()
        while True:
            try:
                removed = await self.expire_journals()
                if removed:
                    logger.info(
                        "retention: removed %d expired step journal(s)",
                        removed,
                        extra=fields("retention_journals_removed"),
                    )
                if trio.current_time() >= next_compaction:
                    next_compaction = trio.current_time() + compact_hours * 3600
                    plan = await self.compact()
                    if plan.changes:
                        logger.info(
                            "retention: compacted the shared logs: %d idempotency record(s) "
                            "kept in place of admissions, %d delivery id(s) expired",
                            len(plan.settled),
                            len(plan.expired),
                            extra=fields("retention_compacted"),
                        )
            except (OSError, JournalError) as error:
                code = error.code if isinstance(error, JournalError) else None
                logger.warning("retention: %s", error, extra=fields("retention_failed", code=code))
            await trio.sleep(min(sweep_hours, compact_hours) * 3600)

    async def _sweep_attachments(self, attachments: AttachmentStore) -> None:
        """Remove the attachment files no record names (A8): their writer died between the
        file and its outcome. Named are those of every published result and of every outcome
        in the log of a delivery still unfinished (its result will carry them). When such a
        log cannot be read, nothing is removed at this start: what it names is unknown."""
        referenced = self._host.outbox.referenced()
        for ids in self._unfinished.values():
            for delivery_id in ids:
                records = await self._read_log(delivery_id)
                if records is None:  # it may name some: nothing is removed on a guess
                    logger.warning(
                        "attachment files are not swept at this start: the log of unfinished "
                        "delivery %s cannot be read, and may name some of them",
                        delivery_id,
                        extra=fields("attachments_sweep_failed", delivery_id=delivery_id),
                    )
                    return
                for record in records:
                    if isinstance(record, ToolOutcome):
                        referenced.update(ref.sha256 for ref in record.attachments)
        try:
            removed = await trio.to_thread.run_sync(attachments.sweep, referenced)
        except OSError as error:  # the root cannot be swept: the orphans wait, nothing else does
            logger.warning(
                "cannot sweep the attachment root %s: %s",
                attachments.root,
                error,
                extra=fields("attachments_sweep_failed"),
            )
            return
        if removed:
            logger.info(
                "removed %d orphaned attachment file(s)",
                len(removed),
                extra=fields("attachments_swept"),
            )

    async def _steered(self, owners: list[str]) -> dict[str, _Steered]:
        """For each delivery steered into one of ``owners``: (owner, text, first step, the
        last step answered before it — L26), from the owners' logs (only deliveries whose
        turn started have one)."""
        found: dict[str, _Steered] = {}
        for owner in owners:
            records = await self._log_records(owner)
            answered = {r.step for r in records if isinstance(r, ModelResponse)}
            for record in records:
                if isinstance(record, AbsorbedInput):
                    first = record.first_step
                    after = (
                        -1 if first is None else max((s for s in answered if s < first), default=-1)
                    )
                    found[record.delivery_id] = (owner, record.text, first, after)
        return found

    async def _recorded_result(self, delivery_id: str) -> bool:
        """Whether a ``Result`` is already durable in the delivery's own log (the host died
        before publishing it): recovery publishes that one (L5, docs/design/recovery.md step
        1) — a refusal (changed settings, L11) or a cancel must not replace a turn that
        already ended, often a paid answer, with a second, contradicting result. Read only
        for a delivery about to be refused or cancelled."""
        return any(isinstance(r, Result) for r in await self._log_records(delivery_id))

    async def _log_records(self, delivery_id: str) -> tuple[Record, ...]:
        """The records of a delivery's own log; none when its turn never began (no log) or
        the log is damaged (its lane refuses it, ``recovery_refused:journal``)."""
        return await self._read_log(delivery_id) or ()

    async def _read_log(self, delivery_id: str) -> tuple[Record, ...] | None:
        """The records of a delivery's own log (none when its turn never began: no log);
        ``None`` when the log cannot be read (damaged)."""
        if not await self.store.exists(self.store.delivery_rel(delivery_id)):
            return ()
        try:
            return (await self.store.read_delivery_log(delivery_id)).records
        except JournalError:
            return None

    def _refusal(
        self, record: Admission, delivery: Delivery, grants: frozenset[str] | None
    ) -> str | None:
        """``recovery_refused:<what>`` when what the admission pinned has changed."""
        if grants is None:
            return ReasonCode.RECOVERY_REFUSED.at("grants")
        now = fingerprints(delivery, grants=grants, settings=self._settings_print(grants))
        if now.authority != record.fingerprints.authority:
            return ReasonCode.RECOVERY_REFUSED.at("grants")
        changed = changed_settings(record.fingerprints.settings, now.settings)
        if changed:  # tools, route, worker or persona (docs/design/recovery.md)
            return ReasonCode.RECOVERY_REFUSED.at(changed[0])
        return None

    async def _refuse(self, lane: Lane, pending: Pending, code: str | None) -> None:
        """End a recovered delivery without a turn: ``failed`` with ``code``, or
        ``cancelled`` (``code`` None) when a cancel was requested while no server ran."""
        outcome = Outcome.CANCELLED if code is None else Outcome.FAILED
        if code is not None:  # recovery_refused:<what> (docs/design/operations.md)
            labelled(RECOVERY_REFUSALS, code).inc()
        result = Result(outcome=outcome, code=code, finished_ms=self._host.clocks.wall.time_ms())
        await self._write_result(lane, pending, result)

    async def _kill_leftover_epochs(self, rooms: set[str] | None = None) -> None:
        if rooms is None:
            rels = await self.store.lane_logs()
        else:
            rels = [self.store.lane_rel(room) for room in sorted(rooms)]
            rels = [rel for rel in rels if await self.store.exists(rel)]
        for rel in rels:
            contents = await self.store.read(rel)
            launching: dict[int, EpochLaunching] = {}
            started: dict[int, EpochStarted] = {}
            for record in contents.records:
                if isinstance(record, EpochLaunching):
                    launching[record.epoch] = record
                elif isinstance(record, EpochStarted):
                    launching.pop(record.epoch, None)
                    started[record.epoch] = record
                elif isinstance(record, EpochFenced):
                    launching.pop(record.epoch, None)
                    started.pop(record.epoch, None)
            for record in started.values():
                await kill_epoch_leftovers(record)
            for launch in launching.values():  # W13: a crash between the spawn and the start
                await kill_launch_leftovers(launch.nonce)


@contextlib.asynccontextmanager
async def _releasing_leases(worker: Callable[[], RoomWorker | None]) -> AsyncIterator[None]:
    """On leaving (after every lane and its workers stopped): give up the leases the worker
    still holds, so the other hosts claim its rooms at once rather than when the leases run
    out (bounded; they run out anyway)."""
    try:
        yield
    finally:
        running = worker()
        if running is not None and running.leases is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_BOUND):
                for fence in running.leases.held.values():
                    await running.leases.release(fence)


RELEASE_BOUND: Final = 5.0
"""Seconds a stopping host spends giving its leases up."""

CANCEL_REQUESTS: Final = "cancel-requests.json"
"""A document in the state directory: deliveries whose cancel was requested while no server
ran; the next start ends each ``cancelled`` before anything runs (docs/design/protocol.md,
``cancel``)."""

CANCELS: Final = "cancels/"
"""On a shared store, one document per cancel a host took for a delivery it does not run
(S26): ``cancels/<delivery key>``, holding the delivery id."""

COMPACTION_LEASE: Final = "retention:shared"
"""The lease a host holds while it compacts a shared store's logs (RT11): one at a time. No
room is named so (a room id is ``dm:…`` or ``guild:…:…``), nor a task lane (``task:…``)."""


def _count_down(counts: dict[str, int], room: str) -> None:
    """One less for ``room`` in ``counts`` (the key dropped at zero)."""
    if (left := counts[room] - 1) == 0:
        del counts[room]
    else:
        counts[room] = left


def _cancel_rel(delivery_id: str) -> str:
    return CANCELS + delivery_key(delivery_id)


def _open_journal_store(
    config: RoomWorkerConfig, *, clocks: Clocks, fs: FileSystem | None, sync_log: bool = True
) -> contextlib.AbstractAsyncContextManager[JournalStore]:
    """The configured journal store: the file store in ``state_dir`` (the default), or the
    PostgreSQL store when ``[store] url`` names a database (``docs/design/scale-out.md``),
    shared with the deployment's other hosts; ``state_dir`` then keeps only what is local
    (copies of sessions, sockets, the token, the receipt store)."""
    state_dir = Path(config.state_dir)
    if config.store.url is None:
        return open_store(state_dir, clocks=clocks, fs=fs, sync_log=sync_log)
    if fs is not None:
        raise ConfigError("store.url", "a file system is given to the file store only")
    try:  # the optional extra pi-runtime[postgres]
        from .._journal._postgres import open_pg_store
    except ImportError as error:
        raise ConfigError(
            "store.url", f"the PostgreSQL store needs pi-runtime[postgres] ({error})"
        ) from None
    owner = config.store.host_name or f"{socket.gethostname()}:{state_dir}"
    return open_pg_store(config.store.url, root=state_dir, clocks=clocks, owner=owner)


@contextlib.asynccontextmanager
async def _open_runnable_store(
    config: RoomWorkerConfig, *, clocks: Clocks, fs: FileSystem | None, sync_log: bool
) -> AsyncIterator[JournalStore]:
    """The configured journal store (:func:`_open_journal_store`), once C16 holds
    (docs/design/config.md): this start strands none of the deliveries the state directory's
    file store holds pending. Checked here, in every start — ``serve``'s and an embedder's —
    under the state directory's lock, before anything is written or run: before
    ``retention.json`` is recorded again and before any delivery is resumed."""
    if config.store.url is not None:
        await trio.to_thread.run_sync(_refuse_file_store_pending, config)
    async with _open_journal_store(config, clocks=clocks, fs=fs, sync_log=sync_log) as store:
        if isinstance(store, Store):
            await _refuse_work_root_changed(config, store)
        yield store


async def _refuse_work_root_changed(config: RoomWorkerConfig, store: Store) -> None:
    """C16 ``work_root_changed``, ``store`` open (its lock held): refuse a ``work_root`` that
    is not the one recorded when the pending deliveries were admitted (``retention.json``,
    RT14). A room's turn is replayed in its lane's working directory below ``work_root``, byte
    for byte (G1): Pi's system prompt names that directory, its session records it; in another
    one the replay would not match. A delivery whose cancel is recorded (``pi-runtime cancel``
    with no server) is not counted: recovery ends it ``cancelled`` before anything runs. A
    damaged record refuses nothing: this start replaces it (:func:`record_settings`)."""
    pending = _pending(store.admissions.contents.records, store.results.contents.records)
    if not pending:
        return
    try:
        recorded = await read_settings(store)
    except JournalError:
        return
    if recorded is None:
        return
    now = RetentionSettings.of(config).task_work_root
    if await trio.to_thread.run_sync(_same_directory, recorded.task_work_root, now):
        return  # (the same directory by another name, a symbolic link, is the same)
    cancels = set(await _read_cancel_requests(store))
    stranded = [d for d in pending if d not in cancels]
    if stranded:
        state_dir, before = config.state_dir, str(Path(recorded.task_work_root).parent)
        raise ConfigError(
            "work_root",
            f"{state_dir} holds {_deliveries(stranded)} admitted while work_root was "
            f"{before}; their turns replay in their rooms' directories there, not below "
            f"{config.work_root}: start with work_root = {before} until `pi-runtime status "
            f"--state-dir {state_dir}` shows none pending, or cancel them (`pi-runtime "
            "cancel ID` for each: this start then ends them cancelled)",
            code=ReasonCode.WORK_ROOT_CHANGED,
        )


def _refuse_file_store_pending(config: RoomWorkerConfig) -> None:
    """C16 ``file_store_pending`` (blocking; before the PostgreSQL store is opened): refuse
    a start on the database while the state directory's file store holds pending
    deliveries — the database's hosts never read the file store, so they would never run
    nor be answered. Read under the directory's lock, taken for the read: when a server
    holds it (it runs those deliveries itself), or the logs cannot be read, nothing is
    refused."""
    state_dir = Path(config.state_dir)
    if not (state_dir / ADMISSIONS).exists():
        return  # no file store here: nothing can be stranded
    try:
        lock = acquire_lock(state_dir)
    except (StateDirError, OSError):
        return
    try:
        status = offline_status(state_dir, recent=0)
    except (JournalError, StateDirError, OSError, msgspec.DecodeError):
        return
    finally:
        os.close(lock)
    pending = [str(d["delivery_id"]) for d in status["pending_deliveries"]]
    if pending:
        raise ConfigError(
            "store.url",
            f"the file store in {state_dir} holds {_deliveries(pending)} no PostgreSQL "
            "host will ever run; serve once without --store (and no [store] url) until "
            f"`pi-runtime status --state-dir {state_dir}` shows none pending (to give "
            "them up: `pi-runtime cancel ID` for each, then that start ends them "
            "cancelled), or give the PostgreSQL hosts another state directory",
            code=ReasonCode.FILE_STORE_PENDING,
        )


def _pending(admissions: Iterable[Record], results: Iterable[Record]) -> list[str]:
    """The deliveries admitted without a published result, in admission order."""
    published = {r.delivery_id for r in results if isinstance(r, ResultPublished)}
    return [
        r.delivery_id
        for r in admissions
        if isinstance(r, Admission) and r.delivery_id not in published
    ]


def _same_directory(one: str, other: str) -> bool:
    """Blocking: ``one`` and ``other`` name one directory (by a symbolic link too)."""
    return Path(one).resolve() == Path(other).resolve()


def _deliveries(ids: list[str], shown: int = 5) -> str:
    """``3 pending deliveries (d1, d2, d3)``, the first ``shown`` ids named."""
    named = ", ".join(repr(i) for i in ids[:shown]) + (", …" if len(ids) > shown else "")
    return f"{len(ids)} pending deliver{'y' if len(ids) == 1 else 'ies'} ({named})"


@contextlib.asynccontextmanager
async def _open_receipt_store(
    config: RoomWorkerConfig, store: JournalStore, *, clocks: Clocks
) -> AsyncIterator[ReceiptStore]:
    """The receipt store beside the journal: ``receipts.sqlite`` in ``state_dir`` with the
    file store, the database's tables with the PostgreSQL store, where the next holder of a
    lane finds the receipts its intents need (receipts.md R9)."""
    if config.store.url is None:
        async with receipt_store(config.state_dir, now_ms=clocks.wall.time_ms) as receipts:
            yield receipts
        return
    from .._boundary._receipts_pg import PgReceiptStore  # the optional extra, as the store
    from .._journal._postgres import PgStore

    assert isinstance(store, PgStore)
    yield PgReceiptStore(store, now_ms=clocks.wall.time_ms)


async def _read_cancel_requests(store: JournalStore) -> list[str]:
    data = await store.read_document(CANCEL_REQUESTS)
    return [] if data is None else msgspec.json.decode(data, type=list[str])


def _encode_ids(ids: list[str]) -> bytes:
    return msgspec.json.encode(sorted(set(ids)))


async def request_cancel(
    state_dir: Path | str, delivery_id: str, *, clocks: Clocks | None = None
) -> Literal["requested", "finished"]:
    """Cancel ``delivery_id`` in a state directory no server runs on: the request is made
    durable and the next start ends the delivery ``cancelled`` before anything runs.
    ``finished`` when it already has a result. Raises ``state_dir_locked`` when a server owns
    the directory (cancel through it), ``delivery_unknown`` when it was never admitted."""
    await trio.to_thread.run_sync(require_journal, Path(state_dir))  # nothing created there
    async with open_store(Path(state_dir), clocks=clocks or Clocks.system()) as store:
        records = store.admissions.contents.records
        admitted = (Admission, Settled)
        if not any(isinstance(r, admitted) and r.delivery_id == delivery_id for r in records):
            if store.expired.holds(delivery_key(delivery_id), now_ms=store.clocks.wall.time_ms()):
                return "finished"  # long ago: retention removed its result (RT4)
            raise DeliveryError(ReasonCode.DELIVERY_UNKNOWN, f"no delivery {delivery_id}")
        if ResultOutbox(store.results).result_of(delivery_id) is not None:
            return "finished"
        requested = await _read_cancel_requests(store)
        await store.write_document(CANCEL_REQUESTS, _encode_ids([*requested, delivery_id]))
    return "requested"


async def request_cancel_in_database(
    dsn: str, delivery_id: str
) -> Literal["requested", "finished"]:
    """Cancel ``delivery_id`` of the deployment on the PostgreSQL store ``dsn`` names, from
    outside any host (S26): the request is made durable and announced; the holder of the
    delivery's room — or the next one — ends it ``cancelled``. ``finished`` when it already
    has a result; ``delivery_unknown`` when it was never admitted."""
    from .._journal._postgres import open_pg_reader  # the optional extra, as the store

    async with open_pg_reader(dsn) as store:
        records = store.admissions.contents.records
        if not any(isinstance(r, Admission) and r.delivery_id == delivery_id for r in records):
            raise DeliveryError(ReasonCode.DELIVERY_UNKNOWN, f"no delivery {delivery_id}")
        if ResultOutbox(store.results).result_of(delivery_id) is not None:
            return "finished"
        await store.write_document(_cancel_rel(delivery_id), delivery_id.encode())
        await store.announce()
    return "requested"


@raises_one_error
@contextlib.asynccontextmanager
async def open_room_worker(
    config: RoomWorkerConfig,
    *,
    clocks: Clocks | None = None,
    base_dir: Path | None = None,
    fs: FileSystem | None = None,
    sync_log: bool = True,
) -> AsyncIterator[RoomWorker]:
    """Run a room worker on ``config`` until the block ends (see the module docstring).

    Relative ``state_dir`` and ``work_root`` resolve against ``base_dir`` (default: the
    current directory). ``fs`` is the journal store's file system (tests pass one that
    fails or loses power on purpose); sessions and work directories are always on disk.
    ``sync_log=False`` makes the file store sync each delivery's log on its own
    (:func:`~runtime.open_store`; a test that fails the n-th write of one delivery's file).
    """
    config = validate_config(config, base=base_dir)
    state_dir = Path(config.state_dir)
    work_root = Path(config.work_root)
    program = worker_program(config)
    clocks = clocks or Clocks.system()
    worker: RoomWorker | None = None
    attachments = AttachmentStore(config.attachment_root())  # A1
    async with (
        _open_runnable_store(config, clocks=clocks, fs=fs, sync_log=sync_log) as store,
        _open_receipt_store(config, store, clocks=clocks) as receipts,
        _releasing_leases(lambda: worker),
        trio.open_nursery() as nursery,
    ):
        if isinstance(store, Store):  # a pass with no server acts with these (RT14)
            await record_settings(store, RetentionSettings.of(config))
        else:  # RT4, RT11: the deployment's expired ids count with this host's forget_days
            await follow_forget_days(store, config.retention)
        model = config.model
        base_url, route = await start_model(model, nursery)
        thresholds = config.thresholds
        upstream = GatewayConfig(
            upstream_url=base_url,
            upstream_key_env=model.api_key_env,
            keepalive_interval=thresholds.keepalive_seconds,
            upstream_inactivity=thresholds.upstream_inactivity_seconds,
            park_unavailable=config.backoff.enabled,  # PB1
        )

        def finished(pending: Pending) -> None:
            assert worker is not None
            worker._finished(pending)

        def emit(event: RoomEvent) -> None:
            assert worker is not None
            worker._emit(event)

        async def reserve(lane: Lane, slot: Slot) -> None:
            assert worker is not None
            await worker._reserve_worker(lane, slot)

        def release(lane: Lane, slot: Slot) -> None:
            assert worker is not None
            worker._release_worker(lane, slot)

        def lane_idle(lane: Lane) -> None:
            assert worker is not None
            worker._lane_idle(lane)

        def lane_gone(lane: Lane) -> None:
            assert worker is not None
            worker._lane_gone(lane)

        shared = config.store.url is not None

        host = LaneHost(
            store=store,
            clocks=clocks,
            program=program,
            route=route,
            upstream=upstream,
            outbox=ResultOutbox(store.results, now_ms=clocks.wall.time_ms),
            work_root=work_root,
            socket_root=runtime_dir(state_dir),
            persona=config.persona,
            stall=thresholds.stall_seconds,
            abort_grace=thresholds.abort_grace_seconds,
            tool_lease_max=thresholds.tool_lease_max_seconds,
            tick=thresholds.tick_seconds,
            typing_refresh=thresholds.typing_refresh_seconds,
            idle_stop=thresholds.idle_stop_seconds,
            recovery_attempts=config.caps.recovery_attempts,
            text_update_chars=config.caps.text_update_chars,
            max_frame_bytes=config.server.max_frame_bytes,
            emit=emit,
            finished=finished,
            reserve_worker=reserve,
            release_worker=release,
            lane_idle=lane_idle,
            lane_gone=lane_gone,
            shared=shared,
            breaker=RouteBreaker(config.backoff, clocks) if config.backoff.enabled else None,
            classes=config.replay_classes(),  # L14
            ledger=work_root / "effects.jsonl",
            receipts=receipts,
            attach=lambda workdir, share, attached: AttachTool(
                attachments,
                workdir,
                max_bytes=config.attachments.max_bytes,
                media_types=config.attachments.media_types,
                share=share,
                max_per_reply=config.attachments.max_per_reply,
                attached=attached,
            ),
        )
        worker = RoomWorker(config, store, host, nursery)
        worker._learn_admissions(list(store.admissions.contents.records))
        if shared:  # one host of many: lanes under leases (docs/design/scale-out.md)
            leased = cast(LeaseStore, store)
            worker._forget_expired(leased.expired)  # RT11: read after the logs were
            leased.on_expired = worker._forget_expired
            # S21: what any refresh reads is taken in under the log's lock, so an admission
            # decides against it (``unless``) before its record could be written a second time
            store.admissions.on_records = worker._learn_admissions  # type: ignore[attr-defined]
            leases = LaneLeases(leased, ttl=config.store.lease_seconds, lost=worker._lane_lost)
            worker.leases = leases
            poll = config.store.poll_seconds
            nursery.start_soon(leases.run)
            nursery.start_soon(functools.partial(leased.watch_shared, worker._poke, poll=poll))
            nursery.start_soon(worker._follow_shared)
            nursery.start_soon(worker._claim_waiting, poll)
            retention = config.retention
            nursery.start_soon(
                worker._retain_periodically, retention.sweep_hours, retention.compact_hours
            )  # RT11
        else:
            await worker._sweep_attachments(attachments)  # A8: before any lane runs
            await worker._recover()
            retention = config.retention
            nursery.start_soon(
                worker._retain_periodically, retention.sweep_hours, retention.compact_hours
            )
        try:
            yield worker
        finally:
            worker._admitting = False
            nursery.cancel_scope.cancel()
