"""A room lane's worker slots: a worker of one authority for one session, its boundaries and
at most one live epoch (docs/design/lanes.md L6, docs/design/boundaries.md)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Protocol

import trio

from .._boundary._boundaries import Boundaries, BoundaryConfig, open_boundaries
from .._errors import JournalError, PiRuntimeError, RpcError, one_error
from .._journal._interface import Log
from .._linux._proc import boot_id
from .._linux._proctree import new_nonce
from .._pi._launch import WorkerLaunch
from .._pi._rpc import RpcChannel, open_rpc_channel
from .._pi._worker import Epoch, open_worker
from .._records import EpochFenced, EpochLaunching

__all__ = ["Live", "Slot", "SlotOwner"]


class SlotOwner(Protocol):
    """What a slot uses of its lane (:class:`~runtime._rooms._lane.Lane`)."""

    epochs: int
    """Epochs started in the lane, over its whole log: the next one's number is one more."""

    async def hold_log(self) -> Log:
        """The lane's log, held open for an epoch from its launch's record to its end's."""
        ...

    async def let_log_go(self) -> None:
        """The epoch's end was recorded (or could not be): its hold on the log ends."""
        ...

    def launch(self, session: Path) -> WorkerLaunch: ...
    async def reserve_worker(self, slot: Slot) -> None:
        """Wait for a live-worker place of the host for ``slot``'s worker (L8): each worker
        counts, a one-shot one beside its room's warm one too."""
        ...

    def release_worker(self, slot: Slot) -> None: ...
    def now_ms(self) -> int: ...
    def lane_log_failed(self, error: JournalError) -> None:
        """An append to the lane's log failed after the epoch started (its end's record)."""
        ...


class Live:
    """One running worker epoch, with the channel to it."""

    def __init__(
        self, number: int, worker: Epoch, rpc: RpcChannel, scope: trio.CancelScope
    ) -> None:
        self.number = number
        self.worker = worker
        self.rpc = rpc
        self.scope = scope
        self.stop = trio.Event()
        self.ended = trio.Event()


class Slot:
    """A worker of one authority for one session: its boundaries (opened with the first
    delivery it serves, kept while its worker lives or a delivery runs: an idle lane with no
    worker lets its slot go, L21) and at most one live epoch.

    The room's own slot lives as long as the lane; a privileged delivery's one-shot slot
    only as long as that delivery (L6).
    """

    def __init__(self, lane: SlotOwner, config: BoundaryConfig, session: Path) -> None:
        self.lane = lane
        self.config = config
        self.session = session
        self.boundaries: Boundaries | None = None
        self.live: Live | None = None
        self._scope = trio.CancelScope()
        self._failure: PiRuntimeError | None = None
        self._served = trio.Event()
        """Set when the boundaries' task ends."""

    @property
    def failure(self) -> PiRuntimeError | None:
        """Why the attached delivery's journal could not be written (L17), if it could not:
        the boundaries' own failure the moment it happened, or one the lane reported
        (:meth:`fail`). Cleared when the next delivery is served."""
        if self._failure is not None:
            return self._failure
        return self.boundaries.failure if self.boundaries is not None else None

    async def serve(self, nursery: trio.Nursery, log: Log, key: str) -> Boundaries:
        """The boundaries, serving ``log`` (opened on first use, and again after a journal
        failure stopped the last ones)."""
        self._failure = None
        if self.boundaries is not None and self.boundaries.failure is not None:
            await self._served.wait()  # the failed boundaries end first; new ones serve
        if self.boundaries is None:
            self.boundaries = await nursery.start(self._serve, log, key)
        else:
            self.boundaries.attach(log, key=key)
        return self.boundaries

    async def _serve(self, log: Log, key: str, task_status: trio.TaskStatus[Boundaries]) -> None:
        self._scope = scope = trio.CancelScope()
        self._served = served = trio.Event()
        opened: Boundaries | None = None
        try:
            with scope:
                async with open_boundaries(self.config, log, key=key, epoch=0) as opened:
                    task_status.started(opened)
                    await trio.sleep_forever()
        except* PiRuntimeError as group:  # L17: a journal write of the attached delivery
            if opened is None:
                raise  # they never started: the lane's own failure
            failure = opened.failure or one_error(group)
            assert isinstance(failure, PiRuntimeError)
            self.fail(failure)
        finally:
            if self.boundaries is opened:
                self.boundaries = None
            served.set()

    def fail(self, error: PiRuntimeError) -> None:
        """The attached delivery's journal failed (L17): its worker is fenced at once, so it
        starts no effect that could not be journaled; the lane ends the delivery."""
        if self._failure is None:
            self._failure = error
        if self.live is not None:
            self.live.scope.cancel()

    async def ensure_live(self, nursery: trio.Nursery) -> Live:
        """The slot's live epoch for a turn: the running one, or a new one. An epoch asked to
        stop (the idle stop, the worker cap) is never handed a turn: its channel is closing,
        and the turn would be charged an attempt it never ran (L19); it ends first."""
        stopping = self.live
        if stopping is not None and stopping.stop.is_set():
            await stopping.ended.wait()
        if self.live is not None and not self.live.ended.is_set():
            return self.live
        assert self.boundaries is not None
        lane = self.lane
        await lane.reserve_worker(self)
        lane.epochs += 1
        number = lane.epochs
        self.boundaries.begin_epoch(number)
        launch = self.boundaries.launch(lane.launch(self.session))
        try:
            self.live = await nursery.start(self._run_epoch, launch, number)
        except BaseException:
            lane.release_worker(self)
            raise
        return self.live

    async def _run_epoch(
        self, launch: WorkerLaunch, number: int, task_status: trio.TaskStatus[Live]
    ) -> None:
        lane = self.lane
        live: Live | None = None
        log = await lane.hold_log()  # closed again once no epoch of the lane runs (L21)
        try:
            with trio.CancelScope() as scope:
                # W13: the nonce (and so the cgroup's name) is durable before the spawn, so a
                # crash before ``EpochStarted`` leaves no tree that no record names
                nonce = new_nonce()
                await log.append(
                    EpochLaunching(
                        epoch=number, nonce=nonce, boot_id=boot_id(), launching_ms=lane.now_ms()
                    )
                )
                secrets = self.boundaries.worker_secrets() if self.boundaries else ()
                async with open_worker(launch, nonce=nonce, secrets=secrets) as worker:
                    await log.append(worker.record(number, started_ms=lane.now_ms()))
                    async with open_rpc_channel(
                        worker.stdin, worker.stdout, stderr=worker.stderr_tail
                    ) as rpc:
                        live = Live(number, worker, rpc, scope)
                        task_status.started(live)
                        await live.stop.wait()
                        if rpc.running:
                            with contextlib.suppress(RpcError):
                                await rpc.abort()
            reason = "fenced" if scope.cancelled_caught else "stopped"
            with trio.CancelScope(shield=True):
                try:
                    await log.append(
                        EpochFenced(epoch=number, reason=reason, fenced_ms=lane.now_ms())
                    )
                except JournalError as error:
                    # the epoch's tree is stopped: without this record the next owner just
                    # finds nothing left of it to kill; the lane decides what the failure
                    # means (lost to another host: it stops)
                    lane.lane_log_failed(error)
        finally:
            await lane.let_log_go()
            if live is not None:
                live.ended.set()
            if self.live is live:
                self.live = None
            lane.release_worker(self)

    def hurry(self) -> None:
        """The live epoch's stop kills its tree at once, no TERM grace (S12: a lost lane)."""
        if self.live is not None:
            self.live.worker.hurry()

    def request_stop(self) -> None:
        if self.live is not None:
            self.live.stop.set()

    async def stop(self) -> None:
        """Stop the live epoch once idle (stdin closed after ``agent_settled``)."""
        live = self.live
        if live is not None:
            live.stop.set()
            await live.ended.wait()

    async def fence(self) -> None:
        """Cancel the live epoch's scope: its whole tree is stopped before this returns."""
        live = self.live
        if live is not None:
            live.scope.cancel()
            await live.ended.wait()

    async def close(self) -> None:
        """Stop the epoch, then the boundaries (a one-shot slot's end)."""
        await self.stop()
        self._scope.cancel()

    async def retire(self, grace: float) -> None:
        """The room's slot replaced by one of other grants (L6): stop the live epoch the
        ordinary way (:meth:`stop`: an abort first if a run were in flight, stdin closed once
        settled), fenced if it has not ended within ``grace``; then end the boundaries and
        wait for them. The epoch's end gives its live-worker place back (L8). Returns once
        nothing of the slot runs."""
        with trio.move_on_after(grace):
            await self.stop()
        await self.fence()
        await self.end_boundaries()

    async def end_boundaries(self) -> None:
        """End the boundaries and wait for them: no epoch of the slot runs (it was stopped,
        or the lane is idle with none, L21)."""
        self._scope.cancel()
        if self.boundaries is not None:
            await self._served.wait()
