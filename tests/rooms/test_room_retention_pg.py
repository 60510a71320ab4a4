"""Retention on PostgreSQL (docs/design/retention.md RT11, the built part): finished
deliveries' step journals removed from the database after ``journal_days``, by a real room
worker on a real PostgreSQL (``pgserver``), its wall clock a virtual one moved on."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import trio

from fake_pi.scenario import Hang, Step, Text
from runtime._clock import Clocks, MockWallClock, SystemSilenceClock
from runtime._config import ModelConfig, RetentionConfig, RoomWorkerConfig, StoreConfig
from runtime._rooms._worker import open_room_worker

from .._workers import scripted_upstream
from ..journal.pg_fixtures import execute, pg_dsn, pg_server
from .test_room_worker import message, next_results

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses
LIMIT: Final = 60.0
DAY: Final = 86_400.0
A, B, C = "dm:1", "dm:2", "dm:3"


async def test_rt11_step_journals_leave_the_database_after_their_days(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT11: eight days after their results were published and acknowledged, the step
    journals of a room's older deliveries are deleted from the database (their rows gone);
    kept are the room's latest one (another host may be about to recover from it), an
    unacknowledged one, and every one of a room with a delivery still running. A duplicate
    of a removed one still gets its result from the shared log, and asks the model
    nothing."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    steps: list[Step] = [*(Text(text=f"answer {n}") for n in range(4)), Hang(seconds=3600)]
    hanging = trio.Event()

    async def arrived(n: int) -> None:
        if n == 5:
            hanging.set()  # b2's request: room B stays busy

    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=arrived) as (model, url):
            config = RoomWorkerConfig(
                state_dir=str(tmp_path / "state"),
                work_root=str(tmp_path / "work"),
                model=ModelConfig(base_url=url),
                store=StoreConfig(url=pg_dsn, lease_seconds=60, poll_seconds=0.05, host_name="h1"),
                retention=RetentionConfig(journal_days=7),
            )
            async with open_room_worker(config, clocks=clocks) as worker:
                store = worker.store
                seen = 0
                for delivery_id, room in (("a1", A), ("a2", A), ("b1", B)):
                    await worker.deliver(message(delivery_id, room=room))
                    (result,) = await next_results(worker, 1, after=seen)
                    seen = result.seq
                await worker.ack(seen)
                await worker.deliver(message("c1", room=C))  # published, not acknowledged
                await next_results(worker, 1, after=seen)
                await worker.deliver(message("b2", room=B))
                await hanging.wait()
                wall.advance(8 * DAY)
                removed = await worker.expire_journals()
                kept = {
                    d: await store.exists(store.delivery_rel(d)) for d in ("a1", "a2", "b1", "c1")
                }
                rows = await execute(
                    pg_dsn,
                    "SELECT count(*) FROM pi_runtime.log_records WHERE log = %s",
                    [store.delivery_rel("a1")],
                )
                duplicate = await worker.deliver(message("a1", room=A))
                again = worker.result_of("a1")
    assert removed == 1  # a1: a2 is room A's latest acknowledged, b1's room is busy
    assert kept == {"a1": False, "a2": True, "b1": True, "c1": True}
    assert rows == [(0,)]
    assert duplicate.disposition == "duplicate"
    assert again is not None
    assert again.text == "answer 0"
    assert sum("(message m-a1)" in str(r.body["messages"][-1]) for r in model.requests) == 1
