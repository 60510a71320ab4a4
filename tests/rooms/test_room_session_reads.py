"""What a room lane reads of its long-lived session per delivery (docs/design/sessions.md
S14, lanes.md L18): a real room worker, Fake-Pi as a subprocess, a scripted model on
loopback. The bytes the runtime's process reads (``rchar`` of ``/proc/self/io``: every
``read`` of every thread; Fake-Pi's own reads are another process's) are counted around one
delivery, for a room whose session holds a long history."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Final

import trio

from fake_pi.scenario import Text
from runtime._journal._store import lane_key
from runtime._pi._pijson import stringify
from runtime._pi._session_files import create_session
from runtime._records import Outcome
from runtime._rooms._worker import open_room_worker

from .._workers import scripted_upstream
from .test_room_worker import ROOM, config, message, next_results

LIMIT: Final = 90.0
HISTORY: Final = 4_000_000
"""Bytes of history in the room's session before the test's deliveries."""


class StepClock:
    now = 1_795_978_317_155

    def time_ms(self) -> int:
        self.now += 1
        return self.now


def rchar() -> int:
    """Bytes this process has read so far, all threads (``/proc/self/io``)."""
    for row in Path("/proc/self/io").read_text().splitlines():
        if row.startswith("rchar:"):
            return int(row.split()[1])
    raise LookupError("rchar")


def long_history(session: Path) -> int:
    """The room's session, Pi-shaped, with ~4 MB of turns on a branch the model no longer
    sees (as a compaction leaves the old turns out of the context, the file keeping them);
    its leaf a ``custom`` entry under Pi's first lines, so each request stays small.
    Returns the file's size."""
    for directory in (session.parents[2], session.parents[1], session.parent):  # state/…
        directory.mkdir(mode=0o700)
    first = create_session(
        session, cwd="/work/room", provider="fake", model_id="fake-model", clock=StepClock()
    )
    assert first.leaf is not None
    parent, lines = first.leaf.id, []
    for number in random.sample(range(1 << 32), 12_000):
        entry_id = f"{number:08x}"
        text = f"an older turn of this room, long since answered {entry_id} " * 5
        message_ = {"role": "user", "content": [{"type": "text", "text": text}], "timestamp": 1}
        raw = {
            "type": "message",
            "id": entry_id,
            "parentId": parent,
            "timestamp": "2026-12-01T08:58:24.759Z",
            "message": message_,
        }
        lines.append(stringify(raw) + b"\n")
        parent = entry_id
    marker = {
        "type": "custom",
        "id": "0badcafe",
        "parentId": first.leaf.id,
        "timestamp": "2026-12-01T09:00:00.000Z",
        "customType": "pi-runtime/replay",
        "data": {"replay": True},
    }
    lines.append(stringify(marker) + b"\n")
    with session.open("ab") as f:
        f.write(b"".join(lines))
    size = os.stat(session).st_size
    assert size > HISTORY
    return size


async def test_s14_l18_a_delivery_to_a_room_with_a_long_history_reads_what_was_appended(
    tmp_path: Path,
) -> None:
    """S14, L18: a room's session holds ~4 MB of history. Its first delivery after the
    host starts reads the file whole once (the count sees the session: the runtime read
    more than the file). Its next delivery — the admission's leaf and the result's leaf —
    reads what the turn appended and a few hundred bytes more, not the history: under an
    eighth of the file in all, the turn's own traffic (the worker's events, the model's
    request and answer, the journal) included. Before S14 each of those two leaf reads
    read and parsed the whole file."""
    session = tmp_path / "state" / "lanes" / lane_key(ROOM) / "session.jsonl"
    size = await trio.to_thread.run_sync(long_history, session)
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([Text(text="one"), Text(text="two")]) as (_model, url),
            open_room_worker(config("fake", url), base_dir=tmp_path) as worker,
        ):
            start = rchar()
            await worker.deliver(message("d1"))
            (first,) = await next_results(worker, 1)
            between = rchar()
            await worker.deliver(message("d2"))
            (second,) = await next_results(worker, 1, after=first.seq)
            end = rchar()
    assert [(r.outcome, r.text) for r in (first, second)] == [
        (Outcome.REPLY, "one"),
        (Outcome.REPLY, "two"),
    ]
    assert between - start > size  # the lane's first read is whole, and counted
    assert end - between < size // 8, f"read {end - between} bytes for one delivery"
