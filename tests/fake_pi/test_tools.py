"""Fake-Pi's tools (fake_pi._tools): Pi 1.6.0's behaviour and texts, the gate, abort.

Real files under tmp_path and real processes; bash tests use the real clock with fail_after bounds
and wait on output, never on a sleep. Expected texts are Pi's own (pi-coding-agent/dist/core/tools,
pi-agent-core/dist/agent-loop.js); the tool schemas are compared with a request real Pi sent
(tests/data/pi-1.6.0/llm_request_first_full.json)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from fake_pi._gate import (
    AllowAllGate,
    GateDecision,
    Refused,
    Run,
    SavedResult,
    ToolCall,
    ToolResult,
)
from fake_pi._tools import (
    PI_DEFAULT_TOOLS,
    Tool,
    ToolContext,
    builtin_tools,
    run_tool_call,
)

from .._samples import FIRST_REQUEST

ALL = ["read", "bash", "edit", "write", "effect", "send_text_update"]
ALL += ["task_done", "task_fail", "task_wait"]
TOOLS = builtin_tools(ALL)


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    work = tmp_path / "work"
    work.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    return ToolContext(
        cwd=work, env=env, ledger_path=tmp_path / "ledger.jsonl", tmp_dir=tmp_path, kill_grace=0.3
    )


@dataclass
class RecordingGate:
    decision: GateDecision = field(default_factory=Run)
    before_calls: list[ToolCall] = field(default_factory=list)
    after_calls: list[tuple[ToolCall, ToolResult]] = field(default_factory=list)
    cancel_while_deciding: trio.CancelScope | None = None
    """Cancel this scope from inside ``before``, which then never answers."""

    async def before(self, call: ToolCall) -> GateDecision:
        self.before_calls.append(call)
        if self.cancel_while_deciding is not None:
            self.cancel_while_deciding.cancel()
            await trio.sleep_forever()
        return self.decision

    async def after(self, call: ToolCall, result: ToolResult) -> None:
        await trio.lowlevel.checkpoint()
        self.after_calls.append((call, result))


async def call(name: str, ctx: ToolContext, call_id: str = "call_1", **args: Any) -> ToolResult:
    """One call through run_tool_call with a gate that runs everything (validation included)."""
    with trio.fail_after(20):
        return await run_tool_call(TOOLS[name], ToolCall(call_id, name, args), ctx, AllowAllGate())


def ledger(ctx: ToolContext) -> list[dict[str, Any]]:
    assert ctx.ledger_path is not None
    if not ctx.ledger_path.exists():
        return []
    return [json.loads(line) for line in ctx.ledger_path.read_text().splitlines()]


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def pids(text: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+) (\d+)$", text, re.MULTILINE)}


# --- schemas and the tool set ------------------------------------------------------------------


def test_pi_tool_schemas_equal_the_ones_real_pi_sent() -> None:
    assert FIRST_REQUEST.is_file(), f"missing Pi sample {FIRST_REQUEST}: the check cannot run"
    sent = json.loads(FIRST_REQUEST.read_text())["body"]["tools"]
    ours = [tool.declaration() for tool in builtin_tools().values()]
    assert ours == sent
    assert json.dumps(ours) == json.dumps(sent)  # same key order: same request bytes


def test_default_set_is_pis_four_in_pis_order() -> None:
    assert tuple(builtin_tools()) == PI_DEFAULT_TOOLS == ("read", "bash", "edit", "write")
    assert list(builtin_tools(["effect", "read"])) == ["effect", "read"]
    with pytest.raises(ValueError, match="nope"):
        builtin_tools(["read", "nope"])


def test_replay_classes() -> None:
    classes = {name: tool.replay_class for name, tool in TOOLS.items()}
    assert classes == {name: "safe" if name == "read" else "never" for name in ALL}


def test_each_call_gets_fresh_schemas() -> None:
    first = builtin_tools()["read"]
    first.parameters["properties"].clear()
    assert builtin_tools()["read"].parameters["properties"]


@pytest.mark.parametrize("name", ALL[4:])
def test_runtime_tool_schemas_describe_every_parameter(name: str) -> None:
    schema = TOOLS[name].parameters
    assert schema["type"] == "object"
    assert schema["required"] == list(schema["properties"])
    assert all(p["type"] == "string" and p["description"] for p in schema["properties"].values())
    assert TOOLS[name].description


# --- read --------------------------------------------------------------------------------------


async def test_read_returns_the_text_of_a_relative_path(ctx: ToolContext) -> None:
    (ctx.cwd / "f.txt").write_text("alpha\nbeta\n")
    result = await call("read", ctx, path="f.txt")
    assert (result.text_content, result.is_error, result.details) == ("alpha\nbeta\n", False, None)
    assert (await call("read", ctx, path=str(ctx.cwd / "f.txt"))).text_content == "alpha\nbeta\n"


async def test_read_offset_and_limit_tell_where_to_continue(ctx: ToolContext) -> None:
    (ctx.cwd / "f.txt").write_text("\n".join(f"l{i}" for i in range(1, 11)))
    result = await call("read", ctx, path="f.txt", offset="3", limit=2)  # "3": coerced
    assert result.text_content == "l3\nl4\n\n[6 more lines in file. Use offset=5 to continue.]"
    assert (await call("read", ctx, path="f.txt", offset=9)).text_content == "l9\nl10"


async def test_read_offset_beyond_end(ctx: ToolContext) -> None:
    (ctx.cwd / "f.txt").write_text("\n".join(f"l{i}" for i in range(1, 11)))
    result = await call("read", ctx, path="f.txt", offset=20)
    assert result.is_error
    assert result.text_content == "Offset 20 is beyond end of file (10 lines total)"


async def test_read_truncates_at_2000_lines(ctx: ToolContext) -> None:
    (ctx.cwd / "f.txt").write_text("".join(f"line{i}\n" for i in range(1, 2501)))
    result = await call("read", ctx, path="f.txt")
    body, notice = result.text_content.split("\n\n")
    assert body.splitlines() == [f"line{i}" for i in range(1, 2001)]
    assert notice == "[Showing lines 1-2000 of 2501. Use offset=2001 to continue.]"
    assert result.details is not None
    assert result.details["truncation"]["truncatedBy"] == "lines"


async def test_read_truncates_at_50kb(ctx: ToolContext) -> None:
    (ctx.cwd / "f.txt").write_text("\n".join("x" * 1000 for _ in range(100)))
    result = await call("read", ctx, path="f.txt")
    body, notice = result.text_content.split("\n\n")
    assert len(body.splitlines()) == 51
    assert notice == "[Showing lines 1-51 of 100 (50.0KB limit). Use offset=52 to continue.]"


async def test_read_first_line_over_the_limit_points_to_bash(ctx: ToolContext) -> None:
    (ctx.cwd / "big.txt").write_text("x" * 60_000)
    result = await call("read", ctx, path="big.txt")
    assert result.text_content == (
        "[Line 1 is 58.6KB, exceeds 50.0KB limit. Use bash: sed -n '1p' big.txt | head -c 51200]"
    )


async def test_read_errors_are_nodes(ctx: ToolContext) -> None:
    missing = await call("read", ctx, path="nope.txt")
    assert (missing.is_error, missing.details) == (True, {})
    expected = f"ENOENT: no such file or directory, access '{ctx.cwd}/nope.txt'"
    assert missing.text_content == expected
    (ctx.cwd / "d").mkdir()
    directory = await call("read", ctx, path="d")
    assert directory.is_error
    assert directory.text_content == "EISDIR: illegal operation on a directory, read"


# --- write -------------------------------------------------------------------------------------


async def test_write_creates_parent_directories_and_overwrites(ctx: ToolContext) -> None:
    result = await call("write", ctx, path="a/b/c.txt", content="one\r\ntwo")
    assert (result.text_content, result.is_error) == ("Successfully wrote to a/b/c.txt", False)
    assert (ctx.cwd / "a/b/c.txt").read_bytes() == b"one\r\ntwo"
    await call("write", ctx, path="a/b/c.txt", content="new")
    assert (ctx.cwd / "a/b/c.txt").read_text() == "new"


async def test_write_below_a_file_fails(ctx: ToolContext) -> None:
    (ctx.cwd / "f.txt").write_text("")
    result = await call("write", ctx, path="f.txt/x.txt", content="x")
    assert result.is_error
    assert result.text_content == f"EEXIST: file already exists, mkdir '{ctx.cwd}/f.txt'"


# --- edit --------------------------------------------------------------------------------------


async def test_edit_applies_disjoint_edits_against_the_original(ctx: ToolContext) -> None:
    (ctx.cwd / "f.txt").write_text("alpha\nbeta\ngamma\n")
    edits = [{"oldText": "gamma", "newText": "GAMMA"}, {"oldText": "alpha", "newText": "beta"}]
    result = await call("edit", ctx, path="f.txt", edits=edits)
    assert (result.text_content, result.is_error) == (
        "Successfully replaced 2 block(s) in f.txt.",
        False,
    )
    assert (ctx.cwd / "f.txt").read_text() == "beta\nbeta\nGAMMA\n"


def _edit(old: str, new: str = "X") -> dict[str, str]:
    return {"oldText": old, "newText": new}


NOT_FOUND = " must match exactly including all whitespace and newlines."
MORE_CONTEXT = " Please provide more context to make it unique."


@pytest.mark.parametrize(
    ("edits", "expected"),
    [
        ([_edit("zeta")], "Could not find the exact text in f.txt. The old text" + NOT_FOUND),
        (
            [_edit("alpha"), _edit("zeta")],
            "Could not find edits[1] in f.txt. The oldText" + NOT_FOUND,
        ),
        (
            [_edit("a")],
            "Found 5 occurrences of the text in f.txt. The text must be unique." + MORE_CONTEXT,
        ),
        (
            [_edit("beta"), _edit("a")],
            "Found 5 occurrences of edits[1] in f.txt. Each oldText must be unique." + MORE_CONTEXT,
        ),
        (
            [_edit("alpha\nbeta"), _edit("beta\ngamma")],
            "edits[0] and edits[1] overlap in f.txt. Merge them into one edit or target disjoint "
            "regions.",
        ),
        ([_edit("")], "oldText must not be empty in f.txt."),
        ([_edit("beta"), _edit("")], "edits[1].oldText must not be empty in f.txt."),
        (
            [_edit("beta", "beta")],
            "No changes made to f.txt. The replacement produced identical content. This might "
            "indicate an issue with special characters or the text not existing as expected.",
        ),
        ([], "Edit tool input is invalid. edits must contain at least one replacement."),
    ],
)
async def test_edit_refuses_with_pis_texts(
    ctx: ToolContext, edits: list[dict[str, str]], expected: str
) -> None:
    (ctx.cwd / "f.txt").write_text("alpha\nbeta\ngamma\n")
    result = await call("edit", ctx, path="f.txt", edits=edits)
    assert (result.text_content, result.is_error, result.details) == (expected, True, {})
    assert (ctx.cwd / "f.txt").read_text() == "alpha\nbeta\ngamma\n"


async def test_edit_of_a_missing_file(ctx: ToolContext) -> None:
    result = await call("edit", ctx, path="nope.txt", edits=[_edit("a")])
    assert result.text_content == "Could not edit file: nope.txt. Error code: ENOENT."


async def test_edit_keeps_bom_and_crlf_line_endings(ctx: ToolContext) -> None:
    (ctx.cwd / "f.txt").write_bytes("\ufeffone\r\ntwo\r\nthree\r\n".encode())
    result = await call("edit", ctx, path="f.txt", edits=[_edit("two\n", "2a\n2b\n")])
    assert not result.is_error, result.text_content
    assert (ctx.cwd / "f.txt").read_bytes() == "\ufeffone\r\n2a\r\n2b\r\nthree\r\n".encode()


async def test_edit_repairs_arguments_like_pi(ctx: ToolContext) -> None:
    (ctx.cwd / "f.txt").write_text("alpha beta")
    legacy = await call("edit", ctx, path="f.txt", oldText="alpha", newText="A")
    as_json = await call("edit", ctx, path="f.txt", edits=json.dumps([_edit("beta", "B")]))
    single = await call("edit", ctx, path="f.txt", edits=_edit("A B", "done"))
    assert [r.is_error for r in (legacy, as_json, single)] == [False] * 3
    assert (ctx.cwd / "f.txt").read_text() == "done"


# --- bash --------------------------------------------------------------------------------------


async def test_bash_merges_stdout_and_stderr(ctx: ToolContext) -> None:
    result = await call("bash", ctx, command="echo out; echo err >&2; pwd")
    assert result.text_content == f"out\nerr\n{ctx.cwd}\n"
    assert (result.is_error, result.details) == (False, None)
    assert result.structured is not None
    assert result.structured["output"] == result.text_content
    assert (result.structured["truncated"], result.structured["exit_code"]) == (False, 0)
    assert isinstance(result.structured["wall_time_seconds"], float)


@pytest.mark.parametrize(
    ("command", "text", "code"),
    [
        ("echo REWRITE; exit 3", "REWRITE\n\n\nCommand exited with code 3", 3),
        ("exit 1", "(no output)\n\nCommand exited with code 1", 1),
        ("true", "(no output)", 0),
        ("kill -9 $$", "(no output)\n\nCommand exited with code 137", 137),
    ],
)
async def test_bash_exit_codes(ctx: ToolContext, command: str, text: str, code: int) -> None:
    result = await call("bash", ctx, command=command)
    assert (result.text_content, result.is_error) == (text, code != 0)
    assert result.structured is not None
    assert result.structured["exit_code"] == code


async def test_bash_sees_only_the_context_environment(
    ctx: ToolContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PI_TOOLS_TEST_SECRET", "s3cret")
    result = await call("bash", ctx, command='echo "[${PI_TOOLS_TEST_SECRET:-unset}] $HOME"')
    assert result.text_content == f"[unset] {ctx.env['HOME']}\n"


async def test_bash_streams_cumulative_updates_while_running(
    ctx: ToolContext, tmp_path: Path
) -> None:
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    updates: list[ToolResult] = []
    released: list[bool] = []

    def release() -> None:
        with open(fifo, "w") as f:  # blocks until the command opens the fifo to read
            f.write("go\n")

    async def on_update(partial: ToolResult) -> None:
        updates.append(partial)
        if "first" in partial.text_content and not released:
            # The command cannot finish before this write: the update arrived while it ran.
            released.append(True)
            await trio.to_thread.run_sync(release)

    bash = TOOLS["bash"]
    command = f"echo first; read line < {fifo}; echo second $line"
    with trio.fail_after(20):
        result = await bash.execute(ToolCall("c1", "bash", {"command": command}), ctx, on_update)
    assert result.text_content == "first\nsecond go\n"
    assert updates[0] == ToolResult(content=[], details=None)  # Pi's opening update
    texts = [u.text_content for u in updates[1:]]
    assert (texts[0], texts[-1]) == ("first\n", "first\nsecond go\n")
    assert released  # the release happened from inside an update
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))


async def test_bash_timeout_kills_and_reports(ctx: ToolContext) -> None:
    with trio.fail_after(10):
        result = await call("bash", ctx, command='echo "sh $$"; sleep 30; echo after', timeout=0.3)
    shell = pids(result.text_content)["sh"]
    assert result.text_content == f"sh {shell}\n\n\nCommand timed out after 0.3 seconds"
    assert (result.is_error, result.details, result.structured) == (True, {}, None)
    assert not alive(shell)


async def test_bash_refuses_bad_timeouts_and_missing_cwd(ctx: ToolContext, tmp_path: Path) -> None:
    zero = await call("bash", ctx, command="true", timeout=0)
    assert zero.text_content == "Invalid timeout: must be a finite number of seconds"
    gone = ToolContext(cwd=tmp_path / "gone", env=ctx.env)
    missing = await call("bash", gone, command="true")
    assert missing.is_error
    assert missing.text_content == (
        f"Working directory does not exist: {tmp_path / 'gone'}\nCannot execute bash commands."
    )


async def test_bash_truncates_to_the_last_2000_lines_and_keeps_the_full_output(
    ctx: ToolContext, tmp_path: Path
) -> None:
    result = await call("bash", ctx, command="seq 1 3000")
    assert result.details is not None
    path = result.details["fullOutputPath"]
    (saved,) = [tmp_path / n for n in os.listdir(tmp_path) if n.startswith("pi-bash-")]
    assert str(saved) == path
    full = "".join(f"{i}\n" for i in range(1, 3001))
    assert saved.read_bytes() == full.encode()
    shown = "\n".join(str(i) for i in range(1001, 3001))
    notice = f"[Showing lines 1001-3000 of 3000. Full output: {path}]"
    assert result.text_content == f"{shown}\n\n{notice}"
    assert result.structured is not None
    assert (result.structured["output"], result.structured["truncated"]) == (full, False)


# --- abort -------------------------------------------------------------------------------------


async def _abort_bash_when(
    ctx: ToolContext, command: str, ready: str, gate: RecordingGate | None = None
) -> ToolResult:
    """Run bash and cancel its scope as soon as the output contains ``ready``."""
    with trio.fail_after(20), trio.CancelScope() as scope:

        async def on_update(partial: ToolResult) -> None:
            if ready in partial.text_content:
                scope.cancel()

        tool_call = ToolCall("c1", "bash", {"command": command})
        if gate is None:
            return await TOOLS["bash"].execute(tool_call, ctx, on_update)
        return await run_tool_call(TOOLS["bash"], tool_call, ctx, gate, on_update)
    raise AssertionError("unreachable: the tool returns its abort result")


async def test_abort_kills_the_whole_process_group(ctx: ToolContext) -> None:
    command = (
        'echo "sh $$"; sleep 30 & echo "bg $!"; (echo "sub $BASHPID"; exec sleep 30); '
        "echo after > after.txt"
    )
    result = await _abort_bash_when(ctx, command, "sub ")
    found = pids(result.text_content)
    assert set(found) == {"sh", "bg", "sub"}
    assert result.text_content.endswith("\n\nCommand aborted")
    assert (result.is_error, result.details, result.structured) == (True, {}, None)
    assert [name for name, pid in found.items() if alive(pid)] == []
    assert not (ctx.cwd / "after.txt").exists()


async def test_abort_escalates_to_sigkill_when_sigterm_is_ignored(ctx: ToolContext) -> None:
    command = 'trap \'\' TERM; echo "sh $$"; sleep 30 & echo "bg $!"; wait; echo after > after.txt'
    started = trio.current_time()
    result = await _abort_bash_when(ctx, command, "bg ")
    assert trio.current_time() - started >= ctx.kill_grace  # SIGTERM was ignored, SIGKILL was not
    found = pids(result.text_content)
    assert set(found) == {"sh", "bg"}
    assert [name for name, pid in found.items() if alive(pid)] == []
    assert not (ctx.cwd / "after.txt").exists()


async def test_abort_kills_at_once_by_default_as_pi_does(ctx: ToolContext) -> None:
    """F4: by default an abort SIGKILLs the tool's group at once, as Pi 1.6.0 does
    (``killProcessTree``): a TERM trap of the tool never runs, so nothing a tool does after
    the abort reaches a test that the real Pi would not let happen."""
    default = dataclasses.replace(ctx, kill_grace=ToolContext(cwd=ctx.cwd).kill_grace)
    assert default.kill_grace == 0
    command = "trap 'echo trapped > trapped.txt' TERM; echo \"sh $$\"; sleep 30 & wait"
    result = await _abort_bash_when(default, command, "sh ")
    found = pids(result.text_content)
    assert [name for name, pid in found.items() if alive(pid)] == []
    assert not (ctx.cwd / "trapped.txt").exists()


async def test_an_aborted_call_still_reports_to_the_gate(ctx: ToolContext) -> None:
    gate = RecordingGate()
    result = await _abort_bash_when(ctx, "echo go; sleep 30", "go", gate)
    assert result.text_content == "go\n\n\nCommand aborted"
    assert gate.after_calls == [(gate.before_calls[0], result)]


async def test_abort_before_a_file_tool_starts_has_no_effect(ctx: ToolContext) -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        result = await TOOLS["effect"].execute(ToolCall("c1", "effect", {"key": "k"}), ctx)
    assert (result.text_content, result.is_error) == ("Operation aborted", True)
    assert ledger(ctx) == []


async def test_abort_while_the_gate_decides_runs_nothing(ctx: ToolContext) -> None:
    with trio.fail_after(20), trio.CancelScope() as scope:
        gate = RecordingGate(cancel_while_deciding=scope)
        tool_call = ToolCall("c1", "effect", {"key": "k"})
        result = await run_tool_call(TOOLS["effect"], tool_call, ctx, gate)
    assert (result.text_content, result.is_error) == ("Operation aborted", True)
    assert (ledger(ctx), gate.after_calls) == ([], [])


async def test_an_abort_while_the_outcome_is_reported_still_reports_it(ctx: ToolContext) -> None:
    """As Pi's extension (its report is a promise no abort stops, gate.md T23): a call that ran
    to its end, aborted while its outcome is on its way to the gate, still has it reported,
    whole — else the gate holds the call running (T11) and fails the next calls closed (T21).
    Before, the report was cancelled half-way."""

    class SlowReport(RecordingGate):
        async def after(self, call: ToolCall, result: ToolResult) -> None:
            abort.cancel()  # the turn is aborted while the report is on its way
            await trio.lowlevel.checkpoint()
            await super().after(call, result)

    abort = trio.CancelScope()
    gate = SlowReport()
    with trio.fail_after(20), abort:
        result = await run_tool_call(
            TOOLS["effect"], ToolCall("c1", "effect", {"key": "k"}), ctx, gate
        )
    assert result.text_content == "effect k applied"
    assert [(c.id, r.text_content) for c, r in gate.after_calls] == [("c1", "effect k applied")]


# --- effect, send_text_update, lifecycle -------------------------------------------------------


async def test_effect_appends_one_ledger_line_per_execution(ctx: ToolContext) -> None:
    first = await call("effect", ctx, "call_a", key="deploy")
    second = await call("effect", ctx, "call_b", key="deploy")
    assert [first.text_content, second.text_content] == ["effect deploy applied"] * 2
    assert [(e["key"], e["intent"]) for e in ledger(ctx)] == [
        ("deploy", "call_a"),
        ("deploy", "call_b"),
    ]


async def test_effect_without_a_ledger_is_an_error(ctx: ToolContext) -> None:
    no_ledger = ToolContext(cwd=ctx.cwd)
    result = await call("effect", no_ledger, key="k")
    assert result.is_error
    assert "ledger" in result.text_content


async def test_send_text_update_without_and_with_a_runtime(ctx: ToolContext) -> None:
    assert (await call("send_text_update", ctx, text="working")).text_content == "sent"
    seen: list[ToolCall] = []

    async def runtime(tool_call: ToolCall) -> ToolResult:
        seen.append(tool_call)
        return ToolResult.text("delivered")

    with_runtime = ToolContext(cwd=ctx.cwd, runtime_tool=runtime)
    assert (await call("send_text_update", with_runtime, text="hi")).text_content == "delivered"
    assert seen == [ToolCall("call_1", "send_text_update", {"text": "hi"})]


async def test_send_text_update_is_limited_to_600_characters(ctx: ToolContext) -> None:
    assert not (await call("send_text_update", ctx, text="x" * 600)).is_error
    result = await call("send_text_update", ctx, text="x" * 601)
    assert result.is_error
    head = 'Validation failed for tool "send_text_update":\n'
    assert result.text_content.startswith(head + "  - text: expected at most 600 characters\n")


@pytest.mark.parametrize(
    ("name", "param", "ack"),
    [
        ("task_done", "summary", "Task marked done."),
        ("task_fail", "reason", "Task marked failed."),
        ("task_wait", "question", "Waiting for the answer."),
    ],
)
async def test_lifecycle_tools_acknowledge_or_go_to_the_runtime(
    ctx: ToolContext, name: str, param: str, ack: str
) -> None:
    assert (await call(name, ctx, **{param: "because"})).text_content == ack

    async def runtime(tool_call: ToolCall) -> ToolResult:
        return ToolResult.text(f"runtime got {tool_call.name}: {tool_call.arguments[param]}")

    with_runtime = ToolContext(cwd=ctx.cwd, runtime_tool=runtime)
    result = await call(name, with_runtime, **{param: "because"})
    assert result.text_content == f"runtime got {name}: because"


# --- the gate ----------------------------------------------------------------------------------


def _effect_call(call_id: str = "call_1") -> ToolCall:
    return ToolCall(call_id, "effect", {"key": "k"})


async def test_saved_result_is_returned_verbatim_without_executing(ctx: ToolContext) -> None:
    saved = ToolResult(content=[{"type": "text", "text": "saved"}], details={"from": "journal"})
    gate = RecordingGate(decision=SavedResult(saved))
    result = await run_tool_call(TOOLS["effect"], _effect_call(), ctx, gate)
    assert result is saved
    assert (ledger(ctx), gate.after_calls) == ([], [])


async def test_refused_is_an_error_and_does_not_execute(ctx: ToolContext) -> None:
    gate = RecordingGate(decision=Refused(ToolResult.text("blocked by runtime: no grant")))
    result = await run_tool_call(TOOLS["effect"], _effect_call(), ctx, gate)
    assert (result.text_content, result.is_error) == ("blocked by runtime: no grant", True)
    assert (ledger(ctx), gate.after_calls) == ([], [])


async def test_run_executes_once_and_after_gets_the_result(ctx: ToolContext) -> None:
    gate = RecordingGate()
    result = await run_tool_call(TOOLS["effect"], _effect_call("call_x"), ctx, gate)
    assert result.text_content == "effect k applied"
    assert [(e["key"], e["intent"]) for e in ledger(ctx)] == [("k", "call_x")]
    assert gate.after_calls == [(_effect_call("call_x"), result)]


async def test_unknown_tool_is_not_found_without_asking_the_gate(ctx: ToolContext) -> None:
    gate = RecordingGate()
    result = await run_tool_call(None, ToolCall("c1", "nope", {}), ctx, gate)
    assert (result.text_content, result.is_error, result.details) == (
        "Tool nope not found",
        True,
        {},
    )
    assert gate.before_calls == []


async def test_invalid_arguments_fail_validation_without_asking_the_gate(
    ctx: ToolContext,
) -> None:
    gate = RecordingGate()
    missing = await run_tool_call(TOOLS["effect"], ToolCall("c1", "effect", {}), ctx, gate)
    assert missing.is_error
    assert missing.text_content == (
        'Validation failed for tool "effect":\n  - key: missing\n\nReceived arguments:\n{}'
    )
    wrong = await run_tool_call(TOOLS["bash"], ToolCall("c2", "bash", {"command": []}), ctx, gate)
    assert wrong.text_content.startswith(
        'Validation failed for tool "bash":\n  - command: expected string, got array\n'
    )
    assert (gate.before_calls, ledger(ctx)) == ([], [])


async def test_the_gate_sees_the_coerced_arguments(ctx: ToolContext) -> None:
    (ctx.cwd / "f.txt").write_text("a\nb\n")
    gate = RecordingGate()
    arguments = {"path": "f.txt", "offset": "2", "limit": None}
    result = await run_tool_call(TOOLS["read"], ToolCall("c1", "read", arguments), ctx, gate)
    assert result.text_content == "b\n"
    assert gate.before_calls == [ToolCall("c1", "read", {"path": "f.txt", "offset": 2})]


def test_a_custom_tool_is_a_plain_value() -> None:
    async def run(tool_call: ToolCall, ctx: ToolContext, on_update: object) -> ToolResult:
        return ToolResult.text("ok")

    tool = Tool(
        name="ping",
        description="Ping.",
        parameters={"type": "object"},
        replay_class="safe",
        run=run,
    )
    assert tool.declaration() == {
        "type": "function",
        "function": {"name": "ping", "description": "Ping.", "parameters": {"type": "object"}},
    }
