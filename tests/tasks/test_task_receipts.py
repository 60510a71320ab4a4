"""Receipts (``docs/design/receipts.md``, gate T13) in task lanes. The crash tests kill a real
host process (``tests/tasks/task_host.py``) at a named point and recover the task on a second
host (the rig and its helpers are ``test_task_crash.py``'s); the others run a task runner in
process (``tests/task_harness.py``) on virtual time, with a real receipt store."""

from __future__ import annotations

import json
import secrets
import sqlite3
from pathlib import Path

import trio
import trio.testing

from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import Call, Scenario, Step, Text, ToolCalls
from runtime._boundary._receipts import receipt_store
from runtime._clock import Clocks, MockWallClock
from runtime._config import RetentionConfig
from runtime._journal._store import open_store
from runtime._tasks._runner import open_task_runner
from runtime._wire import TaskSpec
from runtime.testing._in_process import InProcessWorkers

from .._workers import tool_messages
from ..task_harness import ROUTE, TASK, WAIT_BOUND, make_worktree, say
from .test_task_crash import (
    assert_asked,
    check_common,
    crash_rig,
    done,
    kill_when_paused,
    outcome,
    recover,
    task_spec,
)


async def test_t13_crash_after_a_coerced_receipt_write_settles_with_its_saved_result(
    tmp_path: Path,
) -> None:
    """The model sends ``write_document`` a number where the schema asks a string
    (``"content": 42``); the worker coerces it to ``"42"`` before the gate sees the call, so
    the intent records ``"42"`` and the write applies ``"42"``. The host is killed after the
    receipt committed, before the outcome. The next host settles the dead worker's dangling
    call from its session, which holds the model's ``42``: run with those arguments, the
    guarded write was refused ``document_invalid`` and that recorded as the call's outcome —
    the model was told its write was refused while the document held it. It must get the
    receipt's saved result, nothing written again."""
    args = {"document_id": "notes", "content": 42}
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="write_document", arguments=args, id="c1")]),
        done(),
        Text(text="finished"),
    ]
    async with crash_rig(tmp_path, steps) as (model, url, workers):
        spec = task_spec(url, grants=("read", "write_document"))
        facts = await kill_when_paused(tmp_path, spec, "receipt_commit")
        facts += await recover(tmp_path, spec)
    assert outcome(facts)["ended"]["state"] == "done", facts
    check_common(tmp_path, facts, workers)
    with sqlite3.connect(tmp_path / "state" / "receipts.sqlite") as db:
        revisions = db.execute("SELECT revision_id, content FROM revisions").fetchall()
        receipts = db.execute("SELECT intent_id FROM receipts").fetchall()
    assert [r[1] for r in revisions] == ["42"]
    assert len(receipts) == 1
    assert_asked(model, through_done=2)
    (saved,) = tool_messages(model.requests[1].body).values()
    assert not saved.startswith("document_invalid"), saved
    assert json.loads(saved)["revision_id"] == revisions[0][0]


async def test_t13_crash_between_a_receipt_intent_and_its_write_applies_it_once(
    tmp_path: Path,
) -> None:
    """Killed right after ``write_document``'s intent is durable, before the guarded write
    ran (nothing committed): the next host settles the dead worker's dangling call by running
    that write under the original intent id — applied exactly once, its result the model's —
    not "possibly ran", and not skipped."""
    args = {"document_id": "notes", "content": "written after the crash"}
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="write_document", arguments=args, id="c1")]),
        done(),
        Text(text="finished"),
    ]
    async with crash_rig(tmp_path, steps) as (model, url, workers):
        spec = task_spec(url, grants=("read", "write_document"))
        facts = await kill_when_paused(tmp_path, spec, "record:tool_intent")
        assert not (tmp_path / "state" / "receipts.sqlite").exists() or _rows(tmp_path) == []
        facts += await recover(tmp_path, spec)
    assert outcome(facts)["ended"]["state"] == "done", facts
    check_common(tmp_path, facts, workers)
    revisions = _rows(tmp_path)
    assert [r[1] for r in revisions] == ["written after the crash"]
    assert_asked(model, through_done=2)
    (saved,) = tool_messages(model.requests[1].body).values()
    assert json.loads(saved)["revision_id"] == revisions[0][0]


def _rows(tmp_path: Path) -> list[tuple[str, str]]:
    """The store's revisions (id, content) and, checked beside them, one receipt each."""
    with sqlite3.connect(tmp_path / "state" / "receipts.sqlite") as db:
        revisions = db.execute("SELECT revision_id, content FROM revisions").fetchall()
        receipts = db.execute("SELECT intent_id FROM receipts").fetchall()
    assert len(receipts) == len(revisions)
    return [(str(r[0]), str(r[1])) for r in revisions]


DAY = 86_400.0


def write(document_id: str, content: str) -> ToolCalls:
    """A new document's first write (no base)."""
    args = {"document_id": document_id, "content": content}
    return ToolCalls(calls=[Call(name="write_document", arguments=args)])


async def test_r1_a_task_id_used_again_after_forget_days_writes_anew(
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    """A receipt's key is the intent id, and an intent id must never be minted twice. A task
    that wrote a document ends and is expired; past ``forget_days`` its id is new again
    (RT4, RT12) and a new task under it gets a new lane log whose sequence numbers start
    over. Its intent ids were ``<lane key>:<seq>`` — the old task's, whose receipts the store
    keeps — so its first ``write_document`` (another document, at the same place in the log)
    was refused ``receipt_key_conflict`` ("applied with other input") for a write that never
    applied; with the same input it would have been handed the old task's saved result,
    nothing written. The new task's write applies, and the model hears its revision."""
    retention = RetentionConfig(journal_days=7, idempotency_days=30, forget_days=40)
    steps: list[Step] = [
        write("notes", "the first task's"),
        done(),
        say("one"),
        write("plan", "the second task's"),
        done(),
        say("two"),
    ]
    model = ScriptedModel(
        scenario=Scenario(steps=steps), call_id_prefix=f"call_{secrets.token_hex(4)}"
    )
    workers = InProcessWorkers(model=model, behaviours={}, identity={}, survivors={})
    spec = TaskSpec(
        task_id=TASK,
        prompt="write the notes",
        worktree=str(make_worktree(tmp_path)),
        grants=frozenset({"read", "write_document"}),
    )
    state = tmp_path / "state"
    async with (
        open_store(state, clocks=clocks) as store,
        receipt_store(state) as receipts,
        open_task_runner(
            store,
            workers=workers,
            route=ROUTE,
            clocks=clocks,
            ledger=tmp_path / "effects.jsonl",
            work_root=tmp_path / "work",
            receipts=receipts,
        ) as runner,
    ):
        await runner.submit(spec)
        with trio.fail_after(WAIT_BOUND):
            assert (await runner.wait(TASK)).state == "done"
        (first,) = await receipts.revisions("notes")
        wall_clock.advance(31 * DAY)
        assert (await runner.retain(retention)).expired == (TASK,)
        wall_clock.advance(10 * DAY)  # day 41: the id is let go, new again
        await runner.submit(spec)
        with trio.fail_after(WAIT_BOUND):
            assert (await runner.wait(TASK)).state == "done"
        notes, plan = await receipts.revisions("notes"), await receipts.revisions("plan")
        last = tool_messages(model.requests[-1].body)
        (answer,) = [text for text in last.values() if not text.startswith("Accepted")]
        assert not answer.startswith("receipt_key_conflict"), answer
        assert plan == [json.loads(answer)["revision_id"]]
        read = await receipts.read_document({"document_id": "plan"})
    assert notes == [first]
    assert read["content"] == "the second task's"
