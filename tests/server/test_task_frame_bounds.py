"""Task frames fit ``[server] max_frame_bytes`` (docs/design/protocol.md P15): a real server on
127.0.0.1 with a small bound, a real websocket client that takes frames of at most that size
(a larger one closes its connection, 1009), real Fake-Pi epochs talking to a scripted model on
loopback. Every wait is for a frame, bounded by ``trio.fail_after``; nothing sleeps.

A ``task_list`` of many tasks and a ``task_view`` of many receipts grow without bound; a client
built to the documented bound must still be able to read them, at every ask."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import msgspec
import trio
from trio_websocket import open_websocket_url

from fake_pi.scenario import Step
from runtime._config import config_from_dict
from runtime._server._frame_fit import fit_task_list, fit_task_view
from runtime._server._protocol import TaskList, TaskViewFrame
from runtime._server._serve import ServeOptions, open_server

from .._wire import Client, Frame
from .._workers import scripted_upstream
from ..task_harness import done, make_worktree, say, wait
from .test_task_wire import TASK_VIEW, answer, ended

LIMIT: Final = 90.0
BOUND: Final = 8 * 1024
"""A small frame bound the configuration allows (C15, with one attachment a reply)."""
SETTINGS: Final[dict[str, Any]] = {
    "server": {"max_frame_bytes": BOUND},
    "attachments": {"max_per_reply": 1},
}
LONG_ID: Final = "t" * 120
"""A task id near its longest (128 characters); each task's own ends in a number."""


@contextlib.asynccontextmanager
async def bounded_server(root: Path, steps: list[Step]) -> AsyncIterator[tuple[Client, Path]]:
    """A server under :data:`BOUND`, and a client that takes frames of at most ``BOUND``
    UTF-8 bytes: a larger one fails the test (trio-websocket's own ``max_message_size``
    counts a text frame's characters, not its bytes, so it is set, and the bytes are counted
    here too)."""
    worktree = make_worktree(root)
    async with scripted_upstream(steps) as (_model, url):
        config = config_from_dict(SETTINGS | {"model": {"base_url": url}}, base=root)
        async with open_server(config, ServeOptions(port=0), base_dir=root) as server:
            token = (root / "state" / "token").read_text()
            url = f"ws://127.0.0.1:{server.port}/"
            async with open_websocket_url(url, max_message_size=BOUND) as ws:
                client = Client(ws)

                async def receive() -> Frame:
                    text = await ws.get_message()
                    size = len(text.encode() if isinstance(text, str) else text)
                    assert size <= BOUND, f"a frame of {size} bytes: {text[:200]!r}"
                    frame: Frame = json.loads(text)
                    return frame

                client.receive = receive  # type: ignore[method-assign]
                assert (await client.hello(token))["type"] == "welcome"
                yield client, worktree


def _submit(task_id: str, worktree: Path) -> Frame:
    return {"type": "task_submit", "task_id": task_id, "prompt": "do it", "worktree": str(worktree)}


async def test_p15_a_task_list_of_more_tasks_than_a_frame_holds_fits_and_pages(
    tmp_path: Path,
) -> None:
    """P15: eight ended tasks with ids near their longest make a ``task_list`` of every task
    larger than the bound (about 20 KB at 8 KiB). The answer fits: the tasks it carries, by
    id, and ``tasks_left_out`` says how many more there are; ``task_show {after}`` pages on
    from the last task carried, until every task was listed once. Before, the whole list went
    out in one frame, and the client's connection was closed (1009) at every ``task_show``."""
    ids = [f"{LONG_ID}{n:02d}" for n in range(8)]
    steps: list[Step] = [step for _ in ids for step in (done("fixed"), say("finished"))]
    with trio.fail_after(LIMIT):
        async with bounded_server(tmp_path, steps) as (client, worktree):
            for task_id in ids:  # one after another: the worktree is leased while one runs
                assert (await answer(client, _submit(task_id, worktree)))["type"] == (
                    "task_accepted"
                )
                assert (await ended(client, task_id))[-1]["ended"] == "done"
            listed: list[str] = []
            pages = 0
            after: dict[str, str] = {}
            while True:
                page = await answer(client, {"type": "task_show", **after})
                assert page["type"] == "task_list", page
                pages += 1
                listed += [view["task_id"] for view in page["tasks"]]
                assert all(view["receipts_left_out"] == 0 for view in page["tasks"])
                if page["tasks_left_out"] == 0:
                    break
                assert page["tasks"], "a page carries at least one task"
                after = {"after": listed[-1]}
            view = await answer(client, {"type": "task_show", "task_id": ids[-1]})
            assert (view["type"], view["state"]) == ("task_view", "done")
    assert listed == sorted(ids)
    assert pages > 1


async def test_p15_a_task_view_of_more_receipts_than_a_frame_holds_fits(tmp_path: Path) -> None:
    """P15: a task asks five long questions (each receipt keeps 2,000 characters of one), is
    answered each time and ends done: its ``task_view`` — the answer to each ``task_reply``
    and to ``task_show`` — is larger than the bound (about 13 KB at 8 KiB). Each fits: it
    carries its latest receipts, the ``done`` one last, and ``receipts_left_out`` says how many
    earlier ones it left out. Before, the view went out whole, and the client's connection was
    closed (1009) at the reply that made it too large, and at every ``task_show`` after."""
    questions = [f"{n}" + "q" * 1999 for n in range(5)]
    steps: list[Step] = [s for q in questions for s in (wait(q), say("asked"))]
    steps += [done("fixed"), say("finished")]
    with trio.fail_after(LIMIT):
        async with bounded_server(tmp_path, steps) as (client, worktree):
            assert (await answer(client, _submit("t1", worktree)))["type"] == "task_accepted"
            for _ in questions:
                await client.until(lambda f: f["type"] == "task_event" and f["state"] == "waiting")
                woken = await answer(client, {"type": "task_reply", "task_id": "t1", "text": "x"})
                assert (woken["type"], woken["task_id"]) == ("task_view", "t1"), woken
            assert (await ended(client))[-1]["ended"] == "done"
            view = await answer(client, {"type": "task_show", "task_id": "t1"})
            listed = await answer(client, {"type": "task_show"})
    assert view["type"] == "task_view"
    assert view["state"] == "done"
    kinds = [receipt["kind"] for receipt in view["receipts"]]
    assert kinds[-1] == "done"
    assert view["receipts_left_out"] > 0
    assert view["receipts_left_out"] + len(kinds) == len(questions) + 1
    assert [t["task_id"] for t in listed["tasks"]] == ["t1"]
    assert listed["tasks_left_out"] == 0


def _size(frame: msgspec.Struct) -> int:
    return len(msgspec.json.encode(frame))


def test_p15_a_task_view_whose_texts_alone_overflow_the_bound_is_cut_and_marked() -> None:
    """P15: a view whose every part is long — a hold reason, a finalization with a long
    validation command and output, an end whose detail and validation are long, many long
    receipts — is cut to fit bounds from the least one (1 KiB) up: the receipts first (the
    latest kept), then its long texts, marked ``truncated``; its ids and state are whole. A
    bound it already fits leaves it unchanged."""
    long = "\u00e9" * 3000  # two UTF-8 bytes a character: the bound is counted in bytes
    validation = {"command": ["make", long], "exit_status": 1, "output_tail": long}
    view = msgspec.structs.replace(
        TASK_VIEW,
        task_id="t" * 128,
        hold_reason=long,
        receipts=[{"kind": "wait", "detail": long, "intent_id": f"i{n}"} for n in range(9)],
        finalization={"code": "task_not_done", "detail": long, "validation": validation},
        ended={"state": "failed", "detail": long, "validation": validation},
        failure={"code": "x", "message": long},
    )
    assert fit_task_view(TASK_VIEW, 2048) == TASK_VIEW
    for bound in (1024, 2048, 4096, 16 * 1024):
        fitted = fit_task_view(view, bound)
        assert _size(TaskViewFrame.of(fitted)) <= bound
        assert (fitted.task_id, fitted.state) == (view.task_id, view.state)
        assert fitted.truncated
        assert fitted.receipts == view.receipts[len(view.receipts) - len(fitted.receipts) :]
        assert fitted.receipts_left_out == len(view.receipts) - len(fitted.receipts)
    assert fit_task_view(view, 256 * 1024) == view


def test_p15_a_task_list_carries_at_least_one_task_however_large() -> None:
    """P15: a list whose first task alone is larger than the bound carries it cut (so paging
    always moves on), and every task carried after it whole."""
    big = msgspec.structs.replace(
        TASK_VIEW, task_id="a", receipts=[{"detail": "r" * 900, "n": n} for n in range(9)]
    )
    small = [msgspec.structs.replace(TASK_VIEW, task_id=f"b{n}") for n in range(20)]
    page = fit_task_list([big, *small], 4096)
    assert _size(page) <= 4096
    assert page.tasks[0].task_id == "a"
    assert page.tasks[0].receipts_left_out > 0
    assert page.tasks[1:] == small[: len(page.tasks) - 1]
    assert page.tasks_left_out == 21 - len(page.tasks)
    whole = fit_task_list(small, 1024 * 1024)
    assert (whole.tasks, whole.tasks_left_out) == (small, 0)
    assert isinstance(whole, TaskList)
