"""The framing layer (runtime._journal._frame): pure bytes in, frames out."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from runtime._errors import ReasonCode
from runtime._journal._frame import HEADER_SIZE, SECTOR, FrameDamage, encode_frame, scan


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


@given(
    cut=st.integers(min_value=0, max_value=200),
    tail=st.one_of(st.binary(max_size=64), st.integers(0, 64).map(bytes)),
)
def test_torn_final_frame_is_discarded(cut: int, tail: bytes) -> None:
    """J3: a final frame cut anywhere, plus zeros or garbage, is a torn tail — unless the
    tail happens to make it a whole frame (a header not all zeros, its declared length ending
    inside the file, no 512-byte sector of it all zeros) that fails its checksum: that is
    damage (J4, J3a: a count or length of 0 included), never dropped."""
    good = _log([b"1"], [b"2", b"3"])
    last = encode_frame(3, [b'"' + b"z" * 100 + b'"'])
    data = good + last[: min(cut, len(last) - 1)] + tail
    assume(not data.startswith(good + last))  # the tail happened to complete the frame
    final = data[len(good) :]
    length = int.from_bytes(final[:4], "little") if len(final) >= HEADER_SIZE else 0
    body = final[HEADER_SIZE : HEADER_SIZE + length]
    whole = len(final) >= HEADER_SIZE and length == len(body) and any(final[:HEADER_SIZE])  # J3a
    if whole and not _zero_sector_in(data, len(good), len(good) + HEADER_SIZE + length):
        with pytest.raises(FrameDamage) as info:
            scan(data)
        assert info.value.code is ReasonCode.JOURNAL_CORRUPT
        assert info.value.offset == len(good)
        return
    result = scan(data)
    # garbage may by chance not extend beyond good; it must never add frames
    assert [f.first_seq for f in result.frames] == [0, 1]
    assert result.good_length == len(good)
    assert result.torn_bytes == len(data) - len(good)


def test_a_cut_final_frame_is_torn_wherever_it_is_cut() -> None:
    """J3: every prefix of the final frame (an interrupted write) is a torn tail."""
    good = _log([b"1"], [b"2", b"3"])
    last = encode_frame(3, [b'"' + b"z" * 100 + b'"'])
    for cut in range(len(last)):
        result = scan(good + last[:cut])
        assert (result.good_length, result.torn_bytes) == (len(good), cut)


def test_j4_a_flipped_bit_in_the_last_complete_frame_is_damage_not_a_torn_tail() -> None:
    """J4: the last acknowledged record with one bit flipped is whole — its length ends
    exactly at the end of the file — so it is damage and fails closed; dropping it as torn
    would forget an intent (a tool that then runs twice)."""
    good = _log([b"1"], [b"2", b"3"])
    last = bytearray(encode_frame(3, [b'{"type":"tool_intent","name":"bash"}']))
    for position in (HEADER_SIZE + 5, len(last) - 2, 9):  # body, last body byte, header seq
        flipped = bytearray(last)
        flipped[position] ^= 0x04
        with pytest.raises(FrameDamage) as info:
            scan(good + bytes(flipped))
        assert info.value.code is ReasonCode.JOURNAL_CORRUPT
        assert info.value.offset == len(good)


def test_j3_a_whole_final_frame_with_a_zero_filled_body_is_a_torn_write() -> None:
    """J3: a power loss after the file grew but before the body's later sectors were written
    leaves the header, the first sector's bytes and zeros from a sector boundary on: a torn
    write, not damage."""
    good = _log([b"1"])
    last = bytearray(encode_frame(1, [b'"' + b"z" * 1500 + b'"']))
    written = SECTOR - len(good)  # the frame's bytes in the file's first sector
    last[written:] = bytes(len(last) - written)
    result = scan(good + bytes(last))
    assert (result.good_length, result.torn_bytes) == (len(good), len(last))
    tail = bytearray(encode_frame(1, [b'"' + b"z" * 1500 + b'"']))
    tail[written + SECTOR : written + 2 * SECTOR] = bytes(SECTOR)  # a middle sector unwritten
    result = scan(good + bytes(tail))
    assert (result.good_length, result.torn_bytes) == (len(good), len(tail))


def test_j4_a_bit_flipped_to_a_nul_in_the_last_frame_is_damage_not_a_torn_write() -> None:
    """J4: one flipped bit can make a NUL byte — a space (0x20), an ``@`` (0x40), a UTF-8
    continuation byte (0x80, the second byte of ``À``) — but never a whole zero sector. So
    the last acknowledged record with such a bit fails closed, also with the zeros of a log
    allocated ahead after it (J19); read as a torn write, it would vanish and its tool run
    again."""
    good = _log([b"1"], [b"2", b"3"])
    record = '{"type":"tool_intent","name":"bash","note":"a b@c À"}'.encode()
    last = encode_frame(3, [record])
    for byte in (b" ", b"@", b"\x80"):  # each a single set bit: clearing it is one flip
        flipped = bytearray(last)
        flipped[HEADER_SIZE + record.index(byte)] = 0
        for after in (b"", bytes(1 << 20)):
            with pytest.raises(FrameDamage) as info:
                scan(good + bytes(flipped) + after)
            assert info.value.code is ReasonCode.JOURNAL_CORRUPT
            assert info.value.offset == len(good)


@pytest.mark.parametrize(("start", "body"), [(SECTOR - 1, 256), (SECTOR - 2, 65536)])
def test_j4_a_flipped_bit_in_a_last_frame_just_before_a_sector_boundary_is_damage(
    start: int, body: int
) -> None:
    """J4: the last frame begins ``start`` bytes into a sector, so the piece of that sector
    it holds is only the low bytes of its length — zeros whenever the length is a multiple
    of 256 (65,536). A whole frame with one flipped bit in its body is damage; that piece,
    written with the frame and zero by nature, is no sector a torn write left unwritten (it
    was read as one, and the last acknowledged record vanished)."""
    first = encode_frame(0, [b'"' + b"a" * (start - HEADER_SIZE - 4) + b'"'])
    assert len(first) == start
    last = bytearray(encode_frame(1, [b'"' + b"z" * (body - 4) + b'"']))
    assert len(last) == HEADER_SIZE + body
    last[HEADER_SIZE + 100] ^= 0x04
    for after in (b"", bytes(1 << 20)):  # at the end of the file, or before zeros (J19)
        with pytest.raises(FrameDamage) as info:
            scan(first + bytes(last) + after)
        assert info.value.code is ReasonCode.JOURNAL_CORRUPT
        assert info.value.offset == start


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


def test_j3_j12_a_zero_filled_remainder_after_a_cut_frame_is_a_torn_tail() -> None:
    """J3, J12: a sync log generation is zero-filled ahead; a frame cut in it, followed by
    megabytes of zeros, is a torn tail — and a valid frame after the zeros is still found,
    which makes the cut frame damage (J4)."""
    good = encode_frame(0, [b'{"a":1}'])
    cut = encode_frame(1, [b'{"b":"' + b"x" * 1300 + b'"}'])[: 2 * SECTOR - len(good)]
    zeros = bytes(4 * 1024 * 1024)
    found = scan(good + cut + zeros)
    assert [f.first_seq for f in found.frames] == [0]
    assert found.torn_bytes == len(cut) + len(zeros)
    later = encode_frame(1, [b'{"c":2}'])
    with pytest.raises(FrameDamage) as damage:
        scan(good + cut + zeros + later)
    assert damage.value.code is ReasonCode.JOURNAL_CORRUPT


def _zero_sector_in(data: bytes, start: int, end: int) -> bool:
    """The test's own statement of J3's zero sector: some 512-byte-aligned sector of the
    file from ``start`` on (not the one ``start`` lies inside, unless it begins there),
    clipped to ``end``, holds only zeros."""
    first = -(-start // SECTOR) * SECTOR
    return any(
        not any(data[sector : min(sector + SECTOR, end)]) for sector in range(first, end, SECTOR)
    )
