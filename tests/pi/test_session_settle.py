"""Dangling tool calls and settling them before a relaunch (runtime._pi._session). Test names
cite invariants S12 and S13 of docs/design/sessions.md.

The unit tests build sessions with ``create_session`` and ``SessionWriter`` appends, in the
shapes real Pi 1.6.0 writes (its samples in tests/data/pi-1.6.0/). The end-to-end tests run
the real Pi and Fake-Pi against a scripted model: a worker is killed mid-tool (or a session is
written by hand), ``prepare_for_relaunch`` settles it, and a relaunched worker sends the
settled text to the model. They are bounded by ``trio.fail_after``, never sleep, and every
process is stopped by ``open_worker``.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi._messages import usage
from fake_pi.model_server import ScriptedModel
from fake_pi.model_server import serve_model as serve_model_http
from fake_pi.scenario import Call, Scenario, Step, Text, ToolCalls
from runtime._boundary._http import HttpServer
from runtime._clock import Clocks, MockWallClock
from runtime._errors import ReasonCode, SessionError
from runtime._pi._pijson import iso_timestamp, loads
from runtime._pi._rpc import open_rpc_channel
from runtime._pi._session import SessionEntry, encode_entry
from runtime._pi._session_files import (
    SessionWriter,
    acreate_session,
    aread_session,
    create_session,
    read_session,
)
from runtime._pi._session_settle import (
    DanglingCall,
    SettledResult,
    aprepare_for_relaunch,
    asettle_dangling,
    dangling_tool_calls,
    interrupted_text,
    possibly_ran_result,
    prepare_for_relaunch,
    settle_dangling,
)
from runtime._pi._worker import ModelRoute, RetrySettings, WorkerLaunch, WorkerProgram, open_worker

from .._pi import real_pi
from .._samples import SESSION_NAMES, facts, session_sample

PROCESS_LIMIT: Final = 90.0
LIMIT: Final = 10.0
T0: Final = 1_795_978_317_155
TORN: Final = b'{"type":"message","id":"0badc0de","parentId":'


@dataclass
class StepClock:
    """A wall clock for sync tests: each reading is one millisecond later."""

    now: int = T0

    def time_ms(self) -> int:
        self.now += 1
        return self.now


# ---------------------------------------------------------------- Pi-shaped messages


def _user(text: str, time_ms: int = T0) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}], "timestamp": time_ms}


def _tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "toolCall", "id": call_id, "name": name, "arguments": arguments}


def _assistant(
    content: list[dict[str, Any]], *, stop: str = "toolUse", time_ms: int = T0
) -> dict[str, Any]:
    """An assistant message in the exact shape Pi writes (``session_killed_midtool``)."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "api": "openai-completions",
        "provider": "fake",
        "model": "fake-model",
        "usage": usage(100, 20),
        "stopReason": stop,
        "timestamp": time_ms,
        "responseId": "chatcmpl-fake-1",
        "rawStopReason": {"toolUse": "tool_calls", "stop": "stop"}.get(stop, stop),
        "durationMs": 49,
        "thinkingLevel": "off",
    }
    if stop in ("aborted", "error"):
        message["errorMessage"] = "Request was aborted"
    return message


def _tool_result(call_id: str, name: str, text: str, time_ms: int = T0) -> dict[str, Any]:
    """A toolResult message in the exact shape Pi writes for an executed tool."""
    return {
        "role": "toolResult",
        "toolCallId": call_id,
        "toolName": name,
        "content": [{"type": "text", "text": text}],
        "isError": False,
        "durationMs": 15,
        "timestamp": time_ms,
    }


def _tear(path: Path) -> None:
    """Leave a torn last line, as a worker killed in the middle of an append would."""
    with path.open("ab") as f:
        f.write(TORN)


def _new(path: Path) -> Path:
    create_session(
        path, cwd="/work/lane", provider="fake", model_id="fake-model", clock=StepClock()
    )
    return path


def _write(path: Path, *entries: dict[str, Any]) -> list[SessionEntry]:
    """Append ``message`` dicts (or whole entries with a ``type``) at the leaf, fsynced."""
    with SessionWriter.open(path, clock=StepClock()) as writer:
        written = [writer.append(e) if "type" in e else writer.append_message(e) for e in entries]
        writer.fsync()
    return written


PARALLEL: Final = [
    _tool_call("call_1", "bash", {"command": "ls"}),
    _tool_call("call_2", "read", {"path": "a.txt"}),
    _tool_call("call_3", "bash", {"command": "rm -rf build"}),
]


def _answers(*call_ids: str) -> dict[str, SettledResult]:
    return {c: SettledResult([{"type": "text", "text": f"settled {c}"}], False) for c in call_ids}


def _ids(calls: Sequence[DanglingCall]) -> list[str]:
    return [c.tool_call_id for c in calls]


# -------------------------------------------------------------------------------- S12


def test_s12_killed_midtool_sample_has_its_call_dangling() -> None:
    """Real Pi's file after SIGKILL mid-tool: the leaf's bash call is dangling. The call is
    the one the recorder scripted, in the entry Pi named as its leaf while the tool ran
    (facts.json); that entry is the file's last line."""
    call = facts().dangling_call
    session = read_session(session_sample("killed_midtool")).require_clean()
    assert session.leaf is not None
    assert session.leaf.id == call.assistant_entry_id
    assert dangling_tool_calls(session) == (
        DanglingCall(
            tool_call_id=call.tool_call_id,
            name=call.name,
            arguments=call.arguments,
            assistant_entry_id=call.assistant_entry_id,
        ),
    )


@pytest.mark.parametrize("name", [n for n in SESSION_NAMES if n != "killed_midtool"])
def test_s12_real_pi_samples_have_nothing_dangling(name: str) -> None:
    session = read_session(session_sample(name)).session
    assert dangling_tool_calls(session) == ()


def test_s12_parallel_calls_one_answered(tmp_path: Path) -> None:
    """Three calls, one result present: the other two, in the assistant's source order."""
    path = _new(tmp_path / "s.jsonl")
    _, assistant, _ = _write(
        path, _user("go"), _assistant(PARALLEL), _tool_result("call_2", "read", "a")
    )
    calls = dangling_tool_calls(read_session(path).session)
    assert calls == (
        DanglingCall("call_1", "bash", {"command": "ls"}, assistant.id),
        DanglingCall("call_3", "bash", {"command": "rm -rf build"}, assistant.id),
    )


def test_s12_a_completed_round_has_nothing_dangling(tmp_path: Path) -> None:
    path = _new(tmp_path / "s.jsonl")
    _write(
        path,
        _user("go"),
        _assistant(PARALLEL),
        *(_tool_result(c["id"], c["name"], "ok") for c in PARALLEL),
    )
    assert dangling_tool_calls(read_session(path).session) == ()  # all answered
    _write(path, _assistant([{"type": "text", "text": "done"}], stop="stop"))
    assert dangling_tool_calls(read_session(path).session) == ()  # the last has no calls


def test_s12_no_messages_nothing_dangling(tmp_path: Path) -> None:
    assert dangling_tool_calls(read_session(_new(tmp_path / "s.jsonl")).session) == ()


@pytest.mark.parametrize("stop", ["aborted", "error"])
def test_s12_aborted_or_failed_assistant_is_not_dangling(tmp_path: Path, stop: str) -> None:
    """Pi leaves such a reply out of the context, calls and all, and closes the calls of the
    replies before it there: nothing to settle, also for an earlier unanswered call."""
    path = _new(tmp_path / "s.jsonl")
    _write(
        path,
        _user("go"),
        _assistant([_tool_call("call_a", "bash", {"command": "ls"})]),
        _assistant([_tool_call("call_b", "bash", {"command": "ls"})], stop=stop),
    )
    assert dangling_tool_calls(read_session(path).session) == ()


@pytest.mark.parametrize(
    "closer",
    [
        _user("continue"),
        {"role": "bashExecution", "command": "ls", "output": "", "exitCode": 0,
         "cancelled": False, "truncated": False, "timestamp": T0},
        {"type": "custom_message", "customType": "note", "content": "hi", "display": True},
    ],
    ids=["user", "bashExecution", "custom_message"],
)  # fmt: skip
def test_s12_a_user_side_message_closes_the_calls(tmp_path: Path, closer: dict[str, Any]) -> None:
    """Once Pi sends something as a user message after the calls, it has answered them
    ("No result provided") before it; a result appended below would answer nothing."""
    path = _new(tmp_path / "s.jsonl")
    _write(path, _user("go"), _assistant(PARALLEL), closer)
    assert dangling_tool_calls(read_session(path).session) == ()


def test_s12_transparent_entries_keep_the_calls_dangling(tmp_path: Path) -> None:
    """``custom`` entries, a bash execution kept out of the context and system messages do
    not reach the model as user messages: the calls stay dangling."""
    path = _new(tmp_path / "s.jsonl")
    _, assistant, *_ = _write(
        path,
        _user("go"),
        _assistant(PARALLEL[:1]),
        {"type": "custom", "customType": "runtime", "data": {"k": 1}},
        {"role": "bashExecution", "command": "ls", "output": "", "exitCode": 0,
         "cancelled": False, "truncated": False, "timestamp": T0, "excludeFromContext": True},
        {"type": "session_info", "name": "lane"},
        {"role": "system", "content": "", "sections": {"preamble": "p"}, "timestamp": T0},
    )  # fmt: skip
    calls = dangling_tool_calls(read_session(path).session)
    assert calls == (DanglingCall("call_1", "bash", {"command": "ls"}, assistant.id),)


def test_s12_only_the_current_path_counts(tmp_path: Path) -> None:
    """Calls on a branch the leaf left are not in the context; the path's own are."""
    path = _new(tmp_path / "s.jsonl")
    user, _ = _write(path, _user("go"), _assistant(PARALLEL[:1]))
    with SessionWriter.open(path, clock=StepClock()) as writer:
        branch = writer.append({"type": "custom", "customType": "x", "data": {}}, parent_id=user.id)
    session = read_session(path).session
    assert session.leaf == branch
    assert dangling_tool_calls(session) == ()


def test_s12_context_edit_applies_as_in_pi(tmp_path: Path) -> None:
    """A hidden reply is not in the context (the one before it, without calls, is the
    last); a replaced one has the replacement's content instead of its calls."""
    path = _new(tmp_path / "s.jsonl")
    *_, dangling = _write(
        path,
        _user("go"),
        _assistant([{"type": "text", "text": "before"}], stop="stop"),
        _assistant(PARALLEL[:1]),
    )
    session = read_session(path).session
    assert _ids(dangling_tool_calls(session)) == ["call_1"]
    hide = {"type": "context_edit", "targetId": dangling.id, "replacement": None}
    _write(path, hide)
    assert dangling_tool_calls(read_session(path).session) == ()
    replace = {"type": "context_edit", "targetId": dangling.id, "replacement": {"content": "x"}}
    _write(path, replace)  # the newest edit wins: the calls are replaced by text
    assert dangling_tool_calls(read_session(path).session) == ()


def test_s12_compaction_keeps_the_kept_calls_in_context(tmp_path: Path) -> None:
    """Pi puts the compaction summary first and keeps the entries from ``firstKeptEntryId``:
    the summary entry after the calls does not close them."""
    path = _new(tmp_path / "s.jsonl")
    user, assistant = _write(path, _user("go"), _assistant(PARALLEL[:1]))
    _write(
        path,
        {"type": "compaction", "summary": "s", "firstKeptEntryId": user.id, "tokensBefore": 9},
    )
    calls = dangling_tool_calls(read_session(path).session)
    assert calls == (DanglingCall("call_1", "bash", {"command": "ls"}, assistant.id),)


# -------------------------------------------------------------------------------- S13


def test_s13_settle_appends_one_result_per_call_in_order(tmp_path: Path) -> None:
    path = _new(tmp_path / "s.jsonl")
    _, assistant, result = _write(
        path, _user("go"), _assistant(PARALLEL), _tool_result("call_2", "read", "a")
    )
    entries = settle_dangling(path, _answers("call_1", "call_3"), clock=StepClock())
    assert [e.raw["message"]["toolCallId"] for e in entries] == ["call_1", "call_3"]
    assert [e.parent_id for e in entries] == [result.id, entries[0].id]
    reread = read_session(path)
    assert reread.issues == ()
    assert reread.session.entries[-2:] == entries
    assert reread.session.to_bytes() == path.read_bytes()
    assert dangling_tool_calls(reread.session) == ()
    first = entries[0].raw["message"]
    assert first["toolName"] == "bash"
    assert first["content"] == [{"type": "text", "text": "settled call_1"}]
    assert first["isError"] is False
    assert assistant.id in reread.session.by_id


def test_s13_settled_lines_have_pi_key_order(tmp_path: Path) -> None:
    """Entry keys as Pi writes them; message keys in the order of Pi's own toolResult lines
    (``session_abort.jsonl``), without the ``details`` and ``durationMs`` Pi sets for an
    executed tool; ``timestamp`` is epoch ms from the same clock reading as the entry's."""
    pi_line = next(
        line
        for line in session_sample("abort").read_bytes().splitlines()
        if b'"role":"toolResult"' in line
    )
    pi_keys = list(loads(pi_line)["message"])
    path = _new(tmp_path / "s.jsonl")
    _write(path, _user("go"), _assistant(PARALLEL[:1]))
    (entry,) = settle_dangling(
        path, lambda call: possibly_ran_result(call.name), clock=StepClock(now=T0 + 1000)
    )
    assert list(entry.raw) == ["type", "id", "parentId", "timestamp", "message"]
    message = entry.raw["message"]
    assert list(message) == [k for k in pi_keys if k not in ("details", "durationMs")]
    assert message["timestamp"] == T0 + 1001
    assert entry.timestamp == iso_timestamp(T0 + 1001)
    assert entry.raw_line == encode_entry(entry.raw)
    assert message["content"] == [{"type": "text", "text": interrupted_text("bash")}]
    assert message["isError"] is True


def test_s13_possibly_ran_result_is_the_gate_text() -> None:
    assert possibly_ran_result("edit") == SettledResult(
        [{"type": "text", "text": "tool edit was interrupted and possibly ran; inspect before "
                                  "repeating"}],
        True,
    )  # fmt: skip


def test_s13_nothing_dangling_writes_nothing(tmp_path: Path) -> None:
    path = _new(tmp_path / "s.jsonl")
    _write(path, _user("go"), _assistant(PARALLEL[:1]), _tool_result("call_1", "bash", "ok"))
    before = path.read_bytes()
    assert settle_dangling(path, {}, clock=StepClock()) == ()
    assert path.read_bytes() == before


def test_s13_refused_on_a_torn_tail(tmp_path: Path) -> None:
    path = _new(tmp_path / "s.jsonl")
    _write(path, _user("go"), _assistant(PARALLEL[:1]))
    _tear(path)
    before = path.read_bytes()
    with pytest.raises(SessionError) as info:
        settle_dangling(path, _answers("call_1"), clock=StepClock())
    assert info.value.code is ReasonCode.SESSION_TORN_TAIL
    assert path.read_bytes() == before


def test_s13_refused_when_the_file_changes_behind_the_writer(tmp_path: Path) -> None:
    """A worker that is not dead after all appends between the read and the first write:
    ``session_changed``, and nothing of ours is written."""
    path = _new(tmp_path / "s.jsonl")
    _write(path, _user("go"), _assistant(PARALLEL[:2]))
    worker_line = b'{"type":"custom","id":"feedf00d","parentId":null,"timestamp":"x"}\n'

    def results(call: DanglingCall) -> SettledResult:
        if call.tool_call_id == "call_1":
            with path.open("ab") as f:  # the "dead" worker writes
                f.write(worker_line)
        return possibly_ran_result(call.name)

    with pytest.raises(SessionError) as info:
        settle_dangling(path, results, clock=StepClock())
    assert info.value.code is ReasonCode.SESSION_CHANGED
    assert path.read_bytes().endswith(worker_line)
    assert b'"toolResult"' not in path.read_bytes()


@pytest.mark.parametrize(
    ("results", "fragment"),
    [
        (_answers("call_1"), "no result for dangling call 'call_2'"),
        ({**_answers("call_1"), "call_2": SettledResult("text", True)}, "is not blocks"),  # type: ignore[arg-type]
        ({**_answers("call_1"), "call_2": SettledResult([], 1)}, "is not a bool"),  # type: ignore[arg-type]
        (
            {**_answers("call_1"), "call_2": SettledResult([{"n": float("nan")}], True)},
            "NaN",
        ),
    ],
    ids=["missing", "content", "is_error", "unencodable"],
)
def test_s13_every_result_is_checked_before_the_first_write(
    tmp_path: Path, results: dict[str, SettledResult], fragment: str
) -> None:
    path = _new(tmp_path / "s.jsonl")
    _write(path, _user("go"), _assistant(PARALLEL[:2]))
    before = path.read_bytes()
    with pytest.raises(SessionError) as info:
        settle_dangling(path, results, clock=StepClock())
    assert info.value.code is ReasonCode.SESSION_ENTRY_INVALID
    assert fragment in str(info.value)
    assert path.read_bytes() == before


def test_s13_prepare_cuts_a_torn_tail_then_settles(tmp_path: Path) -> None:
    path = _new(tmp_path / "s.jsonl")
    _, assistant = _write(path, _user("go"), _assistant(PARALLEL[:2]))
    _tear(path)
    report = prepare_for_relaunch(
        path, lambda call: possibly_ran_result(call.name), clock=StepClock()
    )
    assert report.torn_bytes == len(TORN)
    assert _ids(report.settled) == ["call_1", "call_2"]
    assert {c.assistant_entry_id for c in report.settled} == {assistant.id}
    assert [e.parent_id for e in report.entries] == [assistant.id, report.entries[0].id]
    reread = read_session(path)
    assert reread.issues == ()
    assert reread.session.to_bytes() == report.session.to_bytes() == path.read_bytes()
    assert dangling_tool_calls(reread.session) == ()


def test_s13_prepare_with_nothing_to_do_changes_nothing(tmp_path: Path) -> None:
    path = _new(tmp_path / "s.jsonl")
    _write(path, _user("go"))
    before = path.read_bytes()
    report = prepare_for_relaunch(path, {}, clock=StepClock())
    assert (report.torn_bytes, report.settled, report.entries) == (0, (), ())
    assert path.read_bytes() == before


def test_s13_prepare_refuses_what_is_no_session(tmp_path: Path) -> None:
    """A missing file or a torn *header* is refused before anything is cut."""
    with pytest.raises(SessionError) as info:
        prepare_for_relaunch(tmp_path / "missing.jsonl", {}, clock=StepClock())
    assert info.value.code is ReasonCode.SESSION_MISSING
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b'{"type":"sess')
    with pytest.raises(SessionError) as info:
        prepare_for_relaunch(garbage, {}, clock=StepClock())
    assert info.value.code is ReasonCode.SESSION_HEADER_INVALID
    assert garbage.read_bytes() == b'{"type":"sess'


async def test_s13_async_twins(tmp_path: Path) -> None:
    """Works with MockWallClock: the clock is read, and ``results`` called, on the Trio
    thread."""
    wall = MockWallClock()
    path = tmp_path / "s.jsonl"
    seen: list[str] = []

    def results(call: DanglingCall) -> SettledResult:
        trio.lowlevel.current_task()  # raises off the Trio thread
        seen.append(call.tool_call_id)
        return possibly_ran_result(call.name)

    with trio.fail_after(LIMIT):
        await acreate_session(path, cwd="/c", provider="fake", model_id="fake-model", clock=wall)
        first = [_user("go"), _assistant(PARALLEL), _tool_result("call_1", "bash", "")]
        await trio.to_thread.run_sync(_write, path, *first)
        before = wall.time_ms()
        entries = await asettle_dangling(path, _answers("call_2", "call_3"), clock=wall)
        assert [e.raw["message"]["toolCallId"] for e in entries] == ["call_2", "call_3"]
        stamps = {e.raw["message"]["timestamp"] for e in entries}  # one reading
        assert len(stamps) == 1
        assert before <= stamps.pop() <= wall.time_ms()
        call = _tool_call("call_4", "write", {"path": "x", "content": "y"})
        await trio.to_thread.run_sync(_write, path, _assistant([call]))
        await trio.to_thread.run_sync(_tear, path)
        report = await aprepare_for_relaunch(path, results, clock=wall)
        assert (report.torn_bytes, _ids(report.settled)) == (len(TORN), ["call_4"])
        assert seen == ["call_4"]
        assert dangling_tool_calls((await aread_session(path)).require_clean()) == ()
        assert await asettle_dangling(path, {}, clock=wall) == ()


# ----------------------------------------------------------------------- end to end


def _launch(kind: str, root: Path, model_server: HttpServer) -> WorkerLaunch:
    """Pi or Fake-Pi on ``root/lane.jsonl`` against the scripted model; no extension."""
    program = WorkerProgram.pi(real_pi()) if kind == "pi" else WorkerProgram.fake_pi()
    for sub in ("work", "home", "tmp"):
        (root / sub).mkdir(exist_ok=True)
    return WorkerLaunch(
        program=program,
        cwd=root / "work",
        home=root / "home",
        agent_dir=root / "home" / "agent",
        tmp_dir=root / "tmp",
        session=root / "lane.jsonl",
        route=ModelRoute(provider="fake", model="fake-model", base_url=f"{model_server.url}/v1"),
        retry=RetrySettings(max_retries=0),
    )


async def _create_lane(root: Path) -> Path:
    path = root / "lane.jsonl"
    cwd = str(root / "work")
    await acreate_session(
        path, cwd=cwd, provider="fake", model_id="fake-model", clock=Clocks.system().wall
    )
    return path


@contextlib.asynccontextmanager
async def scripted_model(steps: Sequence[Step]) -> AsyncIterator[tuple[ScriptedModel, HttpServer]]:
    model = ScriptedModel(scenario=Scenario(steps=list(steps)))
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(serve_model_http, model)
        yield model, server
        nursery.cancel_scope.cancel()


async def _kill_mid_tool(launch: WorkerLaunch, call_id: str) -> None:
    """Prompt; once the tool ``call_id`` started, SIGKILL the worker alone (as a crash
    would), then stop the rest of its tree (the tool, orphaned, pi-observed.md §8)."""
    async with (
        open_worker(launch) as worker,
        open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
    ):
        await rpc.prompt("go")
        async for event in rpc:
            if event.type == "tool_execution_start" and event.record["toolCallId"] == call_id:
                break
        worker.process.kill()
        assert await worker.wait() == -signal.SIGKILL
        await worker.stop()


async def _continue(launch: WorkerLaunch) -> None:
    """Relaunch on the same session, prompt "continue", wait until the run settled."""
    async with (
        open_worker(launch) as worker,
        open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
    ):
        prompted = await rpc.prompt("continue")
        settled = await rpc.wait_settled(prompted.settled_before)
        assert settled.record["aborted"] is False


def _tool_messages(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(tool_call_id, text) of each ``tool`` message of a chat-completions request."""
    out = []
    for message in body["messages"]:
        if message.get("role") == "tool":
            content = message["content"]
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content)
            out.append((message["tool_call_id"], content))
    return out


def _roles(body: dict[str, Any]) -> list[str]:
    return [m["role"] for m in body["messages"]]


async def _continued_below(path: Path, settled: SessionEntry) -> list[str]:
    """Check that the relaunched worker appended its entries as a chain right below the
    settled entry (the leaf it found), and return their roles. Pi writes a ``system``
    message first when the path holds none, as in a hand-written session (Fake-Pi does not).
    """
    session = (await aread_session(path)).require_clean()
    path_ids = [e.id for e in session.path_to_root()]
    new = session.entries[session.entries.index(settled) + 1 :]
    assert path_ids[-len(new) - 1 :] == [settled.id, *(e.id for e in new)]
    assert new[-1].raw["message"]["content"] == [{"type": "text", "text": "ok"}]
    return [e.role or "" for e in new]


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_s13_e2e_worker_killed_mid_tool_then_settled(kind: str, tmp_path: Path) -> None:
    """SIGKILL mid-tool leaves the bash call dangling; after ``prepare_for_relaunch`` the
    relaunched worker accepts the session, sends the possibly-ran text for the call (not
    "No result provided") and continues below the settled entry."""
    hang = Call(name="bash", arguments={"command": "sleep 600"}, id="call_hang")
    with trio.fail_after(PROCESS_LIMIT):
        async with scripted_model([ToolCalls(calls=[hang]), Text(text="ok")]) as (model, up):
            path = await _create_lane(tmp_path)
            launch = _launch(kind, tmp_path, up)
            await _kill_mid_tool(launch, "call_hang")
            killed = (await aread_session(path)).require_clean()
            assert killed.leaf is not None
            assert killed.leaf.role == "assistant"
            assert dangling_tool_calls(killed) == (
                DanglingCall("call_hang", "bash", {"command": "sleep 600"}, killed.leaf.id),
            )
            report = await aprepare_for_relaunch(
                path, lambda call: possibly_ran_result(call.name), clock=Clocks.system().wall
            )
            assert (report.torn_bytes, _ids(report.settled)) == (0, ["call_hang"])
            await _continue(launch)
    assert model.request_count == 2
    body = model.requests[1].body
    assert _tool_messages(body) == [("call_hang", interrupted_text("bash"))]
    roles = _roles(body)
    at = roles.index("tool")
    assert roles[at - 1 : at + 2] == ["assistant", "tool", "user"]
    (settled,) = report.entries
    assert await _continued_below(path, settled) == ["user", "assistant"]


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_s13_e2e_hand_written_parallel_calls_with_a_torn_tail(
    kind: str, tmp_path: Path
) -> None:
    """A session written with ``SessionWriter`` in Pi's shapes: two parallel calls, one
    answered, then a torn tail. ``prepare_for_relaunch`` cuts the tail and settles the
    other call; the worker sends both results, in order, and continues below them."""
    with trio.fail_after(PROCESS_LIMIT):
        async with scripted_model([Text(text="ok")]) as (model, up):
            path = await _create_lane(tmp_path)
            launch = _launch(kind, tmp_path, up)
            calls = [
                _tool_call("call_ls", "bash", {"command": "ls"}),
                _tool_call("call_rd", "read", {"path": "notes.txt"}),
            ]
            messages = [_user("go"), _assistant(calls), _tool_result("call_ls", "bash", "a\n")]
            await trio.to_thread.run_sync(_write, path, *messages)
            await trio.to_thread.run_sync(_tear, path)
            answer = SettledResult([{"type": "text", "text": "settled by the runtime"}], True)
            report = await aprepare_for_relaunch(
                path, {"call_rd": answer}, clock=Clocks.system().wall
            )
            assert (report.torn_bytes, _ids(report.settled)) == (len(TORN), ["call_rd"])
            await _continue(launch)
    assert model.request_count == 1
    body = model.requests[0].body
    assert _tool_messages(body) == [("call_ls", "a\n"), ("call_rd", "settled by the runtime")]
    assert _roles(body)[-5:] == ["user", "assistant", "tool", "tool", "user"]
    (settled,) = report.entries
    roles = await _continued_below(path, settled)
    assert roles[-2:] == ["user", "assistant"]
    assert roles[:-2] == ["system"]  # the branch had none: both record the prompt again
