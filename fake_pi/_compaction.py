"""Pi's automatic context compaction (``compaction/compaction.js``, ``agent-session.js``).

When the context passes ``contextWindow - reserveTokens`` Pi summarizes the older part
of the conversation with one (or, for a split turn, two) ordinary model requests, appends
a ``compaction`` entry (summary, ``firstKeptEntryId``, ``tokensBefore``, ``details``,
``usage``, ``fromHook``, ``systemMessage``) and from then on sends the summary plus the
kept messages instead of the history (:func:`fake_pi._messages.project_path`).

This module holds the pure parts: the settings, Pi's chars/4 token estimates, the
thresholds, the cut point (``keepRecentTokens``), the summarization requests and the
entry. :class:`~fake_pi._agent.Agent` decides when to call them and emits
``compaction_start`` / ``compaction_end``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from ._messages import (
    COMPACTION_SUMMARY_PREFIX,
    COMPACTION_SUMMARY_SUFFIX,
    Projected,
    assistant_message,
    compaction_summary_message,
    project_path,
    request_messages,
    user_message,
)
from ._model import Assembler, ModelClient, ModelError

__all__ = [
    "CompactionError",
    "CompactionResult",
    "CompactionSettings",
    "Preparation",
    "compact",
    "compaction_entry",
    "current_system_message",
    "estimate_context_tokens",
    "estimate_projected_context_tokens",
    "estimate_tokens",
    "prepare_compaction",
    "serialize_conversation",
    "should_compact",
    "summarization_body",
    "tokens_after_reply",
]

_encode = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class CompactionSettings:
    """Pi's ``compaction`` settings (``settings.json``), with Pi's defaults."""

    enabled: bool = True
    reserve_tokens: int = 16384
    keep_recent_tokens: int = 20000

    @classmethod
    def from_settings(
        cls, settings: dict[str, Any], model_key: str | None = None
    ) -> CompactionSettings:
        """``compaction.{enabled,reserveTokens,keepRecentTokens}``, and the token settings
        of ``compaction.modelOverrides["provider/id"]`` over them (Pi's precedence)."""
        compaction = settings.get("compaction")
        compaction = compaction if isinstance(compaction, dict) else {}
        overrides = compaction.get("modelOverrides")
        override = overrides.get(model_key) if isinstance(overrides, dict) and model_key else None
        override = override if isinstance(override, dict) else {}
        default = cls()

        def tokens(key: str, fallback: int) -> int:
            for source in (override, compaction):
                value = source.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    return value
            return fallback

        return cls(
            enabled=bool(compaction.get("enabled", default.enabled)),
            reserve_tokens=tokens("reserveTokens", default.reserve_tokens),
            keep_recent_tokens=tokens("keepRecentTokens", default.keep_recent_tokens),
        )


# -- token estimates ------------------------------------------------------------------


def _js_len(text: str) -> int:
    """``String.length``: UTF-16 code units."""
    return len(text.encode("utf-16-le")) // 2


def _json_len(value: Any) -> int:
    return _js_len(_encode.encode(value).decode())


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return _js_len(content)
    chars = 0
    for block in content or []:
        if block.get("type") == "text" and block.get("text"):
            chars += _js_len(block["text"])
        elif block.get("type") == "image":
            chars += 4800
    return chars


def estimate_tokens(message: dict[str, Any]) -> int:
    """Pi's conservative chars/4 estimate of one message."""
    role = message.get("role")
    chars = 0
    if role == "system":
        chars = _content_chars(message.get("content"))
        chars += sum(_js_len(s) for s in (message.get("sections") or {}).values() if s)
        if message.get("toolsAdded"):
            chars += _json_len(message["toolsAdded"])
    elif role in ("user", "custom", "toolResult"):
        chars = _content_chars(message.get("content"))
    elif role == "assistant":
        for block in message.get("content") or []:
            kind = block.get("type")
            if kind == "text":
                chars += _js_len(block.get("text", ""))
            elif kind == "thinking":
                chars += _js_len(block.get("thinking", ""))
            elif kind == "toolCall":
                chars += _js_len(block.get("name", "")) + _json_len(block.get("arguments", {}))
    elif role == "bashExecution":
        chars = _js_len(message.get("command", "")) + _js_len(message.get("output", ""))
    elif role in ("branchSummary", "compactionSummary"):
        chars = _js_len(message.get("summary", ""))
    else:
        return 0
    return math.ceil(chars / 4)


def _context_tokens(usage: dict[str, Any]) -> int:
    total = int(usage.get("totalTokens") or 0)
    if total:
        return total
    return sum(int(usage.get(k) or 0) for k in ("input", "output", "cacheRead", "cacheWrite"))


def _valid_usage(message: dict[str, Any]) -> dict[str, Any] | None:
    if message.get("role") != "assistant" or message.get("stopReason") in ("aborted", "error"):
        return None
    usage = message.get("usage")
    return usage if isinstance(usage, dict) and _context_tokens(usage) > 0 else None


@dataclass(frozen=True, slots=True)
class ContextEstimate:
    tokens: int
    last_usage_index: int | None


def estimate_context_tokens(messages: list[dict[str, Any]]) -> ContextEstimate:
    """The last valid assistant usage plus estimates of the messages after it."""
    for index in range(len(messages) - 1, -1, -1):
        usage = _valid_usage(messages[index])
        if usage is not None:
            trailing = sum(estimate_tokens(m) for m in messages[index + 1 :])
            return ContextEstimate(_context_tokens(usage) + trailing, index)
    return ContextEstimate(sum(estimate_tokens(m) for m in messages), None)


def current_system_message(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Pi's ``getCurrentSystemMessage``: every system message replayed into one."""
    content: list[str] = []
    sections: dict[str, Any] = {}
    tools: dict[str, Any] = {}
    timestamp: int | None = None
    for message in messages:
        if message.get("role") != "system":
            continue
        if timestamp is None:
            timestamp = message.get("timestamp")
        text = message.get("content")
        text = text if isinstance(text, str) else ""
        if text:
            content.append(text)
        for name, value in (message.get("sections") or {}).items():
            if value is None:
                sections.pop(name, None)
            else:
                sections[name] = value
        for tool in message.get("toolsRemoved") or []:
            tools.pop(tool.get("name"), None)
        for tool in message.get("toolsAdded") or []:
            tools[tool.get("name")] = tool
    if timestamp is None and not tools:
        return None
    result: dict[str, Any] = {"role": "system", "content": "\n\n".join(content)}
    if sections:
        result["sections"] = sections
    if tools:
        result["toolsAdded"] = list(tools.values())
    result["timestamp"] = timestamp or 0
    return result


def _flatten(projection: Projected) -> list[dict[str, Any]]:
    return [message for _, messages in projection for message in messages]


def estimate_projected_context_tokens(projection: Projected, branch: list[dict[str, Any]]) -> int:
    """Pi's ``estimateProjectedContextTokens``: trust the last usage only when no
    ``context_edit`` or ``compaction`` came after it; else estimate everything."""
    messages = _flatten(projection)
    estimate = estimate_context_tokens(messages)
    if estimate.last_usage_index is not None:
        seen = 0
        usage_entry_id = None
        for entry, entry_messages in projection:
            seen += len(entry_messages)
            if estimate.last_usage_index < seen:
                usage_entry_id = entry.get("id")
                break
        ids = [e.get("id") for e in branch]
        usage_index = ids.index(usage_entry_id) if usage_entry_id in ids else -1
        invalidating = max(
            (i for i, e in enumerate(branch) if e.get("type") in ("context_edit", "compaction")),
            default=-1,
        )
        if usage_index > invalidating:
            return estimate.tokens
    system = current_system_message(messages)
    tokens = estimate_tokens(system) if system else 0
    return tokens + sum(estimate_tokens(m) for m in messages if m.get("role") != "system")


def should_compact(context_tokens: int, context_window: int, settings: CompactionSettings) -> bool:
    return settings.enabled and context_tokens > context_window - settings.reserve_tokens


def _before_compaction(
    message: dict[str, Any], branch: list[dict[str, Any]], compaction_index: int
) -> bool:
    """Whether ``message`` was recorded before the compaction at ``compaction_index``.

    Pi compares timestamps (``<=``); Fake-Pi compares positions on the path, which
    means the same with a real clock and stays right under a virtual clock, where a
    reply and the compaction after it can share a millisecond."""
    for index in range(len(branch) - 1, -1, -1):
        entry = branch[index]
        if entry.get("type") == "message" and entry["message"] == message:
            return index < compaction_index
    timestamp: int = compaction_summary_message(branch[compaction_index])["timestamp"]
    return int(message.get("timestamp", 0)) <= timestamp


def tokens_after_reply(assistant: dict[str, Any], branch: list[dict[str, Any]]) -> int | None:
    """The context size Pi's ``_checkCompaction`` compares with the threshold after a
    reply (its case 3), or ``None`` when the reply predates the latest compaction."""
    latest = max((i for i, e in enumerate(branch) if e.get("type") == "compaction"), default=-1)
    if latest >= 0 and _before_compaction(assistant, branch, latest):
        return None
    projection = project_path(branch)
    usage = assistant.get("usage")
    direct = _context_tokens(usage) if isinstance(usage, dict) else 0
    if any(entry.get("type") == "context_edit" for entry, _ in projection):
        return estimate_projected_context_tokens(projection, branch)
    if assistant.get("stopReason") == "error" or direct == 0:
        messages = _flatten(projection)
        estimate = estimate_context_tokens(messages)
        if estimate.last_usage_index is not None and latest >= 0:
            source = messages[estimate.last_usage_index]
            if _before_compaction(source, branch, latest):
                return None
        return estimate.tokens
    return direct


# -- the cut point --------------------------------------------------------------------

_CUT_POINT_ROLES: Final = frozenset(
    {"user", "assistant", "bashExecution", "custom", "branchSummary", "compactionSummary"}
)
_TURN_START_ROLES: Final = _CUT_POINT_ROLES - {"assistant"}


def _is_compaction(entry: dict[str, Any]) -> bool:
    return entry.get("type") == "compaction"


def _is_turn_start(item: tuple[dict[str, Any], list[dict[str, Any]]]) -> bool:
    entry, messages = item
    return not _is_compaction(entry) and any(m.get("role") in _TURN_START_ROLES for m in messages)


def _intrinsically_visible(entry: dict[str, Any]) -> bool:
    """The entry has messages of its own (before any ``context_edit``)."""
    return entry.get("type") in ("message", "compaction", "custom_message", "branch_summary")


@dataclass(frozen=True, slots=True)
class _CutPoint:
    first_kept: int
    turn_start: int
    split_turn: bool


def _find_cut_point(projection: Projected, start: int, end: int, keep_recent: int) -> _CutPoint:
    """Pi's ``findProjectedCutPoint``: walk back from the newest entry until
    ``keep_recent`` estimated tokens are kept; cut at a user or assistant message."""
    cut_points = [
        i
        for i in range(start, end)
        if not _is_compaction(projection[i][0])
        and any(m.get("role") in _CUT_POINT_ROLES for m in projection[i][1])
    ]
    if not cut_points:
        return _CutPoint(start, -1, False)
    accumulated = 0
    exceeded = False
    cut = cut_points[0]
    for i in range(end - 1, start - 1, -1):
        tokens = sum(estimate_tokens(m) for m in projection[i][1])
        if tokens == 0:
            continue
        accumulated += tokens
        if accumulated >= keep_recent:
            exceeded = True
            cut = next((c for c in cut_points if c >= i), cut_points[-1])
            break
    # a closed suffix of omitted (context-edited away) replies moves the cut past them
    suffix = projection[cut + 1 : end]

    def omitted(item: tuple[dict[str, Any], list[dict[str, Any]]]) -> bool:
        return _intrinsically_visible(item[0]) and not item[1]

    omitted_ids = {item[0].get("id") for item in suffix if omitted(item)}
    external_replacement = any(
        e.get("type") == "context_edit"
        and e.get("replacement") is not None
        and e.get("targetId") not in omitted_ids
        for e, _ in suffix
    )
    if (
        exceeded
        and not external_replacement
        and any(
            omitted(item)
            and item[0].get("type") == "message"
            and item[0]["message"].get("role") == "assistant"
            for item in suffix
        )
        and all(
            not _is_compaction(item[0]) and (not _intrinsically_visible(item[0]) or omitted(item))
            for item in suffix
        )
    ):
        cut += 1
    while cut > start:
        previous_entry, previous_messages = projection[cut - 1]
        if _is_compaction(previous_entry) or previous_messages:
            break
        cut -= 1
    if _is_turn_start(projection[cut]):
        return _CutPoint(cut, -1, False)
    turn_start = next((i for i in range(cut, start - 1, -1) if _is_turn_start(projection[i])), -1)
    return _CutPoint(cut, turn_start, turn_start != -1)


# -- preparation ----------------------------------------------------------------------


@dataclass
class Preparation:
    """What Pi's ``prepareCompaction`` returns."""

    first_kept_entry_id: str
    messages_to_summarize: list[dict[str, Any]]
    turn_prefix_messages: list[dict[str, Any]]
    is_split_turn: bool
    tokens_before: int
    previous_summary: str | None
    read: set[str] = field(default_factory=set)
    modified: set[str] = field(default_factory=set)


def _summarizable(item: tuple[dict[str, Any], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    entry, messages = item
    if _is_compaction(entry):
        return []
    return [m for m in messages if m.get("role") != "system"]


def _file_ops(messages: list[dict[str, Any]], preparation: Preparation) -> None:
    written: set[str] = set()
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for block in message.get("content") or []:
            if block.get("type") != "toolCall":
                continue
            path = (block.get("arguments") or {}).get("path")
            if not isinstance(path, str) or not path:
                continue
            if block.get("name") == "read":
                preparation.read.add(path)
            elif block.get("name") in ("write", "edit"):
                written.add(path)
    preparation.modified |= written


def prepare_compaction(
    branch: list[dict[str, Any]], settings: CompactionSettings
) -> Preparation | None:
    """What to summarize and where the kept part starts; ``None`` if nothing to do."""
    if branch and _is_compaction(branch[-1]):
        return None
    projection = project_path(branch)
    previous_index = next(
        (i for i, (e, messages) in enumerate(projection) if _is_compaction(e) and messages), -1
    )
    previous_summary: str | None = None
    start = 0
    if previous_index >= 0:
        previous_summary = projection[previous_index][0].get("summary")
        start = previous_index + 1
    end = len(projection)
    tokens_before = estimate_projected_context_tokens(projection, branch)
    cut = _find_cut_point(projection, start, end, settings.keep_recent_tokens)
    if cut.first_kept >= len(projection):
        return None
    first_kept_id = projection[cut.first_kept][0].get("id")
    if not first_kept_id:
        return None
    history_end = cut.turn_start if cut.split_turn else cut.first_kept
    to_summarize = [m for item in projection[start:history_end] for m in _summarizable(item)]
    prefix = (
        [m for item in projection[cut.turn_start : cut.first_kept] for m in _summarizable(item)]
        if cut.split_turn
        else []
    )
    if not to_summarize and not prefix:
        return None
    preparation = Preparation(
        first_kept_entry_id=first_kept_id,
        messages_to_summarize=to_summarize,
        turn_prefix_messages=prefix,
        is_split_turn=cut.split_turn,
        tokens_before=tokens_before,
        previous_summary=previous_summary,
    )
    if previous_index >= 0:
        details = projection[previous_index][0].get("details") or {}
        if not projection[previous_index][0].get("fromHook") and isinstance(details, dict):
            preparation.read.update(f for f in details.get("readFiles") or [] if isinstance(f, str))
            preparation.modified.update(
                f for f in details.get("modifiedFiles") or [] if isinstance(f, str)
            )
    _file_ops(to_summarize + prefix, preparation)
    return preparation


# -- the summarization requests -------------------------------------------------------

SUMMARIZATION_SYSTEM_PROMPT: Final = (
    "You are a context summarization assistant. Your task is to read a conversation between "
    "a user and an AI assistant, then produce a structured summary following the exact "
    "format specified.\n\nDo NOT continue the conversation. Do NOT respond to any questions "
    "in the conversation. ONLY output the structured summary."
)
_FORMAT: Final = """## Goal
{goal}

## Constraints & Preferences
{constraints}

## Progress
### Done
- [x] {done}

### In Progress
- [ ] {in_progress}

### Blocked
- [{blocked}]

## Key Decisions
- **[Decision]**: [Brief rationale]{decisions}

## Next Steps
1. [{next_steps}]

## Critical Context
{critical}

Keep each section concise. Preserve exact file paths, function names, and error messages."""
SUMMARIZATION_PROMPT: Final = (
    "The messages above are a conversation to summarize. Create a structured context "
    "checkpoint summary that another LLM will use to continue the work.\n\n"
    "Use this EXACT format:\n\n"
    + _FORMAT.format(
        goal="[What is the user trying to accomplish? Can be multiple items if the session "
        "covers different tasks.]",
        constraints="- [Any constraints, preferences, or requirements mentioned by user]\n"
        '- [Or "(none)" if none were mentioned]',
        done="[Completed tasks/changes]",
        in_progress="[Current work]",
        blocked="Issues preventing progress, if any",
        decisions="",
        next_steps="Ordered list of what should happen next",
        critical="- [Any data, examples, or references needed to continue]\n"
        '- [Or "(none)" if not applicable]',
    )
)
UPDATE_SUMMARIZATION_PROMPT: Final = (
    "The messages above are NEW conversation messages to incorporate into the existing "
    "summary provided in <previous-summary> tags.\n\n"
    "Update the existing structured summary with new information. RULES:\n"
    "- PRESERVE all existing information from the previous summary\n"
    "- ADD new progress, decisions, and context from the new messages\n"
    '- UPDATE the Progress section: move items from "In Progress" to "Done" when completed\n'
    '- UPDATE "Next Steps" based on what was accomplished\n'
    "- PRESERVE exact file paths, function names, and error messages\n"
    "- If something is no longer relevant, you may remove it\n\n"
    "Use this EXACT format:\n\n"
    + _FORMAT.format(
        goal="[Preserve existing goals, add new ones if the task expanded]",
        constraints="- [Preserve existing, add new ones discovered]",
        done="[Include previously done items AND newly completed items]",
        in_progress="[Current work - update based on progress]",
        blocked="Current blockers - remove if resolved",
        decisions=" (preserve all previous, add new)",
        next_steps="Update based on current state",
        critical="- [Preserve important context, add new if needed]",
    )
)
TURN_PREFIX_SUMMARIZATION_PROMPT: Final = (
    "The messages above are earlier context from an ongoing conversation. Later messages are "
    "stored separately and do not need to be reconstructed.\n\n"
    "Create a concise checkpoint of the user's request and the progress shown above. This "
    "checkpoint will be placed before the later messages so the conversation can continue "
    "with the necessary context.\n\n"
    "## Original Request\n[What did the user ask for?]\n\n"
    "## Progress So Far\n- [Key decisions and work completed in these messages]\n\n"
    "## Context Needed to Continue\n"
    "- [Information from these messages needed to understand the later work]\n\n"
    "Only summarize information explicitly present above. Do not infer or recreate later "
    "messages."
)
_TOOL_RESULT_MAX_CHARS: Final = 2000


def _text(content: Any, separator: str = "\n") -> str:
    if isinstance(content, str):
        return content
    return separator.join(b.get("text", "") for b in content or [] if b.get("type") == "text")


def _json_text(value: Any) -> str:
    return _encode.encode(value).decode()


def serialize_conversation(messages: list[dict[str, Any]]) -> str:
    """Pi's ``serializeConversation``: ``[User]: …`` lines, thinking left out, tool
    results cut at 2000 characters."""
    parts: list[str] = []
    for message in messages:
        role = message.get("role")
        if role == "compactionSummary":  # convertToLlm makes it a user message
            summary = message.get("summary", "")
            parts.append(f"[User]: {COMPACTION_SUMMARY_PREFIX}{summary}{COMPACTION_SUMMARY_SUFFIX}")
        elif role == "bashExecution":
            output = message.get("output", "")
            text = f"Ran `{message.get('command', '')}`\n```\n{output}```\n"
            parts.append(f"[User]: {text}")
        elif role in ("user", "custom"):
            text = _text(message.get("content"), "")
            if text:
                parts.append(f"[User]: {text}")
        elif role == "assistant":
            blocks = message.get("content") or []
            calls = [
                f"{b.get('name', '')}("
                + ", ".join(f"{k}={_json_text(v)}" for k, v in (b.get("arguments") or {}).items())
                + ")"
                for b in blocks
                if b.get("type") == "toolCall"
            ]
            if any(b.get("type") == "text" for b in blocks):
                parts.append(f"[Assistant]: {_text(blocks)}")
            if calls:
                parts.append(f"[Assistant tool calls]: {'; '.join(calls)}")
        elif role == "toolResult":
            text = _text(message.get("content"), "")
            if text:
                if len(text) > _TOOL_RESULT_MAX_CHARS:
                    cut = len(text) - _TOOL_RESULT_MAX_CHARS
                    text = (
                        f"{text[:_TOOL_RESULT_MAX_CHARS]}\n\n[... {cut} more characters truncated]"
                    )
                parts.append(f"[Tool result]: {text}")
    return "\n\n".join(parts)


def summarization_body(prompt_text: str, *, model_id: str, max_tokens: int) -> dict[str, Any]:
    """One summarization request: Pi's summarization system prompt and one user
    message, streamed from the session's model endpoint, no tools."""
    user = user_message(prompt_text, time_ms=0)
    return {
        "model": model_id,
        "messages": [
            {"role": "system", "content": SUMMARIZATION_SYSTEM_PROMPT},
            *request_messages([user]),
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "store": False,
        "max_completion_tokens": max_tokens,
    }


def history_prompt(messages: list[dict[str, Any]], previous_summary: str | None) -> str:
    prompt = f"<conversation>\n{serialize_conversation(messages)}\n</conversation>\n\n"
    if previous_summary:
        prompt += f"<previous-summary>\n{previous_summary}\n</previous-summary>\n\n"
    return prompt + (UPDATE_SUMMARIZATION_PROMPT if previous_summary else SUMMARIZATION_PROMPT)


def turn_prefix_prompt(messages: list[dict[str, Any]]) -> str:
    conversation = serialize_conversation(messages)
    return f"# Conversation\n{conversation}\n\n# Instructions\n{TURN_PREFIX_SUMMARIZATION_PROMPT}"


class CompactionError(Exception):
    """A summarization request failed; ``str()`` is Pi's message."""


async def _summarize(
    client: ModelClient, body: dict[str, Any], label: str
) -> tuple[str, dict[str, Any]]:
    """Stream one summarization reply; its text and usage."""
    message = assistant_message(provider="", model=body["model"], time_ms=0)
    assembler = Assembler(message)
    try:
        async for chunk in client.stream(body):
            assembler.feed(chunk)
        assembler.finish(duration_ms=0)
    except ModelError as exc:
        raise CompactionError(f"{label} failed: {exc.message}") from exc
    if message["stopReason"] == "length":
        raise CompactionError(
            f"{label} failed: generation hit the token cap and the summary is incomplete"
        )
    if any(b.get("type") == "toolCall" for b in message["content"]):
        raise CompactionError(f"{label} attempted to call a tool")
    usage: dict[str, Any] = message["usage"]
    return _text(message["content"]), usage


def _combine_usage(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    keys = ("input", "output", "cacheRead", "cacheWrite")
    combined: dict[str, Any] = {k: first.get(k, 0) + second.get(k, 0) for k in keys}
    if "reasoning" in first or "reasoning" in second:
        combined["reasoning"] = first.get("reasoning", 0) + second.get("reasoning", 0)
    combined["totalTokens"] = first.get("totalTokens", 0) + second.get("totalTokens", 0)
    a, b = first.get("cost", {}), second.get("cost", {})
    combined["cost"] = {
        **{k: a.get(k, 0) + b.get(k, 0) for k in (*keys, "total")},
        "totalFromProvider": a.get("totalFromProvider") is True
        and b.get("totalFromProvider") is True,
    }
    return combined


@dataclass(frozen=True, slots=True)
class CompactionResult:
    summary: str
    first_kept_entry_id: str
    tokens_before: int
    usage: dict[str, Any]
    details: dict[str, list[str]]

    def as_pi(self, *, estimated_tokens_after: int) -> dict[str, Any]:
        """``compaction_end.result``, in Pi's key order."""
        return {
            "summary": self.summary,
            "firstKeptEntryId": self.first_kept_entry_id,
            "tokensBefore": self.tokens_before,
            "estimatedTokensAfter": estimated_tokens_after,
            "usage": self.usage,
            "details": self.details,
        }


async def compact(
    preparation: Preparation, client: ModelClient, *, model_id: str, max_tokens: int
) -> CompactionResult:
    """Pi's ``compact``: summarize the history (and a split turn's prefix) through the
    model; raises :class:`CompactionError`."""
    p = preparation

    def body(prompt: str) -> dict[str, Any]:
        return summarization_body(prompt, model_id=model_id, max_tokens=max_tokens)

    if p.is_split_turn and p.turn_prefix_messages:
        history = p.previous_summary or "No prior history."
        history_usage: dict[str, Any] | None = None
        if p.messages_to_summarize:
            prompt = history_prompt(p.messages_to_summarize, p.previous_summary)
            history, history_usage = await _summarize(client, body(prompt), "Summarization")
        prefix_prompt = turn_prefix_prompt(p.turn_prefix_messages)
        prefix, prefix_usage = await _summarize(
            client, body(prefix_prompt), "Turn prefix summarization"
        )
        summary = f"{history}\n\n---\n\n**Turn Context (split turn):**\n\n{prefix}"
        usage = _combine_usage(history_usage, prefix_usage) if history_usage else prefix_usage
    else:
        prompt = history_prompt(p.messages_to_summarize, p.previous_summary)
        summary, usage = await _summarize(client, body(prompt), "Summarization")
    read = sorted(p.read - p.modified)
    modified = sorted(p.modified)
    sections = []
    if read:
        sections.append("<read-files>\n" + "\n".join(read) + "\n</read-files>")
    if modified:
        sections.append("<modified-files>\n" + "\n".join(modified) + "\n</modified-files>")
    if sections:
        summary += "\n\n" + "\n\n".join(sections)
    return CompactionResult(
        summary=summary,
        first_kept_entry_id=p.first_kept_entry_id,
        tokens_before=p.tokens_before,
        usage=usage,
        details={"readFiles": read, "modifiedFiles": modified},
    )


def compaction_entry(
    result: CompactionResult, *, timestamp: str, time_ms: int, context: list[dict[str, Any]]
) -> dict[str, Any]:
    """The ``compaction`` entry Pi's ``appendCompaction`` writes (``id``/``parentId``
    are added by the conversation)."""
    entry: dict[str, Any] = {
        "type": "compaction",
        "timestamp": timestamp,
        "summary": result.summary,
        "firstKeptEntryId": result.first_kept_entry_id,
        "tokensBefore": result.tokens_before,
        "details": result.details,
        "usage": result.usage,
        "fromHook": False,
    }
    system = current_system_message(context)
    if system is not None:
        entry["systemMessage"] = {**system, "timestamp": time_ms}
    return entry
