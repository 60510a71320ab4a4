"""HTTP/1.1 message syntax and framing, sans I/O (``docs/design/boundaries.md`` B10):
``runtime/_boundary/_h1.py`` — the codec under the gateway, the gate, the metrics and operator
listener and Fake-Pi's model server — against h11, the library it replaced and the oracle.

The differential tests generate thousands of messages from a fixed seed, valid ones and mutated
ones, feed the same bytes (split at random points, 1-byte feeds too) to ``h11.Connection`` and to
the codec, and compare what each read: refused or not (and with which status, where the message
has one fault), each message's head, its body's bytes, whether the connection may carry the next
one. The oracle is h11 with exactly the differences the codec's docstring lists patched in
(:func:`oracle`); any other difference fails. Then what the codec sends is read back by h11, and
each refusal and buffering rule has a small test of its own.
"""

from __future__ import annotations

import itertools
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import h11
import h11._readers
import pytest

from runtime._boundary._h1 import (
    CLOSED,
    END,
    MAX_HEAD,
    NEED_DATA,
    ClientConnection,
    Data,
    LocalProtocolError,
    RemoteProtocolError,
    RequestHead,
    ResponseHead,
    ServerConnection,
)

SEED: Final = 0xB10
REQUEST_CASES: Final = 2500
RESPONSE_CASES: Final = 2000
CPU_BOUND: Final = 2.0
"""Seconds of this process's CPU a slow head may cost: linear work is ~0.02 s."""

Record = tuple[Any, ...]
"""What a reader made of a connection's bytes, in order: ``("head", ...)``, ``("body",
bytes)`` at a message's end, ``("next", may_continue)``, ``("refused", status)``,
``("closed",)``, ``("waiting",)`` (the bytes ran out)."""


# -- the oracle: h11 with the codec's listed differences -------------------------------------


def _no_folding(lines: Iterable[bytes]) -> Iterator[bytes]:
    """The codec refuses obsolete line folding (h11 joins the lines)."""
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            raise h11.LocalProtocolError("a folded header line")
        yield line


_BLANK: Final = re.compile(rb"\n\r?\n")
_VERSIONS: Final = (b"1.0", b"1.1")


def _strict_head(reader: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A head reader of h11's with the codec's other listed differences: a head over
    :data:`MAX_HEAD` arriving whole is 431, a version other than 1.0 and 1.1 is 505, an
    HTTP/1.0 message with ``Transfer-Encoding`` is 400, and so is a request with both
    ``Transfer-Encoding`` and ``Content-Length``."""

    def read(buffer: Any) -> Any:
        if len(buffer) > MAX_HEAD:
            found = _BLANK.search(bytes(buffer))
            if found is not None and found.start() > MAX_HEAD:
                raise h11.RemoteProtocolError("the head is too large", 431)
        event = reader(buffer)
        if isinstance(event, h11.Request | h11.Response | h11.InformationalResponse):
            if event.http_version not in _VERSIONS:
                raise h11.RemoteProtocolError("only 1.0 and 1.1", 505)
            names = {name for name, _ in event.headers}
            coded = b"transfer-encoding" in names
            if coded and event.http_version == b"1.0":
                raise h11.RemoteProtocolError("Transfer-Encoding in HTTP/1.0", 400)
            if coded and b"content-length" in names and isinstance(event, h11.Request):
                raise h11.RemoteProtocolError("both Transfer-Encoding and Content-Length", 400)
        return event

    return read


@pytest.fixture
def oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    """h11, with exactly the differences ``_h1``'s docstring lists."""
    monkeypatch.setattr(h11._readers, "_obsolete_line_fold", _no_folding)
    readers = h11._readers.READERS
    for key in ((h11.CLIENT, h11.IDLE), (h11.SERVER, h11.IDLE), (h11.SERVER, h11.SEND_RESPONSE)):
        monkeypatch.setitem(readers, key, _strict_head(readers[key]))  # type: ignore[arg-type]


# -- reading with each -----------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """A server's answer to a request, given to both servers alike."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


def _answer_h1(conn: ServerConnection, method: str, answer: Answer) -> bytes:
    sent = conn.response(answer.status, answer.headers)
    if method != "HEAD" and answer.status not in (204, 304):
        sent += conn.data(answer.body)
    return sent + conn.end()


def _answer_h11(conn: h11.Connection, method: bytes, answer: Answer) -> bytes:
    sent = conn.send(h11.Response(status_code=answer.status, headers=answer.headers))
    if method != b"HEAD" and answer.status not in (204, 304):
        sent += conn.send(h11.Data(data=answer.body))
    return sent + conn.send(h11.EndOfMessage())


def _serve_h1(pieces: list[bytes], answers: list[Answer]) -> list[Record]:
    """What a :class:`ServerConnection` read, answering each request as it ended; also checks
    that a read's body bytes came out as one :class:`Data` (never an empty one)."""
    conn = ServerConnection()
    records: list[Record] = []
    body = bytearray()
    method = ""
    for piece in pieces:
        conn.receive_data(piece)
        data_events = 0
        while True:
            try:
                event = conn.next_event()
            except RemoteProtocolError as exc:
                return [*records, ("refused", exc.status)]
            if event is NEED_DATA:
                break
            if isinstance(event, RequestHead):
                records.append(("head", event.method, event.target, event.version, event.headers))
                method, data_events = event.method, 0
                body.clear()
            elif isinstance(event, Data):
                data_events += 1
                assert event.data, "an empty Data event"
                assert data_events == 1, "one read's body bytes in more than one Data"
                body += event.data
            elif event is END:
                records.append(("body", bytes(body)))
                _answer_h1(conn, method, answers[len(records) % len(answers)])
                records.append(("next", conn.can_continue))
                if not conn.can_continue:
                    return records
                conn.start_next_cycle()
            else:
                assert event is CLOSED
                return [*records, ("closed",)]
    return [*records, ("waiting",)]


def _serve_h11(pieces: list[bytes], answers: list[Answer]) -> list[Record]:
    conn = h11.Connection(h11.SERVER)
    records: list[Record] = []
    body = bytearray()
    method = b""
    for piece in pieces:
        conn.receive_data(piece)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                return [*records, ("refused", exc.error_status_hint)]
            if event is h11.NEED_DATA or event is h11.PAUSED:
                break
            if isinstance(event, h11.Request):
                headers = {name.decode(): value.decode("latin-1") for name, value in event.headers}
                target = event.target.decode()
                records.append(("head", event.method.decode(), target, _v(event), headers))
                method = event.method
                body.clear()
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                records.append(("body", bytes(body)))
                _answer_h11(conn, method, answers[len(records) % len(answers)])
                reuse = conn.our_state is h11.DONE and conn.their_state is h11.DONE
                records.append(("next", reuse))
                if not reuse:
                    return records
                conn.start_next_cycle()
            else:
                assert isinstance(event, h11.ConnectionClosed)
                return [*records, ("closed",)]
    return [*records, ("waiting",)]


def _v(event: h11.Request | h11.Response) -> str:
    return event.http_version.decode()


def _fetch_h1(pieces: list[bytes], methods: list[str]) -> list[Record]:
    """What a :class:`ClientConnection` read of the responses to ``methods``, sent one after
    the other while the connection may be reused."""
    conn = ClientConnection()
    conn.request(methods[0], "/", [("host", "example")], b"")
    sent = 1
    records: list[Record] = []
    body = bytearray()
    for piece in pieces:
        conn.receive_data(piece)
        data_events = 0
        while True:
            try:
                event = conn.next_event()
            except RemoteProtocolError:
                return [*records, ("refused",)]
            if event is NEED_DATA:
                break
            if isinstance(event, ResponseHead):
                records.append(("head", event.status, event.version, event.headers))
                body.clear()
                data_events = 0
            elif isinstance(event, Data):
                data_events += 1
                assert event.data, "an empty Data event"
                assert data_events == 1, "one read's body bytes in more than one Data"
                body += event.data
            else:
                assert event is END
                records += [("body", bytes(body)), ("next", conn.reusable)]
                if not conn.reusable or sent == len(methods):
                    return records
                conn.start_next_cycle()
                conn.request(methods[sent], "/", [("host", "example")], b"")
                sent += 1
    return [*records, ("waiting",)]


def _fetch_h11(pieces: list[bytes], methods: list[str]) -> list[Record]:
    conn = h11.Connection(h11.CLIENT)

    def send(method: str) -> None:
        conn.send(h11.Request(method=method, target="/", headers=[("host", "example")]))
        conn.send(h11.EndOfMessage())

    send(methods[0])
    sent = 1
    records: list[Record] = []
    body = bytearray()
    for piece in pieces:
        conn.receive_data(piece)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return [*records, ("refused",)]
            if event is h11.NEED_DATA or event is h11.PAUSED:
                break
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                headers = {name.decode(): value.decode("latin-1") for name, value in event.headers}
                records.append(("head", event.status_code, _v(event), headers))
                body.clear()
            elif isinstance(event, h11.Data):
                body += event.data
            else:
                assert isinstance(event, h11.EndOfMessage), event
                reuse = (
                    conn.our_state is h11.DONE
                    and conn.their_state is h11.DONE
                    and conn.trailing_data == (b"", False)
                )
                records += [("body", bytes(body)), ("next", reuse)]
                if not reuse or sent == len(methods):
                    return records
                conn.start_next_cycle()
                send(methods[sent])
                sent += 1
    return [*records, ("waiting",)]


# -- generating messages ---------------------------------------------------------------------

_METHODS: Final = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "M-SEARCH", "x")
_TARGETS: Final = (
    "/",
    "/v1/chat/completions",
    "/a?b=c&d=%20e",
    "*",
    "http://example.com:80/x?y",
    "/~u/!$&'()*+,;=:@",
)
_NAMES: Final = ("User-Agent", "accept", "X-Custom", "x-b10", "Cookie", "ETAG", "!#$%&'*+-.^_`|~")
_VALUES: Final = (
    "x",
    "a b",
    "a  \t b",
    "",
    "\x80\xff",
    "ctl\x01x",
    '"quoted, comma"',
    "text/event-stream; q=0.5",
)
_SEPARATORS: Final = (": ", ":", ":\t", ":  ")
_TRAILING: Final = ("", "", " ", "\t ")
_EOLS: Final = ("\r\n", "\r\n", "\r\n", "\n")


def _casing(rng: random.Random, name: str) -> str:
    return "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in name)


def _field_lines(rng: random.Random, fields: list[tuple[str, str]]) -> str:
    return "".join(
        _casing(rng, name)
        + rng.choice(_SEPARATORS)
        + value
        + (rng.choice(_TRAILING) if value else "")
        + rng.choice(_EOLS)
        for name, value in fields
    )


def _chunked(rng: random.Random, body: bytes, trailer: list[tuple[str, str]]) -> bytes:
    """``body`` as chunks of random sizes, spellings and extensions, then ``trailer``."""
    out = bytearray()
    at = 0
    while at < len(body):
        size = rng.randint(1, len(body) - at)
        spelled = rng.choice(["", "0", "00"]) + _casing(rng, f"{size:x}")
        extension = rng.choice(["", "", ";a=b", ";x", ';n="v w"', ";a=b;c"])
        out += f"{spelled}{extension}{rng.choice(['', '', ' ', '	'])}\r\n".encode()
        out += body[at : at + size] + b"\r\n"
        at += size
    out += f"{rng.choice(['0', '000'])}{rng.choice(['', ';last'])}\r\n".encode()
    out += (_field_lines(rng, trailer) + rng.choice(_EOLS)).encode("latin-1")
    return bytes(out)


@dataclass
class Message:
    """One message to generate: its start line, fields and body, and how the body is framed."""

    start: str
    fields: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    framing: str = "length"
    """``length``, ``chunked``, ``none`` (no body) or ``close`` (until the connection's end)."""
    trailer: list[tuple[str, str]] = field(default_factory=list)
    fault: str = ""
    """The one fault put in (its name), or ``""``."""

    def encode(self, rng: random.Random) -> bytes:
        fields = list(self.fields)
        if self.framing == "length":
            fields.append(("Content-Length", str(len(self.body))))
        elif self.framing == "chunked":
            fields.append(("Transfer-Encoding", rng.choice(["chunked", "Chunked", "CHUNKED"])))
        rng.shuffle(fields)
        head = self.start + rng.choice(_EOLS) + _field_lines(rng, fields) + rng.choice(_EOLS)
        if self.framing == "chunked":
            return head.encode("latin-1") + _chunked(rng, self.body, self.trailer)
        return head.encode("latin-1") + self.body


def _fields(rng: random.Random) -> list[tuple[str, str]]:
    fields = [(rng.choice(_NAMES), rng.choice(_VALUES)) for _ in range(rng.randrange(4))]
    if rng.random() < 0.2:
        fields.append(("Connection", rng.choice(["close", "keep-alive", "Keep-Alive, CLOSE"])))
    if rng.random() < 0.05:
        fields.append(("Upgrade", "websocket"))
    return fields


def _request(rng: random.Random) -> Message:
    version = "1.0" if rng.random() < 0.15 else "1.1"
    method = rng.choice(_METHODS)
    message = Message(f"{method} {rng.choice(_TARGETS)} HTTP/{version}", _fields(rng))
    if version == "1.1" or rng.random() < 0.5:
        message.fields.append(("Host", rng.choice(["example.com", "127.0.0.1:8080", ""])))
    if rng.random() < 0.1:
        message.fields.append(("Expect", "100-continue"))
    message.framing = rng.choice(["none", "length", "length", "chunked"])
    if message.framing != "none":
        message.body = rng.randbytes(rng.choice([0, 1, 5, 40, 300]))
    if message.framing == "chunked" and rng.random() < 0.3:
        message.trailer = [("X-Trailer", rng.choice(_VALUES))]
    return message


_STATUSES: Final = (200, 200, 201, 204, 304, 404, 500, 599, 999)


def _response(rng: random.Random, method: str, last: bool) -> Message:
    version = "1.0" if rng.random() < 0.1 else "1.1"
    status = rng.choice(_STATUSES)
    reason = rng.choice([" OK", "", " ", " Not Found", " a\tb", " \x80"])
    message = Message(f"HTTP/{version} {status}{reason}", _fields(rng))
    framings = ["length", "length", "chunked"] + (["close"] if last else [])
    message.framing = rng.choice(framings)
    if message.framing != "close":
        message.body = rng.randbytes(rng.choice([0, 1, 5, 40, 300]))
    else:
        message.body = rng.randbytes(rng.choice([0, 7, 300]))
    if method == "HEAD" or status in (204, 304):  # no body, whatever the fields say
        body, message.body = message.body, b""
        if message.framing == "length":
            message.fields.append(("Content-Length", str(len(body))))
        elif message.framing == "chunked":
            message.fields.append(("Transfer-Encoding", "chunked"))
        message.framing = "none"
    if message.framing == "chunked" and rng.random() < 0.3:
        message.trailer = [("X-Trailer", rng.choice(_VALUES))]
    return message


def _informational(rng: random.Random) -> bytes:
    return rng.choice(
        [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n"]
    )


# -- faults: one named change to a message -----------------------------------------------------


def _fault(rng: random.Random, message: Message, request: bool) -> None:
    """Put one fault in ``message`` (``message.fault`` names it)."""
    faults: dict[str, Callable[[], None]] = {}

    def add(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
        def register(change: Callable[[], None]) -> Callable[[], None]:
            faults[name] = change
            return change

        return register

    @add("two equal content-lengths")
    def _() -> None:
        message.framing = "none"
        message.fields += [("Content-Length", str(len(message.body)))] * 2

    @add("a listed content-length")
    def _() -> None:
        message.framing = "none"
        message.fields.append(("Content-Length", f"{len(message.body)}, {len(message.body)}"))

    @add("conflicting content-lengths")
    def _() -> None:
        message.framing = "none"
        message.fields += [("Content-Length", "1"), ("Content-Length", "2")]
        message.body = b"xx"

    @add("a bad content-length")
    def _() -> None:
        message.framing = "none"
        bad = rng.choice(["+5", "-1", "0x5", "5 5", "", "1" * 21, "5,", "five"])
        message.fields.append(("Content-Length", bad))

    @add("a transfer coding other than chunked")
    def _() -> None:
        message.framing = "none"
        coding = rng.choice(["gzip", "identity", "chunked, chunked", "gzip, chunked"])
        message.fields.append(("Transfer-Encoding", coding))

    @add("two transfer-encoding lines")
    def _() -> None:
        message.framing = "chunked"
        message.fields.append(("Transfer-Encoding", "chunked"))

    @add("transfer-encoding and content-length")
    def _() -> None:
        message.framing = "chunked"
        message.fields.append(("Content-Length", str(len(message.body))))

    @add("a huge chunk size")
    def _() -> None:
        message.framing = "raw"
        size = rng.choice(["f" * 20, "f" * 21, "1" + "0" * 19])
        message.body = f"{size}\r\nabc".encode()
        message.fields.append(("Transfer-Encoding", "chunked"))

    @add("a bad chunk end")
    def _() -> None:
        message.framing = "raw"
        message.body = b"3\r\nabc" + rng.choice([b"XX", b"\n", b"\r\r", b"x\r\n"]) + b"0\r\n\r\n"
        message.fields.append(("Transfer-Encoding", "chunked"))

    @add("a bad chunk header")
    def _() -> None:
        message.framing = "raw"
        header = rng.choice([b"3\n", b"g\r\n", b"\r\n", b" 3\r\n", b"3 ;x\r\n", b"-3\r\n"])
        message.body = header + b"abc\r\n0\r\n\r\n"
        message.fields.append(("Transfer-Encoding", "chunked"))

    @add("a folded line")
    def _() -> None:
        message.fields.append(("X-Folded", "one\r\n" + rng.choice([" ", "\t", "  "]) + "two"))

    @add("a folded trailer line")
    def _() -> None:
        message.framing = "chunked"
        message.trailer = [("X-Folded", "one\r\n two")]

    @add("a framing field in the trailer")
    def _() -> None:
        message.framing = "chunked"
        value = rng.choice(["5", "abc", "1, 2", "chunked", "gzip"])
        message.trailer = [(rng.choice(["Content-Length", "Transfer-Encoding"]), value)]

    @add("an oversized chunk header or trailer")
    def _() -> None:
        message.framing = "raw"
        size = rng.choice([MAX_HEAD - 100, MAX_HEAD + 100])
        if rng.random() < 0.5:
            message.body = b"3;" + b"e" * size + b"\r\nabc\r\n0\r\n\r\n"
        else:
            message.body = b"3\r\nabc\r\n0\r\nx-t: " + b"t" * size + b"\r\n\r\n"
        message.fields.append(("Transfer-Encoding", "chunked"))

    @add("a leading blank line")
    def _() -> None:
        message.start = rng.choice(["\r\n", "\n", "\r\n\r\n"]) + message.start

    @add("an oversized head")
    def _() -> None:
        size = rng.choice([MAX_HEAD - 200, MAX_HEAD - 60, MAX_HEAD - 10, MAX_HEAD + 100, 20000])
        message.fields.append(("X-Big", "a" * size))

    @add("another version")
    def _() -> None:
        version = rng.choice(["1.2", "2.0", "0.9", "3.7"])
        message.start = message.start.rsplit("HTTP/", 1)[0] + "HTTP/" + version
        if not request:
            message.start = f"HTTP/{version} 200 OK"

    @add("a malformed version")
    def _() -> None:
        spellings = ["http/1.1", "HTTP/1.10", "HTTP/11", "HTTP/1", "HTTP 1.1", "HTTP/1.1 "]
        version = rng.choice(spellings)
        if request:
            message.start = message.start.rsplit(" ", 1)[0] + " " + version
        else:
            message.start = f"{version} 200 OK"

    @add("a space before the colon")
    def _() -> None:
        message.fields.append(("X-Space ", "x"))

    @add("a NUL, CR or LF in a value")
    def _() -> None:
        message.fields.append(("X-Bad", "a" + rng.choice(["\x00", "\r", "\x0b", "\x0c"]) + "b"))

    @add("a line that is no field")
    def _() -> None:
        message.fields.append((rng.choice(["no colon", "", "x y", "[x]", "é"]), ""))

    if request:

        @add("no host")
        def _() -> None:
            message.start = message.start.replace("HTTP/1.0", "HTTP/1.1")
            message.fields = [f for f in message.fields if f[0] != "Host"]

        @add("two hosts")
        def _() -> None:
            message.fields += [("Host", "a"), ("host", "b")]

        @add("a bad request line")
        def _() -> None:
            method, target, version = message.start.split(" ")
            message.start = rng.choice(
                [
                    f"{method}  {target} {version}",
                    f"{method} {target}",
                    f"G@T {target} {version}",
                    f"{method} /a b {version}",
                    f"{method} /\x80 {version}",
                    f"{method} {target} {version} ",
                    f" {method} {target} {version}",
                    f"{method}\t{target} {version}",
                ]
            )

    else:

        @add("a bad status line")
        def _() -> None:
            version = message.start.split(" ")[0]
            message.start = rng.choice(
                [
                    f"{version} 20 OK",
                    f"{version} 2000 OK",
                    f"{version} 099 Odd",
                    f"{version} 000",
                    f"{version}  200 OK",
                    f"{version} 200OK",
                    f"{version} abc OK",
                    f"{version} 200 O\x00K",
                    f"{version} 200 O\rK",
                    f"{version} 101 Switching",
                ]
            )

    message.fault = rng.choice(sorted(faults))
    faults[message.fault]()
    if message.framing == "raw":  # the body's bytes are given as they go on the wire
        message.framing = "none"


_INSERTS: Final = (b"\r", b"\n", b"\x00", b" ", b"\t", b"\r\n", b"\n\n", b"\r\n ", b"\x7f", b",")


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """``data`` with one random change to its bytes."""
    if not data:
        return data
    at = rng.randrange(len(data))
    kind = rng.randrange(6)
    if kind == 0:
        return data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1 :]
    if kind == 1:
        return data[:at] + rng.choice(_INSERTS) + data[at:]
    if kind == 2:
        return data[:at] + data[at + 1 :]
    if kind == 3:
        return data[:at]
    if kind == 4:
        end = min(len(data), at + rng.randint(1, 40))
        return data[:end] + data[at:]
    return data[:at] + rng.choice(_INSERTS) + data[at + 1 :]


def _pieces(rng: random.Random, data: bytes, eof: bool) -> list[bytes]:
    """``data`` split at random points (whole, in 1-byte pieces, or cut a few times); then the
    end of file if ``eof``."""
    mode = rng.random()
    if mode < 0.2 or not data:
        cuts: list[int] = []
    elif mode < 0.35 and len(data) < 3000:
        cuts = list(range(1, len(data)))
    else:
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 6))))
    bounds = [0, *cuts, len(data)]
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    return [*pieces, b""] if eof else pieces


# -- the differential tests --------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    wire: bytes
    pieces: list[bytes]
    faults: list[str]
    mutated: bool


def _request_cases() -> Iterator[tuple[Case, list[Answer]]]:
    rng = random.Random(SEED)
    for _ in range(REQUEST_CASES):
        messages = [_request(rng) for _ in range(rng.choice([1, 1, 2, 3]))]
        if rng.random() < 0.35:
            _fault(rng, rng.choice(messages), request=True)
        wire = b"".join(message.encode(rng) for message in messages)
        mutated = rng.random() < 0.3
        if mutated:
            wire = _mutate(rng, wire)
        faults = [m.fault for m in messages if m.fault]
        answers = [_answer(rng) for _ in range(3)]
        yield Case(wire, _pieces(rng, wire, rng.random() < 0.5), faults, mutated), answers


def _answer(rng: random.Random) -> Answer:
    status = rng.choice([200, 200, 204, 304, 404])
    headers = [("content-type", "text/plain")]
    body = b"" if status in (204, 304) else rng.randbytes(rng.choice([0, 3]))
    if rng.random() < 0.6:
        headers.append(("content-length", str(len(body))))
    if rng.random() < 0.15:
        headers.append(("connection", "close"))
    return Answer(status, headers, body)


def _response_cases() -> Iterator[tuple[Case, list[str]]]:
    rng = random.Random(SEED + 1)
    for _ in range(RESPONSE_CASES):
        methods = [rng.choice(["GET", "GET", "POST", "HEAD"]) for _ in range(rng.choice([1, 2, 3]))]
        messages = [
            _response(rng, method, last=i == len(methods) - 1) for i, method in enumerate(methods)
        ]
        if rng.random() < 0.35:
            _fault(rng, rng.choice(messages), request=False)
        wire = b"".join(
            (_informational(rng) if rng.random() < 0.15 else b"") + message.encode(rng)
            for message in messages
        )
        mutated = rng.random() < 0.3
        if mutated:
            wire = _mutate(rng, wire)
        faults = [m.fault for m in messages if m.fault]
        eof = rng.random() < 0.5 or messages[-1].framing == "close"
        yield Case(wire, _pieces(rng, wire, eof), faults, mutated), methods


def _without_status(records: list[Record]) -> list[Record]:
    return [("refused",) if record[0] == "refused" else record for record in records]


@pytest.mark.usefixtures("oracle")
def test_b10_requests_are_read_as_h11_reads_them() -> None:
    """Thousands of requests (valid ones, ones with one named fault, byte-mutated ones),
    pipelined, split at random points: the codec's server side reads each as h11 does — the
    same heads, bodies, refusals and keep-alive decisions — but for the differences its
    docstring lists (patched into the oracle). Where the bytes carry one named fault and no
    mutation, the refusal's status agrees too."""
    failures = []
    for number, (case, answers) in enumerate(_request_cases()):
        ours, theirs = _serve_h1(case.pieces, answers), _serve_h11(case.pieces, answers)
        if case.mutated or len(case.faults) != 1:  # several faults: which is met first varies
            ours, theirs = _without_status(ours), _without_status(theirs)
        if ours != theirs:
            failures.append((number, case.faults, case.wire[:300], ours, theirs))
    assert not failures, _report(failures)


@pytest.mark.usefixtures("oracle")
def test_b10_responses_are_read_as_h11_reads_them() -> None:
    """Thousands of responses (informational ones before them, HEAD/204/304, chunked,
    close-delimited; with one named fault or byte-mutated), one after another on a
    kept-alive connection, split at random points: the codec's client side reads each as
    h11 does, but for the differences its docstring lists."""
    failures = []
    for number, (case, methods) in enumerate(_response_cases()):
        ours, theirs = _fetch_h1(case.pieces, methods), _fetch_h11(case.pieces, methods)
        if ours != theirs:
            failures.append((number, case.faults, case.wire[:300], ours, theirs))
    assert not failures, _report(failures)


def _report(failures: list[tuple[Any, ...]]) -> str:
    """The first cases that differ, each from the first record where the two readers part."""
    lines = [f"{len(failures)} cases differ; the first ones:"]
    for number, faults, wire, ours, theirs in failures[:6]:
        at = 0
        while at < min(len(ours), len(theirs)) and ours[at] == theirs[at]:
            at += 1
        lines += [
            f"case {number} {faults}: {wire[:200]!r}",
            f"  _h1: ...{ours[at : at + 2]}",
            f"  h11: ...{theirs[at : at + 2]}",
        ]
    return "\n".join(lines)


# -- framing sent: read back by h11 ------------------------------------------------------------


def _events(conn: h11.Connection) -> list[Any]:
    """Every event ``conn`` has for what it was given, up to the first need for more."""
    events = []
    while (event := conn.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
        events.append(event)
        if isinstance(event, h11.ConnectionClosed):
            break
    return events


def _field_list(rng: random.Random) -> list[tuple[str, str]]:
    names = [*_NAMES, "content-type", "Cache-Control", "X-A"]
    values = ["x", "a b", "a  \t b", "", "\x80\xff", "ctl\x01x", "text/event-stream"]
    return [(_casing(rng, rng.choice(names)), rng.choice(values)) for _ in range(rng.randrange(4))]


def test_b10_responses_sent_are_read_back_by_h11() -> None:
    """Hundreds of responses framed by :class:`ServerConnection` (status, fields, a body in
    pieces; with or without ``Content-Length``) to HTTP/1.1 and HTTP/1.0 requests, HEAD
    included, read back by an h11 client: the same status, fields and body; chunked to an
    HTTP/1.1 client when no length was given, delimited by the close (``connection:
    close``) to an HTTP/1.0 one; not a byte of body after a HEAD, 204 or 304 head; and the
    codec's keep-alive decision is h11's."""
    rng = random.Random(SEED + 2)
    for _ in range(400):
        version = rng.choice(["1.1", "1.1", "1.0"])
        method = rng.choice(["GET", "POST", "HEAD"])
        close = rng.random() < 0.2
        client = h11.Connection(h11.CLIENT)  # it sends HTTP/1.1 only: told the method alone
        client.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
        server = ServerConnection()
        server.receive_data(
            f"{method} / HTTP/{version}\r\nhost: x\r\n".encode()
            + (b"connection: close\r\n" if close else b"")
            + b"\r\n"
        )
        assert isinstance(server.next_event(), RequestHead)
        assert server.next_event() is END

        status = rng.choice([200, 201, 204, 304, 404, 500, 599, 999])
        headers = _field_list(rng)
        pieces = [rng.randbytes(rng.choice([0, 1, 9, 200])) for _ in range(rng.randrange(4))]
        body = b"" if method == "HEAD" or status in (204, 304) else b"".join(pieces)
        length = rng.random() < 0.5
        if length:
            headers.append((_casing(rng, "content-length"), str(len(body))))
        if rng.random() < 0.15:
            headers.append(("Connection", "close"))
        wire = server.response(status, headers)
        head_length = len(wire)
        if body:
            wire += b"".join(server.data(piece) for piece in pieces)
        wire += server.end()

        client.receive_data(wire)
        events = _events(client)
        bodiless = method == "HEAD" or status in (204, 304)
        close_delimited = not bodiless and not length and version == "1.0"
        if close_delimited:
            assert not any(isinstance(e, h11.EndOfMessage) for e in events)
            client.receive_data(b"")
            events += _events(client)
        response, *rest = events
        assert isinstance(response, h11.Response)
        assert response.status_code == status
        got = {name.decode(): value.decode("latin-1") for name, value in response.headers}
        given = {name.lower(): value for name, value in headers}
        given.pop("connection", None)  # "close" may be added to it
        assert {name: got.get(name) for name in given} == given
        assert b"".join(e.data for e in rest if isinstance(e, h11.Data)) == body
        assert isinstance(rest[-1 if not close_delimited else -2], h11.EndOfMessage)
        if bodiless:
            assert len(wire) == head_length  # not a byte after the head
        elif not length:
            chunked = version == "1.1"
            assert (got.get("transfer-encoding") == "chunked") is chunked
            assert ("close" in got.get("connection", "")) or chunked
        reuse = client.our_state is h11.DONE and client.their_state is h11.DONE
        assert server.can_continue is reuse


def test_b10_requests_sent_are_read_back_by_h11() -> None:
    """Hundreds of requests framed by :class:`ClientConnection`, read by an h11 server: the
    same method, target and fields, and the body framed by the ``Content-Length`` the codec
    sets — a caller's own ``Content-Length`` or ``Transfer-Encoding`` (which would frame
    the body otherwise, or twice) never goes out."""
    rng = random.Random(SEED + 3)
    for _ in range(300):
        method = rng.choice(["GET", "POST", "PUT", "x-Custom"])
        target = rng.choice(_TARGETS)
        headers = [("Host", "example"), *_field_list(rng)]
        if rng.random() < 0.2:
            headers.append(("Content-Length", "999"))
        if rng.random() < 0.2:
            headers.append(("Transfer-Encoding", "chunked"))
        body = rng.randbytes(rng.choice([0, 1, 300]))
        wire = ClientConnection().request(method, target, headers, body)
        server = h11.Connection(h11.SERVER)
        server.receive_data(wire)
        request, *rest = _events(server)
        assert isinstance(request, h11.Request)
        assert (request.method.decode(), request.target.decode()) == (method, target)
        got = {name.decode(): value.decode("latin-1") for name, value in request.headers}
        expected = {name.lower(): value for name, value in headers}
        expected.pop("transfer-encoding", None)
        expected["content-length"] = str(len(body))
        assert got == expected
        assert b"".join(e.data for e in rest if isinstance(e, h11.Data)) == body
        assert isinstance(rest[-1], h11.EndOfMessage)


def _answering(version: str = "1.1", method: str = "GET") -> ServerConnection:
    conn = ServerConnection()
    host = "host: x\r\n" if version == "1.1" else ""
    conn.receive_data(f"{method} / HTTP/{version}\r\n{host}\r\n".encode())
    assert isinstance(conn.next_event(), RequestHead)
    assert conn.next_event() is END
    return conn


def _respond(status: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> None:
    _answering().response(status, list(headers))


def _too_much() -> None:
    conn = _answering()
    conn.response(200, [("content-length", "2")])
    conn.data(b"abc")


def _too_little() -> None:
    conn = _answering()
    conn.response(200, [("content-length", "5")])
    conn.data(b"ab")
    conn.end()


def _data_after_the_end() -> None:
    conn = _answering()
    conn.response(200, [("content-length", "0")])
    conn.end()
    conn.data(b"x")


def _data_after_a_head_response() -> None:
    conn = _answering(method="HEAD")
    conn.response(200, [("content-length", "5")])
    conn.data(b"x")


def _two_responses() -> None:
    conn = _answering()
    conn.response(200, [])
    conn.response(200, [])


def _send(method: str = "GET", target: str = "/", *headers: tuple[str, str]) -> None:
    ClientConnection().request(method, target, [("host", "x"), *headers], b"")


@pytest.mark.parametrize(
    "send",
    [
        pytest.param(lambda: _respond(200, (("x", "a\r\nb"),)), id="CR LF in a value"),
        pytest.param(lambda: _respond(200, (("x", "a\nb"),)), id="LF in a value"),
        pytest.param(lambda: _respond(200, (("x", "a\rb"),)), id="CR in a value"),
        pytest.param(lambda: _respond(200, (("x", "a\x00b"),)), id="NUL in a value"),
        pytest.param(lambda: _respond(200, (("x", " a"),)), id="a leading space"),
        pytest.param(lambda: _respond(200, (("x", "a\t"),)), id="a trailing tab"),
        pytest.param(lambda: _respond(200, (("x", "\u2028"),)), id="a value not latin-1"),
        pytest.param(lambda: _respond(200, (("a b", "x"),)), id="a name with a space"),
        pytest.param(lambda: _respond(200, (("a:b", "x"),)), id="a name with a colon"),
        pytest.param(lambda: _respond(200, (("", "x"),)), id="an empty name"),
        pytest.param(lambda: _respond(200, (("é", "x"),)), id="a name not ASCII"),
        pytest.param(lambda: _respond(199), id="status 199"),
        pytest.param(lambda: _respond(101), id="status 101"),
        pytest.param(lambda: _respond(1000), id="status 1000"),
        pytest.param(lambda: _respond(200, (("content-length", "x"),)), id="a bad length"),
        pytest.param(_too_much, id="more data than the length"),
        pytest.param(_too_little, id="less data than the length"),
        pytest.param(_data_after_the_end, id="data after the end"),
        pytest.param(_data_after_a_head_response, id="data in a HEAD response"),
        pytest.param(_two_responses, id="two responses"),
        pytest.param(lambda: _send("G T"), id="a method with a space"),
        pytest.param(lambda: _send("GÉT"), id="a method not ASCII"),
        pytest.param(lambda: _send("GET", "/a b"), id="a target with a space"),
        pytest.param(lambda: _send("GET", "/\u2028"), id="a target not latin-1"),
        pytest.param(lambda: _send("GET", "/", ("x", "a\r\nb")), id="a request's CR LF"),
        pytest.param(lambda: _send("GET", "/", ("x", "\u2028")), id="a request's non-latin-1"),
        pytest.param(lambda: _send("GET", "/", ("host", "y")), id="two hosts"),
        pytest.param(lambda: ClientConnection().request("GET", "/", [], b""), id="no host"),
    ],
)
def test_b10_what_no_peer_may_receive_is_a_local_protocol_error(send: Callable[[], None]) -> None:
    """A field that could smuggle another one in (a line break, a NUL, surrounding space, a
    name that is no token, a character the wire cannot carry), a status outside 200 to 999, a
    body longer or shorter than its ``Content-Length``, data after the end or in a HEAD
    response, a request without its one ``Host``: refused with :class:`LocalProtocolError`
    before a byte is framed (never a ``UnicodeEncodeError`` escaping the shell's handling)."""
    with pytest.raises(LocalProtocolError):
        send()


def test_b10_the_framing_fields_are_read_in_their_one_spelling() -> None:
    """A ``Content-Length`` repeated or listed with one value is read as that value (RFC 9110
    §8.6, as h11 does) and the coding lower-cased: a handler reading the length as a number
    must not meet ``"5, 5"``."""
    conn = ServerConnection()
    conn.receive_data(_POST + b"content-length: 5, 5\r\nContent-Length: 5\r\n\r\nabcde")
    head = conn.next_event()
    assert isinstance(head, RequestHead)
    assert head.headers["content-length"] == "5"
    conn = ServerConnection()
    conn.receive_data(_POST + b"transfer-encoding: Chunked\r\n\r\n")
    head = conn.next_event()
    assert isinstance(head, RequestHead)
    assert head.headers["transfer-encoding"] == "chunked"


# -- refusals: each status --------------------------------------------------------------------


def _read_all(conn: ServerConnection) -> None:
    """Read every request ``conn`` was given (answering each ``200``), until it is refused."""
    while True:
        event = conn.next_event()
        assert event is not NEED_DATA, "not refused: more is waited for"
        assert event is not CLOSED, "not refused: read as whole requests"
        if event is END:
            conn.response(200, [("content-length", "0")])
            conn.end()
            conn.start_next_cycle()


def _refusal(wire: bytes, eof: bool = False) -> RemoteProtocolError:
    """How a :class:`ServerConnection` refuses ``wire`` (answering each request ``200``)."""
    conn = ServerConnection()
    conn.receive_data(wire)
    if eof:
        conn.receive_data(b"")
    with pytest.raises(RemoteProtocolError) as refused:
        _read_all(conn)
    assert conn.failed
    with pytest.raises(RemoteProtocolError):
        conn.next_event()  # nothing more is read
    return refused.value


_POST: Final = b"POST / HTTP/1.1\r\nhost: x\r\n"
_CHUNKED: Final = _POST + b"transfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(b"GET / HTTP/1.1\r\n\r\n", id="no host"),
        pytest.param(b"GET / HTTP/1.1\r\nhost: a\r\nHost: b\r\n\r\n", id="two hosts"),
        pytest.param(b"GET  / HTTP/1.1\r\nhost: x\r\n\r\n", id="two spaces"),
        pytest.param(b"GET / HTTP/1.1 \r\nhost: x\r\n\r\n", id="a space after the version"),
        pytest.param(b"G@T / HTTP/1.1\r\nhost: x\r\n\r\n", id="a method that is no token"),
        pytest.param(b"GET /\x80 HTTP/1.1\r\nhost: x\r\n\r\n", id="a target byte over 0x7e"),
        pytest.param(b"GET / http/1.1\r\nhost: x\r\n\r\n", id="a lower-case version"),
        pytest.param(b"\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n", id="a leading blank line"),
        pytest.param(b" GET / HTTP/1.1\r\n", id="a leading space"),
        pytest.param(b"GET / HTTP/1.1\r\nhost : x\r\n\r\n", id="a space before the colon"),
        pytest.param(b"GET / HTTP/1.1\r\nhost: x\r\nno colon\r\n\r\n", id="a line no field"),
        pytest.param(b"GET / HTTP/1.1\r\nhost: x\r\nx: a\x00b\r\n\r\n", id="a NUL in a value"),
        pytest.param(b"GET / HTTP/1.1\r\nhost: x\r\nx: a\rb\r\n\r\n", id="a bare CR"),
        pytest.param(b"GET / HTTP/1.1\r\nhost: x\r\nx: a\r\n b\r\n\r\n", id="a folded line"),
        pytest.param(_POST + b"content-length: 1\r\ncontent-length: 2\r\n\r\nab", id="two lengths"),
        pytest.param(_POST + b"content-length: 1, 2\r\n\r\nab", id="a listed length"),
        pytest.param(_POST + b"content-length: -1\r\n\r\n", id="a negative length"),
        pytest.param(_POST + b"content-length: " + b"1" * 21 + b"\r\n\r\n", id="21 digits"),
        pytest.param(
            _POST + b"transfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n0\r\n\r\n",
            id="transfer-encoding and content-length",
        ),
        pytest.param(
            b"POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            id="transfer-encoding in HTTP/1.0",
        ),
        pytest.param(_CHUNKED + b"z\r\n", id="a chunk size no number"),
        pytest.param(_CHUNKED + b"f" * 21 + b"\r\n", id="a chunk size of 21 digits"),
        pytest.param(_CHUNKED + b"3\r\nabcX", id="a bad chunk end"),
        pytest.param(_CHUNKED + b"3\nabc\r\n", id="a chunk header ended by LF"),
        pytest.param(_CHUNKED + b"0\r\nx : y\r\n\r\n", id="a bad trailer line"),
        pytest.param(_CHUNKED + b"0\r\ncontent-length: x\r\n\r\n", id="a bad length trailer"),
        pytest.param(_CHUNKED + b"0\r\nx: y\r\n z\r\n\r\n", id="a folded trailer line"),
    ],
)
def test_b10_a_malformed_request_is_refused_400(wire: bytes) -> None:
    """A request outside RFC 9112's grammar, a framing that could be read two ways, or one
    the codec's docstring lists as refused: ``400``, and nothing more is read."""
    assert _refusal(wire).status == 400


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(b"GET / HTTP/1.1\r\nhost: x\r\nx: " + b"a" * MAX_HEAD, id="a head"),
        pytest.param(_CHUNKED + b"5;" + b"e" * MAX_HEAD, id="a chunk header"),
        pytest.param(_CHUNKED + b"0\r\nx: " + b"t" * MAX_HEAD, id="a trailer"),
    ],
)
def test_b10_a_head_over_16_kib_is_refused_431(wire: bytes) -> None:
    """A head (or chunk header, or trailer section) still not whole past :data:`MAX_HEAD`
    bytes: ``431`` — the codec does not hold more of it."""
    assert _refusal(wire).status == 431


def test_b10_a_head_of_16_kib_is_read_and_one_byte_more_is_431() -> None:
    """The bound's edge, a head arriving whole: :data:`MAX_HEAD` bytes before its blank line
    are read, one more is ``431``."""
    start = b"GET / HTTP/1.1\r\nhost: x\r\nx: "
    fits = start + b"a" * (MAX_HEAD - len(start) - 1) + b"\r\n\r\n"
    conn = ServerConnection()
    conn.receive_data(fits)
    assert isinstance(conn.next_event(), RequestHead)
    over = start + b"a" * (MAX_HEAD - len(start)) + b"\r\n\r\n"
    assert _refusal(over).status == 431


@pytest.mark.parametrize(
    "coding", [b"gzip", b"identity", b"gzip, chunked", b"chunked, chunked", b"chunked\r\nte: x"]
)
def test_b10_a_transfer_coding_other_than_chunked_is_refused_501(coding: bytes) -> None:
    """``Transfer-Encoding`` other than one ``chunked``: ``501`` (not implemented)."""
    wire = _POST + b"transfer-encoding: " + coding.replace(b"te:", b"transfer-encoding:")
    assert _refusal(wire + b"\r\n\r\n").status == 501


def test_b10_two_transfer_encoding_lines_are_refused_501() -> None:
    """Two ``Transfer-Encoding`` lines, each ``chunked``: the coding twice, ``501``."""
    wire = _POST + b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n"
    assert _refusal(wire).status == 501


@pytest.mark.parametrize("version", [b"2.0", b"1.2", b"0.9", b"3.7"])
def test_b10_a_version_other_than_1_0_and_1_1_is_refused_505(version: bytes) -> None:
    """A request, or a response, of another HTTP version: ``505`` (the codec speaks 1.0 and
    1.1 only)."""
    assert _refusal(b"GET / HTTP/" + version + b"\r\nhost: x\r\n\r\n").status == 505
    client = ClientConnection()
    client.request("GET", "/", [("host", "x")], b"")
    client.receive_data(b"HTTP/" + version + b" 200 OK\r\ncontent-length: 0\r\n\r\n")
    with pytest.raises(RemoteProtocolError) as refused:
        client.next_event()
    assert refused.value.status == 505


@pytest.mark.parametrize(
    "status_line",
    [b"HTTP/1.1 099 Odd", b"HTTP/1.1 000", b"HTTP/1.1 101 Switching Protocols", b"HTTP/1.1 20"],
)
def test_b10_a_response_status_under_100_or_a_switch_is_refused(status_line: bytes) -> None:
    """A status under 100 is none (h11 refuses it; the codec read it as an informational
    response and went on to the next head), and a switch no request asked for is refused."""
    client = ClientConnection()
    client.request("GET", "/", [("host", "x")], b"")
    client.receive_data(status_line + b"\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
    with pytest.raises(RemoteProtocolError):
        client.next_event()


@pytest.mark.parametrize(
    ("method", "status", "framing"),
    [
        ("GET", 204, b"transfer-encoding: gzip"),
        ("GET", 304, b"content-length: x"),
        ("GET", 100, b"content-length: 1, 2"),
        ("HEAD", 200, b"content-length: -5"),
    ],
)
def test_b10_a_bad_framing_field_is_refused_where_it_frames_nothing(
    method: str, status: int, framing: bytes
) -> None:
    """A response's ``Content-Length`` or ``Transfer-Encoding`` is checked even where it
    frames no body (a 1xx, 204 or 304, or the answer to HEAD), as h11 does: the codec took
    them unread."""
    client = ClientConnection()
    client.request(method, "/", [("host", "x")], b"")
    client.receive_data(b"HTTP/1.1 %d X\r\n%b\r\n\r\n" % (status, framing))
    with pytest.raises(RemoteProtocolError):
        client.next_event()


def test_b10_a_refusal_never_quotes_a_field_line() -> None:
    """A refused field line may carry a secret (an ``Authorization`` line with a space before
    its colon, a cookie): the error's text says what was wrong, never the line's bytes."""
    secret = b"sk-secret-0123"
    for wire in (
        b"GET / HTTP/1.1\r\nhost: x\r\nauthorization : Bearer " + secret + b"\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + secret + b"\x00\r\n\r\n",
        _CHUNKED + b"0\r\nauthorization : " + secret + b"\r\n\r\n",
        b"GET /?key=" + secret + b" HTTP/1.1 x\r\nhost: x\r\n\r\n",
    ):
        assert secret.decode() not in str(_refusal(wire))
    client = ClientConnection()
    client.request("GET", "/", [("host", "x")], b"")
    client.receive_data(b"HTTP/1.1 200 OK\r\nset-cookie : " + secret + b"\r\n\r\n")
    with pytest.raises(RemoteProtocolError) as refused:
        client.next_event()
    assert secret.decode() not in str(refused.value)


# -- the listed differences, asserted against h11 as it is -------------------------------------


def _h11_reads(wire: bytes) -> tuple[h11.Request, bytes]:
    """The request plain h11 reads from ``wire``, and its body."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(wire)
    request, *rest = _events(conn)
    assert isinstance(request, h11.Request)
    assert isinstance(rest[-1], h11.EndOfMessage)
    return request, b"".join(e.data for e in rest if isinstance(e, h11.Data))


def test_b10_obsolete_line_folding_is_refused_where_h11_joins_the_lines() -> None:
    """A field line continued on the next (obsolete line folding): h11 joins the two, the
    codec refuses it ``400`` (RFC 9112 §5.2 lets a server do either; a fold is how one
    field hides inside another's value)."""
    wire = b"GET / HTTP/1.1\r\nhost: x\r\nx-a: one\r\n two\r\n\r\n"
    request, _ = _h11_reads(wire)
    assert (b"x-a", b"one two") in list(request.headers)
    assert _refusal(wire).status == 400


def test_b10_transfer_encoding_with_content_length_is_refused_where_h11_lets_the_coding_win() -> (
    None
):
    """A request with both ``Transfer-Encoding`` and ``Content-Length``: h11 reads the body
    chunked; the codec refuses it ``400`` (RFC 9112 §6.1: a server may; the two readings of
    such a request are how requests are smuggled past a proxy)."""
    wire = _POST + b"transfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    assert _h11_reads(wire)[1] == b"abc"
    assert _refusal(wire).status == 400


def test_b10_a_whole_head_over_16_kib_is_refused_where_h11_takes_it() -> None:
    """A head over :data:`MAX_HEAD` bytes arriving in one read: h11 bounds only the bytes it
    holds while a head is incomplete, and takes it; the codec refuses it ``431`` whatever the
    reads (a head's bound should not depend on how the bytes were cut)."""
    wire = b"GET / HTTP/1.1\r\nhost: x\r\nx: " + b"a" * MAX_HEAD + b"\r\n\r\n"
    _h11_reads(wire)
    assert _refusal(wire).status == 431


@pytest.mark.parametrize("version", [b"2.0", b"1.2", b"0.9"])
def test_b10_another_version_is_refused_where_h11_takes_it(version: bytes) -> None:
    """``HTTP/2.0``, ``1.2``, ``0.9``: h11 reads any ``x.y`` as HTTP/1.1 (keep-alive and
    all); the codec answers ``505``."""
    wire = b"GET / HTTP/" + version + b"\r\nhost: x\r\n\r\n"
    assert _h11_reads(wire)[0].http_version == version
    assert _refusal(wire).status == 505


def test_b10_transfer_encoding_in_http_1_0_is_refused_where_h11_reads_it() -> None:
    """An HTTP/1.0 message with ``Transfer-Encoding``: h11 reads it chunked; RFC 9112 §6.1
    says its framing must be treated as faulty (a 1.0 peer does not speak chunked, so the
    two sides disagree on where it ends): the codec refuses it, ``400``, and a client so
    answered refuses the response."""
    wire = b"POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    assert _h11_reads(wire)[1] == b"abc"
    assert _refusal(wire).status == 400
    client = ClientConnection()
    client.request("GET", "/", [("host", "x")], b"")
    client.receive_data(b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n")
    with pytest.raises(RemoteProtocolError):
        client.next_event()


# -- buffering ---------------------------------------------------------------------------------


def _byte_by_byte(conn: ServerConnection | ClientConnection, wire: bytes) -> list[Any]:
    """The events of ``wire`` fed one byte at a time."""
    events = []
    for at in range(len(wire)):
        conn.receive_data(wire[at : at + 1])
        while (event := conn.next_event()) is not NEED_DATA:
            events.append(event)
    return events


def test_b10_a_slow_head_is_read_once_whole_in_linear_time() -> None:
    """A head of nearly :data:`MAX_HEAD` bytes arriving a byte at a time: nothing until its
    last byte, then the head — and the bytes are searched once, not again on each byte (a
    rescan from the start would be quadratic: a slow client's bytes costing the server's
    CPU). Measured in this process's CPU time, against a bound far above linear work."""
    wire = b"GET / HTTP/1.1\r\nhost: x\r\nx: " + b"a" * (MAX_HEAD - 100) + b"\r\n\r\n"
    conn = ServerConnection()
    started = time.process_time()
    for at in range(len(wire) - 1):
        conn.receive_data(wire[at : at + 1])
        assert conn.next_event() is NEED_DATA
    conn.receive_data(wire[-1:])
    assert isinstance(conn.next_event(), RequestHead)
    assert time.process_time() - started < CPU_BOUND


def test_b10_slow_chunk_headers_and_trailers_are_read_in_linear_time() -> None:
    """The same for a chunked body: chunk headers with long extensions and a long trailer
    section, each nearly :data:`MAX_HEAD` bytes, arriving a byte at a time, cost about what
    the same bytes cost as a length-framed body fed alike (the codec searched each such line
    from its start on every byte: ~5 times that, ~0.15 s of CPU per 16 KiB line, a core held
    by a slow client with a few such chunks). A ratio in this process's CPU time, so that
    the machine's speed and load cancel out."""
    extension = b";" + b"e" * (MAX_HEAD - 100)
    chunks = b"".join(b"1" + extension + b"\r\n" + bytes([65 + i]) + b"\r\n" for i in range(6))
    wire = chunks + b"0\r\nx-t: " + b"t" * (MAX_HEAD - 100) + b"\r\n\r\n"
    chunked = ServerConnection()
    chunked.receive_data(_CHUNKED)
    assert isinstance(chunked.next_event(), RequestHead)
    started = time.process_time()
    events = _byte_by_byte(chunked, wire)
    spent = time.process_time() - started
    assert b"".join(e.data for e in events if isinstance(e, Data)) == b"ABCDEF"
    assert events[-1] is END

    framed = ServerConnection()
    framed.receive_data(_POST + b"content-length: %d\r\n\r\n" % len(wire))
    assert isinstance(framed.next_event(), RequestHead)
    started = time.process_time()
    _byte_by_byte(framed, wire)
    reference = time.process_time() - started
    assert spent < 2.5 * reference


def test_b10_the_body_bytes_of_one_read_come_out_as_one_data_event() -> None:
    """All the body bytes one read made available come out as one :class:`Data` — a
    length-framed body, and a chunked one of many chunks (h11 gave each chunk its own
    event) — so that a relay writes once per read; the end comes on the next call."""
    conn = ServerConnection()
    conn.receive_data(_POST + b"content-length: 10\r\n\r\n0123456789")
    assert isinstance(conn.next_event(), RequestHead)
    assert conn.next_event() == Data(b"0123456789")
    assert conn.next_event() is END

    chunks = b"".join(b"%x;i=%d\r\n%b\r\n" % (i, i, b"x" * i) for i in range(1, 40))
    conn = ServerConnection()
    conn.receive_data(_CHUNKED + chunks[:-5])
    assert isinstance(conn.next_event(), RequestHead)
    first = conn.next_event()
    assert isinstance(first, Data)
    assert conn.next_event() is NEED_DATA
    conn.receive_data(chunks[-5:] + b"0\r\n\r\n")
    last = conn.next_event()
    assert isinstance(last, Data)
    assert first.data + last.data == b"".join(b"x" * i for i in range(1, 40))
    assert conn.next_event() is END


def test_b10_pipelined_requests_wait_for_start_next_cycle() -> None:
    """Two requests in one read: after the first one's end the second is not read (its bytes
    wait) until the first is answered and :meth:`ServerConnection.start_next_cycle` called —
    which is refused before the answer has ended."""
    conn = ServerConnection()
    conn.receive_data(b"GET /1 HTTP/1.1\r\nhost: x\r\n\r\nGET /2 HTTP/1.1\r\nhost: x\r\n\r\n")
    first = conn.next_event()
    assert isinstance(first, RequestHead)
    assert first.target == "/1"
    assert conn.next_event() is END
    assert conn.next_event() is NEED_DATA
    assert conn.buffered
    with pytest.raises(LocalProtocolError):
        conn.start_next_cycle()
    conn.response(200, [])
    answering = conn.can_continue
    with pytest.raises(LocalProtocolError):
        conn.start_next_cycle()
    conn.data(b"answer")
    conn.end()
    assert not answering
    assert conn.can_continue
    conn.start_next_cycle()
    second = conn.next_event()
    assert isinstance(second, RequestHead)
    assert second.target == "/2"


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(b"GET / HTTP/1.1\r\nhost: x\r\n", id="in a head"),
        pytest.param(_POST + b"content-length: 5\r\n\r\nabc", id="in a length-framed body"),
        pytest.param(_POST + b"content-length: 5\r\n\r\n", id="before a body"),
        pytest.param(_CHUNKED + b"5", id="in a chunk header"),
        pytest.param(_CHUNKED + b"5\r\nab", id="in a chunk"),
        pytest.param(_CHUNKED + b"2\r\nab\r", id="in a chunk's end"),
        pytest.param(_CHUNKED + b"0\r\n", id="before the trailer"),
        pytest.param(_CHUNKED + b"0\r\nx: y\r\n", id="in the trailer"),
    ],
)
def test_b10_the_end_of_file_inside_a_request_is_a_remote_protocol_error(wire: bytes) -> None:
    """The connection's end inside a head or a body: the request is cut, a
    :class:`RemoteProtocolError` (never a short body read as whole)."""
    _refusal(wire, eof=True)


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(b"", id="before a response"),
        pytest.param(b"HTTP/1.1 200 OK\r\n", id="in a head"),
        pytest.param(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nabc", id="in a body"),
        pytest.param(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab", id="chunk"),
    ],
)
def test_b10_the_end_of_file_inside_a_response_is_a_remote_protocol_error(wire: bytes) -> None:
    """The same for a response: cut, never read as whole."""
    client = ClientConnection()
    client.request("GET", "/", [("host", "x")], b"")
    client.receive_data(wire)
    client.receive_data(b"")
    with pytest.raises(RemoteProtocolError):  # noqa: PT012 - the body's bytes come first
        while client.next_event() is not END:
            pass


def test_b10_the_end_of_file_between_requests_is_closed() -> None:
    """The connection's end after a whole request and its answer: :data:`CLOSED`."""
    conn = _answering()
    conn.response(200, [("content-length", "0")])
    conn.end()
    conn.start_next_cycle()
    assert conn.next_event() is NEED_DATA
    conn.receive_data(b"")
    assert conn.next_event() is CLOSED


def test_b10_a_close_delimited_response_ends_at_the_end_of_file() -> None:
    """A response with neither length nor coding ends at the connection's end: its bytes
    come as they arrive, its end only with the close, and the connection is not reused."""
    client = ClientConnection()
    client.request("GET", "/", [("host", "x")], b"")
    client.receive_data(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\nabc")
    head = client.next_event()
    assert isinstance(head, ResponseHead)
    assert head.status == 200
    assert client.next_event() == Data(b"abc")
    assert client.next_event() is NEED_DATA
    client.receive_data(b"def")
    assert client.next_event() == Data(b"def")
    client.receive_data(b"")
    assert client.next_event() is END
    assert not client.reusable
