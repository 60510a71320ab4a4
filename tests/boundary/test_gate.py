"""The tool gate (``runtime/_boundary/_gate.py``, ``runtime/_boundary/pi_extension/gate.ts``,
Fake-Pi's ``fake_pi/_gate_client.py``); test names cite ``docs/design/gate.md`` (T1…).

The server's decisions run against the real Unix socket with an in-memory log (and once on a
real store); the end-to-end tests launch the real Pi (with the extension) and Fake-Pi as
subprocesses, driven over RPC by a scripted model. Every wait is bounded by ``trio.fail_after``
and driven by events, never by sleeping; every process is stopped by ``open_worker``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import trio.testing
from msgspec.structs import replace

from fake_pi._gate_client import post_json
from fake_pi.model_server import ScriptedModel
from fake_pi.model_server import serve_model as serve_model_http
from fake_pi.scenario import Call, Scenario, Step, Text, ToolCalls
from runtime._boundary._calls import GateCall, GateResult, RunTool, Saved
from runtime._boundary._gate import (
    EXTENSION_PATH,
    GATE_SECRET_ENV,
    GATE_SOCKET_ENV,
    Gate,
    GateServer,
    MemoryLog,
    RecordingGateJournal,
    canonical_args,
    gate_environment,
    replay_class_of,
    serve_gate,
)
from runtime._boundary._http import HttpServer, Request, ResponseWriter
from runtime._boundary._receipts import open_receipt_store
from runtime._boundary._tools import DocumentTools
from runtime._clock import Clocks
from runtime._errors import JournalError, ReasonCode, WorkerLaunchError
from runtime._journal._store import delivery_key, open_store
from runtime._pi._rpc import open_rpc_channel
from runtime._pi._session_settle import interrupted_text
from runtime._pi._worker import WorkerLaunch, open_worker
from runtime._records import Record, ReplayClass, ToolIntent, ToolOutcome

from .._secrets import files_containing
from .._workers import one_turn, sandbox_launch, tool_messages

LIMIT: Final = 10.0
PROCESS_LIMIT: Final = 90.0
KEY: Final = "k"
SAVED_TEXT: Final = "saved-output-123\nline2\n"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short private directory for sockets (a socket path is limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="gate-", dir="/tmp"))
    path.chmod(0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class Rig:
    gate: Gate
    server: GateServer
    log: MemoryLog
    journal: RecordingGateJournal

    async def post(self, target: str, body: Any, secret: str | None = "") -> tuple[int, Any]:
        given = self.gate.secret if secret == "" else secret
        return await post_json(str(self.server.path), target, body, secret=given)


@contextlib.asynccontextmanager
async def rig(
    sock_dir: Path,
    *,
    existing: Sequence[Record] = (),
    granted: Sequence[str] = ("read", "bash", "edit", "write"),
    log: MemoryLog | None = None,
) -> AsyncIterator[Rig]:
    log = log if log is not None else MemoryLog(records=list(existing))
    journal = RecordingGateJournal(
        log, key=KEY, epoch=1, granted=granted, existing=list(log.records)
    )
    gate = Gate(journal)
    async with trio.open_nursery() as nursery:
        server: GateServer = await nursery.start(serve_gate, gate, sock_dir / "gate.sock")
        yield Rig(gate, server, log, journal)
        nursery.cancel_scope.cancel()


async def test_t1_a_gate_that_ends_leaves_its_successors_socket_alone(sock_dir: Path) -> None:
    """T1: a one-shot slot's next gate may be bound at the same path before the previous one
    has finished ending. The previous gate removes its own socket file when it ends — never
    the one its successor bound there, which would leave the next delivery's every tool
    unable to reach its gate."""
    path = sock_dir / "o.sock"

    def gate() -> Gate:
        return Gate(RecordingGateJournal(MemoryLog(), key=KEY, epoch=1, granted=["bash"]))

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as outer:
            first = trio.CancelScope()

            async def serve_first(task_status: trio.TaskStatus[GateServer]) -> None:
                with first:
                    await serve_gate(gate(), path, task_status=task_status)

            await outer.start(serve_first)
            await outer.start(serve_gate, gate(), path)  # the successor, bound over it
            first.cancel()  # the first one ends now, its successor serving
            await trio.testing.wait_all_tasks_blocked()
            assert path.exists()
            stream = await trio.open_unix_socket(str(path))  # the successor answers
            await stream.aclose()
            outer.cancel_scope.cancel()


def _intent(call_id: str, name: str = "bash", *, seq: int = 1, **kw: Any) -> ToolIntent:
    return ToolIntent(
        intent_id=f"{KEY}:{seq}",
        step=kw.get("step", 0),
        tool_call_id=call_id,
        name=name,
        args=canonical_args(kw.get("args", {})),
        replay_class=replay_class_of(name),
        epoch=0,
    )


def _saved_records(call_id: str = "call_saved") -> list[Record]:
    return [
        _intent(call_id, args={"command": "touch saved-ran"}),
        ToolOutcome(
            intent_id=f"{KEY}:1",
            tool_call_id=call_id,
            content=[{"type": "text", "text": SAVED_TEXT}],
        ),
    ]


# ---------------------------------------------------------------------- the server, unit


async def test_t1_a_gate_ending_as_its_successor_binds_leaves_the_successors_socket(
    sock_dir: Path,
) -> None:
    """T1: the previous gate is told to end and its successor is served at the same path at
    once — the order a one-shot slot's next delivery takes. Whatever the interleaving of the
    one's ending (its listener closed first, then its own file's removal) and the other's bind,
    the successor's socket file stays. Tries to break: the ending gate took its successor's
    file for its own — its inode number freed as the listener closed, and given again to the
    successor's file — and removed it (every tool of the next delivery then unable to reach
    its gate). A hundred rounds: the interleaving differs from one to the next (on the code
    before, about one run in three failed; the real-Pi tests `test_e2e_b10_*`, which serve a
    successor the same way, failed one run in two)."""
    path = sock_dir / "o.sock"

    def gate() -> Gate:
        return Gate(RecordingGateJournal(MemoryLog(), key=KEY, epoch=1, granted=["bash"]))

    async def serve_in(scope: trio.CancelScope, task_status: trio.TaskStatus[GateServer]) -> None:
        with scope:
            await serve_gate(gate(), path, task_status=task_status)

    with trio.fail_after(LIMIT):
        for _ in range(100):
            async with trio.open_nursery() as outer:
                first = trio.CancelScope()
                await outer.start(serve_in, first)
                first.cancel()
                await outer.start(serve_gate, gate(), path)  # the successor, at once
                await trio.testing.wait_all_tasks_blocked()
                assert path.exists()
                stream = await trio.open_unix_socket(str(path))  # the successor answers
                await stream.aclose()
                outer.cancel_scope.cancel()


async def test_t1_only_the_current_secret_is_served(sock_dir: Path) -> None:
    """T1: no secret, a wrong one, or the previous epoch's: 401, and nothing is recorded."""
    body = {"tool_call_id": "c1", "name": "bash", "args": {"command": "true"}}
    with trio.fail_after(LIMIT):
        async with rig(sock_dir) as r:
            old = r.gate.secret
            for secret in (None, "wrong", old + "x"):
                status, answer = await r.post("/before", body, secret=secret)
                assert status == 401
                assert answer["error"]["code"] == ReasonCode.GATE_UNAUTHORIZED
            r.gate.rotate_secret()
            assert (await r.post("/before", body, secret=old))[0] == 401
            assert r.log.records == []
            assert r.gate.refused_unauthorized == 4
            status, answer = await r.post("/before", body)
            assert (status, answer["decision"]) == (200, "run")


async def test_t1_socket_is_private_and_removed(sock_dir: Path) -> None:
    with trio.fail_after(LIMIT):
        async with rig(sock_dir) as r:
            mode = r.server.path.stat().st_mode
            assert stat.S_ISSOCK(mode)
            assert stat.S_IMODE(mode) == 0o600
    assert not (sock_dir / "gate.sock").exists()


async def test_t2_t3_t4_decisions_over_the_socket(sock_dir: Path) -> None:
    """run (intent durable first, id ``<key>:<seq>``), after → outcome (with Pi's details,
    A6); the same call id in the same round → saved, verbatim; a tool not granted → refused,
    nothing recorded."""
    call = {"tool_call_id": "c1", "name": "bash", "args": {"command": "echo hi", "timeout": 3}}
    with trio.fail_after(LIMIT):
        async with rig(sock_dir, granted=("read", "bash")) as r:
            status, answer = await r.post("/before", call)
            assert (status, answer) == (200, {"decision": "run", "intent_id": "k:1"})
            assert r.log.records == [
                ToolIntent(
                    intent_id="k:1",
                    step=0,
                    tool_call_id="c1",
                    name="bash",
                    args='{"command":"echo hi","timeout":3}',
                    replay_class=ReplayClass.NEVER,
                    epoch=1,
                )
            ]
            content: list[dict[str, Any]] = [{"type": "text", "text": "hi\n"}]
            result = {"content": content, "details": {"x": 1}}
            after = {"tool_call_id": "c1", "name": "bash", "result": result}
            assert await r.post("/after", after) == (200, {"ok": True})
            assert r.log.records[1] == ToolOutcome(
                intent_id="k:1",
                tool_call_id="c1",
                content=content,
                is_error=False,
                details={"x": 1},
            )
            # the same call again within the round: the recorded result, no new intent, its
            # details too (A6: handed back verbatim)
            status, answer = await r.post("/before", call)
            assert (status, answer) == (
                200,
                {
                    "decision": "saved",
                    "result": {"content": content, "isError": False, "details": {"x": 1}},
                },
            )
            assert len(r.log.records) == 2
            # not granted
            write = {"tool_call_id": "c2", "name": "write", "args": {"path": "x", "content": ""}}
            status, answer = await r.post("/before", write)
            assert status == 200
            assert answer["decision"] == "refused"
            assert answer["result"]["isError"] is True
            assert "not granted" in answer["result"]["content"][0]["text"]
            assert len(r.log.records) == 2
            # malformed, unknown target, an outcome nobody let run
            assert (await r.post("/before", {"name": "bash"}))[0] == 400
            assert (await r.post("/before", [1, 2]))[0] == 400
            assert (await r.post("/nope", call))[0] == 404
            assert (await r.post("/after", {**after, "tool_call_id": "zz"}))[0] == 409
            assert (await r.post("/after", {**after, "result": {"content": "x"}}))[0] == 400


def test_t5_replay_classes() -> None:
    assert replay_class_of("read") is ReplayClass.SAFE
    for name in ("bash", "write", "edit", "mcp_whatever"):
        assert replay_class_of(name) is ReplayClass.NEVER
    assert replay_class_of("read", recorded=ReplayClass.NEVER) is ReplayClass.NEVER
    assert replay_class_of("x", {"x": ReplayClass.SAFE}, ReplayClass.SAFE) is ReplayClass.SAFE
    assert replay_class_of("x", {"x": ReplayClass.RECEIPT}) is ReplayClass.NEVER


async def test_t5_intent_without_outcome(sock_dir: Path) -> None:
    """A ``never`` tool whose intent has no outcome is not run again: the model gets the
    "possibly ran" result (recorded, so the next replay says the same); a ``safe`` one
    runs again under a new intent."""
    existing: list[Record] = [
        _intent("c_bash"),
        _intent("c_read", "read", seq=2, args={"path": "a"}),  # the call asked again (T14)
    ]
    with trio.fail_after(LIMIT):
        async with rig(sock_dir, existing=existing) as r:
            status, answer = await r.post(
                "/before", {"tool_call_id": "c_bash", "name": "bash", "args": {}}
            )
            assert status == 200
            assert answer == {
                "decision": "saved",
                "result": {
                    "content": [{"type": "text", "text": interrupted_text("bash")}],
                    "isError": True,
                },
            }
            assert r.log.records[2:] == [
                ToolOutcome(
                    intent_id="k:1",
                    tool_call_id="c_bash",
                    content=answer["result"]["content"],
                    is_error=True,
                )
            ]
            status, answer = await r.post(
                "/before", {"tool_call_id": "c_read", "name": "read", "args": {"path": "a"}}
            )
            assert answer == {"decision": "run", "intent_id": "k:4"}


async def test_t10_a_runtime_tool_runs_in_the_runtime_once() -> None:
    """T10: a granted runtime tool is run by the gate itself between its durable intent and
    its durable outcome, and answered *saved*; asked again in the round, the recorded result
    comes back and the handler is not called; a handler that fails settles the call as an
    error result; an intent left without outcome (a crash inside the handler) is answered
    "possibly ran", never run again."""
    calls: list[tuple[str, str]] = []

    async def update(call: GateCall, intent_id: str) -> GateResult:
        await trio.lowlevel.checkpoint()
        calls.append((call.tool_call_id, intent_id))
        if call.args.get("text") == "boom":
            raise RuntimeError("chat is down")
        return GateResult.text("sent")

    crashed = _intent("c_crash", "send_text_update")
    log = MemoryLog(records=[crashed])
    journal = RecordingGateJournal(
        log,
        key=KEY,
        epoch=1,
        granted=["send_text_update"],
        existing=[crashed],
        runtime_tools={"send_text_update": update},
    )
    ok = GateCall("c1", "send_text_update", {"text": "hi"})
    with trio.fail_after(LIMIT):
        assert await journal.decide(ok) == Saved(GateResult.text("sent"))
        assert await journal.decide(ok) == Saved(GateResult.text("sent"))
        failed = await journal.decide(GateCall("c2", "send_text_update", {"text": "boom"}))
        assert failed == Saved(
            GateResult.text(
                "tool send_text_update failed (gate_tool_failed): chat is down", is_error=True
            )
        )
        interrupted = await journal.decide(GateCall("c_crash", "send_text_update", {}))
    assert interrupted == Saved(
        GateResult.text(interrupted_text("send_text_update"), is_error=True)
    )
    assert calls == [("c1", "k:2"), ("c2", "k:4")]
    assert [type(r) for r in log.records] == [
        ToolIntent,
        ToolIntent,
        ToolOutcome,
        ToolIntent,
        ToolOutcome,
        ToolOutcome,
    ]


async def test_t11_wait_outcomes_returns_once_the_outcome_is_durable() -> None:
    """T11: ``wait_outcomes`` holds while a call let run has no durable outcome; calls never
    let run (or already settled) do not hold."""
    journal = RecordingGateJournal(MemoryLog(), key=KEY, epoch=1, granted=["bash"])
    call = GateCall("c1", "bash", {"command": "true"})
    with trio.fail_after(LIMIT):
        assert isinstance(await journal.decide(call), RunTool)
        await journal.wait_outcomes(["other"])
        released: list[bool] = []
        async with trio.open_nursery() as nursery:

            async def waiter() -> None:
                await journal.wait_outcomes(["c1", "other"])
                released.append(True)

            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert released == []
            await journal.record_outcome(call, GateResult.text("ok"))
        assert released == [True]
        await journal.wait_outcomes(["c1"])


async def test_t15_a_call_asked_again_while_it_runs_is_refused_not_settled(
    sock_dir: Path,
) -> None:
    """T15: the same call asked again while it runs (its intent answered *run* in this epoch,
    its outcome not yet reported) is refused and does not run — it is not settled "possibly
    ran" under the running intent (T5), which refused the real outcome (409) and made every
    later answer "possibly ran" for a call whose result the worker had reported."""
    call = {"tool_call_id": "c1", "name": "bash", "args": {"command": "echo hi"}}
    content: list[dict[str, Any]] = [{"type": "text", "text": "hi\n"}]
    after = {"tool_call_id": "c1", "name": "bash", "result": {"content": content}}
    with trio.fail_after(LIMIT):
        async with rig(sock_dir) as r:
            assert await r.post("/before", call) == (200, {"decision": "run", "intent_id": "k:1"})
            status, again = await r.post("/before", call)  # while it runs
            assert (status, again["decision"]) == (200, "refused"), again
            assert again["result"]["isError"] is True
            assert "already running" in again["result"]["content"][0]["text"]
            assert len(r.log.records) == 1  # nothing recorded for it
            assert await r.post("/after", after) == (200, {"ok": True})
            status, replayed = await r.post("/before", call)
    assert replayed == {"decision": "saved", "result": {"content": content, "isError": False}}


# ------------------------------------------- T16: nothing is decided for a fenced epoch


def _begin_epoch(r: Rig, epoch: int) -> None:
    """A new epoch, as ``Boundaries.begin_epoch`` makes it: the journal records ``epoch`` from
    now on and the gate's secret rotates (the previous one stops working at once)."""
    r.journal.epoch = epoch
    r.gate.rotate_secret()


def _holding_the_next_append() -> tuple[
    Callable[[Record], Awaitable[None]], trio.Event, trio.Event
]:
    """A ``MemoryLog.on_append`` that holds the next append (the journal's lock held) until
    ``release`` is set; ``held`` is set once it waits. Later appends pass."""
    held, release = trio.Event(), trio.Event()

    async def hold(record: Record) -> None:
        if not held.is_set():
            held.set()
            await release.wait()

    return hold, held, release


def _calls(records: Sequence[Record]) -> list[tuple[type, str, int | None]]:
    """Each record as (type, tool-call id, the intent's epoch or ``None``)."""
    return [
        (
            type(r),
            r.tool_call_id if isinstance(r, ToolIntent | ToolOutcome) else "",
            r.epoch if isinstance(r, ToolIntent) else None,
        )
        for r in records
    ]


def _waiting_for_the_lock(r: Rig) -> int:
    return r.journal._lock.statistics().tasks_waiting


@pytest.mark.parametrize("waiting_id", ["c1", "c2"], ids=["its-twin", "another-call"])
async def test_t16_a_fenced_epochs_call_waiting_for_the_lock_is_not_decided(
    sock_dir: Path, waiting_id: str
) -> None:
    """T16: epoch 1 asks c1 (its intent being appended, the journal's lock held) and then
    asks again — the same call (its twin) or another one — which, authorized with epoch 1's
    secret, waits for the lock. Epoch 1 is fenced and epoch 2 begins. The waiting call must
    then be refused 401 ``gate_unauthorized``: nothing recorded, nothing let run. Before, it
    was decided once it got the lock — an intent recorded under epoch 2's number and answered
    *run* to a fenced worker, its outcome awaited (T11) from a worker that would never report
    it, and epoch 2's replay of the call refused as "already running" (T15)."""
    hold, held, release = _holding_the_next_append()
    answers: dict[str, tuple[int, Any]] = {}
    with trio.fail_after(LIMIT):
        async with rig(sock_dir, log=MemoryLog(on_append=hold)) as r:
            old = r.gate.secret

            async def ask(name: str, call_id: str) -> None:
                body = {"tool_call_id": call_id, "name": "bash", "args": {"command": "true"}}
                answers[name] = await r.post("/before", body, secret=old)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, "first", "c1")
                await held.wait()  # c1's intent is being appended: the lock is held
                nursery.start_soon(ask, "waiting", waiting_id)
                await trio.testing.wait_all_tasks_blocked()
                assert _waiting_for_the_lock(r) == 1  # authorized, waiting for the lock
                _begin_epoch(r, 2)
                release.set()
            records = list(r.log.records)
            in_flight = [(i.tool_call_id, i.epoch) for i in r.journal.in_flight()]
            refused = r.gate.refused_unauthorized
    assert answers["first"] == (200, {"decision": "run", "intent_id": "k:1"})  # before the fence
    status, answer = answers["waiting"]
    assert status == 401, answer
    assert answer["error"]["code"] == ReasonCode.GATE_UNAUTHORIZED
    assert refused == 1
    assert _calls(records) == [(ToolIntent, "c1", 1)]  # nothing of the waiting call
    assert in_flight == [("c1", 1)]


async def test_t16_a_decision_under_way_at_the_fence_stays_its_epochs(sock_dir: Path) -> None:
    """T16 with T15 and T5: epoch 1's c1 is being decided (its intent being appended) when
    epoch 1 is fenced. The decision goes on to its end — answered *run*, its intent epoch 1's —
    and it was let run in epoch 1, not epoch 2. So epoch 2, asking c1 again (the replay of the
    round), gets "possibly ran" recorded as c1's outcome (T5) and nothing is left awaiting an
    outcome. Before, the intent counted as let run in epoch 2 (the epoch read after the
    append): the replay was refused "already running" (T15), and the outcome it waited for
    (T11) could only come from the fenced worker."""
    hold, held, release = _holding_the_next_append()
    body = {"tool_call_id": "c1", "name": "bash", "args": {"command": "true"}}
    answers: list[tuple[int, Any]] = []
    with trio.fail_after(LIMIT):
        async with rig(sock_dir, log=MemoryLog(on_append=hold)) as r:
            old = r.gate.secret

            async def ask() -> None:
                answers.append(await r.post("/before", body, secret=old))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await held.wait()
                _begin_epoch(r, 2)
                release.set()
            status, replayed = await r.post("/before", body)  # epoch 2, the same round
            assert answers == [(200, {"decision": "run", "intent_id": "k:1"})]
            assert (status, replayed["decision"]) == (200, "saved"), replayed
            text = interrupted_text("bash")
            assert replayed["result"]["content"] == [{"type": "text", "text": text}]
            assert r.journal.in_flight() == []
            await r.journal.wait_outcomes(["c1"])  # T11: nothing left to wait for
            records = list(r.log.records)
    assert _calls(records) == [(ToolIntent, "c1", 1), (ToolOutcome, "c1", None)]


async def test_t16_an_outcome_reported_before_the_fence_is_recorded_after_it(
    sock_dir: Path,
) -> None:
    """T16: the fence stops a dead epoch's *decisions*, not the truth about a call it ran.
    Epoch 1 reports c1's outcome while the journal's lock is held (c2 being decided); epoch 1
    is fenced, and epoch 2 asks c1 again, waiting behind the report. The report, authorized
    before the fence, is recorded as c1's outcome — the call ran, and that is its result —
    and epoch 2 gets it *saved*, not "possibly ran". A report that arrives after the fence
    (c2's, with epoch 1's secret) is refused 401 like any other request: c2 stays without
    outcome, "possibly ran" for every later ask."""
    content: list[dict[str, Any]] = [{"type": "text", "text": "ran\n"}]
    c1 = {"tool_call_id": "c1", "name": "bash", "args": {"command": "true"}}
    c2 = {"tool_call_id": "c2", "name": "bash", "args": {"command": "false"}}
    after_c1 = {"tool_call_id": "c1", "name": "bash", "result": {"content": content}}
    after_c2 = {**after_c1, "tool_call_id": "c2"}
    got: dict[str, tuple[int, Any]] = {}
    with trio.fail_after(LIMIT):
        async with rig(sock_dir) as r:
            old = r.gate.secret
            assert await r.post("/before", c1) == (200, {"decision": "run", "intent_id": "k:1"})
            r.log.on_append, held, release = _holding_the_next_append()

            async def post(name: str, target: str, body: Any, secret: str) -> None:
                got[name] = await r.post(target, body, secret=secret)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, "c2", "/before", c2, old)
                await held.wait()  # c2's intent is being appended: the lock is held
                nursery.start_soon(post, "after c1", "/after", after_c1, old)
                await trio.testing.wait_all_tasks_blocked()
                assert _waiting_for_the_lock(r) == 1
                _begin_epoch(r, 2)
                nursery.start_soon(post, "c1 again", "/before", c1, r.gate.secret)
                await trio.testing.wait_all_tasks_blocked()
                assert _waiting_for_the_lock(r) == 2  # behind the report
                release.set()
            late = await r.post("/after", after_c2, secret=old)
            records = list(r.log.records)
    assert got["c2"] == (200, {"decision": "run", "intent_id": "k:2"})  # before the fence
    assert got["after c1"] == (200, {"ok": True})
    assert got["c1 again"] == (
        200,
        {"decision": "saved", "result": {"content": content, "isError": False}},
    )
    assert late[0] == 401
    assert _calls(records) == [
        (ToolIntent, "c1", 1),
        (ToolIntent, "c2", 1),
        (ToolOutcome, "c1", None),
    ]


async def test_t1_t16_a_request_whose_body_ends_after_the_fence_is_refused(
    sock_dir: Path,
) -> None:
    """T1, T16: epoch 1's worker sends a ``/before`` head with its secret and part of the
    body; epoch 1 is fenced before the body ends. The secret is checked once the request is
    whole, so the request is refused 401 and nothing is recorded — a head read before the
    fence does not authorize what follows it."""
    body = json.dumps({"tool_call_id": "c1", "name": "bash", "args": {"command": "true"}}).encode()
    with trio.fail_after(LIMIT):
        async with rig(sock_dir) as r:
            head = (
                "POST /before HTTP/1.1\r\nhost: gate\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nauthorization: Bearer {r.gate.secret}\r\n"
                "connection: close\r\n\r\n"
            ).encode()
            stream = await trio.open_unix_socket(str(r.server.path))
            async with stream:
                await stream.send_all(head + body[:7])
                await trio.testing.wait_all_tasks_blocked()
                _begin_epoch(r, 2)
                await stream.send_all(body[7:])
                reply = bytearray()
                while chunk := await stream.receive_some(65536):
                    reply += chunk
            records = list(r.log.records)
    assert reply.startswith(b"HTTP/1.1 401 "), bytes(reply)
    assert ReasonCode.GATE_UNAUTHORIZED.encode() in reply
    assert records == []


async def test_t2_journal_failure_answers_503_and_stops_the_gate(sock_dir: Path) -> None:
    async def fail(record: Record) -> None:
        raise JournalError(ReasonCode.JOURNAL_POISONED, "disk said no")

    log = MemoryLog(on_append=fail)
    journal = RecordingGateJournal(log, key=KEY, epoch=1, granted=["bash"])
    gate = Gate(journal)
    body = {"tool_call_id": "c1", "name": "bash", "args": {}}
    raised: list[JournalError] = []

    async def run(task_status: trio.TaskStatus[GateServer]) -> None:
        try:
            await serve_gate(gate, sock_dir / "g.sock", task_status=task_status)
        except JournalError as error:
            raised.append(error)

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            server: GateServer = await nursery.start(run)
            status, answer = await post_json(str(server.path), "/before", body, secret=gate.secret)
            assert status == 503
            assert answer["error"]["code"] == ReasonCode.JOURNAL_POISONED
    assert [e.code for e in raised] == [ReasonCode.JOURNAL_POISONED]
    assert not (sock_dir / "g.sock").exists()


async def test_t2_t3_on_a_delivery_log(tmp_path: Path) -> None:
    """On a real store: intent ids are ``<delivery key>:<seq>`` of the intent itself; after a
    reopen, the recorded outcome is answered for the same call id."""
    key = delivery_key("d1")
    call = GateCall("call_1", "bash", {"command": "ls"})
    async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
        log = await store.create_delivery_log("d1")
        journal = RecordingGateJournal(log, key=key, epoch=1, granted=["bash"])
        decision = await journal.decide(call)
        assert isinstance(decision, RunTool)
        await journal.record_outcome(call, GateResult.text("a\nb\n"))
        await store.close_log(log)
    async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
        log = await store.open_delivery_log("d1")
        records = log.contents.records
        seq = int(decision.intent_id.rsplit(":", 1)[1])
        assert decision.intent_id == f"{key}:{seq}"
        intent = records[seq]
        assert isinstance(intent, ToolIntent)
        assert intent.intent_id == decision.intent_id
        reopened = RecordingGateJournal(log, key=key, epoch=2, granted=["bash"], existing=records)
        assert await reopened.decide(call) == Saved(GateResult.text("a\nb\n"))
        await store.close_log(log)


# ------------------------------------------------------------------------- end to end


def _launch(
    kind: str,
    root: Path,
    model_server: HttpServer,
    *,
    gate_env: dict[str, str] | None,
    extension: bool = True,
) -> WorkerLaunch:
    return sandbox_launch(
        kind,
        root,
        base_url=f"{model_server.url}/v1",
        extensions=(EXTENSION_PATH,) if extension and kind == "pi" else (),
        extra_env=gate_env or {},
    )


def _text(content: list[dict[str, Any]]) -> str:
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


@contextlib.asynccontextmanager
async def model_and_gate(
    steps: Sequence[Step] | ScriptedModel,
    sock_dir: Path,
    log: MemoryLog,
    granted: Sequence[str],
) -> AsyncIterator[tuple[ScriptedModel, HttpServer, Rig]]:
    model = (
        steps
        if isinstance(steps, ScriptedModel)
        else ScriptedModel(scenario=Scenario(steps=list(steps)))
    )
    async with trio.open_nursery() as nursery:
        up: HttpServer = await nursery.start(serve_model_http, model)
        async with rig(sock_dir, log=log, granted=granted) as r:
            yield model, up, r
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_e2e_saved_refused_run_and_no_secret_for_tools(
    kind: str, tmp_path: Path, sock_dir: Path
) -> None:
    """T3: a saved result reaches the model exactly and the tool did not run. T4: a refused
    tool's text reaches the model, the tool did not run. T2: a run tool's intent and outcome
    are recorded, the outcome being what the model got. T6: the agent's ``env`` shows the
    socket but not the secret, and no file written holds it. T8: calls run one at a time."""
    steps: list[Step] = [
        ToolCalls(
            calls=[
                Call(name="bash", arguments={"command": "env"}, id="call_env"),
                Call(name="bash", arguments={"command": "touch saved-ran"}, id="call_saved"),
                Call(
                    name="write",
                    arguments={"path": "refused.txt", "content": "x"},
                    id="call_refused",
                ),
            ]
        ),
        Text(text="done"),
    ]
    log = MemoryLog(records=_saved_records())
    with trio.fail_after(PROCESS_LIMIT):
        async with model_and_gate(steps, sock_dir, log, ("read", "bash")) as (model, up, r):
            env = gate_environment(r.server, r.gate)
            events = await one_turn(_launch(kind, tmp_path, up, gate_env=env))
            secret = r.gate.secret
    work = tmp_path / "work"
    assert model.request_count == 2
    tools = tool_messages(model.requests[1].body)
    assert tools["call_saved"] == SAVED_TEXT
    assert not (work / "saved-ran").exists()
    assert "not granted" in tools["call_refused"]
    assert not (work / "refused.txt").exists()
    seen_env = tools["call_env"]
    assert f"{GATE_SOCKET_ENV}={r.server.path}" in seen_env
    assert GATE_SECRET_ENV not in seen_env
    assert secret not in seen_env
    assert files_containing([tmp_path, sock_dir], secret) == []
    # the recorded outcome is what the model got; nothing recorded for saved or refused
    new = log.records[2:]
    assert [type(x) for x in new] == [ToolIntent, ToolOutcome]
    intent, outcome = new
    assert isinstance(intent, ToolIntent)
    assert isinstance(outcome, ToolOutcome)
    assert (intent.tool_call_id, intent.name, intent.intent_id) == ("call_env", "bash", "k:3")
    assert intent.args == '{"command":"env"}'
    assert outcome.intent_id == "k:3"
    assert _text(outcome.content) == seen_env
    # T8: sequential — each call ends before the next starts
    order = [
        (e.type, e.record.get("toolCallId"))
        for e in events
        if e.type in ("tool_execution_start", "tool_execution_end")
    ]
    assert order == [
        (t, c)
        for c in ("call_env", "call_saved", "call_refused")
        for t in ("tool_execution_start", "tool_execution_end")
    ]


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_e2e_t2_intent_durable_before_the_tool_starts(
    kind: str, tmp_path: Path, sock_dir: Path
) -> None:
    """T2: while the intent's append is held, the tool's effect has not happened; it happens
    only after the append returned."""
    entered = trio.Event()
    release = trio.Event()
    effect = tmp_path / "work" / "effect"
    seen_at_return: list[bool] = []

    async def hold(record: Record) -> None:
        if isinstance(record, ToolIntent):
            entered.set()
            await release.wait()
            seen_at_return.append(effect.exists())

    steps: list[Step] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": "touch effect"}, id="c1")]),
        Text(text="done"),
    ]
    log = MemoryLog(on_append=hold)
    with trio.fail_after(PROCESS_LIMIT):
        async with model_and_gate(steps, sock_dir, log, ("bash",)) as (_model, up, r):
            launch = _launch(kind, tmp_path, up, gate_env=gate_environment(r.server, r.gate))
            async with (
                open_worker(launch) as worker,
                open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
            ):
                prompted = await rpc.prompt("go")
                await entered.wait()
                assert not effect.exists()
                release.set()
                settled = await rpc.wait_settled(prompted.settled_before)
                assert settled.record["aborted"] is False
    assert seen_at_return == [False]
    assert effect.exists()
    assert [type(x) for x in log.records] == [ToolIntent, ToolOutcome]


@dataclass
class Counted(ScriptedModel):
    """The scripted model, setting ``second`` as its second request arrives."""

    second: trio.Event = field(default_factory=trio.Event)

    def next_step(self, body: dict[str, Any]) -> Step:
        step = super().next_step(body)
        if self.request_count == 2:
            self.second.set()
        return step


async def test_e2e_t18_pis_result_is_not_held_for_its_outcomes_answer(
    tmp_path: Path, sock_dir: Path
) -> None:
    """T18, T11: with the real Pi, a call's result goes back to Pi as soon as the tool ran;
    the extension reports its outcome (``/after``) without waiting for the answer — the
    gateway's barrier (T11) is what holds a model request carrying a result the journal does
    not hold yet. So while the outcome's append is held, Pi's next model request (carrying the
    result) already reaches the model. The next call's ``/before`` waits for that answer: the
    gate sees each outcome before the next intent, and both calls ran once, in order. (Before,
    every call waited for its ``/after`` round trip before Pi saw its result: a round trip on
    the path of every tool call.)"""
    entered = trio.Event()
    release = trio.Event()

    async def hold(record: Record) -> None:
        if isinstance(record, ToolOutcome) and not entered.is_set():
            entered.set()
            await release.wait()

    steps: list[Step] = [
        ToolCalls(
            calls=[Call(name="bash", arguments={"command": "echo one | tee -a order"}, id="c1")]
        ),
        ToolCalls(
            calls=[Call(name="bash", arguments={"command": "echo two | tee -a order"}, id="c2")]
        ),
        Text(text="done"),
    ]
    model = Counted(scenario=Scenario(steps=steps))
    log = MemoryLog(on_append=hold)
    with trio.fail_after(PROCESS_LIMIT):
        async with model_and_gate(model, sock_dir, log, ("bash",)) as (_model, up, r):
            launch = _launch("pi", tmp_path, up, gate_env=gate_environment(r.server, r.gate))
            async with (
                open_worker(launch) as worker,
                open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
            ):
                prompted = await rpc.prompt("go")
                await entered.wait()
                await model.second.wait()  # the result reached the model; its outcome is held
                held = [type(x) for x in log.records]
                release.set()
                settled = await rpc.wait_settled(prompted.settled_before)
                assert settled.record["aborted"] is False
    assert held == [ToolIntent]
    assert tool_messages(model.requests[1].body)["c1"].strip() == "one"
    assert (tmp_path / "work" / "order").read_text() == "one\ntwo\n"
    records = log.records
    assert [type(x) for x in records] == [ToolIntent, ToolOutcome, ToolIntent, ToolOutcome]
    assert [x.tool_call_id for x in records if isinstance(x, ToolIntent)] == ["c1", "c2"]


async def test_e2e_t7_pi_schemas_and_prompt_unchanged_by_the_extension(
    tmp_path: Path, sock_dir: Path
) -> None:
    """T7: the tools array and the system prompt Pi sends are byte-identical with the
    extension loaded (and the gate configured) and without it."""
    bodies = []
    with trio.fail_after(PROCESS_LIMIT):
        for extension in (False, True):
            async with model_and_gate([Text(text="ok")], sock_dir, MemoryLog(), ["bash"]) as (
                model,
                up,
                r,
            ):
                env = gate_environment(r.server, r.gate) if extension else None
                await one_turn(_launch("pi", tmp_path, up, gate_env=env, extension=extension))
                bodies.append(model.requests[0].body)
    plain, gated = bodies
    assert [t["function"]["name"] for t in plain["tools"]] == ["read", "bash", "edit", "write"]
    assert gated["tools"] == plain["tools"]
    assert gated["messages"][0] == plain["messages"][0]


async def test_e2e_pi_extension_without_gate_config_refuses_to_start(tmp_path: Path) -> None:
    """T9: loaded without the socket and secret, the extension fails Pi's start (exit 1)
    rather than running tools ungated."""
    with trio.fail_after(PROCESS_LIMIT):
        async with trio.open_nursery() as nursery:
            up: HttpServer = await nursery.start(serve_model_http, ScriptedModel())
            launch = _launch("pi", tmp_path, up, gate_env=None)
            with pytest.raises(WorkerLaunchError) as raised:
                await one_turn(launch)
            nursery.cancel_scope.cancel()
    assert raised.value.code is ReasonCode.WORKER_LAUNCH_FAILED
    assert f"{GATE_SOCKET_ENV} and {GATE_SECRET_ENV} must be set" in str(raised.value)


def test_extension_ships_with_the_package() -> None:
    assert EXTENSION_PATH.is_file()
    text = EXTENSION_PATH.read_text()
    specifiers = re.findall(r'from "([^"]+)"', text)
    assert specifiers  # only Pi's own package and node built-ins resolve in an extension
    assert all(s == "@earendil-works/pi-coding-agent" or s.startswith("node:") for s in specifiers)
    assert "registerCommand(" not in text


async def test_t13_a_receipt_intent_without_outcome_runs_the_same_guarded_write(
    tmp_path: Path,
) -> None:
    """T13 (receipts R2): a ``write_document`` intent left without outcome is not "possibly
    ran": the gate runs the same receipt-guarded write under the *original* intent id. The
    call whose write committed before the crash gets its saved result and writes nothing;
    the one that never applied is applied exactly once; both outcomes are recorded."""
    store = await open_receipt_store(tmp_path)
    applied_args = {"document_id": "notes", "content": "before the crash"}
    orphan_args = {"document_id": "other", "content": "never applied"}
    receipt = {"replay_class": ReplayClass.RECEIPT}  # as the gate records its declared class
    applied = replace(_intent("c_applied", "write_document", seq=1, args=applied_args), **receipt)
    orphan = replace(_intent("c_orphan", "write_document", seq=2, args=orphan_args), **receipt)
    log = MemoryLog(records=[applied, orphan])
    journal = RecordingGateJournal(
        log,
        key=KEY,
        epoch=1,
        granted=["write_document"],
        existing=[applied, orphan],
        runtime_tools=DocumentTools(store).handlers(),
    )
    with trio.fail_after(LIMIT):
        committed = await store.write_document("k:1", applied_args)  # the crash came after
        first = await journal.decide(GateCall("c_applied", "write_document", applied_args))
        second = await journal.decide(GateCall("c_orphan", "write_document", orphan_args))
        again = await journal.decide(GateCall("c_orphan", "write_document", orphan_args))
        notes, other = await store.revisions("notes"), await store.revisions("other")
        await store.aclose()
    assert isinstance(first, Saved)
    assert json.loads(first.result.content[0]["text"]) == committed
    assert notes == [committed["revision_id"]]  # nothing written again
    assert isinstance(second, Saved)
    assert json.loads(second.result.content[0]["text"])["revision_id"] == other[0]
    assert len(other) == 1  # applied exactly once
    assert again == second  # now the recorded outcome
    outcomes = [r for r in log.records if isinstance(r, ToolOutcome)]
    assert [(o.intent_id, o.is_error) for o in outcomes] == [("k:1", False), ("k:2", False)]


def test_t13_only_the_registry_keeps_the_receipt_class() -> None:
    assert replay_class_of("write_document", {"write_document": ReplayClass.RECEIPT}) is (
        ReplayClass.RECEIPT
    )
    assert replay_class_of("read_document", {"read_document": ReplayClass.SAFE}) is (
        ReplayClass.SAFE
    )


async def test_t13_a_definite_refusal_settles_as_a_tool_error_with_its_code(
    tmp_path: Path,
) -> None:
    """Receipts R5 through the gate: a stale base or a reused key is the tool's error result
    (its code first), recorded as the call's outcome; the document is unchanged."""
    store = await open_receipt_store(tmp_path)
    journal = RecordingGateJournal(
        MemoryLog(),
        key=KEY,
        epoch=1,
        granted=["write_document"],
        runtime_tools=DocumentTools(store).handlers(),
    )
    with trio.fail_after(LIMIT):
        await store.write_document("other:1", {"document_id": "notes", "content": "first"})
        stale = {"document_id": "notes", "content": "mine", "base_revision_id": "rev-old"}
        answer = await journal.decide(GateCall("c1", "write_document", stale))
        revisions = await store.revisions("notes")
        await store.aclose()
    assert isinstance(answer, Saved)
    assert answer.result.is_error
    assert answer.result.content[0]["text"].startswith("document_stale_base: ")
    assert len(revisions) == 1


# ------------------------------------------------- T14: a replay must ask the recorded call

_BASH_ARGS: Final = {"command": "touch saved-ran"}


@pytest.mark.parametrize(
    ("existing", "asked"),
    [
        pytest.param(
            _saved_records("c1"),
            {"name": "bash", "args": {"command": "rm -rf important"}},
            id="same-name-other-args-with-outcome",
        ),
        pytest.param(
            _saved_records("c1"),
            {"name": "write", "args": {"path": "x", "content": "y"}},
            id="other-name-with-outcome",
        ),
        pytest.param(
            [_intent("c1", args=_BASH_ARGS)],
            {"name": "bash", "args": {"command": "echo other"}},
            id="never-without-outcome-other-args",
        ),
        pytest.param(
            [_intent("c1", "read", args={"path": "a"})],
            {"name": "read", "args": {"path": "/etc/other"}},
            id="safe-without-outcome-other-args",
        ),
        pytest.param(
            [_intent("c1", "read", args={"path": "a"})],
            {"name": "bash", "args": {"path": "a"}},
            id="safe-recorded-other-name",
        ),
    ],
)
async def test_t14_a_replayed_call_that_is_not_the_recorded_one_fails_closed(
    sock_dir: Path, existing: list[Record], asked: dict[str, Any]
) -> None:
    """T14: a call whose round and tool-call id have a recorded intent of another name or
    other arguments is refused with ``gate_replay_mismatch``: it is not handed the recorded
    result, not reported "possibly ran", not run again (a ``safe`` tool neither), and
    nothing is recorded. The recorded call itself is still answered as before."""
    recorded = existing[0]
    assert isinstance(recorded, ToolIntent)
    with trio.fail_after(LIMIT):
        async with rig(sock_dir, existing=existing) as r:
            status, answer = await r.post("/before", {"tool_call_id": "c1", **asked})
            assert status == 200
            assert answer["decision"] == "refused", answer
            assert answer["result"]["isError"] is True
            (text,) = [c["text"] for c in answer["result"]["content"]]
            assert ReasonCode.GATE_REPLAY_MISMATCH in text
            assert f"tool {asked['name']} was refused and did not run" in text
            assert SAVED_TEXT not in text
            assert r.log.records == existing  # nothing recorded, nothing let run
            assert r.journal.in_flight() == []
            assert r.journal.mismatch is not None
            assert r.journal.mismatch.code is ReasonCode.GATE_REPLAY_MISMATCH
            # the recorded call, asked as it was recorded, is answered as it always was
            same = {"tool_call_id": "c1", "name": recorded.name, "args": json.loads(recorded.args)}
            status, answer = await r.post("/before", same)
            assert answer["decision"] in ("saved", "run"), answer
            if answer["decision"] == "saved" and len(existing) > 1:
                assert answer["result"]["content"][0]["text"] == SAVED_TEXT


async def test_t14_with_on_mismatch_the_whole_delivery_is_refused() -> None:
    """T14: a journal whose delivery replays as a whole (room lanes) tells ``on_mismatch``
    once, and refuses every later call — a new one and the recorded one alike — so nothing
    runs in a replay that is no longer the recorded turn."""
    told: list[str] = []
    existing = _saved_records("c1")
    log = MemoryLog(records=list(existing))
    journal = RecordingGateJournal(
        log,
        key=KEY,
        epoch=1,
        granted=["bash", "write"],
        existing=existing,
        on_mismatch=lambda error: told.append(str(error.code)),
    )
    with trio.fail_after(LIMIT):
        first = await journal.decide(GateCall("c1", "write", {"path": "x", "content": ""}))
        fresh = await journal.decide(GateCall("c2", "bash", {"command": "true"}))
        recorded = await journal.decide(GateCall("c1", "bash", _BASH_ARGS))
    for decision in (first, fresh, recorded):
        assert not isinstance(decision, RunTool | Saved)
        assert decision.result.is_error
        assert ReasonCode.GATE_REPLAY_MISMATCH in decision.result.content[0]["text"]
    assert told == [ReasonCode.GATE_REPLAY_MISMATCH]
    assert log.records == existing


async def test_t14_a_dead_workers_call_is_not_settled_with_another_tools_result() -> None:
    """T14 when settling (T12): a dangling call whose id has a recorded intent of another
    tool gets neither that tool's outcome nor a recorded "possibly ran" — an error result
    with ``gate_replay_mismatch`` that says its result is unknown; nothing is recorded. The
    arguments are not compared there: the session holds them as the model sent them, the
    intent as the worker validated (and coerced) them."""
    existing = _saved_records("c1")
    log = MemoryLog(records=list(existing))
    journal = RecordingGateJournal(log, key=KEY, epoch=1, granted=["bash"], existing=existing)
    with trio.fail_after(LIMIT):
        other = await journal.settle(GateCall("c1", "write", {"path": "x", "content": ""}))
        coerced = await journal.settle(GateCall("c1", "bash", {"command": "touch saved-ran "}))
    assert other.is_error
    (text,) = [c["text"] for c in other.content]
    assert ReasonCode.GATE_REPLAY_MISMATCH in text
    assert "result is unknown" in text
    assert SAVED_TEXT not in text
    assert log.records == existing
    outcome = existing[1]
    assert isinstance(outcome, ToolOutcome)
    assert coerced == GateResult(content=outcome.content, is_error=False)


async def test_t12_a_dangling_call_of_an_earlier_round_is_settled_with_its_outcome() -> None:
    """T12 after a power loss: Pi's session is not synced, the journal is. The session lost
    round 0's tool results, while the journal holds the call's intent and outcome in round 0
    and the next model request (round 1). Settling the dangling call must find its outcome in
    round 0 — it ran — not answer "did not run" because round 1 has no such call: the agent
    would run it again without being told."""
    existing = _saved_records("c1")  # round 0: intent and outcome
    log = MemoryLog(records=list(existing))
    journal = RecordingGateJournal(
        log, key=KEY, epoch=2, granted=["bash"], existing=existing, step=lambda: 1
    )
    with trio.fail_after(LIMIT):
        settled = await journal.settle(GateCall("c1", "bash", {"command": "touch saved-ran"}))
        unknown = await journal.settle(GateCall("c9", "bash", {"command": "true"}))
    outcome = existing[1]
    assert isinstance(outcome, ToolOutcome)
    assert settled == GateResult(content=outcome.content, is_error=False)
    assert unknown.is_error  # a call the gate never saw: did not run
    assert log.records == existing


async def test_t14_a_receipt_intent_is_not_applied_with_other_arguments(tmp_path: Path) -> None:
    """T14 with T13: a ``write_document`` intent without outcome, asked again with another
    content, is refused — the guarded write under the original intent id is not applied
    with arguments that were never recorded."""
    store = await open_receipt_store(tmp_path)
    recorded_args = {"document_id": "notes", "content": "recorded"}
    intent = replace(
        _intent("c1", "write_document", args=recorded_args), replay_class=ReplayClass.RECEIPT
    )
    log = MemoryLog(records=[intent])
    journal = RecordingGateJournal(
        log,
        key=KEY,
        epoch=1,
        granted=["write_document"],
        existing=[intent],
        runtime_tools=DocumentTools(store).handlers(),
    )
    with trio.fail_after(LIMIT):
        asked = {"document_id": "notes", "content": "something else"}
        answer = await journal.decide(GateCall("c1", "write_document", asked))
        revisions = await store.revisions("notes")
        await store.aclose()
    assert not isinstance(answer, RunTool | Saved)
    assert ReasonCode.GATE_REPLAY_MISMATCH in answer.result.content[0]["text"]
    assert revisions == []
    assert log.records == [intent]


# -- B10: the extension's own HTTP/1.1 client (runtime/_boundary/pi_extension/gate.ts) -------


@dataclass
class HeldSecond(ScriptedModel):
    """The scripted model, its second request (the first call's result) held until ``go``."""

    go: trio.Event = field(default_factory=trio.Event)

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        if self.request_count == 1:
            await self.go.wait()
        await super().handle(request, response)


TWO_CALLS: Final[list[Step]] = [
    ToolCalls(calls=[Call(name="bash", arguments={"command": "echo one | tee -a order"}, id="c1")]),
    ToolCalls(calls=[Call(name="bash", arguments={"command": "echo two | tee -a order"}, id="c2")]),
    Text(text="done"),
]


def answered_after(gate: Gate) -> trio.Event:
    """Set once the gate has answered the first ``/after`` whole (its bytes handed to the
    kernel): the extension's report of the first call is in, whatever the test does next."""
    done = trio.Event()
    handle = gate.handle

    async def handled(request: Request, response: ResponseWriter) -> None:
        await handle(request, response)
        if request.target == "/after":
            done.set()

    gate.handle = handled  # type: ignore[method-assign]
    return done


async def _two_calls(
    tmp_path: Path,
    sock_dir: Path,
    between: Callable[[Gate, trio.Nursery, trio.CancelScope], Awaitable[None]],
) -> tuple[HeldSecond, MemoryLog]:
    """The real Pi makes two ``bash`` calls through the gate; ``between`` runs once the first
    call's outcome was answered and before the model asks for the second."""
    model = HeldSecond(scenario=Scenario(steps=list(TWO_CALLS)))
    log = MemoryLog()
    gate = Gate(RecordingGateJournal(log, key=KEY, epoch=1, granted=("bash",)))
    reported = answered_after(gate)
    path = sock_dir / "gate.sock"
    with trio.fail_after(PROCESS_LIMIT):
        async with trio.open_nursery() as nursery:
            up: HttpServer = await nursery.start(serve_model_http, model)
            first = trio.CancelScope()

            async def serve_first(task_status: trio.TaskStatus[GateServer]) -> None:
                with first:
                    await serve_gate(gate, path, task_status=task_status)

            server: GateServer = await nursery.start(serve_first)
            launch = _launch("pi", tmp_path, up, gate_env=gate_environment(server, gate))
            async with (
                open_worker(launch) as worker,
                open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
            ):
                prompted = await rpc.prompt("go")
                await reported.wait()
                await between(gate, nursery, first)
                model.go.set()
                settled = await rpc.wait_settled(prompted.settled_before)
                assert settled.record["aborted"] is False
            nursery.cancel_scope.cancel()
    return model, log


async def test_e2e_b10_the_extension_reconnects_once_the_gate_closed_its_connection(
    tmp_path: Path, sock_dir: Path
) -> None:
    """B10, T1: Pi's gate extension speaks HTTP/1.1 itself, on one kept connection. The gate
    closes it between two calls (its server stopped, and the same gate served again on the
    same path): the next call opens a new connection and runs — never a call failed on a
    connection the gate closed while it was idle."""

    async def restart(gate: Gate, nursery: trio.Nursery, first: trio.CancelScope) -> None:
        first.cancel()
        await nursery.start(serve_gate, gate, sock_dir / "gate.sock")

    model, log = await _two_calls(tmp_path, sock_dir, restart)
    assert (tmp_path / "work" / "order").read_text() == "one\ntwo\n"
    assert [type(x) for x in log.records] == [ToolIntent, ToolOutcome, ToolIntent, ToolOutcome]
    assert tool_messages(model.requests[2].body)["c2"].strip() == "two"


async def test_e2e_b10_t1_an_answer_refused_fails_the_call_closed(
    tmp_path: Path, sock_dir: Path
) -> None:
    """B10, T1: the gate's secret rotated between two calls (a fence's): the second call's
    ``/before`` is answered 401 with the connection's close. The extension fails that call
    closed — the tool does not run, Pi hands the model the refusal as an error result — and
    nothing is recorded for it."""

    async def fence(gate: Gate, nursery: trio.Nursery, first: trio.CancelScope) -> None:
        gate.rotate_secret()

    model, log = await _two_calls(tmp_path, sock_dir, fence)
    assert (tmp_path / "work" / "order").read_text() == "one\n"
    assert [type(x) for x in log.records] == [ToolIntent, ToolOutcome]
    assert "tool gate /before: HTTP 401" in tool_messages(model.requests[2].body)["c2"]


async def test_e2e_b10_an_answer_not_framed_by_content_length_fails_the_call_closed(
    tmp_path: Path, sock_dir: Path
) -> None:
    """B10: the extension reads only what the gate's shell sends — one whole answer framed by
    ``Content-Length``. An answer framed otherwise (chunked, here, with ``run`` in it) is no
    answer: the call fails closed, the tool does not run, and the connection is dropped."""

    async def chunked(gate: Gate, nursery: trio.Nursery, first: trio.CancelScope) -> None:
        async def handled(request: Request, response: ResponseWriter) -> None:
            await response.start(200, [("content-type", "application/json")])
            await response.send(b'{"decision":"run"}')
            await response.end()

        gate.handle = handled  # type: ignore[method-assign]
        first.cancel()  # served again with the handler above (new connections take it)
        await nursery.start(serve_gate, gate, sock_dir / "gate.sock")

    model, log = await _two_calls(tmp_path, sock_dir, chunked)
    assert (tmp_path / "work" / "order").read_text() == "one\n"
    assert [type(x) for x in log.records] == [ToolIntent, ToolOutcome]
    assert "Content-Length" in tool_messages(model.requests[2].body)["c2"]


async def test_e2e_b10_a_saved_result_of_megabytes_reaches_the_model_whole(
    tmp_path: Path, sock_dir: Path
) -> None:
    """B10, T3: the extension reads an answer of several megabytes (a saved result the gate
    hands back, many reads' worth of pieces) whole, and Pi hands it to the model as it was
    recorded; the tool does not run. (Its pieces are joined once, not at every piece.)"""
    text = "".join(f"line {i:07d} of a large saved output\n" for i in range(80_000))  # ~3 MB
    records: list[Record] = [
        _intent("call_saved", args={"command": "touch saved-ran"}),
        ToolOutcome(
            intent_id=f"{KEY}:1",
            tool_call_id="call_saved",
            content=[{"type": "text", "text": text}],
        ),
    ]
    steps: list[Step] = [
        ToolCalls(
            calls=[Call(name="bash", arguments={"command": "touch saved-ran"}, id="call_saved")]
        ),
        Text(text="done"),
    ]
    log = MemoryLog(records=records)
    with trio.fail_after(PROCESS_LIMIT):
        async with model_and_gate(steps, sock_dir, log, ("bash",)) as (model, up, r):
            launch = _launch("pi", tmp_path, up, gate_env=gate_environment(r.server, r.gate))
            # a result this large would have Pi compact its context first
            await one_turn(dataclasses.replace(launch, settings={"compaction": {"enabled": False}}))
    assert model.request_count == 2
    assert not (tmp_path / "work" / "saved-ran").exists()
    assert tool_messages(model.requests[1].body)["call_saved"] == text
