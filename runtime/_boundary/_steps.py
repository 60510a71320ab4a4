"""The model gateway's step journals (docs/design/gateway.md): what a worker's model requests
were and what they were answered, durable before the answer is released, so a replayed
request is answered from the journal and no finished model answer is paid for twice.

:class:`StepJournal` is what the gateway asks; :class:`DeliveryStepJournal` keeps the steps in
one delivery's (or task lane's) log, :class:`MemoryStepJournal` in memory for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import trio

from .._errors import ReasonCode, ReplayMismatch, StepRefused
from .._journal._interface import Log
from .._records import ModelRequestIntent, ModelResponse

__all__ = ["DeliveryStepJournal", "MemoryStepJournal", "StepJournal"]


class StepJournal(Protocol):
    """What the gateway asks of a delivery's journal. Every method returns once durable."""

    async def lookup(self, digest: str) -> list[str] | None:
        """The recorded SSE payloads of a complete response to ``digest``, or ``None``."""
        ...

    async def record_request(self, digest: str) -> None:
        """Make the intent to call upstream for ``digest`` durable (before the call)."""
        ...

    async def record_response(self, digest: str, chunks: list[str]) -> None:
        """Make the complete response durable (before its terminal part is released)."""
        ...


@dataclass
class MemoryStepJournal:
    """A :class:`StepJournal` in memory, for tests and in-process runs."""

    responses: dict[str, list[str]] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    """Every ``record_request`` digest, in order."""

    async def lookup(self, digest: str) -> list[str] | None:
        await trio.lowlevel.checkpoint()
        found = self.responses.get(digest)
        return list(found) if found is not None else None

    async def record_request(self, digest: str) -> None:
        await trio.lowlevel.checkpoint()
        self.requests.append(digest)

    async def record_response(self, digest: str, chunks: list[str]) -> None:
        await trio.lowlevel.checkpoint()
        self.responses[digest] = list(chunks)


class DeliveryStepJournal:
    """A :class:`StepJournal` on one delivery's log.

    Records :class:`ModelRequestIntent` / :class:`ModelResponse`; step numbers
    count distinct model requests in the log. A request whose intent is
    recorded but unanswered (a retry after a cut) keeps its step; the new
    intent records the new epoch.

    Keep one per open delivery log across epochs (it tracks what it appended;
    ``journal.contents`` holds only what the log had when opened) and set
    :attr:`epoch` when a new epoch starts.
    """

    def __init__(self, journal: Log, *, epoch: int, replay: bool = False) -> None:
        self._journal: Log | None = journal
        self.epoch = epoch
        self.replay = replay
        """Each epoch asks the steps again from the first; diverging is refused (G13)."""
        self._steps: dict[str, int] = {}
        self._responses: dict[str, list[str]] = {}
        self._next_step = 0
        self._last_answered = -1
        self._replayed_upto = -1
        """The highest answered step this epoch's worker has asked again (G13)."""
        self._asked_in: dict[str, int] = {}
        """The epoch each request in flight was asked in: a dead epoch's request goes on to
        its answer (G12), which is then not the new epoch's replay (G13)."""
        self.current_step = 0
        """The step of the request answered last (recorded or replayed): the round whose
        response carries the tool calls the gate is asked about next (shared numbering)."""
        self.mismatch: ReplayMismatch | None = None
        """Set when this epoch's replay diverged from the journal (G13); the lane ends the
        delivery ``recovery_refused:replay``."""
        for record in journal.contents.records:
            if isinstance(record, ModelRequestIntent):
                self._steps.setdefault(record.request_digest, record.step)
                self._next_step = max(self._next_step, record.step + 1)
                self.current_step = record.step
            elif isinstance(record, ModelResponse):
                self._responses[record.request_digest] = list(record.chunks)
                self._last_answered = max(self._last_answered, record.step)

    def release(self) -> None:
        """The delivery ended: forget its steps and log (an idle lane keeps no turn in
        memory); every later request is refused (G14)."""
        self._journal = None
        self._steps.clear()
        self._responses.clear()
        self._asked_in.clear()

    def _log(self) -> Log:
        if self._journal is None:
            raise StepRefused(
                ReasonCode.GATEWAY_BAD_REQUEST, "no delivery is being answered on this gateway"
            )
        return self._journal

    @property
    def last_answered(self) -> int:
        """The highest step with a recorded response (-1: none): what a replay asks again."""
        return self._last_answered

    def begin_epoch(self, epoch: int) -> None:
        """A new worker epoch records ``epoch`` and replays the delivery from its first step."""
        self.epoch = epoch
        self._replayed_upto = -1

    def diverge(self, reason: str) -> None:
        """The gate refused a replayed tool call that is not the recorded one (T14): the
        replay diverged like a request the journal did not answer (G13). From now on no
        request is asked upstream; the lane ends the delivery ``recovery_refused:replay``."""
        if self.mismatch is None:
            self.mismatch = ReplayMismatch(ReasonCode.RECOVERY_REFUSED, reason)

    def step_of(self, digest: str) -> int | None:
        return self._steps.get(digest)

    async def lookup(self, digest: str) -> list[str] | None:
        await trio.lowlevel.checkpoint()
        found = self._responses.get(digest)
        if found is None:
            return None
        self.current_step = self._steps[digest]
        self._replayed_upto = max(self._replayed_upto, self.current_step)
        return list(found)

    async def record_request(self, digest: str) -> None:
        log = self._log()
        step = self._steps.get(digest)
        if step is None:
            step = self._next_step
        if self.mismatch is not None:  # G13, T14: a diverged replay asks nothing more
            raise ReplayMismatch(self.mismatch.code, self.mismatch.message)
        behind = self._replayed_upto < self._last_answered and step > self._replayed_upto + 1
        if self.replay and behind:
            # G13: an answered step lies between what this epoch replayed and this request
            self.mismatch = ReplayMismatch(
                ReasonCode.RECOVERY_REFUSED,
                f"the replayed request at step {self._replayed_upto + 1} is not the one the "
                "journal answered there; the turn is not asked upstream",
            )
            raise self.mismatch
        if step == self._next_step:
            self._next_step += 1
            self._steps[digest] = step
        self.current_step = step
        self._asked_in[digest] = self.epoch
        await log.append(ModelRequestIntent(step=step, request_digest=digest, epoch=self.epoch))

    async def record_response(self, digest: str, chunks: list[str]) -> None:
        log = self._log()
        step = self._steps[digest]
        asked_in = self._asked_in.pop(digest, self.epoch)
        await log.append(
            ModelResponse(step=step, request_digest=digest, chunks=list(chunks), epoch=asked_in)
        )
        self._responses[digest] = list(chunks)
        self._last_answered = max(self._last_answered, step)
        if asked_in == self.epoch:  # this epoch's worker asked it: replayed up to here
            self._replayed_upto = max(self._replayed_upto, step)
