"""HTTP/1.1 message syntax and framing, sans I/O (boundaries.md B10).

:mod:`runtime._boundary._http` serves the gateway, the gate, the metrics listener, the operator
page and Fake-Pi's model server, and is the gateway's client upstream. Every model request
crosses it twice and every SSE event of its answer four times, so its per-message cost is the
boundaries' floor (performance.md, "The HTTP layer"). This module is that layer's protocol:
a :class:`ServerConnection` reads requests and frames responses, a :class:`ClientConnection`
frames requests and reads responses. Neither does I/O: bytes go in with ``receive_data`` (an
empty ``bytes`` is the peer's end of file), events come out of ``next_event``, and each send
method returns the bytes to write.

What it accepts is RFC 9112's grammar, the one h11 (which this replaced) checks with the same
expressions; a message outside it raises :class:`RemoteProtocolError` with the status a server
answers (``status``) — as soon as it is seen (a head whose first byte is a space or a control
byte at once, not once its blank line or 16 KiB came) and with a text that never quotes a
field line (it may be an ``Authorization`` one). h11 stays the oracle of the differential test
(``tests/boundary/test_h1.py``, which patches exactly this list into it). Where the two differ,
this module refuses what h11 repaired or let through:

* a line folded onto the one before (obsolete line folding), in a head or a trailer section:
  400 (RFC 9112 §5.2 lets a recipient refuse it; h11 joined the lines);
* a request with both ``Transfer-Encoding`` and ``Content-Length``: 400 (RFC 9112 §6.1 lets a
  server refuse it; h11 let the coding win);
* an HTTP/1.0 message with ``Transfer-Encoding``: 400, a response as much as a request (RFC
  9112 §6.1: its framing must be treated as faulty; h11 read it chunked);
* a head longer than :data:`MAX_HEAD` even when it arrived whole in one read: 431 (h11 bounded
  only what it held of an incomplete head, so its bound depended on how the bytes were cut);
* an HTTP version other than 1.0 and 1.1: 505 (h11 read any ``x.y`` as 1.1).

Like h11, it checks ``Content-Length`` and ``Transfer-Encoding`` wherever they appear — in a
1xx, 204 or 304 response or the answer to HEAD, which they do not frame, and in a trailer
section — and gives them in :attr:`RequestHead.headers` in their one spelling (a repeated or
listed length as its one value, the coding lower-cased).

Bodies: a request's is framed by ``Content-Length`` or ``Transfer-Encoding: chunked`` (any other
coding is 501), or is empty; a response's also by the connection's end. A chunk's extensions and
a chunked body's trailer fields are read, checked and dropped. All body bytes a read made
available come out as one :class:`Data` (h11 gave each chunk its own event), so a relay writes
once per read.

What a peer may reuse: a connection goes on to its next message only when both messages were
whole, neither side said ``connection: close``, the peer speaks HTTP/1.1, and the response's end
was framed (not the connection's end) — :meth:`ServerConnection.start_next_cycle`,
:meth:`ClientConnection.reusable`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Final

__all__ = [
    "CLOSED",
    "END",
    "MAX_HEAD",
    "NEED_DATA",
    "ClientConnection",
    "Data",
    "Event",
    "LocalProtocolError",
    "RemoteProtocolError",
    "RequestHead",
    "ResponseHead",
    "ServerConnection",
]

MAX_HEAD: Final = 16 * 1024
"""The longest head (start line and fields) read, and the longest chunk header or trailer
section: longer is ``431`` (h11's ``max_incomplete_event_size``)."""
_MAX_LENGTH_DIGITS: Final = 20
"""A ``Content-Length`` of more digits is refused (h11's bound)."""


class RemoteProtocolError(Exception):
    """The peer sent what is not HTTP/1.1 as this module speaks it; ``status`` is what a
    server answers it (400, 413, 431, 501, 505)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class LocalProtocolError(Exception):
    """This side asked for what HTTP does not allow: a header no peer may receive, a body
    past its declared length, a response's end before its length, data after the end."""


class _Marker(Enum):
    NEED_DATA = "need data"
    """Nothing more can be read until more bytes arrive."""
    END = "end"
    """The message's body is whole."""
    CLOSED = "closed"
    """The peer ended the connection between messages."""


NEED_DATA: Final = _Marker.NEED_DATA
END: Final = _Marker.END
CLOSED: Final = _Marker.CLOSED


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: str
    target: str
    version: str
    """``"1.1"`` or ``"1.0"``."""
    headers: dict[str, str]
    """Lower-cased names, latin-1 values; the last of a repeated field wins (but
    ``content-length``, given as its one value, and ``transfer-encoding``, lower-cased)."""


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    version: str
    headers: dict[str, str]
    """As :attr:`RequestHead.headers`."""


@dataclass(frozen=True, slots=True)
class Data:
    data: bytes


Event = RequestHead | ResponseHead | Data | _Marker

# RFC 9110/9112's grammar (h11 checks the same expressions)
_TOKEN: Final = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_FIELD_VCHAR: Final = rb"[^\x00\s]"
_FIELD_CONTENT: Final = _FIELD_VCHAR + rb"+(?:[ \t]+" + _FIELD_VCHAR + rb"+)*"
_FIELD: Final = re.compile(rb"(" + _TOKEN + rb"):[ \t]*((?:" + _FIELD_CONTENT + rb")?)[ \t]*")
_FIELD_NAME: Final = re.compile(_TOKEN)
_FIELD_VALUE: Final = re.compile(rb"(?:" + _FIELD_CONTENT + rb")?")
_TARGET_CHARS: Final = rb"[\x21-\x7e]+"
_TARGET: Final = re.compile(_TARGET_CHARS)
_REQUEST_LINE: Final = re.compile(
    rb"(" + _TOKEN + rb") (" + _TARGET_CHARS + rb") HTTP/([0-9]\.[0-9])"
)
_STATUS_LINE: Final = re.compile(
    rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: (?:[ \t]|" + _FIELD_VCHAR + rb")*)?"
)
_CHUNK_HEADER: Final = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*")
_LENGTH: Final = re.compile(rb"[0-9]+")
_BLANK_LINE: Final = re.compile(rb"\n\r?\n")
_VERSIONS: Final = frozenset({b"1.0", b"1.1"})
_FRAMING_FIELDS: Final = (b"content-length", b"transfer-encoding")


def _lines(head: bytes) -> list[bytes]:
    """A head's lines (its blank line excluded), each without its ``\\r\\n`` or ``\\n``."""
    return [line[:-1] if line.endswith(b"\r") else line for line in head.split(b"\n")]


def _fields(lines: list[bytes]) -> list[tuple[bytes, bytes]]:
    """Each field line as ``(lower-cased name, value)``; a line that is no field, a folded one
    included, is a :class:`RemoteProtocolError` — whose text does not quote the line, which
    may be an ``Authorization`` or a ``Cookie`` one."""
    fields = []
    for line in lines:
        matched = _FIELD.fullmatch(line)
        if matched is None:
            if line[:1] in (b" ", b"\t"):
                raise RemoteProtocolError("a folded header line (obsolete line folding)")
            raise RemoteProtocolError("an illegal header line")
        fields.append((matched[1].lower(), matched[2]))
    return fields


def _tokens(fields: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    """A comma-separated field's lower-cased elements, over all its lines."""
    return [
        item.strip().lower()
        for field, value in fields
        if field == name
        for item in value.split(b",")
        if item.strip()
    ]


def _as_dict(fields: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {name.decode("ascii"): value.decode("latin-1") for name, value in fields}


class _Framing(Enum):
    NONE = "none"
    LENGTH = "length"
    CHUNKED = "chunked"
    UNTIL_CLOSE = "until close"


def _body_framing(
    fields: list[tuple[bytes, bytes]],
    headers: dict[str, str],
    *,
    request: bool,
    version: bytes = b"1.1",
) -> tuple[_Framing, int]:
    """How a message's body is delimited, from its fields (RFC 9112 §6.3); its length. Both
    framing fields are checked wherever they appear (as h11 does: in a response that they do
    not frame, in a trailer section) and written to ``headers`` in their one spelling: a
    repeated or listed ``Content-Length`` as its one value (RFC 9110 §8.6), the coding
    lower-cased. An HTTP/1.0 message with a coding is refused (RFC 9112 §6.1)."""
    lengths = [value for name, value in fields if name == b"content-length"]
    codings = [value for name, value in fields if name == b"transfer-encoding"]
    length = 0
    if lengths:
        values = {item.strip() for value in lengths for item in value.split(b",")}
        if len(values) != 1:
            raise RemoteProtocolError("conflicting Content-Length headers")
        value = values.pop()
        if _LENGTH.fullmatch(value) is None or len(value) > _MAX_LENGTH_DIGITS:
            raise RemoteProtocolError("a bad Content-Length")
        headers["content-length"] = value.decode("ascii")
        length = int(value)
    if codings:
        if len(codings) > 1 or codings[0].lower() != b"chunked":
            raise RemoteProtocolError("only Transfer-Encoding: chunked is supported", 501)
        if version == b"1.0":
            raise RemoteProtocolError("Transfer-Encoding in an HTTP/1.0 message")
        if lengths and request:
            raise RemoteProtocolError("both Transfer-Encoding and Content-Length")
        headers["transfer-encoding"] = "chunked"
        return _Framing.CHUNKED, 0
    if lengths:
        return _Framing.LENGTH, length
    return (_Framing.NONE, 0) if request else (_Framing.UNTIL_CLOSE, 0)


class _Reader:
    """One direction's received bytes: heads, then each body by its framing."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.eof = False
        self._searched = 0
        """How far the buffer was searched for a head's end (or a chunk header's, or a trailer
        section's) without finding it: the next search goes on from there, so that a line
        arriving a byte at a time is searched once, not from its start on every byte."""
        self._framing = _Framing.NONE
        self._remaining = 0
        """LENGTH: the body's bytes still to come; CHUNKED: the current chunk's (0: a chunk
        header is next)."""
        self._chunk_end = False
        """CHUNKED: the ``\\r\\n`` after a chunk's data is next."""
        self._trailer = False
        """CHUNKED: the last chunk came; its trailer section is next."""

    def feed(self, data: bytes) -> None:
        if not data:
            self.eof = True
        elif self.eof:
            raise LocalProtocolError("data received after the end of file")
        else:
            self.buffer += data

    def head(self) -> list[bytes] | None:
        """The next head's lines, taken from the buffer; ``None`` while it is not whole."""
        found = _BLANK_LINE.search(self.buffer, self._searched)
        if found is None:
            if self.buffer and self.buffer[0] < 0x21:  # no start line begins so: refused now
                raise RemoteProtocolError("a head that begins with a space or a control byte")
            if len(self.buffer) > MAX_HEAD:
                raise RemoteProtocolError("the head is too large", 431)
            self._searched = max(0, len(self.buffer) - 2)
            return None
        if found.start() > MAX_HEAD:
            raise RemoteProtocolError("the head is too large", 431)
        head = bytes(self.buffer[: found.start()])
        del self.buffer[: found.end()]
        self._searched = 0
        return _lines(head)

    def begin_body(self, framing: _Framing, length: int) -> None:
        self._framing, self._remaining = framing, length
        self._chunk_end = self._trailer = False
        self._searched = 0

    def body(self) -> Data | _Marker:
        """The body's bytes available now (one :class:`Data`), its :data:`END`, or
        :data:`NEED_DATA`; a body cut by the end of file is a :class:`RemoteProtocolError`."""
        framing = self._framing
        if framing is _Framing.NONE:
            return END
        if framing is _Framing.LENGTH:
            if self._remaining == 0:
                self._framing = _Framing.NONE
                return END
            if not self.buffer:
                if self.eof:
                    raise RemoteProtocolError("the connection ended inside a body")
                return NEED_DATA
            data = bytes(self.buffer[: self._remaining])
            del self.buffer[: len(data)]
            self._remaining -= len(data)
            return Data(data)
        if framing is _Framing.UNTIL_CLOSE:
            if self.buffer:
                data = bytes(self.buffer)
                self.buffer.clear()
                return Data(data)
            if self.eof:
                self._framing = _Framing.NONE
                return END
            return NEED_DATA
        return self._chunked()

    def _chunked(self) -> Data | _Marker:
        pieces: list[bytes] = []
        buffer = self.buffer
        taken = 0
        try:
            while True:
                if self._trailer:  # its fields, then a blank line: checked and dropped
                    rest = buffer[taken : taken + 2]
                    if rest[:1] == b"\n" or rest == b"\r\n":
                        taken += len(rest) if rest == b"\r\n" else 1
                        self._framing = _Framing.NONE
                        break
                    found = _BLANK_LINE.search(buffer, taken + self._searched)
                    if found is None:
                        if len(buffer) - taken > MAX_HEAD:
                            raise RemoteProtocolError("the trailer section is too large", 431)
                        self._searched = max(0, len(buffer) - taken - 2)
                        break
                    trailer = _fields(_lines(bytes(buffer[taken : found.start()])))
                    _body_framing(trailer, {}, request=False)  # its framing fields checked
                    taken = found.end()
                    self._framing = _Framing.NONE
                    self._searched = 0
                    break
                if self._chunk_end:
                    if len(buffer) - taken < 2:
                        if bytes(buffer[taken:]) not in (b"", b"\r"):
                            raise RemoteProtocolError("a malformed chunk end")
                        break
                    if buffer[taken : taken + 2] != b"\r\n":
                        raise RemoteProtocolError("a malformed chunk end")
                    taken += 2
                    self._chunk_end = False
                if self._remaining == 0:
                    newline = buffer.find(b"\r\n", taken + self._searched)
                    if newline < 0:
                        if len(buffer) - taken > MAX_HEAD:
                            raise RemoteProtocolError("the chunk header is too large", 431)
                        self._searched = max(0, len(buffer) - taken - 1)
                        break
                    self._searched = 0
                    matched = _CHUNK_HEADER.fullmatch(buffer, taken, newline)
                    if matched is None:
                        raise RemoteProtocolError("an illegal chunk header")
                    taken = newline + 2
                    size = int(matched[1], 16)
                    if size == 0:
                        self._trailer = True
                        continue
                    self._remaining = size
                available = min(self._remaining, len(buffer) - taken)
                if available == 0:
                    break
                pieces.append(bytes(buffer[taken : taken + available]))
                taken += available
                self._remaining -= available
                if self._remaining == 0:
                    self._chunk_end = True
        finally:
            del buffer[:taken]
        if pieces:
            return Data(b"".join(pieces))
        if self._framing is _Framing.NONE:
            return END
        if self.eof:
            raise RemoteProtocolError("the connection ended inside a chunked body")
        return NEED_DATA


def _check_fields(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """Fields this side sends, encoded and checked: a name no token, or a value with a line
    break, a NUL, surrounding spaces or a character outside latin-1, is a
    :class:`LocalProtocolError` (no field may smuggle another one in)."""
    fields = []
    for name, value in headers:
        try:
            raw_name, raw_value = name.encode("ascii"), value.encode("latin-1")
        except UnicodeEncodeError:  # the value (perhaps a key) not chained into a traceback
            raise LocalProtocolError(f"header {name!r} has a character HTTP cannot carry") from None
        if _FIELD_NAME.fullmatch(raw_name) is None:
            raise LocalProtocolError(f"an illegal header name {name!r}")
        if _FIELD_VALUE.fullmatch(raw_value) is None:
            raise LocalProtocolError(f"an illegal value for header {name!r}")
        fields.append((raw_name.lower(), raw_value))
    return fields


def _head_bytes(start: bytes, fields: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join([start, *(name + b": " + value + b"\r\n" for name, value in fields), b"\r\n"])


class _Writer:
    """One direction's sent message body, framed as its head said."""

    def __init__(self) -> None:
        self.framing: _Framing | None = None
        """``None``: no message is being sent (none yet, or the last one ended)."""
        self._remaining = 0
        self.done = False
        """The message was sent whole (``framing`` is ``None`` again)."""

    def begin(self, framing: _Framing, length: int) -> None:
        self.framing, self._remaining = framing, length
        self.done = False

    def data(self, data: bytes) -> bytes:
        framing = self.framing
        if framing is None:
            raise LocalProtocolError("no message body is being sent")
        if not data:
            return b""
        if framing is _Framing.CHUNKED:
            return b"%x\r\n%b\r\n" % (len(data), data)
        if framing is _Framing.LENGTH or framing is _Framing.NONE:
            if len(data) > self._remaining:
                raise LocalProtocolError("too much data for the declared Content-Length")
            self._remaining -= len(data)
        return data

    def end(self) -> bytes:
        framing = self.framing
        if framing is None:
            raise LocalProtocolError("no message is being sent")
        if framing is _Framing.LENGTH and self._remaining:
            raise LocalProtocolError("too little data for the declared Content-Length")
        self.framing, self.done = None, True
        return b"0\r\n\r\n" if framing is _Framing.CHUNKED else b""


class ServerConnection:
    """A connection's server side: :meth:`next_event` yields each request's
    :class:`RequestHead`, its body's :class:`Data`, :data:`END`, and :data:`CLOSED` when the
    peer ends the connection between requests; :meth:`response`, :meth:`data` and
    :meth:`end` frame the answer; :meth:`start_next_cycle` goes on to the next request."""

    def __init__(self) -> None:
        self._in = _Reader()
        self._out = _Writer()
        self._request: RequestHead | None = None
        self._request_done = False
        self._keep_alive = True
        self.failed = False
        """A request's bytes were refused (:class:`RemoteProtocolError`): nothing more is read."""

    def receive_data(self, data: bytes) -> None:
        self._in.feed(data)

    @property
    def buffered(self) -> bool:
        """Whether a byte of the next request (or the end of file) is here already."""
        return bool(self._in.buffer) or self._in.eof

    @property
    def reading_body(self) -> bool:
        """A request's head came and its body is not whole yet."""
        return self._request is not None and not self._request_done

    def next_event(self) -> Event:
        if self.failed:
            raise RemoteProtocolError("the connection's input was refused already")
        try:
            return self._next()
        except RemoteProtocolError:
            self.failed = True
            self._keep_alive = False
            raise

    def _next(self) -> Event:
        if self._request is None:
            lines = self._in.head()
            if lines is None:
                if self._in.eof:
                    if self._in.buffer:
                        raise RemoteProtocolError("the connection ended inside a head")
                    return CLOSED
                return NEED_DATA
            return self._read_head(lines)
        if self._request_done:
            return NEED_DATA  # the next request waits for start_next_cycle
        event = self._in.body()
        if event is END:
            self._request_done = True
        return event

    def _read_head(self, lines: list[bytes]) -> RequestHead:
        matched = _REQUEST_LINE.fullmatch(lines[0])
        if matched is None:
            raise RemoteProtocolError("an illegal request line")  # its target is not quoted
        version = matched[3]
        if version not in _VERSIONS:
            raise RemoteProtocolError("only HTTP/1.1 and HTTP/1.0 are spoken", 505)
        fields = _fields(lines[1:])
        hosts = sum(1 for name, _ in fields if name == b"host")
        if hosts > 1 or (version == b"1.1" and not hosts):
            raise RemoteProtocolError("an HTTP/1.1 request needs one Host header")
        headers = _as_dict(fields)
        framing, length = _body_framing(fields, headers, request=True, version=version)
        self._keep_alive = version == b"1.1" and b"close" not in _tokens(fields, b"connection")
        self._in.begin_body(framing, length)
        self._request = RequestHead(
            matched[1].decode("ascii"), matched[2].decode("ascii"), version.decode("ascii"), headers
        )
        return self._request

    def response(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        """A response's head, its framing added: ``Content-Length`` if given, else chunked (or,
        to an HTTP/1.0 client, the connection's end, with ``connection: close``)."""
        if self._out.framing is not None:
            raise LocalProtocolError("a response is being sent already")
        if self._out.done:
            raise LocalProtocolError("the response was sent already")
        if not 200 <= status <= 999:
            raise LocalProtocolError(f"a response status must be 200-999, not {status}")
        fields = [f for f in _check_fields(headers) if f[0] != b"transfer-encoding"]
        request = self._request
        method = request.method if request is not None else ""
        lengths = [value for name, value in fields if name == b"content-length"]
        if method == "HEAD" or status in (204, 304):
            framing, length = _Framing.NONE, 0
        elif lengths:
            if len(lengths) > 1 or _LENGTH.fullmatch(lengths[0]) is None:
                raise LocalProtocolError("one Content-Length of digits only")
            framing, length = _Framing.LENGTH, int(lengths[0])
        elif request is not None and request.version == "1.1":
            framing, length = _Framing.CHUNKED, 0
            fields.append((b"transfer-encoding", b"chunked"))
        else:  # an HTTP/1.0 client, or an answer to no request (an error): the close ends it
            framing, length = _Framing.UNTIL_CLOSE, 0
            self._keep_alive = False
        if b"close" in _tokens(fields, b"connection"):
            self._keep_alive = False
        elif not self._keep_alive:
            fields = [f for f in fields if f[0] != b"connection"]
            fields.append((b"connection", b"close"))
        self._out.begin(framing, length)
        return _head_bytes(b"HTTP/1.1 %d \r\n" % status, fields)

    def data(self, data: bytes) -> bytes:
        if self._out.done:
            raise LocalProtocolError("can't send data: the response has ended")
        return self._out.data(data)

    def end(self) -> bytes:
        if self._out.done:
            raise LocalProtocolError("the response has ended already")
        return self._out.end()

    @property
    def can_continue(self) -> bool:
        """Whether the next request may be read: this one and its answer whole, and neither
        side ending the connection."""
        return self._keep_alive and self._request_done and self._out.done

    def start_next_cycle(self) -> None:
        if not self.can_continue:
            raise LocalProtocolError("this connection cannot carry another request")
        self._request = None
        self._request_done = False
        self._out = _Writer()


class ClientConnection:
    """A connection's client side: :meth:`request` frames a request (its body whole, with
    ``Content-Length``), :meth:`next_event` yields the :class:`ResponseHead` (informational
    responses skipped), its body's :class:`Data` and :data:`END`; :meth:`reusable` says whether
    the next request may go on this connection."""

    def __init__(self) -> None:
        self._in = _Reader()
        self._method: str | None = None
        self._response: ResponseHead | None = None
        self._response_done = False
        self._keep_alive = True

    def receive_data(self, data: bytes) -> None:
        self._in.feed(data)

    def request(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> bytes:
        """The request's bytes: its head (with ``Content-Length``, which frames ``body``: a
        ``Content-Length`` or ``Transfer-Encoding`` in ``headers`` is dropped) and ``body``.
        ``headers`` must hold one ``Host``."""
        if self._method is not None:
            raise LocalProtocolError("a request was sent already on this cycle")
        try:
            raw_method, raw_target = method.encode("ascii"), target.encode("ascii")
        except UnicodeEncodeError:
            raise LocalProtocolError("a method or target HTTP cannot carry") from None
        if _FIELD_NAME.fullmatch(raw_method) is None:
            raise LocalProtocolError(f"an illegal method {method!r}")
        if _TARGET.fullmatch(raw_target) is None:
            raise LocalProtocolError(f"an illegal request target {target!r}")
        fields = [f for f in _check_fields(headers) if f[0] not in _FRAMING_FIELDS]
        if sum(1 for name, _ in fields if name == b"host") != 1:
            raise LocalProtocolError("a request needs one Host header")
        fields.append((b"content-length", b"%d" % len(body)))
        if b"close" in _tokens(fields, b"connection"):
            self._keep_alive = False
        self._method = method
        start = b"%b %b HTTP/1.1\r\n" % (raw_method, raw_target)
        return _head_bytes(start, fields) + body

    def next_event(self) -> Event:
        if self._method is None:
            raise LocalProtocolError("no request was sent")
        while self._response is None:
            lines = self._in.head()
            if lines is None:
                if self._in.eof:
                    raise RemoteProtocolError("the connection ended before a response")
                return NEED_DATA
            head = self._read_head(lines)
            if head is not None:
                return head
        if self._response_done:
            return END
        event = self._in.body()
        if event is END:
            self._response_done = True
        return event

    def _read_head(self, lines: list[bytes]) -> ResponseHead | None:
        matched = _STATUS_LINE.fullmatch(lines[0])
        if matched is None:
            raise RemoteProtocolError(f"an illegal status line {lines[0][:80]!r}")
        version, status = matched[1], int(matched[2])
        if version not in _VERSIONS:
            raise RemoteProtocolError("only HTTP/1.1 and HTTP/1.0 are spoken", 505)
        fields = _fields(lines[1:])
        headers = _as_dict(fields)
        framing, length = _body_framing(fields, headers, request=False, version=version)
        if status < 200:
            if status < 100:
                raise RemoteProtocolError(f"no such status {status}")
            if status == 101:
                raise RemoteProtocolError("a protocol switch was not asked for")
            return None  # informational: the response is still to come
        if self._method == "HEAD" or status in (204, 304):
            framing, length = _Framing.NONE, 0
        if framing is _Framing.UNTIL_CLOSE or version != b"1.1":
            self._keep_alive = False
        if b"close" in _tokens(fields, b"connection"):
            self._keep_alive = False
        self._in.begin_body(framing, length)
        self._response = ResponseHead(status, version.decode("ascii"), headers)
        return self._response

    @property
    def reusable(self) -> bool:
        """Whether the next request may go on this connection: the response whole, nothing
        after it, and neither side ending the connection."""
        return self._keep_alive and self._response_done and not self._in.buffer and not self._in.eof

    def start_next_cycle(self) -> None:
        if not self.reusable:
            raise LocalProtocolError("this connection cannot carry another request")
        self._method = None
        self._response = None
        self._response_done = False
