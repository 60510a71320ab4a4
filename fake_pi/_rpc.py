"""Pi's RPC protocol over any pair of byte streams (stdin/stdout, or in memory).

Commands are JSON objects, one per LF-terminated line (split on ``\\n`` only,
never on U+2028/2029); responses echo ``id`` in Pi's ``{type: "response",
command, success, data | error}`` shape; events are interleaved on the same
stream. A bad line gets Pi's parse error (a blank one too), an unknown command — or a
JSON value that is not an object — Pi's ``Unknown command: …``, and a ``prompt``, ``steer`` or
``follow_up`` whose ``message`` is not a string the ``TypeError`` text Pi 1.6.0 answers
(docs/design/pi-observed.md §6). A line nested deeper than the decoder follows is answered as
a value that is no command, and the next line is served (F1). When the input ends while a run
is in flight, the run is aborted the way Pi aborts it on stdin EOF (persisted, not printed).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import msgspec
import trio

from ._agent import Agent

__all__ = ["read_lines", "serve_rpc"]

_MAX_LINE: Final = 64 * 1024 * 1024
BUSY: Final = (
    "Agent is already processing. Specify streamingBehavior ('steer' or 'followUp') "
    "to queue the message."
)
_encode = msgspec.json.Encoder()


async def read_lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[bytes]:
    """LF-terminated lines from a byte stream (a final unterminated line too)."""
    buffer = bytearray()
    while True:
        data = await stream.receive_some(65536)
        if not data:
            if buffer:
                yield bytes(buffer)
            return
        buffer += data
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            yield line
        if len(buffer) > _MAX_LINE:
            raise ValueError("an input line exceeds 64 MiB")


_LITERALS: Final = {"t": "true", "f": "false", "n": "null"}
_CONTEXT: Final = 10  # V8's kMaxContextCharacters


def js_parse_error(text: str) -> str:
    """What Node's ``JSON.parse`` says about ``text`` (its common cases), as Pi reports it.

    V8 names the first character that cannot continue a JSON value; a source of
    21 characters or more is shown as a window of 10 characters either side.
    Other errors (bad strings or numbers inside a value) get a generic text.
    """
    pos = len(text) - len(text.lstrip())
    if pos == len(text):
        return "Unexpected end of JSON input"
    literal = _LITERALS.get(text[pos])
    if literal is not None:
        matched = 0
        while (
            matched < len(literal) and text[pos + matched : pos + matched + 1] == literal[matched]
        ):
            matched += 1
        if matched == len(literal):
            return f"Unexpected non-whitespace character after JSON at position {pos + matched}"
        pos += matched
        if pos >= len(text):
            return "Unexpected end of JSON input"
    elif text[pos] in '{["-0123456789':
        return f"Unexpected token in JSON at position {pos}"
    token = text[pos]
    if len(text) < 2 * _CONTEXT + 1:
        return f"Unexpected token '{token}', \"{text}\" is not valid JSON"
    start, end = max(0, pos - _CONTEXT), min(len(text), pos + _CONTEXT)
    before = "..." if start > 0 else ""
    after = "..." if end < len(text) else ""
    return f"Unexpected token '{token}', {before}\"{text[start:end]}\"{after} is not valid JSON"


def _response(
    command: str, cmd_id: Any, *, data: Any = None, error: str | None = None
) -> dict[str, Any]:
    response: dict[str, Any] = {}
    if cmd_id is not None:
        response["id"] = cmd_id
    response.update(type="response", command=command, success=error is None)
    if error is not None:
        response["error"] = error
    elif data is not None:
        response["data"] = data
    return response


async def serve_rpc(
    agent: Agent,
    lines: AsyncIterator[bytes],
    send: Callable[[dict[str, Any]], Awaitable[None]],
    *,
    on_line: Callable[[bytes], None] | None = None,
) -> None:
    """Answer commands from ``lines`` until they end; ``send`` writes one object."""
    async with trio.open_nursery() as nursery:
        agent.attach(nursery)
        async for line in lines:
            if on_line is not None:
                on_line(line)
            await _dispatch(agent, line, send, nursery)
        await agent.shutdown()
        nursery.cancel_scope.cancel()


async def _dispatch(
    agent: Agent,
    line: bytes,
    send: Callable[[dict[str, Any]], Awaitable[None]],
    nursery: trio.Nursery,
) -> None:
    try:
        command = msgspec.json.decode(line)
    except msgspec.DecodeError:
        error = f"Failed to parse command: {js_parse_error(line.decode(errors='replace'))}"
        await send(_response("parse", None, error=error))
        return
    except RecursionError:
        # nested past the decoder (Node's ``JSON.parse`` has no such limit): answered as Pi
        # answers such a line that holds no command — a deep array, or an object without
        # ``type`` (F1; a command with a deep field Pi would run is not emulated)
        command = None
    if not isinstance(command, dict):  # Pi reads its ``type`` as undefined (null: Pi exits)
        await send({"type": "response", "success": False, "error": "Unknown command: undefined"})
        return
    kind = command.get("type")
    cmd_id = command.get("id")
    handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
    if handler is None:
        await send(_response(str(kind), cmd_id, error=f"Unknown command: {kind}"))
        return

    async def run() -> None:
        try:
            data = await handler(agent, command)
        except _Refused as exc:
            await send(_response(str(kind), cmd_id, error=str(exc)))
        else:
            await send(_response(str(kind), cmd_id, data=data))

    if kind in _BACKGROUND:
        nursery.start_soon(run)
    else:
        await run()


class _Refused(Exception):
    pass


async def _prompt(agent: Agent, command: dict[str, Any]) -> Any:
    # the ``prompt:N`` barrier: ``hang`` there is a worker that never answers its prompt
    await agent.options.barriers.reach("prompt")
    text = _message(command)
    behaviour = command.get("streamingBehavior")
    if agent.running:
        if behaviour not in ("steer", "followUp"):
            raise _Refused(BUSY)
        await agent.queue(text, behaviour)
        return {"disposition": "queued"}
    agent.start_prompt(text)
    return {"disposition": "started"}


def _message(command: dict[str, Any]) -> str:
    """A command's ``message``. Pi 1.6.0 calls ``text.startsWith`` on it before anything else,
    so one that is not a string is answered with that ``TypeError``'s text."""
    text = command.get("message")
    if isinstance(text, str):
        return text
    if text is None:
        which = "null" if "message" in command else "undefined"
        raise _Refused(f"Cannot read properties of {which} (reading 'startsWith')")
    raise _Refused("text.startsWith is not a function")


async def _steer(agent: Agent, command: dict[str, Any]) -> Any:
    await agent.queue(_message(command), "steer")
    return {"disposition": "queued"}


async def _follow_up(agent: Agent, command: dict[str, Any]) -> Any:
    await agent.queue(_message(command), "followUp")
    return {"disposition": "queued"}


async def _abort(agent: Agent, command: dict[str, Any]) -> Any:
    # the ``abort:N`` barrier: ``hang`` there is a wedged worker, one that neither aborts nor
    # answers (its run goes on); a shutdown's abort (stdin closed, SIGTERM) passes no barrier
    await agent.options.barriers.reach("abort")
    await agent.abort()
    return None


async def _clear_queue(agent: Agent, command: dict[str, Any]) -> Any:
    return await agent.clear_queue()


async def _get_state(agent: Agent, command: dict[str, Any]) -> Any:
    return agent.state()


async def _get_messages(agent: Agent, command: dict[str, Any]) -> Any:
    return {"messages": agent.conversation.context()}


async def _get_entries(agent: Agent, command: dict[str, Any]) -> Any:
    entries = agent.conversation.entries()
    since = command.get("since")
    if since is not None:
        ids = [e.get("id") for e in entries]
        if since not in ids:
            raise _Refused(f"Entry not found: {since}")
        entries = entries[ids.index(since) + 1 :]
    return {"entries": entries, "leafId": agent.conversation.leaf_id}


async def _get_tree(agent: Agent, command: dict[str, Any]) -> Any:
    entries = agent.conversation.entries()
    nodes = {e["id"]: {"entry": e, "children": []} for e in entries}
    roots: list[dict[str, Any]] = []
    for entry in entries:
        parent = nodes.get(entry.get("parentId"))
        (parent["children"] if parent else roots).append(nodes[entry["id"]])
    return {"tree": roots, "leafId": agent.conversation.leaf_id}


async def _get_session_stats(agent: Agent, command: dict[str, Any]) -> Any:
    return agent.session_stats()


async def _get_last_assistant_text(agent: Agent, command: dict[str, Any]) -> Any:
    for message in reversed(agent.conversation.context()):
        if message.get("role") == "assistant" and message.get("stopReason") != "aborted":
            text = "".join(b.get("text", "") for b in message["content"] if b["type"] == "text")
            return {"text": text}
    return {}


async def _get_fork_messages(agent: Agent, command: dict[str, Any]) -> Any:
    messages = []
    for entry in agent.conversation.path_entries():
        message = entry.get("message") or {}
        if entry.get("type") == "message" and message.get("role") == "user":
            text = "".join(p.get("text", "") for p in message["content"] if p["type"] == "text")
            messages.append({"entryId": entry["id"], "text": text})
    return {"messages": messages}


async def _get_available_models(agent: Agent, command: dict[str, Any]) -> Any:
    return {"models": [agent.options.model.as_pi()]}


async def _get_available_thinking_levels(agent: Agent, command: dict[str, Any]) -> Any:
    return {"levels": ["off"]}


async def _get_commands(agent: Agent, command: dict[str, Any]) -> Any:
    return {"commands": []}


async def _set_session_name(agent: Agent, command: dict[str, Any]) -> Any:
    name = str(command.get("name", ""))
    agent.conversation.append({"type": "session_info", "name": name})
    await agent.emit({"type": "session_info_changed", "name": name})
    return None


Handler = Callable[[Agent, dict[str, Any]], Awaitable[Any]]
_HANDLERS: Final[dict[str, Handler]] = {
    "prompt": _prompt,
    "steer": _steer,
    "follow_up": _follow_up,
    "abort": _abort,
    "clear_queue": _clear_queue,
    "get_state": _get_state,
    "get_messages": _get_messages,
    "get_entries": _get_entries,
    "get_tree": _get_tree,
    "get_session_stats": _get_session_stats,
    "get_last_assistant_text": _get_last_assistant_text,
    "get_fork_messages": _get_fork_messages,
    "get_available_models": _get_available_models,
    "get_available_thinking_levels": _get_available_thinking_levels,
    "get_commands": _get_commands,
    "set_session_name": _set_session_name,
}
_BACKGROUND: Final = frozenset({"abort"})
