"""Fake-Pi's tools: Pi 1.6.0's ``read``, ``bash``, ``edit``, ``write`` and the runtime's own tools.

A :class:`Tool` has a name, a description, JSON-schema ``parameters`` (for Pi's four tools exactly
the schemas Pi sends the model), a replay class and :meth:`Tool.execute`. Behaviour and texts are
Pi's (``pi-coding-agent/dist/core/tools``); results are :class:`~fake_pi._gate.ToolResult`.

Error handling: a tool failure is never raised. As in Pi, a missing file, a non-matching edit, an
``OSError`` or a :class:`ToolError` becomes a result with ``is_error=True``, ``details={}`` and the
message as its text.

Cancellation: cancelling the caller's scope is Pi's *abort*. :meth:`Tool.execute` then returns
Pi's abort result instead of raising (``bash``: output so far + ``"Command aborted"``; others:
``"Operation aborted"``); Trio cancellation is level-triggered, so the caller's next checkpoint
raises. ``bash`` (:mod:`fake_pi._bash`) kills its whole process group on abort: SIGKILL at
once, as Pi does (a SIGTERM first and :attr:`ToolContext.kill_grace` to wait, if set). File
tools run in a worker thread and finish once started: an effect either happened and is
reported, or never started.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import itertools
import json
import os
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

import trio

from runtime.worker_kit import RUNTIME_TOOLS, TOOLS_ENV

from ._bash import MAX_BYTES, OnUpdate, format_size, run_bash, truncate
from ._bash import MAX_LINES as MAX_LINES  # importable from here, as before the split
from ._gate import TOOL_ABORTED_TEXT, Refused, SavedResult, ToolCall, ToolGate, ToolResult
from ._schema import check, js_string

__all__ = [
    "PI_DEFAULT_TOOLS",
    "OnUpdate",
    "ReplayClass",
    "RuntimeTool",
    "Tool",
    "ToolContext",
    "ToolError",
    "builtin_tools",
    "run_tool_call",
    "runtime_tools_from_environ",
]

ReplayClass = Literal["safe", "receipt", "never"]
RuntimeTool = Callable[[ToolCall], Awaitable[ToolResult]]
"""Executes a runtime-owned call (``send_text_update``, lifecycle tools) inside the runtime."""
RunFn = Callable[[ToolCall, "ToolContext", OnUpdate | None], Awaitable[ToolResult]]

PI_DEFAULT_TOOLS = ("read", "bash", "edit", "write")
"""Pi's default tools, in the order Pi declares them to the model."""

_AFTER_GRACE = 5.0  # how long an aborted call's gate.after may still run, shielded
_UNICODE_SPACES = re.compile("[\u00a0\u2000-\u200a\u202f\u205f\u3000]")
_UV_MESSAGES = {  # libuv's wording where it differs from strerror's
    errno.ENOENT: "no such file or directory",
    errno.EACCES: "permission denied",
    errno.EISDIR: "illegal operation on a directory",
    errno.ENOTDIR: "not a directory",
    errno.EEXIST: "file already exists",
}


class ToolError(Exception):
    """Raise inside a tool to hand the model an error result with exactly this text."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolContext:
    """Where and how tools run. Tools run inside the caller's cancel scope: cancelling it is an
    abort (see the module docstring)."""

    cwd: Path
    """Relative paths resolve against it; ``bash`` runs in it."""
    env: dict[str, str] = field(default_factory=dict)
    """The complete environment of ``bash`` (allow-listed by the caller); nothing is inherited."""
    ledger_path: Path | None = None
    """The ``effect`` tool's ledger: one fsynced JSON line per execution."""
    runtime_tool: RuntimeTool | None = None
    """When set, ``send_text_update`` and the lifecycle tools delegate to it."""
    tmp_dir: Path | None = None
    """Where ``bash`` keeps the full output of truncated commands (default: the temp dir)."""
    kill_grace: float = 0.0
    """Seconds from SIGTERM to SIGKILL when a running ``bash`` is aborted. 0 (the default):
    SIGKILL at once, exactly as Pi 1.6.0 does (``killProcessTree``), so no trap of the tool's
    runs and nothing it does after the abort reaches a test."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tool:
    """One tool as the model sees it, and how to run it."""

    name: str
    description: str
    parameters: dict[str, Any]
    """The arguments' JSON schema (Pi's ``parameters``)."""
    replay_class: ReplayClass
    run: RunFn = field(repr=False, compare=False)
    """The implementation; may raise :class:`ToolError` or ``OSError`` (see :meth:`execute`)."""
    prepare_arguments: Callable[[dict[str, Any]], dict[str, Any]] | None = field(
        default=None, repr=False, compare=False
    )
    """Pi's ``prepareArguments``: repairs common model mistakes before validation."""

    def declaration(self) -> dict[str, Any]:
        """The ``tools[]`` entry Pi sends: ``{"type": "function", "function": {…}}``."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Prepare, coerce and check ``arguments`` as Pi does; :class:`ToolError` with Pi's
        ``Validation failed for tool …`` text when they do not fit the schema."""
        args = copy.deepcopy(dict(arguments))
        if self.prepare_arguments is not None:
            args = self.prepare_arguments(args)
        value, errors = check(self.parameters, args)
        if errors:
            lines = "\n".join(f"  - {e}" for e in errors)
            received = json.dumps(args, indent=2, ensure_ascii=False)
            head = f'Validation failed for tool "{self.name}":'
            raise ToolError(f"{head}\n{lines}\n\nReceived arguments:\n{received}")
        assert isinstance(value, dict)
        return value

    async def execute(
        self, call: ToolCall, ctx: ToolContext, on_update: OnUpdate | None = None
    ) -> ToolResult:
        """Run ``call`` (arguments already validated). Never raises for a tool failure or an
        abort: both come back as error results (see the module docstring)."""
        try:
            await trio.lowlevel.checkpoint()
            return await self.run(call, ctx, on_update)
        except trio.Cancelled:
            return _error(TOOL_ABORTED_TEXT)
        except ToolError as exc:
            return _error(str(exc))
        except OSError as exc:
            return _error(_node_error(exc, "open", exc.filename))


def _error(text: str) -> ToolResult:
    """Pi's ``createErrorToolResult``."""
    return ToolResult(content=[{"type": "text", "text": text}], is_error=True, details={})


# --- paths and Node-style errors (Pi's path-utils.js) ------------------------------------------


def _resolve(path: str, ctx: ToolContext) -> Path:
    p = _UNICODE_SPACES.sub(" ", path).removeprefix("@")
    if p == "~" or p.startswith("~/"):
        p = (ctx.env.get("HOME") or str(Path.home())) + p[1:]
    elif p.startswith("file://"):
        p = unquote(urlparse(p).path)
    return Path(os.path.normpath(os.path.join(ctx.cwd, p)))


def _node_error(exc: OSError, syscall: str, path: object = None) -> str:
    """An ``OSError`` as Node words it: ``ENOENT: no such file or directory, access '/x'``."""
    code = errno.errorcode.get(exc.errno or 0, "EIO")
    message = _UV_MESSAGES.get(exc.errno or 0) or (exc.strerror or "").lower()
    return f"{code}: {message}, {syscall}" + (f" '{path}'" if path is not None else "")


# --- read, write, edit, bash, effect, runtime-owned tools ----------------------------------------


def _read_sync(args: dict[str, Any], ctx: ToolContext) -> ToolResult:
    path, offset, limit = args["path"], args.get("offset"), args.get("limit")
    target = _resolve(path, ctx)
    if not os.access(target, os.R_OK):
        code = errno.EACCES if target.exists() else errno.ENOENT
        raise ToolError(_node_error(OSError(code, ""), "access", target))
    if target.is_dir():
        raise ToolError(_node_error(OSError(errno.EISDIR, ""), "read"))
    lines = target.read_bytes().decode("utf-8", "replace").split("\n")
    start = max(0, int(offset) - 1) if offset else 0
    if start >= len(lines):
        raise ToolError(
            f"Offset {js_string(offset)} is beyond end of file ({len(lines)} lines total)"
        )
    end = None if limit is None else min(start + int(limit), len(lines))
    t, first, details = truncate("\n".join(lines[start:end]), tail=False), start + 1, None
    if t["firstLineExceedsLimit"]:
        size, cap = format_size(len(lines[start].encode("utf-8"))), format_size(MAX_BYTES)
        text = f"[Line {first} is {size}, exceeds {cap} limit. Use bash: "
        text += f"sed -n '{first}p' {path} | head -c {MAX_BYTES}]"
        details = {"truncation": t}
    elif t["truncated"]:
        last = first + t["outputLines"] - 1
        cap = "" if t["truncatedBy"] == "lines" else f" ({format_size(MAX_BYTES)} limit)"
        text = f"{t['content']}\n\n[Showing lines {first}-{last} of {len(lines)}{cap}. "
        text += f"Use offset={last + 1} to continue.]"
        details = {"truncation": t}
    elif end is not None and end < len(lines):
        text = f"{t['content']}\n\n[{len(lines) - end} more lines in file. "
        text += f"Use offset={end + 1} to continue.]"
    else:
        text = t["content"]
    # Pi's read adds structuredContent = the text it returned (toReadOutput in read.js)
    return ToolResult(content=[{"type": "text", "text": text}], details=details, structured=text)


def _write_sync(args: dict[str, Any], ctx: ToolContext) -> ToolResult:
    target = _resolve(args["path"], ctx)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ToolError(_node_error(exc, "mkdir", exc.filename or target.parent)) from exc
    try:
        with open(target, "w", encoding="utf-8", newline="") as f:
            f.write(args["content"])
    except OSError as exc:
        raise ToolError(_node_error(exc, "open", target)) from exc
    return ToolResult.text(f"Successfully wrote to {args['path']}")


def _prepare_edit(args: dict[str, Any]) -> dict[str, Any]:
    """Pi's ``prepareEditArguments``: edits sent as a JSON string or as one object, and the
    legacy top-level ``oldText``/``newText``."""
    if isinstance(edits := args.get("edits"), str):
        with contextlib.suppress(ValueError):
            edits = args["edits"] = json.loads(edits)
    if isinstance(edits, dict) and isinstance(edits.get("oldText"), str):
        edits = args["edits"] = [edits]
    if isinstance(args.get("oldText"), str) and isinstance(args.get("newText"), str):
        legacy = {"oldText": args.pop("oldText"), "newText": args.pop("newText")}
        args["edits"] = [*(edits if isinstance(edits, list) else []), legacy]
    return args


def _lf(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _to_original(content: str, replacements: list[tuple[int, int, str]]) -> str:
    """Pi's ``applyReplacementsToOriginal``: splice replacements found in the LF-normalized text
    into the original, keeping its line endings (new text takes the ending of its line)."""
    crlfs = [m.start() for m in re.finditer("\r\n", content)]

    def orig(offset: int) -> int:
        return offset + sum(1 for i, p in enumerate(crlfs) if p - i < offset)

    parts, pos = [], 0
    for index, length, new in replacements:
        start = orig(index)
        nl = content.find("\n", start)
        nl = content.rfind("\n", 0, start + 1) if nl == -1 else nl
        crlf = nl > 0 and content[nl - 1] == "\r"
        parts += [content[pos:start], new.replace("\n", "\r\n") if crlf else new]
        pos = orig(index + length)
    return "".join([*parts, content[pos:]])


def _edit_sync(args: dict[str, Any], ctx: ToolContext) -> ToolResult:
    path, edits = args["path"], args["edits"]
    if not edits:
        raise ToolError("Edit tool input is invalid. edits must contain at least one replacement.")
    target = _resolve(path, ctx)
    if not os.access(target, os.R_OK | os.W_OK):
        code = "EACCES" if target.exists() else "ENOENT"
        raise ToolError(f"Could not edit file: {path}. Error code: {code}.")
    raw = target.read_bytes().decode("utf-8", "replace")
    bom, content = ("\ufeff", raw[1:]) if raw.startswith("\ufeff") else ("", raw)
    base, one, found = _lf(content), len(edits) == 1, []
    for i, edit in enumerate(edits):
        old, new, what = _lf(edit["oldText"]), _lf(edit["newText"]), f"edits[{i}]"
        if not old:
            raise ToolError(
                f"{'oldText' if one else what + '.oldText'} must not be empty in {path}."
            )
        if (index := base.find(old)) == -1:
            raise ToolError(
                (f"Could not find the exact text in {path}. The old text" if one else
                 f"Could not find {what} in {path}. The oldText")
                + " must match exactly including all whitespace and newlines."
            )  # fmt: skip
        if (n := base.count(old)) > 1:
            raise ToolError(
                (f"Found {n} occurrences of the text in {path}. The text must be unique." if one
                 else f"Found {n} occurrences of {what} in {path}. Each oldText must be unique.")
                + " Please provide more context to make it unique."
            )  # fmt: skip
        found.append((index, len(old), new, i))
    found.sort()
    for (a, size, _, i), (b, _, _, j) in itertools.pairwise(found):
        if a + size > b:
            raise ToolError(
                f"edits[{i}] and edits[{j}] overlap in {path}. "
                "Merge them into one edit or target disjoint regions."
            )
    result = base
    for index, size, new, _ in reversed(found):
        result = result[:index] + new + result[index + size :]
    if result == base:
        raise ToolError(
            f"No changes made to {path}. The replacement produced identical content. This might "
            "indicate an issue with special characters or the text not existing as expected."
            if one
            else f"No changes made to {path}. The replacements produced identical content."
        )
    spliced = [(i, n, new) for i, n, new, _ in found]
    final = bom + (result if content == base else _to_original(content, spliced))
    with open(target, "w", encoding="utf-8", newline="") as f:
        f.write(final)
    return ToolResult.text(f"Successfully replaced {len(edits)} block(s) in {path}.")


def _effect_sync(args: dict[str, Any], ctx: ToolContext, intent: str) -> ToolResult:
    """Append ``{"key", "intent", "pid"}`` to the ledger and fsync (and the directory on
    creation): once this returns, the effect is durable."""
    if ctx.ledger_path is None:
        raise ToolError("effect needs a ledger: ToolContext.ledger_path is not set")
    created = not ctx.ledger_path.exists()
    line = json.dumps({"key": args["key"], "intent": intent, "pid": os.getpid()}) + "\n"
    fds = [os.open(ctx.ledger_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)]
    if created:
        fds.append(os.open(ctx.ledger_path.parent, os.O_RDONLY))
    try:
        os.write(fds[0], line.encode("utf-8"))
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return ToolResult.text(f"effect {args['key']} applied")


def _threaded(fn: Callable[[dict[str, Any], ToolContext], ToolResult]) -> RunFn:
    async def run(call: ToolCall, ctx: ToolContext, on_update: OnUpdate | None) -> ToolResult:
        return await trio.to_thread.run_sync(fn, call.arguments, ctx)

    return run


async def _bash(call: ToolCall, ctx: ToolContext, on_update: OnUpdate | None) -> ToolResult:
    return await run_bash(
        call.arguments["command"],
        call.arguments.get("timeout"),
        cwd=ctx.cwd,
        env=ctx.env,
        tmp_dir=ctx.tmp_dir,
        kill_grace=ctx.kill_grace,
        on_update=on_update,
    )


async def _effect(call: ToolCall, ctx: ToolContext, on_update: OnUpdate | None) -> ToolResult:
    return await trio.to_thread.run_sync(_effect_sync, call.arguments, ctx, call.id)


_STANDALONE_ACKS = {
    "send_text_update": "sent",
    "task_done": "Task marked done.",
    "task_fail": "Task marked failed.",
    "task_wait": "Waiting for the answer.",
    "write_document": "No document store: documents are kept by pi-runtime.",
    "read_document": "No document store: documents are kept by pi-runtime.",
    "attach": "No attachment root: attachments are kept by pi-runtime.",
}


def _runtime_owned(ack: str) -> RunFn:
    async def run(call: ToolCall, ctx: ToolContext, on_update: OnUpdate | None) -> ToolResult:
        return await ctx.runtime_tool(call) if ctx.runtime_tool else ToolResult.text(ack)

    return run


# --- the tool table ----------------------------------------------------------------------------


def _obj(**props: dict[str, Any] | str) -> dict[str, Any]:
    """An object schema; ``name="description"`` is a required string, ``name=_opt(…)`` more."""
    required = [k for k, p in props.items() if isinstance(p, str) or p.pop("_required", False)]
    properties = {k: {"type": "string", "description": p} if isinstance(p, str) else p
                  for k, p in props.items()}  # fmt: skip
    return {"type": "object", "required": required, "properties": properties}


def _opt(kind: str, description: str, *, required: bool = False, **extra: Any) -> dict[str, Any]:
    return {"type": kind, **extra, "description": description, "_required": required}


def _tool(
    name: str,
    replay: ReplayClass,
    run: RunFn,
    *description: str,
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    **props: Any,
) -> Tool:
    return Tool(
        name=name,
        description="".join(description),
        parameters=_obj(**props),
        replay_class=replay,
        run=run,
        prepare_arguments=prepare,
    )


_PATH = "Path to the file to {} (relative or absolute)"
_LIMITS = "2000 lines or 50KB (whichever is hit first)"
_EDIT_ITEM = _obj(
    oldText="Exact text for one targeted replacement. It must be unique in the original file and "
    "must not overlap with any other edits[].oldText in the same call.",
    newText="Replacement text for this targeted edit.",
)
_TOOLS = {
    t.name: t
    for t in [
        _tool(
            "read", "safe", _threaded(_read_sync),
            "Read the contents of a file. Supports text files and images (jpg, png, gif, webp, "
            "bmp). Images are sent as attachments. For text files, output is truncated to ",
            _LIMITS, ". Use offset/limit for large files. When you need the full file, continue "
            "with offset until complete.",
            path=_PATH.format("read"),
            offset=_opt("number", "Line number to start reading from (1-indexed)"),
            limit=_opt("number", "Maximum number of lines to read"),
        ),
        _tool(
            "bash", "never", _bash,
            "Execute a bash command in the current working directory. Returns stdout and stderr. "
            "Output is truncated to last ", _LIMITS, ". If truncated, full output is saved to a "
            "temp file. Optionally provide a timeout in seconds.",
            command="Shell command to execute",
            timeout=_opt("number", "Timeout in seconds (optional, no default timeout)"),
        ),
        _tool(
            "edit", "never", _threaded(_edit_sync),
            "Edit a single file using exact text replacement. Every edits[].oldText must match a "
            "unique, non-overlapping region of the original file. If two changes affect the same "
            "block or nearby lines, merge them into one edit instead of emitting overlapping "
            "edits. Do not include large unchanged regions just to connect distant changes.",
            path=_PATH.format("edit"),
            edits=_opt(
                "array",
                "One or more targeted replacements. Each edit is matched against the original "
                "file, not incrementally. Do not include overlapping or nested edits. If two "
                "changes touch the same block or nearby lines, merge them into one edit instead.",
                required=True, items=_EDIT_ITEM,
            ),
            prepare=_prepare_edit,
        ),
        _tool(
            "write", "never", _threaded(_write_sync),
            "Write content to a file. Creates the file if it doesn't exist, overwrites if it "
            "does. Automatically creates parent directories.",
            path=_PATH.format("write"), content="Content to write to the file",
        ),
]
} | {
    spec.name: Tool(
        name=spec.name,
        description=spec.description,
        parameters=spec.parameters,
        replay_class=spec.replay_class.value,
        run=_effect if spec.name == "effect" else _runtime_owned(_STANDALONE_ACKS[spec.name]),
    )
    for spec in RUNTIME_TOOLS.values()
}  # fmt: skip
"""Every built-in tool by name: Pi's four, then the runtime's own (declared in
``runtime/_boundary/_tools.py``; standalone, Fake-Pi acknowledges them itself and ``effect`` writes
Fake-Pi's ledger)."""


def runtime_tools_from_environ(environ: Mapping[str, str]) -> dict[str, Tool]:
    """The runtime tools the runtime declares in ``$PI_RUNTIME_TOOLS`` (as the Pi extension
    registers them): exactly the given declarations, run only by the runtime's gate, which
    answers each call with its result; reaching :attr:`Tool.run` is an error result."""
    text = environ.get(TOOLS_ENV)
    if not text:
        return {}
    declared = json.loads(text)
    return {
        d["name"]: Tool(
            name=d["name"],
            description=d["description"],
            parameters=d["parameters"],
            replay_class="never",
            run=_only_in_runtime,
        )
        for d in declared
    }


async def _only_in_runtime(
    call: ToolCall, ctx: ToolContext, on_update: OnUpdate | None
) -> ToolResult:
    raise ToolError(f"{call.name} is a runtime tool; the runtime's gate runs it")


def builtin_tools(names: Iterable[str] | None = None) -> dict[str, Tool]:
    """The named built-in tools, in the order named; by default Pi's ``read, bash, edit, write``.

    Each call returns fresh schema dicts. An unknown name raises ``ValueError``.
    """
    chosen = list(PI_DEFAULT_TOOLS if names is None else names)
    if unknown := [n for n in chosen if n not in _TOOLS]:
        raise ValueError(f"unknown tools {unknown}; known: {', '.join(_TOOLS)}")
    return {
        n: dataclasses.replace(_TOOLS[n], parameters=copy.deepcopy(_TOOLS[n].parameters))
        for n in chosen
    }


async def run_tool_call(
    tool: Tool | None,
    call: ToolCall,
    ctx: ToolContext,
    gate: ToolGate,
    on_update: OnUpdate | None = None,
) -> ToolResult:
    """Run one model tool call through ``gate``, as Pi's agent loop does. Always returns a result.

    * ``tool is None`` (no tool of that name): ``"Tool <name> not found"``; the gate is not asked.
    * Invalid arguments: Pi's ``Validation failed for tool …`` error; the gate is not asked.
    * Otherwise the gate sees the call with the validated (coerced) arguments:
      :class:`~fake_pi._gate.Run` executes it, then ``gate.after(call, result)`` gets the result;
      :class:`~fake_pi._gate.SavedResult` returns its result verbatim (no execution, no ``after``);
      :class:`~fake_pi._gate.Refused` returns its result as an error (no execution, no ``after``).

    Aborted (the caller's scope cancelled) while the gate decides: ``"Operation aborted"``,
    nothing ran — but for a runtime tool once asked, whose result is the gate's answer
    (the gate runs it whatever the worker does: gate.md T25). Aborted while the tool runs or
    its result is reported: the result (the tool's abort result), still reported to
    ``gate.after`` whole (shielded, for at most a few seconds). The caller's next checkpoint
    then raises Cancelled.
    """
    await trio.lowlevel.cancel_shielded_checkpoint()
    if tool is None:
        return _error(f"Tool {call.name} not found")
    try:
        call = dataclasses.replace(call, arguments=tool.validate(call.arguments))
    except ToolError as exc:
        return _error(str(exc))
    try:
        decision = await gate.before(call)
    except trio.Cancelled:
        return _error(TOOL_ABORTED_TEXT)
    if isinstance(decision, SavedResult):
        return decision.result
    if isinstance(decision, Refused):
        return dataclasses.replace(decision.result, is_error=True)
    result = await tool.execute(call, ctx, on_update)
    # aborted before or while it is reported, Pi still reports the result (its report is a
    # promise an abort does not stop, gate.md T23): shielded, for at most a few seconds
    with trio.CancelScope(shield=True, deadline=trio.current_time() + _AFTER_GRACE):
        await gate.after(call, result)
    return result
