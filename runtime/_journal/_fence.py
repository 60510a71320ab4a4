"""A lane's lease as a value: who holds it, at which epoch (docs/design/scale-out.md S10, S11).

Pure data, shared by the store interface (``_interface.py``) and both stores.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fence", "Lease"]


@dataclass(frozen=True, slots=True)
class Fence:
    """A lane's lease as its owner holds it (docs/design/scale-out.md S10, S11): a write
    made under it is refused (``lane_fenced``) once another host claimed the lane."""

    lane: str
    """The lane's log name (:meth:`JournalStore.lane_rel`): the lease's key."""
    owner: str
    """The holding host's name for its life (a process started again is a new owner)."""
    epoch: int
    """One more than every earlier claim of the lane."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A lane's lease as the database sees it now."""

    fence: Fence
    live: bool
    """Whether it has not run out yet (by the database's clock)."""
    remaining: float
    """Seconds until it runs out (0 once it has)."""
    expired_for: float = 0.0
    """Seconds since it ran out (0 while it runs; infinite once given up: S32)."""
