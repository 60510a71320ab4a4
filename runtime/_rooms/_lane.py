"""Room lanes: one long-lived session per room, its deliveries run one at a time.

A :class:`Lane` owns one room's queue, session file, working directory and — while it is
warm — one worker epoch behind its own gateway and gate (``runtime/_boundary/_boundaries.py``;
the worker and its boundaries are a slot, ``_slot.py``). The lane runs in its own nursery and
each epoch in a nested one, so stopping a lane or fencing an epoch is a cancellation
(docs/design/boundaries.md). The invariants (L1…) are in ``docs/design/lanes.md``.

One delivery's turn: the delivery's log is created (or reopened when it is replayed) and its
admission written there with the session leaf it starts from; the rendered prompt is sent; the
worker's events are watched (typing, tool activity, the stall backstop; ``_turn.py``) until
``agent_settled``; the last assistant message decides the outcome (``runtime/_rooms/_outcome.py``);
the session is fsynced, the result appended to the delivery's log and then published in the
outbox. A worker that dies mid-turn is fenced, the step is recorded as abandoned, the session
branched back to the admission leaf and the turn replayed on a new epoch — the gateway and the
gate answer what was already done from the delivery's log — until the recovery attempts run
out (``recovery_exhausted``).

Privileged deliveries (grants beyond the room's standing set) run in a one-shot session with
an epoch of their own, stopped afterwards, so the room session's tools never change.

On a store several hosts share (docs/design/scale-out.md S11, S13) a lane runs under its
lease (:attr:`Lane.fence`): every write it makes — its logs, the gate's and the gateway's
records, its results, its session's bytes — is fenced by it. A write refused ``lane_fenced``
means another host claimed the lane: the lane is lost (:meth:`Lane.lose`), its scope is
cancelled — its epochs' trees are stopped — and nothing more of it is published; its
unfinished deliveries are the new owner's. The session file is stored in the database at the
two points the journal depends on it (the admission leaf, the result's leaf) and a lane that
starts on a host restores it from there first.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import msgspec
import trio

from .._backoff import (
    DescriptorWait,
    RouteBreaker,
    failure_park,
    give_up_ms,
    past_bounds,
    patiently,
    route_park,
    sleeping,
)
from .._boundary._boundaries import BoundaryConfig
from .._boundary._calls import GateCall, GateResult, RuntimeTool
from .._boundary._gateway import GatewayConfig
from .._boundary._receipts import ReceiptStore
from .._boundary._stream import UpstreamFailure
from .._boundary._tools import DocumentTools, EffectLedger
from .._clock import Clocks
from .._errors import (
    JournalError,
    PiRuntimeError,
    ReasonCode,
    RpcError,
    SessionError,
    WorkerError,
    descriptors_exhausted,
)
from .._journal._attachments import SHARED_ATTACHMENTS
from .._journal._fence import Fence
from .._journal._interface import JournalStore, LeaseStore, Log
from .._journal._leases import fenced_out
from .._journal._store import delivery_key, lane_key
from .._logs import fields
from .._metrics import RECOVERY_ATTEMPTS, RECOVERY_REFUSALS, labelled
from .._pi._launch import ModelRoute, RetrySettings, WorkerLaunch, WorkerProgram
from .._pi._session_files import (
    afsync_session,
    aread_session,
    atruncate_torn_tail,
    create_session,
    open_session_writer,
)
from .._pi._session_index import SessionIndex
from .._records import (
    AbsorbedInput,
    Admission,
    AttachmentRef,
    EpochLaunching,
    EpochStarted,
    Outcome,
    Parked,
    ReplayClass,
    Result,
    StepAbandoned,
)
from .._wire import Attachment, RoomEvent, TextUpdate, fit_reply_text, room_for_text
from ._outbox import ResultOutbox
from ._outcome import TurnEnd
from ._pending import Absorbed, Pending
from ._session_copies import SessionCopies
from ._slot import Slot
from ._turn import Turn, WorkerWedged

if TYPE_CHECKING:
    pass

__all__ = ["Lane", "LaneHost"]

_PROVIDER_CODES: Final = (ReasonCode.MODEL_FAILED, ReasonCode.USAGE_LIMIT_REACHED)
"""The turn ends a provider's failure gets (``_outcome.py``): the ones parking replaces."""
REPLAY_MARKER: Final = "pi-runtime/replay"
"""``customType`` of the session entry that branches a replay back to the admission leaf."""
logger = logging.getLogger("runtime.rooms")
_T = TypeVar("_T")

EXHAUSTED: Final = TurnEnd(outcome=Outcome.FAILED, code=ReasonCode.RECOVERY_EXHAUSTED)


@dataclass
class LaneHost:
    """What every lane needs from its worker host (``runtime/_rooms/_worker.py``)."""

    store: JournalStore
    clocks: Clocks
    program: WorkerProgram
    route: ModelRoute
    upstream: GatewayConfig
    outbox: ResultOutbox
    work_root: Path
    socket_root: Path
    persona: str | None
    stall: float
    abort_grace: float
    """After the stall backstop's abort, how long the worker has to settle (L20)."""
    tool_lease_max: float
    """The longest tool lease (L20)."""
    tick: float
    typing_refresh: float
    idle_stop: float
    recovery_attempts: int
    text_update_chars: int
    max_frame_bytes: int
    """A result frame's bound: a reply's text is cut to fit it (protocol.md P14)."""
    emit: Callable[[RoomEvent], None]
    finished: Callable[[Pending], None]
    reserve_worker: Callable[[Lane, Slot], Any]
    """Wait for a live-worker place for one of the lane's worker slots (L8)."""
    release_worker: Callable[[Lane, Slot], None]
    lane_idle: Callable[[Lane], None]
    """Called when a lane's delivery ends: its live worker may now be stopped for another (L8)."""
    lane_gone: Callable[[Lane], None]
    """Called when a lane was lost to another host (S11) and has stopped."""
    classes: Mapping[str, ReplayClass]
    """The configured replay classes (``RoomWorkerConfig.replay_classes()``), the gate's
    declared classes (L14)."""
    retry: RetrySettings = field(default_factory=RetrySettings)
    receipts: ReceiptStore | None = None
    """The receipt and document store behind ``write_document`` / ``read_document``."""
    ledger: Path | None = None
    """Where the test tool ``effect`` writes (only when granted)."""
    attach: Callable[[Callable[[], Path], Share | None, Attached], RuntimeTool] | None = None
    """The ``attach`` tool for a working directory, sharing its bytes through the store when
    one is given (docs/design/attachments.md A11), and counting what the current delivery
    attached (A12)."""
    shared: bool = False
    """The store is shared by several hosts: sessions travel through it (S13)."""
    breaker: RouteBreaker | None = None
    """The model route's breaker; ``None``: an unavailable provider fails the turn (PB1)."""


Share = Callable[[str, bytes], Awaitable[None]]
"""Makes an attachment's bytes durable in the shared store: ``(sha256, data)``."""
Attached = Callable[[], list[AttachmentRef]]
"""What the current delivery's recorded outcomes attached (A12)."""

SESSIONS: Final = "sessions/"
"""Documents holding the lanes' session files on a shared store, named ``sessions/`` and
the file's path under the state directory."""


class _WorkerDied(Exception):
    """The epoch ended mid-turn (exit, launch failure or a broken channel)."""


class _OutOfDescriptors(Exception):
    """A want of file descriptors met before the delivery's turn began — its slot's
    boundaries, its session's leaf, its replay's branch, its worker's launch (L21): nothing
    of the turn reached the worker or the session, so it is taken up again later,
    uncharged."""

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(f"{what}: {cause}")
        self.what, self.cause = what, cause


@contextlib.contextmanager
def _before_the_turn(what: str) -> Iterator[None]:
    """Raise :class:`_OutOfDescriptors` for a want of descriptors the block meets."""
    try:
        yield
    except BaseException as error:
        if not descriptors_exhausted(error):
            raise
        raise _OutOfDescriptors(what, error) from error


class Lane:
    """One room's lane; the host starts :meth:`run` in the lane's own nursery."""

    def __init__(self, host: LaneHost, room: str, fence: Fence | None = None) -> None:
        self.host = host
        self.room = room
        self.fence = fence
        """The lane's lease on a shared store (S11); ``None`` where this host owns it all."""
        self._session_copies: SessionCopies | None = None
        """On a shared store, the lane's session files there (S36), made when first used."""
        self.lost = False
        """Another host claimed the lane: it stops, and publishes nothing more."""
        self.lost_why = ""
        self._scope = trio.CancelScope()
        self.stopped = trio.Event()
        """Set once :meth:`run` has ended (its epochs' trees are stopped by then)."""
        self.key = lane_key(room)
        self.queue: deque[Pending] = deque()
        self._riding = 0
        """Deliveries steered into the replay of an owner still in :attr:`queue` (at recovery,
        L10): :attr:`waiting` counts them without walking the queue."""
        self.current: Pending | None = None
        self._wake = trio.Event()
        self.last_used = 0.0
        self.dir = host.store.root / "lanes" / self.key
        self.session = self.dir / "session.jsonl"
        self._session_index = SessionIndex(self.session)
        """The room session's leaf, read by difference (sessions.md S14)."""
        self.cwd = host.work_root / "rooms" / self.key
        self.home = host.work_root / "homes" / self.key
        self.tmp = host.work_root / "tmp" / self.key
        self.log: Log | None = None
        """The lane's log while an epoch of it runs (:meth:`hold_log`); ``None`` otherwise:
        an idle lane holds no descriptor for it (L21)."""
        self._log_users = 0
        self._log_lock = trio.Lock()
        self.epochs = 0
        """Epochs this lane ever started (numbers them; from the lane log at start)."""
        self._room: Slot | None = None
        self._oneshot: Slot | None = None
        self._running: Turn | None = None
        self._cancelled = trio.Event()
        """Set when the current delivery is cancelled (a parked one stops waiting)."""
        self._descriptors = DescriptorWait()
        """Openings refused in a row for want of a file descriptor (L21): the wait grows."""
        self._retry_at: float | None = None
        """When the first queued delivery, whose log could not be opened — or whose turn
        could not begin — for want of a file descriptor, is tried again (L21); ``None``: at
        once."""

    # -- the host's view ---------------------------------------------------------------

    @property
    def live_worker(self) -> bool:
        """Whether a worker process of this lane is running (either authority)."""
        return any(
            slot is not None and slot.live is not None for slot in (self._room, self._oneshot)
        )

    @property
    def busy(self) -> bool:
        return self.current is not None

    @property
    def waiting(self) -> int:
        """Deliveries queued or running here (the queue limit counts them, L4) — those
        steered into the running turn too (or, at recovery, into a queued owner's replay):
        they wait on their owner, and one that answers nothing hands them all back to the
        queue (L10). Constant time: it is asked at every admission, and a room's queue may
        be long."""
        current = self.current
        queued = len(self.queue) + self._riding
        return queued + (0 if current is None else 1 + len(current.absorbed))

    def submit(self, pending: Pending, *, front: bool = False) -> None:
        (self.queue.appendleft if front else self.queue.append)(pending)
        self._riding += len(pending.absorbed)
        self._wake.set()

    def ride(self, owner: Pending, item: Absorbed) -> None:
        """At recovery: ``item`` rides the replay of ``owner``, a delivery of this lane (L10)."""
        owner.absorbed += (item,)
        if any(queued is owner for queued in self.queue):  # (recovery only: a walk is fine)
            self._riding += 1

    def stop_worker(self) -> None:
        """Ask the room's live epoch (if any) to stop once idle; the lane and its session
        stay (the live-worker cap and the idle stop use this)."""
        if self._room is not None:
            self._room.request_stop()

    def may_steer(self, pending: Pending) -> bool:
        """Whether :meth:`steer` could take ``pending`` now: a running turn of the same
        authority that still takes steering. Nothing awaited; :meth:`steer` asks again under
        the turn's steer lock."""
        owner, turn = self.current, self._running
        if owner is None or turn is None or owner.privileged or pending.privileged:
            return False
        return not owner.cancelled and owner.grants == pending.grants and turn.steerable

    async def steer(self, pending: Pending) -> bool:
        """Steer ``pending`` into the running turn (docs/design/lanes.md) when that turn has the
        same authority and is still running: its absorbed input is journaled in the owner's log
        first, then sent as a ``steer``. False (queue it instead) otherwise — also when, by the
        time the steer lock is held, the turn settled or its owner was cancelled (L10)."""
        if not self.may_steer(pending):
            return False
        owner, turn = self.current, self._running
        assert owner is not None
        assert turn is not None
        async with turn.steer_lock:
            if not turn.steerable or owner.cancelled:  # either may have changed meanwhile
                return False
            item = Absorbed(pending, pending.admission.rendered_prompt)
            try:
                await turn.log.append(
                    AbsorbedInput(delivery_id=pending.delivery_id, text=item.text)
                )
            except JournalError as error:  # L17: the owner's log failed; this one runs alone
                if self._room is not None:
                    self._room.fail(error)
                return False
            owner.absorbed += (item,)
            pending.absorbed_into = owner.delivery_id
            if turn.caught_up:
                await turn.send_steer(item)
            # else a replay is below its last answered step: sent once it reached it (L10)
            return True

    async def cancel(self, delivery_id: str) -> bool:
        """Cancel a queued or running delivery of this lane; False if it is not here. A
        queued one recovered with its result already recorded (its turn ended before the
        host died) is left as it is: that result is published when the lane takes it up,
        and settles what was steered into it (L5, L10, L23)."""
        queued = self._queued(delivery_id)
        if queued is not None and queued.recovering:
            if await self._result_recorded(delivery_id):
                return True  # answered as for a finished delivery (L13)
            queued = self._queued(delivery_id)  # still queued after the read?
        for at, pending in enumerate(self.queue):
            if pending is queued:
                del self.queue[at]
                self._riding -= len(pending.absorbed)
                pending.cancelled = True
                # an owner queued for its replay answers nothing now: the deliveries steered
                # into it (L10) run as their own turns, in its place
                self._requeue_absorbed(pending, at)
                # out of the queue now: its result is written whole, whoever cancels the
                # caller, else it would neither run nor end until a restart (L13)
                with trio.CancelScope(shield=True):
                    await self._finish_without_turn(pending, Outcome.CANCELLED)
                return True
        current = self.current
        if current is not None and current.delivery_id == delivery_id:
            current.cancelled = True
            self._cancelled.set()
            slot = self._oneshot if current.privileged else self._room
            if slot is not None and slot.live is not None:
                # bounded (L20): a wedged worker answers no abort; its turn's backstop fences
                # it, and the delivery ends ``cancelled`` then — the caller need not wait.
                # Sent whoever cancels the caller: the cancel is decided (the flag above)
                with (
                    trio.CancelScope(shield=True),
                    trio.move_on_after(self.host.abort_grace),
                    contextlib.suppress(RpcError),
                ):
                    await slot.live.rpc.abort()
            return True
        return False

    def _queued(self, delivery_id: str) -> Pending | None:
        return next((p for p in self.queue if p.delivery_id == delivery_id), None)

    async def _result_recorded(self, delivery_id: str) -> bool:
        """Whether a ``Result`` is durable in the delivery's own log. A log that cannot be
        read (damaged, or no descriptor to read it with) shows none: the cancel goes on, and
        writing its result then meets the same fault (L11, L17, L21)."""
        store = self.host.store
        try:
            if not await store.exists(store.delivery_rel(delivery_id)):
                return False
            records = (await store.read_delivery_log(delivery_id)).records
        except (JournalError, OSError):
            return False
        return any(isinstance(r, Result) for r in records)

    # -- the lane's task ---------------------------------------------------------------

    def lose(
        self, why: str = "a write under its lease was refused: another host claimed it"
    ) -> None:
        """The lane is another host's now (S11), or may be (S12): stop it — its epochs'
        trees with it — and publish nothing more. Safe to call more than once, from anywhere."""
        if not self.lost:
            self.lost, self.lost_why = True, why
        for slot in (self._room, self._oneshot):  # S12: no grace for a tree another host
            if slot is not None:  # may replay beside
                slot.hurry()
        self._scope.cancel()

    async def _give_up(self) -> None:
        """:meth:`lose` from inside the lane: returns only if the caller is shielded."""
        self.lose()
        await trio.lowlevel.checkpoint()

    async def run(self) -> None:
        """Serve the queue until cancelled (the host's shutdown) or lost (S11)."""
        try:
            with self._scope:
                await self._serve()
        finally:
            if self.lost:
                self.host.lane_gone(self)
            self.stopped.set()

    async def _serve(self) -> None:
        if self.host.shared:
            await self._restore_session(self.session)
        log = await self._patiently("its session or its log", self._prepare_and_open)
        self.epochs = max(  # W13: a launch a crash cut before it started used its number too
            (r.epoch for r in log.contents.records if isinstance(r, EpochLaunching | EpochStarted)),
            default=0,
        )
        await self.host.store.close_log(log)  # opened again by the first epoch (L21)
        async with trio.open_nursery() as nursery:
            while True:
                if not self.queue:
                    await self._idle()
                    continue
                if self._retry_at is not None:  # L21: the first one waits for descriptors
                    await trio.sleep_until(self._retry_at)
                    self._retry_at = None
                    if not self.queue:  # (cancelled meanwhile)
                        continue
                pending = self.queue.popleft()
                self._riding -= len(pending.absorbed)  # counted as the current's from here
                self.current = pending
                try:
                    await self._deliver(nursery, pending)
                except JournalError as error:  # the shared outbox failed (L17), or fenced
                    if fenced_out(error):
                        await self._give_up()
                    # the disk is going: the delivery stays pending; the host stops admitting
                finally:
                    self.current = None
                    self.last_used = trio.current_time()
                    self.host.lane_idle(self)

    async def _prepare_and_open(self) -> Log:
        """The lane's directories and session made, then its log opened."""
        await trio.to_thread.run_sync(self._prepare)
        return await self.host.store.open_lane_log(self.room, fence=self.fence)

    async def hold_log(self) -> Log:
        """The lane's log for an epoch, from its launch's record to its end's
        (:meth:`let_log_go`): opened by the first epoch that needs it, closed when the last
        one ends, so an idle lane holds no descriptor for it (L21). A log that refused a
        record for want of a descriptor refuses every later one (the refused record took a
        sequence number): it is closed and opened anew. Its opening's failure is the
        caller's (a launch: the delivery waits, L21)."""
        async with self._log_lock:
            store = self.host.store
            if self.log is not None and self.log.poisoned:
                await store.close_log(self.log)
                self.log = None
            if self.log is None:
                self.log = await store.open_lane_log(self.room, fence=self.fence)
            self._log_users += 1
            return self.log

    async def let_log_go(self) -> None:
        """An epoch's end was recorded: the last one to end closes the lane's log. Not
        cancellable: it closes, whatever comes."""
        with trio.CancelScope(shield=True):
            async with self._log_lock:
                self._log_users -= 1
                if self._log_users == 0 and self.log is not None:
                    log, self.log = self.log, None
                    await self.host.store.close_log(log)

    def _backoff(self, error: BaseException, what: str) -> float:
        """L21: how long to wait before opening ``what`` again, the process (or the system)
        having no file descriptor left (the lane's :class:`DescriptorWait`), said first."""
        delay = self._descriptors.next()
        self._waiting(error, what, delay)
        return delay

    def _waiting(self, error: BaseException, what: str, delay: float) -> None:
        """Log a want of descriptors, with the stable code ``too_many_open_files`` (L21)."""
        logger.warning(
            "lane %s could not open %s (%s); it tries again in %.2fs, its deliveries wait",
            self.key,
            what,
            getattr(error, "strerror", None) or error,
            delay,
            extra=fields(
                "descriptors_exhausted",
                room=self.room,
                lane=self.key,
                code=ReasonCode.TOO_MANY_OPEN_FILES,
            ),
        )

    def _wait_for_descriptors(self, pending: Pending, error: BaseException, what: str) -> None:
        """L21: ``pending`` met a want of file descriptors before its turn began: it goes
        back first in its queue — admitted, durable, cancellable, charged nothing — and is
        taken up again after the lane's backoff."""
        self.submit(pending, front=True)
        self._retry_at = trio.current_time() + self._backoff(error, what)

    async def _patiently(self, what: str, work: Callable[[], Awaitable[_T]]) -> _T:
        """``work()``, waited out and tried again while the process has no file descriptor
        left (L21) — where nothing can go back to the queue instead: the lane's start, and
        a turn that ran. A write refused under a lease another host holds gives the lane up
        (S11)."""
        try:
            pause = sleeping(lambda error, delay: self._waiting(error, what, delay))
            return await patiently(work, self._descriptors, pause)
        except JournalError as error:
            if fenced_out(error):
                await self._give_up()
            raise

    async def _journal_failed(self, pending: Pending, refused: str | None) -> None:
        """A delivery whose log was poisoned — now, or before the host restarted — ends
        ``failed journal_poisoned`` (L17); one whose log is found damaged when it is recovered
        ends ``recovery_refused:journal`` (``refused="journal"``, L11), published from the
        shared outbox, which is another file. If even that fails the disk is gone: the
        delivery stays pending and the host stops admitting (``JournalStore.disk_failure``)."""
        code = (
            ReasonCode.JOURNAL_POISONED
            if refused is None
            else ReasonCode.RECOVERY_REFUSED.at(refused)
        )
        if refused is not None:
            labelled(RECOVERY_REFUSALS, code).inc()
        self._requeue_absorbed(pending)
        try:
            await self.host.outbox.publish(
                delivery_id=pending.delivery_id,
                room=self.room,
                outcome=Outcome.FAILED,
                code=code,
                fence=self.fence,
            )
        except JournalError as error:
            if fenced_out(error):
                await self._give_up()
            return
        self.host.finished(pending)

    def _requeue_absorbed(self, owner: Pending, at: int = 0) -> None:
        """The deliveries steered into ``owner`` (live, or attached to its replay at
        recovery) when it ends without an answer and without :meth:`_settle_absorbed` — its
        journal failed (L17), or it was cancelled while queued (L13): each runs as its own
        turn, from position ``at`` of the queue (next, by default) in arrival order (L10),
        else it would be neither queued nor finished until a restart. (A steered delivery
        carries no steers of its own: nothing for :attr:`_riding`.)"""
        retry = [item.pending for item in owner.absorbed]
        owner.absorbed = ()
        for steered in reversed(retry):
            steered.absorbed_into = None
            self.queue.insert(at, steered)
        self._wake.set()

    async def _idle(self) -> None:
        self._wake = trio.Event()
        room = self._room
        if room is not None and room.live is None:
            # L21: an idle lane with no worker holds no descriptor — its slot's boundaries
            # (the gateway's and the gate's listeners, the upstream connection) end here;
            # the next delivery opens new ones, as a change of grants does (L6)
            self._room = None
            await room.end_boundaries()
            return
        live = room is not None and room.live is not None
        with trio.move_on_after(self.host.idle_stop if live else math.inf):
            await self._wake.wait()
            return
        self.stop_worker()  # warm long enough: stop it, keep the session

    def _prepare(self) -> None:
        for path in (self.dir, self.cwd, self.home, self.tmp):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._create_session(self.session)

    def _create_session(self, path: Path) -> None:
        """Create a Pi-shaped session at ``path`` if it is missing (blocking)."""
        if path.exists():
            return
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        create_session(
            path,
            cwd=str(self.cwd),
            provider=self.host.route.provider,
            model_id=self.host.route.model,
            clock=self.host.clocks.wall,
        )

    # -- one delivery ------------------------------------------------------------------

    async def _deliver(self, nursery: trio.Nursery, pending: Pending) -> None:
        store = self.host.store
        try:
            log = await store.open_or_create_delivery_log(pending.delivery_id, fence=self.fence)
        except (JournalError, OSError) as error:
            if fenced_out(error):  # S11: another host's lane now
                await self._give_up()
            if descriptors_exhausted(error):  # L21: it waits, first in its queue
                self._wait_for_descriptors(pending, error, "a delivery's log")
                return
            if not isinstance(error, JournalError):
                raise
            # poisoned before a restart: as if now (L17); found damaged: refused (L11)
            damaged = pending.recovering and error.code is not ReasonCode.JOURNAL_POISONED
            await self._journal_failed(pending, "journal" if damaged else None)
            return
        self._descriptors.met()
        try:
            try:
                existing = log.contents.records
                recorded = next((r for r in existing if isinstance(r, Result)), None)
                if recorded is None:
                    recorded = await self._run(nursery, pending, log)
                    await log.append(recorded)
            finally:
                await store.close_log(log)
        except _OutOfDescriptors as out:  # L21: its turn never began; it waits, first
            self._wait_for_descriptors(pending, out.cause, out.what)
            return
        except JournalError as error:  # this delivery's log failed: it ends here (L17)
            if fenced_out(error):  # S11: not failed — another host's lane now
                await self._give_up()
            self.stop_worker()  # its worker is not trusted with the next delivery
            await self._journal_failed(pending, None)
            return
        absorbed = await self._record_absorbed(pending, recorded)
        await self._publish(pending, recorded)
        await self._settle_absorbed(pending, recorded, absorbed)

    @staticmethod
    def _absorbs(result: Result, item: Absorbed) -> bool:
        """Whether ``item`` ends ``absorbed`` into an owner that ended with ``result``: a
        model request carried its text, and the owner answered (reply or silent, L10)."""
        answered = result.outcome in (Outcome.REPLY, Outcome.SILENT)
        return answered and item.first_step is not None

    async def _record_absorbed(self, owner: Pending, result: Result) -> dict[str, Result]:
        """L10, L5 (L22): with the owner's result durable in its own log and not yet
        published, each steered delivery it absorbs has its ``absorbed`` result recorded in
        its own log — so that a host killed after the owner's publication finds it
        recorded, and publishes it at its next start (L5), whatever else of the room was
        published meanwhile: recovery looks for the deliveries steered into a finished owner
        only in the log of the room's latest one, and a queued delivery cancelled in between
        (L13) is that one then. What each recorded, by delivery id; one whose log failed
        ended ``journal_poisoned`` (L17) and is not among them."""
        recorded: dict[str, Result] = {}
        for item in owner.absorbed:
            if not self._absorbs(result, item):
                continue
            absorbed = Result(
                outcome=Outcome.ABSORBED,
                absorbed_into=owner.delivery_id,
                finished_ms=self.host.clocks.wall.time_ms(),
            )
            kept = await self.record_result(item.pending, absorbed)
            if kept is not None:
                recorded[item.pending.delivery_id] = kept
        return recorded

    async def _settle_absorbed(
        self, owner: Pending, result: Result, recorded: Mapping[str, Result]
    ) -> None:
        """Once the owner's result is published: a steered delivery whose text a model
        request carried ends ``absorbed`` into it, when the owner answered (reply or silent)
        — its result recorded before (:meth:`_record_absorbed`), published now; any other
        runs as its own turn next, in arrival order (docs/design/lanes.md, L10)."""
        retry: list[Pending] = []
        for item in owner.absorbed:
            if self._absorbs(result, item):
                kept = recorded.get(item.pending.delivery_id)
                if kept is not None:  # (else it ended journal_poisoned: published already)
                    await self._publish(item.pending, kept)
            else:
                item.pending.absorbed_into = None
                retry.append(item.pending)
        owner.absorbed = ()
        for pending in reversed(retry):
            self.submit(pending, front=True)

    async def _run(self, nursery: trio.Nursery, pending: Pending, log: Log) -> Result:
        """The delivery's turn, replayed after a worker death, within the recovery attempts
        (docs/design/recovery.md, L19): the attempts so far are the abandoned steps in its log,
        and a delivery the host finds unfinished at start whose turn had begun (``recovering``:
        its log made by a run before) is charged one before anything of its turn runs."""
        existing = log.contents.records  # as the log was opened
        attempts = sum(isinstance(r, StepAbandoned) for r in existing)
        parks = [r for r in existing if isinstance(r, Parked)]
        resting = bool(existing) and isinstance(existing[-1], Parked)  # PB2: nothing ran since
        if pending.recovering and not resting and not pending.restart_charged:
            # the host died during its turn: charged (L19), once (L21: taken up again)
            await log.append(StepAbandoned(step=-1, reason="host_restart", epoch=0))
            pending.restart_charged = True
            attempts += 1
            RECOVERY_ATTEMPTS.inc()
        self._cancelled = trio.Event()
        if resting and self.host.breaker is not None:  # PB2: the recorded schedule holds
            self.host.breaker.resume(parks[-1])
        started = next((r for r in existing if isinstance(r, Admission)), None)
        slot = await self._slot_for(pending)
        if started is None:
            try:
                with _before_the_turn("its session"):
                    leaf = await self._leaf(slot.session)
            except (SessionError, OSError):  # L18: the session cannot be read: fail closed
                return self._refused("session")
            started = msgspec.structs.replace(
                pending.admission, session_path=self._rel(slot.session), session_leaf=leaf
            )
            await self._store_session(slot.session)  # S13: before the record that needs it
            await log.append(started)
        elif self.host.shared and slot.session != self.session:  # a one-shot session
            await self._restore_session(slot.session)
        with _before_the_turn("its worker's boundaries"):
            boundaries = await slot.serve(nursery, log, delivery_key(pending.delivery_id))
        branch = attempts > 0 or bool(parks)  # the session goes back to the admission leaf
        gateway, breaker = boundaries.gateway, self.host.breaker
        waited = self._waited_from(pending, parks)  # PB3: its wait for the outage began then
        try:
            while True:
                if attempts > self.host.recovery_attempts:  # L19: that many replays
                    labelled(RECOVERY_REFUSALS, str(ReasonCode.RECOVERY_EXHAUSTED)).inc()
                    return self._result(EXHAUSTED)
                probe = await self._wait_for_route(pending, log, parks, waited, slot)
                if isinstance(probe, TurnEnd):  # cancelled, or past its bounds, while parked
                    return self._result(probe)
                judged = False  # whether _park told the route's breaker how the turn ended
                try:  # a probe ended before it asks said nothing of the route (PB4: finally)
                    gateway.upstream_failure = None  # PB1: what this turn meets
                    if branch:
                        with _before_the_turn("its session"):
                            branched = await self._branch(slot.session, started)
                        if not branched:
                            return self._refused("session")
                    if breaker is not None:  # PB4: told at once — the route's first answer
                        # closes its breaker, an outage that ends the turn opens it again
                        gateway.on_answered = breaker.succeeded
                        gateway.on_unavailable = functools.partial(breaker.failed, probe=probe)
                    answered = gateway.statistics().journaled
                    end = await self._turn(nursery, slot, pending, log)
                    judged = True  # (_park tells the breaker before its first await)
                    ended = await self._park(
                        pending,
                        slot,
                        log,
                        parks,
                        end,
                        gateway.upstream_failure,
                        answered=gateway.statistics().journaled > answered,
                        probe=probe,
                        waited=waited,
                    )
                except _WorkerDied:
                    await slot.fence()
                    if slot.failure is not None:  # L17: it was fenced for its journal
                        return await self._journal_lost(slot.failure)
                    # the host stopping killed it: not charged here (the next start is, L19)
                    await trio.lowlevel.checkpoint()
                    attempts += 1
                    RECOVERY_ATTEMPTS.inc()
                    branch = True
                    await log.append(
                        StepAbandoned(
                            step=boundaries.steps.current_step,
                            reason="worker_exited",
                            epoch=boundaries.epoch,
                        )
                    )
                    continue
                finally:
                    if breaker is not None:
                        if not judged:  # died, stopped: what its last call upstream met
                            self._tell_route(breaker, gateway.upstream_failure, probe)
                        breaker.abandoned(probe)  # no word on the route: another probes
                if slot.failure is not None:  # L17: re-checked after the turn's last await
                    await slot.fence()
                    return await self._journal_lost(slot.failure)
                if ended is None:
                    branch = True  # PB1: parked; the same turn again, from the journal
                    continue
                end = ended
                try:  # (the turn ran: out of descriptors this waits in place, L21)
                    await self._patiently("its session", lambda: self._fsync(slot.session))
                except OSError:  # L18: the leaf it would name cannot be made durable (EIO):
                    return self._refused("session")  # this delivery ends, as _leaf's do
                if boundaries.steps.mismatch is not None:  # G13: the replay diverged
                    return self._refused("replay")
                try:
                    leaf = await self._patiently("its session", lambda: self._leaf(slot.session))
                except (SessionError, OSError):  # L18
                    return self._refused("session")
                await self._store_session(slot.session)  # S13: before the result
                attached = boundaries.tools.attachments() if end.outcome is Outcome.REPLY else []
                result = self._result(end, leaf=leaf, attachments=attached)  # A4
                return self._fitted(pending, result)  # P14
        finally:
            boundaries.release()  # the log closes next: nothing of this turn stays in memory
            if slot is self._oneshot:
                self._oneshot = None
                await slot.close()

    # -- an unavailable provider (docs/design/retention.md PB1-PB4) ----------------------

    def _waited_from(self, pending: Pending, parks: list[Parked]) -> int | None:
        """PB3: when a delivery reaching the head of its queue with no park of its own began
        to wait for the route's outage — admitted while the route was down (behind a parked
        delivery of its room: there is no live run to steer into), or queued when it went
        down — on the wall clock; ``None`` when the route is not down, or it has parks (its
        episode's first failure governs)."""
        breaker = self.host.breaker
        if parks or breaker is None or breaker.down_since_ms is None:
            return None
        now = self.host.clocks.wall.time_ms()
        return min(now, max(pending.admission.admitted_ms, breaker.down_since_ms))

    def _outage_since(self, waited: int | None) -> int | None:
        """``waited`` (:meth:`_waited_from`) while the route is still down; the later start of
        an outage begun after it answered meanwhile; ``None`` once it is up."""
        breaker = self.host.breaker
        if waited is None or breaker is None or breaker.down_since_ms is None:
            return None
        return max(waited, breaker.down_since_ms)

    async def _wait_for_route(
        self,
        pending: Pending,
        log: Log,
        parks: list[Parked],
        waited: int | None = None,
        slot: Slot | None = None,
    ) -> TurnEnd | object | None:
        """Before a turn asks the provider: wait while the route's breaker is open (PB4) —
        its schedule is the one this delivery's last :class:`Parked` recorded, or another
        delivery's failure set — recording each new wait (a restart resumes there, PB2), and
        keeping no worker meanwhile (PB1: ``slot``'s, warm from the turn before, is stopped).
        ``None``: go; a token: go, as the half-open breaker's one probe; a
        :class:`TurnEnd`: it ends here (cancelled, or past its bounds, PB3 — before its first
        park, counted from ``waited``: :meth:`_waited_from`)."""
        breaker = self.host.breaker
        if breaker is None:
            return None
        wall = self.host.clocks.wall
        while True:
            if pending.cancelled:
                return TurnEnd(outcome=Outcome.CANCELLED)
            # PB3: weighed before every try — after each wait, at a restart — whatever the
            # breaker says (half-open, or closed meanwhile): past its bounds it asks nothing
            since = None if parks else self._outage_since(waited)
            if past_bounds(breaker.config, parks, wall.time_ms(), since_ms=since):
                code = parks[-1].code if parks else ReasonCode.MODEL_FAILED
                return TurnEnd(outcome=Outcome.FAILED, code=ReasonCode(code))
            admit = breaker.admit()
            if admit.until_ms is None:
                return admit.probe
            if not parks or parks[-1].next_attempt_ms != admit.until_ms:
                record = route_park(
                    breaker.config,
                    parks,
                    until_ms=admit.until_ms,
                    now_ms=wall.time_ms(),
                    route_failures=breaker.failures,
                    since_ms=since,
                )
                await self._parked(pending, log, parks, record)
            ends = give_up_ms(breaker.config, parks)  # PB3: no wait outlasts the deadline
            until = admit.until_ms if ends is None else min(admit.until_ms, ends)
            if slot is not None and slot.live is not None:  # PB1: parked, it keeps no worker
                await slot.fence()  # (its last turn settled: the next try is a new epoch)
            await breaker.wait(until, self._cancelled)

    async def _parked(
        self, pending: Pending, log: Log, parks: list[Parked], record: Parked
    ) -> None:
        """Record a park, durably; on a delivery's first, tell the room when configured
        (PB5: once — a restart finds the record and says nothing again)."""
        await log.append(record)
        parks.append(record)
        breaker = self.host.breaker
        if len(parks) == 1 and breaker is not None and breaker.config.notify:
            self.host.emit(
                TextUpdate(
                    room=self.room,
                    delivery_id=pending.delivery_id,
                    reply_to=pending.delivery.message_id,
                    text=breaker.config.notify_text,
                )
            )

    async def _park(
        self,
        pending: Pending,
        slot: Slot,
        log: Log,
        parks: list[Parked],
        end: TurnEnd,
        failure: UpstreamFailure | None,
        *,
        answered: bool,
        probe: object | None,
        waited: int | None = None,
    ) -> TurnEnd | None:
        """After a turn: ``None`` when it met an unavailable provider and is parked (PB1) —
        its schedule durable in its journal, its worker stopped — else how it ends: as it
        did (a definite refusal, a usage limit with no time to wait for, any other end), or,
        past its bounds (PB3), with the provider's failure code (``usage_limit_reached`` for
        an account limit the gateway kept from the worker), or ``cancelled``. The provider
        answering (a response, or a definite refusal) closes the route's breaker; a turn
        that never reached it (all replayed) says nothing; one whose last call upstream met
        it unavailable counts that failure however the turn ended (PB4: cancelled meanwhile,
        it is not parked, but the breaker opens again with the next wait). The breaker is
        told before the first await."""
        breaker = self.host.breaker
        if breaker is None:
            return end
        failed = end.outcome is Outcome.FAILED and end.code in _PROVIDER_CODES
        if not failed or failure is None or not failure.unavailable:
            self._tell_route(breaker, failure, probe, answered=answered)
            return end
        next_attempt = breaker.failed(failure, probe)
        now = self.host.clocks.wall.time_ms()
        record = failure_park(
            breaker.config,
            parks,
            failure,
            next_attempt_ms=next_attempt,
            now_ms=now,
            code=str(end.code),
            route_failures=breaker.failures,
            since_ms=None if parks else self._outage_since(waited),  # PB3
        )
        if pending.cancelled:
            return TurnEnd(outcome=Outcome.CANCELLED)
        if past_bounds(breaker.config, [*parks, record], now):
            return TurnEnd(outcome=Outcome.FAILED, code=ReasonCode(record.code))
        await self._parked(pending, log, parks, record)
        await slot.fence()  # no worker is kept while parked; the next try is a new epoch
        return None

    @staticmethod
    def _tell_route(
        breaker: RouteBreaker,
        failure: UpstreamFailure | None,
        probe: object,
        *,
        answered: bool = False,
    ) -> None:
        """PB4: tell the route's breaker what a turn not parked met — its last call upstream
        unavailable (counted, as the gateway's ``on_unavailable`` may have already: the
        breaker counts it once), a refusal of the request's own or an answer (the provider is
        up); nothing heard says nothing. Also for a turn that ended before :meth:`_park`
        judged it (its worker died, its lane stopped): an answer told it already then
        (``on_answered``)."""
        if failure is not None and failure.unavailable:
            breaker.failed(failure, probe)
        elif answered or failure is not None:
            breaker.succeeded()

    async def _journal_lost(self, failure: PiRuntimeError) -> Result:
        """L17: the delivery's journal failed mid-turn and its worker is fenced. A journal
        error is raised (the log is poisoned: the lane publishes ``journal_poisoned``); any
        other failure of the boundaries (the receipt store, the gate's own append) ends the
        delivery ``failed`` with its code."""
        await trio.lowlevel.checkpoint()
        if isinstance(failure, JournalError):
            raise failure
        return self._result(TurnEnd(outcome=Outcome.FAILED, code=failure.code))

    async def _turn(self, nursery: trio.Nursery, slot: Slot, pending: Pending, log: Log) -> TurnEnd:
        try:
            with _before_the_turn("its worker"):
                live = await slot.ensure_live(nursery)
            boundaries = slot.boundaries  # held: a journal failure drops the slot's (L17)
            assert boundaries is not None
            turn = Turn(self.host, self.room, pending, live.rpc, log, outside=nursery)
            turn.replay_upto = boundaries.steps.last_answered
            turn.answered_upto = lambda: boundaries.steps.last_answered
            self._running = turn
            boundaries.on_request = turn.on_request
            try:
                return await turn.run()
            finally:
                boundaries.on_request = None
                self._running = None
        except WorkerWedged as wedged:
            # L20: the stalled turn's worker did not settle after the abort. It is fenced —
            # its whole tree is dead when this returns — so nothing of it can reach the
            # session after the result's leaf is read, and a line it tore is cut (as a replay
            # would, _branch); the turn ends as the stall decided, never replayed.
            await slot.fence()
            with contextlib.suppress(SessionError, OSError):  # the leaf read reports these
                await atruncate_torn_tail(slot.session)
            return wedged.end
        except (WorkerError, RpcError) as error:  # exited, failed to launch, channel broke
            raise _WorkerDied(str(error)) from error

    def _refused(self, what: str) -> Result:
        """A replay that cannot be trusted fails closed (docs/design/recovery.md):
        ``recovery_refused:what``."""
        code = ReasonCode.RECOVERY_REFUSED.at(what)
        labelled(RECOVERY_REFUSALS, code).inc()
        return Result(
            outcome=Outcome.FAILED, code=code, finished_ms=self.host.clocks.wall.time_ms()
        )

    def _result(
        self,
        end: TurnEnd,
        *,
        leaf: str | None = None,
        attachments: list[AttachmentRef] | None = None,
    ) -> Result:
        return Result(
            outcome=end.outcome,
            text=end.text,
            code=str(end.code) if end.code is not None else None,
            session_leaf=leaf,
            finished_ms=self.host.clocks.wall.time_ms(),
            attachments=attachments or [],
        )

    def _fitted(self, pending: Pending, result: Result) -> Result:
        """``result`` with its reply text cut to what a result frame carries (protocol.md
        P14), before it is recorded: the delivery's log, the outbox and every re-send hold
        the same words."""
        if result.text is None:
            return result
        room = room_for_text(
            delivery_id=pending.delivery_id,
            room=self.room,
            attachments=map(Attachment.of, result.attachments),
            max_frame_bytes=self.host.max_frame_bytes,
        )
        text, cut = fit_reply_text(result.text, room)
        if not cut:
            return result
        logger.warning(
            "the reply of %s was cut to its first %d of %d characters to fit a result frame",
            pending.delivery_id,
            len(text),
            len(result.text),
            extra=fields("reply_truncated", delivery_id=pending.delivery_id, room=self.room),
        )
        return msgspec.structs.replace(result, text=text, truncated=True)

    async def _publish(self, pending: Pending, result: Result) -> None:
        await self.host.outbox.publish(
            delivery_id=pending.delivery_id,
            room=self.room,
            outcome=result.outcome,
            text=result.text,
            code=result.code,
            absorbed_into=result.absorbed_into,
            attachments=result.attachments,
            truncated=result.truncated,
            fence=self.fence,
        )
        self.host.finished(pending)

    async def _finish_without_turn(self, pending: Pending, outcome: Outcome) -> None:
        """A delivery that ends before its turn starts (cancelled while queued)."""
        result = Result(outcome=outcome, finished_ms=self.host.clocks.wall.time_ms())
        await self.write_result(pending, result)

    async def write_result(self, pending: Pending, result: Result) -> None:
        """Record ``result`` in the delivery's own log (:meth:`record_result`), then publish
        what the log holds as its result: ``result``, or one recorded before (L5). Raises
        ``lane_fenced`` when another host claimed the lane (the lane is lost: :meth:`lose`),
        and the outbox's failure."""
        kept = await self.record_result(pending, result)
        if kept is None:
            return
        try:
            await self._publish(pending, kept)
        except JournalError as error:
            if fenced_out(error):
                self.lose()
            raise

    async def record_result(self, pending: Pending, result: Result) -> Result | None:
        """Record ``result`` in the delivery's own log (created with its admission if the
        delivery never ran); what the log holds as its result now — a ``Result`` recorded
        there before is kept, never followed by a second, contradicting one (L5, L23: a
        turn that ended before a host died is published as it ended). ``None``: a log that
        cannot be opened or written ended the delivery as :meth:`_deliver` would —
        ``recovery_refused:journal`` when found damaged at recovery, else
        ``journal_poisoned`` — published from the shared outbox (L11, L17): the fault stays
        in that delivery. Raises ``lane_fenced`` when another host claimed the lane (the
        lane is lost: :meth:`lose`)."""
        try:
            return await self._record_result(pending, result)
        except JournalError as error:
            if fenced_out(error):
                self.lose()
            raise

    async def _record_result(self, pending: Pending, result: Result) -> Result | None:
        store = self.host.store
        try:
            log = await store.open_or_create_delivery_log(pending.delivery_id, fence=self.fence)
        except JournalError as error:
            if fenced_out(error):
                raise
            damaged = pending.recovering and error.code is not ReasonCode.JOURNAL_POISONED
            await self._journal_failed(pending, "journal" if damaged else None)
            return None
        try:
            try:
                records = log.contents.records
                kept = next((r for r in records if isinstance(r, Result)), None)
                if kept is not None:
                    return kept
                if not any(isinstance(r, Admission) for r in records):
                    await log.append(pending.admission)
                await log.append(result)
            finally:
                await store.close_log(log)
        except JournalError as error:  # its log failed (poisoned): it ends here (L17)
            if fenced_out(error):
                raise
            await self._journal_failed(pending, None)
            return None
        return result

    # -- sessions ----------------------------------------------------------------------

    async def _slot_for(self, pending: Pending) -> Slot:
        """The slot ``pending`` runs in: a one-shot one when it is privileged, else the
        room's — a new one when the room's grants differ from its slot's (L6), the old one
        stopped first. That one is idle or already stopping: the lane runs one delivery at a
        time and the room slot's turns only in :meth:`_run`, so its last turn ended — at
        ``agent_settled``, or with its epoch fenced (a death, a stall, a park, a journal
        failure) or asked to stop (L17) — before this delivery was taken up. It is stopped
        the ordinary way, bounded by the abort grace (L20), and gives its live-worker place
        back before the new one needs one (L8); left running, it would hold that place, and
        the session beside the new worker, until the lane ended."""
        if pending.privileged:
            session = self.dir / "oneshot" / f"{delivery_key(pending.delivery_id)}.jsonl"
            self._oneshot = Slot(self, self._boundary_config(pending.grants, "o"), session)
            return self._oneshot
        slot = old = self._room
        if slot is None or slot.config.granted != pending.grants:
            self._room = slot = Slot(self, self._boundary_config(pending.grants, "r"), self.session)
            if old is not None:
                await old.retire(self.host.abort_grace)
        return slot

    def _rel(self, path: Path) -> str:
        return str(path.relative_to(self.host.store.root))

    async def _store_session(self, session: Path) -> None:
        """On a shared store, the session file's bytes into the database, under the lane's
        lease (S13) — the bytes past what is stored already (S36): written after the session
        is fsynced, before the record naming its leaf, so a host that claims the lane finds at
        least what that record depends on."""
        if not self.host.shared:
            return
        await self._copies().store_file(SESSIONS + self._rel(session), session, self.fence)

    async def _restore_session(self, session: Path) -> None:
        """On a shared store, the session file as the database holds it, written over this
        host's copy (which may be stale: another host may have run the lane since), at the
        same path (S13). None stored: the lane never started a turn, and starts fresh."""
        await self._copies().restore_file(SESSIONS + self._rel(session), session)

    def _copies(self) -> SessionCopies:
        if self._session_copies is None:
            self._session_copies = SessionCopies(cast(LeaseStore, self.host.store))
        return self._session_copies

    async def _leaf(self, session: Path) -> str | None:
        """The session's leaf, its file created first if missing and fsynced. The room
        session's is read by difference (S14): only what was appended since the last read,
        whatever the history; a one-shot session's is read whole (it is new)."""
        await trio.to_thread.run_sync(self._create_session, session)
        await self._fsync(session)
        index = self._session_index if session == self.session else SessionIndex(session)
        return (await index.aread()).leaf

    async def _fsync(self, session: Path) -> None:
        """Make Pi's unsynced appends durable before the journal depends on them."""
        await afsync_session(session)

    async def _branch(self, session: Path, started: Admission) -> bool:
        """Point the session back at the admission leaf (the worker is proven dead): a
        ``custom`` entry under that leaf, which Pi keeps and never sends to the model, so the
        replayed requests are byte-identical to the first ones. False when the session no
        longer holds that leaf (its history is missing: ``recovery_refused:session``), and
        when it can no longer be read as a session at all: a removed file that the crashed
        host's orphaned worker appended to before it was killed has no header (seen with the
        real Pi, which re-creates the file with its next append)."""
        try:
            await atruncate_torn_tail(session)
            read = await aread_session(session)
        except (SessionError, FileNotFoundError):
            return False
        leaf = read.session.leaf
        if started.session_leaf is None or (leaf is not None and leaf.id == started.session_leaf):
            return True
        if started.session_leaf not in read.session.by_id:
            return False
        entry = {"type": "custom", "customType": REPLAY_MARKER, "data": {"replay": True}}
        async with open_session_writer(session, clock=self.host.clocks.wall) as writer:
            append = functools.partial(writer.append, entry, parent_id=started.session_leaf)
            await trio.to_thread.run_sync(append)
            await trio.to_thread.run_sync(writer.fsync)
        return True

    # -- what a worker gets ------------------------------------------------------------

    def _boundary_config(self, grants: frozenset[str], kind: str) -> BoundaryConfig:
        tools: dict[str, RuntimeTool] = {"send_text_update": self._send_text_update}
        if self.host.attach is not None:
            share = self._share_attachment if self.host.shared else None
            tools["attach"] = self.host.attach(lambda: self.cwd, share, self._attached(kind))
        if self.host.ledger is not None:
            tools["effect"] = EffectLedger(self.host.ledger)
        if self.host.receipts is not None:
            tools.update(DocumentTools(self.host.receipts).handlers())
        return BoundaryConfig(
            upstream=self.host.upstream,
            granted=grants,
            runtime_tools={n: t for n, t in tools.items() if n in grants},
            classes=self.host.classes,  # L14: the configured classes, not the built-in ones
            socket_dir=self.host.socket_root,
            socket_name=f"{self.key[:20]}-{kind}.sock",
            replay=True,
        )

    def _attached(self, kind: str) -> Attached:
        """What the delivery the ``kind`` slot serves has attached so far (A12)."""

        def attached() -> list[AttachmentRef]:
            slot = self._oneshot if kind == "o" else self._room
            boundaries = slot.boundaries if slot is not None else None
            return boundaries.tools.attachments() if boundaries is not None else []

        return attached

    async def _share_attachment(self, sha256: str, data: bytes) -> None:
        """A11: an attachment's bytes in the shared store, under the lane's lease, before the
        outcome that names them (any host may send its result)."""
        await self.host.store.write_document(SHARED_ATTACHMENTS + sha256, data, fence=self.fence)

    async def _send_text_update(self, call: GateCall, intent_id: str) -> GateResult:
        """``send_text_update``: a short message threaded on the one being answered; it does
        not settle the turn (docs/design/lanes.md)."""
        await trio.lowlevel.checkpoint()
        pending = self.current
        text = call.args.get("text")
        limit = self.host.text_update_chars
        if pending is None:
            return GateResult.text("no delivery is being answered", is_error=True)
        if not isinstance(text, str) or not text.strip():
            return GateResult.text("send_text_update needs a non-empty text", is_error=True)
        if len(text) > limit:
            return GateResult.text(
                f"the update has {len(text)} characters; at most {limit} are sent", is_error=True
            )
        self.host.emit(
            TextUpdate(
                room=self.room,
                delivery_id=pending.delivery_id,
                reply_to=pending.delivery.message_id,
                text=text,
            )
        )
        return GateResult.text("sent")

    async def reserve_worker(self, slot: Slot) -> None:
        await self.host.reserve_worker(self, slot)

    def release_worker(self, slot: Slot) -> None:
        """``slot``'s epoch ended (or never started): its live-worker place goes back, and
        an idle lane wakes to let its slot go (:meth:`_idle`, L21)."""
        self.host.release_worker(self, slot)
        self._wake.set()

    def idle_worker(self, slot: Slot) -> bool:
        """Whether ``slot``'s live worker may be stopped for another's place (L8): the
        room's own worker while no delivery of its authority runs in it — the lane idle, or
        running a privileged delivery in its one-shot worker. A one-shot worker lives only
        while its delivery runs, so it is never idle."""
        current = self.current
        return slot is self._room and (current is None or current.privileged)

    def lane_log_failed(self, error: JournalError) -> None:
        """An epoch's end could not be recorded: under a lease another host claimed, the
        lane is lost (S11); a failed disk is the store's (it stops admitting)."""
        if fenced_out(error):
            self.lose()

    def now_ms(self) -> int:
        return self.host.clocks.wall.time_ms()

    def launch(self, session: Path) -> WorkerLaunch:
        return WorkerLaunch(
            program=self.host.program,
            cwd=self.cwd,
            home=self.home,
            agent_dir=self.home / "agent",
            tmp_dir=self.tmp,
            session=session,
            route=self.host.route,
            persona=self.host.persona,
            retry=self.host.retry,
            settings={"steeringMode": "all"},  # a burst's steers reach one request (L10)
            state_dir=self.host.store.root,
        )
