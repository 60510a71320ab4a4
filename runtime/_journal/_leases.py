"""This host's leases on its lanes (rooms and tasks), on a store several hosts share
(docs/design/scale-out.md S10, S12, S31).

:class:`LaneLeases` claims a lane for the room worker or the task runner, renews every lease it
holds in one statement every third of the lease's time to live, and gives a lane up — calls
``lost`` — when a renewal says another host has it, or when the lease may have run out because
no renewal succeeded in time: the deadline of a lease is the moment its last successful claim or
renewal was *sent*, plus the TTL, less a margin (:data:`MARGIN`), measured on Trio's clock — the
database's lease cannot have run out before it, so the host stops the lane's workers before any
other host may claim the lane (S12). A renewal that hangs does not hold that deadline back: it
is watched by a task of its own.

Resource handling: :meth:`LaneLeases.run` (renewals and deadlines) runs in its owner's (the
room worker's, the task runner's) nursery until it is cancelled; nothing is released by it
(its owner releases its leases once its lanes are stopped).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Final

import trio

from .._errors import DiskFailedError, JournalError, ReasonCode
from ._fence import Fence
from ._interface import LeaseStore

__all__ = ["MARGIN", "LaneLeases", "fenced_out"]

MARGIN: Final = 0.1
"""The share of the TTL a host gives up before its lease's deadline: room for the rates of
two clocks to differ and for the lane's workers to be stopped."""


def fenced_out(error: BaseException) -> bool:
    """Whether ``error`` is a write refused because another host claimed the lane (S11)."""
    return isinstance(error, JournalError) and error.code is ReasonCode.LANE_FENCED


class LaneLeases:
    """The leases this host holds, by lane name (a room, ``task:<id>``)."""

    def __init__(
        self, store: LeaseStore, *, ttl: float, lost: Callable[[str, Fence, str], None]
    ) -> None:
        if ttl <= 0:
            raise ValueError("a lease's time to live is positive")
        self.store = store
        self.ttl = ttl
        self._lost = lost
        self._held: dict[str, Fence] = {}
        self._until: dict[str, float] = {}
        """Trio time by which each lease is given up unless renewed (S12)."""
        self._changed = trio.Event()

    def fence(self, lane: str) -> Fence | None:
        """The lease this host holds on ``lane`` (``None``: it holds none)."""
        return self._held.get(lane)

    @property
    def held(self) -> dict[str, Fence]:
        return dict(self._held)

    def _deadline(self, sent: float) -> float:
        return sent + self.ttl * (1 - MARGIN)

    async def claim(self, lane: str) -> Fence | None:
        """Claim ``lane``: its :class:`Fence`, or ``None`` while another host holds it — or
        while this host does under a later epoch (S12).

        One fence per lane is kept, the newest: every claim moves the epoch on (S10), so
        once a later claim of this host's committed the database refuses the earlier epoch.
        A claim answered after a later one (its connection retried, a slow thread) proves
        nothing now and is answered ``None``, never kept over the newer one — kept, the
        newer would be renewed and watched by nobody. A claim that supersedes a held epoch
        reports that one lost at once: what runs under it is refused from now on."""
        sent = trio.current_time()
        fence = await self.store.claim(lane, self.ttl)
        if fence is None:
            return None
        held = self._held.get(lane)
        if held is not None and held.epoch > fence.epoch:
            return None  # superseded by a later claim of this host's, already kept
        if held is not None and held != fence:
            self._lose(lane, f"claimed again by this host at epoch {fence.epoch}")
        self._held[lane] = fence
        self._until[lane] = self._deadline(sent)
        self._wake()
        return fence

    def drop(self, lane: str, fence: Fence) -> None:
        """Forget ``fence`` (its lane was found taken over, or stopped): it is renewed no
        more."""
        if self._held.get(lane) == fence:
            del self._held[lane]
            del self._until[lane]
            self._wake()

    async def release(self, fence: Fence) -> None:
        """Give ``fence`` up in the database too (best effort: it runs out anyway)."""
        for lane, held in list(self._held.items()):
            if held == fence:
                self.drop(lane, fence)
        with contextlib.suppress(DiskFailedError, JournalError):  # it runs out anyway
            await self.store.release(fence)

    async def run(self) -> None:
        """Renew and watch the deadlines until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._renewals)
            nursery.start_soon(self._deadlines)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _lose(self, lane: str, why: str) -> None:
        fence = self._held.pop(lane, None)
        self._until.pop(lane, None)
        if fence is not None:
            self._lost(lane, fence, why)

    async def _renewals(self) -> None:
        while True:
            await trio.sleep(self.ttl / 3)
            fences = dict(self._held)
            if not fences:
                continue
            sent = trio.current_time()
            try:
                held = await self.store.renew(list(fences.values()), self.ttl)
            except (DiskFailedError, JournalError):
                continue  # the deadlines decide (S12)
            for lane, fence in fences.items():
                if self._held.get(lane) != fence:
                    continue  # dropped or claimed again meanwhile
                if fence in held:
                    self._until[lane] = self._deadline(sent)
                else:
                    self._lose(lane, "another host claimed it (found at a renewal)")
            self._wake()

    async def _deadlines(self) -> None:
        while True:
            changed = self._changed
            now = trio.current_time()
            for lane in [lane for lane, until in self._until.items() if until <= now]:
                self._lose(lane, "its lease was not renewed in time, so it may run out (S12)")
            with trio.move_on_at(min(self._until.values(), default=math.inf)):
                await changed.wait()
