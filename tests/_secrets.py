"""Looking for a secret on disk: tests prove keys and epoch secrets never land in a file."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path


def files_containing(roots: Sequence[Path], needle: str) -> list[Path]:
    """Every regular file below ``roots`` whose bytes contain ``needle``."""
    found = []
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                with contextlib.suppress(OSError):
                    if needle.encode() in path.read_bytes():
                        found.append(path)
    return found
