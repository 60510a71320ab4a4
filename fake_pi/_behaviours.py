"""Test behaviours of a Fake-Pi process, and its recorder.

For watchdog and crash tests a Fake-Pi can be told to misbehave at a named
*barrier*: ``startup``, ``before_tool:N`` / ``after_tool:N`` (the N-th tool call,
counted from 1 over the process's life), ``before_model:N`` / ``after_model:N``
(the N-th model response), ``mid_stream:N`` (after the first chunk of the N-th
model response), ``settled:N`` (before the N-th ``agent_settled`` is printed; the run of a
shutdown, which prints none, passes none), ``agent_start:N`` (before the
N-th run emits anything: a worker slow to start on a loaded machine), ``abort:N`` (the N-th
``abort`` command, before it is carried out: ``hang`` there is a wedged worker that neither
aborts nor answers while its run goes on; a shutdown's own abort passes no barrier),
``prompt:N`` (the N-th ``prompt`` command, before it is answered or started).
Actions: ``kill`` (SIGKILL itself), ``exit:CODE`` (0 to 255), ``hang`` (stop doing anything,
forever), ``delay:SECONDS`` (do nothing for that long, then go on). A barrier name or an action
that is none of these is refused when the :class:`Behaviours` is made (``ValueError``; a
``msgspec.ValidationError`` from a configuration file): a misspelt barrier would never be
reached, and the test using it would pass without its fault ever happening.
``ignore_sigterm`` makes SIGTERM wait that many seconds before it takes
effect. The recorder writes launch argv, environment *keys* (never values),
stdin lines and tool executions as JSON lines.

Behaviours come from ``--fake-config FILE`` or ``$FAKE_PI_CONFIG`` (JSON or TOML)
for a subprocess, or a :class:`Behaviours` object in-process.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Final

import msgspec
import trio

from .scenario import Scenario, _load_document

__all__ = ["BarrierExit", "BarrierKill", "Barriers", "Behaviours", "FakeConfig", "Recorder"]


COUNTED_BARRIERS: Final = frozenset(
    {
        "before_tool",
        "after_tool",
        "before_model",
        "after_model",
        "mid_stream",
        "settled",
        "agent_start",
        "abort",
        "prompt",
    }
)
"""The barriers passed more than once, named ``<kind>:<N>`` (N from 1); ``startup`` is bare."""

_BARRIER = re.compile(r"([a-z_]+):([1-9][0-9]*)")


def _barrier_problem(name: str, action: str) -> str | None:
    """Why ``name = action`` is no behaviour a barrier carries out, or ``None``."""
    match = _BARRIER.fullmatch(name)
    if name != "startup" and (match is None or match[1] not in COUNTED_BARRIERS):
        kinds = ", ".join(f"{kind}:N" for kind in sorted(COUNTED_BARRIERS))
        return f"no barrier {name!r} (startup, or {kinds} with N from 1)"
    if action in ("kill", "hang"):
        return None
    verb, _, argument = action.partition(":")
    if verb == "exit" and argument.isascii() and argument.isdigit() and int(argument) <= 255:
        return None
    if verb == "delay":
        try:
            seconds = float(argument)
        except ValueError:
            seconds = math.nan
        if seconds >= 0:  # NaN is not
            return None
    return f"no action {action!r} at {name} (kill, hang, exit:0..255, delay:SECONDS)"


class Behaviours(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    at: dict[str, str] = msgspec.field(default_factory=dict)
    """Barrier name -> action (``kill``, ``exit:CODE``, ``hang``, ``delay:SECONDS``)."""
    ignore_sigterm: Annotated[float, msgspec.Meta(ge=0)] = 0.0

    def __post_init__(self) -> None:
        for name, action in self.at.items():
            problem = _barrier_problem(name, action)
            if problem is not None:
                raise ValueError(f"behaviour refused: {problem}")


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
        """Read a ``.json`` or ``.toml`` file, with :meth:`Scenario.load`'s error handling."""
        return _load_document(path, cls)


class Recorder:
    """Appends JSON lines to a recording file (flushed per line)."""

    def __init__(self, path: str | Path | None) -> None:
        """Error handling: ``path`` that cannot be opened for appending raises ``OSError``; a
        FIFO is opened without waiting for a reader (with none, ``ENXIO``)."""
        self._file = None
        if path:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK
            fd = os.open(path, flags, 0o666)
            os.set_blocking(fd, True)  # (a FIFO with a reader is then written as a file)
            self._file = open(fd, "ab", buffering=0)  # noqa: SIM115

    def record(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(msgspec.json.encode({"kind": kind, **fields}) + b"\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
