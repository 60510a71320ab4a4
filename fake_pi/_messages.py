"""Pi's message shapes, and how a conversation becomes a model request (pure).

Messages are plain dicts in exactly the shape Pi 1.6.0 emits them in events and
stores them in session entries (``docs/design/pi-observed.md`` §4-§5), so the
runtime cannot tell Fake-Pi from Pi. :func:`request_messages` converts a context
(the messages on the session path) into OpenAI ``chat/completions`` messages the
way Pi's ``openai-completions`` provider does: the system text, user content
parts, assistant text or ``null`` with ``tool_calls``, one ``tool`` message per
tool result; failed and aborted replies left out; a dangling tool call answered
with a synthetic ``"No result provided"`` (in the request only).
"""

from __future__ import annotations

import datetime
from typing import Any, Final

import msgspec

__all__ = [
    "assistant_message",
    "compaction_summary_message",
    "context_from_path",
    "project_path",
    "request_messages",
    "system_message",
    "tool_result_message",
    "usage",
    "user_message",
]

NO_RESULT: Final = "No result provided"
_encode = msgspec.json.Encoder()


def usage(
    input_tokens: int = 0, output_tokens: int = 0, *, with_reasoning: bool = True
) -> dict[str, Any]:
    """Pi's usage object (the pending message's omits ``reasoning``)."""
    result: dict[str, Any] = {
        "input": input_tokens,
        "output": output_tokens,
        "cacheRead": 0,
        "cacheWrite": 0,
    }
    if with_reasoning:
        result["reasoning"] = 0
    result["totalTokens"] = input_tokens + output_tokens
    cost: dict[str, Any] = {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0}
    if with_reasoning:
        cost["totalFromProvider"] = False
    result["cost"] = cost
    return result


def user_message(text: str, *, time_ms: int) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}], "timestamp": time_ms}


def system_message(
    sections: dict[str, str], tools: list[dict[str, Any]], *, time_ms: int
) -> dict[str, Any]:
    """The system message Pi stores before a session's first request."""
    return {
        "role": "system",
        "content": "",
        "sections": sections,
        "timestamp": time_ms,
        "toolsAdded": [
            {
                "name": t["name"],
                "description": t["description"],
                "parameters": t["parameters"],
                "constrainedSampling": {"type": "json_schema", "strict": "prefer"},
            }
            for t in tools
        ],
    }


def system_text(message: dict[str, Any]) -> str:
    sections = message.get("sections") or {}
    return "\n\n".join(text for text in sections.values() if text)


def assistant_message(
    *, provider: str, model: str, time_ms: int, thinking_level: str = "off"
) -> dict[str, Any]:
    """A pending assistant message, as ``message_start`` shows it."""
    return {
        "role": "assistant",
        "content": [],
        "api": "openai-completions",
        "provider": provider,
        "model": model,
        "usage": usage(with_reasoning=False),
        "stopReason": "pending",
        "timestamp": time_ms,
    }


def tool_result_message(
    *,
    tool_call_id: str,
    tool_name: str,
    content: list[dict[str, Any]],
    is_error: bool,
    time_ms: int,
    duration_ms: int | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "toolResult",
        "toolCallId": tool_call_id,
        "toolName": tool_name,
        "content": content,
    }
    if details is not None:
        message["details"] = details
    message["isError"] = is_error
    if duration_ms is not None:
        message["durationMs"] = duration_ms
    message["timestamp"] = time_ms
    return message


def context_from_path(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages of a session path (root first) as the model will see them.

    ``context_edit`` entries with ``replacement: null`` hide their target (Pi's
    way of dropping a failed reply before a retry). ``custom`` entries are
    never sent. After a ``compaction`` entry the context is its summary (and
    system message) plus the kept entries and what followed (:func:`project_path`).
    """
    return [message for _, messages in project_path(entries) for message in messages]


# -- compaction (Pi's session-manager ``buildSessionProjection``) ---------------------

COMPACTION_SUMMARY_PREFIX: Final = (
    "The conversation history before this point was compacted into the following summary:"
    "\n\n<summary>\n"
)
COMPACTION_SUMMARY_SUFFIX: Final = "\n</summary>"


def _iso_ms(timestamp: str) -> int:
    moment = datetime.datetime.fromisoformat(timestamp)
    return int(moment.timestamp() * 1000 + 0.5)


def compaction_summary_message(entry: dict[str, Any]) -> dict[str, Any]:
    """The ``compactionSummary`` message a ``compaction`` entry stands for."""
    return {
        "role": "compactionSummary",
        "summary": entry.get("summary", ""),
        "tokensBefore": entry.get("tokensBefore", 0),
        "timestamp": _iso_ms(entry["timestamp"]),
    }


def _entry_messages(entry: dict[str, Any]) -> list[dict[str, Any]]:
    kind = entry.get("type")
    if kind == "message":
        return [entry["message"]]
    if kind == "compaction":
        summary = compaction_summary_message(entry)
        system = entry.get("systemMessage")
        return [system, summary] if system else [summary]
    return []


Projected = list[tuple[dict[str, Any], list[dict[str, Any]]]]


def project_path(entries: list[dict[str, Any]]) -> Projected:
    """Each context entry of a path with the messages it contributes, as Pi projects it.

    Without compaction that is the whole path. With one, the newest ``compaction``
    entry comes first (its system message and summary), then the entries from its
    ``firstKeptEntryId`` up to it (system messages left out), then those after it.
    """
    latest = max((i for i, e in enumerate(entries) if e.get("type") == "compaction"), default=-1)
    selected = entries
    if latest >= 0:
        compaction = entries[latest]
        kept: list[dict[str, Any]] = []
        found = False
        for entry in entries[:latest]:
            found = found or entry.get("id") == compaction.get("firstKeptEntryId")
            is_system = entry.get("type") == "message" and entry["message"].get("role") == "system"
            if found and not is_system:
                kept.append(entry)
        selected = [compaction, *kept, *entries[latest + 1 :]]
    hidden = {
        e.get("targetId")
        for e in selected
        if e.get("type") == "context_edit" and e.get("replacement") is None
    }
    return [
        (
            entry,
            []
            if entry.get("id") in hidden or (index > 0 and entry.get("type") == "compaction")
            else _entry_messages(entry),
        )
        for index, entry in enumerate(selected)
    ]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def request_messages(context: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Convert Pi messages to OpenAI chat messages, as Pi's provider does."""
    out: list[dict[str, Any]] = []
    pending_calls: list[str] = []  # tool calls of the last assistant message without a result

    def settle_dangling() -> None:
        for call_id in pending_calls:
            out.append({"role": "tool", "content": NO_RESULT, "tool_call_id": call_id})
        pending_calls.clear()

    for message in context:
        role = message.get("role")
        if role == "system":
            text = system_text(message)
            if text and not any(m["role"] == "system" for m in out):  # the prompt leads
                out.insert(0, {"role": "system", "content": text})
        elif role == "user":
            settle_dangling()
            parts = [
                {"type": "text", "text": p["text"]}
                for p in message.get("content", [])
                if p.get("type") == "text" and p.get("text")
            ]
            if isinstance(message.get("content"), str):
                out.append({"role": "user", "content": message["content"]})
            elif parts:
                out.append({"role": "user", "content": parts})
        elif role == "compactionSummary":
            settle_dangling()
            summary = message.get("summary", "")
            text = f"{COMPACTION_SUMMARY_PREFIX}{summary}{COMPACTION_SUMMARY_SUFFIX}"
            out.append({"role": "user", "content": [{"type": "text", "text": text}]})
        elif role == "bashExecution":
            settle_dangling()
            text = f"Ran `{message.get('command', '')}`\n```\n{message.get('output', '')}```\n"
            out.append({"role": "user", "content": [{"type": "text", "text": text}]})
        elif role == "assistant":
            if message.get("stopReason") in ("aborted", "error"):
                continue
            settle_dangling()
            blocks = message.get("content", [])
            text = "".join(
                b["text"] for b in blocks if b.get("type") == "text" and b["text"].strip()
            )
            thinking = [
                b["thinking"]
                for b in blocks
                if b.get("type") == "thinking" and b["thinking"].strip()
            ]
            calls = [b for b in blocks if b.get("type") == "toolCall"]
            converted: dict[str, Any] = {"role": "assistant", "content": text or None}
            if thinking:
                converted["reasoning_content"] = "\n".join(thinking)
            if calls:
                converted["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {
                            "name": c["name"],
                            "arguments": _encode.encode(c["arguments"]).decode(),
                        },
                    }
                    for c in calls
                ]
                pending_calls.extend(c["id"] for c in calls)
            if text or calls:
                out.append(converted)
        elif role == "toolResult":
            call_id = message.get("toolCallId")
            if call_id in pending_calls:
                pending_calls.remove(call_id)
            text = "\n".join(
                p["text"] for p in message.get("content", []) if p.get("type") == "text"
            )
            out.append(
                {
                    "role": "tool",
                    "content": text if text.strip() else "(no tool output)",
                    "tool_call_id": call_id,
                }
            )
    settle_dangling()
    return out
