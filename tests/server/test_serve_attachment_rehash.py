"""A result re-sent at every reconnect checks its attachments again (attachments.md A7) — by
their file's identity while it is unchanged, by their bytes only when it changed (A13): a
client that reconnects in a loop without acknowledging costs the server one hash of each
picture, not one per reconnect; a bit flipped in place after a verified send is still found."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import trio

from runtime._clock import MockWallClock, SystemWallClock
from runtime._journal import _attachments
from runtime._journal._attachments import AttachmentStore

from .test_serve import LIMIT, rig
from .test_serve_attachments import DIGEST, PNG, SETTINGS, answer, steps, stored

RECONNECTS = 8


class _CountingHashlib:
    """``hashlib`` as the attachment store sees it, counting the sha256 hashes it makes."""

    def __init__(self) -> None:
        self.hashes = 0

    def sha256(self, data: bytes = b"") -> Any:
        self.hashes += 1
        return hashlib.sha256(data)


async def _after_the_file_system_clock_passes(path: Path) -> None:
    """Wait (on the condition, not on a timer) until a change made now gets a ctime other than
    ``path``'s: a file system stamps changes with a coarse clock (a tick, or a second)."""
    before = os.stat(path).st_ctime_ns
    probe = path.parent.parent / "clock-probe"
    while True:
        probe.write_bytes(b"")
        if os.stat(probe).st_ctime_ns > before:
            return
        await trio.sleep(0.001)


def _flip_a_bit_in_place(path: Path) -> None:
    """One bit of ``path`` flipped, written over it: the same inode, the same size."""
    data = bytearray(PNG)
    data[20] ^= 0x01
    with open(path, "r+b") as file:
        file.write(bytes(data))


async def test_a13_reconnects_without_an_ack_cost_one_hash_and_damage_in_place_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A13, A7: the result is sent (its picture checked by its bytes), then sent again at each
    of 8 reconnects (never acknowledged): the reconnects hash nothing (today: 8 hashes). Then
    one bit of the stored file is flipped in place (same inode, same size): the next send
    hashes it again and says ``lost: true, code: attachment_damaged``."""
    counting = _CountingHashlib()
    monkeypatch.setattr(_attachments, "hashlib", counting)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SETTINGS, steps()) as r:
            # the picture counts as settled when checked (its last change over 2 s before)
            settled = MockWallClock.reading(SystemWallClock().time_ms() + 10_000)
            r.server.attachments = AttachmentStore(r.server.attachments.root, wall=settled)
            async with r.connect() as client:
                first = await answer(client)
            checked = counting.hashes  # the attach tool's hashes and the first send's
            for _ in range(RECONNECTS):
                async with r.connect() as client:
                    again = await client.until(lambda f: f["type"] == "result")
                assert (again["seq"], again["attachments"]) == (first["seq"], first["attachments"])
            resent = counting.hashes - checked
            await _after_the_file_system_clock_passes(stored(r))
            inode = os.stat(stored(r)).st_ino
            _flip_a_bit_in_place(stored(r))
            assert os.stat(stored(r)).st_ino == inode
            async with r.connect() as client:
                damaged = await client.until(lambda f: f["type"] == "result")
    assert first["attachments"][0]["lost"] is False
    assert resent == 0, f"{RECONNECTS} re-sends of one picture made {resent} hashes"
    assert first["attachments"][0]["sha256"] == DIGEST
    assert (damaged["attachments"][0]["lost"], damaged["attachments"][0]["code"]) == (
        True,
        "attachment_damaged",
    )
