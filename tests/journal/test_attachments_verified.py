"""A read that found an attachment intact is remembered by its file's identity (attachments.md
A13): the next check of the unchanged file is one ``stat``, no hash; any change to the file, or
a file changed too recently to tell a second change by its stamps, is read and hashed again."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from runtime._errors import ReasonCode
from runtime._journal._attachments import SETTLE_MS, AttachmentStore

DATA = b"\x89PNG\r\n\x1a\n" + bytes(range(200))


@dataclass
class _Wall:
    now_ms: int

    def time_ms(self) -> int:
        return self.now_ms


def _changed_ms(path: Path) -> int:
    return os.stat(path).st_ctime_ns // 1_000_000


def _after_the_file_system_clock_passes(path: Path) -> None:
    """Return once a change made now gets a ctime other than ``path``'s (a file system stamps
    changes with a coarse clock: a tick, or a second) — a condition, polled."""
    probe = path.parent.parent / "clock-probe"
    while True:
        probe.write_bytes(b"")
        if os.stat(probe).st_ctime_ns > os.stat(path).st_ctime_ns:
            return


def test_a13_an_unchanged_verified_file_is_known_and_any_change_is_read_again(
    tmp_path: Path,
) -> None:
    """A13: read intact (settled) → ``unchanged``; one bit flipped in place (same inode, same
    size) and its mtime set back as it was → no longer ``unchanged`` (its ctime moved), and
    the read says ``attachment_damaged``; removed and put again (another inode) → not known
    until read again."""
    wall = _Wall(0)
    store = AttachmentStore(tmp_path / "attachments", wall=wall)
    digest = store.put(DATA)
    path = store.path_of(digest)
    wall.now_ms = _changed_ms(path) + SETTLE_MS + 1
    assert not store.unchanged(digest, len(DATA))  # put's read found it just made (wall 0)
    assert store.read(digest, len(DATA)) == DATA
    assert store.unchanged(digest, len(DATA))
    assert not store.unchanged(digest, len(DATA) + 1)  # another size: not this record's file
    _after_the_file_system_clock_passes(path)
    before = os.stat(path)
    damaged = bytearray(DATA)
    damaged[9] ^= 0x01
    with open(path, "r+b") as file:
        file.write(bytes(damaged))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert not store.unchanged(digest, len(DATA))  # the ctime moved; nobody can set it back
    assert store.read(digest, len(DATA)) == ReasonCode.ATTACHMENT_DAMAGED
    assert not store.unchanged(digest, len(DATA))  # a failed read forgets
    path.unlink()
    store.put(DATA)
    assert not store.unchanged(digest, len(DATA))  # put replaced it: damaged, so written anew
    wall.now_ms = _changed_ms(path) + SETTLE_MS + 1
    assert store.read(digest, len(DATA)) == DATA
    assert store.unchanged(digest, len(DATA))


def test_a13_a_file_changed_just_before_its_read_is_not_remembered(tmp_path: Path) -> None:
    """A13: a file whose last change is less than ``SETTLE_MS`` before the read is hashed at
    every check: a second change within the same stamp of the file system's coarse clock
    would leave ``stat`` as it was, so its identity proves nothing yet."""
    wall = _Wall(0)
    store = AttachmentStore(tmp_path / "attachments", wall=wall)
    digest = store.put(DATA)
    wall.now_ms = _changed_ms(store.path_of(digest)) + SETTLE_MS - 1
    assert store.read(digest, len(DATA)) == DATA
    assert not store.unchanged(digest, len(DATA))
