"""A failed outcome report (``/after``) fails closed only the calls whose proof it withholds
(``docs/design/gate.md`` T21): the later calls of its own delivery and epoch, never a later
delivery's or epoch's.

The worker's next ``/before`` waits for its previous ``/after`` to be answered (T18), and the
gate — which knows whether that outcome is recorded in the journal it serves — refuses the call
if not. Before, Pi's extension kept the failed report itself and failed every later call of the
process with it: one report that reached the gate after its delivery ended and the next one was
attached (answered 409 by the next delivery's journal) failed every tool call of every later
delivery of that Pi. The end-to-end tests launch the real Pi (with the extension) and Fake-Pi as
subprocesses against the real gate on a Unix socket, driven over RPC by a scripted model; the
gate tests use the real socket with an in-memory log. Every wait is bounded by
``trio.fail_after`` and driven by events, never by sleeping; every process is stopped by
``open_worker``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi.model_server import ScriptedModel
from fake_pi.model_server import serve_model as serve_model_http
from fake_pi.scenario import Call, Scenario, Step, Text, ToolCalls
from runtime._boundary._gate import (
    Gate,
    GateServer,
    MemoryLog,
    RecordingGateJournal,
    gate_environment,
    serve_gate,
)
from runtime._boundary._http import HttpServer, Request, ResponseWriter
from runtime._errors import ReasonCode
from runtime._pi._rpc import open_rpc_channel
from runtime._pi._worker import open_worker
from runtime._records import ToolIntent, ToolOutcome

from .._workers import tool_messages
from .test_gate import _launch, rig
from .test_gate import sock_dir as sock_dir

LIMIT: Final = 10.0
PROCESS_LIMIT: Final = 90.0
OK_CONTENT: Final[list[dict[str, Any]]] = [{"type": "text", "text": "ran\n"}]

TWO_TURNS: Final[list[Step]] = [
    ToolCalls(calls=[Call(name="bash", arguments={"command": "echo one | tee -a order"}, id="c1")]),
    Text(text="first done"),
    ToolCalls(calls=[Call(name="bash", arguments={"command": "echo two | tee -a order"}, id="c2")]),
    Text(text="second done"),
]


def _journal(log: MemoryLog, key: str) -> RecordingGateJournal:
    return RecordingGateJournal(log, key=key, epoch=1, granted=("bash",))


class HeldReport:
    """Holds the gate's first ``/after`` before the gate looks at it (as a report still on its
    way): ``arrived`` once it is in, held until ``go``; ``answered`` once the gate answered it."""

    def __init__(self, gate: Gate) -> None:
        self.arrived = trio.Event()
        self.go = trio.Event()
        self.answered = trio.Event()
        handle = gate.handle

        async def held(request: Request, response: ResponseWriter) -> None:
            first = request.target == "/after" and not self.arrived.is_set()
            if first:
                self.arrived.set()
                await self.go.wait()
            await handle(request, response)
            if first:
                self.answered.set()

        gate.handle = held  # type: ignore[method-assign]


class Lane:
    """One worker's gate across two deliveries, as ``Boundaries`` serves it: the first
    delivery's journal attached, the second's ready for :meth:`next_delivery`."""

    def __init__(self, sock_dir: Path) -> None:
        self.first_log, self.second_log = MemoryLog(), MemoryLog()
        self.first = _journal(self.first_log, "a")
        self.second = _journal(self.second_log, "b")
        self.gate = Gate(self.first)
        self.report = HeldReport(self.gate)
        self.path = sock_dir / "gate.sock"
        self.serving = trio.CancelScope()

    def next_delivery(self) -> None:
        """The first delivery ended and the second is attached (``Boundaries.release`` then
        ``Boundaries.attach``)."""
        self.first.release()
        self.gate.journal = self.second

    async def serve(self, task_status: trio.TaskStatus[GateServer]) -> None:
        with self.serving:
            await serve_gate(self.gate, self.path, task_status=task_status)


async def _two_turns(
    kind: str,
    tmp_path: Path,
    sock_dir: Path,
    meanwhile: Callable[[Lane, trio.Nursery], Awaitable[None]],
) -> tuple[ScriptedModel, Lane]:
    """One worker process, two prompts, each making one ``bash`` call through the gate. The
    first call's report is held at the gate; ``meanwhile`` runs then, and lets it go."""
    model = ScriptedModel(scenario=Scenario(steps=list(TWO_TURNS)))
    lane = Lane(sock_dir)
    with trio.fail_after(PROCESS_LIMIT):
        async with trio.open_nursery() as nursery:
            up: HttpServer = await nursery.start(serve_model_http, model)
            server: GateServer = await nursery.start(lane.serve)
            launch = _launch(kind, tmp_path, up, gate_env=gate_environment(server, lane.gate))
            async with (
                open_worker(launch) as worker,
                open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
            ):
                prompted = await rpc.prompt("one")
                await lane.report.arrived.wait()
                await meanwhile(lane, nursery)
                settled = await rpc.wait_settled(prompted.settled_before)
                assert settled.record["aborted"] is False
                prompted = await rpc.prompt("two")
                settled = await rpc.wait_settled(prompted.settled_before)
                assert settled.record["aborted"] is False
            nursery.cancel_scope.cancel()
    return model, lane


@pytest.mark.parametrize("kind", ["pi", "fake"])
async def test_t21_a_report_refused_after_its_delivery_ended_fails_no_call_of_the_next(
    kind: str, tmp_path: Path, sock_dir: Path
) -> None:
    """T21, T18, G14: a call's report reaches the gate only after its delivery ended and the
    next delivery is attached (a turn aborted, or ended, while the report was on its way): the
    next delivery's journal never let that call run, so it answers 409 and records nothing.
    That failure is the ended delivery's: the same worker's call in the next delivery runs and
    is recorded there. (Before, Pi's extension kept the failed report and threw it at every
    later call of the process: the next delivery's ``bash`` did not run and the model was told
    ``tool gate /after: HTTP 409``, and so was every later delivery's.)"""

    async def ended_while_on_its_way(lane: Lane, nursery: trio.Nursery) -> None:
        lane.next_delivery()
        lane.report.go.set()
        await lane.report.answered.wait()

    model, lane = await _two_turns(kind, tmp_path, sock_dir, ended_while_on_its_way)
    assert tool_messages(model.requests[3].body)["c2"].strip() == "two"
    assert (tmp_path / "work" / "order").read_text() == "one\ntwo\n"
    # the ended delivery's call is left without outcome ("possibly ran", T5); the next one's ran
    assert [type(x) for x in lane.first_log.records] == [ToolIntent]
    assert [type(x) for x in lane.second_log.records] == [ToolIntent, ToolOutcome]


@pytest.mark.parametrize("kind", ["pi", "fake"])
async def test_t21_a_report_lost_fails_the_next_call_of_its_delivery_closed(
    kind: str, tmp_path: Path, sock_dir: Path
) -> None:
    """T21, T18: a call's report is lost on its way (the gate's connection dropped before the
    gate looked at it; the same gate is served again on the same path). Its outcome is not
    recorded, so the next call of the same delivery and epoch fails closed: the gate refuses
    it, nothing runs and nothing is recorded for it, and the model is told why. (Pi's extension
    failed it closed before too, by itself; Fake-Pi only wrote the failure to stderr and ran
    the next call after an intent the journal holds without outcome.)"""

    async def lost(lane: Lane, nursery: trio.Nursery) -> None:
        lane.serving.cancel()  # the held report's connection goes with the server
        lane.serving = trio.CancelScope()
        await nursery.start(lane.serve)

    model, lane = await _two_turns(kind, tmp_path, sock_dir, lost)
    assert (tmp_path / "work" / "order").read_text() == "one\n"
    assert [type(x) for x in lane.first_log.records] == [ToolIntent]
    assert lane.second_log.records == []
    refused = tool_messages(model.requests[3].body)["c2"]
    assert "c1" in refused
    assert ReasonCode.GATE_BAD_REQUEST in refused


# ------------------------------------------------------------------- the gate's own rule


async def test_t21_the_gate_refuses_a_call_that_follows_a_missing_outcome(
    sock_dir: Path,
) -> None:
    """T21: a ``/before`` names the call its worker ran and reported last (``follows``); while
    the gate let that call run in the current epoch and holds no outcome for it, the gate lets
    nothing run — refused naming that call, nothing recorded. A recorded result is still
    answered *saved*, the running call asked again is still T15's refusal, and once the
    outcome is recorded the next call runs. A call let run in an earlier epoch (a dead
    worker's) holds no call of the next epoch back. ``follows`` that is not a string is 400."""
    with trio.fail_after(LIMIT):
        async with rig(sock_dir) as r:
            assert (await r.post("/before", _before("c1")))[1]["decision"] == "run"
            status, answer = await r.post("/before", _before("c2", follows="c1"))
            assert status == 200
            assert answer["decision"] == "refused"
            assert "'c1'" in _text(answer)
            assert ReasonCode.GATE_BAD_REQUEST in _text(answer)
            status, answer = await r.post("/before", _before("c1", follows="c1"))  # T15
            assert answer["decision"] == "refused"
            assert "already running" in _text(answer)
            assert [type(x) for x in r.log.records] == [ToolIntent]
            assert (await r.post("/after", _after("c1")))[0] == 200
            assert (await r.post("/before", _before("c1")))[1]["decision"] == "saved"
            assert (await r.post("/before", _before("c2", follows="c1")))[1]["decision"] == "run"
            # c2's report never comes: c3, which follows it, is refused in this epoch ...
            answer = (await r.post("/before", _before("c3", follows="c2")))[1]
            assert answer["decision"] == "refused"
            assert "'c2'" in _text(answer)
            # ... and runs in the next (a new worker, a new secret)
            r.journal.epoch = 2
            r.gate.rotate_secret()
            assert (await r.post("/before", _before("c3", follows="c2")))[1]["decision"] == "run"
            assert (await r.post("/before", _before("c4", follows="")))[0] == 400
            assert [
                (type(x), x.tool_call_id)
                for x in r.log.records
                if isinstance(x, ToolIntent | ToolOutcome)
            ] == [(ToolIntent, "c1"), (ToolOutcome, "c1"), (ToolIntent, "c2"), (ToolIntent, "c3")]
            assert len(r.log.records) == 4


def _before(call_id: str, *, follows: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"tool_call_id": call_id, "name": "bash", "args": {"command": "true"}}
    if follows is not None:
        body["follows"] = follows
    return body


def _after(call_id: str) -> dict[str, Any]:
    return {"tool_call_id": call_id, "name": "bash", "result": {"content": OK_CONTENT}}


def _text(answer: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in answer["result"]["content"])
