"""Crashes of the room-worker host, by SIGKILL at named points (``docs/design/lanes.md``,
docs/design/recovery.md); each cell with the real Pi and with Fake-Pi.

The host is a real process (``tests/rooms/room_host.py``) that reports each fact on stdout; the test
kills it right after the fact it waits for, starts a new host on the same state directory and
checks what happened exactly once: one result per delivery, no completed model response paid
for again (the scripted model counts requests), an interrupted ``never`` tool reported
"possibly ran" and never run twice, an unacknowledged result delivered again with its seq.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi.scenario import Call, Step, Text, ToolCalls
from runtime._journal._frame import HEADER_SIZE, scan
from runtime._journal._journal import decode_log
from runtime._journal._store import delivery_key
from runtime._pi._session_settle import interrupted_text
from runtime._records import StepAbandoned
from runtime._rooms._worker import request_cancel

from .._host_process import Fact, Host, run_host
from .._pi import pi_home
from .._procs import alive_with_nonce, epoch_nonces, kill_orphaned_epochs
from .._workers import scripted_upstream, tool_messages, waiting_bash

HOST: Final = Path(__file__).with_name("room_host.py")
REPO: Final = Path(__file__).resolve().parents[2]
LIMIT: Final = 120.0
ROOM: Final = "dm:7"


def message(delivery_id: str, text: str = "hi") -> dict[str, Any]:
    return {
        "delivery_id": delivery_id,
        "room": ROOM,
        "author": {"id": "u1", "name": "Ann"},
        "message_id": f"m-{delivery_id}",
        "text": text,
    }


def host(
    root: Path, spec: dict[str, Any], name: str
) -> contextlib.AbstractAsyncContextManager[Host]:
    return run_host(HOST, root, spec, name)


def config(kind: str, url: str, grants: Sequence[str] = ("send_text_update",)) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "agent": "pi" if kind == "pi" else "fake",
        "model": {"base_url": url},
        "rooms": {ROOM: {"grants": list(grants)}},
    }
    if kind == "pi":
        settings["pi_home"] = str(pi_home())
    return settings


def results(facts: list[Fact]) -> list[Fact]:
    return [f["result"] for f in facts if "result" in f]


async def kill_when_paused(
    root: Path,
    spec: dict[str, Any],
    point: str,
    *,
    deliver: Sequence[dict[str, Any]] = (),
    nth: int = 1,
) -> None:
    """Run host ``a`` on ``deliver`` (default: one message ``d1``) until it passes the
    ``nth`` ``point`` barrier inside the runtime (``room_host.py`` ``pause``) and stops there
    whole, then SIGKILL it: none of its tasks goes on past the point, however late the kill."""
    messages = list(deliver) or [message("d1")]
    paused = {**spec, "deliver": messages, "expect": len(messages)}
    async with host(root, {**paused, "pause": {"point": point, "nth": nth}}, "a") as h:
        await h.until(lambda f: "paused" in f)
        await h.stopped()  # whole: nothing of it goes on until the kill
        await h.kill()


async def recover(root: Path, spec: dict[str, Any], expect: int = 1) -> list[Fact]:
    """Run host ``b`` on the same state until ``expect`` results, acknowledging each."""
    async with host(root, {**spec, "expect": expect, "ack": True}, "b") as h:
        return results(await h.finish())


KINDS: Final = ("fake", "pi")


@pytest.mark.parametrize("kind", KINDS)
async def test_crash_after_admission_then_exactly_one_result(kind: str, tmp_path: Path) -> None:
    """Killed right after ``accepted``: the next host answers the delivery once; a repeat
    of it after yet another restart is a duplicate with the identical result, and a changed
    text under the same id is refused ``delivery_conflict``."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="the answer")]) as (model, url):
            spec = {"config": config(kind, url)}
            async with host(tmp_path, {**spec, "deliver": [message("d1")], "expect": 1}, "a") as h:
                await h.until(lambda f: "accepted" in f)
                await h.kill()
            async with host(tmp_path, {**spec, "expect": 1, "ack": True}, "b") as h:
                (first,) = results(await h.finish())
            repeat = {**spec, "deliver": [message("d1"), message("d1", "changed")]}
            async with host(tmp_path, repeat, "c") as h:
                facts = await h.finish()
    assert (first["delivery_id"], first["outcome"], first["text"]) == ("d1", "reply", "the answer")
    assert facts[0] == {
        "accepted": {
            "type": "accepted",
            "delivery_id": "d1",
            "room": ROOM,
            "disposition": "duplicate",
        }
    }
    assert facts[1] == {"refused": "delivery_conflict"}
    assert model.request_count == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_crash_during_a_never_tool_reports_possibly_ran(kind: str, tmp_path: Path) -> None:
    """Killed while a bash tool runs (its intent durable): the next host kills the old
    worker's tree, replays the turn — the tool-call response from the journal, the tool as
    "possibly ran" — and the delivery gets one reply; the tool ran once; the completed
    model response was not requested again."""
    started, runs = tmp_path / "started.fifo", tmp_path / "runs"
    os.mkfifo(started)
    command = f"echo x >> {runs}; echo go > {started}; sleep 300"
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": command}, id="c1")]),
        Text(text="after the crash"),
    ]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec = {"config": config(kind, url, ("bash", "send_text_update"))}
            async with host(tmp_path, {**spec, "deliver": [message("d1")], "expect": 1}, "a") as h:
                await h.until(lambda f: "accepted" in f)
                await trio.to_thread.run_sync(started.read_bytes)
                await h.kill()
            (result,) = await recover(tmp_path, spec)
    assert (result["outcome"], result["text"]) == ("reply", "after the crash")
    assert runs.read_text() == "x\n"
    assert model.request_count == 2
    tools = [m for m in model.requests[1].body["messages"] if m.get("role") == "tool"]
    assert [t["content"] for t in tools] == [interrupted_text("bash")]


@pytest.mark.parametrize("kind", KINDS)
async def test_crash_after_the_result_before_the_ack_redelivers_it(
    kind: str, tmp_path: Path
) -> None:
    """Killed after the result was published, before the client acknowledged it: the next
    host delivers the same result again, with the same seq, and runs nothing."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="once")]) as (model, url):
            spec = {"config": config(kind, url)}
            async with host(tmp_path, {**spec, "deliver": [message("d1")], "expect": 1}, "a") as h:
                first = (await h.until(lambda f: "result" in f))["result"]
                await h.kill()
            async with host(tmp_path, {**spec, "expect": 1, "ack": True}, "b") as h:
                (again,) = results(await h.finish())
            async with host(tmp_path, {**spec, "deliver": [message("d2")], "expect": 1}, "c") as h:
                (second,) = results(await h.finish())
    assert again == first
    assert first["seq"] == 1
    assert second["seq"] == 2  # the acknowledged one is not delivered again
    assert model.request_count == 2


class Killer:
    """Kills the running host when the model's ``at``-th request arrives (once)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.host: Host | None = None
        self.killed = trio.Event()

    async def __call__(self, n: int) -> None:
        if n == self.at and self.host is not None and not self.killed.is_set():
            await self.host.kill()
            self.killed.set()


@pytest.mark.parametrize("kind", KINDS)
async def test_crash_mid_request_repeats_only_the_unfinished_step(
    kind: str, tmp_path: Path
) -> None:
    """Killed while the model is being asked (the request's intent durable, no response yet):
    the next host asks again — that step was never answered, so it is paid once more — and the
    delivery gets one reply."""
    killer = Killer(at=1)
    with trio.fail_after(LIMIT):
        async with scripted_upstream(
            [Text(text="never seen"), Text(text="the reply")], on_request=killer
        ) as (
            model,
            url,
        ):
            spec = {"config": config(kind, url)}
            async with host(tmp_path, {**spec, "deliver": [message("d1")], "expect": 1}, "a") as h:
                killer.host = h
                await killer.killed.wait()
            (result,) = await recover(tmp_path, spec)
    assert (result["outcome"], result["text"]) == ("reply", "the reply")
    assert model.request_count == 2
    assert model.requests[0].digest == model.requests[1].digest  # the same step, asked again


@pytest.mark.parametrize("kind", KINDS)
async def test_crash_after_a_tool_outcome_keeps_the_tool_done_once(
    kind: str, tmp_path: Path
) -> None:
    """Killed when the request after a tool round arrives (so the tool's outcome is durable,
    B4): the next host answers the first step from the journal and the tool from its outcome
    (the runtime's ``effect`` applied once), asks the unfinished step again, one reply."""
    killer = Killer(at=2)
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="effect", arguments={"key": "k1"}, id="c1")]),
        Text(text="never seen"),
        Text(text="done once"),
    ]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=killer) as (model, url):
            spec = {"config": config(kind, url, ("effect", "send_text_update"))}
            async with host(tmp_path, {**spec, "deliver": [message("d1")], "expect": 1}, "a") as h:
                killer.host = h
                await killer.killed.wait()
            (result,) = await recover(tmp_path, spec)
    assert (result["outcome"], result["text"]) == ("reply", "done once")
    ledger = (tmp_path / "work" / "effects.jsonl").read_text().splitlines()
    assert len(ledger) == 1
    assert model.request_count == 3  # step 0 once; step 1 twice (never answered the first time)
    assert model.requests[1].digest == model.requests[2].digest


@pytest.mark.parametrize("kind", KINDS)
async def test_crash_during_a_steer_absorbs_it_exactly_once(kind: str, tmp_path: Path) -> None:
    """Killed right after a second message was steered into a running turn (its absorbed
    input durable, the steer sent): the next host replays the owner with the steer re-sent;
    the owner gets one reply and the steered message ends ``absorbed`` into it — never lost,
    never answered twice."""
    started, _, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [waiting, Text(text="one answer for both")]
    deliver = [message("d1", "first"), {"wait_fifo": str(started)}, message("d2", "second")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec = {"config": config(kind, url, ("bash", "send_text_update"))}
            async with host(tmp_path, {**spec, "deliver": deliver, "expect": 2}, "a") as h:
                steered = await h.until(lambda f: f.get("accepted", {}).get("delivery_id") == "d2")
                await h.kill()
            async with host(tmp_path, {**spec, "expect": 2, "ack": True}, "b") as h:
                found = results(await h.finish())
    assert steered["accepted"]["disposition"] == "steered"
    by_id = {r["delivery_id"]: r for r in found}
    assert (by_id["d1"]["outcome"], by_id["d1"]["text"]) == ("reply", "one answer for both")
    assert (by_id["d2"]["outcome"], by_id["d2"]["absorbed_into"]) == ("absorbed", "d1")
    assert model.request_count == 2
    last = str(model.requests[1].body["messages"])
    assert "second" in last
    assert interrupted_text("bash") in last


@pytest.mark.parametrize("kind", KINDS)
async def test_crash_mid_stream_asks_the_unanswered_step_again(kind: str, tmp_path: Path) -> None:
    """Killed while the reply streams (the worker already showed ``typing``): the response
    was never complete, so nothing was journaled for it; the next host asks that step again
    and the delivery gets one reply."""
    steps: list[Step] = [
        Text(text="one two three four five six", delay=0.2),
        Text(text="the whole reply"),
    ]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec = {"config": config(kind, url)}
            async with host(tmp_path, {**spec, "deliver": [message("d1")], "expect": 1}, "a") as h:
                await h.until(lambda f: f.get("event", {}).get("type") == "typing")
                await h.kill()
            (result,) = await recover(tmp_path, spec)
    assert (result["outcome"], result["text"]) == ("reply", "the whole reply")
    assert model.request_count == 2
    assert model.requests[0].digest == model.requests[1].digest


def thread_states(pid: int) -> dict[int, str]:
    """The scheduler state of every thread of ``pid`` (``T``: stopped), by thread id."""
    states = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        states[int(stat.parent.name)] = stat.read_text().rpartition(")")[2].split()[0]
    return states


async def test_a_pause_point_stops_the_whole_host(tmp_path: Path) -> None:
    """What every ``pause`` cell rests on: at the point the room host stops **whole** — every
    thread of it, not just the task that passed it (``tests/_host_process.py``'s
    ``stop_here``) — so its other tasks (another room's turn, a lane's ticks, a lease
    renewal, a writer thread) cannot go on while the test's SIGKILL comes, however late."""
    spec = {"deliver": [message("d1")], "expect": 1, "pause": {"point": "model_response"}}
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="never heard")]) as (_model, url):
            async with host(tmp_path, {"config": config("fake", url), **spec}, "a") as h:
                await h.until(lambda f: "paused" in f)
                await h.stopped()
                states = thread_states(h.process.pid)
                await h.kill()
            await kill_orphaned_epochs(tmp_path)  # its worker: no host recovers after it
    assert len(states) > 1  # the Trio thread and the host's others (a writer, a to_thread)
    assert set(states.values()) == {"T"}, states


@pytest.mark.parametrize("kind", KINDS)
async def test_crash_after_a_model_response_is_journaled_never_pays_it_again(
    kind: str, tmp_path: Path
) -> None:
    """Killed right after the complete response is durable, before the worker heard its
    end: the next host answers that step from the journal — the model is asked once."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="paid once")]) as (model, url):
            spec = {"config": config(kind, url)}
            await kill_when_paused(tmp_path, spec, "model_response")
            (result,) = await recover(tmp_path, spec)
    assert (result["outcome"], result["text"]) == ("reply", "paid once")
    assert model.request_count == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_crash_after_a_never_tool_intent_before_the_tool(kind: str, tmp_path: Path) -> None:
    """Killed when a bash call's intent is durable, before the worker was told to run it:
    the runtime cannot know, so the model hears "possibly ran" — and the tool never ran."""
    runs = tmp_path / "runs"
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": f"echo x >> {runs}"}, id="c1")]),
        Text(text="told the truth"),
    ]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec = {"config": config(kind, url, ("bash", "send_text_update"))}
            await kill_when_paused(tmp_path, spec, "tool_intent")
            (result,) = await recover(tmp_path, spec)
    assert (result["outcome"], result["text"]) == ("reply", "told the truth")
    assert not runs.exists()
    assert model.request_count == 2
    assert list(tool_messages(model.requests[1].body).values()) == [interrupted_text("bash")]


@pytest.mark.parametrize("kind", KINDS)
async def test_crash_after_a_safe_tool_intent_runs_it_again(kind: str, tmp_path: Path) -> None:
    """Killed when a ``read`` (a ``safe`` tool) has its intent durable but no outcome: the
    replay runs it again, and the model gets what it read — not "possibly ran"."""
    notes = tmp_path / "notes.txt"
    notes.write_text("the safe content 42\n")
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="read", arguments={"path": str(notes)}, id="c1")]),
        Text(text="read it"),
    ]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec = {"config": config(kind, url, ("read", "send_text_update"))}
            await kill_when_paused(tmp_path, spec, "tool_intent")
            (result,) = await recover(tmp_path, spec)
    assert (result["outcome"], result["text"]) == ("reply", "read it")
    assert model.request_count == 2
    (content,) = tool_messages(model.requests[1].body).values()
    assert "the safe content 42" in content


@pytest.mark.parametrize("kind", KINDS)
async def test_l14_crash_after_a_read_configured_never_reports_possibly_ran(
    kind: str, tmp_path: Path
) -> None:
    """L14: the same crash with ``read`` configured ``never`` (``tool_classes``): the
    configured class reaches the gate, so the replay does not run ``read`` again — the model
    hears "possibly ran", not what the file holds."""
    notes = tmp_path / "notes.txt"
    notes.write_text("the safe content 42\n")
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="read", arguments={"path": str(notes)}, id="c1")]),
        Text(text="told the truth"),
    ]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            settings = config(kind, url, ("read", "send_text_update"))
            spec = {"config": {**settings, "tool_classes": {"read": "never"}}}
            await kill_when_paused(tmp_path, spec, "tool_intent")
            (result,) = await recover(tmp_path, spec)
    assert (result["outcome"], result["text"]) == ("reply", "told the truth")
    assert model.request_count == 2
    assert list(tool_messages(model.requests[1].body).values()) == [interrupted_text("read")]


def session_of(root: Path) -> Path:
    (path,) = (root / "state" / "lanes").glob("*/session.jsonl")
    return path


ORPHAN_APPEND: Final = b'{"type":"message","id":"0rphan00","parentId":"feedf00d","timestamp":"x"}\n'
"""What the crashed host's orphaned worker appends to a session file that was removed: Pi
re-creates the file with that one entry and no header (this made the test below fail one run
in ten when the orphan's retry wrote between the removal and the next host's fence)."""


@pytest.mark.parametrize("damage", ["removed", "removed_then_appended"])
@pytest.mark.parametrize("kind", KINDS)
async def test_recovery_refuses_a_session_without_the_admission_leaf(
    kind: str, damage: str, tmp_path: Path
) -> None:
    """The session file lost its history while the host was down — removed, or removed and
    then appended to (no header left): the replay cannot branch at the admission leaf, so
    the delivery fails ``recovery_refused:session`` and the host goes on serving — nothing
    is asked upstream again."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="never delivered")]) as (model, url):
            spec = {"config": config(kind, url)}
            await kill_when_paused(tmp_path, spec, "model_response")
            session = session_of(tmp_path)
            await kill_orphaned_epochs(tmp_path)  # only the damage below touches the file
            session.unlink()
            if damage == "removed_then_appended":
                session.write_bytes(ORPHAN_APPEND)
            (result,) = await recover(tmp_path, spec)
    assert (result["outcome"], result["code"]) == ("failed", "recovery_refused:session")
    assert model.request_count == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_a_replay_that_diverges_from_the_journal_fails_closed(
    kind: str, tmp_path: Path
) -> None:
    """The history before the admission leaf was edited while the host was down, so the
    replayed first request is not the one the journal answered: the gateway refuses it
    (G13) and the delivery fails ``recovery_refused:replay`` — the model is not asked."""
    steps: list[Step] = [Text(text="zero"), Text(text="one")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec = {"config": config(kind, url)}
            await kill_when_paused(
                tmp_path, spec, "model_response", deliver=[message("d0"), message("d1")], nth=2
            )
            session = session_of(tmp_path)
            edited = session.read_text().replace('"text":"zero"', '"text":"zero, edited"')
            assert edited != session.read_text()
            session.write_text(edited)
            async with host(tmp_path, {**spec, "expect": 2, "ack": True}, "b") as h:
                found = {r["delivery_id"]: r for r in results(await h.finish())}
    assert (found["d0"]["outcome"], found["d0"]["text"]) == ("reply", "zero")
    assert (found["d1"]["outcome"], found["d1"]["code"]) == ("failed", "recovery_refused:replay")
    assert model.request_count == 2


@pytest.mark.parametrize("kind", KINDS)
async def test_a_steered_message_whose_owner_is_cancelled_while_down_runs_on_its_own(
    kind: str, tmp_path: Path
) -> None:
    """Killed right after a second message was steered into the running turn; while no host
    runs, the owner is cancelled (``pi-runtime cancel``). The next host ends the owner
    ``cancelled`` without running it, and the steered message — never absorbed into a
    durable owner result — is answered as its own turn: never lost."""
    started, _, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [waiting, Text(text="the second, on its own")]
    deliver = [message("d1", "first"), {"wait_fifo": str(started)}, message("d2", "second")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec = {"config": config(kind, url, ("bash", "send_text_update"))}
            async with host(tmp_path, {**spec, "deliver": deliver, "expect": 2}, "a") as h:
                await h.until(lambda f: f.get("accepted", {}).get("delivery_id") == "d2")
                await h.kill()
            assert await request_cancel(tmp_path / "state", "d1") == "requested"
            async with host(tmp_path, {**spec, "expect": 2, "ack": True}, "b") as h:
                found = {r["delivery_id"]: r for r in results(await h.finish())}
    assert found["d1"]["outcome"] == "cancelled"
    assert (found["d2"]["outcome"], found["d2"]["text"]) == ("reply", "the second, on its own")
    assert model.request_count == 2
    assert "second" in str(model.requests[1].body["messages"])


@pytest.mark.parametrize("kind", KINDS)
async def test_crash_between_a_receipt_commit_and_its_outcome_replays_the_receipt(
    kind: str, tmp_path: Path
) -> None:
    """Issue #7: killed after ``write_document``'s transaction committed (the revision and its
    receipt) and before the gate recorded the outcome. The next host runs the same guarded
    write for the orphaned call: the receipt's saved result, nothing written again — the
    document has exactly one revision, and the model got that revision's result."""
    args = {"document_id": "notes", "content": "written once"}
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="write_document", arguments=args, id="c1")]),
        Text(text="saved"),
    ]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec = {"config": config(kind, url, ("write_document", "send_text_update"))}
            await kill_when_paused(tmp_path, spec, "receipt_commit")
            (result,) = await recover(tmp_path, spec)
    assert (result["outcome"], result["text"]) == ("reply", "saved")
    with sqlite3.connect(tmp_path / "state" / "receipts.sqlite") as db:
        revisions = db.execute("SELECT revision_id, content FROM revisions").fetchall()
        receipts = db.execute("SELECT intent_id FROM receipts").fetchall()
    assert len(revisions) == 1
    assert revisions[0][1] == "written once"
    assert len(receipts) == 1
    assert model.request_count == 2
    (saved,) = tool_messages(model.requests[1].body).values()
    assert json.loads(saved)["revision_id"] == revisions[0][0]


@pytest.mark.parametrize("kind", KINDS)
async def test_j4_a_flipped_bit_in_the_last_record_fails_closed_and_never_reruns_the_tool(
    kind: str, tmp_path: Path
) -> None:
    """Killed when a bash call's intent is the delivery log's last record; one bit of that
    record flips on disk while the host is down. The record is whole — not a torn write —
    so the log is damaged (J4): the delivery fails closed (`recovery_refused:journal`), and
    bash never runs (dropping the record as torn would have run it as if it never was)."""
    runs = tmp_path / "runs"
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": f"echo x >> {runs}"}, id="c1")]),
        Text(text="must not be reached"),
    ]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec = {"config": config(kind, url, ("bash", "send_text_update"))}
            await kill_when_paused(tmp_path, spec, "tool_intent")
            await kill_orphaned_epochs(tmp_path)
            (log,) = (tmp_path / "state" / "deliveries").glob("*.log")
            data = bytearray(log.read_bytes())
            last = scan(bytes(data)).frames[-1]
            assert b"tool_intent" in last.body
            data[last.offset + HEADER_SIZE + len(last.body) // 2] ^= 0x01
            log.write_bytes(bytes(data))
            (result,) = await recover(tmp_path, spec)
    assert result["outcome"] == "failed"
    assert result["code"] == "recovery_refused:journal", result
    assert not runs.exists()
    assert model.request_count == 1


OTHER: Final = "dm:8"


@pytest.mark.parametrize("kind", KINDS)
async def test_l17_a_host_with_one_rooms_journal_failing_answers_the_others(
    kind: str, tmp_path: Path
) -> None:
    """L17, by killing the host: one write of room A's delivery log fails mid-turn (the model
    response record, EINVAL: not a disk failure) while room B is answered. The host does not go
    down: B's reply is published, and A's delivery reaches the publish of its
    ``journal_poisoned`` result — where the host, B's reply reported, is SIGKILLed. The next
    host publishes it ``journal_poisoned`` (not ``recovery_refused:journal``: the log was
    poisoned, not found damaged), redelivers B's unacknowledged reply unchanged, and asks the
    model nothing."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="answer")] * 3) as (model, url):
            settings = config(kind, url)
            settings["rooms"][OTHER] = {"grants": ["send_text_update"]}
            spec: dict[str, Any] = {"config": settings}
            fault = {"delivery": "a1", "nth": 4, "errno": errno.EINVAL}
            first = {
                **spec,
                "deliver": [{**message("b1"), "room": OTHER}, message("a1")],
                "expect": 2,
                "fault": fault,
                "pause": {"point": "poisoned_publish", "results": 1},  # B's reply first
            }
            async with host(tmp_path, first, "a") as h:
                await h.until(lambda f: "paused" in f)
                await h.stopped()  # whole: nothing of it goes on until the kill
                await h.kill()
                before = results(h.facts)
            asked = model.request_count
            after = await recover(tmp_path, spec, expect=2)
    assert [(r["delivery_id"], r["outcome"], r["text"]) for r in before] == [
        ("b1", "reply", "answer")
    ]
    by_id = {r["delivery_id"]: r for r in after}
    assert by_id["b1"] == before[0]  # unacknowledged: again, the same result and seq
    assert (by_id["a1"]["outcome"], by_id["a1"]["code"]) == ("failed", "journal_poisoned")
    assert asked == 2  # one request per room: A's response was not journaled
    assert model.request_count == asked  # nothing of A asked again after the restart


@pytest.mark.parametrize("kind", KINDS)
async def test_l10_l17_a_message_steered_into_an_owner_poisoned_before_a_restart_runs_on_its_own(
    kind: str, tmp_path: Path
) -> None:
    """L10, L17, by killing the host: d2 is steered into d1's running turn (its absorbed
    input durable in d1's log); then d1's log fails (the tool's outcome record, EINVAL), and
    the host is SIGKILLed right before d1's ``journal_poisoned`` result is published. The
    next host attaches d2 to d1 (its log names it) and finds d1's log poisoned: d1 ends
    ``journal_poisoned`` and d2, carried by no answer, runs as its own turn — never lost."""
    started, release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [waiting, Text(text="the second, on its own")]
    deliver = [message("d1", "first"), {"wait_fifo": str(started)}, message("d2", "second")]
    # d1's writes: 1-5 up to the tool's intent, 6 d2's absorbed input, 7 the tool's outcome
    fault = {"delivery": "d1", "nth": 7, "errno": errno.EINVAL}
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            spec = {"config": config(kind, url, ("bash", "send_text_update"))}
            first = {**spec, "deliver": deliver, "expect": 2, "fault": fault}
            async with host(tmp_path, {**first, "pause": {"point": "poisoned_publish"}}, "a") as h:
                steered = await h.until(lambda f: f.get("accepted", {}).get("delivery_id") == "d2")
                await trio.to_thread.run_sync(release.write_bytes, b"go\n")
                await h.until(lambda f: "paused" in f)
                await h.stopped()  # whole: nothing of it goes on until the kill
                await h.kill()
                before = results(h.facts)
            asked = model.request_count
            found = {r["delivery_id"]: r for r in await recover(tmp_path, spec, expect=2)}
    assert steered["accepted"]["disposition"] == "steered"
    assert before == []
    assert asked == 1  # d1's first step only: its tool's outcome was never journaled
    assert (found["d1"]["outcome"], found["d1"]["code"]) == ("failed", "journal_poisoned")
    assert (found["d2"]["outcome"], found["d2"]["text"]) == ("reply", "the second, on its own")
    assert model.request_count == 2
    assert "second" in str(model.requests[1].body["messages"])


@pytest.mark.parametrize("kind", KINDS)
async def test_l19_a_host_killed_at_the_same_point_replays_three_times_then_exhausts(
    kind: str, tmp_path: Path
) -> None:
    """L19: the host is SIGKILLed each time the delivery's model request reaches the model
    (never answered, so every replay asks again). The configured 3 recovery attempts are 3
    replays, each charged durably before it runs; the 4th start ends the delivery ``failed
    recovery_exhausted`` without asking the model, and the room answers its next delivery."""
    arrivals_in, arrivals = trio.open_memory_channel[int](10)
    seen: list[int] = []

    async def hold(n: int) -> None:
        seen.append(n)
        if n <= 4:  # the first run and the three replays: report it, never answer
            await arrivals_in.send(n)
            await trio.sleep_forever()

    steps: list[Step] = [*[Text(text="never sent")] * 4, Text(text="the next one")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=hold) as (model, url):
            spec: dict[str, Any] = {"config": config(kind, url)}
            for run in range(4):
                deliver = [message("d1")] if run == 0 else []
                once = {**spec, "deliver": deliver, "expect": 1}
                async with host(tmp_path, once, f"run{run}") as h:
                    assert await arrivals.receive() == run + 1
                    await h.kill()
            asked = len(seen)
            last = {**spec, "deliver": [message("d2")], "expect": 2, "ack": True}
            async with host(tmp_path, last, "last") as h:
                found = results(await h.finish())
        log = tmp_path / "state" / "deliveries" / f"{delivery_key('d1')}.log"
        records = decode_log(await trio.to_thread.run_sync(log.read_bytes), rel="d1").records
        abandoned = [r.reason for r in records if isinstance(r, StepAbandoned)]
    assert asked == 4  # the first run and three replays
    assert [(r["delivery_id"], r["outcome"], r.get("code")) for r in found] == [
        ("d1", "failed", "recovery_exhausted"),
        ("d2", "reply", None),
    ]
    assert len(seen) == asked + 1  # d1 asked nothing more; d2 once
    assert model.request_count == 1  # and only d2's request was answered
    assert abandoned == ["host_restart"] * 4  # each start after the first charged one first


async def test_l19_a_delivery_only_queued_at_a_crash_is_charged_nothing(tmp_path: Path) -> None:
    """L19: the charge is for a turn that began. d1's model request kills the host at every
    start (never answered); d2 waits behind it in the same room, its turn never begun. Only
    d1 is charged — its three replays, then ``recovery_exhausted`` — and d2 then runs with
    every one of its own attempts left: its log holds no ``host_restart``. Before, the start
    at which d2's turn began charged it one it never ran, as if it had killed the host."""
    arrivals_in, arrivals = trio.open_memory_channel[int](10)
    asked = 0

    async def hold(n: int) -> None:
        nonlocal asked
        asked = n
        if n <= 4:  # d1's first run and its three replays: report it, never answer
            await arrivals_in.send(n)
            await trio.sleep_forever()

    steps: list[Step] = [Text(text="d2's answer")] * 5  # (answered in order: only d2's is)
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=hold) as (model, url):
            spec: dict[str, Any] = {"config": config("fake", url)}
            for run in range(4):
                deliver = [message("d1"), message("d2")] if run == 0 else []
                async with host(
                    tmp_path, {**spec, "deliver": deliver, "expect": 2}, f"r{run}"
                ) as h:
                    assert await arrivals.receive() == run + 1
                    await h.kill()
            async with host(tmp_path, {**spec, "expect": 2, "ack": True}, "last") as h:
                found = results(await h.finish())
        logs = tmp_path / "state" / "deliveries"
        charged = {}
        for delivery in ("d1", "d2"):
            data = await trio.to_thread.run_sync(
                (logs / f"{delivery_key(delivery)}.log").read_bytes
            )
            found_records = decode_log(data, rel=delivery).records
            charged[delivery] = [r.reason for r in found_records if isinstance(r, StepAbandoned)]
    assert [(r["delivery_id"], r["outcome"], r.get("text")) for r in found] == [
        ("d1", "failed", None),
        ("d2", "reply", "d2's answer"),
    ]
    assert charged == {"d1": ["host_restart"] * 4, "d2": []}
    assert asked == 5  # d1 four times, never answered; d2 once
    assert model.request_count == 1


async def test_w13_a_host_killed_between_a_workers_spawn_and_its_start_record_leaves_no_tree(
    tmp_path: Path,
) -> None:
    """W13: SIGKILLed after the worker was spawned and proven, before its ``EpochStarted`` is
    durable. The worker hangs at its start and never reads its stdin, so the host's death
    does not end it (as a worker slow to start on a loaded machine, or a tool's daemon, would
    not). Before, no record named that tree: the next host killed nothing and the orphan ran
    on, beside the epoch the next host launched for the same session. Now the launch's nonce
    is durable before the spawn, and the next host kills that tree by it before it runs
    anything — then answers the delivery once."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="the answer")]) as (model, url):
            spec = {"config": config("fake", url)}
            await kill_when_paused(
                tmp_path, {**spec, "fake": {"startup": "hang"}}, "epoch_launched"
            )
            (orphan,) = epoch_nonces(tmp_path)  # the hung worker, which no record started
            assert alive_with_nonce(orphan)
            async with host(tmp_path, {**spec, "expect": 1, "ack": True}, "b") as h:
                await h.until(lambda f: "accepted" in f or "result" in f)
                left = alive_with_nonce(orphan)  # killed at its start, before any turn ran
                (result,) = results(await h.finish())
    assert left == []
    assert (result["outcome"], result["text"]) == ("reply", "the answer")
    assert model.request_count == 1
