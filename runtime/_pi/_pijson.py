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
"""

from __future__ import annotations

import datetime
import decimal
import json
import math
import re
from collections.abc import Mapping
from typing import Any, Final

import msgspec

__all__ = ["iso_timestamp", "loads", "stringify"]

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
    JavaScript could write them.
    """
    return _encoder.encode(_js_ready(value))


def loads(data: bytes) -> Any:
    """Decode one JSON text; ``stringify(loads(data)) == data`` for what ``stringify`` wrote.

    Objects keep their key order. Unlike ``msgspec.json.decode`` it accepts the escapes of
    lone surrogates. Raises ``msgspec.DecodeError`` (a ``ValueError``) for anything that is
    not JSON, including invalid UTF-8 and the constants ``NaN`` and ``Infinity``, and for
    JSON nested too deeply to decode (msgspec's ``RecursionError``, from about a thousand
    levels: a model's tool arguments can be that, and a line is never let crash a reader).
    """
    try:
        return msgspec.json.decode(data)
    except RecursionError:  # nested too deep for any decoder here: refused as a line
        raise msgspec.DecodeError("JSON nested too deeply") from None
    except msgspec.DecodeError:
        try:
            return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
        except (ValueError, RecursionError):
            raise msgspec.DecodeError("invalid JSON") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


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
