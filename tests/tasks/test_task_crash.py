"""Crashes of a task-runner host, by SIGKILL at every outbox step (issue #8 items 7 and 8:
"restart at every outbox step"; ``docs/design/watchdog.md`` WD11, LK7).

The host is a real process (``tests/tasks/task_host.py``): a task runner with real worker
processes (subprocess Fake-Pi behind the lane's gateway and gate) on the scripted model,
the unsafe test time scale and the real clock. A Fake-Pi ``hang`` barrier before its first
model request wedges an epoch, so the watchdog probes, finds it eligible, reserves the
budget, fences and resumes it. The test kills the host right after a named point, starts a
new host on the same state directory and checks what happened exactly once and what was never
lost: one continuation prompt per continuation action (its marker once in the session), one
budget charge per replacement (a host restart that replaces the worker is one too), no
refund, an explicit disposition or a hold, no worker of the killed host left alive and never
two workers of the task at once, each effect at most once, one lifecycle receipt, and a task
that had ended not run again.
"""

from __future__ import annotations

import collections
import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import Call, Step, Text, ToolCalls
from runtime._journal._journal import read_log
from runtime._journal._store import Store
from runtime._linux._fs import OsFileSystem
from runtime._linux._proctree import EPOCH_ENV, proc_table, read_environ
from runtime._pi._session_settle import interrupted_text
from runtime._records import (
    ContinuationSent,
    EpochStarted,
    LifecycleReceipt,
    OutboxAction,
    Record,
    TaskEnded,
    ToolIntent,
)

from .._host_process import Fact, Host, no_epoch_left, run_host
from .._procs import alive_with_nonce, epoch_nonces
from .._workers import scripted_upstream, tool_messages

pytestmark = pytest.mark.slow

HOST: Final = Path(__file__).with_name("task_host.py")
REPO: Final = Path(__file__).resolve().parents[2]
LIMIT: Final = 60.0
SCALE: Final = 300.0
"""Soft 1 s, hard 3 s, grace 0.4 s, tick 1/60 s, probe timeout 0.1 s, recovery 6 s."""
TASK: Final = "task-1"
HANG: Final = {"before_model:1": "hang"}
"""A Fake-Pi epoch wedged before its first model request (provider phase, no output)."""


def done(summary: str = "did it") -> ToolCalls:
    return ToolCalls(calls=[Call(name="task_done", arguments={"summary": summary})])


# ------------------------------------------------------------------------------ the host


def host(
    root: Path, spec: Mapping[str, Any], name: str
) -> contextlib.AbstractAsyncContextManager[Host]:
    return run_host(HOST, root, spec, name)


def task_spec(
    url: str,
    *,
    grants: Sequence[str] = ("read",),
    behaviours: Mapping[int, Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    """What every host of one test runs: the task, the model, the wedged epochs."""
    return {
        "upstream": url,
        "scale": SCALE,
        "task": {"task_id": TASK, "prompt": "do the task", "grants": list(grants)},
        "behaviours": {str(n): dict(at) for n, at in (behaviours or {}).items()},
        "term_grace": 0.5,
        "probe_timeout": 3.0,
    }


async def kill_when_paused(
    root: Path, spec: Mapping[str, Any], point: str, *, name: str = "a", nth: int = 1
) -> list[Fact]:
    """Run a host until it passes the ``nth`` ``point`` (``task_host.py`` ``pause``) and
    stops there whole, then SIGKILL it; its facts. Stopped, none of its tasks goes on past the
    point, however late the kill comes (a loaded machine)."""
    async with host(root, {**spec, "pause": {"point": point, "nth": nth}}, name) as h:
        await h.until(lambda f: "paused" in f)
        await h.stopped()
        await h.kill()
        return h.facts


async def recover(root: Path, spec: Mapping[str, Any], name: str = "b") -> list[Fact]:
    """Run a host on the same state until the task ends or is held; its facts."""
    async with host(root, spec, name) as h:
        return await h.finish()


def assert_asked(model: ScriptedModel, *, through_done: int) -> None:
    """The model was asked ``through_done`` times up to the answer that called ``task_done``,
    and at most once more: the request after the terminal receipt (answered "finished") is
    made only if the worker gets to it within the grace (LK9: 0.4 s on this time scale,
    after which the epoch is stopped), which the machine's load decides."""
    assert model.request_count in (through_done, through_done + 1), model.request_count


def outcome(facts: list[Fact]) -> Fact:
    """The last host's end: its ``ended`` or ``held`` fact (a change event may follow it)."""
    ends = [f for f in facts if "ended" in f or "held" in f]
    assert ends, facts
    return ends[-1]


# ------------------------------------------------------------------- what the tests read


def records(root: Path) -> list[Record]:
    rel = Store.lane_rel(f"task:{TASK}")
    return list(read_log(OsFileSystem(), str(root / "state"), rel).records)


def actions(found: list[Record], kind: str, state: str | None = "done") -> list[OutboxAction]:
    return [
        r
        for r in found
        if isinstance(r, OutboxAction) and r.kind == kind and state in (None, r.state)
    ]


def session_text(root: Path) -> str:
    (path,) = (root / "state" / "lanes").glob("*/session.jsonl")
    return path.read_text()


def effects(root: Path) -> list[dict[str, Any]]:
    path = root / "effects.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def budgets(facts: list[Fact]) -> list[int]:
    """``epochs_used`` as each host reported it, in order."""
    return [f["budget"]["epochs_used"] for f in facts if "budget" in f]


def make_worktree(root: Path) -> None:
    worktree = root / "worktree"
    worktree.mkdir()
    (worktree / "README.md").write_text("a task's worktree\n")


class Workers:
    """Every live worker process of this test (any process whose environment carries an
    epoch nonce and whose HOME lies under the test's ``work``), sampled while the test runs:
    the most distinct epochs ever alive at once."""

    def __init__(self, root: Path) -> None:
        self.home = f"HOME={root / 'work'}".encode()
        self.most = 0
        self.seen: set[str] = set()

    def alive(self) -> dict[str, list[int]]:
        """Live worker processes by epoch nonce."""
        prefix = f"{EPOCH_ENV}=".encode()
        out: dict[str, list[int]] = {}
        for pid, info in proc_table().items():
            if not info.alive:
                continue
            env = (read_environ(pid) or b"").split(b"\0")
            if not any(e.startswith(self.home) for e in env):
                continue
            for entry in env:
                if entry.startswith(prefix):
                    out.setdefault(entry[len(prefix) :].decode(), []).append(pid)
        return out

    async def watch(self) -> None:
        while True:
            alive = await trio.to_thread.run_sync(self.alive)
            self.seen |= set(alive)
            self.most = max(self.most, len(alive))
            await trio.sleep(0.02)


@contextlib.asynccontextmanager
async def crash_rig(
    root: Path, steps: Sequence[Step]
) -> AsyncIterator[tuple[ScriptedModel, str, Workers]]:
    """The scripted model, a worktree, and the live-worker watch, for one test; as it ends,
    whatever the hosts' worker epochs left running is killed from their records, and a test
    that would have left any fails (``no_epoch_left``)."""
    make_worktree(root)
    workers = Workers(root)
    async with no_epoch_left(root):  # nothing any host started outlives the test
        with trio.fail_after(LIMIT):
            async with scripted_upstream(steps) as (model, url), trio.open_nursery() as nursery:
                nursery.start_soon(workers.watch)
                yield model, url, workers
                nursery.cancel_scope.cancel()


def check_common(root: Path, facts: list[Fact], workers: Workers) -> list[Record]:
    """What holds after every recovery: the lane's log, checked for what must be once."""
    found = records(root)
    # no refund: epochs_used never decreases across the hosts
    used = budgets(facts)
    assert used == sorted(used), used
    # one reserve per continuation id, one charge per reserve
    reserves = actions(found, "reserve")
    assert len({r.action_id for r in reserves}) == len(reserves)
    # one continuation prompt per continuation action id: one record, never two markers in the
    # session; a worker killed with its host right after the prompt was sent may not have kept
    # it (TL5: it is not sent again, the next replacement gets its own), but the last one sent
    # is the one the finishing worker worked from
    sent = [r for r in found if isinstance(r, ContinuationSent)]
    assert len({r.action_id for r in sent}) == len(sent)
    text = session_text(root)
    for record in sent:
        assert text.count(json.dumps(record.marker)[1:-1]) <= 1, record
    if sent and "ended" in outcome(facts):
        assert text.count(json.dumps(sent[-1].marker)[1:-1]) == 1, sent[-1]
    # the lifecycle receipt is not duplicated
    receipts = [r for r in found if isinstance(r, LifecycleReceipt)]
    assert len({r.intent_id for r in receipts}) == len(receipts)
    assert sum(r.accepted for r in receipts) <= 1
    # never two workers of the task at once, none unrecorded; nothing of any epoch left alive
    assert workers.most <= 1, workers.seen
    nonces = {r.nonce for r in found if isinstance(r, EpochStarted)} | {
        str(a.detail["nonce"]) for a in actions(found, "launch", None) if "nonce" in a.detail
    }  # W13: a launch names its tree before the spawn
    assert workers.seen
    assert workers.seen <= nonces, (workers.seen, nonces)
    assert not set(workers.alive()) & nonces
    for nonce in nonces:
        marker = f"{EPOCH_ENV}={nonce}".encode()
        for pid in proc_table():
            assert marker not in (read_environ(pid) or b"").split(b"\0"), (pid, nonce)
    # each effect at most once
    keys = [e["key"] for e in effects(root)]
    assert len(set(keys)) == len(keys), keys
    return found


# --------------------------------------------------------------------------------- tests

STEPS: Final[list[Step]] = [done(), Text(text="finished")]


async def test_a_wedged_worker_is_fenced_and_resumed_without_a_crash(tmp_path: Path) -> None:
    """The baseline every crash below departs from: epoch 1 wedges before its first model
    request, the watchdog probes (soft, then fence), finds it eligible, reserves one epoch,
    fences it and resumes the task in epoch 2 with one continuation; the task ends done."""
    async with crash_rig(tmp_path, STEPS) as (model, url, workers):
        facts = await recover(tmp_path, task_spec(url, behaviours={1: HANG}), "a")
    assert outcome(facts)["ended"]["state"] == "done", facts
    found = check_common(tmp_path, facts, workers)
    assert [r.epoch for r in found if isinstance(r, EpochStarted)] == [1, 2]
    assert [p.detail["purpose"] for p in actions(found, "probe")] == ["soft", "fence"]
    assert [len(actions(found, k)) for k in ("eligibility", "reserve", "fence", "reap")] == [1] * 4
    assert outcome(facts)["view"]["budget"]["epochs_used"] == 1
    assert_asked(model, through_done=1)
    # domain isolation: both answers came after the continuation, counted apart, once each
    costs = outcome(facts)["ended"]["costs"]
    assert costs["task"]["answers"] == 0
    answered = model.request_count - costs["requests_without_answer"]  # the last one may be
    assert costs["continuation"]["answers"] == answered >= 1  # cut by the grace (LK9)
    assert costs["continuation"]["completion_tokens"] > 0
    assert costs["requests_without_answer"] <= 1


FENCE_STEPS: Final = [
    # (pause point, whether the point lies after the budget reserve of the fence)
    ("action:probe:done:soft", False),
    ("action:eligibility", False),
    ("action:reserve", True),
    ("action:fence", True),
    ("action:signal:reserved", True),
    ("action:signal:done", True),
]


@pytest.mark.parametrize(("point", "reserved"), FENCE_STEPS)
async def test_crash_at_a_fence_step_resumes_once_and_charges_once(
    tmp_path: Path, point: str, reserved: bool
) -> None:
    """Killed at one step of the fence of a wedged epoch 1 (after the soft probe, after
    eligibility, after the budget reserve, after the fence, after the signal was reserved with
    the worker still alive, after the signal before the reap record): the next host kills what
    is left of epoch 1 before anything else, replaces the worker once (the restart is the
    replacement; a reserve already recorded is that replacement's, never charged again),
    sends one continuation and the task ends done."""
    async with crash_rig(tmp_path, STEPS) as (model, url, workers):
        spec = task_spec(url, behaviours={1: HANG})
        first = await kill_when_paused(tmp_path, spec, point)
        before = records(tmp_path)
        facts = first + await recover(tmp_path, spec)
    assert outcome(facts)["ended"]["state"] == "done", facts
    found = check_common(tmp_path, facts, workers)
    assert len(actions(before, "reserve")) == int(reserved)
    assert [r.epoch for r in found if isinstance(r, EpochStarted)] == [1, 2]
    (reserve,) = actions(found, "reserve")
    (sent,) = [r for r in found if isinstance(r, ContinuationSent)]
    assert reserve.action_id.endswith("/c1/reserve")
    assert sent.action_id == reserve.action_id.replace("/reserve", "/prompt")
    assert sent.epoch == 2
    view = outcome(facts)["view"]
    assert view["budget"]["epochs_used"] == 1
    assert budgets(facts)[-1] == 1
    assert_asked(model, through_done=1)
    # WD11: one recovery, charged from its reserve (the time the host was down included) to
    # the resumed worker's first progress, never restarted by the restart
    (charge,) = actions(found, "recovery_time")
    resumed = [r for r in found if isinstance(r, EpochStarted)][-1]
    assert charge.detail["from_ms"] == reserve.detail["at_ms"]
    assert charge.detail["to_ms"] >= resumed.started_ms
    assert charge.detail["seconds"] == (charge.detail["to_ms"] - charge.detail["from_ms"]) / 1000
    assert view["budget"]["seconds_used"] == round(charge.detail["seconds"], 3)
    # every outbox action of the killed host happened at most once
    kinds = [(r.action_id, r.state) for r in found if isinstance(r, OutboxAction)]
    twice = {kind: n for kind, n in collections.Counter(kinds).items() if n > 1}
    assert not twice, (twice, [r for r in found if isinstance(r, OutboxAction)])


async def test_repeated_crashes_after_the_launch_charge_the_replacement_once(
    tmp_path: Path,
) -> None:
    """Killed twice right after a replacement epoch was launched and recorded, before its
    continuation prompt: each restart kills that epoch and launches another for the *same*
    continuation, charged once in all; the prompt is sent once, by the epoch that lives."""
    async with crash_rig(tmp_path, STEPS) as (model, url, workers):
        spec = task_spec(url, behaviours={1: HANG})
        facts = await kill_when_paused(tmp_path, spec, "continuation_launch")
        assert [r.epoch for r in records(tmp_path) if isinstance(r, EpochStarted)] == [1, 2]
        facts += await kill_when_paused(tmp_path, spec, "continuation_launch", name="b")
        facts += await recover(tmp_path, spec, "c")
    assert outcome(facts)["ended"]["state"] == "done", facts
    found = check_common(tmp_path, facts, workers)
    assert [r.epoch for r in found if isinstance(r, EpochStarted)] == [1, 2, 3, 4]
    assert len(actions(found, "reserve")) == 1
    (sent,) = [r for r in found if isinstance(r, ContinuationSent)]
    assert sent.epoch == 4
    assert outcome(facts)["view"]["budget"]["epochs_used"] == 1
    assert_asked(model, through_done=1)


async def test_w13_a_host_killed_between_a_workers_spawn_and_its_start_record_leaves_no_tree(
    tmp_path: Path,
) -> None:
    """W13, TL12: SIGKILLed after epoch 1's worker was spawned and proven, before its
    ``EpochStarted`` is durable. The worker hangs at its start and never reads its stdin, so
    the host's death does not end it. Before, no record named that tree: the next host killed
    nothing, counted nothing of it alive, and launched epoch 2 beside it — two workers of one
    task at once on one session. Now the launch action carries the nonce, durable before the
    spawn; the next host kills the tree by it before it launches anything."""
    async with crash_rig(tmp_path, STEPS) as (model, url, workers):
        spec = task_spec(url, behaviours={1: {"startup": "hang"}})
        facts = await kill_when_paused(tmp_path, spec, "epoch_launched")
        (orphan,) = epoch_nonces(tmp_path)  # the hung worker, which no record started
        assert alive_with_nonce(orphan)
        facts += await recover(tmp_path, spec, "b")
    assert outcome(facts)["ended"]["state"] == "done", facts
    found = check_common(tmp_path, facts, workers)  # never two workers at once, none left
    (launch,) = actions(found, "launch", "reserved")[:1]
    assert launch.detail["nonce"] == orphan
    assert [r.epoch for r in found if isinstance(r, EpochStarted)] == [2]
    assert_asked(model, through_done=1)


@pytest.mark.parametrize("point", ["continuation_prompted", "record:continuation_sent"])
async def test_crash_after_the_continuation_prompt_never_sends_it_again(
    tmp_path: Path, point: str
) -> None:
    """Killed right after the continuation prompt reached the worker's session, before or
    after its marker was recorded (epoch 2 wedged too): that prompt is never sent again (a
    marker found only in the session is recorded then, TL5); the restart is a new replacement
    with its own continuation, charged once more, sent at once (no wait on an answer that
    will never come: no second fence); each marker is in the session exactly once."""
    async with crash_rig(tmp_path, STEPS) as (model, url, workers):
        spec = task_spec(url, behaviours={1: HANG, 2: HANG})
        facts = await kill_when_paused(tmp_path, spec, point)
        facts += await recover(tmp_path, spec)
    assert outcome(facts)["ended"]["state"] == "done", facts
    found = check_common(tmp_path, facts, workers)
    sent = [r for r in found if isinstance(r, ContinuationSent)]
    assert [(r.action_id.rsplit("/", 2)[1], r.epoch) for r in sent] == [("c1", 2), ("c2", 3)]
    assert len(actions(found, "reserve")) == 2
    assert [r.epoch for r in found if isinstance(r, EpochStarted)] == [1, 2, 3]
    assert len(actions(found, "fence")) == 1
    assert outcome(facts)["view"]["budget"]["epochs_used"] == 2
    assert_asked(model, through_done=1)


async def test_wd13_crash_after_an_effect_before_its_outcome_holds_and_never_runs_it_again(
    tmp_path: Path,
) -> None:
    """Killed after the runtime's ``effect`` tool (a ``never`` tool without a receipt) wrote
    its ledger line, before the gate recorded its outcome: the next host holds the task
    (``effect_possibly_ran:effect``, WD13) instead of continuing on a guess; the operator's
    resume on a third host settles the call as "possibly ran" (recorded), never runs it again,
    and continues with one continuation; the model hears it."""
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="effect", arguments={"key": "k1"}, id="c1")]),
        done(),
        Text(text="finished"),
    ]
    async with crash_rig(tmp_path, steps) as (model, url, workers):
        spec = task_spec(url, grants=("read", "effect"))
        facts = await kill_when_paused(tmp_path, spec, "effect")
        held = await recover(tmp_path, spec)
        assert outcome(held)["held"]["hold_reason"] == "effect_possibly_ran:effect", held
        assert model.request_count == 1  # nothing continued on the guess
        facts += held
        facts += await recover(tmp_path, {**spec, "on_hold": {"seconds": 1}}, "c")
    assert outcome(facts)["ended"]["state"] == "done", facts
    found = check_common(tmp_path, facts, workers)
    assert [e["key"] for e in effects(tmp_path)] == ["k1"]
    assert len([r for r in found if isinstance(r, ToolIntent) and r.name == "effect"]) == 1
    assert_asked(model, through_done=2)
    assert tool_messages(model.requests[1].body) == {"c1": interrupted_text("effect")}
    assert len(actions(found, "reserve")) == 1


async def test_crash_after_a_receipt_commit_before_its_outcome_replays_the_receipt(
    tmp_path: Path,
) -> None:
    """Killed after ``write_document``'s receipt transaction committed, before the outcome:
    the next host runs the same guarded write for the orphaned call — the receipt's saved
    result, nothing written again — and the resumed task ends done."""
    args = {"document_id": "notes", "content": "written once"}
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
    assert [r[1] for r in revisions] == ["written once"]
    assert len(receipts) == 1
    assert_asked(model, through_done=2)
    (saved,) = tool_messages(model.requests[1].body).values()
    assert json.loads(saved)["revision_id"] == revisions[0][0]


@pytest.mark.parametrize("point", ["record:lifecycle_receipt", "finalize"])
async def test_crash_after_the_terminal_receipt_finishes_without_running_again(
    tmp_path: Path, point: str
) -> None:
    """Killed right after ``task_done``'s receipt is durable (before the worker heard the
    answer), or after the epoch ended on it (before the end record): the next host kills what
    is left of the epoch, takes the manifest and candidate and ends the task done — no new
    epoch, no continuation, no second receipt, no budget charged."""
    async with crash_rig(tmp_path, STEPS) as (model, url, workers):
        spec = task_spec(url)
        facts = await kill_when_paused(tmp_path, spec, point)
        asked = model.request_count
        facts += await recover(tmp_path, spec)
    ended = outcome(facts)
    assert ended["ended"]["state"] == "done", facts
    assert ended["ended"]["candidate"] is not None
    found = check_common(tmp_path, facts, workers)
    assert [r.epoch for r in found if isinstance(r, EpochStarted)] == [1]
    assert [(r.kind, r.accepted) for r in found if isinstance(r, LifecycleReceipt)] == [
        ("done", True)
    ]
    assert not [r for r in found if isinstance(r, ContinuationSent)]
    assert not actions(found, "reserve")
    assert model.request_count == asked
    assert len([r for r in found if isinstance(r, TaskEnded)]) == 1


async def test_a_task_that_ended_is_not_run_again(tmp_path: Path) -> None:
    """Killed right after the end record: the next host (and the one after it) report the
    same end and run nothing — no epoch, no model request, no second end record."""
    async with crash_rig(tmp_path, STEPS) as (model, url, workers):
        spec = task_spec(url)
        first = await kill_when_paused(tmp_path, spec, "record:task_ended")
        asked = model.request_count
        again = await recover(tmp_path, spec)
        facts = first + again + await recover(tmp_path, spec, "c")
    ends = [f["ended"] for f in facts if "ended" in f]
    assert [e["state"] for e in ends] == ["done", "done"]
    assert ends[0] == ends[1]
    found = check_common(tmp_path, facts, workers)
    assert [r.epoch for r in found if isinstance(r, EpochStarted)] == [1]
    assert len([r for r in found if isinstance(r, TaskEnded)]) == 1
    assert model.request_count == asked
    assert_asked(model, through_done=1)


async def test_repeated_restarts_exhaust_the_budget_then_a_grant_continues_charging_once(
    tmp_path: Path,
) -> None:
    """Every restart replaces the worker and is charged: three restarts (each killed right
    after its continuation was recorded, every epoch wedged) use the three replacement
    epochs; the fourth host holds the task ``budget_exhausted`` (a restart refunds
    nothing), and so does the fifth; an operator grant of one epoch (audited) and a resume let
    it continue, charged once, to an explicit done. The recovery that ran across the four
    hosts (no progress since the first reserve) is charged when the hold ends it, never
    reset by a restart; the grant adds seconds too."""
    behaviours = {n: HANG for n in (1, 2, 3, 4)}
    async with crash_rig(tmp_path, STEPS) as (model, url, workers):
        # The epochs must run out first: the host's recovery time (600 s) is not run out by
        # five loaded host starts, a hold that would be durable too (WD12).
        spec = task_spec(url, behaviours=behaviours)
        facts = await kill_when_paused(tmp_path, spec, "record:epoch_started")
        for name in ("b", "c", "d"):
            facts += await kill_when_paused(tmp_path, spec, "record:continuation_sent", name=name)
        held = await recover(tmp_path, spec, "e")
        facts += held
        assert "held" in outcome(held), held
        assert model.request_count == 0
        facts += await recover(tmp_path, {**spec, "on_hold": {"epochs": 1, "seconds": 60}}, "f")
    view = outcome(held)["held"]
    assert view["hold_reason"] == "budget_exhausted:epochs"
    assert (view["budget"]["epochs_used"], view["budget"]["epochs_left"]) == (3, 0)
    (granted,) = [f["granted"] for f in facts if "granted" in f]
    assert granted["budget"]["granted_epochs"] == 1
    assert granted["budget"]["epochs_used"] == 3
    # the recovery open since the first reserve, ended by the hold: charged across the hosts
    (first_reserve, *_) = actions(records(tmp_path), "reserve")
    (across, *_) = actions(records(tmp_path), "recovery_time")
    assert across.detail["from_ms"] == first_reserve.detail["at_ms"]
    assert granted["budget"]["seconds_used"] >= across.detail["seconds"] > 0
    assert outcome(facts)["ended"]["state"] == "done", facts
    found = check_common(tmp_path, facts, workers)
    assert [r.epoch for r in found if isinstance(r, EpochStarted)] == [1, 2, 3, 4, 5]
    reserves = actions(found, "reserve")
    assert [r.action_id.rsplit("/", 2)[1] for r in reserves] == ["c1", "c2", "c3", "c4"]
    assert len(actions(found, "grant")) == 1
    budget = outcome(facts)["view"]["budget"]
    assert (budget["epochs_used"], budget["epochs_left"], budget["granted_epochs"]) == (4, 0, 1)
    sent = [r for r in found if isinstance(r, ContinuationSent)]
    assert [r.epoch for r in sent] == [2, 3, 4, 5]
    assert_asked(model, through_done=1)


# ------------------------------------------------- what a crash test leaves: nothing at all


class _Failed(Exception):
    """A crash test's check that failed half-way."""


async def killed_host_left(root: Path, left: dict[str, list[int]], *, fail: bool) -> None:
    """A crash test cut short: its host SIGKILLed at a fence step (epoch 1 wedged, so it
    ignores its closed stdin and lives on), and no next host to kill what it left. It fails
    there (``_Failed``) or ends as if its checks had passed. What was alive, by nonce, goes
    into ``left``."""
    async with crash_rig(root, STEPS) as (_model, url, workers):
        await kill_when_paused(root, task_spec(url, behaviours={1: HANG}), "action:reserve")
        left.update(workers.alive())
        assert len(left) == 1, left  # the killed host's wedged worker lives on
        if fail:
            raise _Failed


FAILED: Final = pytest.RaisesGroup(_Failed, flatten_subgroups=True)
"""The test's own error, as the rig's nurseries raise it."""


async def test_a_crash_test_that_fails_leaves_no_worker_of_the_host_it_killed(
    tmp_path: Path,
) -> None:
    """A test that fails after it SIGKILLed a host, before a next host killed what it left:
    the wedged epoch is killed from its record as the rig ends, never left running
    reparented to pid 1, and the test's own error stands, with what was killed as a note."""
    left: dict[str, list[int]] = {}
    with FAILED as failed:
        await killed_host_left(tmp_path, left, fail=True)
    ((nonce, pids),) = left.items()
    assert not alive_with_nonce(nonce), (nonce, pids)
    assert any(nonce in note for note in failed.value.__notes__), failed.value.__notes__


async def test_a_crash_test_that_would_leave_a_worker_fails_and_leaves_none(
    tmp_path: Path,
) -> None:
    """A test whose checks all pass but whose hosts left a recorded epoch's tree alive fails
    as the rig ends, naming the epoch and its pids; and that tree is killed."""
    left: dict[str, list[int]] = {}
    with pytest.raises(AssertionError, match="left running") as failed:
        await killed_host_left(tmp_path, left, fail=False)
    ((nonce, pids),) = left.items()
    assert nonce in str(failed.value)
    assert not alive_with_nonce(nonce), (nonce, pids)


async def host_fails_while_running(root: Path) -> None:
    """A test that fails while its host runs, paused at a fence step with epoch 1 wedged."""
    make_worktree(root)
    pause = {"pause": {"point": "action:reserve", "nth": 1}}
    async with scripted_upstream(STEPS) as (_model, url):
        spec = {**task_spec(url, behaviours={1: HANG}), **pause}
        async with host(root, spec, "a") as h:
            await h.until(lambda f: "paused" in f)
            raise _Failed


async def test_a_host_running_when_its_test_fails_is_killed_with_its_epochs(
    tmp_path: Path,
) -> None:
    """``run_host`` alone (what the room crash tests use too): a test that fails while its
    host runs SIGKILLs the host, and the epoch the host was running goes with it."""
    with FAILED as failed:
        await host_fails_while_running(tmp_path)
    (record,) = [r for r in records(tmp_path) if isinstance(r, EpochStarted)]
    assert not alive_with_nonce(record.nonce), record
    (own,) = failed.value.exceptions  # the host's note is on the test's own error
    assert any(record.nonce in note for note in getattr(own, "__notes__", ())), own
