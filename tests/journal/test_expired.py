"""The expired-id filter (docs/design/retention.md RT4; the task lanes' one, RT12): an id is
held back until ``forget_days`` after its own time — asked at each lookup, counted with the
``forget_days`` the filter was last written with, which a host started with another rewrites
at once — and the file fails closed."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Final

import pytest

from runtime._clock import Clocks, MockWallClock, SystemSilenceClock
from runtime._config import RetentionConfig
from runtime._errors import JournalError, ReasonCode
from runtime._journal._expired import EXPIRED, ExpiredIds, decode_expired
from runtime._journal._store import delivery_key, lane_key, open_store
from runtime._retention import follow_forget_days

DAY: Final = 86_400_000
T0: Final = 1_795_000_000_000
A, B = delivery_key("a"), delivery_key("b")


def _filter(since: dict[str, int], *, forget_days: int, now_ms: int = T0) -> ExpiredIds:
    data = ExpiredIds().merged(since, now_ms=now_ms, forget_ms=forget_days * DAY)
    return decode_expired(data, path=EXPIRED)


def test_rt4_an_id_is_let_go_when_its_forget_days_pass_not_at_the_next_rewrite() -> None:
    """RT4: an id expired at day 0 with ``forget_days`` 40 is held back through day 39 and
    let go from day 40 on, by the lookup alone — the file is not written again. Before, a
    lookup asked only whether the id was listed: it stayed refused until some later expiry
    rewrote the file."""
    key = delivery_key("x")
    ids = _filter({key: T0}, forget_days=40)
    assert ids.holds(key, now_ms=T0 + 39 * DAY)
    assert not ids.holds(key, now_ms=T0 + 40 * DAY)
    assert not ids.holds(delivery_key("y"), now_ms=T0)
    assert key in ids  # still listed, until a rewrite drops it
    again = decode_expired(ids.merged({}, now_ms=T0 + 40 * DAY, forget_ms=40 * DAY), path=EXPIRED)
    assert len(again) == 0


@pytest.mark.parametrize(("first", "then"), [(40, 400), (400, 40)], ids=["raised", "lowered"])
def test_rt4_a_rewrite_with_other_forget_days_moves_every_id_already_there(
    first: int, then: int
) -> None:
    """RT4: a filter written with ``forget_days`` ``first`` and rewritten with ``then`` (a
    host started with a changed configuration, with nothing to add) holds each id until
    ``then`` days after its own time, those already in the file too. Before, each entry kept
    the forget-after time it was written with: a raised ``forget_days`` let an id go (and a
    duplicate of it run again) at the old time."""
    ids = _filter({A: T0, B: T0 + 10 * DAY}, forget_days=first)
    assert ids.counts_with(first * DAY)
    assert not ids.counts_with(then * DAY)
    now = T0 + 41 * DAY
    moved = decode_expired(ids.merged({}, now_ms=now, forget_ms=then * DAY), path=EXPIRED)
    assert moved.counts_with(then * DAY)
    for key, since in ((A, T0), (B, T0 + 10 * DAY)):
        past = since + then * DAY <= now
        assert moved.holds(key, now_ms=now) is not past
        assert moved.holds(key, now_ms=since + then * DAY - 1) is not past
        assert not moved.holds(key, now_ms=since + then * DAY)


def test_rt4_an_earlier_versions_filter_keeps_the_times_it_was_written_with() -> None:
    """RT4: a ``PIRTEXP1`` filter (each entry's forget-after time, no ``forget_days``) is read
    as it was written — each id held back until its own time — and a rewrite with any
    ``forget_days`` keeps those times (nothing says what it was counted with), counting
    what it adds with the new one."""
    body = b"".join(
        bytes.fromhex(key) + struct.pack(">Q", until)
        for key, until in sorted([(A, T0 + 40 * DAY), (B, T0 + 90 * DAY)])
    )
    old = struct.pack("<8sII", b"PIRTEXP1", 2, zlib.crc32(body)) + body
    ids = decode_expired(old, path=EXPIRED)
    assert ids.counts_with(400 * DAY)  # nothing to count again: its times are its own
    assert ids.holds(A, now_ms=T0 + 40 * DAY - 1)
    assert not ids.holds(A, now_ms=T0 + 40 * DAY)
    now = T0 + 50 * DAY
    new = decode_expired(
        ids.merged({delivery_key("c"): now}, now_ms=now, forget_ms=400 * DAY), path=EXPIRED
    )
    assert A not in new  # past its own time: dropped
    assert new.holds(B, now_ms=T0 + 90 * DAY - 1)
    assert not new.holds(B, now_ms=T0 + 90 * DAY)
    assert new.holds(delivery_key("c"), now_ms=now + 400 * DAY - 1)


def test_rt4_a_flipped_bit_in_the_filters_forget_days_is_journal_corrupt() -> None:
    """RT4: the checksum covers the ``forget_days`` the filter counts with, not only its
    entries: a flipped bit there would let every id go early."""
    data = bytearray(ExpiredIds().merged({A: T0}, now_ms=T0, forget_ms=365 * DAY))
    data[17] ^= 0x01
    with pytest.raises(JournalError) as refused:
        decode_expired(bytes(data), path=EXPIRED)
    assert refused.value.code is ReasonCode.JOURNAL_CORRUPT


@pytest.mark.trio
async def test_rt4_rt12_a_host_started_with_other_forget_days_rewrites_both_filters(
    tmp_path: Path,
) -> None:
    """RT4, RT12: a state directory whose filters — the deliveries' and the tasks' — were
    written with ``forget_days`` 40 is opened by a host configured with 400 (what a server
    does at its start: :func:`follow_forget_days`) at day 41: both hold their ids back
    again, durably (a second start reads them so); with 40 again they are let go."""
    wall = MockWallClock(start_ms=T0)
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    task = lane_key("task:t1")
    async with open_store(tmp_path / "state", clocks=clocks) as store:
        now = wall.time_ms()
        await store.expire({"a": now}, forget_ms=40 * DAY)
        await store.expire_tasks({"t1": now}, forget_ms=40 * DAY)
    wall.advance(41 * 86_400)
    async with open_store(tmp_path / "state", clocks=clocks) as store:
        later = wall.time_ms()
        assert not store.expired.holds(A, now_ms=later)
        await follow_forget_days(store, RetentionConfig(forget_days=400))
        held = (store.expired.holds(A, now_ms=later), store.expired_tasks.holds(task, now_ms=later))
    async with open_store(tmp_path / "state", clocks=clocks) as store:
        again = (
            store.expired.holds(A, now_ms=later),
            store.expired_tasks.holds(task, now_ms=later),
        )
        await follow_forget_days(store, RetentionConfig(forget_days=40))
        gone = (len(store.expired), len(store.expired_tasks))
    assert held == again == (True, True)
    assert gone == (0, 0)
