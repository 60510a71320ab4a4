"""The on-disk framing of every journal log (pure: bytes in, frames out).

A log file is a sequence of frames. One frame holds one or more consecutive
records (a group commit writes a whole batch as one frame, so a torn batch is a
torn *final frame*, never damage in the middle)::

    offset 0   u32  body length (little endian)
           4   u32  crc32 over bytes 8.. of the header and the body
           8   u64  sequence number of the first record in the frame
          16   u32  record count (>= 1)
          20   body: a JSON array of ``count`` records

Reading (:func:`scan`) accepts exactly the frames that check out, in sequence.
The only damage it forgives is a **torn tail**: bytes at the end of the file
after which no valid frame begins and that show a write that never completed —
a final frame whose declared length runs past the end of the file (or whose
header is not whole), zeros where a header would begin, or a frame with a whole
**zero sector** in it: a 512-byte sector of the file, aligned, beginning inside
the frame (or where it begins), clipped to its end, all zeros. A disk writes a
sector whole, so the unwritten part of a torn
write is zeros from a sector boundary on (or the old bytes, zeros too in space
never written); one flipped bit never makes a zero sector, while it can make a
single NUL byte. Such bytes were never acknowledged, because an append is
acknowledged only after its frame was synced. A **complete** final frame that
fails its checksum shows no interrupted write: it is damage (a flipped bit in
the last acknowledged record must never make its record vanish), and so is a
bad frame followed by a good one, or a sequence gap: :class:`FrameDamage`.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Final

from .._errors import ReasonCode

__all__ = [
    "HEADER_SIZE",
    "MAX_BODY",
    "SECTOR",
    "Frame",
    "FrameDamage",
    "Scan",
    "encode_frame",
    "scan",
]

_HEADER: Final = struct.Struct("<IIQI")
HEADER_SIZE: Final = _HEADER.size
MAX_BODY: Final = 256 * 1024 * 1024
"""Largest frame body accepted (a model response with megabyte lines fits easily)."""
SECTOR: Final = 512
"""The unit a disk writes whole: a torn write's unwritten part starts at a multiple of it
(J3). Every device sector (512 or 4096 bytes) and page is a multiple of it."""


@dataclass(frozen=True, slots=True)
class Frame:
    offset: int
    first_seq: int
    count: int
    body: bytes

    @property
    def end(self) -> int:
        return self.offset + HEADER_SIZE + len(self.body)


@dataclass(frozen=True, slots=True)
class Scan:
    frames: list[Frame]
    good_length: int
    """Bytes up to the end of the last good frame."""
    torn_bytes: int
    """Bytes after ``good_length`` that form a torn tail (0 if none)."""

    @property
    def next_seq(self) -> int:
        return self.frames[-1].first_seq + self.frames[-1].count if self.frames else 0


class FrameDamage(Exception):
    """Damage that is not a torn tail: the log must fail closed."""

    def __init__(self, code: ReasonCode, offset: int, detail: str) -> None:
        super().__init__(f"{code} at offset {offset}: {detail}")
        self.code = code
        self.offset = offset
        self.detail = detail


def encode_frame(first_seq: int, records: list[bytes]) -> bytes:
    """Frame already-encoded JSON records as one batch."""
    if not records:
        raise ValueError("a frame holds at least one record")
    body = b"[" + b",".join(records) + b"]"
    if len(body) > MAX_BODY:
        raise ValueError(f"frame body of {len(body)} bytes exceeds {MAX_BODY}")
    tail = struct.pack("<QI", first_seq, len(records))
    crc = zlib.crc32(body, zlib.crc32(tail))
    return struct.pack("<II", len(body), crc) + tail + body


def _frame_at(data: bytes | memoryview, offset: int) -> Frame | None:
    """The valid frame starting at ``offset``, or ``None``."""
    if len(data) - offset < HEADER_SIZE:
        return None
    length, crc, first_seq, count = _HEADER.unpack_from(data, offset)
    end = offset + HEADER_SIZE + length
    if length > MAX_BODY or end > len(data) or count == 0:
        return None
    view = memoryview(data)
    if (
        zlib.crc32(view[offset + HEADER_SIZE : end], zlib.crc32(view[offset + 8 : offset + 20]))
        != crc
    ):
        return None
    return Frame(offset, first_seq, count, bytes(view[offset + HEADER_SIZE : end]))


def _complete_but_damaged(data: bytes, offset: int) -> bool:
    """Whether the invalid final bytes at ``offset`` are a whole frame — a header that is
    not all zeros, whose body ends inside the file, with no zero sector in it — that fails
    its checksum: damage, where a torn write would have left the frame short, its header
    zeros or a sector of it zeros (J3, J4). A zero count or a zero length in a header that
    is not all zeros is no sign of a torn write (J3a): a torn write keeps a prefix of its new
    bytes up to a sector boundary, so a header field it did not write is followed by a zero
    sector, which the check finds — while one flipped bit makes a count of 1 (a delivery's
    step) or a length of 64 zero, and the last acknowledged record vanished as torn."""
    if len(data) - offset < HEADER_SIZE:
        return False
    length, _crc, _first, _count = _HEADER.unpack_from(data, offset)
    end = offset + HEADER_SIZE + length
    if length > MAX_BODY or end > len(data) or not any(data[offset : offset + HEADER_SIZE]):
        return False
    return not _zero_sector(data, offset, end)


def _zero_sector(data: bytes, start: int, end: int) -> bool:
    """Whether a :data:`SECTOR`-aligned sector of the file, clipped to ``[start, end)``, is
    all zeros: what a torn write leaves, and one flipped bit never does (J3). The sector the
    frame begins in counts only when the frame begins at its start: a torn write keeps its
    new bytes up to a sector boundary, so that one was written with the frame — and the
    piece of it a frame begins near its end holds only the low bytes of the frame's length,
    zeros by nature when the length is a multiple of 256 (J4)."""
    sector = start + (-start) % SECTOR  # the first sector boundary from the frame's start
    while sector < end:
        high = min(sector + SECTOR, end)
        if data.count(0, sector, high) == high - sector:
            return True
        sector += SECTOR
    return False


def _valid_frame_after(data: bytes, offset: int) -> int | None:
    """Offset of the first valid frame that begins after ``offset``, if any. A frame's header
    holds a non-zero byte (its length and count are not zero), so none begins in the zeros
    that end a file (a zero-filled sync log generation's, journal.md J12): not searched."""
    last = len(data.rstrip(b"\0"))
    for candidate in range(offset + 1, min(last, len(data) - HEADER_SIZE + 1)):
        if _frame_at(data, candidate) is not None:
            return candidate
    return None


def scan(data: bytes, *, first_seq: int = 0) -> Scan:
    """Split a log's bytes into frames, forgiving only a torn tail.

    Raises :class:`FrameDamage` with ``journal_corrupt`` when a bad frame is
    followed by a valid one, and ``journal_sequence_gap`` when a valid frame
    does not continue the sequence.
    """
    frames: list[Frame] = []
    offset = 0
    expected = first_seq
    while offset < len(data):
        frame = _frame_at(data, offset)
        if frame is None:
            later = _valid_frame_after(data, offset)
            if later is not None:
                raise FrameDamage(
                    ReasonCode.JOURNAL_CORRUPT,
                    offset,
                    f"unreadable frame followed by a valid frame at offset {later}",
                )
            if _complete_but_damaged(data, offset):
                raise FrameDamage(
                    ReasonCode.JOURNAL_CORRUPT,
                    offset,
                    "the final frame is complete but fails its checksum (damage, not a torn write)",
                )
            return Scan(frames, offset, len(data) - offset)
        if frame.first_seq != expected:
            raise FrameDamage(
                ReasonCode.JOURNAL_SEQUENCE_GAP,
                offset,
                f"expected record {expected}, found record {frame.first_seq}",
            )
        frames.append(frame)
        expected += frame.count
        offset = frame.end
    return Scan(frames, offset, 0)
