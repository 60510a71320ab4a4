"""The demo behind ``scripts/several-hosts`` (see there)."""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import trio

warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
from pgserver.postgres_server import get_server  # noqa: E402

from bench import _hosts as hosts  # noqa: E402
from runtime._journal._postgres import migrate  # noqa: E402

LEASE = 3.0
COMMON = Path(tempfile.mkdtemp(prefix="pi-hosts-", dir="/tmp"))
"""Where every host sees its own directory (in its own mount namespace), as separate machines
would each have ``/srv/pi-runtime``: short, since a socket's path must fit in 108 bytes."""


def host_config(dsn: str, name: str) -> str:
    return (
        'state_dir = "state"\nwork_root = "work"\n\n'
        f'[store]\nurl = "{dsn}"\nhost_name = "{name}"\nlease_seconds = {LEASE}\n'
    )


async def start_host(root: Path, name: str) -> tuple[trio.Process, int]:
    """Start host ``name``; its process and the port it listens on."""
    log = (root / f"{name}.log").open("ab")
    return await hosts.start_host(COMMON, root / "hosts" / name, stderr=log)


async def ask(root: Path, name: str, port: int, delivery_id: str, room: str) -> dict[str, Any]:
    return await hosts.ask(root / "hosts" / name, port, delivery_id, room)


def holder(root: Path, room: str) -> str:
    for name in "abc":
        log = (root / f"{name}.log").read_text(errors="replace")
        claims = re.findall(rf"lane {re.escape(room)} claimed at epoch (\d+)", log)
        if claims and int(claims[-1]) > 1:
            return f"{name} (epoch {claims[-1]})"
    return "?"


def prepare(root: Path, dsn: str) -> None:
    for name in "abc":
        own = root / "hosts" / name
        own.mkdir(parents=True, mode=0o700)
        (own / "config.toml").write_text(host_config(dsn, name))


async def main(root: Path, dsn: str) -> None:
    hosts: dict[str, trio.Process] = {}
    try:
        print(f"PostgreSQL: {dsn} (schema {await migrate(dsn)})")
        ports: dict[str, int] = {}
        for name in "abc":
            hosts[name], ports[name] = await start_host(root, name)
            print(f"host {name}: ws://127.0.0.1:{ports[name]}/ (log: {root / f'{name}.log'})")
        for n, name in enumerate("abc", 1):
            answer = await ask(root, name, ports[name], f"d{n}", f"dm:{name}")
            print(f"dm:{name} through host {name}: {answer}")
        hosts["a"].kill()
        await hosts["a"].wait()
        print("host a SIGKILLed; writing to its room dm:a through host b …")
        with trio.fail_after(LEASE + 30):
            answer = await ask(root, "b", ports["b"], "d4", "dm:a")
        print(f"dm:a through host b: {answer}, its lane now held by {holder(root, 'dm:a')}")
    finally:
        for process in hosts.values():
            if process.returncode is None:
                process.kill()
                await process.wait()


def run(root: Path) -> None:
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    # its own temporary directory: as root, PostgreSQL runs as the user `pgserver`, which must
    # traverse every parent of its data directory (DIR's may not let it)
    data = Path(tempfile.mkdtemp(prefix="pi-runtime-pg-"))
    server = get_server(data / "data", cleanup_mode="stop")
    try:
        prepare(root, server.get_uri())
        trio.run(main, root, server.get_uri())
    finally:
        server.cleanup()
        shutil.rmtree(data, ignore_errors=True)
        COMMON.rmdir()


run(Path(sys.argv[1]).absolute())
