"""How retention removes a directory tree so that a crash half-way leaves nothing behind for
good (docs/design/retention.md RT15).

A tree is not removed in one atomic step: ``rmtree`` unlinks entry by entry, and a crash
half-way leaves part of it — perhaps without the file that named it (a task lane's
``lane.log``), so that nothing leads a later pass back to it, and a later owner of the same
name (a task submitted again under its id once the id was forgotten) would find the old
one's files in its directory. So a tree is first **renamed** into ``trash/`` beside it, under
a name of its own, and the rename made durable (both directories synced): one atomic step,
after which its old name is free and only the trash holds what is left. Only then is it
removed, and every retention pass first removes whatever the trash holds
(:func:`sweep_trash`), so what a crash left there goes at the next pass, whoever's it was.

Blocking: run off the Trio loop.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from typing import Any, Final

from .._linux._fs import FileSystem

__all__ = ["TRASH", "discard_tree", "sweep_trash"]

TRASH: Final = "trash"
"""The directory, under a tree's root (the state directory, a task work root), that what is
being removed is renamed into first."""
_GONE: Final = ".gone-"
"""In a trash entry's name, between the name it had and a random part (never the temp
files' ``.tmp-``: the start-up sweep of those unlinks files only)."""


def discard_tree(fs: FileSystem, root: str, rel: str) -> bool:
    """Remove the directory ``root/rel`` and everything in it, crash-safe (RT15): renamed
    to ``root/trash/<name>.gone-<random>`` (the trash made first if missing), its old
    directory and the trash synced, then removed there and the trash synced. Whether it
    was there. A crash before the rename's sync leaves the tree whole under its name or in
    the trash; after it, at most a part of it in the trash."""
    path = os.path.join(root, rel)
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    trash = os.path.join(root, TRASH)
    if not fs.exists(trash):
        fs.makedirs(trash)
        fs.fsync_dir(root)
    gone = os.path.join(trash, f"{os.path.basename(path)}{_GONE}{secrets.token_hex(8)}")
    fs.rename(path, gone)
    fs.fsync_dir(os.path.dirname(path))
    fs.fsync_dir(trash)
    _remove(gone)
    fs.fsync_dir(trash)
    return True


def sweep_trash(fs: FileSystem, root: str) -> list[str]:
    """Remove whatever ``root/trash`` holds — what a crash left of a removal (RT15) — then
    sync the trash: the names removed. Nothing else is looked at."""
    trash = os.path.join(root, TRASH)
    try:
        names = fs.listdir(trash)
    except (FileNotFoundError, NotADirectoryError):
        return []
    for name in names:
        path = os.path.join(trash, name)
        if os.path.isdir(path) and not os.path.islink(path):
            _remove(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                fs.unlink(path)
    if names:
        fs.fsync_dir(trash)
    return names


def _remove(path: str) -> None:
    """``rmtree`` of a trash entry; what is gone already is no error (a pass's sweep and a
    ``task forget`` may remove the same entry at once)."""

    def gone_already(function: Any, name: str, info: Any) -> None:
        if not isinstance(info[1], FileNotFoundError):
            raise info[1]

    shutil.rmtree(path, onerror=gone_already)
