"""A host out of file descriptors (EMFILE/ENFILE): the lane's problem, never the host's
(docs/design/lanes.md L21).

The exhaustion is injected where the store opens files (its ``FileSystem``): the open of one
room's files fails with the errno the kernel gives when the process (``EMFILE``) or the
system (``ENFILE``) has no descriptor left, the first few times, then succeeds — as when
other rooms' descriptors are freed meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path
from typing import Final

import pytest
import trio

from fake_pi.scenario import Hang, Step, Text
from runtime import _backoff as backoff_module
from runtime._boundary._boundaries import Boundaries
from runtime._config import Caps, RoomConfig
from runtime._journal._interface import Log
from runtime._journal._store import delivery_key, lane_key
from runtime._linux._fs import OsFileSystem
from runtime._records import Outcome, StepAbandoned
from runtime._rooms import _slot as slot_module
from runtime._rooms._worker import RoomWorker, open_room_worker
from runtime._wire import DeliveryResult

from .._descriptors import descriptors_left, then_cancel
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
    tmp_path: Path, code: int, whose: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L21: the open of a room's lane log (or of its delivery's log) fails with
    ``EMFILE``/``ENFILE`` three times. Tries to break: the failure leaving the room worker's
    nursery and stopping the whole host (the benchmark's ``journal_poisoned`` stop), the log
    poisoned for a failed *open* (no write failed: nothing to bound), the store taking it for
    a disk failure and refusing admissions, or the admitted delivery lost or ended with a
    wrong code. Expected: another room is served meanwhile, admissions go on, the delivery
    waits and then runs once descriptors are back — exactly one result, a reply."""
    monkeypatch.setattr(backoff_module, "DESCRIPTORS_FIRST", 0.01)  # (how long is not tested)
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
            first: list[DeliveryResult] = []
            async for result in w.results(None):  # up to a1's (b1's may come first)
                first.append(result)
                if result.delivery_id == "a1":
                    break
            await w.deliver(message("a2"))  # admissions go on (a1 done: a2 is a turn of its own)
            rest = await next_results(w, 3 - len(first), after=first[-1].seq)
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


# ------------------------------------------------------------ the process really out of them


class _Noticed(logging.Handler):
    """Sets ``event`` at the first record of WARNING or above, from any logger: every want
    of a descriptor the host meets must be said (the lane's ``descriptors_exhausted``, an
    accept loop's retry) — one it swallowed would leave the test waiting, and failing."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.event = trio.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.event.set()


SWEEP: Final = range(15)
"""Free descriptors left when a delivery comes: from none to more than its whole turn needs
(its lane log, session, delivery log, boundaries' sockets, the worker's pipes and files)."""


@pytest.mark.parametrize("room_before", ["new", "served_before_a_restart"])
async def test_l21_the_process_really_out_of_descriptors_at_every_step_of_a_turn(
    tmp_path: Path, room_before: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L21 with the kernel's own ``EMFILE``: for each number of free descriptors in
    :data:`SWEEP`, a delivery comes to a room of its own — a new room, or one served before
    the host restarted (its lane log's first append after a restart) — while the process has
    only that many left; the table is freed once the host says it met the want (or the
    reply came). Tries to break, at whichever step the descriptors run out: the lane's log
    poisoned by its directory's sync (the host stopped ``journal_poisoned``), the worker's
    settings file or its cgroup failing the lane (the host stopped), the delivery's log
    poisoned (``failed journal_poisoned``), the spawn charged as the worker's death until
    ``failed recovery_exhausted``, a want met and never said. Expected: every delivery
    replies exactly once, charged no recovery attempt (its log holds no abandoned step),
    the host serves another room after each, nothing is poisoned, and the sweep spans both
    ends — its first step meets the want, its last does not."""
    monkeypatch.setattr(backoff_module, "DESCRIPTORS_FIRST", 0.01)  # (how long is not tested)
    rooms = {f"dm:3{k:02d}": RoomConfig() for k in SWEEP}
    rooms[ROOM] = RoomConfig()
    noticed_at: dict[int, list[str]] = {}
    with trio.fail_after(LIMIT * 2):
        async with scripted_upstream([Text(text="hi")] * (3 * len(SWEEP) + 2)) as (_model, url):
            cfg = config("fake", url, rooms=rooms)
            after = None
            if room_before != "new":
                async with open_room_worker(cfg, base_dir=tmp_path) as w:
                    for room in rooms:
                        await w.deliver(message(f"b-{room}", room=room))
                    after = (await next_results(w, len(rooms)))[-1].seq
            async with open_room_worker(cfg, base_dir=tmp_path) as w:
                for k in SWEEP:
                    room = f"dm:3{k:02d}"
                    noticed = _Noticed()
                    logging.getLogger().addHandler(noticed)
                    try:
                        replied = trio.Event()
                        found: list[DeliveryResult] = []

                        async with trio.open_nursery() as nursery:
                            with descriptors_left(k) as release:
                                await w.deliver(message(f"d{k}", room=room))
                                nursery.start_soon(_collect, w, after, found, replied)
                                async with trio.open_nursery() as first:
                                    for event in (noticed.event, replied):
                                        first.start_soon(then_cancel, event, first.cancel_scope)
                                release()
                    finally:
                        logging.getLogger().removeHandler(noticed)
                    noticed_at[k] = noticed.messages
                    (result,) = found
                    assert (result.delivery_id, result.outcome, result.code) == (
                        f"d{k}",
                        Outcome.REPLY,
                        None,
                    ), k
                    records = (await w.store.read_delivery_log(f"d{k}")).records
                    assert not [r for r in records if isinstance(r, StepAbandoned)], k  # L19
                    await w.deliver(message(f"a{k}"))  # the host goes on
                    (other,) = await next_results(w, 1, after=result.seq)
                    assert (other.delivery_id, other.outcome) == (f"a{k}", Outcome.REPLY)
                    after = other.seq
                assert w.store.disk_failure is None
                state = w.store.root
    assert _poisons(state) == []
    assert noticed_at[SWEEP[0]], "the sweep's first step met no want of a descriptor"
    assert not noticed_at[SWEEP[-1]], noticed_at[SWEEP[-1]]


async def _collect(
    w: RoomWorker, after: int | None, found: list[DeliveryResult], replied: trio.Event
) -> None:
    found.extend(await next_results(w, 1, after=after))
    replied.set()


def _open_files() -> list[str]:
    """What this process's descriptors point at (a socket as ``socket:[inode]``)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
    return found


async def test_l21_an_idle_room_holds_no_descriptor(tmp_path: Path) -> None:
    """L21: descriptors must not grow with the rooms a host has served. Twelve rooms are
    served one after another with one live worker allowed (each new room's worker stops
    the last one's, L8), so eleven of them end idle with no worker. Tries to break: an idle
    lane keeping its ``lane.log`` open, or its slot's boundaries (the gateway's and the
    gate's listeners, the gateway's upstream connection) — a host with tens of thousands
    of rooms then runs out (the benchmark's stop at ~20,000 rooms). Expected: the process
    holds what it held with one room served (give or take the one room whose worker is
    live), and a lane log is open only for the room whose worker is live."""
    rooms = {f"dm:5{i:02d}": RoomConfig() for i in range(12)}
    rooms[ROOM] = RoomConfig()
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="hi")] * (len(rooms) + 1)) as (_model, url):
            cfg = config("fake", url, rooms=rooms, caps=Caps(max_live_workers=1))
            async with open_room_worker(cfg, base_dir=tmp_path) as w:
                await w.deliver(message("a1"))
                (last,) = await next_results(w, 1)
                before = _open_files()
                for room in rooms:
                    if room != ROOM:
                        await w.deliver(message(f"b-{room}", room=room))
                        (last,) = await next_results(w, 1, after=last.seq)
                        assert last.outcome is Outcome.REPLY
                after = _open_files()
    grown = len(after) - len(before)
    assert grown <= 5, f"{grown} more descriptors after 12 rooms: {sorted(after)}"
    assert sum(path.endswith("lane.log") for path in after) <= 1, sorted(after)


async def test_l21_l19_a_recovered_delivery_that_waits_for_descriptors_is_charged_its_restart_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L21, L19: the host stops while a delivery's turn waits for the model; at the next
    start that delivery is recovered — charged one attempt for the restart — and its slot's
    boundaries cannot be opened for want of a descriptor four times. Tries to break: each
    taking-up again charging the restart anew (the delivery ends ``failed
    recovery_exhausted`` having never run again). Expected: it is answered, and its log
    holds exactly one abandoned step, the restart's."""
    monkeypatch.setattr(backoff_module, "DESCRIPTORS_FIRST", 0.01)  # (how long is not tested)
    asked = trio.Event()

    async def arrived(n: int) -> None:
        await trio.lowlevel.checkpoint()
        asked.set()

    serve = slot_module.Slot.serve
    refused = 0

    async def out_of_descriptors(
        self: slot_module.Slot, nursery: trio.Nursery, log: Log, key: str
    ) -> Boundaries:
        nonlocal refused
        if refused < 4:
            refused += 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return await serve(self, nursery, log, key)

    with trio.fail_after(LIMIT):
        steps: list[Step] = [Hang(seconds=60), Text(text="after")]
        async with scripted_upstream(steps, on_request=arrived) as (_model, url):
            cfg = config("fake", url)
            async with open_room_worker(cfg, base_dir=tmp_path) as w:
                await w.deliver(message("d1"))
                await asked.wait()  # the host stops mid-turn
            monkeypatch.setattr(slot_module.Slot, "serve", out_of_descriptors)
            async with open_room_worker(cfg, base_dir=tmp_path) as w:
                (result,) = await next_results(w, 1)
                log = await w.store.read_delivery_log("d1")
    assert refused == 4
    assert (result.delivery_id, result.outcome, result.text) == ("d1", Outcome.REPLY, "after")
    assert [r.reason for r in log.records if isinstance(r, StepAbandoned)] == ["host_restart"]
