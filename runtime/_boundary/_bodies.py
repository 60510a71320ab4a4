"""A model request's body and its step digest, read by difference from the last one
(docs/design/gateway.md G1, G1a).

A worker's conversation grows by appending: each model request repeats the last one's
messages and adds a few. :class:`RequestBodies` keeps what it learnt of the last body — its
bytes, where its ``messages`` array ends in them, the decoded body, and the sha256 state of
the canonical text up to the end of its last message — and reads a body that repeats those
bytes and only appends messages by decoding, encoding and hashing the new messages alone.
Any other body is read whole, as :func:`~runtime._pi._pijson.loads` and
:func:`~runtime._boundary._stream.request_digest` always read it. Either way the answer is
the same, bit for bit (the property test in ``tests/boundary/test_bodies.py`` holds the two
side by side). Pure: no I/O, no Trio.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from .._pi._pijson import loads, nesting
from ._stream import request_digest

__all__ = ["RequestBodies"]

_TOP: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ANY: Final = msgspec.json.Decoder()
_JSON: Final = msgspec.json.Encoder()
_SORTED: Final = msgspec.json.Encoder(order="sorted")
_MESSAGES: Final = "messages"
_COMMA: Final = ord(",")
_CLOSE: Final = ord("]")
NEW_NESTING: Final = 64
"""The deepest new messages read by difference (Pi's nest about five levels); deeper ones are
read whole, so that a body the whole reading refuses as too deep (G19) is never taken."""


@dataclass(frozen=True, slots=True)
class _Last:
    """What the last body read taught: ``raw[:end]`` is everything before its ``messages``
    array's closing bracket and ``raw[end + 1:]`` everything after it; ``state`` hashed the
    canonical text up to the end of its last message, and ``after`` is the canonical text
    that follows the messages' closing bracket. Its top level was written compactly, each key
    once (checked when it was read whole), so the two byte ranges hold every other key."""

    raw: bytes
    end: int
    body: dict[str, Any]
    state: Any  # hashlib's sha256 object (its type is private)
    after: bytes

    def read(self, raw: bytes) -> tuple[_Last, dict[str, Any], str] | None:
        """``raw`` read by difference, or ``None`` when it is not this body with messages
        appended (and nothing else changed)."""
        before, tail = memoryview(self.raw)[: self.end], memoryview(self.raw)[self.end + 1 :]
        close = len(raw) - len(tail) - 1  # where the closing bracket would be
        if close < self.end or not raw.startswith(before) or not raw.endswith(tail):
            return None
        added = raw[self.end : close + 1]  # "]", or ",m1,…,mk]"
        state = self.state.copy()
        if added == b"]":
            new: list[Any] = []
        else:
            if added[0] != _COMMA or added[-1] != _CLOSE:
                return None
            try:
                new = _ANY.decode(b"[" + added[1:])
                canonical = _SORTED.encode(new)
            except (msgspec.DecodeError, RecursionError, UnicodeEncodeError):
                return None  # not JSON (or a lone surrogate: the whole reading's stdlib route)
            if not (isinstance(new, list) and new) or nesting(new) > NEW_NESTING:
                return None  # "[]": ",]" is no JSON; too deep: the whole reading decides
            state.update(b"," + canonical[1:-1])
        body = {**self.body, _MESSAGES: [*self.body[_MESSAGES], *new]}
        final = state.copy()
        final.update(b"]")
        final.update(self.after)
        return _Last(raw, close, body, state, self.after), body, final.hexdigest()


def _learnt(raw: bytes, body: dict[str, Any], canonical: bytes) -> tuple[_Last | None, str]:
    """The digest of a body decoded whole (by msgspec) whose canonical text is
    ``canonical``, and what the next read can start from — ``None`` when its shape does not
    allow it: no non-empty ``messages`` list, a top-level key that is not ASCII (the
    canonical order is then not plainly Python's), or a top level not written compactly with
    each key once."""
    learnt = _shape(raw, body, canonical)
    if learnt is None:
        return None, hashlib.sha256(canonical).hexdigest()
    end, after, close = learnt
    state = hashlib.sha256(memoryview(canonical)[:close])
    final = state.copy()
    final.update(memoryview(canonical)[close:])
    return _Last(raw, end, body, state, after), final.hexdigest()


def _shape(raw: bytes, body: dict[str, Any], canonical: bytes) -> tuple[int, bytes, int] | None:
    """Where ``raw``'s ``messages`` array closes, the canonical text after that array, and
    where the array closes in ``canonical`` — or ``None`` (:func:`_learnt`)."""
    messages = body.get(_MESSAGES)
    if not (isinstance(messages, list) and messages) or not all(key.isascii() for key in body):
        return None
    try:
        top = _TOP.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    keys = [_JSON.encode(key) for key in top]
    values = [bytes(value) for value in top.values()]
    written = b"{" + b",".join(k + b":" + v for k, v in zip(keys, values, strict=True)) + b"}"
    if written != raw:  # whitespace at the top level, or a key twice (or escaped)
        return None
    end = 0
    for key, written_key, value in zip(top, keys, values, strict=True):
        end += len(written_key) + 2  # '{' or ',', the key, ':'
        if key == _MESSAGES:
            end += len(value) - 1  # the array's closing bracket
            break
        end += len(value)
    later = (k for k in sorted(body) if k > _MESSAGES)
    after = b"".join(b"," + _JSON.encode(k) + b":" + _SORTED.encode(body[k]) for k in later) + b"}"
    close = len(canonical) - len(after) - 1
    if canonical[close] != _CLOSE or not canonical.endswith(after):
        return None
    return end, after, close


class RequestBodies:
    """Reads a gateway's request bodies, each by difference from the last (G1a)."""

    def __init__(self) -> None:
        self._last: _Last | None = None

    def forget(self) -> None:
        """Keep nothing of the last body (its delivery ended: nothing of a turn stays)."""
        self._last = None

    def read(self, raw: bytes) -> tuple[Any, str]:
        """``(body, digest)``: ``loads(raw, deep=False)`` and, for an object,
        ``request_digest`` of it (``""`` for any other JSON value); raises as they do
        (``ValueError``, ``RecursionError``). The body may share values with the last one
        read: read it, never change it."""
        last, self._last = self._last, None
        if last is not None and (found := last.read(raw)) is not None:
            self._last, body, digest = found
            return body, digest
        try:
            body = msgspec.json.decode(raw)  # loads' first try: the msgspec route
        except (msgspec.DecodeError, RecursionError):
            body = loads(raw, deep=False)  # the stdlib's route (lone surrogates), or raises
            return body, request_digest(body) if isinstance(body, dict) else ""
        if not isinstance(body, dict):
            return body, ""
        try:
            canonical = _SORTED.encode(body)
        except RecursionError:
            return body, request_digest(body)  # which raises as it always did (G19)
        self._last, digest = _learnt(raw, body, canonical)
        return body, digest
