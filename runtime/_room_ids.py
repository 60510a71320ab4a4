"""Room ids (docs/design/index.md, protocol.md): validated before anything else touches them,
never used raw in a path.

``guild:<guild>:<channel>`` and ``dm:<channel>``, where each part is 1 to 64 ASCII letters,
digits, ``_``, ``-`` or ``.``; or ``room:<opaque>`` with 1 to 200 printable, non-space
characters (for platforms such as Matrix). Pure (a bounded set remembers the ids found
valid: an admission checks its room several times); no I/O.
"""

from __future__ import annotations

import re
from typing import Final

from ._errors import DeliveryError, ReasonCode

__all__ = ["check_room", "room_problem"]

_PART: Final = r"[A-Za-z0-9_.\-]{1,64}"
_NAMED: Final = re.compile(rf"guild:{_PART}:{_PART}|dm:{_PART}")
_SHAPES: Final = "guild:<guild>:<channel>, dm:<channel> or room:<opaque>"


_VALID: Final[set[str]] = set()
"""Room ids found valid (every admission checks its room several times); bounded."""
_VALID_KEPT: Final = 65_536


def room_problem(room: object) -> str | None:
    """Why ``room`` is not a valid room id, or ``None`` when it is."""
    if not isinstance(room, str):
        return f"a room id is a string ({_SHAPES})"
    if room in _VALID:
        return None
    opaque = room.removeprefix("room:")
    if opaque != room:
        valid = (
            0 < len(opaque) <= 200 and opaque.isprintable() and not any(c.isspace() for c in opaque)
        )
    else:
        valid = _NAMED.fullmatch(room) is not None
    if not valid:
        return f"{room[:80]!r} is not a room id; expected {_SHAPES}"
    if len(_VALID) < _VALID_KEPT:
        _VALID.add(room)
    return None


def check_room(room: object) -> str:
    """``room`` if valid; else :class:`DeliveryError` (``room_invalid``) saying why."""
    problem = room_problem(room)
    if problem is not None:
        raise DeliveryError(ReasonCode.ROOM_INVALID, problem)
    assert isinstance(room, str)
    return room
