"""What a room lane queues: an admitted delivery (:class:`Pending`) and a delivery steered
into another's run (:class:`Absorbed`, docs/design/lanes.md L10)."""

from __future__ import annotations

from dataclasses import dataclass

from .._records import Admission
from ._admission import Delivery

__all__ = ["Absorbed", "Pending"]


@dataclass(eq=False, slots=True)
class Pending:
    """An admitted delivery the host has not finished."""

    delivery: Delivery
    admission: Admission
    grants: frozenset[str]
    privileged: bool
    recovering: bool = False
    """Found unfinished at a start with its turn begun by a run before (its own log exists):
    charged a recovery attempt before its turn runs again (L19)."""
    restart_charged: bool = False
    """Its ``host_restart`` attempt is recorded: a turn taken up again in this run — having
    waited for file descriptors before it began (L21) — is charged no second one."""
    cancelled: bool = False
    absorbed: tuple[Absorbed, ...] = ()
    """Deliveries steered into this one's run (it is their owner); a tuple, so a delivery
    nothing was steered into holds no container of its own for the collector to track."""
    absorbed_into: str | None = None
    """The owner this delivery was steered into, while it is."""

    @property
    def delivery_id(self) -> str:
        return self.delivery.delivery_id


@dataclass(eq=False, slots=True)
class Absorbed:
    """A delivery steered into an owner's run (docs/design/lanes.md): its text, and the step
    whose model request first carried it (``None`` until seen)."""

    pending: Pending
    text: str
    first_step: int | None = None
    after: int = -1
    """The last step the journal answered before :attr:`first_step` (-1: none): a replay
    sends the steer again once it has asked that step, or right after the prompt when there
    is none (L26). Not always ``first_step - 1``: a request Pi retried with the steer added
    (pi-observed §12) is a step of its own, and the failed one's step has no answer."""
    sent: bool = False
    """Steered into the current attempt's worker."""
    held: bool = False
    """The current attempt's run holds it: one of its requests carried it, or its replay was
    answered from the journal at :attr:`first_step` or later (L26)."""
