"""Fake-Pi's conversation: its Pi session file, written as Pi writes it.

Like Pi, Fake-Pi creates the session file only when the first user or
assistant message exists (header, ``model_change``, ``thinking_level_change``,
then what was pending, e.g. the system message), appends one line per finished
entry without fsync, resumes an existing file by appending (leaf = last line),
and with ``--no-session`` keeps everything in memory. Appends are synchronous,
as Pi's ``appendFileSync`` is: they are small, and keeping them off threads
keeps virtual-time tests deterministic.

A torn last line (a previous process died mid-append) is cut off when the file
is opened; Pi would skip it and append after it, which the runtime never lets
happen (it truncates torn tails before relaunching a worker).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runtime.worker_kit import (
    Session,
    SessionWriter,
    WallClock,
    iso_timestamp,
    read_session,
    stringify,
    truncate_torn_tail,
    uuid7,
)

from ._messages import context_from_path

__all__ = ["Conversation"]


class Conversation:
    """The session-backed (or in-memory) list of entries behind one agent."""

    def __init__(
        self,
        *,
        path: Path | None,
        cwd: Path,
        provider: str,
        model_id: str,
        clock: WallClock,
        session_id: str | None = None,
    ) -> None:
        self.path = path
        self._session_id = session_id
        self._cwd = cwd
        self._provider = provider
        self._model_id = model_id
        self._clock = clock
        self._writer: SessionWriter | None = None
        self._pending: list[dict[str, Any]] = []
        self._memory: list[dict[str, Any]] = []  # entries when there is no file (yet)
        self.resumed = False
        if path is not None and path.exists():
            truncate_torn_tail(path)
            self._writer = SessionWriter.open(path, clock=clock)
            self.resumed = True
            if not any(e.type == "message" for e in self._writer.session.entries):
                # Pi re-states its model and thinking level below the leaf of a session
                # that holds no message yet, and writes them at once
                for entry in self._settings_entries():
                    self._writer.append(entry)
        else:
            # a new session: the entries exist from the start (get_entries shows them);
            # the file is written with the first user or assistant message
            for entry in self._settings_entries():
                self.append(entry)

    def _settings_entries(self) -> list[dict[str, Any]]:
        return [
            {"type": "model_change", "provider": self._provider, "modelId": self._model_id},
            {"type": "thinking_level_change", "thinkingLevel": "off"},
        ]

    @property
    def session(self) -> Session | None:
        return self._writer.session if self._writer else None

    @property
    def session_id(self) -> str | None:
        session = self.session
        return session.id if session else self._session_id

    def entries(self) -> list[dict[str, Any]]:
        """Every entry in file order (all branches), as dicts."""
        if self._writer is not None:
            return [dict(e.raw) for e in self._writer.session.entries] + self._pending
        return self._memory + self._pending

    def path_entries(self) -> list[dict[str, Any]]:
        """The entries from the root to the leaf (the active branch)."""
        if self._writer is not None:
            path = [dict(e.raw) for e in self._writer.session.path_to_root()]
            return path + self._pending
        return self._memory + self._pending

    def context(self) -> list[dict[str, Any]]:
        return context_from_path(self.path_entries())

    @property
    def leaf_id(self) -> str | None:
        entries = self.path_entries()
        return entries[-1]["id"] if entries else None

    @property
    def is_new(self) -> bool:
        """No message has been recorded yet (a new session's first request)."""
        return not any(e.get("type") == "message" for e in self.entries())

    @property
    def needs_system_message(self) -> bool:
        """The active branch carries no system message: Pi then records one before the
        request (it diffs the path's system sections against its prompt; a session reopened
        on a branch without one, e.g. after a replay branch, gets a new one)."""
        return not any(m.get("role") == "system" for m in self.context())

    def _ensure_file(self) -> None:
        """Write the header and every entry so far, as Pi does at the first message."""
        if self._writer is not None or self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        now = self._clock.time_ms()
        header = {
            "type": "session",
            "version": 3,
            "id": self._session_id or uuid7(now),
            "timestamp": iso_timestamp(now),
            "cwd": str(self._cwd),
        }
        data = b"".join(stringify(item) + b"\n" for item in [header, *self._pending])
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        self._pending = []
        self._writer = SessionWriter.open(self.path, clock=self._clock)

    def append(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Record one entry below the leaf; return it as written."""
        if self._writer is None and self.path is not None:
            message = entry.get("message") or {}
            if entry.get("type") == "message" and message.get("role") in ("user", "assistant"):
                self._ensure_file()
        if self._writer is not None:
            return dict(self._writer.append(entry).raw)
        now = self._clock.time_ms()
        built = {
            "type": entry["type"],
            "id": os.urandom(4).hex(),
            "parentId": self.leaf_id,
            "timestamp": iso_timestamp(now),
            **{k: v for k, v in entry.items() if k != "type"},
        }
        if self.path is None:
            self._memory.append(built)
        else:
            self._pending.append(built)
        return built

    def append_message(self, message: dict[str, Any]) -> dict[str, Any]:
        return self.append({"type": "message", "message": message})

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    @staticmethod
    def read_entries(path: Path) -> list[dict[str, Any]]:
        return [dict(e.raw) for e in read_session(path).session.entries]
