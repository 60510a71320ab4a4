"""Fencing guards and recovery budgets of a task lane (docs/design/watchdog.md). Pure: no trio, no
I/O.

A fence stops a live process, so it needs *proof*, not a timer. :class:`GuardEvidence` holds
what the shell found, one field per guard; a guard is ``True`` only when checked and holding,
``False`` when checked and failing, ``None`` when it could not be checked. :func:`failed_guards`
names every guard that is not ``True``: any failed **or unknown** guard holds (WD10).

:class:`Budget` bounds recovery exposure, not a task's runtime: 3 replacement epochs and
1800 s of recovery time (fence to the resumed worker's first progress) per attempt, charged
before launch, never refunded, rebuilt from the lane log after a restart (WD11). An operator
adds to it by a grant of at most :data:`MAX_GRANT_EPOCHS` epochs and :data:`MAX_GRANT_SECONDS`
seconds (:func:`check_grant`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Final

__all__ = [
    "MAX_GRANT_EPOCHS",
    "MAX_GRANT_SECONDS",
    "Budget",
    "GuardEvidence",
    "check_grant",
    "failed_guards",
]

MAX_GRANT_EPOCHS: Final = 100
"""The most replacement epochs one operator grant adds (WD11)."""
MAX_GRANT_SECONDS: Final = 86_400.0
"""The most recovery seconds one operator grant adds: a day (WD11)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardEvidence:
    """Every fencing guard of docs/design/watchdog.md, as checked by the shell."""

    progress_unchanged: bool | None = None
    """Compare-and-set: the progress sequence is the one the hard clock crossed on."""
    session_unchanged: bool | None = None
    """The session file's size is what it was at eligibility."""
    process_identity: bool | None = None
    """The live process is exactly the recorded (pid, start time, boot id) and carries the nonce."""
    fresh_probe_quiet: bool | None = None
    """A fresh read-only probe brought no new evidence."""
    effects_safe: bool | None = None
    """No ``never`` tool is in flight without an outcome."""
    no_terminal: bool | None = None
    """The lifecycle kernel holds no terminal reservation."""
    budget_left: bool | None = None
    attested: bool | None = None
    """Same session, route and worktree as recorded for the attempt."""


def check_grant(*, epochs: int, seconds: float) -> None:
    """Refuse (``ValueError``) an operator's grant that is not a bounded, positive amount:
    0 to :data:`MAX_GRANT_EPOCHS` epochs and 0 to :data:`MAX_GRANT_SECONDS` seconds, not both
    0 (WD11). Without the bound a grant of ``10**30`` epochs, or two of ``1e308`` seconds
    (their sum is ``inf``), switched the budget off while the view showed a number (or
    ``null``). Checked where an operator asks, not where a log is read back: a grant recorded
    counts as it was recorded."""
    if not (0 <= epochs <= MAX_GRANT_EPOCHS and 0 <= seconds <= MAX_GRANT_SECONDS) or (
        epochs == 0 and seconds == 0
    ):  # a NaN fails every comparison: refused too
        raise ValueError(
            f"a grant adds 0 to {MAX_GRANT_EPOCHS} epochs and 0 to {MAX_GRANT_SECONDS:g} "
            "seconds, not both 0; grant again for more"
        )


def failed_guards(evidence: GuardEvidence) -> tuple[str, ...]:
    """The guards that do not hold (failed or unknown), in declaration order."""
    return tuple(f.name for f in fields(evidence) if getattr(evidence, f.name) is not True)


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """The recovery budget of one attempt (immutable; every change returns a new one)."""

    max_epochs: int = 3
    max_seconds: float = 1800.0
    used_epochs: int = 0
    used_seconds: float = 0.0
    granted_epochs: int = 0
    granted_seconds: float = 0.0

    @property
    def epochs_left(self) -> int:
        return self.max_epochs + self.granted_epochs - self.used_epochs

    @property
    def seconds_left(self) -> float:
        return self.max_seconds + self.granted_seconds - self.used_seconds

    @property
    def exhausted(self) -> bool:
        return self.epochs_left <= 0 or self.seconds_left <= 0

    def as_dict(self) -> dict[str, float | int]:
        """The budget as ``task show`` prints it."""
        return {
            "epochs_used": self.used_epochs,
            "epochs_left": self.epochs_left,
            "seconds_used": round(self.used_seconds, 3),
            "seconds_left": round(self.seconds_left, 3),
            "granted_epochs": self.granted_epochs,
            "granted_seconds": self.granted_seconds,
        }

    def charge_epoch(self) -> Budget:
        """One replacement epoch, charged before its launch (never refunded)."""
        if self.epochs_left <= 0:
            raise ValueError("no replacement epoch is left in the budget")
        return replace(self, used_epochs=self.used_epochs + 1)

    def charge_seconds(self, seconds: float) -> Budget:
        """Recovery time spent (never negative, never refunded)."""
        return replace(self, used_seconds=self.used_seconds + max(0.0, seconds))

    def grant(self, *, epochs: int = 0, seconds: float = 0.0) -> Budget:
        """An operator's audited manual grant (finite, positive)."""
        if not (epochs >= 0 and 0 <= seconds < math.inf) or (epochs == 0 and seconds == 0):
            raise ValueError("a grant adds a finite, positive number of epochs or seconds")
        return replace(
            self,
            granted_epochs=self.granted_epochs + epochs,
            granted_seconds=self.granted_seconds + seconds,
        )
