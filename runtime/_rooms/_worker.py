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
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import msgspec
import trio

from .._boundary._gate import replay_class_of
from .._boundary._gateway import GatewayConfig
from .._boundary._receipts import ReceiptStore, receipt_store
from .._boundary._tools import RUNTIME_TOOLS
from .._clock import Clocks
from .._config import RoomWorkerConfig, validate_config
from .._errors import ConfigError, DeliveryError, JournalError, ReasonCode, raises_one_error
from .._hosting import start_model, worker_program
from .._journal._interface import JournalStore
from .._journal._store import open_store, runtime_dir
from .._linux._fs import FileSystem
from .._pi._worker import kill_epoch_leftovers
from .._records import (
    AbsorbedInput,
    Admission,
    EpochFenced,
    EpochStarted,
    Fingerprints,
    Outcome,
    Result,
)
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

__all__ = ["Accepted", "RoomStatus", "RoomWorker", "open_room_worker", "request_cancel"]

EVENT_BUFFER = 1024
"""Signals kept for a slow events reader; older ones are dropped (they are not durable)."""


@dataclass(frozen=True, slots=True)
class _Known:
    """An admission this host knows: its fingerprints and its room."""

    fingerprints: Fingerprints
    room: str


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
        self._known: dict[str, _Known] = {}
        self._pending: dict[str, Pending] = {}
        self._admitting = True
        self._events_in, self._events_out = trio.open_memory_channel[RoomEvent](EVENT_BUFFER)
        self.dropped_events = 0
        self._live: set[Lane] = set()
        self._live_changed = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self._warm: set[str] = set()
        self._settings_prints: dict[frozenset[str], str] = {}

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
        grants = self.config.grants_for(delivery.room, delivery.author.id)
        if grants is None:
            raise DeliveryError(ReasonCode.ROOM_REFUSED, f"room {delivery.room} is not served here")
        prints = fingerprints(delivery, grants=grants, settings=self._settings_print(grants))
        known = self._known.get(delivery.delivery_id)
        if known is not None:
            if known.fingerprints.request != prints.request:
                raise DeliveryError(
                    ReasonCode.DELIVERY_CONFLICT,
                    f"delivery {delivery.delivery_id} was admitted with a different request",
                )
            return Accepted(
                delivery_id=delivery.delivery_id, room=known.room, disposition="duplicate"
            )
        lane = self._lane(delivery.room)
        if len(lane.queue) + lane.busy >= caps.queue_limit:
            raise DeliveryError(
                ReasonCode.QUEUE_FULL,
                f"room {delivery.room} already has {caps.queue_limit} deliveries waiting",
            )
        privileged = self.config.is_privileged(delivery.room, delivery.author.id)
        cold = privileged or (delivery.room not in self._warm and not lane.busy and not lane.queue)
        admission = Admission(
            delivery_id=delivery.delivery_id,
            lane=lane.key,
            request=msgspec.to_builtins(delivery),
            fingerprints=prints,
            rendered_prompt=render_prompt(delivery, cold=cold),
            admitted_ms=self._host.clocks.wall.time_ms(),
        )
        self._known[delivery.delivery_id] = _Known(prints, delivery.room)
        try:
            await self.store.admissions.append(admission)
        except BaseException:
            del self._known[delivery.delivery_id]
            raise
        if not privileged:
            self._warm.add(delivery.room)
        started = not lane.busy and not lane.queue
        pending = Pending(delivery, admission, grants, privileged)
        self._pending[delivery.delivery_id] = pending
        if await lane.steer(pending):  # L10: into the live run of the same authority
            disposition: Literal["started", "steered", "queued"] = "steered"
        else:
            self._enqueue(lane, pending)
            disposition = "started" if started else "queued"
        return Accepted(
            delivery_id=delivery.delivery_id, room=delivery.room, disposition=disposition
        )

    async def cancel(self, delivery_id: str) -> None:
        """Cancel a queued or running delivery (its result: ``cancelled``); a finished one
        is left as it is; an unknown one raises ``delivery_unknown``."""
        pending = self._pending.get(delivery_id)
        if pending is None:
            if delivery_id in self._known:
                return  # already finished
            raise DeliveryError(ReasonCode.DELIVERY_UNKNOWN, f"no delivery {delivery_id}")
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

    def status(self, room: str | None = None) -> list[RoomStatus]:
        """Each room lane this host has (or only ``room``), sorted by room."""
        outbox = self._host.outbox
        return [
            RoomStatus(
                room=name,
                state="running" if lane.current is not None else "idle",
                queued=len(lane.queue),
                live_worker=lane.live_worker,
                last_result_seq=last.seq if (last := outbox.last_of_room.get(name)) else 0,
            )
            for name, lane in sorted(self._lanes.items())
            if room is None or name == room
        ]

    @property
    def last_seq(self) -> int:
        """The seq of the latest published result (0 before the first)."""
        return self._host.outbox.last_seq

    def result_of(self, delivery_id: str) -> DeliveryResult | None:
        return self._host.outbox.result_of(delivery_id)

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

    def _lane(self, room: str) -> Lane:
        lane = self._lanes.get(room)
        if lane is None:
            lane = Lane(self._host, room)
            self._lanes[room] = lane
            self._nursery.start_soon(lane.run)
        return lane

    def _enqueue(self, lane: Lane, pending: Pending, *, front: bool = False) -> None:
        self._pending[pending.delivery_id] = pending
        lane.submit(pending, front=front)

    def _finished(self, pending: Pending) -> None:
        self._pending.pop(pending.delivery_id, None)
        self._idle.set()

    def _emit(self, event: RoomEvent) -> None:
        try:
            self._events_in.send_nowait(event)
        except trio.WouldBlock:
            self.dropped_events += 1

    async def _reserve_worker(self, lane: Lane) -> None:
        """Wait for a live-worker slot (L8): the least recently used idle lane stops."""
        cap = self.config.caps.max_live_workers
        while lane not in self._live and len(self._live) >= cap:
            idle = [other for other in self._live if not other.busy]
            if idle:
                min(idle, key=lambda other: other.last_used).stop_worker()
            changed = self._live_changed
            await changed.wait()
        self._live.add(lane)

    def _release_worker(self, lane: Lane) -> None:
        self._live.discard(lane)
        self._wake_reservations()

    def _lane_idle(self, lane: Lane) -> None:
        """A lane finished a delivery: a reservation waiting for a slot may stop its worker."""
        if lane in self._live:
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

    async def _recover(self) -> None:
        """Pick up what a previous owner left: kill its epochs' trees, then requeue every
        admitted delivery without a published result, in admission order
        (docs/design/recovery.md)."""
        await self._kill_leftover_epochs()
        published = self._host.outbox
        admissions = [r for r in self.store.admissions.contents.records if isinstance(r, Admission)]
        running = [a for a in admissions if published.result_of(a.delivery_id) is None]
        steered = await self._steered(
            [a.delivery_id for a in running] + self._finished_owners(running)
        )
        cancels = await _read_cancel_requests(self.store)
        if any(published.result_of(d) is not None for d in cancels):  # applied: forget them
            unfinished = [d for d in cancels if published.result_of(d) is None]
            await self.store.write_document(CANCEL_REQUESTS, _encode_ids(unfinished))
        replaying: set[str] = set()
        for record in admissions:
            delivery = msgspec.convert(record.request, Delivery)
            self._known[record.delivery_id] = _Known(record.fingerprints, delivery.room)
            if published.result_of(record.delivery_id) is not None:
                self._warm.add(delivery.room)
                continue
            grants = self.config.grants_for(delivery.room, delivery.author.id)
            privileged = self.config.is_privileged(delivery.room, delivery.author.id)
            lane = self._lane(delivery.room)
            pending = Pending(delivery, record, grants or frozenset(), privileged, recovering=True)
            refused = self._refusal(record, delivery, grants)
            if record.delivery_id in cancels:  # `pi-runtime cancel` while no server ran
                refused = None
            if refused is not None or record.delivery_id in cancels:
                self._pending[record.delivery_id] = pending
                self._nursery.start_soon(self._refuse, lane, pending, refused)
                continue
            if not privileged:
                self._warm.add(delivery.room)
            owner_id = steered.get(record.delivery_id)
            if owner_id is not None and self._absorbed_at_recovery(lane, pending, owner_id):
                continue
            owner = self._pending.get(owner_id[0]) if owner_id is not None else None
            if owner is not None and owner_id is not None and owner_id[0] in replaying:
                self._pending[record.delivery_id] = pending  # it rides its owner's replay
                pending.absorbed_into = owner.delivery_id
                owner.absorbed.append(Absorbed(pending, owner_id[1], owner_id[2]))
                continue
            replaying.add(record.delivery_id)  # an owner refused or cancelled: its own turn
            self._enqueue(lane, pending)

    def _finished_owners(self, unfinished: list[Admission]) -> list[str]:
        """Owners that finished while deliveries steered into them did not: the host died
        between the owner's result and theirs (``_settle_absorbed``). Only the latest owner
        of a room can be one — the room's latest result, or the owner that one was absorbed
        into — so one log per room with unfinished deliveries is read, not every log."""
        owners = []
        for room in {a.request.get("room") for a in unfinished}:
            last = self._host.outbox.last_of_room.get(str(room))
            if last is not None:
                owners.append(last.absorbed_into or last.delivery_id)
        return owners

    def _absorbed_at_recovery(
        self, lane: Lane, pending: Pending, owner: tuple[str, str, int | None]
    ) -> bool:
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
        self._nursery.start_soon(lane.write_result, pending, absorbed)
        return True

    async def _steered(self, owners: list[str]) -> dict[str, tuple[str, str, int | None]]:
        """For each delivery steered into one of ``owners``: (owner, text, first step), from
        the owners' logs (only deliveries whose turn started have one)."""
        found: dict[str, tuple[str, str, int | None]] = {}
        for owner in owners:
            if not await self.store.exists(self.store.delivery_rel(owner)):
                continue
            try:
                records = (await self.store.read_delivery_log(owner)).records
            except JournalError:
                continue  # damaged: its lane refuses it (recovery_refused:journal)
            for record in records:
                if isinstance(record, AbsorbedInput):
                    found[record.delivery_id] = (owner, record.text, record.first_step)
        return found

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
        result = Result(outcome=outcome, code=code, finished_ms=self._host.clocks.wall.time_ms())
        await lane.write_result(pending, result)

    async def _kill_leftover_epochs(self) -> None:
        for rel in await self.store.lane_logs():
            contents = await self.store.read(rel)
            started = {r.epoch: r for r in contents.records if isinstance(r, EpochStarted)}
            for record in contents.records:
                if isinstance(record, EpochFenced):
                    started.pop(record.epoch, None)
            for record in started.values():
                await kill_epoch_leftovers(record)


CANCEL_REQUESTS: Final = "cancel-requests.json"
"""A document in the state directory: deliveries whose cancel was requested while no server
ran; the next start ends each ``cancelled`` before anything runs (docs/design/protocol.md,
``cancel``)."""


def _open_journal_store(
    config: RoomWorkerConfig, *, clocks: Clocks, fs: FileSystem | None
) -> contextlib.AbstractAsyncContextManager[JournalStore]:
    """The configured journal store: the file store in ``state_dir`` (the default), or the
    PostgreSQL store when ``[store] url`` names a database (``docs/design/scale-out.md``),
    held exclusively by this host until lanes are leased; ``state_dir`` then keeps only what
    is local (sessions, sockets, the token, the receipt store)."""
    state_dir = Path(config.state_dir)
    if config.store.url is None:
        return open_store(state_dir, clocks=clocks, fs=fs)
    if fs is not None:
        raise ConfigError("store.url", "a file system is given to the file store only")
    try:  # the optional extra pi-runtime[postgres]
        from .._journal._postgres import open_pg_store
    except ImportError as error:
        raise ConfigError(
            "store.url", f"the PostgreSQL store needs pi-runtime[postgres] ({error})"
        ) from None
    return open_pg_store(config.store.url, root=state_dir, clocks=clocks, exclusive=True)


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
    async with open_store(Path(state_dir), clocks=clocks or Clocks.system()) as store:
        records = store.admissions.contents.records
        if not any(isinstance(r, Admission) and r.delivery_id == delivery_id for r in records):
            raise DeliveryError(ReasonCode.DELIVERY_UNKNOWN, f"no delivery {delivery_id}")
        if ResultOutbox(store.results).result_of(delivery_id) is not None:
            return "finished"
        requested = await _read_cancel_requests(store)
        await store.write_document(CANCEL_REQUESTS, _encode_ids([*requested, delivery_id]))
    return "requested"


@raises_one_error
@contextlib.asynccontextmanager
async def open_room_worker(
    config: RoomWorkerConfig,
    *,
    clocks: Clocks | None = None,
    base_dir: Path | None = None,
    fs: FileSystem | None = None,
) -> AsyncIterator[RoomWorker]:
    """Run a room worker on ``config`` until the block ends (see the module docstring).

    Relative ``state_dir`` and ``work_root`` resolve against ``base_dir`` (default: the
    current directory). ``fs`` is the journal store's file system (tests pass one that
    fails or loses power on purpose); sessions and work directories are always on disk.
    """
    config = validate_config(config, base=base_dir)
    state_dir = Path(config.state_dir)
    work_root = Path(config.work_root)
    program = worker_program(config)
    clocks = clocks or Clocks.system()
    async with (
        _open_journal_store(config, clocks=clocks, fs=fs) as store,
        receipt_store(state_dir, now_ms=clocks.wall.time_ms) as receipts,
        trio.open_nursery() as nursery,
    ):
        model = config.model
        base_url, route = await start_model(model, nursery)
        thresholds = config.thresholds
        upstream = GatewayConfig(
            upstream_url=base_url,
            upstream_key_env=model.api_key_env,
            keepalive_interval=thresholds.keepalive_seconds,
            upstream_inactivity=thresholds.upstream_inactivity_seconds,
        )
        worker: RoomWorker | None = None

        def finished(pending: Pending) -> None:
            assert worker is not None
            worker._finished(pending)

        def emit(event: RoomEvent) -> None:
            assert worker is not None
            worker._emit(event)

        async def reserve(lane: Lane) -> None:
            assert worker is not None
            await worker._reserve_worker(lane)

        def release(lane: Lane) -> None:
            assert worker is not None
            worker._release_worker(lane)

        def lane_idle(lane: Lane) -> None:
            assert worker is not None
            worker._lane_idle(lane)

        host = LaneHost(
            store=store,
            clocks=clocks,
            program=program,
            route=route,
            upstream=upstream,
            outbox=ResultOutbox(store.results),
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
            emit=emit,
            finished=finished,
            reserve_worker=reserve,
            release_worker=release,
            lane_idle=lane_idle,
            classes=config.replay_classes(),  # L14
            ledger=work_root / "effects.jsonl",
            receipts=receipts,
        )
        worker = RoomWorker(config, store, host, nursery)
        await worker._recover()
        try:
            yield worker
        finally:
            worker._admitting = False
            nursery.cancel_scope.cancel()
