"""Adversarial checks of the command line's configuration and start-up (docs/design/config.md,
operations.md): bad input — a setting, a flag, a configuration naming a state directory — gets
one line with its stable code and a non-zero exit, never a traceback, never another value
than the one typed, and never a secret.

Each test runs the real ``python -m runtime._cli`` process (bounded by a timeout), since what
is tested is what the process prints and how it exits. What ``tests/test_config.py`` and
``tests/cli/test_cli_errors.py`` already cover (types, unknown keys, NaN and infinity, the
bounds, a directory or FIFO as the file, usage errors) is not repeated here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import pytest

from runtime._cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE

LIMIT: Final = 60.0
SECRET: Final = "hunter2SECRET"


def cli(
    argv: Sequence[str], *, cwd: Path | None = None, timeout: float = LIMIT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime._cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )


def refused(done: subprocess.CompletedProcess[str], status: int, line: str) -> None:
    """``done`` ended with ``status`` and printed ``line`` on standard error, no traceback
    and no secret."""
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert SECRET not in done.stderr + done.stdout
    assert line in done.stderr, done.stderr


# --------------------------------------------------------------- the metrics listener's port


@pytest.mark.parametrize("port", ["²", "١٢٣"], ids=["superscript two", "arabic-indic 123"])
@pytest.mark.parametrize("given", ["flag", "file"])
def test_o11_m4_a_metrics_port_of_other_digits_is_config_invalid(
    tmp_path: Path, port: str, given: str
) -> None:
    """M4, O11: a ``metrics.listen`` port of characters Python calls digits but that are
    not ASCII is refused naming the setting. Before, ``"²"`` passed ``str.isdigit`` and
    ``int()`` raised: ``serve`` (and every command loading that file) died with a
    ``ValueError`` traceback; ``"١٢٣"`` was taken as port 123, a port the operator never
    typed."""
    listen = f"127.0.0.1:{port}"
    config = tmp_path / "pi-runtime.toml"
    argv = ["serve", "--port", "0", "--state-dir", str(tmp_path / "state")]
    if given == "flag":
        argv += ["--metrics", listen]
    else:
        config.write_text(f'[metrics]\nlisten = "{listen}"\n', encoding="utf-8")
        argv += ["--config", str(config)]
    refused(cli(argv), EXIT_USAGE, "pi-runtime: config_invalid: metrics.listen: ")
    assert not (tmp_path / "state").exists()  # refused before anything was created


def test_o11_m4_a_metrics_port_python_cannot_read_is_config_invalid_in_every_command(
    tmp_path: Path,
) -> None:
    """O11: the same file given to ``journal verify`` and ``journal compact`` is
    ``config_invalid`` (exit 1), not a ``ValueError`` traceback."""
    config = tmp_path / "pi-runtime.toml"
    config.write_text('[metrics]\nlisten = "127.0.0.1:²"\n', encoding="utf-8")
    for argv in (
        ["journal", "verify", "--state-dir", str(tmp_path / "state"), "--config", str(config)],
        ["journal", "compact", "--config", str(config)],
    ):
        refused(cli(argv), EXIT_FAILED, "pi-runtime: config_invalid: metrics.listen: ")


# ------------------------------------------------------------------------ the model's URL


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_o11_c3_serve_refuses_a_base_url_whose_port_is_no_port(tmp_path: Path, port: str) -> None:
    """C3: ``model.base_url`` with a port out of range is refused at start naming the
    setting. Before, it was taken and ``serve`` ran: every later reader of the URL (the
    route fingerprint of each admission, ``route_endpoint``) raises ``ValueError: Port out
    of range`` on it — the first delivery, not the start, would have met the fault."""
    config = tmp_path / "pi-runtime.toml"
    config.write_text(f'[model]\nbase_url = "https://llm.example:{port}/v1"\n', encoding="utf-8")
    argv = ["serve", "--port", "0", "--state-dir", str(tmp_path / "state"), "--config"]
    refused(cli([*argv, str(config)]), EXIT_USAGE, "pi-runtime: config_invalid: model.base_url: ")


# ----------------------------------------------------------------------- secrets stay out


@pytest.mark.parametrize(
    "toml",
    [
        f'[model]\napi_key_env = "sk-{SECRET}"\n',
        f'[model]\nbase_url = "https://user:{SECRET}@llm.example/v1"\n',
        f'[model]\nbase_url = "https://llm.example/v1?api_key={SECRET}"\n',
        f'[store]\nurl = "postgresql://u:{SECRET}@db.example/x"\n',
        f"[store]\nurl = \"host=db.example password='{SECRET} x'\"\n",
    ],
    ids=["api_key_env", "base_url user", "base_url query", "store url", "store pair"],
)
@pytest.mark.parametrize("log_json", [False, True], ids=["plain", "json"])
def test_c4_o11_a_secret_in_the_file_is_refused_without_being_shown(
    tmp_path: Path, toml: str, log_json: bool
) -> None:
    """C4, O11: a configuration holding a key or a password is refused at start by the real
    process, plain or ``--log-json``, and neither standard error nor standard output carries
    it; nothing is created in the state directory."""
    config = tmp_path / "pi-runtime.toml"
    config.write_text(toml, encoding="utf-8")
    argv = ["--log-json"] if log_json else []
    argv += ["serve", "--port", "0", "--state-dir", str(tmp_path / "state")]
    refused(cli([*argv, "--config", str(config)]), EXIT_USAGE, "config_invalid")
    assert not (tmp_path / "state").exists()


# -------------------------------------------------- the state directory a --config names


def test_o13_tasks_and_task_show_read_the_state_directory_their_config_names(
    tmp_path: Path,
) -> None:
    """O13: with ``--config`` and no ``--state-dir``, ``tasks`` and ``task show`` read the
    configuration's ``state_dir`` — the one ``serve --config`` runs on — not ``./state``.
    Before, they read ``./state`` of wherever they were started."""
    config = tmp_path / "pi-runtime.toml"
    config.write_text('state_dir = "elsewhere/state"\nwork_root = "work"\n', encoding="utf-8")
    here = tmp_path / "here"
    here.mkdir()
    named = str(tmp_path / "elsewhere" / "state")
    for argv in (["tasks"], ["task", "show", "t1"]):
        done = cli([*argv, "--config", str(config)], cwd=here)
        refused(done, EXIT_FAILED, "pi-runtime: state_dir_invalid: ")
        assert named in done.stderr, done.stderr
    assert not (here / "state").exists()


@contextlib.contextmanager
def _bounded(process: subprocess.Popen[str], seconds: float) -> Iterator[None]:
    """Kill ``process`` if the block has not ended within ``seconds`` (a read of its output
    then ends, and the block's assertion says what it saw)."""
    timer = threading.Timer(seconds, process.kill)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """``serve --config F`` on the state directory ``F`` names; ``(F, that directory)``;
    stopped (SIGTERM, then the drain of 0 s) at the end."""
    config = tmp_path / "pi-runtime.toml"
    config.write_text(
        'state_dir = "served/state"\nwork_root = "served/work"\n'
        "[thresholds]\ndrain_timeout_seconds = 0\n",
        encoding="utf-8",
    )
    state = tmp_path / "served" / "state"
    server = subprocess.Popen(
        [sys.executable, "-m", "runtime._cli", "serve", "--port", "0", "--config", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        seen = ""
        with _bounded(server, LIMIT):  # its admin socket is up before it says it listens
            while "listening on" not in seen:
                line = server.stdout.readline()
                assert line, f"serve ended before it listened: {seen}"
                seen += line
        yield config, state
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.communicate(timeout=LIMIT)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


def test_o13_o14_task_run_with_a_config_reaches_the_server_that_config_runs(
    tmp_path: Path, serving: tuple[Path, Path]
) -> None:
    """O13, O14: ``task run --config F`` (no ``--state-dir``) submits to the server ``serve
    --config F`` runs. Before, it asked ``./state``'s admin socket, found none, and ran the
    task standalone in a new ``./state`` of the working directory — a second owner of the
    configuration's work root, and a task the server never saw."""
    config, state = serving
    here = tmp_path / "here"
    (here / "tree").mkdir(parents=True)
    done = cli(
        ["task", "run", "--config", str(config), "--worktree", "tree", "--prompt", "p"],
        cwd=here,
    )
    assert done.returncode == EXIT_OK, done.stderr
    assert "started on the server" in done.stdout, done.stdout
    assert not (here / "state").exists()
    assert any((state / "lanes").iterdir())  # the server's state directory holds its lane
