"""JSON nested deeper than msgspec and the stdlib recurse, as Pi writes it for a model's tool
arguments (docs/design/sessions.md S3, S9, S12; docs/design/rpc.md R10;
docs/design/pi-observed.md §11).

JavaScript's ``JSON.parse`` does not recurse, and Pi 1.6.0 writes a session line (and RPC
events) for tool arguments nested a few thousand levels deep. The lines below are shaped as
the real Pi wrote them for a ``bash`` call whose ``x`` nested 2,000 arrays deep
(``tests/boundary/test_deep_json.py`` runs the real Pi to that point).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import given, settings

from runtime._pi._pijson import MAX_DEPTH, loads, nesting, stringify
from runtime._pi._rpc_protocol import MALFORMED_LINE, ProtocolState
from runtime._pi._session import SessionIssueKind, attest, contains_path, parse_session
from runtime._pi._session_files import read_session
from runtime._pi._session_settle import (
    SettledResult,
    dangling_tool_calls,
    prepare_for_relaunch,
)

DEPTH: Final = 2_000
DEEP_X: Final = b"[" * DEPTH + b"]" * DEPTH

HEADER: Final = (
    b'{"type":"session","version":3,"id":"01a24dde-13e5-7715-ac06-ddac75f2fe9e",'
    b'"timestamp":"2026-12-07T00:18:49.445Z","cwd":"/work"}'
)
MODEL: Final = (
    b'{"type":"model_change","id":"348b892d","parentId":null,'
    b'"timestamp":"2026-12-07T00:18:49.445Z","provider":"fake","modelId":"fake-model"}'
)
USER: Final = (
    b'{"type":"message","id":"df5dab31","parentId":"348b892d",'
    b'"timestamp":"2026-12-07T00:18:50.071Z","message":{"role":"user","content":'
    b'[{"type":"text","text":"go"}],"timestamp":1796602730065}}'
)
USAGE: Final = (
    b'"usage":{"input":0,"output":0,"cacheRead":0,"cacheWrite":0,"totalTokens":0,'
    b'"cost":{"input":0,"output":0,"cacheRead":0,"cacheWrite":0,"total":0}}'
)
ASSISTANT: Final = (
    b'{"type":"message","id":"0d3c893f","parentId":"df5dab31",'
    b'"timestamp":"2026-12-07T00:18:50.139Z","message":{"role":"assistant","content":'
    b'[{"type":"toolCall","id":"c1","name":"bash","arguments":{"command":"echo hi","x":'
    + DEEP_X
    + b'}},{"type":"toolCall","id":"c2","name":"read","arguments":{"path":"a.txt"}}],'
    b'"api":"openai-completions","provider":"fake","model":"fake-model",'
    + USAGE
    + b',"stopReason":"toolUse","timestamp":1796602730098,"responseId":"x",'
    b'"rawStopReason":"tool_calls","durationMs":34,"thinkingLevel":"off"}}'
)
RESULT_C1: Final = (
    b'{"type":"message","id":"563180c7","parentId":"0d3c893f",'
    b'"timestamp":"2026-12-07T00:18:50.157Z","message":{"role":"toolResult",'
    b'"toolCallId":"c1","toolName":"bash","content":[{"type":"text","text":"refused"}],'
    b'"details":{},"isError":true,"durationMs":10,"timestamp":1796602730157}}'
)
RESULT_C2: Final = (
    b'{"type":"message","id":"6a1f0c2e","parentId":"563180c7",'
    b'"timestamp":"2026-12-07T00:18:50.160Z","message":{"role":"toolResult",'
    b'"toolCallId":"c2","toolName":"read","content":[{"type":"text","text":"a"}],'
    b'"isError":false,"timestamp":1796602730160}}'
)
FINAL: Final = (
    b'{"type":"message","id":"f0fb05b0","parentId":"6a1f0c2e",'
    b'"timestamp":"2026-12-07T00:18:50.174Z","message":{"role":"assistant","content":'
    b'[{"type":"text","text":"done"}],"api":"openai-completions","provider":"fake",'
    b'"model":"fake-model",'
    + USAGE
    + b',"stopReason":"stop","timestamp":1796602730165,"responseId":"x",'
    b'"rawStopReason":"stop","durationMs":9,"thinkingLevel":"off"}}'
)


class FixedClock:
    def time_ms(self) -> int:
        return 1_796_602_731_000


def session_bytes(*lines: bytes) -> bytes:
    return b"".join(line + b"\n" for line in (HEADER, *lines))


def unwrap(value: Any, levels: int) -> Any:
    for _ in range(levels):
        assert isinstance(value, list)
        assert len(value) == 1
        value = value[0]
    return value


# ------------------------------------------------------------------------------ loads


def test_s3_loads_reads_pi_depth_exactly_and_refuses_beyond_max_depth() -> None:
    """JSON nested deeper than msgspec recurses (here 2,000 and then :data:`MAX_DEPTH`
    levels) decodes to the same nesting, keys in file order; one level more is a
    ``DecodeError`` — never a ``RecursionError``. Before, anything past about a thousand
    levels was refused, the line Pi wrote for such tool arguments included."""
    data = b'{"z":1,"k":' + DEEP_X + b',"2":"\\ud800","a":[1.5,-0,1e2]}'
    value = loads(data)
    assert list(value) == ["z", "k", "2", "a"]
    assert unwrap(value["k"], DEPTH - 1) == []
    assert value["2"] == "\ud800"
    assert repr(value["a"]) == "[1.5, 0, 100.0]"
    assert nesting(value) == DEPTH + 1
    at_bound = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert nesting(loads(at_bound)) == MAX_DEPTH
    with pytest.raises(msgspec.DecodeError, match="nested deeper than"):
        loads(b"[" + at_bound + b"]")
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
        loads(data, deep=False)


def test_s2_a_value_nested_deeper_than_python_recurses_is_refused_as_a_value_error() -> None:
    """S2: ``stringify`` refuses what it cannot write with ``ValueError``, as its contract
    says (``new_entry`` turns that into ``session_entry_invalid``); before, a value read
    2,000 levels deep let a ``RecursionError`` out. The runtime writes no such line."""
    value: list[Any] = []
    for _ in range(DEPTH):
        value = [value]
    with pytest.raises(ValueError, match="nested too deeply for this encoder"):
        stringify({"type": "custom", "data": value})


WRAP: Final = 4_000
"""Deeper than msgspec and the stdlib recurse, also under Hypothesis (which raises the limit)."""

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    | st.sampled_from(["\ud800", "a\udfffb", "\u2028", "\x7f"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(value=JSON_VALUES, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]))
def test_s3_deep_json_reads_exactly_as_shallow_json(
    value: Any, ascii_only: bool, indent: int | None
) -> None:
    """The iterative reader and msgspec (or the stdlib, for lone surrogates) give the same
    value — types, key order, float bits — for any JSON, here wrapped 4,000 arrays deep so
    that only the iterative reader can read it."""
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    try:
        data = text.encode()
    except UnicodeEncodeError:  # a lone surrogate, written raw: not UTF-8
        data = json.dumps(value, indent=indent).encode()
    shallow = loads(data)
    wrapped = b"[" * WRAP + data + b"\n]" * WRAP
    with pytest.raises(RecursionError):  # (Hypothesis raises the limit to about 2,000)
        msgspec.json.decode(wrapped)
    assert repr(unwrap(loads(wrapped), WRAP)) == repr(shallow)


@pytest.mark.parametrize(
    "bad",
    [b" ,", b"[1,]", b'{"a":1,}', b"[1 2]", b"01", b"1.", b".5", b"+1", b"-", b"tru", b"NaN",
     b"-Infinity", b'"a\x01"', b'"\\x"', b'{"a"}', b"{1:2}", b"[", b"1 2", b"[]]", b'"\xff"',
     b'{"a":1}}', b"[,1]", b"\xef\xbb\xbf1", b'{"a":1 "b":2}'],
)  # fmt: skip
def test_s3_deep_json_refuses_what_shallow_json_refuses(bad: bytes) -> None:
    """Anything msgspec and the stdlib refuse is refused as deep, as a ``DecodeError``."""
    with pytest.raises(msgspec.DecodeError):
        loads(bad)
    with pytest.raises(msgspec.DecodeError):
        loads(b"[" * WRAP + bad + b"]" * WRAP)


def test_r10_an_event_line_pi_wrote_for_deep_arguments_is_an_event() -> None:
    """R10: the ``tool_execution_start`` Pi prints for such a call is the event it is, not an
    ``rpc_malformed_line``; a line deeper than :data:`MAX_DEPTH` still is one."""
    state = ProtocolState()
    line = b'{"type":"tool_execution_start","toolCallId":"c1","toolName":"bash","args":'
    event = state.receive(line + b'{"command":"echo hi","x":' + DEEP_X + b"}}").event
    assert event is not None
    assert event.type == "tool_execution_start"
    assert event.record["args"]["command"] == "echo hi"
    beyond = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    malformed = state.receive(line + b"{" + b'"x":' + beyond + b"}}").event
    assert malformed is not None
    assert malformed.type == MALFORMED_LINE
    assert state.malformed == 1


# ---------------------------------------------------------------------------- sessions


def test_s3_s4_s5_the_line_pi_wrote_for_deep_arguments_is_an_entry_of_the_tree() -> None:
    """S3, S4, S5: the assistant line holding the deep call is an entry, not ``bad_json``;
    the results below it are not ``unknown_parent``; the path from the leaf runs to the root.
    Before, the line was ``bad_json``, its children's parent unknown, and the path from the
    leaf stopped at the first result: the turn's call and everything above it were gone."""
    data = session_bytes(MODEL, USER, ASSISTANT, RESULT_C1, RESULT_C2, FINAL)
    read = parse_session(data)
    assert read.issues == ()
    session = read.session
    assert session.leaf is not None
    assert session.leaf.id == "f0fb05b0"
    path = [e.id for e in session.path_to_root()]
    assert path == ["348b892d", "df5dab31", "0d3c893f", "563180c7", "6a1f0c2e", "f0fb05b0"]
    assert session.get("0d3c893f").raw_line == ASSISTANT
    assert session.to_bytes() == data


def test_s12_a_dead_workers_deep_call_is_dangling_from_its_own_message() -> None:
    """S12: the worker died after Pi wrote the assistant message (and the first result):
    the call still dangling is found in that message. Before, the message was unreadable,
    the session's leaf the first result (whose parent was unknown) or the user's prompt, and
    no call dangled: the runtime settled nothing, and Pi's relaunch sent the model its
    synthetic "No result provided" for the call the gate had let run."""
    only_call = parse_session(session_bytes(MODEL, USER, ASSISTANT)).session
    assert only_call.leaf is not None
    assert only_call.leaf.id == "0d3c893f"
    calls = dangling_tool_calls(only_call)
    assert [(c.tool_call_id, c.name, c.assistant_entry_id) for c in calls] == [
        ("c1", "bash", "0d3c893f"),
        ("c2", "read", "0d3c893f"),
    ]
    assert calls[0].arguments["command"] == "echo hi"
    assert nesting(calls[0].arguments) == DEPTH + 1
    after_first = parse_session(session_bytes(MODEL, USER, ASSISTANT, RESULT_C1)).session
    assert [c.tool_call_id for c in dangling_tool_calls(after_first)] == ["c2"]


def test_s13_settling_a_deep_call_answers_it_under_its_message(tmp_path: Path) -> None:
    """S13: ``prepare_for_relaunch`` answers the dangling call below the message that holds
    it, the deep line kept byte for byte."""
    path = tmp_path / "s.jsonl"
    path.write_bytes(session_bytes(MODEL, USER, ASSISTANT, RESULT_C1))
    answer = SettledResult([{"type": "text", "text": "possibly ran"}], is_error=True)
    report = prepare_for_relaunch(path, {"c2": answer}, clock=FixedClock())
    assert [c.tool_call_id for c in report.settled] == ["c2"]
    read = read_session(path)
    assert read.issues == ()
    assert [e.id for e in read.session.path_to_root()][2:4] == ["0d3c893f", "563180c7"]
    leaf = read.session.leaf
    assert leaf is not None
    assert leaf.parent_id == "563180c7"
    assert leaf.raw["message"]["toolCallId"] == "c2"
    assert dangling_tool_calls(read.session) == ()
    assert path.read_bytes().startswith(session_bytes(MODEL, USER, ASSISTANT, RESULT_C1))


def test_s9_a_path_attested_before_a_deep_turn_is_still_contained_after_it() -> None:
    """S9: an attestation taken before the turn (a task lane's, TL4) is contained in the
    session after it. Before, the path from the new leaf stopped below the unreadable line,
    the attested leaf was not on it, and the task's next replacement was held
    ``session_attestation_mismatch`` for good."""
    before = parse_session(session_bytes(MODEL, USER)).session
    attested = attest(before)
    after = parse_session(session_bytes(MODEL, USER, ASSISTANT, RESULT_C1, RESULT_C2, FINAL))
    assert after.issues == ()
    assert contains_path(after.session, attested)
    assert attest(after.session).count == 6


def test_s3_a_line_deeper_than_max_depth_is_still_bad_json() -> None:
    """S3: past :data:`MAX_DEPTH` (deeper than Pi can write) the line is ``bad_json``, and
    the reader is not harmed."""
    beyond = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    line = ASSISTANT.replace(DEEP_X, beyond)
    read = parse_session(session_bytes(MODEL, USER, line))
    assert [(i.kind, i.line) for i in read.issues] == [(SessionIssueKind.BAD_JSON, 4)]
