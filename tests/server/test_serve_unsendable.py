"""A result the server fails to prepare goes out as truthful as it can still be built
(docs/design/protocol.md P21), against a real server on 127.0.0.1 with real websocket clients
and a real Fake-Pi worker.

Preparing a stored result for sending — its attachments checked (A7), its frame fitted (P14)
— can fail on a fault of the server's own. Before, any such fault sent the result as
``failed`` / ``server_fault`` and nothing else (P17), although its record is a reply: the
client was told the delivery failed while the agent had answered, and never saw the answer.
Now the record's own words go out, fitted to the bound, each attachment marked ``lost`` with
``server_fault`` (not checked, so never shown as there); only when that frame cannot be built
either is the result sent as P17's bare ``failed`` / ``server_fault``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest
import trio

from fake_pi.scenario import HttpError, Text
from runtime._records import Outcome
from runtime._wire import MAX_SEQ, Attachment, DeliveryResult

from .._wire import message
from .test_serve import LIMIT, rig, still_usable
from .test_serve_attachments import DIGEST, ROOM, SETTINGS, steps
from .test_serve_bounds import LONG_ROOM
from .test_serve_containment import _CheckRaises, _events


async def test_p21_a_reply_whose_attachment_check_raises_is_sent_with_its_words_and_marks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """P21: the reply ``look`` with a picture whose check raises comes as the reply — its
    words whole, its picture listed ``lost`` with ``server_fault`` (its bytes were not
    checked) — the same to a duplicate and at a reconnect; the next result follows; an
    ``ack`` of it acknowledges it (a reconnect after it gets the next one first); the fault is
    logged once, with its traceback. Before: ``failed`` / ``server_fault``, no text."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SETTINGS, [*steps(), Text(text="after")]) as r:
            r.server.attachments = _CheckRaises(r.server.attachments.root)
            async with r.connect() as client:
                await client.send(message("d1", room=ROOM))
                first = await client.result("d1")
                await client.send(message("d2", room=ROOM))
                second = await client.result("d2")
                await client.send(message("d1", room=ROOM))  # a duplicate: its result again
                duplicate = await client.result("d1")
                await still_usable(client)
            async with r.connect() as client:  # not acknowledged: both again, in seq order
                again = [await client.until(lambda f: f["type"] == "result") for _ in range(2)]
                await client.send({"type": "ack", "seq": first["seq"]})
                await still_usable(client)
            async with r.connect() as client:  # d1 acknowledged: d2 comes first now
                after_ack = await client.until(lambda f: f["type"] == "result")
    assert first["outcome"] == "reply", first
    assert (first["text"], first["code"], first["truncated"]) == ("look", None, False)
    (picture,) = first["attachments"]
    assert (picture["sha256"], picture["lost"], picture["code"]) == (DIGEST, True, "server_fault")
    assert (second["outcome"], second["text"]) == ("reply", "after")
    assert second["seq"] == first["seq"] + 1
    assert duplicate == first
    assert again == [first, second]
    assert after_ack == second
    (logged,) = _events(caplog, "result_unsendable")
    assert logged.levelno == logging.ERROR
    assert logged.exc_info is not None
    assert "injected" in str(logged.exc_info[1])
    assert getattr(logged, "seq", None) == first["seq"]
    assert _events(caplog, "attachment_lost") == []  # not checked: not found lost either
    assert _events(caplog, "connection_failed") == []


async def test_p21_a_result_not_a_reply_whose_preparation_raises_is_sent_as_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P21: a ``failed`` result (the provider refused the key: ``model_failed``) whose
    preparation raises goes out as its record says — ``failed`` with its own code, not
    ``server_fault`` — and the next result follows; logged once. Before: ``server_fault``."""

    with trio.fail_after(LIMIT):
        refused = HttpError(status=401, message="Incorrect API key provided")
        async with rig(tmp_path, SETTINGS, [refused, Text(text="after")]) as r:
            prepared = r.server._prepared

            async def raises(result: DeliveryResult) -> DeliveryResult:
                if result.delivery_id == "d1":
                    raise RuntimeError("injected: preparing the result failed")
                return await prepared(result)

            monkeypatch.setattr(r.server, "_prepared", raises)
            async with r.connect() as client:
                await client.send(message("d1", room=ROOM))
                first = await client.result("d1")
                await client.send(message("d2", room=ROOM))
                second = await client.result("d2")
            recorded = r.server.worker.result_of("d1")
    assert recorded is not None
    assert recorded.outcome == "failed"
    assert first["outcome"] == "failed", first
    assert first["code"] == recorded.code != "server_fault"
    assert (second["outcome"], second["text"]) == ("reply", "after")
    (logged,) = _events(caplog, "result_unsendable")
    assert getattr(logged, "seq", None) == first["seq"]


async def test_p21_the_words_sent_unchecked_fit_the_frame_bound(tmp_path: Path) -> None:
    """P21 with P14: a reply recorded under a larger configuration — sixteen attachments with
    names as long as a file system allows, ids at their longest, text longer than the frame —
    sent unchecked under ``max_frame_bytes = 8192`` fits the bound: the text cut and the
    attachments that leave no room left out, ``truncated``; every one carried marked ``lost``
    with ``server_fault``, none shown as there."""
    bound = 8 * 1024
    settings = {
        "server": {"max_frame_bytes": bound},
        "attachments": {"max_per_reply": 1},
    }
    attachments = [
        Attachment(
            id=f"{n:064x}",
            name="\U0001f600" * 63,
            media_type="image/png",
            size=10 * 1024 * 1024,
            sha256=f"{n:064x}",
        )
        for n in range(16)
    ]
    recorded = DeliveryResult(
        seq=MAX_SEQ,
        delivery_id="\U0001f600" * 200,
        room=LONG_ROOM,
        outcome=Outcome.REPLY,
        text="the words " * 1000,
        attachments=attachments,
    )
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings) as r:
            sent = r.server._unchecked(recorded)
    assert len(msgspec.json.encode(sent)) <= bound
    assert sent.truncated
    assert 0 < len(sent.attachments) < len(attachments)
    assert all((a.lost, a.code) == (True, "server_fault") for a in sent.attachments)
    assert [a.id for a in sent.attachments] == [a.id for a in attachments[: len(sent.attachments)]]
    assert sent.text
    assert recorded.text is not None
    assert recorded.text.startswith(sent.text)
    assert (sent.outcome, sent.code, sent.seq) == (Outcome.REPLY, None, MAX_SEQ)
