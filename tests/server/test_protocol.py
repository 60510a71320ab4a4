"""The wire protocol (runtime._server._protocol): frames, bad input, negotiation, the schema.

Pure and sync. Test names cite the invariants P1..P10 of docs/design/protocol.md.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from runtime._errors import DeliveryError, ProtocolError, ReasonCode
from runtime._records import Outcome
from runtime._rooms._admission import Author, Delivery, HistoryItem, parse_delivery
from runtime._server._protocol import (
    CLIENT_FRAME_TYPES,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Ack,
    AttachmentData,
    Cancel,
    ClientFrame,
    Deliver,
    ErrorFrame,
    FetchAttachment,
    Hello,
    RoomStatus,
    ServerFrame,
    StatusReport,
    StatusRequest,
    TaskAccepted,
    TaskControl,
    TaskEvent,
    TaskList,
    TaskReplyFrame,
    TaskShow,
    TaskSubmit,
    TaskViewFrame,
    Welcome,
    decode_client_frame,
    decode_server_frame,
    encode_client_frame,
    encode_server_frame,
    error_frame,
    negotiate,
    reject_binary_frame,
    schema_text,
)
from runtime._wire import (
    MAX_SEQ,
    Accepted,
    Attachment,
    DeliveryResult,
    TextUpdate,
    ToolActivity,
    Typing,
    fit_reply_text,
    room_for_text,
)

from .test_task_wire import TASK_VIEW

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "docs" / "protocol.schema.json"
PAGE = ROOT / "docs" / "design" / "protocol.md"

AUTHOR = Author(id="u1", name="Ada")
CLIENT_FRAMES: list[ClientFrame] = [
    Hello(protocol=1, token="t0ken", client="bridge/1.0"),
    Hello(protocol=[1, 2], token="t0ken", client="bridge/1.0", ack_seq=41),
    Deliver(delivery_id="d1", room="dm:42", author=AUTHOR, message_id="m1", text="hi"),
    Deliver(
        delivery_id="d2",
        room="guild:1:2",
        author=AUTHOR,
        message_id="m2",
        text="and now?",
        history=[HistoryItem(author=Author(id="u2"), message_id="m0", text="earlier")],
    ),
    Cancel(delivery_id="d1"),
    Ack(seq=7),
    StatusRequest(),
    StatusRequest(room="room:!abc:matrix.org"),
    TaskSubmit(task_id="t1", prompt="fix the build", worktree="/src/app"),
    TaskSubmit(
        task_id="t2", prompt="p", worktree="/w", grants=["read"], validation=["make", "test"]
    ),
    TaskReplyFrame(task_id="t1", text="the blue one"),
    TaskReplyFrame(task_id="t1", text="yes", correlation="t1/g1/a1/e1/c3"),
    TaskControl(task_id="t1", action="abort", reason="not needed"),
    TaskControl(task_id="t1", action="grant", epochs=1, seconds=600, reason="slow model"),
    TaskShow(),
    TaskShow(task_id="t1"),
    FetchAttachment(id="5f2c"),
]
SERVER_FRAMES: list[ServerFrame] = [
    Welcome(protocol=1, worker_id="w1"),
    Accepted(delivery_id="d1", room="dm:42", disposition="started"),
    Typing(room="dm:42", delivery_id="d1"),
    TextUpdate(room="dm:42", delivery_id="d1", reply_to="m1", text="looking"),
    ToolActivity(room="dm:42", delivery_id="d1", tool="bash", phase="start"),
    DeliveryResult(seq=8, delivery_id="d1", room="dm:42", outcome=Outcome.REPLY, text="hello"),
    DeliveryResult(seq=9, delivery_id="d3", room="dm:42", outcome=Outcome.FAILED, code="x"),
    DeliveryResult(
        seq=10, delivery_id="d4", room="dm:42", outcome=Outcome.ABSORBED, absorbed_into="d1"
    ),
    StatusReport(
        worker_id="w1",
        pending=1,
        rooms=[
            RoomStatus(room="dm:42", state="running", queued=0, live_worker=True, last_result_seq=8)
        ],
    ),
    ErrorFrame(code="unknown_type", message="...", ref="frob"),
    ErrorFrame(code="not_json", message="..."),
    TaskAccepted(task_id="t1", state="open"),
    TaskViewFrame.of(TASK_VIEW),
    TaskList(tasks=[TASK_VIEW]),
    TaskEvent(
        task_id="t1", state="open", classification="Suspect", phase="provider", process_epoch=1
    ),
    DeliveryResult(
        seq=11,
        delivery_id="d5",
        room="dm:42",
        outcome=Outcome.REPLY,
        text="the chart",
        attachments=[
            Attachment(id="5f2c", name="q3.png", media_type="image/png", size=79, sha256="5f2c"),
            Attachment(
                id="9a1e",
                name="old.png",
                media_type="image/png",
                size=12,
                sha256="9a1e",
                lost=True,
                code="attachment_missing",
            ),
        ],
    ),
    AttachmentData(id="5f2c", offset=0, size=79, data="iVBORw0K", last=True),
]


def _tag(frame_type: Any) -> str:
    return str(frame_type.__struct_config__.tag)


# -- P1: frames, tags, round trips ---------------------------------------------------------


@pytest.mark.parametrize("frame", CLIENT_FRAMES, ids=repr)
def test_p1_every_client_frame_round_trips(frame: ClientFrame) -> None:
    text = encode_client_frame(frame)
    assert json.loads(text)["type"] == _tag(type(frame))
    assert decode_client_frame(text) == frame
    assert decode_client_frame(text.encode()) == frame


@pytest.mark.parametrize("frame", SERVER_FRAMES, ids=repr)
def test_p1_every_server_frame_round_trips(frame: ServerFrame) -> None:
    text = encode_server_frame(frame)
    assert json.loads(text)["type"] == _tag(type(frame))
    assert decode_server_frame(text) == frame


def test_p1_the_tags_are_the_briefs() -> None:
    """The tag strings are stable: never renamed, never reused."""
    assert CLIENT_FRAME_TYPES == (
        "hello",
        "deliver",
        "cancel",
        "ack",
        "status",
        "task_submit",
        "task_reply",
        "task_control",
        "task_show",
        "fetch_attachment",
    )
    assert [_tag(t) for t in get_args(ServerFrame)] == [
        "welcome",
        "accepted",
        "typing",
        "text_update",
        "tool_activity",
        "result",
        "status",
        "error",
        "task_accepted",
        "task_view",
        "task_list",
        "task_event",
        "attachment_data",
    ]
    assert {type(f) for f in CLIENT_FRAMES} == set(get_args(ClientFrame))
    assert {type(f) for f in SERVER_FRAMES} == set(get_args(ServerFrame))


def _examples() -> list[tuple[str, str]]:
    """Every ```json block of the page, with the direction of the section it is in."""
    page = PAGE.read_text()
    client, server = page.split("## Server → client", 1)
    server = server.split("## Negotiation", 1)[0]
    blocks = re.compile(r"```json\n(.*?)```", re.DOTALL)
    return [("client", b) for b in blocks.findall(client)] + [
        ("server", b) for b in blocks.findall(server)
    ]


def test_p1_the_pages_examples_are_frames() -> None:
    examples = _examples()
    types: dict[str, set[str]] = {"client": set(), "server": set()}
    for direction, text in examples:
        frame = decode_client_frame(text) if direction == "client" else decode_server_frame(text)
        types[direction].add(_tag(type(frame)))
    assert types["client"] == set(CLIENT_FRAME_TYPES)
    assert types["server"] == {_tag(t) for t in get_args(ServerFrame)}


# -- P2: strict client frames, lenient server frames ------------------------------------------


def test_p2_clients_ignore_fields_they_do_not_know() -> None:
    text = '{"type":"welcome","protocol":1,"worker_id":"w1","region":"eu"}'
    assert decode_server_frame(text) == Welcome(protocol=1, worker_id="w1")


def test_p2_client_frames_refuse_fields_they_do_not_know() -> None:
    for frame in CLIENT_FRAMES:
        data = msgspec.to_builtins(frame) | {"extra": 1}
        with pytest.raises(ProtocolError) as caught:
            decode_client_frame(json.dumps(data))
        assert caught.value.code is ReasonCode.UNKNOWN_FIELD


# -- P3, P4: one stable code per bad frame, and what it answers -------------------------------

DELIVER = {
    "type": "deliver",
    "delivery_id": "d1",
    "room": "dm:42",
    "author": {"id": "u1", "name": "Ada"},
    "message_id": "m1",
    "text": "hi",
}


def _with(base: dict[str, Any], **changes: Any) -> str:
    return json.dumps({k: v for k, v in (base | changes).items() if v is not ...})


BAD_FRAMES = [
    # (data, code, ref, the message mentions)
    pytest.param("{", ReasonCode.NOT_JSON, None, "JSON", id="not_json-truncated"),
    pytest.param('{"type":"ack","seq":1} x', ReasonCode.NOT_JSON, None, "JSON", id="not_json-tail"),
    pytest.param(b"\xff\xfe{}", ReasonCode.NOT_JSON, None, "UTF-8", id="not_json-not_utf8"),
    pytest.param('{"type": 5, ', ReasonCode.NOT_JSON, None, "JSON", id="not_json-late"),
    pytest.param("", ReasonCode.NOT_JSON, None, "JSON", id="not_json-empty"),
    pytest.param("[1, 2]", ReasonCode.NOT_AN_OBJECT, None, "an array", id="not_an_object"),
    pytest.param('"hello"', ReasonCode.NOT_AN_OBJECT, None, "a string", id="not_an_object-str"),
    pytest.param("null", ReasonCode.NOT_AN_OBJECT, None, "null", id="not_an_object-null"),
    pytest.param("{}", ReasonCode.UNKNOWN_TYPE, None, "no `type`", id="unknown_type-missing"),
    pytest.param('{"type":"frob"}', ReasonCode.UNKNOWN_TYPE, "frob", '"frob"', id="unknown_type"),
    pytest.param('{"type":7}', ReasonCode.UNKNOWN_TYPE, None, "7", id="unknown_type-number"),
    pytest.param(
        '{"type":"result","seq":1}', ReasonCode.UNKNOWN_TYPE, "result", "result", id="server-tag"
    ),
    pytest.param(
        _with(DELIVER, text=...), ReasonCode.MISSING_FIELD, "d1", "`text`", id="missing_field"
    ),
    pytest.param(
        _with(DELIVER, author={"name": "Ada"}),
        ReasonCode.MISSING_FIELD,
        "d1",
        "`author.id`",
        id="missing_field-nested",
    ),
    pytest.param(
        '{"type":"hello","protocol":1,"client":"c"}',
        ReasonCode.MISSING_FIELD,
        "hello",
        "`token`",
        id="missing_field-hello",
    ),
    pytest.param(
        _with(DELIVER, colour="red"), ReasonCode.UNKNOWN_FIELD, "d1", "`colour`", id="unknown_field"
    ),
    pytest.param(
        _with(DELIVER, history=[{"author": {"id": "u2", "x": 1}, "text": "t"}]),
        ReasonCode.UNKNOWN_FIELD,
        "d1",
        "`history[0].author.x`",
        id="unknown_field-nested",
    ),
    pytest.param(
        _with(DELIVER, text=5), ReasonCode.WRONG_TYPE, "d1", "`text`: expected `str`, got `int`"
    ),
    pytest.param(
        _with(DELIVER, history=[{"author": {"id": "u2"}, "text": None}]),
        ReasonCode.WRONG_TYPE,
        "d1",
        "`history[0].text`",
        id="wrong_type-nested",
    ),
    pytest.param(
        '{"type":"ack","seq":-1}', ReasonCode.WRONG_TYPE, "ack", "`seq`: expected `int` >= 0"
    ),
    pytest.param('{"type":"ack","seq":"1"}', ReasonCode.WRONG_TYPE, "ack", "`seq`", id="seq-str"),
    pytest.param(
        '{"type":"hello","protocol":"1","token":"t","client":"c"}',
        ReasonCode.WRONG_TYPE,
        "hello",
        "`protocol`",
        id="wrong_type-protocol",
    ),
    pytest.param(
        '{"type":"cancel","delivery_id":7}', ReasonCode.WRONG_TYPE, "cancel", "`delivery_id`"
    ),
    pytest.param(
        '{"type":"hello","protocol":[2,3],"token":"t","client":"c"}',
        ReasonCode.UNSUPPORTED_PROTOCOL,
        "hello",
        "speaks protocol 1",
        id="unsupported_protocol",
    ),
]


@pytest.mark.parametrize(("data", "code", "ref", "mentions"), BAD_FRAMES)
def test_p3_p4_each_bad_frame_has_its_code(
    data: str | bytes, code: ReasonCode, ref: str | None, mentions: str
) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_client_frame(data)
    assert caught.value.code is code
    assert caught.value.ref == ref
    assert mentions in caught.value.message
    frame = error_frame(caught.value)
    assert frame == ErrorFrame(code=str(code), message=caught.value.message, ref=ref)


def test_p3_every_protocol_code_is_tested() -> None:
    tested = {p.values[1] for p in BAD_FRAMES} | {
        ReasonCode.FRAME_TOO_LARGE,  # P5
        ReasonCode.BINARY_FRAME,  # P6
    }
    documented = PAGE.read_text()
    for code in tested:
        assert f"`{code}`" in documented
    assert len(tested) == 9


def test_p4_an_unusable_delivery_id_is_not_a_ref() -> None:
    for bad in ["", "x" * 201, "a\nb"]:
        with pytest.raises(ProtocolError) as caught:
            decode_client_frame(_with(DELIVER, delivery_id=bad, text=...))
        assert caught.value.ref == "deliver"


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def _refusal(data: str | bytes) -> ProtocolError | None:
    """The error ``decode_client_frame`` raised, or ``None`` when it returned a frame."""
    try:
        decode_client_frame(data)
    except ProtocolError as error:
        return error
    return None


@given(data=st.text() | st.binary())
def test_p3_any_text_is_a_frame_or_a_protocol_error(data: str | bytes) -> None:
    error = _refusal(data)
    assert error is None or error.code in ReasonCode


@given(
    kind=st.sampled_from(CLIENT_FRAME_TYPES),
    fields=st.dictionaries(
        st.sampled_from(["protocol", "token", "client", "ack_seq", "seq", "room", "text"])
        | st.sampled_from(["delivery_id", "author", "message_id", "history", "x"]),
        JSON,
    ),
)
def test_p3_any_object_is_a_frame_or_a_protocol_error(kind: str, fields: dict[str, Any]) -> None:
    error = _refusal(json.dumps(fields | {"type": kind}))
    assert error is None or (error.code in ReasonCode and error.ref is not None)


# -- P5, P6: size and binary frames ---------------------------------------------------------


def test_p5_a_frame_too_large_is_refused_before_parsing() -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_client_frame("{" * (MAX_FRAME_BYTES + 1))
    assert caught.value.code is ReasonCode.FRAME_TOO_LARGE
    assert caught.value.ref is None
    assert str(MAX_FRAME_BYTES) in caught.value.message


def test_p5_the_bound_counts_utf8_bytes() -> None:
    text = _with(DELIVER, text="é" * 100)  # 100 characters, 200 bytes
    size = len(text.encode())
    assert isinstance(decode_client_frame(text, max_size=size), Deliver)
    with pytest.raises(ProtocolError) as caught:
        decode_client_frame(text, max_size=size - 1)
    assert caught.value.code is ReasonCode.FRAME_TOO_LARGE


def test_p6_a_binary_frame_is_refused() -> None:
    with pytest.raises(ProtocolError) as caught:
        reject_binary_frame(b'{"type":"ack","seq":1}')
    assert caught.value.code is ReasonCode.BINARY_FRAME
    assert error_frame(caught.value).code == "binary_frame"


# -- P7: negotiation -----------------------------------------------------------------------


def test_p7_the_server_picks_the_highest_common_version() -> None:
    assert PROTOCOL_VERSION == 1
    assert negotiate(1) == 1
    assert negotiate([1]) == 1
    assert negotiate([3, 1, 2], supported={1, 2}) == 2
    assert negotiate(2, supported={1, 2}) == 2


@pytest.mark.parametrize("offered", [0, 2, [], [2, 3], [0, -1]])
def test_p7_no_common_version_is_unsupported_protocol(offered: int | list[int]) -> None:
    with pytest.raises(ProtocolError) as caught:
        negotiate(offered)
    assert caught.value.code is ReasonCode.UNSUPPORTED_PROTOCOL
    assert caught.value.ref == "hello"
    hello = json.dumps({"type": "hello", "protocol": offered, "token": "t", "client": "c"})
    with pytest.raises(ProtocolError) as decoded:
        decode_client_frame(hello)
    assert decoded.value.code is ReasonCode.UNSUPPORTED_PROTOCOL


def test_p7_a_welcome_names_the_version_chosen() -> None:
    hello = decode_client_frame('{"type":"hello","protocol":[1,9],"token":"t","client":"c"}')
    assert isinstance(hello, Hello)
    welcome = Welcome(protocol=negotiate(hello.protocol), worker_id="w1")
    assert json.loads(encode_server_frame(welcome)) == {
        "type": "welcome",
        "protocol": 1,
        "worker_id": "w1",
    }


# -- P8: server frames are the runtime's own objects ----------------------------------------


def test_p8_the_runtimes_objects_are_server_frames() -> None:
    members = set(get_args(ServerFrame))
    assert {Accepted, DeliveryResult, Typing, TextUpdate, ToolActivity} <= members
    result = DeliveryResult(seq=3, delivery_id="d1", room="dm:42", outcome=Outcome.SILENT)
    assert json.loads(encode_server_frame(result)) == {
        "type": "result",
        "seq": 3,
        "delivery_id": "d1",
        "room": "dm:42",
        "outcome": "silent",
        "text": None,
        "code": None,
        "absorbed_into": None,
        "attachments": [],
        "truncated": False,
    }


# -- P9: a deliver frame is the delivery's shape; the worker checks its meaning -------------


def test_p9_deliver_has_the_fields_of_delivery() -> None:
    assert msgspec.structs.fields(Deliver) == msgspec.structs.fields(Delivery)
    assert not issubclass(Deliver, Delivery)


def test_p9_the_request_of_a_deliver_frame_parses_as_the_same_delivery() -> None:
    for frame in CLIENT_FRAMES:
        if isinstance(frame, Deliver):
            delivery = parse_delivery(frame.request())
            assert msgspec.structs.asdict(delivery) == msgspec.structs.asdict(frame)


def test_p9_meaning_is_refused_by_the_worker_with_the_delivery_as_ref() -> None:
    frame = decode_client_frame(_with(DELIVER, room="../etc"))
    assert isinstance(frame, Deliver)
    with pytest.raises(DeliveryError) as caught:
        parse_delivery(frame.request())
    answer = error_frame(caught.value, frame.delivery_id)
    assert (answer.code, answer.ref) == ("room_invalid", "d1")


# -- P10: the committed schema is the types' --------------------------------------------------


def test_p10_the_committed_schema_is_generated_from_the_types() -> None:
    assert SCHEMA.read_text() == schema_text(), (
        "docs/protocol.schema.json is out of date with runtime/_server/_protocol.py; regenerate it:"
        " .venv/bin/python -m runtime._server._protocol --schema > docs/protocol.schema.json"
    )


def test_p10_the_schema_entry_point_prints_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "runtime._server._protocol", "--schema"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    )
    assert done.stdout.decode() == schema_text()
    assert json.loads(done.stdout)["$defs"]["ClientFrame"]["discriminator"]["propertyName"] == (
        "type"
    )


# -- P14: a result frame fits max_frame_bytes ------------------------------------------------


def _worst(attachments: list[Attachment], **fields: Any) -> DeliveryResult:
    """A reply's result frame at its largest for a text: the largest seq, every attachment
    lost with the longest code (as the server may send it again later)."""
    longest = max((str(code) for code in ReasonCode), key=len)
    lost = [msgspec.structs.replace(a, lost=True, code=longest) for a in attachments]
    return DeliveryResult(
        seq=MAX_SEQ, delivery_id="d1", room="dm:42", outcome=Outcome.REPLY, attachments=lost,
        **fields,
    )  # fmt: skip


def _size(frame: DeliveryResult) -> int:
    return len(encode_server_frame(frame).encode())


@given(
    text=st.text(min_size=1, max_size=400),
    bound=st.integers(min_value=200, max_value=2_000),
    named=st.lists(st.text(min_size=1, max_size=20), max_size=3),
)
def test_p14_a_fitted_reply_is_the_longest_beginning_a_frame_carries(
    text: str, bound: int, named: list[str]
) -> None:
    """P14: the fitted text is a beginning of the reply; its frame, at its largest, is within
    the bound; cut only when the whole would not fit, and then one more character would not."""
    attachments = [
        Attachment(id="a" * 64, name=name, media_type="image/png", size=9, sha256="a" * 64)
        for name in named
    ]
    room = room_for_text(
        delivery_id="d1", room="dm:42", attachments=attachments, max_frame_bytes=bound
    )
    assume(room >= 0)
    fitted, cut = fit_reply_text(text, room)
    assert text.startswith(fitted)
    assert cut is (fitted != text)
    assert _size(_worst(attachments, text=fitted, truncated=True)) <= bound
    if cut:
        longer = text[: len(fitted) + 1]
        assert _size(_worst(attachments, text=longer, truncated=True)) > bound


@pytest.mark.parametrize(
    "unit", ["a", "é", "\U0001f600", "\x01", '"', "a\x01é\U0001f600\\"], ids=repr
)
def test_p14_a_long_reply_is_cut_to_the_frame_in_any_characters(unit: str) -> None:
    """P14: a reply of up to six bytes per character on the wire (a control character
    escaped) is cut to fit 256 KiB with sixteen attachments, and no more than it must."""
    bound = 256 * 1024
    picture = Attachment(
        id="f" * 64, name="pic.png", media_type="image/png", size=1, sha256="f" * 64
    )
    attachments = [picture] * 16
    text = unit * (300_000 // len(unit))
    room = room_for_text(
        delivery_id="d1", room="dm:42", attachments=attachments, max_frame_bytes=bound
    )
    fitted, cut = fit_reply_text(text, room)
    assert cut
    assert text.startswith(fitted)
    assert bound - len(unit) * 6 < _size(_worst(attachments, text=fitted, truncated=True)) <= bound
    assert fit_reply_text(fitted, room) == (fitted, False)


def test_p14_a_reply_that_fits_is_left_whole() -> None:
    assert fit_reply_text("hello", 5) == ("hello", False)
    assert fit_reply_text("hello", 4) == ("hell", True)
    assert fit_reply_text("\x01", 5) == ("", True)  # "\u0001": six bytes
