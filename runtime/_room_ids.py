"""Room ids (docs/design/index.md, protocol.md): validated before anything else touches them, never
used raw
in a path.

``guild:<guild>:<channel>`` and ``dm:<channel>``, where each part is 1 to 64 ASCII letters,
digits, ``_``, ``-`` or ``.``; or ``room:<opaque>`` with 1 to 200 printable, non-space
characters (for platforms such as Matrix). Pure; no I/O.
"""

from __future__ import annotations

import re
from typing import Final

from ._errors import DeliveryError, ReasonCode

__all__ = ["check_room", "room_problem"]

_PART: Final = r"[A-Za-z0-9_.\-]{1,64}"
_NAMED: Final = re.compile(rf"guild:{_PART}:{_PART}|dm:{_PART}")
_SHAPES: Final = "guild:<guild>:<channel>, dm:<channel> or room:<opaque>"


def room_problem(room: object) -> str | None:
    """Why ``room`` is not a valid room id, or ``None`` when it is."""
    if not isinstance(room, str):
        return f"a room id is a string ({_SHAPES})"
    opaque = room.removeprefix("room:")
    if opaque != room:
        valid = (
            0 < len(opaque) <= 200 and opaque.isprintable() and not any(c.isspace() for c in opaque)
        )
    else:
        valid = _NAMED.fullmatch(room) is not None
    if not valid:
        return f"{room[:80]!r} is not a room id; expected {_SHAPES}"
    return None


def check_room(room: object) -> str:
    """``room`` if valid; else :class:`DeliveryError` (``room_invalid``) saying why."""
    problem = room_problem(room)
    if problem is not None:
        raise DeliveryError(ReasonCode.ROOM_INVALID, problem)
    assert isinstance(room, str)
    return room
