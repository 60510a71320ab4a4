"""The framing layer (runtime._journal._frame): pure bytes in, frames out."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from runtime._errors import ReasonCode
from runtime._journal._frame import HEADER_SIZE, FrameDamage, encode_frame, scan


def _log(*batches: list[bytes]) -> bytes:
    out = b""
    seq = 0
    for batch in batches:
        out += encode_frame(seq, batch)
        seq += len(batch)
    return out


def test_round_trip_batches() -> None:
    """J2: every frame written reads back, in order, with its sequence numbers."""
    data = _log([b'{"a":1}'], [b"1", b"2", b"3"], [b'"x"'])
    result = scan(data)
    assert [(f.first_seq, f.count) for f in result.frames] == [(0, 1), (1, 3), (4, 1)]
    assert result.frames[1].body == b"[1,2,3]"
    assert result.good_length == len(data)
    assert result.torn_bytes == 0
    assert result.next_seq == 5


@given(cut=st.integers(min_value=0, max_value=200), tail=st.binary(max_size=64))
def test_torn_final_frame_is_discarded(cut: int, tail: bytes) -> None:
    """J3: a final frame cut anywhere, plus any garbage, is a torn tail."""
    good = _log([b"1"], [b"2", b"3"])
    last = encode_frame(3, [b'"' + b"z" * 100 + b'"'])
    data = good + last[: min(cut, len(last) - 1)] + tail
    assume(not data.startswith(good + last))  # the tail happened to complete the frame
    result = scan(data)
    # garbage may by chance not extend beyond good; it must never add frames
    assert [f.first_seq for f in result.frames] == [0, 1]
    assert result.good_length == len(good)
    assert result.torn_bytes == len(data) - len(good)


def test_zero_filled_tail_is_torn() -> None:
    """J3: zeros after the last frame (power loss after a size change) are torn."""
    good = _log([b"1"])
    result = scan(good + b"\0" * 4096)
    assert result.good_length == len(good)
    assert result.torn_bytes == 4096


def test_damage_in_the_middle_fails_closed() -> None:
    """J4: a bad frame followed by a good one is corruption, with its offset."""
    data = bytearray(_log([b"1"], [b"22"], [b"3"]))
    first_end = HEADER_SIZE + 3
    data[first_end + HEADER_SIZE + 1] ^= 0xFF  # flip a byte in frame 2's body
    with pytest.raises(FrameDamage) as info:
        scan(bytes(data))
    assert info.value.code is ReasonCode.JOURNAL_CORRUPT
    assert info.value.offset == first_end


def test_sequence_gap_fails_closed() -> None:
    """J4: a valid frame that skips sequence numbers is refused."""
    data = encode_frame(0, [b"1"]) + encode_frame(2, [b"3"])
    with pytest.raises(FrameDamage) as info:
        scan(data)
    assert info.value.code is ReasonCode.JOURNAL_SEQUENCE_GAP
    assert info.value.offset == HEADER_SIZE + 3


def test_empty_frame_is_refused_by_the_encoder() -> None:
    with pytest.raises(ValueError, match="at least one"):
        encode_frame(0, [])
