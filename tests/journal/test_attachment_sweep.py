"""The orphan sweep (attachments.md A8) removes what no record names — and an entry of the root
that is not a file the store wrote (a directory, a FIFO, a symbolic link under a sha256's name)
is skipped, logged once, and does not stop the sweep of the rest."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from runtime._journal._attachments import AttachmentStore


def test_a8_an_entry_that_is_not_a_file_is_skipped_and_the_rest_is_swept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A8: the root holds a kept file, orphans, a temporary file a crash left, and — under
    sha256 names no record names — a directory (with a file in it), a FIFO and a symbolic link
    to a file outside. The sweep removes the orphans and the temporary file, keeps the kept
    file, leaves the three others (and what they lead to) untouched, and logs them in one
    warning. Today the directory stops the sweep with ``IsADirectoryError``."""
    store = AttachmentStore(tmp_path / "attachments")
    kept = store.put(b"kept")
    orphans = [store.put(f"orphan {i}".encode()) for i in range(3)]
    odd = [hashlib.sha256(f"odd {i}".encode()).hexdigest() for i in range(3)]
    directory, fifo, link = (store.root / name for name in odd)
    directory.mkdir()
    (directory / "inside").write_bytes(b"not the sweep's")
    os.mkfifo(fifo)
    outside = tmp_path / "outside"
    outside.write_bytes(b"not the sweep's either")
    link.symlink_to(outside)
    temporary = store.root / f"{kept}.tmp-1234"
    temporary.write_bytes(b"half")
    with caplog.at_level(logging.WARNING):
        removed = store.sweep({kept})
    assert sorted(removed) == sorted([*orphans, temporary.name])
    assert sorted(os.listdir(store.root)) == sorted([kept, *odd])
    assert (directory / "inside").read_bytes() == b"not the sweep's"
    assert outside.read_bytes() == b"not the sweep's either"
    skipped = [r for r in caplog.records if getattr(r, "event", None) == "attachments_skipped"]
    assert len(skipped) == 1
    assert all(name in skipped[0].getMessage() for name in odd)
