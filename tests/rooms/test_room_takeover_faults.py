"""What a host holds as proof when it takes a room lane over, gives it up or fails to start it
(docs/design/scale-out.md S10, S12, S13), on a real, throw-away PostgreSQL with Fake-Pi workers
as real processes: a fault met while a claimed lane starts stays in that room, and a lane
given up is released only once its workers are stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio

from fake_pi._behaviours import Behaviours, FakeConfig
from runtime._errors import DiskFailedError, ReasonCode
from runtime._journal._fence import Fence
from runtime._journal._postgres import PgStore
from runtime._pi import _rpc
from runtime._pi import _worker as _pi_worker
from runtime._pi._launch import WorkerProgram
from runtime._pi._worker import StopPolicy
from runtime._rooms import _slot, _worker
from runtime._rooms._lane import Lane
from runtime._rooms._worker import RoomWorker, open_room_worker

from .._workers import scripted_upstream
from ..journal.pg_fixtures import execute, pg_dsn, pg_server
from .test_room_hosts import held_request, host, result_of
from .test_room_worker import config as room_config
from .test_room_worker import message

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses
LIMIT: Final = 60.0


async def test_s13_a_claimed_lane_that_cannot_start_stays_in_its_room(
    tmp_path: Path, pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """S13, L17: A answered d1 in dm:1, so dm:1's session is stored in the database; then a
    part of it is lost (a gap: ``journal_corrupt``, never a shorter session) and A stops,
    handing its lanes over. B claims dm:1 for d2 and its lane cannot rebuild the session.
    That fault is dm:1's: B gives that lane up and serves on — d3 in dm:2 is answered, B is
    not torn down (nor would the next host to claim dm:1 be) — and does not claim dm:1 again
    at once (a lease's time later at the earliest), so a lasting fault is not retried in a
    loop. d2 stays admitted and unanswered: nothing of dm:1 ran on B."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream([]) as (model, url):
            async with host(tmp_path, "a", pg_dsn, url) as a:
                await a.deliver(message("d1", "one", room="dm:1"))
                await result_of(a, "d1")
            parts = await execute(  # every part one byte further on: the first is missing
                pg_dsn,
                "UPDATE pi_runtime.documents SET name = name || '1' "
                "WHERE name LIKE 'sessions/%%' RETURNING name",
            )
            async with host(tmp_path, "b", pg_dsn, url) as b:
                queued = await b.deliver(message("d2", "two", room="dm:1"))
                if (lane := b._lanes.get("dm:1")) is not None:
                    await lane.stopped.wait()  # it fails as it starts (if not already gone)
                started = await b.deliver(message("d3", "three", room="dm:2"))
                d3 = await result_of(b, "d3")
                assert b.leases is not None
                held = b.leases.fence("dm:1")
                status = {lane.room for lane in b.status()}
                d2 = b.result_of("d2")
    assert parts
    assert queued.disposition in ("queued", "started")  # (the lane may fail after its take)
    assert started.disposition == "started"
    assert (d3.outcome, d3.seq) == ("reply", 2)
    assert d2 is None
    assert held is None
    assert status == {"dm:2"}
    assert model.request_count == 2  # d1 on A, d3 on B
    assert any(
        "dm:1" in r.getMessage() and ReasonCode.JOURNAL_CORRUPT in r.getMessage()
        for r in caplog.records
    )


async def test_s13_a_lane_failing_in_a_task_of_its_own_stays_in_its_room(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S13: a lane's fault met after it started, in a task of the lane's own nursery (its
    epoch's RPC channel ends with ``EIO``), leaves the lane as an exception group, not as the
    bare error the start's faults are. It stays that room's: the lane is given up (and not
    claimed here again for a lease's time), and the host answers dm:2. Before, the group
    passed the lane's ``except`` and took the host down."""
    real = _rpc.open_rpc_channel
    armed = trio.Event()

    @contextlib.asynccontextmanager
    async def failing(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async with real(*args, **kwargs) as rpc:
            yield rpc
        if armed.is_set():
            raise OSError(errno.EIO, "the channel's end met an I/O error")

    monkeypatch.setattr(_slot, "open_rpc_channel", failing)
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([]) as (model, url),
            host(tmp_path, "a", pg_dsn, url) as a,
        ):
            await a.deliver(message("d1", "one", room="dm:1"))
            d1 = await result_of(a, "d1")
            lane = a._lanes["dm:1"]
            armed.set()
            lane.stop_worker()  # its epoch ends: the channel's exit raises
            await lane.stopped.wait()
            armed = trio.Event()
            await a.deliver(message("d2", "two", room="dm:2"))
            d2 = await result_of(a, "d2")
            assert a.leases is not None
            held = a.leases.fence("dm:1")
    assert (d1.outcome, d2.outcome) == ("reply", "reply")
    assert lane.lost
    assert held is None
    assert model.request_count == 2


async def test_s10_s12_a_lane_given_up_mid_claim_is_released_only_once_its_workers_stopped(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S10, S12: A claims dm:1 for d1; its recovery has handed d1 to the lane, whose worker
    runs d1's turn (the model request held open), when the recovery's last step fails (the
    database out of reach). A gives the half-taken lane up — but its lease is the other
    hosts' proof that nothing of the lane runs here: released while the worker still lives,
    another host (on another machine, where it cannot kill that tree) would claim dm:1 at
    once and replay d1 beside it. So the lease is released only once the lane has stopped,
    its worker with it; d1 is answered at a later look."""
    asked, on_request = held_request(1)  # the first turn's request: never answered
    recover = RoomWorker._recover
    lanes: list[Lane] = []
    released: list[tuple[Fence, bool, bool]] = []

    async def recovered_then_failed(self: RoomWorker, rooms: set[str] | None = None) -> None:
        await recover(self, rooms)
        if not lanes and rooms is not None:
            lanes.append(self._lanes["dm:1"])
            await asked.wait()  # the lane's worker runs d1's turn
            raise DiskFailedError(ReasonCode.STORE_UNAVAILABLE, "the database is away (test)")

    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([], on_request=on_request) as (model, url),
            host(tmp_path, "a", pg_dsn, url) as a,
        ):
            store = a.store
            assert isinstance(store, PgStore)
            release = store.release

            async def seen_releasing(fence: Fence) -> None:
                if lanes and fence == lanes[0].fence:
                    released.append((fence, lanes[0].stopped.is_set(), lanes[0].live_worker))
                await release(fence)

            monkeypatch.setattr(RoomWorker, "_recover", recovered_then_failed)
            monkeypatch.setattr(store, "release", seen_releasing)
            accepted = await a.deliver(message("d1", "one", room="dm:1"))
            d1 = await result_of(a, "d1")
    assert accepted.disposition == "queued"
    (lane,) = lanes
    assert lane.lost
    assert released[0] == (lane.fence, True, False)  # stopped, no worker left, then released
    assert (d1.outcome, d1.seq) == ("reply", 1)
    assert model.request_count == 1  # the later look's (the held one was never answered)


async def test_s12_a_lost_lane_kills_its_workers_tree_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S11, S12: a lane given up because another host may own it now (a write refused, its
    lease's deadline passed) stops its worker's tree with no TERM grace: the KILL at once.
    The new owner replays the turn from the stored journal and session, so nothing is kept
    by letting the old worker finish; every moment it runs on is one a tool of it may run
    beside the new owner's replay — and a grace (here made two minutes long, the worker
    ignoring TERM) outlasts the lease's margin. Before, the stop waited out the grace."""
    config = tmp_path / "fake-config.json"
    config.write_bytes(msgspec.json.encode(FakeConfig(behaviours=Behaviours(ignore_sigterm=600))))
    program = WorkerProgram.fake_pi()
    ignoring = dataclasses.replace(
        program, command=(*program.command, "--fake-config", str(config))
    )
    monkeypatch.setattr(_worker, "worker_program", lambda settings: ignoring)
    monkeypatch.setattr(_pi_worker, "StopPolicy", functools.partial(StopPolicy, term_grace=120))
    asked, on_request = held_request(1)
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([], on_request=on_request) as (_model, url),
            open_room_worker(room_config("fake", url), base_dir=tmp_path) as worker,
        ):
            await worker.deliver(message("d1"))
            await asked.wait()
            lane = next(iter(worker._lanes.values()))
            (live,) = [s.live for s in (lane._room, lane._oneshot) if s is not None and s.live]
            epoch = live.worker
            lane.lose("its lease's deadline passed")
            await lane.stopped.wait()
            report = await epoch.stop()
    assert report.clean, report
    assert not report.graceful
    assert report.exit_status == -signal.SIGKILL
