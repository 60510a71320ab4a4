"""Every frame the server sends fits ``[server] max_frame_bytes`` (docs/design/protocol.md
P14, P15): a real server on 127.0.0.1, a real websocket client that takes frames of at most
that size (a larger one closes its connection, 1009), a real Fake-Pi worker.

``max_frame_bytes`` bounds both ways (serve.md "Configuration"): a client built to it — its
websocket library's ``max_message_size`` set to it — must never be sent a larger frame, or
it loses its connection, and with a frame it asked for again (a ``status``, a fetch), at
every try."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio

from runtime._errors import ReasonCode
from runtime._records import Outcome
from runtime._rooms import _worker
from runtime._wire import Attachment, DeliveryResult, RoomStatus, fit_result

from .._wire import Client, Frame, message
from .test_serve import LIMIT, Rig, error, rig, still_usable
from .test_serve_attachments import BIG_PNG, fetch, steps

BOUND: Final = 8 * 1024
"""A small frame bound the configuration allows (C15, with one attachment a reply)."""
SETTINGS: Final[dict[str, Any]] = {
    "server": {"max_frame_bytes": BOUND},
    "attachments": {"max_per_reply": 1, "fetch_bytes_per_second": 1024 * 1024},
}
LONG_ROOM: Final = "room:" + "\U0001f600" * 200
"""A room id at its longest: 805 UTF-8 bytes."""


@contextlib.asynccontextmanager
async def bounded(r: Rig) -> AsyncIterator[Client]:
    """A client that takes frames of at most ``BOUND`` UTF-8 bytes: a larger one fails the
    test (trio-websocket's own ``max_message_size`` counts a text frame's characters, not
    its bytes, so it is set, and the bytes are counted here too)."""
    async with r.connect(max_message_size=BOUND) as client:

        async def receive() -> Frame:
            text = await client.ws.get_message()
            size = len(text.encode() if isinstance(text, str) else text)
            assert size <= BOUND, f"a frame of {size} bytes: {text[:200]!r}"
            frame: Frame = json.loads(text)
            return frame

        client.receive = receive  # type: ignore[method-assign]
        yield client


async def _statuses(client: Client, **asked: Any) -> Frame:
    await client.send({"type": "status", **asked})
    return await client.until(lambda f: f["type"] == "status")


async def test_p15_a_status_of_more_rooms_than_a_frame_holds_fits_and_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P15: twelve rooms whose ids are at their longest make a ``status`` of every room
    larger than the bound (about 11 KB at 8 KiB). The answer fits: the rooms it carries, in
    order, and ``rooms_left_out`` says how many more there are; ``status {after}`` pages on
    from the last room carried, until every room was reported once. Before, the whole list
    went out in one frame, and the client's connection was closed (1009) at every ``status``.
    Each page builds the statuses it carries and one more (the first that did not fit), not
    every room's: at 50,000 rooms a frame cost the loop 140 ms."""
    rooms = [f"{LONG_ROOM[:-2]}{n:02d}" for n in range(12)]
    built = [0]

    def counted(**fields: Any) -> RoomStatus:
        built[0] += 1
        return RoomStatus(**fields)

    monkeypatch.setattr(_worker, "RoomStatus", counted)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SETTINGS) as r, bounded(r) as client:
            for n, room in enumerate(rooms):
                await client.send(message(f"d{n}", room=room))
                await client.result(f"d{n}")
            seen: list[str] = []
            pages = 0
            after: dict[str, str] = {}
            while True:
                built[0] = 0
                page = await _statuses(client, **after)
                pages += 1
                assert built[0] <= len(page["rooms"]) + 1, (built, len(page["rooms"]))
                seen += [status["room"] for status in page["rooms"]]
                if page["rooms_left_out"] == 0:
                    break
                assert page["rooms"], "a page carries at least one room"
                after = {"after": seen[-1]}
            await still_usable(client)
    assert seen == sorted(rooms)
    assert pages > 1


async def test_p15_a_fetched_attachment_comes_in_frames_the_bound_allows(
    tmp_path: Path,
) -> None:
    """P15: a picture of 76,879 bytes is fetched by a client that takes frames of 8 KiB:
    its ``attachment_data`` chunks are cut to fit, and the bytes arrive whole. Before, every
    chunk was 48 KiB (64 KiB as base64) whatever the bound: the client's connection was
    closed (1009) at every fetch, and the picture could never be had."""
    digest = hashlib.sha256(BIG_PNG).hexdigest()
    settings = SETTINGS | {"rooms": {"dm:1": {"grants": ["bash", "attach"]}}}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings, steps(BIG_PNG)) as r, bounded(r) as client:
            await client.send(message("d1"))
            result = await client.result("d1")
            assert result["attachments"][0]["id"] == digest
            fetched = await fetch(client, digest)
            await still_usable(client)
    assert fetched == BIG_PNG


async def test_a9_a_file_replaced_mid_fetch_never_mixes_two_files(tmp_path: Path) -> None:
    """A9: the attachment's file is replaced (another file renamed over it, as a restore or
    an operator's tool does) while its fetch is between two chunks. The bytes the client
    assembles are all the checked file's — they match the sha256 the result names — or the
    fetch is refused with a code; never a mix of the two files."""
    digest = hashlib.sha256(BIG_PNG).hexdigest()
    settings = SETTINGS | {"rooms": {"dm:1": {"grants": ["bash", "attach"]}}}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings, steps(BIG_PNG)) as r, bounded(r) as client:
            await client.send(message("d1"))
            await client.result("d1")
            path = r.root / "state" / "attachments" / digest
            await client.send({"type": "fetch_attachment", "id": digest})
            first = await client.until(lambda f: f["type"] == "attachment_data")
            other = path.with_name("replacement")
            other.write_bytes(bytes(len(BIG_PNG)))
            os.replace(other, path)
            data = base64.b64decode(first["data"])
            frame = first
            while not frame["last"]:
                frame = await client.until(lambda f: f["type"] in ("attachment_data", "error"))
                if frame["type"] == "error":
                    break
                data += base64.b64decode(frame["data"])
            await still_usable(client)
    if frame["type"] == "error":
        assert error(frame) == ("attachment_damaged", digest)
    else:
        assert hashlib.sha256(data).hexdigest() == digest


def test_p14_a_result_recorded_with_more_attachments_than_the_bound_holds_is_sent_within_it() -> (
    None
):
    """P14: a reply recorded under a configuration that allowed sixteen attachments (their
    names as long as a file system allows: 63 four-byte characters), its ids at their
    longest, is sent after a restart under ``max_frame_bytes = 6144`` with one attachment a
    reply (C15 accepts it). Its frame fits: the text is cut, and the attachments after the
    last one that fits are left out, ``truncated``. Before, the text was cut to nothing and
    the frame was still about 10 KB — over the bound at every re-send, holding up every
    later result."""
    bound = 6144
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
        seq=41,
        delivery_id="\U0001f600" * 200,
        room=LONG_ROOM,
        outcome=Outcome.REPLY,
        text="the words " * 100,
        attachments=attachments,
    )
    worst = [
        msgspec.structs.replace(a, lost=True, code=max(ReasonCode, key=len)) for a in attachments
    ]
    sent = fit_result(msgspec.structs.replace(recorded, attachments=worst), bound)
    assert len(msgspec.json.encode(sent)) <= bound
    assert sent.truncated
    assert sent.attachments == worst[: len(sent.attachments)]
    assert 0 < len(sent.attachments) < len(worst)
    assert recorded.text is not None
    assert recorded.text.startswith(sent.text or "")
    small = msgspec.structs.replace(recorded, attachments=attachments[:1], text="short")
    assert fit_result(small, bound) == small  # one that fits is sent as it is
