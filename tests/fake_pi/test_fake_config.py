"""``python -m fake_pi --fake-config FILE`` with a FILE it cannot use (docs/design/fake-pi.md F13).

Each case is a real Fake-Pi process, its stdin at end of file, bounded by a timeout: what a
test author sees on standard error is the point.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final

import pytest

from fake_pi._retry import RetrySettings

LIMIT: Final = 20.0
"""Bound on one Fake-Pi process (a FIFO opened the blocking way would wait for ever)."""


def _write(name: str, data: bytes) -> Callable[[Path], Path]:
    def make(directory: Path) -> Path:
        path = directory / name
        path.write_bytes(data)
        return path

    return make


def _fifo(directory: Path) -> Path:
    path = directory / "fake-config.json"
    os.mkfifo(path)
    return path


def _directory(directory: Path) -> Path:
    path = directory / "fake-config.json"
    path.mkdir()
    return path


BAD_FILES: Final[dict[str, Callable[[Path], Path]]] = {
    "missing": lambda directory: directory / "no-such-config.json",
    "fifo": _fifo,
    "directory": _directory,
    "json not utf-8": _write("fake-config.json", b'{"record": "\xff\xfe"}'),
    "toml not utf-8": _write("fake-config.toml", b'record = "\xff\xfe"\n'),
    "not json": _write("fake-config.json", b'{"directives": tru'),
    "not toml": _write("fake-config.toml", b"directives = [\n"),
    "an array": _write("fake-config.json", b"[]"),
    "an unknown key": _write("fake-config.json", json.dumps({"behavior": {}}).encode()),
    "a barrier that does not exist": _write(
        "fake-config.json", json.dumps({"behaviours": {"at": {"explode": "kill"}}}).encode()
    ),
    "a field of the wrong type": _write("fake-config.toml", b'directives = "yes"\n'),
}


def _fake_pi(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fake_pi", "--mode", "rpc", "--no-session", *argv],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=LIMIT,
        check=False,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env=env,
    )


def _refused(tmp_path: Path, path: Path, how: str) -> str:
    """Run Fake-Pi with ``path`` given by ``how``; its one-line refusal."""
    work = tmp_path / "work"
    work.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "PI_CODING_AGENT_DIR": str(tmp_path / "agent"),
        "LANG": "C.UTF-8",
    }
    if how == "$FAKE_PI_CONFIG":
        argv, env["FAKE_PI_CONFIG"] = [], str(path)
    else:
        argv = ["--fake-config", str(path)]
    try:
        result = _fake_pi(argv, env, work)
    finally:
        with contextlib.suppress(OSError):  # an old blocking open still waits: give it EOF
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"fake-pi: cannot load {how} {path}: "), result.stderr
    return result.stderr


@pytest.mark.parametrize("make", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_f13_a_fake_config_it_cannot_use_is_one_line_and_exit_2(
    tmp_path: Path, make: Callable[[Path], Path]
) -> None:
    """F13: a ``--fake-config`` that is missing, not a regular file (a FIFO, a directory), not
    UTF-8, not JSON/TOML or not of the configuration's shape ends Fake-Pi before it reads a
    command, with exit status 2 and one line on standard error,
    ``fake-pi: cannot load --fake-config FILE: <why>``, as its ``--mode`` refusal. Before,
    each ended in a Python traceback and exit status 1. The FIFO is opened without waiting."""
    _refused(tmp_path, make(tmp_path), "--fake-config")


def test_f13_fake_pi_config_from_the_environment_is_refused_the_same_way(tmp_path: Path) -> None:
    """F13: ``$FAKE_PI_CONFIG`` naming a file that is not UTF-8 is the same refusal, naming
    the variable."""
    path = _write("fake-config.json", b'{"record": "\xff"}')(tmp_path)
    assert "not UTF-8 text (byte 12)" in _refused(tmp_path, path, "$FAKE_PI_CONFIG")


def test_f13_a_good_fake_config_still_loads(tmp_path: Path) -> None:
    """F13's other side: a configuration it can use is taken (its recording file is made)."""
    record = tmp_path / "record.jsonl"
    config = tmp_path / "fake-config.toml"
    config.write_text(f'directives = true\nrecord = "{record}"\n')
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    env["PI_CODING_AGENT_DIR"] = str(tmp_path / "agent")
    result = _fake_pi(["--fake-config", str(config)], env, tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert json.loads(record.read_text().splitlines()[0])["kind"] == "launch"


def _agent_fifo(directory: Path, name: str) -> None:
    os.mkfifo(directory / name)


def _agent_file(data: bytes) -> Callable[[Path, str], None]:
    def make(directory: Path, name: str) -> None:
        (directory / name).write_bytes(data)

    return make


BAD_AGENT_FILES: Final[dict[str, Callable[[Path, str], None]]] = {
    "not json": _agent_file(b'{"providers": {'),
    "not utf-8": _agent_file(b'{"providers": {"\xff": {}}}'),
    "fifo": _agent_fifo,
    "directory": lambda directory, name: (directory / name).mkdir(),
}


@pytest.mark.parametrize("name", ["models.json", "settings.json"])
@pytest.mark.parametrize("make", BAD_AGENT_FILES.values(), ids=BAD_AGENT_FILES.keys())
def test_f13_an_agent_directory_file_it_cannot_read_is_one_line_and_exit_2(
    tmp_path: Path, make: Callable[[Path, str], None], name: str
) -> None:
    """F13: ``models.json`` or ``settings.json`` in ``$PI_CODING_AGENT_DIR`` that is not JSON,
    not UTF-8, a FIFO (opened without waiting) or a directory ends Fake-Pi before it reads a
    command: exit status 2 and one line ``fake-pi: cannot load FILE: <why>``. Before, each
    ended in a traceback (exit status 1), and a FIFO kept Fake-Pi waiting for a writer."""
    agent = tmp_path / "agent"
    agent.mkdir()
    make(agent, name)
    path = agent / name
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    env["PI_CODING_AGENT_DIR"] = str(agent)
    try:
        result = _fake_pi([], env, tmp_path)
    finally:
        with contextlib.suppress(OSError):  # an old blocking open still waits: give it EOF
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"fake-pi: cannot load {path}: "), result.stderr


WRONG_SHAPE_MODELS: Final[dict[str, tuple[object, str]]] = {
    "providers a list": ({"providers": []}, "`$.providers`"),
    "a provider a list": ({"providers": {"fake": []}}, "`$.providers[...]`"),
    "a model without an id": (
        {"providers": {"fake": {"models": [{"name": "x"}]}}},
        "`$.providers[...].models[0]`",
    ),
    "a context window in words": (
        {"providers": {"fake": {"models": [{"id": "fake-model", "contextWindow": "big"}]}}},
        "`$.providers[...].models[0].contextWindow`",
    ),
    "a base url a number": ({"providers": {"fake": {"baseUrl": 8080}}}, "baseUrl"),
}


@pytest.mark.parametrize(
    ("document", "where"), WRONG_SHAPE_MODELS.values(), ids=WRONG_SHAPE_MODELS.keys()
)
def test_f13_a_models_json_of_the_wrong_shape_is_one_line_and_exit_2(
    tmp_path: Path, document: object, where: str
) -> None:
    """F13: a ``models.json`` that is JSON but not of Pi's shape (``providers`` not an object,
    a provider that is not one, a model without an ``id``, a number that is not one) ends
    Fake-Pi before it reads a command, one line naming the file and where. Before, each was a
    Python traceback (``AttributeError``, ``ValueError``) and exit status 1."""
    agent = tmp_path / "agent"
    agent.mkdir()
    path = agent / "models.json"
    path.write_text(json.dumps(document))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    env["PI_CODING_AGENT_DIR"] = str(agent)
    result = _fake_pi([], env, tmp_path)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"fake-pi: cannot load {path}: "), result.stderr
    assert where in result.stderr, result.stderr


def test_f13_retry_settings_of_the_wrong_type_are_ignored_not_a_traceback(
    tmp_path: Path,
) -> None:
    """F13's settings side: ``settings.json`` whose ``retry`` is not an object, or whose
    ``maxRetries`` is not a count, keeps the defaults (as its ``compaction`` settings always
    did) and Fake-Pi starts. Before, ``"retry": 5`` or ``"maxRetries": "x"`` was a traceback
    at start; a good value is still taken."""
    agent = tmp_path / "agent"
    agent.mkdir()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    env["PI_CODING_AGENT_DIR"] = str(agent)
    for settings in ({"retry": 5}, {"retry": {"maxRetries": "x", "enabled": "no"}}):
        (agent / "settings.json").write_text(json.dumps(settings))
        result = _fake_pi([], env, tmp_path)
        assert (result.returncode, result.stdout, result.stderr) == (0, "", ""), settings
    assert RetrySettings.from_settings({"retry": {"maxRetries": "x"}}) == RetrySettings()
    assert RetrySettings.from_settings({"retry": {"maxRetries": 1, "baseDelayMs": 5}}) == (
        RetrySettings(max_retries=1, base_delay_ms=5)
    )


def _record_in_a_missing_directory(directory: Path) -> Path:
    return directory / "no-such-directory" / "record.jsonl"


def _record_a_directory(directory: Path) -> Path:
    path = directory / "record.jsonl"
    path.mkdir()
    return path


def _record_a_fifo(directory: Path) -> Path:
    path = directory / "record.jsonl"
    os.mkfifo(path)
    return path


BAD_RECORDS: Final[dict[str, Callable[[Path], Path]]] = {
    "in a missing directory": _record_in_a_missing_directory,
    "a directory": _record_a_directory,
    "a fifo with no reader": _record_a_fifo,
}


@pytest.mark.parametrize("make", BAD_RECORDS.values(), ids=BAD_RECORDS.keys())
def test_f13_a_record_file_it_cannot_open_is_one_line_and_exit_2(
    tmp_path: Path, make: Callable[[Path], Path]
) -> None:
    """F13: the configuration's ``record`` naming a file Fake-Pi cannot open for appending (in
    a directory that does not exist, a directory, a FIFO nobody reads: opened without
    waiting) ends Fake-Pi before it reads a command: exit status 2 and one line
    ``fake-pi: cannot open --fake-config's record FILE: <why>``. Before, a traceback (exit
    status 1), and a FIFO kept it waiting for a reader."""
    record = make(tmp_path)
    config = tmp_path / "fake-config.json"
    config.write_text(json.dumps({"record": str(record)}))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    env["PI_CODING_AGENT_DIR"] = str(tmp_path / "agent")
    try:
        result = _fake_pi(["--fake-config", str(config)], env, tmp_path)
    finally:
        with contextlib.suppress(OSError):  # an old blocking open still waits: read it
            os.close(os.open(record, os.O_RDONLY | os.O_NONBLOCK))
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    prefix = f"fake-pi: cannot open --fake-config's record {record}: "
    assert result.stderr.startswith(prefix), result.stderr
