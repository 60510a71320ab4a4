"""Pi's RPC protocol, the pure core: JSON lines in, records and state out; no I/O, no Trio.

Commands go on stdin; responses (``type: "response"``, matched by ``id``), events and
``extension_ui_request`` records come interleaved on stdout (docs/design/pi-observed.md §6).
:class:`LineSplitter` turns bytes into lines (R1, R2), :class:`ProtocolState` keeps ids,
response matching and run tracking (R3, R7, R8, R10), :func:`chat_text` (R9) and
:func:`ui_response` (R8) shape what is sent. The Trio shell is :mod:`runtime._pi._rpc`.
Invariants: ``docs/design/rpc.md``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from .._errors import RpcLineTooLongError
from ._pijson import loads

__all__ = [
    "COMMAND_GUARD",
    "MALFORMED_LINE",
    "MAX_LINE",
    "NOTICE_METHODS",
    "ChannelStatistics",
    "Event",
    "LineSplitter",
    "Prompted",
    "ProtocolState",
    "Received",
    "Response",
    "UiCancel",
    "UiConfirm",
    "UiPolicy",
    "UiReply",
    "UiRequest",
    "UiValue",
    "cancel_dialogs",
    "chat_text",
    "decode_line",
    "ui_response",
]


MAX_LINE: Final = 256 * 1024 * 1024
"""Longest stdout line accepted (``agent_end`` and ``get_entries`` lines run to megabytes)."""


COMMAND_GUARD: Final = " "
"""Put before chat text that starts with ``/`` so that Pi never runs it as a command (R9)."""


MALFORMED_LINE: Final = "rpc_malformed_line"
"""The ``type`` of the event that stands for a stdout line that is not a JSON object."""


NOTICE_METHODS: Final = frozenset(
    {"notify", "setStatus", "setWidget", "setTitle", "set_editor_text"}
)
"""Fire-and-forget extension UI methods: Pi waits for no answer (rpc-extension-ui.md)."""


class Response(msgspec.Struct, frozen=True, kw_only=True):
    """A ``{"type": "response"}`` record, in Pi's shape."""

    id: str | None
    command: str
    success: bool
    data: Any = None
    error: str | None = None


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """One stdout record that is not a matched response; ``seq`` is its stdout position."""

    seq: int
    type: str
    record: dict[str, Any]


class UiRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An ``extension_ui_request`` that Pi waits on (a dialog, or a method not known here)."""

    id: str
    method: str
    record: dict[str, Any]


class UiValue(msgspec.Struct, frozen=True, kw_only=True):
    """Answer a ``select``/``input``/``editor`` dialog with ``value``."""

    value: str


class UiConfirm(msgspec.Struct, frozen=True, kw_only=True):
    """Answer a ``confirm`` dialog."""

    confirmed: bool


class UiCancel(msgspec.Struct, frozen=True, kw_only=True):
    """Dismiss any dialog (confirm → false, the others → undefined)."""


UiReply = UiValue | UiConfirm | UiCancel


UiPolicy = Callable[[UiRequest], Awaitable[UiReply]]


async def cancel_dialogs(request: UiRequest) -> UiReply:
    """The default policy: a runtime has nobody to ask, so every dialog is cancelled."""
    return UiCancel()


class Prompted(msgspec.Struct, frozen=True, kw_only=True):
    """A prompt the worker accepted; pass ``settled_before`` to :meth:`RpcChannel.wait_settled`."""

    disposition: str
    """``started``, ``queued`` (a run was active) or ``handled`` (no run for this prompt)."""
    text: str
    """The text as sent, after :func:`chat_text`."""
    settled_before: int


class ChannelStatistics(msgspec.Struct, frozen=True, kw_only=True):
    records: int
    events_buffered: int
    pending_requests: int
    running: bool
    settled: int
    ui_answered: int
    malformed_lines: int
    longest_line: int
    ended: bool


class LineSplitter:
    """Split a byte stream into lines at ``b"\\n"`` only (R1).

    Never at U+2028/U+2029 or any other separator; a line may arrive in any number of chunks
    and each byte is scanned once, so multi-megabyte lines cost linear time. Raises
    :class:`RpcLineTooLongError` when an unfinished line exceeds ``max_line`` bytes (R2).
    """

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self.longest = 0
        self.overflowed = False
        """A line past ``max_line`` was met: every later :meth:`feed` and :meth:`finish`
        raises :class:`RpcLineTooLongError`."""
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray) -> list[bytes]:
        """The lines completed by ``data``, without their ``\\n``.

        A line longer than ``max_line`` — finished in this ``data`` or not — raises
        :class:`RpcLineTooLongError`; when lines before it were completed by the same
        ``data`` they are returned first (nothing before the long line is lost), with
        :attr:`overflowed` set: the caller raises after them, and the next call does."""
        if self.overflowed:
            raise RpcLineTooLongError(self.max_line)
        buffer = self._buffer
        scan = len(buffer)
        buffer += data
        lines: list[bytes] = []
        start = 0
        while (end := buffer.find(b"\n", scan)) >= 0:
            if end - start > self.max_line:  # whole in this chunk, but past the limit all the same
                self.overflowed = True
                break
            lines.append(bytes(buffer[start:end]))
            self.longest = max(self.longest, end - start)
            start = scan = end + 1
        else:
            del buffer[:start]
            self.overflowed = len(buffer) > self.max_line
        if self.overflowed:
            self._buffer = bytearray()
            if not lines:
                raise RpcLineTooLongError(self.max_line)
        return lines

    def finish(self) -> bytes | None:
        """At end of stream: the unterminated last line, if any."""
        if self.overflowed:
            raise RpcLineTooLongError(self.max_line)
        rest, self._buffer = bytes(self._buffer), bytearray()
        return rest or None


def chat_text(text: str) -> str:
    """``text`` as it must be sent so that Pi treats it as chat, never as a command (R9).

    Pi 1.6.0's ``prompt`` runs text starting with ``/`` as an extension command when one has
    that name, and expands ``/skill:…`` and prompt templates; ``steer``/``follow_up`` refuse
    command names. One leading space (:data:`COMMAND_GUARD`) defeats every one of those
    ``startsWith("/")`` checks and reaches the model unchanged, with the text intact after it.
    """
    return COMMAND_GUARD + text if text.startswith("/") else text


def ui_response(request_id: str, reply: UiReply) -> dict[str, Any]:
    """The ``extension_ui_response`` record for ``reply`` (docs/rpc-extension-ui.md, R8)."""
    record: dict[str, Any] = {"type": "extension_ui_response", "id": request_id}
    if isinstance(reply, UiValue):
        record["value"] = reply.value
    elif isinstance(reply, UiConfirm):
        record["confirmed"] = reply.confirmed
    else:
        record["cancelled"] = True
    return record


def decode_line(seq: int, line: bytes) -> Event:
    """One stdout line as an :class:`Event`; anything but a JSON object with a string
    ``type`` becomes a :data:`MALFORMED_LINE` event (R10)."""
    try:
        value = loads(line)
    except msgspec.DecodeError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        return Event(seq=seq, type=value["type"], record=value)
    text = line[:4096].decode("utf-8", "replace")
    return Event(
        seq=seq,
        type=MALFORMED_LINE,
        record={"type": MALFORMED_LINE, "line": text, "length": len(line)},
    )


def _response_of(record: dict[str, Any]) -> Response:
    rid, error = record.get("id"), record.get("error")
    return Response(
        id=rid if isinstance(rid, str) else None,
        command=str(record.get("command", "")),
        success=record.get("success") is True,
        data=record.get("data"),
        error=error if isinstance(error, str) else None,
    )


def _disposition(response: Response) -> str:
    data = response.data if isinstance(response.data, dict) else {}
    return str(data.get("disposition", ""))


@dataclass(frozen=True, slots=True)
class Received:
    """What one stdout line means: at most one of a matched response or an event, plus a
    dialog to answer. ``settled_before`` counts the ``agent_settled`` events read before it."""

    response: Response | None = None
    event: Event | None = None
    ui: UiRequest | None = None
    settled_before: int = 0


@dataclass
class ProtocolState:
    """The channel's knowledge, advanced only by the commands it sends and the lines it reads.

    Ids are ``rpc-1``, ``rpc-2``, …, never reused (R3). A run is in flight from a ``prompt``
    response with disposition ``started`` (Pi writes it before the run's ``agent_start``) or
    an ``agent_start``, until ``agent_settled`` (R7).
    """

    records: int = 0
    running: bool = False
    settled: list[Event] = field(default_factory=list)
    pending: dict[str, str] = field(default_factory=dict)
    """id → command type, for requests awaiting their response."""
    abandoned: dict[str, str] = field(default_factory=dict)
    """Requests whose caller stopped waiting; their responses are dropped."""
    malformed: int = 0
    last_id: int = 0

    def command(self, command: Mapping[str, Any]) -> dict[str, Any]:
        """``command`` with a fresh ``id``, registered as pending."""
        kind = command.get("type")
        if not isinstance(kind, str) or "id" in command:
            raise ValueError("a command needs a string 'type' and no 'id' (the channel assigns it)")
        self.last_id += 1
        rid = f"rpc-{self.last_id}"
        self.pending[rid] = kind
        return {"id": rid, **command}

    def abandon(self, rid: str) -> None:
        if (kind := self.pending.pop(rid, None)) is not None:
            self.abandoned[rid] = kind

    def receive(self, line: bytes) -> Received:
        """Advance by one stdout line (blank lines are not records)."""
        if not line.strip():
            return Received(settled_before=len(self.settled))
        event = decode_line(self.records, line)
        self.records += 1
        before = len(self.settled)
        if event.type == MALFORMED_LINE:
            self.malformed += 1
        elif event.type == "response":
            response = _response_of(event.record)
            rid = response.id or ""
            live = self.pending.pop(rid, None)
            kind = live or self.abandoned.pop(rid, None)
            if kind is not None:  # ours: to its caller, or dropped if abandoned
                if kind == "prompt" and _disposition(response) == "started":
                    self.running = True
                return Received(response=response if live else None, settled_before=before)
        elif event.type == "agent_start":
            self.running = True
        elif event.type == "agent_settled":
            self.running = False
            self.settled.append(event)
        ui = None
        if event.type == "extension_ui_request":
            uid, method = event.record.get("id"), event.record.get("method")
            if isinstance(uid, str) and isinstance(method, str) and method not in NOTICE_METHODS:
                ui = UiRequest(id=uid, method=method, record=event.record)
        return Received(event=event, ui=ui, settled_before=before)
