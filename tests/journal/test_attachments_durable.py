"""An attachment stored again after a crash is durable before ``put`` returns (attachments.md
A2): ``put`` skips bytes already stored intact, and what it finds there may be what a killed
process left — its file synced and renamed into place, the directory entry never synced."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from runtime._journal._attachments import AttachmentStore
from runtime._linux._fs import OsFileSystem

from ..faultfs import Fault, FaultyFileSystem


class _Syncs(OsFileSystem):
    """The real file system, recording every directory sync."""

    def __init__(self) -> None:
        self.dirs: list[str] = []

    def fsync_dir(self, path: str) -> None:
        self.dirs.append(path)
        super().fsync_dir(path)


@pytest.mark.parametrize("left", ["name", "root"])
def test_a2_bytes_found_stored_are_made_durable_before_put_returns(
    tmp_path: Path, left: str
) -> None:
    """A2, J7: a process stores an attachment and is killed before the rename's directory
    sync (``name``), or before the sync that makes a new attachment root's own entry durable
    (``root``). The next process puts the same bytes: it finds them intact and writes nothing
    — but it must still sync the directory entries, or a power loss drops a file an
    acknowledged record names."""
    state = tmp_path / "state"
    state.mkdir()
    root = state / "attachments"
    where = str(root) if left == "name" else str(state)
    dies = FaultyFileSystem(OsFileSystem(), Fault("sync", errno=errno.EIO, path_contains=where))
    if left == "name":
        dies.arm(Fault("sync", nth=2, errno=errno.EIO, path_contains=where))  # the file's, then
    with pytest.raises(OSError, match="injected"):
        AttachmentStore(root, dies).put(b"the report")
    assert root.is_dir()
    syncs = _Syncs()
    digest = AttachmentStore(root, syncs).put(b"the report")
    assert (root / digest).read_bytes() == b"the report"
    assert str(root) in syncs.dirs, "the attachment's name is not made durable"
    assert str(state) in syncs.dirs, "the attachment root's own name is not made durable"
