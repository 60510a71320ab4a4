"""The model gateway (``runtime/_boundary/_gateway.py``); test names cite
``docs/design/gateway.md`` (G1…).

Two speeds: the pure helpers (sync), and the Trio shell on loopback sockets against the
scripted model (real clock, short intervals, every wait bounded by ``trio.fail_after`` and
driven by events, never by sleeping); plus end-to-end runs of Fake-Pi and the real Pi
pointed at the gateway.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import resource
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import h11
import pytest
import trio
import trio.testing

from fake_pi._retry import is_retryable
from fake_pi.model_server import ScriptedModel, body_digest
from fake_pi.model_server import serve_model as serve_model_http
from fake_pi.scenario import Call, Cut, Hang, HttpError, Scenario, Step, Text, ToolCalls
from runtime import ReasonCode
from runtime._boundary._gateway import (
    KEEPALIVE,
    Gateway,
    GatewayConfig,
    _Downstream,
    _Keepalives,
    data_inactivity_message,
    inactivity_message,
    serve_gateway,
)
from runtime._boundary._h1 import END, ServerConnection
from runtime._boundary._http import (
    HttpClientError,
    HttpServer,
    Request,
    ResponseWriter,
    SseEvent,
    SseParser,
    _socket_of,
    iter_sse,
    open_request,
    serve_http,
)
from runtime._boundary._steps import DeliveryStepJournal, MemoryStepJournal
from runtime._boundary._stream import DONE, ToolCallIds, is_terminal, request_digest, sse_data
from runtime._clock import Clocks
from runtime._errors import JournalError, ReplayMismatch, StepRefused
from runtime._journal._store import open_store
from runtime._pi._rpc import open_rpc_channel
from runtime._pi._session_files import create_session
from runtime._pi._worker import ModelRoute, RetrySettings, WorkerLaunch, WorkerProgram, open_worker
from runtime._records import ModelRequestIntent, ModelResponse

from .._pi import real_pi
from .._secrets import files_containing

LIMIT: Final = 10.0
PROCESS_LIMIT: Final = 90.0
BODY: Final[dict[str, Any]] = {
    "model": "fake-model",
    "stream": True,
    "messages": [{"role": "user", "content": "say hi"}],
}
UPSTREAM_KEY_ENV: Final = "PI_RUNTIME_TEST_UPSTREAM_KEY"
UPSTREAM_KEY: Final = "sk-secret-123"
SSE: Final = [("content-type", "text/event-stream")]

Handler = Callable[[Request, ResponseWriter], Awaitable[None]]


def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
    return json.dumps(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )


# ---------------------------------------------------------------------------- pure helpers


def test_g1_digest_is_over_the_canonical_body() -> None:
    reordered = {"stream": True, "messages": BODY["messages"], "model": "fake-model"}
    assert request_digest(BODY) == request_digest(reordered) == body_digest(BODY)
    assert request_digest({**BODY, "model": "other"}) != request_digest(BODY)


def test_g1_nested_key_order_and_a_floats_spelling_do_not_change_the_step() -> None:
    """G1 below the top level: keys are sorted at every depth, and a number is its value, not
    its spelling (``0.7`` and ``7e-1`` are one float)."""
    spelled = json.loads('{"m": [{"b": 1, "a": {"y": 0.5, "x": 2}}], "temperature": 0.7}')
    respelled = json.loads('{"temperature": 7e-1, "m": [{"a": {"x": 2, "y": 5.0e-1}, "b": 1}]}')
    assert request_digest(spelled) == request_digest(respelled)


def test_g3_an_event_split_across_reads_at_every_byte_parses_the_same() -> None:
    """G3: however the upstream's bytes are split into reads — down to one byte a read, inside
    a multi-byte character, between ``\\r`` and ``\\n`` — the events are the same."""
    delta = {"content": "h\u00e9llo \U0001f600"}  # sent as UTF-8, not escaped
    text = json.dumps({"choices": [{"index": 0, "delta": delta}]}, ensure_ascii=False)
    spread = b'data: {"a":\r\ndata: 1}\r\n\r\n'  # one event, two data lines
    stream = sse_data(text) + b": ping\r\n\r\n" + spread + sse_data(DONE)
    whole = SseParser().feed(stream)
    parser = SseParser()
    one_by_one = [event for i in range(len(stream)) for event in parser.feed(stream[i : i + 1])]
    assert one_by_one == whole
    assert [e.data for e in whole] == [text, None, '{"a":\n1}', DONE]


async def test_sse_framing_round_trips() -> None:
    async def feed() -> AsyncIterator[bytes]:
        yield sse_data(chunk({"content": "a"})) + KEEPALIVE[:5]
        yield KEEPALIVE[5:] + sse_data(DONE)

    events = [event async for event in iter_sse(feed())]
    assert events == [
        SseEvent(data=chunk({"content": "a"})),
        SseEvent(comment="keepalive"),
        SseEvent(data=DONE),
    ]


def test_g4_terminal_part_is_finish_usage_and_done() -> None:
    assert not is_terminal(chunk({"content": "x"}))
    assert not is_terminal(chunk({"role": "assistant", "content": ""}))
    assert is_terminal(chunk({}, "stop"))
    assert is_terminal(chunk({}, "tool_calls"))
    assert is_terminal(json.dumps({"choices": [], "usage": {"total_tokens": 3}}))
    assert not is_terminal(json.dumps({"choices": [], "usage": None}))
    assert is_terminal(DONE)
    assert not is_terminal("not json")


def test_g7_missing_ids_are_minted_on_the_first_delta_only() -> None:
    first = chunk({"tool_calls": [{"index": 0, "type": "function", "function": {"name": "bash"}}]})
    more = chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})
    second = chunk({"tool_calls": [{"index": 1, "id": "", "function": {"name": "read"}}]})
    given = chunk({"tool_calls": [{"index": 2, "id": "call_x", "function": {"name": "ls"}}]})
    ids = ToolCallIds("ab" * 32)
    out = [ids.apply(p) for p in (first, more, second, given)]
    calls = [json.loads(p)["choices"][0]["delta"]["tool_calls"][0] for p in out]
    assert [c.get("id") for c in calls] == [
        "call_abababababababab_0",
        None,
        "call_abababababababab_1",
        "call_x",
    ]
    assert out[1] == more  # untouched payloads keep their bytes
    assert out[3] == given
    again = ToolCallIds("ab" * 32)
    assert [again.apply(p) for p in (first, more, second, given)] == out  # deterministic


def test_g10_the_inactivity_error_is_retryable_by_pi() -> None:
    message = inactivity_message(270)
    assert is_retryable(message)
    assert ReasonCode.GATEWAY_UPSTREAM_INACTIVE in message


# ------------------------------------------------------------------------------ the shell


@dataclass
class Rig:
    gateway: Gateway
    server: HttpServer
    model: ScriptedModel
    journal: MemoryStepJournal
    upstream_auth: list[str | None] = field(default_factory=list)
    intents_when_upstream_called: list[list[str]] = field(default_factory=list)
    upstream_connections: list[int] = field(default_factory=list)
    """The upstream server's connection number for each request it got (G17)."""
    upstream_bodies: list[bytes] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"{self.server.url}/v1/chat/completions"

    def headers(self, secret: str | None = None) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {secret or self.gateway.secret}")]


@contextlib.asynccontextmanager
async def rig(
    steps: Sequence[Step] = (),
    *,
    journal: MemoryStepJournal | None = None,
    upstream: Handler | None = None,
    environ: Mapping[str, str] | None = None,
    **config: Any,
) -> AsyncIterator[Rig]:
    model = ScriptedModel(scenario=Scenario(steps=list(steps)))
    journal = journal or MemoryStepJournal()
    this: Rig | None = None

    async def recording(request: Request, response: ResponseWriter) -> None:
        assert this is not None
        this.upstream_auth.append(request.headers.get("authorization"))
        this.intents_when_upstream_called.append(list(getattr(journal, "requests", [])))
        this.upstream_connections.append(request.connection)
        this.upstream_bodies.append(request.body)
        await (upstream or model.handle)(request, response)

    async with trio.open_nursery() as nursery:
        up: HttpServer = await nursery.start(functools.partial(serve_http, recording))
        settings = {"keepalive_interval": 0.05, "upstream_inactivity": 5.0, **config}
        gateway = Gateway(
            GatewayConfig(upstream_url=f"{up.url}/v1", **settings),
            journal,
            environ=environ if environ is not None else {},
        )
        server: HttpServer = await nursery.start(functools.partial(serve_gateway, gateway))
        this = Rig(gateway, server, model, journal)
        yield this
        nursery.cancel_scope.cancel()


async def exchange(
    rig: Rig, body: Mapping[str, Any] = BODY, secret: str | None = None
) -> tuple[int, list[SseEvent]]:
    async with open_request(
        "POST", rig.url, headers=rig.headers(secret), body=json.dumps(body).encode()
    ) as response:
        if response.status != 200:
            return response.status, [SseEvent(data=(await response.read()).decode())]
        return 200, [event async for event in iter_sse(response.iter_bytes())]


def data(events: list[SseEvent]) -> list[str]:
    return [e.data for e in events if e.data is not None]


async def exchange_cut(rig: Rig, body: Mapping[str, Any] = BODY) -> list[SseEvent]:
    """What the worker got before its stream was cut (it must be: G10, G14, G16)."""
    got: list[SseEvent] = []

    async def read() -> None:
        async with open_request(
            "POST", rig.url, headers=rig.headers(), body=json.dumps(body).encode()
        ) as response:
            assert response.status == 200
            async for event in iter_sse(response.iter_bytes()):
                got.append(event)

    with pytest.raises(HttpClientError):
        await read()
    return got


def gated(more: trio.Event) -> Handler:
    """An upstream that sends one chunk, waits for ``more``, then finishes (stop, ``[DONE]``)."""

    async def upstream(request: Request, response: ResponseWriter) -> None:
        await response.start(200, SSE)
        await response.send(sse_data(chunk({"content": "hel"})))
        await more.wait()
        await response.send(sse_data(chunk({}, "stop")) + sse_data(DONE))
        await response.end()

    return upstream


def answering(*answers: Sequence[str]) -> Handler:
    """An upstream that answers its n-th request with the n-th list of SSE payloads, all in
    one write (one read of the gateway may complete them all), and ends its stream."""
    left = iter(answers)

    async def upstream(request: Request, response: ResponseWriter) -> None:
        await response.start(200, SSE)
        await response.send(b"".join(map(sse_data, next(left))))
        await response.end()

    return upstream


async def test_g3_chunks_pass_through_before_the_upstream_finishes() -> None:
    more = trio.Event()

    async def halting(request: Request, response: ResponseWriter) -> None:
        await response.start(200, SSE)
        await response.send(sse_data(chunk({"content": "hel"})))
        await more.wait()
        await response.send(sse_data(chunk({"content": "lo"})) + sse_data(chunk({}, "stop")))
        await response.send(sse_data(DONE))
        await response.end()

    with trio.fail_after(LIMIT):
        async with (
            rig(upstream=halting, keepalive_interval=60) as r,
            open_request(
                "POST", r.url, headers=r.headers(), body=json.dumps(BODY).encode()
            ) as resp,
        ):
            events = iter_sse(resp.iter_bytes())
            first = await anext(events)
            assert first.data == chunk({"content": "hel"})  # the upstream is still waiting
            assert not more.is_set()
            more.set()
            rest = [e async for e in events]
    assert data(rest) == [chunk({"content": "lo"}), chunk({}, "stop"), DONE]
    assert r.journal.responses[request_digest(BODY)] == [first.data, *data(rest)]


class BlockingJournal(MemoryStepJournal):
    def __init__(self) -> None:
        super().__init__()
        self.entered = trio.Event()
        self.release = trio.Event()

    async def record_response(self, digest: str, chunks: list[str]) -> None:
        self.entered.set()
        await self.release.wait()
        await super().record_response(digest, chunks)


async def test_g4_g5_terminal_part_held_until_durable_with_keepalives() -> None:
    journal = BlockingJournal()
    with trio.fail_after(LIMIT):
        async with (
            rig([Text(text="one two three")], journal=journal) as r,
            open_request(
                "POST", r.url, headers=r.headers(), body=json.dumps(BODY).encode()
            ) as resp,
        ):
            events = iter_sse(resp.iter_bytes())
            before: list[SseEvent] = []
            keepalives_while_held = 0
            while keepalives_while_held < 3:
                event = await anext(events)
                before.append(event)
                if event.comment == "keepalive" and journal.entered.is_set():
                    keepalives_while_held += 1
            assert not any(is_terminal(p) for p in data(before))
            assert "".join(
                json.loads(p)["choices"][0]["delta"]["content"] for p in data(before)
            ) == ("one two three")
            assert journal.responses == {}
            journal.release.set()
            after = [e async for e in events]
    relayed = data(before) + data(after)
    assert [is_terminal(p) for p in data(after)] == [True, True, True]  # finish, usage, [DONE]
    assert data(after)[-1] == DONE
    assert journal.responses[request_digest(BODY)] == relayed


async def test_g2_g6_replay_from_the_journal_pays_upstream_once() -> None:
    digest = request_digest(BODY)
    with trio.fail_after(LIMIT):
        async with rig([Text(text="paid once")]) as r:
            status, first = await exchange(r)
            assert status == 200
            assert r.intents_when_upstream_called == [[digest]]  # G2: intent before the call
            status, retried = await exchange(r)  # Pi's retry resends identical bytes
            assert (status, data(retried)) == (200, data(first))
            assert r.model.count(digest) == 1
            stats = r.gateway.statistics()
            assert (stats.upstream_calls, stats.replayed, stats.journaled) == (1, 1, 1)
        # a new epoch (new gateway, new secret) on the same journal: still not paid again
        async with rig([Text(text="must not be used")], journal=r.journal) as again:
            status, replayed = await exchange(again)
            assert (status, data(replayed)) == (200, data(first))
            assert again.model.count(digest) == 0
            assert again.model.request_count == 0


async def test_only_requests_in_flight_hold_a_lock() -> None:
    """The per-digest locks (identical requests in flight wait for each other) do not
    accumulate: a gateway that answered many distinct requests holds none afterwards."""
    with trio.fail_after(LIMIT):
        async with rig([Text(text=f"answer {n}") for n in range(5)]) as r:
            for n in range(5):
                status, _ = await exchange(
                    r, {**BODY, "messages": [{"role": "user", "content": str(n)}]}
                )
                assert status == 200
            await trio.testing.wait_all_tasks_blocked()  # the last handler has returned
            assert r.gateway._locks == {}


async def test_g14_a_released_delivery_refuses_without_stopping_the_gateway(
    tmp_path: Path,
) -> None:
    """After the lane releases the delivery (its turn ended), its journal forgets it and a
    late request of its worker is refused (409), while the gateway goes on serving."""
    with trio.fail_after(LIMIT):
        async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
            log = await store.create_delivery_log("d1")
            steps = DeliveryStepJournal(log, epoch=1)
            await steps.record_request("a" * 64)
            await steps.record_response("a" * 64, [DONE])
            steps.release()
            assert await steps.lookup("a" * 64) is None
            with pytest.raises(StepRefused):
                await steps.record_request("b" * 64)
            async with rig(journal=steps) as r:  # type: ignore[arg-type]
                status, _ = await exchange(r)
                assert status == 409
                status, _ = await exchange(r)
                assert status == 409  # still serving
            await store.close_log(log)


async def test_g14_a_request_waiting_for_its_twin_keeps_the_delivery_it_arrived_in() -> None:
    """G14, G6: R2, identical to delivery A's R1 in flight, waits for it (the per-digest lock);
    meanwhile the lane ends A and attaches B. R1's answer comes after that: detached (cut, not
    journaled). R2 belongs to A too: it must neither record A's step into B's journal nor pay
    the upstream again, but be refused as a request of an ended delivery is."""
    more = trio.Event()
    a, b = MemoryStepJournal(), MemoryStepJournal()
    digest = request_digest(BODY)
    second: list[tuple[int, list[SseEvent]]] = []
    with trio.fail_after(LIMIT):
        async with rig(upstream=gated(more), journal=a, keepalive_interval=60) as r:

            async def ask_again() -> None:
                second.append(await exchange(r))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(exchange_cut, r)  # R1: streams, then is detached
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(ask_again)  # R2: Pi's retry of the same body
                await trio.testing.wait_all_tasks_blocked()
                assert r.gateway._locks[digest].statistics().tasks_waiting == 1
                r.gateway.journal = b  # the lane: A ended, B attached (Boundaries.attach)
                more.set()
            stats = r.gateway.statistics()
    assert (b.requests, b.responses) == ([], {})
    assert (a.requests, a.responses) == ([digest], {})
    assert len(r.upstream_bodies) == 1
    ((status, body),) = second
    assert status == 409
    assert json.loads(body[0].data or "")["error"]["type"] == ReasonCode.GATEWAY_BAD_REQUEST
    assert (stats.detached, stats.refused) == (1, 1)


async def test_g7_omitted_tool_ids_assigned_and_stable_across_replay() -> None:
    calls = [Call(name="bash", arguments={"command": "echo a"}), Call(name="ls", arguments={})]
    with trio.fail_after(LIMIT):
        async with rig([ToolCalls(calls=calls, omit_ids=True)]) as r:
            _, live = await exchange(r)
            _, replayed = await exchange(r)
    ids = [
        call["id"]
        for payload in data(live)
        if payload != DONE
        for choice in json.loads(payload)["choices"]
        for call in choice["delta"].get("tool_calls", [])
        if "id" in call
    ]
    digest = request_digest(BODY)
    assert ids == [f"call_{digest[:16]}_0", f"call_{digest[:16]}_1"]
    assert data(replayed) == data(live)
    assert r.model.count(digest) == 1


async def test_g8_wrong_or_missing_secret_is_refused_before_upstream() -> None:
    with trio.fail_after(LIMIT):
        async with rig([Text(text="never")]) as r:
            old = r.gateway.secret
            status, body = await exchange(r, secret="not-the-secret")
            assert status == 401
            assert json.loads(body[0].data or "")["error"]["type"] == "gateway_unauthorized"
            async with open_request("POST", r.url, body=json.dumps(BODY).encode()) as resp:
                assert resp.status == 401
                await resp.read()
            new = r.gateway.rotate_secret()
            assert new != old
            status, _ = await exchange(r, secret=old)
            assert status == 401
            assert r.model.request_count == 0
            assert r.journal.requests == []
            assert r.gateway.statistics().refused == 3
            status, _ = await exchange(r, secret=new)
            assert status == 200
            assert r.model.request_count == 1


async def test_g9_upstream_key_read_per_request_and_never_journaled() -> None:
    environ = {UPSTREAM_KEY_ENV: UPSTREAM_KEY}
    second = {**BODY, "messages": [{"role": "user", "content": "again"}]}
    third = {**BODY, "messages": [{"role": "user", "content": "and again"}]}
    with trio.fail_after(LIMIT):
        async with rig(environ=environ, upstream_key_env=UPSTREAM_KEY_ENV) as r:
            assert (await exchange(r))[0] == 200
            environ[UPSTREAM_KEY_ENV] = "sk-rotated"
            assert (await exchange(r, second))[0] == 200
            del environ[UPSTREAM_KEY_ENV]
            status, body = await exchange(r, third)
    assert r.upstream_auth == [f"Bearer {UPSTREAM_KEY}", "Bearer sk-rotated"]
    assert status == 500
    assert "gateway_upstream_key_missing" in (body[0].data or "")
    assert UPSTREAM_KEY not in json.dumps(r.journal.responses)
    assert r.model.request_count == 2


async def test_g10_upstream_silence_mid_stream_is_a_retryable_error() -> None:
    with trio.fail_after(LIMIT):
        async with (
            rig([Hang(seconds=60)], upstream_inactivity=0.3, keepalive_interval=0.05) as r,
            open_request(
                "POST", r.url, headers=r.headers(), body=json.dumps(BODY).encode()
            ) as resp,
        ):
            assert resp.status == 200
            events: list[SseEvent] = []

            async def read_all() -> None:
                async for event in iter_sse(resp.iter_bytes()):
                    events.append(event)

            with pytest.raises(HttpClientError):  # then the connection is cut
                await read_all()
    error = json.loads(data(events)[-1])["error"]["message"]
    assert is_retryable(error)
    assert "gateway_upstream_inactive" in error
    assert any(e.comment == "keepalive" for e in events)  # G5: while the upstream was silent
    assert r.journal.responses == {}
    assert r.gateway.statistics().inactivity_aborts == 1


def numbered(n: int) -> dict[str, Any]:
    return {**BODY, "messages": [{"role": "user", "content": f"request {n}"}]}


async def test_g1_upstream_gets_the_workers_body_bytes_as_they_came() -> None:
    """The digest is over the canonical body; the bytes sent upstream are the worker's own
    (its key order and spacing), not a re-encoding."""
    sent = json.dumps({"stream": True, **BODY}, indent=1, ensure_ascii=True).encode()
    with trio.fail_after(LIMIT):
        async with (
            rig([Text(text="as sent")]) as r,
            open_request("POST", r.url, headers=r.headers(), body=sent) as response,
        ):
            assert response.status == 200
            await response.read()
    assert r.upstream_bodies == [sent]
    assert r.journal.requests == [request_digest(json.loads(sent))]


async def test_g17_a_lanes_requests_share_one_kept_alive_upstream_connection() -> None:
    with trio.fail_after(LIMIT):
        async with rig([Text(text=f"answer {n}") for n in range(3)]) as r:
            for n in range(3):
                status, _ = await exchange(r, numbered(n))
                assert status == 200
            stats = r.gateway.statistics()
    assert r.upstream_connections == [1, 1, 1]
    assert (stats.upstream_calls, stats.upstream_connections) == (3, 1)


async def test_g17_a_stream_aborted_for_silence_does_not_leave_its_connection() -> None:
    """G10 cut the first response mid-stream: its connection is closed, never given to the
    next request (which would read the rest of the old answer as its own)."""
    with trio.fail_after(LIMIT):
        async with rig(
            [Text(text="late words", delay=60), Text(text="on time")],
            upstream_inactivity=0.3,
            keepalive_interval=60,
        ) as r:
            cut: list[SseEvent] = []

            async def read_until_cut() -> None:
                async with open_request(
                    "POST", r.url, headers=r.headers(), body=json.dumps(numbered(1)).encode()
                ) as response:
                    async for event in iter_sse(response.iter_bytes()):
                        cut.append(event)

            with pytest.raises(HttpClientError):  # the worker's stream is cut after the error
                await read_until_cut()
            status, answered = await exchange(r, numbered(2))
            stats = r.gateway.statistics()
    assert "gateway_upstream_inactive" in error_message(cut)
    assert status == 200
    text = [json.loads(p)["choices"] for p in data(answered) if p != DONE]
    assert "".join(c[0]["delta"].get("content", "") for c in text if c) == "on time"
    assert r.upstream_connections == [1, 2]
    assert (stats.inactivity_aborts, stats.upstream_connections) == (1, 2)


@contextlib.contextmanager
def descriptors_taken_below(n: int) -> Iterator[None]:
    """Every file descriptor below ``n`` taken (duplicates of /dev/null; the soft
    RLIMIT_NOFILE raised towards the hard one if it is too low), so the sockets opened meanwhile
    get numbers from ``n`` up: a busy host with a raised limit. All released afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = n + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    filler = [os.open(os.devnull, os.O_RDONLY)]
    try:
        while filler[-1] < n - 1:  # dup takes the lowest free number: all below are taken
            filler.append(os.dup(filler[0]))
        yield
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_g17_a_kept_alive_connection_numbered_above_1024_is_reused() -> None:
    """G17 looks at an idle connection before taking it again (has the server closed it?).
    On a descriptor numbered 1024 or more that look must work as on any other — select()
    cannot take such a number, and its ValueError escaped the request and stopped the
    lane's gateway."""
    with descriptors_taken_below(1100), trio.fail_after(LIMIT):
        async with rig([Text(text="one"), Text(text="two")]) as r:
            first, _ = await exchange(r, numbered(1))
            (kept,) = [idle.stream for each in r.gateway._upstream._idle.values() for idle in each]
            assert _socket_of(kept).fileno() >= 1024  # past select()'s FD_SETSIZE
            second, _ = await exchange(r, numbered(2))
            stats = r.gateway.statistics()
    assert (first, second) == (200, 200)
    assert r.upstream_connections == [1, 1]  # the kept connection carried the second request
    assert stats.upstream_connections == 1


async def test_g10_upstream_silence_before_headers_is_a_504() -> None:
    with trio.fail_after(LIMIT):
        async with rig(
            [Text(text="late", first_token_delay=60)],
            upstream_inactivity=0.3,
            keepalive_interval=60,
        ) as r:
            status, body = await exchange(r)
    assert status == 504
    assert is_retryable(f"504: {body[0].data}")


def commenting(*script: float | str, then_hang: bool = False) -> Handler:
    """An upstream stream: SSE comments for each float (seconds, one every 0.05 s), a data
    event for each str; then it ends, or hangs silent."""

    async def upstream(request: Request, response: ResponseWriter) -> None:
        await response.start(200, SSE)
        for step in script:
            if isinstance(step, str):
                await response.send(sse_data(step))
                continue
            until = trio.current_time() + step
            while trio.current_time() < until:
                await response.send(b": processing\n\n")
                await trio.sleep(0.05)
        if then_hang:
            await trio.sleep_forever()
        await response.end()

    return upstream


def error_message(events: list[SseEvent]) -> str:
    message = json.loads(data(events)[-1])["error"]["message"]
    assert isinstance(message, str)
    return message


async def test_g15_an_upstream_sending_only_comments_is_cut_by_the_data_deadline() -> None:
    with trio.fail_after(LIMIT):
        async with rig(
            upstream=commenting(math.inf), upstream_data_inactivity=0.3, keepalive_interval=60
        ) as r:
            status, body = await exchange(r)
    message = error_message(body)
    assert status == 504
    assert message == data_inactivity_message(0.3)
    assert "no data event" in message
    assert is_retryable(f"504: {message}")
    assert ReasonCode.GATEWAY_UPSTREAM_INACTIVE in message
    stats = r.gateway.statistics()
    assert (stats.data_inactivity_aborts, stats.inactivity_aborts) == (1, 0)  # comments are bytes
    assert r.journal.responses == {}


async def test_g15_data_events_reset_the_data_deadline() -> None:
    payloads = [chunk({"content": "a"}), chunk({"content": "b"}), chunk({}, "stop"), DONE]
    script = [item for payload in payloads for item in (0.4, payload)]  # 1.6 s, 0.4 s per gap
    with trio.fail_after(LIMIT):
        async with rig(upstream=commenting(*script), upstream_data_inactivity=1.0) as r:
            status, events = await exchange(r)
    assert (status, data(events)) == (200, payloads)
    assert r.journal.responses[request_digest(BODY)] == payloads
    stats = r.gateway.statistics()
    assert (stats.data_inactivity_aborts, stats.inactivity_aborts, stats.journaled) == (0, 0, 1)


async def test_g15_without_a_data_deadline_only_the_byte_rule_cuts_comments() -> None:
    with trio.fail_after(LIMIT):
        async with rig(
            upstream=commenting(0.6, then_hang=True),
            upstream_inactivity=0.3,
            keepalive_interval=60,
        ) as r:
            started = trio.current_time()
            status, body = await exchange(r)
            elapsed = trio.current_time() - started
    assert r.gateway.config.upstream_data_inactivity is None
    assert elapsed >= 0.6  # comments kept the stream alive past upstream_inactivity (G10)
    assert (status, error_message(body)) == (504, inactivity_message(0.3))  # then the silence
    stats = r.gateway.statistics()
    assert (stats.data_inactivity_aborts, stats.inactivity_aborts) == (0, 1)


async def test_g16_a_stream_that_ends_without_a_terminal_part_is_cut_not_journaled() -> None:
    """The upstream ends its stream cleanly after some content, with no ``finish_reason``,
    usage or ``[DONE]``: an incomplete response. The gateway neither journals it nor finishes
    the worker's stream as if it were whole: it cuts it, as an upstream cut (the worker
    retries, and the step is asked again)."""

    async def incomplete(request: Request, response: ResponseWriter) -> None:
        await response.start(200, SSE)
        await response.send(sse_data(chunk({"content": "half an ans"})))
        await response.end()

    with trio.fail_after(LIMIT):
        async with rig(upstream=incomplete) as r:
            with pytest.raises(HttpClientError):
                await exchange(r)
            assert r.journal.responses == {}
            assert r.gateway.statistics().incomplete_streams == 1


PROVIDER_ERROR: Final = {"code": 502, "message": "Provider disconnected unexpectedly"}
OPENROUTER_ERROR: Final = json.dumps(
    {
        "id": "c",
        "object": "chat.completion.chunk",
        "error": PROVIDER_ERROR,
        "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}],
    }
)
VLLM_ERROR: Final = json.dumps({"error": {**PROVIDER_ERROR, "type": "InternalServerError"}})


@pytest.mark.parametrize(
    "failed",
    [[chunk({"content": "par"}), OPENROUTER_ERROR], [VLLM_ERROR]],
    ids=["openrouter", "vllm"],
)
async def test_g10_an_error_event_in_a_200_stream_is_relayed_cut_and_never_journaled(
    failed: list[str],
) -> None:
    """G10: the upstream answered 200 and then reported an error inside the stream — a payload
    with a top-level ``error`` (OpenRouter also ends the choice ``finish_reason: "error"``,
    vLLM just follows it with ``[DONE]``). That is an upstream error, not the step's answer:
    the worker gets the error event and a cut, nothing is journaled, and the same request —
    Pi's retry, or a later epoch's — is asked upstream again."""
    whole = [chunk({"content": "whole"}), chunk({}, "stop"), DONE]
    with trio.fail_after(LIMIT):
        async with rig(upstream=answering([*failed, DONE], whole)) as r:
            relayed = await exchange_cut(r)
            assert r.journal.responses == {}
            status, retried = await exchange(r)
            stats = r.gateway.statistics()
    assert data(relayed) == failed  # up to the error, the error itself, nothing after it
    assert (status, data(retried)) == (200, whole)
    assert len(r.upstream_bodies) == 2
    assert r.journal.responses == {request_digest(BODY): whole}
    assert (stats.stream_errors, stats.journaled) == (1, 1)


async def test_g7_a_malformed_upstream_stream_stays_in_its_request() -> None:
    """G3, G7: an upstream whose stream is odd — a tool call whose ``index`` is not a number,
    a line that is not UTF-8 — is relayed as it came (the call's id assigned by its position,
    the bytes that are not text replaced). It must not raise out of the request into the
    lane's gateway: a provider's fault stays in its request."""
    odd_call = {"tool_calls": [{"index": None, "function": {"name": "ls", "arguments": "{}"}}]}

    async def odd(request: Request, response: ResponseWriter) -> None:
        await response.start(200, SSE)
        await response.send(sse_data(chunk(odd_call)))
        await response.send(b'data: {"choices": [], "note": "\xff\xfe"}\n\n')
        await response.send(sse_data(chunk({}, "tool_calls")) + sse_data(DONE))
        await response.end()

    with trio.fail_after(LIMIT):
        async with rig(upstream=odd) as r:
            status, events = await exchange(r)
            again_status, _ = await exchange(r)  # the gateway still serves
    assert (status, again_status) == (200, 200)
    payloads = data(events)
    (call,) = json.loads(payloads[0])["choices"][0]["delta"]["tool_calls"]
    assert call["id"] == f"call_{request_digest(BODY)[:16]}_0"
    assert "\ufffd" in payloads[1]
    assert payloads[-1] == DONE


async def test_upstream_errors_and_cuts_are_relayed_not_journaled() -> None:
    with trio.fail_after(LIMIT):
        # no keepalive before the 503 arrives (a loaded machine): it is relayed as a status
        steps: list[Step] = [HttpError(status=503, message="busy"), Cut(after_chunks=2)]
        async with rig(steps, keepalive_interval=LIMIT) as r:
            status, body = await exchange(r)
            assert status == 503
            assert "busy" in (body[0].data or "")
            with pytest.raises(HttpClientError):
                await exchange(r)
            assert r.journal.responses == {}
            assert r.journal.requests == [request_digest(BODY)] * 2


async def test_g11_the_gate_barrier_holds_a_request_with_keepalives() -> None:
    open_gate = trio.Event()
    held: list[dict[str, Any]] = []

    async def barrier(body: dict[str, Any]) -> None:
        held.append(body)
        await open_gate.wait()

    with trio.fail_after(LIMIT):
        async with rig([Text(text="through")]) as r:
            r.gateway._barrier = barrier  # the tool gate's hook
            async with open_request(
                "POST", r.url, headers=r.headers(), body=json.dumps(BODY).encode()
            ) as resp:
                events = iter_sse(resp.iter_bytes())
                assert (await anext(events)).comment == "keepalive"
                assert held == [BODY]
                assert r.model.request_count == 0
                open_gate.set()
                rest = [e async for e in events]
    assert data(rest)[-1] == DONE
    assert r.model.request_count == 1


class RefusingJournal(MemoryStepJournal):
    """Refuses every new step as a diverged replay (G13)."""

    async def record_request(self, digest: str) -> None:
        await trio.lowlevel.checkpoint()
        raise ReplayMismatch(ReasonCode.RECOVERY_REFUSED, "the replay took another path")


async def test_g5_g13_a_refusal_after_a_keepalive_is_an_sse_error_not_a_cut() -> None:
    """G5 started the 200 stream while the request waited at the gate barrier (G11); then the
    journal refused the step (G13). The worker gets the refusal as an SSE error event carrying
    its reason code, and the stream's end: a bare cut would read as a network failure, which
    Pi and Fake-Pi retry."""
    open_gate = trio.Event()

    async def barrier(body: dict[str, Any]) -> None:
        await open_gate.wait()

    with trio.fail_after(LIMIT):
        async with rig([Text(text="never")], journal=RefusingJournal()) as r:
            r.gateway._barrier = barrier
            async with open_request(
                "POST", r.url, headers=r.headers(), body=json.dumps(BODY).encode()
            ) as resp:
                assert resp.status == 200
                events = iter_sse(resp.iter_bytes())
                assert (await anext(events)).comment == "keepalive"
                open_gate.set()
                rest = [e async for e in events]  # ends: no HttpClientError
    message = error_message(rest)
    assert message.startswith(f"{ReasonCode.RECOVERY_REFUSED}: ")
    assert not is_retryable(message)
    assert r.model.request_count == 0
    assert r.gateway.statistics().refused == 1


async def test_a_worker_that_goes_away_mid_stream_still_gets_the_step_journaled() -> None:
    more = trio.Event()

    class Recorded(MemoryStepJournal):
        done = trio.Event()

        async def record_response(self, digest: str, chunks: list[str]) -> None:
            await super().record_response(digest, chunks)
            self.done.set()

    journal = Recorded()
    with trio.fail_after(LIMIT):
        async with rig(upstream=gated(more), keepalive_interval=60, journal=journal) as r:
            async with open_request(
                "POST", r.url, headers=r.headers(), body=json.dumps(BODY).encode()
            ) as resp:
                await anext(iter_sse(resp.iter_bytes()))
            more.set()  # the worker's connection is closed now
            await journal.done.wait()
            _, replayed = await exchange(r)
    assert data(replayed) == [chunk({"content": "hel"}), chunk({}, "stop"), DONE]
    assert r.intents_when_upstream_called == [[request_digest(BODY)]]


class PoisonedJournal(MemoryStepJournal):
    async def record_request(self, digest: str) -> None:
        await trio.lowlevel.checkpoint()
        raise JournalError(ReasonCode.JOURNAL_POISONED, "a write failed")


async def test_g12_a_journal_failure_stops_the_gateway() -> None:
    gateway = Gateway(GatewayConfig(upstream_url="http://127.0.0.1:9/v1"), PoisonedJournal())

    async def ask(server: HttpServer) -> bytes:
        async with open_request(
            "POST",
            f"{server.url}/v1/chat/completions",
            headers=[("authorization", f"Bearer {gateway.secret}")],
            body=json.dumps(BODY).encode(),
        ) as resp:
            return await resp.read()

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            server: HttpServer = await nursery.start(functools.partial(serve_gateway, gateway))
            with pytest.raises(HttpClientError):  # the worker is cut, nothing answered
                await ask(server)

    with trio.fail_after(LIMIT), pytest.raises(ExceptionGroup) as caught:
        await run()
    (error,) = caught.value.exceptions
    assert isinstance(error, JournalError)
    assert error.code == ReasonCode.JOURNAL_POISONED


async def test_delivery_step_journal_on_a_real_log(tmp_path: Path) -> None:
    digest_a, digest_b = "a" * 64, "b" * 64
    with trio.fail_after(LIMIT):
        async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
            log = await store.create_delivery_log("d1")
            steps = DeliveryStepJournal(log, epoch=1)
            assert await steps.lookup(digest_a) is None
            await steps.record_request(digest_a)
            await steps.record_request(digest_a)  # a retry after a cut keeps its step
            await steps.record_response(digest_a, ["x", DONE])
            await steps.record_request(digest_b)
            await store.close_log(log)
        async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
            log = await store.open_delivery_log("d1")
            records = log.contents.records[1:]
            assert records == (
                ModelRequestIntent(step=0, request_digest=digest_a, epoch=1),
                ModelRequestIntent(step=0, request_digest=digest_a, epoch=1),
                ModelResponse(step=0, request_digest=digest_a, chunks=["x", DONE], epoch=1),
                ModelRequestIntent(step=1, request_digest=digest_b, epoch=1),
            )
            reopened = DeliveryStepJournal(log, epoch=2)
            assert await reopened.lookup(digest_a) == ["x", DONE]
            assert await reopened.lookup(digest_b) is None
            assert reopened.step_of(digest_b) == 1
            await reopened.record_request("c" * 64)
            assert reopened.step_of("c" * 64) == 2


async def test_g13_a_dead_epochs_late_answer_is_not_this_epochs_replay(tmp_path: Path) -> None:
    """G12, G13: epoch 1 asked step 1 (b) and died while the answer streamed; its request goes
    on (a paid answer is journaled, G12) and lands after epoch 2 began. Epoch 2 replayed only
    step 0: the late answer is journaled — under the epoch that asked it — but it is not what
    epoch 2 replayed, so epoch 2's next request, not b, leaves an answered step behind and is
    refused (G13), as it would be had the answer landed before epoch 2 began."""
    a, b, x = "a" * 64, "b" * 64, "x" * 64
    with trio.fail_after(LIMIT):
        async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
            log = await store.create_delivery_log("d1")
            steps = DeliveryStepJournal(log, epoch=1, replay=True)
            await steps.record_request(a)
            await steps.record_response(a, [DONE])
            await steps.record_request(b)  # epoch 1's request in flight as it dies
            steps.begin_epoch(2)
            assert await steps.lookup(a) == [DONE]  # epoch 2 replays step 0
            await steps.record_response(b, ["late", DONE])  # epoch 1's answer lands
            with pytest.raises(ReplayMismatch) as refused:
                await steps.record_request(x)  # epoch 2 diverged at step 1
            assert refused.value.code is ReasonCode.RECOVERY_REFUSED
            assert await steps.lookup(b) == ["late", DONE]  # journaled all the same
            await store.close_log(log)
        async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
            log = await store.open_delivery_log("d1")
            (late,) = [r for r in log.contents.records if isinstance(r, ModelResponse)][1:]
            await store.close_log(log)
    assert (late.step, late.epoch) == (1, 1)  # recorded as the epoch that asked it


async def test_g13_a_replay_that_leaves_an_answered_step_behind_is_refused(
    tmp_path: Path,
) -> None:
    """With ``replay``, each epoch asks the steps again from the first: a request the journal
    did not answer while answered steps remain is a mismatch — refused, nothing recorded. A
    request past every answered step, or the unanswered step asked again, is fine; without
    ``replay`` (a resumed session) nothing is checked."""
    a, b, c, x = "a" * 64, "b" * 64, "c" * 64, "x" * 64
    with trio.fail_after(LIMIT):
        async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
            log = await store.create_delivery_log("d1")
            first = DeliveryStepJournal(log, epoch=1, replay=True)
            for digest in (a, b):
                await first.record_request(digest)
                await first.record_response(digest, [DONE])
            await first.record_request(c)  # asked, never answered
            await store.close_log(log)
        async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
            log = await store.open_delivery_log("d1")
            count = len(log.contents.records)
            replaying = DeliveryStepJournal(log, epoch=1, replay=True)
            replaying.begin_epoch(2)
            assert await replaying.lookup(a) == [DONE]
            with pytest.raises(ReplayMismatch) as refused:
                await replaying.record_request(x)  # step 1 was b, not x
            assert refused.value.code is ReasonCode.RECOVERY_REFUSED
            assert replaying.mismatch is refused.value
            assert replaying.step_of(x) is None
            await store.close_log(log)

        async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
            log = await store.open_delivery_log("d1")
            assert len(log.contents.records) == count  # the refusal recorded nothing
            again = DeliveryStepJournal(log, epoch=3, replay=True)
            again.begin_epoch(3)
            assert await again.lookup(a) == [DONE]
            assert await again.lookup(b) == [DONE]
            await again.record_request(c)  # the unanswered step, asked again
            assert again.step_of(c) == 2
            await again.record_request(x)  # past every answered step: a new one
            assert (again.step_of(x), again.mismatch) == (3, None)

            resumed = DeliveryStepJournal(log, epoch=4)  # a resumed session: not checked
            resumed.begin_epoch(4)
            await resumed.record_request("y" * 64)
            assert resumed.mismatch is None
            await store.close_log(log)


# ---------------------------------------------------------------- adversarial boundary checks


def key_echoing(status: int) -> Handler:
    """An upstream that refuses the key it was given and quotes it back in its error: as a
    whole ``status`` response, or (200) as an error event inside the stream."""

    async def upstream(request: Request, response: ResponseWriter) -> None:
        given = request.headers.get("authorization", "").removeprefix("Bearer ")
        error = json.dumps({"error": {"message": f"Incorrect API key provided: {given}"}})
        if status != 200:
            await response.respond(status, error.encode())
            return
        await response.start(200, SSE)
        await response.send(sse_data(error))
        await response.end()

    return upstream


@pytest.mark.parametrize("status", [401, 200], ids=["status", "in-stream"])
async def test_g9_an_upstream_error_quoting_the_key_reaches_the_worker_without_it(
    status: int,
) -> None:
    """G9: the upstream key is never handed to the worker — not even inside an upstream's
    error, which the gateway relays (a provider that quotes the key it refused). The worker
    gets the error with the key blotted out."""
    environ = {UPSTREAM_KEY_ENV: UPSTREAM_KEY}
    with trio.fail_after(LIMIT):
        async with rig(
            upstream=key_echoing(status), environ=environ, upstream_key_env=UPSTREAM_KEY_ENV
        ) as r:
            if status == 200:
                events = await exchange_cut(r)
                got = "".join(data(events))
            else:
                got_status, events = await exchange(r)
                assert got_status == status
                got = "".join(data(events))
    assert r.upstream_auth == [f"Bearer {UPSTREAM_KEY}"]
    assert "Incorrect API key provided" in got  # the error is relayed
    assert UPSTREAM_KEY not in got


async def test_g8_g13_a_dead_epochs_request_waiting_for_its_twin_is_not_served(
    tmp_path: Path,
) -> None:
    """G8, G13: epoch 1 asked step 0 (R1, streaming) and again (R2, Pi's retry of the same
    body, waiting for R1: G6). Epoch 1 is fenced and epoch 2 begins: its secret rotated, so
    R2 — authorized with epoch 1's secret, still waiting — is not served: nothing of epoch 1
    is answered after its secret stopped working. Had it been replayed, that replay would
    count as epoch 2's, and epoch 2's diverging first request would go upstream instead of
    being refused."""
    more = trio.Event()
    diverged = {**BODY, "messages": [{"role": "user", "content": "something else"}]}
    got: dict[str, tuple[int, list[SseEvent]]] = {}
    with trio.fail_after(LIMIT):
        async with open_store(tmp_path / "state", clocks=Clocks.system()) as store:
            log = await store.create_delivery_log("d1")
            steps = DeliveryStepJournal(log, epoch=1, replay=True)
            async with rig(upstream=gated(more), journal=steps, keepalive_interval=60) as r:  # type: ignore[arg-type]

                async def ask(name: str) -> None:
                    got[name] = await exchange(r)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ask, "R1")
                    await trio.testing.wait_all_tasks_blocked()
                    nursery.start_soon(ask, "R2")
                    await trio.testing.wait_all_tasks_blocked()
                    assert r.gateway._locks[request_digest(BODY)].statistics().tasks_waiting == 1
                    steps.begin_epoch(2)  # the lane: Boundaries.begin_epoch
                    r.gateway.rotate_secret()
                    more.set()
                status, _ = await exchange(r, diverged)  # epoch 2's first request
                upstream_calls = len(r.upstream_bodies)
            await store.close_log(log)
    assert got["R1"][0] == 200  # asked before the fence: answered and journaled (G12)
    assert got["R2"][0] == 401
    assert json.loads(got["R2"][1][0].data or "")["error"]["type"] == "gateway_unauthorized"
    assert status == 409  # G13: epoch 2 never asked step 0 again
    assert upstream_calls == 1


@pytest.mark.parametrize(
    "terminal",
    [
        [chunk({}, "stop"), DONE, DONE],
        [json.dumps({"choices": [], "usage": {"total_tokens": 3}}), chunk({}, "stop"), DONE],
    ],
    ids=["done-twice", "usage-before-finish"],
)
async def test_g4_g6_an_odd_terminal_part_is_held_journaled_and_replayed_as_it_came(
    terminal: list[str],
) -> None:
    """G4, G6: a terminal part in another order than finish, usage, ``[DONE]`` — ``[DONE]``
    twice, the usage chunk first — is held from its first payload, journaled whole and
    replayed as the worker got it live, and the step is paid once."""
    script = [chunk({"content": "x"}), *terminal]
    with trio.fail_after(LIMIT):
        async with rig(upstream=answering(script)) as r:
            live_status, live = await exchange(r)
            again_status, again = await exchange(r)
    assert (live_status, again_status) == (200, 200)
    assert data(live) == data(again) == script
    assert r.journal.responses == {request_digest(BODY): script}
    assert len(r.upstream_bodies) == 1


async def test_g3_g6_a_data_event_of_several_lines_is_relayed_and_replayed_whole() -> None:
    """G3, G6: SSE lets an event's data span several ``data:`` lines (joined by newlines). The
    worker must get each payload whole, live and replayed: a payload with a newline framed
    as one ``data:`` line would reach the worker cut at its first line."""
    spread = (
        'data: {"id": "c", "object": "chat.completion.chunk",\n'
        'data: "choices": [{"index": 0, "delta": {"content": "two lines"}, '
        '"finish_reason": null}]}\n\n'
    )

    async def upstream(request: Request, response: ResponseWriter) -> None:
        await response.start(200, SSE)
        await response.send(spread.encode())
        await response.send(sse_data(chunk({}, "stop")) + sse_data(DONE))
        await response.end()

    with trio.fail_after(LIMIT):
        async with rig(upstream=upstream) as r:
            _, live = await exchange(r)
            _, replayed = await exchange(r)
    payloads = data(live)
    assert json.loads(payloads[0])["choices"][0]["delta"]["content"] == "two lines"
    assert data(replayed) == payloads
    assert len(r.upstream_bodies) == 1


# ------------------------------------------------------------------------- end to end


def _launch(
    kind: str, root: Path, session: Path, gateway: Gateway, server: HttpServer
) -> WorkerLaunch:
    # the secret travels in the environment, not on disk: both workers resolve "$NAME"
    program = WorkerProgram.pi(real_pi()) if kind == "pi" else WorkerProgram.fake_pi()
    api_key = "$PI_RUNTIME_GATEWAY_SECRET"
    extra_env = {"PI_RUNTIME_GATEWAY_SECRET": gateway.secret}
    for sub in ("work", "home", "tmp"):
        (root / sub).mkdir(exist_ok=True)
    return WorkerLaunch(
        program=program,
        cwd=root / "work",
        home=root / "home",
        agent_dir=root / "home" / "agent",
        tmp_dir=root / "tmp",
        session=session,
        route=ModelRoute(
            provider="fake", model="fake-model", base_url=f"{server.url}/v1", api_key=api_key
        ),
        retry=RetrySettings(max_retries=2, base_delay_ms=20),
        extra_env=extra_env,
        state_dir=root / "state",
    )


async def _one_turn(launch: WorkerLaunch, events: list[str] | None = None) -> str:
    """Prompt once, wait for ``agent_settled``; the final assistant text."""
    async with (
        open_worker(launch) as worker,
        open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
    ):
        prompted = await rpc.prompt("say hello")
        settled = await rpc.wait_settled(prompted.settled_before)
        assert settled.record["aborted"] is False
        if events is not None:
            async for event in rpc:  # buffered: read back up to the settle
                events.append(event.type)
                if event.type == "agent_settled":
                    break
        messages = (await rpc.request({"type": "get_messages"})).data["messages"]
        last = messages[-1]
        assert last["role"] == "assistant", last
        assert last.get("stopReason") == "stop", last
        return "".join(p.get("text", "") for p in last["content"])


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_e2e_turn_through_the_gateway_then_replay_after_restart(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """G2, G6, G8, G9 with a real worker: a turn completes through the gateway; a restarted
    worker on the same session (rewound to the admission leaf) is answered from the journal;
    neither the upstream key nor (for Pi) the epoch secret is in any file written."""
    monkeypatch.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    for sub in ("work", "home", "tmp"):
        (tmp_path / sub).mkdir()
    session = tmp_path / "sessions" / "lane.jsonl"
    session.parent.mkdir()
    create_session(
        session,
        cwd=str(tmp_path / "work"),
        provider="fake",
        model_id="fake-model",
        clock=Clocks.system().wall,
    )
    admission_leaf = session.read_bytes()
    model = ScriptedModel(scenario=Scenario(steps=[Text(text="hello from upstream")]))
    upstream_auth: list[str | None] = []

    async def upstream(request: Request, response: ResponseWriter) -> None:
        upstream_auth.append(request.headers.get("authorization"))
        await model.handle(request, response)

    with trio.fail_after(PROCESS_LIMIT):
        async with (
            open_store(tmp_path / "state", clocks=Clocks.system()) as store,
            trio.open_nursery() as nursery,
        ):
            up: HttpServer = await nursery.start(functools.partial(serve_http, upstream))
            log = await store.create_delivery_log("delivery-1")
            steps = DeliveryStepJournal(log, epoch=1)
            texts: list[str] = []
            for epoch in (1, 2):
                session.write_bytes(admission_leaf)  # what replay does: back to the leaf
                steps.begin_epoch(epoch)
                gateway = Gateway(
                    GatewayConfig(upstream_url=f"{up.url}/v1", upstream_key_env=UPSTREAM_KEY_ENV),
                    steps,
                )
                server: HttpServer = await nursery.start(functools.partial(serve_gateway, gateway))
                texts.append(await _one_turn(_launch(kind, tmp_path, session, gateway, server)))
                assert files_containing([tmp_path], gateway.secret) == []
            nursery.cancel_scope.cancel()
        assert texts == ["hello from upstream", "hello from upstream"]
        assert model.request_count == 1  # the restarted worker was answered from the journal
        assert upstream_auth == [f"Bearer {UPSTREAM_KEY}"]
        assert files_containing([tmp_path], UPSTREAM_KEY) == []


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_e2e_g10_silent_upstream_is_retried_in_the_same_process(
    kind: str, tmp_path: Path
) -> None:
    """G10: the gateway aborts a silent upstream; the worker auto-retries the identical
    request in the same process and the turn completes with the retry's answer."""
    model = ScriptedModel(scenario=Scenario(steps=[Hang(seconds=60), Text(text="after retry")]))
    with trio.fail_after(PROCESS_LIMIT):
        async with trio.open_nursery() as nursery:
            up: HttpServer = await nursery.start(serve_model_http, model)
            journal = MemoryStepJournal()
            gateway = Gateway(
                GatewayConfig(
                    upstream_url=f"{up.url}/v1", upstream_inactivity=0.5, keepalive_interval=0.1
                ),
                journal,
            )
            server: HttpServer = await nursery.start(functools.partial(serve_gateway, gateway))
            events: list[str] = []
            launch = _launch(kind, tmp_path, tmp_path / "lane.jsonl", gateway, server)
            assert await _one_turn(launch, events) == "after retry"
            nursery.cancel_scope.cancel()
    assert "auto_retry_start" in events
    assert "auto_retry_end" in events
    digests = [r.digest for r in model.requests]
    assert len(digests) == 2
    assert digests[0] == digests[1]  # the same bytes, retried in the same process
    assert gateway.statistics().inactivity_aborts == 1
    assert list(journal.responses) == [digests[0]]


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_e2e_a_stream_cut_upstream_is_retried_and_the_turn_completes(
    kind: str, tmp_path: Path
) -> None:
    """An upstream that drops the connection mid-stream: the gateway cuts the worker's
    stream too (nothing journaled for the cut attempt), the worker retries the identical
    request in the same process, and the turn completes with the retry's answer."""
    model = ScriptedModel(scenario=Scenario(steps=[Cut(after_chunks=2), Text(text="whole")]))
    with trio.fail_after(PROCESS_LIMIT):
        async with trio.open_nursery() as nursery:
            up: HttpServer = await nursery.start(serve_model_http, model)
            journal = MemoryStepJournal()
            gateway = Gateway(GatewayConfig(upstream_url=f"{up.url}/v1"), journal)
            server: HttpServer = await nursery.start(functools.partial(serve_gateway, gateway))
            events: list[str] = []
            launch = _launch(kind, tmp_path, tmp_path / "lane.jsonl", gateway, server)
            assert await _one_turn(launch, events) == "whole"
            nursery.cancel_scope.cancel()
    assert "auto_retry_start" in events
    digests = [r.digest for r in model.requests]
    assert len(digests) == 2
    assert digests[0] == digests[1]
    assert journal.requests == digests  # both attempts recorded as intents
    assert list(journal.responses) == [digests[0]]  # only the whole answer journaled


class _GoneWorker:
    """A worker connection that is gone: every send fails; counts the attempts."""

    started = True

    def __init__(self) -> None:
        self.sends = 0

    async def start(
        self, status: int, headers: list[tuple[str, str]], data: bytes = b"", *, end: bool = False
    ) -> None:
        raise trio.BrokenResourceError

    async def send(self, data: bytes) -> None:
        self.sends += 1
        if self.sends > 100:
            raise AssertionError("the keepalive loop spins on a gone worker")
        raise trio.BrokenResourceError


async def test_g5_keepalives_stop_once_the_worker_is_gone() -> None:
    """G5: a worker that went away mid-stream (the step goes on, G12's note) gets no more
    keepalives: the loop ends instead of spinning (a send to a gone worker is a no-op, so
    the loop would never sleep again — it did, at 100 % CPU, until the upstream ended)."""
    worker = _GoneWorker()
    downstream = _Downstream(worker)  # type: ignore[arg-type]
    with trio.fail_after(5):  # a spinning loop still checkpoints: cancelled, then failed
        await downstream.keepalive(0.001)
    assert downstream.gone
    assert worker.sends == 1


class _SlowEndingWorker:
    """A worker connection whose end of the response takes a while (a slow socket): h11
    refuses any data once the response has ended, as the real writer's does."""

    def __init__(self) -> None:
        self.started = False
        self.ended = False
        self.after_end: list[bytes] = []

    async def start(
        self, status: int, headers: list[tuple[str, str]], data: bytes = b"", *, end: bool = False
    ) -> None:
        self.started = True
        await self.send(data)
        if end:
            await self.end()

    async def send(self, data: bytes) -> None:
        if self.ended:
            self.after_end.append(data)
            raise h11.LocalProtocolError("can't send data when our state is DONE")

    async def end(self, data: bytes = b"") -> None:
        await self.send(data)
        await trio.sleep(2)  # the keepalive comes due meanwhile, and waits for the lock
        self.ended = True


async def test_g5_a_keepalive_due_as_the_response_ends_sends_nothing_after_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """G5, G12: a keepalive that came due while the response was being ended waits for the
    send lock, and gets it once the response has ended: it must send nothing then — h11
    refuses data after the end, an error no handler expects, and it would escape the
    request into the lane's gateway."""
    worker = _SlowEndingWorker()
    downstream = _Downstream(worker)  # type: ignore[arg-type]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(downstream.keepalive, 1.0)
            await downstream.send(b"data: {}\n\n")
            await downstream.finish(b"data: [DONE]\n\n")
            await trio.sleep(5)  # the keepalive has had every chance to send
            nursery.cancel_scope.cancel()
    assert worker.ended
    assert worker.after_end == []


def _writer_for_a_request() -> tuple[ResponseWriter, list[bytes]]:
    """A response writer for one HTTP/1.1 request, and the list of its writes, each whole."""
    conn = ServerConnection()
    conn.receive_data(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    while conn.next_event() is not END:
        pass
    writes: list[bytes] = []
    wire = trio.testing.MemorySendStream()

    async def taken() -> None:  # after each write: that write's bytes, whole
        writes.append(bytes(wire.get_data_nowait()))

    wire.send_all_hook = taken
    return ResponseWriter(wire, conn), writes


async def test_g3_a_stream_s_head_goes_with_its_first_event_and_its_end_with_its_last() -> None:
    """G3, G6: each send to the worker is one write — the response's head with the first
    events, the held terminal part with the stream's end, a replay's whole answer at once —
    so the worker wakes once for each, not for a head or an end alone."""
    writer, writes = _writer_for_a_request()
    downstream = _Downstream(writer)
    await downstream.send(b"data: {}\n\n")
    await downstream.finish(b"data: [DONE]\n\n")
    assert len(writes) == 2
    assert writes[0].startswith(b"HTTP/1.1 200 ")
    assert writes[0].endswith(b"\r\n\r\na\r\ndata: {}\n\n\r\n")
    assert writes[1] == b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    replay, replayed = _writer_for_a_request()
    await _Downstream(replay).finish(b"data: {}\n\ndata: [DONE]\n\n")
    assert len(replayed) == 1
    assert replayed[0].endswith(b"\r\n\r\n18\r\ndata: {}\n\ndata: [DONE]\n\n\r\n0\r\n\r\n")


async def test_g5a_a_request_answered_in_time_starts_no_keepalive_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """G5a: requests answered within the keepalive interval start no task of their own (one
    was started and cancelled per request, about 35 µs of the loop's time); a request that
    stays silent for the interval gets its keepalives (G5)."""
    started: list[_Downstream] = []
    loop = _Downstream.keepalive

    async def counted(self: _Downstream, interval: float) -> None:
        started.append(self)
        await loop(self, interval)

    monkeypatch.setattr(_Downstream, "keepalive", counted)
    with trio.fail_after(LIMIT):
        async with rig([Text(text=w) for w in ("one", "two", "three")], keepalive_interval=60) as r:
            for n in range(3):
                status, events = await exchange(r, {**BODY, "user": f"in-time-{n}"})
                assert status == 200
                assert data(events)[-1] == DONE
    assert started == []
    more = trio.Event()
    with trio.fail_after(LIMIT):
        async with (
            rig(upstream=gated(more), keepalive_interval=0.05) as r,
            open_request(
                "POST", r.url, headers=r.headers(), body=json.dumps(BODY).encode()
            ) as response,
        ):
            comments = 0
            async for event in iter_sse(response.iter_bytes()):
                if event.data is None:
                    comments += 1
                    if comments == 2:
                        more.set()
    assert len(started) == 1


class _Quiet:
    """A response the watcher sees (G5a): when data last went out, and when its own
    keepalive loop was started."""

    def __init__(self) -> None:
        self.last_sent = trio.current_time()
        self.looped_at: list[float] = []

    async def keepalive(self, interval: float) -> None:
        self.looped_at.append(trio.current_time())


async def test_g5a_responses_in_flight_together_each_get_their_keepalive_on_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """G5a: the watcher starts each response's loop when that response has been silent for
    the interval — not earlier, not later — whatever the others do: data moving one on, one
    watched while the watcher sleeps, one forgotten (its request ended), one watched after
    none was."""
    keepalives = _Keepalives(15.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keepalives.run)
        a, b, gone = _Quiet(), _Quiet(), _Quiet()
        keepalives.watch(a, nursery)  # type: ignore[arg-type]
        keepalives.watch(gone, nursery)  # type: ignore[arg-type]
        await trio.sleep(5)
        b.last_sent = trio.current_time()
        keepalives.watch(b, nursery)  # type: ignore[arg-type]
        await trio.sleep(3)
        a.last_sent = trio.current_time()  # data flowed to a at 8
        await trio.sleep(2)
        keepalives.forget(gone)  # type: ignore[arg-type]
        await trio.sleep(40)
        assert b.looped_at == [20.0]
        assert a.looped_at == [23.0]
        assert gone.looped_at == []
        late = _Quiet()  # none watched since 23: the watcher waits for the next
        keepalives.watch(late, nursery)  # type: ignore[arg-type]
        await trio.sleep(20)
        assert late.looped_at == [65.0]
        nursery.cancel_scope.cancel()
