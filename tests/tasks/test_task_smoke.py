"""The smoke scenario of issue #8: the **installed** ``pi-runtime`` in pseudo-terminals.

Every command is the console script next to ``sys.executable`` (``.venv/bin/pi-runtime``),
spawned in its own pseudo-terminal with pexpect, as an operator would run it. The model is a
scripted model served on loopback from a thread of the test process; the task's prompt names
what it does (``[smoke:MODE]``), so several tasks can share it in any interleaving:

* ``prod`` / ``wait``: ``task_done`` at once / ``task_wait`` first, ``task_done`` after the reply;
* ``fence`` / ``stop``: the first request reaches a provider that starts its answer and then
  pads the stream with empty deltas forever, never a token (a wedged backend behind a router
  that keeps its stream busy): the gateway sees data events, so neither of its inactivity
  bounds (G10 bytes, G15 data) ends the stream, while the worker sees the answer start and
  then nothing — a wedge only the watchdog can see. (A provider that sends only SSE comments
  is the gateway's to cut, G15.) After the continuation prompt, ``task_done``;
* ``hold``: never calls a lifecycle tool (held after its one completion prompt).

First the production thresholds (no time scale: a standalone run, then ``task show``), then one
server under ``--unsafe-test-timescale`` (``docs/design/watchdog.md`` WD2, WD3, WD8-WD11, LK5,
TL5, TL8, TL9; ``docs/design/operations.md`` O13-O16) running four tasks at once:

* ``smoke``: Active → Suspect → HardResumeEligible → Fencing → Resuming → Active → done, one
  continuation prompt, one replacement epoch charged;
* ``smoke-stop``: the same wedge, and its worker SIGSTOPped (its pid from ``task show
  --json``). A stopped worker answers no probe, and an unanswered fence probe is an unknown
  guard, so the watchdog holds (``probe_unanswered``) and never signals it (WD3, WD10) — it
  is *not* fenced automatically. The operator's ``task resume`` then stops it (TERM stays
  pending on a stopped process; the KILL after the bound ends it) and the task resumes in the
  same session to done; nothing of the stopped worker is left;
* ``smoke2``: a wait, woken by ``task reply`` from another terminal, then done;
* ``smoke-hold``: held, then ``task abort`` → aborted; refusals with their stable codes
  (``task_not_waiting``, ``task_not_held``, ``task_ended``), exit status 1.

Nothing sleeps on the clock to wait: a test waits for a line a terminal prints, a process's
exit, or a request reaching the model, each bounded by :data:`LIMIT`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import pexpect
import trio

from fake_pi.model_server import ReceivedRequest, ScriptedModel, body_digest, serve_model
from fake_pi.scenario import Call, Step, Text, ToolCalls
from runtime._boundary._http import Request, ResponseWriter
from runtime._linux._proc import process_start_time
from runtime._linux._proctree import is_alive_pid

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
CONTINUATION: Final = "[pi-runtime continuation v1 "
REPLY: Final = "REPLY:"
FENCED_PATH: Final = ["Active", "Suspect", "HardResumeEligible", "Fencing", "Resuming", "Active"]
HELD_PATH: Final = ["Active", "Suspect", "HardResumeEligible", "StalledOperatorRequired"]
TRICKLE_SECONDS: Final = 0.5
"""How often the wedged provider sends an empty delta (well inside the gateway's bounds)."""
TRICKLE_LIMIT: Final = 120.0
"""The wedged provider gives up by itself after this long (the test is over by then)."""


# -- the scripted model ----------------------------------------------------------------------


def done(summary: str = "did it") -> ToolCalls:
    return ToolCalls(calls=[Call(name="task_done", arguments={"summary": summary})])


def task_wait(question: str) -> ToolCalls:
    return ToolCalls(calls=[Call(name="task_wait", arguments={"question": question})])


def text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


@dataclass
class SmokeModel(ScriptedModel):
    """Answers by the task's mode (``[smoke:MODE]`` in its prompt) and the last message, so
    any number of tasks can use it at once; records ``(mode, stage)`` of every request."""

    seen: list[tuple[str, str]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def plan(self, body: dict[str, Any]) -> tuple[str, str, Step | None]:
        """``(mode, stage, step)``; step ``None``: the wedged provider."""
        messages = [m for m in body.get("messages", []) if m.get("role") != "system"]
        prompt = next((text_of(m) for m in messages if m.get("role") == "user"), "")
        found = re.search(r"\[smoke:(\w+)\]", prompt)
        mode = found.group(1) if found else "plain"
        last = messages[-1] if messages else {}
        text = text_of(last)
        if last.get("role") == "tool":
            return mode, "tool_result", Text(text="finished")
        if mode == "hold":
            return mode, "prompt", Text(text="I will not call a lifecycle tool.")
        if CONTINUATION in text:
            return mode, "continuation", done("finished after the continuation")
        if REPLY in text:  # after the reply's marker line (LK8)
            return mode, "reply", done("finished after the reply")
        if mode in ("fence", "stop"):
            return mode, "wedged", None
        if mode == "wait":
            return mode, "prompt", task_wait("which colour?")
        return mode, "prompt", done()

    def note(self, mode: str, stage: str) -> None:
        with self.changed:
            self.seen.append((mode, stage))
            self.changed.notify_all()

    def next_step(self, body: dict[str, Any]) -> Step:
        mode, stage, step = self.plan(body)
        assert step is not None
        self.requests.append(ReceivedRequest(body, body_digest(body), step))
        self.note(mode, stage)
        return step

    def wait_for(self, mode: str, stage: str, timeout: float = LIMIT) -> None:
        with self.changed:
            arrived = self.changed.wait_for(lambda: (mode, stage) in self.seen, timeout)
        assert arrived, f"no {stage} request of {mode} reached the model: {self.seen}"

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        if request.method == "POST" and request.target.rstrip("/").endswith("/chat/completions"):
            with contextlib.suppress(msgspec.DecodeError):
                body = msgspec.json.decode(request.body)
                if isinstance(body, dict):
                    mode, stage, step = self.plan(body)
                    if step is None:
                        self.note(mode, stage)
                        await self.wedged(response)
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
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
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
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"pty {args[:2]}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.child.read_nonblocking(65536, timeout=1.0)
            except pexpect.TIMEOUT:
                continue
            except (pexpect.EOF, OSError, ValueError):
                break
            with self._changed:
                self.text += data.replace("\r\n", "\n")
                self._changed.notify_all()
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
                f"(ended: {self.ended}, status {self.status}); it printed:\n{self.text}"
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


def write_config(root: Path, url: str) -> Path:
    path = root / "config.toml"
    path.write_text(
        f'state_dir = "{root / "state"}"\nwork_root = "{root / "work"}"\n\n'
        f'[model]\nbase_url = "{url}"\n'
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

    def command(self, *args: str) -> tuple[int, str]:
        """``pi-runtime ARGS --state-dir STATE`` in its own terminal, to its end."""
        return ran(self.terminal(self.root, *args, "--state-dir", str(self.state)))

    def run_task(self, task_id: str, mode: str) -> Terminal:
        """``pi-runtime task run … --wait`` through the server, printing the task's events."""
        worktree = self.worktree / task_id  # one live task per worktree (TL13)
        if not worktree.exists():
            make_worktree(self.worktree, name=task_id)
        follow = self.terminal(self.root, *run_args(worktree, self.state, task_id, mode,
                                                    "--wait"))  # fmt: skip
        follow.expect(rf"^task {task_id}: started on the server \(state open\)$")
        return follow

    def event(self, task_id: str, classification: str) -> str:
        """The start of a printed event line of ``task_id`` (loud: the time scale is unsafe)."""
        return rf"^{re.escape(MARKER)} task {re.escape(task_id)}: {classification} state="

    def show_json(self, task_id: str) -> dict[str, Any]:
        view = query_json(self.root, "task", "show", task_id, "--state-dir", str(self.state))
        assert view["source"] == "server", view
        task: dict[str, Any] = view["task"]
        return task


def refused(answer: tuple[int, str], code: str, message: str) -> None:
    status, text = answer
    assert status == 1, text
    assert f"pi-runtime: {code}: {message}" in text, text


def stop_the_wedged_worker(smoke: Smoke) -> None:
    """``smoke-stop``'s worker, waiting on the wedged provider, gets SIGSTOP: from now on it
    answers no probe."""
    smoke.model.wait_for("stop", "wedged")
    process = smoke.show_json("smoke-stop")["process"]
    assert process is not None
    smoke.stopped.update(process)
    os.kill(process["pid"], signal.SIGSTOP)
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


def shown_and_listed(smoke: Smoke) -> dict[str, Any]:
    """O16: ``task show`` prints the production thresholds, the ones in effect and the
    warning; one continuation marker (in the session once); one replacement epoch charged.
    ``tasks`` begins with the warning. The JSON view of ``smoke``."""
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
    task = smoke.show_json("smoke")
    assert task["budget"]["epochs_used"] == 1
    assert task["prompt_marker"] == "[pi-runtime continuation v1 smoke/g1/a1/c1/prompt]"
    assert task["production"]["soft_seconds"] == 300
    assert task["production"]["hard_seconds"] == {"provider": 900, "generation": 900}
    assert task["production"]["grace_seconds"] == 120
    assert task["timescale"] == FACTOR
    session = (smoke.state / task["session_path"]).read_text()  # relative to the state dir
    assert session.count("[pi-runtime continuation v1 smoke/g1/a1/c1/prompt]") == 1
    listed = smoke.terminal(smoke.root, "tasks", "--state-dir", str(smoke.state))
    listed.expect(rf"^!!! {re.escape(WARNING)} ")
    listed.expect(r"^server: running")
    for task_id, ended in (
        ("smoke", "done"), ("smoke-hold", "aborted"), ("smoke-stop", "done"), ("smoke2", "done"),
    ):  # fmt: skip
        listed.expect(rf"^{re.escape(task_id)} +{ended} ")
    assert ran(listed)[0] == 0
    return task


def test_smoke_fence_resume_wait_reply_and_abort_under_the_test_time_scale(
    tmp_path: Path,
) -> None:
    """Four tasks at once on one ``pi-runtime serve --unsafe-test-timescale``, each followed
    by its own ``task run --wait`` terminal, controlled from more terminals."""
    model = SmokeModel()
    with model_thread(model) as url, terminals() as terminal:
        smoke = Smoke(tmp_path, make_worktree(tmp_path, "worktrees"), tmp_path / "state", model,
                      terminal)  # fmt: skip
        try:
            serve = terminal(
                tmp_path, "serve", "--port", "0", "--config", str(write_config(tmp_path, url)),
                "--state-dir", str(smoke.state), "--unsafe-test-timescale", str(FACTOR),
            )  # fmt: skip
            serve.expect(rf"^pi-runtime serve: !!! {re.escape(WARNING)} \(")
            serve.expect(r"^pi-runtime serve: listening on ws://127\.0\.0\.1:\d+ ")
            fence = smoke.run_task("smoke", "fence")
            stop = smoke.run_task("smoke-stop", "stop")
            waiting = smoke.run_task("smoke2", "wait")
            hold = smoke.run_task("smoke-hold", "hold")
            model.wait_for("fence", "wedged")
            refused(smoke.command("task", "reply", "smoke", "hi"), "task_not_waiting",
                    "task 'smoke' is not waiting")  # fmt: skip
            stop_the_wedged_worker(smoke)
            wait_reply_done(smoke, waiting)  # meanwhile the wedged tasks' clocks run
            hold_abort(smoke, hold)
            fenced_resumed_done(smoke, fence)
            held_then_resumed(smoke, stop)
            task = shown_and_listed(smoke)
            assert serve.stop() == 0
            serve.expect(r"^pi-runtime serve: SIGTERM: not admitting")
        finally:
            stopped = smoke.stopped
            if stopped and not gone(stopped["pid"], stopped["start_time"]):
                # the test failed before the runtime ended it: never leave it behind
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped["pid"], signal.SIGKILL)
    # every log line of the server says so (O16)
    logged = [line for line in serve.text.splitlines() if re.match(r"^\d{4}-\d\d-\d\d ", line)]
    assert logged
    assert all("UNSAFE" in line for line in logged), logged
    # WD11: the time from the fence to the resumed worker's first progress is the resume
    # latency, charged to the recovery budget
    recovery = (task["telemetry"]["resume_latency_seconds"], task["budget"])
    assert len(recovery[0]) == 1, recovery
    assert task["budget"]["seconds_used"] > 0, recovery
