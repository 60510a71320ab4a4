"""Where the commands and the server log: standard error, plain text or JSON lines (O11)."""

from __future__ import annotations

import datetime
import logging
import queue
import sys
import threading
from collections.abc import Sequence
from typing import Any, Final, TextIO

from .._logs import FIELDS
from ._base import JSON, hide_passwords, logger


class _Quoting(logging.Formatter):
    """A line of the command's own may quote what was typed (a DSN given to the wrong
    option): the password of any DSN in it, or in an argument of ``argv``, is hidden (O17)."""

    def __init__(self, fmt: str | None = None, *, argv: Sequence[str] = ()) -> None:
        super().__init__(fmt)
        self._argv = tuple(argv)

    def _message(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        return hide_passwords(message, self._argv) if record.name == logger.name else message


class _JsonLines(_Quoting):
    """One JSON object per record: time, level, logger, message, and the stable fields the
    record carries (``event``, ``delivery``, ``room``, ``lane``, ``task``, ``epoch``,
    ``code``, ``outcome``, ``seq``: ``runtime/_logs.py``). A line of the command's own
    (``pi-runtime: …``) is the event ``command``; one of a library that gave none, ``log``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": self._message(record),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value if isinstance(value, int | str) else str(value)
        entry.setdefault("event", "command" if record.name == logger.name else "log")
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        try:
            return JSON.encode(entry).decode()
        except UnicodeEncodeError:  # a name of bytes that are not UTF-8 (lone surrogates)
            return JSON.encode({key: _utf8(value) for key, value in entry.items()}).decode()


def _utf8(value: object) -> object:
    """A text with every character UTF-8 cannot encode written as its escape (``\\udcff``,
    as a plain-text line shows it): the line is written, not lost (L1)."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


class _Plain(_Quoting):
    """``pi-runtime: message`` for the command's own words; time, level and logger for the
    rest (the server's logs)."""

    def __init__(self, *, argv: Sequence[str] = ()) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s", argv=argv)

    def format(self, record: logging.LogRecord) -> str:
        if record.name == logger.name:
            code = getattr(record, "code", None)
            text = f"pi-runtime: {code}: " if code is not None else "pi-runtime: "
            text += self._message(record)
            if record.exc_info:
                text += "\n" + self.formatException(record.exc_info)
            return text
        return super().format(record)


LOG_QUEUE: Final = 10_000
"""Lines waiting for standard error at most; beyond it a line is dropped and counted."""


class OffloadedHandler(logging.Handler):
    """Formats a record on the thread that logs it and hands the line to a thread of its own
    that writes it: a slow or blocked standard error (a full pipe nobody reads) never stalls
    the Trio loop. Bounded: past :data:`LOG_QUEUE` lines waiting, lines are dropped and counted,
    and the writer says how many once it catches up (the event ``log_lines_dropped``).
    :meth:`close` writes every line still waiting, then stops the thread."""

    def __init__(self, stream: TextIO, formatter: logging.Formatter) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self._stream = stream
        self._lines: queue.Queue[str | None] = queue.Queue(LOG_QUEUE)
        self._dropped = 0
        self._count_lock = threading.Lock()
        self._writer = threading.Thread(target=self._write, name="pi-runtime-log", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        try:
            self._lines.put_nowait(line)
        except queue.Full:
            with self._count_lock:
                self._dropped += 1

    def _write(self) -> None:
        while True:
            line = self._lines.get()
            with self._count_lock:
                dropped, self._dropped = self._dropped, 0
            if dropped:
                self._out(self._dropped_line(dropped))
            if line is None:
                return
            self._out(line)

    def _dropped_line(self, count: int) -> str:
        record = logging.makeLogRecord(
            {
                "name": "runtime.log",
                "levelno": logging.WARNING,
                "levelname": "WARNING",
                "msg": "%d log lines dropped: standard error was not read fast enough",
                "args": (count,),
                "event": "log_lines_dropped",
            }
        )
        return self.format(record)

    def _out(self, line: str) -> None:
        try:
            self._stream.write(line + "\n")
            self._stream.flush()
        except (OSError, ValueError):
            pass  # standard error is gone: nothing is left to tell

    def close(self) -> None:
        if self._writer.is_alive():
            self._lines.put(None)  # after every line already waiting
            self._writer.join(timeout=10.0)
        super().close()


def configure_logging(
    *, json_lines: bool, level: int = logging.INFO, argv: Sequence[str] = ()
) -> logging.Handler:
    """Send every log record to standard error, as JSON lines or plain text (O11), written by
    a thread of its own (:class:`OffloadedHandler`); the handler installed on the root logger
    (remove and close it to undo: closing writes what is still waiting). ``argv``: the
    command line, whose passwords the command's own lines never quote (O17)."""
    formatter = _JsonLines(argv=argv) if json_lines else _Plain(argv=argv)
    handler = OffloadedHandler(sys.stderr, formatter)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    return handler
