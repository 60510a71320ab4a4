"""Tool-call ids unique within one model response (``runtime/_boundary/_stream.py``
``ToolCallIds``, applied by the gateway); test names cite ``docs/design/gateway.md`` (G7).

A weak or local provider may give two calls of one response the same id (both ``call_0``)
or none. Pi and Fake-Pi tell the calls apart by their ``index`` and run both; the tool gate
keys a call by (round, id), so two calls under one id would be one call to it. Three
speeds: the pure re-minting (sync), the gateway on loopback against the scripted model,
and a room worker end to end (Fake-Pi and the real Pi as subprocesses).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi.scenario import Call, Step, Text, ToolCalls
from runtime._boundary._steps import MemoryStepJournal
from runtime._boundary._stream import DONE, ToolCallIds, request_digest
from runtime._config import ModelConfig, RoomConfig, RoomWorkerConfig
from runtime._records import Outcome
from runtime._rooms._worker import open_room_worker

from .._pi import pi_home
from .._workers import scripted_upstream, tool_messages
from .test_gateway import BODY, LIMIT, chunk, data, exchange, rig

PROCESS_LIMIT: Final = 90.0
DIGEST: Final = "cd" * 32


def calls_of(payloads: list[str]) -> list[dict[str, Any]]:
    """Every tool-call delta of ``payloads``, in order."""
    return [
        call
        for payload in payloads
        if payload != DONE
        for choice in json.loads(payload)["choices"]
        for call in (choice.get("delta") or {}).get("tool_calls") or []
    ]


# ---------------------------------------------------------------------------- pure re-minting


def test_g7_a_repeated_or_empty_id_is_reminted_from_the_digest_and_index() -> None:
    """G7: a second and a third call under an id the response already gave (``call_0``),
    and a call with an empty id, each get the call's minted id on its first delta; a later
    delta of a re-minted call that repeats the upstream's id carries the minted one (never
    the duplicate); any other later delta keeps the id it brings (Pi keeps a call's first),
    or none when it brings none. The first holder of an id keeps it, bytes untouched. The
    same payloads give the same ids again (a re-paid step)."""
    stream = [
        chunk({"tool_calls": [{"index": 0, "id": "call_0", "function": {"name": "bash"}}]}),
        chunk({"tool_calls": [{"index": 0, "id": "call_0", "function": {"arguments": "{}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_0", "function": {"name": "read"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_0", "function": {"arguments": "{}"}}]}),
        chunk({"tool_calls": [{"index": 2, "id": "", "function": {"name": "ls"}}]}),
        chunk({"tool_calls": [{"index": 2, "function": {"arguments": "{"}}]}),
        chunk({"tool_calls": [{"index": 2, "id": "late", "function": {"arguments": "}"}}]}),
        chunk({"tool_calls": [{"index": 3, "id": "call_0", "function": {"name": "ls"}}]}),
    ]
    ids = ToolCallIds(DIGEST)
    out = [ids.apply(p) for p in stream]
    minted = f"call_{DIGEST[:16]}"
    assert [c.get("id") for c in calls_of(out)] == [
        "call_0",
        "call_0",
        f"{minted}_1",
        f"{minted}_1",
        f"{minted}_2",
        None,
        "late",
        f"{minted}_3",
    ]
    assert out[:2] == stream[:2]  # the first holder's payloads keep their bytes
    again = ToolCallIds(DIGEST)
    assert [again.apply(p) for p in stream] == out  # deterministic
    replayed = ToolCallIds(DIGEST)
    assert [replayed.apply(p) for p in out] == out  # relayed ids stay as they are


def test_g7_a_minted_id_the_upstream_also_gave_is_not_given_twice() -> None:
    """G7: an upstream id that happens to be the one the gateway would mint for another call
    (the digest is the request's, a provider could echo it) does not make two calls share
    it: the later one is re-minted with a suffix of its own."""
    minted = f"call_{DIGEST[:16]}"
    stream = [
        chunk({"tool_calls": [{"index": 0, "id": f"{minted}_1", "function": {"name": "a"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "", "function": {"name": "b"}}]}),
        chunk({"tool_calls": [{"index": 2, "id": f"{minted}_1", "function": {"name": "c"}}]}),
    ]
    ids = ToolCallIds(DIGEST)
    got = [c["id"] for c in calls_of([ids.apply(p) for p in stream])]
    assert len(set(got)) == 3
    assert got[0] == f"{minted}_1"


# ------------------------------------------------------------------------------ the gateway


async def test_g7_two_calls_under_one_id_are_relayed_distinct_and_replayed_the_same() -> None:
    """G7: the scripted model gives two calls of one response the id ``call_0``. The worker
    gets two ids, the first kept, the second minted from the request's digest and the call's
    index; a retry of the request, and a new epoch's gateway on the same journal, are
    answered from the journal with the same bytes, the upstream paid once."""
    calls = [
        Call(name="bash", arguments={"command": "echo a"}, id="call_0"),
        Call(name="bash", arguments={"command": "echo b"}, id="call_0"),
    ]
    digest = request_digest(BODY)
    journal = MemoryStepJournal()
    with trio.fail_after(LIMIT):
        async with rig([ToolCalls(calls=calls)], journal=journal) as r:
            _, live = await exchange(r)
            _, retried = await exchange(r)
        async with rig([Text(text="must not be used")], journal=journal) as again:
            _, replayed = await exchange(again)
    heads = [c for c in calls_of(data(live)) if "function" in c and "name" in c["function"]]
    assert [c["id"] for c in heads] == ["call_0", f"call_{digest[:16]}_1"]
    assert {c["id"] for c in calls_of(data(live)) if "id" in c} == {
        "call_0",
        f"call_{digest[:16]}_1",
    }
    assert journal.responses[digest] == data(live)
    assert data(retried) == data(replayed) == data(live)
    assert r.model.count(digest) == 1
    assert again.model.request_count == 0


# ------------------------------------------------------------------------ end to end, a room


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_g7_two_calls_under_one_id_both_run_once_and_the_delivery_replies(
    kind: str, tmp_path: Path
) -> None:
    """G7 through a room worker: the model calls ``bash`` twice under the id ``call_0`` with
    other arguments. Both calls reach the tool gate as two calls and run once each; the next
    model request carries each call's own result under its own id; the delivery ends in its
    reply. Before, the second call was taken for a replay of the first with other arguments
    and refused (``gate_replay_mismatch``), ending the live delivery
    ``recovery_refused:replay``."""
    runs = tmp_path / "runs"
    both = [f"echo {n} >> {runs}; echo ran-{n}" for n in ("a", "b")]
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": c}, id="call_0") for c in both]),
        Text(text="both done"),
    ]
    rooms = {"dm:100": RoomConfig(grants=frozenset({"bash", "send_text_update"}))}
    with trio.fail_after(PROCESS_LIMIT):
        async with scripted_upstream(steps) as (model, url):
            cfg = RoomWorkerConfig(
                agent="pi" if kind == "pi" else "fake",
                pi_home=str(pi_home()) if kind == "pi" else None,
                model=ModelConfig(base_url=url),
                rooms=rooms,
            )
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(
                    {
                        "delivery_id": "d1",
                        "room": "dm:100",
                        "author": {"id": "u1", "name": "Ann"},
                        "message_id": "m-d1",
                        "text": "run both",
                    }
                )
                async for found in worker.results():
                    result = found
                    break
    assert (result.outcome, result.code, result.text) == (Outcome.REPLY, None, "both done")
    assert sorted(runs.read_text().split()) == ["a", "b"]  # each ran, once
    assert model.request_count == 2
    results = tool_messages(model.requests[1].body)
    assert len(results) == 2
    assert sorted(text.strip() for text in results.values()) == ["ran-a", "ran-b"]
