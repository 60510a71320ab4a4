"""Typed scenarios for the scripted model.

A :class:`Scenario` is a list of steps; each model request takes the next step.
When the steps run out the model answers plainly and calls no tools. A scenario
is an object or a JSON/TOML file (``Scenario.load``). Only when a test enables
them (``directives=True``) are directives in the user text honoured, e.g.
``#sleep=30`` — see :func:`parse_directives`.

Every step type is a frozen msgspec Struct tagged by ``kind``.
"""

from __future__ import annotations

import base64
import errno
import os
import re
import shlex
import stat
import struct
import zlib
from pathlib import Path
from typing import Annotated, Any, Final, TypeVar

import msgspec

__all__ = [
    "STAY_SILENT",
    "TINY_PNG",
    "Attach",
    "Call",
    "Cut",
    "Empty",
    "Hang",
    "HttpError",
    "Scenario",
    "StaySilent",
    "Step",
    "Text",
    "Thinking",
    "ToolCalls",
    "UsageLimit",
    "parse_directives",
]

STAY_SILENT = "[[stay-silent]]"

_Seconds = Annotated[float, msgspec.Meta(ge=0)]
"""A delay or duration in a scenario file: not negative, not NaN (``inf`` is for ever)."""


class _Step(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", forbid_unknown_fields=True
):
    first_token_delay: _Seconds = 0.0
    """Seconds before the response starts (slow time to first token)."""


class Text(_Step, tag="text", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Stream ``text``, one token (word and its trailing space) per chunk."""

    text: str
    delay: _Seconds = 0.0
    """Seconds between chunks."""


class Thinking(_Step, tag="thinking", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Stream reasoning (``reasoning_content``), then ``text``."""

    thinking: str
    text: str = ""
    delay: _Seconds = 0.0


class Call(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    id: str | None = None
    """``None``: the server numbers it ``call_<n>``."""


class ToolCalls(_Step, tag="tool_calls", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One assistant message with one or several tool calls (and optional text)."""

    calls: list[Call]
    text: str = ""
    delay: _Seconds = 0.0
    omit_ids: bool = False
    """Send the calls without ids (some upstreams do; the gateway assigns them)."""


def _png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A valid PNG of one colour (no dependencies: zlib and the chunk CRCs)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = b"\x00" + bytes(rgb) * width
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


TINY_PNG: Final = base64.b64encode(_png(16, 16, (32, 96, 160))).decode()
"""A 16 by 16 blue PNG, base64: the picture an :class:`Attach` step makes by default."""


class Attach(_Step, tag="attach", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One round that makes a file in the working directory and attaches it to the reply: a
    ``bash`` call writing ``data`` (base64) to ``path``, then an ``attach`` call for it (the
    room must grant ``bash`` and ``attach``). The next step is usually the reply's text."""

    path: str = "picture.png"
    data: str = TINY_PNG
    """The file's bytes, base64."""
    name: str | None = None
    """The name the reply shows (``attach``'s ``name``); ``None``: the file's."""
    text: str = ""

    def as_tool_calls(self) -> ToolCalls:
        write = f"printf %s {shlex.quote(self.data)} | base64 -d > {shlex.quote(self.path)}"
        directory = str(Path(self.path).parent)
        if directory != ".":
            write = f"mkdir -p {shlex.quote(directory)} && {write}"
        attach: dict[str, Any] = {"path": self.path}
        if self.name is not None:
            attach["name"] = self.name
        return ToolCalls(
            calls=[
                Call(name="bash", arguments={"command": write}),
                Call(name="attach", arguments=attach),
            ],
            text=self.text,
            first_token_delay=self.first_token_delay,
        )


class Hang(_Step, tag="hang", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Start the response, then total silence for ``seconds``, then drop the connection."""

    seconds: _Seconds


class Cut(_Step, tag="cut", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Stream ``text`` but drop the connection after ``after_chunks`` chunks."""

    text: str = "this answer is cut off in the middle"
    after_chunks: Annotated[int, msgspec.Meta(ge=0)] = 2
    delay: _Seconds = 0.0


class HttpError(_Step, tag="http_error", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Answer with an HTTP error (default 500, which Pi retries)."""

    status: Annotated[int, msgspec.Meta(ge=400, le=599)] = 500
    """An HTTP error status, 400 to 599 (a scenario file with another is refused)."""
    message: str = "internal server error"


class UsageLimit(_Step, tag="usage_limit", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Answer 429 with OpenAI's ``insufficient_quota`` code (Pi does not retry it)."""

    message: str = "You exceeded your current quota, please check your plan and billing details."


class Empty(_Step, tag="empty", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A well-formed response with no content at all (``finish_reason: stop``)."""


class StaySilent(_Step, tag="stay_silent", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Answer exactly ``[[stay-silent]]``."""


Step = (
    Text | Thinking | ToolCalls | Attach | Hang | Cut | HttpError | UsageLimit | Empty | StaySilent
)


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    steps: list[Step] = msgspec.field(default_factory=list)

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        """Read a scenario from a ``.json`` or ``.toml`` file.

        Error handling: a path that is not a regular file (a FIFO, a device, a directory) is
        an :class:`OSError` at once, never waited on; bytes that are not UTF-8 JSON/TOML, or
        nested deeper than the parser follows, a :class:`msgspec.DecodeError`; a step of an
        unknown kind, with an unknown field, a negative or NaN delay or duration, a negative
        chunk count or an ``http_error`` status outside 400 to 599 a
        :class:`msgspec.ValidationError`.
        """
        return _load_document(path, cls)

    def dump_json(self) -> bytes:
        return msgspec.json.encode(self)


_T = TypeVar("_T")


def _load_document(path: str | Path, kind: type[_T]) -> _T:
    """``path`` decoded as ``kind``: TOML for a ``.toml`` name, else JSON (what
    :meth:`Scenario.load` does, for Fake-Pi's other test files too).

    Opened without waiting (a FIFO with no writer blocks a plain open for ever) and checked to
    be a regular file before a byte is read (``/dev/zero`` never ends)."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
            raise OSError(code, "not a regular file (a .json or .toml file is)", str(path))
        with open(fd, "rb", closefd=False) as stream:
            data = stream.read()
    finally:
        os.close(fd)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise msgspec.DecodeError(f"not UTF-8 text (byte {exc.start})") from None
    try:
        if path.suffix == ".toml":
            return msgspec.toml.decode(data, type=kind)
        return msgspec.json.decode(data, type=kind)
    except RecursionError:
        raise msgspec.DecodeError(f"{path} is nested too deeply for the parser to follow") from None


_DIRECTIVE = re.compile(r"#([a-z_0-9]+)(?:=([^\s]+))?")


def parse_directives(text: str) -> Step | None:
    """The step a test directive in ``text`` asks for, or ``None``.

    ``#text`` / ``#text=WORDS`` (underscores become spaces), ``#slowtext=N``
    (N chunks 0.5 s apart), ``#sleep=N`` (a ``bash sleep N`` tool call),
    ``#bash=CMD`` (underscores become spaces), ``#read=PATH``,
    ``#effect=KEY``, ``#attach`` / ``#attach=FILE`` (:class:`Attach`), ``#hang=N``,
    ``#ttft=N`` (slow first token), ``#cut``,
    ``#fail500``, ``#usage_limit``, ``#empty``, ``#think``, ``#silent``.
    Only honoured when the model was started with directives enabled. A directive whose number
    is not one it can use (``#hang=soon``, ``#ttft=-1``, ``#slowtext=nan``) is no directive,
    like an unknown name: the text is answered as any other.
    """
    for name, value in _DIRECTIVE.findall(text):
        step = _directive(name, value)
        if step is not None:
            return step
    return None


def _seconds(value: str, default: float) -> float | None:
    """A directive's seconds: ``default`` when none is given; ``None`` when unusable."""
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None  # NaN fails the comparison too


def _directive(name: str, value: str) -> Step | None:
    """The step of one ``#name=value`` directive; ``None`` for no directive."""
    match name:
        case "text":
            return Text(text=value.replace("_", " ") if value else "ok")
        case "slowtext":
            if value and not (value.isascii() and value.isdigit()):
                return None
            count = int(value or 3)
            return Text(text=" ".join(f"chunk{i}" for i in range(count)), delay=0.5)
        case "sleep":
            return ToolCalls(calls=[Call(name="bash", arguments={"command": f"sleep {value}"})])
        case "bash":
            return ToolCalls(
                calls=[Call(name="bash", arguments={"command": value.replace("_", " ")})]
            )
        case "read":
            return ToolCalls(calls=[Call(name="read", arguments={"path": value})])
        case "effect":
            return ToolCalls(calls=[Call(name="effect", arguments={"key": value})])
        case "attach":
            return Attach(path=value) if value else Attach()
        case "hang":
            seconds = _seconds(value, 3600)
            return None if seconds is None else Hang(seconds=seconds)
        case "ttft":
            seconds = _seconds(value, 5)
            return (
                None if seconds is None else Text(text="slow to start", first_token_delay=seconds)
            )
        case "cut":
            return Cut()
        case "fail500":
            return HttpError()
        case "usage_limit":
            return UsageLimit()
        case "empty":
            return Empty()
        case "think":
            return Thinking(thinking="let me think", text="thought it through")
        case "silent":
            return StaySilent()
    return None
