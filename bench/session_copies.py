"""A growing session kept in PostgreSQL: whole at every store (before S36) against by
difference (docs/design/scale-out.md S36).

Run it from the repository root (the ``bench`` extra)::

    .venv/bin/python -m bench.session_copies             # 3 rounds of 400 stores
    .venv/bin/python -m bench.session_copies --quick     # 1 round of 100

A throw-away PostgreSQL (``pgserver``, ``fsync=on``, its data on the repository's disk). One
round: a session file grows by one turn's appends (``--turn-bytes``, default 6 KiB: a prompt,
a model answer with a tool call, its result) and is stored after each, ``--stores`` times,
the two ways alternating turn by turn on two lanes of their own: **whole**, the file's bytes
as one document (what a lane did before S36, twice per turn), and **by difference**,
``SessionCopies.store_file``. Per way: the bytes sent to the database, the time of a store
(p50, and p50 of the last tenth, where the file is largest), and the time to rebuild the
final file on another host. Ratios are per round, the median over rounds is printed;
nothing asserts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Final

import trio

from runtime._journal._fence import Fence
from runtime._journal._postgres import PgStore, open_pg_store
from runtime._rooms._session_copies import SessionCopies

from .postgres import print_medians, throwaway_postgres

BASE: Final = "sessions/lanes/bench/session.jsonl"


async def _store_whole(store: PgStore, path: Path, fence: Fence) -> int:
    data = await trio.to_thread.run_sync(path.read_bytes)
    await store.write_document(BASE + ".whole", data, fence=fence)
    return len(data)


async def _round(dsn: str, root: Path, stores: int, turn_bytes: int, n: int) -> dict[str, float]:
    work = root / f"round-{n}"
    work.mkdir()
    whole_file, diff_file = work / "whole.jsonl", work / "diff.jsonl"
    line = (b'{"type":"message","text":"' + b"x" * (turn_bytes - 32) + b'"}\n')[:turn_bytes]
    sent = {"whole": 0, "diff": 0}
    times: dict[str, list[float]] = {"whole": [], "diff": []}
    async with open_pg_store(dsn, root=work / "a", owner=f"a{n}") as store:
        fence_whole = await store.claim(f"room:whole-{n}", 600.0)
        fence_diff = await store.claim(f"room:diff-{n}", 600.0)
        assert fence_whole is not None
        assert fence_diff is not None
        copies = SessionCopies(store)
        written: list[int] = []
        real_write = store.write_document

        async def counted(rel: str, data: bytes, **kwargs: object) -> None:
            written.append(len(data))
            await real_write(rel, data, **kwargs)  # type: ignore[arg-type]

        store.write_document = counted  # type: ignore[method-assign]
        for i in range(stores):
            for path in (whole_file, diff_file):
                with path.open("ab") as file:
                    file.write(line)
            for way in ("whole", "diff") if i % 2 == 0 else ("diff", "whole"):
                written.clear()
                started = time.perf_counter()
                if way == "whole":
                    await _store_whole(store, whole_file, fence_whole)
                else:
                    await copies.store_file(BASE, diff_file, fence_diff)
                times[way].append(time.perf_counter() - started)
                sent[way] += sum(written)
        store.write_document = real_write  # type: ignore[method-assign]
    async with open_pg_store(dsn, root=work / "b", owner=f"b{n}") as other:
        started = time.perf_counter()
        await SessionCopies(other).restore_file(BASE, work / "rebuilt.jsonl")
        rebuild_diff = time.perf_counter() - started
        started = time.perf_counter()
        await other.read_document(BASE + ".whole")
        rebuild_whole = time.perf_counter() - started
    assert (work / "rebuilt.jsonl").read_bytes() == diff_file.read_bytes()
    tail = max(1, stores // 10)
    return {
        "size_mib": diff_file.stat().st_size / 2**20,
        "sent_whole_mib": sent["whole"] / 2**20,
        "sent_diff_mib": sent["diff"] / 2**20,
        "r_sent": sent["whole"] / sent["diff"],
        "p50_whole_ms": statistics.median(times["whole"]) * 1e3,
        "p50_diff_ms": statistics.median(times["diff"]) * 1e3,
        "tail_whole_ms": statistics.median(times["whole"][-tail:]) * 1e3,
        "tail_diff_ms": statistics.median(times["diff"][-tail:]) * 1e3,
        "r_tail": statistics.median(times["whole"][-tail:])
        / statistics.median(times["diff"][-tail:]),
        "rebuild_whole_ms": rebuild_whole * 1e3,
        "rebuild_diff_ms": rebuild_diff * 1e3,
    }


LABELS: Final = (
    ("size_mib", "the session at the end", "MiB"),
    ("sent_whole_mib", "bytes sent, whole at every store", "MiB"),
    ("sent_diff_mib", "bytes sent, by difference", "MiB"),
    ("r_sent", "bytes sent whole / by difference", "ratio"),
    ("p50_whole_ms", "a store, whole (p50)", "ms"),
    ("p50_diff_ms", "a store, by difference (p50)", "ms"),
    ("tail_whole_ms", "a store in the last tenth, whole (p50)", "ms"),
    ("tail_diff_ms", "a store in the last tenth, by difference (p50)", "ms"),
    ("r_tail", "last tenth: whole / by difference", "ratio"),
    ("rebuild_whole_ms", "rebuild on another host, whole", "ms"),
    ("rebuild_diff_ms", "rebuild on another host, by difference", "ms"),
)


async def _main(rounds: int, stores: int, turn_bytes: int) -> None:
    async with throwaway_postgres("sessions") as (dsn, root, _data):
        print(
            f"bench.session_copies: {rounds} rounds of {stores} stores, {turn_bytes} bytes a "
            f"turn; {time.strftime('%Y-%m-%d %H:%M %Z')}"
        )
        found = []
        for n in range(1, rounds + 1):
            found.append(await _round(dsn, root, stores, turn_bytes, n))
            print(f"round {n}: " + ", ".join(f"{k}={v:.3g}" for k, v in found[-1].items()))
        print_medians(found, LABELS, width=50)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.session_copies", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="1 round of 100 stores")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--stores", type=int, default=None)
    parser.add_argument("--turn-bytes", type=int, default=6 * 1024)
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    stores = args.stores or (100 if args.quick else 400)
    trio.run(_main, rounds, stores, args.turn_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
