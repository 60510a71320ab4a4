"""Adversarial tests of the room lanes' steering and exactly-once rules
(``docs/design/lanes.md`` L5, L10, L13; ``docs/design/recovery.md``).

Each test puts an event in the narrowest window a rule leaves: between an owner's published
result and the results of the messages steered into it, between a run's last model request
and its settle, across a host killed (SIGKILL of a real process) in such a window. Crash
cells run this file as their host (``python tests/rooms/test_room_adversarial.py SPEC``): it
is ``tests/rooms/room_host.py`` with two more pause points, ``cancel_after_publish`` and
``before_publish``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi.scenario import Step, Text
from tests._host_process import Host, run_host, stop_here
from tests._pi import pi_home
from tests._workers import scripted_upstream, waiting_bash

HOST: Final = Path(__file__)
LIMIT: Final = 120.0
ROOM: Final = "dm:7"
GRANTS: Final = ("bash", "send_text_update")


def message(delivery_id: str, text: str = "hi", author: str = "u1") -> dict[str, Any]:
    return {
        "delivery_id": delivery_id,
        "room": ROOM,
        "author": {"id": author, "name": "Ann"},
        "message_id": f"m-{delivery_id}",
        "text": text,
    }


def config(kind: str, url: str, grants: Sequence[str] = GRANTS) -> dict[str, Any]:
    """The room's standing ``grants``; actor ``u2`` has ``read`` on top (privileged, L6):
    a message of theirs is queued, never steered into ``u1``'s run (L10)."""
    settings: dict[str, Any] = {
        "agent": "pi" if kind == "pi" else "fake",
        "model": {"base_url": url},
        "rooms": {ROOM: {"grants": list(grants), "actors": {"u2": [*grants, "read"]}}},
    }
    if kind == "pi":
        settings["pi_home"] = str(pi_home())
    return settings


def host(
    root: Path, spec: dict[str, Any], name: str
) -> contextlib.AbstractAsyncContextManager[Host]:
    return run_host(HOST, root, spec, name)


def results(facts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [f["result"] for f in facts if "result" in f]


KINDS: Final = ("fake", "pi")


# ------------------------------------------------------------------ live races (one host)


@pytest.mark.parametrize("kind", KINDS)
async def test_l10_a_steer_the_worker_accepts_after_its_run_ended_is_answered_once(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L10: d2 arrives after d1's run ended in the worker (``agent_settled`` sent) but before
    the lane has read that event: the turn still takes steers, so d2 is journaled in d1's log
    and steered into a worker that is idle. No model request carried it, so it must be
    answered by a turn of its own — and carried there once: the worker's queue is taken back
    (``clear_queue``), else d2's own prompt would take the stale steer along with it and the
    model would read the message twice."""
    from runtime._config import config_from_dict
    from runtime._pi._rpc import RpcChannel
    from runtime._rooms._worker import open_room_worker

    accepted: list[str] = []
    worker_ref: list[Any] = []
    following = RpcChannel.__anext__

    async def late(self: RpcChannel) -> Any:
        event = await following(self)
        if event.type == "agent_settled" and not accepted:  # d1's run ended in the worker
            accepted.append((await worker_ref[0].deliver(message("d2", "second"))).disposition)
        return event

    monkeypatch.setattr(RpcChannel, "__anext__", late)
    steps: list[Step] = [Text(text="for d1"), Text(text="for d2"), Text(text="never asked")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            cfg = config_from_dict(config(kind, url), base=tmp_path)
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                worker_ref.append(worker)
                await worker.deliver(message("d1", "first"))
                found: dict[str, Any] = {}
                async for result in worker.results():
                    found[result.delivery_id] = result
                    if len(found) == 2:
                        break
    assert accepted == ["steered"]
    assert (found["d1"].outcome, found["d1"].text) == ("reply", "for d1")
    assert (found["d2"].outcome, found["d2"].text) == ("reply", "for d2")
    assert model.request_count == 2
    own = [str(m) for m in model.requests[1].body["messages"] if m.get("role") == "user"]
    assert sum(text.count("second") for text in own) == 1, own


# ------------------------------------------------------------------ crashes (real processes)


@pytest.mark.parametrize("kind", KINDS)
async def test_l5_l10_a_cancel_published_between_an_owner_and_its_absorbed_message_loses_nothing(
    kind: str, tmp_path: Path
) -> None:
    """L5, L10, L13: d2 is steered into d1's run and carried by its next model request; d3
    (another actor's, privileged) is queued behind. d1 answers and its reply is published;
    before d2's ``absorbed`` result is recorded, a client cancels d3 — its ``cancelled``
    result is published, the room's latest — and the host is SIGKILLed. The next host must
    end d2 ``absorbed`` into d1: its text was answered by d1's reply, so a turn of its own
    would answer it twice (one burst, one answer). Before the fix, recovery looked for
    steered messages only in the log of the room's latest owner (d3 now), found none, and
    ran d2 on its own."""
    started, release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [
        waiting,
        Text(text="one answer for both"),
        Text(text="d2 answered a second time"),
        Text(text="never asked"),
    ]
    deliver = [
        message("d1", "first"),
        {"wait_fifo": str(started)},
        message("d2", "second"),
        message("d3", "from another actor", author="u2"),
    ]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec = {"config": config(kind, url)}
            pause = {"point": "cancel_after_publish", "owner": "d1", "cancel": "d3"}
            running = {**spec, "deliver": deliver, "expect": 3, "pause": pause}
            async with host(tmp_path, running, "a") as h:
                queued = await h.until(lambda f: f.get("accepted", {}).get("delivery_id") == "d3")
                await trio.to_thread.run_sync(release.write_bytes, b"done\n")
                await h.until(lambda f: "paused" in f)
                await h.stopped()
                await h.kill()
            steered = next(f for f in h.facts if f.get("accepted", {}).get("delivery_id") == "d2")
            async with host(tmp_path, {**spec, "expect": 3, "ack": True}, "b") as h:
                found = {r["delivery_id"]: r for r in results(await h.finish())}
    assert steered["accepted"]["disposition"] == "steered"
    assert queued["accepted"]["disposition"] == "queued"
    assert (found["d1"]["outcome"], found["d1"]["text"]) == ("reply", "one answer for both")
    assert found["d3"]["outcome"] == "cancelled"
    assert (found["d2"]["outcome"], found["d2"]["absorbed_into"]) == ("absorbed", "d1")
    assert found["d1"]["seq"] < found["d2"]["seq"]
    assert model.request_count == 2  # d1's tool round, then the request carrying d2
    assert "second" in str(model.requests[1].body["messages"])


@pytest.mark.parametrize("point", ["reply_recorded", "before_publish"])
@pytest.mark.parametrize("kind", KINDS)
async def test_l5_l10_l13_a_cancel_of_a_recovered_owner_whose_result_is_recorded_changes_nothing(
    kind: str, point: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L5, L10, L13: d2 is steered into d1's run and carried by its next model request; d1's
    reply is recorded in its log, and the host is SIGKILLed before it is published — right
    after the record (``reply_recorded``), or right before the publication
    (``before_publish``: what else the lane records first is recorded). The next
    host queues d1 (its recorded result to publish, d2 riding it); a client cancels d1 while
    it is still queued. Its turn ended before the crash: the cancel must not replace the
    recorded reply with ``cancelled`` (a second, contradicting ``Result`` in its log), nor
    hand d2 back to run on its own — d1's reply answered it. Before the fix, d1 ended
    ``cancelled`` and d2 was answered a second time."""
    from runtime._config import config_from_dict
    from runtime._records import Result
    from runtime._rooms._lane import Lane
    from runtime._rooms._worker import open_room_worker

    started, release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [
        waiting,
        Text(text="one answer for both"),
        Text(text="d2 answered a second time"),
        Text(text="never asked"),
    ]
    deliver = [message("d1", "first"), {"wait_fifo": str(started)}, message("d2", "second")]
    run, serve = Lane.run, trio.Event()

    async def held(self: Lane) -> None:
        await serve.wait()  # the lane takes nothing up until the cancel is answered
        await run(self)

    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec = {"config": config(kind, url)}
            pause = {"point": point, "owner": "d1"}
            async with host(
                tmp_path, {**spec, "deliver": deliver, "expect": 2, "pause": pause}, "a"
            ) as h:
                await h.until(lambda f: f.get("accepted", {}).get("delivery_id") == "d2")
                await trio.to_thread.run_sync(release.write_bytes, b"done\n")
                await h.until(lambda f: "paused" in f)
                await h.stopped()
                await h.kill()
            monkeypatch.setattr(Lane, "run", held)
            cfg = config_from_dict(spec["config"], base=tmp_path)
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.cancel("d1")
                serve.set()
                found: dict[str, Any] = {}
                async for result in worker.results():
                    found[result.delivery_id] = result
                    if len(found) == 2:
                        break
                log = await worker.store.read_delivery_log("d1")
    assert (found["d1"].outcome, found["d1"].text) == ("reply", "one answer for both")
    assert (found["d2"].outcome, found["d2"].absorbed_into) == ("absorbed", "d1")
    assert [r.outcome for r in log.records if isinstance(r, Result)] == ["reply"]
    assert model.request_count == 2


# ------------------------------------------------------------------------ the host part


def _install_cancel_after_publish(owner: str, cancel: str) -> None:
    """Right after ``owner``'s result is published by its lane, a client cancels the queued
    ``cancel`` (its result published); then the host stops whole, to be SIGKILLed: the
    deliveries steered into ``owner`` have no published result yet."""
    from runtime._records import Result
    from runtime._rooms._lane import Lane
    from runtime._rooms._pending import Pending

    publish = Lane._publish

    async def publishing(self: Lane, pending: Pending, result: Result) -> None:
        await publish(self, pending, result)
        if pending.delivery_id == owner:
            assert await self.cancel(cancel), f"{cancel} is not queued"
            stop_here("cancel_after_publish")

    Lane._publish = publishing  # type: ignore[method-assign]


def _install_before_publish(owner: str) -> None:
    """Right before ``owner``'s result is published by its lane (recorded in its log), the
    host stops whole, to be SIGKILLed."""
    from runtime._records import Result
    from runtime._rooms._lane import Lane
    from runtime._rooms._pending import Pending

    publish = Lane._publish

    async def publishing(self: Lane, pending: Pending, result: Result) -> None:
        if pending.delivery_id == owner:
            stop_here("before_publish")
        await publish(self, pending, result)

    Lane._publish = publishing  # type: ignore[method-assign]


def _install_reply_recorded() -> None:
    """Right after a ``reply`` result is durable in its delivery's log — before anything
    else of that delivery's end is written — the host stops whole, to be SIGKILLed."""
    from runtime._journal._fence import Fence
    from runtime._journal._journal import Journal
    from runtime._records import Outcome, Record, Result

    append = Journal.append

    async def appending(self: Journal, record: Record, *, fence: Fence | None = None) -> int:
        seq = await append(self, record, fence=fence)
        if isinstance(record, Result) and record.outcome is Outcome.REPLY:
            stop_here("reply_recorded")
        return seq

    Journal.append = appending  # type: ignore[method-assign]


async def _host_main(spec: dict[str, Any]) -> None:
    from tests.rooms import room_host

    pause = spec.get("pause")
    if pause is not None and pause["point"] == "cancel_after_publish":
        _install_cancel_after_publish(pause["owner"], pause["cancel"])
        spec = {k: v for k, v in spec.items() if k != "pause"}
    elif pause is not None and pause["point"] == "before_publish":
        _install_before_publish(pause["owner"])
        spec = {k: v for k, v in spec.items() if k != "pause"}
    elif pause is not None and pause["point"] == "reply_recorded":
        _install_reply_recorded()
        spec = {k: v for k, v in spec.items() if k != "pause"}
    await room_host.main(spec)


if __name__ == "__main__":
    trio.run(_host_main, json.loads(Path(sys.argv[1]).read_text()))
