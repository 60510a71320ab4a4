"""The Fake-Pi agent loop: turns, model calls, tools, steering, abort and retry.

One *run* goes from ``agent_start`` to ``agent_settled``; it may hold several
``agent_start … agent_end`` pairs (auto-retries) and several turns (tool
rounds, steering, follow-ups), exactly as Pi 1.6.0 sequences them (see
``docs/design/pi-observed.md`` §4, §7 and the RPC transcripts). Events go out
through the ``emit`` callback; messages are persisted at ``message_end``.

Abort cancels the one operation in flight (a model stream, a tool, a retry
wait) through its own cancel scope, then emits what Pi emits after an abort;
a shutdown abort (stdin closed, SIGTERM) persists the same but prints nothing
more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from runtime.worker_kit import WallClock, iso_timestamp

from ._behaviours import Barriers, Recorder
from ._compaction import (
    CompactionError,
    CompactionSettings,
    compact,
    compaction_entry,
    estimate_projected_context_tokens,
    estimate_tokens,
    prepare_compaction,
    should_compact,
    tokens_after_reply,
)
from ._gate import AllowAllGate, ToolCall, ToolGate, ToolResult
from ._messages import (
    assistant_message,
    project_path,
    request_messages,
    system_message,
    tool_result_message,
    user_message,
)
from ._model import Assembler, ModelClient, ModelError
from ._retry import RetrySettings, is_retryable
from ._tools import Tool, ToolContext, run_tool_call

__all__ = ["Agent", "AgentOptions", "CommandError", "ModelInfo"]

Emit = Callable[[dict[str, Any]], Awaitable[None]]
ABORTED_TEXT = "This operation was aborted"
"""Pi's errorMessage for the empty reply that ends a run aborted between requests."""
REQUEST_ABORTED = "Request was aborted"
"""Pi's errorMessage for a reply aborted while its request was streaming."""
SNIPPETS = {
    "read": "Read file contents",
    "bash": "Execute bash commands (ls, grep, find, etc.)",
    "edit": "Make precise file edits with exact text replacement",
    "write": "Create or overwrite files",
}
PREAMBLE = (
    "You are Fake-Pi, a credential-free stand-in for the Pi coding agent. "
    "Help users inspect files, run commands, and modify code."
)


class CommandError(Exception):
    """An RPC command is refused; the message is Pi's error text."""


class _Aborted(Exception):
    pass


@dataclass(frozen=True)
class ModelInfo:
    provider: str = "fake"
    id: str = "fake-model"
    name: str = "Fake Model"
    base_url: str = ""
    context_window: int = 128000
    max_tokens: int = 4096

    def as_pi(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "api": "openai-completions",
            "provider": self.provider,
            "baseUrl": self.base_url,
            "reasoning": False,
            "input": ["text"],
            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
            "contextWindow": self.context_window,
            "maxTokens": self.max_tokens,
        }


@dataclass
class AgentOptions:
    cwd: Path
    client: ModelClient
    tools: dict[str, Tool]
    clock: WallClock
    conversation: Any
    """A :class:`~fake_pi._conversation.Conversation`."""
    barriers: Barriers
    model: ModelInfo = field(default_factory=ModelInfo)
    gate: ToolGate = field(default_factory=AllowAllGate)
    retry: RetrySettings = field(default_factory=RetrySettings)
    compaction: CompactionSettings = field(default_factory=CompactionSettings)
    append_system_prompt: list[str] = field(default_factory=list)
    tool_env: dict[str, str] = field(default_factory=dict)
    ledger_path: Path | None = None
    recorder: Recorder = field(default_factory=lambda: Recorder(None))
    steering_mode: str = "one-at-a-time"
    """Pi's ``steeringMode`` setting: ``one-at-a-time`` (one queued steer per turn) or
    ``all`` (every queued steer goes into the next request)."""
    sequential_tools: bool = False
    """Run a round's calls one after the other (what the runtime's gate extension asks
    of Pi with ``executionMode: "sequential"``); Pi's default is parallel."""


class Agent:
    """Pi's agent session, in Trio. Use through :func:`fake_pi._rpc.serve_rpc`."""

    def __init__(self, options: AgentOptions, emit: Emit) -> None:
        self.options = options
        self.conversation = options.conversation
        self._emit_raw = emit
        self.running = False
        self.steering: list[str] = []
        self.follow_up: list[str] = []
        self._op_scope: trio.CancelScope | None = None
        self._abort_requested = False
        self._quiet = False
        self._settled = trio.Event()
        self._settled.set()
        self._nursery: trio.Nursery | None = None
        self.compacting = False

    # -- plumbing -------------------------------------------------------------------

    def attach(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    async def emit(self, event: dict[str, Any]) -> None:
        if not self._quiet:
            await self._emit_raw(event)

    def _now(self) -> int:
        return self.options.clock.time_ms()

    async def _queue_update(self) -> None:
        await self.emit(
            {
                "type": "queue_update",
                "steering": list(self.steering),
                "followUp": list(self.follow_up),
            }
        )

    # -- commands -------------------------------------------------------------------

    def start_prompt(self, text: str) -> None:
        """Start a run with ``text`` (the caller already answered ``started``)."""
        assert self._nursery is not None
        self.running = True
        self._abort_requested = False
        self._settled = trio.Event()
        self._nursery.start_soon(self._run, text)

    async def queue(self, text: str, behaviour: str) -> None:
        (self.steering if behaviour == "steer" else self.follow_up).append(text)
        await self._queue_update()

    async def clear_queue(self) -> dict[str, Any]:
        removed = {"steering": self.steering, "followUp": self.follow_up}
        self.steering, self.follow_up = [], []
        await self._queue_update()
        return removed

    async def abort(self) -> None:
        """Abort the run in flight and wait until it settled."""
        if not self.running:
            return
        self._abort_requested = True
        if self._op_scope is not None:
            self._op_scope.cancel()
        await self._settled.wait()

    async def shutdown(self) -> None:
        """Aborting shutdown (stdin closed, SIGTERM): persist, print nothing more."""
        self._quiet = True
        await self.abort()

    # -- views ----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """``get_state``'s data, in Pi's key order."""
        state: dict[str, Any] = {
            "model": self.options.model.as_pi(),
            "thinkingLevel": "off",
            "isStreaming": self.running,
            "isCompacting": self.compacting,
            "steeringMode": self.options.steering_mode,
            "followUpMode": "one-at-a-time",
        }
        if self.conversation.path is not None:
            state["sessionFile"] = str(self.conversation.path)
        state["sessionId"] = self.conversation.session_id
        state["autoCompactionEnabled"] = self.options.compaction.enabled
        state["messageCount"] = len(self.conversation.context())
        state["pendingMessageCount"] = len(self.steering) + len(self.follow_up)
        return state

    def session_stats(self) -> dict[str, Any]:
        messages = [e["message"] for e in self.conversation.entries() if e.get("type") == "message"]
        roles = [m.get("role") for m in messages]
        assistants = [m for m in messages if m.get("role") == "assistant"]
        tokens = {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}
        for m in assistants:
            for key in tokens:
                tokens[key] += int(m.get("usage", {}).get(key, 0))
        last = next((m for m in reversed(assistants) if m.get("stopReason") != "aborted"), None)
        context_tokens = int(last["usage"].get("totalTokens", 0)) if last else 0
        window = self.options.model.context_window
        stats: dict[str, Any] = {}
        if self.conversation.path is not None:
            stats["sessionFile"] = str(self.conversation.path)
        stats.update(
            sessionId=self.conversation.session_id,
            userMessages=roles.count("user"),
            assistantMessages=roles.count("assistant"),
            toolCalls=sum(
                1 for m in assistants for b in m["content"] if b.get("type") == "toolCall"
            ),
            toolResults=roles.count("toolResult"),
            totalMessages=len(roles),
            tokens={**tokens, "total": sum(tokens.values())},
            cost=0,
            contextUsage={
                "tokens": context_tokens,
                "contextWindow": window,
                "percent": context_tokens / window * 100 if window else 0,
            },
        )
        return stats

    # -- the run --------------------------------------------------------------------

    async def _run(self, text: str) -> None:
        aborted = False
        try:
            await self._loop([user_message(text, time_ms=self._now())])
        except _Aborted:
            aborted = True
        finally:
            self.running = False
            self._op_scope = None
        # the ``settled:N`` barrier: a shutdown's run (its agent_settled never printed) passes none
        if not self._quiet:
            await self.options.barriers.reach("settled")
        await self.emit({"type": "agent_settled", "aborted": aborted})
        self._settled.set()

    def _system_message(self) -> dict[str, Any]:
        tools = self.options.tools.values()
        listing = (
            "\n".join(
                f"- {t.name}: {SNIPPETS.get(t.name, t.description.split('. ')[0])}" for t in tools
            )
            or "(none)"
        )
        sections = {
            "preamble": PREAMBLE,
            "tools": f"<tools>\n{listing}\n\nAdditional tools may be available.\n</tools>",
            "rules": "<rules>\n- Be concise in your responses\n"
            "- Show file paths clearly when working with files\n</rules>",
            "docs": "<docs>\nFake-Pi has no documentation of its own; see pi-runtime's.\n</docs>",
        }
        if self.options.append_system_prompt:
            addendum = "\n\n".join(self.options.append_system_prompt)
            sections["addendum"] = f"<addendum>\n{addendum}\n</addendum>"
        sections["cwd"] = f"<cwd>\n{self.options.cwd}\n</cwd>"
        schemas = [
            {"name": t.name, "description": t.description, "parameters": t.parameters}
            for t in tools
        ]
        return system_message(sections, schemas, time_ms=self._now())

    async def _record(self, message: dict[str, Any], produced: list[dict[str, Any]]) -> None:
        await self.emit({"type": "message_start", "message": message})
        await self.emit({"type": "message_end", "message": message})
        self.conversation.append_message(message)
        produced.append(message)

    async def _loop(self, inputs: list[dict[str, Any]]) -> None:
        retry_attempt = 0
        produced: list[dict[str, Any]] = []
        continuing = False  # a later turn of this loop (not a retry): Pi may compact first
        queued: str | None = None  # the queue ``inputs`` came from ("steering"/"followUp")
        await self.options.barriers.reach("agent_start")
        await self.emit({"type": "agent_start"})
        while True:
            if continuing:
                await self._compact_before_turn()
            continuing = False
            await self.emit({"type": "turn_start"})
            if self.conversation.needs_system_message:
                await self._record(self._system_message(), produced)
            for index, message in enumerate(inputs):
                if queued is not None:
                    # Pi takes a delivered text off its queue at the message's own
                    # message_start (after turn_start and any compaction) and prints
                    # queue_update then: one per message, the rest of the batch still shown.
                    later = [m["content"][0]["text"] for m in inputs[index + 1 :]]
                    shown = {"steering": list(self.steering), "followUp": list(self.follow_up)}
                    shown[queued] = later + shown[queued]
                    await self.emit({"type": "queue_update", **shown})
                await self._record(message, produced)
            inputs, queued = [], None
            assistant = await self._call_model(produced)
            stop = assistant["stopReason"]
            if stop == "error":
                await self.emit({"type": "turn_end", "message": assistant, "toolResults": []})
                retry = self.options.retry
                message = assistant.get("errorMessage", "")
                if retry.enabled and is_retryable(message) and retry_attempt < retry.max_retries:
                    retry_attempt += 1
                    await self.emit({"type": "agent_end", "messages": produced, "willRetry": True})
                    produced = []
                    await self._retry_wait(retry_attempt, message, assistant)
                    # Pi retries with agent.continue(), whose loop polls the steering queue
                    # before its first request: a steer queued before the retry (while the
                    # request failed or Pi waited) goes into the retried request.
                    inputs, queued = self._take_steering(), "steering"
                    await self.emit({"type": "agent_start"})
                    continue
                await self.emit({"type": "agent_end", "messages": produced, "willRetry": False})
                if retry_attempt:
                    await self.emit(
                        {
                            "type": "auto_retry_end",
                            "success": False,
                            "attempt": retry_attempt,
                            "finalError": message,
                        }
                    )
                await self._compact_after_run(assistant)
                return
            if retry_attempt:
                await self.emit(
                    {"type": "auto_retry_end", "success": True, "attempt": retry_attempt}
                )
                retry_attempt = 0
            if stop == "aborted":
                await self.emit({"type": "turn_end", "message": assistant, "toolResults": []})
                await self.emit({"type": "agent_end", "messages": produced, "willRetry": False})
                raise _Aborted
            calls = [b for b in assistant["content"] if b.get("type") == "toolCall"]
            results = await self._run_tools(calls, produced) if calls else []
            await self.emit({"type": "turn_end", "message": assistant, "toolResults": results})
            if self._abort_requested:
                await self.emit({"type": "turn_start"})
                aborted = self._aborted_message()
                await self._record(aborted, produced)
                await self.emit({"type": "turn_end", "message": aborted, "toolResults": []})
                await self.emit({"type": "agent_end", "messages": produced, "willRetry": False})
                raise _Aborted
            if self.steering:
                inputs, queued = self._take_steering(), "steering"
            elif not calls and self.follow_up:
                inputs = [user_message(self.follow_up.pop(0), time_ms=self._now())]
                queued = "followUp"
            elif not calls:
                break
            continuing = True
        await self.emit({"type": "agent_end", "messages": produced, "willRetry": False})
        await self._compact_after_run(assistant)

    def _take_steering(self) -> list[dict[str, Any]]:
        """The queued steers for the next request (``steeringMode``: one, or all)."""
        taken = len(self.steering) if self.options.steering_mode == "all" else 1
        texts, self.steering = self.steering[:taken], self.steering[taken:]
        return [user_message(text, time_ms=self._now()) for text in texts]

    # -- compaction (Pi's _checkCompaction / _runAutoCompaction) ---------------------

    async def _compact_before_turn(self) -> None:
        """Pi's ``_compactBeforeNextAssistantResponse``: between turns of a run, compact
        when the projected context (last usage + later messages) passes the threshold.
        An abort meanwhile ends the next request as aborted, as in Pi."""
        window = self.options.model.context_window
        branch = self.conversation.path_entries()
        tokens = estimate_projected_context_tokens(project_path(branch), branch)
        if window > 0 and should_compact(tokens, window, self.options.compaction):
            await self._compact("threshold")

    async def _compact_after_run(self, assistant: dict[str, Any]) -> None:
        """Pi's threshold check after a run (between ``agent_end`` and ``agent_settled``)."""
        settings = self.options.compaction
        if not settings.enabled or assistant.get("stopReason") == "aborted":
            return
        tokens = tokens_after_reply(assistant, self.conversation.path_entries())
        window = self.options.model.context_window
        due = tokens is not None and should_compact(tokens, window, settings)
        if due and await self._compact("threshold"):
            raise _Aborted

    async def _compact(self, reason: str) -> bool:
        """Summarize through the model, append the ``compaction`` entry and emit
        ``compaction_start/end``; returns whether it was aborted."""
        preparation = prepare_compaction(self.conversation.path_entries(), self.options.compaction)
        if preparation is None:
            return False
        model = self.options.model
        self.compacting = True
        await self.emit({"type": "compaction_start", "reason": reason})
        error: str | None = None
        try:
            with trio.CancelScope() as scope:
                self._op_scope = scope
                if self._abort_requested:
                    scope.cancel()
                try:
                    result = await compact(
                        preparation,
                        self.options.client,
                        model_id=model.id,
                        max_tokens=model.max_tokens,
                    )
                except CompactionError as exc:
                    error = str(exc)
            self._op_scope = None
            if scope.cancelled_caught or error is not None:
                end: dict[str, Any] = {"type": "compaction_end", "reason": reason}
                end.update(aborted=scope.cancelled_caught, willRetry=False)
                if not scope.cancelled_caught:
                    end["errorMessage"] = f"Auto-compaction failed: {error}"
                await self.emit(end)
                return scope.cancelled_caught
            now = self._now()
            entry = compaction_entry(
                result,
                timestamp=iso_timestamp(now),
                time_ms=now,
                context=self.conversation.context(),
            )
            self.conversation.append(entry)
            after = sum(estimate_tokens(m) for m in self.conversation.context())
            await self.emit(
                {
                    "type": "compaction_end",
                    "reason": reason,
                    "result": result.as_pi(estimated_tokens_after=after),
                    "aborted": False,
                    "willRetry": False,
                }
            )
            return False
        finally:
            self.compacting = False

    async def _retry_wait(self, attempt: int, message: str, failed: dict[str, Any]) -> None:
        delay_ms = self.options.retry.delay_ms(attempt)
        await self.emit(
            {
                "type": "auto_retry_start",
                "attempt": attempt,
                "maxAttempts": self.options.retry.max_retries,
                "delayMs": delay_ms,
                "errorMessage": message,
            }
        )
        target = self.conversation.leaf_id
        entry = self.conversation.append(
            {"type": "context_edit", "targetId": target, "replacement": None}
        )
        await self.emit({"type": "entry_appended", "entry": entry})
        with trio.CancelScope() as scope:
            self._op_scope = scope
            if self._abort_requested:
                scope.cancel()
            await trio.sleep(delay_ms / 1000)
        self._op_scope = None
        if scope.cancelled_caught:
            await self.emit(
                {
                    "type": "auto_retry_end",
                    "success": False,
                    "attempt": attempt,
                    "finalError": "Retry cancelled",
                }
            )
            raise _Aborted

    def _aborted_message(self) -> dict[str, Any]:
        model = self.options.model
        message = assistant_message(provider=model.provider, model=model.id, time_ms=self._now())
        timestamp = message.pop("timestamp")
        message["stopReason"] = "aborted"
        message["errorMessage"] = ABORTED_TEXT
        message["timestamp"] = timestamp
        message["durationMs"] = 0
        message["thinkingLevel"] = "off"
        return message

    def request_body(self) -> dict[str, Any]:
        model = self.options.model
        return {
            "model": model.id,
            "messages": request_messages(self.conversation.context()),
            "stream": True,
            "stream_options": {"include_usage": True},
            "store": False,
            "max_completion_tokens": model.max_tokens,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.parameters,
                    },
                }
                for t in self.options.tools.values()
            ],
        }

    async def _call_model(self, produced: list[dict[str, Any]]) -> dict[str, Any]:
        """One model request; returns the finished (or failed/aborted) assistant message."""
        if self._abort_requested:
            message = self._aborted_message()
            await self._record(message, produced)
            return message
        barriers = self.options.barriers
        await barriers.reach("before_model")
        model = self.options.model
        message = assistant_message(provider=model.provider, model=model.id, time_ms=self._now())
        assembler = Assembler(message)
        started = trio.current_time()
        body = self.request_body()
        # Like Pi, the reply's message_start goes out once the response has started;
        # a request that fails or is aborted before that starts with the final message.
        announced = False

        def elapsed() -> int:
            return int((trio.current_time() - started) * 1000)

        with trio.CancelScope() as scope:
            self._op_scope = scope
            try:
                async with contextlib.aclosing(self.options.client.stream(body)) as chunks:
                    async for chunk in chunks:
                        if not announced:
                            announced = True
                            await self.emit({"type": "message_start", "message": message})
                            await barriers.reach("mid_stream")
                        for event in assembler.feed(chunk):
                            await self._update(message, event)
                for event in assembler.finish(duration_ms=elapsed()):
                    await self._update(message, event)
            except ModelError as exc:
                assembler.fail(reason="error", error_message=exc.message, duration_ms=elapsed())
        self._op_scope = None
        if scope.cancelled_caught:
            ended = assembler.fail(
                reason="aborted", error_message=REQUEST_ABORTED, duration_ms=elapsed()
            )
            if announced:
                for event in ended:
                    await self._update(message, event)
        if not announced:
            await self.emit({"type": "message_start", "message": message})
        await self.emit({"type": "message_end", "message": message})
        self.conversation.append_message(message)
        produced.append(message)
        await barriers.reach("after_model")
        return message

    async def _update(self, message: dict[str, Any], event: dict[str, Any]) -> None:
        await self.emit(
            {"type": "message_update", "usage": message["usage"], "assistantMessageEvent": event}
        )

    async def _run_tools(
        self, blocks: list[dict[str, Any]], produced: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Run a round's tool calls the way Pi does (docs/design/pi-observed.md §4).

        Parallel by default: every ``tool_execution_start`` in order, the calls
        run concurrently, each ``tool_execution_end`` as it finishes, then the
        toolResult messages in the assistant's order. With ``sequential_tools``
        each call starts, ends and records its result before the next starts.
        """
        if self.options.sequential_tools:
            messages: list[dict[str, Any]] = []
            for block in blocks:
                call, started = await self._start_tool(block)
                with trio.CancelScope() as scope:
                    self._op_scope = scope
                    if self._abort_requested:
                        scope.cancel()
                    result = await self._execute(call)
                self._op_scope = None
                messages.append(await self._end_tool(call, started, result))
                await self._record(messages[-1], produced)
                await self.options.barriers.reach("after_tool")
                if self._abort_requested:
                    break
            return messages
        starts = [await self._start_tool(block) for block in blocks]
        results: list[ToolResult | None] = [None] * len(starts)
        ended: list[dict[str, Any] | None] = [None] * len(starts)

        async def run(index: int) -> None:
            call, started = starts[index]
            results[index] = await self._execute(call)  # an abort returns its own result
            ended[index] = await self._end_tool(call, started, results[index])

        with trio.CancelScope() as scope:
            self._op_scope = scope
            if self._abort_requested:
                scope.cancel()
            async with trio.open_nursery() as nursery:
                for index in range(len(starts)):
                    nursery.start_soon(run, index)
        self._op_scope = None
        messages = []
        for index, message in enumerate(ended):
            if message is None:  # the abort came before it could report
                call, started = starts[index]
                message = await self._end_tool(call, started, results[index])
            await self._record(message, produced)
            await self.options.barriers.reach("after_tool")
            messages.append(message)
        return messages

    async def _start_tool(self, block: dict[str, Any]) -> tuple[ToolCall, float]:
        await self.options.barriers.reach("before_tool")
        call = ToolCall(id=block["id"], name=block["name"], arguments=block["arguments"])
        start = {"type": "tool_execution_start", "toolCallId": call.id, "toolName": call.name}
        await self.emit({**start, "args": call.arguments})
        self.options.recorder.record("tool", id=call.id, name=call.name, args=call.arguments)
        return call, trio.current_time()

    async def _execute(self, call: ToolCall) -> ToolResult:
        options = self.options

        async def on_update(partial: ToolResult) -> None:
            update = {"type": "tool_execution_update", "toolCallId": call.id}
            await self.emit(
                {
                    **update,
                    "toolName": call.name,
                    "args": call.arguments,
                    "partialResult": _result_payload(partial),
                }
            )

        context = ToolContext(
            cwd=options.cwd, env=options.tool_env, ledger_path=options.ledger_path
        )
        return await run_tool_call(
            options.tools.get(call.name), call, context, options.gate, on_update
        )

    async def _end_tool(
        self, call: ToolCall, started: float, result: ToolResult | None
    ) -> dict[str, Any]:
        """Emit ``tool_execution_end``; return the toolResult message (not yet recorded).

        ``None`` is a call cancelled before its tool could answer (an abort)."""
        if result is None:
            result = ToolResult(
                content=[{"type": "text", "text": "Command aborted"}], is_error=True, details={}
            )
        duration = int((trio.current_time() - started) * 1000)
        await self.emit(
            {
                "type": "tool_execution_end",
                "toolCallId": call.id,
                "toolName": call.name,
                "result": _result_payload(result),
                "isError": result.is_error,
                "durationMs": duration,
            }
        )
        return tool_result_message(
            tool_call_id=call.id,
            tool_name=call.name,
            content=result.content,
            is_error=result.is_error,
            time_ms=self._now(),
            duration_ms=duration,
            details=result.details,
        )


def _result_payload(result: ToolResult) -> dict[str, Any]:
    payload: dict[str, Any] = {"content": result.content}
    if result.details is not None:
        payload["details"] = result.details
    if result.structured is not None:
        payload["structuredContent"] = result.structured
    return payload
