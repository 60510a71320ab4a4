"""``pi-runtime pi install`` when it cannot install, and ``doctor`` when Pi cannot run
(docs/design/operations.md O19).

No network is used: each run is a real ``python -m runtime._cli`` process whose ``PATH`` holds
only a directory the test made — with no ``npm`` at all, or an ``npm`` script that fails as
npm does when the registry refuses the connection, cannot be started, installs nothing, or
hangs as npm does on a registry that never answers. Every run is bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

from runtime._cli import EXIT_FAILED

LIMIT: Final = 30.0

FAILING_NPM: Final = """#!/bin/sh
echo "npm ERR! code ECONNREFUSED" >&2
echo "npm ERR! errno ECONNREFUSED" >&2
echo "npm ERR! request to https://ci:hunter2SECRET@registry.npmjs.org/node failed" >&2
exit 1
"""
"""What npm prints when the registry refuses the connection (several lines), then exit 1.
The registry URL carries a password, as an ``.npmrc`` with credentials in it may put there."""


def _pi_install(tmp_path: Path, npm: str | None, *extra: str) -> subprocess.CompletedProcess[str]:
    """``pi-runtime pi install --home …`` with a PATH holding only ``npm`` (if given)."""
    home = str(tmp_path / "pi")
    return _cli(tmp_path, npm, "pi", "install", "--home", home, *extra)


def _cli(tmp_path: Path, npm: str | None, *argv: str) -> subprocess.CompletedProcess[str]:
    """``pi-runtime ARGV`` with a PATH holding only ``npm`` (if given)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if npm is not None:
        script = bin_dir / "npm"
        script.write_text(npm)
        script.chmod(0o755)
    return subprocess.run(
        [sys.executable, "-m", "runtime._cli", *argv],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=False,
        stdin=subprocess.DEVNULL,
        env={"PATH": str(bin_dir), "HOME": str(tmp_path), "LANG": "C.UTF-8"},
    )


@pytest.mark.parametrize(
    ("npm", "says"),
    [
        (None, "npm is not on PATH"),
        (FAILING_NPM, "npm ERR! code ECONNREFUSED"),
        ("#!/bin/sh\nexit 7\n", "npm ci failed"),
    ],
    ids=["npm missing", "network refused", "a bare non-zero exit"],
)
def test_o19_a_pi_install_that_fails_says_pi_install_failed_in_one_line(
    tmp_path: Path, npm: str | None, says: str
) -> None:
    """O19: ``pi install`` with no npm, or an npm that fails (the registry refusing the
    connection, or a bare non-zero exit), is one line ``pi-runtime: pi_install_failed: …``
    that keeps npm's reason, exit status 1 as every refusal. Before, it printed
    ``pi-runtime: …`` with no reason code, and npm's several lines of standard error under it."""
    _assert_refused(_pi_install(tmp_path, npm), says)


def _assert_refused(result: subprocess.CompletedProcess[str], says: str) -> None:
    """One line ``pi-runtime: pi_install_failed: …`` holding ``says``, exit status 1."""
    assert (result.returncode, result.stdout) == (EXIT_FAILED, ""), result.stderr
    assert result.stderr.startswith("pi-runtime: pi_install_failed: "), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr


def test_o19_a_failed_pi_install_under_log_json_is_one_json_line_without_the_password(
    tmp_path: Path,
) -> None:
    """O19: with ``--log-json`` the refusal is one JSON line whose ``code`` is
    ``pi_install_failed``; a password in a URL npm quotes is hidden (``***``)."""
    result = _pi_install(tmp_path, FAILING_NPM, "--log-json")
    assert result.returncode == EXIT_FAILED, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    record = json.loads(lines[0])
    assert record["code"] == "pi_install_failed"
    assert "ECONNREFUSED" in record["message"]
    assert "hunter2SECRET" not in result.stderr


@pytest.mark.parametrize(
    ("npm", "says"),
    [
        ("#!/no/such/interpreter\n", "cannot start npm"),
        ("echo no interpreter line\n", "cannot start npm"),
        ("#!/bin/sh\nexit 0\n", "Pi's node is missing"),
    ],
    ids=["a missing interpreter", "not an executable format", "exit 0 installing nothing"],
)
def test_o19_an_npm_that_cannot_start_or_installs_no_node_is_pi_install_failed(
    tmp_path: Path, npm: str, says: str
) -> None:
    """O19: an ``npm`` on PATH that the system cannot start (its ``#!`` interpreter missing,
    no ``#!`` line at all), or an ``npm ci`` that exits 0 but leaves no Node, is an install
    failure: one line ``pi_install_failed``. Before, the ``OSError`` of starting npm, or of
    starting the missing ``node``, came out as ``io_failed``, as if the ``--home`` path had
    been refused."""
    _assert_refused(_pi_install(tmp_path, npm), says)


def test_o19_an_npm_that_hangs_is_stopped_with_its_children_at_the_timeout(
    tmp_path: Path,
) -> None:
    """O19: ``npm ci`` on a registry that never answers is stopped after ``--timeout``
    seconds — npm and what it started (here a ``sleep`` child) — and the command ends with
    ``pi_install_failed`` saying it timed out. Before, ``pi install`` waited for ever (the
    run hit this test's bound instead)."""
    pids = tmp_path / "npm.pids"
    sleep = shutil.which("sleep")
    assert sleep is not None
    npm = (
        f"#!/bin/sh\necho $$ >> {shlex.quote(str(pids))}\n"
        f"{shlex.quote(sleep)} 1000 &\necho $! >> {shlex.quote(str(pids))}\nwait\n"
    )
    result = _pi_install(tmp_path, npm, "--timeout", "3")
    _assert_refused(result, "npm ci did not finish within 3 s")
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 2, started  # npm and its child both ran
    assert all(_exits_within(pid, 10.0) for pid in started), started  # SIGKILL is sent


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "soon"])
def test_o19_a_pi_install_timeout_that_is_no_duration_is_usage_invalid(
    tmp_path: Path, timeout: str
) -> None:
    """O19: ``--timeout`` must be a positive, finite number of seconds (``usage_invalid``,
    exit status 2); npm is never started."""
    result = _pi_install(tmp_path, "#!/bin/sh\nexit 9\n", "--timeout", timeout)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("pi-runtime: usage_invalid: "), result.stderr


def test_o19_doctor_says_pi_cannot_run_with_a_reason_code(tmp_path: Path) -> None:
    """O19: ``doctor`` with no Pi installed prints its report, then ends with one line
    ``pi-runtime: pi_unavailable: …`` (a JSON line with ``--log-json``), exit status 1.
    Before, the last line was ``Pi cannot run here yet; …`` with no reason code."""
    result = _cli(tmp_path, None, "doctor", "--pi-home", str(tmp_path / "pi"))
    assert result.returncode == EXIT_FAILED, result.stderr
    assert "run `pi-runtime pi install`" in result.stdout
    assert result.stderr.startswith("pi-runtime: pi_unavailable: Pi cannot run"), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    (tmp_path / "again").mkdir()
    as_json = _cli(tmp_path / "again", None, "doctor", "--log-json", "--pi-home", str(tmp_path))
    lines = as_json.stderr.splitlines()
    assert len(lines) == 1, as_json.stderr
    assert json.loads(lines[0])["code"] == "pi_unavailable"


def _exits_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` has exited, or exits within ``seconds``: waits on the kernel's
    exit notification (a pidfd turns readable), not on a clock."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], seconds)[0])
    finally:
        os.close(fd)
