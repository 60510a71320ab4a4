"""The scripted model (fake_pi.model_server, fake_pi.scenario) over HTTP and in-process.

Issue item 4 (model server scenarios): every step type, the plain default answer, directives only
when enabled, request counting and body digests, scenario files, and the standalone CLI. HTTP
tests use the runtime's own client (``runtime._boundary._http.open_request`` / ``iter_sse``) against
``serve_model`` in the test's Trio run, on the real clock with ``fail_after`` bounds; timing
tests call ``ScriptedModel.stream`` directly under the ``autojump_clock`` fixture, so delays are
measured in virtual time.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from fake_pi._model import HttpModelClient, ModelError
from fake_pi.model_server import (
    ModelHttpError,
    ScriptedModel,
    StreamCut,
    body_digest,
    serve_model,
)
from fake_pi.scenario import (
    STAY_SILENT,
    Call,
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
)
from runtime._boundary._http import (
    HttpClientError,
    HttpServer,
    Request,
    ResponseWriter,
    iter_sse,
    open_request,
    serve_http,
)
from runtime._config import ModelConfig
from runtime._errors import ConfigError
from runtime._hosting import start_model

LIMIT = 20.0
"""Bound on every real-clock wait."""

Chunk = dict[str, Any]


def request_body(*texts: str, tool_result: str | None = None) -> dict[str, Any]:
    """A request shaped like the one Pi sends: a system message, then user messages."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a test."}]
    messages += [{"role": "user", "content": [{"type": "text", "text": t}]} for t in texts]
    if tool_result is not None:
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command":"ls"}'},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "content": tool_result, "tool_call_id": "call_1"})
    return {
        "model": "fake-model",
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "store": False,
        "max_completion_tokens": 4096,
    }


def model_with(*steps: Step, directives: bool = False) -> ScriptedModel:
    return ScriptedModel(scenario=Scenario(steps=list(steps)), directives=directives)


# -- in-process -----------------------------------------------------------------------------


async def collect(model: ScriptedModel, body: dict[str, Any]) -> list[Chunk]:
    """Every chunk of one in-process response (it must finish normally)."""
    async with contextlib.aclosing(model.stream(body)) as chunks:
        return [chunk async for chunk in chunks]


@dataclass
class Timed:
    """Chunks with the (virtual) time each arrived, relative to the request."""

    chunks: list[Chunk] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: BaseException | None = None
    error_time: float | None = None


async def collect_timed(model: ScriptedModel, body: dict[str, Any]) -> Timed:
    timed = Timed()
    start = trio.current_time()
    try:
        async with contextlib.aclosing(model.stream(body)) as chunks:
            async for chunk in chunks:
                timed.chunks.append(chunk)
                timed.times.append(trio.current_time() - start)
    except (StreamCut, ModelHttpError) as exc:
        timed.error = exc
        timed.error_time = trio.current_time() - start
    return timed


def deltas(chunks: list[Chunk]) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for c in chunks if c.get("choices")]


def contents(chunks: list[Chunk], key: str = "content") -> list[str]:
    return [d[key] for d in deltas(chunks) if d.get(key)]


def finish_reasons(chunks: list[Chunk]) -> list[str]:
    return [
        c["choices"][0]["finish_reason"]
        for c in chunks
        if c.get("choices") and c["choices"][0]["finish_reason"] is not None
    ]


# -- over HTTP ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def served(model: ScriptedModel) -> AsyncIterator[HttpServer]:
    """``model`` on 127.0.0.1 for the block."""
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(serve_model, model)
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()


@dataclass
class HttpResult:
    status: int
    headers: dict[str, str]
    events: list[str] = field(default_factory=list)
    """SSE data payloads, in order (``[DONE]`` included)."""
    body: bytes = b""
    """The body of a non-streamed (error) response."""
    cut: HttpClientError | None = None
    """Set if the stream ended without its end-of-message (a dropped connection)."""

    @property
    def chunks(self) -> list[Chunk]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


async def post(
    server: HttpServer, body: dict[str, Any] | bytes, *, path: str = "/v1/chat/completions"
) -> HttpResult:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with trio.fail_after(LIMIT):
        async with open_request(
            "POST",
            f"{server.url}{path}",
            headers=[("content-type", "application/json")],
            body=raw,
        ) as response:
            result = HttpResult(response.status, response.headers)
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                result.body = await response.read()
                return result
            try:
                async for event in iter_sse(response.iter_bytes()):
                    if event.data is not None:
                        result.events.append(event.data)
            except HttpClientError as exc:
                result.cut = exc
            return result


def assert_chunk_shape(chunks: list[Chunk], model_id: str = "fake-model") -> None:
    """Every chunk is an OpenAI ``chat.completion.chunk`` of one response id."""
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1, ids
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        assert c["model"] == model_id
        if c["choices"]:
            assert c["choices"][0]["index"] == 0


# ===================================================================== step types over HTTP


async def test_text_streams_token_chunks_then_stop_usage_and_done() -> None:
    """Item 4: a Text step streams one chunk per word token (role chunk first), then a
    ``finish_reason: stop`` chunk, a ``choices: []`` usage chunk and ``data: [DONE]``."""
    model = model_with(Text(text="hello big world"))
    async with served(model) as server:
        result = await post(server, request_body("hi"))
    assert result.status == 200
    assert result.headers["content-type"] == "text/event-stream"
    assert result.cut is None
    assert result.events[-1] == "[DONE]"
    chunks = result.chunks
    assert_chunk_shape(chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert contents(chunks) == ["hello ", "big ", "world"]
    assert finish_reasons(chunks) == ["stop"]
    finish = chunks[-2]
    assert finish["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 3
    assert usage["prompt_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_http_stream_carries_exactly_the_in_process_chunks() -> None:
    """Item 4: the HTTP endpoint and ``ScriptedModel.stream`` give the same chunks (the SSE
    stream adds only ``[DONE]``), for every step kind that finishes normally."""
    steps: list[Step] = [
        Text(text="one two"),
        Thinking(thinking="hmm yes", text="done"),
        ToolCalls(calls=[Call(name="read", arguments={"path": "a.txt"})], text="look"),
        Empty(),
        StaySilent(),
    ]
    over_http = model_with(*steps)
    in_process = model_with(*steps)
    async with served(over_http) as server:
        for _ in steps:
            body = request_body("same question")
            result = await post(server, body)
            assert result.events[-1] == "[DONE]"
            assert result.chunks == await collect(in_process, body)
    assert over_http.request_count == in_process.request_count == len(steps)


async def test_thinking_streams_reasoning_content_then_text() -> None:
    """Item 4: a Thinking step streams its reasoning as ``reasoning_content`` deltas, then the
    answer as ``content`` deltas, and finishes with ``stop``."""
    model = model_with(Thinking(thinking="let me see", text="the answer"))
    async with served(model) as server:
        result = await post(server, request_body("think"))
    chunks = result.chunks
    assert_chunk_shape(chunks)
    reasoning = [d for d in deltas(chunks) if "reasoning_content" in d]
    assert [d["reasoning_content"] for d in reasoning] == ["let ", "me ", "see"]
    assert all("content" not in d for d in reasoning)
    assert contents(chunks) == ["the ", "answer"]
    # reasoning comes before the first content token
    kinds = [next(iter(d)) for d in deltas(chunks)[1:] if d]
    assert kinds == ["reasoning_content"] * 3 + ["content"] * 2
    assert finish_reasons(chunks) == ["stop"]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert result.events[-1] == "[DONE]"


async def test_tool_calls_stream_ids_names_and_argument_fragments() -> None:
    """Item 4: a ToolCalls step streams its text, then per call a head delta (index, id, type,
    name, empty arguments) and argument fragments that join to the JSON arguments; an explicit
    id is kept, a missing one is numbered ``call_<n>``; ``finish_reason`` is ``tool_calls``."""
    calls = [
        Call(name="bash", arguments={"command": "echo hi >> out.txt"}, id="call_mine"),
        Call(name="read", arguments={"path": "out.txt", "limit": 5}),
    ]
    model = model_with(ToolCalls(calls=calls, text="running it"))
    async with served(model) as server:
        result = await post(server, request_body("do it"))
    chunks = result.chunks
    assert_chunk_shape(chunks)
    assert contents(chunks) == ["running ", "it"]
    tool_deltas = [tc for d in deltas(chunks) for tc in d.get("tool_calls", [])]
    heads = [tc for tc in tool_deltas if "type" in tc]
    assert heads == [
        {
            "index": 0,
            "type": "function",
            "id": "call_mine",
            "function": {"name": "bash", "arguments": ""},
        },
        {
            "index": 1,
            "type": "function",
            "id": "call_2",
            "function": {"name": "read", "arguments": ""},
        },
    ]
    for index, call in enumerate(calls):
        fragments = [
            tc["function"]["arguments"]
            for tc in tool_deltas
            if tc["index"] == index and "type" not in tc
        ]
        assert len(fragments) == 2
        assert all(fragments)
        assert json.loads("".join(fragments)) == call.arguments
    assert finish_reasons(chunks) == ["tool_calls"]
    assert chunks[-1]["usage"]["completion_tokens"] == 2 + len(calls)
    assert result.events[-1] == "[DONE]"


async def test_tool_calls_omit_ids_sends_calls_without_ids() -> None:
    """Item 4: ``omit_ids`` streams the calls with no ``id`` at all (as some upstreams do)."""
    model = model_with(
        ToolCalls(calls=[Call(name="bash", arguments={"command": "ls"}, id="x")], omit_ids=True)
    )
    async with served(model) as server:
        result = await post(server, request_body("go"))
    tool_deltas = [tc for d in deltas(result.chunks) for tc in d.get("tool_calls", [])]
    assert tool_deltas
    assert all("id" not in tc for tc in tool_deltas)
    assert tool_deltas[0]["function"]["name"] == "bash"
    assert finish_reasons(result.chunks) == ["tool_calls"]


async def test_tool_call_numbering_continues_across_requests() -> None:
    """Item 4: server-numbered call ids are unique over the model's life (``call_1``,
    ``call_2``, … across responses), like Pi's ``call_fake_N``."""
    step = ToolCalls(calls=[Call(name="bash", arguments={"command": "true"})])
    model = model_with(step, step)
    ids = []
    for _ in range(2):
        chunks = await collect(model, request_body("again"))
        ids += [tc["id"] for d in deltas(chunks) for tc in d.get("tool_calls", []) if "id" in tc]
    assert ids == ["call_1", "call_2"]


async def test_hang_starts_the_response_then_drops_the_connection() -> None:
    """Item 4: a Hang step sends the first chunk, stays silent, then drops the connection: the
    client sees a cut stream with no finish_reason, usage or ``[DONE]``."""
    model = model_with(Hang(seconds=0.05))
    async with served(model) as server:
        result = await post(server, request_body("hello?"))
    assert result.status == 200
    assert result.cut is not None
    assert "[DONE]" not in result.events
    assert [c["choices"][0]["delta"] for c in result.chunks] == [
        {"role": "assistant", "content": ""}
    ]
    assert model.request_count == 1


async def test_cut_drops_the_connection_after_n_chunks() -> None:
    """Item 4: a Cut step streams ``after_chunks`` tokens, then drops the connection."""
    model = model_with(Cut(text="a b c d e", after_chunks=2))
    async with served(model) as server:
        result = await post(server, request_body("tell me"))
    assert result.status == 200
    assert result.cut is not None
    assert "[DONE]" not in result.events
    assert contents(result.chunks) == ["a ", "b "]
    assert finish_reasons(result.chunks) == []
    assert all(c["choices"] for c in result.chunks)  # no usage chunk


async def test_http_error_answers_status_and_openai_error_body() -> None:
    """Item 4: an HttpError step answers a plain JSON error (default 500, Pi retries it) in
    OpenAI's ``{"error": {message, type, code}}`` shape, not a stream."""
    model = model_with(HttpError(), HttpError(status=503, message="overloaded"))
    async with served(model) as server:
        first = await post(server, request_body("x"))
        second = await post(server, request_body("x"))
    assert first.status == 500
    assert first.headers["content-type"] == "application/json"
    assert json.loads(first.body) == {
        "error": {"message": "internal server error", "type": "server_error", "code": None}
    }
    assert second.status == 503
    assert json.loads(second.body)["error"]["message"] == "overloaded"
    assert model.request_count == 2


async def test_usage_limit_answers_429_insufficient_quota() -> None:
    """Item 4: a UsageLimit step answers 429 with OpenAI's ``insufficient_quota`` type and
    code (which Pi does not retry)."""
    model = model_with(UsageLimit())
    async with served(model) as server:
        result = await post(server, request_body("x"))
    assert result.status == 429
    error = json.loads(result.body)["error"]
    assert error["type"] == "insufficient_quota"
    assert error["code"] == "insufficient_quota"
    assert "exceeded your current quota" in error["message"]


async def test_error_steps_raise_before_any_chunk_in_process() -> None:
    """Item 4: in-process, HttpError and UsageLimit raise ModelHttpError before the first
    chunk, carrying the same status and body the HTTP endpoint sends."""
    model = model_with(HttpError(status=502, message="bad gateway"), UsageLimit(message="quota"))
    for status, kind in ((502, "server_error"), (429, "insufficient_quota")):
        received: list[Chunk] = []
        with pytest.raises(ModelHttpError) as caught:
            async with contextlib.aclosing(model.stream(request_body("x"))) as chunks:
                received += [c async for c in chunks]
        assert received == []
        assert caught.value.status == status
        assert caught.value.body["error"]["type"] == kind
    assert model.request_count == 2


async def test_empty_is_a_well_formed_response_with_no_content() -> None:
    """Item 4: an Empty step is role chunk, ``finish_reason: stop``, usage (0 completion
    tokens), ``[DONE]`` — and nothing else."""
    model = model_with(Empty())
    async with served(model) as server:
        result = await post(server, request_body("x"))
    chunks = result.chunks
    assert result.cut is None
    assert result.events[-1] == "[DONE]"
    assert contents(chunks) == []
    assert all("tool_calls" not in d for d in deltas(chunks))
    assert finish_reasons(chunks) == ["stop"]
    assert len(chunks) == 3
    assert chunks[-1]["usage"]["completion_tokens"] == 0


async def test_stay_silent_answers_the_marker_exactly() -> None:
    """Item 4: a StaySilent step answers exactly ``[[stay-silent]]`` in one content chunk."""
    model = model_with(StaySilent())
    async with served(model) as server:
        result = await post(server, request_body("x"))
    assert STAY_SILENT == "[[stay-silent]]"
    assert contents(result.chunks) == [STAY_SILENT]
    assert finish_reasons(result.chunks) == ["stop"]
    assert result.events[-1] == "[DONE]"


# ======================================================================= virtual-time steps


async def test_first_token_delay_is_measured_in_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Item 4: ``first_token_delay`` holds the whole response back that long (a slow time to
    first token) and then streams at once; ``delay`` spaces the chunks — virtual seconds."""
    model = model_with(
        Text(text="slow to start", first_token_delay=7.5),
        Text(text="a b c", delay=0.25),
    )
    slow = await collect_timed(model, request_body("x"))
    assert slow.error is None
    assert slow.times[0] == pytest.approx(7.5)
    assert slow.times[-1] == pytest.approx(7.5)
    assert contents(slow.chunks) == ["slow ", "to ", "start"]

    spaced = await collect_timed(model, request_body("y"))
    token_times = [t for t, c in zip(spaced.times, spaced.chunks, strict=True) if contents([c])]
    assert token_times == pytest.approx([0.0, 0.25, 0.5])


async def test_thinking_and_tool_call_delays_in_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Item 4: Thinking spaces every token after the first by ``delay``; ToolCalls spaces the
    calls after any text by ``delay``."""
    model = model_with(
        Thinking(thinking="a b", text="c", delay=1.0),
        ToolCalls(calls=[Call(name="bash"), Call(name="read")], delay=2.0),
    )
    thinking = await collect_timed(model, request_body("x"))
    token_times = [
        t
        for t, c in zip(thinking.times, thinking.chunks, strict=True)
        if contents([c]) or contents([c], "reasoning_content")
    ]
    assert token_times == pytest.approx([0.0, 1.0, 2.0])

    calls = await collect_timed(model, request_body("y"))
    head_times = [
        t
        for t, c in zip(calls.times, calls.chunks, strict=True)
        if any("type" in tc for d in deltas([c]) for tc in d.get("tool_calls", []))
    ]
    assert head_times == pytest.approx([0.0, 2.0])


async def test_hang_is_silence_for_its_seconds_then_a_cut(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Item 4: in-process, Hang yields the role chunk at once, is silent for ``seconds``
    (virtual), then raises StreamCut; a ``first_token_delay`` comes before all of it."""
    model = model_with(Hang(seconds=300), Hang(seconds=10, first_token_delay=5))
    hung = await collect_timed(model, request_body("x"))
    assert hung.times == [0.0]
    assert isinstance(hung.error, StreamCut)
    assert hung.error_time == pytest.approx(300)

    late = await collect_timed(model, request_body("y"))
    assert late.times == pytest.approx([5.0])
    assert isinstance(late.error, StreamCut)
    assert late.error_time == pytest.approx(15.0)


async def test_cut_in_process_spaces_chunks_then_raises(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Item 4: in-process, Cut yields the role chunk and ``after_chunks`` tokens (``delay``
    apart, virtual time), then raises StreamCut with no finish chunk."""
    model = model_with(Cut(text="one two three four", after_chunks=3, delay=0.5))
    cut = await collect_timed(model, request_body("x"))
    assert contents(cut.chunks) == ["one ", "two ", "three "]
    assert cut.times == pytest.approx([0.0, 0.0, 0.5, 1.0])
    assert isinstance(cut.error, StreamCut)
    assert finish_reasons(cut.chunks) == []


# ======================================================================== default answers


async def test_default_answer_without_a_scenario_is_plain_text() -> None:
    """Item 4: with no scenario the model echoes the last user text plainly and calls no tools;
    after a tool result it echoes that; ``finish_reason`` is ``stop``."""
    model = ScriptedModel()
    async with served(model) as server:
        plain = await post(server, request_body("first", "what is up"))
        after_tool = await post(server, request_body("go", tool_result="file.txt\n"))
    assert "".join(contents(plain.chunks)) == "You said: what is up"
    assert "".join(contents(after_tool.chunks)) == "The tool said: file.txt"
    for result in (plain, after_tool):
        assert all("tool_calls" not in d for d in deltas(result.chunks))
        assert finish_reasons(result.chunks) == ["stop"]
        assert result.events[-1] == "[DONE]"


async def test_scenario_steps_run_in_order_then_the_default_answer() -> None:
    """Item 4: each request takes the next scenario step; once the steps run out the model
    answers plainly (no tool calls)."""
    model = model_with(Text(text="first"), Empty())
    answers = []
    for _ in range(3):
        answers.append("".join(contents(await collect(model, request_body("q")))))
    assert answers == ["first", "", "You said: q"]
    assert [type(r.step).__name__ for r in model.requests] == ["Text", "Empty", "Text"]


async def test_models_listing_and_unknown_paths() -> None:
    """Item 4: ``GET …/models`` lists the model id; another path is a 404 and a non-JSON body a
    400; none of them counts as a model request."""
    model = ScriptedModel(model_id="other-model")
    async with served(model) as server:
        with trio.fail_after(LIMIT):
            async with open_request("GET", f"{server.url}/v1/models") as response:
                listing = json.loads(await response.read())
                assert response.status == 200
        missing = await post(server, request_body("x"), path="/v1/completions")
        bad = await post(server, b"{not json")
        ok = await post(server, request_body("x"))
    assert listing["data"] == [{"id": "other-model", "object": "model"}]
    assert missing.status == 404
    assert bad.status == 400
    assert_chunk_shape(ok.chunks, model_id="other-model")
    assert model.request_count == 1


# ================================================================================ directives


async def test_directives_are_ignored_unless_enabled() -> None:
    """Item 4: without ``directives=True`` a ``#…`` directive is plain text: the model echoes
    it and calls no tools (the default scripted model is safe)."""
    model = ScriptedModel()
    for text in ("#sleep=30", "#fail500", "#bash=rm_-rf_x", "#effect=k"):
        chunks = await collect(model, request_body(text))
        assert "".join(contents(chunks)) == f"You said: {text}"
        assert finish_reasons(chunks) == ["stop"]
    assert model.request_count == 4


async def test_directives_when_enabled_choose_the_step() -> None:
    """Item 4: with directives enabled, ``#…`` in the last user text picks the step."""
    model = ScriptedModel(directives=True)
    cases: list[tuple[str, Step]] = [
        (
            "please #sleep=5 now",
            ToolCalls(calls=[Call(name="bash", arguments={"command": "sleep 5"})]),
        ),
        ("#bash=echo_hi", ToolCalls(calls=[Call(name="bash", arguments={"command": "echo hi"})])),
        ("#read=a.txt", ToolCalls(calls=[Call(name="read", arguments={"path": "a.txt"})])),
        ("#effect=k1", ToolCalls(calls=[Call(name="effect", arguments={"key": "k1"})])),
        ("#text=all_good", Text(text="all good")),
        ("#hang=4", Hang(seconds=4.0)),
        ("#cut", Cut()),
        ("#fail500", HttpError()),
        ("#usage_limit", UsageLimit()),
        ("#empty", Empty()),
        ("#silent", StaySilent()),
        ("#slowtext=2", Text(text="chunk0 chunk1", delay=0.5)),
        ("#ttft=3", Text(text="slow to start", first_token_delay=3.0)),
        ("#think", Thinking(thinking="let me think", text="thought it through")),
        ("#text", Text(text="ok")),
    ]
    for index, (text, expected) in enumerate(cases):
        # a different conversation length for each, so every key is fresh
        body = request_body(*(["earlier"] * index), text)
        assert model.next_step(body) == expected, text
    assert model.request_count == len(cases)


async def test_a_directive_answers_its_user_message_once() -> None:
    """Item 4: a directive answers its user message once — a retry of the very same request
    (Pi's auto-retry after ``#fail500``) gets the plain answer; the directive in a new user
    message (a longer conversation) is honoured again."""
    model = ScriptedModel(directives=True)
    async with served(model) as server:
        body = request_body("#fail500")
        failed = await post(server, body)
        retried = await post(server, body)
        later = await post(server, request_body("#fail500", "#fail500"))
    assert failed.status == 500
    assert retried.status == 200
    assert "".join(contents(retried.chunks)) == "You said: #fail500"
    assert later.status == 500
    digest = body_digest(body)
    assert model.count(digest) == 2
    assert model.request_count == 3


async def test_scenario_steps_take_precedence_over_directives() -> None:
    """Item 4: while scenario steps remain they answer, directives or not; a directive is only
    consulted once the scenario is used up."""
    model = model_with(Text(text="scripted"), directives=True)
    first = await collect(model, request_body("#text=directed"))
    second = await collect(model, request_body("x", "#text=directed"))
    assert "".join(contents(first)) == "scripted"
    assert "".join(contents(second)) == "directed"


# ================================================================ counting and body digests


async def test_requests_are_counted_with_body_digests() -> None:
    """Item 4: the model records every request with the sha256 of its canonical (sorted-key)
    body, so ``count(digest)`` proves how often one exact request was made — over HTTP too."""
    model = ScriptedModel()
    first = request_body("one")
    second = request_body("one", "two")
    reordered = dict(reversed(list(first.items())))
    async with served(model) as server:
        await post(server, first)
        await post(server, second)
        await post(server, reordered)
    assert model.request_count == 3
    assert [r.body for r in model.requests] == [first, second, first]
    digest = body_digest(first)
    assert digest == body_digest(reordered)
    assert len(digest) == 64
    assert model.requests[0].digest == digest
    assert model.count(digest) == 2
    assert model.count(body_digest(second)) == 1
    assert model.count(body_digest(request_body("never sent"))) == 0


async def test_failed_and_cut_requests_are_counted_too() -> None:
    """Item 4: a request counts whatever its answer (an error, a cut, a hang)."""
    model = model_with(HttpError(), Cut(after_chunks=1), Hang(seconds=0.01))
    async with served(model) as server:
        for _ in range(3):
            await post(server, request_body("x"))
    assert model.request_count == 3
    assert model.count(body_digest(request_body("x"))) == 3
    assert [type(r.step) for r in model.requests] == [HttpError, Cut, Hang]


# ============================================================================ scenario files

EVERY_STEP: list[Step] = [
    Text(text="hello", delay=0.1, first_token_delay=2.0),
    Thinking(thinking="hmm", text="ok"),
    ToolCalls(
        calls=[
            Call(name="bash", arguments={"command": "ls", "timeout": 5}, id="call_a"),
            Call(name="effect", arguments={"key": "k1"}),
        ],
        text="calling",
        omit_ids=True,
    ),
    Hang(seconds=30),
    Cut(text="cut here", after_chunks=1),
    HttpError(status=503, message="busy"),
    UsageLimit(),
    Empty(),
    StaySilent(),
]

SCENARIO_TOML = """\
[[steps]]
kind = "text"
text = "hello"
delay = 0.1
first_token_delay = 2.0

[[steps]]
kind = "thinking"
thinking = "hmm"
text = "ok"

[[steps]]
kind = "tool_calls"
text = "calling"
omit_ids = true
calls = [
  { name = "bash", arguments = { command = "ls", timeout = 5 }, id = "call_a" },
  { name = "effect", arguments = { key = "k1" } },
]

[[steps]]
kind = "hang"
seconds = 30

[[steps]]
kind = "cut"
text = "cut here"
after_chunks = 1

[[steps]]
kind = "http_error"
status = 503
message = "busy"

[[steps]]
kind = "usage_limit"

[[steps]]
kind = "empty"

[[steps]]
kind = "stay_silent"
"""


def test_scenario_loads_from_json(tmp_path: Path) -> None:
    """Item 4: a JSON scenario file (steps tagged by ``kind``) loads into the typed steps, and
    ``dump_json`` round-trips."""
    data = {
        "steps": [
            {"kind": "text", "text": "hello", "delay": 0.1, "first_token_delay": 2.0},
            {"kind": "thinking", "thinking": "hmm", "text": "ok"},
            {
                "kind": "tool_calls",
                "text": "calling",
                "omit_ids": True,
                "calls": [
                    {"name": "bash", "arguments": {"command": "ls", "timeout": 5}, "id": "call_a"},
                    {"name": "effect", "arguments": {"key": "k1"}},
                ],
            },
            {"kind": "hang", "seconds": 30},
            {"kind": "cut", "text": "cut here", "after_chunks": 1},
            {"kind": "http_error", "status": 503, "message": "busy"},
            {"kind": "usage_limit"},
            {"kind": "empty"},
            {"kind": "stay_silent"},
        ]
    }
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(data))
    scenario = Scenario.load(path)
    assert scenario == Scenario(steps=EVERY_STEP)
    again = tmp_path / "again.json"
    again.write_bytes(scenario.dump_json())
    assert Scenario.load(again) == scenario


def test_scenario_loads_from_toml(tmp_path: Path) -> None:
    """Item 4: the same scenario as a TOML file (``[[steps]]`` tables) loads identically."""
    path = tmp_path / "scenario.toml"
    path.write_text(SCENARIO_TOML)
    assert Scenario.load(path) == Scenario(steps=EVERY_STEP)
    assert Scenario.load(str(path)) == Scenario(steps=EVERY_STEP)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("unknown_kind.json", '{"steps": [{"kind": "teleport"}]}'),
        ("no_kind.json", '{"steps": [{"text": "hi"}]}'),
        ("missing_field.json", '{"steps": [{"kind": "text"}]}'),
        ("unknown_field.json", '{"steps": [{"kind": "text", "text": "hi", "colour": "red"}]}'),
        ("wrong_type.json", '{"steps": [{"kind": "hang", "seconds": "long"}]}'),
        ("bad_call.json", '{"steps": [{"kind": "tool_calls", "calls": [{"arguments": {}}]}]}'),
        ("top_level.json", '{"steps": [], "extra": 1}'),
        ("not_a_list.json", '{"steps": {"kind": "empty"}}'),
        ("unknown_kind.toml", '[[steps]]\nkind = "teleport"\n'),
        ("unknown_field.toml", '[[steps]]\nkind = "empty"\nsurprise = true\n'),
    ],
)
def test_bad_scenario_files_are_refused(tmp_path: Path, name: str, text: str) -> None:
    """Item 4: a scenario file with an unknown step kind, an unknown or missing field, or a
    wrong type is refused with a validation error (never half-loaded)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(msgspec.ValidationError):
        Scenario.load(path)


@pytest.mark.parametrize(
    ("name", "text"),
    [("broken.json", '{"steps": [{"kind": "empty"}'), ("broken.toml", "[[steps]\nkind =\n")],
)
def test_malformed_scenario_files_are_refused(tmp_path: Path, name: str, text: str) -> None:
    """Item 4: a scenario file that is not valid JSON/TOML is refused with a decode error."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(msgspec.DecodeError):
        Scenario.load(path)


# ======================================================================================= CLI

FLAGS = ("--host", "--port", "--scenario", "--directives", "--model-id", "--port-file")


async def test_cli_help_documents_the_flags() -> None:
    """Item 4: ``python -m fake_pi.model_server --help`` exits 0 and documents every flag."""
    with trio.fail_after(LIMIT):
        done = await trio.run_process(
            [sys.executable, "-m", "fake_pi.model_server", "--help"],
            capture_stdout=True,
            capture_stderr=True,
        )
    assert done.returncode == 0
    text = done.stdout.decode()
    for flag in (*FLAGS, "--max-seconds"):
        assert flag in text, flag
    assert "chat/completions" in text


async def test_cli_serves_with_port_file_and_stops_after_max_seconds(tmp_path: Path) -> None:
    """Item 4: the CLI writes its port to ``--port-file`` and announces it, serves the scenario
    (and directives when ``--directives``) over HTTP, and exits 0 by itself after
    ``--max-seconds``."""
    scenario = tmp_path / "scenario.toml"
    scenario.write_text('[[steps]]\nkind = "text"\ntext = "from the file"\n')
    port_file = tmp_path / "port"
    max_seconds = 2.5
    argv = [sys.executable, "-m", "fake_pi.model_server", "--scenario", str(scenario)]
    argv += ["--directives", "--model-id", "cli-model", "--port-file", str(port_file)]
    argv += ["--max-seconds", str(max_seconds)]
    launched = trio.current_time()
    process = await trio.lowlevel.open_process(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert process.stdout is not None
        announced = b""
        with trio.fail_after(LIMIT):
            while b"\n" not in announced:
                data = await process.stdout.receive_some(4096)
                assert data, "the model server exited before it announced itself"
                announced += data
        port = int(port_file.read_text().strip())
        assert (
            announced.split(b"\n")[0].decode()
            == f"fake model listening on http://127.0.0.1:{port}/v1"
        )
        server = HttpServer("127.0.0.1", port)
        scripted = await post(server, request_body("hello"))
        directed = await post(server, request_body("hello", "#usage_limit"))
        assert "".join(contents(scripted.chunks)) == "from the file"
        assert_chunk_shape(scripted.chunks, model_id="cli-model")
        assert directed.status == 429
        with trio.fail_after(max_seconds + LIMIT):
            returncode = await process.wait()
        assert returncode == 0
        assert trio.current_time() - launched >= max_seconds
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(LIMIT):
                await process.wait()


async def test_fake_pis_model_client_keeps_its_connection_alive_as_pis_agent_does() -> None:
    """Fake-Pi's model client, like Pi's HTTP agent, sends a turn's requests on one kept-alive
    connection (docs/design/gateway.md G17); a cut stream's connection is not used again."""
    model = model_with(Text(text="one"), Text(text="two"), Cut(), Text(text="four"))
    with trio.fail_after(10):
        async with served(model) as server:
            client = HttpModelClient(f"{server.url}/v1")
            answers = []
            for n in range(4):
                try:
                    answers.append([c async for c in client.stream(request_body(f"q{n}"))])
                except ModelError:
                    answers.append([])
    assert [bool(a) for a in answers] == [True, True, False, True]
    assert model.connections == [1, 1, 1, 2]


async def test_fake_pis_model_client_a_cut_after_done_is_a_whole_answer() -> None:
    """A stream cut after its ``[DONE]`` was a whole answer: the client returns it (no
    error, no retry) and only gives up the connection."""
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}

    async def done_then_cut(request: Request, response: ResponseWriter) -> None:
        await response.start(200, [("content-type", "text/event-stream")])
        await response.send(b"data: " + json.dumps(finish).encode() + b"\n\ndata: [DONE]\n\n")
        # returns without end(): the server drops the connection

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server: HttpServer = await nursery.start(serve_http, done_then_cut)
            client = HttpModelClient(f"{server.url}/v1")
            chunks = [c async for c in client.stream(request_body("q"))]
            nursery.cancel_scope.cancel()
    assert chunks == [finish]


# ========================================================== malformed requests and scenarios

MALFORMED_BODIES: list[dict[str, Any]] = [
    {"messages": "hello"},
    {"messages": {"role": "user", "content": "hello"}},
    {"messages": [1, 2]},
    {"messages": [{"role": "user", "content": 7}]},
    {"messages": [{"role": "user", "content": ["hello"]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]},
    {"messages": [{"role": 5, "content": "hello"}]},
]


async def test_f9_a_malformed_chat_request_is_a_400_and_the_server_keeps_serving() -> None:
    """F9: a chat request whose ``messages`` is not a list of messages (a string, an object,
    numbers, a ``content`` or a text part of the wrong type) is answered 400
    ``invalid_request_error``, is not counted and takes no scenario step — and the next
    well-formed request is answered by the first step. Before, such a body raised inside the
    handler and the exception ended the whole server: every later request found the port
    closed (and in ``pi-runtime serve`` with no ``model.base_url`` the host's model with it)."""
    model = model_with(Text(text="still here"))
    async with served(model) as server:
        refused = [await post(server, body) for body in MALFORMED_BODIES]
        ok = await post(server, request_body("hi"))
    for body, result in zip(MALFORMED_BODIES, refused, strict=True):
        assert result.status == 400, body
        error = json.loads(result.body)["error"]
        assert error["type"] == "invalid_request_error", body
        assert "messages" in error["message"], body
    assert ok.status == 200
    assert "".join(contents(ok.chunks)) == "still here"
    assert model.request_count == 1
    assert model.connections == [model.connections[0]]  # only the answered request's


async def test_f9_a_malformed_request_in_process_is_the_same_400() -> None:
    """F9: in-process (``ScriptedModel.stream``, what Fake-Pi's in-process client calls) a
    malformed body raises the same 400 :class:`ModelHttpError` before any chunk, not an
    ``AttributeError`` from the middle of the model, and is not counted."""
    model = ScriptedModel()
    for body in MALFORMED_BODIES:
        with pytest.raises(ModelHttpError) as raised:
            await collect(model, body)
        assert raised.value.status == 400, body
        assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert model.request_count == 0


@pytest.mark.parametrize(
    "text", ["#hang=soon", "#hang=-5", "#hang=nan", "#ttft=-1", "#ttft=later", "#slowtext=many"]
)
async def test_f9_a_directive_with_a_value_it_cannot_use_is_plain_text(text: str) -> None:
    """F9: with directives enabled, a directive whose value is not a usable number (not a
    number, negative, NaN) is no directive: the user text is answered plainly, over HTTP, and
    the server answers the next request too. Before, ``float("soon")`` or ``trio.sleep(-5)``
    raised inside the handler and ended the server."""
    model = ScriptedModel(directives=True)
    async with served(model) as server:
        answered = await post(server, request_body(text))
        after = await post(server, request_body(text, "#text=alive"))
    assert answered.status == 200
    assert "".join(contents(answered.chunks)) == f"You said: {text}"
    assert "".join(contents(after.chunks)) == "alive"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("negative_delay.json", '{"steps": [{"kind": "text", "text": "a b", "delay": -1}]}'),
        ("negative_ttft.json", '{"steps": [{"kind": "empty", "first_token_delay": -0.5}]}'),
        ("negative_hang.json", '{"steps": [{"kind": "hang", "seconds": -3}]}'),
        ("nan_hang.toml", '[[steps]]\nkind = "hang"\nseconds = nan\n'),
        ("nan_delay.toml", '[[steps]]\nkind = "cut"\ndelay = nan\n'),
        ("negative_chunks.json", '{"steps": [{"kind": "cut", "after_chunks": -1}]}'),
        ("status_200.json", '{"steps": [{"kind": "http_error", "status": 200}]}'),
        ("status_1000.json", '{"steps": [{"kind": "http_error", "status": 1000}]}'),
    ],
)
def test_f11_scenario_values_the_model_cannot_play_are_refused_on_load(
    tmp_path: Path, name: str, text: str
) -> None:
    """F11: a scenario file whose step has a negative or NaN delay or duration, a negative
    chunk count, or an ``http_error`` status that is not an HTTP error (400 to 599) is refused by
    ``Scenario.load`` with a validation error. Before, it loaded, and the request that reached
    the step raised inside the model server (``trio.sleep(-1)``, h11 refusing status 1000) —
    which ended the server — or answered an "error" with status 200."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(msgspec.ValidationError):
        Scenario.load(path)


@pytest.mark.parametrize("name", ["deep.json", "deep.toml"])
def test_f11_a_scenario_nested_too_deeply_is_a_decode_error(tmp_path: Path, name: str) -> None:
    """F11: a scenario file nested deeper than the parser can follow (tool-call arguments in
    JSON, an array in TOML) is a :class:`msgspec.DecodeError` like any malformed file, which
    ``model.scenario`` reports as ``config_invalid`` — not a ``RecursionError`` traceback."""
    depth = 100_000
    path = tmp_path / name
    if name.endswith(".json"):
        arguments = '{"a": ' + "[" * depth + "]" * depth + "}"
        calls = '[{"name": "bash", "arguments": ' + arguments + "}]"
        path.write_text('{"steps": [{"kind": "tool_calls", "calls": ' + calls + "}]}")
    else:
        path.write_text("x = " + "[" * depth + "]" * depth + "\n")
    with pytest.raises(msgspec.DecodeError):
        Scenario.load(path)


async def test_f11_scenario_load_refuses_a_fifo_without_waiting_for_a_writer(
    tmp_path: Path,
) -> None:
    """F11: ``Scenario.load`` of a FIFO raises an ``OSError`` at once (not a regular file). Before,
    it waited for a writer for ever — in ``pi-runtime serve`` (``model.scenario``) on the event
    loop itself, so the host hung before it served anything. The load runs in a thread here,
    and the FIFO is opened for writing and closed afterwards, so an old blocking load ends."""
    fifo = tmp_path / "scenario.json"
    os.mkfifo(fifo)
    outcome: list[BaseException | Scenario] = []

    def load() -> None:
        try:
            outcome.append(Scenario.load(fifo))
        except Exception as exc:  # the test inspects what was raised
            outcome.append(exc)

    try:
        with trio.move_on_after(LIMIT):
            await trio.to_thread.run_sync(load, abandon_on_cancel=True)
    finally:
        with contextlib.suppress(OSError):  # a reader still waits: give it EOF
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert outcome, "Scenario.load waited on the FIFO"
    assert isinstance(outcome[0], OSError)
    assert "not a regular file" in str(outcome[0])


async def test_f11_the_cli_refuses_a_scenario_it_cannot_load_with_a_message(
    tmp_path: Path,
) -> None:
    """F11: ``python -m fake_pi.model_server --scenario FILE`` with a FIFO, or a file of
    negative delays, exits 2 at once with ``cannot load FILE: …`` on stderr and serves
    nothing. Before, the FIFO kept it waiting for ever and the bad file was served (the first
    request ended the server with a traceback)."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[steps]]\nkind = "text"\ntext = "a b"\ndelay = -1\n')
    for scenario in (fifo, bad):
        argv = [sys.executable, "-m", "fake_pi.model_server", "--scenario", str(scenario)]
        process = await trio.lowlevel.open_process(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            assert process.stdout is not None
            assert process.stderr is not None
            with trio.fail_after(LIMIT):
                returncode = await process.wait()
            out = await process.stdout.receive_some(65536)
            err = (await process.stderr.receive_some(65536)).decode()
        finally:
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True), trio.move_on_after(LIMIT):
                    await process.wait()
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        assert returncode == 2, err
        assert f"cannot load {scenario}" in err
        assert "Traceback" not in err
        assert b"listening" not in out


async def test_f11_model_scenario_the_model_cannot_play_is_config_invalid(
    tmp_path: Path,
) -> None:
    """F11: ``[model] scenario`` naming a file with a negative delay makes the host's model
    start fail with ``config_invalid: model.scenario`` before anything is served. Before, it
    was served and its first request ended the model server."""
    path = tmp_path / "scenario.toml"
    path.write_text('[[steps]]\nkind = "hang"\nseconds = -1\n')
    async with trio.open_nursery() as nursery:
        with pytest.raises(ConfigError) as raised:
            await start_model(ModelConfig(scenario=str(path)), nursery)
        nursery.cancel_scope.cancel()  # a model served after all: stop it
    assert raised.value.setting == "model.scenario"
    assert str(path) in str(raised.value)
