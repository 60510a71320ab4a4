"""A room worker restarted with its wall clock stepped (docs/design/clocks.md C5,
docs/design/retention.md PB2, PB3): a real room worker with Fake-Pi workers on a real state
directory, its model an upstream on loopback that refuses the first host's tries (503) and
answers the next host's. The first host parks a delivery and stops; the next starts on the
same directory with its wall clock an hour behind, or an hour ahead, of the one the park was
written with (a :class:`~runtime._clock.MockWallClock` following Trio's real clock).

The real clock: the workers are real processes. The park's wait is the shipped first step
(2.5 to 5 s), so the first host is stopped before it asks again."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import trio

from runtime._clock import Clocks, MockWallClock, SystemWallClock
from runtime._config import BackoffConfig
from runtime._records import Outcome
from runtime._rooms._worker import open_room_worker

from .test_room_backoff import LIMIT, Outage, config, outage_upstream, parked, parks_of
from .test_room_worker import message, next_results

__all__ = ["parked"]  # the fixture, used by name

HOUR_MS: Final = 3_600_000
BACKOFF: Final = BackoffConfig(first_seconds=5, max_seconds=300, deadline_minutes=30)
"""The shipped schedule: the first wait is 2.5 to 5 s, the deadline 30 minutes."""


@pytest.mark.parametrize("step_ms", [-HOUR_MS, HOUR_MS], ids=["set-back", "set-forward"])
async def test_c5_pb2_pb3_a_host_restarted_with_its_clock_stepped_keeps_a_parked_delivery_bounded(
    step_ms: int, tmp_path: Path, parked: trio.Event
) -> None:
    """C5: set back an hour, the next host asks the provider again within the park's own
    wait (5 s) of its start and the delivery is answered — before, it waited the hour too
    (its wait was the recorded time less a clock an hour behind: past its 30-minute
    deadline, nothing asked). Set forward an hour, past the episode's deadline: it cannot
    be told from a host that was down an hour, and the delivery ends ``model_failed`` at
    once, the provider asked nothing more — a result, nothing lost (PB3)."""
    outage = Outage(seconds=0, at_least=1_000_000)  # the first host's every try refused
    with trio.fail_after(LIMIT):
        async with outage_upstream(outage) as url:
            async with open_room_worker(config(url, BACKOFF), base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                await parked.wait()
            refused = len(outage.down)
            outage.at_least = 0  # the provider is back for the next host
            stepped = MockWallClock.reading(SystemWallClock().time_ms() + step_ms)
            clocks = Clocks(wall=stepped)
            async with open_room_worker(
                config(url, BACKOFF), base_dir=tmp_path, clocks=clocks
            ) as worker:
                started = trio.current_time()
                (result,) = await next_results(worker, 1)
                ended = trio.current_time()
                parks = await parks_of(worker, "d1")
    assert parks
    assert outage.up + len(outage.down) - refused <= 1  # at most one try after the restart
    if step_ms < 0:
        assert (result.outcome, result.code) == (Outcome.REPLY, None)
        assert outage.up == 1
        # the park's wait (at most 5 s) and a worker's launch — not the hour
        assert ended - started < 5 + 60
    else:
        assert (result.outcome, result.code) == (Outcome.FAILED, "model_failed")
        assert (outage.up, len(outage.down)) == (0, refused)
