"""A task lane's session work beside :func:`~runtime._boundary._boundaries.settle_session`: the
answers a crashed host left wrong (TL7), the continuation marker (TL5), the size a probe compares
(WD1).

Each takes the session's path and does its file work off the Trio thread or through
``trio.Path``; none keeps anything open.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from .._boundary._calls import GateCall
from .._boundary._gate import RecordingGateJournal
from .._clock import WallClock
from .._errors import PiRuntimeError, ReasonCode, descriptors_exhausted
from .._pi._session import SessionEntry
from .._pi._session_files import SessionWriter, afsync_session, aread_session, atruncate_torn_tail
from ._state import continuation_marker

__all__ = ["marker_in_session", "prompt_in_session", "reanswer_orphaned", "session_size"]


async def reanswer_orphaned(
    session: Path, tools: RecordingGateJournal, *, step: int, clock: WallClock
) -> None:
    """Before the session is settled (TL4, TL7): a call the gate let run in round ``step``
    whose outcome it never recorded may be answered in the session by what the worker wrote
    on its own once its host was gone ("request to the gate failed", "Operation aborted") —
    not what happened. That round is answered again from the gate (the recorded outcome,
    "possibly ran" or the receipt's result), as a branch at its assistant message: the next
    epoch's context follows what the runtime knows."""
    unsettled = {i.tool_call_id for i in tools.unsettled() if i.step == step}
    if not unsettled:
        return
    await atruncate_torn_tail(session)
    path = (await aread_session(session)).session.path_to_root()
    messages = [e.raw.get("message") if e.type == "message" else None for e in path]
    for index in range(len(path) - 1, -1, -1):
        message = messages[index]
        content = message.get("content") if isinstance(message, dict) else None
        calls = [
            b for b in (content if isinstance(content, list) else ())
            if isinstance(b, dict) and b.get("type") == "toolCall"
            and isinstance(b.get("id"), str)
        ]  # fmt: skip
        if {b["id"] for b in calls} & unsettled:
            break
    else:
        return
    answered = {
        m.get("toolCallId")
        for m in messages[index + 1 :]
        if isinstance(m, dict) and m.get("role") == "toolResult"
    }
    if not answered & unsettled:
        return  # dangling, not answered: settle_session answers it
    results = []
    for block in calls:
        args = block.get("arguments")
        args = args if isinstance(args, dict) else {}
        call = GateCall(block["id"], str(block.get("name")), args)
        result = await tools.settle(call)
        results.append(
            {"role": "toolResult", "toolCallId": call.tool_call_id, "toolName": call.name,
             "content": result.content, "isError": result.is_error}
        )  # fmt: skip

    def branch() -> None:
        with SessionWriter.open(session, clock=clock) as writer:
            parent = path[index].id
            for result in results:
                parent = writer.append_message(result, parent_id=parent).id
            writer.fsync()

    await trio.to_thread.run_sync(branch)


async def marker_in_session(session: Path, action_id: str, *, wants: bool = False) -> bool | None:
    """Whether prompt ``action_id`` (a continuation or a reply) is in the session as Pi
    loads it (TL5, LK8): the prompt itself — a user message whose text begins with its
    marker — inside an entry Pi reads. A malformed or torn line, which Pi skips, does not
    count, nor does the marker's text quoted anywhere else (a tool's result that read a
    file holding it, the model's own words): that is not the prompt, and the worker was
    never sent it. ``None`` when the session cannot be read: nobody knows whether the
    worker has it, and the caller holds (``prompt_marker_unknown``) rather than guess.
    ``wants``: a want of file descriptors is raised instead (the caller waits it out, L21)."""
    marker = continuation_marker(action_id)
    needle = json.dumps(marker)[1:-1].encode()

    def found(entry: SessionEntry) -> bool:
        return needle in entry.raw_line and _prompt_begins(entry.raw, marker)

    return await _in_session(session, found, wants=wants)


async def prompt_in_session(session: Path, *, wants: bool = False) -> bool | None:
    """Whether any prompt is in the session as Pi loads it — a user message in an entry Pi
    reads (TL5): the task's, the first a worker of the lane is sent, or a later one that
    carried it. A worker that was sent the task and died before Pi wrote it there never kept
    it. ``None`` when the session cannot say; ``wants`` as for :func:`marker_in_session`."""
    return await _in_session(session, lambda entry: _user_message(entry.raw), wants=wants)


async def _in_session(
    session: Path, found: Callable[[SessionEntry], bool], *, wants: bool
) -> bool | None:
    """Whether an entry Pi loads from ``session`` is ``found``; what it finds it makes
    durable first (S15: the caller acts on it, and Pi appends without a sync)."""
    try:
        read = await aread_session(session)
    except PiRuntimeError as error:
        return False if error.code == ReasonCode.SESSION_MISSING else None
    except OSError as error:
        if wants and descriptors_exhausted(error):
            raise
        return None
    if not any(found(entry) for entry in read.session.by_id.values()):
        return False
    try:
        await afsync_session(session)
    except OSError as error:
        if wants and descriptors_exhausted(error):
            raise
        return None
    return True


def _user_message(entry: Mapping[str, Any]) -> bool:
    message = entry.get("message") if entry.get("type") == "message" else None
    return isinstance(message, dict) and message.get("role") == "user"


def _prompt_begins(entry: Mapping[str, Any], marker: str) -> bool:
    """``entry`` is a user message (a prompt) whose text begins with ``marker``."""
    message = entry.get("message") if entry.get("type") == "message" else None
    if not isinstance(message, dict) or message.get("role") != "user":
        return False
    content = message.get("content")
    if isinstance(content, str):
        return content.startswith(marker)
    blocks = content if isinstance(content, list) else ()
    return any(
        isinstance(b, dict) and b.get("type") == "text" and str(b.get("text")).startswith(marker)
        for b in blocks
    )


async def session_size(session: Path) -> int:
    """The session file's size in bytes, -1 when it does not exist."""
    try:
        return (await trio.Path(session).stat()).st_size
    except FileNotFoundError:
        return -1
