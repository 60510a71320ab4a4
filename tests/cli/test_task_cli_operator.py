"""The task commands an operator sends, through a running ``pi-runtime serve`` (an adversarial
review of the operator surfaces, ``docs/design/operations.md`` O14, O17): what the command
line sends is what the server takes, and a value it cannot send as given is refused with its
code before anything is sent. Real processes, as in ``test_task_cli.py`` (its helpers); every
wait is for a line a process prints or a server's long-poll answer, bounded by
``trio.fail_after``.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import trio

from fake_pi.scenario import Step
from runtime._cli import EXIT_OK, EXIT_USAGE, main

from .._workers import scripted_upstream
from ..task_harness import done, make_worktree, say
from .test_task_cli import LIMIT, cli, err, run_task, serve, until, write_config


@pytest.mark.trio
async def test_o14_task_run_with_a_validation_timeout_through_a_running_server(
    tmp_path: Path,
) -> None:
    """O14: ``task run --validation-timeout S`` through a running server is the task the
    standalone run would run: the server takes the bound, and a validation past it is
    killed, its receipt says so and the task is held from done. Before, the admin socket's
    ``task_run`` request had no ``validation_timeout`` field, and the command was refused
    ``admin_bad_request: task_run: Object contains unknown field `validation_timeout```
    whenever a server ran."""
    worktree = make_worktree(tmp_path)
    state = tmp_path / "state"
    slow = "sleep 120"
    steps: list[Step] = [done(), say("finished")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (_model, url):
            config = write_config(tmp_path, url)
            async with serve(tmp_path, config) as server:
                ran = await cli(
                    tmp_path,
                    *run_task(worktree, "tv", "--validate", slow, "--validation-timeout", "0.5"),
                )
                assert ran.returncode == EXIT_OK, err(ran)
                view = await until(
                    state,
                    "tv",
                    lambda v: v["hold_reason"] == "finalization_incomplete:validation",
                )
                validation = view["finalization"]["validation"]
                assert validation["exit_status"] < 0  # killed at its bound: never a pass
                assert "timed out after 0.5s" in validation["output_tail"]
                failed = await cli(tmp_path, "task", "fail", "tv", "--reason", "too slow")
                assert failed.returncode == EXIT_OK, err(failed)
                server.process.send_signal(signal.SIGTERM)
                assert await server.process.wait() == 0
    shown = json.loads((await cli(tmp_path, "task", "show", "tv", "--json")).stdout)
    assert shown["task"]["ended"]["state"] == "failed"


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
@pytest.mark.parametrize(
    ("option", "argv"),
    [
        ("--seconds", ["task", "grant", "t1", "--reason", "r"]),
        ("--validation-timeout", ["task", "run", "--worktree", "/w", "--prompt", "p"]),
    ],
)
def test_o17_seconds_that_json_cannot_carry_are_a_usage_error(
    value: str,
    option: str,
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """O17: ``task grant --seconds`` and ``task run --validation-timeout`` take a finite
    number. Before, ``inf`` and ``nan`` were parsed and sent as JSON ``null`` (the encoder's
    spelling of a number JSON has none for): a running server answered the grant
    ``admin_bad_request: … Expected `float`, got `null```, a value the operator never typed,
    and would have run the validation with its default bound instead of the one given."""
    monkeypatch.chdir(tmp_path)  # ./state, were the command to get that far
    code = main([*argv, f"{option}={value}"])
    out, stderr = capsys.readouterr()
    assert (code, out) == (EXIT_USAGE, "")
    assert stderr.startswith("pi-runtime: usage_invalid: "), stderr
    assert option in stderr
