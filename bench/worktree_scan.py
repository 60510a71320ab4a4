"""What the task lane's worktree progress scan costs (WD1 of docs/design/watchdog.md).

Run it from the repository root::

    .venv/bin/python -m bench.worktree_scan            # 1k, 10k, 20k and 100k files
    .venv/bin/python -m bench.worktree_scan --quick    # 1k and 10k, a few seconds

Per size N, a worktree of N small files in directories of 100 is made in a temporary
directory; then, warm (the page cache and dentry cache hold it, as they do for a worktree a
worker is busy in), each of ``--reps`` repetitions times:

* **baseline**: ``os.walk`` and one ``os.lstat`` per file, the plainest walk that sees every
  file's size and modification time, over the same first ``min(N, STAMP_LIMIT)`` files;
* **stamp**: :func:`~runtime._tasks._worktree.worktree_stamp`, as the lane runs it (bounded at
  ``STAMP_LIMIT`` entries, directories included).

It prints the median of each, the ratio stamp / baseline, and what one lane's scan every
30 s (``WORKTREE_SCAN_TICKS`` ticks of 5 s) costs of one core. Nothing asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from runtime._tasks._epoch import WORKTREE_SCAN_TICKS
from runtime._tasks._watchdog import WatchdogPolicy
from runtime._tasks._worktree import STAMP_LIMIT, worktree_stamp


def make_tree(root: Path, files: int) -> None:
    for n in range(files):
        directory = root / f"d{n // 100:05}"
        if n % 100 == 0:
            directory.mkdir(parents=True)
        (directory / f"f{n % 100:03}.txt").write_bytes(b"x" * (n % 512))


def baseline(root: Path, limit: int) -> int:
    seen = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            os.lstat(os.path.join(directory, name))
            seen += 1
            if seen >= limit:
                return seen
    return seen


def timed(run: Callable[[Path], object], root: Path, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        run(root)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,20000,100000")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = [1000, 10_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    interval = WatchdogPolicy().tick_seconds * WORKTREE_SCAN_TICKS
    print(f"worktree scan: limit {STAMP_LIMIT} entries, one scan every {interval:g} s per lane")
    print(f"{'files':>8} {'baseline ms':>12} {'stamp ms':>9} {'ratio':>6} {'entries':>8} "
          f"{'truncated':>9} {'core %/lane':>11}")  # fmt: skip
    for size in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "worktree"
            make_tree(root, size)
            stamp = worktree_stamp(root)  # warm
            assert stamp is not None
            baseline(root, STAMP_LIMIT)
            base = timed(lambda path: baseline(path, STAMP_LIMIT), root, args.reps)
            scan = timed(worktree_stamp, root, args.reps)
            print(
                f"{size:>8} {base * 1000:>12.1f} {scan * 1000:>9.1f} {scan / base:>6.2f} "
                f"{stamp.entries:>8} {stamp.truncated!s:>9} {100 * scan / interval:>11.3f}"
            )


if __name__ == "__main__":
    main()
