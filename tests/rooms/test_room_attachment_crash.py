"""The attachment crash matrix (docs/design/attachments.md A2, A5, A8): SIGKILL a real room
host after the attachment's file is durable but before its record, after the record but
before the result, and after the result while it is still being re-sent; after each restart
exactly one copy exists, the result names it once, nothing it names is missing, and an
orphaned file is gone. With Fake-Pi and the real Pi where the worker matters.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi.scenario import TINY_PNG, Attach, Call, Step, Text, ToolCalls
from runtime._journal._journal import read_log
from runtime._journal._store import delivery_key
from runtime._linux._fs import OsFileSystem
from runtime._records import Result, ToolIntent, ToolOutcome

from .._workers import scripted_upstream
from .test_room_crash import KINDS, LIMIT, config, host, kill_when_paused, message, recover

PNG: Final = base64.b64decode(TINY_PNG)
DIGEST: Final = hashlib.sha256(PNG).hexdigest()
GRANTS: Final = ("bash", "attach", "send_text_update")


def steps() -> list[Step]:
    return [Attach(path="chart.png"), Text(text="your chart")]


def root_files(root: Path) -> list[str]:
    return sorted(os.listdir(root / "state" / "attachments"))


def work_file(root: Path) -> Path:
    """The chart the agent made, in its lane's working directory."""
    (found,) = (root / "work").rglob("chart.png")
    return found


def delivery_records(root: Path) -> list[Any]:
    rel = f"deliveries/{delivery_key('d1')}.log"
    return list(read_log(OsFileSystem(), str(root / "state"), rel).records)


def named(result: dict[str, Any]) -> list[str]:
    return [a["sha256"] for a in result["attachments"]]


@pytest.mark.parametrize("kind", KINDS)
async def test_a5_a8_killed_after_the_file_before_its_record(kind: str, tmp_path: Path) -> None:
    """The host dies with the picture durable in the root and no outcome naming it. The
    picture in the working directory changes before the restart (an adversary's order): the
    old file is an orphan — no record names it — and is swept at the start; the call (class
    ``receipt``: its outcome is the receipt, and there is none) runs once more and attaches
    what is there now; the result names that one file once, and the model's tool-call answer
    is not asked for again."""
    redrawn = PNG + b"redrawn"
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps()) as (model, url):
            spec = {"config": config(kind, url, GRANTS)}
            await kill_when_paused(tmp_path, spec, "attachment_stored")
            assert root_files(tmp_path) == [DIGEST]
            work_file(tmp_path).write_bytes(redrawn)
            (result,) = await recover(tmp_path, spec)
    new = hashlib.sha256(redrawn).hexdigest()
    assert (result["outcome"], result["text"]) == ("reply", "your chart")
    assert named(result) == [new]
    assert root_files(tmp_path) == [new]
    assert (tmp_path / "state" / "attachments" / new).read_bytes() == redrawn
    records = delivery_records(tmp_path)
    attaches = [r for r in records if isinstance(r, ToolIntent) and r.name == "attach"]
    assert len(attaches) == 1  # the same intent, run once more (T13)
    assert model.request_count == 2  # the tool round once, the answer once


@pytest.mark.parametrize("kind", KINDS)
async def test_a6_killed_after_the_record_before_the_result(kind: str, tmp_path: Path) -> None:
    """The host dies with the outcome naming the picture durable and no result. The picture
    in the working directory is removed before the restart: the replay hands the recorded
    outcome back verbatim (the call does not run again), the result names the stored file
    once, and that file is the one copy."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps()) as (model, url):
            spec = {"config": config(kind, url, GRANTS)}
            await kill_when_paused(tmp_path, spec, "attachment_outcome")
            work_file(tmp_path).unlink()
            (result,) = await recover(tmp_path, spec)
    assert (result["outcome"], result["text"], named(result)) == ("reply", "your chart", [DIGEST])
    assert root_files(tmp_path) == [DIGEST]
    records = delivery_records(tmp_path)
    outcomes = [r for r in records if isinstance(r, ToolOutcome) and r.attachments]
    assert len(outcomes) == 1
    (final,) = [r for r in records if isinstance(r, Result)]
    assert [a.sha256 for a in final.attachments] == [DIGEST]
    assert model.request_count == 2


async def test_a8_killed_while_the_result_is_re_sent(tmp_path: Path) -> None:
    """The host dies after the result was published and before it was acknowledged, then
    again while the next host re-sends it: each restart re-sends the same result — same seq,
    the same attachment once — and the one file stays (a published result names it)."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps()) as (model, url):
            spec = {"config": config("fake", url, GRANTS)}
            async with host(tmp_path, {**spec, "deliver": [message("d1")], "expect": 1}, "a") as h:
                first = (await h.until(lambda f: "result" in f))["result"]
                await h.kill()
            async with host(tmp_path, {**spec, "expect": 1}, "b") as h:
                resent = (await h.until(lambda f: "result" in f))["result"]
                await h.kill()
            (again,) = await recover(tmp_path, spec)
    assert first == resent == again
    assert named(first) == [DIGEST]
    assert root_files(tmp_path) == [DIGEST]
    assert model.request_count == 2


async def test_a6_the_real_pis_read_of_a_picture_is_replayed_byte_for_byte(
    tmp_path: Path,
) -> None:
    """A6, with the real Pi: a ``read`` of a PNG gives an image block; the host dies right
    after its outcome is durable, and the picture is redrawn before the restart. The replay
    hands Pi the recorded result — the same image block, byte for byte, and Pi's details —
    so the session's tool result and the next model request carry the first picture, not the
    redrawn one."""
    make = Attach(path="seen.png").as_tool_calls().calls[0]  # the bash call writing it
    read = Call(name="read", arguments={"path": "seen.png"}, id="r1")
    round_ = ToolCalls(calls=[make, read])
    with trio.fail_after(LIMIT):
        async with scripted_upstream([round_, Text(text="I saw it")]) as (model, url):
            spec = {"config": config("pi", url, ("bash", "read", "send_text_update"))}
            await kill_when_paused(tmp_path, spec, "outcome_of:r1")
            (seen,) = [
                r
                for r in delivery_records(tmp_path)
                if isinstance(r, ToolOutcome) and r.tool_call_id == "r1"
            ]
            (picture,) = [b for b in seen.content if b.get("type") == "image"]
            (found,) = (tmp_path / "work").rglob("seen.png")
            found.write_bytes(base64.b64decode(picture["data"])[:-12] + PNG[-12:] + b"x")
            (result,) = await recover(tmp_path, spec)
    assert (result["outcome"], result["text"]) == ("reply", "I saw it")
    assert base64.b64decode(picture["data"]) == PNG  # the bytes Pi read, unchanged
    (session,) = (tmp_path / "state" / "lanes").rglob("session.jsonl")
    entries = [json.loads(line) for line in session.read_text().splitlines()]
    tool_results = [
        e["message"]
        for e in entries
        if e.get("type") == "message" and e["message"].get("toolCallId") == "r1"
    ]
    assert tool_results, entries
    assert tool_results[-1]["content"] == seen.content  # byte for byte, from the journal
    assert tool_results[-1].get("details") == seen.details
    assert model.request_count == 2  # the tool round once, then the answer
    assert picture["data"] in json.dumps(model.requests[1].body)


async def test_a8_an_unfinished_log_that_cannot_be_read_sweeps_nothing(tmp_path: Path) -> None:
    """A8, with no guess: the host dies with the outcome naming the picture durable and no
    result, and the delivery's own log is then found damaged. What an unreadable log names
    is unknown — a read that failed once may succeed at the next start, and its result would
    name a file already removed — so this start removes no attachment file; the delivery
    ends ``recovery_refused:journal`` (L11), and the next start, with nothing unfinished
    left, sweeps the file no record names."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps()) as (_model, url):
            spec = {"config": config("fake", url, GRANTS)}
            await kill_when_paused(tmp_path, spec, "attachment_outcome")
            log = tmp_path / "state" / "deliveries" / f"{delivery_key('d1')}.log"
            damaged = bytearray(log.read_bytes())
            used = len(damaged.rstrip(b"\0"))  # the log is allocated ahead (J19): zeros after
            damaged[used // 2] ^= 0x40  # inside a record: damage, never a torn tail
            log.write_bytes(bytes(damaged))
            (result,) = await recover(tmp_path, spec)
            assert (result["outcome"], result["code"]) == ("failed", "recovery_refused:journal")
            assert root_files(tmp_path) == [DIGEST]  # kept: the damaged log may name it
            await recover(tmp_path, spec, expect=0)
    assert root_files(tmp_path) == []  # nothing unfinished names it now: swept
