"""A fetch streams its attachment (docs/design/attachments.md A9, A3; protocol.md
``attachment_data``): a real server on 127.0.0.1, real websocket clients, a real Fake-Pi
worker that makes a picture of several MiB. What a fetch holds while its sends wait is a
chunk, not the file; and the bytes sent are hashed as they are read, so a fetch whose file
changed under it never ends ``last: true`` on bytes that are not the sha256's — it ends with
``attachment_damaged`` instead."""

from __future__ import annotations

import base64
import contextlib
import gc
import hashlib
import tracemalloc
from pathlib import Path
from typing import Any, Final

import trio

from fake_pi.scenario import Call, Step, Text, ToolCalls

from .._wire import Client, Frame, message
from .test_serve import LIMIT, error, rig, still_usable

ROOM: Final = "dm:1"
SIZE: Final = 8 * 1024 * 1024
"""The picture: 8 MiB (``[attachments] max_bytes`` is 10 MiB)."""
FETCHES: Final = 4
SETTINGS: Final[dict[str, Any]] = {
    "rooms": {ROOM: {"grants": ["bash", "attach"]}},
    # 48 KiB chunks, one every 47 ms: a fetch of the picture lasts 8 s, far longer than the
    # few chunks each test reads of it
    "attachments": {"fetch_bytes_per_second": 1024 * 1024},
}
PICTURE: Final = "big.png"


def big_picture() -> list[Step]:
    """The worker writes a PNG header and ``SIZE`` - 8 random bytes, attaches it, replies."""
    write = f"{{ printf '\\211PNG\\r\\n\\032\\n'; head -c {SIZE - 8} /dev/urandom; }} > {PICTURE}"
    return [
        ToolCalls(
            calls=[
                Call(name="bash", arguments={"command": write}),
                Call(name="attach", arguments={"path": PICTURE}),
            ]
        ),
        Text(text="look"),
    ]


def _flip_the_last_byte_in_place(path: Path) -> None:
    """One bit of the file's last byte flipped, written over it: the same inode and size."""
    with open(path, "r+b") as file:
        file.seek(SIZE - 1)
        last = file.read(1)
        file.seek(SIZE - 1)
        file.write(bytes([last[0] ^ 0x01]))


async def _first_chunks(client: Client, attachment_id: str, count: int) -> list[Frame]:
    await client.send({"type": "fetch_attachment", "id": attachment_id})
    return [
        await client.until(lambda f: f["type"] in ("attachment_data", "error"))
        for _ in range(count)
    ]


async def test_a9_concurrent_fetches_hold_a_chunk_each_not_the_attachment(
    tmp_path: Path,
) -> None:
    """A9: four clients fetch an 8 MiB picture at once and read its first chunks; the rest
    of each fetch waits on its pacing and its socket. What the process allocated meanwhile, at
    its peak (``tracemalloc``: the server's reads, hashes, frames — and the clients' frames),
    stays below half of one picture (measured: about 1.1 MiB). Before, each fetch read the
    whole file into memory and held it until its last chunk was sent: four fetches, a peak of
    33 MiB."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SETTINGS, big_picture()) as r, contextlib.AsyncExitStack() as s:
            clients = [await s.enter_async_context(r.connect()) for _ in range(FETCHES)]
            await clients[0].send(message("d1", room=ROOM))
            results = [await client.result("d1") for client in clients]
            (attachment,) = results[0]["attachments"]
            assert (attachment["size"], attachment["lost"]) == (SIZE, False)
            gc.collect()
            tracemalloc.start()
            try:
                chunks: list[list[Frame]] = []

                async def fetch(client: Client) -> None:
                    chunks.append(await _first_chunks(client, attachment["id"], 2))

                async with trio.open_nursery() as nursery:
                    for client in clients:
                        nursery.start_soon(fetch, client)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    for frames in chunks:
        assert [frame["type"] for frame in frames] == ["attachment_data"] * 2
        assert [frame["offset"] for frame in frames] == [0, 48 * 1024]
    assert peak < SIZE // 2, f"{FETCHES} fetches of {SIZE} bytes peaked at {peak} bytes"


async def test_a9_a_file_changed_in_place_mid_fetch_never_ends_last_on_other_bytes(
    tmp_path: Path,
) -> None:
    """A9, A3: the picture's last byte is flipped in place (the same inode, the same size,
    written over the file) while its fetch is between its first two chunks. The fetch reads
    what it sends as it sends it, so it reads the changed byte — and it never ends ``last:
    true`` on bytes that are not the sha256's: it ends with ``error attachment_damaged`` (ref:
    the id), the last chunk unsent, every byte sent before it the file's own. The connection
    stays usable."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SETTINGS, big_picture()) as r, r.connect() as client:
            await client.send(message("d1", room=ROOM))
            (attachment,) = (await client.result("d1"))["attachments"]
            path = r.root / "state" / "attachments" / attachment["sha256"]
            (first,) = await _first_chunks(client, attachment["id"], 1)
            await trio.to_thread.run_sync(_flip_the_last_byte_in_place, path)
            data = base64.b64decode(first["data"])
            frame = first
            while frame["type"] == "attachment_data" and not frame["last"]:
                frame = await client.until(lambda f: f["type"] in ("attachment_data", "error"))
                if frame["type"] == "attachment_data":
                    assert frame["offset"] == len(data)
                    data += base64.b64decode(frame["data"])
            await still_usable(client)
            stored = await trio.Path(path).read_bytes()
    if frame["type"] == "attachment_data":  # never: the changed byte is in the last chunk
        assert hashlib.sha256(data).hexdigest() == attachment["sha256"]
    assert error(frame) == ("attachment_damaged", attachment["id"])
    assert len(data) < SIZE
    assert data == stored[: len(data)]
