"""Task lanes from the command line and the admin socket (issue #8 items 1, 4, 9;
``docs/design/operations.md``, O13-O16).

``pi-runtime task run`` runs as a real ``python -m runtime._cli`` process: standalone (it owns
the state directory) and through a running ``pi-runtime serve`` process's admin socket. Workers
are Fake-Pi subprocesses; the model is a scripted model served on loopback by the test run
(the configuration's ``model.base_url`` points at it). Every wait is for a line a process
prints, a process's exit, or a server's long-poll answer, bounded by ``trio.fail_after``;
nothing sleeps on the clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi.scenario import Step
from runtime._cli import EXIT_FAILED, EXIT_NO_SERVER, EXIT_OK, main
from runtime._server._admin import admin_request, serve_admin

from .._workers import scripted_upstream
from ..task_harness import done, fail, make_worktree, say, wait

REPO: Final = Path(__file__).resolve().parents[2]
LIMIT: Final = 120.0
ENV: Final = {**os.environ, "PYTHONPATH": str(REPO)}
LISTENING: Final = re.compile(rb"listening on ws://([0-9.]+):(\d+)")
PRODUCTION: Final = (
    "production thresholds: soft 300 s, hard provider 900 s, generation 900 s, grace 120 s"
)


def write_config(root: Path, url: str, extra: str = "") -> Path:
    path = root / "config.toml"
    path.write_text(
        f'state_dir = "state"\nwork_root = "work"\n\n[model]\nbase_url = "{url}"\n{extra}'
    )
    return path


async def cli(root: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """``pi-runtime ARGS`` as a real process in ``root``."""
    return await trio.run_process(
        [sys.executable, "-m", "runtime._cli", *args],
        cwd=root,
        env=ENV,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


def out(done: subprocess.CompletedProcess[bytes]) -> str:
    return done.stdout.decode()


def err(done: subprocess.CompletedProcess[bytes]) -> str:
    return done.stderr.decode()


class Process:
    """A long-running ``pi-runtime`` process whose standard output the test reads."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.output = b""

    async def printed(self, pattern: bytes) -> re.Match[bytes]:
        """Wait until the process prints something matching ``pattern``."""
        assert self.process.stdout is not None
        while (found := re.search(pattern, self.output)) is None:
            data = await self.process.stdout.receive_some(4096)
            assert data, f"the process ended without printing {pattern!r}: {self.output!r}"
            self.output += data
        return found

    async def rest(self) -> str:
        """Everything it prints until it exits."""
        assert self.process.stdout is not None
        while data := await self.process.stdout.receive_some(4096):
            self.output += data
        await self.process.wait()
        return self.output.decode()


@contextlib.asynccontextmanager
async def started(root: Path, *args: str) -> AsyncIterator[Process]:
    with (root / f"{args[0]}.stderr").open("ab") as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "runtime._cli", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=str(root),
            env=ENV,
        )
        try:
            yield Process(process)
        finally:
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()


@contextlib.asynccontextmanager
async def serve(root: Path, config: Path, *args: str) -> AsyncIterator[Process]:
    async with started(root, "serve", "--port", "0", "--config", str(config), *args) as server:
        await server.printed(LISTENING.pattern)
        yield server


async def until(
    state: Path, task_id: str, wanted: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """Follow a task through the server's ``task_wait`` long poll until ``wanted(view)``."""
    after = 0
    while True:
        answer = await admin_request(
            state, {"command": "task_wait", "task_id": task_id, "after": after, "seconds": 20}
        )
        assert answer is not None
        assert answer["ok"], answer
        view: dict[str, Any] = answer["task"]
        if wanted(view):
            return view
        after = answer["last"]


def run_task(worktree: Path, task_id: str, *extra: str) -> list[str]:
    return [
        "task", "run", "--worktree", str(worktree), "--prompt", "do the task",
        "--task-id", task_id, "--state-dir", "state", *extra,
    ]  # fmt: skip


# -- O13: task run standalone, then read without a server -----------------------------------


async def test_o13_task_run_standalone_to_done_then_tasks_and_show_read_the_lane_log(
    tmp_path: Path,
) -> None:
    worktree = make_worktree(tmp_path)
    steps: list[Step] = [done("fixed it"), say("finished")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            config = str(write_config(tmp_path, url))
            ran = await cli(tmp_path, *run_task(worktree, "t1", "--config", config))
            assert ran.returncode == EXIT_OK, err(ran)
            lines = out(ran).splitlines()
            assert lines[0].startswith("task t1: started here (standalone")
            assert "task t1: Active state=open phase=provider epoch=1" in lines
            assert lines[-2].endswith("ended=done")
            assert lines[-1].startswith("task t1 ended done: candidate archive ")
            assert "UNSAFE" not in out(ran) + err(ran)
            assert model.request_count == 2
            # the same task again: the lane log already holds its end; nothing runs
            again = await cli(tmp_path, *run_task(worktree, "t1", "--config", config))
            assert again.returncode == EXIT_OK, err(again)
            assert out(again).splitlines()[0].startswith("task t1: duplicate here")
            assert model.request_count == 2
    listed = await cli(tmp_path, "tasks", "--state-dir", "state")
    assert listed.returncode == EXIT_OK
    assert out(listed).splitlines()[0] == "server: not running; read from the lane logs"
    assert re.search(r"^t1 +done +- +- +1 +- +none: the task has ended$", out(listed), re.M)
    shown = await cli(tmp_path, "task", "show", "t1", "--state-dir", "state")
    assert shown.returncode == EXIT_OK, err(shown)
    text = out(shown)
    for field in (
        "state", "ids", "epochs", "session", "route", "worktree", "process", "classification",
        "phase", "progress", "soft threshold", "hard threshold", "grace", "receipts",
        "prompt marker", "budget", "pending action", "hold reason", "next action",
        "time scale", "telemetry", "ended", "candidate",
    ):  # fmt: skip
        assert re.search(rf"^  {field} +\S", text, re.M), field
    assert "done accepted (epoch 1" in text
    assert "route           fake/fake-model" in text
    assert f"  {PRODUCTION}" in text
    assert "UNSAFE" not in text
    as_json = json.loads(out(await cli(tmp_path, "task", "show", "t1", "--json")))
    assert as_json["source"] == "state_dir"
    assert as_json["task"]["ended"]["state"] == "done"
    assert as_json["task"]["production"]["hard_seconds"] == {"provider": 900, "generation": 900}
    status = await cli(tmp_path, "status", "--state-dir", "state")
    assert "tasks: 1\n  t1  done  - ended done" in out(status)
    unknown = await cli(tmp_path, "task", "show", "ghost", "--state-dir", "state")
    assert unknown.returncode == EXIT_FAILED
    assert (
        err(unknown)
        == "pi-runtime: task_unknown: no task 'ghost' in "
        + str((tmp_path / "state").absolute())
        + "\n"
    )
    for control in (["abort", "t1"], ["reply", "t1", "hi"], ["grant", "t1", "--reason", "r"]):
        refused = await cli(tmp_path, "task", *control, "--state-dir", "state")
        assert refused.returncode == EXIT_NO_SERVER
        assert err(refused).startswith("pi-runtime: server_not_running: no server answers")


async def test_o13_a_task_that_fails_exits_non_zero_with_its_code(tmp_path: Path) -> None:
    worktree = make_worktree(tmp_path)
    with trio.fail_after(LIMIT):
        async with scripted_upstream([fail("cannot build"), say()]) as (_model, url):
            config = str(write_config(tmp_path, url))
            ran = await cli(tmp_path, *run_task(worktree, "t2", "--config", config))
    assert ran.returncode == EXIT_FAILED
    assert out(ran).splitlines()[-1].endswith("ended=failed")
    assert err(ran).splitlines()[-1] == (
        "pi-runtime: task_not_done: task t2 ended failed: cannot build"
    )


async def test_o13_a_validation_past_its_timeout_is_killed_and_keeps_the_task_from_done(
    tmp_path: Path,
) -> None:
    """``--validate`` with ``--validation-timeout``: the command is killed at its bound, its
    receipt says so and has not passed, so the task is not done: it holds
    ``finalization_incomplete:validation`` (LK4, LK10), ``task show`` shows the receipt, and
    the run ends when the operator fails the task."""
    worktree = make_worktree(tmp_path)
    slow = f"{sys.executable} -c 'import time; time.sleep(120)'"
    with trio.fail_after(LIMIT):
        async with scripted_upstream([done(), say()]) as (_model, url):
            config = str(write_config(tmp_path, url))
            args = (*run_task(worktree, "tv", "--config", config),
                    "--validate", slow, "--validation-timeout", "0.5")  # fmt: skip
            async with started(tmp_path, *args) as run:
                await run.printed(rb"hold=finalization_incomplete:validation")
                shown = json.loads(out(await cli(tmp_path, "task", "show", "tv", "--json")))
                validation = shown["task"]["finalization"]["validation"]
                assert validation["exit_status"] < 0  # killed: a signal, never a pass
                assert "timed out after 0.5s" in validation["output_tail"]
                assert validation["duration_ms"] < 60_000
                assert shown["task"]["ended"] is None
                failed = await cli(tmp_path, "task", "fail", "tv", "--reason", "too slow")
                assert failed.returncode == EXIT_OK, err(failed)
                await run.rest()
                assert run.process.returncode == EXIT_FAILED
    assert "task tv ended failed: too slow" in (tmp_path / "task.stderr").read_text()


async def test_o13_a_standalone_task_run_answers_replies_on_its_admin_socket(
    tmp_path: Path,
) -> None:
    """A task that waits for the user is woken by ``pi-runtime task reply`` from another
    process: the standalone run serves the admin socket."""
    worktree = make_worktree(tmp_path)
    steps: list[Step] = [wait("which colour?"), say("asked"), done(), say("finished")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (_model, url):
            config = str(write_config(tmp_path, url))
            async with started(tmp_path, *run_task(worktree, "t3", "--config", config)) as run:
                await run.printed(rb"state=waiting")
                shown = await cli(tmp_path, "task", "show", "t3", "--state-dir", "state")
                assert "classification  WaitingUser" in out(shown)
                assert "(no server runs" not in out(shown)
                replied = await cli(tmp_path, "task", "reply", "t3", "blue")
                assert replied.returncode == EXIT_OK, err(replied)
                assert out(replied).startswith("task t3: reply accepted; state open")
                rest = await run.rest()
                assert run.process.returncode == EXIT_OK
                assert rest.splitlines()[-1].startswith("task t3 ended done")


async def test_o13_ctrl_c_stops_a_standalone_run_and_leaves_the_task_unfinished(
    tmp_path: Path,
) -> None:
    worktree = make_worktree(tmp_path)
    with trio.fail_after(LIMIT):
        async with scripted_upstream([wait(), say("asked")]) as (_model, url):
            config = str(write_config(tmp_path, url))
            async with started(tmp_path, *run_task(worktree, "t4", "--config", config)) as run:
                await run.printed(rb"state=waiting")
                run.process.send_signal(signal.SIGINT)
                await run.rest()
                assert run.process.returncode == 130
    logged = (tmp_path / "task.stderr").read_text()
    assert "pi-runtime: task_not_done: task t4 interrupted (SIGINT): it stays unfinished" in logged
    listed = out(await cli(tmp_path, "tasks", "--state-dir", "state"))
    assert re.search(r"^t4 +waiting +- ", listed, re.M)


# -- O14: through a running server -----------------------------------------------------------


async def test_o14_task_run_show_and_abort_through_a_running_server(tmp_path: Path) -> None:
    worktree = make_worktree(tmp_path)
    state = tmp_path / "state"
    steps: list[Step] = [done(), say("finished"), wait("which one?"), say("asked")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (_model, url):
            config = write_config(tmp_path, url)
            async with serve(tmp_path, config) as server:
                assert b"UNSAFE" not in server.output
                ran = await cli(tmp_path, *run_task(worktree, "t1", "--wait"))
                assert ran.returncode == EXIT_OK, err(ran)
                lines = out(ran).splitlines()
                assert lines[0] == "task t1: started on the server (state open)"
                assert lines[-1].startswith("task t1 ended done: candidate archive ")
                shown = out(await cli(tmp_path, "task", "show", "t1"))
                assert "(no server runs" not in shown
                assert "classification  Active" in shown
                assert f"  {PRODUCTION}" in shown
                # a second task, not followed: it waits for the user
                started_t2 = await cli(tmp_path, *run_task(worktree, "t2"))
                assert started_t2.returncode == EXIT_OK
                assert out(started_t2) == "task t2: started on the server (state open)\n"
                view = await until(state, "t2", lambda v: v["state"] == "waiting")
                assert view["classification"] == "WaitingUser"
                listed = out(await cli(tmp_path, "tasks"))
                assert listed.splitlines()[0] == "server: running (answered on its admin socket)"
                assert re.search(r"^t2 +waiting +WaitingUser ", listed, re.M)
                resumed = await cli(tmp_path, "task", "resume", "t2")
                assert resumed.returncode == EXIT_FAILED
                assert err(resumed) == "pi-runtime: task_not_held: task 't2' is not held\n"
                aborted = await cli(tmp_path, "task", "abort", "t2", "--reason", "not needed")
                assert aborted.returncode == EXIT_OK, err(aborted)
                view = await until(state, "t2", lambda v: v["ended"] is not None)
                assert view["ended"]["state"] == "aborted"
                again = await cli(tmp_path, "task", "abort", "t2")
                assert (again.returncode, err(again)) == (
                    EXIT_FAILED,
                    "pi-runtime: task_ended: task 't2' has ended\n",
                )
                # the admin socket's task commands, as JSON lines
                bad = await admin_request(
                    state,
                    {"command": "task_submit", "task_id": "t9", "prompt": "p", "worktree": "rel"},
                )
                assert bad is not None
                assert (bad["ok"], bad["code"]) == (False, "task_invalid")
                bad = await admin_request(state, {"command": "task_grant", "task_id": "t1"})
                assert bad is not None
                assert (bad["ok"], bad["code"]) == (False, "admin_bad_request")
                status = await admin_request(state, {"command": "status"})
                assert status is not None
                assert [t["task_id"] for t in status["tasks"]] == ["t1", "t2"]
                server.process.send_signal(signal.SIGTERM)
                assert await server.process.wait() == 0
            listed = out(await cli(tmp_path, "tasks", "--state-dir", "state"))
            assert re.search(r"^t1 +done ", listed, re.M)
            assert re.search(r"^t2 +aborted ", listed, re.M)
            # the next start knows both as they ended
            async with serve(tmp_path, config) as server:
                shown = json.loads(out(await cli(tmp_path, "task", "show", "t1", "--json")))
                assert shown["source"] == "server"
                assert (shown["task"]["state"], shown["task"]["process_epoch"]) == ("done", 1)
                assert [r["kind"] for r in shown["task"]["receipts"]] == ["done"]
                again = await cli(tmp_path, *run_task(worktree, "t1", "--wait"))
                assert again.returncode == EXIT_OK, err(again)
                assert out(again).splitlines()[0] == (
                    "task t1: duplicate on the server (state done)"
                )
                server.process.send_signal(signal.SIGTERM)
                assert await server.process.wait() == 0


# -- O15: the watchdog's configuration is checked at start ------------------------------------


@pytest.mark.parametrize(
    ("table", "code", "setting"),
    [
        ("hard_provider_seconds = 600", "watchdog_config_invalid",
         "watchdog.hard_provider_seconds: must be at least 900 s, not 600"),
        ("soft_seconds = 100", "watchdog_config_invalid", "watchdog.soft_seconds: is static"),
        ("grace_seconds = -1", "watchdog_config_invalid", "watchdog.grace_seconds: must be"),
        ("max_replacements = 0", "watchdog_config_invalid", "watchdog.max_replacements: must"),
        ('soft_seconds = "x"', "config_invalid", "watchdog.soft_seconds: Expected `float`"),
        ("frob = 1", "config_invalid", "watchdog.frob: unknown setting"),
    ],
)  # fmt: skip
async def test_o15_an_invalid_watchdog_configuration_is_refused_naming_the_setting(
    tmp_path: Path, table: str, code: str, setting: str, capsys: pytest.CaptureFixture[str]
) -> None:
    worktree = make_worktree(tmp_path)
    config = write_config(tmp_path, "http://127.0.0.1:9/v1", f"\n[watchdog]\n{table}\n")
    argv = run_task(worktree, "t1", "--config", str(config))
    assert await trio.to_thread.run_sync(main, argv) == EXIT_FAILED
    assert capsys.readouterr().err.startswith(f"pi-runtime: {code}: {setting}")
    argv = ["serve", "--port", "0", "--config", str(config)]
    assert await trio.to_thread.run_sync(main, argv) == 2
    assert f"{code}: {setting}" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()  # refused before anything started


async def test_o15_a_time_scale_below_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    worktree = make_worktree(tmp_path)
    argv = run_task(worktree, "t1", "--unsafe-test-timescale", "0.5")
    assert await trio.to_thread.run_sync(main, argv) == EXIT_FAILED
    assert capsys.readouterr().err.startswith(
        "pi-runtime: watchdog_config_invalid: unsafe_test_timescale: must be a finite number"
    )


# -- O16: the unsafe test time scale is said loudly ---------------------------------------------


async def test_o16_the_unsafe_time_scale_is_in_every_line_status_and_show(tmp_path: Path) -> None:
    worktree = make_worktree(tmp_path)
    warning = "UNSAFE TEST TIMESCALE x60: thresholds divided by 60"
    scaled = "in effect: soft 5 s, hard provider 15 s, generation 15 s, grace 2 s"
    with trio.fail_after(LIMIT):
        async with scripted_upstream([done(), say(), done(), say()]) as (_model, url):
            config = write_config(tmp_path, url)
            async with serve(tmp_path, config, "--unsafe-test-timescale", "60") as server:
                assert f"!!! {warning}".encode() in server.output
                status = await cli(tmp_path, "status")
                lines = out(status).splitlines()
                assert lines[0].startswith(f"!!! {warning}")
                assert lines[-1].startswith(f"!!! {warning}")
                ran = await cli(tmp_path, *run_task(worktree, "t1", "--wait"))
                assert ran.returncode == EXIT_OK, err(ran)
                events = [line for line in out(ran).splitlines() if ": Active state=" in line]
                assert events
                assert all(e.startswith("[UNSAFE TEST TIMESCALE x60] ") for e in events)
                shown = out(await cli(tmp_path, "task", "show", "t1"))
                assert f"  {PRODUCTION}" in shown
                assert f"  {scaled}" in shown
                assert f"  !!! {warning}" in shown
                assert "  time scale      x60" in shown
                listed = out(await cli(tmp_path, "tasks"))
                assert listed.startswith(f"!!! {warning}")
                server.process.send_signal(signal.SIGTERM)
                assert await server.process.wait() == 0
            logged = (tmp_path / "serve.stderr").read_text().splitlines()
            assert logged
            assert all("UNSAFE" in line for line in logged), logged
            # standalone: every line it prints or logs says so too
            alone = await cli(
                tmp_path, *run_task(worktree, "t2", "--config", str(config),
                                    "--unsafe-test-timescale", "60"),
            )  # fmt: skip
            assert alone.returncode == EXIT_OK, err(alone)
            printed = out(alone).splitlines()
            assert printed[0].startswith(f"pi-runtime task run: !!! {warning}")
            events = [line for line in printed if ": Active state=" in line]
            assert events
            assert all(e.startswith("[UNSAFE TEST TIMESCALE x60] ") for e in events)
            assert err(alone).splitlines()
            assert all("UNSAFE" in line for line in err(alone).splitlines())


# -- the admin socket without task lanes ---------------------------------------------------


class RoomsOnly:
    async def status(self) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        return {"worker_id": "w"}

    async def cancel(self, delivery_id: str) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        return {"delivery_id": delivery_id}


async def test_o7_task_commands_of_a_server_without_task_lanes_are_unknown(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_admin, state, RoomsOnly())
            answer = await admin_request(state, {"command": "tasks"})
            assert answer is not None
            assert (answer["ok"], answer["code"]) == (False, "admin_unknown_command")
            assert "runs no task lanes" in answer["message"]
            answer = await admin_request(state, {"command": "task_show"})
            assert answer is not None
            assert (answer["ok"], answer["code"]) == (False, "admin_bad_request")
            answer = await admin_request(state, {"command": "task_show", "task_id": ""})
            assert answer is not None
            assert (answer["ok"], answer["code"]) == (False, "admin_bad_request")
            nursery.cancel_scope.cancel()


async def test_op11_task_show_and_tasks_say_not_watched_for_a_silence_not_measured(
    tmp_path: Path,
) -> None:
    """OP11: a task waiting for its user has no silence the watchdog measures (WD7); `tasks`
    and `task show` say `not watched`, and the view says `silence_watched: false` — before,
    both printed `0 s`, a measurement nobody made."""
    worktree = make_worktree(tmp_path)
    state = tmp_path / "state"
    with trio.fail_after(LIMIT):
        async with scripted_upstream([wait("which one?")]) as (_model, url):
            config = write_config(tmp_path, url)
            async with serve(tmp_path, config) as server:
                started = await cli(tmp_path, *run_task(worktree, "t2"))
                assert started.returncode == EXIT_OK, err(started)
                await until(state, "t2", lambda v: v["state"] == "waiting")
                listed = out(await cli(tmp_path, "tasks"))
                shown = out(await cli(tmp_path, "task", "show", "t2"))
                viewed = json.loads(out(await cli(tmp_path, "task", "show", "t2", "--json")))
                server.process.send_signal(signal.SIGTERM)
                assert await server.process.wait() == 0
    assert re.search(r"^t2 +waiting +WaitingUser +\S+ +\S+ +not watched ", listed, re.M), listed
    assert "silence not watched" in shown, shown
    assert viewed["task"]["silence_watched"] is False
