"""The smoke scenario of issues #8 and #17: the **installed** ``pi-runtime`` in
pseudo-terminals, registered in ``tests/smoke/manifest.toml`` (owner: task lanes).

Every command is the console script next to ``sys.executable`` (``.venv/bin/pi-runtime``),
spawned in its own pseudo-terminal with pexpect, as an operator would run it: ``serve``, ``task
run --wait`` (one terminal following each task), ``task show``, ``tasks``, ``task reply``,
``resume``, ``abort``, ``fail``, ``grant`` and ``journal verify``. The workers are Fake-Pi
processes (the configuration's default agent) behind the runtime's gateway and gate. The model
is a scripted model served on loopback from a thread of the test process; the task's prompt
names what it does (``[smoke:MODE]``), so many tasks share it in any interleaving. The
*wedged provider* starts its answer and then pads the stream with empty deltas forever,
never a token (a wedged backend behind a router that keeps its stream busy): the gateway sees
data events, so neither of its inactivity bounds (G10 bytes, G15 data) ends the stream, while
the worker sees the answer start and then nothing — a wedge only the watchdog can see. (A
provider that sends only SSE comments is the gateway's to cut, G15.) An *endless answer*
streams a token every half second for longer than any test runs: a worker with a request in
flight that keeps progressing (never suspected, however late the test gets to it), for the
test to kill, or its host.

First the production thresholds (no time scale: a standalone run, then ``task show``):

* ``production-thresholds`` (WD9, O16): soft 300 s, hard 900 s, grace 120 s, time scale x1,
  nothing says UNSAFE.

Then one server under ``--unsafe-test-timescale 75`` (soft 4 s, hard 12 s, grace 1.6 s) running
eleven tasks at once (``test_smoke_fence_resume_wait_reply_and_abort_under_the_test_time_scale``),
each in a worktree of its own (TL13):

* ``fence`` (WD2, WD3, WD10, WD11, TL5): ``smoke`` on the wedged provider: Active → Suspect →
  HardResumeEligible → Fencing → Resuming → Active → done; one continuation prompt, one
  replacement epoch charged, the resume latency charged to the recovery budget;
* ``stop`` (WD3, WD10, TL8 manual resume): ``smoke-stop``, the same wedge with its worker
  SIGSTOPped (its pid from its lane log). A stopped worker answers no probe, and an
  unanswered fence probe is an unknown guard, so the watchdog holds (``probe_unanswered``) and
  never signals it; the operator's ``task resume`` stops it (TERM stays pending on a stopped
  process; the KILL after the bound ends it) and the task resumes in the same session to done;
* ``wait`` (LK5, LK8, TL8, TL9): ``smoke2`` waits; ``task reply`` from another terminal wakes
  it; done;
* ``hold-abort`` (WD8, TL8): ``smoke-hold`` settles twice without a lifecycle tool → held after
  its one completion prompt; ``task abort`` → aborted;
* ``refusals`` (TL8): ``task_not_waiting``, ``task_not_held``, ``task_ended`` (exit status 1);
* ``long`` (WD1, WD3): ``smoke-long``'s model streams its answer half a second a chunk for
  longer than hard + grace (a progressing run the watchdog leaves alone: not even a Suspect)
  and ends it with ``task_done``;
* ``retry`` (WD1, WD2, WD4): ``smoke-retry``'s provider cuts its first answer's stream after
  its first data once (a 5xx would be parked by the runtime, PB6); Pi retries by itself
  (``auto_retry_start`` is provider progress, its ``agent_end`` with ``willRetry`` no settle)
  and the retried request's first token comes after the soft threshold: Suspect and one
  read-only probe, nothing else (a request in flight is no stall before hard + grace) → done;
* ``tool`` (WD1): ``smoke-tool`` runs a ``bash`` that prints as it goes, without a declared
  timeout, for twice the soft threshold: its live output is progress, never a Suspect → done;
* ``lease`` (WD5): ``smoke-lease`` runs a silent ``bash`` under a declared ``timeout`` (a valid
  lease) for twice the soft threshold: LongTool, never a Suspect → done;
* ``silent-tool`` (WD4, WD12): ``smoke-silent`` runs a ``bash`` that prints nothing and declares
  no timeout, past the soft threshold: Suspect, one read-only probe, then held
  ``silent_in_tool_phase`` (the tool phase has no hard threshold) with its worker alive —
  never fenced or signalled; the tool's end is progress, which lifts the hold → done;
* ``settle`` (WD8, TL5): ``smoke-settle``'s model answers text without a lifecycle tool: its
  settle enters NeedsFinalization at once (state open: neither done nor failed), exactly one
  completion prompt in the same session and epoch, nothing charged → done;
* ``exit`` (WD8, WD11, TL5, TL12): ``smoke-exit``'s worker is SIGTERMed (exit status 143) in
  the middle of an endless answer, no tool running — a safe exit: NeedsFinalization at once, one
  replacement charged, one continuation prompt in the same session → done;
* ``no-duplicates`` (TL5, TL6, TL10, TL12, LK3, WD11): read from every task's lane log and
  session at the end: no prompt marker, tool effect, launch or epoch number, owner (an epoch
  starts only after the last was fenced), worker pid, session, route or reserve (charge)
  twice, and every complete model answer counted once in the task's costs.

Then another server, with a budget of two replacement epochs, running seven tasks at once; it
is killed (SIGKILL by its pid) and started again on the same state directory in the middle
(``test_smoke_restart_budget_fail_and_races_under_the_test_time_scale``). A worker the test
kills is the last epoch its task's lane log recorded (read while the server writes on, as
``journal verify`` does), checked by its start time and epoch nonce before the signal:

* ``agent-fail`` (LK1, TL3): ``b-fail``'s agent calls ``task_fail`` → failed;
* ``operator-fail`` (WD8, TL8): ``b-opfail`` is held after its completion prompt; the
  operator's ``task fail`` → failed;
* ``race`` (LK1, LK3, LK4, LK9): ``b-race``'s agent calls ``task_done`` and ``task_fail`` in one
  answer (the first wins, the second is late evidence); while its validation command
  (``--validate``, which asks the model server to go on) runs, the operator's ``task abort``
  still ends the success intent, and the task ends aborted, not done;
* ``unsafe-exit`` (WD13, WD8, WD12): ``b-effect``'s worker is SIGKILLed while its ``bash`` (a
  never-replay tool, which asks the model server to go on) runs: NeedsFinalization, then held
  ``effect_possibly_ran:bash``, nothing relaunched; the operator's ``task resume`` continues
  it in the same session with the call settled "possibly ran", the bash never runs again →
  done;
* ``budget`` (WD11, TL6): ``b-budget``'s worker is SIGKILLed three times in an endless answer;
  the third exit finds no budget left: held ``budget_exhausted:epochs``;
* ``restart-prompt`` (TL5, TL6, TL7): the host is killed while ``b-restart``'s completion
  prompt is worked on (an endless answer); the restarted host kills the worker it left (by
  its record) and continues in a replacement charged like any other, with a continuation of
  its own; the completion prompt is never sent again (once in the session, the model asked
  once);
* ``restart-continuation`` (TL5, TL6, TL7, WD11): the same while ``b-cont``'s first
  continuation (after an exit) is worked on: c1 never again, c2 once, done;
* ``restart-budget`` (WD11, WD12): ``b-budget`` is still held after the restart, its budget
  not replenished and nothing launched;
* ``manual-resume`` (TL8, WD11): ``task grant`` adds one epoch (audited; still held), ``task
  resume`` continues ``b-budget`` to done, charged once more;
* ``no-duplicates``: as above, over every task of this server too (the two tasks the killed host
  was running each start one epoch without a fence record of the last), and ``journal
  verify`` finds no problem in any log.

Left out, and why: a silence in the *unknown* phase itself (WD4: alive, between a message's end
and whatever comes next) cannot be produced through the installed binary — the scripted model
can only make a worker silent in a provider, generation or tool phase, and Fake-Pi's barriers
(``hang`` after a message) are set only through ``FAKE_PI_CONFIG``, which the runtime's
allow-listed worker environment (W8) never passes on; ``silent-tool`` shows the same rule
(observe, then hold, never kill) for the tool phase, and the in-process tests
(``tests/tasks/test_tasks.py``) cover the unknown phase. A *suspend* (WD6) cannot be made on
demand either. Nor can a worker's exit with status 0 (Fake-Pi exits on its own only when its
input ends, which the runtime never does to a live epoch): the exits here are a SIGTERM (143)
and SIGKILLs.

Nothing sleeps on the clock to wait: a test waits for a line a terminal prints, a process's
exit, or a request reaching the model, each bounded by :data:`LIMIT`. (The scripted model and
the workers' own tools take their time on purpose: that is the behaviour under test.)
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import json
import math
import os
import queue
import re
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec
import pexpect
import trio

from fake_pi.model_server import ReceivedRequest, ScriptedModel, body_digest, serve_model
from fake_pi.scenario import Call, Cut, HttpError, Step, Text, ToolCalls
from runtime._boundary._http import Request, ResponseWriter
from runtime._journal._journal import read_log
from runtime._journal._store import Store
from runtime._linux._fs import OsFileSystem
from runtime._linux._proc import process_start_time
from runtime._linux._proctree import carries_nonce, is_alive_pid
from runtime._records import (
    ContinuationSent,
    EpochFenced,
    EpochStarted,
    LifecycleReceipt,
    ModelResponse,
    OutboxAction,
    Record,
    TaskEnded,
    TaskSubmitted,
    ToolIntent,
    ToolOutcome,
)

from .._procs import alive_with_nonce

BIN: Final = Path(sys.executable).parent / "pi-runtime"
"""The installed console script (``pip install -e``), not ``python -m runtime._cli``."""
LIMIT: Final = 60.0
"""The bound of every wait for a line, an exit or a model request."""
FACTOR: Final = 75
"""The unsafe test time scale: soft 4 s, hard 12 s, grace 1.6 s (hard + grace 13.6 s)."""
WARNING: Final = f"UNSAFE TEST TIMESCALE x{FACTOR}: thresholds divided by {FACTOR}"
MARKER: Final = f"[UNSAFE TEST TIMESCALE x{FACTOR}]"
PRODUCTION: Final = (
    "production thresholds: soft 300 s, hard provider 900 s, generation 900 s, grace 120 s"
)
IN_EFFECT: Final = "in effect: soft 4 s, hard provider 12 s, generation 12 s, grace 1.6 s"
SOFT, HARD, GRACE = 300 / FACTOR, 900 / FACTOR, 120 / FACTOR
CONTINUATION: Final = "[pi-runtime continuation v1 "
CONTINUATION_ID: Final = re.compile(r"\[pi-runtime continuation v1 (\S+)\]")
REPLY: Final = "REPLY:"
FENCED_PATH: Final = ["Active", "Suspect", "HardResumeEligible", "Fencing", "Resuming", "Active"]
HELD_PATH: Final = ["Active", "Suspect", "HardResumeEligible", "StalledOperatorRequired"]
NOT_FOR_PROGRESS: Final = frozenset(
    {"HardResumeEligible", "Fencing", "Resuming", "NeedsFinalization", "StalledOperatorRequired"}
)
"""What work that progresses (or a request in flight before hard + grace) never sees."""
TRICKLE_SECONDS: Final = 0.5
"""How often the wedged provider sends an empty delta (well inside the gateway's bounds)."""
TRICKLE_LIMIT: Final = 120.0
"""The wedged provider gives up by itself after this long (the test is over by then)."""
LONG_CHUNKS: Final = 30
LONG_GAP: Final = 0.5
"""``long``: about 35 chunks half a second apart, about 17 s: past hard + grace (13.6 s)."""
RETRY_TTFT: Final = 6.0
"""``retry``: the retried request's first token, after soft (4 s), well before hard (12 s)."""
STREAMING_BASH: Final = 'for i in $(seq 16); do echo "tick $i"; sleep 0.5; done'
"""``tool``: 8 s of output, a line every half second (twice the soft threshold)."""
SILENT_BASH: Final = "sleep 10"
LEASE_SECONDS: Final = 60
"""``lease``: a silent 10 s under a declared timeout of 60 s (a valid lease, WD5); ``silent``:
the same without one (held after its soft probe, WD4, until it ends)."""
ENDLESS_CONTINUATIONS: Final = {"cont": 1, "budget": 2}
"""Continuations (by number) that get an endless answer again, by mode."""
ENDLESS_GAP: Final = 0.5
GATE: Final = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=60)"
"""A gate's client: ``race``'s validation command, ``effect``'s bash."""

R = TypeVar("R")


# -- the scripted model ----------------------------------------------------------------------


def done(summary: str = "did it") -> ToolCalls:
    return ToolCalls(calls=[Call(name="task_done", arguments={"summary": summary})])


def task_wait(question: str) -> ToolCalls:
    return ToolCalls(calls=[Call(name="task_wait", arguments={"question": question})])


def task_fail(reason: str) -> ToolCalls:
    return ToolCalls(calls=[Call(name="task_fail", arguments={"reason": reason})])


def bash(command: str, **more: Any) -> ToolCalls:
    return ToolCalls(calls=[Call(name="bash", arguments={"command": command, **more})])


def text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def tool_name(messages: list[dict[str, Any]], result: dict[str, Any]) -> str:
    """The name of the tool call whose result ``result`` is."""
    for message in messages:
        for call in message.get("tool_calls") or []:
            if call.get("id") == result.get("tool_call_id"):
                return str((call.get("function") or {}).get("name", ""))
    return ""


def endless(mode: str) -> Plan:
    """An answer that streams a token every :data:`ENDLESS_GAP` for longer than any test
    runs: a worker busy with a request in flight, progressing (so never suspected or fenced,
    however late the test gets to it), for the test to kill — or its host."""
    words = " ".join(f"more{i}" for i in range(int(TRICKLE_LIMIT / ENDLESS_GAP)))
    return Plan(mode, "streaming", Text(text=words), ENDLESS_GAP)


def gate_command(model: SmokeModel, name: str) -> list[str]:
    """A command that asks the model server's gate ``name`` to go on and returns once the test
    released it (exit status 0)."""
    return [sys.executable, "-c", GATE, f"{model.base_url}/gate/{name}"]


@dataclass(frozen=True)
class Plan:
    """How the model answers one request: the task's mode, the stage of the task the request
    is at, and the answer (``step None``: the wedged provider; ``gap``: the answer's chunks
    are streamed this far apart, a slow model that keeps progressing)."""

    mode: str
    stage: str
    step: Step | None
    gap: float = 0.0


@dataclass
class SmokeModel(ScriptedModel):
    """Answers by the task's mode (``[smoke:MODE]`` in its prompt) and the last message, so
    any number of tasks can use it at once; records ``(mode, stage)`` of every request, and
    how many complete answers it gave each mode (the accounting the lane logs must match).
    ``GET …/gate/NAME`` (``race``'s validation command, ``effect``'s bash) is noted as
    ``(NAME, "gate")`` and answered once the test releases NAME."""

    seen: list[tuple[str, str]] = field(default_factory=list)
    answered: Counter[str] = field(default_factory=Counter)
    changed: threading.Condition = field(default_factory=threading.Condition)
    gates: dict[str, threading.Event] = field(default_factory=dict)
    base_url: str = ""
    """Where it is served (``…/v1``), once it is."""

    def plan(self, body: dict[str, Any]) -> Plan:
        messages = [m for m in body.get("messages", []) if m.get("role") != "system"]
        prompt = next((text_of(m) for m in messages if m.get("role") == "user"), "")
        found = re.search(r"\[smoke:(\w+)\]", prompt)
        mode = found.group(1) if found else "plain"
        last = messages[-1] if messages else {}
        text = text_of(last)
        if last.get("role") == "tool":
            if mode in ("tool", "lease", "silent") and tool_name(messages, last) == "bash":
                return Plan(mode, "bash_result", done("the long tool ran"))
            return Plan(mode, "tool_result", Text(text="finished"))
        if mode == "hold":
            return Plan(mode, "prompt", Text(text="I will not call a lifecycle tool."))
        action = CONTINUATION_ID.search(text)
        if action is not None:
            number = re.search(r"/c(\d+)/prompt$", action.group(1))
            if number is None:  # the completion prompt after a settle (WD8)
                if mode == "restart":
                    return endless(mode)  # the host is killed while it is worked on
                return Plan(mode, "completion", done("finished after the completion prompt"))
            if int(number.group(1)) <= ENDLESS_CONTINUATIONS.get(mode, 0):
                return endless(mode)
            return Plan(mode, "continuation", done("finished after the continuation"))
        if REPLY in text:  # after the reply's marker line (LK8)
            return Plan(mode, "reply", done("finished after the reply"))
        return self.first_answer(mode)

    def first_answer(self, mode: str) -> Plan:
        """The answer to the task's own prompt."""
        match mode:
            case "fence" | "stop":
                return Plan(mode, "wedged", None)
            case "exit" | "cont" | "budget":
                return endless(mode)
            case "wait":
                return Plan(mode, "prompt", task_wait("which colour?"))
            case "long":
                words = " ".join(f"step{i}" for i in range(LONG_CHUNKS))
                return Plan(mode, "prompt", ToolCalls(text=words, calls=done().calls), LONG_GAP)
            case "retry" if (mode, "error") not in self.seen:
                # a stream cut after its first data: not an outage the runtime parks
                # (PB6 parks a 5xx), an error Pi retries itself ("terminated")
                return Plan(mode, "error", Cut())
            case "retry":
                return Plan(mode, "retried", ToolCalls(calls=done().calls,
                                                       first_token_delay=RETRY_TTFT))  # fmt: skip
            case "tool":
                return Plan(mode, "prompt", bash(STREAMING_BASH))
            case "lease":
                return Plan(mode, "prompt", bash(SILENT_BASH, timeout=LEASE_SECONDS))
            case "silent":
                return Plan(mode, "prompt", bash(SILENT_BASH))
            case "settle" | "restart":
                return Plan(mode, "prompt", Text(text="I fixed the README; nothing else to do."))
            case "fail":
                return Plan(mode, "prompt", task_fail("the README cannot be fixed"))
            case "effect":  # a never-replay tool that runs until the test lets it go on
                return Plan(mode, "prompt", bash(shlex.join(gate_command(self, "b-effect"))))
            case "race":  # two terminals in one answer: the first wins, the second is late
                calls = [*done("fixed it").calls, *task_fail("no, it failed").calls]
                return Plan(mode, "prompt", ToolCalls(calls=calls))
        return Plan(mode, "prompt", done())

    def note(self, mode: str, stage: str) -> None:
        with self.changed:
            self.seen.append((mode, stage))
            self.changed.notify_all()

    def next_step(self, body: dict[str, Any]) -> Step:
        plan = self.plan(body)
        assert plan.step is not None
        self.requests.append(ReceivedRequest(body, body_digest(body), plan.step))
        if not plan.gap and not isinstance(plan.step, HttpError | Cut):
            self.answered[plan.mode] += 1  # a paced answer counts once it is complete
        self.note(plan.mode, plan.stage)
        return plan.step

    def wait_for(self, mode: str, stage: str, count: int = 1, timeout: float = LIMIT) -> None:
        """Until ``count`` requests of ``mode`` at ``stage`` reached the model (bounded)."""
        with self.changed:
            arrived = self.changed.wait_for(
                lambda: self.seen.count((mode, stage)) >= count, timeout
            )
        assert arrived, f"no {stage} request #{count} of {mode} reached the model: {self.seen}"

    def gate(self, name: str) -> threading.Event:
        with self.changed:
            return self.gates.setdefault(name, threading.Event())

    def release(self, name: str) -> None:
        self.gate(name).set()

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        target = request.target.rstrip("/")
        if request.method == "GET" and "/gate/" in target:
            name = target.rsplit("/", 1)[1]
            self.note(name, "gate")
            released = await trio.to_thread.run_sync(self.gate(name).wait, LIMIT)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await response.respond(200 if released else 504, b"{}")  # its caller may be gone
            return
        if request.method == "POST" and target.endswith("/chat/completions"):
            with contextlib.suppress(msgspec.DecodeError):
                body = msgspec.json.decode(request.body)
                if isinstance(body, dict):
                    plan = self.plan(body)
                    if plan.step is None:
                        self.note(plan.mode, plan.stage)
                        await self.wedged(response)
                        return
                    if plan.gap:
                        if await self.paced(body, response, plan.gap):
                            self.answered[plan.mode] += 1
                        return
        await super().handle(request, response)

    async def wedged(self, response: ResponseWriter) -> None:
        """A provider that accepted the request, started its answer and keeps its stream busy
        with empty deltas but never sends a token."""
        empty = {"id": "chatcmpl-wedged", "object": "chat.completion.chunk", "created": 0,
                 "model": "fake-model", "choices": [{"index": 0, "delta": {}}]}  # fmt: skip
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await response.start(
                200, [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
            )
            with trio.move_on_after(TRICKLE_LIMIT):
                while True:
                    await response.send(b"data: " + json.dumps(empty).encode() + b"\n\n")
                    await trio.sleep(TRICKLE_SECONDS)

    async def paced(self, body: dict[str, Any], response: ResponseWriter, gap: float) -> bool:
        """The planned answer, each chunk ``gap`` seconds after the one before: a slow model
        whose every token is progress. Whether it was sent whole (not cut by its client)."""
        chunks = self.stream(body)
        try:
            await response.start(
                200, [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
            )
            async for item in chunks:
                await response.send(b"data: " + json.dumps(item).encode() + b"\n\n")
                await trio.sleep(gap)
            await response.send(b"data: [DONE]\n\n")
            await response.end()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        finally:
            await chunks.aclose()
        return True


@contextlib.contextmanager
def model_thread(model: SmokeModel) -> Iterator[str]:
    """Serve ``model`` on loopback from a thread with its own Trio run; the base URL."""
    started: queue.Queue[tuple[int, trio.lowlevel.TrioToken, trio.Event] | BaseException]
    started = queue.Queue()

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_model, model)
            stop = trio.Event()
            started.put((server.port, trio.lowlevel.current_trio_token(), stop))
            await stop.wait()
            nursery.cancel_scope.cancel()

    def run() -> None:
        try:
            trio.run(serve)
        except BaseException as error:  # reported to the test's thread
            started.put(error)

    thread = threading.Thread(target=run, name="smoke-model", daemon=True)
    thread.start()
    answer = started.get(timeout=LIMIT)
    if isinstance(answer, BaseException):
        raise answer
    port, token, stop = answer
    model.base_url = f"http://127.0.0.1:{port}/v1"
    try:
        yield model.base_url
    finally:
        for gate in list(model.gates.values()):  # a gate still closed would hold it up
            gate.set()
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(stop.set, trio_token=token)
        thread.join(timeout=LIMIT)
        assert not thread.is_alive(), "the model server did not stop"


# -- pseudo-terminals --------------------------------------------------------------------------


class Terminal:
    """``pi-runtime ARGS`` in a pseudo-terminal (pexpect). A thread reads everything it prints
    as it comes (so a chatty process never blocks on a full terminal) and, once it ended,
    reaps it; the test waits for what it printed with :meth:`expect`, always bounded."""

    def __init__(self, cwd: Path, *args: str) -> None:
        self.args = args
        self.child = pexpect.spawn(
            str(BIN),
            list(args),
            cwd=str(cwd),
            env={**os.environ, "TERM": "dumb"},
            encoding="utf-8",
            codec_errors="replace",
            echo=False,
            dimensions=(50, 400),
            timeout=LIMIT,
        )
        self.pid: int = self.child.pid
        self.text = ""
        self.cursor = 0
        self.status: int | None = None
        """Exit status (``-N`` for a signal) once it ended and was reaped."""
        self.ended = False
        self.stopped_by = ""
        """An error other than the end that stopped reading the terminal, if any."""
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"pty {args[:2]}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Read the terminal until the process has closed it (``EIO``) — not past a second
        after the process ended: a worker it left behind may hold the terminal open. Read
        directly, not with pexpect's read, which may report an end while the process still
        writes (its output then lost, or the process blocked on a full terminal)."""
        fd = self.child.child_fd
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        last_look = math.inf  # (once it ended: what it wrote is there within a second)
        while time.monotonic() < last_look:
            try:
                if not poller.poll(200):
                    if self.child.isalive():
                        continue
                    last_look = min(last_look, time.monotonic() + 1.0)
                    if not poller.poll(0):
                        break
                chunk = os.read(fd, 65536)
            except OSError as error:  # EIO: every writer has closed it
                if error.errno != errno.EIO:
                    self.stopped_by = repr(error)
                break
            if not chunk:  # (an end reported as an empty read)
                break
            self._add(decoder.decode(chunk))
        self._add(decoder.decode(b"", final=True))
        with contextlib.suppress(Exception):
            self.child.wait()
        with contextlib.suppress(Exception):
            self.child.close()
        status = self.child.exitstatus
        if status is None and self.child.signalstatus is not None:
            status = -int(self.child.signalstatus)
        with self._changed:
            self.status = status
            self.ended = True
            self._changed.notify_all()

    def _add(self, data: str) -> None:
        with self._changed:
            self.text += data.replace("\r\n", "\n")
            self._changed.notify_all()

    def expect(self, pattern: str, timeout: float = LIMIT) -> re.Match[str]:
        """The first match of ``pattern`` (a multi-line regex) after the previous match."""
        compiled = re.compile(pattern, re.M)
        found: list[re.Match[str]] = []

        def matched() -> bool:
            match = compiled.search(self.text, self.cursor)
            if match is not None:
                found.append(match)
            return match is not None or self.ended

        with self._changed:
            self._changed.wait_for(matched, timeout)
            if not found:  # one last look: it may have printed it as it ended
                match = compiled.search(self.text, self.cursor)
                if match is not None:
                    found.append(match)
            assert found, (
                f"{' '.join(self.args[:2])}: no {pattern!r} within {timeout} s "
                f"(ended: {self.ended}, status {self.status}, reading stopped by "
                f"{self.stopped_by or 'no error'}); it printed:\n{self.text}"
            )
            self.cursor = found[0].end()
            return found[0]

    def wait(self, timeout: float = LIMIT) -> int:
        """Its exit status once it ended (bounded)."""
        with self._changed:
            self._changed.wait_for(lambda: self.ended, timeout)
            assert self.ended, f"{self.args[:2]} still runs after {timeout} s:\n{self.text}"
            assert self.status is not None
            return self.status

    def stop(self, timeout: float = LIMIT) -> int:
        """SIGTERM, a bounded wait, then SIGKILL if need be; its exit status."""
        if not self.ended:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            with self._changed:
                self._changed.wait_for(lambda: self.ended, timeout)
        if not self.ended:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        return self.wait(10.0)


@contextlib.contextmanager
def terminals() -> Iterator[Callable[..., Terminal]]:
    """Open terminals with ``open(cwd, *args)``; every one still running is stopped after."""
    opened: list[Terminal] = []

    def open_terminal(cwd: Path, *args: str) -> Terminal:
        terminal = Terminal(cwd, *args)
        opened.append(terminal)
        return terminal

    try:
        yield open_terminal
    finally:
        for terminal in reversed(opened):
            terminal.stop()


def ran(terminal: Terminal) -> tuple[int, str]:
    """A short command to its end: its status and everything it printed."""
    status = terminal.wait()
    return status, terminal.text


def query_json(cwd: Path, *args: str) -> dict[str, Any]:
    """``pi-runtime ARGS --json`` (standard output only), bounded."""
    done_ = subprocess.run(
        [str(BIN), *args, "--json"], cwd=cwd, capture_output=True, timeout=LIMIT, check=False
    )
    assert done_.returncode == 0, done_.stderr.decode()
    answer: dict[str, Any] = json.loads(done_.stdout)
    return answer


# -- helpers -------------------------------------------------------------------------------------


def make_worktree(root: Path, name: str = "worktree") -> Path:
    worktree = root / name
    worktree.mkdir()
    (worktree / "README.md").write_text("a task's worktree\n")
    return worktree


def write_config(root: Path, url: str, more: str = "") -> Path:
    path = root / "config.toml"
    path.write_text(
        f'state_dir = "{root / "state"}"\nwork_root = "{root / "work"}"\n\n'
        f'[model]\nbase_url = "{url}"\n\n{more}'
    )
    return path


def run_args(worktree: Path, state: Path, task_id: str, mode: str, *extra: str) -> list[str]:
    return [
        "task", "run", "--worktree", str(worktree), "--task-id", task_id,
        "--prompt", f"fix the README [smoke:{mode}]", "--state-dir", str(state), *extra,
    ]  # fmt: skip


def classifications(text: str, task_id: str) -> list[str]:
    """The classifications of ``task_id``'s event lines, in order, repeats collapsed."""
    seen: list[str] = []
    for found in re.finditer(rf"^(?:\S+ )*task {re.escape(task_id)}: (\w+) state=", text, re.M):
        if not seen or seen[-1] != found.group(1):
            seen.append(found.group(1))
    return seen


def gone(pid: int, start_time: int) -> bool:
    """No live process is that one: the pid is free, a reaped-to-be zombie is not alive, or
    the pid is someone else's now (another start time)."""
    return not is_alive_pid(pid) or process_start_time(pid) != start_time


def until(condition: Callable[[], bool], timeout: float = LIMIT) -> bool:
    """Whether ``condition()`` came true within ``timeout`` (checked back to back: for a
    state the kernel is about to reach, such as a signalled process stopping)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        os.sched_yield()
    return True


def stat_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


# -- the production thresholds (no time scale) ----------------------------------------------------


def test_the_installed_binary_shows_the_production_thresholds(tmp_path: Path) -> None:
    assert BIN.is_file(), f"pi-runtime is not installed next to {sys.executable}"
    worktree = make_worktree(tmp_path)
    state = tmp_path / "state"
    model = SmokeModel()
    with model_thread(model) as url, terminals() as terminal:
        config = str(write_config(tmp_path, url))
        run = terminal(tmp_path, *run_args(worktree, state, "prod", "prod", "--config", config))
        run.expect(r"^task prod: started here \(standalone")
        run.expect(r"^task prod: Active state=open phase=\w+ epoch=1")
        run.expect(r"^task prod ended done: candidate archive ")
        status, printed = ran(run)
        assert status == 0, printed
        shown = terminal(tmp_path, "task", "show", "prod", "--state-dir", str(state))
        shown.expect(r"^task prod$")
        shown.expect(r"^  state +done$")
        shown.expect(r"^  soft threshold +300 s; ")
        shown.expect(r"^  hard threshold +900 s ")
        shown.expect(r"^  grace +120 s ")
        shown.expect(r"^  time scale +x1$")
        shown.expect(rf"^  {re.escape(PRODUCTION)}$")
        status, text = ran(shown)
        assert status == 0, text
        help_ = terminal(tmp_path, "task", "run", "--help")
        help_.expect(r"--unsafe-test-timescale FACTOR")
        assert ran(help_)[0] == 0
    for printed_by in (printed, text):
        assert "UNSAFE" not in printed_by
        assert "in effect:" not in printed_by
    assert ("prod", "tool_result") in model.seen


# -- under the unsafe test time scale --------------------------------------------------------------


@dataclass
class Smoke:
    """One ``pi-runtime serve`` under the test time scale, and how to talk to it."""

    root: Path
    worktree: Path
    """Each task's worktree is a directory of its own in here."""
    state: Path
    model: SmokeModel
    terminal: Callable[..., Terminal]
    stopped: dict[str, Any] = field(default_factory=dict)
    """The identity (pid, start time, nonce) of the worker the test SIGSTOPped."""
    modes: dict[str, str] = field(default_factory=dict)
    """Each task's mode (the model's key for it)."""
    extra: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Each task's further ``task run`` options (a submission again must be the same)."""
    servers: list[Terminal] = field(default_factory=list)
    """Every ``serve`` started, for the report of a failure."""

    def command(self, *args: str) -> tuple[int, str]:
        """``pi-runtime ARGS --state-dir STATE`` in its own terminal, to its end."""
        return ran(self.terminal(self.root, *args, "--state-dir", str(self.state)))

    def serve(self, config: Path) -> Terminal:
        """``pi-runtime serve`` on the state directory, once it listens."""
        serve = self.terminal(
            self.root, "serve", "--port", "0", "--config", str(config),
            "--state-dir", str(self.state), "--unsafe-test-timescale", str(FACTOR),
        )  # fmt: skip
        self.servers.append(serve)
        serve.expect(rf"^pi-runtime serve: !!! {re.escape(WARNING)} \(")
        serve.expect(r"^pi-runtime serve: listening on ws://127\.0\.0\.1:\d+ ")
        return serve

    @contextlib.contextmanager
    def reported(self) -> Iterator[None]:
        """A failure inside prints what every server logged (pytest shows it with the failure):
        a lane that failed (TL11) or a hold is only in there."""
        try:
            yield
        except BaseException:
            for number, serve in enumerate(self.servers, 1):
                print(f"--- serve #{number} (status {serve.status}) printed:\n{serve.text}")
            raise

    def submit(self, task_id: str, mode: str, *extra: str) -> Terminal:
        """``pi-runtime task run … --wait`` through the server, printing the task's events
        (its first line not awaited here: many start at once)."""
        worktree = self.worktree / task_id  # one live task per worktree (TL13)
        if not worktree.exists():
            make_worktree(self.worktree, name=task_id)
        self.modes[task_id], self.extra[task_id] = mode, extra
        return self.terminal(self.root, *run_args(worktree, self.state, task_id, mode,
                                                  "--wait", *extra))  # fmt: skip

    def follow(self, task_id: str) -> Terminal:
        """The same submission again (after a restart): the server's task, followed."""
        follow = self.submit(task_id, self.modes[task_id], *self.extra[task_id])
        follow.expect(rf"^task {task_id}: duplicate on the server \(state \w+\)$")
        return follow

    def event(self, task_id: str, classification: str) -> str:
        """The start of a printed event line of ``task_id`` (loud: the time scale is unsafe)."""
        return rf"^{re.escape(MARKER)} task {re.escape(task_id)}: {classification} state="

    def show_json(self, task_id: str) -> dict[str, Any]:
        view = query_json(self.root, "task", "show", task_id, "--state-dir", str(self.state))
        assert view["source"] == "server", view
        task: dict[str, Any] = view["task"]
        return task

    def views(self) -> dict[str, dict[str, Any]]:
        """Every task's view (``tasks --json``: one command for all), by id."""
        listing = query_json(self.root, "tasks", "--state-dir", str(self.state))
        assert listing["source"] == "server", listing
        return {view["task_id"]: view for view in listing["tasks"]}

    def kill_worker(self, task_id: str, sig: signal.Signals, count: int = 1) -> dict[str, Any]:
        """Once the model streams its ``count``-th endless answer to ``task_id``, send its
        worker ``sig``: a worker that exits without a terminal receipt, nothing in flight but
        that request."""
        self.model.wait_for(self.modes[task_id], "streaming", count)
        return self.signal_worker(task_id, sig)

    def signal_worker(self, task_id: str, sig: signal.Signals) -> dict[str, Any]:
        """Send ``sig`` to the task's live worker: the last epoch its lane log recorded (read
        as ``journal verify`` reads it, while the server writes on), checked by its start
        time and its nonce. Its identity."""
        last = [r for r in lane_records(self.state, task_id) if isinstance(r, EpochStarted)][-1]
        assert process_start_time(last.pid) == last.start_time, last
        assert carries_nonce(last.pid, last.nonce), last
        os.kill(last.pid, sig)
        return {"pid": last.pid, "start_time": last.start_time, "nonce": last.nonce}

    def session(self, view: Mapping[str, Any]) -> str:
        """The task's session file (its path is relative to the state directory)."""
        return (self.state / str(view["session_path"])).read_text()


def kill_leftover_workers(state: Path) -> None:
    """After a test that failed midway (the host killed and not restarted, say): SIGKILL
    every worker any lane log recorded that is still alive, each by its pid once its start
    time says it is that worker. A test that passes has proven each of them gone."""
    for log in state.glob("lanes/*/lane.log"):
        with contextlib.suppress(Exception):  # a log torn by the failure names no one
            for record in read_log(OsFileSystem(), str(state), str(log.relative_to(state))).records:
                if isinstance(record, EpochStarted) and not gone(record.pid, record.start_time):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(record.pid, signal.SIGKILL)


def refused(answer: tuple[int, str], code: str, message: str) -> None:
    status, text = answer
    assert status == 1, text
    assert f"pi-runtime: {code}: {message}" in text, text


def marker(action_id: str) -> str:
    return f"{CONTINUATION}{action_id}]"


def stop_the_wedged_worker(smoke: Smoke) -> None:
    """``smoke-stop``'s worker, waiting on the wedged provider, gets SIGSTOP: from now on it
    answers no probe. Its pid is read from the lane log, not by a command: the stop must come
    well inside the hard threshold (12 s) even on a loaded machine, where starting a command
    can take seconds (a flake hunt saw the fence come first)."""
    smoke.model.wait_for("stop", "wedged")
    process = smoke.signal_worker("smoke-stop", signal.SIGSTOP)
    smoke.stopped.update(process)
    assert until(lambda: stat_state(process["pid"]) == "T"), "the worker did not stop"


def wait_reply_done(smoke: Smoke, waiting: Terminal) -> None:
    """TL8, TL9, LK5: ``smoke2`` waits; ``task resume`` is refused (not held); ``task reply``
    from another terminal wakes it; it ends done; a later reply is refused (ended)."""
    waiting.expect(smoke.event("smoke2", "WaitingUser") + "waiting ")
    refused(smoke.command("task", "resume", "smoke2"), "task_not_held",
            "task 'smoke2' is not held")  # fmt: skip
    status, text = smoke.command("task", "reply", "smoke2", f"{REPLY} blue")
    assert status == 0, text
    assert text.startswith("task smoke2: reply accepted; state open"), text
    waiting.expect(r"^task smoke2 ended done: candidate archive ")
    assert waiting.wait() == 0
    assert ("wait", "reply") in smoke.model.seen
    refused(smoke.command("task", "reply", "smoke2", "again"), "task_ended",
            "task 'smoke2' has ended")  # fmt: skip


def hold_abort(smoke: Smoke, hold: Terminal) -> None:
    """WD8, TL8: ``smoke-hold`` settles twice without a lifecycle tool → held; ``task abort``
    ends it aborted (``task run`` exits 1 with the end's code); a second abort is refused."""
    hold.expect(smoke.event("smoke-hold", "StalledOperatorRequired") + r"open .*hold=")
    status, text = smoke.command("task", "abort", "smoke-hold", "--reason", "smoke test")
    assert status == 0, text
    assert text.startswith("task smoke-hold: abort accepted; state aborted"), text
    hold.expect(r"ended=aborted")
    hold.expect(r"^pi-runtime: task_not_done: task smoke-hold ended aborted: smoke test")
    assert hold.wait() == 1
    refused(smoke.command("task", "abort", "smoke-hold"), "task_ended",
            "task 'smoke-hold' has ended")  # fmt: skip


def fenced_resumed_done(smoke: Smoke, fence: Terminal) -> None:
    """WD2, WD3, WD10, TL5: the wedge is suspected at the soft threshold, eligible after hard +
    grace, fenced on a quiet probe with every guard holding, resumed in the same session with
    one continuation prompt; the task ends on an explicit ``task_done``."""
    for classification in FENCED_PATH[1:5]:
        fence.expect(smoke.event("smoke", classification) + "open ")
    fence.expect(smoke.event("smoke", "Active") + r"\w+ phase=\w+ epoch=2")
    fence.expect(r"ended=done$")
    fence.expect(r"^task smoke ended done: candidate archive \S+ \(manifest \w+\)$")
    assert fence.wait() == 0
    path = classifications(fence.text, "smoke")
    assert path[: len(FENCED_PATH)] == FENCED_PATH, path
    assert "StalledOperatorRequired" not in path
    assert ("fence", "continuation") in smoke.model.seen


def held_then_resumed(smoke: Smoke, stop: Terminal) -> None:
    """WD3, WD10: the stopped worker answers no fence probe, so the watchdog holds
    (``probe_unanswered``) and signals nothing; the operator's ``task resume`` stops it — TERM
    stays pending on a stopped process, the KILL after the bound ends it — and the task
    resumes in the same session to done. Nothing of that worker is left."""
    stop.expect(smoke.event("smoke-stop", "StalledOperatorRequired") + r"open .*"
                r"hold=probe_unanswered$")  # fmt: skip
    assert classifications(stop.text, "smoke-stop") == HELD_PATH
    assert stat_state(smoke.stopped["pid"]) == "T"  # held: still there, still stopped
    status, text = smoke.command("task", "resume", "smoke-stop", "--reason", "smoke")
    assert status == 0, text
    assert text.startswith("task smoke-stop: resume accepted; state open"), text
    stop.expect(smoke.event("smoke-stop", "Resuming") + "open ")
    stop.expect(r"^task smoke-stop ended done: candidate archive ")
    assert stop.wait() == 0
    assert gone(smoke.stopped["pid"], smoke.stopped["start_time"])
    assert not alive_with_nonce(smoke.stopped["nonce"])
    assert ("stop", "continuation") in smoke.model.seen


Views = Mapping[str, Mapping[str, Any]]
"""Every task's view by id, from one ``tasks --json`` (each command is a process to start)."""


def ended_as(follower: Terminal, task_id: str, state: str = "done") -> list[str]:
    """``task_id`` ended ``state`` (``task run`` exits 0 only for done): its classification
    path as its terminal printed it."""
    if state == "done":
        follower.expect(rf"^task {re.escape(task_id)} ended done: candidate archive ")
    else:
        follower.expect(rf"ended={state}$")
    assert follower.wait() == (0 if state == "done" else 1), follower.text
    return classifications(follower.text, task_id)


def progressing_untouched(smoke: Smoke, followers: Mapping[str, Terminal], views: Views) -> None:
    """WD1, WD3, WD4, WD5, WD7: work that progresses, or a request in flight, is never
    fenced, held, finalized or replaced, however long it takes — each of ``smoke-long``,
    ``smoke-retry``, ``smoke-tool`` and ``smoke-lease`` ends done in its first epoch with no
    continuation or completion prompt and nothing charged."""
    for task_id, follower in followers.items():
        path, task = ended_as(follower, task_id), views[task_id]
        assert not set(path) & NOT_FOR_PROGRESS, (task_id, path)
        assert task["process_epoch"] == 1, task
        assert task["budget"]["epochs_used"] == 0, task
        assert task["prompt_marker"] is None, task
        telemetry = task["telemetry"]
        took = ran_for(smoke, task_id)
        if task_id == "smoke-long":  # tokens past soft, hard and grace: not even a suspicion
            assert took > HARD + GRACE, took
            assert path == ["Active"], path
            assert telemetry["suspicions"] == 0, telemetry
            assert 0 < telemetry["max_inter_token_gap_seconds"] < SOFT, telemetry
        elif task_id == "smoke-retry":  # a cut stream retried by Pi, then a slow first token
            assert set(path) == {"Active", "Suspect"}, path  # observed, never acted on
            assert path[-1] == "Active", path
            assert telemetry["probes"] >= 1, telemetry
            assert telemetry["false_suspects"] >= 1, telemetry
            assert smoke.model.seen.count(("retry", "error")) == 1
            assert smoke.model.seen.count(("retry", "retried")) == 1
        elif task_id == "smoke-tool":  # a bash printing as it runs, no declared timeout
            assert took > 2 * SOFT, took
            assert "Suspect" not in path, path
            assert telemetry["suspicions"] == 0, telemetry
        elif task_id == "smoke-lease":  # a silent bash under its declared timeout
            assert took > 2 * SOFT, took
            assert "LongTool" in path, path
            assert "Suspect" not in path, path
            assert telemetry["suspicions"] == 0, telemetry
    for mode in ("tool", "lease"):  # the long tool ran once
        assert smoke.model.seen.count((mode, "bash_result")) == 1


def silent_tool_held_not_killed(smoke: Smoke, silent: Terminal, task: Mapping[str, Any]) -> None:
    """WD4, WD12: ``smoke-silent`` runs a ``bash`` that prints nothing and declares no timeout,
    for longer than the soft threshold: Suspect, one read-only probe, and — the tool phase
    has no hard threshold — held ``silent_in_tool_phase`` for an operator, its worker kept:
    never fenced, never signalled. The tool ending is progress, which lifts the hold; the
    task goes on in the same epoch to done, nothing charged."""
    silent.expect(smoke.event("smoke-silent", "StalledOperatorRequired") + r"open .*"
                  r"hold=silent_in_tool_phase$")  # fmt: skip
    path = ended_as(silent, "smoke-silent")
    assert path == ["Active", "Suspect", "StalledOperatorRequired", "Active"], path
    assert ran_for(smoke, "smoke-silent") > 2 * SOFT
    assert (task["process_epoch"], task["budget"]["epochs_used"]) == (1, 0), task
    assert task["prompt_marker"] is None, task
    assert smoke.model.seen.count(("silent", "bash_result")) == 1  # the tool ran to its end
    actions = [r for r in lane_records(smoke.state, "smoke-silent") if isinstance(r, OutboxAction)]
    assert [a.kind for a in actions if a.kind in ("hold", "unhold")] == ["hold", "unhold"]
    assert not [a for a in actions if a.kind in ("fence", "signal", "reserve")], actions


def ran_for(smoke: Smoke, task_id: str) -> float:
    """Seconds from the task's submission to its end, as its lane log recorded them."""
    records = lane_records(smoke.state, task_id)
    (submitted,) = [r for r in records if isinstance(r, TaskSubmitted)]
    (end,) = [r for r in records if isinstance(r, TaskEnded)]
    return (end.ended_ms - submitted.submitted_ms) / 1000


def settled_then_finalized(smoke: Smoke, settle: Terminal, task: Mapping[str, Any]) -> None:
    """WD8, TL5: ``smoke-settle``'s model answers with text and no lifecycle tool; its settle
    enters NeedsFinalization at once (state still open: neither done nor failed, no
    soft-threshold wait) and gets exactly one completion prompt in the same epoch and
    session; it ends done on its ``task_done``, nothing charged."""
    settle.expect(smoke.event("smoke-settle", "NeedsFinalization") + "open ")
    path = ended_as(settle, "smoke-settle")
    assert path == ["Active", "NeedsFinalization", "Active"], path
    completion = marker("smoke-settle/g1/a1/e1/completion")
    assert task["prompt_marker"] == completion, task
    assert (task["process_epoch"], task["budget"]["epochs_used"]) == (1, 0), task
    assert smoke.session(task).count(completion) == 1
    assert smoke.model.seen.count(("settle", "completion")) == 1


def exited_then_continued(
    smoke: Smoke, exit_: Terminal, task: Mapping[str, Any], process: Mapping[str, Any]
) -> None:
    """WD8, WD11, TL5, TL12: ``smoke-exit``'s worker exits (SIGTERM, status 143) while its
    request is in flight and no tool runs — a safe exit: NeedsFinalization at once (open),
    then exactly one replacement, charged once, resumed in the same session with one
    continuation prompt; it ends done. Nothing of the exited worker is left."""
    exit_.expect(smoke.event("smoke-exit", "NeedsFinalization") + "open ")
    exit_.expect(smoke.event("smoke-exit", "Resuming") + "open ")
    path = ended_as(exit_, "smoke-exit")
    at = path.index("NeedsFinalization")  # a Suspect before the exit is only observation
    assert path[at : at + 2] == ["NeedsFinalization", "Resuming"], path
    assert not set(path) & {"HardResumeEligible", "Fencing", "StalledOperatorRequired"}, path
    continuation = marker("smoke-exit/g1/a1/c1/prompt")
    assert task["prompt_marker"] == continuation, task
    assert (task["process_epoch"], task["budget"]["epochs_used"]) == (2, 1), task
    assert smoke.session(task).count(continuation) == 1
    assert smoke.model.seen.count(("exit", "continuation")) == 1
    assert gone(process["pid"], process["start_time"])


def shown_and_listed(smoke: Smoke, views: Views) -> Mapping[str, Any]:
    """O16: ``task show`` prints the production thresholds, the ones in effect and the
    warning; one continuation marker (in the session once); one replacement epoch charged.
    ``tasks`` begins with the warning and lists every task as it ended. The view of
    ``smoke``."""
    shown = smoke.terminal(smoke.root, "task", "show", "smoke", "--state-dir", str(smoke.state))
    for line in (
        r"task smoke", r"  state +done", r"  epochs +process epoch 2, continuation epoch 1",
        r"  receipts +1", r" +done accepted \(epoch 2, .*",
        r"  prompt marker +\[pi-runtime continuation v1 smoke/g1/a1/c1/prompt\]",
        r"  budget +epochs used 1, left 2 .*", rf"  time scale +x{FACTOR}",
        r"  candidate +archive .*", rf"  {re.escape(PRODUCTION)}", rf"  {re.escape(IN_EFFECT)}",
        rf"  !!! {re.escape(WARNING)} .*",
    ):  # fmt: skip
        shown.expect(rf"^{line}$")
    status, text = ran(shown)
    assert status == 0, text
    assert text.count(CONTINUATION) == 1
    task = views["smoke"]
    assert task["budget"]["epochs_used"] == 1
    assert task["prompt_marker"] == "[pi-runtime continuation v1 smoke/g1/a1/c1/prompt]"
    assert task["production"]["soft_seconds"] == 300
    assert task["production"]["hard_seconds"] == {"provider": 900, "generation": 900}
    assert task["production"]["grace_seconds"] == 120
    assert task["timescale"] == FACTOR
    session = (smoke.state / task["session_path"]).read_text()  # relative to the state dir
    assert session.count("[pi-runtime continuation v1 smoke/g1/a1/c1/prompt]") == 1
    listed_as(smoke, {task_id: view["state"] for task_id, view in views.items()})
    return task


def listed_as(smoke: Smoke, ended: Mapping[str, str]) -> None:
    """``tasks`` (warning first) lists every task, by id, in the state it ended in."""
    listed = smoke.terminal(smoke.root, "tasks", "--state-dir", str(smoke.state))
    listed.expect(rf"^!!! {re.escape(WARNING)} ")
    listed.expect(r"^server: running")
    for task_id in sorted(ended):
        listed.expect(rf"^{re.escape(task_id)} +{ended[task_id]} ")
    assert ran(listed)[0] == 0


# -- nothing twice ---------------------------------------------------------------------------------


def lane_records(state: Path, task_id: str) -> list[Record]:
    """Every record of the task's lane log (its own and its gateway's and gate's)."""
    rel = Store.lane_rel(f"task:{task_id}")
    return list(read_log(OsFileSystem(), str(state), rel).records)


def once(items: list[Any], what: str) -> None:
    repeated = [item for item, n in Counter(items).items() if n > 1]
    assert not repeated, f"{what} twice: {repeated}"


def nothing_twice(
    smoke: Smoke,
    views: Views,
    ended: Mapping[str, tuple[str, int]],
    restarted: Collection[str] = (),
) -> None:
    """The end of a scenario, read from every task's lane log and session (TL5, TL6, TL12,
    WD11, LK3, LK7, TL10): no prompt, effect, launch, epoch, owner, pid, session, route or
    charge twice. ``ended``: each task's end state and replacement epochs charged;
    ``restarted``: the tasks whose worker the killed host left running (their next epoch
    starts without a fence record of the last: the restarted host killed it by its record).
    """
    assert sorted(views) == sorted(ended), list(views)
    identities: list[tuple[int, int]] = []
    nonces: list[str] = []
    sessions: list[str] = []
    for task_id, (state, replacements) in sorted(ended.items()):
        records = lane_records(smoke.state, task_id)
        view = views[task_id]
        assert view["state"] == state, view

        def of(kind: type[R], records: list[Record] = records) -> list[R]:
            return [r for r in records if isinstance(r, kind)]

        # one submission: one owner, one attempt and generation, one route and session
        (submitted,) = of(TaskSubmitted)
        assert {(r.generation, r.attempt) for r in of(LifecycleReceipt)} <= {(1, 1)}
        assert len(of(TaskEnded)) == 1
        once([r.intent_id for r in of(LifecycleReceipt)], f"{task_id}: a lifecycle intent")
        # prompts: each continuation, completion or reply prompt once in the log and once in
        # the session, and every marker the session holds is one the log recorded
        session_text = (smoke.state / submitted.session_path).read_text()
        sent = [r.action_id for r in of(ContinuationSent)]
        once(sent, f"{task_id}: a prompt record")
        in_session = re.findall(r"\[pi-runtime (?:continuation|reply) v1 ([^\]\s]+)\]",
                                session_text)  # fmt: skip
        once(in_session, f"{task_id}: a prompt in the session")
        assert set(sent) == set(in_session), (sent, in_session)
        # effects: each tool call decided once and its outcome recorded once
        intents = of(ToolIntent)
        once([r.intent_id for r in intents], f"{task_id}: a tool intent")
        once([r.tool_call_id for r in intents], f"{task_id}: a tool call")
        once([r.intent_id for r in of(ToolOutcome)], f"{task_id}: a tool outcome")
        # launches and epochs: numbered 1, 2, … once each, each launch recorded once
        started = of(EpochStarted)
        epochs = [r.epoch for r in started]
        assert epochs == list(range(1, len(epochs) + 1)), epochs
        assert view["process_epoch"] == len(epochs), view
        launches = [a.action_id for a in of(OutboxAction) if a.kind == "launch"
                    and a.state == "done"]  # fmt: skip
        once(launches, f"{task_id}: a launch")
        assert len(launches) == len(epochs), launches
        # owner: one worker at a time — an epoch starts only after the last one was fenced
        # (stopped and reaped), or, once, after the host that ran it was killed
        unfenced, live = 0, None
        for record in records:
            if isinstance(record, EpochStarted):
                unfenced += live is not None
                live = record.epoch
            elif isinstance(record, EpochFenced) and record.epoch == live:
                live = None
        assert unfenced == (task_id in restarted), (task_id, unfenced)
        assert live is None, f"{task_id}: epoch {live} never stopped"
        identities += [(r.pid, r.start_time) for r in started]
        nonces += [r.nonce for r in started]
        assert all(gone(r.pid, r.start_time) for r in started), started
        # one session (one header), on the frozen route; every attestation names it
        entries = [json.loads(line) for line in session_text.splitlines() if line.strip()]
        headers = [e for e in entries if e.get("type") == "session"]
        assert len(headers) == 1, headers
        assert headers[0].get("cwd") == submitted.worktree, headers  # the same worktree
        sessions.append(headers[0]["id"])
        models = {(e.get("provider"), e.get("modelId")) for e in entries
                  if e.get("type") == "model_change"}  # fmt: skip
        assert models == {(submitted.route["provider"], submitted.route["model"])}, models
        assert view["route"] == submitted.route
        attested = {a.detail.get("session_id") for a in of(OutboxAction) if a.kind == "attest"}
        assert attested <= {headers[0]["id"]}, attested
        # charges: one reserve per replacement, never twice; one answer per step, and every
        # complete answer the model gave this task counted once in its costs
        reserves = [a.action_id for a in of(OutboxAction) if a.kind == "reserve"
                    and a.state == "done"]  # fmt: skip
        once(reserves, f"{task_id}: a reserve")
        assert len(reserves) == replacements == view["budget"]["epochs_used"], (reserves, view)
        once([r.step for r in of(ModelResponse)], f"{task_id}: an answer to one step")
        costs = view["costs"]
        answers = costs["task"]["answers"] + costs["continuation"]["answers"]
        assert answers == smoke.model.answered[smoke.modes[task_id]], (task_id, costs)
    once(identities, "a worker identity (pid, start time)")
    once(nonces, "an epoch nonce")
    once(sessions, "a session")


A_TASKS: Final = {
    "smoke": "fence", "smoke-stop": "stop", "smoke2": "wait", "smoke-hold": "hold",
    "smoke-long": "long", "smoke-retry": "retry", "smoke-tool": "tool", "smoke-lease": "lease",
    "smoke-settle": "settle", "smoke-exit": "exit", "smoke-silent": "silent",
}  # fmt: skip
"""The tasks of the first server: id → mode."""
A_ENDED: Final = {
    "smoke": ("done", 1), "smoke-stop": ("done", 1), "smoke2": ("done", 0),
    "smoke-hold": ("aborted", 0), "smoke-long": ("done", 0), "smoke-retry": ("done", 0),
    "smoke-tool": ("done", 0), "smoke-lease": ("done", 0), "smoke-settle": ("done", 0),
    "smoke-exit": ("done", 1), "smoke-silent": ("done", 0),
}  # fmt: skip
"""How each ends, and the replacement epochs it is charged."""
PROGRESSING: Final = ("smoke-long", "smoke-retry", "smoke-tool", "smoke-lease")


def test_smoke_fence_resume_wait_reply_and_abort_under_the_test_time_scale(
    tmp_path: Path,
) -> None:
    """Eleven tasks at once on one ``pi-runtime serve --unsafe-test-timescale``, each followed
    by its own ``task run --wait`` terminal, controlled from more terminals."""
    model = SmokeModel()
    with model_thread(model) as url, terminals() as terminal:
        smoke = Smoke(tmp_path, make_worktree(tmp_path, "worktrees"), tmp_path / "state", model,
                      terminal)  # fmt: skip
        try:
            with smoke.reported():
                serve = smoke.serve(write_config(tmp_path, url))
                follow = {task_id: smoke.submit(task_id, mode) for task_id, mode in A_TASKS.items()}
                for task_id, follower in follow.items():
                    follower.expect(rf"^task {task_id}: started on the server \(state open\)$")
                stop_the_wedged_worker(smoke)  # first: inside its hard threshold
                exited = smoke.kill_worker("smoke-exit", signal.SIGTERM)
                model.wait_for("fence", "wedged")
                refused(smoke.command("task", "reply", "smoke", "hi"), "task_not_waiting",
                        "task 'smoke' is not waiting")  # fmt: skip
                wait_reply_done(smoke, follow["smoke2"])  # meanwhile the wedged tasks' clocks run
                hold_abort(smoke, follow["smoke-hold"])
                fenced_resumed_done(smoke, follow["smoke"])
                held_then_resumed(smoke, follow["smoke-stop"])
                for task_id in ("smoke-settle", "smoke-exit", "smoke-silent", *PROGRESSING):
                    follow[task_id].wait()  # to its end (bounded); what it printed is checked below
                views = smoke.views()
                settled_then_finalized(smoke, follow["smoke-settle"], views["smoke-settle"])
                exited_then_continued(smoke, follow["smoke-exit"], views["smoke-exit"], exited)
                progressing_untouched(smoke, {t: follow[t] for t in PROGRESSING}, views)
                silent_tool_held_not_killed(smoke, follow["smoke-silent"], views["smoke-silent"])
                task = shown_and_listed(smoke, views)
                nothing_twice(smoke, views, A_ENDED)
                assert serve.stop() == 0
                serve.expect(r"^pi-runtime serve: SIGTERM: not admitting")
        finally:
            stopped = smoke.stopped
            if stopped and not gone(stopped["pid"], stopped["start_time"]):
                # the test failed before the runtime ended it: never leave it behind
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped["pid"], signal.SIGKILL)
            kill_leftover_workers(smoke.state)
    # every log line of the server says so (O16)
    logged = [line for line in serve.text.splitlines() if re.match(r"^\d{4}-\d\d-\d\d ", line)]
    assert logged
    assert all("UNSAFE" in line for line in logged), logged
    # WD11: the time from the fence to the resumed worker's first progress is the resume
    # latency, charged to the recovery budget
    recovery = (task["telemetry"]["resume_latency_seconds"], task["budget"])
    assert len(recovery[0]) == 1, recovery
    assert task["budget"]["seconds_used"] > 0, recovery


# -- restarts, budget, fail, races ---------------------------------------------------------------


def agent_failed(failing: Terminal, task: Mapping[str, Any]) -> None:
    """LK1, TL3: ``b-fail``'s agent calls ``task_fail``: accepted, the task ends failed (no
    candidate), ``task run`` exits 1 with its reason."""
    ended_as(failing, "b-fail", "failed")
    failing.expect(r"^pi-runtime: task_not_done: task b-fail ended failed: the README cannot "
                   r"be fixed")  # fmt: skip
    assert [(r["kind"], r["accepted"]) for r in task["receipts"]] == [("fail", True)], task
    assert task["ended"]["candidate"] is None, task


def effect_held_then_resumed(smoke: Smoke, effect: Terminal) -> None:
    """WD13, WD8, WD12, TL8: ``b-effect``'s worker is killed (SIGKILL) while its ``bash`` (a
    never-replay tool) runs: an exit whose effect may have run — NeedsFinalization, then held
    ``effect_possibly_ran:bash``, nothing relaunched. The operator's ``task resume``
    continues it in the same session, the call settled "possibly ran"; the bash never runs
    again, and the task ends done."""
    smoke.model.wait_for("b-effect", "gate")  # the bash runs
    process = smoke.signal_worker("b-effect", signal.SIGKILL)
    effect.expect(smoke.event("b-effect", "NeedsFinalization") + "open ")
    effect.expect(smoke.event("b-effect", "StalledOperatorRequired") + r"open .*"
                  r"hold=effect_possibly_ran:bash$")  # fmt: skip
    smoke.model.release("b-effect")  # what is left of that bash may end now
    status, text = smoke.command("task", "resume", "b-effect", "--reason", "it did no harm")
    assert status == 0, text
    assert text.startswith("task b-effect: resume accepted; state open"), text
    effect.expect(smoke.event("b-effect", "Resuming") + "open ")
    path = ended_as(effect, "b-effect")
    assert path[:4] == ["Active", "NeedsFinalization", "StalledOperatorRequired", "Resuming"]
    assert gone(process["pid"], process["start_time"]), process
    assert smoke.model.seen.count(("b-effect", "gate")) == 1  # the effect, once
    assert smoke.model.seen.count(("effect", "continuation")) == 1
    (resumed,) = [r.body for r in smoke.model.requests
                  if CONTINUATION_ID.search(text_of(r.body["messages"][-1]))
                  and "[smoke:effect]" in json.dumps(r.body)]  # fmt: skip
    told = [text_of(m) for m in resumed["messages"] if m.get("role") == "tool"]
    assert told == ["tool bash was interrupted and possibly ran; inspect before repeating"], told


def operator_failed(smoke: Smoke, held: Terminal) -> None:
    """WD8, TL8: ``b-opfail`` settles twice without a lifecycle tool and is held (its worker
    kept); the operator's ``task fail`` ends it failed."""
    held.expect(smoke.event("b-opfail", "StalledOperatorRequired") + r"open .*"
                r"hold=no_terminal_after_completion_prompt:settled$")  # fmt: skip
    status, text = smoke.command("task", "fail", "b-opfail", "--reason", "the operator gave up")
    assert status == 0, text
    assert text.startswith("task b-opfail: fail accepted; state failed"), text
    ended_as(held, "b-opfail", "failed")
    held.expect(r"^pi-runtime: task_not_done: task b-opfail ended failed: the operator gave up")


def terminal_race(smoke: Smoke, race: Terminal) -> None:
    """LK1, LK3, LK4, LK9: ``b-race``'s agent calls ``task_done`` and ``task_fail`` in one
    answer — the first is accepted (a success intent), the second is late evidence. Done
    needs the whole tuple, and its validation command (``--validate``) is still running when
    the operator's ``task abort`` comes: accepted (not finalized yet), and it wins — the task
    ends aborted, not done; a later ``task fail`` is refused."""
    smoke.model.wait_for("b-race", "gate")  # the validation runs: the task is not done yet
    task = smoke.show_json("b-race")
    assert task["state"] == "success_intent", task
    verdicts = [(r["kind"], r["accepted"], r["verdict"]) for r in task["receipts"]]
    assert verdicts == [("done", True, "accepted"), ("fail", False, "late_terminal")], verdicts
    status, text = smoke.command("task", "abort", "b-race", "--reason", "the operator was first")
    assert status == 0, text
    assert text.startswith("task b-race: abort accepted; state aborted"), text
    smoke.model.release("b-race")  # the validation passes, too late
    ended_as(race, "b-race", "aborted")
    race.expect(r"^pi-runtime: task_not_done: task b-race ended aborted: the operator was first")
    refused(smoke.command("task", "fail", "b-race"), "task_ended", "task 'b-race' has ended")


def budget_exhausted(smoke: Smoke, budget: Terminal) -> None:
    """WD11, WD8, TL6: ``b-budget``'s worker is killed (SIGKILL) with a request in flight,
    three times: each exit gets one continuation on a replacement charged before its launch,
    until the budget (2 replacements) runs out: held ``budget_exhausted:epochs``, nothing
    launched."""
    for count in (1, 2, 3):
        smoke.kill_worker("b-budget", signal.SIGKILL, count)
    budget.expect(smoke.event("b-budget", "StalledOperatorRequired") + r"open .*"
                  r"hold=budget_exhausted:epochs$")  # fmt: skip


def restarted_host(smoke: Smoke, serve: Terminal, config: Path) -> tuple[Terminal, Views]:
    """TL7: the host dies (SIGKILL by its pid) while ``b-restart``'s completion prompt and
    ``b-cont``'s first continuation are worked on and ``b-budget`` is held; the same
    ``serve`` starts again on the same state directory. The new server, and the views just
    before the kill."""
    smoke.model.wait_for("restart", "streaming")  # the completion prompt is answered
    smoke.model.wait_for("cont", "streaming", 2)  # continuation c1 is answered
    before = smoke.views()
    assert before["b-restart"]["prompt_marker"] == marker("b-restart/g1/a1/e1/completion")
    assert before["b-cont"]["prompt_marker"] == marker("b-cont/g1/a1/c1/prompt")
    held = before["b-budget"]
    assert held["hold_reason"] == "budget_exhausted:epochs", held
    assert (held["budget"]["epochs_used"], held["budget"]["epochs_left"]) == (2, 0), held
    assert (held["process"], held["process_epoch"]) == (None, 3), held
    os.kill(serve.pid, signal.SIGKILL)
    assert serve.wait() == -signal.SIGKILL
    return smoke.serve(config), before


def restarted_around_the_prompts(
    smoke: Smoke, followers: Mapping[str, Terminal], before: Views, views: Views
) -> None:
    """TL5, TL6, TL7, WD11: after the restart the killed host's workers are gone (killed by
    their records) and each task continues in a replacement — charged like any other — with
    a continuation of its own; the prompt the dead worker was given is never sent again
    (each marker once in the session, the model asked once at that stage)."""
    for task_id, mode, epoch, used, markers in (
        ("b-restart", "restart", 2, 1, ("e1/completion", "c1/prompt")),
        ("b-cont", "cont", 3, 2, ("c1/prompt", "c2/prompt")),
    ):
        follower, task = followers[task_id], views[task_id]
        follower.expect(smoke.event(task_id, "Resuming") + "open ")
        path = ended_as(follower, task_id)
        assert "Fencing" not in path, path
        assert (task["process_epoch"], task["budget"]["epochs_used"]) == (epoch, used), task
        session = smoke.session(task)
        for action in markers:
            assert session.count(marker(f"{task_id}/g1/a1/{action}")) == 1, action
        process = before[task_id]["process"]
        assert gone(process["pid"], process["start_time"]), process
        assert smoke.model.seen.count((mode, "continuation")) == 1
    assert smoke.model.seen.count(("restart", "streaming")) == 1  # the completion prompt, once
    assert smoke.model.seen.count(("cont", "streaming")) == 2  # its prompt and c1, once each


def granted_then_resumed(smoke: Smoke, budget: Terminal) -> None:
    """WD11, WD12, TL8: the restarted host restores ``b-budget``'s hold and its spent budget
    (nothing refunded, nothing relaunched); ``task grant`` adds one epoch (audited, still
    held), ``task resume`` continues it in the same session."""
    budget.expect(smoke.event("b-budget", "StalledOperatorRequired") + r"open .*"
                  r"hold=budget_exhausted:epochs$")  # fmt: skip
    status, text = smoke.command("task", "grant", "b-budget", "--epochs", "1",
                                 "--reason", "smoke: one more")  # fmt: skip
    assert status == 0, text
    assert text.startswith("task b-budget: grant accepted; state open, StalledOperatorRequired")
    status, text = smoke.command("task", "resume", "b-budget", "--reason", "smoke")
    assert status == 0, text
    assert text.startswith("task b-budget: resume accepted; state open"), text
    budget.expect(smoke.event("b-budget", "Resuming") + "open ")
    ended_as(budget, "b-budget")
    assert classifications(budget.text, "b-budget")[0] == "StalledOperatorRequired"


def resumed_budget(smoke: Smoke, task: Mapping[str, Any]) -> None:
    """What the grant and the resume cost: one epoch more, charged once, one continuation."""
    assert task["budget"]["epochs_used"] == 3, task
    assert task["budget"]["granted_epochs"] == 1, task
    assert task["budget"]["epochs_left"] == 0, task
    assert task["process_epoch"] == 4, task
    grants = [a for a in lane_records(smoke.state, "b-budget")
              if isinstance(a, OutboxAction) and a.kind == "grant"]  # fmt: skip
    assert [g.detail["reason"] for g in grants] == ["smoke: one more"], grants
    assert smoke.session(task).count(marker("b-budget/g1/a1/c3/prompt")) == 1
    assert smoke.model.seen.count(("budget", "continuation")) == 1


B_ENDED: Final = {
    "b-restart": ("done", 1), "b-cont": ("done", 2), "b-budget": ("done", 3),
    "b-fail": ("failed", 0), "b-opfail": ("failed", 0), "b-race": ("aborted", 0),
    "b-effect": ("done", 1),
}  # fmt: skip
"""How each task of the second server ends, and the replacement epochs it is charged."""


def restarts_budget_fail_and_races(smoke: Smoke, url: str) -> None:
    """The second server's scenario (see the test)."""
    config = write_config(smoke.root, url, "[watchdog]\nmax_replacements = 2\n")
    serve = smoke.serve(config)
    validate = shlex.join(gate_command(smoke.model, "b-race"))
    follow = {
        "b-restart": smoke.submit("b-restart", "restart"),
        "b-cont": smoke.submit("b-cont", "cont"),
        "b-budget": smoke.submit("b-budget", "budget"),
        "b-fail": smoke.submit("b-fail", "fail"),
        "b-opfail": smoke.submit("b-opfail", "hold"),
        "b-race": smoke.submit("b-race", "race", "--validate", validate),
        "b-effect": smoke.submit("b-effect", "effect"),
    }
    for task_id, follower in follow.items():
        follower.expect(rf"^task {task_id}: started on the server \(state open\)$")
    smoke.kill_worker("b-cont", signal.SIGKILL)
    effect_held_then_resumed(smoke, follow["b-effect"])
    operator_failed(smoke, follow["b-opfail"])
    terminal_race(smoke, follow["b-race"])
    budget_exhausted(smoke, follow["b-budget"])
    follow["b-restart"].expect(smoke.event("b-restart", "NeedsFinalization") + "open ")
    serve, before = restarted_host(smoke, serve, config)
    for task_id in ("b-restart", "b-cont", "b-budget"):  # their server died under them
        assert follow[task_id].wait() == 1, follow[task_id].text
        follow[task_id] = smoke.follow(task_id)
    granted_then_resumed(smoke, follow["b-budget"])
    for follower in follow.values():
        follower.wait()  # to its end (bounded); what it printed is checked below
    views = smoke.views()
    agent_failed(follow["b-fail"], views["b-fail"])
    restarted_around_the_prompts(smoke, follow, before, views)
    resumed_budget(smoke, views["b-budget"])
    listed_as(smoke, {task_id: view["state"] for task_id, view in views.items()})
    status, text = smoke.command("journal", "verify")
    assert status == 0, text
    assert re.search(r"^checked \d+ logs: 0 problems$", text, re.M), text
    nothing_twice(smoke, views, B_ENDED, restarted={"b-restart", "b-cont"})
    assert serve.stop() == 0


def test_smoke_restart_budget_fail_and_races_under_the_test_time_scale(tmp_path: Path) -> None:
    """Seven tasks at once on one ``pi-runtime serve --unsafe-test-timescale`` whose budget is
    two replacement epochs; the host is killed and started again in the middle."""
    model = SmokeModel()
    with model_thread(model) as url, terminals() as terminal:
        smoke = Smoke(tmp_path, make_worktree(tmp_path, "worktrees"), tmp_path / "state", model,
                      terminal)  # fmt: skip
        try:
            with smoke.reported():
                restarts_budget_fail_and_races(smoke, url)
        finally:
            kill_leftover_workers(smoke.state)
