"""Task frames on the wire (P11-P13 of ``docs/design/protocol.md``; issue #8).

A real server (``open_server``: room worker and task service on one store) on 127.0.0.1 with
real websocket clients; every task's epochs are Fake-Pi subprocesses behind their gateway and
gate, talking to a scripted model on loopback. Every wait is for a frame, bounded by
``trio.fail_after``; nothing sleeps on the clock.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio
from trio_websocket import open_websocket_url

from fake_pi.scenario import Step
from runtime._config import config_from_dict
from runtime._server._admin import admin_request
from runtime._server._protocol import TaskViewFrame, decode_server_frame, encode_server_frame
from runtime._server._serve import RoomServer, ServeOptions, open_server
from runtime._wire import TaskEvent, TaskView

from .._wire import Client, Frame
from .._workers import scripted_upstream
from ..task_harness import done, make_worktree, say, wait

LIMIT: Final = 60.0

TASK_VIEW: Final = TaskView(
    task_id="t1",
    state="open",
    generation=1,
    attempt=1,
    fence=0,
    process_epoch=1,
    continuation_epoch=0,
    session_path="lanes/3f9a1c2e7b/session.jsonl",
    session_id="0b6c9d2e",
    route={"provider": "fake", "model": "fake-model"},
    worktree="/src/app",
    process={"pid": 4242, "start_time": 81234, "boot_id": "9c1e", "nonce": "a41f"},
    classification="Suspect",
    phase="provider",
    progress_seq=7,
    silence_seconds=312.5,
    soft_seconds=300.0,
    probe="soft: no new evidence",
    hard_seconds=900.0,
    grace_seconds=120.0,
    grace="not started",
    receipts=[],
    prompt_marker=None,
    budget={"epochs_used": 0, "epochs_left": 3},
    pending_action=None,
    hold_reason=None,
    next_action="observe",
    timescale=1.0,
    telemetry={"probes": 1},
)
"""A task view as the wire carries it (also used by ``tests/server/test_protocol.py``)."""


class Rig:
    def __init__(self, server: RoomServer, root: Path, worktree: Path) -> None:
        self.server = server
        self.root = root
        self.worktree = worktree

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[Client]:
        token = (self.root / "state" / "token").read_text()
        async with open_websocket_url(f"ws://127.0.0.1:{self.server.port}/") as ws:
            client = Client(ws)
            assert (await client.hello(token))["type"] == "welcome"
            yield client

    def submit(self, task_id: str = "t1", **extra: Any) -> Frame:
        frame = {
            "type": "task_submit",
            "task_id": task_id,
            "prompt": "do the task",
            "worktree": str(self.worktree),
        }
        return frame | extra


@contextlib.asynccontextmanager
async def rig(root: Path, steps: list[Step]) -> AsyncIterator[Rig]:
    worktree = make_worktree(root)
    async with scripted_upstream(steps) as (_model, url):
        config = config_from_dict({"model": {"base_url": url}}, base=root)
        async with open_server(config, ServeOptions(port=0), base_dir=root) as server:
            yield Rig(server, root, worktree)


async def ended(client: Client, task_id: str = "t1") -> list[Frame]:
    """Every ``task_event`` of ``task_id`` up to and including its last one."""
    seen: list[Frame] = []
    while True:
        frame = await client.until(lambda f: f["type"] == "task_event" and f["task_id"] == task_id)
        seen.append(frame)
        if frame["ended"] is not None:
            return seen


def error(frame: Frame) -> tuple[str, str | None]:
    assert frame["type"] == "error", frame
    return frame["code"], frame.get("ref")


async def answer(client: Client, frame: Frame) -> Frame:
    """Send ``frame``; the next frame that is not an event."""
    await client.send(frame)
    return await client.until(lambda f: f["type"] not in ("task_event", "typing"))


# -- P11: submit, run to done, show ----------------------------------------------------------


async def test_p11_submit_streams_events_to_done_and_shows_the_candidate(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, [done("fixed it"), say("finished")]) as r, r.connect() as client:
            accepted = await answer(client, r.submit())
            assert accepted == {
                "type": "task_accepted",
                "task_id": "t1",
                "state": "open",
                "disposition": "started",
            }
            events = await ended(client)
            assert events[-1]["ended"] == "done"
            assert events[-1]["state"] == "done"
            assert "success_intent" in [e["state"] for e in events]
            view = await answer(client, {"type": "task_show", "task_id": "t1"})
            assert view["type"] == "task_view"
            assert view["state"] == "done"
            assert view["worktree"] == str(r.worktree)
            assert view["process"] is None  # the epoch's tree is gone
            candidate = view["ended"]["candidate"]
            assert candidate["manifest_digest"] == view["ended"]["manifest_digest"]
            assert await trio.Path(candidate["ref"]).exists()
            assert [(x["kind"], x["accepted"]) for x in view["receipts"]] == [("done", True)]
            assert view["soft_seconds"] == 300.0
            assert view["timescale"] == 1.0
            # the same task again: duplicate; the list holds it
            again = await answer(client, r.submit())
            assert (again["type"], again["disposition"]) == ("task_accepted", "duplicate")
            listed = await answer(client, {"type": "task_show"})
            assert listed["type"] == "task_list"
            assert [t["task_id"] for t in listed["tasks"]] == ["t1"]
            # a control of an ended task is refused with its code
            late = await answer(client, {"type": "task_control", "task_id": "t1",
                                         "action": "abort"})  # fmt: skip
            assert error(late) == ("task_ended", "t1")


async def test_p11_a_waiting_task_is_woken_by_its_reply_on_the_wire(tmp_path: Path) -> None:
    steps: list[Step] = [wait("which colour?"), say("asked"), done(), say("finished")]
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, steps) as r, r.connect() as client:
            await client.send({"type": "task_reply", "task_id": "t1", "text": "early"})
            assert error(await client.receive()) == ("task_unknown", "t1")
            assert (await answer(client, r.submit()))["type"] == "task_accepted"
            await client.until(lambda f: f["type"] == "task_event" and f["state"] == "waiting")
            view = await answer(client, {"type": "task_show", "task_id": "t1"})
            assert view["classification"] == "WaitingUser"
            assert "task reply" in view["next_action"]
            wrong = {"type": "task_reply", "task_id": "t1", "text": "x", "correlation": "nope"}
            assert error(await answer(client, wrong)) == ("task_not_waiting", "t1")
            correlation = view["receipts"][-1]["intent_id"]
            reply = {
                "type": "task_reply",
                "task_id": "t1",
                "text": "blue",
                "correlation": correlation,
            }
            woken = await answer(client, reply)
            assert (woken["type"], woken["task_id"]) == ("task_view", "t1")
            assert (await ended(client))[-1]["ended"] == "done"


async def test_p11_bad_task_frames_and_refusals_have_their_codes(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, []) as r, r.connect() as client:
            cases: list[tuple[Frame, tuple[str, str | None]]] = [
                ({"type": "task_submit", "task_id": "t9", "worktree": "/x"},
                 ("missing_field", "t9")),
                (r.submit(colour="red"), ("unknown_field", "t1")),
                ({"type": "task_control", "task_id": "t1", "action": "explode"},
                 ("wrong_type", "t1")),
                ({"type": "task_control", "task_id": "t1", "action": "grant", "epochs": -1},
                 ("wrong_type", "t1")),
                ({"type": "task_show", "task_id": 5}, ("wrong_type", "task_show")),
                (r.submit("bad id!"), ("task_invalid", "bad id!")),
                (r.submit(prompt="  "), ("task_invalid", "t1")),
                (r.submit(worktree="relative/dir"), ("task_invalid", "t1")),
                (r.submit(worktree=str(tmp_path / "nowhere")), ("worktree_missing", "t1")),
                (r.submit(grants=["read", "launch_missiles"]), ("task_invalid", "t1")),
                ({"type": "task_show", "task_id": "ghost"}, ("task_unknown", "ghost")),
                ({"type": "task_control", "task_id": "ghost", "action": "resume"},
                 ("task_unknown", "ghost")),
            ]  # fmt: skip
            for frame, expected in cases:
                assert error(await answer(client, frame)) == expected, frame
            # nothing of that was admitted; the connection is still usable
            assert (await answer(client, {"type": "task_show"}))["tasks"] == []


async def test_p11_conflict_not_held_and_late_controls(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, [wait(), say("asked")]) as r, r.connect() as client:
            assert (await answer(client, r.submit()))["type"] == "task_accepted"
            conflict = await answer(client, r.submit(prompt="another task"))
            assert error(conflict) == ("task_conflict", "t1")
            await client.until(lambda f: f["type"] == "task_event" and f["state"] == "waiting")
            resume = {"type": "task_control", "task_id": "t1", "action": "resume"}
            assert error(await answer(client, resume)) == ("task_not_held", "t1")
            grant = {"type": "task_control", "task_id": "t1", "action": "grant", "epochs": 1}
            assert error(await answer(client, grant)) == ("task_invalid", "t1")
            grant["reason"] = "a slow model"
            granted = await answer(client, grant)
            assert granted["budget"]["granted_epochs"] == 1
            abort = {"type": "task_control", "task_id": "t1", "action": "abort", "reason": "x"}
            aborted = await answer(client, abort)
            assert aborted["type"] == "task_view"
            events = await ended(client)
            assert events[-1]["ended"] == "aborted"
            fail = {"type": "task_control", "task_id": "t1", "action": "fail"}
            assert error(await answer(client, fail)) == ("task_ended", "t1")


# -- P12: every connection hears every task ----------------------------------------------------


async def test_p12_task_events_go_to_every_connection(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        async with (
            rig(tmp_path, [done(), say()]) as r,
            r.connect() as submitter,
            r.connect() as watcher,
        ):
            assert (await answer(submitter, r.submit()))["type"] == "task_accepted"
            heard = await ended(watcher)
            assert heard[-1]["ended"] == "done"
            assert (await ended(submitter))[-1]["ended"] == "done"
            status = await r.server.status()
            assert status["tasks"][0]["task_id"] == "t1"
            assert status["tasks"][0]["ended"] == "done"
            assert status["unsafe_test_timescale"] == 1.0
            assert "warning" not in status


# -- P13: the runner's own objects -----------------------------------------------------------


def test_p13_task_view_and_task_event_are_the_runners_objects() -> None:
    frame = TaskViewFrame.of(TASK_VIEW)
    assert isinstance(frame, TaskView)
    fields = {f.name for f in msgspec.structs.fields(TaskView)}
    data = msgspec.json.decode(encode_server_frame(frame))
    assert set(data) == fields | {"type"}
    assert decode_server_frame(encode_server_frame(frame)) == frame
    event = TaskEvent(
        task_id="t1", state="open", classification="Active", phase="provider", process_epoch=1
    )
    assert decode_server_frame(encode_server_frame(event)) == event


@pytest.mark.parametrize("timescale", [60.0])
async def test_p12_the_unsafe_time_scale_is_in_every_view_and_the_status(
    tmp_path: Path, timescale: float
) -> None:
    worktree = make_worktree(tmp_path)
    with trio.fail_after(LIMIT):
        async with scripted_upstream([done(), say()]) as (_model, url):
            config = config_from_dict({"model": {"base_url": url}}, base=tmp_path)
            options = ServeOptions(port=0, unsafe_test_timescale=timescale)
            async with open_server(config, options, base_dir=tmp_path) as server:
                r = Rig(server, tmp_path, worktree)
                async with r.connect() as client:
                    assert (await answer(client, r.submit()))["type"] == "task_accepted"
                    await ended(client)
                    view = await answer(client, {"type": "task_show", "task_id": "t1"})
                    assert view["timescale"] == timescale
                    assert view["soft_seconds"] == 300.0 / timescale
                    assert view["grace_seconds"] == 120.0 / timescale
                status = await server.status()
                assert status["unsafe_test_timescale"] == timescale
                assert status["warning"].startswith("UNSAFE TEST TIMESCALE x60: thresholds divided")


async def test_rt12_task_forget_through_the_running_server(tmp_path: Path) -> None:
    """``task forget`` on the admin socket of a running server (docs/design/retention.md
    RT12): an ended task's candidate archive and lane go, and a submission under its id is
    then refused ``task_expired`` on the wire; a live task is ``task_not_ended``."""
    with trio.fail_after(LIMIT):
        steps: list[Step] = [done("fixed it"), say("finished"), wait("which one?")]
        async with rig(tmp_path, steps) as r, r.connect() as client:
            await answer(client, r.submit())
            await ended(client)
            view = await answer(client, {"type": "task_show", "task_id": "t1"})
            archive = trio.Path(view["ended"]["candidate"]["ref"])
            assert await archive.exists()
            live_tree = tmp_path / "live"
            live_tree.mkdir()
            await answer(client, r.submit("t2", worktree=str(live_tree)))
            await client.until(lambda f: f["type"] == "task_event" and f["state"] == "waiting")
            state = tmp_path / "state"
            live = await admin_request(state, {"command": "task_forget", "task_id": "t2"})
            assert live is not None
            assert (live["ok"], live["code"]) == (False, "task_not_ended")
            assert r.server.tasks.events_of("t1")[0]  # its events, shown while it is known
            forgot = await admin_request(state, {"command": "task_forget", "task_id": "t1"})
            assert forgot is not None
            assert forgot["ok"], forgot
            assert r.server.tasks.events_of("t1") == ([], 0)  # let go with its id
            assert str(archive) in forgot["removed"]
            assert not await archive.exists()
            again = await answer(client, r.submit())
            assert error(again) == ("task_expired", "t1")
