"""The room worker and its lanes (``runtime/_rooms/_worker.py``, ``runtime/_rooms/_lane.py``); test
names cite ``docs/design/lanes.md`` (L1…).

Real processes (Fake-Pi as a subprocess, and the real Pi where a test is parametrized over
both), a real state directory, a scripted model on loopback. Waits are bounded by
``trio.fail_after`` and driven by the worker's own results and events, never by sleeping.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio
import trio.testing

from fake_pi.scenario import (
    Call,
    Empty,
    Hang,
    HttpError,
    Step,
    Text,
    ToolCalls,
    UsageLimit,
)
from runtime._boundary._receipts import RECEIPT_DB
from runtime._config import Caps, ModelConfig, RoomConfig, RoomWorkerConfig
from runtime._errors import DeliveryError, ReasonCode
from runtime._journal._store import delivery_key, lane_key
from runtime._linux._fs import OsFileSystem
from runtime._metrics import REGISTRY
from runtime._pi._session_settle import interrupted_text
from runtime._records import (
    AbsorbedInput,
    EpochFenced,
    EpochStarted,
    Outcome,
    ReplayClass,
    Result,
    StepAbandoned,
    ToolIntent,
    ToolOutcome,
)
from runtime._rooms._admission import changed_settings, route_endpoint, settings_fingerprint
from runtime._rooms._lane import Lane
from runtime._rooms._pending import Pending
from runtime._rooms._turn import Turn
from runtime._rooms._worker import RoomWorker, open_room_worker, request_cancel
from runtime._wire import DeliveryResult, RoomEvent, TextUpdate, ToolActivity, Typing

from .._cancelling import cancelled_once
from .._pi import pi_home
from .._procs import recorded_alive
from .._workers import scripted_upstream, waiting_bash
from ..faultfs import Fault, FaultyFileSystem

LIMIT: Final = 90.0
ROOM: Final = "dm:100"


def message(
    delivery_id: str, text: str = "hi", *, room: str = ROOM, **extra: Any
) -> dict[str, Any]:
    return {
        "delivery_id": delivery_id,
        "room": room,
        "author": {"id": extra.pop("author_id", "u1"), "name": "Ann"},
        "message_id": f"m-{delivery_id}",
        "text": text,
        **extra,
    }


def config(kind: str, url: str, **overrides: Any) -> RoomWorkerConfig:
    return RoomWorkerConfig(
        agent="pi" if kind == "pi" else "fake",
        pi_home=str(pi_home()) if kind == "pi" else None,
        model=ModelConfig(base_url=url),
        **overrides,
    )


async def next_results(
    worker: RoomWorker, count: int, after: int | None = None
) -> list[DeliveryResult]:
    found: list[DeliveryResult] = []
    async for result in worker.results(after):
        found.append(result)
        if len(found) == count:
            break
    return found


@contextlib.asynccontextmanager
async def collecting(worker: RoomWorker) -> AsyncIterator[list[RoomEvent]]:
    events: list[RoomEvent] = []

    async def collect() -> None:
        async for event in worker.events():
            events.append(event)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(collect)
        yield events
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ admission and results


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_l1_l2_l5_reply_published_redelivered_until_acked(kind: str, tmp_path: Path) -> None:
    """L1: accepted after the admission is durable. L5: one result with a seq, delivered again
    after a restart until acknowledged, never after. L2: the same id and request is a
    duplicate with the same result; the same id with another text is a conflict."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="hello there")]) as (model, url):
            cfg = config(kind, url)
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                accepted = await worker.deliver(message("d1"))
                assert accepted.disposition == "started"
                (first,) = await next_results(worker, 1)
            assert (first.seq, first.delivery_id, first.outcome, first.text) == (
                1,
                "d1",
                Outcome.REPLY,
                "hello there",
            )
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                assert await next_results(worker, 1) == [first]  # not acknowledged: again
                await worker.ack(first.seq)
                again = await worker.deliver(message("d1"))
                assert again.disposition == "duplicate"
                assert worker.result_of("d1") == first
                with pytest.raises(DeliveryError) as conflict:
                    await worker.deliver(message("d1", "something else"))
                assert conflict.value.code is ReasonCode.DELIVERY_CONFLICT
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                assert worker.pending() == []
                with trio.move_on_after(0.5):  # nothing comes: everything was acknowledged
                    assert await next_results(worker, 1) == []
    assert model.request_count == 1


async def test_l3_a_rooms_deliveries_run_in_order_and_the_warm_lane_gets_no_backlog(
    tmp_path: Path,
) -> None:
    """L3: a second delivery to a busy room is queued and runs after the first, in the same
    session (the second request holds the first reply); a cold lane's prompt carries the
    backlog, a warm lane's does not."""
    history = [{"author": {"id": "u9", "name": "Bob"}, "text": "BACKLOG-LINE"}]
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([Text(text="first", delay=0.3), Text(text="second")]) as (model, url),
            open_room_worker(config("fake", url), base_dir=tmp_path) as worker,
        ):
            a = await worker.deliver(message("d1", "one", history=history))
            b = await worker.deliver(message("d2", "two", history=history))
            results = await next_results(worker, 2)
    assert (a.disposition, b.disposition) == ("started", "queued")
    assert [(r.delivery_id, r.text) for r in results] == [("d1", "first"), ("d2", "second")]
    first, second = (r.body["messages"] for r in model.requests)
    assert "BACKLOG-LINE" in str(first[-1])
    assert "BACKLOG-LINE" not in str(second[-1])
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[2]["content"] == "first"


async def test_l3_l6_an_ordinary_delivery_after_a_privileged_one_is_cold_and_gets_the_backlog(
    tmp_path: Path,
) -> None:
    """L3, L6: a room's first delivery is privileged (it runs in a one-shot session); an
    ordinary one arriving while it runs is queued behind it, and is still the room
    session's first: a cold prompt, with the backlog — the one-shot session is not the
    room's, so nothing before it holds the conversation there."""
    history = [{"author": {"id": "u9", "name": "Bob"}, "text": "BACKLOG-LINE"}]
    started, release, waiting = waiting_bash(tmp_path)
    rooms = {ROOM: RoomConfig(actors={"boss": frozenset({"bash"})})}
    steps: list[Step] = [waiting, Text(text="boss done"), Text(text="for u1")]
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (model, url),
            open_room_worker(config("fake", url, rooms=rooms), base_dir=tmp_path) as worker,
        ):
            await worker.deliver(message("d1", author_id="boss", history=history))
            await trio.to_thread.run_sync(started.read_bytes)  # its one-shot worker runs
            queued = await worker.deliver(message("d2", "two", history=history))
            await trio.to_thread.run_sync(release.write_bytes, b"go\n")
            results = await next_results(worker, 2)
    assert queued.disposition == "queued"
    assert [(r.delivery_id, r.text) for r in results] == [("d1", "boss done"), ("d2", "for u1")]
    last = model.requests[-1].body["messages"]
    assert [m["role"] for m in last] == ["system", "user"]  # the room session's first turn
    assert "BACKLOG-LINE" in str(last[-1])


async def test_l4_l6_refusals_admit_nothing(tmp_path: Path) -> None:
    """L4: a full room queue refuses with queue_full. L6: a room outside the configured
    table is refused, an invalid room id or delivery is invalid; none is admitted."""
    rooms = {ROOM: RoomConfig(grants=frozenset({"send_text_update"}))}
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Hang(seconds=60)]) as (_model, url):
            cfg = config("fake", url, rooms=rooms, caps=Caps(queue_limit=1))
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                cases = [
                    (message("d2"), ReasonCode.QUEUE_FULL),
                    (message("d3", room="dm:999"), ReasonCode.ROOM_REFUSED),
                    (message("d4", room="nope"), ReasonCode.ROOM_INVALID),
                    (message("d5", text="   "), ReasonCode.DELIVERY_INVALID),
                    ({**message("d6"), "extra": 1}, ReasonCode.DELIVERY_INVALID),
                ]
                for request, code in cases:
                    with pytest.raises(DeliveryError) as refused:
                        await worker.deliver(request)
                    assert refused.value.code is code, request
                assert worker.pending() == ["d1"]
                await worker.cancel("d1")
                (result,) = await next_results(worker, 1)
                assert result.outcome is Outcome.CANCELLED
                with pytest.raises(DeliveryError) as unknown:
                    await worker.cancel("zzz")
                assert unknown.value.code is ReasonCode.DELIVERY_UNKNOWN


async def test_l1_l2_a_duplicate_of_an_admission_in_flight_gets_its_outcome_its_error_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L1, L2: a second ``deliver`` of the same id arrives while the first's admission is
    still being appended. It is not ``duplicate`` yet — nothing is admitted until that
    append is durable: it waits for it, and when the append fails it fails the same way (a
    client told "accepted" would wait for a result that never comes)."""
    fault = Fault("write", 2, "before", errno.EINVAL, path_contains="admissions")  # 1: header
    faulty = FaultyFileSystem(OsFileSystem(), fault)
    append = RoomWorker._append_admission
    appending, go = trio.Event(), trio.Event()

    async def held(self: RoomWorker, *args: Any) -> Any:
        if not go.is_set():
            appending.set()
            await go.wait()  # the duplicate comes in meanwhile
        return await append(self, *args)

    monkeypatch.setattr(RoomWorker, "_append_admission", held)
    outcomes: dict[str, str] = {}
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([Text(text="hi")]) as (model, url),
            open_room_worker(config("fake", url), base_dir=tmp_path, fs=faulty) as w,
        ):

            async def deliver(name: str) -> None:
                try:
                    outcomes[name] = (await w.deliver(message("d1"))).disposition
                except Exception as error:  # the outcome under test
                    outcomes[name] = f"{type(error).__name__}: {getattr(error, 'code', '')}"

            async with trio.open_nursery() as nursery:
                nursery.start_soon(deliver, "first")
                await appending.wait()
                nursery.start_soon(deliver, "second")
                await trio.testing.wait_all_tasks_blocked()
                go.set()
            pending, result = w.pending(), w.result_of("d1")
    assert [hit.fault for hit in faulty.hits] == [fault]
    assert outcomes["first"].startswith("JournalError"), outcomes
    assert outcomes["second"] == outcomes["first"]  # not "duplicate" of nothing admitted
    assert (pending, result, model.request_count) == ([], None, 0)


async def test_l4_l10_steered_deliveries_count_toward_the_queue_limit(tmp_path: Path) -> None:
    """L4, L10: with a queue limit of 2, a running turn and one delivery steered into it
    fill the room: the next are ``queue_full``. (Steered deliveries wait on their owner: one
    that answers nothing hands them back to the queue, which must not then hold more than
    the limit.) The owner fails; the steered one runs as its own turn."""
    started, release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [waiting, HttpError(status=400, message="no"), Text(text="t0")]
    rooms = {ROOM: RoomConfig(grants=frozenset({"bash", "send_text_update"}))}
    got: list[str] = []
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (_model, url),
            open_room_worker(
                config("fake", url, rooms=rooms, caps=Caps(queue_limit=2)), base_dir=tmp_path
            ) as worker,
        ):
            await worker.deliver(message("d1"))
            await trio.to_thread.run_sync(started.read_bytes)  # d1's tool runs
            for n in range(3):
                try:
                    got.append((await worker.deliver(message(f"s{n}", f"text {n}"))).disposition)
                except DeliveryError as refused:
                    got.append(str(refused.code))
            await trio.to_thread.run_sync(release.write_bytes, b"go\n")
            results = await next_results(worker, 2)
    assert got == ["steered", "queue_full", "queue_full"]
    assert [(r.delivery_id, r.outcome, r.code) for r in results] == [
        ("d1", Outcome.FAILED, "model_failed"),
        ("s0", Outcome.REPLY, None),
    ]


async def test_l4_admissions_at_once_do_not_pass_the_queue_limit_together(
    tmp_path: Path,
) -> None:
    """L4: the queue limit counts the room's admissions still being written, so two sent at
    once to a room with one place left are one admitted and one refused ``queue_full`` — not
    both admitted, one over the limit."""
    rooms = {ROOM: RoomConfig(grants=frozenset({"send_text_update"}))}
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Hang(seconds=60)]) as (_model, url):
            cfg = config("fake", url, rooms=rooms, caps=Caps(queue_limit=2))
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))  # running: one place left
                refused: list[ReasonCode] = []

                async def deliver(delivery_id: str) -> None:
                    try:
                        await worker.deliver(message(delivery_id))
                    except DeliveryError as error:
                        refused.append(error.code)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(deliver, "d2")
                    nursery.start_soon(deliver, "d3")
                pending = worker.pending()
    assert refused == [ReasonCode.QUEUE_FULL]
    assert len(pending) == 2


async def test_l19_a_turn_taken_up_as_its_idle_worker_stops_gets_a_new_one(
    tmp_path: Path,
) -> None:
    """L19, the idle stop (the worker cap's too): the room's worker is asked to stop while
    idle, and a new delivery is taken up before that worker has ended. It must not be handed
    the stopping worker — its prompt would meet a closed channel, and the delivery be charged
    a recovery attempt for a turn that never ran: it waits for the old worker's end and gets
    a new one."""
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([Text(text="one"), Text(text="two")]) as (_model, url),
            open_room_worker(config("fake", url), base_dir=tmp_path) as worker,
        ):
            await worker.deliver(message("d1"))
            (first,) = await next_results(worker, 1)
            worker._lanes[ROOM].stop_worker()  # as the idle stop and the cap do
            await worker.deliver(message("d2"))
            (second,) = await next_results(worker, 1, after=first.seq)
            log = await worker.store.read(worker.store.delivery_rel("d2"))
    assert (second.delivery_id, second.outcome, second.text) == ("d2", Outcome.REPLY, "two")
    assert [r for r in log.records if isinstance(r, StepAbandoned)] == []


async def test_l7_l12_silent_turn_never_types_and_updates_do_not_settle(tmp_path: Path) -> None:
    """L12: ``send_text_update`` is threaded on the answered message and the turn goes on;
    typing starts only once the reply can no longer be silent, and never for a silent turn.
    L7: ``[[stay-silent]]`` ends ``silent`` with no text."""
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="send_text_update", arguments={"text": "looking"})]),
        Text(text="[[stay-silent]]"),
        Text(text="a real answer"),
    ]
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (_model, url),
            open_room_worker(config("fake", url), base_dir=tmp_path) as worker,
            collecting(worker) as events,
        ):
            await worker.deliver(message("d1"))
            (silent,) = await next_results(worker, 1)
            await trio.testing.wait_all_tasks_blocked()  # the collector has read every event
            quiet = list(events)
            await worker.deliver(message("d2"))
            (reply,) = await next_results(worker, 1, after=silent.seq)
            await trio.testing.wait_all_tasks_blocked()
            loud = events[len(quiet) :]
    assert (silent.outcome, silent.text) == (Outcome.SILENT, None)
    assert (reply.outcome, reply.text) == (Outcome.REPLY, "a real answer")
    assert TextUpdate(room=ROOM, delivery_id="d1", reply_to="m-d1", text="looking") in quiet
    assert not any(isinstance(e, Typing) for e in quiet)
    assert [e.phase for e in quiet if isinstance(e, ToolActivity)] == ["start", "end"]
    assert Typing(room=ROOM, delivery_id="d2") in loud


async def test_l12_a_turn_that_lit_typing_never_ends_silent(tmp_path: Path) -> None:
    """L12 (issue #18 item 11): a tool round's preamble ("Let me check.") is words that can
    no longer become ``[[stay-silent]]``, so the room is shown ``typing`` while the tools run;
    the turn has then spoken, and a final ``[[stay-silent]]`` ends it ``failed
    silence_after_typing`` — never ``silent`` after the room was lit. A turn whose only words
    are the marker stays ``silent`` and never types."""
    steps: list[Step] = [
        ToolCalls(
            text="Let me check.",
            calls=[Call(name="send_text_update", arguments={"text": "looking"})],
        ),
        Text(text="[[stay-silent]]"),
        ToolCalls(calls=[Call(name="send_text_update", arguments={"text": "hm"})]),
        Text(text="[[stay-silent]]"),
    ]
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (_model, url),
            open_room_worker(config("fake", url), base_dir=tmp_path) as worker,
            collecting(worker) as events,
        ):
            await worker.deliver(message("d1"))
            (spoken,) = await next_results(worker, 1)
            await trio.testing.wait_all_tasks_blocked()
            lit = list(events)
            await worker.deliver(message("d2"))
            (silent,) = await next_results(worker, 1, after=spoken.seq)
            await trio.testing.wait_all_tasks_blocked()
            quiet = events[len(lit) :]
    assert Typing(room=ROOM, delivery_id="d1") in lit
    assert (spoken.outcome, spoken.code, spoken.text) == (
        Outcome.FAILED,
        "silence_after_typing",
        None,
    )
    assert (silent.outcome, silent.text) == (Outcome.SILENT, None)
    assert not any(isinstance(e, Typing) for e in quiet)


# ------------------------------------------------------------------------------- workers


async def _lane_epochs(worker: RoomWorker, room: str = ROOM) -> list[Any]:
    contents = await worker.store.read(f"lanes/{lane_key(room)}/lane.log")
    return [r for r in contents.records if isinstance(r, EpochStarted | EpochFenced)]


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_l9_a_worker_killed_mid_tool_is_replayed_on_a_new_epoch(
    kind: str, tmp_path: Path
) -> None:
    """L9: SIGKILL of the worker while its bash tool runs: the epoch is fenced, the turn
    replays on a new epoch in the same session — the recorded model response is not
    requested again, the interrupted tool is reported "possibly ran" — and ends in one
    reply."""
    fifo = tmp_path / "started.fifo"
    runs = tmp_path / "runs"
    os.mkfifo(fifo)
    command = f"echo x >> {runs}; echo go > {fifo}; sleep 60"
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": command}, id="c1")]),
        Text(text="recovered"),
    ]
    rooms = {ROOM: RoomConfig(grants=frozenset({"bash", "send_text_update"}))}
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            cfg = config(kind, url, rooms=rooms)
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                # the tool is running once it writes to the FIFO (its intent is durable, T2)
                await trio.to_thread.run_sync(fifo.read_bytes)
                epochs = await _lane_epochs(worker)
                (started,) = [r for r in epochs if isinstance(r, EpochStarted)]
                os.kill(started.pid, signal.SIGKILL)
                (result,) = await next_results(worker, 1)
                epochs = await _lane_epochs(worker)
    assert (result.outcome, result.text) == (Outcome.REPLY, "recovered")
    assert runs.read_text() == "x\n"  # never run again
    assert model.request_count == 2  # the tool-call response was replayed, not paid again
    tools = [m for m in model.requests[1].body["messages"] if m.get("role") == "tool"]
    assert [t["content"] for t in tools] == [interrupted_text("bash")]
    kinds = [(type(r).__name__, r.epoch) for r in epochs]
    assert kinds[:3] == [("EpochStarted", 1), ("EpochFenced", 1), ("EpochStarted", 2)]


async def test_l8_live_workers_are_capped_least_recently_used_stops(tmp_path: Path) -> None:
    """L8: with one live worker allowed, a second room's turn waits until the first room's
    idle worker is stopped; both are answered and the first lane's epoch ended."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="a"), Text(text="b")]) as (_model, url):
            cfg = config("fake", url, caps=Caps(max_live_workers=1))
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                await next_results(worker, 1)
                await worker.deliver(message("d2", room="dm:200"))
                results = await next_results(worker, 1, after=1)
                first_lane = await _lane_epochs(worker)
    assert [r.text for r in results] == ["b"]
    assert [type(r).__name__ for r in first_lane] == ["EpochStarted", "EpochFenced"]


async def test_l8_the_cap_counts_a_privileged_one_shot_worker_beside_its_rooms_warm_one(
    tmp_path: Path,
) -> None:
    """L8, L6: with one live worker allowed, a privileged delivery (a one-shot worker) in a
    room whose own worker is warm needs a slot of its own: the room's idle worker is stopped
    before the one-shot one starts. When the one-shot worker ends, another room's worker
    starts — and the first room's is not still running beside it."""
    rooms = {ROOM: RoomConfig(actors={"boss": frozenset({"read"})}), OTHER: RoomConfig()}
    steps = [Text(text="a"), Text(text="b"), Text(text="c")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (_model, url):
            cfg = config("fake", url, rooms=rooms, caps=Caps(max_live_workers=1))
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))  # the room's worker, kept warm
                (first,) = await next_results(worker, 1)
                await worker.deliver(message("d2", author_id="boss"))  # a one-shot worker
                (second,) = await next_results(worker, 1, after=first.seq)
                await worker.deliver(message("e1", room=OTHER))
                (third,) = await next_results(worker, 1, after=second.seq)
                room_epochs = await _lane_epochs(worker)
                live = [s.room for s in worker.status() if s.live_worker]
    assert [(r.delivery_id, r.text) for r in (first, second, third)] == [
        ("d1", "a"),
        ("d2", "b"),
        ("e1", "c"),
    ]
    # the room's epoch 1 ended before the one-shot epoch 2 started, which ended too
    assert [(type(r).__name__, r.epoch) for r in room_epochs] == [
        ("EpochStarted", 1),
        ("EpochFenced", 1),
        ("EpochStarted", 2),
        ("EpochFenced", 2),
    ]
    assert live == [OTHER]


async def test_l8_rooms_waiting_for_a_slot_get_it_when_a_turn_ends(tmp_path: Path) -> None:
    """L8: three rooms admitted at once with one live worker allowed: the second and third
    wait while the first turn runs, and each gets the slot when the turn before it ends
    (the ended lane's idle worker is stopped for it) — no room waits for the idle stop."""
    steps = [Text(text=t) for t in "abc"]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (_model, url):
            cfg = config("fake", url, caps=Caps(max_live_workers=1))
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                for n in range(3):
                    await worker.deliver(message(f"d{n}", room=f"dm:{n}"))
                results = await next_results(worker, 3)
    assert sorted(r.delivery_id for r in results) == ["d0", "d1", "d2"]
    assert {r.outcome for r in results} == {Outcome.REPLY}


@pytest.mark.parametrize("cap", [8, 1])
async def test_l6_l8_a_room_worker_replaced_for_other_grants_is_stopped_first(
    cap: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L6, L8: the room's grants differ from its warm worker's for the next delivery (here
    its standing grants are changed under the running host): the room's slot is replaced,
    and the old worker — idle, its turn settled — is stopped the ordinary way (``EpochFenced``
    ``stopped``), its process gone and its live-worker place given back, before the new
    worker starts. Both deliveries end once each. Left running, the old worker would hold
    its place until the lane ended: with one live worker allowed, the new one would wait
    for it for ever (the cap stops only the room's current worker)."""
    grants = {"now": frozenset({"send_text_update"})}

    def standing(self: RoomWorkerConfig, room: str) -> frozenset[str]:
        self.check_served(room)
        return grants["now"]

    monkeypatch.setattr(RoomWorkerConfig, "standing_grants", standing)
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="one"), Text(text="two")]) as (model, url):
            cfg = config("fake", url, caps=Caps(max_live_workers=cap))
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                (first,) = await next_results(worker, 1)
                (old,) = [r for r in await _lane_epochs(worker) if isinstance(r, EpochStarted)]
                assert recorded_alive(old) != []  # warm: its worker is still running
                grants["now"] = frozenset({"send_text_update", "read"})
                await worker.deliver(message("d2"))
                (second,) = await next_results(worker, 1, after=first.seq)
                left = recorded_alive(old)
                epochs = await _lane_epochs(worker)
                logs = [await worker.store.read(worker.store.delivery_rel(d)) for d in ("d1", "d2")]
    assert left == []  # the old worker's whole tree is gone, not only asked to stop
    assert [(r.delivery_id, r.outcome, r.text) for r in (first, second)] == [
        ("d1", Outcome.REPLY, "one"),
        ("d2", Outcome.REPLY, "two"),
    ]
    assert [sum(isinstance(r, Result) for r in log.records) for log in logs] == [1, 1]
    assert model.request_count == 2
    # the old epoch stopped (not fenced: it was idle) before the new one started
    assert [(type(r).__name__, r.epoch) for r in epochs] == [
        ("EpochStarted", 1),
        ("EpochFenced", 1),
        ("EpochStarted", 2),
    ]
    assert [r.reason for r in epochs if isinstance(r, EpochFenced)] == ["stopped"]


# ------------------------------------------------------------------------------ steering


async def test_l9_l10_a_message_steered_while_a_replay_catches_up_is_sent_once_it_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L9, L10: d1's worker is killed in its second tool round, and the turn is replayed;
    while the replay is still below its last answered step (step 0 answered from the
    journal, step 1 not yet asked again), d2 is steered into it. It is journaled at once
    but sent only once the replay has caught up: the replayed step 1 is the journal's (no
    ``recovery_refused:replay``, G13), and the next request carries d2 — one reply, d2
    absorbed into it."""
    started, _release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": "echo one"}, id="c0")]),
        waiting,  # step 1: its worker is killed while this tool runs
        Text(text="final answer"),
        Text(text="never asked"),
    ]
    steered: list[str] = []
    on_request = Turn.on_request

    async def steering(self: Turn, body: dict[str, Any], step: int, replayed: bool) -> None:
        await on_request(self, body, step, replayed)
        if replayed and step == 0 and not steered:  # the replay is below its step 1
            steered.append((await worker.deliver(message("d2", "also this"))).disposition)

    monkeypatch.setattr(Turn, "on_request", steering)
    rooms = {ROOM: RoomConfig(grants=frozenset({"bash", "send_text_update"}))}
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (model, url),
            open_room_worker(config("fake", url, rooms=rooms), base_dir=tmp_path) as worker,
        ):
            await worker.deliver(message("d1"))
            await trio.to_thread.run_sync(started.read_bytes)  # step 1's tool runs
            (first,) = [r for r in await _lane_epochs(worker) if isinstance(r, EpochStarted)]
            os.kill(first.pid, signal.SIGKILL)
            results = await next_results(worker, 2)
    assert steered == ["steered"]
    assert [(r.delivery_id, r.outcome, r.code, r.text, r.absorbed_into) for r in results] == [
        ("d1", Outcome.REPLY, None, "final answer", None),
        ("d2", Outcome.ABSORBED, None, None, "d1"),
    ]
    assert model.request_count == 3  # steps 0 and 1 once each (replayed), then step 2
    assert "also this" in str(model.requests[-1].body["messages"])


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_l10_a_burst_gets_one_answer_and_two_absorbed(kind: str, tmp_path: Path) -> None:
    """L10: two messages arriving while the first one's tool runs are journaled and steered
    into the run (``steered``); the next model request carries both; once the owner's reply
    is durable they end ``absorbed`` into it. One burst, one answer, one model call more."""
    started, release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [waiting, Text(text="one answer for all")]
    rooms = {ROOM: RoomConfig(grants=frozenset({"bash", "send_text_update"}))}
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (model, url),
            open_room_worker(config(kind, url, rooms=rooms), base_dir=tmp_path) as worker,
        ):
            first = await worker.deliver(message("d1", "first"))
            await trio.to_thread.run_sync(started.read_bytes)  # the tool runs
            second = await worker.deliver(message("d2", "second"))
            third = await worker.deliver(message("d3", "third"))
            await trio.to_thread.run_sync(release.write_bytes, b"done\n")
            results = await next_results(worker, 3)
    assert [first.disposition, second.disposition, third.disposition] == [
        "started",
        "steered",
        "steered",
    ]
    by_id = {r.delivery_id: r for r in results}
    assert (by_id["d1"].outcome, by_id["d1"].text) == (Outcome.REPLY, "one answer for all")
    for absorbed in ("d2", "d3"):
        assert (by_id[absorbed].outcome, by_id[absorbed].absorbed_into) == (Outcome.ABSORBED, "d1")
    assert by_id["d1"].seq < by_id["d2"].seq < by_id["d3"].seq  # the owner's result first
    assert model.request_count == 2
    carried = str(model.requests[1].body["messages"])
    assert "second" in carried
    assert "third" in carried


# ------------------------------------------------------------------------------ recovery


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"persona": "You are someone else now."}, "recovery_refused:persona"),
        ({"rooms": {ROOM: RoomConfig(grants=frozenset({"read"}))}}, "recovery_refused:grants"),
        ({"model": "other-model"}, "recovery_refused:route"),
    ],
)
async def test_l11_recovery_refuses_what_the_admission_pinned_when_it_changed(
    change: dict[str, Any], code: str, tmp_path: Path
) -> None:
    """L11: a delivery left unfinished (the worker stopped mid-turn) is not replayed under a
    changed persona, grants or model route: it ends ``failed`` with
    ``recovery_refused:<what>``, naming what changed; nothing reaches the model again; and
    ``pi_runtime_recovery_refusals_total{code}`` counts it (operations.md)."""
    counted = _refusals(code)
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Hang(seconds=60)]) as (model, url):
            before = config("fake", url)
            async with open_room_worker(before, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))  # admitted; the turn hangs; leave

            fields: dict[str, Any] = dict(change)
            if "model" in fields:
                fields["model"] = ModelConfig(base_url=url, model=fields["model"])
            after = msgspec.structs.replace(before, **fields)
            async with open_room_worker(after, base_dir=tmp_path) as worker:
                (result,) = await next_results(worker, 1)
                asked = model.request_count
    assert (result.delivery_id, result.outcome, result.code) == ("d1", Outcome.FAILED, code)
    assert asked == model.request_count
    assert _refusals(code) == counted + 1


def _refusals(code: str) -> float:
    """``pi_runtime_recovery_refusals_total`` for ``code``, from the process's registry."""
    return REGISTRY.get_sample_value("pi_runtime_recovery_refusals_total", {"code": code}) or 0.0


@pytest.mark.parametrize("change", ["persona", "cancel"])
async def test_l5_a_recorded_result_is_published_at_start_though_changed_or_cancelled(
    change: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L5, recovery.md step 1: d1's ``Result`` (a paid reply) is durable in its log, and the
    host stops before publishing it. The next start publishes that result — even with a
    changed persona (which refuses an unfinished turn, L11) or a cancel requested while no
    server ran: neither may write and publish a second, contradicting result."""
    publish = Lane._publish
    held = trio.Event()

    async def stuck(self: Lane, pending: Pending, result: Result) -> None:
        held.set()
        await trio.sleep_forever()  # the host stops here: recorded, not published

    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="the paid answer")]) as (model, url):
            before = config("fake", url)
            monkeypatch.setattr(Lane, "_publish", stuck)
            async with open_room_worker(before, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                await held.wait()
            monkeypatch.setattr(Lane, "_publish", publish)
            after = before
            if change == "persona":
                after = msgspec.structs.replace(before, persona="You are someone else now.")
            else:
                assert await request_cancel(tmp_path / "state", "d1") == "requested"
            async with open_room_worker(after, base_dir=tmp_path) as worker:
                (result,) = await next_results(worker, 1)
                log = await worker.store.read_delivery_log("d1")
    assert (result.delivery_id, result.outcome, result.code, result.text) == (
        "d1",
        Outcome.REPLY,
        None,
        "the paid answer",
    )
    assert [(r.outcome, r.text) for r in log.records if isinstance(r, Result)] == [
        (Outcome.REPLY, "the paid answer")
    ]
    assert model.request_count == 1


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ("tool_classes", "recovery_refused:tools"),
        ("base_url", "recovery_refused:route"),
    ],
)
async def test_l14_l15_recovery_refuses_changed_replay_classes_or_endpoint(
    change: str, code: str, tmp_path: Path
) -> None:
    """L14: the effective replay classes are part of the settings fingerprint, so a restart
    that configures ``read`` as ``never`` refuses the unfinished delivery ``:tools``. L15:
    the route fingerprint pins the upstream endpoint, so a deploy that points the room at
    another endpoint refuses it ``:route`` instead of replaying into the other upstream."""
    rooms = {ROOM: RoomConfig(grants=frozenset({"read", "send_text_update"}))}
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([Hang(seconds=60)]) as (model, url),
            scripted_upstream([Text(text="from the other endpoint")]) as (other, other_url),
        ):
            before = config("fake", url, rooms=rooms)
            async with open_room_worker(before, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))  # admitted; the turn hangs; leave
            asked = model.request_count
            if change == "tool_classes":
                after = msgspec.structs.replace(before, tool_classes={"read": ReplayClass.NEVER})
            else:
                after = msgspec.structs.replace(before, model=ModelConfig(base_url=other_url))
            async with open_room_worker(after, base_dir=tmp_path) as worker:
                (result,) = await next_results(worker, 1)
    assert (result.delivery_id, result.outcome, result.code) == ("d1", Outcome.FAILED, code)
    assert model.request_count == asked
    assert other.request_count == 0


def test_l15_the_route_endpoint_carries_no_credentials() -> None:
    """L15: the endpoint the route fingerprint pins is scheme, host, port and path: a
    trailing ``/`` (which the gateway drops) changes nothing; user info, query and fragment
    are never part of it."""
    assert route_endpoint(None) is None
    assert route_endpoint("https://API.example.com/v1/") == "https://api.example.com/v1"
    assert route_endpoint("http://127.0.0.1:8080/v1") == "http://127.0.0.1:8080/v1"
    assert route_endpoint("http://[::1]:9/v1") == "http://[::1]:9/v1"
    leaky = route_endpoint("https://user:s3cret@example.com/v1?key=t0ken#frag")
    assert leaky == "https://example.com/v1"
    assert route_endpoint("https://example.com/v1") != route_endpoint("https://example.org/v1")


def test_l11_changed_settings_names_the_part() -> None:
    old = settings_fingerprint({"route": 1, "tools": [1], "persona": "a"})
    new = settings_fingerprint({"route": 1, "tools": [2], "persona": "b", "worker": 3})
    assert changed_settings(old, new) == ["persona", "tools", "worker"]
    assert changed_settings(old, old) == []


@pytest.mark.parametrize(
    ("step", "code"),
    [
        (UsageLimit(), "usage_limit_reached"),
        (HttpError(status=400, message="bad request from the provider"), "model_failed"),
        (Empty(), "response_missing"),
    ],
)
async def test_l7_provider_failures_carry_only_the_code(
    step: Step, code: str, tmp_path: Path
) -> None:
    """L7: a provider failure ends ``failed`` with its code; the provider's own text stays in
    the session and appears in no result and no journal record."""
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([step]) as (_model, url),
            open_room_worker(config("fake", url), base_dir=tmp_path) as worker,
        ):
            await worker.deliver(message("d1"))
            (result,) = await next_results(worker, 1)
    assert (result.outcome, result.code, result.text) == (Outcome.FAILED, code, None)
    provider_text = getattr(step, "message", None)
    if provider_text is not None:
        session = (tmp_path / "state" / "lanes" / lane_key(ROOM) / "session.jsonl").read_text()
        assert provider_text in session
        for log in (tmp_path / "state").rglob("*.log"):
            assert provider_text.encode() not in log.read_bytes(), log


BASH_ROOM: Final = {ROOM: RoomConfig(grants=frozenset({"bash", "send_text_update"}))}


def _tool_then_next(tmp_path: Path) -> tuple[list[Step], Path]:
    """d1's turn: a tool that says it started (into a FIFO, returned) and runs on; then the
    room's next answer."""
    started = tmp_path / "started.fifo"
    os.mkfifo(started)
    tool = Call(name="bash", arguments={"command": f"echo go > {started}; sleep 60"})
    return [ToolCalls(calls=[tool]), Text(text="next one")], started


async def _d1_log_damaged_mid_turn(cfg: RoomWorkerConfig, tmp_path: Path, started: Path) -> None:
    """A host runs d1 until its tool runs (its turn and log exist) and stops; then one byte
    inside d1's log's first frame is flipped: damage, not a torn tail."""
    async with open_room_worker(cfg, base_dir=tmp_path) as worker:
        await worker.deliver(message("d1"))
        await trio.to_thread.run_sync(started.read_bytes)
        log = tmp_path / "state" / worker.store.delivery_rel("d1")
    data = bytearray(await trio.to_thread.run_sync(log.read_bytes))
    data[30] ^= 0xFF
    await trio.to_thread.run_sync(log.write_bytes, bytes(data))


@pytest.mark.parametrize("change", ["nothing", "persona", "cancel"])
async def test_l11_a_damaged_delivery_log_refuses_recovery(change: str, tmp_path: Path) -> None:
    """L11, L17: an unfinished delivery whose log is damaged (a bad checksum before its end)
    is not replayed: it ends ``failed`` with ``recovery_refused:journal``, and the lane goes
    on serving the room. So too when the next start refuses d1 for another reason as well — a
    changed persona, or a cancel requested meanwhile. Its log cannot
    be opened to record that end, so it ends ``recovery_refused:journal`` (what its log
    being found damaged means, as for any delivery recovered) from the shared outbox; the
    fault stays in that delivery: the host serves, and the room answers its next one."""
    steps, started = _tool_then_next(tmp_path)
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (_model, url):
            cfg = config("fake", url, rooms=BASH_ROOM)
            await _d1_log_damaged_mid_turn(cfg, tmp_path, started)
            if change == "persona":
                cfg = msgspec.structs.replace(cfg, persona="You are someone else now.")
            elif change == "cancel":
                assert await request_cancel(tmp_path / "state", "d1") == "requested"
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d2"))
                first, second = await next_results(worker, 2)
    assert (first.delivery_id, first.outcome, first.code) == (
        "d1",
        Outcome.FAILED,
        "recovery_refused:journal",
    )
    assert (second.delivery_id, second.outcome) == ("d2", Outcome.REPLY)


# ------------------------------------------------------------------ a fault stays in its delivery

OTHER: Final = "dm:200"


@pytest.mark.parametrize(
    ("where", "nth", "error"),
    [
        ("gateway", 4, errno.EINVAL),  # the model response record
        ("gate", 5, errno.EINVAL),  # the tool intent record
        ("gateway", 4, errno.EIO),  # a disk-level failure: admission stops host-wide
    ],
    ids=["gateway", "gate", "gateway-eio"],
)
async def test_l17_a_failed_journal_write_mid_turn_poisons_only_that_delivery(
    where: str, nth: int, error: int, tmp_path: Path
) -> None:
    """L17: the ``nth`` write to one delivery's log fails mid-turn (the gateway's model
    response, or the gate's tool intent), while a turn of another room runs a tool. Only that
    delivery ends — ``failed journal_poisoned``, its log poisoned, its worker fenced (its tool
    never ran) — and the host goes on: the other room's turn finishes, and the failed room
    answers its next delivery on a new epoch. A disk-level error (EIO) also stops admission
    host-wide, saying why; what was admitted still finishes."""
    started, release, waiting = waiting_bash(tmp_path)
    ran = tmp_path / "ran"
    first_a: Step = Text(text="never relayed")
    if where == "gate":
        first_a = ToolCalls(calls=[Call(name="bash", arguments={"command": f"touch {ran}"})])
    steps: list[Step] = [waiting, first_a, Text(text="other room done"), Text(text="A again")]
    grants = frozenset({"bash", "send_text_update"})
    rooms = {ROOM: RoomConfig(grants=grants), OTHER: RoomConfig(grants=grants)}
    fault = Fault("write", nth, "before", error, path_contains=delivery_key("a1"))
    faulty = FaultyFileSystem(OsFileSystem(), fault)
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (_model, url),
            open_room_worker(
                config("fake", url, rooms=rooms), base_dir=tmp_path, fs=faulty, sync_log=False
            ) as w,  # (the n-th write of a1's file: each record written as appended, J12)
        ):
            await w.deliver(message("b1", room=OTHER))
            await trio.to_thread.run_sync(started.read_bytes)  # the other room's tool runs
            await w.deliver(message("a1"))
            (poisoned,) = await next_results(w, 1)
            assert [hit.fault for hit in faulty.hits] == [fault]
            if error == errno.EIO:
                with pytest.raises(DeliveryError) as refused:
                    await w.deliver(message("a2"))
                assert refused.value.code is ReasonCode.NOT_ADMITTING
                assert "disk_failed" in str(refused.value)
            else:
                assert w.store.disk_failure is None
                await w.deliver(message("a2"))
            await trio.to_thread.run_sync(release.write_bytes, b"go\n")
            later = await next_results(w, 1 if error == errno.EIO else 2, after=poisoned.seq)
            lane = await w.store.read(w.store.lane_rel(ROOM))
    assert (poisoned.delivery_id, poisoned.outcome, poisoned.code, poisoned.text) == (
        "a1",
        Outcome.FAILED,
        "journal_poisoned",
        None,
    )
    answered = {r.delivery_id: (r.outcome, r.text) for r in later}
    assert answered.pop("b1") == (Outcome.REPLY, "other room done")
    if error != errno.EIO:
        assert answered == {"a2": (Outcome.REPLY, "A again")}
    fenced = [(r.epoch, r.reason) for r in lane.records if isinstance(r, EpochFenced)]
    assert fenced[0] == (1, "fenced")
    assert not ran.exists()  # the tool whose intent could not be journaled never ran
    assert (tmp_path / "state" / (w.store.delivery_rel("a1") + ".poison")).exists()


async def test_l10_l17_a_delivery_steered_into_an_owner_whose_journal_fails_runs_on_its_own(
    tmp_path: Path,
) -> None:
    """L10, L17: d2 is steered into d1's running turn (its absorbed input durable in d1's
    log); then d1's log fails (the tool's outcome record) and d1 ends ``failed
    journal_poisoned``. Its owner answered nothing, so d2 runs as its own turn next — it
    must not be left neither queued nor finished: every delivery ends exactly once."""
    started, release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [waiting, Text(text="for d2"), Text(text="never asked")]
    grants = frozenset({"bash", "send_text_update"})
    # d1's writes: 1-5 up to the tool's intent, 6 d2's absorbed input, 7 the tool's outcome
    fault = Fault("write", 7, "before", errno.EINVAL, path_contains=delivery_key("d1"))
    faulty = FaultyFileSystem(OsFileSystem(), fault)
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (_model, url),
            open_room_worker(
                config("fake", url, rooms={ROOM: RoomConfig(grants=grants)}),
                base_dir=tmp_path,
                fs=faulty,
                sync_log=False,
            ) as w,
        ):
            await w.deliver(message("d1", "first"))
            await trio.to_thread.run_sync(started.read_bytes)  # its tool runs
            steered = await w.deliver(message("d2", "second"))
            assert not faulty.hits  # d2's absorbed input is durable in d1's log
            await trio.to_thread.run_sync(release.write_bytes, b"go\n")
            results = await next_results(w, 2)
            pending = w.pending()
    assert steered.disposition == "steered"
    assert [hit.fault for hit in faulty.hits] == [fault]
    assert [(r.delivery_id, r.outcome, r.code, r.text) for r in results] == [
        ("d1", Outcome.FAILED, "journal_poisoned", None),
        ("d2", Outcome.REPLY, None, "for d2"),
    ]
    assert pending == []


async def test_l10_l13_a_queued_owner_cancelled_after_a_restart_hands_its_steers_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L10, L13: d2 was steered into d1's turn (its absorbed input durable in d1's log) when
    the host stopped. The next start queues d1 for its replay, d2 riding it. d1 is
    cancelled while still queued (before its lane takes it up): d1 ends ``cancelled``
    without a turn, so it answers nothing — d2 runs as its own turn, as it would had d1's
    cancel been found at the start. It must not be left neither queued nor finished."""
    started, _release, waiting = waiting_bash(tmp_path)
    run = Lane.run
    serve = trio.Event()

    async def held(self: Lane) -> None:
        await serve.wait()  # the lane takes nothing up until the cancel is done
        await run(self)

    grants = frozenset({"bash", "send_text_update"})
    with trio.fail_after(LIMIT):
        async with scripted_upstream([waiting, Text(text="for d2")]) as (model, url):
            cfg = config("fake", url, rooms={ROOM: RoomConfig(grants=grants)})
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1", "first"))
                await trio.to_thread.run_sync(started.read_bytes)  # its tool runs
                steered = await worker.deliver(message("d2", "second"))
            monkeypatch.setattr(Lane, "run", held)
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                lane = worker._lanes[ROOM]
                before = lane.waiting  # L4: d1 queued, d2 riding its replay
                await worker.cancel("d1")
                after = lane.waiting  # d2 queued on its own
                serve.set()
                results = await next_results(worker, 2)
                pending = worker.pending()
                done = lane.waiting
    assert (before, after, done) == (2, 1, 0)
    assert steered.disposition == "steered"
    assert [(r.delivery_id, r.outcome, r.text) for r in results] == [
        ("d1", Outcome.CANCELLED, None),
        ("d2", Outcome.REPLY, "for d2"),
    ]
    assert pending == []
    assert model.request_count == 2  # d1's tool round, then d2's own turn


async def test_l10_l13_no_read_at_recovery_lies_between_a_lanes_start_and_its_riders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L10, L13: d2 was steered into d1's turn when the host stopped; ``r``, admitted between
    them (another actor's, privileged: queued, never steered), was cancelled while no server
    ran. Recovery reads whether the cancelled delivery's result was recorded. Any read is an
    await, and a lane handed its first delivery before it may take that delivery up at once:
    an owner that then ends without a turn (its log poisoned, L17) hands back only the riders
    attached by then, and one attached later is never run (CI saw this once as a timeout of
    ``test_l10_l17_…_poisoned_before_a_restart_runs_on_its_own``). So no lane is handed a
    delivery while recovery still reads: checked at the read of ``r``'s result, which came
    after d1's lane was handed d1 before. Then d1 replays with d2 riding, their one answer
    covers both, and ``r`` ends cancelled."""
    started, _release, waiting = waiting_bash(tmp_path)
    recorded = RoomWorker._recorded_result
    handed: list[list[str]] = []

    async def reading(self: RoomWorker, delivery_id: str) -> bool:
        handed.append([room for room, lane in self._lanes.items() if lane.queue or lane.current])
        return await recorded(self, delivery_id)

    grants = frozenset({"bash", "send_text_update"})
    room = RoomConfig(grants=grants, actors={"u2": grants | {"read"}})
    with trio.fail_after(LIMIT):
        async with scripted_upstream([waiting, Text(text="for both")]) as (model, url):
            cfg = config("fake", url, rooms={ROOM: room})
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1", "first"))
                await trio.to_thread.run_sync(started.read_bytes)  # its tool runs
                queued = await worker.deliver(message("r", "other", author_id="u2"))
                steered = await worker.deliver(message("d2", "second"))
            assert await request_cancel(tmp_path / "state", "r") == "requested"
            monkeypatch.setattr(RoomWorker, "_recorded_result", reading)
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                results = await next_results(worker, 3)
    assert (queued.disposition, steered.disposition) == ("queued", "steered")
    assert handed == [[]]  # r's read, with no lane handed anything yet
    assert sorted((r.delivery_id, r.outcome, r.text) for r in results) == [
        ("d1", Outcome.REPLY, "for both"),
        ("d2", Outcome.ABSORBED, None),
        ("r", Outcome.CANCELLED, None),
    ]
    assert model.request_count == 2  # d1's tool round, then its replay's next request


async def test_l10_l13_a_message_waiting_to_steer_into_a_run_cancelled_meanwhile_is_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L10, L13: d2 arrives while d1's turn runs, and waits for the turn's steer lock (an
    earlier steer holds it). Meanwhile d1 is cancelled — marked, its abort on its way. Once
    d2 has the lock the run is still steerable, but it was cancelled: nothing more steers
    into it (as none would have, had d2 come a moment later). d2 is ``queued`` — not
    journaled in d1's log, not sent to its worker — and answered by its own turn."""
    from runtime._pi._rpc import RpcChannel

    asked, aborting, release = trio.Event(), trio.Event(), trio.Event()
    waiting, routed = trio.Event(), trio.Event()
    abort, steer = RpcChannel.abort, Lane.steer

    async def on_request(n: int) -> None:
        asked.set()

    async def held_abort(self: RpcChannel) -> None:
        aborting.set()
        await release.wait()  # d1 is marked cancelled; the worker has not aborted yet
        await abort(self)

    async def steering(self: Lane, pending: Pending) -> bool:
        if pending.delivery_id == "d2":
            waiting.set()  # (it waits for the lock before this task yields)
        return await steer(self, pending)

    monkeypatch.setattr(RpcChannel, "abort", held_abort)
    monkeypatch.setattr(Lane, "steer", steering)
    accepted: list[Any] = []
    steps: list[Step] = [Hang(seconds=3600), Text(text="for d2")]
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps, on_request=on_request) as (_model, url),
            open_room_worker(config("fake", url), base_dir=tmp_path) as worker,
            trio.open_nursery() as nursery,
        ):
            await worker.deliver(message("d1", "one"))
            await asked.wait()
            turn = worker._lanes[ROOM]._running
            assert turn is not None

            async def deliver_d2() -> None:
                accepted.append(await worker.deliver(message("d2", "two")))
                routed.set()

            async with turn.steer_lock:  # an earlier steer, still being journaled
                nursery.start_soon(deliver_d2)
                await waiting.wait()
                nursery.start_soon(worker.cancel, "d1")
                await aborting.wait()
            await routed.wait()
            release.set()
            results = await next_results(worker, 2)
            log = await worker.store.read_delivery_log("d1")
    assert accepted[0].disposition == "queued"
    assert [(r.delivery_id, r.outcome, r.text) for r in results] == [
        ("d1", Outcome.CANCELLED, None),
        ("d2", Outcome.REPLY, "for d2"),
    ]
    assert not [r for r in log.records if isinstance(r, AbsorbedInput)]


async def test_l17_a_drain_ends_once_a_turn_ends_on_a_failed_result_write(
    tmp_path: Path,
) -> None:
    """L17, recovery.md: the host drains while a turn runs; the turn ends, and its result's
    write to the outbox fails (the disk: the delivery stays pending, the host stops
    admitting). Nothing runs any more, so the drain ends then — not at its timeout."""
    started, release, waiting = waiting_bash(tmp_path)
    grants = frozenset({"bash", "send_text_update"})
    fault = Fault("write", 2, "before", errno.EIO, path_contains="results.log")  # 1: header
    faulty = FaultyFileSystem(OsFileSystem(), fault)
    with trio.fail_after(LIMIT):  # far less than the drain's 3600 s
        async with scripted_upstream([waiting, Text(text="done")]) as (_model, url):
            cfg = config("fake", url, rooms={ROOM: RoomConfig(grants=grants)})
            async with open_room_worker(cfg, base_dir=tmp_path, fs=faulty) as w:
                await w.deliver(message("d1"))
                await trio.to_thread.run_sync(started.read_bytes)  # its tool runs
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(w.drain, 3600.0)
                    await trio.to_thread.run_sync(release.write_bytes, b"go\n")
                pending = w.pending()
    assert [hit.fault for hit in faulty.hits] == [fault]
    assert pending == ["d1"]


@pytest.mark.parametrize("when", ["new", "recovering"])
async def test_l18_a_damaged_session_header_fails_that_lane_closed_and_the_host_serves(
    when: str, tmp_path: Path
) -> None:
    """L18: the room's session file has lost its header (its first line overwritten). A new
    delivery of that room, and one the host finds unfinished at start, fail closed
    ``recovery_refused:session`` — the unfinished one charged its recovery attempt before
    the session is read (L19) — and another room of the same host is answered."""
    first: Step = Text(text="first") if when == "new" else Hang(seconds=60)
    steps: list[Step] = [first, Text(text="other room")]
    rooms = {ROOM: RoomConfig(), OTHER: RoomConfig()}
    session = tmp_path / "state" / "lanes" / lane_key(ROOM) / "session.jsonl"
    asked_once = trio.Event()

    async def arrived(n: int) -> None:
        await trio.lowlevel.checkpoint()
        asked_once.set()

    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=arrived) as (model, url):
            cfg = config("fake", url, rooms=rooms)
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                if when == "new":
                    await next_results(worker, 1)
                else:  # the turn hangs in the model: the host stops mid-turn
                    await asked_once.wait()
            lines = (await trio.to_thread.run_sync(session.read_bytes)).split(b"\n")
            lines[0] = b'{"type":"not-a-session-header"' + b" " * 8
            await trio.to_thread.run_sync(session.write_bytes, b"\n".join(lines))
            asked = model.request_count
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                if when == "new":
                    await worker.deliver(message("d2"))
                await worker.deliver(message("e1", room=OTHER))
                found = await next_results(worker, 2, after=1 if when == "new" else None)
                log = await worker.store.read(worker.store.delivery_rel("d1"))
    outcomes = {r.delivery_id: (r.outcome, r.code, r.text) for r in found}
    refused = "d2" if when == "new" else "d1"
    assert outcomes == {
        refused: (Outcome.FAILED, "recovery_refused:session", None),
        "e1": (Outcome.REPLY, None, "other room"),
    }
    assert model.request_count == asked + 1  # only the other room's turn asked the model
    if when == "recovering":
        assert [r.reason for r in log.records if isinstance(r, StepAbandoned)] == ["host_restart"]


async def test_l18_a_session_fsync_failing_after_a_turn_fails_that_delivery_and_the_host_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L18, L17: the fsync of a room's session after its turn fails (EIO) — the session the
    result's leaf would name cannot be made durable. Only that delivery ends, ``failed
    recovery_refused:session``; another room's delivery is answered (the host lives)."""
    fsync = Lane._fsync
    syncs = 0

    async def failing(self: Lane, session: Path) -> None:
        nonlocal syncs
        if self.room == ROOM:
            syncs += 1
            if syncs == 2:  # after the turn (the first: the admission leaf before it)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        await fsync(self, session)

    monkeypatch.setattr(Lane, "_fsync", failing)
    rooms = {ROOM: RoomConfig(), OTHER: RoomConfig()}
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([Text(text="a"), Text(text="b")]) as (_model, url),
            open_room_worker(config("fake", url, rooms=rooms), base_dir=tmp_path) as worker,
        ):
            await worker.deliver(message("d1"))
            (failed,) = await next_results(worker, 1)
            await worker.deliver(message("e1", room=OTHER))
            (other,) = await next_results(worker, 1, after=failed.seq)
    assert (failed.delivery_id, failed.outcome, failed.code) == (
        "d1",
        Outcome.FAILED,
        "recovery_refused:session",
    )
    assert (other.delivery_id, other.outcome, other.text) == ("e1", Outcome.REPLY, "b")


async def test_l17_a_receipt_store_locked_past_its_retries_fails_only_that_delivery(
    tmp_path: Path,
) -> None:
    """L17, receipts R8: another connection holds the receipt store's write lock for the
    whole turn. ``write_document`` is retried (the bounded backoff) and then fails: only that
    delivery ends ``failed receipt_store_failed`` — its call unsettled, nothing written, its
    worker fenced — while another room is answered, and the room's next delivery writes the
    document once the lock is gone."""
    args = {"document_id": "notes", "content": "hello"}
    write = ToolCalls(calls=[Call(name="write_document", arguments=args, id="w1")])
    steps: list[Step] = [write, Text(text="other room"), write, Text(text="written")]
    grants = frozenset({"write_document", "send_text_update"})
    rooms = {ROOM: RoomConfig(grants=grants), OTHER: RoomConfig()}
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (_model, url),
            open_room_worker(config("fake", url, rooms=rooms), base_dir=tmp_path) as w,
        ):
            lock = sqlite3.connect(tmp_path / "state" / RECEIPT_DB, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")  # a real write lock, held by someone else
            await w.deliver(message("a1"))
            (failed,) = await next_results(w, 1)
            await w.deliver(message("b1", room=OTHER))
            (other,) = await next_results(w, 1, after=failed.seq)
            lock.execute("ROLLBACK")
            lock.close()
            await w.deliver(message("a2"))
            (written,) = await next_results(w, 1, after=other.seq)
            log = await w.store.read(w.store.delivery_rel("a1"))
            assert w.receipts is not None
            revisions = await w.receipts.revisions("notes")
            lane = await w.store.read(w.store.lane_rel(ROOM))
    assert (failed.delivery_id, failed.outcome, failed.code) == (
        "a1",
        Outcome.FAILED,
        "receipt_store_failed",
    )
    assert [type(r) for r in log.records if isinstance(r, ToolIntent | ToolOutcome)] == [
        ToolIntent
    ]  # the call stays unsettled (R5)
    assert (other.delivery_id, other.text) == ("b1", "other room")
    assert (written.delivery_id, written.outcome, written.text) == ("a2", Outcome.REPLY, "written")
    assert len(revisions) == 1  # applied once, by a2
    fenced = [(r.epoch, r.reason) for r in lane.records if isinstance(r, EpochFenced)]
    assert fenced[0] == (1, "fenced")


async def test_l13_a_queued_cancel_whose_caller_is_cancelled_still_ends_it_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L13: cancelling a queued delivery takes it out of its room's queue, then writes its
    result. A caller cancelled during that write (a client gone) must not leave it out of
    the queue with no result — it would neither run nor end until a restart: it ends
    ``cancelled``, and the room goes on."""
    rooms = {ROOM: RoomConfig(actors={"u2": frozenset({"read"})})}  # u2: never steered (L10)
    writing, release = trio.Event(), trio.Event()
    write = Lane.write_result

    async def held_write(self: Lane, pending: Pending, result: Result) -> None:
        if pending.delivery_id == "d2":
            writing.set()
            await release.wait()  # the caller is cancelled meanwhile
        await write(self, pending, result)

    monkeypatch.setattr(Lane, "write_result", held_write)
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Hang(seconds=60)]) as (_model, url):
            cfg = config("fake", url, rooms=rooms)
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                queued = await worker.deliver(message("d2", author_id="u2"))
                await cancelled_once(writing, lambda: worker.cancel("d2"), then=release)
                (d2,) = await next_results(worker, 1)
                pending = worker.pending()
    assert queued.disposition == "queued"
    assert (d2.delivery_id, d2.outcome) == ("d2", Outcome.CANCELLED)
    assert pending == ["d1"]


async def test_l1_a_delivery_admitted_before_its_caller_was_cancelled_still_runs(
    tmp_path: Path,
) -> None:
    """L1, L10: a delivery's admission is durable before it is routed to its lane (steered
    into the running turn, or queued). A caller cancelled between the two (a client gone
    while d2 waited for the running turn's steer lock) must not leave the admitted delivery
    with neither: it is steered or queued all the same, and gets its result."""
    release = trio.Event()
    asked = trio.Event()

    async def on_request(n: int) -> None:
        if n == 1:
            asked.set()
            await release.wait()  # d1's turn runs until the test lets it answer

    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([Text(text="first"), Text(text="second")], on_request=on_request) as (
                _model,
                url,
            ),
            open_room_worker(config("fake", url), base_dir=tmp_path) as worker,
        ):
            await worker.deliver(message("d1", "one"))
            await asked.wait()
            lane = worker._lanes[ROOM]
            turn = lane._running
            assert turn is not None
            held, let_go = trio.Event(), trio.Event()

            async def hold_the_steer_lock() -> None:  # d2's routing waits for it, admitted
                async with turn.steer_lock:
                    held.set()
                    await let_go.wait()

            async def cancel_once_routing() -> None:
                while not turn.steer_lock.statistics().tasks_waiting:
                    await trio.testing.wait_all_tasks_blocked()
                caller.cancel()
                let_go.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(hold_the_steer_lock)
                await held.wait()
                with trio.CancelScope() as caller:
                    async with trio.open_nursery() as inner:
                        inner.start_soon(cancel_once_routing)
                        await worker.deliver(message("d2", "two"))
            release.set()
            results = await next_results(worker, 2)
    outcomes = {r.delivery_id: r.outcome for r in results}
    assert outcomes["d1"] is Outcome.REPLY
    assert outcomes["d2"] in (Outcome.ABSORBED, Outcome.REPLY)  # steered (L10), or its own turn


async def test_l13_a_running_cancel_whose_caller_is_cancelled_still_aborts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L13: cancelling a running delivery marks it cancelled, then sends the worker its
    abort. A caller cancelled before the abort is written (a client gone) must not leave it
    marked and unaborted — its turn running on, its tools too, for a cancel already decided:
    the abort is sent all the same, and the delivery ends ``cancelled``."""
    from runtime._pi._rpc import RpcChannel

    asked, aborting, release = trio.Event(), trio.Event(), trio.Event()
    abort = RpcChannel.abort

    async def on_request(n: int) -> None:
        asked.set()

    async def held_abort(self: RpcChannel) -> None:
        aborting.set()
        await release.wait()  # the caller is cancelled meanwhile
        await abort(self)

    monkeypatch.setattr(RpcChannel, "abort", held_abort)
    with trio.fail_after(60):
        async with scripted_upstream([Hang(seconds=3600)], on_request=on_request) as (_m, url):
            cfg = config("fake", url)
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                await asked.wait()
                await cancelled_once(aborting, lambda: worker.cancel("d1"), then=release)
                (result,) = await next_results(worker, 1)
    assert (result.delivery_id, result.outcome) == ("d1", Outcome.CANCELLED)


async def test_l13_a_cancel_while_its_worker_is_launching_ends_it_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L13: a delivery cancelled after its lane took it up but before its worker is live —
    no abort can be sent then — still ends ``cancelled`` once the worker runs its prompt (the
    model never answers, so nothing else would end it). Found by the operator page's test on a
    slow machine; made deterministic here by holding the launch until the cancel is in."""
    from runtime._rooms._slot import Slot

    launching, go = trio.Event(), trio.Event()
    original = Slot.ensure_live

    async def held(self: Slot, nursery: trio.Nursery) -> Any:
        launching.set()
        await go.wait()
        return await original(self, nursery)

    monkeypatch.setattr(Slot, "ensure_live", held)
    with trio.fail_after(60):
        async with scripted_upstream([Hang(seconds=3600)]) as (_model, url):
            cfg = config("fake", url)
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                await launching.wait()
                await worker.cancel("d1")
                go.set()
                (result,) = await next_results(worker, 1)
    assert (result.delivery_id, result.outcome) == ("d1", Outcome.CANCELLED)
