"""What an OpenAI-compatible chat-completions stream says, read by the model gateway
(docs/design/gateway.md; the backoff's reading: docs/design/retention.md PB1, PB6).

Pure functions and values, no I/O: a request's step identity (:func:`request_digest`, G1),
the SSE framing (:func:`sse_data`), which payloads are the held terminal part
(:func:`is_terminal`, G4), which report an upstream failure inside a 200 stream
(:func:`is_upstream_error`, G10) and how the backoff reads one (:func:`stream_failure`) or a
stream that stopped short (:func:`stream_cut`), whether a payload gave the worker part of the
answer (:func:`carries_answer`, PB1), and the tool-call ids minted where the upstream gave
none or one another call of the response has (:class:`ToolCallIds`, G7).
:class:`~runtime._boundary._gateway.Gateway` is the Trio shell that applies them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from .._pi._provider_errors import USAGE_LIMIT_PATTERN

__all__ = [
    "CUT_SHORT",
    "DONE",
    "ToolCallIds",
    "UpstreamFailure",
    "carries_answer",
    "is_terminal",
    "is_upstream_error",
    "request_digest",
    "retry_after_seconds",
    "sse_data",
    "stream_cut",
    "stream_failure",
]

DONE: Final = "[DONE]"
"""The payload that ends an SSE chat-completions stream."""
_json = msgspec.json.Encoder()
_sorted_json = msgspec.json.Encoder(order="sorted")


@dataclass(frozen=True, slots=True)
class UpstreamFailure:
    """How the gateway's last call upstream failed, as the provider backoff reads it
    (docs/design/retention.md PB1): never the provider's words, only their shape."""

    status: int | None
    """The HTTP status; ``None``: no response (refused, unreachable, cut before its head). For
    an error inside a 200 stream, the status it names or its class's (:func:`stream_failure`)."""
    retry_after: float | None = None
    """The response's ``Retry-After``, in seconds, when it gave one (a 200 stream's too)."""
    account_limit: bool = False
    """Its body reports an account usage limit (quota, billing, plan:
    :data:`~runtime._pi._provider_errors.USAGE_LIMIT_PATTERN`)."""
    in_stream: str | None = None
    """For an error inside a 200 stream (:func:`stream_failure`): what it said, in words a
    continuation may carry — what it named (its class as the provider spelled it when that is
    a plain identifier, a status, an account limit) and the status it was taken for; for a
    200 stream that stopped short after part of the answer (:func:`stream_cut`), that."""

    def describe(self) -> str:
        """What was received, in words a continuation may carry (PB6): ``HTTP <status>``,
        ``no response``, or an error inside a 200 stream by what it named — never a status
        that was not received."""
        if self.in_stream is not None:
            return self.in_stream
        return "no response" if self.status is None else f"HTTP {self.status}"

    @property
    def unavailable(self) -> bool:
        """Whether it says the provider is unavailable for now, not that the request is
        wrong: no response, 408, 429 or any 5xx — but an account limit only with a time to
        wait for (``Retry-After``: a usage limit's reset). A 400, 401, 403 or 404 is a
        definite refusal (PB3), and so is every other status."""
        status = self.status
        transient = status is None or status in (408, 429) or 500 <= status <= 599
        return transient and (not self.account_limit or self.retry_after is not None)


def retry_after_seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header's seconds (its delta-seconds form; an HTTP date is not
    read), ``None`` when absent or unreadable; at most a day."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    if not seconds >= 0:  # NaN too
        return None
    return min(seconds, 86_400.0)


def request_digest(body: Mapping[str, Any]) -> str:
    """sha256 of the canonical body: sorted-key compact JSON of the parsed body (G1).

    The same function as the scripted model's ``body_digest``, so tests can ask
    the upstream how often it saw a digest.
    """
    try:
        canonical = _sorted_json.encode(body)
    except UnicodeEncodeError:  # a lone surrogate, which JavaScript writes and msgspec cannot
        canonical = _sorted_json.encode(_surrogates_escaped(body))
    return hashlib.sha256(canonical).hexdigest()


_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def _surrogates_escaped(value: Any) -> Any:
    """``value`` with each string holding a lone surrogate as its JSON text, the surrogate
    written ``\\udxxx`` as JavaScript writes it (G1): one canonical text per body, and never
    another string's (a backslash the string holds is written ``\\\\``). A key holding one
    raises ``ValueError``."""
    if isinstance(value, str):
        if not _SURROGATE.search(value):
            return value
        text = json.dumps(value, ensure_ascii=False)
        text = _SURROGATE.sub(lambda found: f"\\u{ord(found[0]):04x}", text)
        return msgspec.Raw(text.encode())
    if isinstance(value, list):
        return [_surrogates_escaped(item) for item in value]
    if isinstance(value, dict):
        if any(_SURROGATE.search(key) for key in value):
            raise ValueError("an object key holds a lone surrogate")
        return {key: _surrogates_escaped(item) for key, item in value.items()}
    return value


def sse_data(payload: str) -> bytes:
    """One SSE event carrying ``payload`` (a chunk's JSON, or ``[DONE]``): one ``data:``
    line per line of it, since an upstream event may span several (G3) and a newline inside
    one ``data:`` line would end the payload there for the worker."""
    if "\n" not in payload:  # the common chunk
        return b"data: " + payload.encode() + b"\n\n"
    return b"".join(b"data: " + line.encode() + b"\n" for line in payload.split("\n")) + b"\n"


def _decode(payload: str) -> dict[str, Any] | None:
    try:
        value = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


def is_terminal(payload: str) -> bool:
    """Whether this SSE payload belongs to the held terminal part (G4).

    ``[DONE]``, a chunk whose choice carries a ``finish_reason``, or a usage chunk.
    """
    if payload.strip() == DONE:
        return True
    chunk = _decode(payload)
    if chunk is None:
        return False
    if chunk.get("usage") is not None:
        return True
    return _any_choice(chunk, lambda choice: choice.get("finish_reason") is not None)


def is_upstream_error(payload: str) -> bool:
    """Whether this SSE payload reports that the upstream failed inside a 200 stream (G10).

    A chunk with a top-level ``error`` (vLLM sends ``{"error": …}`` then ``[DONE]``;
    OpenRouter adds a choice ending ``finish_reason: "error"``), or such a choice alone. The
    response failed: it is not the step's answer, however its stream ends. Checked before
    :func:`is_terminal`, which counts any ``finish_reason``.
    """
    if '"error"' not in payload:
        return False  # the common chunk: no second decode
    chunk = _decode(payload)
    if chunk is None:
        return False
    if chunk.get("error") is not None:
        return True
    return _any_choice(chunk, lambda choice: choice.get("finish_reason") == "error")


def _any_choice(chunk: dict[str, Any], test: Callable[[dict[str, Any]], bool]) -> bool:
    """Whether a choice of the decoded ``chunk`` passes ``test``."""
    choices = chunk.get("choices")
    return isinstance(choices, list) and any(isinstance(c, dict) and test(c) for c in choices)


_STREAM_ERROR_CLASSES: Final = (
    (429, re.compile(r"rate.?limit|too.?many.?requests|resource.?exhausted", re.IGNORECASE)),
    (503, re.compile(r"overload|unavailable|capacity|busy", re.IGNORECASE)),
    (504, re.compile(r"time.?out|deadline.?exceeded", re.IGNORECASE)),
    (500, re.compile(r"server.?error|internal|api.?error|bad.?gateway", re.IGNORECASE)),
)
"""An error class named inside a stream (its ``type``, ``code`` or ``status`` string) that says
the provider is unavailable, and the status that says the same (PB1): rate limited, overloaded
or unavailable, timed out, a server error. Any other named class is the request's own (400)."""


def stream_failure(payload: str, retry_after: float | None = None) -> UpstreamFailure:
    """How the backoff reads an error inside a 200 stream (:func:`is_upstream_error`; PB1) by
    the same rules as a status: the error object's status (``status``, ``status_code`` or
    ``code``, 400-599); else an account limit (:data:`USAGE_LIMIT_PATTERN` anywhere in the
    payload, as in an error body) as a 429; else the class its ``type``, ``code`` or
    ``status`` string names (:data:`_STREAM_ERROR_CLASSES`: 429, 503, 504, 500 — any other
    named class 400, the request's own fault); an error that names nothing (a bare message,
    a choice ending ``finish_reason: "error"`` alone) keeps the 200 it came in: not an outage,
    its words are not guessed at. ``retry_after``: the 200 response's ``Retry-After``."""
    chunk = _decode(payload)
    error = chunk.get("error") if chunk is not None else None
    account_limit = USAGE_LIMIT_PATTERN.search(payload) is not None
    status, named = _stream_status(error, account_limit)
    said = f"{named} inside an HTTP 200 stream"
    if status != 200 and not named.startswith("an error naming status"):
        said += f", taken for a {status}"
    return UpstreamFailure(status, retry_after, account_limit, in_stream=said)


_PLAIN_NAME: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
"""A class name an error inside a stream may be told by (PB6): a plain identifier, never the
provider's free text."""


def _stream_status(error: object, account_limit: bool) -> tuple[int, str]:
    """The status an error inside a stream says (:func:`stream_failure`), and what it named."""
    if isinstance(error, dict):
        for key in ("status", "status_code", "code"):
            value = error.get(key)
            if isinstance(value, str) and value.isascii() and value.isdigit():
                value = int(value)
            if isinstance(value, int) and not isinstance(value, bool) and 400 <= value <= 599:
                return value, f"an error naming status {value}"
    if account_limit:
        return 429, "an account limit"
    names = (
        [v for k in ("type", "code", "status") if isinstance(v := error.get(k), str) and v]
        if isinstance(error, dict)
        else []
    )
    if not names:
        return 200, "an error naming no class"
    status, name = next(
        (
            (status, name)
            for status, pattern in _STREAM_ERROR_CLASSES
            for name in names
            if pattern.search(name)
        ),
        (400, names[0]),
    )
    told = f"class {name}" if _PLAIN_NAME.fullmatch(name) else "an unnamed class"
    return status, f"an error of {told}"


CUT_SHORT: Final = "an HTTP 200 stream cut short after part of the answer"
"""How a stream that stopped short after part of the answer is told (PB6)."""


def stream_cut(*, answering: bool) -> UpstreamFailure:
    """How the backoff reads an upstream stream that stopped short — cut, or ended with no
    terminal part (G16) — by what it had passed to the worker (PB1): before any of the answer
    (:func:`carries_answer`) the upstream gave no response, as one cut before its head; after
    part of it, a stream cut short — an outage too (no status: none was received), told as
    such (:data:`CUT_SHORT`), never as the failure of an earlier request."""
    return UpstreamFailure(None, in_stream=CUT_SHORT if answering else None)


def carries_answer(payload: str) -> bool:
    """Whether this SSE payload, passed to the worker, gave it part of the answer (PB1): a
    delta with anything but its role — text, reasoning, a tool call, a refusal. A role alone,
    empty deltas and a chunk with no choices give nothing; a payload that is not a JSON object
    is taken for part of the answer (it was passed as it came)."""
    chunk = _decode(payload)
    if chunk is None:
        return True
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict):
            if any(
                key != "role" and value not in (None, "", [], {}) for key, value in delta.items()
            ):
                return True
        elif delta:
            return True
    return False


@dataclass
class ToolCallIds:
    """Gives every tool call of one response an id of its own, deterministically (G7).

    The first delta of each call (a choice's ``index`` and the call's ``index``) keeps the
    id the upstream gave unless it is empty or another call of the response already has it
    (a weak or local provider gives ``call_0`` twice: Pi runs both, telling them apart by
    their index, and the tool gate would take them for one call). Then the call gets the
    minted id ``call_<digest[:16]>_<index>`` (plus ``_<choice>`` for a choice other than 0;
    plus ``-<n>`` in the odd case that the upstream gave that one too). A later delta of a
    call given an id for a repeated one that repeats it gets the given one; any other later
    delta keeps what it carries, and one without an id is left without (an id there could
    start a new call in a parser that goes by ids, as one without an index does). A pure
    function of the digest and the payloads: feed every payload of one response in order;
    the relayed payloads fed again come out unchanged.
    """

    digest: str
    _given: dict[tuple[int, int], tuple[str, str] | None] = field(default_factory=dict)
    """Each call seen, by (choice, index): the repeated id it came with (or ``""``) and the
    one the gateway gave it; ``None``: it kept its own."""
    _taken: set[str] = field(default_factory=set)
    """Every id a call of the response has."""

    def mint(self, choice: int, index: int) -> str:
        suffix = f"_{choice}" if choice else ""
        return f"call_{self.digest[:16]}_{index}{suffix}"

    def _first(self, key: tuple[int, int], call: dict[str, Any]) -> bool:
        """Note the first delta of call ``key``; whether its id was set."""
        upstream = call.get("id")
        if upstream and isinstance(upstream, str) and upstream not in self._taken:
            self._given[key] = None
            self._taken.add(upstream)
            return False
        minted = base = self.mint(*key)
        again = 0
        while minted in self._taken:
            again += 1
            minted = f"{base}-{again}"
        self._given[key] = (upstream if isinstance(upstream, str) else "", minted)
        self._taken.add(minted)
        call["id"] = minted
        return True

    def apply(self, payload: str) -> str:
        """``payload`` unchanged, or re-encoded with ids set."""
        if '"tool_calls"' not in payload:
            return payload
        chunk = _decode(payload)
        if chunk is None or not isinstance(chunk.get("choices"), list):
            return payload
        changed = False
        for position, choice in enumerate(chunk["choices"]):
            if not isinstance(choice, dict):
                continue
            choice_index = choice.get("index", position)
            delta = choice.get("delta")
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            if not isinstance(calls, list):
                continue
            for call in calls:
                if not isinstance(call, dict):
                    continue
                key = (_index(choice_index, position), _index(call.get("index"), 0))
                if key not in self._given:
                    changed = self._first(key, call) or changed
                elif (given := self._given[key]) and given[0] and call.get("id") == given[0]:
                    call["id"] = given[1]
                    changed = True
        return _json.encode(chunk).decode() if changed else payload


def _index(value: object, default: int) -> int:
    """A choice's or a tool call's ``index`` as the upstream sent it; ``default`` (its
    position) when that is not a number: an odd stream is relayed, never a crash (G3)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default
