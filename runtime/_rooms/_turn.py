"""One delivery's turn in a room lane's worker: the prompt, the steers, the events until
``agent_settled`` (typing, tool activity, the stall backstop) and the outcome
(docs/design/lanes.md; the outcome rules are ``runtime/_rooms/_outcome.py``).

The stall backstop is bounded itself (L20): once the turn has stalled it is ``turn_stalled``
whatever the worker does next. Its ``abort`` is sent from outside the turn (the lane's
nursery), so not even a write to a worker that stopped reading holds the turn; a worker with
no ``agent_settled`` ``abort_grace`` seconds after it — or one that died after the stall —
is :class:`WorkerWedged`, and the lane fences its epoch before the result is published.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

import trio

from .._clock import Clocks
from .._errors import ReasonCode, RpcError
from .._journal._interface import Log
from .._metrics import FIRST_TOKEN_SECONDS, TURN_SECONDS
from .._pi._rpc import RpcChannel
from .._pi._rpc_protocol import Event
from .._records import AbsorbedInput, Outcome
from .._wire import RoomEvent, ToolActivity, Typing
from ._outcome import TurnEnd, classify_turn, could_still_be_silent
from ._pending import Absorbed, Pending
from ._stall import StallWatch, watch_turn

__all__ = ["Turn", "TurnHost", "WorkerWedged"]


class TurnHost(Protocol):
    """What a turn uses of its lane's host (:class:`~runtime._rooms._lane.LaneHost`)."""

    @property
    def clocks(self) -> Clocks: ...
    @property
    def stall(self) -> float: ...
    @property
    def abort_grace(self) -> float:
        """Seconds (Trio time) the worker has to settle after the backstop's abort (L20)."""
        ...

    @property
    def tool_lease_max(self) -> float:
        """The longest tool lease; a ``bash`` call with no timeout gets it (L20)."""
        ...

    @property
    def tick(self) -> float: ...
    @property
    def typing_refresh(self) -> float: ...
    @property
    def emit(self) -> Callable[[RoomEvent], None]: ...


class WorkerWedged(Exception):
    """The stalled turn's worker did not settle (L20): no ``agent_settled`` within
    ``abort_grace`` of the backstop's abort, or it died after the stall. The lane fences the
    epoch, then ends the turn with :attr:`end` — never a replay."""

    def __init__(self, end: TurnEnd) -> None:
        super().__init__("the stalled turn's worker did not settle after its abort")
        self.end = end


class Turn:
    """The events of one turn: typing, tool activity, the stall backstop, the outcome.

    ``outside`` is a nursery that outlives the turn (the lane's): the backstop's abort runs
    there, so the turn can end while that command is still unanswered (L20)."""

    def __init__(
        self,
        host: TurnHost,
        room: str,
        pending: Pending,
        rpc: RpcChannel,
        log: Log,
        *,
        outside: trio.Nursery,
    ) -> None:
        self.room = room
        self.outside = outside
        self.pending = pending
        self.rpc = rpc
        self.log = log
        self.steer_lock = trio.Lock()
        self.steerable = False
        """Steers are taken from the prompt's acceptance until ``agent_settled``."""
        self.host = host
        self.watch = StallWatch(limit=self.host.stall)
        self.messages: list[dict[str, Any]] = []
        self.partial = ""
        self.typing = trio.Event()
        self._started = 0.0
        """When :meth:`run` began (Trio time): the turn metrics count from here."""
        self._first_token = False
        self.stalled = False
        """The backstop fired: the turn is ``turn_stalled`` whatever the worker does next."""
        self._abort_scopes: list[trio.CancelScope] = []
        """One scope per abort sent (L13, L20): a turn can abort twice — cancelled while its
        worker launched, then stalled — and a Trio scope may be entered only once."""
        self._aborts_dropped = False
        """The turn ended: an abort not yet begun is dropped at once."""
        self.replay_upto = -1
        """The last step the journal answers (a replay asks them again first): a steer never
        seen before the crash is sent again only once that step is answered (L10)."""
        self._asked_upto = -1
        """The highest step whose request :meth:`on_request` saw in this attempt."""
        self.answered_upto: Callable[[], int] = lambda: -1
        """The last step the journal answers now (the lane's step journal): read when a
        request first carries a steer, to know what a replay must ask before re-sending it."""

    def _now(self) -> float:
        return self.host.clocks.silence.read().boottime

    async def run(self) -> TurnEnd:
        rpc = self.rpc
        self._started = trio.current_time()
        self._first_token = False
        self.watch.event(self._now())
        for item in self.pending.absorbed:
            item.sent = item.held = False
        died: RpcError | None = None
        settled = False
        try:
            async with trio.open_nursery() as nursery:
                # L20: the backstop watches from the prompt on, so a worker that never
                # answers the prompt is fenced like one that goes silent after it
                nursery.start_soon(self._backstop, nursery.cancel_scope)
                nursery.start_soon(self._keep_typing)
                try:
                    await rpc.prompt(self.pending.admission.rendered_prompt)
                    if self.pending.cancelled:
                        # cancelled before its worker was live (launching, or before the
                        # prompt): no abort could be sent then, so the turn sends it now
                        nursery.start_soon(self._abort)
                    async with self.steer_lock:
                        self.steerable = True
                        for item in self.pending.absorbed:
                            if self._send_after_prompt(item):
                                await self.send_steer(item)
                    async for event in rpc:
                        self.watch.event(self._now())
                        if self._see(event):
                            settled = True
                            TURN_SECONDS.observe(trio.current_time() - self._started)
                            break
                except RpcError as error:  # raised here, not from the nursery: no group
                    died = error
                nursery.cancel_scope.cancel()
        finally:
            self._drop_aborts()  # an abort still unanswered is dropped, not awaited
        if self.stalled and not settled:
            # L20: the worker did not settle after the stall (presumed wedged once the grace
            # ran out, or dead): the lane fences its epoch and the turn ends as the stall
            # decided — never replayed as a worker death (L9) would be
            self.steerable = False
            raise WorkerWedged(self._stalled_end())
        if died is not None:
            raise died
        async with self.steer_lock:  # a steer being sent finishes first
            self.steerable = False
            if any(item.first_step is None and item.sent for item in self.pending.absorbed):
                # steered too late for any model request: the worker still queues it, and
                # it runs as its own turn (L10) — take it back so it is not carried twice
                with contextlib.suppress(RpcError):
                    await rpc.clear_queue()
        end = classify_turn(self.messages)
        if self.stalled and end.outcome is not Outcome.REPLY:
            # L20: the stall decided the outcome; only a complete reply the worker settled
            # with before the abort landed is kept — not a silence, an empty answer or a
            # provider's failure (which could park the turn and so run it again, PB1)
            return self._stalled_end()
        if end.outcome is Outcome.CANCELLED and not self.pending.cancelled:
            code = ReasonCode.TURN_STALLED if self.stalled else ReasonCode.RESPONSE_MISSING
            return TurnEnd(outcome=Outcome.FAILED, code=code)
        if self.pending.cancelled and end.outcome is not Outcome.REPLY:
            return TurnEnd(outcome=Outcome.CANCELLED, text=None, code=None)
        if end.outcome is Outcome.SILENT and self.typing.is_set():
            # L12: the room was shown typing — words that could no longer be the marker (a
            # tool round's preamble) — so the turn has spoken: it cannot end in silence
            return TurnEnd(outcome=Outcome.FAILED, code=ReasonCode.SILENCE_AFTER_TYPING)
        return end

    def _stalled_end(self) -> TurnEnd:
        """How a stalled turn whose worker never settled ends: ``cancelled`` when it was
        cancelled (L13), else ``failed turn_stalled``."""
        if self.pending.cancelled:
            return TurnEnd(outcome=Outcome.CANCELLED, text=None, code=None)
        return TurnEnd(outcome=Outcome.FAILED, code=ReasonCode.TURN_STALLED)

    def _send_after_prompt(self, item: Absorbed) -> bool:
        """Whether ``item`` is sent right after the prompt: never seen and no replay, or seen
        at a step no answered step precedes (L10, L26) — so the first request carries it, as
        it did the first time (a retried request that took it is a step of its own, the failed
        one's step never answered)."""
        if item.first_step is None:
            return self.replay_upto < 0
        return item.after < 0

    @property
    def caught_up(self) -> bool:
        """Whether a steer may be sent now: no replay, or the replay has reached its last
        answered step. Below it, a steer would change the next replayed request, which the
        journal then no longer answers (G13, ``recovery_refused:replay``): it is held, and
        :meth:`on_request` sends it at that step (L10)."""
        return self._asked_upto >= self.replay_upto

    async def send_steer(self, item: Absorbed) -> None:
        """Steer ``item`` into this run; a dead worker is noticed by the turn itself."""
        item.sent = True
        with contextlib.suppress(RpcError):
            await self.rpc.steer(item.text)

    async def on_request(self, body: dict[str, Any], step: int, replayed: bool) -> None:
        """Before each model request is answered: a steer first carried here is recorded as
        seen at ``step`` (L10, L24), after the last step the journal answered before it; on a
        replay, a steer seen after this step — no answered step between — is sent again now,
        so the next request is the same as the first time (docs/design/recovery.md, L26).
        ``body`` is read, never changed."""
        self._asked_upto = max(self._asked_upto, step)  # (a steer arriving now may be sent)
        if replayed:  # the journal's request here is this one: it holds what it carried
            for item in self.pending.absorbed:
                if item.first_step is not None and item.first_step <= step:
                    item.held = True
        for item in self._carried(body, step):
            item.held = True
            if item.first_step == step:  # the same request asked again (its answer was lost)
                continue
            answered = self.answered_upto()
            item.first_step = step
            item.after = answered if answered < step else step - 1
            await self.log.append(
                AbsorbedInput(delivery_id=item.pending.delivery_id, text=item.text, first_step=step)
            )
        if not replayed:
            await self._left_behind()
            return
        for item in self.pending.absorbed:
            if item.sent:
                continue
            if (item.first_step is not None and item.after == step) or (
                item.first_step is None and step >= self.replay_upto
            ):  # seen right after this answered step, or never seen: after the last one
                await self.send_steer(item)

    async def _left_behind(self) -> None:
        """L26: a request the journal does not answer, asked while a steer seen before is not
        held by this attempt's run — the replay could not ask again the request that carried
        it (Pi's retry took it, pi-observed §12; the failed request is asked instead): that
        request is answered without it, so its recorded step holds no more. It is not seen
        (recorded so, for a restart) and sent now if it was not: a later request that carries
        it records it there, else it runs as its own turn — never ``absorbed`` into an
        answer whose model did not see it."""
        for item in self.pending.absorbed:
            if item.first_step is None or item.held:
                continue
            item.first_step, item.after = None, -1
            await self.log.append(
                AbsorbedInput(delivery_id=item.pending.delivery_id, text=item.text, first_step=None)
            )
            if not item.sent:
                await self.send_steer(item)

    def _carried(self, body: dict[str, Any], step: int) -> list[Absorbed]:
        """The steers this request is the first to carry (L24): each one sent to this attempt's
        worker and not yet held by its run (L26) whose text is a whole user message *new* in
        it — one of the user messages after its last other message (the worker adds a burst's
        steers right before it asks), and at step 0 only those after the turn's own prompt. The
        room's history may hold the same text (the same chat message delivered again, or
        quoted): that is no proof the model saw this steer. Same texts are counted, not merged."""
        waiting = [i for i in self.pending.absorbed if not i.held and i.sent]
        if not waiting:
            return []
        new = _trailing_user_texts(body)
        if step == 0:
            new = _after_prompt(
                new, self.pending.admission.rendered_prompt, Counter(i.text for i in waiting)
            )
        left = Counter(new)
        carried: list[Absorbed] = []
        for item in waiting:  # in the order they were sent: the worker adds them so
            if left[item.text] > 0:
                left[item.text] -= 1
                carried.append(item)
        return carried

    def _see(self, event: Event) -> bool:
        """Handle one event; True at ``agent_settled``."""
        record = event.record
        kind = event.type
        if kind == "agent_settled":
            self.steerable = False
            return True
        if kind == "message_end":
            message = record.get("message")
            if isinstance(message, dict) and message.get("role") in ("assistant", "toolResult"):
                self.messages.append(message)
            self.partial = ""
        elif kind == "message_update":
            delta = record.get("assistantMessageEvent") or {}
            if delta.get("type") == "text_delta":
                if not self._first_token:
                    self._first_token = True
                    FIRST_TOKEN_SECONDS.observe(trio.current_time() - self._started)
                self.partial += str(delta.get("delta", ""))
                if not self.typing.is_set() and not could_still_be_silent(self.partial):
                    self.typing.set()
        elif kind in ("tool_execution_start", "tool_execution_end"):
            call_id = str(record.get("toolCallId", ""))
            tool = str(record.get("toolName", ""))
            phase: Literal["start", "end"] = "start" if kind == "tool_execution_start" else "end"
            if phase == "start":
                lease = _lease_seconds(tool, record, cap=self.host.tool_lease_max)
                self.watch.lease(call_id, self._now() + lease)
            else:
                self.watch.release(call_id, self._now())
            self.host.emit(
                ToolActivity(
                    room=self.room,
                    delivery_id=self.pending.delivery_id,
                    tool=tool,
                    phase=phase,
                )
            )
        return False

    async def _backstop(self, events: trio.CancelScope) -> None:
        """The stall backstop (L7, L20). Once the turn stalled it is ``turn_stalled``; the abort
        is sent from the lane's nursery, and if ``agent_settled`` (which cancels this task)
        has not come ``abort_grace`` seconds later, the worker is presumed wedged: the turn's
        events (``events``) are cancelled and :meth:`run` raises :class:`WorkerWedged`.

        The grace is Trio time, the host's awake time: a suspended host gives the worker no
        chance to settle, so it is not counted against it (the silence before the stall is)."""
        await watch_turn(self.watch, self.host.clocks.silence, tick=self.host.tick)
        self.stalled = True
        self.outside.start_soon(self._abort)
        await trio.sleep(self.host.abort_grace)
        events.cancel()  # no agent_settled: presumed wedged

    async def _abort(self) -> None:
        """``abort``, dropped when the turn ends first; a broken channel is the turn's to see.

        Each call gets a scope of its own, kept until the turn ends: the turn's own abort (a
        cancel that came while the worker launched, L13) may still be unanswered when the
        backstop sends its own (L20), and re-entering one scope would raise in the lane's
        nursery — the host's."""
        scope = trio.CancelScope()
        self._abort_scopes.append(scope)
        if self._aborts_dropped:  # started after the turn ended: nothing to send
            scope.cancel()
        with scope, contextlib.suppress(RpcError):
            await self.rpc.abort()

    def _drop_aborts(self) -> None:
        """The turn ended: every abort still unanswered is dropped, and any started later."""
        self._aborts_dropped = True
        for scope in self._abort_scopes:
            scope.cancel()
        self._abort_scopes.clear()

    async def _keep_typing(self) -> None:
        await self.typing.wait()
        while True:
            self.host.emit(Typing(room=self.room, delivery_id=self.pending.delivery_id))
            await trio.sleep(self.host.typing_refresh)


def _trailing_user_texts(body: Mapping[str, Any]) -> list[str]:
    """The text of each user message after the last message of another role in an OpenAI
    chat request, in order: what the worker added since its last answer (L24)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    texts: list[str] = []
    for message in reversed(messages):
        if not isinstance(message, dict) or message.get("role") != "user":
            break
        texts.append(_message_text(message))
    texts.reverse()
    return texts


def _message_text(message: Mapping[str, Any]) -> str:
    """One message's text, whole: its string content, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return ""


def _after_prompt(texts: list[str], prompt: str, steers: Counter[str]) -> list[str]:
    """At step 0: the user messages after the turn's own ``prompt`` — its first occurrence
    in ``texts`` that only steers still waiting (``steers``) follow, so an earlier message
    with the same text (a turn that ended without an answer leaves its prompt there) is
    history, and so is a steer with the prompt's own text that no request carried yet.
    ``texts`` whole when the prompt is not there as expected."""
    for index, text in enumerate(texts):
        after = texts[index + 1 :]
        if text == prompt and not Counter(after) - steers:
            return after
    return texts


def _lease_seconds(tool: str, record: dict[str, Any], *, cap: float) -> float:
    """A gated tool's lease: its own timeout when it names one, a ``bash`` call without one
    ``cap``, any other tool none — never more than ``cap`` (L20): the model chooses the
    timeout, so an uncapped one could hold the backstop off for ever."""
    args = record.get("args") or {}
    timeout = args.get("timeout") if isinstance(args, dict) else None
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0:
        return min(float(timeout), cap)
    return cap if tool == "bash" else 0.0
