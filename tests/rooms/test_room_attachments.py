"""Attachments in room lanes (docs/design/attachments.md, A4-A8): a reply carries the files
the agent attached, the outcome that names them is the only way in, refusals reach the model
and never the reply; with Fake-Pi and the real Pi, real processes and a real state directory.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import TINY_PNG, Attach, Call, Step, Text, ToolCalls
from runtime._cli import main
from runtime._config import ModelConfig, RoomConfig, RoomWorkerConfig
from runtime._records import Outcome, Result, ToolOutcome
from runtime._rooms._worker import open_room_worker
from runtime._wire import Attachment, DeliveryResult

from .._pi import pi_home
from .._workers import scripted_upstream
from .test_room_worker import message, next_results

LIMIT: Final = 90.0
ROOM: Final = "dm:100"
PNG: Final = base64.b64decode(TINY_PNG)
DIGEST: Final = hashlib.sha256(PNG).hexdigest()
GRANTS: Final = frozenset({"bash", "attach", "send_text_update"})


def config(kind: str, url: str, **overrides: Any) -> RoomWorkerConfig:
    return RoomWorkerConfig(
        agent="pi" if kind == "pi" else "fake",
        pi_home=str(pi_home()) if kind == "pi" else None,
        model=ModelConfig(base_url=url),
        rooms={ROOM: RoomConfig(grants=GRANTS)},
        **overrides,
    )


def picture(name: str = "picture.png") -> Attachment:
    return Attachment(id=DIGEST, name=name, media_type="image/png", size=len(PNG), sha256=DIGEST)


async def one_reply(tmp_path: Path, steps: list[Step]) -> tuple[ScriptedModel, DeliveryResult]:
    """A Fake-Pi room worker on ``steps`` answers one delivery: the model and the result."""
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (model, url),
            open_room_worker(config("fake", url), base_dir=tmp_path) as worker,
        ):
            await worker.deliver(message("d1"))
            (result,) = await next_results(worker, 1)
    return model, result


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_a4_a_reply_carries_the_picture_the_agent_made_and_attached(
    kind: str, tmp_path: Path
) -> None:
    """A4: the agent makes a file (bash) and attaches it: the reply's result names it once —
    attached twice, under two names, it is one attachment, the first name — its bytes are in
    the attachment root under their sha256, and the outcome that named it is in the
    delivery's journal with Pi's shape (content, details)."""
    steps: list[Step] = [
        Attach(path="out/chart.png"),
        ToolCalls(calls=[Call(name="attach", arguments={"path": "out/chart.png", "name": "x"})]),
        Text(text="here is the chart"),
    ]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (_model, url):
            async with open_room_worker(config(kind, url), base_dir=tmp_path) as worker:
                await worker.deliver(message("d1", "draw me a chart"))
                (result,) = await next_results(worker, 1)
                log = await worker.store.read(worker.store.delivery_rel("d1"))
            async with open_room_worker(config(kind, url), base_dir=tmp_path) as worker:
                again = worker.result_of("d1")
    assert (result.outcome, result.text) == (Outcome.REPLY, "here is the chart")
    assert result.attachments == [picture("chart.png")]
    root = tmp_path / "state" / "attachments"
    assert os.listdir(root) == [DIGEST]
    assert (root / DIGEST).read_bytes() == PNG
    outcomes = [r for r in log.records if isinstance(r, ToolOutcome) and r.attachments]
    assert [o.attachments[0].name for o in outcomes] == ["chart.png", "x"]
    assert outcomes[0].details == {
        "attachment": {"id": DIGEST, "name": "chart.png", "sha256": DIGEST}
    }
    (recorded,) = [r for r in log.records if isinstance(r, Result)]
    assert [a.name for a in recorded.attachments] == ["chart.png"]
    assert again == result  # from the results log, after a restart (and not swept, A8)
    assert os.listdir(root) == [DIGEST]


async def test_a5_a_refused_attach_reaches_the_model_and_not_the_reply(tmp_path: Path) -> None:
    """A5: an attach of a path outside the working directory is the tool's error result,
    which the model reads; the reply's words go out with no attachment and nothing is
    stored."""
    outside = tmp_path / "secret.png"
    outside.write_bytes(PNG)
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="attach", arguments={"path": str(outside)})]),
        Text(text="I could not attach it"),
    ]
    model, result = await one_reply(tmp_path, steps)
    assert (result.outcome, result.text, result.attachments) == (
        Outcome.REPLY,
        "I could not attach it",
        [],
    )
    told = str(model.requests[1].body["messages"][-1]["content"])
    assert "attachment_outside_workdir" in told
    root = tmp_path / "state" / "attachments"
    assert not root.exists() or os.listdir(root) == []


async def test_a4_a_failed_or_silent_turn_carries_no_attachment(tmp_path: Path) -> None:
    """A4: only a reply carries attachments: a turn that attached a picture and then stayed
    silent publishes none (and its file is swept at the next start, A8: no result names
    it)."""
    steps: list[Step] = [Attach(), Text(text="[[stay-silent]]")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (_model, url):
            cfg = config("fake", url)
            async with open_room_worker(cfg, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                (result,) = await next_results(worker, 1)
            root = tmp_path / "state" / "attachments"
            assert os.listdir(root) == [DIGEST]
            async with open_room_worker(cfg, base_dir=tmp_path):
                pass
    assert (result.outcome, result.attachments) == (Outcome.SILENT, [])
    assert os.listdir(root) == []


async def test_a10_journal_verify_reports_a_damaged_attachment_and_an_orphan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A10: ``pi-runtime journal verify`` checks the attachments the journal names: intact,
    nothing to report; one flipped bit in the picture is a problem with its code (exit 1);
    a file no record names is a note, not a problem."""
    steps: list[Step] = [Attach(), Text(text="here")]
    await one_reply(tmp_path, steps)
    state = tmp_path / "state"
    root = state / "attachments"
    verify = ["journal", "verify", "--state-dir", str(state)]
    assert main(verify) == 0
    capsys.readouterr()
    orphan = hashlib.sha256(b"orphan").hexdigest()
    (root / orphan).write_bytes(b"orphan")
    data = bytearray(PNG)
    data[30] ^= 0x04
    (root / DIGEST).write_bytes(bytes(data))
    assert main(verify) == 1
    out = capsys.readouterr().out
    assert f"problem: attachments/{DIGEST}: attachment_damaged: picture.png" in out
    assert f"note: attachments/{orphan}: no record names it" in out


async def test_a12_attaches_past_max_per_reply_are_refused_and_the_turn_replies(
    tmp_path: Path,
) -> None:
    """A12: an agent that attaches 17 files in one round (the default ``max_per_reply`` is
    16) gets ``attachment_limit`` for the 17th as that call's error, reads it, and replies:
    the result names 16 files and nothing of the 17th is stored."""
    count = 17
    make = "for i in $(seq 1 17); do echo file $i > f$i.txt; done"
    calls = [Call(name="attach", arguments={"path": f"f{i}.txt"}) for i in range(1, count + 1)]
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": make})]),
        ToolCalls(calls=calls),
        Text(text="sixteen of them"),
    ]
    model, result = await one_reply(tmp_path, steps)
    assert (result.outcome, result.text) == (Outcome.REPLY, "sixteen of them")
    assert [a.name for a in result.attachments] == [f"f{i}.txt" for i in range(1, 17)]
    told = [m for m in model.requests[2].body["messages"] if m.get("role") == "tool"]
    assert "attachment_limit" in str(told[-1]["content"])
    assert all("attachment_limit" not in str(m["content"]) for m in told[:-1])
    assert len(os.listdir(tmp_path / "state" / "attachments")) == 16
