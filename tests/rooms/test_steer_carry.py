"""What proves that a model request *carried* a steered message (docs/design/lanes.md L10,
L24), and the stall race's outcomes (L20).

A steered message is recorded as first carried at the step whose model request first holds it
(``AbsorbedInput.first_step``): a replay re-sends it so that the replayed request at that step
is the journal's, and a message no request carried is not ``absorbed`` but runs on its own.
Before, a request "carried" a steer whenever the steer's text appeared anywhere in the
request's user messages — so a message whose text the room's history already held (the same
chat message delivered again under a new delivery id, or an earlier message quoting it) was
taken as carried by a request the model answered without it.

Real processes: Fake-Pi as a subprocess, a real state directory, a scripted model on loopback;
waits are bounded and driven by the worker's own results, never by sleeping.
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
from fake_pi.scenario import Call, HttpError, Step, Text, ToolCalls
from runtime._clock import Clocks
from runtime._config import BackoffConfig, RoomConfig
from runtime._errors import ReasonCode
from runtime._records import AbsorbedInput, EpochStarted, Outcome, StepAbandoned
from runtime._rooms._admission import Author, Delivery, render_prompt
from runtime._rooms._turn import Turn
from runtime._rooms._worker import RoomWorker, open_room_worker

from .._workers import scripted_upstream, waiting_bash
from .test_room_stall import (
    Aborts,
    Alive,
    Driver,
    Probe,
    _behaving,
    _epochs,
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

LIMIT: Final = 90.0
GRANTS: Final = {ROOM: RoomConfig(grants=frozenset({"bash", "send_text_update"}))}
ANN: Final = Author(id="u1", name="Ann")


def message(delivery_id: str, text: str, message_id: str) -> dict[str, Any]:
    return {
        "delivery_id": delivery_id,
        "room": ROOM,
        "author": {"id": ANN.id, "name": ANN.name},
        "message_id": message_id,
        "text": text,
    }


def rendered(text: str, message_id: str) -> str:
    """A warm lane's prompt for Ann's message (what a steer of it sends)."""
    delivery = Delivery(delivery_id="x", room=ROOM, author=ANN, message_id=message_id, text=text)
    return render_prompt(delivery, cold=False)


SAME: Final = {
    # the chat message m-yes delivered again under a new delivery id: the same prompt
    "redelivered": (message("d0", "yes", "m-yes"), message("d2", "yes", "m-yes")),
    # an earlier message whose text holds the later one's whole prompt
    "quoted": (
        message("d0", f"Bob wrote: {rendered('yes', 'm-d2')}", "m-d0"),
        message("d2", "yes", "m-d2"),
    ),
}


def user_texts(body: dict[str, Any]) -> list[str]:
    """Each user message's text, whole."""
    texts: list[str] = []
    for item in body["messages"]:
        if item.get("role") != "user":
            continue
        content = item["content"]
        if isinstance(content, str):
            texts.append(content)
        else:
            texts.append("\n".join(str(p.get("text", "")) for p in content))
    return texts


async def first_steps(worker: RoomWorker, owner: str, steered: str) -> list[int | None]:
    """Every ``first_step`` the owner's log recorded for the steered delivery, in order."""
    contents = await worker.store.read_delivery_log(owner)
    return [
        r.first_step
        for r in contents.records
        if isinstance(r, AbsorbedInput) and r.delivery_id == steered
    ]


# ------------------------------------------------------------------------------ L10, L24


@pytest.mark.parametrize("same", list(SAME))
async def test_l10_l24_a_steer_held_by_a_replay_is_not_carried_by_its_text_in_the_history(
    same: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L10, L24: d0 is answered, so the room's history holds its prompt. d1's worker is killed
    in its second tool round and the turn is replayed; while the replay is below its last
    answered step, d2 — whose prompt the history already holds (the same chat message again,
    or quoted in d0) — is steered into it: journaled, held until the replay caught up. The
    replayed step 0 holds d2's text only as d0's, so it did not carry d2; d2 is sent once the
    replay caught up, and the request after it (step 2) carries it — recorded there, and the
    model saw it. (Before, step 0 was taken as carrying it: d2 was never sent, and ended
    ``absorbed`` into an answer whose model never saw it.)"""
    first, steer = SAME[same]
    text = rendered(steer["text"], steer["message_id"])
    started, _release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [
        Text(text="noted"),  # d0
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
            steered.append((await worker.deliver(steer)).disposition)

    monkeypatch.setattr(Turn, "on_request", steering)
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (model, url),
            open_room_worker(config("fake", url, rooms=GRANTS), base_dir=tmp_path) as worker,
        ):
            await worker.deliver(first)
            (answered,) = await next_results(worker, 1)
            await worker.deliver(message("d1", "run the checks", "m-d1"))
            await trio.to_thread.run_sync(started.read_bytes)  # step 1's tool runs
            (epoch,) = [r for r in await _lane_epochs(worker) if isinstance(r, EpochStarted)]
            os.kill(epoch.pid, signal.SIGKILL)
            results = await next_results(worker, 2, after=answered.seq)
            recorded = await first_steps(worker, "d1", "d2")
    assert steered == ["steered"]
    assert [(r.delivery_id, r.outcome, r.code, r.text, r.absorbed_into) for r in results] == [
        ("d1", Outcome.REPLY, None, "final answer", None),
        ("d2", Outcome.ABSORBED, None, None, "d1"),
    ]
    assert model.request_count == 4  # d0; d1's steps 0 and 1 once each (replayed), step 2
    before = user_texts(model.requests[2].body).count(text)  # step 1, before the kill
    assert user_texts(model.requests[3].body).count(text) == before + 1  # step 2 carries d2
    assert recorded == [None, 2]


@pytest.mark.parametrize("same", list(SAME))
async def test_l10_l24_a_retried_request_that_did_not_carry_a_steer_is_not_its_first_step(
    same: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L10, L24, L26: d1's first request fails (500) and Pi retries it. d2 — whose prompt the
    room's history already holds — is steered into d1 while the *retried* request is in
    flight: Pi polled its steering queue before asking it (pi-observed §12), so the retry is
    the failed request again (the same step 0) and does not carry d2 — its text is there only
    as history; step 1, after the tool round, does, and is recorded as d2's first step. Then
    d1's worker is killed in step 1's tool and the turn is replayed: d2 is re-sent while step
    0 is answered from the journal, the replayed step 1 is the journal's, and d1 answers with
    d2 absorbed — a request of the answering run carried it. (A steer queued *before* the
    retry is carried by the retried request itself: tests/rooms/test_steer_retry_carry.py.
    Before, this test steered d2 while the first request was in flight, on the belief that
    Pi's retry leaves its steering queue untouched; Pi's retry takes it, so that scenario
    checked nothing of its name — and passed on an answer whose model never saw d2.)"""
    first, steer = SAME[same]
    text = rendered(steer["text"], steer["message_id"])
    started, _release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [
        Text(text="noted"),  # d0
        HttpError(),  # d1's step 0, asked again by the worker
        ToolCalls(calls=[Call(name="bash", arguments={"command": "echo one"}, id="c0")]),
        waiting,  # step 1: carries d2; its worker is killed while this tool runs
        Text(text="final answer"),
        Text(text="never asked"),
    ]
    steered: list[str] = []
    asked: list[int] = []
    on_request = Turn.on_request

    async def steering(self: Turn, body: dict[str, Any], step: int, replayed: bool) -> None:
        await on_request(self, body, step, replayed)
        if self.pending.delivery_id == "d1":
            asked.append(step)
            if asked == [0, 0]:  # the retried request, in flight
                steered.append((await worker.deliver(steer)).disposition)

    monkeypatch.setattr(Turn, "on_request", steering)
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            cfg = config("fake", url, rooms=GRANTS, backoff=BackoffConfig(enabled=False))
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(first)
                (answered,) = await next_results(worker, 1)
                await worker.deliver(message("d1", "run the checks", "m-d1"))
                await trio.to_thread.run_sync(started.read_bytes)  # step 1's tool runs
                recorded = await first_steps(worker, "d1", "d2")
                (epoch,) = [r for r in await _lane_epochs(worker) if isinstance(r, EpochStarted)]
                os.kill(epoch.pid, signal.SIGKILL)
                results = await next_results(worker, 2, after=answered.seq)
                d1_log = await worker.store.read_delivery_log("d1")
    assert steered == ["steered"]
    assert [(r.delivery_id, r.outcome, r.code, r.text, r.absorbed_into) for r in results] == [
        ("d1", Outcome.REPLY, None, "final answer", None),
        ("d2", Outcome.ABSORBED, None, None, "d1"),
    ]
    bodies = [r.body for r in model.requests]
    assert bodies[2] == bodies[1]  # the retry is the failed request again: it lacks d2
    before = user_texts(bodies[2]).count(text)  # d2's text there only as the history's
    assert user_texts(bodies[3]).count(text) == before + 1  # step 1 carries d2
    assert user_texts(bodies[4]).count(text) == before + 1  # and so does the answered one
    assert recorded == [None, 1]  # step 1 carried it first, not the retried step 0
    assert asked[:3] == [0, 0, 1]
    assert sum(isinstance(r, StepAbandoned) for r in d1_log.records) == 1  # one replay
    assert model.request_count == 5  # d0; step 0 twice (the 500), step 1; replayed: step 2


# ------------------------------------------------------------------------------------ L20


@pytest.mark.parametrize(
    ("then", "outcome", "code", "text"),
    [
        ("here I am", Outcome.REPLY, None, "here I am"),
        ("[[stay-silent]]", Outcome.FAILED, str(ReasonCode.TURN_STALLED), None),
        ("", Outcome.FAILED, str(ReasonCode.TURN_STALLED), None),
    ],
    ids=["reply", "silent", "empty"],
)
async def test_l20_a_stalled_turn_keeps_only_a_complete_reply_its_worker_settles_with(
    then: str,
    outcome: Outcome,
    code: str | None,
    text: str | None,
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    aborts: Aborts,
    clocks: Clocks,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L20: the model starts its answer and then sends only keepalives; the turn stalls at
    300 s and the backstop sends ``abort``, which the worker ignores (Fake-Pi ``abort:1 =
    hang``). 320 s in — within the 30 s grace — the model finishes its answer and the worker
    settles with it. A complete reply is kept (the one exception); a ``[[stay-silent]]`` or
    an empty answer is not: the turn ends ``failed turn_stalled``, as the stall decided.
    Never replayed, never fenced (it settled). (Before, a silent answer ended the stalled turn
    ``silent`` and an empty one ``failed response_missing``.)"""
    _behaving(monkeypatch, tmp_path, Behaviours(at={"abort:1": "hang"}))
    async with (
        serving([Alive(seconds=320.0, every=10.0, then=then)], probe) as upstream,
        room_worker(upstream, tmp_path, clocks, probe) as (worker, results),
    ):
        await worker.deliver(stall_message("d1", "are you there?"))
        await driver.wait_for(
            lambda: upstream.started == 1 and upstream.streamed_reached_lane(),
            "the answer to start",
        )
        await _until_stalled(driver, upstream, probe)
        await driver.wait_for(lambda: len(aborts.sent) == 1, "the backstop's abort")
        await driver.advance(
            60.0,
            quiet=lambda: (
                upstream.streamed_reached_lane()
                and (upstream.alive_answered == 0 or probe.count("agent_settled") == 1)
            ),
            stop=lambda: len(results) == 1,
        )
        await driver.wait_for(lambda: len(results) == 1, "the stalled turn's result")
        (result,) = results
        epochs = await _epochs(worker)
        d1_log = await worker.store.read_delivery_log("d1")
    assert upstream.alive_answered == 1  # the model finished its answer after the stall
    assert (result.delivery_id, result.outcome, result.code, result.text) == (
        "d1",
        outcome,
        code,
        text,
    )
    assert aborts.fenced == []  # it settled within the grace
    assert [type(r).__name__ for r in epochs] == ["EpochStarted"]
    assert not any(isinstance(r, StepAbandoned) for r in d1_log.records)
    assert upstream.arrived == 1
