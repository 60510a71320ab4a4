"""A fault stays where it happened (docs/design/protocol.md P17-P19), against a real server on
127.0.0.1 with real websocket clients and a real Fake-Pi worker.

* A result the server fails to prepare for sending, and cannot send even as its record's words
  (its attachment check and its fitting raise), goes out marked ``failed`` / ``server_fault``,
  logged once, and the results after it follow: before, the exception ended the connection,
  and since the same unacknowledged result came first again at every reconnect, that client
  never received another result (P17; the rung above it, the words, in
  ``test_serve_unsendable.py``, P21).
* The task frames' numbers are bounded where they are decoded: out of range is ``wrong_type``
  naming the field, whatever the task's state, never taken and ignored (P18).
* What a client names itself in its ``hello`` is logged short, and its token never (P19).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi.scenario import Text
from runtime._errors import ReasonCode
from runtime._journal._attachments import AttachmentStore
from runtime._server import _serve
from runtime._server._protocol import MAX_VALIDATION_TIMEOUT, TaskControl, decode_client_frame
from runtime._tasks._guards import MAX_GRANT_EPOCHS, MAX_GRANT_SECONDS
from runtime._tasks._state import MAX_VALIDATION_TIMEOUT as TASKS_MAX_VALIDATION_TIMEOUT
from runtime._wire import DeliveryResult, fit_result

from .._wire import message
from .test_serve import LIMIT, error, rig, still_usable
from .test_serve_attachments import ROOM, SETTINGS, steps


@dataclass(frozen=True, slots=True)
class _CheckRaises(AttachmentStore):
    """The server's attachment store whose check (A7) fails unexpectedly: no identity is
    known, so every attachment is checked, and every check raises."""

    def unchanged(self, sha256: str, size: int) -> bool:
        return False

    def check(self, sha256: str, size: int) -> None:
        raise RuntimeError("injected: the attachment check failed")


@dataclass(frozen=True, slots=True)
class _CheckLost(AttachmentStore):
    """The server's attachment store whose every attachment is found missing (A7)."""

    def unchanged(self, sha256: str, size: int) -> bool:
        return False

    def check(self, sha256: str, size: int) -> ReasonCode | None:
        return ReasonCode.ATTACHMENT_MISSING


def _events(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if getattr(record, "event", None) == event]


async def test_p17_a_result_that_cannot_be_prepared_is_sent_marked_and_the_next_ones_follow(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P17, P21's last rung: the reply with a picture whose check raises, and whose frame
    cannot be fitted either (so not even its words can go out, P21), comes as ``failed``
    with ``server_fault``, its seq and ids, no text, no attachments; the next delivery's
    result follows on the same connection, and the connection stays usable; a duplicate of
    the first delivery gets the same marked result; a client that reconnects without
    acknowledging gets both again, the same, in order; the fault is logged once with its
    traceback (both faults), not at every send. Before, the connection closed at the first
    result and at every reconnect."""

    def fit_raises(result: DeliveryResult, max_frame_bytes: int) -> DeliveryResult:
        if result.delivery_id == "d1":
            raise RuntimeError("injected: fitting the frame failed")
        return fit_result(result, max_frame_bytes)

    monkeypatch.setattr(_serve, "fit_result", fit_raises)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SETTINGS, [*steps(), Text(text="after")]) as r:
            r.server.attachments = _CheckRaises(r.server.attachments.root)
            async with r.connect() as client:
                await client.send(message("d1", room=ROOM))
                first = await client.result("d1")
                await client.send(message("d2", room=ROOM))
                second = await client.result("d2")
                await client.send(message("d1", room=ROOM))  # a duplicate: its result again
                accepted = await client.until(lambda f: f["type"] == "accepted")
                duplicate = await client.result("d1")
                await still_usable(client)
            async with r.connect() as client:  # not acknowledged: both again, in seq order
                again = [await client.until(lambda f: f["type"] == "result") for _ in range(2)]
    assert first == {
        "type": "result",
        "seq": first["seq"],
        "delivery_id": "d1",
        "room": ROOM,
        "outcome": "failed",
        "text": None,
        "code": "server_fault",
        "absorbed_into": None,
        "attachments": [],
        "truncated": False,
    }
    assert (second["outcome"], second["text"], second["seq"]) == (
        "reply",
        "after",
        first["seq"] + 1,
    )
    assert accepted["disposition"] == "duplicate"
    assert duplicate == first
    assert again == [first, second]
    (logged,) = _events(caplog, "result_unsendable")
    assert logged.levelno == logging.ERROR
    assert logged.exc_info is not None
    fault = logged.exc_info[1]
    assert "injected: fitting the frame failed" in str(fault)
    assert fault is not None
    assert "injected: the attachment check failed" in str(fault.__context__)
    assert "as failed (server_fault)" in logged.getMessage()
    assert getattr(logged, "seq", None) == first["seq"]
    assert _events(caplog, "connection_failed") == []


async def test_p19_a_hellos_client_name_is_logged_short_and_its_token_never(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """P19: a ``hello`` whose ``client`` is 200,000 characters (a line feed among them) is
    welcomed; the log line that says so shows its first 80 characters escaped and its length,
    about 200 characters in all — before, the whole name, 200 KB in one line. No log line
    holds the token."""
    caplog.set_level(logging.DEBUG)
    name = "bridge/1.0\n" + "x" * 199_989
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect(hello=False) as client:
            token = r.token
            await client.send({"type": "hello", "protocol": 1, "token": token, "client": name})
            assert (await client.receive())["type"] == "welcome"
            await still_usable(client)
    (opened,) = _events(caplog, "connection_opened")
    line = opened.getMessage()
    assert len(line) < 300, len(line)
    assert "'bridge/1.0\\nxxx" in line
    assert "200000 characters" in line
    assert "\n" not in line
    assert all(token not in record.getMessage() for record in caplog.records)


OUT_OF_RANGE: Final[list[tuple[str, dict[str, Any], str]]] = [
    # (what, the frame's fields, the field named)
    ("grant seconds 1e308", {"action": "grant", "seconds": 1e308, "reason": "r"}, "seconds"),
    (
        "grant seconds over a day",
        {"action": "grant", "seconds": 86_400.5, "reason": "r"},
        "seconds",
    ),
    ("grant seconds negative", {"action": "grant", "seconds": -1, "reason": "r"}, "seconds"),
    ("grant epochs 101", {"action": "grant", "epochs": 101, "reason": "r"}, "epochs"),
    ("grant epochs 10**30", {"action": "grant", "epochs": 10**30, "reason": "r"}, "epochs"),
    ("abort seconds 1e308", {"action": "abort", "seconds": 1e308}, "seconds"),
    ("submit validation_timeout -1", {"validation_timeout": -1}, "validation_timeout"),
    ("submit validation_timeout 0", {"validation_timeout": 0}, "validation_timeout"),
    ("submit validation_timeout 1e308", {"validation_timeout": 1e308}, "validation_timeout"),
]


async def test_p18_task_frames_numbers_out_of_range_are_wrong_type_naming_the_field(
    tmp_path: Path,
) -> None:
    """P18: each number of a task frame out of its range is refused ``wrong_type`` with
    ``ref`` = the task id and the field and its bound named, before the task is looked up
    (no task of that id exists: before, most were ``task_unknown``, the submissions
    ``task_invalid``, and ``abort`` with ``seconds: 1e308`` was taken, the number ignored);
    a number no float holds is ``wrong_type`` and NaN or Infinity, not JSON, ``not_json``
    (P4); the connection stays usable."""
    worktree = tmp_path / "worktree"
    worktree.mkdir()
    got: dict[str, tuple[Any, Any, bool]] = {}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path / "host") as r, r.connect() as client:
            for what, extra, field in OUT_OF_RANGE:
                kind = "task_control" if "action" in extra else "task_submit"
                frame = {"type": kind, "task_id": "t-none", **extra}
                if kind == "task_submit":
                    frame |= {"prompt": "p", "worktree": str(worktree)}
                await client.send(json.dumps(frame))
                answer = await client.until(
                    lambda f: f["type"] in ("error", "task_view", "task_accepted")
                )
                code, ref = answer.get("code", answer["type"]), answer.get("ref")
                got[what] = (code, ref, f"field `{field}`" in answer.get("message", ""))
            for what, text in (
                ("seconds 1e400", '"seconds": 1e400'),
                ("seconds NaN", '"seconds": NaN'),
                ("seconds Infinity", '"seconds": Infinity'),
            ):
                await client.send(
                    '{"type": "task_control", "task_id": "t-none", "action": "grant", '
                    f'"reason": "r", {text}}}'
                )
                answer = await client.receive()
                got[what] = (*error(answer), True)
            await still_usable(client)
    assert got == {
        **{what: ("wrong_type", "t-none", True) for what, _, _ in OUT_OF_RANGE},
        "seconds 1e400": ("wrong_type", "t-none", True),
        "seconds NaN": ("not_json", None, True),
        "seconds Infinity": ("not_json", None, True),
    }


def test_p18_the_protocols_bounds_are_the_task_lanes_and_admit_their_largest() -> None:
    """P18: the bounds the frames are decoded with are the ones the task lanes check (a grant,
    WD11; a validation timeout, TL1), so a value at the bound is decoded, not refused."""
    assert MAX_VALIDATION_TIMEOUT == TASKS_MAX_VALIDATION_TIMEOUT
    control = decode_client_frame(
        json.dumps(
            {
                "type": "task_control",
                "task_id": "t",
                "action": "grant",
                "reason": "r",
                "epochs": MAX_GRANT_EPOCHS,
                "seconds": MAX_GRANT_SECONDS,
            }
        )
    )
    assert isinstance(control, TaskControl)
    assert (control.epochs, control.seconds) == (MAX_GRANT_EPOCHS, MAX_GRANT_SECONDS)
    submit = decode_client_frame(
        json.dumps(
            {
                "type": "task_submit",
                "task_id": "t",
                "prompt": "p",
                "worktree": "/",
                "validation_timeout": MAX_VALIDATION_TIMEOUT,
            }
        )
    )
    assert getattr(submit, "validation_timeout", None) == MAX_VALIDATION_TIMEOUT


async def test_p20_a_lost_attachment_is_logged_once_however_often_its_result_is_sent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """P20: a result whose picture is lost is sent marked at every send (A7) — to its
    delivery, to a duplicate, to a client that reconnects without acknowledging — and the
    loss is logged once. Before, every re-send logged it again: a client reconnecting in a
    loop filled the log."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SETTINGS, steps()) as r:
            r.server.attachments = _CheckLost(r.server.attachments.root)
            async with r.connect() as client:
                await client.send(message("d1", room=ROOM))
                first = await client.result("d1")
                await client.send(message("d1", room=ROOM))  # a duplicate: its result again
                duplicate = await client.result("d1")
            for _ in range(2):  # not acknowledged: sent again at each reconnect
                async with r.connect() as client:
                    again = await client.until(lambda f: f["type"] == "result")
                    assert again == first
    assert duplicate == first
    assert [a["lost"] for a in first["attachments"]] == [True]
    (logged,) = _events(caplog, "attachment_lost")
    assert getattr(logged, "seq", None) == first["seq"]
