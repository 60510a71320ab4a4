"""A tool call the worker aborts still has its outcome recorded: the one the model is told
(``docs/design/gate.md`` T23), so the next model request — which carries that result — passes
the gateway's barrier (T11) at once.

Pi aborts a running turn on the user's ``abort`` (RPC), a signal or the runtime's own stop. The
call under way then ends as an error result (Pi's ``bash`` is killed, ``execute`` throws, Pi
records the error's message) or — when the abort comes while the gate is still deciding the
call (its ``/before`` on its way) — before the tool starts. The gate may still have let that
call run: its intent is durable before the answer (T2). Before, the extension reported nothing
then: the gate kept the call as let run without outcome, and the next prompt's model request,
carrying the aborted call's result, waited at the barrier until the delivery was released.

The tests launch the real Pi (with the extension) and Fake-Pi through both boundaries on a real
store, against a scripted model on loopback, driven over RPC. Every wait is bounded by
``trio.fail_after`` and driven by events; every process is stopped by ``open_worker``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi.scenario import Call, Step, Text, ToolCalls
from runtime._boundary._boundaries import Boundaries, open_boundaries
from runtime._boundary._http import Request, ResponseWriter
from runtime._journal._store import delivery_key
from runtime._pi._rpc import open_rpc_channel
from runtime._pi._worker import open_worker
from runtime._records import ToolIntent, ToolOutcome

from .._workers import tool_messages, waiting_bash
from .test_boundary import DELIVERY, base_launch, lane, read_back

LIMIT: Final = 10.0
"""How long the next prompt may take once the aborted call's outcome is due: far more than a
turn needs, far less than the watchdog's stall bound."""
PROCESS_LIMIT: Final = 90.0


def _text(content: list[dict[str, Any]]) -> str:
    return "".join(str(p.get("text", "")) for p in content if p.get("type") == "text")


class HeldBefore:
    """Holds the gate's first ``/before`` before the gate looks at it (a call still on its way
    to the gate when the turn is aborted): ``arrived`` once it is in, held until ``go``;
    ``answered`` once the gate decided it and wrote its answer (to a peer that may be gone)."""

    def __init__(self, b: Boundaries) -> None:
        self.arrived = trio.Event()
        self.go = trio.Event()
        self.answered = trio.Event()
        gate = b.gate
        handle = gate.handle

        async def held(request: Request, response: ResponseWriter) -> None:
            first = request.target == "/before" and not self.arrived.is_set()
            if first:
                self.arrived.set()
                await self.go.wait()
            try:
                await handle(request, response)
            finally:
                if first:
                    self.answered.set()

        gate.handle = held  # type: ignore[method-assign]


@pytest.mark.parametrize("kind", ["pi", "fake"])
async def test_t23_t11_a_call_aborted_while_it_runs_has_its_outcome_and_the_turn_goes_on(
    kind: str, tmp_path: Path
) -> None:
    """T23, T11: the turn is aborted while its ``bash`` call runs (``sleep``-like: it waits on
    a FIFO nobody writes). Pi kills the command and records the thrown error as the call's
    result; the extension reports exactly that, so the journal holds the outcome the model is
    told, and the next prompt's model request (carrying it) passes the barrier at once. (This
    path reported before too, with both workers: Pi awaits the tool's ``execute`` after an
    abort and records the error it throws, and the extension reports that error.)"""
    started, _release, call = waiting_bash(tmp_path)
    steps: list[Step] = [call, Text(text="after the abort")]
    with trio.fail_after(PROCESS_LIMIT):
        async with lane(tmp_path, steps) as ln:
            config = ln.config(("bash",))
            launch = base_launch(kind, tmp_path)
            async with (
                open_boundaries(config, ln.log, key=delivery_key(DELIVERY), epoch=1) as b,
                open_worker(b.launch(launch)) as worker,
                open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
            ):
                prompted = await rpc.prompt("go")
                await trio.Path(started).read_text()  # the command runs
                await rpc.abort()
                settled = await rpc.wait_settled(prompted.settled_before)
                assert settled.record["aborted"] is True
                with trio.fail_after(LIMIT):
                    prompted = await rpc.prompt("next")
                    settled = await rpc.wait_settled(prompted.settled_before)
                assert settled.record["aborted"] is False
            records = await read_back(ln.store)
    assert ln.model.request_count == 2  # the aborted turn asked nothing more
    told = tool_messages(ln.model.requests[1].body)["c1"]
    outcomes = [r for r in records if isinstance(r, ToolOutcome)]
    assert [o.tool_call_id for o in outcomes] == ["c1"]
    assert outcomes[0].is_error
    assert _text(outcomes[0].content) == told


@pytest.mark.parametrize("kind", ["pi", "fake"])
async def test_t23_t11_a_call_aborted_while_the_gate_decides_it_has_its_outcome(
    kind: str, tmp_path: Path
) -> None:
    """T23, T11, T2: the turn is aborted while the call's ``/before`` is at the gate, not yet
    decided. The worker does not wait for the gate: the call fails at once, the tool does not
    run. The gate then decides it — *run*, its intent durable — to a worker that no longer
    waits. The worker (Pi's extension, Fake-Pi's gate client) still reads that answer and
    reports the result it recorded, so the journal holds the outcome the model is told, the
    next prompt's model request passes the barrier, and the call that request asks for runs
    after that outcome (T18, T21: its ``/before`` follows it). (Before, nothing was reported:
    the next model request waited at the barrier until the delivery ended — with both
    workers.)"""
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": "echo x >> ran"}, id="c1")]),
        ToolCalls(calls=[Call(name="bash", arguments={"command": "echo y >> next"}, id="c2")]),
        Text(text="after the abort"),
    ]
    with trio.fail_after(PROCESS_LIMIT):
        async with lane(tmp_path, steps) as ln:
            config = ln.config(("bash",))
            launch = base_launch(kind, tmp_path)
            async with open_boundaries(config, ln.log, key=delivery_key(DELIVERY), epoch=1) as b:
                held = HeldBefore(b)
                async with (
                    open_worker(b.launch(launch)) as worker,
                    open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
                ):
                    prompted = await rpc.prompt("go")
                    await held.arrived.wait()
                    await rpc.abort()
                    settled = await rpc.wait_settled(prompted.settled_before)
                    assert settled.record["aborted"] is True
                    held.go.set()
                    await held.answered.wait()  # let run: its intent is durable
                    with trio.fail_after(LIMIT):
                        prompted = await rpc.prompt("next")
                        settled = await rpc.wait_settled(prompted.settled_before)
                    assert settled.record["aborted"] is False
            records = await read_back(ln.store)
    assert ln.model.request_count == 3  # the aborted turn asked nothing more
    told = tool_messages(ln.model.requests[1].body)["c1"]
    calls = [(type(r), r.tool_call_id) for r in records if isinstance(r, ToolIntent | ToolOutcome)]
    intent, outcome = ToolIntent, ToolOutcome
    assert calls == [(intent, "c1"), (outcome, "c1"), (intent, "c2"), (outcome, "c2")]
    aborted = next(r for r in records if isinstance(r, ToolOutcome))
    assert aborted.is_error
    assert _text(aborted.content) == told
    assert not (tmp_path / "work" / "ran").exists()  # the aborted call's tool never started
    assert (tmp_path / "work" / "next").read_text() == "y\n"
    assert not [r for r in records if isinstance(r, ToolOutcome)][1].is_error
