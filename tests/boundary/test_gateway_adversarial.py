"""The model gateway against an adversary: an upstream that ends oddly, a worker that sends odd
bodies; test names cite ``docs/design/gateway.md`` (G1…).

Loopback sockets against scripted upstreams (real clock, short bounds, every wait bounded by
``trio.fail_after`` and driven by events, never by sleeping).
"""

from __future__ import annotations

import json
from typing import Final

import trio

from runtime._boundary._http import Request, ResponseWriter, SseParser, open_request
from runtime._boundary._stream import DONE, request_digest, sse_data

from .test_gateway import (
    BODY,
    LIMIT,
    SSE,
    Handler,
    Rig,
    chunk,
    data,
    exchange,
    exchange_cut,
    rig,
)

WHOLE: Final = [chunk({"content": "hi"}), chunk({}, "stop"), DONE]


def answered_then_cut(*, end_after: int = 0) -> Handler:
    """An upstream whose first response is the whole answer, ``[DONE]`` included, and then is
    cut before the chunked body's end (the handler returns without ending it: its connection is
    closed); from its ``end_after``-th response on it ends its responses properly."""
    calls = 0

    async def upstream(request: Request, response: ResponseWriter) -> None:
        nonlocal calls
        calls += 1
        await response.start(200, SSE)
        await response.send(b"".join(map(sse_data, WHOLE)))
        if end_after and calls >= end_after:
            await response.end()

    return upstream


async def test_g4_g6_a_whole_answer_cut_after_its_done_is_journaled_not_paid_again() -> None:
    """G4, G6: the upstream sends the whole answer, ``[DONE]`` included, and then its
    connection is cut before the HTTP body's end (a proxy that resets after the last event).
    Nothing more could have come: the answer is finished and paid for. The gateway must
    journal it and finish the worker's stream; before, the cut made it an upstream cut — the
    worker's stream was cut, nothing journaled, and the worker's retry paid the model again
    for the same answer."""
    with trio.fail_after(LIMIT):
        async with rig(upstream=answered_then_cut()) as r:
            status, events = await exchange(r)
            again_status, again = await exchange(r)
            stats = r.gateway.statistics()
    assert (status, data(events)) == (200, WHOLE)
    assert (again_status, data(again)) == (200, WHOLE)
    assert len(r.upstream_bodies) == 1  # paid once
    assert r.journal.responses == {request_digest(BODY): WHOLE}
    assert (stats.journaled, stats.replayed) == (1, 1)
    assert r.gateway.upstream_failure is None  # an answer, not an outage


async def test_g4_g16_a_cut_after_the_finish_but_before_done_is_still_a_cut() -> None:
    """G4, G16: a cut after the ``finish_reason`` chunk but before ``[DONE]`` may have lost the
    usage chunk that follows it: nothing says the response is whole, so it stays a cut (not
    journaled, retried), as before."""
    partial = [chunk({"content": "hi"}), chunk({}, "stop")]

    async def upstream(request: Request, response: ResponseWriter) -> None:
        await response.start(200, SSE)
        await response.send(b"".join(map(sse_data, partial)))

    with trio.fail_after(LIMIT):
        async with rig(upstream=upstream) as r:
            got = await exchange_cut(r)
    assert data(got) == [chunk({"content": "hi"})]  # the finish was held, never released
    assert r.journal.responses == {}


async def test_g16_a_stream_cut_mid_event_is_a_cut() -> None:
    """G16: a stream cut in the middle of an event — its ``data:`` line written, the blank line
    that completes it never — is a cut even when the cut-off event is ``[DONE]``: an event is
    only what a blank line completed."""

    async def upstream(request: Request, response: ResponseWriter) -> None:
        await response.start(200, SSE)
        await response.send(b"".join(map(sse_data, WHOLE[:2])) + b"data: [DONE]\n")

    with trio.fail_after(LIMIT):
        async with rig(upstream=upstream) as r:
            await exchange_cut(r)
    assert r.journal.responses == {}


async def exchange_raw(r: Rig, body: bytes) -> tuple[int, bytes]:
    """Send ``body`` as it is; the status and the whole response body."""
    async with open_request("POST", r.url, headers=r.headers(), body=body) as response:
        return response.status, await response.read()


def _payloads(stream: bytes) -> list[str]:
    """The data payloads of an SSE stream, its comments (keepalives, G5) left out."""
    parser = SseParser()
    events = [*parser.feed(stream), *parser.end()]
    return [event.data for event in events if event.data is not None]


async def test_g1_g6_a_body_with_a_lone_surrogate_is_served_and_replayed() -> None:
    """G1, G6: Pi removes lone surrogates from the texts it sends, but not from all of a body:
    a thinking block sent back as ``reasoning_content`` (a provider's reasoning field), a
    tool call's id or name go as they are, and ``JSON.stringify`` writes a lone surrogate as
    ``\\ud83d`` — a reasoning stream cut between the two halves of an emoji leaves one. Such
    a body is JSON (JavaScript reads it) and the provider reads it; before, the gateway
    answered it 400 ``gateway_bad_request``, which Pi does not retry, and since the session
    sends that message again with every later request, every later turn failed too. It is a
    step like any other: relayed as it came, journaled, replayed, its digest its own."""
    raw = (
        b'{"model":"fake-model","stream":true,"messages":[{"role":"user","content":"hi"},'
        b'{"role":"assistant","content":"ok","reasoning_content":"think \\ud83d"},'
        b'{"role":"user","content":"again"}]}'
    )
    with trio.fail_after(LIMIT):
        async with rig(upstream=answered_then_cut(end_after=1)) as r:
            first = await exchange_raw(r, raw)
            second = await exchange_raw(r, raw)
            stats = r.gateway.statistics()
    assert first[0] == second[0] == 200, first
    assert _payloads(first[1]) == _payloads(second[1])  # a slow live one had keepalives too
    assert r.upstream_bodies == [raw]  # relayed as it came, and paid once
    assert (stats.journaled, stats.replayed) == (1, 1)
    escaped = json.loads(raw)
    escaped["messages"][1]["reasoning_content"] = "think \\ud83d"  # the six characters
    assert request_digest(json.loads(raw)) != request_digest(escaped)
