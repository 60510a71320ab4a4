"""Secrets never leave in an error text (docs/design/gateway.md G9, boundaries.md B5): a worker
that prints the upstream key or an epoch secret to its stderr — a provider error it quotes, a
crash dump of its environment — has that stderr quoted in the error its exit raises
(:class:`~runtime._errors.WorkerExitedError`), which reaches logs and the API. The key must not.

Real processes on a real clock, every wait bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Final

import pytest
import trio

from runtime._boundary._boundaries import BoundaryConfig, open_boundaries
from runtime._boundary._gate import GATE_SECRET_ENV
from runtime._boundary._gateway import GATEWAY_SECRET_ENV, GatewayConfig
from runtime._clock import Clocks
from runtime._errors import WorkerExitedError
from runtime._journal._store import delivery_key, open_store, runtime_dir
from runtime._pi._rpc import open_rpc_channel
from runtime._pi._worker import open_epoch

LIMIT: Final = 30.0
KEY: Final = "sk-live-0123456789abcdefghijklmnopqrstuvwxyz"
TAIL: Final = 64 * 1024
DELIVERY: Final = "delivery-1"


def _worker(stderr: str) -> list[str]:
    """A worker that, once its first command arrives, writes the bytes the Python expression
    ``stderr`` makes and exits, before it answers anything. (It waits for the command: one that
    exited at once could exit during the launch's proof on a loaded machine, and its error
    would be the launch's, ``worker_launch_failed``, not the exit's the test reads.)"""
    code = f"import sys; sys.stdin.readline(); sys.stderr.buffer.write({stderr}); sys.exit(3)"
    return [sys.executable, "-c", code]


async def _exit_error(stderr: str, tmp_path: Path, secrets: tuple[str, ...]) -> str:
    """The text of the error raised on its first command by a worker that wrote the bytes the
    Python expression ``stderr`` makes."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    argv = _worker(stderr)
    with trio.fail_after(LIMIT):
        async with open_epoch(argv, env=env, cwd=tmp_path, secrets=secrets) as epoch:
            channel = open_rpc_channel(epoch.stdin, epoch.stdout, stderr=epoch.stderr_tail)
            async with channel as rpc:
                with pytest.raises(WorkerExitedError) as caught:
                    await rpc.request({"type": "get_state"})
    error = caught.value
    return str(error) + "\n" + error.stderr.decode(errors="replace")


async def test_g9_a_workers_stderr_quoting_the_key_leaves_in_no_error_text(
    tmp_path: Path,
) -> None:
    """G9, B5: the worker prints a provider's error quoting the upstream key, and its epoch
    secrets, to its stderr and exits. The error its exit raises quotes the stderr's tail (up to
    64 KiB): before, the key and the secrets were in that text as they came. Now every secret
    the runtime gave the epoch to hide is blotted out."""
    secret = "gateway-secret-abcdefghijklmnop"
    said = f"Error: 401 Incorrect API key provided: {KEY}\nenv: {GATEWAY_SECRET_ENV}={secret}\n"
    text = await _exit_error(repr(said.encode()), tmp_path, (KEY, secret))
    assert "Incorrect API key provided" in text  # the stderr is still quoted
    assert KEY not in text
    assert secret not in text
    assert "[secret]" in text


async def test_g9_a_key_cut_by_the_stderr_tails_start_leaves_no_fragment(tmp_path: Path) -> None:
    """G9: the stderr kept is its last 64 KiB, cut at any byte — also inside the key, whose
    end then begins the tail. That fragment is blotted out too."""
    kept = 12  # the key's last 12 characters fall inside the tail
    stderr = f"b'x' * 100 + {KEY.encode()!r} + b'y' * {TAIL - kept}"
    text = await _exit_error(stderr, tmp_path, (KEY,))
    assert KEY[-kept:] not in text
    assert KEY[-8:] not in text


_HALF_READ: Final = """
import fcntl, os, struct, sys, termios
key = sys.argv[1].encode()
os.write(2, b"Error: 401 Incorrect API key provided: " + key[:{half}])
while struct.unpack("i", fcntl.ioctl(2, termios.FIONREAD, b"0000"))[0]:
    pass  # until the runtime has read all of it: the key's first part is in its tail
os.close(1)  # the runtime sees the worker gone, and quotes its stderr now
sys.stdin.buffer.read()  # the rest of the key would come after (it never does: TERM)
os.write(2, key[{half}:])
"""


async def test_g9_a_key_half_read_when_the_worker_exits_leaves_no_prefix(tmp_path: Path) -> None:
    """G9: the worker writes a line quoting the key; the runtime has read the key's first part
    and not yet its rest when the worker's stdout ends, so the error is made with a tail that
    ends in the middle of the key (two reads of the pipe, the quote taken between them). The
    key's beginning is blotted out too. Before, only a whole key or the end of one at the tail's
    start was: the error text carried the key's first 30 of 44 characters."""
    half = 30
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    argv = [sys.executable, "-c", _HALF_READ.format(half=half), KEY]
    with trio.fail_after(LIMIT):
        async with open_epoch(argv, env=env, cwd=tmp_path, secrets=(KEY,)) as epoch:
            channel = open_rpc_channel(epoch.stdin, epoch.stdout, stderr=epoch.stderr_tail)
            async with channel as rpc:
                with pytest.raises(WorkerExitedError) as caught:
                    await rpc.request({"type": "get_state"})
    text = str(caught.value) + "\n" + caught.value.stderr.decode(errors="replace")
    assert "Incorrect API key provided" in text  # the stderr is quoted, up to the key
    assert KEY[:half] not in text
    assert KEY[:8] not in text
    assert text.rstrip().endswith("[secret]"), text


async def test_b5_the_boundaries_name_every_secret_a_worker_must_not_print(
    tmp_path: Path,
) -> None:
    """B5, G9: a lane hides from its worker's error texts the secrets it knows: the upstream
    key (read, as the gateway reads it, from the variable the configuration names) and the
    epoch's gateway and gate secrets."""
    name = "PI_RUNTIME_TEST_SECRETS_KEY"
    os.environ[name] = KEY
    try:
        config = BoundaryConfig(
            upstream=GatewayConfig(upstream_url="http://127.0.0.1:9/v1", upstream_key_env=name),
            granted=frozenset(),
            socket_dir=runtime_dir(tmp_path / "state"),
        )
        with trio.fail_after(LIMIT):
            async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
                log = await store.create_delivery_log(DELIVERY)
                async with open_boundaries(
                    config, log, key=delivery_key(DELIVERY), epoch=1
                ) as boundaries:
                    env = boundaries.worker_env()
                    hidden = boundaries.worker_secrets()
    finally:
        del os.environ[name]
        shutil.rmtree(runtime_dir(tmp_path / "state"), ignore_errors=True)
    assert set(hidden) >= {KEY, env[GATEWAY_SECRET_ENV], env[GATE_SECRET_ENV]}
