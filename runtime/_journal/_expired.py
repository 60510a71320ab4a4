"""The expired-id filter (docs/design/retention.md RT4): the deliveries whose idempotency
record retention removed, so that a late duplicate is answered ``delivery_expired`` and is
never run again as new.

One file, ``expired.ids`` in the state directory, replaced atomically (:func:`atomic_write`)
by every compaction that expires a delivery::

    offset 0   8 bytes  magic b"PIRTEXP1"
           8   u32      entry count (little endian)
          12   u32      crc32 over the entries
          16   entries, sorted by key, 24 bytes each:
                 16 bytes  key: the delivery's file-name key (:func:`delivery_key`), raw
                  8 bytes  u64 forget-after time, wall clock ms (``[retention] forget_days``)

A lookup is a binary search over the bytes as read: opening it decodes nothing, so start-up
does not grow with the number of expired deliveries beyond reading the file (24 bytes each).
The file fails closed: a wrong magic, length or checksum is ``journal_corrupt`` — a flipped
bit must not turn an expired delivery into a new one. Pure, apart from :func:`read_expired`.
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
_MAGIC: Final = b"PIRTEXP1"
_HEAD: Final = struct.Struct("<8sII")
_ENTRY: Final = 24
_KEY: Final = 16
_WHEN: Final = struct.Struct(">Q")


def _key_of(delivery_key: str) -> bytes:
    return bytes.fromhex(delivery_key)


class ExpiredIds:
    """The filter as read; :meth:`merged` builds the next one."""

    def __init__(self, data: bytes = b"") -> None:
        self._data = memoryview(data)[_HEAD.size :] if data else memoryview(b"")
        self._count = len(self._data) // _ENTRY

    def __len__(self) -> int:
        return self._count

    def _key(self, i: int) -> bytes:
        return bytes(self._data[i * _ENTRY : i * _ENTRY + _KEY])

    def _find(self, key: bytes) -> int:
        lo, hi = 0, self._count
        while lo < hi:
            mid = (lo + hi) // 2
            if self._key(mid) < key:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def __contains__(self, delivery_key: object) -> bool:
        """Whether the delivery whose file-name key is ``delivery_key`` expired."""
        if not isinstance(delivery_key, str):
            return False
        key = _key_of(delivery_key)
        i = self._find(key)
        return i < self._count and self._key(i) == key

    def entries(self) -> Iterable[tuple[bytes, int]]:
        for i in range(self._count):
            at = i * _ENTRY
            yield bytes(self._data[at : at + _KEY]), _WHEN.unpack_from(self._data, at + _KEY)[0]

    def merged(self, forget_after_ms: Mapping[str, int], *, now_ms: int) -> bytes:
        """The next file: these entries past their forget-after time dropped (RT4's bound),
        ``forget_after_ms``'s added, by delivery key (an entry already there keeps the
        later time)."""
        table = {key: when for key, when in self.entries() if when > now_ms}
        for delivery_key, forget_after in forget_after_ms.items():
            key = _key_of(delivery_key)
            table[key] = max(table.get(key, 0), forget_after)
        body = b"".join(key + _WHEN.pack(table[key]) for key in sorted(table))
        return _HEAD.pack(_MAGIC, len(table), zlib.crc32(body)) + body


def decode_expired(data: bytes, *, path: str) -> ExpiredIds:
    """The filter in ``data``; ``journal_corrupt`` naming ``path`` if it does not check out."""
    if not data:
        return ExpiredIds()
    if len(data) < _HEAD.size:
        raise JournalError(ReasonCode.JOURNAL_CORRUPT, "expired-id filter is cut short", path=path)
    magic, count, crc = _HEAD.unpack_from(data)
    body = memoryview(data)[_HEAD.size :]
    if magic != _MAGIC:
        raise JournalError(ReasonCode.JOURNAL_CORRUPT, "not an expired-id filter", path=path)
    if len(body) != count * _ENTRY:
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
