"""Room ids (runtime._room_ids): the check's answer never depends on what it saw before."""

from __future__ import annotations

import pytest

from runtime import _room_ids
from runtime._room_ids import room_problem


@pytest.mark.parametrize(
    "room",
    ["dm:", "dm:a b", "guild:1", "room:", "room:a b", "x" * 300, "dm:" + "a" * 65, "DM:1"],
)
def test_an_invalid_room_stays_invalid_after_valid_ones(room: str) -> None:
    """Remembering valid ids (an admission checks its room several times) never lets an
    invalid one through, before or after valid ones were seen."""
    first = room_problem(room)
    assert first is not None
    for valid in ("dm:1", "guild:g:c", "room:!abc:matrix.org", room.strip() + "1"):
        room_problem(valid)
    assert room_problem(room) == first


def test_remembered_valid_ids_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The set of remembered ids stops growing at its bound; ids past it are still checked."""
    monkeypatch.setattr(_room_ids, "_VALID", set())
    monkeypatch.setattr(_room_ids, "_VALID_KEPT", 3)
    for n in range(10):
        assert room_problem(f"dm:{n}") is None
    assert len(_room_ids._VALID) == 3
    assert room_problem("dm:9") is None
    assert room_problem("dm:9 ") is not None
    assert room_problem(7) is not None
