"""Where the commands and the server log: standard error, plain text or JSON lines (O11)."""

from __future__ import annotations

import datetime
import logging
import sys
from typing import Any

from .._logs import FIELDS
from ._base import JSON, logger


class _JsonLines(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and the stable fields the
    record carries (``event``, ``delivery``, ``room``, ``lane``, ``task``, ``epoch``,
    ``code``, ``outcome``, ``seq``: ``runtime/_logs.py``). A line of the command's own
    (``pi-runtime: …``) is the event ``command``; one of a library that gave none, ``log``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value if isinstance(value, int | str) else str(value)
        entry.setdefault("event", "command" if record.name == logger.name else "log")
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return JSON.encode(entry).decode()


class _Plain(logging.Formatter):
    """``pi-runtime: message`` for the command's own words; time, level and logger for the
    rest (the server's logs)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if record.name == logger.name:
            code = getattr(record, "code", None)
            text = f"pi-runtime: {code}: " if code is not None else "pi-runtime: "
            text += record.getMessage()
            if record.exc_info:
                text += "\n" + self.formatException(record.exc_info)
            return text
        return super().format(record)


def configure_logging(*, json_lines: bool, level: int = logging.INFO) -> logging.Handler:
    """Send every log record to standard error, as JSON lines or plain text (O11); the
    handler installed on the root logger (remove it to undo)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLines() if json_lines else _Plain())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    return handler
