"""Pi's ``bash`` tool (bash.js, output-accumulator.js, child-process.js) and output truncation
(truncate.js), which ``read`` shares.

:func:`run_bash` runs one command with ``bash -c`` in its own session (process group), like Pi's
detached spawn, with stdout and stderr merged, nothing inherited but ``env`` and no stdin. The
model sees the output's tail, truncated to 2000 lines or 50 KB; past those limits the raw output
spills to a temp file (``pi-bash-*.log``) named in the result. Partial results go to
``on_update``, throttled.

Error handling: an invalid timeout, a missing working directory, a timeout and a non-zero exit
come back as error results. A timeout SIGKILLs the group at once, as Pi does. An ``OSError`` from
starting the shell, or an exception from ``on_update``, propagates (the group killed first).

Cancellation: cancelling the caller's scope is Pi's abort. :func:`run_bash` then returns the
output so far + ``"Command aborted"`` instead of raising; the group gets SIGKILL at once, as
Pi's (a SIGTERM first and ``kill_grace`` to wait, if it is set), the shell is reaped and no
group member is left alive.
"""

from __future__ import annotations

import codecs
import contextlib
import math
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import trio

from ._gate import ToolResult
from ._schema import js_string

__all__ = ["MAX_BYTES", "MAX_LINES", "OnUpdate", "format_size", "run_bash", "truncate"]

OnUpdate = Callable[[ToolResult], Awaitable[None]]
"""Receives cumulative partial results (Pi's ``tool_execution_update.partialResult``)."""

MAX_LINES, MAX_BYTES = 2000, 50 * 1024  # Pi's DEFAULT_MAX_LINES / DEFAULT_MAX_BYTES
_STRUCTURED_MAX_BYTES = 1024 * 1024
_UPDATE_THROTTLE = 0.1  # Pi's BASH_UPDATE_THROTTLE_MS
_EXIT_STDIO_GRACE = 0.1  # Pi's EXIT_STDIO_GRACE_MS: pipes still held by descendants after exit
_MAX_TIMEOUT_SECONDS = 2_147_483.647


# --- truncation (Pi's truncate.js) -------------------------------------------------------------


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def format_size(n: int) -> str:
    """Pi's ``formatSize``: ``512B``, ``50.0KB``, ``1.5MB``."""
    if n < 1024:
        return f"{n}B"
    return f"{n / 1024:.1f}KB" if n < 1024 * 1024 else f"{n / (1024 * 1024):.1f}MB"


def truncate(text: str, *, tail: bool) -> dict[str, Any]:
    """Pi's ``truncateHead`` (``tail=False``: whole lines from the start; a first line over the
    byte limit gives no content) and ``truncateTail`` (whole lines from the end; only a single
    over-long last line is cut). Limits: 2000 lines, 50 KB. Returns Pi's truncation record."""
    lines = text.split("\n") if text else []
    lines = lines[:-1] if text.endswith("\n") else lines
    out: dict[str, Any] = {"content": text, "truncated": False, "truncatedBy": None}
    out |= {"totalLines": len(lines), "totalBytes": _nbytes(text), "outputLines": len(lines)}
    out |= {"outputBytes": _nbytes(text), "lastLinePartial": False}
    out |= {"firstLineExceedsLimit": False, "maxLines": MAX_LINES, "maxBytes": MAX_BYTES}
    if len(lines) <= MAX_LINES and _nbytes(text) <= MAX_BYTES:
        return out
    if not tail and _nbytes(lines[0]) > MAX_BYTES:
        out |= {"content": "", "outputLines": 0, "outputBytes": 0, "firstLineExceedsLimit": True}
        return out | {"truncated": True, "truncatedBy": "bytes"}
    kept: list[str] = []
    size, by = 0, "lines"
    for line in reversed(lines) if tail else lines:
        if len(kept) >= MAX_LINES:
            break
        n = _nbytes(line) + (1 if kept else 0)
        if size + n > MAX_BYTES:
            by = "bytes"
            if tail and not kept:  # the end of one over-long line
                raw = line.encode("utf-8")[-MAX_BYTES:]
                skip = next((i for i, b in enumerate(raw) if b & 0xC0 != 0x80), len(raw))
                kept, out["lastLinePartial"] = [raw[skip:].decode("utf-8")], True
            break
        kept.append(line)
        size += n
    content = "\n".join(reversed(kept) if tail else kept)
    by = "lines" if len(kept) >= MAX_LINES and size <= MAX_BYTES else by
    out |= {"content": content, "truncated": True, "truncatedBy": by, "outputLines": len(kept)}
    return out | {"outputBytes": _nbytes(content)}


# --- bash (Pi's bash.js, output-accumulator.js, child-process.js) ------------------------------


class _Output:
    """Pi's OutputAccumulator: a decoded rolling tail for display; the raw output spills to a
    temp file (``pi-bash-*.log``) once it passes the display limits."""

    def __init__(self, tmp_dir: Path | None) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chunks: list[bytes] = []
        self._tail, self._tail_at_line_start = "", True
        self.raw_bytes = self.decoded_bytes = self._lines = self.last_line_bytes = 0
        self._open_line, self._tmp_dir = False, tmp_dir
        self.path: str | None = None
        self._file: BinaryIO | None = None

    @property
    def total_lines(self) -> int:
        return self._lines + self._open_line

    def append(self, data: bytes, final: bool = False) -> None:
        self.raw_bytes += len(data)
        if text := self._decoder.decode(data, final):
            n = _nbytes(text)
            self.decoded_bytes += n
            self._tail += text
            if len(self._tail) > 4 * MAX_BYTES:  # keep ~2 x 50 KB of tail, from a char boundary
                buf = self._tail.encode("utf-8")
                cut = len(buf) - 2 * MAX_BYTES
                while cut < len(buf) and buf[cut] & 0xC0 == 0x80:
                    cut += 1
                self._tail_at_line_start = buf[cut - 1] == 0x0A
                self._tail = buf[cut:].decode("utf-8")
            if (newlines := text.count("\n")) == 0:
                self.last_line_bytes, self._open_line = self.last_line_bytes + n, True
            else:
                self._lines += newlines
                rest = text[text.rindex("\n") + 1 :]
                self.last_line_bytes, self._open_line = _nbytes(rest), bool(rest)
        big = max(self.raw_bytes, self.decoded_bytes) > MAX_BYTES or self.total_lines > MAX_LINES
        if self._file is not None or big:
            self._spill().write(data)
        elif data:
            self._chunks.append(data)

    def _spill(self) -> BinaryIO:
        if self._file is None:
            fd, self.path = tempfile.mkstemp(prefix="pi-bash-", suffix=".log", dir=self._tmp_dir)
            self._file = os.fdopen(fd, "wb")
            self._file.writelines(self._chunks)
            self._chunks = []
        return self._file

    def snapshot(self) -> dict[str, Any]:
        """The display tail with Pi's truncation record (totals over the whole output)."""
        text = self._tail
        if not self._tail_at_line_start and "\n" in text:
            text = text[text.index("\n") + 1 :] or self._tail
        t = truncate(text, tail=True)
        truncated = self.total_lines > MAX_LINES or self.decoded_bytes > MAX_BYTES
        by = t["truncatedBy"] or ("bytes" if self.decoded_bytes > MAX_BYTES else "lines")
        t |= {"truncated": truncated, "truncatedBy": by if truncated else None}
        t |= {"totalLines": self.total_lines, "totalBytes": self.decoded_bytes}
        if truncated and self.path is None:
            self._spill()
        return t

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None

    def full_output(self) -> tuple[str, bool]:
        """``structured.output``: everything, or over 1 MB its head and tail halves."""
        self.close()
        data = Path(self.path).read_bytes() if self.path else b"".join(self._chunks)
        if len(data) <= _STRUCTURED_MAX_BYTES:
            return data.decode("utf-8", "replace"), False
        half = _STRUCTURED_MAX_BYTES // 2
        head = codecs.getincrementaldecoder("utf-8")("replace").decode(data[:half])
        tail = data[len(data) - half :]
        tail = tail[next((i for i, b in enumerate(tail) if b & 0xC0 != 0x80), len(tail)) :]
        omitted = f"\n\n[... {len(data) - 2 * half} bytes omitted ...]\n\n"
        return head + omitted + tail.decode("utf-8", "replace"), True

    def format(self, empty: str) -> tuple[str, dict[str, Any] | None]:
        """Pi's ``formatOutput``: the tail, plus a notice naming the full output if truncated."""
        t = self.snapshot()
        text = t["content"] or empty
        if not t["truncated"]:
            return text, None
        total = t["totalLines"]
        if t["lastLinePartial"]:
            line_size = format_size(self.last_line_bytes)
            text += f"\n\n[Showing last {format_size(t['outputBytes'])} of line {total} "
            text += f"(line is {line_size})."
        else:
            cap = "" if t["truncatedBy"] == "lines" else f" ({format_size(MAX_BYTES)} limit)"
            text += f"\n\n[Showing lines {total - t['outputLines'] + 1}-{total} of {total}{cap}."
        return f"{text} Full output: {self.path}]", {"truncation": t, "fullOutputPath": self.path}


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of group ``pgid`` exists."""
    for entry in os.scandir("/proc"):
        try:
            stat = Path(entry.path, "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


async def _kill_group(proc: trio.Process, grace: float) -> None:
    """SIGTERM the group, SIGKILL it when ``grace`` ends or at once, reap the shell, and wait
    (bounded) until no member is alive. Call shielded."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        if wait > 0:
            _signal_group(proc.pid, sig)
            if sig == signal.SIGKILL:
                await proc.wait()
            with trio.move_on_after(wait):
                while _group_alive(proc.pid):  # noqa: ASYNC110 (no event exists for this)
                    await trio.sleep(0.01)


async def _pump(
    proc: trio.Process, out: _Output, on_update: OnUpdate | None, exited_at: list[float]
) -> None:
    """Read the merged output until EOF, or until it stays idle for Pi's grace after the shell
    exited, with throttled cumulative updates. Returns once the shell exited (its time is
    appended to ``exited_at``)."""
    assert proc.stdout is not None
    reader: list[trio.CancelScope] = []
    last_update, dirty, idle_until = -math.inf, False, math.inf

    async def emit() -> None:
        nonlocal last_update, dirty
        dirty, last_update = False, trio.current_time()
        if on_update is not None:
            t = out.snapshot()
            details = {"truncation": t, "fullOutputPath": out.path} if t["truncated"] else {}
            text = [{"type": "text", "text": t["content"]}]
            await on_update(ToolResult(content=text, details=details))

    async def wait_exit() -> None:
        await proc.wait()
        exited_at.append(trio.current_time())
        for scope in reader:
            scope.deadline = min(scope.deadline, exited_at[0] + _EXIT_STDIO_GRACE)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_exit)
        while True:
            if exited_at and idle_until == math.inf:
                idle_until = exited_at[0] + _EXIT_STDIO_GRACE
            chunk: bytes | None = None
            with trio.CancelScope(
                deadline=min(last_update + _UPDATE_THROTTLE if dirty else math.inf, idle_until)
            ) as scope:
                reader[:] = [scope]
                chunk = bytes(await proc.stdout.receive_some(65536))
            reader.clear()
            now = trio.current_time()
            if chunk == b"" or (chunk is None and now >= idle_until):
                break
            if chunk:
                out.append(chunk)
                idle_until = now + _EXIT_STDIO_GRACE if exited_at else idle_until
                dirty = True
            if dirty and now >= last_update + _UPDATE_THROTTLE:
                await emit()
        if dirty:
            await emit()


def _non_cancelled(exc: BaseException) -> BaseException | None:
    """``exc`` without its Cancelled parts, unwrapped from one-exception groups; None if only
    cancellation is left."""
    rest = exc.split(trio.Cancelled)[1] if isinstance(exc, BaseExceptionGroup) else exc
    while isinstance(rest, BaseExceptionGroup) and len(rest.exceptions) == 1:
        rest = rest.exceptions[0]
    return None if isinstance(rest, trio.Cancelled) else rest


async def run_bash(
    command: str,
    timeout_seconds: float | None,
    *,
    cwd: Path,
    env: Mapping[str, str],
    tmp_dir: Path | None,
    kill_grace: float,
    on_update: OnUpdate | None,
) -> ToolResult:
    """Run ``command`` as Pi's ``bash`` tool does (see the module docstring): ``timeout_seconds``
    (None: none), the full output spilled under ``tmp_dir`` (None: the temp dir),
    ``kill_grace`` seconds from SIGTERM to SIGKILL on abort (0: SIGKILL at once)."""
    if timeout_seconds is not None and (not math.isfinite(timeout_seconds) or timeout_seconds <= 0):
        return _error("Invalid timeout: must be a finite number of seconds")
    if timeout_seconds is not None and timeout_seconds > _MAX_TIMEOUT_SECONDS:
        return _error(f"Invalid timeout: maximum is {_MAX_TIMEOUT_SECONDS} seconds")
    if not cwd.is_dir():  # noqa: ASYNC240 (one stat, before anything starts)
        return _error(f"Working directory does not exist: {cwd}\nCannot execute bash commands.")
    out, exited_at = _Output(tmp_dir), list[float]()
    if on_update is not None:
        await on_update(ToolResult(content=[], details=None))
    started = trio.current_time()
    deadline = started + timeout_seconds if timeout_seconds is not None else math.inf
    proc = await trio.lowlevel.open_process(
        [shutil.which("bash") or "sh", "-c", command],
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # Pi spawns detached: the command leads its own process group
    )
    assert proc.stdout is not None
    try:
        with trio.move_on_at(deadline) as timeout_scope:
            await _pump(proc, out, on_update, exited_at)
        if timeout_scope.cancelled_caught:
            _signal_group(proc.pid, signal.SIGKILL)  # Pi's timeout: SIGKILL the group at once
            await proc.wait()
            with trio.move_on_after(_EXIT_STDIO_GRACE):
                while chunk := bytes(await proc.stdout.receive_some(65536)):
                    out.append(chunk)
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            await _kill_group(proc, kill_grace)
            await proc.stdout.aclose()
        out.append(b"", final=True)
        text = out.format("")[0]
        out.close()
        if (rest := _non_cancelled(exc)) is None:
            return _error(f"{text}\n\nCommand aborted" if text else "Command aborted")
        if rest is exc:
            raise
        raise rest from exc
    with trio.CancelScope(shield=True):
        await proc.stdout.aclose()
    out.append(b"", final=True)
    assert proc.returncode is not None  # the shell has been reaped
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    if timeout_scope.cancelled_caught:
        text = out.format("")[0]
        out.close()
        status = f"Command timed out after {js_string(timeout_seconds)} seconds"
        if exited_at and exited_at[0] < deadline:
            after = js_string(_tenths(exited_at[0] - started))
            status += (
                f". The shell exited with code {code} after {after} seconds, but background "
                "processes it started kept writing output until the timeout."
            )
        return _error(f"{text}\n\n{status}" if text else status)
    text, details = out.format("(no output)")
    full, truncated = out.full_output()
    structured: dict[str, Any] = {"output": full, "truncated": truncated}
    if truncated:
        structured["full_output_path"] = out.path
    structured |= {"exit_code": code, "wall_time_seconds": _tenths(trio.current_time() - started)}
    text = f"{text}\n\nCommand exited with code {code}" if code else text
    content = [{"type": "text", "text": text}]
    return ToolResult(content=content, is_error=code != 0, details=details, structured=structured)


def _tenths(seconds: float) -> float:
    """JavaScript's ``Math.round(seconds * 10) / 10``."""
    return math.floor(seconds * 10 + 0.5) / 10


def _error(text: str) -> ToolResult:
    """Pi's ``createErrorToolResult`` (as in :mod:`fake_pi._tools`)."""
    return ToolResult(content=[{"type": "text", "text": text}], is_error=True, details={})
