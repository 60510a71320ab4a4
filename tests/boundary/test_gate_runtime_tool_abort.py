"""A runtime tool whose call is aborted while the gate runs it: the model is told what the gate
did (``docs/design/gate.md`` T25, with T10, T19, T23).

A runtime tool (``send_text_update``, the lifecycle tools, the test tool ``effect``) runs in the
runtime, inside the gate's ``/before``: the gate records the intent, runs the handler, records
the outcome and answers *saved* with it (T10); the worker only carries the call and never
reports it (T19). An abort (the user's, the runtime's stop) that reaches the worker while that
``/before`` is on its way cannot stop the gate — the update is sent, the task marked done, the
effect applied. Before, the worker gave up on the call at once and told the model "aborted and
did not run" (Pi: ``tool <name> was aborted and did not run``; Fake-Pi: ``Operation aborted``)
while the journal held the handler's result: the model, told its update was not sent, would
send it again, and a replay (which answers the recorded result) told another story than the
turn it replays. Now the worker waits for a runtime tool's answer even when aborted, and hands
the model that answer: the journal, the model and the world agree.

The tests launch the real Pi (with the extension) and Fake-Pi through both boundaries on a real
store, against a scripted model on loopback, driven over RPC. Every wait is bounded by
``trio.fail_after`` and driven by events; every process is stopped by ``open_worker``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import trio.testing

from fake_pi.scenario import Call, Step, Text, ToolCalls
from runtime._boundary._boundaries import BoundaryConfig, open_boundaries
from runtime._journal._store import delivery_key
from runtime._pi._rpc import RpcChannel, open_rpc_channel
from runtime._pi._worker import open_worker
from runtime._records import LifecycleReceipt, Record, ToolIntent, ToolOutcome
from runtime._tasks._lifecycle import LifecycleKernel, TaskState
from runtime._tasks._lifecycle_tools import lifecycle_tools
from runtime._tasks._watchdog import Watchdog, WatchdogPolicy

from .._workers import tool_messages
from .test_boundary import DELIVERY, Lane, base_launch, lane, read_back
from .test_gate_abort import HeldBefore
from .test_gate_abort_hold import DroppedAnswer

LIMIT: Final = 10.0
PROCESS_LIMIT: Final = 90.0


def _text(content: list[dict[str, Any]]) -> str:
    return "".join(str(p.get("text", "")) for p in content if p.get("type") == "text")


class _Task:
    """A task lane as the lifecycle tools see it (their real kernel and watchdog): what the
    task sees of a lifecycle call is the kernel's state and the receipts appended."""

    def __init__(self) -> None:
        self.kernel = LifecycleKernel("task-1")
        assert self.kernel.begin_epoch(1, fenced=False)
        self.watchdog = Watchdog(policy=WatchdogPolicy())
        self.records: list[Record] = []

    def gate_epoch(self) -> int:
        return 1

    async def append(self, record: Record) -> int:
        await trio.lowlevel.checkpoint()
        self.records.append(record)
        return len(self.records)

    async def resumed_progress(self) -> None:
        await trio.lowlevel.checkpoint()

    def changed(self) -> None:
        pass


@dataclasses.dataclass
class _Case:
    """One runtime tool: its call's arguments, the lane's config for it, and what the world
    holds once it ran (``seen``: how many times its effect happened)."""

    args: dict[str, Any]
    config: Callable[[Lane, BoundaryConfig], BoundaryConfig]
    seen: Callable[[Lane], int]


def _case(tool: str) -> _Case:
    task = _Task()
    if tool == "send_text_update":
        return _Case({"text": "halfway there"}, lambda _, c: c, lambda ln: len(ln.updates.texts))
    if tool == "effect":
        return _Case({"key": "k1"}, lambda _, c: c, lambda ln: len(ln.ledger.entries()))

    def with_lifecycle(_: Lane, config: BoundaryConfig) -> BoundaryConfig:
        tools = {**config.runtime_tools, tool: lifecycle_tools(task)[tool]}
        return dataclasses.replace(config, runtime_tools=tools)

    state = {"task_done": TaskState.SUCCESS_INTENT, "task_wait": TaskState.WAITING}[tool]

    def seen(_: Lane) -> int:
        receipts = [r for r in task.records if isinstance(r, LifecycleReceipt)]
        assert task.kernel.state is (state if receipts else TaskState.OPEN)
        return len(receipts)

    arg = {"task_done": "summary", "task_wait": "question"}[tool]
    return _Case({arg: "all tests pass?"}, with_lifecycle, seen)


async def _abort_taken(rpc: RpcChannel, nursery: trio.Nursery) -> None:
    """Send ``abort`` (its answer comes once the run settled) and return once the worker has
    taken it: a ``get_state`` sent after it is answered. Pi reads its stdin lines in order and
    fires the run's abort signal before anything else of an ``abort`` (no await before
    ``agent.abort()``); Fake-Pi starts its abort task before reading the next line, and that
    task cancels the call's scope in its first step, before ``get_state``'s answer is written
    (two checkpoints later)."""
    nursery.start_soon(rpc.abort)
    await trio.testing.wait_all_tasks_blocked()  # the abort line is written, its answer awaited
    await rpc.request({"type": "get_state"})


@pytest.mark.parametrize("tool", ["send_text_update", "task_done", "task_wait", "effect"])
@pytest.mark.parametrize("kind", ["pi", "fake"])
async def test_t25_t10_a_runtime_tool_aborted_while_the_gate_runs_it_tells_the_model_its_result(
    kind: str, tool: str, tmp_path: Path
) -> None:
    """T25, T10, T19, T23: the turn is aborted while the runtime tool's ``/before`` is at the
    gate, not yet decided; the worker has taken the abort before the gate acts. The gate then
    runs the tool all the same (its intent first, T2): the update is sent, the task marked
    done or waiting, the effect applied — once. The worker still reads the gate's answer and
    hands the model the handler's result: the journal's outcome is exactly what the next model
    request carries for the call, so a replay (answered from the journal) and the model agree,
    and the model is never told that an effect that happened did not. (Before, both workers
    told the model "aborted and did not run" while the journal held the handler's result.)"""
    case = _case(tool)
    steps: list[Step] = [
        ToolCalls(calls=[Call(name=tool, arguments=case.args, id="c1")]),
        Text(text="after the abort"),
    ]
    with trio.fail_after(PROCESS_LIMIT):
        async with lane(tmp_path, steps) as ln:
            config = case.config(ln, ln.config((tool,)))
            launch = base_launch(kind, tmp_path)
            async with open_boundaries(config, ln.log, key=delivery_key(DELIVERY), epoch=1) as b:
                held = HeldBefore(b)
                async with (
                    open_worker(b.launch(launch)) as worker,
                    open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
                ):
                    prompted = await rpc.prompt("go")
                    await held.arrived.wait()
                    async with trio.open_nursery() as nursery:
                        await _abort_taken(rpc, nursery)
                        assert case.seen(ln) == 0  # the gate has not acted yet
                        held.go.set()
                        with trio.fail_after(LIMIT):
                            settled = await rpc.wait_settled(prompted.settled_before)
                    assert settled.record["aborted"] is True
                    await held.answered.wait()
                    with trio.fail_after(LIMIT):
                        prompted = await rpc.prompt("next")
                        settled = await rpc.wait_settled(prompted.settled_before)
                    assert settled.record["aborted"] is False
            records = await read_back(ln.store)
    assert case.seen(ln) == 1  # the gate ran it, once
    assert ln.model.request_count == 2  # the aborted turn asked nothing more
    calls = [(type(r), r.tool_call_id) for r in records if isinstance(r, ToolIntent | ToolOutcome)]
    assert calls == [(ToolIntent, "c1"), (ToolOutcome, "c1")]
    outcome = next(r for r in records if isinstance(r, ToolOutcome))
    told = tool_messages(ln.model.requests[1].body)["c1"]
    assert told == _text(outcome.content)  # the model is told what the journal holds
    assert "aborted" not in told


@pytest.mark.parametrize("kind", ["pi", "fake"])
async def test_t26_a_runtime_tool_whose_answer_was_lost_is_told_it_possibly_ran(
    kind: str, tmp_path: Path
) -> None:
    """T26, T24, T10: no abort — the gate runs the runtime tool (``effect``: the ledger's line
    is written, its outcome recorded) but its answer never reaches the worker (the connection
    drops). The call fails closed on the worker's side ("tool gate unreachable"), and the model
    is told so — but now also that the tool may have run (``possibly ran``: inspect before
    repeating), which is the truth: the effect happened once. (Before, the model was told only
    that the gate was unreachable, as if nothing had happened, and would apply it again.)"""
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="effect", arguments={"key": "k1"}, id="c1")]),
        Text(text="after the lost answer"),
    ]
    with trio.fail_after(PROCESS_LIMIT):
        async with lane(tmp_path, steps) as ln:
            config = ln.config(("effect",))
            launch = base_launch(kind, tmp_path)
            async with open_boundaries(config, ln.log, key=delivery_key(DELIVERY), epoch=1) as b:
                dropped = DroppedAnswer(b)
                dropped.go.set()
                async with (
                    open_worker(b.launch(launch)) as worker,
                    open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
                ):
                    prompted = await rpc.prompt("go")
                    await dropped.answered.wait()
                    assert b'"saved"' in dropped.kept.body  # the gate ran it: its result
                    with trio.fail_after(LIMIT):
                        settled = await rpc.wait_settled(prompted.settled_before)
                    assert settled.record["aborted"] is False
            records = await read_back(ln.store)
    assert len(ln.ledger.entries()) == 1  # the effect happened, once
    told = tool_messages(ln.model.requests[1].body)["c1"]
    assert "possibly ran" in told, told  # after why the call failed on the worker's side
    (outcome,) = [r for r in records if isinstance(r, ToolOutcome)]
    assert _text(outcome.content) == "effect k1 applied"  # what the gate did, in the journal
