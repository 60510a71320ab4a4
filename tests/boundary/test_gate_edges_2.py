"""More edges of the tool gate (``docs/design/gate.md``): a call whose arguments hold a lone
surrogate (T22), and T21 in the in-process harness (``runtime/testing/_in_process.py``).

The gate's decisions run against the real Unix socket with an in-memory log, and on a real
store; the end-to-end test launches the real Pi (with the extension) against a scripted model;
the in-process test runs a task lane with Fake-Pi in the test's Trio run on virtual time.
Every wait is bounded by ``trio.fail_after`` and driven by events, never by sleeping.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio
from msgspec.structs import replace

from fake_pi.scenario import Call, Step, Text, ToolCalls
from runtime._boundary._calls import GateCall, GateResult, RunTool, Saved
from runtime._boundary._gate import (
    MemoryLog,
    RecordingGateJournal,
    canonical_args,
    gate_environment,
)
from runtime._boundary._receipts import open_receipt_store
from runtime._boundary._tools import DocumentTools
from runtime._clock import Clocks
from runtime._errors import GateError, ReasonCode
from runtime._journal._store import delivery_key, open_store
from runtime._pi._pijson import loads
from runtime._records import ReplayClass, ToolIntent, ToolOutcome

from .._workers import one_turn, tool_messages
from ..task_harness import TASK, open_rig, say
from .test_gate import KEY, LIMIT, PROCESS_LIMIT, _intent, _launch, model_and_gate, rig
from .test_gate import sock_dir as sock_dir

LONE: Final = "\ud83d"
"""The high half of an emoji, alone: what a model's output cut between the halves leaves."""
COMMAND: Final = f"printf ok # {LONE}"
RAW_COMMAND: Final = msgspec.Raw(b'"printf ok # \\ud83d"')
"""``COMMAND`` as ``JSON.stringify`` writes it: the surrogate as its six-character escape."""
CANONICAL: Final = '{"command":"printf ok # \\ud83d"}'


def test_t22_canonical_args_write_a_lone_surrogate_as_its_escape() -> None:
    """T22: the canonical arguments of a call holding a lone surrogate are JSON text (the
    surrogate written as ``JSON.stringify`` writes it, keys sorted as for any call) that the
    journal can encode and ``loads`` reads back as the same arguments; arguments without one
    are written as before. Before, ``canonical_args`` raised ``UnicodeEncodeError``."""
    args = {"b": [LONE, {"z": 1, "a": "\udc00x"}], "a": 5.0, LONE: "key"}
    text = canonical_args(args)
    assert text == '{"a":5.0,"b":["\\ud83d",{"a":"\\udc00x","z":1}],"\\ud83d":"key"}'
    assert loads(text.encode()) == args
    assert msgspec.json.decode(msgspec.json.encode(text)) == text  # a journal field as any
    assert canonical_args({"command": COMMAND}) == CANONICAL
    plain = {"b": "é😀", "a": [1, 2.5, None, True]}
    assert canonical_args(plain) == msgspec.json.encode(plain, order="sorted").decode()
    # a valid pair is the character it stands for, as JavaScript and msgspec read it
    assert canonical_args({"e": "\ud83d\ude00"}) == canonical_args({"e": "😀"})


async def test_t22_a_call_holding_a_lone_surrogate_is_decided_and_replayed(
    sock_dir: Path,
) -> None:
    """T22 with T2, T3, T14: a ``/before`` whose arguments hold a lone surrogate (Pi's
    extension writes the call with ``JSON.stringify``: the surrogate as ``\\ud83d``) is read
    as the gateway reads a body, its intent recorded with the arguments as given, and it is
    answered *run*; its outcome is recorded; asked again it is answered *saved* (T3), and asked
    with another lone surrogate it is not the recorded call (T14). Before, the gate answered
    400 ``gate_bad_request`` ("the body is not JSON"): the tool failed although the model
    request that carried the call was accepted."""
    body = {"tool_call_id": "c1", "name": "bash", "args": {"command": RAW_COMMAND}}
    other = body | {"args": {"command": msgspec.Raw(b'"ok \\udc00"')}}
    with trio.fail_after(LIMIT):
        async with rig(sock_dir) as r:
            first = await r.post("/before", body)
            result = {"content": [{"type": "text", "text": "ok"}], "isError": False}
            report = {"tool_call_id": "c1", "name": "bash", "result": result}
            reported = await r.post("/after", report)
            again = await r.post("/before", body)
            mismatched = await r.post("/before", other)
    assert first == (200, {"decision": "run", "intent_id": f"{KEY}:1"}), first
    assert reported == (200, {"ok": True})
    assert again == (200, {"decision": "saved", "result": result})
    assert mismatched[0] == 200
    assert mismatched[1]["decision"] == "refused"
    assert ReasonCode.GATE_REPLAY_MISMATCH in mismatched[1]["result"]["content"][0]["text"]
    intent, outcome = r.log.records
    assert isinstance(intent, ToolIntent)
    assert isinstance(outcome, ToolOutcome)
    assert intent.args == CANONICAL
    assert loads(intent.args.encode()) == {"command": COMMAND}


async def test_t22_what_no_record_can_hold_is_a_bad_request_not_a_fault(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """T22: an ``/after`` whose result holds a lone surrogate (no ToolOutcome can hold one),
    and a ``/before`` whose tool-call id does, are answered 400 ``gate_bad_request`` saying
    so, nothing recorded, no fault logged; the gate serves on."""
    ran = {"tool_call_id": "c1", "name": "bash", "args": {"command": "true"}}
    text = msgspec.Raw(b'"cut \\ud83d"')
    result = {"content": [{"type": "text", "text": text}], "isError": False}
    with trio.fail_after(LIMIT):
        async with rig(sock_dir) as r:
            assert (await r.post("/before", ran))[0] == 200
            after = await r.post("/after", {"tool_call_id": "c1", "name": "bash", "result": result})
            odd_id = await r.post("/before", ran | {"tool_call_id": msgspec.Raw(b'"c\\udc00"')})
            plain = {"content": [{"type": "text", "text": "ok"}], "isError": False}
            report = {"tool_call_id": "c1", "name": "bash", "result": plain}
            reported = await r.post("/after", report)
    for (status, answer), why in ((after, "the result holds"), (odd_id, "tool_call_id and name")):
        assert status == 400, answer
        assert answer["error"]["code"] == ReasonCode.GATE_BAD_REQUEST
        assert why in answer["error"]["message"]
    assert reported == (200, {"ok": True})
    assert [type(x) for x in r.log.records] == [ToolIntent, ToolOutcome]
    assert [x for x in caplog.records if x.levelno >= logging.ERROR] == []


async def test_t22_a_lone_surrogates_intent_round_trips_a_delivery_log(tmp_path: Path) -> None:
    """T22 on a real store: the intent of a call holding a lone surrogate is written to the
    delivery log (fsync'd) and read back after a reopen; the recorded outcome is answered
    *saved* for the same call (T3), and a ``safe`` call's intent without outcome is run again
    for it under a new intent (T5, T14: the same arguments). Before, the gate could not make
    the intent at all (``UnicodeEncodeError`` from the canonical arguments)."""
    key = delivery_key("d1")
    bash = GateCall("c1", "bash", {"command": COMMAND})
    read = GateCall("c2", "read", {"path": f"notes{LONE}.md"})
    async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
        log = await store.create_delivery_log("d1")
        journal = RecordingGateJournal(log, key=key, epoch=1, granted=["bash", "read"])
        assert isinstance(await journal.decide(bash), RunTool)
        await journal.record_outcome(bash, GateResult.text("ok"))
        assert isinstance(await journal.decide(read, follows="c1"), RunTool)
        await store.close_log(log)
    async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
        log = await store.open_delivery_log("d1")
        records = log.contents.records
        intents = [r for r in records if isinstance(r, ToolIntent)]
        reopened = RecordingGateJournal(
            log, key=key, epoch=2, granted=["bash", "read"], existing=records
        )
        saved = await reopened.decide(bash)
        rerun = await reopened.decide(read)
        await store.close_log(log)
    assert [loads(i.args.encode()) for i in intents] == [bash.args, read.args]
    assert saved == Saved(GateResult.text("ok"))
    assert isinstance(rerun, RunTool)
    assert rerun.intent_id != intents[1].intent_id


async def test_t22_t13_a_receipt_intent_holding_a_lone_surrogate_is_settled(
    tmp_path: Path,
) -> None:
    """T22 with T13: a dead worker's ``write_document`` intent whose recorded arguments hold a
    lone surrogate is settled by running the write with those arguments, read back from the
    intent as it wrote them, and that outcome is recorded. Before, ``settle`` read the
    recorded arguments with msgspec, which refuses the escape: a ``DecodeError`` out of the
    settling instead of a result."""
    store = await open_receipt_store(tmp_path)
    args = {"document_id": "notes", "content": f"half {LONE}"}
    intent = replace(_intent("c1", "write_document", args=args), replay_class=ReplayClass.RECEIPT)
    assert intent.args == '{"content":"half \\ud83d","document_id":"notes"}'
    log = MemoryLog(records=[intent])
    journal = RecordingGateJournal(
        log,
        key=KEY,
        epoch=2,
        granted=["write_document"],
        existing=[intent],
        runtime_tools=DocumentTools(store).handlers(),
    )
    with trio.fail_after(LIMIT):
        try:
            result = await journal.settle(GateCall("c1", "write_document", {}))
        finally:
            await store.aclose()
    (outcome,) = log.records[1:]
    assert isinstance(outcome, ToolOutcome)
    assert outcome.intent_id == intent.intent_id
    assert (outcome.content, outcome.is_error) == (result.content, result.is_error)


async def test_e2e_t22_pis_call_holding_a_lone_surrogate_runs(
    tmp_path: Path, sock_dir: Path
) -> None:
    """T22 with the real Pi: the model's tool call holds a lone surrogate in its arguments
    (``\\ud83d`` in the streamed arguments' JSON); Pi parses it, its extension asks the gate
    with the call as ``JSON.stringify`` writes it, and the call runs: the model is told its
    output, and the intent and outcome are recorded. Before, the gate answered 400 and the
    tool failed with "HTTP 400"."""
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": RAW_COMMAND}, id="c_lone")]),
        Text(text="done"),
    ]
    log = MemoryLog()
    with trio.fail_after(PROCESS_LIMIT):
        async with model_and_gate(steps, sock_dir, log, ("bash",)) as (model, up, r):
            env = gate_environment(r.server, r.gate)
            await one_turn(_launch("pi", tmp_path, up, gate_env=env))
    assert model.request_count == 2
    assert tool_messages(model.requests[1].body)["c_lone"] == "ok"
    intent, outcome = log.records
    assert isinstance(intent, ToolIntent)
    assert isinstance(outcome, ToolOutcome)
    assert (intent.tool_call_id, intent.args) == ("c_lone", CANONICAL)
    assert outcome.content == [{"type": "text", "text": "ok"}]
    assert not outcome.is_error


# ------------------------------------------------------------- T21 in the in-process harness


def _read(path: str = "README.md") -> ToolCalls:
    return ToolCalls(calls=[Call(name="read", arguments={"path": path})])


@pytest.mark.trio
async def test_t21_in_process_a_call_that_follows_a_refused_report_is_refused(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """T21 through the in-process harness (``InProcessWorkers``): Fake-Pi in the test's Trio
    run names the call it reported last (``follows``) as its socket client does, so a call
    that follows a report the journal refused (as it refuses one that reaches it after its
    delivery ended, 409 on the socket) is refused, nothing recorded, and the worker goes on
    (the failed report is written to stderr, as the socket client writes it). Before,
    ``_DirectGate`` asked without ``follows``: the next call ran as if the outcome were
    recorded, and the refused report's error went up into Fake-Pi's agent loop."""
    recorded = RecordingGateJournal.record_outcome
    refused: list[str] = []

    async def refuse_first(journal: RecordingGateJournal, call: GateCall, result: Any) -> None:
        if not refused:
            refused.append(call.tool_call_id)
            raise GateError(ReasonCode.GATE_BAD_REQUEST, f"an outcome for {call.tool_call_id!r}")
        await recorded(journal, call, result)

    monkeypatch.setattr(RecordingGateJournal, "record_outcome", refuse_first)
    async with open_rig(tmp_path, clocks, [_read(), _read(), say("stopped")]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until_logged(lambda _: rig.model.request_count >= 3)
        await rig.runner.abort(TASK, "enough")
        await rig.ended(TASK)
        records = await rig.records()
    told = tool_messages(rig.model.requests[2].body)
    (first_id,) = refused
    second_id = next(i for i in told if i != first_id)
    assert "a task's worktree" in told[first_id]  # it ran; its report was refused
    assert f"the earlier call {first_id!r}" in told[second_id]
    assert "was not recorded (its report failed)" in told[second_id]
    reads = [r for r in records if isinstance(r, ToolIntent) and r.name == "read"]
    assert [r.tool_call_id for r in reads] == [first_id]  # the second never ran
    assert not [r for r in records if isinstance(r, ToolOutcome)]
    assert json.dumps(told)  # the model was told, the worker went on
