"""``pi-runtime pi install`` when it cannot install (docs/design/operations.md O19).

No network is used: each run is a real ``python -m runtime._cli`` process whose ``PATH`` holds
only a directory the test made — with no ``npm`` at all, or an ``npm`` script that fails as
npm does when the registry refuses the connection. Every run is bounded by a timeout.
"""

from __future__ import annotations

import json
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
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if npm is not None:
        script = bin_dir / "npm"
        script.write_text(npm)
        script.chmod(0o755)
    home = str(tmp_path / "pi")
    return subprocess.run(
        [sys.executable, "-m", "runtime._cli", "pi", "install", "--home", home, *extra],
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
    result = _pi_install(tmp_path, npm)
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
