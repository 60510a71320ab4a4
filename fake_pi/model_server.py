"""The scripted model: an OpenAI-compatible streaming ``chat/completions`` endpoint.

It serves Fake-Pi and the real Pi alike (``finish_reason`` and a usage chunk
included), over HTTP on loopback or called directly in-process, and it counts
every request it receives, so a test can prove a response was not requested
twice. What it answers is decided by a :class:`~fake_pi.scenario.Scenario`
(one step per request), by test directives in the user text when enabled, and
otherwise plainly, with no tool calls.

Run it on its own::

    python -m fake_pi.model_server --port 8000 [--scenario FILE] [--directives]

and point a Pi ``models.json`` provider (``api: openai-completions``) at
``http://127.0.0.1:8000/v1``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from runtime.worker_kit import HttpServer, Request, ResponseWriter, request_digest, serve_http

from .scenario import (
    STAY_SILENT,
    Attach,
    Cut,
    Empty,
    Hang,
    HttpError,
    Scenario,
    StaySilent,
    Step,
    Text,
    Thinking,
    ToolCalls,
    UsageLimit,
    parse_directives,
)

__all__ = [
    "ModelHttpError",
    "ReceivedRequest",
    "ScriptedModel",
    "StreamCut",
    "main",
    "serve_model",
]

_json = msgspec.json.Encoder()


class ModelHttpError(Exception):
    """The model answered with an HTTP error instead of a stream."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"{status} {body.get('error', {}).get('message', '')}")
        self.status = status
        self.body = body


class StreamCut(Exception):
    """The stream was cut off before it finished."""


@dataclass(frozen=True, slots=True)
class ReceivedRequest:
    body: dict[str, Any]
    digest: str
    """sha256 of the canonical (sorted-key) JSON body."""
    step: Step


body_digest = request_digest
"""The runtime gateway's step digest: a test can ask how often a journaled step was paid."""


def _tokens(text: str) -> list[str]:
    """Split into word tokens that keep their trailing spaces."""
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + ([words[-1]] if words[-1] else [])


def _last_message(body: dict[str, Any]) -> dict[str, Any]:
    messages = [m for m in body.get("messages", []) if m.get("role") != "system"]
    return messages[-1] if messages else {}


def _request_problem(body: dict[str, Any]) -> str | None:
    """What makes ``body`` no chat request the model can answer, or ``None``: ``messages``
    (when given) must be a list of objects with a string ``role``, each ``content`` a string,
    null or a list of objects whose ``text``, when given, is a string."""
    messages = body.get("messages", [])
    if not isinstance(messages, list):
        return "messages must be an array of messages"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"messages[{index}] must be an object with a string role"
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(
            isinstance(part, dict) and isinstance(part.get("text", ""), str) for part in content
        ):
            return (
                f"messages[{index}].content must be a string or an array of content parts "
                "with string texts"
            )
    return None


def _invalid_request(problem: str) -> ModelHttpError:
    """The 400 an OpenAI-compatible endpoint answers a malformed request with."""
    error = {"message": problem, "type": "invalid_request_error", "code": None}
    return ModelHttpError(400, {"error": error})


def _text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


@dataclass
class ScriptedModel:
    """Answers chat-completion requests by a scenario; records every request.

    Use :meth:`stream` in-process (delays are ``trio.sleep``, so a MockClock
    drives them) or :func:`serve_model` over HTTP.
    """

    scenario: Scenario = field(default_factory=Scenario)
    directives: bool = False
    """Honour ``#…`` directives in the last user text (tests only)."""
    model_id: str = "fake-model"
    call_id_prefix: str = "call"
    """Server-numbered tool-call ids are ``<prefix>_<n>``, unique over this model's life. A
    test that restarts a host on the same session with a new model gives it another prefix,
    as a real provider's ids never repeat."""
    requests: list[ReceivedRequest] = field(default_factory=list)
    connections: list[int] = field(default_factory=list)
    """Over HTTP: the server's connection number each chat request came on (1, 2, …)."""
    _next: int = 0
    _call_counter: int = 0
    _directed: set[tuple[int, str]] = field(default_factory=set)

    @property
    def request_count(self) -> int:
        return len(self.requests)

    def count(self, digest: str) -> int:
        """How many times a request with this body digest was received."""
        return sum(1 for r in self.requests if r.digest == digest)

    def _default(self, body: dict[str, Any]) -> Step:
        last = _last_message(body)
        if last.get("role") == "tool":
            return Text(text=f"The tool said: {_text_of(last)[:200].strip()}")
        return Text(text=f"You said: {_text_of(last)[:200].strip()}")

    def next_step(self, body: dict[str, Any]) -> Step:
        """Choose the step for this request and record the request."""
        step: Step | None = None
        if self._next < len(self.scenario.steps):
            step = self.scenario.steps[self._next]
            self._next += 1
        elif self.directives:
            # a directive answers its user message once: a retry of the same
            # request (Pi's auto-retry after #fail500) gets the plain answer
            messages = body.get("messages", [])
            last = _last_message(body)
            key = (len(messages), _text_of(last))
            if last.get("role") == "user" and key not in self._directed:
                step = parse_directives(key[1])
                if step is not None:
                    self._directed.add(key)
        if step is None:
            step = self._default(body)
        self.requests.append(ReceivedRequest(body, body_digest(body), step))
        return step

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """Chunks of one streamed response (without the ``[DONE]`` marker).

        Raises :class:`ModelHttpError` before the first chunk for error steps and for a
        malformed request (400 ``invalid_request_error``: not counted, no step taken), and
        :class:`StreamCut` after some chunks for cut and hung streams.
        """
        problem = _request_problem(body)
        if problem is not None:
            raise _invalid_request(problem)
        step = self.next_step(body)
        if isinstance(step, Attach):
            step = step.as_tool_calls()
        number = len(self.requests)
        if step.first_token_delay:
            await trio.sleep(step.first_token_delay)
        base = {
            "id": f"chatcmpl-fake-{number}",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": self.model_id,
        }

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        match step:
            case HttpError(status=status, message=message):
                kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
                raise ModelHttpError(
                    status, {"error": {"message": message, "type": kind, "code": None}}
                )
            case UsageLimit(message=message):
                raise ModelHttpError(
                    429,
                    {
                        "error": {
                            "message": message,
                            "type": "insufficient_quota",
                            "code": "insufficient_quota",
                        }
                    },
                )
        yield chunk({"role": "assistant", "content": ""})
        produced = 0
        finish = "stop"
        match step:
            case Text(text=text, delay=delay):
                for token in _tokens(text):
                    if delay and produced:
                        await trio.sleep(delay)
                    yield chunk({"content": token})
                    produced += 1
            case StaySilent():
                yield chunk({"content": STAY_SILENT})
                produced += 1
            case Thinking(thinking=thinking, text=text, delay=delay):
                for token in _tokens(thinking):
                    if delay and produced:
                        await trio.sleep(delay)
                    yield chunk({"reasoning_content": token})
                    produced += 1
                for token in _tokens(text):
                    if delay:
                        await trio.sleep(delay)
                    yield chunk({"content": token})
                    produced += 1
            case ToolCalls(calls=calls, text=text, delay=delay, omit_ids=omit_ids):
                for token in _tokens(text):
                    yield chunk({"content": token})
                    produced += 1
                for index, call in enumerate(calls):
                    if delay and produced:
                        await trio.sleep(delay)
                    self._call_counter += 1
                    head: dict[str, Any] = {"index": index, "type": "function"}
                    if not omit_ids:
                        head["id"] = call.id or f"{self.call_id_prefix}_{self._call_counter}"
                    head["function"] = {"name": call.name, "arguments": ""}
                    yield chunk({"tool_calls": [head]})
                    arguments = _json.encode(call.arguments).decode()
                    for piece in (
                        arguments[: len(arguments) // 2],
                        arguments[len(arguments) // 2 :],
                    ):
                        yield chunk(
                            {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
                        )
                    produced += 1
                finish = "tool_calls"
            case Hang(seconds=seconds):
                await trio.sleep(seconds)
                raise StreamCut(f"the model hung for {seconds} s and the stream was dropped")
            case Cut(text=text, after_chunks=after, delay=delay):
                for token in _tokens(text)[:after]:
                    if delay and produced:
                        await trio.sleep(delay)
                    yield chunk({"content": token})
                    produced += 1
                raise StreamCut("the stream was cut off in the middle")
            case Empty():
                pass
        yield chunk({}, finish)
        prompt_tokens = max(1, len(_json.encode(body.get("messages", []))) // 4)
        yield {
            **base,
            "choices": [],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": produced,
                "total_tokens": prompt_tokens + produced,
            },
        }

    # -- HTTP ------------------------------------------------------------------------

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        """The HTTP handler: ``POST …/chat/completions`` and ``GET …/models``."""
        if request.method == "GET" and request.target.rstrip("/").endswith("/models"):
            body = {"object": "list", "data": [{"id": self.model_id, "object": "model"}]}
            await response.respond(200, _json.encode(body))
            return
        if request.method != "POST" or not request.target.rstrip("/").endswith("/chat/completions"):
            await response.respond(404, b'{"error":{"message":"not found"}}')
            return
        try:
            body = msgspec.json.decode(request.body)
        except msgspec.DecodeError:
            await response.respond(400, b'{"error":{"message":"request body is not JSON"}}')
            return
        if not isinstance(body, dict):
            await response.respond(400, b'{"error":{"message":"request body is not an object"}}')
            return
        problem = _request_problem(body)
        if problem is not None:  # answered, not counted: the server goes on serving
            refused = _invalid_request(problem)
            await response.respond(refused.status, _json.encode(refused.body))
            return
        self.connections.append(request.connection)
        chunks = self.stream(body)
        try:
            try:
                first = await anext(chunks)
            except ModelHttpError as exc:
                await response.respond(exc.status, _json.encode(exc.body))
                return
            await response.start(
                200, [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
            )
            await response.send(b"data: " + _json.encode(first) + b"\n\n")
            async for item in chunks:
                await response.send(b"data: " + _json.encode(item) + b"\n\n")
            await response.send(b"data: [DONE]\n\n")
            await response.end()
        except StreamCut:
            return  # returning without end() drops the connection
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the client went away
        finally:
            await chunks.aclose()


async def serve_model(
    model: ScriptedModel,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``model`` over HTTP until cancelled (``started`` once listening)."""
    await serve_http(model.handle, host=host, port=port, task_status=task_status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fake_pi.model_server",
        description=(
            "A scripted, OpenAI-compatible streaming chat/completions endpoint on loopback. "
            "Point an openai-completions provider at http://HOST:PORT/v1. Without a scenario "
            "it answers plainly and calls no tools."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (default: any free port)")
    parser.add_argument("--scenario", type=Path, help="a scenario file (.json or .toml)")
    parser.add_argument(
        "--directives", action="store_true", help="honour #… test directives in user text"
    )
    parser.add_argument("--model-id", default="fake-model", help="the model id it reports")
    parser.add_argument("--port-file", type=Path, help="write the bound port to this file")
    parser.add_argument(
        "--max-seconds", type=float, default=None, help="stop by itself after this many seconds"
    )
    args = parser.parse_args(argv)
    try:
        scenario = Scenario.load(args.scenario) if args.scenario else Scenario()
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as error:
        parser.error(f"cannot load {args.scenario}: {error}")  # exits 2
    model = ScriptedModel(scenario=scenario, directives=args.directives, model_id=args.model_id)

    async def run() -> None:
        with trio.move_on_after(args.max_seconds if args.max_seconds is not None else float("inf")):
            async with trio.open_nursery() as nursery:
                server: HttpServer = await nursery.start(
                    lambda task_status: serve_model(
                        model, host=args.host, port=args.port, task_status=task_status
                    )
                )
                if args.port_file:
                    args.port_file.write_text(f"{server.port}\n")
                print(f"fake model listening on {server.url}/v1", flush=True)

    try:
        trio.run(run)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
