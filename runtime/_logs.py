"""The fields of the runtime's log lines (docs/design/operations.md "Logs"; issue #22).

Every line the runtime logs is one event: a stable ``event`` name and, where they apply, the
stable fields of :data:`FIELDS`, passed as the record's ``extra`` (:func:`fields`). With
``--log-json`` each is a key of the line's JSON object; the plain format shows the message.

**No ids that are not already names, no text.** A delivery is logged by its key
(:func:`delivery_ref`: the hash its step journal's file is named by, never the client's id),
a room by its id (``dm:…``, ``guild:…``: the configuration's own vocabulary), a task by its
id (the operator's). Message text, prompts, model output and secrets are never fields, and
never in a message at info level.
"""

from __future__ import annotations

from typing import Final

from ._journal._store import delivery_key

__all__ = ["FIELDS", "delivery_ref", "fields"]

FIELDS: Final = ("event", "delivery", "room", "lane", "task", "epoch", "code", "outcome", "seq")
"""The stable field names, in the order a JSON line carries them."""


def delivery_ref(delivery_id: str) -> str:
    """A delivery as logs name it: the key of its step journal (``deliveries/<key>.log``,
    :func:`~runtime._journal._store.delivery_key`), so an operator can find it without the
    log holding the client's id."""
    return delivery_key(delivery_id)


def fields(
    event: str,
    *,
    delivery_id: str | None = None,
    room: str | None = None,
    lane: str | None = None,
    task: str | None = None,
    epoch: int | None = None,
    code: object | None = None,
    outcome: object | None = None,
    seq: int | None = None,
) -> dict[str, object]:
    """The ``extra`` of one log line: ``event`` and the fields that apply (``None`` ones
    left out); ``delivery_id`` logged as its :func:`delivery_ref`."""
    found: dict[str, object] = {"event": event}
    if delivery_id is not None:
        found["delivery"] = delivery_ref(delivery_id)
    for name, value in (
        ("room", room),
        ("lane", lane),
        ("task", task),
        ("epoch", epoch),
        ("code", None if code is None else str(code)),
        ("outcome", None if outcome is None else str(outcome)),
        ("seq", seq),
    ):
        if value is not None:
            found[name] = value
    return found
