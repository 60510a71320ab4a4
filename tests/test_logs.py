"""The log lines' fields (``runtime/_logs.py``; docs/design/operations.md "Logs" L2)."""

from __future__ import annotations

import json
import logging

from hypothesis import given
from hypothesis import strategies as st

from runtime._cli._logging import _JsonLines
from runtime._journal._store import delivery_key
from runtime._logs import FIELDS, delivery_ref, fields


@given(st.text(min_size=1, max_size=200))
def test_l2_a_delivery_is_logged_by_its_journal_key(delivery_id: str) -> None:
    """L2: the logs name a delivery as its step journal's file is named, never by its id."""
    assert delivery_ref(delivery_id) == delivery_key(delivery_id)
    assert fields("x", delivery_id=delivery_id) == {
        "event": "x",
        "delivery": delivery_ref(delivery_id),
    }


def test_l1_a_json_line_carries_the_event_and_its_fields_and_nothing_else() -> None:
    """L1: the stable fields, in their names, the ones given only; a line with no event of
    its own is ``log``."""
    record = logging.LogRecord("runtime.rooms", logging.INFO, __file__, 1, "m %s", ("x",), None)
    for name, value in fields(
        "result_published", delivery_id="d1", room="dm:1", outcome="reply", seq=3, code=None
    ).items():
        setattr(record, name, value)
    line = json.loads(_JsonLines().format(record))
    assert line["event"] == "result_published"
    assert line["delivery"] == delivery_key("d1")
    assert (line["room"], line["outcome"], line["seq"]) == ("dm:1", "reply", 3)
    assert "code" not in line
    assert set(line) <= {"time", "level", "logger", "message", *FIELDS}
    bare = logging.LogRecord("trio", logging.WARNING, __file__, 1, "m", (), None)
    assert json.loads(_JsonLines().format(bare))["event"] == "log"
