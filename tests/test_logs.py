"""The log lines' fields (``runtime/_logs.py``; docs/design/operations.md "Logs" L2)."""

from __future__ import annotations

import io
import json
import logging
import threading

from hypothesis import given
from hypothesis import strategies as st

from runtime._cli._logging import LOG_QUEUE, OffloadedHandler, _JsonLines
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


class BlockedStream(io.StringIO):
    """A standard error nobody reads: every write waits until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.release.wait()
        return super().write(text)


def test_l3_a_blocked_standard_error_never_blocks_the_thread_that_logs() -> None:
    """L3: the line is formatted where it is logged and written by the handler's own thread;
    past the bound, lines are dropped and counted, and the count is said once it writes."""
    stream = BlockedStream()
    handler = OffloadedHandler(stream, logging.Formatter("%(message)s"))
    log = logging.getLogger("runtime.test.l3")
    log.addHandler(handler)
    log.propagate = False
    try:

        def burst() -> None:
            for i in range(LOG_QUEUE + 50):
                log.warning("line %d", i)

        logged = threading.Thread(target=burst)
        logged.start()
        logged.join(timeout=30)
        assert not logged.is_alive()  # never waited on the stream
    finally:
        log.removeHandler(handler)
        stream.release.set()
        handler.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "line 0"
    assert any(line.endswith("log lines dropped: standard error was not read fast enough")
               for line in lines)  # fmt: skip
    dropped = next(int(line.split()[0]) for line in lines if "dropped" in line)
    written = [line for line in lines if line.startswith("line ")]
    assert len(written) + dropped == LOG_QUEUE + 50
    assert written == sorted(written, key=lambda line: int(line.split()[1]))  # in order
