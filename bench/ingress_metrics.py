"""The ingress benchmark with metrics on and off, side by side (issue #22's second benchmark).

Run it from the repository root::

    .venv/bin/python -m bench.ingress_metrics            # 3 rounds
    .venv/bin/python -m bench.ingress_metrics --quick    # 1 short round

Each round starts two ``bench.ingress`` runtime servers (``--role runtime``, the same held-back
turns, so only admissions are measured), fresh state directories both:

* **off**: every ``prometheus_client`` instrument of the process a no-op
  (``bench.ingress.instruments_off``) and no metrics listener — the runtime without metrics;
* **on**: the metrics listener with its operator page, scraped (``GET /metrics`` over HTTP)
  once a second and with one page's event stream (``GET /api/events``) open and read, while
  its slices run — what a monitored host does.

The same 50 clients' closed-loop slices (``k`` outstanding frames per connection) alternate
between the two, the order flipped every slice; the figure is admissions/s of *on* over *off*,
per round, and its median. Nothing asserts; figures go into ``docs/design/performance.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import trio

from runtime._boundary._http import open_request

from .ingress import (
    CONNECTIONS,
    REPO,
    WARMUP_FRAMES,
    Frames,
    Phase,
    Server,
    check_held,
    drive,
    open_clients,
    start_server,
)

SLICES: Final = 6
PER_SLICE: Final = 40


@contextlib.asynccontextmanager
async def monitored(server: Server, token: str, active: list[bool]) -> AsyncIterator[list[int]]:
    """Scrape ``server``'s metrics once a second and keep one page's event stream open and
    read while ``active[0]``; yields [scrapes, events] counted."""
    port = server.ready["metrics_port"]
    counts = [0, 0]
    bearer = [("authorization", f"Bearer {token}")]

    async def scrape() -> None:
        while True:
            if active[0]:
                async with open_request("GET", f"http://127.0.0.1:{port}/metrics") as r:
                    await r.read()
                counts[0] += 1
            await trio.sleep(1.0)

    async def page() -> None:
        url = f"http://127.0.0.1:{port}/api/events"
        async with open_request("GET", url, headers=bearer) as events:
            async for chunk in events.iter_bytes():
                counts[1] += chunk.count(b"event: state")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(scrape)
        nursery.start_soon(page)
        yield counts
        nursery.cancel_scope.cancel()


async def one_round(base: Path, round_no: int, k: int, frames: Frames) -> tuple[Phase, Phase]:
    rooms = CONNECTIONS
    capacity = SLICES * PER_SLICE + 2 * WARMUP_FRAMES + 8
    phases = {"off": Phase("off", k), "on": Phase("on", k)}
    active = [False]
    async with contextlib.AsyncExitStack() as stack:
        servers, clients = {}, {}
        for mode in ("off", "on"):
            state = base / f"round-{round_no}-k{k}-{mode}"
            state.mkdir()
            extra = ["--base", str(state), "--rooms", str(rooms), "--capacity", str(capacity)]
            servers[mode] = await stack.enter_async_context(
                start_server("runtime", *extra, "--metrics", mode)
            )
            token = (state / "state" / "token").read_text().strip()
            clients[mode] = await stack.enter_async_context(
                open_clients(servers[mode], mode, token)
            )
            await drive(clients[mode], frames.make(WARMUP_FRAMES), 1)
        token = (base / f"round-{round_no}-k{k}-on" / "state" / "token").read_text().strip()
        counts = await stack.enter_async_context(monitored(servers["on"], token, active))
        for s in range(SLICES):
            order = ("off", "on") if (s + round_no) % 2 else ("on", "off")
            for mode in order:
                active[0] = mode == "on"
                phases[mode].add(await drive(clients[mode], frames.make(PER_SLICE), k))
            active[0] = False
        for mode in ("off", "on"):
            await check_held(servers[mode], rooms)
        print(f"  round {round_no}: {counts[0]} scrapes, {counts[1]} page pushes during 'on'")
    return phases["off"], phases["on"]


async def run(rounds: int, pipelines: list[int]) -> None:
    root = REPO / ".cache"
    root.mkdir(exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench-ingress-metrics-", dir=root))
    frames = Frames()
    started = time.perf_counter()
    ratios: dict[int, list[float]] = {k: [] for k in pipelines}
    try:
        for round_no in range(1, rounds + 1):
            for k in pipelines:
                off, on = await one_round(base, round_no, k, frames)
                ratio = on.rate / off.rate
                ratios[k].append(ratio)
                print(
                    f"  round {round_no} k={k}: off {off.rate:,.0f}/s (p50 {off.p(0.5):.1f} ms, "
                    f"server CPU {off.server_cpu / off.ops * 1e6:.0f} us/op), on "
                    f"{on.rate:,.0f}/s (p50 {on.p(0.5):.1f} ms, server CPU "
                    f"{on.server_cpu / on.ops * 1e6:.0f} us/op): on/off {ratio:.3f}"
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"  measured in {time.perf_counter() - started:.0f}s")
    for k, values in ratios.items():
        print(
            f"bench.ingress_metrics k={k}: admissions/s with metrics on / off, median of "
            f"{len(values)} rounds: {statistics.median(values):.3f} "
            f"(rounds: {', '.join(f'{v:.3f}' for v in values)})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ingress_metrics", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pipeline", default="1,4", help="outstanding frames per connection")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    trio.run(run, rounds, [int(k) for k in args.pipeline.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
