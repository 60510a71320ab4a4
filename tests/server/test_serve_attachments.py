"""Attachments over the wire (docs/design/attachments.md A7, A9; protocol.md): a real server on
127.0.0.1, a real websocket client, a real Fake-Pi worker. A result carries its attachments; a
client fetches their bytes over the same connection; a picture lost on disk costs the picture
— marked ``lost`` with its code — and never the words."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any, Final

import trio

from fake_pi.scenario import TINY_PNG, Attach, Step, Text

from .._wire import Client, Frame, message
from .test_serve import LIMIT, Rig, error, rig

PNG: Final = base64.b64decode(TINY_PNG)
DIGEST: Final = hashlib.sha256(PNG).hexdigest()
ROOM: Final = "dm:1"
SETTINGS: Final[dict[str, Any]] = {
    "rooms": {ROOM: {"grants": ["bash", "attach"]}},
    # a picture of more than one chunk (48 KiB), sent at 64 KiB a second of virtual... real
    # time: one pause between its two chunks, well under a second
    "attachments": {"fetch_bytes_per_second": 64 * 1024},
}
BIG: Final = bytes(range(256)) * 300 + PNG  # 76,879 bytes: two chunks
BIG_PNG: Final = b"\x89PNG\r\n\x1a\n" + BIG


def steps(data: bytes = PNG) -> list[Step]:
    return [Attach(path="pic.png", data=base64.b64encode(data).decode()), Text(text="look")]


async def answer(client: Client, delivery_id: str = "d1") -> Frame:
    await client.send(message(delivery_id, room=ROOM))
    return await client.until(lambda f: f["type"] == "result")


async def fetch(client: Client, attachment_id: str) -> bytes | Frame:
    """The bytes ``fetch_attachment`` sends, or the error frame it is answered with."""
    await client.send({"type": "fetch_attachment", "id": attachment_id})
    data = b""
    while True:
        frame = await client.until(lambda f: f["type"] in ("attachment_data", "error"))
        if frame["type"] == "error":
            return frame
        assert frame["offset"] == len(data)
        data += base64.b64decode(frame["data"])
        if frame["last"]:
            assert frame["size"] == len(data)
            return data


def stored(r: Rig, digest: str = DIGEST) -> Path:
    return r.root / "state" / "attachments" / digest


async def test_a9_a_client_fetches_the_bytes_of_a_result_it_saw(tmp_path: Path) -> None:
    """A4, A9: the result frame names the picture (id, name, media type, size, sha256, not
    lost); ``fetch_attachment`` answers its bytes in order, in chunks, checked; an id no
    result names is ``attachment_unknown`` — even one whose bytes are in the root."""
    digest = hashlib.sha256(BIG_PNG).hexdigest()
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SETTINGS, steps(BIG_PNG)) as r, r.connect() as client:
            result = await answer(client)
            assert result["text"] == "look"
            assert result["attachments"] == [
                {
                    "id": digest,
                    "name": "pic.png",
                    "media_type": "image/png",
                    "size": len(BIG_PNG),
                    "sha256": digest,
                    "lost": False,
                    "code": None,
                }
            ]
            assert await fetch(client, digest) == BIG_PNG
            planted = hashlib.sha256(b"planted").hexdigest()
            stored(r, planted).write_bytes(b"planted")
            refused = await fetch(client, planted)
            assert isinstance(refused, dict)
            assert error(refused) == ("attachment_unknown", planted)


async def test_a7_a_damaged_or_missing_picture_is_lost_and_the_words_still_go(
    tmp_path: Path,
) -> None:
    """A7: a result re-sent after its picture's bytes were damaged (one flipped bit) says
    ``lost: true, code: attachment_damaged`` and carries its words unchanged; a fetch of it
    is refused with the same code; removed, it is ``attachment_missing``."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SETTINGS, steps()) as r:
            async with r.connect() as client:
                first = await answer(client)
            data = bytearray(PNG)
            data[20] ^= 0x01
            stored(r).write_bytes(bytes(data))
            async with r.connect() as client:  # not acknowledged: sent again
                again = await client.until(lambda f: f["type"] == "result")
                refused = await fetch(client, DIGEST)
            stored(r).unlink()
            async with r.connect() as client:
                gone = await client.until(lambda f: f["type"] == "result")
    assert first["attachments"][0]["lost"] is False
    assert (again["seq"], again["text"]) == (first["seq"], "look")
    assert (again["attachments"][0]["lost"], again["attachments"][0]["code"]) == (
        True,
        "attachment_damaged",
    )
    assert isinstance(refused, dict)
    assert error(refused) == ("attachment_damaged", DIGEST)
    assert (gone["text"], gone["attachments"][0]["code"]) == ("look", "attachment_missing")
