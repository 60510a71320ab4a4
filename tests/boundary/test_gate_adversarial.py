"""The tool gate against orders of events nobody planned (``runtime/_boundary/_gate.py``);
test names cite ``docs/design/gate.md`` (T1…).

"No side-effecting tool runs twice without the agent being told": each test tries to break
one rule of that promise — an ``/after`` that comes before its ``/before`` was answered, or
for a call never decided, or naming another tool; the same ``/before`` on two connections at
once; a fence while a call waits behind ``settle``; a replayed call whose arguments differ in
key order or number formatting only; a ``never`` intent left by a crash and asked three ways
at once; a model request held at the barrier (T11) whose outcome comes only after a fence or
never. The decisions run on the real Unix socket with an in-memory log; every wait is bounded
by ``trio.fail_after`` and driven by events, never by sleeping.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import trio.testing

from runtime._boundary._calls import GateCall, GateResult, RunTool
from runtime._boundary._gate import (
    Gate,
    GateServer,
    MemoryLog,
    RecordingGateJournal,
    canonical_args,
    replay_class_of,
    serve_gate,
)
from runtime._boundary._tools import EffectLedger
from runtime._errors import ReasonCode
from runtime._pi._session_settle import interrupted_text
from runtime._records import Record, ToolIntent, ToolOutcome

from .test_gate import Rig as GateRig
from .test_gate import _holding_the_next_append
from .test_gate import sock_dir as sock_dir

LIMIT: Final = 10.0
KEY: Final = "k"
OK_CONTENT: Final[list[dict[str, Any]]] = [{"type": "text", "text": "ran\n"}]


@dataclass
class Rig(GateRig):
    async def post_raw(self, target: str, body: bytes) -> tuple[int, Any]:
        """One request whose body is sent byte for byte as given (its number formatting and
        key order untouched), on its own connection."""
        head = (
            f"POST {target} HTTP/1.1\r\nhost: gate\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nauthorization: Bearer {self.gate.secret}\r\n"
            "connection: close\r\n\r\n"
        ).encode()
        stream = await trio.open_unix_socket(str(self.server.path))
        reply = bytearray()
        async with stream:
            await stream.send_all(head + body)
            while chunk := await stream.receive_some(65536):
                reply += chunk
        status_line, _, rest = bytes(reply).partition(b"\r\n")
        _, _, payload = rest.partition(b"\r\n\r\n")
        return int(status_line.split()[1]), json.loads(payload)


@contextlib.asynccontextmanager
async def rig(
    sock_dir: Path,
    *,
    existing: Sequence[Record] = (),
    granted: Sequence[str] = ("read", "bash", "edit", "write"),
    log: MemoryLog | None = None,
    runtime_tools: dict[str, Any] | None = None,
) -> AsyncIterator[Rig]:
    log = log if log is not None else MemoryLog(records=list(existing))
    journal = RecordingGateJournal(
        log,
        key=KEY,
        epoch=1,
        granted=granted,
        existing=list(log.records),
        runtime_tools=runtime_tools,
    )
    gate = Gate(journal)
    async with trio.open_nursery() as nursery:
        server: GateServer = await nursery.start(serve_gate, gate, sock_dir / "gate.sock")
        yield Rig(gate, server, log, journal)
        nursery.cancel_scope.cancel()


def _begin_epoch(r: Rig, epoch: int) -> None:
    """A new epoch as ``Boundaries.begin_epoch`` makes it: the journal's epoch moves on and
    the secret rotates."""
    r.journal.epoch = epoch
    r.gate.rotate_secret()


def _waiting_for_the_lock(r: Rig) -> int:
    return r.journal._lock.statistics().tasks_waiting


def _kinds(records: Sequence[Record]) -> list[tuple[str, str]]:
    return [(type(r).__name__, getattr(r, "tool_call_id", "")) for r in records]


def _call(call_id: str = "c1", name: str = "bash", **args: Any) -> dict[str, Any]:
    return {"tool_call_id": call_id, "name": name, "args": args or {"command": "true"}}


def _after(call_id: str = "c1", name: str = "bash") -> dict[str, Any]:
    return {"tool_call_id": call_id, "name": name, "result": {"content": OK_CONTENT}}


def _intent(call_id: str, name: str = "bash", *, seq: int = 1, args: Any = None) -> ToolIntent:
    return ToolIntent(
        intent_id=f"{KEY}:{seq}",
        step=0,
        tool_call_id=call_id,
        name=name,
        args=canonical_args(args if args is not None else {"command": "true"}),
        replay_class=replay_class_of(name),
        epoch=0,
    )


# --------------------------------------------------- outcomes the gate did not ask for (T2)


async def test_t2_t11_an_after_sent_before_its_befores_answer_was_read_is_recorded(
    sock_dir: Path,
) -> None:
    """T2, T11: a client that sends its ``/after`` (on a second connection) while its
    ``/before`` is still being decided — the intent's append held, the answer not yet
    written — gets the outcome recorded once the decision is done, never ahead of the
    intent: the report waits for the journal's lock behind the decision, and the barrier
    (T11) is released by it."""
    hold, held, release = _holding_the_next_append()
    got: dict[str, tuple[int, Any]] = {}
    with trio.fail_after(LIMIT):
        async with rig(sock_dir, log=MemoryLog(on_append=hold)) as r:

            async def post(name: str, target: str, body: Any) -> None:
                got[name] = await r.post(target, body)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, "before", "/before", _call())
                await held.wait()  # the intent is being appended: no answer yet
                nursery.start_soon(post, "after", "/after", _after())
                await trio.testing.wait_all_tasks_blocked()
                assert _waiting_for_the_lock(r) == 1  # the report waits its turn
                release.set()
            await r.journal.wait_outcomes(["c1"])  # T11: nothing left to wait for
            records = list(r.log.records)
    assert got["before"] == (200, {"decision": "run", "intent_id": "k:1"})
    assert got["after"] == (200, {"ok": True})
    assert _kinds(records) == [("ToolIntent", "c1"), ("ToolOutcome", "c1")]


@pytest.mark.parametrize("asked", ["never", "refused", "saved", "reported-twice"])
async def test_t2_an_outcome_for_a_call_not_let_run_is_refused_409(
    sock_dir: Path, asked: str
) -> None:
    """T2: an ``/after`` for a call the gate never answered *run* — never asked, refused (T4),
    answered *saved* from its recorded outcome (T3), or reported once already — is answered
    409 and records nothing: a recorded outcome is never replaced, and no outcome stands for
    a call that did not run here."""
    existing: list[Record] = []
    if asked == "saved":
        existing = [
            _intent("c1"),
            ToolOutcome(intent_id="k:1", tool_call_id="c1", content=OK_CONTENT),
        ]
    granted = ("read",) if asked == "refused" else ("bash",)
    with trio.fail_after(LIMIT):
        async with rig(sock_dir, existing=existing, granted=granted) as r:
            if asked != "never":
                status, answer = await r.post("/before", _call())
                expected = {"refused": "refused", "saved": "saved"}.get(asked, "run")
                assert (status, answer["decision"]) == (200, expected), answer
            if asked == "reported-twice":
                assert await r.post("/after", _after()) == (200, {"ok": True})
            before = list(r.log.records)
            forged = {**_after(), "result": {"content": [{"type": "text", "text": "forged"}]}}
            status, answer = await r.post("/after", forged)
            after = list(r.log.records)
            replay = await r.post("/before", _call())
    assert status == 409, answer
    assert answer["error"]["code"] == ReasonCode.GATE_BAD_REQUEST
    assert after == before
    assert "forged" not in json.dumps(replay[1])


async def test_t2_t14_an_outcome_naming_another_tool_is_refused_409(sock_dir: Path) -> None:
    """T2, T14: an ``/after`` under the id of a running ``bash`` call that names another tool
    (``write``) is not that call's outcome — the call it reports was never let run — so it
    is answered 409 and nothing is recorded; the running call's own outcome is then recorded
    as usual. Before, the gate looked the running call up by its id alone and recorded the
    other tool's report as ``bash``'s outcome: every later replay answered *saved* with it."""
    with trio.fail_after(LIMIT):
        async with rig(sock_dir) as r:
            assert (await r.post("/before", _call()))[1]["decision"] == "run"
            wrong = {**_after(name="write"), "result": {"content": [{"type": "text", "text": "w"}]}}
            status, answer = await r.post("/after", wrong)
            recorded_after_wrong = list(r.log.records)
            assert await r.post("/after", _after()) == (200, {"ok": True})
            replay = await r.post("/before", _call())
    assert status == 409, answer
    assert answer["error"]["code"] == ReasonCode.GATE_BAD_REQUEST
    assert _kinds(recorded_after_wrong) == [("ToolIntent", "c1")]
    assert replay == (
        200,
        {"decision": "saved", "result": {"content": OK_CONTENT, "isError": False}},
    )


async def test_t10_an_outcome_reported_for_a_runtime_tool_is_refused(sock_dir: Path) -> None:
    """T10: a runtime tool runs in the runtime and its outcome is the handler's — the worker
    only carries the call. An ``/after`` for a runtime tool's call while its handler runs is
    answered 409 and recorded nowhere; the handler's result is the call's outcome and its
    answer. Before, the worker's report was recorded as the outcome (the call was found
    running by its id), and the handler's result, finding an outcome recorded, was dropped:
    the model was told what the worker said, not what the runtime did."""
    entered, release = trio.Event(), trio.Event()
    ledger = EffectLedger(sock_dir / "ledger")

    async def effect(call: GateCall, intent_id: str) -> GateResult:
        entered.set()
        await release.wait()
        return await ledger(call, intent_id)

    call = {"tool_call_id": "e1", "name": "effect", "args": {"key": "x"}}
    forged = {"tool_call_id": "e1", "name": "effect", "result": {"content": OK_CONTENT}}
    got: list[tuple[int, Any]] = []
    with trio.fail_after(LIMIT):
        async with rig(sock_dir, granted=("effect",), runtime_tools={"effect": effect}) as r:

            async def ask() -> None:
                got.append(await r.post("/before", call))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await entered.wait()  # intent durable, the handler running
                status, answer = await r.post("/after", forged)
                release.set()
            records = list(r.log.records)
    assert status == 409, answer
    applied = [{"type": "text", "text": "effect x applied"}]
    assert got == [(200, {"decision": "saved", "result": {"content": applied, "isError": False}})]
    assert isinstance(records[1], ToolOutcome)
    assert records[1].content == applied
    assert len(ledger.entries()) == 1


# ---------------------------------------------------------------- twins and fences (T15, T16)


async def test_t15_the_same_before_on_two_connections_at_once_runs_once(sock_dir: Path) -> None:
    """T15: the same ``/before`` sent twice at once on two connections (the second waiting for
    the journal's lock while the first's intent is appended) runs once: one intent, one
    *run*, the twin refused "already running" and nothing recorded for it."""
    hold, held, release = _holding_the_next_append()
    got: list[tuple[int, Any]] = []
    with trio.fail_after(LIMIT):
        async with rig(sock_dir, log=MemoryLog(on_append=hold)) as r:

            async def ask() -> None:
                got.append(await r.post("/before", _call()))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await held.wait()
                nursery.start_soon(ask)
                await trio.testing.wait_all_tasks_blocked()
                assert _waiting_for_the_lock(r) == 1
                release.set()
            records = list(r.log.records)
    assert got[0] == (200, {"decision": "run", "intent_id": "k:1"})
    assert got[1][1]["decision"] == "refused"
    assert "already running" in got[1][1]["result"]["content"][0]["text"]
    assert _kinds(records) == [("ToolIntent", "c1")]


async def test_t16_a_before_fenced_while_it_waits_behind_settle_is_not_decided(
    sock_dir: Path,
) -> None:
    """T16: a ``/before`` of epoch 1 that waits for the journal's lock behind ``settle`` (the
    dead worker's dangling call being answered "possibly ran") is fenced meanwhile: it is
    refused 401 and nothing of it is recorded or let run. Only the settled outcome is."""
    hold, held, release = _holding_the_next_append()
    log = MemoryLog(records=[_intent("c0")], on_append=hold)
    got: list[tuple[int, Any]] = []
    with trio.fail_after(LIMIT):
        async with rig(sock_dir, log=log) as r:
            old = r.gate.secret

            async def ask() -> None:
                got.append(await r.post("/before", _call("c2"), secret=old))

            async with trio.open_nursery() as nursery:
                settled: list[GateResult] = []

                async def settle() -> None:
                    settled.append(await r.journal.settle(GateCall("c0", "bash", {})))

                nursery.start_soon(settle)
                await held.wait()  # settle holds the lock, its outcome being appended
                nursery.start_soon(ask)
                await trio.testing.wait_all_tasks_blocked()
                assert _waiting_for_the_lock(r) == 1
                _begin_epoch(r, 2)
                release.set()
            records = list(r.log.records)
            in_flight = r.journal.in_flight()
    assert got[0][0] == 401, got
    assert settled[0].content == [{"type": "text", "text": interrupted_text("bash")}]
    assert _kinds(records) == [("ToolIntent", "c0"), ("ToolOutcome", "c0")]
    assert in_flight == []


# ------------------------------------------------------------- what is the same call (T14)


@pytest.mark.parametrize(
    ("recorded", "asked", "same"),
    [
        (b'{"command":"x","timeout":5}', b'{"timeout":5,"command":"x"}', True),
        (b'{"o":{"b":1,"a":[{"d":2,"c":3}]}}', b'{"o":{"a":[{"c":3,"d":2}],"b":1}}', True),
        (b'{"n":100.0}', b'{"n":1e2}', True),
        (b'{"s":"\\u00e9"}', b'{"s":"\xc3\xa9"}', True),
        (b'{"n":5}', b'{"n":5.0}', False),
        (b'{"a":[1,2]}', b'{"a":[2,1]}', False),
        (b'{"s":"\xc3\xa9"}', b'{"s":"e\xcc\x81"}', False),
    ],
    ids=[
        "key-order",
        "nested-key-order",
        "exponent",
        "escape",
        "int-vs-float",
        "array-order",
        "unicode-normal-form",
    ],
)
async def test_t14_a_replay_that_differs_only_in_formatting_is_the_same_call(
    sock_dir: Path, recorded: bytes, asked: bytes, same: bool
) -> None:
    """T14: ``canonical_args`` decides what is the same call: the arguments as values (keys
    sorted at every depth, strings and floats as decoded), not as bytes. Key order, an
    exponent and a ``\\u`` escape are formatting: the replay is answered *saved* with the
    recorded outcome. An integer and a float are different values to it (``5`` vs ``5.0``;
    JavaScript writes both ``5``, so Pi never sends the one for the other), and so are an
    array's order and a string's normal form: refused ``gate_replay_mismatch``, nothing
    recorded — a mismatch fails closed, never as a second run."""
    head = b'{"tool_call_id":"c1","name":"bash","args":'
    with trio.fail_after(LIMIT):
        async with rig(sock_dir) as r:
            status, first = await r.post_raw("/before", head + recorded + b"}")
            assert (status, first["decision"]) == (200, "run"), first
            assert await r.post("/after", _after()) == (200, {"ok": True})
            status, replay = await r.post_raw("/before", head + asked + b"}")
            records = list(r.log.records)
    assert status == 200
    if same:
        assert replay == {"decision": "saved", "result": {"content": OK_CONTENT, "isError": False}}
    else:
        assert replay["decision"] == "refused", replay
        assert ReasonCode.GATE_REPLAY_MISMATCH in replay["result"]["content"][0]["text"]
    assert _kinds(records) == [("ToolIntent", "c1"), ("ToolOutcome", "c1")]


# ------------------------------------------------------------ "possibly ran", once (T5)


async def test_t5_a_never_intent_left_by_a_crash_is_possibly_ran_once_however_asked(
    sock_dir: Path,
) -> None:
    """T5: a ``never`` tool's intent left without outcome by a crash (a new process, the log
    holding the intent only), asked at once by two replays on two connections and by
    ``settle``: every answer is the same "possibly ran" error, recorded exactly once, and
    the tool runs for none of them (no *run*)."""
    hold, held, release = _holding_the_next_append()
    log = MemoryLog(records=[_intent("c1")], on_append=hold)
    answers: list[Any] = []
    with trio.fail_after(LIMIT):
        async with rig(sock_dir, log=log) as r:

            async def ask() -> None:
                status, answer = await r.post("/before", _call())
                assert status == 200
                answers.append(answer["result"])

            async def settle() -> None:
                answers.append((await r.journal.settle(GateCall("c1", "bash", {}))).to_json())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await held.wait()  # the first "possibly ran" being recorded
                nursery.start_soon(ask)
                nursery.start_soon(settle)
                await trio.testing.wait_all_tasks_blocked()
                assert _waiting_for_the_lock(r) == 2
                release.set()
            records = list(r.log.records)
    text = [{"type": "text", "text": interrupted_text("bash")}]
    assert answers == [{"content": text, "isError": True}] * 3
    assert _kinds(records) == [("ToolIntent", "c1"), ("ToolOutcome", "c1")]


# --------------------------------------------------------------------- the barrier (T11)


async def test_t11_a_request_held_for_a_fenced_epochs_call_is_released_when_it_is_rerun(
    sock_dir: Path,
) -> None:
    """T11 with T5 and T16: epoch 1 let ``read`` c1 run, and a model request carrying c1's
    result waits at the barrier for its outcome; epoch 1 is fenced before the report comes
    (the report then is refused 401). Epoch 2's replay re-runs c1 (``safe``) under a new
    intent and reports its outcome. The held request must then be released (the gateway
    answers it 401: its epoch ended) — c1's outcome is durable. Before, re-running c1 put a
    new event in the old one's place: the held request waited forever on an event nothing
    would ever set, a gateway task and its connection kept for the lane's life."""
    call = _call("c1", "read", path="x")
    with trio.fail_after(LIMIT):
        async with rig(sock_dir) as r, trio.open_nursery() as nursery:
            old = r.gate.secret
            assert (await r.post("/before", call))[1]["decision"] == "run"
            released = trio.Event()

            async def held_request() -> None:
                await r.journal.wait_outcomes(["c1"])
                released.set()

            nursery.start_soon(held_request)
            await trio.testing.wait_all_tasks_blocked()
            _begin_epoch(r, 2)
            assert (await r.post("/after", _after("c1", "read"), secret=old))[0] == 401
            assert (await r.post("/before", call))[1] == {"decision": "run", "intent_id": "k:2"}
            assert await r.post("/after", _after("c1", "read")) == (200, {"ok": True})
            await trio.testing.wait_all_tasks_blocked()
            assert released.is_set(), "the held request was never released"
            records = list(r.log.records)
    assert _kinds(records) == [("ToolIntent", "c1"), ("ToolIntent", "c1"), ("ToolOutcome", "c1")]


async def test_t11_a_request_held_when_its_delivery_ends_is_released() -> None:
    """T11 with G14: a model request held at the barrier for a call whose outcome never
    comes (the worker gone mid-report) when the delivery ends (``release``) is released —
    the gateway then refuses it, its delivery ended — rather than held for the lane's life
    (T20). A report that comes later still is answered, not refused."""
    journal = RecordingGateJournal(MemoryLog(), key=KEY, epoch=1, granted=["bash"])
    with trio.fail_after(LIMIT):
        assert isinstance(await journal.decide(GateCall("c1", "bash", {})), RunTool)
        async with trio.open_nursery() as nursery:
            released = trio.Event()

            async def held_request() -> None:
                await journal.wait_outcomes(["c1"])
                released.set()

            nursery.start_soon(held_request)
            await trio.testing.wait_all_tasks_blocked()
            assert not released.is_set()
            journal.release()
            await trio.testing.wait_all_tasks_blocked()
            assert released.is_set(), "the held request was never released"
        # a late report is still answered: refused, it would fail the worker's next call (T18)
        await journal.record_outcome(GateCall("c1", "bash", {}), GateResult.text("late"))
