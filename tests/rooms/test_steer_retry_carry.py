"""A steer taken by Pi's auto-retry, then a worker death (docs/design/lanes.md L10, L24, L26).

Pi 1.6.0 retries a failed model request with a new run whose loop reads the steering queue
first (docs/design/pi-observed.md §12): a message steered while the request failed or Pi
waited to retry is carried by the *retried* request. That request's body is not the failed
one's, so the gateway journals it as a step of its own — the failed request's step is left
without an answer. A replay must then send the steer again before the first request it asks
(no answered step lies before the one that carried it), so that request is the journal's and
the answer the owner ends with was produced by a request that carried the steer.

Before, the replay sent it again only while "the step before" the carrying one was answered
from the journal — the failed step, which never is: the steer was never sent, the replay asked
the failed request again (upstream, since the journal held no answer for it), and the owner's
answer came from a request that did not hold the steer — which was still reported
``absorbed`` into it.

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

from fake_pi.scenario import Call, HttpError, Step, Text, ToolCalls
from runtime._config import BackoffConfig
from runtime._records import (
    AbsorbedInput,
    EpochStarted,
    Outcome,
    StepAbandoned,
)
from runtime._rooms._turn import Turn
from runtime._rooms._worker import open_room_worker

from .._workers import scripted_upstream, waiting_bash
from .test_room_worker import _lane_epochs, config, next_results
from .test_steer_carry import GRANTS, SAME, message, rendered, user_texts

LIMIT: Final = 90.0

STEERS: Final = {
    "fresh": (message("d0", "hello", "m-d0"), message("d2", "and check the docs", "m-d2")),
    "redelivered": SAME["redelivered"],  # the room's history holds d2's prompt already
}


def added_after(body: dict[str, Any], prompt: str) -> list[str]:
    """The user texts of a request after the last occurrence of the turn's ``prompt``."""
    texts = user_texts(body)
    at = len(texts) - 1 - texts[::-1].index(prompt)
    return texts[at + 1 :]


@pytest.mark.parametrize("steers", list(STEERS))
async def test_l10_l24_a_steer_carried_by_a_retried_request_is_carried_by_the_replay(
    steers: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L10, L24, L26: d2 is steered into d1 while d1's first request is in flight; that
    request fails (500) and Pi retries it, its retry taking d2 from the steering queue — so
    the retried request carries d2 and is journaled as a step of its own (1; the failed step
    0 has no answer). d1's worker is killed in the next step's tool; the replay sends d2
    again right after the prompt (no answered step lies before step 1), so its first request
    is the journal's step 1, step 2 is replayed too, and the request that produces d1's
    answer carries d2: d2 ends ``absorbed`` into an answer whose model saw it. One answer
    for the burst, and the model asked no request twice. (Before, d2 was not sent again:
    the replay asked the failed step 0 upstream — without d2 — and its answer ended d1 with
    d2 still reported ``absorbed``.)"""
    first, steer = STEERS[steers]
    d1 = message("d1", "run the checks", "m-d1")
    d1_prompt, d2_prompt = rendered(d1["text"], "m-d1"), rendered(steer["text"], "m-d2")
    if steers == "redelivered":
        d2_prompt = rendered(steer["text"], steer["message_id"])
    started, _release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [
        Text(text="noted"),  # d0
        HttpError(),  # d1's first request: Pi retries it
        ToolCalls(calls=[Call(name="bash", arguments={"command": "echo one"}, id="c0")]),
        waiting,  # its worker is killed while this tool runs
        Text(text="final answer"),
        Text(text="never asked"),
    ]
    steered: list[str] = []
    on_request = Turn.on_request

    async def steering(self: Turn, body: dict[str, Any], step: int, replayed: bool) -> None:
        await on_request(self, body, step, replayed)
        if self.pending.delivery_id == "d1" and not steered:  # the request that fails
            steered.append((await worker.deliver(steer)).disposition)

    monkeypatch.setattr(Turn, "on_request", steering)
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            cfg = config("fake", url, rooms=GRANTS, backoff=BackoffConfig(enabled=False))
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(first)
                (answered,) = await next_results(worker, 1)
                await worker.deliver(d1)
                await trio.to_thread.run_sync(started.read_bytes)  # the tool runs
                (epoch,) = [r for r in await _lane_epochs(worker) if isinstance(r, EpochStarted)]
                os.kill(epoch.pid, signal.SIGKILL)
                results = await next_results(worker, 2, after=answered.seq)
                d1_log = (await worker.store.read_delivery_log("d1")).records
    assert steered == ["steered"]
    bodies = [r.body for r in model.requests]
    # d0; d1's failed request; its retry, which carries d2 (Pi's retry reads the queue)
    assert added_after(bodies[1], d1_prompt) == []
    assert added_after(bodies[2], d1_prompt) == [d2_prompt]
    first_steps = [r.first_step for r in d1_log if isinstance(r, AbsorbedInput)]
    assert first_steps[:2] == [None, 1]  # journaled when steered; then the retry carried it
    # each message answered once: one result each, and nothing more asked of the model
    assert sorted(r.delivery_id for r in results) == ["d1", "d2"]
    assert "never asked" not in {r.text for r in results if r.delivery_id == "d1"}
    assert sum(isinstance(r, StepAbandoned) for r in d1_log) == 1  # one replay
    by_id = {r.delivery_id: r for r in results}
    d1_end, d2_end = by_id["d1"], by_id["d2"]
    # the product rule: d2 is absorbed only into an answer produced by a request carrying it
    if d2_end.outcome is Outcome.ABSORBED:
        assert (d1_end.outcome, d1_end.text, d2_end.absorbed_into) == (
            Outcome.REPLY,
            "final answer",
            "d1",
        )
        answering = next(b for b in reversed(bodies) if d1_prompt in user_texts(b))
        assert d2_prompt in added_after(answering, d1_prompt)  # its model saw d2
        assert first_steps[-1] is not None
    else:  # else it got its own turn, whose request carries it once, after its own prompt
        assert (d2_end.outcome, d2_end.text) == (Outcome.REPLY, "never asked")
        own = bodies[-1]
        assert user_texts(own)[-1] == d2_prompt
        assert first_steps[-1] is None  # recorded: no request of d1's last attempt carried it
        assert d1_end.outcome is not Outcome.REPLY or d1_end.text == "final answer"
