"""What reading a room's session costs at each admission (docs/design/sessions.md S14).

Run it from the repository root::

    .venv/bin/python -m bench.session_leaf                 # sessions of 1, 10 and 70 MB
    .venv/bin/python -m bench.session_leaf --sizes 1,10    # a quicker run

A room lane reads its long-lived session file at each delivery's admission and again for the
result's leaf (``Lane._leaf``). Per size, one Pi-shaped session is written (the entry shapes
of ``tests/data/pi-1.6.0``: a system message, then turns of a user message, assistant
messages with tool calls, their tool results of a long-tailed size, a closing reply; now and
then a ``custom`` entry, a ``context_edit`` and a ``compaction``), and each case runs in a
fresh interpreter of its own (so one case's memory is not another's):

* **whole**: what an admission did before S14 — ``read_session`` (read and parse the whole
  file) for its leaf, in a Trio worker thread as the lane runs it;
* **index, first read**: :class:`~runtime._pi._session_index.SessionIndex` on a file it has
  not seen (a lane's first admission after a start: the file streamed once);
* **index, one turn later**: the index warm, one Pi-shaped turn (4 entries) appended, then
  the leaf read again: what every later admission costs.

Per case, ``--reps`` repetitions (the median, and the largest, reported): wall time, CPU time
of the process, the peak resident memory above what it was before (``VmHWM`` after resetting
it through ``/proc/self/clear_refs``), the bytes read from the file, and how late the Trio
thread woke a task sleeping 1 ms meanwhile — the read runs in a worker thread, but the parse
holds the GIL, and a late loop delays every lane of the host. Then what an index keeps per
room (``tracemalloc``: the bytes still allocated once it has read the file). Nothing asserts:
the figures go into ``docs/design/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import trio

from runtime._pi._pijson import iso_timestamp, stringify

MB: Final = 1_000_000
SYSTEM_TEXT: Final = "You are a coding assistant running inside pi. " * 110  # ~5 KB, as Pi's
WORDS: Final = (
    *("the", "build", "failed", "on", "main", "after", "the", "merge", "please", "look"),
    *("at", "the", "logs", "and", "tell", "me", "what", "changed", "in", "the", "config"),
    *("since", "yesterday", "then", "fix", "the", "test", "and", "open", "a", "pull"),
)


class PiShaped:
    """Writes a session as Pi 1.6.0 does: one ``JSON.stringify`` line per entry."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now_ms = 1_796_115_504_756
        self.leaf: str | None = None
        self.ids: set[str] = set()
        self.turn = 0
        self.since_compaction: list[str] = []

    def _id(self) -> str:
        while (candidate := f"{self.rng.getrandbits(32):08x}") in self.ids:
            pass
        self.ids.add(candidate)
        return candidate

    def _words(self, low: int, high: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(low, high)))

    def entry(self, kind: str, **fields: Any) -> bytes:
        self.now_ms += self.rng.randint(5, 4000)
        entry_id = self._id()
        raw = {
            "type": kind,
            "id": entry_id,
            "parentId": self.leaf,
            "timestamp": iso_timestamp(self.now_ms),
            **fields,
        }
        self.leaf = entry_id
        self.since_compaction.append(entry_id)
        return stringify(raw) + b"\n"

    def message(self, message: dict[str, Any]) -> bytes:
        return self.entry("message", message={**message, "timestamp": self.now_ms})

    def _assistant(self, content: list[dict[str, Any]], stop: str) -> bytes:
        tokens = self.rng.randint(500, 90_000)
        return self.message(
            {
                "role": "assistant",
                "content": content,
                "api": "openai-completions",
                "provider": "openai",
                "model": "gpt-4.1",
                "usage": {
                    "input": tokens,
                    "output": self.rng.randint(1, 900),
                    "cacheRead": 0,
                    "cacheWrite": 0,
                    "reasoning": 0,
                    "totalTokens": tokens + 100,
                    "cost": {
                        "input": 0,
                        "output": 0,
                        "cacheRead": 0,
                        "cacheWrite": 0,
                        "total": 0,
                        "totalFromProvider": False,
                    },
                },
                "stopReason": stop,
                "responseId": f"chatcmpl-{self.rng.getrandbits(64):x}",
                "rawStopReason": "tool_calls" if stop == "toolUse" else "stop",
                "durationMs": self.rng.randint(300, 30_000),
                "thinkingLevel": "off",
            }
        )

    def start(self) -> bytes:
        header = {
            "type": "session",
            "version": 3,
            "id": "019ae0b1-5a1c-7e3a-9c2f-0b4d5e6f7a81",
            "timestamp": iso_timestamp(self.now_ms),
            "cwd": "/var/lib/pi-runtime/rooms/bench",
        }
        lines = stringify(header) + b"\n"
        lines += self.entry("model_change", provider="openai", modelId="gpt-4.1")
        lines += self.entry("thinking_level_change", thinkingLevel="off")
        lines += self.message({"role": "system", "content": SYSTEM_TEXT})
        return lines

    def turn_lines(self) -> bytes:
        """One delivery's turn: the user's message, 0-3 tool rounds, the reply."""
        self.turn += 1
        text = f"[Ann] {self._words(5, 60)}"
        out = self.message({"role": "user", "content": [{"type": "text", "text": text}]})
        for call in range(self.rng.choice((0, 1, 1, 2, 3))):
            call_id = f"call_{self.turn}_{call}"
            command = {"command": f"cd repo && {self._words(3, 12)}"}
            block = {"type": "toolCall", "id": call_id, "name": "bash", "arguments": command}
            out += self._assistant([block], "toolUse")
            size = min(int(self.rng.lognormvariate(6.8, 1.4)), 50_000)  # median ~900 B
            output = (self._words(1, 12) + "\n") * max(1, size // 60)
            out += self.message(
                {
                    "role": "toolResult",
                    "toolCallId": call_id,
                    "toolName": "bash",
                    "content": [{"type": "text", "text": output[:size]}],
                    "isError": False,
                    "durationMs": self.rng.randint(5, 9000),
                }
            )
        reply = [{"type": "text", "text": self._words(20, 300)}]
        out += self._assistant(reply, "stop")
        if self.turn % 50 == 0:
            out += self.entry("custom", customType="pi-runtime/replay", data={"replay": True})
        if self.turn % 97 == 0 and self.leaf is not None:
            out += self.entry("context_edit", targetId=self.leaf, replacement=None)
        if self.turn % 400 == 0:  # Pi's automatic compaction: an entry, the file only grows
            kept = self.since_compaction[-12]
            out += self.entry(
                "compaction",
                summary=self._words(200, 600),
                firstKeptEntryId=kept,
                tokensBefore=self.rng.randint(100_000, 200_000),
            )
            self.since_compaction = []
        return out


def write_session(path: Path, size: int, seed: int = 7) -> PiShaped:
    """A Pi-shaped session of about ``size`` bytes at ``path``; the writer, to go on."""
    pi = PiShaped(seed)
    with path.open("wb") as f:
        written = f.write(pi.start())
        while written < size:
            written += f.write(pi.turn_lines())
    return pi


# ------------------------------------------------------------------------------ one case


def _vm(field: str) -> int:
    """``field`` of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise LookupError("rchar")


async def _timed(read: Callable[[], object]) -> dict[str, float]:
    """``read`` in a Trio worker thread (as the lane runs it) while a task on the Trio thread
    sleeps 1 ms again and again: the wall and CPU time, the peak memory above the start, the
    bytes read, and how late that task woke at worst."""
    late = 0.0
    done = False

    async def ticker() -> None:
        nonlocal late
        while not done:
            start = time.perf_counter()
            await trio.sleep(0.001)
            late = max(late, time.perf_counter() - start - 0.001)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.01)
        _reset_peak()
        rss, rchar = _vm("VmRSS"), _rchar()
        cpu, wall = time.process_time(), time.perf_counter()
        await trio.to_thread.run_sync(read)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        peak, read_bytes = _vm("VmHWM") - rss, _rchar() - rchar
        done = True
    return {"wall": wall, "cpu": cpu, "peak": peak, "read": read_bytes, "late": late}


async def _case(case: str, path: Path, reps: int) -> list[dict[str, float]]:
    from runtime._pi._session_files import read_session

    samples = []
    if case == "whole":
        for _ in range(reps):
            samples.append(await _timed(lambda: read_session(path).session.leaf))
    elif case == "cold":
        from runtime._pi._session_index import SessionIndex

        for _ in range(reps):
            samples.append(await _timed(SessionIndex(path).read))
    elif case == "warm":
        from runtime._pi._session_index import SessionIndex

        pi = PiShaped(11)
        pi.leaf = read_session(path).session.leaf.id  # type: ignore[union-attr]
        index = SessionIndex(path)
        index.read()
        for _ in range(reps):
            with path.open("ab") as f:  # one Pi-shaped turn of 4 entries
                f.write(pi.message({"role": "user", "content": [{"type": "text", "text": "hi"}]}))
                block = {"type": "toolCall", "id": "c", "name": "bash", "arguments": {}}
                f.write(pi._assistant([block], "toolUse"))
                f.write(pi.message({"role": "toolResult", "toolCallId": "c", "content": []}))
                f.write(pi._assistant([{"type": "text", "text": "done"}], "stop"))
            samples.append(await _timed(index.read))
            if index.read().leaf != pi.leaf:
                raise SystemExit("the index's leaf is not the last entry")
    elif case == "kept":
        from runtime._pi._session_index import SessionIndex

        SessionIndex(path).read()  # the module's own first-use caches, not a room's
        tracemalloc.start()
        index = SessionIndex(path)
        before = tracemalloc.get_traced_memory()[0]
        entries = index.read().entries
        kept = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        samples.append({"kept": kept, "entries": entries})
    return samples


def child(case: str, path: str, reps: int) -> None:
    samples = trio.run(_case, case, Path(path), reps)
    print(json.dumps(samples))


# ------------------------------------------------------------------------------- the run


def run_case(case: str, path: Path, reps: int) -> list[dict[str, float]]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.session_leaf", "--child", case, str(path), str(reps)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: list[dict[str, float]] = json.loads(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,10,70", help="session sizes, MB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cases", default="whole,cold,warm,kept")
    parser.add_argument("--dir", default=None, help="where the sessions are written")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    cases = args.cases.split(",")
    names = {
        "whole": "whole (before S14)",
        "cold": "index, first read",
        "warm": "index, one turn later",
    }
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}")
    print(
        f"{'session':>8} {'entries':>8} {'case':<22} {'wall ms':>14} {'cpu ms':>8} "
        f"{'peak MB':>8} {'read KB':>9} {'loop late ms':>13}"
    )
    base = Path(tempfile.mkdtemp(prefix="bench-session-leaf-", dir=args.dir))
    try:
        for size in (float(s) for s in args.sizes.split(",")):
            path = base / f"session-{size:g}.jsonl"
            pi = write_session(path, int(size * MB))
            actual = path.stat().st_size / MB
            for case in cases:
                if case == "kept":
                    (kept,) = run_case("kept", path, 1)
                    print(
                        f"{actual:>7.1f}M {len(pi.ids):>8} {'index kept in memory':<22} "
                        f"{kept['kept'] / 1e3:>11.1f} KB "
                        f"({kept['kept'] / max(kept['entries'], 1):.1f} B/entry)"
                    )
                    continue
                target = path
                if case == "warm":
                    target = base / "warm.jsonl"
                    shutil.copyfile(path, target)
                samples = run_case(case, target, args.reps)
                wall = [s["wall"] * 1e3 for s in samples]
                print(
                    f"{actual:>7.1f}M {len(pi.ids):>8} {names[case]:<22} "
                    f"{statistics.median(wall):>7.1f} ({max(wall):>5.0f}) "
                    f"{statistics.median(s['cpu'] for s in samples) * 1e3:>8.1f} "
                    f"{statistics.median(s['peak'] for s in samples) / MB:>8.1f} "
                    f"{statistics.median(s['read'] for s in samples) / 1e3:>9.1f} "
                    f"{max(s['late'] for s in samples) * 1e3:>13.1f}"
                )
            sys.stdout.flush()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"max RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss} KB")


if __name__ == "__main__":
    main()
