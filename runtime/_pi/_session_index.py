"""The leaf of a long-lived session file, read by difference (S14).

A room lane reads its session's leaf at every admission and for every result. Pi only ever
appends to the file, so what was read before need not be read again: a :class:`SessionIndex`
keeps, between reads, what the leaf depends on — the entry ids seen (a later line repeating
one is no entry, S4), the last entry of the lines read, where they end — and reads only the
bytes past that. What it keeps is small: 4 bytes an entry for Pi's 8-hex ids, no line text.

Nothing kept is trusted blindly. Before each read by difference the file must still be the
one read (same device and inode), at least as long as what was read, its first line and the
last line read must still hold the same bytes at the same offsets, and a file of the size
the last read reached must also have the modification and change times seen before that
read (none are kept when Pi's append overtook the read: a read at that size is then whole).
Anything else — a file replaced (a restored copy is renamed into place), truncated,
rewritten in place — is read whole, as the first read of a lane is. Only whole lines (up to
the last LF) are kept: the bytes after the last LF (a torn tail, or a complete last line
without its LF, S6) are read again every time, so a tail completed, cut or replaced later is
seen as it then is.

What these checks cannot see without reading it all: a line between the first and the last
read changed in place while the file also grew, or in the same tick of the file system's
clock as the last read's. Neither Pi nor the runtime writes so (Pi appends; the runtime
appends, cuts a torn tail, or renames a whole file into place); a hand edit might, and is
seen at the next start of the host, whose first read is whole.

The reading is :func:`~runtime._pi._session.parse_session`'s, line for line (the same
decoding and shape checks: ``_decode_line``): the leaf is the one a whole parse finds, and a
file whose first line is no session header raises as :func:`read_session` does.
"""

from __future__ import annotations

import array
import bisect
import enum
import os
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, Final

import trio

from .._errors import ReasonCode, SessionError
from ._session import StrPath, _decode_line, parse_session

__all__ = ["LeafReading", "SessionIndex", "WholeRead"]

_CHUNK: Final = 1 << 20
"""Bytes read at a time: what a read holds in memory, besides a line longer than that."""
_PROBE: Final = 256
"""Bytes of the last line read compared again before trusting it (its start and its end)."""
_HEX8: Final = re.compile(r"[0-9a-f]{8}")
_MERGE: Final = 64
"""New ids inserted one by one up to this many; more are merged in one sort."""


class WholeRead(enum.StrEnum):
    """Why a read read the whole file."""

    FIRST = "first"
    """Nothing was known of the file (the index is new, or forgot it after a failure)."""
    REPLACED = "replaced"
    """Another file is at the path (another device or inode)."""
    TRUNCATED = "truncated"
    """The file is shorter than the lines already read."""
    REWRITTEN = "rewritten"
    """The bytes read before are not where they were, or the file was written without
    growing."""


@dataclass(frozen=True, slots=True)
class LeafReading:
    """One read of a session file's leaf.

    ``leaf``: the last entry's id in file order (S5), ``None`` if there is none. ``entries``:
    the entries the file holds. ``size``: the offset the read reached (the file's size
    then). ``bytes_read`` and ``lines_parsed``: what this read read and decoded.
    ``whole``: why the whole file was read, or ``None`` when only what was appended since
    the last read was (with a few hundred bytes compared to trust the rest).
    """

    leaf: str | None
    entries: int
    size: int
    bytes_read: int
    lines_parsed: int
    whole: WholeRead | None


class _Ids:
    """Entry ids, compactly: Pi's 8-hex ids as sorted 32-bit numbers, any other in a set."""

    __slots__ = ("_hex", "_other")

    def __init__(self) -> None:
        self._hex = array.array("I")
        self._other: set[str] = set()

    def __len__(self) -> int:
        return len(self._hex) + len(self._other)

    def __contains__(self, entry_id: str) -> bool:
        if _HEX8.fullmatch(entry_id) is None:
            return entry_id in self._other
        value = int(entry_id, 16)
        at = bisect.bisect_left(self._hex, value)
        return at < len(self._hex) and self._hex[at] == value

    def add_new(self, ids: Iterable[str]) -> None:
        """Add ``ids``, none of them present (the caller checked)."""
        numbers = []
        for entry_id in ids:
            if _HEX8.fullmatch(entry_id) is None:
                self._other.add(entry_id)
            else:
                numbers.append(int(entry_id, 16))
        if len(numbers) <= _MERGE:
            for value in numbers:
                self._hex.insert(bisect.bisect_left(self._hex, value), value)
        else:
            numbers.extend(self._hex)
            numbers.sort()
            self._hex = array.array("I", numbers)


@dataclass(slots=True)
class _Known:
    """What a read left to the next: where the whole lines read end and how to trust them."""

    identity: tuple[int, int]
    """``st_dev``, ``st_ino``."""
    size: int
    """The size the read reached (the offset after its tail)."""
    times: tuple[int, int] | None
    """``st_mtime_ns``, ``st_ctime_ns`` at ``size``; ``None`` when they are not known (the
    file changed size while it was read, so the times seen before it are of another size)."""
    consumed: int
    """The offset just past the last LF read."""
    probes: tuple[tuple[int, bytes], ...]
    """``(offset, bytes)`` that must read the same again: the header line, the last line's
    start and end."""
    ids: _Ids
    leaf: str | None
    """The last entry of the whole lines read."""


@dataclass(slots=True)
class _Scan:
    """One pass over lines, from ``consumed``; what it found beside the kept ids."""

    consumed: int
    leaf: str | None
    last_line: tuple[int, bytes]
    fresh: dict[str, None]
    tail: bytes = b""
    bytes_read: int = 0
    lines_parsed: int = 0

    def line(self, raw_line: bytes, ids: _Ids) -> None:
        self.lines_parsed += 1
        _, _, obj = _decode_line(raw_line, tail=False)
        if obj is not None and obj["id"] not in self.fresh and obj["id"] not in ids:
            self.fresh[obj["id"]] = None
            self.leaf = obj["id"]
        self.last_line = (self.consumed, raw_line)
        self.consumed += len(raw_line) + 1

    def run(self, chunks: Iterable[bytes], ids: _Ids) -> None:
        """Feed every whole line of ``chunks``; what follows the last LF is the tail."""
        parts: list[bytes] = []
        for chunk in chunks:
            self.bytes_read += len(chunk)
            end = chunk.rfind(b"\n")
            if end < 0:
                parts.append(chunk)  # one line longer than a chunk: joined once it ends
                continue
            block = b"".join((*parts, chunk[:end])) if parts else chunk[:end]
            parts = [chunk[end + 1 :]] if end + 1 < len(chunk) else []
            for raw_line in block.split(b"\n"):
                self.line(raw_line, ids)
        self.tail = b"".join(parts)

    def tail_entry(self, ids: _Ids) -> str | None:
        """The id of the bytes after the last LF if they are an entry (S6), else ``None``."""
        if not self.tail:
            return None
        self.lines_parsed += 1
        _, _, obj = _decode_line(self.tail, tail=True)
        if obj is None or obj["id"] in self.fresh or obj["id"] in ids:
            return None
        return str(obj["id"])


def _chunks(f: BinaryIO, first: bytes = b"") -> Iterator[bytes]:
    if first:
        yield first
    while chunk := f.read(_CHUNK):
        yield chunk


def _probes(header: bytes, last: tuple[int, bytes]) -> tuple[tuple[int, bytes], ...]:
    offset, line = last
    probes = [(0, header + b"\n")]
    if offset > 0:  # the last line read is not the header
        line += b"\n"
        if len(line) <= 2 * _PROBE:
            probes.append((offset, line))
        else:
            probes += [(offset, line[:_PROBE]), (offset + len(line) - _PROBE, line[-_PROBE:])]
    return tuple(probes)


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    parts = []
    while length > 0 and (part := os.pread(fd, length, offset)):
        parts.append(part)
        length -= len(part)
        offset += len(part)
    return b"".join(parts)


class SessionIndex:
    """The leaf of the session file at ``path``, read by difference (S14). Blocking;
    thread-safe (reads run one at a time).

    Resource handling: it holds no descriptor between reads; what it keeps is a few hundred
    bytes and 4 bytes an entry. Error handling: a read raises as :func:`read_session` does
    (``SESSION_MISSING``, ``SESSION_HEADER_INVALID``, ``OSError``) and then forgets what it
    knew, so the next read is whole.
    """

    def __init__(self, path: StrPath) -> None:
        self.path = os.fspath(path)
        self._known: _Known | None = None
        self._lock = threading.Lock()

    def forget(self) -> None:
        """Keep nothing: the next read is whole."""
        with self._lock:
            self._known = None

    def read(self) -> LeafReading:
        """The file's leaf now; see :class:`LeafReading`."""
        with self._lock:
            known, self._known = self._known, None  # kept again only after a read succeeds
            try:
                f = open(self.path, "rb")  # noqa: SIM115 - closed by the with below
            except FileNotFoundError:
                message = "no session file"
                raise SessionError(ReasonCode.SESSION_MISSING, message, path=self.path) from None
            with f:
                st = os.fstat(f.fileno())
                whole = _distrust(f.fileno(), st, known)
                if whole is not None:
                    return self._read_whole(f, st, whole)
                assert known is not None
                return self._read_more(f, st, known)

    async def aread(self) -> LeafReading:
        """:meth:`read` in a worker thread, never abandoned on cancellation (S10)."""
        return await trio.to_thread.run_sync(self.read)

    def _read_whole(self, f: BinaryIO, st: os.stat_result, why: WholeRead) -> LeafReading:
        parts = []
        while (chunk := f.read(_CHUNK)) and (end := chunk.find(b"\n")) < 0:
            parts.append(chunk)
        if not chunk:  # no LF at all: the header alone, torn or not (S6, S11)
            data = b"".join(parts)
            parse_session(data, path=self.path)  # raises for no session header
            return LeafReading(None, 0, len(data), len(data), 1, why)
        header = b"".join((*parts, chunk[:end]))
        parse_session(header + b"\n", path=self.path)  # raises for no session header (S11)
        ids = _Ids()
        scan = _Scan(len(header) + 1, None, (0, header), {})
        scan.run(_chunks(f, chunk[end + 1 :]), ids)
        scan.lines_parsed += 1  # the header
        probes = _probes(header, scan.last_line)
        return self._keep(st, ids, scan, probes, why, extra=len(header) + 1)

    def _read_more(self, f: BinaryIO, st: os.stat_result, known: _Known) -> LeafReading:
        f.seek(known.consumed)
        scan = _Scan(known.consumed, known.leaf, (0, b""), {})
        scan.run(_chunks(f), known.ids)
        probes = known.probes
        if scan.lines_parsed:  # whole lines were added: the last one is another
            probes = _probes(known.probes[0][1][:-1], scan.last_line)
        probed = sum(len(data) for _, data in known.probes)
        return self._keep(st, known.ids, scan, probes, None, extra=probed)

    def _keep(
        self,
        st: os.stat_result,
        ids: _Ids,
        scan: _Scan,
        probes: tuple[tuple[int, bytes], ...],
        whole: WholeRead | None,
        *,
        extra: int,
    ) -> LeafReading:
        """Keep what ``scan`` read for the next read, and say what the leaf is now.

        The times of ``st`` (taken before the read) are kept only for the size they were
        taken at: if the read went further (Pi appended meanwhile), a later rewrite in place
        that keeps the size reached would leave them unchanged, so none are kept and a read
        at that size is whole."""
        tail = scan.tail_entry(ids)
        ids.add_new(scan.fresh)
        reached = scan.consumed + len(scan.tail)
        self._known = _Known(
            identity=(st.st_dev, st.st_ino),
            size=reached,
            times=(st.st_mtime_ns, st.st_ctime_ns) if reached == st.st_size else None,
            consumed=scan.consumed,
            probes=probes,
            ids=ids,
            leaf=scan.leaf,
        )
        return LeafReading(
            leaf=tail if tail is not None else scan.leaf,
            entries=len(ids) + (tail is not None),
            size=reached,
            bytes_read=scan.bytes_read + extra,
            lines_parsed=scan.lines_parsed,
            whole=whole,
        )


def _distrust(fd: int, st: os.stat_result, known: _Known | None) -> WholeRead | None:
    """Why what ``known`` says of the file at ``fd`` cannot be trusted now, if it cannot."""
    if known is None:
        return WholeRead.FIRST
    if (st.st_dev, st.st_ino) != known.identity:
        return WholeRead.REPLACED
    if st.st_size < known.consumed:
        return WholeRead.TRUNCATED
    if st.st_size == known.size and (st.st_mtime_ns, st.st_ctime_ns) != known.times:
        return WholeRead.REWRITTEN  # written, not grown (Pi only appends), or times unknown
    for offset, data in known.probes:
        if _pread_all(fd, len(data), offset) != data:
            return WholeRead.REWRITTEN
    return None
