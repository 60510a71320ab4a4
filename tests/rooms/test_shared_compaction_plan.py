"""What a compaction of a shared store's logs decides, row by row (retention.md RT11;
``runtime/_rooms/_retention.py`` ``plan_shared_compaction``, pure): on rows as
``PgStore.read_shared`` returns them."""

from __future__ import annotations

from typing import Final

from runtime._config import RetentionConfig
from runtime._journal._interface import SharedRows
from runtime._records import (
    Admission,
    Fingerprints,
    Header,
    LogKind,
    Outcome,
    Record,
    ResultAcked,
    ResultPublished,
)
from runtime._rooms._retention import DAY_MS, plan_shared_compaction

NOW: Final = 1_000 * DAY_MS
OLD: Final = NOW - 40 * DAY_MS
RETENTION: Final = RetentionConfig(journal_days=7, idempotency_days=30)


def _admission(delivery_id: str, room: str) -> Admission:
    return Admission(
        delivery_id=delivery_id,
        lane=room,
        request={"delivery_id": delivery_id, "room": room},
        fingerprints=Fingerprints(request="r", authority="a", settings="s"),
        rendered_prompt="hi",
        admitted_ms=OLD,
    )


def _result(seq: int, delivery_id: str, room: str, when: int = OLD) -> ResultPublished:
    return ResultPublished(
        seq=seq, delivery_id=delivery_id, room=room, outcome=Outcome.REPLY, published_ms=when
    )


def _rows(admissions: list[Record], results: list[Record]) -> SharedRows:
    def numbered(kind: LogKind, records: list[Record]) -> list[tuple[int, Record]]:
        header = Header(schema_version=1, kind=kind, subject=str(kind), created_ms=0)
        return list(enumerate([header, *records]))

    return SharedRows(
        admissions=numbered(LogKind.ADMISSIONS, admissions),
        results=numbered(LogKind.RESULTS, results),
    )


def test_rt11_expired_rows_go_every_acknowledgement_but_the_last_and_never_a_last_row() -> None:
    """RT11: d1 and d2 (room a, 40 days old, acknowledged; a's latest is d3) expire: their
    admission rows and result rows are deleted, with every acknowledgement row but the
    last; the result log's last row (that acknowledgement) and each room's latest stay."""
    rows = _rows(
        [_admission("d1", "dm:a"), _admission("d2", "dm:a"), _admission("d3", "dm:a")],
        [
            _result(1, "d1", "dm:a"),
            ResultAcked(seq=1),
            _result(2, "d2", "dm:a"),
            _result(3, "d3", "dm:a"),
            ResultAcked(seq=3),
        ],
    )
    planned = plan_shared_compaction(rows, busy=lambda room: False, retention=RETENTION, now_ms=NOW)
    assert set(planned.plan.expired) == {"d1", "d2"}
    assert planned.admissions == [1, 2]
    assert planned.results == [1, 2, 3]  # d1's, the first acknowledgement, d2's
    assert planned.slim == {}  # d3 is its room's latest: kept whole, its journal too
    assert set(planned.expire) == {"d1", "d2"}
    assert planned.expire["d1"] == OLD  # its publication: held back forget_days from it (RT4)
    assert planned.forget_ms == int(RETENTION.forget_days * DAY_MS)


def test_rt11_a_delivery_admitted_in_the_last_row_expires_only_later() -> None:
    """RT11: the admission log's last row is never deleted (its number is where every host
    appends next): d2 — absorbed, its result published before its owner's — would expire,
    but its admission is that row, so it waits for a later compaction (its result stays
    with it); d1, its room's latest, is kept whole."""
    rows = _rows(
        [_admission("d1", "dm:a"), _admission("d2", "dm:a")],
        [_result(1, "d2", "dm:a"), _result(2, "d1", "dm:a", NOW - 8 * DAY_MS), ResultAcked(seq=2)],
    )
    planned = plan_shared_compaction(rows, busy=lambda room: False, retention=RETENTION, now_ms=NOW)
    assert (planned.plan.expired, planned.expire) == ({}, {})
    assert (planned.admissions, planned.results, planned.slim) == ([], [], {})
    assert not planned.changes


def test_rt11_a_room_with_a_delivery_running_anywhere_is_left_alone() -> None:
    """RT1 on a shared store: room a has an admission with no result in the rows (it may be
    running on another host this one has not heard from) and room b is busy here: nothing
    of either is slimmed or expired; room c's old delivery expires."""
    rows = _rows(
        [
            _admission("a1", "dm:a"),
            _admission("b1", "dm:b"),
            _admission("c1", "dm:c"),
            _admission("a2", "dm:a"),
            _admission("b2", "dm:b"),
            _admission("c2", "dm:c"),
            _admission("a3", "dm:a"),
        ],
        [
            _result(1, "a1", "dm:a"),
            _result(2, "b1", "dm:b"),
            _result(3, "c1", "dm:c"),
            _result(4, "a2", "dm:a"),
            _result(5, "b2", "dm:b"),
            _result(6, "c2", "dm:c"),
            ResultAcked(seq=6),
        ],
    )
    planned = plan_shared_compaction(
        rows, busy=lambda room: room == "dm:b", retention=RETENTION, now_ms=NOW
    )
    assert set(planned.plan.expired) == {"c1"}
    assert (planned.admissions, planned.results) == ([3], [3])
