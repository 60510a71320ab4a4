"""Calling the model: clients for the two transports, and the stream assembler.

Fake-Pi calls its model the way Pi does: an OpenAI-compatible streaming
``chat/completions`` endpoint over HTTP (:class:`HttpModelClient`, used by the
subprocess, so the runtime's model gateway can sit in front of it exactly as in
front of the real Pi), or a direct call in-process (:class:`InProcessModelClient`,
so a MockClock drives the model's delays). Both yield the same chunk dicts.

:class:`Assembler` turns chunks into Pi's assistant message and its
``assistantMessageEvent`` stream (``text_*``, ``thinking_*``, ``toolcall_*``),
mirroring Pi's ``openai-completions`` provider.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any, Final, Protocol

import msgspec
import trio

from runtime.worker_kit import ConnectionPool, HttpClientError, iter_sse

from ._messages import usage
from .model_server import ModelHttpError, ScriptedModel, StreamCut

__all__ = ["Assembler", "HttpModelClient", "InProcessModelClient", "ModelClient", "ModelError"]

_json = msgspec.json.Encoder()
CUT_MESSAGE = "terminated: other side closed (UND_ERR_SOCKET)"
"""What Pi (Node's fetch) reports for a stream whose connection dropped mid-way."""


class ModelError(Exception):
    """The model call failed; ``message`` is what Pi puts in ``errorMessage``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _http_error_message(status: int, body: bytes) -> str:
    """Pi's rendering: ``"<status>: <JSON of the error object>"``."""
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return f"{status} status code ({body[:200].decode(errors='replace')})"
    error = decoded.get("error", decoded) if isinstance(decoded, dict) else decoded
    return f"{status}: {_json.encode(error).decode()}"


class ModelClient(Protocol):
    def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """Chunk dicts of one streamed response; :class:`ModelError` on failure."""
        ...


class InProcessModelClient:
    """Calls a :class:`ScriptedModel` directly (virtual time friendly)."""

    def __init__(self, model: ScriptedModel) -> None:
        self.model = model

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        chunks = self.model.stream(body)
        try:
            async for chunk in chunks:
                yield chunk
        except ModelHttpError as exc:
            raise ModelError(_http_error_message(exc.status, _json.encode(exc.body))) from exc
        except StreamCut as exc:
            raise ModelError(CUT_MESSAGE) from exc
        finally:
            await chunks.aclose()


_DRAIN_SECONDS: Final = 1.0
"""How long a stream may take to end after its ``[DONE]`` for its connection to be kept."""


class HttpModelClient:
    """POSTs to ``{base_url}/chat/completions`` and parses the SSE stream, on one kept-alive
    connection as Pi's (Node's) HTTP agent does: a stream read to its end leaves its
    connection for the next request."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self._connections = ConnectionPool()

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        headers = [("content-type", "application/json"), ("accept", "application/json")]
        if self.api_key:
            headers.append(("authorization", f"Bearer {self.api_key}"))
        try:
            async with self._connections.request(
                "POST",
                f"{self.base_url}/chat/completions",
                headers=headers,
                body=_json.encode(body),
            ) as response:
                if response.status != 200:
                    raise ModelError(_http_error_message(response.status, await response.read()))
                events = iter_sse(response.iter_bytes())
                try:
                    async for event in events:
                        if event.data is None:
                            continue  # keepalive comment
                        if event.data == "[DONE]":
                            break
                        yield msgspec.json.decode(event.data)
                finally:
                    await events.aclose()
                # what follows [DONE] is read only to keep the connection: the answer is
                # whole, so a stream cut or slow here just closes the connection
                with trio.move_on_after(_DRAIN_SECONDS), contextlib.suppress(HttpClientError):
                    await response.read()
        except HttpClientError as exc:
            raise ModelError(CUT_MESSAGE) from exc


_STOP_REASONS = {"stop": "stop", "tool_calls": "toolUse", "length": "length"}


class Assembler:
    """Builds the assistant message from chunks; returns the events to emit.

    Mirrors Pi's ``openai-completions`` provider: one text block and one
    thinking block at most (later deltas append to them), a block per tool
    call; no block ends while the stream runs — all end, in content order,
    when the stream finishes or is aborted. A stream that fails ends none.
    """

    def __init__(self, message: dict[str, Any]) -> None:
        self.message = message
        self._text: int | None = None
        self._thinking: int | None = None
        self._call_by_index: dict[int, int] = {}  # provider tool index -> contentIndex
        self._raw_args: dict[int, str] = {}
        self.finish_reason: str | None = None
        self.response_id: str | None = None

    @property
    def content(self) -> list[dict[str, Any]]:
        content: list[dict[str, Any]] = self.message["content"]
        return content

    def _end_all(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for index, block in enumerate(self.content):
            if block["type"] == "text":
                events.append({"type": "text_end", "contentIndex": index, "content": block["text"]})
            elif block["type"] == "thinking":
                end = {"type": "thinking_end", "contentIndex": index}
                events.append({**end, "content": block["thinking"]})
            else:
                try:
                    block["arguments"] = msgspec.json.decode(self._raw_args.get(index) or "{}")
                except msgspec.DecodeError:
                    block["arguments"] = {}
                events.append({"type": "toolcall_end", "contentIndex": index, "toolCall": block})
        return events

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._text is None:
            self.content.append({"type": "text", "text": ""})
            self._text = len(self.content) - 1
            events.append({"type": "text_start", "contentIndex": self._text})
        self.content[self._text]["text"] += text
        events.append({"type": "text_delta", "contentIndex": self._text, "delta": text})
        return events

    def _thinking_delta(self, field: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._thinking is None:
            block = {"type": "thinking", "thinking": "", "thinkingSignature": field}
            self.content.append(block)
            self._thinking = len(self.content) - 1
            events.append({"type": "thinking_start", "contentIndex": self._thinking})
        self.content[self._thinking]["thinking"] += text
        events.append({"type": "thinking_delta", "contentIndex": self._thinking, "delta": text})
        return events

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        self.response_id = chunk.get("id", self.response_id)
        if chunk.get("usage"):
            u = chunk["usage"]
            self.message["usage"] = usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            for field in ("reasoning_content", "reasoning", "reasoning_text"):
                if delta.get(field):
                    events += self._thinking_delta(field, delta[field])
                    break
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._tool_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        provider_index = call.get("index", 0)
        function = call.get("function") or {}
        index = self._call_by_index.get(provider_index)
        if index is None:
            block = {
                "type": "toolCall",
                "id": call.get("id") or f"call_{len(self.content)}",
                "name": function.get("name", ""),
                "arguments": {},
            }
            self.content.append(block)
            index = len(self.content) - 1
            self._call_by_index[provider_index] = index
            start = {"type": "toolcall_start", "contentIndex": index, "id": block["id"]}
            events.append({**start, "toolName": block["name"]})
        piece = function.get("arguments", "")
        self._raw_args[index] = self._raw_args.get(index, "") + piece
        events.append({"type": "toolcall_delta", "contentIndex": index, "delta": piece})
        return events

    def finish(self, *, duration_ms: int) -> list[dict[str, Any]]:
        """End every block and complete the message; ModelError if unfinished."""
        events = self._end_all()
        if self.finish_reason is None:
            raise ModelError("Stream ended without finish_reason")
        message = self.message
        message["stopReason"] = _STOP_REASONS.get(self.finish_reason, "stop")
        if self.response_id is not None:
            message["responseId"] = self.response_id
        message["rawStopReason"] = self.finish_reason
        message["durationMs"] = duration_ms
        message["thinkingLevel"] = "off"
        return events

    def fail(self, *, reason: str, error_message: str, duration_ms: int) -> list[dict[str, Any]]:
        """End the message as ``error`` (no block ends) or ``aborted`` (every block ends);
        partial content is kept."""
        events = self._end_all() if reason == "aborted" else []
        message = self.message
        message["stopReason"] = reason
        if self.response_id is not None:
            message["responseId"] = self.response_id
        message["errorMessage"] = error_message
        message["durationMs"] = duration_ms
        message["thinkingLevel"] = "off"
        return events
