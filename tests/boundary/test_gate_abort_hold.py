"""A call the worker gave up on while the gate decided it never holds the delivery's next model
request (``docs/design/gate.md`` T24, with T23, T11, T18, T21).

T23 made the worker read the gate's answer after an abort and report a *run*. What was left: a
``/before`` the gate decided — *run*, its intent durable (T2) — whose answer never reached the
worker (the connection dropped after the decision). The worker then knew nothing of the call
being let run and reported nothing, while the gate kept it as running without outcome: the next
model request, which carries the call's error result, waited at the barrier (T11) until the
delivery was released (its end: the stall backstop, lanes L20), with both workers, aborted or
not. Now a ``/before`` that got no answer is reported like one answered *run*, with the result
the worker recorded for the call (its tool never started).

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

from .._workers import tool_messages
from .test_boundary import DELIVERY, base_launch, lane, read_back

LIMIT: Final = 10.0
"""How long the next prompt may take once the dropped call's outcome is due: far more than a
turn needs, far less than the stall backstop."""
PROCESS_LIMIT: Final = 90.0


def _text(content: list[dict[str, Any]]) -> str:
    return "".join(str(p.get("text", "")) for p in content if p.get("type") == "text")


class _Kept:
    """A stand-in response writer: keeps the gate's answer instead of sending it."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.body = b""

    async def respond(self, status: int, body: bytes, **_: Any) -> None:
        await trio.lowlevel.checkpoint()
        self.status, self.body = status, body


class DroppedAnswer:
    """The gate's first ``/before``: held until ``go`` once it is in (``arrived``), then decided
    by the gate as any other — its answer (``kept``) never sent: the handler returns without
    answering, so the connection closes (``answered`` once decided)."""

    def __init__(self, b: Boundaries) -> None:
        self.arrived = trio.Event()
        self.go = trio.Event()
        self.answered = trio.Event()
        self.kept = _Kept()
        gate = b.gate
        handle = gate.handle

        async def dropped(request: Request, response: ResponseWriter) -> None:
            if request.target != "/before" or self.arrived.is_set():
                await handle(request, response)
                return
            self.arrived.set()
            await self.go.wait()
            try:
                await handle(request, self.kept)  # type: ignore[arg-type]
            finally:
                self.answered.set()

        gate.handle = dropped  # type: ignore[method-assign]


STEPS: Final[list[Step]] = [
    ToolCalls(calls=[Call(name="bash", arguments={"command": "echo x >> ran"}, id="c1")]),
    ToolCalls(calls=[Call(name="bash", arguments={"command": "echo y >> next"}, id="c2")]),
    Text(text="after the abort"),
]


@pytest.mark.parametrize("kind", ["pi", "fake"])
async def test_t24_t23_t11_a_call_aborted_whose_run_answer_was_lost_holds_nothing(
    kind: str, tmp_path: Path
) -> None:
    """T24, T23, T11: the turn is aborted while the call's ``/before`` is at the gate; the gate
    then lets it run (its intent durable) but its answer never reaches the worker (the
    connection drops). The worker reports the call with the result it recorded ("aborted",
    the tool never started), so the journal holds what the model is told, the next prompt's
    model request passes the barrier at once, and the call it asks for runs after that outcome
    (T18, T21: its ``/before`` follows it). (Before, nothing was reported: the next model
    request waited at the barrier until the delivery was released — with both workers.)"""
    with trio.fail_after(PROCESS_LIMIT):
        async with lane(tmp_path, STEPS) as ln:
            config = ln.config(("bash",))
            launch = base_launch(kind, tmp_path)
            async with open_boundaries(config, ln.log, key=delivery_key(DELIVERY), epoch=1) as b:
                dropped = DroppedAnswer(b)
                async with (
                    open_worker(b.launch(launch)) as worker,
                    open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
                ):
                    prompted = await rpc.prompt("go")
                    await dropped.arrived.wait()
                    await rpc.abort()
                    settled = await rpc.wait_settled(prompted.settled_before)
                    assert settled.record["aborted"] is True
                    dropped.go.set()
                    await dropped.answered.wait()
                    assert dropped.kept.status == 200
                    assert b'"run"' in dropped.kept.body  # let run: its intent is durable
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
    first, second = [r for r in records if isinstance(r, ToolOutcome)]
    assert first.is_error
    assert _text(first.content) == told
    assert not (tmp_path / "work" / "ran").exists()  # the dropped call's tool never started
    assert (tmp_path / "work" / "next").read_text() == "y\n"
    assert not second.is_error


@pytest.mark.parametrize("kind", ["pi", "fake"])
async def test_t24_t11_a_call_whose_run_answer_was_lost_holds_nothing(
    kind: str, tmp_path: Path
) -> None:
    """T24, T9, T11: no abort — the gate lets the call run but its answer never reaches the
    worker (the connection drops). The call fails closed (the worker's "gate unreachable"
    error; the tool never starts), and the worker reports that error as its outcome, so the
    model request carrying it — the same turn's next — passes the barrier at once and the
    next call runs after it. (Before, that model request waited at the barrier until the
    delivery was released — with both workers.)"""
    with trio.fail_after(PROCESS_LIMIT):
        async with lane(tmp_path, STEPS) as ln:
            config = ln.config(("bash",))
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
                    assert b'"run"' in dropped.kept.body  # let run: its intent is durable
                    with trio.fail_after(LIMIT):
                        settled = await rpc.wait_settled(prompted.settled_before)
                    assert settled.record["aborted"] is False
            records = await read_back(ln.store)
    assert ln.model.request_count == 3
    told = tool_messages(ln.model.requests[1].body)["c1"]
    calls = [(type(r), r.tool_call_id) for r in records if isinstance(r, ToolIntent | ToolOutcome)]
    intent, outcome = ToolIntent, ToolOutcome
    assert calls == [(intent, "c1"), (outcome, "c1"), (intent, "c2"), (outcome, "c2")]
    first, second = [r for r in records if isinstance(r, ToolOutcome)]
    assert first.is_error
    assert _text(first.content) == told
    assert not (tmp_path / "work" / "ran").exists()  # the tool never started
    assert (tmp_path / "work" / "next").read_text() == "y\n"
    assert not second.is_error
