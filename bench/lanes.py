"""Room-lane benchmarks (issue #5): recovery scan and re-admission of pending deliveries.

``python -m bench.lanes [--sizes 250,500,1000,2000] [--reps 5]``

For each size N, a state directory is prepared with N admitted, unfinished deliveries (one
room, so the lane serializes them and no worker starts before the scan is done). Then, in the
same run and alternating:

* **baseline**: ``open_store`` alone on that directory (reading the shared logs);
* **recover**: ``open_room_worker`` until its block is entered — the store opened, leftover
  epochs looked for, every admission read, fingerprints checked against the configuration, and
  all N deliveries queued on their lane.

The difference is the cost of the room worker's recovery. Reported: medians, the per-delivery
cost, and the ratio to the baseline. Target (issue #5): scan and re-admission of 1,000 pending
deliveries ≤ 0.5 s, linear in their number. No assertion: the numbers go into
``docs/design/performance.md``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import trio

from runtime._config import Caps, ModelConfig, RoomWorkerConfig
from runtime._journal._store import open_store
from runtime._rooms._admission import Author, Delivery
from runtime._rooms._worker import open_room_worker

ROOM = "dm:bench"


async def prepare(base: Path, size: int) -> RoomWorkerConfig:
    """A state directory with ``size`` admitted deliveries, none started."""
    config = RoomWorkerConfig(
        model=ModelConfig(base_url="http://127.0.0.1:9/v1"),  # never called: nothing runs
        caps=Caps(queue_limit=size + 1),
    )
    async with open_room_worker(config, base_dir=base) as worker:
        for n in range(size):
            delivery = Delivery(
                delivery_id=f"d{n}",
                room=ROOM,
                author=Author(id="u1", name="Ann"),
                message_id=f"m{n}",
                text=f"message {n}",
            )
            await worker.deliver(delivery)
        worker._admitting = False  # leave at once: the lane's first turn is cancelled
    return config


async def time_store(base: Path) -> float:
    start = time.perf_counter()
    async with open_store(base / "state"):
        elapsed = time.perf_counter() - start
    return elapsed


async def time_recover(base: Path, config: RoomWorkerConfig, size: int) -> float:
    start = time.perf_counter()
    async with open_room_worker(config, base_dir=base) as worker:
        elapsed = time.perf_counter() - start
        pending = len(worker.pending())
    if pending < size - 1:  # the first may have been started and finished? never: no model
        raise SystemExit(f"recovered {pending} of {size}")
    return elapsed


async def run(sizes: list[int], reps: int) -> None:
    print(f"{'pending':>8} {'store ms':>9} {'recover ms':>11} {'µs/delivery':>12} {'ratio':>6}")
    for size in sizes:
        base = Path(tempfile.mkdtemp(prefix="bench-lanes-"))
        try:
            config = await prepare(base, size)
            store_times, recover_times = [], []
            for _ in range(reps):
                store_times.append(await time_store(base))
                recover_times.append(await time_recover(base, config, size))
            store = statistics.median(store_times)
            recover = statistics.median(recover_times)
            per = (recover - store) / size * 1e6
            print(
                f"{size:>8} {store * 1e3:>9.1f} {recover * 1e3:>11.1f} {per:>12.1f} "
                f"{recover / store:>6.2f}"
            )
        finally:
            shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="250,500,1000,2000")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    trio.run(run, [int(s) for s in args.sizes.split(",")], args.reps)


if __name__ == "__main__":
    main()
