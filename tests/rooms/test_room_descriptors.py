"""A host out of file descriptors (EMFILE/ENFILE): the lane's problem, never the host's
(docs/design/lanes.md L21).

The exhaustion is injected where the store opens files (its ``FileSystem``): the open of one
room's files fails with the errno the kernel gives when the process (``EMFILE``) or the
system (``ENFILE``) has no descriptor left, the first few times, then succeeds — as when
other rooms' descriptors are freed meanwhile.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Final

import pytest
import trio

from fake_pi.scenario import Text
from runtime._config import RoomConfig
from runtime._journal._store import delivery_key, lane_key
from runtime._linux._fs import OsFileSystem
from runtime._records import Outcome
from runtime._rooms._worker import open_room_worker

from .._workers import scripted_upstream
from .test_room_worker import LIMIT, ROOM, config, message, next_results

OTHER: Final = "dm:200"


class OutOfDescriptors(OsFileSystem):
    """Opening a file whose path holds ``marker`` fails with ``code`` ``times`` times (the
    opens that create or append to a log, and whole-file reads), then works."""

    def __init__(self, marker: str, code: int, times: int) -> None:
        self.marker = marker
        self.code = code
        self.left = times
        self.refused: list[str] = []

    def _check(self, path: str) -> None:
        if self.marker in path and self.left > 0:
            self.left -= 1
            self.refused.append(path)
            raise OSError(self.code, os.strerror(self.code), path)

    def open_append(self, path: str) -> int:
        self._check(path)
        return super().open_append(path)

    def open_write(self, path: str) -> int:
        self._check(path)
        return super().open_write(path)

    def open_exclusive(self, path: str) -> int:
        self._check(path)
        return super().open_exclusive(path)

    def read(self, path: str) -> bytes:
        self._check(path)
        return super().read(path)


def _poisons(root: Path) -> list[Path]:
    return sorted(root.rglob("*.poison"))


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
@pytest.mark.parametrize("whose", ["lane", "delivery"])
async def test_l21_a_lane_out_of_descriptors_waits_and_the_host_goes_on(
    tmp_path: Path, code: int, whose: str
) -> None:
    """L21: the open of a room's lane log (or of its delivery's log) fails with
    ``EMFILE``/``ENFILE`` three times. Tries to break: the failure leaving the room worker's
    nursery and stopping the whole host (the benchmark's ``journal_poisoned`` stop), the log
    poisoned for a failed *open* (no write failed: nothing to bound), the store taking it for
    a disk failure and refusing admissions, or the admitted delivery lost or ended with a
    wrong code. Expected: another room is served meanwhile, admissions go on, the delivery
    waits and then runs once descriptors are back — exactly one result, a reply."""
    marker = lane_key(OTHER) if whose == "lane" else delivery_key("b1")
    fs = OutOfDescriptors(marker, code, times=3)
    rooms = {ROOM: RoomConfig(), OTHER: RoomConfig()}
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([Text(text="hi")] * 3) as (_model, url),
            open_room_worker(config("fake", url, rooms=rooms), base_dir=tmp_path, fs=fs) as w,
        ):
            await w.deliver(message("a1"))
            await w.deliver(message("b1", room=OTHER))  # admitted: durable (L1)
            first = await next_results(w, 1)
            await w.deliver(message("a2"))  # admissions go on
            rest = await next_results(w, 2, after=first[-1].seq)
            assert w.store.disk_failure is None
            state = w.store.root
    assert len(fs.refused) == 3
    results = {r.delivery_id: (r.outcome, r.code) for r in [*first, *rest]}
    assert results == {
        "a1": (Outcome.REPLY, None),
        "b1": (Outcome.REPLY, None),
        "a2": (Outcome.REPLY, None),
    }
    assert _poisons(state) == []
