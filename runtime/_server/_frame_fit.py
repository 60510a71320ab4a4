"""Server frames cut to fit ``[server] max_frame_bytes`` (docs/design/protocol.md P15): a
``status`` or a ``task_list`` carries the rooms or tasks, sorted, that fit, and says how many
it left out (the next page starts ``after`` the last one carried); a ``task_view`` too large
for a frame carries its latest receipts that fit, and when even none leaves room, its longer
texts cut, marked ``truncated`` (pure).

Only what the bound counts is measured: each part's UTF-8 JSON (:data:`encode`)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, TypeVar

import msgspec

from .._wire import TaskView
from ._protocol import TaskList, TaskViewFrame

__all__ = ["encode", "fit_prefix", "fit_task_list", "fit_task_view", "fitting", "sorted_after"]

encode: Final = msgspec.json.Encoder().encode
"""The UTF-8 JSON of a frame or of a part of one (what the frame bound counts)."""
_encode: Final = encode

T = TypeVar("T")


def fitting(items: Iterable[Any], room: int) -> int:
    """How many of ``items``, from the first, fit in ``room`` bytes as the elements of a JSON
    array (each encoded, a comma between two)."""
    return len(fit_prefix(items, room))


def fit_prefix(items: Iterable[T], room: int) -> list[T]:
    """The first of ``items`` that fit in ``room`` bytes as the elements of a JSON array
    (:func:`fitting`); an iterator is taken no further than the first that does not fit."""
    size = 0
    fit: list[T] = []
    for item in items:
        size += len(_encode(item)) + bool(fit)  # its comma
        if size > room:
            break
        fit.append(item)
    return fit


def sorted_after(items: Sequence[T], key: Callable[[T], str], after: str | None) -> Sequence[T]:
    """The ``items`` (sorted by ``key``) whose key sorts after ``after``; all for ``None``."""
    if after is None:
        return items
    return items[bisect.bisect_right([key(item) for item in items], after) :]


_CUT_FIELDS: Final = (
    "session_path",
    "session_id",
    "route",
    "worktree",
    "process",
    "probe",
    "prompt_marker",
    "budget",
    "pending_action",
    "hold_reason",
    "next_action",
    "telemetry",
    "ended",
    "costs",
    "finalization",
    "failure",
)
"""The parts of a view whose texts may be cut; its ids, state, classification and phase stay
whole."""

_EMPTIED: Final[dict[str, Any]] = {
    "session_id": None,
    "route": {},
    "process": None,
    "probe": None,
    "prompt_marker": None,
    "budget": {},
    "pending_action": None,
    "hold_reason": None,
    "telemetry": {},
    "ended": None,
    "costs": None,
    "finalization": None,
    "failure": None,
}
"""What a view's parts become when even their texts cut to nothing leave no room (a bound
near its least with an id at its longest)."""


def fit_task_list(views: Sequence[TaskView], bound: int) -> TaskList:
    """A ``task_list`` of ``views`` (sorted by task id) that fits ``bound`` bytes: the views
    that fit whole, in order — the first one cut (:func:`fit_task_view`) when it alone does
    not fit, so that a page always carries a task — and how many more there are."""
    size = len(_encode(TaskList(tasks=[], tasks_left_out=len(views))))  # the count at its widest
    carried = list(views[: fitting(views, bound - size)])
    if not carried and views:
        carried = [_fit(views[0], bound - size)]
    return TaskList(tasks=carried, tasks_left_out=len(views) - len(carried))


def fit_task_view(view: TaskView, bound: int) -> TaskView:
    """``view`` as a ``task_view`` frame of at most ``bound`` bytes carries it: whole when it
    fits; else with its latest receipts that fit and ``receipts_left_out`` the earlier ones;
    else with none and its longer texts cut, ``truncated``."""
    tag = len(_encode(TaskViewFrame.of(view))) - len(_encode(view))
    return _fit(view, bound - tag)


def _fit(view: TaskView, room: int) -> TaskView:
    """:func:`fit_task_view` of a view encoded without its tag, in ``room`` bytes."""
    if len(_encode(view)) <= room:
        return view
    receipts = view.receipts
    bare = msgspec.structs.replace(view, receipts=[], receipts_left_out=len(receipts))
    base = len(_encode(bare))
    kept = fitting(reversed(receipts), room - base)
    if base <= room:
        left_out = len(receipts) - kept
        return msgspec.structs.replace(
            view, receipts=receipts[left_out:], receipts_left_out=left_out
        )
    return _cut(msgspec.structs.replace(bare, truncated=True), room)


def _cut(view: TaskView, room: int) -> TaskView:
    """``view`` with every text of :data:`_CUT_FIELDS` cut to the longest length that fits
    ``room`` (found by halving), or those parts emptied when none does."""
    parts = {name: getattr(view, name) for name in _CUT_FIELDS}
    low, high = 0, max(_longest(part) for part in parts.values())
    best: TaskView | None = None
    while low <= high:
        middle = (low + high) // 2
        cut = msgspec.structs.replace(
            view, **{name: _cut_texts(part, middle) for name, part in parts.items()}
        )
        if len(_encode(cut)) <= room:
            best, low = cut, middle + 1
        else:
            high = middle - 1
    if best is not None:
        return best
    emptied = {name: _cut_texts(part, 0) for name, part in parts.items()} | _EMPTIED
    return msgspec.structs.replace(view, **emptied)


def _cut_texts(value: Any, limit: int) -> Any:
    """``value`` with every string in it (not the keys) cut to ``limit`` characters."""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, dict):
        return {key: _cut_texts(item, limit) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_cut_texts(item, limit) for item in value]
    return value


def _longest(value: Any) -> int:
    """The length of the longest string in ``value`` (0 if none)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return max((_longest(item) for item in value.values()), default=0)
    if isinstance(value, list | tuple):
        return max((_longest(item) for item in value), default=0)
    return 0
