"""Shared set-up for task-lane tests: a store, a worktree, an in-process runner on virtual time.

In-process tests run Fake-Pi as a task of the test's Trio run (``InProcessWorkers``) with the
scripted model called directly, on ``autojump_clock``: a 20-minute stall takes milliseconds.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import trio

from fake_pi._behaviours import Behaviours
from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import Call, Scenario, Step, Text, ToolCalls
from runtime._clock import Clocks
from runtime._journal._store import Store, open_store
from runtime._pi._launch import ModelRoute
from runtime._records import Record, TaskEnded
from runtime._tasks._runner import TaskRunner, open_task_runner
from runtime._tasks._watchdog import WatchdogPolicy
from runtime._wire import TaskEvent, TaskSpec
from runtime.testing._in_process import InProcessWorkers

ROUTE = ModelRoute(provider="fake", model="fake-model")
TASK = "task-1"


def done(summary: str = "did it") -> ToolCalls:
    return ToolCalls(calls=[Call(name="task_done", arguments={"summary": summary})])


def fail(reason: str = "cannot") -> ToolCalls:
    return ToolCalls(calls=[Call(name="task_fail", arguments={"reason": reason})])


def wait(question: str = "which one?") -> ToolCalls:
    return ToolCalls(calls=[Call(name="task_wait", arguments={"question": question})])


def effect(key: str) -> ToolCalls:
    return ToolCalls(calls=[Call(name="effect", arguments={"key": key})])


def say(text: str = "ok") -> Text:
    return Text(text=text)


def make_worktree(root: Path) -> Path:
    worktree = root / "worktree"
    worktree.mkdir(parents=True, exist_ok=True)
    (worktree / "README.md").write_text("a task's worktree\n")
    return worktree


WAIT_BOUND: Final = 6 * 3600.0
"""Virtual seconds a rig wait may take: six hours, far beyond every policy's clocks (the
hard threshold and its grace, four epochs of them, the recovery budget), so only a wrong test
or a hang reaches it (in about half a minute of real time)."""


@dataclass
class Rig:
    """An in-process task runner and what the test needs to look at."""

    runner: TaskRunner
    store: Store
    workers: InProcessWorkers
    model: ScriptedModel
    worktree: Path
    ledger: Path
    events: list[TaskEvent] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)
    times: list[tuple[float, TaskEvent]] = field(default_factory=list)
    """Trio time at which each event was seen (virtual time in these tests)."""

    def first(self, classification: str, task_id: str = TASK) -> float | None:
        """When ``classification`` was first seen."""
        return next(
            (
                t
                for t, e in self.times
                if e.task_id == task_id and e.classification == classification
            ),
            None,
        )

    async def until(self, predicate: Callable[[], bool], *, within: float = WAIT_BOUND) -> None:
        """Wait (on the lanes' change events, never on time) until ``predicate()`` holds; a
        test whose condition never comes fails after ``within`` virtual seconds rather than
        hanging (``trio.TooSlowError``)."""
        with trio.fail_after(within):
            while not predicate():
                await self.changed.wait()

    async def until_logged(
        self,
        predicate: Callable[[list[Record]], bool],
        *,
        task_id: str = TASK,
        within: float = WAIT_BOUND,
    ) -> None:
        """Wait until ``predicate(lane log records)`` holds: a record appended without a
        lane event (an epoch's end, a prompt marker) is looked for once a virtual second;
        fails after ``within`` virtual seconds."""
        with trio.fail_after(within):
            while True:
                if predicate(await self.records(task_id)):
                    return
                await trio.sleep(1)

    async def ended(self, task_id: str = TASK, *, within: float = WAIT_BOUND) -> TaskEnded:
        """The task's end record, once it ends; fails after ``within`` virtual seconds."""
        with trio.fail_after(within):
            return await self.runner.wait(task_id)

    def saw(self, event: TaskEvent) -> None:
        self.events.append(event)
        self.times.append((trio.current_time(), event))
        self.changed.set()
        self.changed = trio.Event()

    def spec(self, prompt: str = "do the task", **kwargs: object) -> TaskSpec:
        grants = kwargs.pop("grants", frozenset({"read", "effect"}))
        return TaskSpec(
            task_id=str(kwargs.pop("task_id", TASK)),
            prompt=prompt,
            worktree=str(self.worktree),
            grants=grants,  # type: ignore[arg-type]
            **kwargs,  # type: ignore[arg-type]
        )

    def classifications(self, task_id: str = TASK) -> list[str]:
        seen: list[str] = []
        for event in self.events:
            if event.task_id == task_id and (not seen or seen[-1] != event.classification):
                seen.append(event.classification)
        return seen

    async def records(self, task_id: str = TASK) -> list[Record]:
        contents = await self.store.read(self.runner.log_rel(task_id))
        return list(contents.records)

    def effects(self) -> list[str]:
        if not self.ledger.exists():
            return []
        return [line for line in self.ledger.read_text().splitlines() if line]


@contextlib.asynccontextmanager
async def open_rig(
    tmp_path: Path,
    clocks: Clocks,
    steps: Sequence[Step],
    *,
    policy: WatchdogPolicy | None = None,
    behaviours: Mapping[int, Behaviours] | None = None,
    identity: Mapping[int, bool | None] | None = None,
    survivors: Mapping[int, tuple[int, ...]] | None = None,
    state: str = "state",
    route: ModelRoute = ROUTE,
) -> AsyncIterator[Rig]:
    # every host its own call ids: a real provider never repeats one (the in-process worker
    # has no gateway, so the gate tells rounds apart by the call id alone)
    model = ScriptedModel(
        scenario=Scenario(steps=list(steps)), call_id_prefix=f"call_{secrets.token_hex(4)}"
    )
    workers = InProcessWorkers(
        model=model,
        behaviours=dict(behaviours or {}),
        identity=dict(identity or {}),
        survivors=dict(survivors or {}),
    )
    worktree = make_worktree(tmp_path)
    ledger = tmp_path / "effects.jsonl"
    async with (
        open_store(tmp_path / state, clocks=clocks) as store,
        open_task_runner(
            store,
            workers=workers,
            route=route,
            policy=policy,
            clocks=clocks,
            ledger=ledger,
            work_root=tmp_path / "work",
        ) as runner,
    ):
        rig = Rig(runner, store, workers, model, worktree, ledger)
        runner.host.log = rig.lines.append
        async with runner.events(buffer=10_000) as events, trio.open_nursery() as nursery:

            async def collect() -> None:
                async for event in events:
                    rig.saw(event)

            nursery.start_soon(collect)
            yield rig
            nursery.cancel_scope.cancel()
