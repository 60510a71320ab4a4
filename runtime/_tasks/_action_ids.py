"""The ids of a task lane's outbox actions (TL6 of ``docs/design/watchdog.md``).

Every action a lane takes that must not be taken twice (an attestation, a reserve, a signal,
a continuation prompt, a grant, a recovery's start or charge) is recorded under an id derived
from the task's generation and attempt and the epoch or continuation it belongs to. The same id
is derived again after a host restart, so the lane finds the action already recorded instead of
repeating it. Pure: no trio, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .._records import ContinuationSent, OutboxAction

__all__ = ["ActionIds"]


@dataclass(frozen=True, slots=True)
class ActionIds:
    """The id scheme of one attempt of one task."""

    task_id: str
    generation: int
    attempt: int

    @property
    def prefix(self) -> str:
        return f"{self.task_id}/g{self.generation}/a{self.attempt}"

    def epoch(self, number: int, kind: str) -> str:
        """Epoch ``number``'s action ``kind``: attest, signal, reap, probeN, fence, …"""
        return f"{self.prefix}/e{number}/{kind}"

    def continuation(self, number: int, kind: str) -> str:
        """Continuation ``number``'s action ``kind``: reserve, attest, prompt."""
        return f"{self.prefix}/c{number}/{kind}"

    def grant(self, number: int) -> str:
        return f"{self.prefix}/grant{number}"

    def reply(self, number: int) -> str:
        """The prompt that delivers the ``number``-th reply (LK8)."""
        return f"{self.prefix}/reply{number}"

    def hold(self, number: int) -> str:
        """The ``number``-th hold or lift of a hold (WD12)."""
        return f"{self.prefix}/hold{number}"

    def finalize(self, number: int) -> str:
        """Finalization attempt ``number`` that found the Done tuple incomplete (LK10)."""
        return f"{self.prefix}/finalize{number}"

    def recovery(self, number: int) -> str:
        """The charge of the ``number``-th recovery's time (WD11)."""
        return f"{self.prefix}/recovery{number}"

    def recovery_start(self, number: int) -> str:
        """The start of the ``number``-th recovery, when no reserve starts it (WD11)."""
        return f"{self.prefix}/recovery{number}/start"

    def next_continuation(
        self,
        continuations: int,
        kind: str,
        actions: Mapping[str, OutboxAction],
        markers: Mapping[str, ContinuationSent],
    ) -> str:
        """The id of the next continuation's action ``kind``: a reserve already recorded
        whose continuation was never sent is that continuation's (TL6)."""
        number = continuations
        reserved = self.continuation(number, "reserve") in actions
        if number and reserved and not self.sent(number, markers):
            return self.continuation(number, kind)
        return self.continuation(number + 1, kind)

    def sent(self, number: int, markers: Mapping[str, ContinuationSent]) -> bool:
        """Continuation ``number`` is recorded as delivered (its marker, TL5)."""
        return self.continuation(number, "prompt") in markers
