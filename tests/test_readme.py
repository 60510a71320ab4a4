"""The README's examples run as written (docs move with code)."""

from __future__ import annotations

import ast
import base64
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import trio

import runtime
from fake_pi.scenario import TINY_PNG
from runtime import load_config

REPO = Path(__file__).resolve().parents[1]

README = Path(__file__).resolve().parents[1] / "README.md"
PNG = base64.b64decode(TINY_PNG)
_EXAMPLE = re.compile(r"<!-- readme-example: (\S+) -->\n```[a-z]+\n(.*?)```", re.S)


def _examples() -> dict[str, str]:
    return dict(_EXAMPLE.findall(README.read_text()))


def test_readme_has_the_example_test() -> None:
    assert "test_example.py" in _examples()


def test_readme_example_test_passes(tmp_path: Path) -> None:
    """F8: the README's complete example test runs as written, with the plugin."""
    example = tmp_path / "test_example.py"
    example.write_text(_examples()["test_example.py"])
    # A temp root of its own: pytest's default one (shared with this run and any other on the
    # machine) would have the child delete older sessions' directories at its exit.
    basetemp = tmp_path / "basetemp"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, "--basetemp", str(basetemp), str(example)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def _run_example(tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    """Run the README's example ``name`` as a script, as written; it must exit 0."""
    example = tmp_path / name
    example.write_text(_examples()[name])
    result = subprocess.run(
        [sys.executable, str(example)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_readme_embedding_example_runs(tmp_path: Path) -> None:
    """L1/L5 as a newcomer sees them: the embedding example admits a message and prints its
    durable, acknowledged result."""
    result = _run_example(tmp_path, "embed.py")
    lines = result.stdout.splitlines()
    assert lines[0] == "started"
    assert lines[1].startswith("1 reply ")


def test_readme_task_example_runs(tmp_path: Path) -> None:
    """Task lanes through the library API, as a newcomer pastes them: the example submits a
    task on the embedded defaults, sees it held (the scripted model never calls a lifecycle
    tool), aborts it and prints the durable end; the README says what it prints."""
    result = _run_example(tmp_path, "task_example.py")
    lines = result.stdout.splitlines()
    assert lines == [
        "submitted t-1 new",
        "held no_terminal_after_completion_prompt:settled",
        "ended aborted demo over",
    ], result.stdout + result.stderr
    readme = " ".join(README.read_text().split())  # the prose wraps lines
    for line in lines:
        assert f"`{line}`" in readme, line


def _runtime_imports(source: str) -> list[str]:
    """Every name ``source`` imports from ``runtime`` or a module below it (dotted)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "runtime":
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "runtime"]
    return names


def test_readme_task_example_uses_only_the_public_api() -> None:
    """The task example imports only what ``runtime`` itself exports, never a private
    module: what the README shows is the library API."""
    imported = _runtime_imports(_examples()["task_example.py"])
    assert imported, "the task example imports nothing from runtime"
    public = getattr(runtime, "__all__", None)
    for dotted in imported:
        module, _, name = dotted.rpartition(".")
        assert module == "runtime", f"{dotted}: imported from a private module"
        assert not name.startswith("_"), dotted
        if public is not None:
            assert name in public, f"{name} is not in runtime.__all__"
        else:
            assert name in vars(runtime), f"runtime does not export {name}"


async def _serve_and_run_client(tmp_path: Path, *serve_args: str) -> list[str]:
    """``pi-runtime serve`` in ``tmp_path`` (``serve_args`` added), then the README's client,
    pasted as is; the lines it printed."""
    (tmp_path / "client.py").write_text(_examples()["client.py"])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            serve = [sys.executable, "-m", "runtime._cli", "serve", "--port", "0", *serve_args]
            run = functools.partial(
                trio.run_process, serve, cwd=tmp_path, env=env, stdout=subprocess.PIPE
            )
            process: trio.Process = await nursery.start(run)
            assert process.stdout is not None
            printed = b""
            while (found := re.search(rb"listening on (ws://\S+)", printed)) is None:
                data = await process.stdout.receive_some(4096)
                assert data, printed
                printed += data
            assert b"a new access token" in printed  # printed once, at the first start
            client = await trio.run_process(
                [sys.executable, "client.py"],
                cwd=tmp_path,
                env={**env, "PI_RUNTIME_URL": found.group(1).decode() + "/"},
                capture_stdout=True,
            )
            process.terminate()
    return client.stdout.decode().splitlines()


async def test_readme_quick_start_client_gets_a_reply(tmp_path: Path) -> None:
    """Issue #6 "done when": ``pi-runtime serve`` on its defaults (Fake-Pi, ./state), then the
    README's client, pasted as is, says hello and prints the reply."""
    lines = await _serve_and_run_client(tmp_path)
    assert lines[0] == "welcome"
    assert lines[1].startswith("reply ")
    assert "hello" in "\n".join(lines)  # the default model echoes the message
    assert not any(line.startswith(("saved", "lost")) for line in lines)  # no attachment


async def test_readme_picture_client_saves_the_reply_picture(tmp_path: Path) -> None:
    """Issue #20 "done when": with the README's ``picture.toml`` and its scenario, Fake-Pi
    draws a picture and attaches it; the README's client receives the reply with the picture,
    fetches it and saves it — the bytes the agent made."""
    for name in ("picture.toml", "picture-scenario.toml"):
        (tmp_path / name).write_text(_examples()[name])
    lines = await _serve_and_run_client(tmp_path, "--config", "picture.toml")
    assert lines == [
        "welcome",
        "reply Here is your picture",
        f"saved picture.png image/png {len(PNG)} bytes",
    ]
    assert (tmp_path / "picture.png").read_bytes() == PNG


def test_readme_configuration_example_loads(tmp_path: Path) -> None:
    """The README's TOML configuration is a valid configuration."""
    path = tmp_path / "pi-runtime.toml"
    path.write_text(_examples()["pi-runtime.toml"])
    config = load_config(path)
    assert (config.agent, config.model.api_key_env) == ("pi", "OPENAI_API_KEY")
    assert config.rooms is not None
    assert config.rooms["dm:42"].grants == frozenset({"send_text_update", "read"})


def test_the_several_hosts_demo_runs_as_the_readme_shows(tmp_path: Path) -> None:
    """The README's "Several hosts" demo (``scripts/several-hosts``, with this environment's
    Python): three hosts answer their rooms; a room of the SIGKILLed host is answered
    through another, which claimed its lane under a new epoch."""
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "_several_hosts.py"), str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for host in "abc":
        assert f"dm:{host} through host {host}: {{'accepted': 'started', 'outcome': 'reply'" in (
            "\n".join(lines)
        )
    last = lines[-1]
    assert last.startswith(
        "dm:a through host b: {'accepted': 'queued', 'outcome': 'reply', 'seq': 4}"
    )
    assert re.search(r"its lane now held by [bc] \(epoch 2\)$", last)
    shown = README.read_text()
    assert "scripts/several-hosts" in shown
