"""Pure normalizers: what of a worker's output must be identical between Pi and Fake-Pi.

Each function maps raw records (stdout objects, model request bodies, session
entries) to plain JSON-like values that compare with ``==``; :func:`diff`
renders a readable unified diff of two such values. What is kept and what is
dropped, and why, is in ``docs/design/fake-pi-conformance.md``.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

__all__ = [
    "LITERAL_KEYS",
    "assert_same",
    "diff",
    "entry_shapes",
    "event_sequence",
    "event_shapes",
    "flatten",
    "key_order_mismatches",
    "queue_updates",
    "request_shape",
    "response_shapes",
    "shape",
    "type_name",
]

Record = Mapping[str, Any]

LITERAL_KEYS: Final = frozenset(
    {
        # discriminators and enums: their values are part of the shape
        "type",
        "role",
        "stopReason",
        "rawStopReason",
        "command",
        "success",
        "disposition",
        "api",
        "provider",
        "model",
        "modelId",
        "toolName",
        "isError",
        "aborted",
        "willRetry",
        "thinkingLevel",
        "steeringMode",
        "followUpMode",
        "isStreaming",
        "isCompacting",
        "autoCompactionEnabled",
        "customType",
        "version",
        "cancelled",
        "truncated",
        "exit_code",
        "contentIndex",
    }
)
"""Keys whose values are compared, not only their types."""

OPAQUE_KEYS: Final = frozenset(
    {
        # system prompt text: deliberately Fake-Pi's own (the brief excludes it)
        "sections",
    }
)
"""Keys whose presence is compared but not their value (neither type nor content)."""


def type_name(value: Any) -> str:
    """The JSON type: JavaScript has one number type, so int and float are "number"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _optional_keys(value: Mapping[str, Any]) -> frozenset[str]:
    """Keys Pi itself writes in some runs and not in others, for this object.

    The empty assistant reply Pi adds after an aborted tool (``stopReason: "aborted"``,
    ``content: []``) has ``durationMs: 0`` in some runs and no ``durationMs`` in others
    (seen in pi-vs-pi runs of the stdin-EOF scenario: one run each way).
    """
    if (
        value.get("role") == "assistant"
        and value.get("stopReason") == "aborted"
        and value.get("content") == []
    ):
        return frozenset({"durationMs"})
    return frozenset()


def shape(value: Any, *, key: str | None = None) -> Any:
    """Keys and value types, recursively (dict keys sorted; lists keep their items).

    Values of :data:`LITERAL_KEYS` are kept; :data:`OPAQUE_KEYS` become ``"…"``; keys that
    Pi itself writes only sometimes (:func:`_optional_keys`) are left out.
    """
    if key in OPAQUE_KEYS:
        return "…"
    if key in LITERAL_KEYS and not isinstance(value, dict | list):
        return {"=": value}
    if isinstance(value, dict):
        optional = _optional_keys(value)
        return {k: shape(v, key=k) for k, v in sorted(value.items()) if k not in optional}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type_name(value)


# --------------------------------------------------------------------------------- events


def _event_label(record: Record) -> str:
    kind = str(record.get("type"))
    if kind in ("message_start", "message_end"):
        message = record.get("message") or {}
        label = f"{kind}:{message.get('role')}"
        if message.get("role") == "assistant":
            label += f":{message.get('stopReason')}"
        return label
    if kind == "message_update":
        event = record.get("assistantMessageEvent") or {}
        return f"message_update:{event.get('type')}"
    if kind in ("tool_execution_start", "tool_execution_update", "tool_execution_end"):
        label = f"{kind}:{record.get('toolName')}"
        if kind == "tool_execution_end":
            label += f":isError={record.get('isError')}"
        return label
    if kind == "turn_end":
        message = record.get("message") or {}
        return f"turn_end:{message.get('stopReason')}:results={len(record.get('toolResults', []))}"
    if kind == "agent_end":
        return f"agent_end:willRetry={record.get('willRetry')}"
    if kind == "agent_settled":
        return f"agent_settled:aborted={record.get('aborted')}"
    if kind == "auto_retry_start":
        return f"auto_retry_start:attempt={record.get('attempt')}"
    if kind == "auto_retry_end":
        return f"auto_retry_end:success={record.get('success')}:attempt={record.get('attempt')}"
    if kind == "entry_appended":
        entry = record.get("entry") or {}
        return f"entry_appended:{entry.get('type')}"
    return kind


_TOOL_EVENTS: Final = ("tool_execution_start", "tool_execution_update", "tool_execution_end")
_COMPRESSED: Final = ("message_update:", "tool_execution_update:")


def _regroup_tool_runs(records: Sequence[Record]) -> list[Record]:
    """Inside each maximal run of ``tool_execution_*`` events, group by tool call.

    Parallel tool calls interleave their updates and ends by completion time (pi-observed.md);
    each call's own order (start, updates, end) is what is deterministic. Groups keep the
    order of their ``tool_execution_start``.
    """
    out: list[Record] = []
    run: list[Record] = []

    def flush() -> None:
        groups: dict[Any, list[Record]] = {}
        for record in run:
            groups.setdefault(record.get("toolCallId"), []).append(record)
        for group in groups.values():
            out.extend(group)
        run.clear()

    for record in records:
        if record.get("type") in _TOOL_EVENTS:
            run.append(record)
        else:
            flush()
            out.append(record)
    flush()
    return out


def event_sequence(records: Iterable[Record]) -> list[str]:
    """The event-type sequence: labels with roles/stopReasons/update subtypes.

    Dropped: responses (their position relative to events is timing) and
    ``queue_update`` (emitted when a command arrives, so it lands anywhere among the
    streaming updates; compare :func:`queue_updates`). Runs of the same
    ``message_update`` subtype or of ``tool_execution_update`` are compressed to one:
    how many deltas Pi emits depends on how the SSE bytes were split into reads.
    """
    events = [r for r in records if r.get("type") not in ("response", "queue_update")]
    labels: list[str] = []
    for record in _regroup_tool_runs(events):
        label = _event_label(record)
        if labels and label == labels[-1] and label.startswith(_COMPRESSED):
            continue
        labels.append(label)
    return labels


def event_shapes(records: Iterable[Record]) -> dict[str, list[Any]]:
    """For each event label, the distinct :func:`shape` s of its events (sorted).

    Distinct shapes, not one per event: how many ``message_update`` or
    ``tool_execution_update`` events carry a given shape is timing. The ``usage`` of a
    ``message_update`` is opaque: Pi prints the message's live usage object, which the
    provider's final usage chunk fills in (``reasoning``, ``cost.totalFromProvider``)
    at a moment that races with the printing of earlier updates.
    """
    seen: dict[str, set[str]] = {}
    for record in records:
        if record.get("type") == "response":
            continue
        item = shape(record)
        if record.get("type") == "message_update" and "usage" in item:
            item["usage"] = "…"
        seen.setdefault(_event_label(record), set()).add(json.dumps(item, sort_keys=True))
    return {
        label: [json.loads(s) for s in sorted(shapes)] for label, shapes in sorted(seen.items())
    }


def queue_updates(records: Iterable[Record]) -> list[Any]:
    """The ``queue_update`` payloads, in order (they carry the full queues)."""
    return [
        {"steering": r.get("steering"), "followUp": r.get("followUp")}
        for r in records
        if r.get("type") == "queue_update"
    ]


# ------------------------------------------------------------------------------ responses


def response_shapes(records: Iterable[Record]) -> list[Any]:
    """Every response, in order of its command id, as :func:`shape` plus its error text."""
    out: list[Any] = []
    for record in records:
        if record.get("type") != "response":
            continue
        item = shape({k: v for k, v in record.items() if k not in ("id", "error")})
        if "error" in record:
            item["error"] = {"=": record["error"]}
        out.append(item)
    return out


# ------------------------------------------------------------------------------- requests


def _content_shape(content: Any) -> Any:
    if isinstance(content, list):
        return [
            {k: (v if k in ("type", "text") else type_name(v)) for k, v in sorted(part.items())}
            if isinstance(part, dict)
            else type_name(part)
            for part in content
        ]
    if isinstance(content, str):
        return {"str": content}
    return type_name(content)


def _request_message(message: Mapping[str, Any]) -> Any:
    role = message.get("role")
    out: dict[str, Any] = {"keys": sorted(message), "role": role}
    if role != "system":  # the system prompt text is Fake-Pi's own
        out["content"] = _content_shape(message.get("content"))
    else:
        out["content"] = type_name(message.get("content"))
    if "tool_calls" in message:
        calls = []
        for call in message["tool_calls"]:
            function = call.get("function", {})
            calls.append(
                {
                    "keys": sorted(call),
                    "id": call.get("id"),
                    "type": call.get("type"),
                    "function.keys": sorted(function),
                    "name": function.get("name"),
                    "arguments": json.loads(function.get("arguments") or "null"),
                }
            )
        out["tool_calls"] = calls
    if "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    return out


def request_shape(body: Mapping[str, Any], *, descriptions: bool = False) -> Any:
    """One chat-completions body: keys and the values that matter to an upstream.

    Kept: every top-level key with the values of ``model``, ``stream``,
    ``stream_options``, ``store`` and ``max_completion_tokens``; every message's role,
    keys, content (exact, except the system prompt's text), tool calls (ids, names,
    parsed arguments) and ``tool_call_id``; every tool's name and parameter schema
    (exact) and, with ``descriptions``, its description.
    """
    out: dict[str, Any] = {"keys": sorted(body)}
    for key in ("model", "stream", "stream_options", "store", "max_completion_tokens"):
        if key in body:
            out[key] = body[key]
    out["messages"] = [_request_message(m) for m in body.get("messages", [])]
    tools = []
    for tool in body.get("tools", []):
        function = tool.get("function", {})
        item = {
            "keys": sorted(tool),
            "type": tool.get("type"),
            "function.keys": sorted(function),
            "name": function.get("name"),
            "parameters": function.get("parameters"),
        }
        if descriptions:
            item["description"] = function.get("description")
        tools.append(item)
    out["tools"] = tools
    return out


# -------------------------------------------------------------------------------- session


def entry_shapes(entries: Sequence[Record]) -> list[Any]:
    """Session entries (a file's lines or ``get_entries``): shape per entry, and the tree.

    ``parentId`` becomes the index of the parent entry in the list (``None`` for a root,
    ``"?"`` for an unknown id), and ``targetId`` likewise, so the tree is compared without
    the random ids.
    """
    index = {e.get("id"): i for i, e in enumerate(entries) if isinstance(e.get("id"), str)}

    def where(entry_id: Any) -> Any:
        if entry_id is None:
            return None
        return index.get(entry_id, "?")

    out = []
    for entry in entries:
        item = shape(entry)
        if "parentId" in entry:
            item["parentId"] = {"at": where(entry["parentId"])}
        if "targetId" in entry:
            item["targetId"] = {"at": where(entry["targetId"])}
        out.append(item)
    return out


def _objects(value: Any, path: str = "") -> dict[str, list[str]]:
    """Every object in ``value`` by path, with its keys in document order."""
    out: dict[str, list[str]] = {}
    if isinstance(value, dict):
        out[path or "."] = list(value)
        for k, v in value.items():
            out.update(_objects(v, f"{path}.{k}"))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.update(_objects(v, f"{path}[{i}]"))
    return out


def key_order_mismatches(expected: Sequence[Record], actual: Sequence[Record]) -> list[str]:
    """Objects whose shared keys come in a different order (entries paired by index).

    :func:`shape` sorts keys, and a missing or extra key already shows there; this
    compares only the order of the keys both sides have, because a session line is
    ``JSON.stringify`` output that the runtime's session module reproduces byte for byte.
    """
    out = []
    for i, (left, right) in enumerate(zip(expected, actual, strict=False)):
        left_objects, right_objects = _objects(left), _objects(right)
        for path, left_keys in left_objects.items():
            right_keys = right_objects.get(path)
            if right_keys is None:
                continue
            common = set(left_keys) & set(right_keys)
            ours = [k for k in left_keys if k in common]
            theirs = [k for k in right_keys if k in common]
            if ours != theirs:
                out.append(f"[{i}]{path if path != '.' else ''}: pi {ours} != {theirs}")
    return out


# ----------------------------------------------------------------------------------- diff


def flatten(value: Any, path: str = "") -> list[str]:
    """One line per leaf: ``path: value`` (``{"=": v}`` shows as ``path == v``; items of
    a list of scalars show as ``path[]: value``)."""
    if isinstance(value, dict):
        if set(value) == {"="}:
            return [f"{path} == {json.dumps(value['='], ensure_ascii=False)}"]
        if not value:
            return [f"{path}: {{}}"]
        return [line for k, v in value.items() for line in flatten(v, f"{path}.{k}")]
    if isinstance(value, list):
        if not value:
            return [f"{path}: []"]
        if not any(isinstance(v, dict | list) for v in value):
            # a sequence of labels: no indexes, so one insertion is one diff line
            return [f"{path}[]: {json.dumps(v, ensure_ascii=False)}" for v in value]
        return [line for i, v in enumerate(value) for line in flatten(v, f"{path}[{i}]")]
    return [f"{path}: {json.dumps(value, ensure_ascii=False)}"]


MAX_DIFF_LINES: Final = 80


def diff(
    expected: Any, actual: Any, *, expected_name: str = "pi", actual_name: str = "fake"
) -> str:
    """A unified diff of two normalized values, one leaf per line ("" when equal);
    at most :data:`MAX_DIFF_LINES` lines."""
    if expected == actual:
        return ""
    lines = list(
        difflib.unified_diff(
            flatten(expected),
            flatten(actual),
            fromfile=expected_name,
            tofile=actual_name,
            n=2,
            lineterm="",
        )
    )
    if len(lines) > MAX_DIFF_LINES:
        lines = [*lines[:MAX_DIFF_LINES], f"… ({len(lines) - MAX_DIFF_LINES} more diff lines)"]
    return "\n".join(lines)


def assert_same(what: str, expected: Any, actual: Any, *, actual_name: str = "fake") -> None:
    """Raise ``AssertionError`` with a readable diff when the normalized values differ."""
    text = diff(expected, actual, actual_name=actual_name)
    if text:
        raise AssertionError(f"{what} differs between pi and {actual_name}:\n{text}")
