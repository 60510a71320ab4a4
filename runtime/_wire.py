"""Every value a client sees: the vocabulary leaf the wire protocol, the room worker and the
task lanes share (docs/design/protocol.md). Plain msgspec Structs with no I/O, so
``runtime._server._protocol`` can be pure.

* Room signals (not durable; docs/design/serve.md): ``typing`` once the reply can no longer
  become silent (and every ``typing_refresh`` seconds after), ``text_update`` when the agent
  calls ``send_text_update``, ``tool_activity`` when a tool starts and ends. Tagged by
  ``type``, so the server sends them as wire frames unchanged.
* Deliveries: :class:`Accepted` (admitted durably), :class:`DeliveryResult` (how one ended),
  :class:`RoomStatus` (one lane in ``status``).
* Tasks: :class:`TaskSpec` (as submitted), :class:`TaskView` (what ``task show`` prints),
  :class:`TaskEvent` (a classification or state changed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final, Literal

import msgspec

from ._errors import ReasonCode
from ._records import AttachmentRef, Outcome, ResultPublished

__all__ = [
    "DEFAULT_TASK_GRANTS",
    "DEFAULT_VALIDATION_TIMEOUT",
    "MAX_ATTACHMENT_NAME",
    "MAX_ID",
    "MAX_SEQ",
    "Accepted",
    "Attachment",
    "DeliveryResult",
    "RoomEvent",
    "RoomStatus",
    "TaskEvent",
    "TaskSpec",
    "TaskView",
    "TextUpdate",
    "ToolActivity",
    "Typing",
    "fit_reply_text",
    "fit_result",
    "largest_update_bytes",
    "least_room_for_text",
    "room_for_text",
]

MAX_ID: Final = 200
"""Longest ``delivery_id``, ``message_id`` or author id accepted (characters)."""
MAX_ATTACHMENT_NAME: Final = 200
"""Longest attachment name (characters)."""
MAX_SEQ: Final = 2**63 - 1
"""No result's ``seq`` passes it (a PostgreSQL ``bigint``); the frame bound counts on it."""
_LONGEST_ROOM: Final = "room:" + "\U0010ffff" * 200
"""The longest room id in UTF-8 bytes (``room:`` and 200 characters, ``_room_ids``)."""
_WIDEST: Final = "\U0010ffff"
"""A printable character of the most UTF-8 bytes (4; an escaped control character is 6, but
ids and names are printable)."""
_LONGEST_CODE: Final = max((str(code) for code in ReasonCode), key=len)


class Typing(msgspec.Struct, frozen=True, kw_only=True, tag="typing"):
    room: str
    delivery_id: str


class TextUpdate(msgspec.Struct, frozen=True, kw_only=True, tag="text_update"):
    room: str
    delivery_id: str
    reply_to: str
    """The message id of the message being answered (the update is threaded on it)."""
    text: str


class ToolActivity(msgspec.Struct, frozen=True, kw_only=True, tag="tool_activity"):
    room: str
    delivery_id: str
    tool: str
    phase: Literal["start", "end"]


RoomEvent = Typing | TextUpdate | ToolActivity


class Attachment(msgspec.Struct, frozen=True, kw_only=True):
    """One attachment of a result as the receiver sees it (docs/design/attachments.md):
    fetch its bytes with ``fetch_attachment {id}``. ``lost``: the server could not find its
    bytes intact when it sent the result (``code`` says why); the words went out anyway."""

    id: str
    name: str
    media_type: str
    size: int
    sha256: str
    lost: bool = False
    code: str | None = None

    @classmethod
    def of(cls, ref: AttachmentRef) -> Attachment:
        return cls(
            id=ref.id, name=ref.name, media_type=ref.media_type, size=ref.size, sha256=ref.sha256
        )


class DeliveryResult(msgspec.Struct, frozen=True, kw_only=True, tag="result"):
    """How one delivery ended, as the receiver sees it (the wire's ``result`` frame)."""

    seq: int
    delivery_id: str
    room: str
    outcome: Outcome
    text: str | None = None
    code: str | None = None
    absorbed_into: str | None = None
    attachments: list[Attachment] = msgspec.field(default_factory=list)
    """A reply's pictures and files, in the order the agent attached them."""
    truncated: bool = False
    """The reply's text was longer than a result frame carries (``[server] max_frame_bytes``,
    protocol.md P14): ``text`` is its beginning, cut at a character. The whole reply stays in
    the room's session. (A result recorded under a configuration that allowed more attachments
    than the frame now holds: ``attachments`` are the first of them, too.)"""

    @classmethod
    def of(cls, record: ResultPublished) -> DeliveryResult:
        return cls(
            seq=record.seq,
            delivery_id=record.delivery_id,
            room=record.room,
            outcome=record.outcome,
            text=record.text,
            code=record.code,
            absorbed_into=record.absorbed_into,
            attachments=[Attachment.of(ref) for ref in record.attachments],
            truncated=record.truncated,
        )


def room_for_text(
    *, delivery_id: str, room: str, attachments: Iterable[Attachment], max_frame_bytes: int
) -> int:
    """How many UTF-8 bytes of JSON-encoded text a reply's ``result`` frame has room for
    within ``max_frame_bytes`` (protocol.md P14), counting the frame at its largest: the
    largest ``seq``, ``truncated`` set, and every attachment marked lost with the longest
    code (the server marks an attachment lost when it sends the frame, after the text was
    fitted)."""
    frame = DeliveryResult(
        seq=MAX_SEQ,
        delivery_id=delivery_id,
        room=room,
        outcome=Outcome.REPLY,
        text="",
        attachments=[
            msgspec.structs.replace(a, lost=True, code=_LONGEST_CODE) for a in attachments
        ],
        truncated=True,
    )
    return max_frame_bytes - len(msgspec.json.encode(frame))


def largest_update_bytes(text_update_chars: int) -> int:
    """The UTF-8 bytes of the largest ``text_update`` frame: the longest ids in the widest
    characters and ``text_update_chars`` characters of the most bytes each (config.md C15)."""
    frame = TextUpdate(
        room=_LONGEST_ROOM, delivery_id=_WIDEST * MAX_ID, reply_to=_WIDEST * MAX_ID, text=""
    )
    return len(msgspec.json.encode(frame)) + _MAX_ESCAPED * text_update_chars


def least_room_for_text(
    *, max_frame_bytes: int, max_per_reply: int, media_types: Iterable[str], max_bytes: int
) -> int:
    """:func:`room_for_text` for the largest frame a configuration allows: the longest ids
    and names in the widest characters, ``max_per_reply`` attachments of the longest media
    type and largest size (config.md C15)."""
    widest = Attachment(
        id="f" * 64,
        name=_WIDEST * MAX_ATTACHMENT_NAME,
        media_type=max(media_types, key=len, default=""),
        size=max_bytes,
        sha256="f" * 64,
    )
    return room_for_text(
        delivery_id=_WIDEST * MAX_ID,
        room=_LONGEST_ROOM,
        attachments=[widest] * max_per_reply,
        max_frame_bytes=max_frame_bytes,
    )


def fit_reply_text(text: str, room: int) -> tuple[str, bool]:
    """``text`` as a result frame with ``room`` bytes for it (:func:`room_for_text`) carries
    it: whole, or its longest beginning that fits, cut at a character; and whether it was cut
    (protocol.md P14)."""

    def fits(length: int) -> bool:
        return len(msgspec.json.encode(text[:length])) - 2 <= room  # less the quotes

    if _MAX_ESCAPED * len(text) <= room or fits(len(text)):
        return text, False
    shortest, longest = 0, len(text)  # text[:shortest] fits; text[:longest] does not
    while longest - shortest > 1:
        middle = (shortest + longest) // 2
        if fits(middle):
            shortest = middle
        else:
            longest = middle
    return text[:shortest], True


def fit_result(result: DeliveryResult, max_frame_bytes: int) -> DeliveryResult:
    """``result`` as a frame of at most ``max_frame_bytes`` carries it (protocol.md P14):
    unchanged when it fits, else with its text cut and ``truncated`` — for a result recorded
    under a larger bound than the one it is sent under now (the configuration changed). When
    its attachments alone leave no room (recorded under a configuration that allowed more
    of them a reply), those after the last one that leaves room are left out as well."""
    if result.text is None and not result.attachments:
        return result
    attachments = list(result.attachments)

    def room() -> int:
        return room_for_text(
            delivery_id=result.delivery_id,
            room=result.room,
            attachments=attachments,
            max_frame_bytes=max_frame_bytes,
        )

    while attachments and room() < 0:
        attachments.pop()
    left_out = len(attachments) < len(result.attachments)
    text, cut = (None, False) if result.text is None else fit_reply_text(result.text, room())
    if not (cut or left_out):
        return result
    return msgspec.structs.replace(result, text=text, attachments=attachments, truncated=True)


_MAX_ESCAPED: Final = 6
"""The most bytes one character of a JSON string takes (a control character, ``\\u001f``)."""


class Accepted(msgspec.Struct, frozen=True, kw_only=True, tag="accepted"):
    """A delivery was admitted durably (or was already): the wire's ``accepted`` frame."""

    delivery_id: str
    room: str
    disposition: Literal["started", "steered", "queued", "duplicate"]


class RoomStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One room lane as ``status`` reports it (the wire's ``status.rooms`` items)."""

    room: str
    state: Literal["idle", "running"]
    queued: int
    """Deliveries admitted and waiting behind the running one."""
    live_worker: bool
    last_result_seq: int
    """The seq of the room's latest published result; 0 when there is none."""


class TaskEvent(msgspec.Struct, frozen=True, kw_only=True, tag="task_event"):
    """A task's classification or state changed (the wire's ``task_event`` frame)."""

    task_id: str
    state: str
    classification: str
    phase: str
    process_epoch: int
    hold_reason: str | None = None
    ended: str | None = None


DEFAULT_VALIDATION_TIMEOUT: Final = 600.0


DEFAULT_TASK_GRANTS: Final = frozenset({"read", "bash", "edit", "write"})


class TaskSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A task as submitted (API, command line, wire)."""

    task_id: str
    prompt: str
    worktree: str
    grants: frozenset[str] = DEFAULT_TASK_GRANTS
    validation: tuple[str, ...] = ()
    """A command (argv) whose passing receipt Done needs; empty: none."""
    validation_timeout: float = DEFAULT_VALIDATION_TIMEOUT
    """Seconds the validation command may run; past them it is killed and has not passed."""


class TaskView(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``pi-runtime task show`` prints (docs/design/watchdog.md's diagnostics list)."""

    task_id: str
    state: str
    generation: int
    attempt: int
    fence: int
    process_epoch: int
    continuation_epoch: int
    session_path: str
    session_id: str | None
    route: dict[str, Any]
    worktree: str
    process: dict[str, Any] | None
    """pid, start time, boot id, nonce of the live epoch."""
    classification: str
    phase: str
    progress_seq: int
    silence_seconds: float
    """How long the worker has been silent, while :attr:`silence_watched`; else ``0.0``, no
    measurement."""
    soft_seconds: float
    probe: str | None
    hard_seconds: float | None
    grace_seconds: float
    grace: str
    receipts: list[dict[str, Any]]
    prompt_marker: str | None
    budget: dict[str, Any]
    pending_action: str | None
    hold_reason: str | None
    next_action: str
    timescale: float
    telemetry: dict[str, Any]
    ended: dict[str, Any] | None = None
    costs: dict[str, Any] | None = None
    """Model answers and tokens, the task's own and its continuations' apart
    (:func:`inference_costs`): from the log (``task show`` offline, an ended task)."""
    finalization: dict[str, Any] | None = None
    """What the last finalization attempt that found the Done tuple incomplete found (its
    code, what was missing, the manifest, candidate and validation receipt: LK10)."""
    failure: dict[str, Any] | None = None
    """Why the task's lane stopped without an end (TL11): ``{"code", "message"}``; the task
    stays unfinished in its log for the next start."""
    receipts_left_out: int = 0
    """The earliest receipts a frame bound left out (``receipts`` holds the latest; protocol.md
    P15); ``task show`` on the server's host prints them all."""
    truncated: bool = False
    """Its longer texts were cut to fit a frame bound (protocol.md P15)."""
    silence_watched: bool = False
    """Whether the watchdog measures the worker's silence now (its lane runs here, no end, no
    lane failure, a prompt being worked on: WD7); when not, ``silence_seconds`` says nothing
    (OP11)."""
