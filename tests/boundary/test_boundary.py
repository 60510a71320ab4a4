"""A lane's gateway and gate wired together (``runtime/_boundary/_boundaries.py``); test names cite
``docs/design/boundaries.md`` (B1…).

The end-to-end tests run the real Pi (with the extension) and the Fake-Pi subprocess through
both boundaries on a real store, against a scripted model served on loopback. Every wait is
bounded by ``trio.fail_after`` and driven by events; every process is stopped by
``open_worker``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio
import trio.testing

from fake_pi._gate_client import post_json
from fake_pi.model_server import ScriptedModel
from fake_pi.model_server import serve_model as serve_model_http
from fake_pi.scenario import Call, Scenario, Step, Text, ToolCalls
from runtime._boundary._boundaries import (
    Boundaries,
    BoundaryConfig,
    carried_tool_results,
    open_boundaries,
)
from runtime._boundary._calls import GateCall, GateResult
from runtime._boundary._gate import GATE_SECRET_ENV, MemoryLog, RecordingGateJournal
from runtime._boundary._gateway import GATEWAY_SECRET_ENV, GatewayConfig
from runtime._boundary._http import HttpServer, open_request
from runtime._boundary._tools import RUNTIME_TOOLS, TOOLS_ENV, EffectLedger
from runtime._clock import Clocks
from runtime._errors import WorkerExitedError
from runtime._journal._journal import Journal
from runtime._journal._store import Store, delivery_key, open_store, runtime_dir
from runtime._linux._proc import is_alive
from runtime._pi._rpc import open_rpc_channel
from runtime._pi._rpc_protocol import Event
from runtime._pi._session_settle import interrupted_text
from runtime._pi._worker import WorkerLaunch, open_worker
from runtime._records import (
    ModelRequestIntent,
    ModelResponse,
    Record,
    ReplayClass,
    ToolIntent,
    ToolOutcome,
)

from .._procs import alive_with_nonce
from .._secrets import files_containing
from .._workers import one_turn, sandbox_launch, tool_messages

LIMIT: Final = 10.0
PROCESS_LIMIT: Final = 90.0
DELIVERY: Final = "delivery-1"


@dataclass
class Updates:
    """A ``send_text_update`` handler that keeps what was sent."""

    texts: list[str] = field(default_factory=list)

    async def __call__(self, call: GateCall, intent_id: str) -> GateResult:
        await trio.lowlevel.checkpoint()
        self.texts.append(str(call.args.get("text")))
        return GateResult.text("sent")


@dataclass
class Lane:
    """What one test's lane holds: the store, the delivery log, the upstream model."""

    root: Path
    store: Store
    log: Journal
    model: ScriptedModel
    upstream: HttpServer
    updates: Updates
    ledger: EffectLedger

    def config(self, granted: Sequence[str]) -> BoundaryConfig:
        return BoundaryConfig(
            upstream=GatewayConfig(upstream_url=f"{self.upstream.url}/v1"),
            granted=frozenset(granted),
            runtime_tools={"send_text_update": self.updates, "effect": self.ledger},
            socket_dir=runtime_dir(self.root / "state"),
        )


@contextlib.asynccontextmanager
async def lane(root: Path, steps: Sequence[Step]) -> AsyncIterator[Lane]:
    model = ScriptedModel(scenario=Scenario(steps=list(steps)))
    async with (
        open_store(root / "state", clocks=Clocks.system()) as store,
        trio.open_nursery() as nursery,
    ):
        upstream: HttpServer = await nursery.start(serve_model_http, model)
        log = await store.create_delivery_log(DELIVERY)
        yield Lane(root, store, log, model, upstream, Updates(), EffectLedger(root / "ledger"))
        nursery.cancel_scope.cancel()
    shutil.rmtree(runtime_dir(root / "state"), ignore_errors=True)


async def read_back(store: Store) -> list[Record]:
    """The delivery's records as read from disk now (header excluded)."""
    contents = await store.read_delivery_log(DELIVERY)
    return list(contents.records[1:])


def base_launch(kind: str, root: Path) -> WorkerLaunch:
    """The gateway's endpoint replaces the route's when the boundaries launch it."""
    return sandbox_launch(kind, root, state_dir=root / "state")


# ------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_b1_b3_b5_a_turn_through_both_boundaries_then_replay(
    kind: str, tmp_path: Path
) -> None:
    """B1: a tool round's intents carry the step of the model response that asked for them, in
    the delivery's one log. B3: the granted runtime tools are declared to the worker exactly as
    ``runtime/_boundary/_tools.py`` has them and run in the runtime (once); a Pi tool runs in
    the worker. B5: neither secret reaches the tools' environment or any file. Then a new epoch
    on the rewound session is answered entirely from the journal: no model call, no tool run,
    nothing appended."""
    steps: list[Step] = [
        ToolCalls(
            calls=[
                Call(name="bash", arguments={"command": "env; echo x >> bash-runs"}, id="c_env"),
                Call(name="send_text_update", arguments={"text": "working"}, id="c_update"),
                Call(name="effect", arguments={"key": "k1"}, id="c_effect"),
            ]
        ),
        Text(text="done"),
    ]
    granted = ("read", "bash", "send_text_update", "effect")
    with trio.fail_after(PROCESS_LIMIT):
        async with lane(tmp_path, steps) as ln:
            launch = base_launch(kind, tmp_path)
            admission_leaf = launch.session.read_bytes() if launch.session else None
            config = ln.config(granted)
            async with open_boundaries(config, ln.log, key=delivery_key(DELIVERY), epoch=1) as b:
                await one_turn(b.launch(launch))
                first_secrets = (b.gateway.secret, b.gate.secret)
                after_first = await read_back(ln.store)
                # epoch 2 on the session rewound to the admission leaf: all from the journal
                assert launch.session is not None
                assert admission_leaf is not None
                launch.session.write_bytes(admission_leaf)
                b.begin_epoch(2)
                await one_turn(b.launch(launch))
                second_secrets = (b.gateway.secret, b.gate.secret)
            after_second = await read_back(ln.store)

    first, second = ln.model.requests[0].body, ln.model.requests[1].body
    assert ln.model.request_count == 2  # the second epoch never reached upstream
    names = [t["function"]["name"] for t in first["tools"]]
    assert names == ["read", "bash", "edit", "write", "send_text_update", "effect"]
    for tool in first["tools"][4:]:
        assert tool["function"] == RUNTIME_TOOLS[tool["function"]["name"]].declaration()
    results = tool_messages(second)
    assert results["c_update"] == "sent"
    assert results["c_effect"] == "effect k1 applied"
    seen_env = results["c_env"]
    for name in (GATEWAY_SECRET_ENV, GATE_SECRET_ENV):
        assert name not in seen_env
    assert f"{TOOLS_ENV}=" in seen_env  # the declarations are not secret
    for secret in (*first_secrets, *second_secrets):
        assert secret not in seen_env
        assert files_containing([tmp_path], secret) == []
    assert ln.updates.texts == ["working"]
    assert (tmp_path / "work" / "bash-runs").read_text() == "x\n"
    ledger = ln.ledger.entries()
    assert len(ledger) == 1

    assert after_second == after_first  # epoch 2 appended nothing
    kinds = [type(r).__name__ for r in after_first]
    assert kinds == [
        "ModelRequestIntent",
        "ModelResponse",
        *["ToolIntent", "ToolOutcome"] * 3,
        "ModelRequestIntent",
        "ModelResponse",
    ]
    intents = [r for r in after_first if isinstance(r, ToolIntent)]
    request_steps = [r.step for r in after_first if isinstance(r, ModelRequestIntent)]
    assert request_steps == [0, 1]
    assert {i.step for i in intents} == {0}  # the round of the response that asked
    assert [i.tool_call_id for i in intents] == ["c_env", "c_update", "c_effect"]
    assert [i.replay_class for i in intents] == [ReplayClass.NEVER] * 3
    assert {i.epoch for i in intents} == {1}
    assert ledger[0]["intent_id"] == intents[2].intent_id
    outcomes = [r for r in after_first if isinstance(r, ToolOutcome)]
    assert [o.intent_id for o in outcomes] == [i.intent_id for i in intents]


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_b3_runtime_tools_not_granted_are_not_declared(kind: str, tmp_path: Path) -> None:
    """B3: a lane granted only ``send_text_update`` declares it and none of the others, and
    Pi's tools outside the grant are refused at the gate."""
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": "touch ran"}, id="c1")]),
        Text(text="ok"),
    ]
    with trio.fail_after(PROCESS_LIMIT):
        async with lane(tmp_path, steps) as ln:
            config = ln.config(("send_text_update",))
            async with open_boundaries(config, ln.log, key=delivery_key(DELIVERY), epoch=1) as b:
                await one_turn(b.launch(base_launch(kind, tmp_path)))
    names = [t["function"]["name"] for t in ln.model.requests[0].body["tools"]]
    assert names == ["read", "bash", "edit", "write", "send_text_update"]
    assert "not granted" in tool_messages(ln.model.requests[1].body)["c1"]
    assert not (tmp_path / "work" / "ran").exists()


# ------------------------------------------------------------------------ the servers


async def _gateway_status(server: HttpServer, secret: str, body: dict[str, Any]) -> int:
    headers = [("content-type", "application/json"), ("authorization", f"Bearer {secret}")]
    url = f"{server.url}/v1/chat/completions"
    async with open_request("POST", url, headers=headers, body=msgspec.json.encode(body)) as r:
        await r.read()
        return r.status


def _request(*tool_call_ids: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for call_id in tool_call_ids:
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "read", "arguments": "{}"},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "content": "x", "tool_call_id": call_id})
    return {"model": "fake-model", "stream": True, "messages": messages}


async def _ask_gate(b: Boundaries, target: str, body: dict[str, Any], secret: str) -> int:
    assert b.gate_server is not None
    status, _answer = await post_json(str(b.gate_server.path), target, body, secret=secret)
    return status


async def test_b2_a_new_epoch_stops_the_previous_secrets(tmp_path: Path) -> None:
    """B2: after ``begin_epoch`` both servers refuse the previous epoch's secrets (401) and
    serve the new ones; records made afterwards carry the new epoch."""
    with trio.fail_after(LIMIT):
        async with (
            lane(tmp_path, [Text(text="a"), Text(text="b")]) as ln,
            open_boundaries(ln.config(("read",)), ln.log, key=delivery_key(DELIVERY), epoch=1) as b,
        ):
            assert b.gateway_server is not None
            old_gateway, old_gate = b.gateway.secret, b.gate.secret
            b.begin_epoch(2)
            assert old_gateway != b.gateway.secret
            assert old_gate != b.gate.secret
            before = {"tool_call_id": "c1", "name": "read", "args": {"path": "x"}}
            assert await _gateway_status(b.gateway_server, old_gateway, _request()) == 401
            assert await _ask_gate(b, "/before", before, old_gate) == 401
            assert await _gateway_status(b.gateway_server, b.gateway.secret, _request()) == 200
            assert await _ask_gate(b, "/before", before, b.gate.secret) == 200
    records = await read_back(ln.store)
    assert [type(r) for r in records] == [ModelRequestIntent, ModelResponse, ToolIntent]
    assert {r.epoch for r in records if isinstance(r, ModelRequestIntent | ToolIntent)} == {2}
    assert ln.model.request_count == 1


async def test_b4_a_request_carrying_a_result_waits_for_its_outcome(tmp_path: Path) -> None:
    """B4: a model request that carries the result of a call the gate let run is held (the
    upstream is not called) until that call's outcome is durable; then it goes through."""
    with trio.fail_after(LIMIT):
        async with (
            lane(tmp_path, [Text(text="a")]) as ln,
            open_boundaries(ln.config(("read",)), ln.log, key=delivery_key(DELIVERY), epoch=1) as b,
            trio.open_nursery() as nursery,
        ):
            assert b.gateway_server is not None
            call = {"tool_call_id": "c1", "name": "read", "args": {"path": "x"}}
            assert await _ask_gate(b, "/before", call, b.gate.secret) == 200
            statuses: list[int] = []

            async def request() -> None:
                assert b.gateway_server is not None
                body = _request("c1")
                statuses.append(await _gateway_status(b.gateway_server, b.gateway.secret, body))

            nursery.start_soon(request)
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert ln.model.request_count == 0  # held at the barrier
            assert statuses == []
            after = {**call, "result": {"content": [{"type": "text", "text": "x"}]}}
            assert await _ask_gate(b, "/after", after, b.gate.secret) == 200
    assert statuses == [200]
    assert ln.model.request_count == 1
    records = await read_back(ln.store)
    assert [type(r) for r in records] == [
        ToolIntent,
        ToolOutcome,
        ModelRequestIntent,
        ModelResponse,
    ]


@pytest.mark.parametrize("replay", [True, False])
async def test_t14_a_mismatched_replayed_call_refuses_the_rest_of_a_replay(
    tmp_path: Path, replay: bool
) -> None:
    """T14 through both boundaries: on a lane that replays (room lanes), a call asked under a
    recorded round and id as another tool is refused, so is every later call, and the next
    model request the journal has not answered is refused too (409, never sent upstream):
    ``steps.mismatch`` is set, from which the lane ends the delivery
    ``recovery_refused:replay``. A lane that does not replay (task lanes) refuses only that
    call."""
    with trio.fail_after(LIMIT):
        async with lane(tmp_path, [Text(text="a")]) as ln:
            config = dataclasses.replace(ln.config(("bash", "write")), replay=replay)
            key = delivery_key(DELIVERY)
            async with open_boundaries(config, ln.log, key=key, epoch=1) as b:
                assert b.gateway_server is not None
                bash = {"tool_call_id": "c1", "name": "bash", "args": {"command": "true"}}
                result = {"content": [{"type": "text", "text": "done"}]}
                assert b.gate_server is not None
                path, secret = str(b.gate_server.path), b.gate.secret
                assert (await post_json(path, "/before", bash, secret=secret))[0] == 200
                after = {**bash, "result": result}
                assert (await post_json(path, "/after", after, secret=secret))[0] == 200
                write = {"tool_call_id": "c1", "name": "write", "args": {"path": "x"}}
                status, answer = await post_json(path, "/before", write, secret=secret)
                assert (status, answer["decision"]) == (200, "refused")
                assert "gate_replay_mismatch" in answer["result"]["content"][0]["text"]
                fresh = {"tool_call_id": "c2", "name": "bash", "args": {"command": "true"}}
                _status, later = await post_json(path, "/before", fresh, secret=secret)
                request = await _gateway_status(b.gateway_server, b.gateway.secret, _request())
                mismatch = b.steps.mismatch
    if replay:
        assert later["decision"] == "refused"
        assert request == 409
        assert ln.model.request_count == 0
        assert mismatch is not None
    else:
        assert later["decision"] == "run"
        assert request == 200
        assert mismatch is None
    records = await read_back(ln.store)
    assert [(type(r).__name__, getattr(r, "name", None)) for r in records][:2] == [
        ("ToolIntent", "bash"),
        ("ToolOutcome", None),
    ]
    assert not any(isinstance(r, ToolIntent) and r.name == "write" for r in records)


def test_carried_tool_results() -> None:
    assert carried_tool_results(_request("a", "b")) == ["a", "b"]
    assert carried_tool_results({"messages": "nope"}) == []
    assert carried_tool_results({}) == []


def test_b3_a_granted_runtime_tool_needs_a_handler() -> None:
    """B3: granting a runtime tool without a handler is refused when the journals are built."""
    with pytest.raises(ValueError, match="task_done"):
        RecordingGateJournal(MemoryLog(), key="k", epoch=1, granted=["task_done"])


def _partial_text(event: Event) -> str:
    partial = event.record.get("partialResult") or {}
    return "".join(p.get("text", "") for p in partial.get("content", []) if isinstance(p, dict))


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_b6_sigkill_mid_tool_leaves_no_descendant_and_the_model_hears_possibly_ran(
    kind: str, tmp_path: Path
) -> None:
    """B6 with W6: the worker is SIGKILLed while its bash tool runs (with a daemonised
    grandchild); the epoch's end leaves no process of the tree alive. The session is
    settled from the journal — the call's intent has no outcome, so "possibly ran" — and
    the next epoch, on the same session, sends the model exactly that as the call's result;
    the tool never runs again."""
    command = "(sleep 300 &) ; echo x >> bash-runs; echo started; sleep 300"
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": command}, id="c_kill")]),
        Text(text="after the crash"),
    ]
    clock = Clocks.system().wall
    with trio.fail_after(PROCESS_LIMIT):
        async with lane(tmp_path, steps) as ln:
            config = ln.config(("bash",))
            launch = base_launch(kind, tmp_path)
            assert launch.session is not None
            async with open_boundaries(config, ln.log, key=delivery_key(DELIVERY), epoch=1) as b:
                async with (
                    open_worker(b.launch(launch)) as worker,
                    open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
                ):
                    await rpc.prompt("go")
                    async for event in rpc:
                        if "started" in _partial_text(event):
                            break
                    tree = await worker.members()
                    assert len(tree) >= 3  # the worker, its bash, the daemonised sleep
                    os.kill(worker.pid, signal.SIGKILL)
                    await worker.wait()
                    with contextlib.suppress(WorkerExitedError):
                        await rpc.request({"type": "get_state"})
                assert not any(is_alive(member) for member in tree)
                assert alive_with_nonce(worker.nonce) == []
                report = await b.settle_session(launch.session, clock=clock)
                b.begin_epoch(2)
                await one_turn(b.launch(launch), "continue")
            records = await read_back(ln.store)
    assert [c.tool_call_id for c in report.settled] == ["c_kill"]
    assert ln.model.request_count == 2
    assert tool_messages(ln.model.requests[1].body)["c_kill"] == interrupted_text("bash")
    assert (tmp_path / "work" / "bash-runs").read_text() == "x\n"  # it ran once, not again
    outcomes = [r for r in records if isinstance(r, ToolOutcome)]
    assert len(outcomes) == 1
    assert outcomes[0].is_error
    assert outcomes[0].content == [{"type": "text", "text": interrupted_text("bash")}]
