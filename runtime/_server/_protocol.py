"""The websocket wire protocol (docs/design/protocol.md): its frames as types, decoded and
encoded (pure).

Every frame is one JSON object in one websocket text frame, tagged by ``type``. Client frames
are inbound commands: strict (``forbid_unknown_fields``), and every way one can be wrong is
a :class:`~runtime._errors.ProtocolError` with its own stable code. Server frames are the
runtime's own objects where one exists — :class:`~runtime._rooms._worker.Accepted`,
:class:`~runtime._rooms._outbox.DeliveryResult` and the room events of :mod:`runtime._wire` — so
the server sends them unchanged; clients must ignore fields they do not know (new fields are
only ever added, with defaults).

``python -m runtime._server._protocol --schema`` prints the JSON Schema of both directions,
generated from these types; ``docs/protocol.schema.json`` is that output, and a test keeps them
equal. The page is ``docs/design/protocol.md``; the invariants P1..P21 are stated there. The
task frames (``task_*``) drive task lanes (docs/design/watchdog.md, issue #8): their server
frames are the task runner's own objects too (:class:`~runtime._tasks._state.TaskView`,
:class:`~runtime._tasks._runner.TaskEvent`).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Collection, Iterable, Sequence
from typing import Annotated, Any, Final, Literal, NoReturn, get_args

import msgspec

from .._errors import PiRuntimeError, ProtocolError, ReasonCode
from .._rooms._admission import Author, HistoryItem
from .._tasks._guards import MAX_GRANT_EPOCHS, MAX_GRANT_SECONDS
from .._wire import (
    MAX_ID,
    Accepted,
    DeliveryResult,
    RoomStatus,
    TaskEvent,
    TaskView,
    TextUpdate,
    ToolActivity,
    Typing,
)

__all__ = [
    "CLIENT_FRAME_TYPES",
    "MAX_FRAME_BYTES",
    "MAX_VALIDATION_TIMEOUT",
    "PROTOCOL_VERSION",
    "SUPPORTED_PROTOCOLS",
    "Ack",
    "AttachmentData",
    "Cancel",
    "ClientFrame",
    "Deliver",
    "ErrorFrame",
    "FetchAttachment",
    "GrantEpochs",
    "GrantSeconds",
    "Hello",
    "RoomStatus",
    "ServerFrame",
    "StatusReport",
    "StatusRequest",
    "TaskAccepted",
    "TaskControl",
    "TaskEvent",
    "TaskList",
    "TaskReplyFrame",
    "TaskShow",
    "TaskSubmit",
    "TaskViewFrame",
    "ValidationTimeout",
    "Welcome",
    "decode_client_frame",
    "decode_server_frame",
    "encode_client_frame",
    "encode_server_frame",
    "error_frame",
    "frame_ref",
    "frame_type",
    "main",
    "negotiate",
    "reject_binary_frame",
    "schema",
    "schema_text",
]

PROTOCOL_VERSION: Final = 1
"""The newest protocol version this server speaks."""
SUPPORTED_PROTOCOLS: Final = frozenset({PROTOCOL_VERSION})
"""Every protocol version this server speaks; ``hello`` picks the highest one in common."""
MAX_FRAME_BYTES: Final = 256 * 1024
"""The default bound on one client frame, in UTF-8 bytes."""

MAX_VALIDATION_TIMEOUT: Final = 86_400.0
"""The longest ``validation_timeout`` a ``task_submit`` may ask, in seconds: a day, the task
lanes' own bound (``runtime._tasks._state``, TL1; not imported: this module stays pure)."""

_Seq = Annotated[int, msgspec.Meta(ge=0)]
# P18: a task frame's numbers are bounded where they are decoded, ``wrong_type`` naming the
# field and its bound whatever the task's state (before, ``1e308`` seconds of an ``abort``
# was taken and ignored, and a grant's range was looked at only once its task was found)
GrantEpochs = Annotated[int, msgspec.Meta(ge=0, le=MAX_GRANT_EPOCHS)]
GrantSeconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_GRANT_SECONDS)]
ValidationTimeout = Annotated[float, msgspec.Meta(gt=0, le=MAX_VALIDATION_TIMEOUT)]


# -- client → server ---------------------------------------------------------------------


class _ClientFrame(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"
):
    pass


class Hello(_ClientFrame, tag="hello", frozen=True, kw_only=True):
    """The first frame of a connection: which protocol versions the client speaks, its token,
    and (optionally) the last result seq it holds."""

    protocol: int | list[int]
    """One version, or every version the client speaks; the server picks the highest."""
    token: str
    client: str
    """The client's name and version, for the server's logs."""
    ack_seq: _Seq | None = None
    """Every result up to this seq is acknowledged (as by ``ack``) before the re-send."""


class Deliver(_ClientFrame, tag="deliver", frozen=True, kw_only=True):
    """One room message to answer; ``delivery_id`` is the client's idempotency key."""

    delivery_id: str
    room: str
    author: Author
    message_id: str
    text: str
    history: list[HistoryItem] | None = None

    def request(self) -> dict[str, Any]:
        """The delivery as decoded JSON without its tag, for ``RoomWorker.deliver``, which
        checks what the shape cannot (room id, id lengths, text, caps: ``room_invalid``,
        ``delivery_invalid``). A ``Deliver`` is deliberately not a ``Delivery``: the worker
        trusts ``Delivery`` instances as already checked (P9)."""
        request: dict[str, Any] = msgspec.to_builtins(self)
        del request["type"]
        return request


class Cancel(_ClientFrame, tag="cancel", frozen=True, kw_only=True):
    """Cancel a queued or running delivery; its result is ``cancelled``."""

    delivery_id: str


class Ack(_ClientFrame, tag="ack", frozen=True, kw_only=True):
    """Every result up to ``seq`` is acknowledged (cumulative); it is not sent again."""

    seq: _Seq


class StatusRequest(_ClientFrame, tag="status", frozen=True, kw_only=True):
    """Ask for a ``status`` report: of every room, or of one."""

    room: str | None = None
    after: str | None = None
    """Only the rooms sorted after this one: the next page of a report that left rooms out
    (``rooms_left_out``, P15); the last room of the previous page."""


class TaskSubmit(_ClientFrame, tag="task_submit", frozen=True, kw_only=True):
    """Submit a task lane: ``task_id`` is the idempotency key (the same task again is
    ``task_accepted`` ``duplicate``; another under the same id ``task_conflict``)."""

    task_id: str
    prompt: str
    worktree: str
    """An absolute path to an existing directory (``worktree_missing`` otherwise)."""
    grants: list[str] | None = None
    """The tools the worker may use; ``null``: ``read``, ``bash``, ``edit``, ``write``."""
    validation: list[str] | None = None
    """A command (argv) whose passing run Done needs; ``null``: none."""
    validation_timeout: ValidationTimeout | None = None
    """Seconds the validation may run (killed, not passed after), above 0 and at most
    :data:`MAX_VALIDATION_TIMEOUT`; ``null``: 600."""


class TaskReplyFrame(_ClientFrame, tag="task_reply", frozen=True, kw_only=True):
    """Answer a waiting task (its ``task_wait``); only the current wait's reply wakes it."""

    task_id: str
    text: str
    correlation: str | None = None
    """The wait's intent id; ``null``: the task's current wait."""


class TaskControl(_ClientFrame, tag="task_control", frozen=True, kw_only=True):
    """An operator control: ``resume`` a held task, ``abort`` or ``fail`` it, ``grant`` it
    recovery budget (``epochs`` and/or ``seconds``, with a ``reason``: audited)."""

    task_id: str
    action: Literal["resume", "abort", "fail", "grant"]
    reason: str | None = None
    epochs: GrantEpochs = 0
    """Replacement epochs a ``grant`` adds: 0 to 100 (WD11)."""
    seconds: GrantSeconds = 0.0
    """Recovery seconds a ``grant`` adds: 0 to 86,400 (WD11)."""


class TaskShow(_ClientFrame, tag="task_show", frozen=True, kw_only=True):
    """Ask for one task's ``task_view``, or (``task_id`` absent) the ``task_list``."""

    task_id: str | None = None
    after: str | None = None
    """The ``task_list`` of the tasks sorted after this id only: the next page of a list that
    left tasks out (``tasks_left_out``, P15); the last task of the previous page."""


class FetchAttachment(_ClientFrame, tag="fetch_attachment", frozen=True, kw_only=True):
    """Ask for the bytes of an attachment a ``result`` named (docs/design/attachments.md):
    answered by ``attachment_data`` frames, or an ``error`` with ``ref`` = the id."""

    id: str


ClientFrame = (
    Hello | Deliver | Cancel | Ack | StatusRequest | TaskSubmit | TaskReplyFrame | TaskControl
    | TaskShow | FetchAttachment
)  # fmt: skip
CLIENT_FRAME_TYPES: Final[tuple[str, ...]] = tuple(
    str(frame.__struct_config__.tag) for frame in get_args(ClientFrame)
)
"""The ``type`` of every client frame, in the order of :data:`ClientFrame`."""


# -- server → client ---------------------------------------------------------------------


class _ServerFrame(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


class Welcome(_ServerFrame, tag="welcome", frozen=True, kw_only=True):
    """The answer to an accepted ``hello``: the protocol version chosen."""

    protocol: int
    worker_id: str


class StatusReport(_ServerFrame, tag="status", frozen=True, kw_only=True):
    """The answer to a ``status`` frame."""

    worker_id: str
    pending: int
    """Deliveries admitted and not finished, in every room."""
    rooms: list[RoomStatus]
    """Sorted by room; as many as the frame bound holds (P15)."""
    rooms_left_out: int = 0
    """Rooms after the last one carried that did not fit the frame: ask again with
    ``after`` = the last room carried."""


class ErrorFrame(_ServerFrame, tag="error", frozen=True, kw_only=True):
    """A frame or a command was refused; ``code`` is stable, ``message`` says what to do."""

    code: str
    message: str
    ref: str | None = None
    """The ``delivery_id`` (or ``task_id``) or the frame type this error answers, when known."""


class TaskAccepted(_ServerFrame, tag="task_accepted", frozen=True, kw_only=True):
    """A ``task_submit`` was admitted durably (or was already): the task's state now."""

    task_id: str
    state: str
    disposition: Literal["started", "duplicate"] = "started"


class TaskViewFrame(TaskView, tag="task_view", tag_field="type", frozen=True, kw_only=True):
    """Everything about one task (``pi-runtime task show``): the answer to ``task_show`` with
    a ``task_id`` and to an accepted ``task_reply`` or ``task_control``."""

    @classmethod
    def of(cls, view: TaskView) -> TaskViewFrame:
        return cls(**msgspec.structs.asdict(view))


class TaskList(_ServerFrame, tag="task_list", frozen=True, kw_only=True):
    """The answer to ``task_show`` without a ``task_id``: every task of this server."""

    tasks: list[TaskView]
    """Sorted by task id; as many as the frame bound holds (P15)."""
    tasks_left_out: int = 0
    """Tasks after the last one carried that did not fit the frame: ask again with ``after``
    = the last task carried."""


class AttachmentData(_ServerFrame, tag="attachment_data", frozen=True, kw_only=True):
    """One chunk of an attachment's bytes, in order: ``data`` (base64) is its bytes from
    ``offset``; the chunk with ``last`` true ends it. The bytes were checked against the
    attachment's sha256 before the first chunk was sent."""

    id: str
    offset: int
    size: int
    """The attachment's whole size, in bytes."""
    data: str
    last: bool


ServerFrame = (
    Welcome
    | Accepted
    | Typing
    | TextUpdate
    | ToolActivity
    | DeliveryResult
    | StatusReport
    | ErrorFrame
    | TaskAccepted
    | TaskViewFrame
    | TaskList
    | TaskEvent
    | AttachmentData
)

_client_decoder: Final = msgspec.json.Decoder(ClientFrame)
_server_decoder: Final = msgspec.json.Decoder(ServerFrame)
_encoder: Final = msgspec.json.Encoder()


# -- negotiation -------------------------------------------------------------------------


def negotiate(
    offered: int | Iterable[int], supported: Collection[int] = SUPPORTED_PROTOCOLS
) -> int:
    """The highest version both sides speak; ``unsupported_protocol`` when there is none."""
    offers = [offered] if isinstance(offered, int) else list(offered)
    common = set(offers).intersection(supported)
    if not common:  # each offer shown short: the answer fits any frame bound (P16)
        shown = ", ".join(map(_version, offers[:8])) + (", ..." if len(offers) > 8 else "")
        raise ProtocolError(
            ReasonCode.UNSUPPORTED_PROTOCOL,
            f"this server speaks protocol {', '.join(map(str, sorted(supported)))}; the client"
            f" offered [{shown}]; upgrade the client or the server",
            "hello",
        )
    return max(common)


def _version(offer: int) -> str:
    """An offered protocol version as an answer shows it: at most 20 digits (a JSON integer
    may have thousands)."""
    return str(offer) if abs(offer) < 10**20 else f"{'-' if offer < 0 else ''}{'9' * 20}..."


# -- decoding and encoding ---------------------------------------------------------------


def decode_client_frame(data: str | bytes, *, max_size: int = MAX_FRAME_BYTES) -> ClientFrame:
    """One client frame from the text of a websocket message (``bytes`` are its UTF-8).

    Error handling: any input that is not a valid client frame raises
    :class:`~runtime._errors.ProtocolError` — never another exception — with one code per
    case: ``frame_too_large`` (checked before parsing), ``not_json``, ``not_an_object``,
    ``unknown_type`` (``type`` missing, not a string or not a client frame),
    ``missing_field``, ``unknown_field``, ``wrong_type`` (the field is named, nested ones as
    ``author.id`` or ``history[2].text``; a value nested deeper than the decoders go is
    ``wrong_type`` too, ``not_an_object`` at the top) and ``unsupported_protocol`` (a
    ``hello`` with no version in common). Only the shape is checked here; see
    :meth:`Deliver.request`.
    """
    size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))
    if size > max_size:
        raise ProtocolError(
            ReasonCode.FRAME_TOO_LARGE,
            f"a frame is at most {max_size} bytes; this one has {size}; send less history",
        )
    try:
        try:
            frame = _client_decoder.decode(data)
        except msgspec.ValidationError as error:
            raise _refusal(data, str(error)) from error
        except (msgspec.DecodeError, UnicodeError) as error:
            if _out_of_range(error):  # valid JSON (1e400, 10**5000): a value of the wrong type
                raise _refusal(data, _OUT_OF_RANGE) from error
            raise _not_json(error) from error
    except RecursionError:  # nested deeper than the decoders go (here, or in _refusal)
        raise _too_deep(data) from None
    if isinstance(frame, Hello):
        negotiate(frame.protocol)
    return frame


def reject_binary_frame(data: bytes) -> NoReturn:
    """Refuse a binary websocket message (``binary_frame``); the connection stays usable."""
    raise ProtocolError(
        ReasonCode.BINARY_FRAME,
        f"binary frames are not part of the protocol ({len(data)} bytes ignored);"
        " send each frame as JSON text",
    )


def encode_server_frame(frame: ServerFrame) -> str:
    """The JSON text of one server frame."""
    return _encoder.encode(frame).decode()


def decode_server_frame(data: str | bytes) -> ServerFrame:
    """One server frame (for clients and tests); unknown fields are ignored. Raises
    ``msgspec.DecodeError`` (``msgspec.ValidationError``) on anything else."""
    return _server_decoder.decode(data)


def encode_client_frame(frame: ClientFrame) -> str:
    """The JSON text of one client frame (for clients and tests)."""
    return _encoder.encode(frame).decode()


def error_frame(error: PiRuntimeError, ref: str | None = None) -> ErrorFrame:
    """The ``error`` frame that answers ``error``: a :class:`ProtocolError` brings its own
    ``ref``; for others (a ``DeliveryError`` from the worker) pass the ``delivery_id``."""
    if ref is None and isinstance(error, ProtocolError):
        ref = error.ref
    return ErrorFrame(code=str(error.code), message=error.message, ref=ref)


# -- what was wrong with a frame ---------------------------------------------------------

_AT: Final = re.compile(r"(?P<body>.*?)(?: - at `\$(?P<path>[^`]*)`)?", re.DOTALL)
_MISSING: Final = re.compile(r"Object missing required field `(?P<field>.*)`", re.DOTALL)
_UNKNOWN: Final = re.compile(r"Object contains unknown field `(?P<field>.*)`", re.DOTALL)
_SHOWN: Final = 80
_OUT_OF_RANGE: Final = "Number out of range"
"""msgspec's refusal of a JSON number no float holds (``1e400``), at decode time."""
_OUT_OF_RANGE_FORMS: Final = (_OUT_OF_RANGE, "Integer value out of range")
"""msgspec's refusals, at decode time, of valid JSON numbers it cannot hold: a float's
(``1e400``) and an integer of more digits than Python converts (4,300; P4)."""


def _out_of_range(error: Exception) -> bool:
    """Whether msgspec refused valid JSON for a number it cannot hold (P4)."""
    return any(form in str(error) for form in _OUT_OF_RANGE_FORMS)


def _shown(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _not_json(error: Exception) -> ProtocolError:
    return ProtocolError(
        ReasonCode.NOT_JSON,
        f"a frame is one JSON object in a text frame, UTF-8 ({_shown(str(error))})",
    )


def _too_deep(data: str | bytes) -> ProtocolError:
    """The refusal of a frame nested deeper than the JSON decoders go (Python's recursion
    limit; no frame nests more than a few levels): not an object, or an object with a value
    no field has (P3: a form not recognised is ``wrong_type``). Its type cannot be read, so
    it has no ``ref``."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    if not text.lstrip().startswith("{"):
        return ProtocolError(
            ReasonCode.NOT_AN_OBJECT, "a frame is a JSON object, not an array nested this deep"
        )
    return ProtocolError(
        ReasonCode.WRONG_TYPE, "a value is nested deeper than any frame's field; send less"
    )


def _kind(value: object) -> str:
    match value:
        case list():
            return "an array"
        case str():
            return "a string"
        case bool() | None:
            return json.dumps(value)
        case _:
            return "a number"


def _usable_id(value: object) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_ID and value.isprintable():
        return value
    return None


def frame_ref(frame: ClientFrame) -> str:
    """What an error about the decoded client ``frame`` answers (P4): its delivery id, task
    id or attachment id when usable, else its type."""
    for name in ("delivery_id", "task_id", "id"):
        if (ref := _usable_id(getattr(frame, name, None))) is not None:
            return ref
    return frame_type(frame)


def frame_type(frame: ClientFrame) -> str:
    """A client frame's ``type``."""
    return str(type(frame).__struct_config__.tag)


def _refusal(data: str | bytes, message: str) -> ProtocolError:
    """The :class:`ProtocolError` for a frame msgspec refused with ``message``."""
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError as error:
        if not _out_of_range(error):
            return _not_json(error)
        try:  # the stdlib reads 1e400 (as inf), and any integer (as a float): whose it is
            value = json.loads(data, parse_int=float)
        except ValueError:
            return _not_json(error)
    except UnicodeError as error:
        return _not_json(error)
    if not isinstance(value, dict):
        return ProtocolError(
            ReasonCode.NOT_AN_OBJECT, f"a frame is a JSON object, not {_kind(value)}"
        )
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in CLIENT_FRAME_TYPES:
        what = "no `type`" if kind is None else f"unknown `type` {_shown(json.dumps(kind))}"
        return ProtocolError(
            ReasonCode.UNKNOWN_TYPE,
            f"{what}; a client frame's type is one of {', '.join(CLIENT_FRAME_TYPES)}",
            _usable_id(kind),
        )
    ref = kind
    if kind in ("deliver", "cancel"):
        ref = _usable_id(value.get("delivery_id")) or kind
    elif kind.startswith("task_"):
        ref = _usable_id(value.get("task_id")) or kind
    code, problem = _classify(message)
    return ProtocolError(code, f"{kind}: {problem}", ref)


def _classify(message: str) -> tuple[ReasonCode, str]:
    """A stable code and a message for one of msgspec's validation messages."""
    at = _AT.fullmatch(message)
    assert at is not None  # the pattern matches any text
    body, path = at["body"], (at["path"] or "").removeprefix(".")
    if (missing := _MISSING.fullmatch(body)) is not None:
        field = _shown(".".join(filter(None, (path, missing["field"]))))
        return ReasonCode.MISSING_FIELD, f"missing field `{field}`"
    if (unknown := _UNKNOWN.fullmatch(body)) is not None:
        field = _shown(".".join(filter(None, (path, unknown["field"]))))
        return ReasonCode.UNKNOWN_FIELD, f"unknown field `{field}`; remove it"
    problem = body[:1].lower() + body[1:]
    return ReasonCode.WRONG_TYPE, f"field `{path or '(frame)'}`: {_shown(problem)}"


# -- the schema ----------------------------------------------------------------------------


def schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of both directions, generated from the types."""
    (client, server), components = msgspec.json.schema_components(
        (ClientFrame, ServerFrame), ref_template="#/$defs/{name}"
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"pi-runtime wire protocol, version {PROTOCOL_VERSION}",
        "description": (
            "Websocket JSON text frames tagged by `type`: ClientFrame from client to server,"
            " ServerFrame from server to client. See docs/design/protocol.md. Generated by"
            " `python -m runtime._server._protocol --schema`; do not edit."
        ),
        "$defs": {**components, "ClientFrame": client, "ServerFrame": server},
        "anyOf": [{"$ref": "#/$defs/ClientFrame"}, {"$ref": "#/$defs/ServerFrame"}],
    }


def schema_text() -> str:
    """:func:`schema` as committed in ``docs/protocol.schema.json``: sorted keys, indent 2,
    a trailing newline."""
    return json.dumps(schema(), sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m runtime._server._protocol --schema``: print the schema."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["--schema"]:
        print("usage: python -m runtime._server._protocol --schema", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stdout.buffer.write(schema_text().encode())
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
