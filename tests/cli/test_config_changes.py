"""A restart with a changed configuration (docs/design/config.md C3, C16): the real
``pi-runtime serve`` process, stopped by SIGKILL with a delivery pending, started again with
another ``work_root``, or on PostgreSQL (``--store``, a throw-away database from
``tests/journal/pg_fixtures.py``), must refuse to strand that delivery — one line with its
code and what to do, exit 2 — and a ``model.base_url`` with a control character is refused at
start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest
import trio

from fake_pi.scenario import Step, Text
from runtime._cli import EXIT_OK, EXIT_USAGE
from runtime._config import config_from_dict
from runtime._errors import ConfigError

from .._procs import no_worker_left_by_hosts
from .._wire import message
from .._workers import scripted_upstream
from ..journal.pg_fixtures import pg_dsn, pg_server
from ..server.test_serve_e2e import LIMIT, REPO, serve

__all__ = ["no_worker_left_by_hosts", "pg_dsn", "pg_server"]  # the fixtures used here

pytestmark = pytest.mark.usefixtures("no_worker_left_by_hosts")

REFUSED: Final = 60.0
"""The bound on a start that must be refused (a start that is not runs until killed)."""


def write_config(root: Path, url: str, *, work: str = "work", name: str = "config.toml") -> Path:
    path = root / name
    path.write_text(f'state_dir = "state"\nwork_root = "{work}"\n\n[model]\nbase_url = "{url}"\n')
    return path


async def cli(root: Path, *argv: str) -> subprocess.CompletedProcess[bytes]:
    """``pi-runtime ARGV`` run to its end in ``root`` (bounded: a start that is not refused
    fails the test when the bound ends it)."""
    with trio.fail_after(REFUSED):
        return await trio.run_process(
            [sys.executable, "-m", "runtime._cli", *argv],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            stdin=subprocess.DEVNULL,
            cwd=str(root),
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )


def refused(done: subprocess.CompletedProcess[bytes], line: str) -> str:
    """``done`` was refused (exit 2) with ``line`` on standard error, never listening."""
    stderr = done.stderr.decode()
    assert done.returncode == EXIT_USAGE, stderr
    assert "Traceback" not in stderr, stderr
    assert line in stderr, stderr
    assert b"listening on" not in done.stdout
    return stderr


class NeverFirst:
    """``on_request`` for :func:`scripted_upstream`: the first model request is held until
    the server that sent it is killed (its connection then goes); the others are answered."""

    def __init__(self) -> None:
        self.arrived = trio.Event()
        self.requests = 0
        """Model requests that arrived (held or answered)."""

    async def __call__(self, n: int) -> None:
        self.requests = n
        if n == 1:
            self.arrived.set()
            await trio.sleep_forever()


async def pending_d1(root: Path, config: Path, held: NeverFirst) -> None:
    """d1 admitted and its turn begun (its model request open, ``held``) when the server is
    SIGKILLed: pending in the state directory's file store."""
    async with serve(root, config) as server, server.connect() as client:
        await client.send(message("d1"))
        await client.until(lambda f: f["type"] == "accepted")
        await held.arrived.wait()
        await server.kill()


async def test_c16_a_changed_work_root_is_refused_while_a_delivery_admitted_before_is_pending(
    tmp_path: Path,
) -> None:
    """C16: d1 was admitted (and its turn begun) with ``work_root = "work"``; the server
    died. Started with ``work_root = "moved"``, ``serve`` refuses ``work_root_changed``
    naming both directories and d1 — its turn replays in its room's directory below the old
    root (G1), not below the new one — and creates nothing there. Started with the old root
    it answers d1; with d1 finished, the new root is taken (d2 runs below it). Before, the
    start was taken and d1 was replayed in another working directory, silently."""
    steps: list[Step] = [Text(text="answered where it began"), Text(text="d2, moved")]
    with trio.fail_after(LIMIT):
        held = NeverFirst()
        async with scripted_upstream(steps, on_request=held) as (_, url):
            config = write_config(tmp_path, url)
            await pending_d1(tmp_path, config, held)
            moved = write_config(tmp_path, url, work="moved", name="moved.toml")
            stderr = refused(
                await cli(tmp_path, "serve", "--port", "0", "--config", str(moved)),
                "pi-runtime: work_root_changed: work_root: ",
            )
            assert "'d1'" in stderr
            assert f"work_root was {tmp_path / 'work'}" in stderr
            assert str(tmp_path / "moved") in stderr
            assert not (tmp_path / "moved").exists()
            async with serve(tmp_path, config) as server, server.connect() as client:
                answered = await client.result("d1")
                await client.send({"type": "ack", "seq": answered["seq"]})
                await client.send({"type": "status"})
                await client.until(lambda f: f["type"] == "status")
            async with serve(tmp_path, moved) as server, server.connect() as client:
                await client.send(message("d2"))
                second = await client.result("d2")
    assert (answered["outcome"], answered["text"]) == ("reply", "answered where it began")
    assert (second["outcome"], second["text"]) == ("reply", "d2, moved")
    assert [p.parent.name for p in (tmp_path / "moved").glob("rooms/*")] == ["rooms"]


async def test_c16_a_pending_delivery_cancelled_with_no_server_lets_the_new_work_root_start(
    tmp_path: Path,
) -> None:
    """C16: the refusal's other way out: ``pi-runtime cancel d1`` with no server records the
    cancel; ``serve`` with the new ``work_root`` then starts (d1 is not counted) and ends d1
    ``cancelled`` before anything runs — no turn in the new directory."""
    steps: list[Step] = [Text(text="never given")]
    with trio.fail_after(LIMIT):
        held = NeverFirst()
        async with scripted_upstream(steps, on_request=held) as (_, url):
            config = write_config(tmp_path, url)
            await pending_d1(tmp_path, config, held)
            moved = write_config(tmp_path, url, work="moved", name="moved.toml")
            argv = ("serve", "--port", "0", "--config", str(moved))
            refused(await cli(tmp_path, *argv), "pi-runtime: work_root_changed: ")
            cancel = await cli(tmp_path, "cancel", "d1", "--state-dir", str(tmp_path / "state"))
            assert cancel.returncode == EXIT_OK, cancel.stderr.decode()
            async with serve(tmp_path, moved) as server, server.connect() as client:
                ended = await client.result("d1")
    assert ended["outcome"] == "cancelled"
    assert held.requests == 1  # d1's only request was the first life's: no turn ran again


async def test_c16_postgresql_on_a_state_dir_whose_file_store_holds_a_pending_delivery_is_refused(
    tmp_path: Path, pg_dsn: str
) -> None:
    """C16: d1 is pending in the state directory's file store; ``serve --store DSN`` on the
    same directory refuses ``file_store_pending`` naming d1 and what to do — the database's
    hosts never read the file store, so d1 would never be answered. Before, it started and
    d1 was left unrun, silently. Served once on the file store, d1 is answered; then the
    PostgreSQL start is taken."""
    steps: list[Step] = [Text(text="answered on the file store")]
    with trio.fail_after(LIMIT):
        held = NeverFirst()
        async with scripted_upstream(steps, on_request=held) as (_, url):
            config = write_config(tmp_path, url)
            await pending_d1(tmp_path, config, held)
            argv = ("serve", "--port", "0", "--config", str(config), "--store", pg_dsn)
            stderr = refused(
                await cli(tmp_path, *argv), "pi-runtime: file_store_pending: store.url: "
            )
            assert "'d1'" in stderr
            assert "without --store" in stderr
            async with serve(tmp_path, config) as server, server.connect() as client:
                answered = await client.result("d1")
                await client.send({"type": "ack", "seq": answered["seq"]})
                await client.send({"type": "status"})
                await client.until(lambda f: f["type"] == "status")
            async with serve(tmp_path, config, "--store", pg_dsn) as server:
                pass
    assert (answered["outcome"], answered["text"]) == ("reply", "answered on the file store")
    assert server.port > 0


# -------------------------------------------------------------------- model.base_url (C3)

CONTROL: Final = {"newline": "\\n", "return": "\\r", "nul": "\\u0000", "tab": "\\t"}


@pytest.mark.parametrize("escape", CONTROL.values(), ids=CONTROL.keys())
def test_c3_a_base_url_with_a_control_character_is_config_invalid(escape: str) -> None:
    """C3: ``model.base_url`` holding a control character is refused naming the setting,
    without echoing the value. Before, it was taken: ``urlsplit`` drops ``\\t``, ``\\r`` and
    ``\\n`` silently (the route fingerprint saw another URL than the gateway was given) and
    keeps ``\\x00``."""
    value = "https://llm.example/v1" + escape.encode().decode("unicode_escape")
    with pytest.raises(ConfigError) as raised:
        config_from_dict({"model": {"base_url": value}})
    assert raised.value.setting == "model.base_url"
    assert value not in raised.value.message


@pytest.mark.parametrize("escape", CONTROL.values(), ids=CONTROL.keys())
async def test_c3_serve_refuses_a_base_url_with_a_control_character(
    tmp_path: Path, escape: str
) -> None:
    """C3, O11: the real ``serve`` refuses it at start, ``config_invalid``, and creates no
    state directory. Before, it started (and listened)."""
    config = tmp_path / "config.toml"
    config.write_text(
        f'state_dir = "state"\n[model]\nbase_url = "https://llm.example/v1{escape}"\n'
    )
    done = await cli(tmp_path, "serve", "--port", "0", "--config", str(config))
    refused(done, "pi-runtime: config_invalid: model.base_url: ")
    assert not (tmp_path / "state").exists()
