"""How the ``pi-runtime`` command line fails: usage errors with a stable code and no secret
in them (docs/design/operations.md O17), a configuration file that is not one it can read
(O11, config.md C14), a JSON log line whose text is not UTF-8 (L1), the unsafe time scale 0
(O15).

Commands run in-process through ``main(argv)`` and, where what a user sees is the point, as a
real ``python -m runtime._cli`` process (every run bounded by a timeout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import pytest

from runtime._cli import EXIT_FAILED, EXIT_USAGE, main

LIMIT: Final = 30.0
SECRET: Final = "hunter2SECRET"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def json_lines(err: str) -> list[dict[str, Any]]:
    """Standard error as JSON lines; fails on any line that is not one."""
    return [json.loads(line) for line in err.splitlines()]


def cli(
    argv: Sequence[str] | Sequence[bytes], *, timeout: float = LIMIT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime._cli", *argv],
        capture_output=True,
        text=True,
        errors="surrogateescape",
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


# ------------------------------------------------------------------------- usage errors

USAGE_ERRORS: Final = {
    "unknown option": ["serve", "--bogus"],
    "missing argument": ["serve", "--port"],
    "bad int": ["serve", "--port", "abc"],
    "bad float": ["serve", "--drain-timeout", "soon"],
    "invalid choice": ["serve", "--agent", "gpt"],
    "unknown command": ["bogus"],
    "unknown subcommand": ["journal", "nope"],
    "missing required option": ["task", "run", "--prompt", "p"],
    "missing positional": ["cancel"],
    "extra positional": ["status", "extra"],
}


@pytest.mark.parametrize("argv", USAGE_ERRORS.values(), ids=USAGE_ERRORS.keys())
def test_o17_a_usage_error_is_one_line_with_its_code_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """O17: argparse's own refusal (its usage block, ``prog: error: …``, no code) is replaced
    by the shape every other error has: one line ``pi-runtime: usage_invalid: …`` that says
    where help is; exit status 2 as before."""
    code, out, err = run(argv, capsys)
    assert (code, out) == (EXIT_USAGE, "")
    assert err.startswith("pi-runtime: usage_invalid: pi-runtime"), err
    assert err.count("\n") == 1, err
    assert "--help" in err


@pytest.mark.parametrize("argv", USAGE_ERRORS.values(), ids=USAGE_ERRORS.keys())
@pytest.mark.parametrize("where", ["first", "last"])
def test_o17_a_usage_error_under_log_json_is_one_json_line(
    argv: list[str], where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """O17: with ``--log-json`` anywhere on the line (even after the argument that fails the
    parse, so it was never parsed) the refusal is one JSON object with its ``code``, like
    every other error of the command line."""
    given = ["--log-json", *argv] if where == "first" else [*argv, "--log-json"]
    code, out, err = run(given, capsys)
    assert (code, out) == (EXIT_USAGE, "")
    (line,) = json_lines(err)
    assert (line["code"], line["level"], line["event"]) == ("usage_invalid", "error", "command")
    assert line["message"].startswith("pi-runtime")


@pytest.mark.parametrize("argv", [["token"], ["journal"], ["task"], []])
def test_o17_a_group_without_its_subcommand_says_so_with_the_code(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """O17: a group alone still prints its help (plain text), then the coded line; under
    ``--log-json`` only the coded line (standard error stays JSON lines)."""
    code, out, err = run(argv, capsys)
    assert (code, out) == (EXIT_USAGE, "")
    assert err.startswith("usage: pi-runtime")
    assert err.splitlines()[-1].startswith("pi-runtime: usage_invalid: ")
    code, out, err = run([*argv, "--log-json"], capsys)
    assert (code, out) == (EXIT_USAGE, "")
    (line,) = json_lines(err)
    assert line["code"] == "usage_invalid"


SECRET_ARGUMENTS: Final = {
    "url, unrecognized": ["serve", "--bogus", f"postgresql://ann:{SECRET}@db.example/x"],
    "url, extra positional": ["status", f"postgres://ann:{SECRET}@db.example:5433/x"],
    "url, no user": ["serve", f"--port=postgresql://:{SECRET}@db.example"],
    "url, @ in the password": ["status", f"postgresql://ann:a@{SECRET}@db.example/x"],
    "url query": ["db", "migrate", "a", f"postgresql://db.example/x?password={SECRET}&a=b"],
    "key=value, invalid choice": ["serve", "--agent", f"host=db.example password={SECRET}"],
    "key=value, bad int": ["task", "grant", "t", "--reason", "r", "--epochs", f"password={SECRET}"],
    "key=value quoted": ["cancel", "d1", f"host=db sslpassword='a {SECRET} b' dbname=x"],
    "key = value": ["serve", "--port", f"host=db password = {SECRET}"],
    "environment style": ["status", f"PGPASSWORD={SECRET}"],
    "ambiguous abbreviation": ["status", f"--st=postgresql://ann:{SECRET}@db.example/x"],
}


@pytest.mark.parametrize("argv", SECRET_ARGUMENTS.values(), ids=SECRET_ARGUMENTS.keys())
@pytest.mark.parametrize("log_json", [[], ["--log-json"]])
def test_o17_a_usage_error_never_echoes_a_password(
    argv: list[str], log_json: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """O17: argparse quotes the offending arguments; a DSN among them (a URL's ``user:pw@``,
    a ``password=`` pair, quoted or not) is shown with its password replaced by ``***``,
    never the password itself, plain or JSON."""
    code, out, err = run([*log_json, *argv], capsys)
    assert code == EXIT_USAGE
    assert SECRET not in out + err
    assert "***" in err, err
    assert "usage_invalid" in err


def test_o17_as_a_real_process_the_password_stays_off_standard_error() -> None:
    """O17, end to end: what a shell shows for a mistyped flag beside a DSN with a password."""
    done = cli(["serve", "--store", f"postgresql://u:{SECRET}@db.example/x", "--bogus", "x"])
    assert done.returncode == EXIT_USAGE
    assert done.stderr.startswith("pi-runtime: usage_invalid: "), done.stderr
    assert SECRET not in done.stdout + done.stderr
    done = cli(["--log-json", "serve", "--bogus", f"host=db password={SECRET}"])
    assert done.returncode == EXIT_USAGE
    assert SECRET not in done.stdout + done.stderr
    (line,) = json_lines(done.stderr)
    assert line["code"] == "usage_invalid"
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--host", f"postgresql://ann:{SECRET}@db.example/x"],
        ["serve", "--metrics", f"host=db.example password={SECRET}"],
        ["serve", "--metrics", f"host=db.example password='a {SECRET}'"],
        ["serve", "--host", f"postgresql://ann:a {SECRET}@db.example/x"],
    ],
    ids=["url as --host", "key=value as --metrics", "quoted", "a space in the password"],
)
@pytest.mark.parametrize("log_json", [[], ["--log-json"]])
def test_o17_a_refusal_that_quotes_an_argument_hides_its_password(
    argv: list[str], log_json: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """O17: a DSN given to the wrong option is quoted by the refusal of that option's value
    (``config_invalid: host: … is not a loopback address``); every line the command writes
    as its own hides the password in it, whatever the error: before, it was printed."""
    state = ["--state-dir", str(tmp_path / "state")]
    code, out, err = run([*log_json, *argv, *state], capsys)
    assert code == EXIT_USAGE
    assert SECRET not in out + err
    assert "config_invalid" in err
    assert "***" in err


# ------------------------------------------------------------ the configuration file


def test_o11_c14_serve_refuses_a_fifo_as_its_configuration_instead_of_waiting(
    tmp_path: Path,
) -> None:
    """C14: a FIFO given as ``--config`` is refused at once, naming the file: before, opening
    it waited for a writer forever and ``serve`` never started nor said why."""
    fifo = tmp_path / "pi-runtime.toml"
    os.mkfifo(fifo)
    done = cli(["serve", "--config", str(fifo), "--port", "0"], timeout=LIMIT / 2)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert f"pi-runtime: config_invalid: {fifo}: " in done.stderr
    assert "not a regular file" in done.stderr


@pytest.mark.parametrize(
    "content",
    [b'state_dir = "st\xffate"\n', b"a = " + b"[" * 20_000 + b"]" * 20_000 + b"\n"],
    ids=["not UTF-8", "nested past the recursion limit"],
)
def test_o11_c14_serve_refuses_an_unreadable_configuration_without_a_traceback(
    tmp_path: Path, content: bytes
) -> None:
    """C14: a configuration that is not UTF-8, or whose arrays nest deeper than the parser
    recurses, is ``config_invalid`` naming the file, exit 2: before, ``serve`` died with a
    ``UnicodeDecodeError`` / ``RecursionError`` traceback."""
    config = tmp_path / "pi-runtime.toml"
    config.write_bytes(content)
    done = cli(["serve", "--config", str(config), "--port", "0"])
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "Traceback" not in done.stderr
    assert f"pi-runtime: config_invalid: {config}: " in done.stderr


# ----------------------------------------------------------------- JSON lines, any text


def test_l1_a_json_line_whose_text_is_not_utf8_is_still_written() -> None:
    """L1: a state directory named by bytes that are not UTF-8 reaches the message as lone
    surrogates; the JSON line escapes them (``\\udcff``) instead of failing to encode: before,
    ``--log-json`` lost the refusal and printed a ``--- Logging error ---`` traceback."""
    done = cli([b"--log-json", b"status", b"--state-dir", b"/nonexistent/st\xffate"])
    assert done.returncode == EXIT_FAILED
    assert "Logging error" not in done.stderr
    (line,) = json_lines(done.stderr)
    assert line["code"] == "state_dir_invalid"
    assert "st\\udcffate" in line["message"]


# ------------------------------------------------------------------- the unsafe time scale


def test_o15_an_unsafe_test_timescale_of_0_is_refused_not_taken_for_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """O15: ``--unsafe-test-timescale 0`` is below 1 and refused ``unsafe_test_timescale``
    like any other: before, ``serve`` and ``task run`` read 0 as "not given" and ran at
    scale 1 without a word (``serve`` served on)."""
    state = tmp_path / "state"
    argv = ["serve", "--port", "0", "--state-dir", str(state), "--unsafe-test-timescale", "0"]
    done = cli(argv, timeout=LIMIT / 2)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "pi-runtime: watchdog_config_invalid: unsafe_test_timescale: " in done.stderr
    worktree = tmp_path / "wt"
    worktree.mkdir()
    argv = ["task", "run", "--worktree", str(worktree), "--prompt", "p"]
    code, _, err = run([*argv, "--state-dir", str(state), "--unsafe-test-timescale", "0"], capsys)
    assert code == EXIT_FAILED
    assert "pi-runtime: watchdog_config_invalid: unsafe_test_timescale: " in err
    assert not (state / "lanes").exists()


# --------------------------------------------------------------- what the system refused


@pytest.mark.parametrize("log_json", [False, True])
def test_o18_a_file_operation_the_system_refuses_has_its_code(
    log_json: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """O18: an operation on a path the user gave that the system refuses (here a state
    directory under a file: ``ENOTDIR``) ends with one line carrying the stable code
    ``io_failed`` and the system's reason, exit status 1 — as every other refusal of the
    command line. Before, the line had no code (``pi-runtime: [Errno 20] …``)."""
    (tmp_path / "file").write_text("not a directory")
    argv = ["token", "rotate", "--state-dir", str(tmp_path / "file" / "state")]
    code, out, err = run(["--log-json", *argv] if log_json else argv, capsys)
    assert (code, out) == (EXIT_FAILED, "")
    if log_json:
        (line,) = json_lines(err)
        assert line["code"] == "io_failed"
        assert "Not a directory" in line["message"]
    else:
        assert err.startswith("pi-runtime: io_failed: "), err
        assert "Not a directory" in err
        assert err.count("\n") == 1, err
