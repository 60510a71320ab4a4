"""A dead worker's dangling tool calls, answered before a relaunch (S12, S13): which calls
Pi's context still holds without a result (:func:`dangling_tool_calls`), the results appended
for them (:func:`settle_dangling`), and the repair of a torn tail first
(:func:`prepare_for_relaunch`). Also the texts the model gets for an interrupted call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import trio

from .._clock import WallClock
from .._errors import ReasonCode, SessionError
from ._session import Session, SessionEntry, StrPath, encode_entry
from ._session_files import (
    ClockReading,
    SessionWriter,
    open_session_writer,
    read_session,
    truncate_torn_tail,
)

__all__ = [
    "DanglingCall",
    "RelaunchReport",
    "Results",
    "SettledResult",
    "aprepare_for_relaunch",
    "asettle_dangling",
    "dangling_tool_calls",
    "interrupted_text",
    "not_started_text",
    "possibly_ran_result",
    "prepare_for_relaunch",
    "settle_dangling",
]

# ------------------------------------------------------------ dangling tool calls (S12, S13)
# Pi answers a tool call only by running it. A worker killed mid-tool leaves the assistant's
# toolCall blocks without a toolResult (pi-observed.md §8); each later request then carries Pi's
# synthetic "No result provided" for them, in the request only. Before a relaunch the runtime
# writes a real answer instead. Which calls count mirrors Pi's own request building:
# ``buildSessionProjection`` (session-manager.js), ``convertToLlm`` (messages.js) and
# ``transformMessages`` (pi-ai transform-messages.js); ``fake_pi/_messages.py`` mirrors them too.


_DROPPED_STOP_REASONS: Final = frozenset({"aborted", "error"})
"""Pi leaves assistant messages that stopped so out of the model context, calls and all."""


_USER_SIDE_ROLES: Final = frozenset(
    {"user", "bashExecution", "custom", "branchSummary", "compactionSummary"}
)
"""Roles Pi sends as a user message; one after the calls closes them ("No result provided")."""


_EDITABLE_ROLES: Final = frozenset({"user", "assistant", "toolResult", "custom"})
"""Roles whose content a ``context_edit`` replacement replaces."""


@dataclass(frozen=True, slots=True)
class DanglingCall:
    """A toolCall block of the last assistant message in context, without a toolResult (S12).

    ``arguments`` is the block's arguments object (``{}`` if it has none); do not mutate it.
    """

    tool_call_id: str
    name: str
    arguments: dict[str, Any] = field(hash=False)
    assistant_entry_id: str


class SettledResult(NamedTuple):
    """The answer to one dangling call: the toolResult's ``content`` blocks (Pi's shape,
    e.g. ``[{"type": "text", "text": …}]``) and its ``isError``."""

    content: list[dict[str, Any]]
    is_error: bool


Results = Mapping[str, SettledResult] | Callable[[DanglingCall], SettledResult]
"""Answers by tool-call id, or a function from the call to its answer."""


@dataclass(frozen=True, slots=True)
class RelaunchReport:
    """What :func:`prepare_for_relaunch` did: ``torn_bytes`` cut from a torn tail (S6), the
    ``settled`` calls in source order and the toolResult ``entries`` written for them (S13);
    ``session`` is the file as it now stands."""

    torn_bytes: int
    settled: tuple[DanglingCall, ...]
    entries: tuple[SessionEntry, ...]
    session: Session = field(compare=False, repr=False)


def interrupted_text(name: str) -> str:
    """What the model gets for a never-replay tool whose intent has no outcome (gate.md T5)."""
    return f"tool {name} was interrupted and possibly ran; inspect before repeating"


def not_started_text(name: str) -> str:
    """What the model gets for a call the worker died holding before the gate let it run."""
    return f"tool {name} was interrupted before it started; it did not run"


def possibly_ran_result(name: str) -> SettledResult:
    """The standard answer for a call that may have run: :func:`interrupted_text`, as an
    error."""
    return SettledResult([{"type": "text", "text": interrupted_text(name)}], is_error=True)


def _context_entries(path: tuple[SessionEntry, ...]) -> list[SessionEntry]:
    """Pi's ``buildContextEntries``: the path; or, after a ``compaction``, the newest one,
    then the entries from its ``firstKeptEntryId`` up to it (no system messages), then the
    entries after it."""
    latest = max((i for i, e in enumerate(path) if e.type == "compaction"), default=-1)
    if latest < 0:
        return list(path)
    first_kept = path[latest].raw.get("firstKeptEntryId")
    kept: list[SessionEntry] = []
    found = False
    for entry in path[:latest]:
        found = found or entry.id == first_kept
        if found and not (entry.type == "message" and entry.role == "system"):
            kept.append(entry)
    return [path[latest], *kept, *path[latest + 1 :]]


def _entry_messages(entry: SessionEntry) -> list[dict[str, Any]]:
    """Pi's ``sessionEntryToContextMessages``, with only the fields that S12 reads."""
    raw = entry.raw
    if entry.type == "message":
        message = raw.get("message")
        return [message] if isinstance(message, dict) else []
    if entry.type == "custom_message":
        return [{"role": "custom", "content": raw.get("content") or []}]
    if entry.type == "branch_summary" and raw.get("summary"):
        return [{"role": "branchSummary"}]
    if entry.type == "compaction":
        system = raw.get("systemMessage")
        return [*([system] if isinstance(system, dict) else []), {"role": "compactionSummary"}]
    return []


def _projected(entry: SessionEntry, edit: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Pi's ``projectContextEntry``: the entry's newest ``context_edit`` hides its messages
    (``replacement: null``) or replaces their content."""
    messages = _entry_messages(entry)
    if edit is None:
        return messages
    replacement = edit.get("replacement")
    if not isinstance(replacement, dict):
        return []
    out = []
    for message in messages:
        role, content = message.get("role"), replacement.get("content")
        if role in ("assistant", "toolResult") and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        out.append({**message, "content": content} if role in _EDITABLE_ROLES else message)
    return out


def _context(session: Session) -> list[tuple[SessionEntry, dict[str, Any]]]:
    """The messages Pi builds its next request from, each with its source entry."""
    entries = _context_entries(session.path_to_root())
    edits = {e.raw.get("targetId"): e.raw for e in entries if e.type == "context_edit"}
    return [
        (entry, message)
        for index, entry in enumerate(entries)
        if not (index > 0 and entry.type == "compaction")
        for message in _projected(entry, edits.get(entry.id))
    ]


def _sent_as_user(message: Mapping[str, Any]) -> bool:
    """Pi's ``convertToLlm`` turns ``message`` into a user message."""
    role = message.get("role")
    if role == "bashExecution":
        return not message.get("excludeFromContext")
    return isinstance(role, str) and role in _USER_SIDE_ROLES


def _tool_calls(entry_id: str, assistant: Mapping[str, Any]) -> list[DanglingCall]:
    """The assistant's toolCall blocks that carry a string id, in source order."""
    content = assistant.get("content")
    calls = []
    for block in content if isinstance(content, list) else ():
        if not isinstance(block, dict) or block.get("type") != "toolCall":
            continue
        call_id, name, arguments = block.get("id"), block.get("name"), block.get("arguments")
        if isinstance(call_id, str):
            calls.append(
                DanglingCall(
                    tool_call_id=call_id,
                    name=name if isinstance(name, str) else "",
                    arguments=arguments if isinstance(arguments, dict) else {},
                    assistant_entry_id=entry_id,
                )
            )
    return calls


def dangling_tool_calls(session: Session) -> tuple[DanglingCall, ...]:
    """The tool calls Pi would answer with "No result provided" in its next request (S12).

    These are the toolCall blocks of the last assistant message in context on the path
    root→leaf that no toolResult after it answers, in the assistant's source order. There
    are none when that message stopped ``aborted`` or ``error`` (Pi leaves it out of the
    context, and closes any earlier calls there), or when a message Pi sends as a user
    message (user, bashExecution, custom_message, branch_summary, compaction summary)
    follows it: Pi already answered the calls before it, and a result below it would
    answer nothing. ``context_edit`` and ``compaction`` entries apply as Pi applies them.
    """
    context = _context(session)
    roles = [message.get("role") for _, message in context]
    last = max((i for i, role in enumerate(roles) if role == "assistant"), default=-1)
    if last < 0:
        return ()
    entry, assistant = context[last]
    stop = assistant.get("stopReason")
    if isinstance(stop, str) and stop in _DROPPED_STOP_REASONS:
        return ()
    answered: set[str] = set()
    for _, message in context[last + 1 :]:
        if _sent_as_user(message):
            return ()
        if message.get("role") == "toolResult" and isinstance(message.get("toolCallId"), str):
            answered.add(message["toolCallId"])
    return tuple(c for c in _tool_calls(entry.id, assistant) if c.tool_call_id not in answered)


def _result_for(call: DanglingCall, results: Results) -> SettledResult:
    """``call``'s answer from ``results``; ``SESSION_ENTRY_INVALID`` if there is none or
    it is not (a list of content blocks, a bool)."""
    invalid = ReasonCode.SESSION_ENTRY_INVALID
    if isinstance(results, Mapping):
        if call.tool_call_id not in results:
            raise SessionError(invalid, f"no result for dangling call {call.tool_call_id!r}")
        content, is_error = results[call.tool_call_id]
    else:
        content, is_error = results(call)
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise SessionError(invalid, f"result content for {call.tool_call_id!r} is not blocks")
    if not isinstance(is_error, bool):
        raise SessionError(invalid, f"result is_error for {call.tool_call_id!r} is not a bool")
    return SettledResult(content, is_error)


def _tool_result(call: DanglingCall, result: SettledResult) -> dict[str, Any]:
    """Pi's toolResult message for ``call``, keys in Pi's order (``timestamp`` is added on
    append); ``SESSION_ENTRY_INVALID`` if Pi could not write it (S2)."""
    message = {
        "role": "toolResult",
        "toolCallId": call.tool_call_id,
        "toolName": call.name,
        "content": result.content,
        "isError": result.is_error,
    }
    try:
        encode_entry(message)
    except (TypeError, ValueError) as exc:
        raise SessionError(ReasonCode.SESSION_ENTRY_INVALID, str(exc)) from exc
    return message


def _plan(
    session: Session, results: Results
) -> tuple[tuple[DanglingCall, ...], tuple[dict[str, Any], ...]]:
    """The dangling calls and their toolResult messages, all checked before anything is
    written (pure apart from calling ``results``)."""
    calls = dangling_tool_calls(session)
    return calls, tuple(_tool_result(call, _result_for(call, results)) for call in calls)


def _append_results(
    writer: SessionWriter, messages: Iterable[Mapping[str, Any]], *, fsync: bool
) -> tuple[SessionEntry, ...]:
    """Append each message at the leaf, then fsync once if anything was written (or if
    ``fsync`` says always)."""
    entries = tuple(writer.append_message(message) for message in messages)
    if entries or fsync:
        writer.fsync()
    return entries


def _cut_torn_tail(path: StrPath) -> int:
    """:func:`truncate_torn_tail`, but only on a readable version-3 session file
    (``SESSION_MISSING``, ``SESSION_HEADER_INVALID`` otherwise)."""
    return truncate_torn_tail(path) if read_session(path).torn_tail is not None else 0


def settle_dangling(
    path: StrPath, results: Results, *, clock: WallClock
) -> tuple[SessionEntry, ...]:
    """Answer the session's dangling calls (S12) with toolResult entries (S13).

    One toolResult message per dangling call, in source order, each the child of the one
    before (plain leaf appends through a :class:`SessionWriter`), then one fsync; returns
    the new entries. No dangling calls: writes nothing. Every result is looked up and
    checked before the first write (``SESSION_ENTRY_INVALID``). Refused like any append:
    ``SESSION_TORN_TAIL`` on a torn tail, ``SESSION_CHANGED`` if the file changes behind
    the writer (the worker is not dead). Call it only while no worker can write the file.
    """
    with SessionWriter.open(path, clock=clock) as writer:
        _, messages = _plan(writer.session, results)
        return _append_results(writer, messages, fsync=False)


def prepare_for_relaunch(path: StrPath, results: Results, *, clock: WallClock) -> RelaunchReport:
    """What the runtime does to a session whose worker is proven dead, before relaunching.

    Cuts a torn tail (S6), settles the dangling calls as :func:`settle_dangling` does and
    fsyncs the file, also when nothing was cut or settled, so that the dead worker's own
    unsynced appends are durable too (S13). Raises as those do.
    """
    cut = _cut_torn_tail(path)
    with SessionWriter.open(path, clock=clock) as writer:
        calls, messages = _plan(writer.session, results)
        entries = _append_results(writer, messages, fsync=True)
        return RelaunchReport(cut, calls, entries, writer.session)


async def asettle_dangling(
    path: StrPath, results: Results, *, clock: WallClock
) -> tuple[SessionEntry, ...]:
    """:func:`settle_dangling` with its I/O in worker threads; ``results`` is called, and
    the clock read once, on the Trio thread."""
    async with open_session_writer(path, clock=ClockReading(clock.time_ms())) as writer:
        _, messages = _plan(writer.session, results)
        append = functools.partial(_append_results, writer, messages, fsync=False)
        return await trio.to_thread.run_sync(append)


async def aprepare_for_relaunch(
    path: StrPath, results: Results, *, clock: WallClock
) -> RelaunchReport:
    """:func:`prepare_for_relaunch` with its I/O in worker threads; ``results`` is called,
    and the clock read once, on the Trio thread."""
    reading = ClockReading(clock.time_ms())
    cut = await trio.to_thread.run_sync(_cut_torn_tail, path)
    async with open_session_writer(path, clock=reading) as writer:
        calls, messages = _plan(writer.session, results)
        append = functools.partial(_append_results, writer, messages, fsync=True)
        entries = await trio.to_thread.run_sync(append)
        return RelaunchReport(cut, calls, entries, writer.session)
