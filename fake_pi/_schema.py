"""Tool-argument validation: the part of pi-schema that tool schemas use, with its coercions.

:func:`check` coerces arguments to a JSON schema as pi-schema does (scalars to strings, numeric
strings to numbers, one value to an array, ``"true"``/``"false"`` to booleans, an optional
``null`` to omitted) and reports what still does not fit in pi-schema's words. It knows nothing
about tools; :meth:`fake_pi._tools.Tool.validate` turns the failures into Pi's error text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["check", "js_string"]


def js_string(v: Any) -> str:
    """JavaScript's ``String(v)`` for JSON scalars."""
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def check(schema: Mapping[str, Any], value: Any) -> tuple[Any, list[str]]:
    """``value`` coerced to ``schema``, and one ``"path: message"`` per failure (``path`` dotted,
    ``root`` for ``value`` itself); no failures means the coerced value fits."""
    errors: list[tuple[str, str]] = []
    value = _check(schema, value, "", errors)
    return value, [f"{p[1:].replace('/', '.') or 'root'}: {m}" for p, m in errors]


def _type_name(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "Infinity" if v > 0 else ("-Infinity" if v < 0 else "NaN")
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "integer" if float(v).is_integer() else "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names.get(type(v), type(v).__name__)


def _coerce(kind: str, v: Any) -> Any:
    """pi-schema's coercions. What cannot be coerced is left for the check."""
    if kind == "string" and (v is None or isinstance(v, int | float)):
        return js_string(v)
    if kind in ("number", "integer") and isinstance(v, str | bool):
        try:
            n = float(v)
        except ValueError:
            return v
        if math.isfinite(n):
            return int(n) if kind == "integer" or n.is_integer() else n
    if kind == "boolean" and v in ("true", "false"):
        return v == "true"
    return [v] if kind == "array" and not isinstance(v, list) else v


_TYPE_OK: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "integer": lambda v: _type_name(v) == "integer",
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def _check(schema: Mapping[str, Any], v: Any, ptr: str, errors: list[tuple[str, str]]) -> Any:
    """``v`` coerced to ``schema``; each failure appended as (JSON pointer, pi-schema message)."""
    kind = schema.get("type")
    if isinstance(kind, str):
        v = _coerce(kind, v)
        if not _TYPE_OK.get(kind, lambda _: True)(v):
            errors.append((ptr, f"expected {kind}, got {_type_name(v)}"))
            return v
    if isinstance(v, str) and len(v) > schema.get("maxLength", math.inf):
        errors.append((ptr, f"expected at most {schema['maxLength']} characters"))
    if isinstance(v, dict):
        required, v = schema.get("required", []), dict(v)
        errors.extend((f"{ptr}/{k}", "missing") for k in required if k not in v)
        for key, sub in schema.get("properties", {}).items():
            if key in v and v[key] is None and key not in required:
                del v[key]  # an optional null counts as omitted
            elif key in v:
                v[key] = _check(sub, v[key], f"{ptr}/{key}", errors)
    if isinstance(v, list) and isinstance(items := schema.get("items"), dict):
        v = [_check(items, item, f"{ptr}/{i}", errors) for i, item in enumerate(v)]
    return v
