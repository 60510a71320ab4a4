"""Retention of finished deliveries' step journals (docs/design/retention.md RT1-RT3), the slice
built so far: a real room worker on a real state directory, its wall clock a virtual one moved
past the retention period."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Final

import pytest
import trio

from fake_pi.scenario import Hang, Step, Text
from runtime._cli import main
from runtime._clock import Clocks, MockWallClock, SystemSilenceClock
from runtime._config import ModelConfig, RetentionConfig, RoomWorkerConfig
from runtime._journal._inspect import verify_journal
from runtime._rooms._worker import open_room_worker

from .._workers import scripted_upstream
from .test_room_worker import message, next_results

LIMIT: Final = 60.0
DAY: Final = 86_400.0
A, B = "dm:1", "dm:2"


async def test_rt1_rt2_rt3_a_finished_acknowledged_journal_goes_after_its_days(
    tmp_path: Path,
) -> None:
    """RT2: a delivery answered and acknowledged eight days ago has its step journal removed
    (journal_days = 7), durably; RT3: a duplicate still gets its result, with its seq, and no
    model request; RT1: kept whatever their age are an unacknowledged result's journal and
    every journal of a room with a delivery still running. The state directory verifies, and
    a host restarted on it replays the running delivery and still knows the expired one."""
    wall = MockWallClock()
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    steps: list[Step] = [Text(text="old"), Text(text="old"), Text(text="a new"), Hang(seconds=3600)]
    hanging = trio.Event()

    async def arrived(n: int) -> None:
        if n == 4:
            hanging.set()  # b2's request: it hangs

    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=arrived) as (model, url):
            config = RoomWorkerConfig(
                model=ModelConfig(base_url=url), retention=RetentionConfig(journal_days=7)
            )
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                store = worker.store
                await worker.deliver(message("b1", room=B))
                await worker.deliver(message("a1", room=A))
                first = await next_results(worker, 2)
                await worker.ack(max(r.seq for r in first))  # b1 and a1 acknowledged
                await worker.deliver(message("a2", room=A))
                (unacked,) = await next_results(worker, 1, after=max(r.seq for r in first))
                await worker.deliver(message("b2", room=B))  # B stays busy: its model hangs
                await hanging.wait()
                wall.advance(6 * DAY)
                assert await worker.expire_journals() == 0  # not old enough yet
                wall.advance(2 * DAY)
                removed = await worker.expire_journals()
                kept = {d: await store.exists(store.delivery_rel(d)) for d in ("a1", "a2", "b1")}
                duplicate = await worker.deliver(message("a1", room=A))
                again = worker.result_of("a1")
                asked = [
                    r for r in model.requests if "(message m-a1)" in str(r.body["messages"][-1])
                ]
            # a restart on what retention left: the running b2 is replayed (the scenario is
            # spent: a plain answer) and a1 is still known (RT3)
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                after_restart = worker.result_of("a1")
                later = await next_results(worker, 2)  # a2 again (unacknowledged), and b2
    assert removed == 1
    assert kept == {"a1": False, "a2": True, "b1": True}  # a2 unacked; b1's room is busy
    assert duplicate.disposition == "duplicate"
    assert again == {r.delivery_id: r for r in first}["a1"]
    assert len(asked) == 1  # the duplicate asked nothing
    assert unacked.delivery_id == "a2"
    assert after_restart == again
    assert {(r.delivery_id, r.outcome) for r in later} == {("a2", "reply"), ("b2", "reply")}
    _, findings = verify_journal(tmp_path / "state")
    assert [f for f in findings if f.problem] == []


async def test_rt10_journal_compact_removes_them_on_demand_and_waits_for_no_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """RT10 (the built part): ``pi-runtime journal compact`` removes the step journals past
    ``journal_days`` of a state directory no server holds — here, results published ten days
    ago (the host's wall clock was set back) — and is refused ``state_dir_locked`` while a
    room worker holds it."""
    ten_days_ago = MockWallClock.reading(time.time_ns() // 1_000_000 - int(10 * DAY * 1000))
    clocks = Clocks(silence=SystemSilenceClock(), wall=ten_days_ago)
    compact = ["journal", "compact", "--state-dir", str(tmp_path / "state")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="old")]) as (_model, url):
            config = RoomWorkerConfig(model=ModelConfig(base_url=url))
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                await worker.deliver(message("a1", room=A))
                (result,) = await next_results(worker, 1)
                await worker.ack(result.seq)
                refused = await trio.to_thread.run_sync(main, compact)
                log = tmp_path / "state" / worker.store.delivery_rel("a1")
            kept = await trio.to_thread.run_sync(log.exists)
            compacted = await trio.to_thread.run_sync(main, compact)
            gone = not await trio.to_thread.run_sync(log.exists)
    assert refused == 1
    assert "is in use by pid" in caplog.text
    assert kept
    assert compacted == 0
    assert "removed 1 step journal older than 7 days" in capsys.readouterr().out
    assert gone
    elsewhere = ["journal", "compact", "--state-dir", str(tmp_path / "elsewhere")]
    assert await trio.to_thread.run_sync(main, elsewhere) == 1
    assert "holds no file-store journal" in caplog.text
    assert not await trio.to_thread.run_sync((tmp_path / "elsewhere").exists)  # not created
