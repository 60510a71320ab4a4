"""Typed logs (runtime._journal._journal, runtime._records): decoding fails closed."""

from __future__ import annotations

import msgspec
import pytest

from runtime._errors import JournalError, ReasonCode
from runtime._journal._frame import encode_frame
from runtime._journal._journal import decode_log, encode_record
from runtime._records import (
    KNOWN_TAGS,
    SCHEMA_VERSION,
    Header,
    LogKind,
    Outcome,
    Poison,
    ReplayClass,
    Result,
    ToolIntent,
    record_tag,
)


def _header(version: int = SCHEMA_VERSION, kind: LogKind = LogKind.DELIVERY) -> bytes:
    return encode_record(Header(schema_version=version, kind=kind, subject="d", created_ms=1))


def _intent(n: int) -> bytes:
    return encode_record(
        ToolIntent(
            intent_id=f"k:{n}",
            step=n,
            tool_call_id=f"call_{n}",
            name="bash",
            args='{"command":"ls"}',
            replay_class=ReplayClass.NEVER,
            epoch=1,
        )
    )


def test_records_round_trip() -> None:
    """J2: what is appended is what is read, typed."""
    data = encode_frame(0, [_header()]) + encode_frame(1, [_intent(1), _intent(2)])
    contents = decode_log(data, rel="deliveries/x.log", kind=LogKind.DELIVERY)
    assert contents.header.subject == "d"
    assert [type(r).__name__ for r in contents.records] == ["Header", "ToolIntent", "ToolIntent"]
    assert contents.next_seq == 3


def test_future_schema_version_is_refused() -> None:
    """J4: a header from a newer schema is refused with its reason code."""
    data = encode_frame(0, [_header(version=SCHEMA_VERSION + 1)])
    with pytest.raises(JournalError) as info:
        decode_log(data, rel="results.log")
    assert info.value.code is ReasonCode.JOURNAL_VERSION_UNSUPPORTED
    assert info.value.path == "results.log"
    assert info.value.offset == 0


@pytest.mark.parametrize("what", ["a new record type", "a new log kind", "in one frame"])
def test_j4_a_log_from_a_newer_schema_is_refused_as_newer_whatever_it_holds(what: str) -> None:
    """J4, schema rule 4: a newer version writes what this one cannot decode — a record
    type it added (the reason it bumped the version), a header whose log kind it added —
    and the header says so. The log is refused with ``journal_version_unsupported`` at
    offset 0 (upgrade pi-runtime), not as an unknown record further on nor as damage
    (``journal_corrupt`` sends an operator looking for a broken disk)."""
    newer = SCHEMA_VERSION + 1
    later = b'{"type":"from_the_future","x":1}'
    if what == "a new record type":
        data = encode_frame(0, [_header(newer)]) + encode_frame(1, [_intent(1), later])
    elif what == "a new log kind":
        header = _header(newer).replace(b'"delivery"', b'"ledger"')
        data = encode_frame(0, [header]) + encode_frame(1, [_intent(1)])
    else:
        data = encode_frame(0, [_header(newer), later])
    with pytest.raises(JournalError) as info:
        decode_log(data, rel="deliveries/x.log")
    assert info.value.code is ReasonCode.JOURNAL_VERSION_UNSUPPORTED, info.value
    assert info.value.offset == 0


def test_unknown_record_tag_is_refused() -> None:
    """J4: a record type this version does not know is refused, never skipped."""
    alien = b'{"type":"teleport","to":"mars"}'
    data = encode_frame(0, [_header()]) + encode_frame(1, [_intent(1), alien])
    with pytest.raises(JournalError) as info:
        decode_log(data, rel="deliveries/x.log")
    assert info.value.code is ReasonCode.JOURNAL_UNKNOWN_RECORD
    assert info.value.offset == len(encode_frame(0, [_header()]))


def test_malformed_known_record_is_corrupt() -> None:
    """J4: a known record with a wrongly typed field is corrupt."""
    data = encode_frame(0, [_header()]) + encode_frame(1, [b'{"type":"result","outcome":7}'])
    with pytest.raises(JournalError) as info:
        decode_log(data, rel="deliveries/x.log")
    assert info.value.code is ReasonCode.JOURNAL_CORRUPT


def test_missing_header_is_refused() -> None:
    """J4: a log must start with its header."""
    with pytest.raises(JournalError) as info:
        decode_log(encode_frame(0, [_intent(0)]), rel="x.log")
    assert info.value.code is ReasonCode.JOURNAL_HEADER_MISSING


def test_empty_or_torn_header_log_holds_nothing() -> None:
    """J3: a log whose header never became durable acknowledged nothing."""
    assert decode_log(b"", rel="x.log").next_seq == 0
    torn = encode_frame(0, [_header()])[:7]
    contents = decode_log(torn, rel="x.log")
    assert contents.next_seq == 0
    assert contents.torn_bytes == 7


def test_wrong_log_kind_is_refused() -> None:
    with pytest.raises(JournalError) as info:
        decode_log(encode_frame(0, [_header(kind=LogKind.LANE)]), rel="x", kind=LogKind.DELIVERY)
    assert info.value.code is ReasonCode.JOURNAL_CORRUPT


def test_poison_document_bounds_what_is_read() -> None:
    """J5: a poisoned log is read only up to the length its poison vouches for."""
    good = encode_frame(0, [_header()]) + encode_frame(1, [_intent(1)])
    later = encode_frame(2, [_intent(2)])
    poison = Poison(log_path="x", good_length=len(good), reason="EIO", poisoned_ms=1)
    contents = decode_log(good + later, rel="x", poison=poison)
    assert contents.next_seq == 2
    assert contents.poison == poison


def test_unknown_fields_of_a_known_record_are_ignored() -> None:
    """Evolution: a newer writer of the same schema may add fields with defaults."""
    record = b'{"type":"result","outcome":"reply","finished_ms":5,"added_later":{"x":1}}'
    data = encode_frame(0, [_header()]) + encode_frame(1, [record])
    result = decode_log(data, rel="x").records[1]
    assert result == Result(outcome=Outcome.REPLY, finished_ms=5)


def test_tags_are_stable() -> None:
    """Tags are part of the on-disk format: renaming one breaks every journal."""
    assert sorted(KNOWN_TAGS) == [
        "absorbed_input",
        "admission",
        "compacted",
        "continuation_sent",
        "epoch_fenced",
        "epoch_launching",
        "epoch_started",
        "header",
        "lifecycle_receipt",
        "model_request",
        "model_response",
        "outbox_action",
        "parked",
        "poison",
        "result",
        "result_acked",
        "result_published",
        "settled",
        "step_abandoned",
        "task_ended",
        "task_reply",
        "task_submitted",
        "tool_intent",
        "tool_outcome",
    ]
    assert record_tag(Result(outcome=Outcome.SILENT, finished_ms=0)) == "result"


def test_records_are_frozen() -> None:
    record = Result(outcome=Outcome.REPLY, finished_ms=0)
    with pytest.raises(AttributeError):
        record.text = "changed"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Result(Outcome.REPLY, None)  # type: ignore[call-arg]  # keyword-only
    assert msgspec.json.decode(encode_record(record), type=Result) == record


def test_stricter_replay_class_wins() -> None:
    assert ReplayClass.stricter(ReplayClass.SAFE, ReplayClass.NEVER) is ReplayClass.NEVER
    assert ReplayClass.stricter(ReplayClass.RECEIPT, ReplayClass.SAFE) is ReplayClass.RECEIPT
    assert ReplayClass.stricter(ReplayClass.NEVER, ReplayClass.RECEIPT) is ReplayClass.NEVER
