"""A model's tool call whose arguments nest deeper than the runtime's decoders go, at both
boundaries; test names cite ``docs/design/gate.md`` (T17), ``docs/design/gateway.md`` (G19),
``docs/design/sessions.md`` (S3, S12) and ``docs/design/boundaries.md`` (B6).

JavaScript reads and writes JSON a few thousand levels deep; msgspec and the stdlib stop at
about a thousand. In the openai-completions format the gateway speaks, a call's arguments are
a JSON *string* (``tool_calls[].function.arguments``), so the nesting never reaches the
gateway's decoder; it does reach the gate (``/before``'s ``args`` is an object), the session
file and the RPC events. The end-to-end tests run the real Pi 1.6.0 with the extension
(``docs/design/pi-observed.md`` §11): Fake-Pi, which decodes the arguments with msgspec, stops
on them with a ``RecursionError`` where Pi goes on, so it is not run here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio

from fake_pi._gate_client import post_json
from fake_pi.scenario import Call, Step, Text, ToolCalls
from runtime._boundary._boundaries import open_boundaries
from runtime._boundary._gate import (
    ARGS_MAX_DEPTH,
    Gate,
    GateServer,
    MemoryLog,
    RecordingGateJournal,
    serve_gate,
)
from runtime._clock import Clocks
from runtime._errors import ReasonCode, WorkerExitedError
from runtime._journal._store import delivery_key
from runtime._pi._rpc import open_rpc_channel
from runtime._pi._rpc_protocol import MALFORMED_LINE
from runtime._pi._session_files import read_session
from runtime._pi._session_settle import interrupted_text
from runtime._pi._worker import open_worker
from runtime._records import ModelRequestIntent, ModelResponse, ToolIntent, ToolOutcome

from .._workers import one_turn, tool_messages
from .test_boundary import DELIVERY, PROCESS_LIMIT, base_launch, lane, read_back
from .test_gate import sock_dir as sock_dir
from .test_gateway import BODY, LIMIT, exchange, rig
from .test_gateway_adversarial import exchange_raw

DEPTH: Final = 2_000


def nested(depth: int) -> msgspec.Raw:
    """Arrays ``depth`` levels deep, as raw JSON: msgspec writes it as it is."""
    return msgspec.Raw(b"[" * depth + b"]" * depth)


def refusal(name: str, depth: int) -> str:
    return (
        f"tool {name} was refused and did not run: its arguments nest {depth} levels deep, "
        f"more than the {ARGS_MAX_DEPTH} the runtime accepts; send them less deeply nested "
        f"({ReasonCode.GATE_BAD_REQUEST})"
    )


# --------------------------------------------------------------------------- the gate


@contextlib.asynccontextmanager
async def gate_at(sock_dir: Path, log: MemoryLog) -> AsyncIterator[tuple[Gate, str]]:
    journal = RecordingGateJournal(log, key="k", epoch=1, granted=["bash"])
    gate = Gate(journal)
    async with trio.open_nursery() as nursery:
        server: GateServer = await nursery.start(serve_gate, gate, sock_dir / "gate.sock")
        yield gate, str(server.path)
        nursery.cancel_scope.cancel()


async def test_t17_a_call_whose_arguments_nest_too_deep_is_refused_not_a_server_fault(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """T17: arguments nested 2,000 levels (deeper than msgspec decodes) and 300 levels
    (msgspec decodes them) are both answered *refused* with a text naming
    ``gate_bad_request`` and the depth: nothing recorded, nothing runs, no fault logged. At
    :data:`ARGS_MAX_DEPTH` levels the call runs as any other. Before, the 2,000-level body's
    ``RecursionError`` escaped the handler: a 500 ``server_fault`` with a traceback in the log,
    and the model was told "HTTP 500"; a 300-level call was let run."""
    log = MemoryLog()
    answers = []
    with trio.fail_after(LIMIT):
        async with gate_at(sock_dir, log) as (gate, path):
            for call_id, depth in (("deep", DEPTH), ("mid", 300), ("edge", ARGS_MAX_DEPTH - 1)):
                body = {
                    "tool_call_id": call_id,
                    "name": "bash",
                    "args": {"command": "true", "x": nested(depth)},
                }
                answers.append(await post_json(path, "/before", body, secret=gate.secret))
    for status, answer in answers[:2]:
        assert status == 200, answer
        assert answer["decision"] == "refused"
    assert answers[0][1]["result"]["content"][0]["text"] == refusal("bash", DEPTH + 1)
    assert answers[1][1]["result"]["content"][0]["text"] == refusal("bash", 301)
    assert answers[2][0] == 200
    assert answers[2][1]["decision"] == "run"  # 256 levels, the arguments object the first
    assert [r.tool_call_id for r in log.records if isinstance(r, ToolIntent)] == ["edge"]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_t17_a_body_nested_too_deep_but_not_in_its_arguments_is_a_bad_request(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """T17: an ``/after`` whose result nests deeper than msgspec decodes, and a ``/before``
    nested that deep outside its arguments (no body the extension sends), are answered 400
    ``gate_bad_request``, nothing recorded, the gate serving on. Before: a 500 and a
    traceback."""
    log = MemoryLog()
    with trio.fail_after(LIMIT):
        async with gate_at(sock_dir, log) as (gate, path):
            result = {"content": [], "details": {"x": nested(DEPTH)}, "isError": False}
            body = {"tool_call_id": "c1", "name": "bash", "result": result}
            after = await post_json(path, "/after", body, secret=gate.secret)
            plain = {"tool_call_id": "c2", "name": "bash", "args": {"command": "true"}}
            odd = await post_json(path, "/before", plain | {"x": nested(DEPTH)}, secret=gate.secret)
            again = await post_json(path, "/before", plain, secret=gate.secret)
    for status, answer in (after, odd):
        assert status == 400
        assert answer["error"]["code"] == ReasonCode.GATE_BAD_REQUEST
        assert "nests deeper than the gate reads" in answer["error"]["message"]
    assert again[0] == 200
    assert [type(r) for r in log.records] == [ToolIntent]  # c2's: the gate went on
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


# ------------------------------------------------------------------------ the gateway


async def test_g19_a_body_nested_deeper_than_the_gateway_reads_is_a_400_and_it_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """G19: a request body nested 2,000 levels (as structure, not inside a string: Pi never
    sends one) is answered 400 ``gateway_bad_request`` saying so, read no further and never
    sent upstream; the gateway answers the next request as usual."""
    deep = b'{"model":"fake-model","stream":true,"messages":[],"x":' + b"[" * DEPTH
    deep += b"]" * DEPTH + b"}"
    with trio.fail_after(LIMIT):
        async with rig([Text(text="hi")]) as r:
            status, answer = await exchange_raw(r, deep)
            next_status, _events = await exchange(r, BODY)
    assert status == 400
    error = msgspec.json.decode(answer)["error"]
    assert error["type"] == ReasonCode.GATEWAY_BAD_REQUEST
    assert "nested too deeply" in error["message"]
    assert next_status == 200
    assert len(r.upstream_bodies) == 1
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


# --------------------------------------------------------------------- end to end (Pi)


async def test_t17_g19_s3_a_call_nested_2000_deep_fails_closed_and_the_session_goes_on(
    tmp_path: Path,
) -> None:
    """The claim "one tool call nested that deep bricks the room" against the real Pi. The
    model answers with an ``effect`` call whose ``x`` nests 2,000 arrays deep. T17: the tool
    fails closed with the gate's coded refusal, which the model is told; nothing is recorded
    and the effect never happens. G19: Pi's next request carries the arguments as a string,
    and the gateway journals it like any other. S3: the session line Pi wrote for the call is
    an entry of the tree, and the RPC events for it are events. Then a new epoch on the
    rewound session replays the turn from the journal alone, and a later turn of the session
    — whose requests resend the deep call — reaches the model.

    Before: the gate answered 500 ``server_fault`` (a traceback in the log), the session line
    was ``bad_json`` and the results below it ``unknown_parent``, and Pi's RPC events for the
    call were ``rpc_malformed_line``."""
    x = nested(DEPTH)
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="effect", arguments={"key": "k1", "x": x}, id="c_deep")]),
        Text(text="done"),
        Text(text="again"),
    ]
    with trio.fail_after(PROCESS_LIMIT):
        async with lane(tmp_path, steps) as ln:
            launch = base_launch("pi", tmp_path)
            assert launch.session is not None
            admission = launch.session.read_bytes()
            config = ln.config(("read", "bash", "effect"))
            async with open_boundaries(config, ln.log, key=delivery_key(DELIVERY), epoch=1) as b:
                events = await one_turn(b.launch(launch))
                first = await read_back(ln.store)
                session = read_session(launch.session)
                launch.session.write_bytes(admission)  # epoch 2 replays the turn
                b.begin_epoch(2)
                replayed = await one_turn(b.launch(launch))
                replay_records = await read_back(ln.store)
                later = await one_turn(b.launch(launch), "again")
                stats = b.gateway.statistics()
            after = read_session(launch.session)

    told = tool_messages(ln.model.requests[1].body)["c_deep"]
    assert told == refusal("effect", DEPTH + 1)
    sent = [m for m in ln.model.requests[1].body["messages"] if m.get("tool_calls")]
    assert isinstance(sent[0]["tool_calls"][0]["function"]["arguments"], str)  # G19
    assert ln.ledger.entries() == []
    assert [type(r) for r in first] == [ModelRequestIntent, ModelResponse] * 2
    assert replay_records == first  # the replay was answered from the journal alone
    assert ln.model.request_count == 3  # two for the turn, once; one for the later turn
    assert tool_messages(ln.model.requests[2].body)["c_deep"] == told
    assert stats.refused == 0
    for read in (session, after):
        assert read.issues == ()
        assert read.session.leaf is not None
        calls = [
            e for e in read.session.path_to_root() if e.role == "assistant"
            and any(b.get("id") == "c_deep" for b in e.raw["message"]["content"])
        ]  # fmt: skip
        assert len(calls) == 1
    for turn in (events, replayed, later):
        assert MALFORMED_LINE not in {e.type for e in turn}
        starts = [e for e in turn if e.type == "tool_execution_start"]
        assert [e.record["toolCallId"] for e in starts] == (["c_deep"] if turn is not later else [])
    assert after.session.leaf is not None
    assert after.session.leaf.raw["message"]["content"] == [{"type": "text", "text": "again"}]


def _partial_text(record: dict[str, Any]) -> str:
    partial = record.get("partialResult") or {}
    return "".join(p.get("text", "") for p in partial.get("content", []) if isinstance(p, dict))


async def test_b6_s12_a_dead_workers_call_beside_a_deep_one_is_settled_possibly_ran(
    tmp_path: Path,
) -> None:
    """B6, S12: the model asks for a call nested 2,000 deep (refused, T17) and a ``bash`` call
    that the gate lets run; the worker is SIGKILLed while ``bash`` runs. Settling the session
    must find that call dangling in the message that holds both, record "possibly ran" for
    it, and the next epoch must send the model exactly that. Before, the message was
    unreadable: the session's path ended at the first call's result, nothing dangled, nothing
    was settled, and the next epoch's first request, carrying Pi's own "No result provided"
    for a call that had run, waited at the gateway for an outcome that never came (T11)."""
    command = "echo x >> bash-runs; echo started; sleep 300"
    calls = [
        Call(name="read", arguments={"path": "a.txt", "x": nested(DEPTH)}, id="c_deep"),
        Call(name="bash", arguments={"command": command}, id="c_kill"),
    ]
    steps: list[Step] = [ToolCalls(calls=calls), Text(text="after the crash")]
    with trio.fail_after(PROCESS_LIMIT):
        async with lane(tmp_path, steps) as ln:
            config = ln.config(("read", "bash"))
            launch = base_launch("pi", tmp_path)
            assert launch.session is not None
            async with open_boundaries(config, ln.log, key=delivery_key(DELIVERY), epoch=1) as b:
                async with (
                    open_worker(b.launch(launch)) as worker,
                    open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
                ):
                    await rpc.prompt("go")
                    async for event in rpc:
                        if "started" in _partial_text(event.record):
                            break
                    os.kill(worker.pid, signal.SIGKILL)
                    await worker.wait()
                    with contextlib.suppress(WorkerExitedError):
                        await rpc.request({"type": "get_state"})
                report = await b.settle_session(launch.session, clock=Clocks.system().wall)
                assert [c.tool_call_id for c in report.settled] == ["c_kill"]
                b.begin_epoch(2)  # (unsettled, its request would wait for an outcome: T11)
                await one_turn(b.launch(launch), "continue")
            records = await read_back(ln.store)
    assert ln.model.request_count == 2
    told = tool_messages(ln.model.requests[1].body)
    assert told["c_kill"] == interrupted_text("bash")
    assert told["c_deep"] == refusal("read", DEPTH + 1)
    assert (tmp_path / "work" / "bash-runs").read_text() == "x\n"
    outcomes = [r for r in records if isinstance(r, ToolOutcome)]
    assert [o.content for o in outcomes] == [[{"type": "text", "text": interrupted_text("bash")}]]
    assert [r.tool_call_id for r in records if isinstance(r, ToolIntent)] == ["c_kill"]
