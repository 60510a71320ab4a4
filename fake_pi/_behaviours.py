"""Test behaviours of a Fake-Pi process, and its recorder.

For watchdog and crash tests a Fake-Pi can be told to misbehave at a named
*barrier*: ``startup``, ``before_tool:N`` / ``after_tool:N`` (the N-th tool call,
counted from 1 over the process's life), ``before_model:N`` / ``after_model:N``
(the N-th model response), ``mid_stream:N`` (after the first chunk of the N-th
model response), ``settled:N`` (the N-th ``agent_settled``), ``agent_start:N`` (before the
N-th run emits anything: a worker slow to start on a loaded machine), ``abort:N`` (the N-th
``abort`` command, before it is carried out: ``hang`` there is a wedged worker that neither
aborts nor answers while its run goes on; a shutdown's own abort passes no barrier),
``prompt:N`` (the N-th ``prompt`` command, before it is answered or started).
Actions: ``kill`` (SIGKILL itself), ``exit:CODE``, ``hang`` (stop doing anything, forever),
``delay:SECONDS`` (do nothing for that long, then go on).
``ignore_sigterm`` makes SIGTERM wait that many seconds before it takes
effect. The recorder writes launch argv, environment *keys* (never values),
stdin lines and tool executions as JSON lines.

Behaviours come from ``--fake-config FILE`` or ``$FAKE_PI_CONFIG`` (JSON or TOML)
for a subprocess, or a :class:`Behaviours` object in-process.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import trio

from .scenario import Scenario

__all__ = ["BarrierExit", "BarrierKill", "Barriers", "Behaviours", "FakeConfig", "Recorder"]


class Behaviours(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    at: dict[str, str] = msgspec.field(default_factory=dict)
    """Barrier name -> action (``kill``, ``exit:CODE``, ``hang``, ``delay:SECONDS``)."""
    ignore_sigterm: float = 0.0


class Barriers:
    """Counts passes through each barrier and carries out the actions due."""

    def __init__(self, behaviours: Behaviours, *, in_process: bool) -> None:
        self.behaviours = behaviours
        self.in_process = in_process
        self._counts: Counter[str] = Counter()

    def action_for(self, kind: str) -> str | None:
        """Count one pass through ``kind``; the action due there, if any."""
        if kind == "startup":
            return self.behaviours.at.get("startup")
        self._counts[kind] += 1
        return self.behaviours.at.get(f"{kind}:{self._counts[kind]}")

    async def reach(self, kind: str) -> None:
        """Carry out the action due at this pass through ``kind``."""
        in_process = self.in_process
        action = self.action_for(kind)
        if action is None:
            return
        if action == "kill":
            if in_process:
                raise BarrierKill(kind)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        elif action.startswith("exit:"):
            if in_process:
                raise BarrierExit(int(action[5:]))
            sys.stdout.flush()
            os._exit(int(action[5:]))
        elif action == "hang":
            await trio.sleep_forever()
        elif action.startswith("delay:"):
            await trio.sleep(float(action[6:]))
        else:
            raise ValueError(f"unknown behaviour action {action!r} at {kind}")


class BarrierKill(Exception):
    """In-process stand-in for SIGKILL at a barrier: the agent stops dead."""


class BarrierExit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"exit {code}")
        self.code = code


class FakeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What ``--fake-config`` / ``$FAKE_PI_CONFIG`` may set."""

    scenario: Scenario | None = None
    directives: bool = False
    behaviours: Behaviours = msgspec.field(default_factory=Behaviours)
    record: str | None = None
    """Path of the recording file (JSON lines)."""
    tools: list[str] | None = None
    """The tools to expose (default: Pi's read, bash, edit, write); e.g. add ``effect``."""
    ledger: str | None = None
    """Path of the ``effect`` tool's ledger (default: ``.fake-pi-effects.jsonl`` in the cwd)."""

    @classmethod
    def load(cls, path: str | Path) -> FakeConfig:
        path = Path(path)
        data = path.read_bytes()
        if path.suffix == ".toml":
            return msgspec.toml.decode(data, type=cls)
        return msgspec.json.decode(data, type=cls)


class Recorder:
    """Appends JSON lines to a recording file (flushed per line)."""

    def __init__(self, path: str | Path | None) -> None:
        self._file = open(path, "ab", buffering=0) if path else None  # noqa: SIM115

    def record(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(msgspec.json.encode({"kind": kind, **fields}) + b"\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
