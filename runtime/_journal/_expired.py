"""The expired-id filter (docs/design/retention.md RT4): the deliveries whose idempotency
record retention removed, so that a late duplicate is answered ``delivery_expired`` and is
never run again as new — until ``[retention] forget_days`` after it was published. The task
lanes keep one of their own in the same format (``tasks-expired.ids``, RT12).

One file, ``expired.ids`` in the state directory, replaced atomically (:func:`atomic_write`)
by every compaction that expires a delivery::

    offset 0   8 bytes  magic b"PIRTEXP2"
           8   u32      entry count (little endian)
          12   u32      crc32 over everything after these 16 bytes
          16   u64      forget_ms: [retention] forget_days, in ms, the filter counts with
          24   entries, sorted by key, 24 bytes each:
                 16 bytes  key: the delivery's file-name key (:func:`delivery_key`), raw
                  8 bytes  u64 since: when the delivery was published (a task: when it
                           ended, or was forgotten), wall clock ms

An entry holds its id back while ``since + forget_ms`` is ahead of the wall clock
(:meth:`ExpiredIds.holds`): a lookup asks the time, so an id is let go when its time comes —
not at some later rewrite of the file — and the count is the file's own, so a host that
starts with another ``forget_days`` rewrites the header (:meth:`ExpiredIds.counts_with`,
:meth:`ExpiredIds.merged`) and every entry follows it at once, those already in the file
too. (A filter an earlier version wrote, ``PIRTEXP1``, has no ``forget_ms`` and holds each
entry's forget-after time where ``since`` is: it is read as such — each id held back until
the time it was written with — and the next rewrite keeps those times, counted back from
the ``forget_days`` of then.)

A lookup is a binary search over the bytes as read: opening it decodes nothing, so start-up
does not grow with the number of expired deliveries beyond reading the file (24 bytes each).
The file fails closed: a wrong magic, length or checksum is ``journal_corrupt`` — a flipped
bit must not turn an expired delivery into a new one — and so is an empty file (every filter
written holds its header; only a missing one is an empty filter, RT19). Pure, apart from
:func:`read_expired`.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Mapping
from typing import Final

from .._errors import JournalError, ReasonCode
from .._linux._fs import FileSystem

__all__ = ["EXPIRED", "ExpiredIds", "read_expired"]

EXPIRED: Final = "expired.ids"
_MAGIC: Final = b"PIRTEXP2"
_MAGIC_V1: Final = b"PIRTEXP1"
"""An earlier version's filter: no ``forget_ms``, each entry's time its forget-after time."""
_HEAD: Final = struct.Struct("<8sII")
_FORGET: Final = struct.Struct("<Q")
_ENTRY: Final = 24
_KEY: Final = 16
_WHEN: Final = struct.Struct(">Q")


def _key_of(delivery_key: str) -> bytes:
    return bytes.fromhex(delivery_key)


class ExpiredIds:
    """The filter as read; :meth:`merged` builds the next one."""

    def __init__(self, data: bytes = b"") -> None:
        self.forget_ms: int | None = None
        """The ``forget_days`` (ms) its entries are counted with; ``None`` for an earlier
        version's filter (each entry's time its forget-after time) or an empty one."""
        if not data:
            self._data = memoryview(b"")
        elif data[:8] == _MAGIC_V1:
            self._data = memoryview(data)[_HEAD.size :]
        else:
            self.forget_ms = _FORGET.unpack_from(data, _HEAD.size)[0]
            self._data = memoryview(data)[_HEAD.size + _FORGET.size :]
        self._count = len(self._data) // _ENTRY

    def __len__(self) -> int:
        return self._count

    def _key(self, i: int) -> bytes:
        return bytes(self._data[i * _ENTRY : i * _ENTRY + _KEY])

    def _until(self, i: int) -> int:
        """Until when entry ``i`` holds its id back (wall clock ms)."""
        when: int = _WHEN.unpack_from(self._data, i * _ENTRY + _KEY)[0]
        return when + (self.forget_ms or 0)

    def _find(self, key: bytes) -> int:
        lo, hi = 0, self._count
        while lo < hi:
            mid = (lo + hi) // 2
            if self._key(mid) < key:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _index(self, delivery_key: str) -> int | None:
        key = _key_of(delivery_key)
        i = self._find(key)
        return i if i < self._count and self._key(i) == key else None

    def holds(self, delivery_key: str, *, now_ms: int) -> bool:
        """Whether the delivery whose file-name key is ``delivery_key`` is expired at
        ``now_ms``: listed, and its ``forget_days`` not yet past (RT4). Every decision asks
        this, never :meth:`__contains__`."""
        i = self._index(delivery_key)
        return i is not None and self._until(i) > now_ms

    def since(self, delivery_key: str) -> int | None:
        """The time the entry of ``delivery_key`` counts its ``forget_days`` from (a
        delivery's publication; a task's end, or its forget); ``None`` when the file does not
        list it, or is an earlier version's (which kept only its forget-after time). Whose
        expiry an entry is: an id let go and used again has a later time of its own (RT4,
        RT19)."""
        i = self._index(delivery_key)
        if i is None or self.forget_ms is None:
            return None
        when: int = _WHEN.unpack_from(self._data, i * _ENTRY + _KEY)[0]
        return when

    def __contains__(self, delivery_key: object) -> bool:
        """Whether the file lists ``delivery_key``, whatever its time (what a look at the
        file shows; a decision asks :meth:`holds`)."""
        return isinstance(delivery_key, str) and self._index(delivery_key) is not None

    def counts_with(self, forget_ms: int) -> bool:
        """Whether its entries are let go ``forget_ms`` after their time already — or
        there is nothing to count (an empty filter; an earlier version's, whose entries keep
        the time they were written with, :meth:`merged`). A host whose ``forget_days`` this
        is not rewrites it (an empty :meth:`merged`) before it acts on it."""
        return self.forget_ms in (None, forget_ms) or not self._count

    def entries(self) -> Iterable[tuple[bytes, int]]:
        """Each entry's key and until when it holds its id back."""
        for i in range(self._count):
            yield self._key(i), self._until(i)

    def merged(self, since_ms: Mapping[str, int], *, now_ms: int, forget_ms: int) -> bytes:
        """The next file, counted with ``forget_ms``: these entries, ``since_ms``'s added
        (by delivery key, each the time its ``forget_days`` count from; an entry already
        there keeps the later), those whose ``forget_ms`` is past at ``now_ms`` dropped
        (RT4's bound). An earlier version's entry keeps the forget-after time it was written
        with (its ``since``: that time less ``forget_ms``)."""
        table: dict[bytes, int] = {}
        for i in range(self._count):
            when = _WHEN.unpack_from(self._data, i * _ENTRY + _KEY)[0]
            if self.forget_ms is None:  # PIRTEXP1: its forget-after time
                when = max(0, when - forget_ms)
            table[self._key(i)] = when
        for delivery_key, since in since_ms.items():
            key = _key_of(delivery_key)
            table[key] = max(table.get(key, 0), since)
        body = _FORGET.pack(forget_ms) + b"".join(
            key + _WHEN.pack(table[key]) for key in sorted(table) if table[key] + forget_ms > now_ms
        )
        count = (len(body) - _FORGET.size) // _ENTRY
        return _HEAD.pack(_MAGIC, count, zlib.crc32(body)) + body


def decode_expired(data: bytes, *, path: str) -> ExpiredIds:
    """The filter in ``data``; ``journal_corrupt`` naming ``path`` if it does not check out —
    an empty file too: every filter written holds its header, even with no entry, so one
    found empty lost what it held (RT4, RT19: never read as an empty filter). No file at all
    is :func:`read_expired`'s: nothing expired yet."""
    if len(data) < _HEAD.size:
        raise JournalError(ReasonCode.JOURNAL_CORRUPT, "expired-id filter is cut short", path=path)
    magic, count, crc = _HEAD.unpack_from(data)
    body = memoryview(data)[_HEAD.size :]
    if magic not in (_MAGIC, _MAGIC_V1):
        raise JournalError(ReasonCode.JOURNAL_CORRUPT, "not an expired-id filter", path=path)
    fixed = _FORGET.size if magic == _MAGIC else 0
    if len(body) != fixed + count * _ENTRY:
        raise JournalError(
            ReasonCode.JOURNAL_CORRUPT,
            f"expired-id filter announces {count} entries but holds {len(body)} bytes",
            path=path,
            offset=_HEAD.size,
        )
    if zlib.crc32(body) != crc:
        raise JournalError(
            ReasonCode.JOURNAL_CORRUPT, "expired-id filter fails its checksum", path=path
        )
    return ExpiredIds(data)


def read_expired(fs: FileSystem, path: str, *, rel: str = EXPIRED) -> ExpiredIds:
    """Read the filter at ``path`` (blocking); empty when there is none yet."""
    try:
        data = fs.read(path)
    except FileNotFoundError:
        return ExpiredIds()
    return decode_expired(data, path=rel)
