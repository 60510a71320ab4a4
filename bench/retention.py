"""Start-up against history (issue #21, docs/design/retention.md RT9).

Run it from the repository root::

    .venv/bin/python -m bench.retention                 # 0, 10k, 100k, 1M; 5 starts each
    .venv/bin/python -m bench.retention --sizes 0,10000 --starts 3

For each history size N it builds a state directory whose shared logs hold N finished,
acknowledged deliveries published 40 days ago (in 100 rooms) and one live one (admitted, no
result) — written straight into the logs in the runtime's own framing, as N deliveries would
have left them, without their step journals (retention removed those after 7 days) — then
times, on the real room worker (``open_room_worker``, Fake-Pi, the embedded model):

* **start, uncompacted**: open the worker until it admits, on the logs as they are (a
  retention whose periods are not reached, so nothing is compacted meanwhile) — what every
  start cost before this slice;
* **compaction**: ``compact_store`` (the store opened) with the default retention (7 / 30 /
  365 days): N deliveries expire but the rooms' latest;
* **start, compacted**: the same start on what the compaction left.

Each start is timed ``--starts`` times, the median printed; the baseline is the compacted start
of N = 0 measured in the same run, and every other start is printed as a ratio to it. The
target (RT9): a compacted start ≤ 1 s and flat in N. Nothing asserts; CI does not run it.
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

from runtime._clock import Clocks
from runtime._config import RetentionConfig, RoomWorkerConfig
from runtime._journal._frame import encode_frame
from runtime._journal._journal import encode_record
from runtime._journal._store import open_store
from runtime._records import (
    SCHEMA_VERSION,
    Admission,
    Fingerprints,
    Header,
    LogKind,
    Outcome,
    Record,
    ResultAcked,
    ResultPublished,
)
from runtime._rooms._retention import compact_store
from runtime._rooms._worker import RoomWorker, open_room_worker

ROOMS: Final = 100
DAY_MS: Final = 86_400_000
FRAME: Final = 1024
NEVER: Final = RetentionConfig(journal_days=1e6, idempotency_days=1e6, forget_days=1e6)


def _write_log(path: Path, kind: LogKind, subject: str, records: list[Record]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    header = Header(schema_version=SCHEMA_VERSION, kind=kind, subject=subject, created_ms=1)
    encoded = [encode_record(r) for r in (header, *records)]
    with path.open("wb") as out:
        for first in range(0, len(encoded), FRAME):
            out.write(encode_frame(first, encoded[first : first + FRAME]))


def build(state: Path, history: int, *, days: int = 40) -> None:
    """A state directory with ``history`` finished deliveries, their results published
    ``days`` ago, behind one live one."""
    state.mkdir(mode=0o700, parents=True)
    old = time.time_ns() // 1_000_000 - days * DAY_MS
    prints = Fingerprints(request="r" * 64, authority="a" * 64, settings="s" * 64)
    admissions: list[Record] = []
    results: list[Record] = []
    for n in range(history + 1):
        delivery_id = f"d{n}"
        room = f"dm:{n % ROOMS}" if n < history else "dm:live"
        request = {
            "delivery_id": delivery_id,
            "room": room,
            "author": {"id": "u1", "name": "Ann"},
            "message_id": f"m{n}",
            "text": f"message number {n}",
        }
        admissions.append(
            Admission(
                delivery_id=delivery_id,
                lane=room,
                request=request,
                fingerprints=prints,
                rendered_prompt=f"New message from Ann (id u1) (message m{n}):\nmessage {n}",
                admitted_ms=old,
            )
        )
        if n < history:
            results.append(
                ResultPublished(
                    seq=n + 1,
                    delivery_id=delivery_id,
                    room=room,
                    outcome=Outcome.REPLY,
                    text=f"the answer to message {n}",
                    published_ms=old,
                )
            )
    if history:
        results.append(ResultAcked(seq=history))
    _write_log(
        state / "admissions" / "admissions.log", LogKind.ADMISSIONS, "admissions", admissions
    )
    _write_log(state / "results.log", LogKind.RESULTS, "results", results)


async def start(base: Path, retention: RetentionConfig) -> float:
    """Seconds from opening the room worker until it admits."""
    config = RoomWorkerConfig(retention=retention)
    began = time.perf_counter()
    async with open_room_worker(config, base_dir=base, clocks=Clocks.system()) as worker:
        took = time.perf_counter() - began
        assert worker.admitting
    return took


async def stall(base: Path) -> tuple[float, float]:
    """How long compactions of this state directory hold admissions back (the longest an
    admission can wait for one), in seconds: the one that rewrites the logs, and the next,
    which finds nothing to change (0: it plans without holding anything back)."""
    held: list[float] = []
    pause = RoomWorker._admissions_paused

    @contextlib.asynccontextmanager
    async def timed(self: RoomWorker) -> AsyncIterator[None]:
        began = time.perf_counter()
        async with pause(self):
            yield
        held.append(time.perf_counter() - began)

    RoomWorker._admissions_paused = timed  # type: ignore[method-assign]
    try:
        config = RoomWorkerConfig()
        async with open_room_worker(config, base_dir=base, clocks=Clocks.system()) as worker:
            await worker.compact()  # the first to run changes what is due; the next nothing
            await worker.compact()
    finally:
        RoomWorker._admissions_paused = pause  # type: ignore[method-assign]
    return (held[0] if held else 0.0), (held[1] if len(held) > 1 else 0.0)


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0,10000,100000,1000000")
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path(".cache"))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if 0 not in sizes:
        sizes.insert(0, 0)  # the baseline
    args.dir.mkdir(exist_ok=True)
    rows = []
    stalls: list[tuple[int, float, float]] = []

    async def stall_of(base: Path, kept: int) -> tuple[float, float]:
        build(base / "state", kept, days=10)  # past journal_days, within idempotency_days
        try:
            return await stall(base)
        finally:
            shutil.rmtree(base)

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-retention-") as tmp:
        for history in sizes:
            base = Path(tmp) / str(history)
            began = time.perf_counter()
            build(base / "state", history)
            built = time.perf_counter() - began
            before = _size(base / "state" / "admissions" / "admissions.log") + _size(
                base / "state" / "results.log"
            )
            uncompacted = [await start(base, NEVER) for _ in range(args.starts)]
            began = time.perf_counter()
            # the starts above ran with NEVER (and recorded it, RT14): the compaction is
            # the store's own, with the default days, as a server started with them runs it
            async with open_store(base / "state", clocks=Clocks.system()) as store:
                _, plan = await compact_store(store, retention=RetentionConfig())
            compaction = time.perf_counter() - began
            after = _size(base / "state" / "admissions" / "admissions.log") + _size(
                base / "state" / "results.log"
            )
            filter_bytes = _size(base / "state" / "expired.ids")
            compacted = [await start(base, RetentionConfig()) for _ in range(args.starts)]
            stalls.append((history, *await stall_of(Path(tmp) / f"kept-{history}", history)))
            rows.append(
                (
                    history,
                    statistics.median(uncompacted),
                    compaction,
                    statistics.median(compacted),
                    len(plan.expired),
                    before,
                    after,
                    filter_bytes,
                )
            )
            print(f"# built {history} in {built:.1f} s", flush=True)
            shutil.rmtree(base)
    baseline = rows[0][3]
    print(
        f"{'history':>9} {'start, uncompacted':>19} {'ratio':>7} {'compaction':>11} "
        f"{'start, compacted':>17} {'ratio':>6} {'expired':>8} {'logs before':>12} "
        f"{'logs after':>11} {'filter':>10}"
    )
    for history, unc, comp, com, expired, before, after, filt in rows:
        print(
            f"{history:>9} {unc:>17.3f} s {unc / baseline:>6.1f}x {comp:>9.2f} s "
            f"{com:>15.3f} s {com / baseline:>5.2f}x {expired:>8} {before:>12} {after:>11} "
            f"{filt:>10}"
        )
    print()
    print(f"{'kept':>9} {'admissions held: rewrite':>25} {'plan only':>10}")
    for kept, rewrite, plan_only in stalls:
        print(f"{kept:>9} {rewrite * 1000:>22.1f} ms {plan_only * 1000:>7.1f} ms")
    print(
        f"baseline: the compacted start with no history, {baseline:.3f} s (median of "
        f"{args.starts}); target RT9: a compacted start <= 1 s, flat in the history"
    )


if __name__ == "__main__":
    trio.run(main)
