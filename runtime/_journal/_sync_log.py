"""The step sync log: one ``fdatasync`` for the step records of many deliveries (journal.md
J12-J18, issue #23 item 3).

A batch of a writer shard that holds records of two or more delivery logs is made durable by
writing **one** frame to the shard's sync log, ``sync/<generation>.log``, and syncing that
file alone (a generation is zero-filled when it begins, so a frame overwrites zeros and its
sync changes no file size; the zeros after the last frame read as a torn tail). Each entry of
the frame names a delivery log and the records it gained, in that log's own sequence::

    ["deliveries/<key>.log", <first seq>, [<record>, <record>, ...]]

The records stay in memory, owed to their delivery's file (the target's *pending* records),
and reach the file — written and synced, as one frame — when the log is read or closed, when a
single-log batch appends to it anyway, or after its generation is full (it has grown past
:data:`ROTATE_BYTES`: the next batch begins the next generation, and the full one's logs are
written a log at a time between batches; it is removed once none owes records it holds). So a
delivery's file always holds, durably, every acknowledged record but its pending ones, and
those are in the sync log — in one generation or several, which :func:`redo` reads oldest
first.

After a crash — a killed process never wrote its owed records to their files; a power loss
may also have dropped what was written and not yet synced — :func:`redo` replays the sync log
before anything reads a delivery log: an entry's records that its file lacks are appended
to it, and the file is synced; then the generations are removed. This module is the frame's
encoding and the redo; the writer thread (:mod:`runtime._journal._writer`) does the appending.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from .._errors import JournalError, ReasonCode
from .._linux._fs import FileSystem
from .._records import Poison
from ._frame import FrameDamage, encode_frame, scan

__all__ = [
    "ROTATE_BYTES",
    "SYNC_DIR",
    "Owed",
    "Redone",
    "encode_entry",
    "generation_name",
    "owed_in",
    "read_owed",
    "redo",
    "with_owed",
]

Owed = dict[str, list[tuple[int, list[bytes]]]]
"""What the sync log holds, by log: ``(first seq, records)`` in the order appended."""

SYNC_DIR: Final = "sync"
"""The sync log's directory, relative to the state directory."""
ROTATE_BYTES: Final = 4 * 1024 * 1024
"""A generation past this many bytes is full: the next batch begins the next one (J12)."""

_ENTRY: Final = msgspec.json.Decoder(tuple[str, int, list[msgspec.Raw]])
_ENCODER: Final = msgspec.json.Encoder()


def generation_name(generation: int) -> str:
    return f"{generation:016d}.log"


def encode_entry(rel: str, first_seq: int, payloads: Sequence[bytes]) -> bytes:
    """One entry of a sync log frame: ``rel`` gained ``payloads`` from ``first_seq`` on."""
    return b"[%s,%d,[%s]]" % (_ENCODER.encode(rel), first_seq, b",".join(payloads))


@dataclass(frozen=True, slots=True)
class Redone:
    """What :func:`redo` did."""

    generations: int
    """Sync log generations read (and removed)."""
    records: int
    """Records appended to delivery logs that lacked them."""
    logs: tuple[str, ...]
    """The logs that gained records, relative to the state directory."""
    poisoned: tuple[str, ...]
    """Logs that had a gap below the sync log's records (J16): poisoned, never replayed."""


class _File:
    """A delivery log as redo found it."""

    __slots__ = ("changed", "good_length", "held", "held_at", "next_seq", "skip")

    def __init__(self, good_length: int, next_seq: int, *, skip: bool) -> None:
        self.good_length = good_length
        self.next_seq = next_seq
        self.skip = skip
        """Missing, poisoned or damaged: left as it is (J15)."""
        self.changed = False
        self.held = b""
        """The file's frames from the first that holds a record the sync log holds for it:
        read through the page cache, perhaps never on the disk (J14)."""
        self.held_at = 0


def redo(
    fs: FileSystem, root: str, *, now_ms: int, write_document: Callable[[str, bytes], None]
) -> Redone:
    """Replay every sync log generation under ``root`` into the delivery logs (blocking; at
    ``open_store``, before anything reads a log); ``write_document(path, data)`` replaces a
    file atomically (a poison document, J16). Raises :class:`JournalError`
    (``journal_corrupt``, ``journal_sequence_gap``) naming the generation and offset when one
    is damaged other than by a torn tail: what it acknowledged cannot be known, so nothing
    starts (J14)."""
    directory = os.path.join(root, SYNC_DIR)
    if not fs.exists(directory):
        return Redone(0, 0, (), ())
    names = _generations(fs, directory)
    owed = owed_in([(name, fs.read(os.path.join(directory, name))) for name in names])
    records = 0
    changed: list[str] = []
    poisoned: list[str] = []
    for rel, entries in owed.items():
        file = _look(fs, root, rel, low=min(first for first, _ in entries))
        if file.skip:
            continue
        if file.held:
            # What the file seems to hold of the sync log's records was read through the page
            # cache: a killed writer may have written it and never synced it, or its sync may
            # have failed (the kernel then marks the pages clean: a later sync writes nothing
            # of them). So it is written again, and synced below, before the generations go.
            _rewrite(fs, os.path.join(root, rel), file)
        lacking = _lacking(file.next_seq, entries)
        if lacking and lacking[0][0] == file.next_seq:
            start, missing = lacking.pop(0)
            _append(fs, os.path.join(root, rel), file, encode_frame(start, missing))
            file.next_seq += len(missing)
            records += len(missing)
        if file.changed:  # durable before a poison counts it and before the generations go
            _sync(fs, os.path.join(root, rel))
            changed.append(rel)
        if lacking:  # J16: a gap no entry fills
            path = os.path.join(root, rel) + ".poison"
            write_document(path, _poison(rel, file, lacking[0][0], now_ms=now_ms))
            poisoned.append(rel)
    for name in names:
        fs.unlink(os.path.join(directory, name))
    if names:
        fs.fsync_dir(directory)
    return Redone(len(names), records, tuple(sorted(changed)), tuple(poisoned))


def read_owed(fs: FileSystem, root: str) -> Owed:
    """What the sync log holds, by log, read without changing anything (a read-only view of
    a state directory, perhaps while its server runs: read it **before** the logs, since a
    record leaves the sync log only after it reached its file, J17). Raises like
    :func:`redo`."""
    directory = os.path.join(root, SYNC_DIR)
    if not fs.exists(directory):
        return {}
    generations: list[tuple[str, bytes]] = []
    for name in _generations(fs, directory):
        try:
            generations.append((name, fs.read(os.path.join(directory, name))))
        except FileNotFoundError:  # rotated away meanwhile: its records reached their files
            continue
    return owed_in(generations)


def owed_in(generations: Iterable[tuple[str, bytes]]) -> Owed:
    """What the sync log generations ``(name, bytes)`` hold, by log (:func:`read_owed`)."""
    owed: Owed = {}
    for decoded in _entries(generations):
        for rel, first, payloads in decoded:
            owed.setdefault(rel, []).append((first, [bytes(p) for p in payloads]))
    return owed


def with_owed(data: bytes, owed: list[tuple[int, list[bytes]]]) -> bytes:
    """A log file's bytes as :func:`redo` would leave them: the records of ``owed`` it lacks
    appended as frames (its torn tail cut first). A file that does not scan is returned as it
    is (reading it fails closed), and a gap is kept as a gap (reading it fails closed)."""
    try:
        found = scan(data)
    except FrameDamage:
        return data
    lacking = _lacking(found.next_seq, owed)
    if not lacking:
        return data
    frames = [encode_frame(start, records) for start, records in lacking]
    return data[: found.good_length] + b"".join(frames)


def _lacking(next_seq: int, owed: list[tuple[int, list[bytes]]]) -> list[tuple[int, list[bytes]]]:
    """The runs of ``owed`` records that a log ending before record ``next_seq`` lacks, in
    order, each run ``(first seq, records)`` as long as it continues the one before: a run
    beginning past the end of the one before (or past ``next_seq``) is a gap."""
    runs: list[tuple[int, list[bytes]]] = []
    for first, payloads in owed:
        if first + len(payloads) <= next_seq:
            continue  # held already
        start = max(first, next_seq)
        if runs and start == next_seq:
            runs[-1][1].extend(payloads[start - first :])
        else:
            runs.append((start, list(payloads[start - first :])))
        next_seq = first + len(payloads)
    return runs


def _generations(fs: FileSystem, directory: str) -> list[str]:
    return [name for name in fs.listdir(directory) if name.endswith(".log")]


def _entries(
    generations: Iterable[tuple[str, bytes]],
) -> Iterator[list[tuple[str, int, list[msgspec.Raw]]]]:
    """The decoded entries of each frame of the generations ``(name, bytes)``, in order."""
    for name, data in generations:
        rel_name = f"{SYNC_DIR}/{name}"
        try:
            frames = scan(data).frames
        except FrameDamage as damage:
            raise JournalError(
                damage.code, damage.detail, path=rel_name, offset=damage.offset
            ) from damage
        for frame in frames:
            try:
                entries = msgspec.json.decode(frame.body, type=list[msgspec.Raw])
                yield [_ENTRY.decode(entry) for entry in entries]
            except msgspec.DecodeError as error:
                raise JournalError(
                    ReasonCode.JOURNAL_CORRUPT,
                    f"unreadable sync log entry: {error}",
                    path=rel_name,
                    offset=frame.offset,
                ) from error


def _look(fs: FileSystem, root: str, rel: str, *, low: int) -> _File:
    """The log ``rel`` as redo finds it; ``low``: the first record the sync log holds of it."""
    path = os.path.join(root, rel)
    if not fs.exists(path):
        # Removed by retention after its records were synced to it: a log's file is made
        # durable (directory entry included) before any record of it is acknowledged (J13).
        return _File(0, 0, skip=True)
    if fs.exists(path + ".poison"):
        return _File(0, 0, skip=True)  # never replayed (J5)
    data = fs.read(path)
    try:
        found = scan(data)
    except FrameDamage:
        return _File(0, 0, skip=True)  # fails closed when its delivery is recovered (J4)
    file = _File(found.good_length, found.next_seq, skip=False)
    held = [frame.offset for frame in found.frames if frame.first_seq + frame.count > low]
    if held:
        file.held_at = held[0]
        file.held = data[held[0] : found.good_length]
    if found.torn_bytes:  # cut the torn tail before appending after it (J3)
        handle = fs.open_append(path)
        try:
            fs.truncate(handle, found.good_length)
        finally:
            fs.close(handle)
        file.changed = True
    return file


def _rewrite(fs: FileSystem, path: str, file: _File) -> None:
    """Write :attr:`_File.held` again where it is, so that the sync after it carries it to the
    disk whatever became of it before (J14)."""
    handle = fs.open_write(path)
    try:
        at, view = file.held_at, memoryview(file.held)
        while view:
            written = fs.pwrite(handle, bytes(view), at)
            if written <= 0:
                raise OSError(errno.EIO, "a rewrite made no progress")
            at, view = at + written, view[written:]
    finally:
        fs.close(handle)
    file.changed = True


def _append(fs: FileSystem, path: str, file: _File, frame: bytes) -> None:
    handle = fs.open_append(path)
    try:
        written = fs.write(handle, frame)
        if written != len(frame):
            raise OSError(5, f"short write: {written} of {len(frame)} bytes")
    finally:
        fs.close(handle)
    file.good_length += len(frame)
    file.changed = True


def _sync(fs: FileSystem, path: str) -> None:
    handle = fs.open_append(path)
    try:
        fs.fdatasync(handle)
    finally:
        fs.close(handle)


def _poison(rel: str, file: _File, first: int, *, now_ms: int) -> bytes:
    return _ENCODER.encode(
        Poison(
            log_path=rel,
            good_length=file.good_length,
            reason=(
                f"the sync log holds this log's records from {first} on, but its file ends "
                f"at record {file.next_seq}: the records between are lost; it is not replayed"
            ),
            errno=None,
            poisoned_ms=now_ms,
        )
    )
