"""A lane's session files in the shared store, by difference (docs/design/scale-out.md S13,
S36).

On a deployment on PostgreSQL a room lane's session travels with the lane: its bytes are
stored in the database, under the lane's lease, at each point the journal depends on them,
and a host that claims the lane rebuilds the file from there. Pi appends to a session; a
long-lived room's file grows to megabytes. So a copy is kept as **parts**: documents named
``<base>@<generation>.<offset>``, each holding the bytes from its offset on, their offsets
contiguous from 0. A store writes only the bytes past what is stored, when what is stored is
still the file's prefix (its digest, remembered); otherwise — the file rewritten, nothing
known, or :data:`PART_LIMIT` parts — it writes the whole file as part 0 of the **next
generation** (one upsert: a generation is whole from its first part on) and then deletes the
older generation's parts. A rebuild joins the newest generation's parts; a gap between them
is damage (``journal_corrupt``), never a shorter session. A document named ``<base>`` alone
(a store from before S36) is generation 0.

What is remembered is forgotten after any failed write (whether it reached the database is
not known): the next store reads what the database holds first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import trio

from .._errors import JournalError, ReasonCode
from .._journal._fence import Fence
from .._journal._interface import LeaseStore
from .._journal._writer import atomic_write
from .._linux._fs import OsFileSystem

__all__ = ["PART_LIMIT", "SessionCopies", "assemble", "part_name"]

PART_LIMIT: Final = 256
"""Parts of one generation at most: the next store writes the whole file anew (bounding the
rows a rebuild reads; the whole file once per 256 stores)."""


KEPT: Final = 8
"""Session files a lane remembers what it stored of (its room session, recent one-shots)."""


def _read(path: Path, length: int) -> tuple[bytes, bytes | None, bytes]:
    """``path``'s bytes, the sha256 of their first ``length`` (``None``: fewer), and of all
    (in a worker thread: ``hashlib`` lets the loop run meanwhile)."""
    data = path.read_bytes()
    if len(data) < length:
        return data, None, hashlib.sha256(data).digest()
    view = memoryview(data)
    running = hashlib.sha256(view[:length])  # one pass over the bytes for both digests
    prefix = running.digest()
    running.update(view[length:])
    return data, prefix, running.digest()


def part_name(base: str, generation: int, offset: int) -> str:
    """The document holding ``base``'s bytes from ``offset`` on, in ``generation``."""
    return f"{base}@{generation:08d}.{offset:016d}"


@dataclass(slots=True)
class Stored:
    """What the database holds of one session file, as this host last wrote or read it."""

    generation: int
    length: int
    digest: bytes
    """sha256 of the stored bytes."""
    parts: list[str] = field(default_factory=list)
    """The document names of ``generation``, by offset."""


def _nothing() -> Stored:
    return Stored(0, 0, hashlib.sha256(b"").digest())


def assemble(base: str, documents: Mapping[str, bytes]) -> tuple[bytes, Stored, list[str]] | None:
    """The session ``base`` as ``documents`` (every document named ``base…``) hold it: the
    newest generation's parts joined, what that is, and the parts of older generations (left
    over: to remove); ``None`` when nothing is stored. ``journal_corrupt`` when the newest
    generation's parts are not contiguous from offset 0."""
    generations: dict[int, list[tuple[int, str, bytes]]] = {}
    for name, data in documents.items():
        if name == base:  # stored whole, before S36
            generations.setdefault(0, []).append((0, name, data))
            continue
        suffix = name[len(base) :]
        if not name.startswith(base) or not suffix.startswith("@"):
            continue  # another file whose name begins like this one
        number, _, start = suffix[1:].partition(".")
        if not (number.isdigit() and start.isdigit()):
            raise JournalError(
                ReasonCode.JOURNAL_CORRUPT, f"a session part named {name!r}", path=base
            )
        generations.setdefault(int(number), []).append((int(start), name, data))
    if not generations:
        return None
    newest = max(generations)
    joined = bytearray()
    names: list[str] = []
    for offset, name, data in sorted(generations[newest]):
        if offset != len(joined):
            raise JournalError(
                ReasonCode.JOURNAL_CORRUPT,
                f"session {base!r}: generation {newest} has a part at byte {offset} where "
                f"{len(joined)} were expected",
                path=base,
            )
        joined += data
        names.append(name)
    stored = Stored(newest, len(joined), hashlib.sha256(joined).digest(), names)
    older = [name for g, parts in generations.items() if g != newest for _, name, _ in parts]
    return bytes(joined), stored, older


class SessionCopies:
    """The copies in ``store`` of one lane's session files, each named by its ``base``."""

    def __init__(self, store: LeaseStore, *, part_limit: int = PART_LIMIT) -> None:
        self.store = store
        self.part_limit = part_limit
        self._stored: dict[str, Stored] = {}
        self._stale: list[str] = []
        """Parts of generations superseded whose removal has not succeeded yet."""

    async def store_file(self, base: str, path: Path, fence: Fence | None) -> None:
        """Make the database hold ``path``'s bytes now, under ``fence`` (``lane_fenced``
        when another host holds the lane: nothing is written)."""
        stored = self._stored.pop(base, None)  # known again only once a write succeeded
        if stored is None:
            stored = self._learn(base, await self._assemble(base))
        data, prefix, whole = await trio.to_thread.run_sync(_read, path, stored.length)
        if (
            stored.generation > 0
            and len(stored.parts) < self.part_limit
            and prefix == stored.digest
        ):
            if len(data) > stored.length:
                name = part_name(base, stored.generation, stored.length)
                await self.store.write_document(name, data[stored.length :], fence=fence)
                stored.parts.append(name)
            self._remember(base, Stored(stored.generation, len(data), whole, stored.parts))
            return
        generation = stored.generation + 1
        name = part_name(base, generation, 0)
        await self.store.write_document(name, data, fence=fence)
        self._remember(base, Stored(generation, len(data), whole, [name]))
        self._stale += stored.parts
        await self._remove_stale()

    async def _assemble(self, base: str) -> tuple[bytes, Stored, list[str]] | None:
        """:func:`assemble` of what the database holds now (joined and hashed off the loop:
        a session can be megabytes)."""
        documents = await self.store.documents(base)
        return await trio.to_thread.run_sync(assemble, base, documents)

    def _remember(self, base: str, stored: Stored) -> None:
        """Keep what is stored of ``base``, and of the :data:`KEPT` files stored last (a
        lane's one-shot sessions come and go; one forgotten is read again if stored again)."""
        self._stored[base] = stored
        while len(self._stored) > KEPT:
            del self._stored[next(iter(self._stored))]

    def _learn(self, base: str, found: tuple[bytes, Stored, list[str]] | None) -> Stored:
        """What the database holds of ``base`` (read just now); older parts left over by a
        host that stopped between a new generation and the removal of the old are removed
        at the next new generation."""
        if found is None:
            return _nothing()
        _data, stored, older = found
        self._stale += [name for name in older if name not in self._stale]
        return stored

    async def _remove_stale(self) -> None:
        stale, self._stale = self._stale, []
        try:
            await self.store.delete_documents(stale)
        except (JournalError, OSError):  # left over: a rebuild reads the newest generation
            self._stale = stale + self._stale

    async def restore_file(self, base: str, path: Path) -> None:
        """Write the stored session over ``path`` (fsynced, replaced atomically); nothing
        stored: ``path`` removed (the lane never started a turn)."""
        found = await self._assemble(base)
        self._remember(base, self._learn(base, found))
        data = found[0] if found is not None else None

        def write() -> None:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if data is None:
                path.unlink(missing_ok=True)
            else:
                atomic_write(OsFileSystem(), str(path), data)

        await trio.to_thread.run_sync(write)
