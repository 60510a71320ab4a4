"""A message to a room whose turn is *parked* (docs/design/lanes.md L10, L25): the turn exists —
its delivery is the lane's current one — but no live worker run takes steers.

The states a room's turn is parked in:

* **waiting out an unavailable provider** (retention.md PB1): the turn met a 503, its park is
  durable, its worker is stopped, and the lane waits for the route's breaker;
* **between a worker's death and its replay** (L9): the epoch fenced, the session branched
  back, a new worker launching;
* **a stalled turn's abort grace** (L20): the turn's outcome is decided (``turn_stalled``), its
  worker told to abort and not yet settled or fenced — a run that still *takes* steers but
  will answer nothing.

What must hold for a message arriving then, whatever the state: it is never lost (it ends
with exactly one result), never ``absorbed`` unless a model request of the run that answers
carried its text, and never answered twice (no turn of its own when it was absorbed; its text
in no model request of two answered turns). Each case is checked while parked, as the turn
un-parks, and across a restart of the host on the same state directory while the message is
held for the parked turn.

Real processes: Fake-Pi workers as subprocesses, real journal files, a scripted model on
loopback. The provider's waits run on :func:`runtime.testing.io_aware_autojump_clock` (it
jumps only while no worker lives and no journal write is in flight: while the turn is
parked), at the shipped backoff; the stall cases on ``test_room_stall.py``'s driven clock.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import trio.testing

from fake_pi._behaviours import Behaviours
from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import HttpError, Step, Text
from runtime._clock import Clocks
from runtime._config import BackoffConfig, RoomConfig
from runtime._records import AbsorbedInput, EpochStarted, Outcome, Parked, StepAbandoned
from runtime._rooms._lane import Lane
from runtime._rooms._worker import RoomWorker, open_room_worker
from runtime._wire import DeliveryResult
from runtime.testing import io_aware_autojump_clock

from .._workers import scripted_upstream, waiting_bash
from .test_room_stall import (
    Aborts,
    Alive,
    Driver,
    Probe,
    _behaving,
    _until_fenced,
    _until_stalled,
    room_worker,
    serving,
)
from .test_room_stall import aborts as aborts  # fixtures, shared with the stall tests
from .test_room_stall import driver as driver
from .test_room_stall import message as stall_message
from .test_room_stall import probe as probe
from .test_room_stall import virtual_clock as virtual_clock
from .test_room_worker import ROOM, _lane_epochs, config, next_results
from .test_steer_carry import rendered, user_texts

LIMIT: Final = 20 * 60.0
"""Virtual seconds: a hang fails the test, it is not waited for."""
GRANTS: Final = {ROOM: RoomConfig(grants=frozenset({"bash", "send_text_update"}))}
BACKOFF: Final = BackoffConfig()
"""The shipped backoff: a first wait of 5 s (2.5 s at least, equal jitter)."""
DOWN: Final = HttpError(status=503, message="the service is overloaded")


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return io_aware_autojump_clock(follow_children=True)


def message(delivery_id: str, text: str) -> dict[str, Any]:
    return {
        "delivery_id": delivery_id,
        "room": ROOM,
        "author": {"id": "u1", "name": "Ann"},
        "message_id": f"m-{delivery_id}",
        "text": text,
    }


def text_of(delivery_id: str, text: str) -> str:
    """What a warm lane's prompt — and a steer — of that message sends."""
    return rendered(text, f"m-{delivery_id}")


def carrying(model: ScriptedModel, text: str) -> list[int]:
    """The upstream requests (0-based, in arrival order) that *add* ``text``: one of their
    user messages after the last message of another role (what the worker added since its
    last answer) is exactly it. A later turn's request holding it in the room's history
    does not count."""
    found = []
    for n, request in enumerate(model.requests):
        added: list[str] = []
        for item in reversed(request.body["messages"]):
            if item.get("role") != "user":
                break
            added.append(user_texts({"messages": [item]})[0])
        if text in added:
            found.append(n)
    return found


async def first_steps(worker: RoomWorker, owner: str, steered: str) -> list[int | None]:
    contents = await worker.store.read_delivery_log(owner)
    return [
        r.first_step
        for r in contents.records
        if isinstance(r, AbsorbedInput) and r.delivery_id == steered
    ]


async def records(worker: RoomWorker, delivery_id: str) -> list[Any]:
    return list((await worker.store.read_delivery_log(delivery_id)).records)


def outcomes(results: list[DeliveryResult]) -> dict[str, tuple[Outcome, str | None, str | None]]:
    """Each delivery's one result (a second one fails here: never answered twice)."""
    seen: dict[str, tuple[Outcome, str | None, str | None]] = {}
    for r in results:
        assert r.delivery_id not in seen, ("answered twice", r, seen)
        seen[r.delivery_id] = (r.outcome, r.text, r.absorbed_into)
    return seen


async def nothing_more(worker: RoomWorker) -> list[str]:
    """Once the room's lane has nothing running or queued (drained): every delivery id
    published, in seq order (each once: nothing answered twice; nothing left to run again)."""
    await worker.drain(LIMIT)  # (admits nothing more: the test's deliveries are in)
    lane = worker._lanes[ROOM]
    assert lane.current is None
    assert not lane.queue
    return [r.delivery_id for r in worker._host.outbox.published()]


@pytest.fixture
def parked(monkeypatch: pytest.MonkeyPatch) -> list[trio.Event]:
    """One event per park a lane makes durable (a barrier after ``Lane._parked``)."""
    events: list[trio.Event] = [trio.Event()]
    record = Lane._parked

    async def parking(self: Lane, *args: Any) -> None:
        await record(self, *args)
        events[-1].set()
        events.append(trio.Event())

    monkeypatch.setattr(Lane, "_parked", parking)
    return events


# --------------------------------------------------------------- waiting out an outage (PB1)


async def test_l10_l25_a_message_arriving_while_its_rooms_turn_is_parked_gets_its_own_answer(
    tmp_path: Path, clock: trio.testing.MockClock, clocks: Clocks, parked: list[trio.Event]
) -> None:
    """L10, L25: d1's first request meets a 503 and its turn is parked (no worker). d2,
    arriving while it waits, has no run to steer into: it is queued, never journaled in d1's
    log, and runs as its own turn after d1 is answered — d1's requests never hold d2's text,
    d2 ends with its own reply, each is answered once."""
    steps: list[Step] = [DOWN, Text(text="one"), Text(text="two"), Text(text="never asked")]
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (model, url),
            open_room_worker(
                config("fake", url, backoff=BACKOFF), base_dir=tmp_path, clocks=clocks
            ) as worker,
        ):
            await worker.deliver(message("d1", "first"))
            await parked[0].wait()
            lane = worker._lanes[ROOM]
            assert lane.current is not None
            assert lane.current.delivery_id == "d1"
            assert lane._running is None  # parked: no run to steer into
            accepted = await worker.deliver(message("d2", "second"))
            results = await next_results(worker, 2)
            more = await nothing_more(worker)
            d1_log = await records(worker, "d1")
    assert accepted.disposition == "queued"
    assert outcomes(results) == {
        "d1": (Outcome.REPLY, "one", None),
        "d2": (Outcome.REPLY, "two", None),
    }
    assert sorted(more) == sorted(r.delivery_id for r in results)
    assert not any(isinstance(r, AbsorbedInput) for r in d1_log)
    assert carrying(model, text_of("d2", "second")) == [2]  # d2's own turn, only
    assert model.request_count == 3


@pytest.mark.parametrize("how", ["awaited", "beside"])
async def test_l10_l25_a_message_arriving_as_the_turn_unparks_is_answered_once(
    how: str,
    tmp_path: Path,
    clock: trio.testing.MockClock,
    clocks: Clocks,
    parked: list[trio.Event],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L10, L25: d1 is parked; d2 arrives the moment the lane's wait for the route ends —
    ``awaited`` in the lane's own step (admitted before the lane takes its next one), or
    ``beside`` it (started in the same scheduler pass, the two interleaving). Either it is
    queued and runs as its own turn, or it is steered into d1's new run and ends ``absorbed``
    only if a request of that run carried it; never lost, never answered twice."""
    steps: list[Step] = [DOWN, Text(text="one"), Text(text="two"), Text(text="never asked")]
    wait_for_route = Lane._wait_for_route
    dispositions: list[str] = []

    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (model, url),
            open_room_worker(
                config("fake", url, backoff=BACKOFF), base_dir=tmp_path, clocks=clocks
            ) as worker,
            trio.open_nursery() as nursery,
        ):

            async def deliver() -> None:
                dispositions.append((await worker.deliver(message("d2", "second"))).disposition)

            async def unparking(self: Lane, pending: Any, log: Any, parks: Any, *a: Any) -> Any:
                went = await wait_for_route(self, pending, log, parks, *a)
                if parks and pending.delivery_id == "d1" and not dispositions:
                    if how == "awaited":
                        await deliver()
                    else:
                        nursery.start_soon(deliver)
                return went

            monkeypatch.setattr(Lane, "_wait_for_route", unparking)
            await worker.deliver(message("d1", "first"))
            results = await next_results(worker, 2)
            more = await nothing_more(worker)
            steps_seen = await first_steps(worker, "d1", "d2")
    assert len(dispositions) == 1
    seen = outcomes(results)
    assert sorted(more) == sorted(r.delivery_id for r in results)
    assert set(seen) == {"d1", "d2"}
    d2_text = text_of("d2", "second")
    held_by = carrying(model, d2_text)
    if dispositions == ["queued"]:
        assert seen == {"d1": (Outcome.REPLY, "one", None), "d2": (Outcome.REPLY, "two", None)}
        assert steps_seen == []
        assert held_by == [2]
    else:  # steered into d1's new run: absorbed only where a request of it carried d2
        assert dispositions == ["steered"]
        assert seen["d2"][0] is Outcome.ABSORBED
        assert seen["d2"][2] == "d1"
        assert steps_seen
        assert steps_seen[-1] is not None
        assert held_by


async def test_l10_l25_a_steer_carried_by_the_request_that_met_the_outage_is_sent_again(
    tmp_path: Path, clock: trio.testing.MockClock, clocks: Clocks, parked: list[trio.Event]
) -> None:
    """L10, L24, L25: d2 is steered into d1 while d1's tool runs; the next request carries it
    (recorded as its first step, 1) and meets a 503, so d1 is parked holding d2. When d1 is
    tried again on a new worker, step 0 is answered from the journal and d2 is sent again
    before step 1, so the request that is answered holds d2's text: d1 replies, d2 ends
    ``absorbed`` into it — the model that answered saw it. One answer for the burst."""
    started, release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [waiting, DOWN, Text(text="both"), Text(text="never asked")]
    d2_text = text_of("d2", "and this")
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (model, url),
            open_room_worker(
                config("fake", url, rooms=GRANTS, backoff=BACKOFF),
                base_dir=tmp_path,
                clocks=clocks,
            ) as worker,
        ):
            await worker.deliver(message("d1", "run the checks"))
            await trio.to_thread.run_sync(started.read_bytes)
            accepted = await worker.deliver(message("d2", "and this"))
            await trio.to_thread.run_sync(release.write_bytes, b"done\n")
            await parked[0].wait()
            at_park = await first_steps(worker, "d1", "d2")
            results = await next_results(worker, 2)
            more = await nothing_more(worker)
            d1_log = await records(worker, "d1")
    assert accepted.disposition == "steered"
    assert at_park == [None, 1]  # the request that met the outage carried it
    assert outcomes(results) == {
        "d1": (Outcome.REPLY, "both", None),
        "d2": (Outcome.ABSORBED, None, "d1"),
    }
    assert sorted(more) == sorted(r.delivery_id for r in results)
    assert carrying(model, d2_text) == [1, 2]  # the 503'd request, and the answered one
    assert model.request_count == 3  # step 0 was not asked again
    assert sum(isinstance(r, Parked) for r in d1_log) >= 1
    assert not any(isinstance(r, StepAbandoned) for r in d1_log)


async def test_l10_l13_l25_a_parked_owner_cancelled_hands_its_held_steer_back(
    tmp_path: Path, clock: trio.testing.MockClock, clocks: Clocks, parked: list[trio.Event]
) -> None:
    """L10, L13, L25: d2 is steered into d1 and carried by the request that met the outage;
    d1 is cancelled while parked. d1 ends ``cancelled`` (it answered nothing), so d2 is not
    ``absorbed`` into it: it runs as its own turn and is answered once."""
    started, release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [waiting, DOWN, Text(text="two"), Text(text="never asked")]
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (model, url),
            open_room_worker(
                config("fake", url, rooms=GRANTS, backoff=BACKOFF),
                base_dir=tmp_path,
                clocks=clocks,
            ) as worker,
        ):
            await worker.deliver(message("d1", "run the checks"))
            await trio.to_thread.run_sync(started.read_bytes)
            accepted = await worker.deliver(message("d2", "and this"))
            await trio.to_thread.run_sync(release.write_bytes, b"done\n")
            await parked[0].wait()
            await worker.cancel("d1")
            results = await next_results(worker, 2)
            more = await nothing_more(worker)
    assert accepted.disposition == "steered"
    assert outcomes(results) == {
        "d1": (Outcome.CANCELLED, None, None),
        "d2": (Outcome.REPLY, "two", None),
    }
    assert sorted(more) == sorted(r.delivery_id for r in results)
    assert carrying(model, text_of("d2", "and this")) == [1, 2]  # the 503'd one, its own
    assert model.request_count == 3


@pytest.mark.parametrize("carried", [True, False], ids=["carried", "not-carried"])
async def test_l10_l25_a_restart_while_a_steer_is_held_for_a_parked_turn_answers_it_once(
    carried: bool,
    tmp_path: Path,
    clock: trio.testing.MockClock,
    clocks: Clocks,
    parked: list[trio.Event],
) -> None:
    """L10, L25, PB2: d2 is steered into d1, and d1 is parked on a 503 — ``carried``: the
    request that met the outage carried d2; ``not-carried``: d2 was steered after that request
    went up, and taken back from the worker's queue at the settle. d3 arrives while d1 is
    parked (queued). The host is stopped while d1 waits, and a new host started on the same
    state directory: d1 resumes at its recorded schedule (not charged), d2 rides its replay and
    is sent again, so the request that answers d1 carries d2 — d2 ``absorbed``, once; d3 gets
    its own answer, once. Nothing is answered twice, nothing lost."""
    started, release, waiting = waiting_bash(tmp_path)
    d2_text = text_of("d2", "and this")
    steers: list[str] = []

    async def on_request(n: int) -> None:
        if not carried and n == 2:  # d1's step 1 has arrived upstream: d2 comes after it
            steers.append((await first.deliver(message("d2", "and this"))).disposition)

    steps: list[Step] = [waiting, DOWN, Text(text="both"), Text(text="three"), Text(text="no")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=on_request) as (model, url):
            settings = config("fake", url, rooms=GRANTS, backoff=BACKOFF)
            async with open_room_worker(settings, base_dir=tmp_path, clocks=clocks) as first:
                await first.deliver(message("d1", "run the checks"))
                await trio.to_thread.run_sync(started.read_bytes)
                if carried:
                    steers.append((await first.deliver(message("d2", "and this"))).disposition)
                await trio.to_thread.run_sync(release.write_bytes, b"done\n")
                await parked[0].wait()
                queued = (await first.deliver(message("d3", "third"))).disposition
                at_park = await first_steps(first, "d1", "d2")
            async with open_room_worker(settings, base_dir=tmp_path, clocks=clocks) as second:
                results = await next_results(second, 3)
                more = await nothing_more(second)
                d1_log = await records(second, "d1")
                after = await first_steps(second, "d1", "d2")
    assert steers == ["steered"]
    assert queued == "queued"
    assert at_park == ([None, 1] if carried else [None])
    assert outcomes(results) == {
        "d1": (Outcome.REPLY, "both", None),
        "d2": (Outcome.ABSORBED, None, "d1"),
        "d3": (Outcome.REPLY, "three", None),
    }
    assert sorted(more) == sorted(r.delivery_id for r in results)
    answered = model.request_count - 2  # d1's answered request (d3's is the last)
    assert answered in carrying(model, d2_text)  # the model that answered d1 saw d2
    assert carrying(model, d2_text) == ([1, answered] if carried else [answered])
    assert after[-1] is not None
    assert carrying(model, text_of("d3", "third")) == [model.request_count - 1]
    assert not any(isinstance(r, StepAbandoned) for r in d1_log)  # PB2: not charged


# ------------------------------------------------------- between a worker's death and its replay


async def test_l9_l10_l25_a_message_arriving_before_a_dead_workers_replay_gets_its_own_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L9, L10, L25: d1's worker is killed while its tool runs; while the lane fences it and
    branches the session back for the replay — d1 still its current delivery, no worker
    live — d2 arrives: queued, not steered into the dead run nor journaled in d1's log. d1's
    replay answers it alone; d2 gets its own answer; each once."""
    started, _release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [waiting, Text(text="one"), Text(text="two"), Text(text="never asked")]
    branch = Lane._branch
    dispositions: list[str] = []
    worker_ref: list[RoomWorker] = []

    async def branching(self: Lane, *args: Any) -> Any:
        if not dispositions:
            assert self.current is not None
            assert self.current.delivery_id == "d1"
            accepted = await worker_ref[0].deliver(message("d2", "second"))
            dispositions.append(accepted.disposition)
        return await branch(self, *args)

    monkeypatch.setattr(Lane, "_branch", branching)
    with trio.fail_after(90):
        async with (
            scripted_upstream(steps) as (model, url),
            open_room_worker(config("fake", url, rooms=GRANTS), base_dir=tmp_path) as worker,
        ):
            worker_ref.append(worker)
            await worker.deliver(message("d1", "run the checks"))
            await trio.to_thread.run_sync(started.read_bytes)
            (epoch,) = [r for r in await _lane_epochs(worker) if isinstance(r, EpochStarted)]
            os.kill(epoch.pid, signal.SIGKILL)
            results = await next_results(worker, 2)
            d1_log = await records(worker, "d1")
    assert dispositions == ["queued"]
    assert outcomes(results) == {
        "d1": (Outcome.REPLY, "one", None),
        "d2": (Outcome.REPLY, "two", None),
    }
    assert not any(isinstance(r, AbsorbedInput) for r in d1_log)
    assert carrying(model, text_of("d2", "second")) == [2]
    assert model.request_count == 3


# ---------------------------------------------------------------- a stalled turn's abort grace


async def test_l20_l25_a_message_steered_into_a_stalled_turn_gets_its_own_answer(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    aborts: Aborts,
    clocks: Clocks,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L10, L20, L25: d1's model starts its answer and goes silent; the backstop stalls the
    turn and sends ``abort``, which the worker ignores (Fake-Pi ``abort:1 = hang``). d2,
    arriving in the 30 s grace, is steered into that run — its outcome is already decided,
    ``turn_stalled`` — and no request carries it; the worker is fenced, d1 ends ``failed
    turn_stalled``, and d2 runs as its own turn on a new worker: answered once, never
    ``absorbed`` into a turn that answered nothing."""
    _behaving(monkeypatch, tmp_path, Behaviours(at={"abort:1": "hang"}))
    async with (
        serving([Alive(seconds=3600.0, every=10.0), Text(text="two")], probe) as upstream,
        room_worker(upstream, tmp_path, clocks, probe) as (worker, results),
    ):
        await worker.deliver(stall_message("d1", "are you there?"))
        await driver.wait_for(
            lambda: upstream.started == 1 and upstream.streamed_reached_lane(),
            "the answer to start",
        )
        await _until_stalled(driver, upstream, probe)
        await driver.wait_for(lambda: len(aborts.sent) == 1, "the backstop's abort")
        accepted = await worker.deliver(stall_message("d2", "hello?"))
        await _until_fenced(driver, upstream, aborts)
        await driver.wait_for(lambda: len(results) == 2, "both results")
        d1_log = await worker.store.read_delivery_log("d1")
    assert accepted.disposition == "steered"
    assert outcomes(list(results)) == {
        "d1": (Outcome.FAILED, None, None),
        "d2": (Outcome.REPLY, "two", None),
    }
    assert [r.code for r in results if r.delivery_id == "d1"] == ["turn_stalled"]
    assert [r.first_step for r in d1_log.records if isinstance(r, AbsorbedInput)] == [None]
    assert len(aborts.fenced) == 1
