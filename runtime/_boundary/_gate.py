"""The tool gate: before a worker's tool starts, the runtime decides; after it, the outcome.

Boundary 3 of docs/design/boundaries.md The worker (the real Pi through
``runtime/_boundary/pi_extension/gate.ts``,
Fake-Pi through ``fake_pi/_gate_client.py``) asks over a Unix socket (mode 0600, in the
runtime directory) with small JSON bodies over HTTP/1.1:

* ``POST /before {tool_call_id, name, args, follows?}`` →
  ``{"decision":"run","intent_id":…}`` |
  ``{"decision":"saved","result":{content,details?,isError}}`` |
  ``{"decision":"refused","result":{content,isError:true}}``
* ``POST /after {tool_call_id, name, result:{content,details?,isError}}`` → ``{"ok":true}``

Only requests carrying the current epoch's secret (``authorization: Bearer <secret>``) are
served; anything else gets 401 and reaches no journal (T1). A ``/before`` whose epoch was
fenced while it waited for its turn is refused the same way, nothing decided (T16). A
``/before`` whose ``follows`` (the call the worker ran and reported last) was let run in the
current epoch without a recorded outcome lets nothing run: that report failed (T21). Bodies
are read as the gateway reads them (``_pijson.loads``): a lone surrogate in a call's arguments
is an argument like any other, recorded as its ``\\udxxx`` escape (T22). What to
answer is decided by a :class:`GateJournal`; :class:`RecordingGateJournal` is the
implementation, on a delivery's :class:`~runtime._journal._journal.Journal` or (for tests) on a
:class:`MemoryLog`. It makes the :class:`~runtime._records.ToolIntent` durable before it
answers *run* (T2), answers *saved* from a recorded :class:`~runtime._records.ToolOutcome` for
the same tool-call id within the round (T3), *refused* for tools not granted (T4), classifies
tools by replay class (T5), and refuses a replayed call that is not the recorded one — another
name or other arguments under a recorded tool-call id (T14). The invariants are in
``docs/design/gate.md``.

Resource handling: :func:`serve_gate` owns the listening socket and removes the socket file
when it ends. Error handling: a journal failure is answered with 503 (the worker's tool fails
closed, it does not run) and then raised from :func:`serve_gate` as itself.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import socket as stdlib_socket
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import msgspec
import trio

from .._errors import GateError, PiRuntimeError, ReasonCode
from .._metrics import TOOL_CALLS, labelled
from .._pi._pijson import loads, nesting
from .._pi._session_settle import interrupted_text, not_started_text
from .._records import AttachmentRef, Header, Record, ReplayClass, ToolIntent, ToolOutcome
from ._calls import Decision, GateCall, GateResult, Refuse, RuntimeTool, RunTool, Saved
from ._http import ARRIVAL_SECONDS, Request, ResponseWriter, _serve_connection, refusal_text
from ._receipts import RECEIPT_OPERATIONS
from ._tools import RUNTIME_TOOLS

__all__ = [
    "ARGS_MAX_DEPTH",
    "EXTENSION_PATH",
    "GATE_SECRET_ENV",
    "GATE_SOCKET_ENV",
    "PI_TOOL_CLASSES",
    "Gate",
    "GateJournal",
    "GateServer",
    "MemoryLog",
    "RecordingGateJournal",
    "canonical_args",
    "gate_environment",
    "replay_class_of",
    "serve_gate",
]

GATE_SOCKET_ENV: Final = "PI_RUNTIME_GATE_SOCKET"
"""The worker's environment variable naming the gate's Unix socket."""
GATE_SECRET_ENV: Final = "PI_RUNTIME_GATE_SECRET"
"""The worker's environment variable holding the epoch's gate secret. The extension (and
Fake-Pi) remove it from the process environment at load, so no tool ever sees it (T6)."""
EXTENSION_PATH: Final = Path(__file__).resolve().parent / "pi_extension" / "gate.ts"
"""The Pi extension to load with ``-ne -e``."""
PI_TOOL_CLASSES: Final[Mapping[str, ReplayClass]] = {
    "read": ReplayClass.SAFE,
    "bash": ReplayClass.NEVER,
    "write": ReplayClass.NEVER,
    "edit": ReplayClass.NEVER,
}
"""Declared replay classes of Pi's gated tools; any other tool is ``never``
(docs/design/gate.md)."""
ARGS_MAX_DEPTH: Final = 256
"""How deeply a call's arguments may nest (levels of objects and arrays, the arguments object
itself the first): a deeper call is refused and never runs (T17). Far above what a tool's
schema asks for, and far below where msgspec and the stdlib stop recursing (about a thousand
levels), so everything the runtime derives from a call it lets run reads and writes as usual."""

_json = msgspec.json.Encoder()
_SURROGATE: Final = re.compile("[\ud800-\udfff]")
_ESCAPED_SURROGATE: Final = re.compile(rb"\\u[dD][89a-fA-F]")
"""Where a body may hold a surrogate: JSON writes one only as such an escape (T22)."""


# ------------------------------------------------------------------------------- the data


def canonical_args(args: Mapping[str, Any]) -> str:
    """The arguments as canonical JSON (sorted keys, compact): what a ToolIntent stores.

    A lone surrogate (JavaScript writes one as ``\\ud83d``, T22) is written as that escape,
    so the text is one the journal records and :func:`~runtime._pi._pijson.loads` reads back
    as the same arguments; arguments without one are written as msgspec writes them."""
    try:
        return msgspec.json.encode(dict(args), order="sorted").decode()
    except UnicodeEncodeError:  # T22: a surrogate, which UTF-8 (and msgspec) cannot hold
        return _canonical_text(dict(args))


def _canonical_text(value: Any) -> str:
    """:func:`canonical_args` of a value holding surrogates: the same text msgspec writes for
    the rest (keys sorted by code point, as msgspec sorts them), every string holding a
    surrogate written as JavaScript writes it. Called only below :data:`ARGS_MAX_DEPTH`."""
    if isinstance(value, str):
        return _js_string(value)
    if isinstance(value, Mapping):
        items = (f"{_js_string(k)}:{_canonical_text(value[k])}" for k in sorted(value))
        return "{" + ",".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_canonical_text(item) for item in value) + "]"
    return msgspec.json.encode(value).decode()


def _js_string(text: str) -> str:
    """A JSON string as ``JSON.stringify`` writes it: a valid surrogate pair joined into its
    character, a lone surrogate as its ``\\udxxx`` escape (T22)."""
    joined = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    if _SURROGATE.search(joined) is None:
        return msgspec.json.encode(joined).decode()
    rendered = json.dumps(joined, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", rendered)


def replay_class_of(
    name: str,
    declared: Mapping[str, ReplayClass] = PI_TOOL_CLASSES,
    recorded: ReplayClass | None = None,
) -> ReplayClass:
    """A tool's replay class: its declared class (unknown → ``never``); the stricter of that
    and ``recorded`` when an intent already recorded one (T5)."""
    cls = declared.get(name, ReplayClass.NEVER)
    if cls is ReplayClass.RECEIPT and name not in RECEIPT_OPERATIONS:
        cls = ReplayClass.NEVER  # only the registry's operations have a receipt (R7)
    return cls if recorded is None else ReplayClass.stricter(cls, recorded)


# ---------------------------------------------------------------------------- the journal


class GateJournal(Protocol):
    """What the gate server asks. Both calls return only once what they record is durable.

    ``decide`` asks ``authorized`` once the call's turn has come — after its last wait, before
    anything is decided or recorded — and raises :class:`~runtime._errors.GateError`
    ``gate_unauthorized`` if it says no: the epoch the call was authorized in was fenced
    while it waited (T16). ``record_outcome`` records an outcome authorized before the fence
    all the same: the call ran, that is its result (T16). ``follows`` names the call whose
    outcome the worker reported last (T21): while the journal let it run in the current epoch
    and holds no outcome for it, ``decide`` lets nothing run."""

    async def decide(
        self, call: GateCall, *, authorized: Callable[[], bool], follows: str | None = None
    ) -> Decision: ...

    async def record_outcome(self, call: GateCall, result: GateResult) -> None: ...


class AppendLog(Protocol):
    """The part of :class:`~runtime._journal._journal.Journal` the gate needs."""

    @property
    def next_seq(self) -> int: ...

    async def append(self, record: Record) -> int: ...


@dataclass
class MemoryLog:
    """An in-memory :class:`AppendLog` for tests. ``on_append`` runs inside each append,
    before it returns (a test can hold an append there and look at the world)."""

    records: list[Record] = field(default_factory=list)
    """Sequence ``i + 1`` is ``records[i]`` (seq 0 is a real log's header)."""
    on_append: Callable[[Record], Awaitable[None]] | None = None

    def __post_init__(self) -> None:
        self._next = len(self.records) + 1

    @property
    def next_seq(self) -> int:
        return self._next

    async def append(self, record: Record) -> int:
        seq = self._next
        self._next += 1
        if self.on_append is not None:
            await self.on_append(record)
        await trio.lowlevel.checkpoint()
        self.records.append(record)
        return seq


class RecordingGateJournal:
    """The :class:`GateJournal` of one delivery: ToolIntent / ToolOutcome records in its log.

    ``log`` is the delivery's :class:`~runtime._journal._journal.Journal` (or a :class:`MemoryLog`);
    ``existing`` the records it held when opened (``journal.contents.records``), from which
    recorded outcomes are answered. ``key`` is the delivery key, so intent ids are
    ``<key>:<made>:<seq>`` with ``made`` the log header's ``created_ms`` (``<key>:<seq>`` when
    ``existing`` holds no header) and ``seq`` the intent's own sequence number in the log.
    ``granted`` names the tools this lane may run; ``classes`` their declared replay classes
    (the runtime tools' own classes are added). ``runtime_tools`` are the handlers of the
    granted runtime tools (``runtime/_boundary/_tools.py``): the gate runs them itself and
    answers *saved* (T10).
    ``step`` returns the current round (the model step whose response carried the calls); the
    lane wires it to the gateway's step, tests may leave it at 0. Set :attr:`epoch` per epoch.

    A call whose ``(step, tool_call_id)`` has a recorded intent of another name or other
    arguments is refused (T14): nothing runs, nothing is recorded, :attr:`mismatch` keeps the
    first such refusal. ``on_mismatch`` is for journals whose delivery replays as a whole (room
    lanes): it is told of the first mismatch, and from then on every call is refused.
    """

    def __init__(
        self,
        log: AppendLog,
        *,
        key: str,
        epoch: int,
        granted: Collection[str],
        classes: Mapping[str, ReplayClass] = PI_TOOL_CLASSES,
        existing: Iterable[Record] = (),
        step: Callable[[], int] = lambda: 0,
        runtime_tools: Mapping[str, RuntimeTool] | None = None,
        on_mismatch: Callable[[GateError], None] | None = None,
    ) -> None:
        self._log = log
        self.key = key
        self.epoch = epoch
        self.granted = frozenset(granted)
        self.runtime_tools = dict(runtime_tools or {})
        if missing := sorted((self.granted & RUNTIME_TOOLS.keys()) - self.runtime_tools.keys()):
            raise ValueError(f"runtime tools granted without a handler: {', '.join(missing)}")
        self.classes = {n: s.replay_class for n, s in RUNTIME_TOOLS.items()} | dict(classes)
        self._step = step
        self._intents: dict[tuple[int, str], ToolIntent] = {}
        self._outcomes: dict[str, ToolOutcome] = {}
        self._running: dict[str, ToolIntent] = {}
        """Intents answered *run* in this process, by tool-call id, awaiting their outcome."""
        self._settled: dict[str, trio.Event] = {}
        """Per running tool-call id: set once its outcome is durable (the gateway waits, T11)."""
        self._let_run_in: dict[str, int] = {}
        """Per running tool-call id: the epoch it was let run in (asked again there: refused)."""
        self._lock = trio.Lock()
        self._on_mismatch = on_mismatch
        self.mismatch: GateError | None = None
        """The first replayed call refused for not being the recorded one (T14)."""
        self._minted = key
        """What this log's intent ids begin with (T2, receipts R1): the key and, when
        ``existing`` holds the log's header, the time the log was made — so a log made again
        under the same key (a delivery or task id let go after ``forget_days`` and used
        again) never mints an intent id, a receipt's key, that the one before it minted."""
        for record in existing:
            if isinstance(record, Header):
                self._minted = f"{key}:{record.created_ms}"
            self._learn(record)

    def _learn(self, record: Record) -> None:
        if isinstance(record, ToolIntent):
            self._intents[(record.step, record.tool_call_id)] = record
        elif isinstance(record, ToolOutcome):
            self._outcomes[record.intent_id] = record

    async def _append(self, record: Record) -> int:
        try:
            seq = await self._log.append(record)
        except PiRuntimeError:
            raise
        except OSError as error:
            raise GateError(ReasonCode.GATE_JOURNAL_FAILED, f"cannot append: {error}") from error
        self._learn(record)
        return seq

    async def decide(
        self,
        call: GateCall,
        *,
        authorized: Callable[[], bool] = lambda: True,
        follows: str | None = None,
    ) -> Decision:
        """What to answer ``call``: *run* (its intent durable first), *saved* or *refused*.
        ``authorized`` says whether the epoch the call was authorized in is still the current
        one; it is asked under the lock, before anything is decided, and a call it refuses
        raises :class:`GateError` ``gate_unauthorized``, nothing recorded (T16). ``follows``
        is the tool-call id of the call the worker ran and reported last: while that call,
        let run here in the current epoch, has no recorded outcome (its report failed), a
        call that would run is refused, nothing recorded (T21)."""
        decision = await self._decide(call, authorized, follows)
        handler = self.runtime_tools.get(call.name)
        if handler is None or not isinstance(decision, RunTool):
            return decision
        result = await self._run_runtime_tool(handler, call, decision.intent_id)  # T10
        return Saved(await self._record_ran(call, decision.intent_id, result))

    async def _record_ran(self, call: GateCall, intent_id: str, result: GateResult) -> GateResult:
        """Record ``result`` as the outcome of the runtime tool this gate ran for ``intent_id``
        and return the call's answer. T13: a receipt write re-run for a new epoch while an
        earlier epoch's run of it is still under way here is the same guarded write twice (the
        store serialises them: one applies, the other replays its receipt); whichever ends
        second finds the outcome recorded and answers that, never an error for a write that
        applied."""
        async with self._lock:
            outcome = self._outcomes.get(intent_id)
            if outcome is not None:
                return GateResult.recorded(outcome)
            return await self._record_settled(self._let_run_intent(call), call, result)

    async def _run_runtime_tool(
        self, handler: RuntimeTool, call: GateCall, intent_id: str
    ) -> GateResult:
        try:
            return await handler(call, intent_id)
        except PiRuntimeError:
            raise
        except Exception as error:  # the tool failed: the model is told, the call settles
            code = ReasonCode.GATE_TOOL_FAILED
            return GateResult.text(f"tool {call.name} failed ({code}): {error}", is_error=True)

    async def _decide(
        self, call: GateCall, authorized: Callable[[], bool], follows: str | None
    ) -> Decision:
        async with self._lock:  # one decision at a time: seq and intent id stay paired
            if not authorized():  # T16: its epoch was fenced while it waited for its turn
                raise GateError(
                    ReasonCode.GATE_UNAUTHORIZED,
                    "this request's epoch ended while it waited: its secret is no longer "
                    "the current one",
                )
            # T16: a decision is its epoch's to the end, whatever begins during its appends
            epoch, step = self.epoch, self._step()
            if call.name not in self.granted:  # T4: nothing recorded, nothing runs
                return Refuse(
                    GateResult.text(
                        f"tool {call.name} is not granted here ({ReasonCode.GATE_TOOL_REFUSED})",
                        is_error=True,
                    )
                )
            if (depth := nesting(call.args)) > ARGS_MAX_DEPTH:  # T17: nothing recorded
                return Refuse(_too_deep_result(call, depth))
            previous = self._intents.get((step, call.tool_call_id))
            if self.mismatch is not None and self._on_mismatch is not None:
                return Refuse(_mismatch_result(call, self.mismatch))  # T14: the delivery failed
            if previous is not None and not _same_call(previous, call):
                return Refuse(_mismatch_result(call, self._mismatched(previous, call)))  # T14
            declared = replay_class_of(call.name, self.classes)
            if previous is not None:
                outcome = self._outcomes.get(previous.intent_id)
                if outcome is not None:  # T3: the recorded result, verbatim
                    return Saved(GateResult.recorded(outcome))
                if self._running.get(call.tool_call_id) is previous and (
                    self._let_run_in.get(call.tool_call_id) == epoch
                ):  # T15: asked again while it runs: its own outcome is still to come
                    return Refuse(_running_result(call, previous))
                cls = replay_class_of(call.name, self.classes, previous.replay_class)
                if cls is ReplayClass.RECEIPT and call.name in self.runtime_tools:
                    if (unreported := self._unreported(follows, epoch)) is not None:  # T21
                        return Refuse(_unreported_result(call, unreported))
                    # T13: the same receipt-guarded write proves or applies it (R2)
                    self._let_run(call.tool_call_id, previous, epoch)
                    return RunTool(previous.intent_id)
                if cls is not ReplayClass.SAFE:  # T5: possibly ran; never run it again
                    return Saved(await self._record_interrupted(previous, call))
                declared = cls
            if (unreported := self._unreported(follows, epoch)) is not None:  # T21
                return Refuse(_unreported_result(call, unreported))  # nothing recorded
            intent_id = f"{self._minted}:{self._log.next_seq}"
            intent = ToolIntent(
                intent_id=intent_id,
                step=step,
                tool_call_id=call.tool_call_id,
                name=call.name,
                args=canonical_args(call.args),
                replay_class=declared,
                epoch=epoch,
            )
            seq = await self._append(intent)  # T2: durable before "run" is answered
            labelled(TOOL_CALLS, call.name, str(declared)).inc()
            if f"{self._minted}:{seq}" != intent_id:  # pragma: no cover - a second appender raced
                raise GateError(
                    ReasonCode.GATE_JOURNAL_FAILED,
                    f"intent {intent_id} landed at seq {seq}: another task appended meanwhile",
                )
            self._let_run(call.tool_call_id, intent, epoch)
            return RunTool(intent_id)

    def _unreported(self, follows: str | None, epoch: int) -> ToolIntent | None:
        """The intent of ``follows`` — the call the worker ran and reported last, before it
        asked this one (it asks only once that report was answered, T18) — if this journal
        let it run in ``epoch`` and holds no outcome for it: its report failed, and the
        outcome the next intent must follow is missing (T21). ``None`` for a call this journal
        did not let run (another delivery's) or let run in an earlier epoch (a dead
        worker's), and for a runtime tool (its outcome is the gate's own, T10)."""
        if follows is None or (intent := self._running.get(follows)) is None:
            return None
        if self._let_run_in.get(follows) != epoch or intent.name in self.runtime_tools:
            return None
        return intent

    def _let_run(self, tool_call_id: str, intent: ToolIntent, epoch: int) -> None:
        """Note that ``intent`` was answered *run* in ``epoch``, its outcome to come. A call
        let run again (T5 ``safe``, T13) keeps the event of its earlier run, if that run never
        settled: a model request already waiting on it (T11) is released by this run's
        outcome, never left waiting on an event nothing sets (T20)."""
        self._running[tool_call_id] = intent
        self._settled.setdefault(tool_call_id, trio.Event())
        self._let_run_in[tool_call_id] = epoch

    async def record_outcome(self, call: GateCall, result: GateResult) -> None:
        """Record the outcome the worker reports for a call it was answered *run* for. One
        that names another tool than the running call's, or a runtime tool (whose outcome is
        its handler's, T10), is not that call's outcome: refused (``gate_bad_request``, 409),
        nothing recorded (T19)."""
        async with self._lock:
            intent = self._let_run_intent(call)
            if intent.name != call.name:  # T19: not the running call's outcome
                why = f"the gate let it run as {intent.name}"
            elif intent.name in self.runtime_tools:  # T19: its outcome is its handler's (T10)
                why = "a runtime tool, which the runtime runs and reports itself"
            else:
                await self._record_settled(intent, call, result)
                return
            raise GateError(
                ReasonCode.GATE_BAD_REQUEST,
                f"an outcome for {call.tool_call_id!r} as {call.name}: {why}",
            )

    def _let_run_intent(self, call: GateCall) -> ToolIntent:
        """The intent ``call`` was let run under, awaiting its outcome (lock held)."""
        intent = self._running.get(call.tool_call_id)
        if intent is None:
            raise GateError(
                ReasonCode.GATE_BAD_REQUEST,
                f"an outcome for {call.tool_call_id!r}, which the gate did not let run",
            )
        return intent

    async def settle(self, call: GateCall) -> GateResult:
        """The result for a call the dead worker's session left without one (T12): the
        recorded outcome; for an intent without outcome "possibly ran", recorded so every
        later answer is the same; for a call the gate never let run, "did not run"."""
        async with self._lock:
            intent = self._settled_intent(call.tool_call_id)
            if intent is None:
                return GateResult.text(not_started_text(call.name), is_error=True)
            if intent.name != call.name:  # T14; the session holds the arguments before Pi
                # coerced them, the intent after: only the name can be compared here
                return _mismatch_result(call, self._mismatched(intent, call), settling=True)
            outcome = self._outcomes.get(intent.intent_id)
            if outcome is not None:
                return GateResult.recorded(outcome)
            cls = replay_class_of(call.name, self.classes, intent.replay_class)
            handler = self.runtime_tools.get(call.name)
            if cls is ReplayClass.RECEIPT and handler is not None:  # T13
                # the write the intent recorded: the session holds the arguments before Pi
                # coerced them (T14), and only the recorded ones are this intent's write
                recorded = GateCall(call.tool_call_id, call.name, loads(intent.args.encode()))
                result = await self._run_runtime_tool(handler, recorded, intent.intent_id)
                return await self._record_settled(intent, call, result)
            return await self._record_interrupted(intent, call)

    def _settled_intent(self, tool_call_id: str) -> ToolIntent | None:
        """The intent a dangling call of the dead worker's session stands for (T12): the
        current round's; else the latest earlier round's — Pi's session is not synced and the
        journal is, so after a power loss the session may lack a round's tool results that
        the journal, already a round further, holds. Only while the gate has seen no call of
        the current round: a call id is one round's, and a round the gate has seen calls of
        is the one the session's dangling calls belong to."""
        step = self._step()
        found = self._intents.get((step, tool_call_id))
        if found is not None or any(s == step for s, _ in self._intents):
            return found
        earlier = [k for k in self._intents if k[1] == tool_call_id and k[0] < step]
        return self._intents[max(earlier)] if earlier else None

    def _mismatched(self, intent: ToolIntent, call: GateCall) -> GateError:
        """Note that ``call`` is not the call ``intent`` recorded under its id (T14)."""
        asked = f"as {call.name}" if intent.name != call.name else "with other arguments"
        error = GateError(
            ReasonCode.GATE_REPLAY_MISMATCH,
            f"call {call.tool_call_id!r} of round {intent.step} is recorded as a "
            f"{intent.name} call ({intent.intent_id}) and was asked again {asked}: "
            "this is not the recorded turn",
        )
        if self.mismatch is None:
            self.mismatch = error
            if self._on_mismatch is not None:
                self._on_mismatch(error)
        return error

    async def _record_interrupted(self, intent: ToolIntent, call: GateCall) -> GateResult:
        """Record and return "possibly ran" as the outcome of ``intent`` (lock held)."""
        result = GateResult.text(interrupted_text(call.name), is_error=True)
        return await self._record_settled(intent, call, result)

    async def _record_settled(
        self, intent: ToolIntent, call: GateCall, result: GateResult
    ) -> GateResult:
        """Record ``result`` as the outcome of ``intent``, settling it (lock held)."""
        await self._append(
            ToolOutcome(
                intent_id=intent.intent_id,
                tool_call_id=call.tool_call_id,
                content=result.content,
                is_error=result.is_error,
                details=result.details,
                attachments=list(result.attachments),
            )
        )
        if self._running.get(call.tool_call_id) is intent:
            del self._running[call.tool_call_id]
            del self._let_run_in[call.tool_call_id]
            self._settled.pop(call.tool_call_id).set()
        return result

    def release(self) -> None:
        """The delivery ended: forget its intents and outcomes and refuse every tool from
        now on (an idle lane keeps no turn in memory). A model request still held for an
        outcome (T11) is released: the gateway refuses it, its delivery ended (G14, T20). A
        late report is still answered (it lands in the throwaway log); one that comes after
        the next delivery is attached is refused there (409) and fails none of its calls (T21:
        that journal never let the call run)."""
        self._log = MemoryLog()
        self.granted = frozenset()
        self._intents.clear()
        self._outcomes.clear()
        for event in self._settled.values():  # T20: nothing will be recorded for them here
            event.set()

    async def wait_outcomes(self, tool_call_ids: Iterable[str]) -> None:
        """Return once no call among ``tool_call_ids`` that was let run is still without a
        durable outcome (T11: the gateway holds a model request carrying such a result)."""
        for call_id in tool_call_ids:
            event = self._settled.get(call_id)
            if event is not None:
                await event.wait()
        await trio.lowlevel.checkpoint()

    def in_flight(self) -> list[ToolIntent]:
        """Intents let run in this process whose outcome is not recorded yet."""
        return list(self._running.values())

    def unsettled(self) -> list[ToolIntent]:
        """Every known intent (recorded before or by this object) without an outcome."""
        return [i for i in self._intents.values() if i.intent_id not in self._outcomes]

    def outcomes(self) -> list[ToolOutcome]:
        """Every outcome known (recorded before or by this object)."""
        return list(self._outcomes.values())

    def attachments(self) -> list[AttachmentRef]:
        """The files the delivery's recorded outcomes attached, in the order they were
        recorded, each file once (A4): what its reply carries."""
        seen: dict[str, AttachmentRef] = {}
        for outcome in self._outcomes.values():
            if not outcome.is_error:
                for ref in outcome.attachments:
                    seen.setdefault(ref.sha256, ref)
        return list(seen.values())


def _same_call(intent: ToolIntent, call: GateCall) -> bool:
    """Whether ``call`` is the call ``intent`` recorded: the same name and canonical
    arguments (T14; the round and tool-call id are the key it was found by)."""
    return intent.name == call.name and intent.args == canonical_args(call.args)


def _too_deep_result(call: GateCall, depth: int) -> GateResult:
    """The error result of a call whose arguments nest deeper than :data:`ARGS_MAX_DEPTH`
    (T17): refused, it did not run."""
    return GateResult.text(
        f"tool {call.name} was refused and did not run: its arguments nest {depth} levels "
        f"deep, more than the {ARGS_MAX_DEPTH} the runtime accepts; send them less deeply "
        f"nested ({ReasonCode.GATE_BAD_REQUEST})",
        is_error=True,
    )


def _running_result(call: GateCall, intent: ToolIntent) -> GateResult:
    """The error result of a call asked again while it runs in this epoch (T15): not run
    again, and not settled either — its own outcome is still to come."""
    return GateResult.text(
        f"tool {call.name} was refused and did not run again: call {call.tool_call_id!r} is "
        f"already running ({intent.intent_id}); its result comes when it ends "
        f"({ReasonCode.GATE_BAD_REQUEST})",
        is_error=True,
    )


def _unreported_result(call: GateCall, unreported: ToolIntent) -> GateResult:
    """The error result of a call refused because an earlier call of its delivery and epoch
    has no recorded outcome (T21): its report failed, so no later call runs after it."""
    return GateResult.text(
        f"tool {call.name} was refused and did not run: the outcome of the earlier call "
        f"{unreported.tool_call_id!r} ({unreported.name}, {unreported.intent_id}) was not "
        f"recorded (its report failed), so no later call of this delivery runs in this epoch "
        f"({ReasonCode.GATE_BAD_REQUEST})",
        is_error=True,
    )


def _mismatch_result(call: GateCall, error: GateError, *, settling: bool = False) -> GateResult:
    """The error result of a call refused for a mismatch (T14). Settling a dead worker's call,
    the runtime cannot say the call did not run (no intent of it is known), only that the
    recorded result is not its own."""
    if settling:
        return GateResult.text(
            f"tool {call.name}: {error.message}; its result is unknown, inspect before "
            f"repeating ({error.code})",
            is_error=True,
        )
    return GateResult.text(
        f"tool {call.name} was refused and did not run: {error.message} ({error.code})",
        is_error=True,
    )


# ------------------------------------------------------------------------------ the server


def _error_body(code: ReasonCode, message: str) -> bytes:
    return _json.encode({"error": {"code": str(code), "message": message}})


def _refused(status: int) -> bytes:
    """The body of a request refused before the gate saw it whole (malformed, too large, not
    whole in time, without the secret: B8)."""
    if status == 401:
        return _error_body(
            ReasonCode.GATE_UNAUTHORIZED, "this request does not carry the current secret"
        )
    return _error_body(ReasonCode.GATE_BAD_REQUEST, refusal_text(status))


class Gate:
    """The HTTP handler of the gate for one lane; the secret rotates per epoch."""

    def __init__(self, journal: GateJournal, *, secret: str | None = None) -> None:
        self.journal = journal
        self._secret = secret or secrets.token_urlsafe(32)
        self._failure: PiRuntimeError | None = None
        self._failed = trio.Event()
        self.refused_unauthorized = 0

    @property
    def secret(self) -> str:
        """The current epoch's secret; give it to the worker (environment), never to disk."""
        return self._secret

    def rotate_secret(self) -> str:
        """A fresh secret for a new epoch; the old one stops working at once."""
        self._secret = secrets.token_urlsafe(32)
        return self._secret

    def _authorized(self, request: Request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            token.strip().encode(), self._secret.encode()
        )

    def authorize(self, head: Request) -> bool:
        """Whether a request may go on, by its head alone (T1, B8): asked as soon as the head
        has arrived, so that one without the secret is answered 401 before its body is read.
        :meth:`handle` asks again once it is whole (T16: a fence may come in between)."""
        if self._authorized(head):
            return True
        self.refused_unauthorized += 1
        return False

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        if not self._authorized(request):  # T1, T16: the secret rotated while the body came
            self.refused_unauthorized += 1
            await response.respond(401, _refused(401), close=True)  # B8: no idle connection
            return
        target = request.target.split("?", 1)[0]
        if request.method != "POST" or target not in ("/before", "/after"):
            await response.respond(
                404, _error_body(ReasonCode.GATE_BAD_REQUEST, "only POST /before and /after")
            )
            return
        try:
            call, result, follows = _parse(request.body, with_result=target == "/after")
        except ValueError as error:
            await response.respond(400, _error_body(ReasonCode.GATE_BAD_REQUEST, str(error)))
            return
        secret = self._secret  # T16: its epoch's, asked again when its turn comes
        try:
            if result is None:
                decision = await self.journal.decide(
                    call, authorized=lambda: secret == self._secret, follows=follows
                )
                answer = _decision_json(decision)
            else:  # T16: authorized before any fence, the outcome of a call that ran
                await self.journal.record_outcome(call, result)
                answer = {"ok": True}
        except GateError as error:
            if error.code is ReasonCode.GATE_UNAUTHORIZED:  # T16: fenced while it waited
                self.refused_unauthorized += 1
                await response.respond(401, _error_body(error.code, error.message))
                return
            if error.code is ReasonCode.GATE_BAD_REQUEST:
                await response.respond(409, _error_body(error.code, error.message))
                return
            await self._fail_and_answer(error, response)
            return
        except PiRuntimeError as error:  # journal failures: the tool fails closed
            await self._fail_and_answer(error, response)
            return
        await response.respond(200, _json.encode(answer))

    async def _fail_and_answer(self, error: PiRuntimeError, response: ResponseWriter) -> None:
        if self._failure is None:
            self._failure = error
        try:  # answer first (the tool fails closed), then stop serving
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await response.respond(503, _error_body(error.code, error.message))
        finally:
            self._failed.set()

    @property
    def failure(self) -> PiRuntimeError | None:
        """The journal failure that stopped this gate, set the moment it happened."""
        return self._failure

    async def wait_failed(self) -> PiRuntimeError:
        await self._failed.wait()
        assert self._failure is not None
        return self._failure


def _parse(body: bytes, *, with_result: bool) -> tuple[GateCall, GateResult | None, str | None]:
    try:  # as the gateway reads a body (G1): however deep (T17), lone surrogates too (T22)
        data = loads(body)
    except msgspec.DecodeError as error:
        raise ValueError(f"the body is not JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object")
    call_id, name = data.get("tool_call_id"), data.get("name")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise ValueError("tool_call_id and name must be non-empty strings")
    lone = _ESCAPED_SURROGATE.search(body) is not None  # else no string holds a surrogate
    if lone and _SURROGATE.search(call_id + name):  # T22: no record can hold them
        raise ValueError("tool_call_id and name must not hold a lone surrogate")
    if with_result:
        if nesting(data) > ARGS_MAX_DEPTH + 1:  # T17: none kept that deep
            raise ValueError(f"the body nests deeper than the gate reads ({ARGS_MAX_DEPTH} levels)")
        result = GateResult.from_json(data.get("result"))
        if lone and not _recordable(result):  # T22: what a ToolOutcome cannot hold
            raise ValueError("the result holds a lone surrogate, which the journal cannot record")
        return GateCall(call_id, name, {}), result, None
    args = data.get("args", {})
    if not isinstance(args, dict):
        raise ValueError("args must be an object")
    follows = data.get("follows")  # T21: the call the worker ran and reported last
    if follows is not None and (not isinstance(follows, str) or not follows):
        raise ValueError("follows must be a non-empty string")
    if nesting({k: v for k, v in data.items() if k != "args"}) > ARGS_MAX_DEPTH + 1:
        raise ValueError("the body nests deeper than the gate reads, outside its arguments")
    return GateCall(call_id, name, args), None, follows


def _recordable(result: GateResult) -> bool:
    """Whether a ToolOutcome of ``result`` can be encoded (no lone surrogate in it, T22)."""
    try:
        _json.encode([result.content, result.details])
    except UnicodeEncodeError:
        return False
    return True


def _decision_json(decision: Decision) -> dict[str, Any]:
    if isinstance(decision, RunTool):
        return {"decision": "run", "intent_id": decision.intent_id}
    if isinstance(decision, Saved):
        return {"decision": "saved", "result": decision.result.to_json()}
    refused = decision.result.to_json()
    refused["isError"] = True
    return {"decision": "refused", "result": refused}


@dataclass(frozen=True, slots=True)
class GateServer:
    path: Path
    """The Unix socket (mode 0600)."""


def gate_environment(server: GateServer, gate: Gate) -> dict[str, str]:
    """The worker's ``extra_env`` for the gate (the secret only ever travels here)."""
    return {GATE_SOCKET_ENV: str(server.path), GATE_SECRET_ENV: gate.secret}


async def serve_gate(
    gate: Gate,
    path: Path,
    *,
    arrival_seconds: float = ARRIVAL_SECONDS,
    task_status: trio.TaskStatus[GateServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``gate`` on a Unix socket at ``path`` (mode 0600) until cancelled.

    A request gets ``arrival_seconds`` from its first byte to its last (and a new connection
    as long for its first byte); longer, it is answered 408 and its connection closed (B8).

    ``path``'s directory should be private (``runtime._journal._store.runtime_dir``); a path is at
    most 107 bytes. The socket is chmod-ed before ``listen``, so no connection can arrive
    while it is wider. The socket file is removed when serving ends. Raises the journal's
    error if recording failed (after answering the worker 503).
    """
    if len(os.fsencode(path)) > 107:
        raise GateError(ReasonCode.GATE_BAD_REQUEST, f"socket path too long: {path}")
    raw = stdlib_socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    sock = trio.socket.from_stdlib_socket(raw)
    failure: PiRuntimeError | None = None
    held: int | None = None
    """The socket file, held open (``O_PATH``) until this gate has ended (T1): its inode
    cannot be freed, so a successor's socket file at the same path never gets its number —
    the listener closes before this gate ends, and a successor bound then took the freed
    number, which this gate took for its own file and removed."""
    try:
        # the old file's removal, the bind and the hold in one go on the Trio thread (Trio's
        # own bind of a Unix socket runs in a worker thread, with other tasks in between)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raw.bind(str(path))
        held = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        os.chmod(path, 0o600)
        sock.listen(64)
        listener = trio.SocketListener(sock)
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def serve(stream: trio.SocketStream) -> None:
                    await _serve_connection(
                        stream,
                        gate.handle,
                        refusal=_refused,
                        arrival_seconds=arrival_seconds,
                        authorize=gate.authorize,  # B8: the secret before the body
                    )

                nursery.start_soon(
                    functools.partial(
                        trio.serve_listeners, serve, [listener], handler_nursery=nursery
                    )
                )
                task_status.started(GateServer(path=path))
                failure = await gate.wait_failed()
                scope.cancel()
    finally:
        sock.close()
        # its own socket file only: a successor may have been bound at the same path
        # (a one-shot slot's next gate) before this one finished ending
        if held is not None:
            try:
                if _same_file(held, path):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            finally:
                os.close(held)
    if failure is not None:
        raise failure


def _same_file(held: int, path: Path) -> bool:
    """Whether ``path`` names the file ``held`` is open on."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(held)
    return (found.st_dev, found.st_ino) == (mine.st_dev, mine.st_ino)
