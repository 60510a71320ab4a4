"""JSON exactly as JavaScript writes it: :func:`stringify` and its inverse :func:`loads`.

Pi writes its files with ``JSON.stringify``; a line the runtime adds must be the bytes Pi
would have written (``docs/design/sessions.md``, S2). msgspec alone is not enough. It keeps
insertion order and compact separators, but it differs from ``JSON.stringify`` on:

* numbers: ``100.0`` is ``100``, ``1e21`` is ``1e+21``, ``1e16`` is ``10000000000000000``
  and ``-0.0`` is ``0`` in JavaScript;
* key order: JavaScript enumerates array-index keys (``"2"``, ``"10"``) first, ascending;
* lone surrogates: JavaScript writes them as ``\\udxxx`` escapes; msgspec cannot encode
  them, nor decode those escapes.

So :func:`stringify` rewrites the value first (numbers pre-rendered with ECMAScript's
``Number::toString`` as ``msgspec.Raw``, index keys moved to the front, strings holding
surrogates rendered as JavaScript renders them) and lets msgspec do the rest, and
:func:`loads` falls back to the stdlib for the escapes msgspec rejects.

Depth: msgspec and the stdlib recurse, and stop at about a thousand levels (fewer on a deep
stack). JavaScript's ``JSON.parse`` does not, and Pi writes what a model sent — tool
arguments nested a few thousand levels deep included (``docs/design/pi-observed.md`` §11).
So :func:`loads` reads JSON nested deeper than they go with an iterative reader of the same
semantics, up to :data:`MAX_DEPTH` levels, and refuses deeper JSON as a decode error.
"""

from __future__ import annotations

import datetime
import decimal
import json
import math
import re
from _json import scanstring  # the stdlib's C string scanner, as json.loads uses it
from collections.abc import Mapping
from typing import Any, Final

import msgspec

__all__ = ["MAX_DEPTH", "iso_timestamp", "loads", "nesting", "stringify"]

MAX_DEPTH: Final = 5_000
"""How deep :func:`loads` reads: more levels of arrays and objects than Pi can write. Node's
recursive ``JSON.stringify`` stops at about 4,160 levels with its default stack (Pi 1.6.0 on
Node 22), and Pi fails its own model call before that (pi-observed.md §11)."""

_SURROGATE: Final = re.compile("[\ud800-\udfff]")
_encoder: Final = msgspec.json.Encoder()


def stringify(value: Any) -> bytes:
    """UTF-8 bytes identical to JavaScript's ``JSON.stringify(value)`` (no indent, no LF).

    ``value`` is built from ``None``, ``bool``, ``int``, ``float``, ``str``, lists, tuples
    and mappings with string keys. Compact separators; keys in insertion order, except that
    array-index keys come first, ascending; non-ASCII unescaped; control characters escaped
    as JavaScript escapes them; JavaScript number format; lone surrogates as ``\\udxxx``.

    Raises ``ValueError`` for what JavaScript cannot write exactly (NaN and infinities, which
    ``JSON.stringify`` turns into ``null``; an integer no JavaScript number holds exactly),
    never rounding it, and ``TypeError`` for a non-string key or any other type. Object keys
    holding surrogates are refused too (``UnicodeEncodeError``, a ``ValueError``), although
    JavaScript could write them, and so is a value nested deeper than Python recurses (about
    a thousand levels; the runtime writes no such line).
    """
    try:
        return _encoder.encode(_js_ready(value))
    except RecursionError:
        raise ValueError("nested too deeply for this encoder (about a thousand levels)") from None


def loads(data: bytes, *, deep: bool = True) -> Any:
    """Decode one JSON text; ``stringify(loads(data)) == data`` for what ``stringify`` wrote.

    Objects keep their key order. Unlike ``msgspec.json.decode`` it accepts the escapes of
    lone surrogates. Raises ``msgspec.DecodeError`` (a ``ValueError``) for anything that is
    not JSON, including invalid UTF-8 and the constants ``NaN`` and ``Infinity``.

    JSON nested deeper than msgspec and the stdlib recurse (about a thousand levels) is read
    by an iterative reader with the same results, up to :data:`MAX_DEPTH` levels: a line Pi
    wrote for a model's deeply nested tool arguments is read like any other. Deeper JSON is
    a ``msgspec.DecodeError``, never a ``RecursionError``. With ``deep=False`` JSON that
    deep is refused at once: for input the runtime never needs to read that deep, so that a
    large body is not read by the slower reader only to be refused.

    A value read this deep is as deep: code that walks it must not recurse (the runtime
    only reads its top levels; :func:`nesting` measures it without recursing).
    """
    try:
        return msgspec.json.decode(data)
    except RecursionError:  # deeper than msgspec recurses: read without recursing
        pass
    except msgspec.DecodeError:
        try:
            return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
        except RecursionError:  # a lone surrogate's escape, and as deep
            pass
        except ValueError:
            raise msgspec.DecodeError("invalid JSON") from None
    if not deep:
        raise msgspec.DecodeError("JSON nested too deeply")
    try:
        return _loads_deep(data.decode("utf-8"))
    except ValueError as error:  # UnicodeDecodeError too
        raise msgspec.DecodeError(f"invalid JSON: {error}") from None


def nesting(value: Any) -> int:
    """How many levels of lists and dicts ``value`` nests (a scalar 0, ``{}`` and ``[]`` 1,
    ``{"a": [1]}`` 2), measured without recursing however deep it is."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, depth = level.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        level.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_SPACE: Final = re.compile(r"[ \t\n\r]*")
_NUMBER: Final = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_LITERALS: Final = {"true": True, "false": False, "null": None}


def _skip_space(text: str, at: int) -> int:
    found = _SPACE.match(text, at)
    assert found is not None  # it matches the empty string too
    return found.end()


def _loads_deep(text: str) -> Any:
    """JSON as :func:`loads` reads it, with an explicit stack instead of recursion.

    The same results: objects in key order (a repeated key keeps its first place and its
    last value), integers as ``int`` and numbers with a fraction or exponent as ``float``,
    strings by the stdlib's own scanner (lone surrogates' escapes included, raw control
    characters refused). Raises ``ValueError`` for anything else, and for more than
    :data:`MAX_DEPTH` levels.
    """
    space, scan = _skip_space, scanstring
    stack: list[list[Any] | dict[str, Any]] = []
    keys: list[str] = []  # the pending key of each open object, innermost last
    end = len(text)
    at = space(text, 0)

    def key_at(at: int) -> tuple[str, int]:
        if text.startswith('"', at):
            key, at = scan(text, at + 1, True)
            at = space(text, at)
            if text.startswith(":", at):
                return key, space(text, at + 1)
        raise ValueError(f"expected a key and ':' at {at}")

    while True:
        char = text[at : at + 1]
        value: Any
        if char in ("[", "{"):
            if len(stack) >= MAX_DEPTH:
                raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
            at = space(text, at + 1)
            if text.startswith("]" if char == "[" else "}", at):
                value, at = ([] if char == "[" else {}), at + 1
            elif char == "[":
                stack.append([])
                continue
            else:
                key, at = key_at(at)
                stack.append({})
                keys.append(key)
                continue
        elif char == '"':
            value, at = scan(text, at + 1, True)
        elif (number := _NUMBER.match(text, at)) is not None:
            fraction, exponent = number.groups()
            value = float(number[0]) if fraction or exponent else int(number[0])
            at = number.end()
        else:
            word = next((w for w in _LITERALS if text.startswith(w, at)), None)
            if word is None:
                raise ValueError(f"expected a value at {at}")
            value, at = _LITERALS[word], at + len(word)
        while True:  # place the value; close every container it ends
            at = space(text, at)
            if not stack:
                if at != end:
                    raise ValueError(f"trailing characters at {at}")
                return value
            top = stack[-1]
            if isinstance(top, list):
                top.append(value)
            else:
                top[keys[-1]] = value
            char = text[at : at + 1]
            if char == ",":
                at = space(text, at + 1)
                if isinstance(top, dict):
                    keys[-1], at = key_at(at)
                break
            if char != ("]" if isinstance(top, list) else "}"):
                raise ValueError(f"expected ',' or the container's end at {at}")
            value, at = stack.pop(), at + 1
            if isinstance(value, dict):
                keys.pop()


def _js_number(value: float) -> str:
    """ECMAScript ``Number::toString`` of a double (Python's repr has the same digits)."""
    if not math.isfinite(value):
        raise ValueError("NaN and infinities are not JSON (JSON.stringify writes null)")
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    dec = decimal.Decimal(repr(abs(value))).as_tuple()
    assert isinstance(dec.exponent, int)
    n = len(dec.digits) + dec.exponent  # value = 0.<digits> * 10**n
    s = "".join(map(str, dec.digits)).rstrip("0")
    k = len(s)
    if k <= n <= 21:
        return sign + s + "0" * (n - k)
    if 0 < n <= 21:
        return sign + s[:n] + "." + s[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * -n + s
    mantissa = s if k == 1 else s[0] + "." + s[1:]
    return f"{sign}{mantissa}e{'+' if n >= 1 else '-'}{abs(n - 1)}"


def _js_string(value: str) -> msgspec.Raw:
    """A string holding surrogates: JavaScript joins valid pairs, escapes lone halves."""
    joined = value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    text = _SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", json.dumps(joined, ensure_ascii=False))
    return msgspec.Raw(text.encode("utf-8"))


def _is_index(key: str) -> bool:
    """An array-index key, which JavaScript objects enumerate first, ascending."""
    return (
        key.isascii() and key.isdigit() and (key == "0" or key[0] != "0") and int(key) < 2**32 - 1
    )


def _js_ready(value: Any) -> Any:
    """Rewrite ``value`` so that msgspec emits what ``JSON.stringify`` would."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _js_string(value) if _SURROGATE.search(value) else value
    if isinstance(value, int):
        if abs(value) <= 2**53 - 1:
            return value
        text = _js_number(float(value)) if abs(value) < 1e21 else ""
        if text != str(value):  # JavaScript cannot hold it: refuse, do not round
            raise ValueError(f"integer {value} is not exact as a JavaScript number")
        return msgspec.Raw(text.encode("ascii"))
    if isinstance(value, float):
        return msgspec.Raw(_js_number(value).encode("ascii"))
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("JSON object keys must be strings")
        keys = sorted(filter(_is_index, value), key=int) + [k for k in value if not _is_index(k)]
        return {k: _js_ready(value[k]) for k in keys}
    if isinstance(value, list | tuple):
        return [_js_ready(item) for item in value]
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def iso_timestamp(time_ms: int) -> str:
    """Format epoch milliseconds the way Pi writes entry timestamps.

    >>> iso_timestamp(1795978324855)
    '2026-11-29T18:52:04.855Z'
    """
    moment = datetime.datetime.fromtimestamp(time_ms / 1000, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{time_ms % 1000:03d}Z"
