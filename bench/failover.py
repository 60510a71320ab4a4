"""Failover benchmark (issue #19): how long after a host dies its room is answered by another.

Run it from the repository root (Linux; root, or a kernel that allows user namespaces)::

    .venv/bin/python -m bench.failover            # 5 rounds
    .venv/bin/python -m bench.failover --rounds 2 --lease 2

A throw-away PostgreSQL (``pgserver``), and per round two ``pi-runtime serve`` hosts on it
(Fake-Pi, its embedded model), each in a private mount namespace showing it its own directory
at one common path (as ``scripts/several-hosts`` does). Host A answers one message in a room
(it holds the room's lane); the bench reads how long A's lease has left (the database's
``lease_until - now()``: the baseline, the earliest any host may claim the lane), SIGKILLs A
and at once sends the next message of that room through B, timing until B's client has the
result. It prints, per round and as the median: kill → lease expiry (the baseline), kill →
answer, and answer - expiry (what failover adds to waiting out the lease: the claim, the
recovery, a fresh worker and the turn). The issue's target: answer - expiry ≤ 1 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import psycopg
import trio

warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
from pgserver.postgres_server import get_server  # noqa: E402

from runtime._journal._postgres import migrate  # noqa: E402
from runtime._journal._store import Store  # noqa: E402

from ._hosts import ask, start_host  # noqa: E402


def _remaining(dsn: str, room: str) -> float:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM lease_until - now()) FROM pi_runtime.lanes WHERE lane = %s",
            [Store.lane_rel(room)],
        ).fetchone()
    assert row is not None
    return float(row[0])


async def _round(root: Path, common: Path, dsn: str, n: int, lease: float) -> tuple[float, ...]:
    hosts = {}
    for name in (f"a{n}", f"b{n}"):
        own = root / name
        own.mkdir(mode=0o700)
        (own / "config.toml").write_text(
            f'state_dir = "state"\nwork_root = "work"\n\n[store]\nurl = "{dsn}"\n'
            f'host_name = "{name}"\nlease_seconds = {lease}\n'
        )
        hosts[name] = (*await start_host(common, own), own)
    (a, a_port, a_dir), (_b, b_port, b_dir) = hosts[f"a{n}"], hosts[f"b{n}"]
    room = f"dm:bench-{n}"
    try:
        await ask(a_dir, a_port, f"r{n}-1", room)
        expiry = await trio.to_thread.run_sync(_remaining, dsn, room)
        killed = time.monotonic()
        a.kill()
        await ask(b_dir, b_port, f"r{n}-2", room)
        answered = time.monotonic() - killed
    finally:
        for process, _port, _own in hosts.values():
            if process.returncode is None:
                process.kill()
            await process.wait()
    return expiry, answered, answered - expiry


async def _main(rounds: int, lease: float) -> None:
    root = Path(tempfile.mkdtemp(prefix="pi-failover-"))
    common = Path(tempfile.mkdtemp(prefix="pi-hosts-", dir="/tmp"))
    data = Path(tempfile.mkdtemp(prefix="pi-runtime-pg-"))
    server = await trio.to_thread.run_sync(lambda: get_server(data / "data", cleanup_mode="stop"))
    try:
        dsn = server.get_uri()
        await migrate(dsn)
        print(f"failover: {rounds} rounds, lease_seconds = {lease}, poll_seconds = 1")
        print(f"{'round':>5} {'kill->expiry':>13} {'kill->answer':>13} {'answer-expiry':>14}")
        found = []
        for n in range(1, rounds + 1):
            found.append(await _round(root, common, dsn, n, lease))
            e, a, d = found[-1]
            print(f"{n:>5} {e:>12.2f}s {a:>12.2f}s {d:>13.2f}s")
        e, a, d = (statistics.median(column) for column in zip(*found, strict=True))
        print(f"{'p50':>5} {e:>12.2f}s {a:>12.2f}s {d:>13.2f}s")
        print(f"answer after the kill / lease left at the kill (p50): {a / e:.2f}")
    finally:
        server.cleanup()
        shutil.rmtree(data, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        os.rmdir(common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lease", type=float, default=10.0)
    args = parser.parse_args()
    trio.run(_main, args.rounds, args.lease)


if __name__ == "__main__":
    main()
