"""Pi session files (runtime._pi._session). Test names cite invariants S1..S11 of
docs/design/sessions.md; the samples are real Pi 1.6.0 output, recorded into the repository
(tests/data/pi-1.6.0/, see its README.md). Entry ids and line numbers come from the samples
themselves or from the recorder's ``facts.json``, never from a particular recording."""

from __future__ import annotations

import errno
import itertools
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import msgspec
import pytest
import trio
from hypothesis import given, settings

from runtime._clock import MockWallClock, SystemWallClock
from runtime._errors import ReasonCode, SessionError
from runtime._pi import _session
from runtime._pi._session import (
    Attestation,
    Session,
    SessionIssueKind,
    attest,
    contains_path,
    encode_entry,
    parse_session,
    uuid7,
    verify_attestation,
)
from runtime._pi._session_files import (
    SessionWriter,
    aappend_entry,
    acreate_session,
    afsync,
    append_entry,
    aread_session,
    atruncate_torn_tail,
    create_session,
    open_session_writer,
    read_session,
    truncate_torn_tail,
)
from runtime._pi._session_settle import dangling_tool_calls

from .._samples import FACTS, PI_VERSION, SAMPLES, SESSION_NAMES, facts
from .._samples import session_sample as sample

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
UUID7 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
HEX8 = re.compile(r"^[0-9a-f]{8}$")


@dataclass
class StepClock:
    """A wall clock for sync tests: each reading is one millisecond later."""

    now: int = 1_795_978_317_155

    def time_ms(self) -> int:
        self.now += 1
        return self.now


def new_session(path: Path) -> Session:
    return create_session(
        path, cwd="/work/lane", provider="fake", model_id="fake-model", clock=StepClock()
    )


def copy_sample(name: str, tmp_path: Path) -> Path:
    target = tmp_path / f"{name}.jsonl"
    target.write_bytes(sample(name).read_bytes())
    return target


def sample_lines(name: str) -> list[bytes]:
    return sample(name).read_bytes().splitlines()


def not_written_by_pi() -> set[tuple[str, int]]:
    """The recorder appended one line to ``branched`` with Python's json.dumps (", " and ": "
    separators), as another program would: the one line Pi did not write (pi-observed.md §8
    "Branching (a)"; facts.json names it)."""
    return {("branched", facts().injected_line.line)}


def test_samples_directory_is_present() -> None:
    """The samples are the ground truth; missing samples must fail, not skip."""
    assert SAMPLES.is_dir(), f"missing Pi samples at {SAMPLES}"
    assert {p.name for p in SAMPLES.glob("session_*.jsonl")} == {
        f"session_{name}.jsonl" for name in SESSION_NAMES
    }
    assert FACTS.is_file(), f"missing the recorder's facts at {FACTS}"
    assert facts().pi_version == PI_VERSION


# --------------------------------------------------------------------------- S1, S2


@pytest.mark.parametrize("name", SESSION_NAMES)
def test_s1_sample_round_trips_byte_identical(name: str) -> None:
    data = sample(name).read_bytes()
    result = read_session(sample(name))
    assert result.issues == ()
    assert not result.unterminated
    assert result.torn_tail is None
    assert result.session.to_bytes() == data
    assert parse_session(result.session.to_bytes()).session.to_bytes() == data


@pytest.mark.parametrize("name", SESSION_NAMES)
def test_s2_encoder_reproduces_every_line_pi_wrote(name: str) -> None:
    """encode_entry(decoded line) == the line, for every line Pi wrote itself."""
    session = read_session(sample(name)).session
    foreign = not_written_by_pi()
    assert encode_entry(session.header) == session.header_line
    for entry in session.entries:
        same = encode_entry(entry.raw) == entry.raw_line
        assert same is ((name, entry.line) not in foreign), entry.line


# ----------------------------------------------------------------------- S4, S5, S8


@pytest.mark.parametrize("name", SESSION_NAMES)
def test_s5_leaf_is_the_last_line(name: str) -> None:
    lines = sample_lines(name)
    session = read_session(sample(name)).session
    assert session.leaf is not None
    assert session.leaf.line == len(lines)
    assert session.leaf.raw_line == lines[-1]
    assert session.leaf.id == msgspec.json.decode(lines[-1])["id"]


def test_s4_path_to_root_is_root_first() -> None:
    """``basic`` is one chain: its path runs over every entry line, in file order."""
    session = read_session(sample("basic")).session
    path = session.path_to_root()
    assert [e.line for e in path] == list(range(2, len(sample_lines("basic")) + 1))
    assert path[0].type == "model_change"
    assert path[0].parent_id is None
    assert all(child.parent_id == parent.id for parent, child in itertools.pairwise(path))
    assert session.path_to_root(path[3].id) == path[:4]
    assert session.children(None) == (path[0],)
    with pytest.raises(SessionError) as info:
        session.path_to_root("nope")
    assert info.value.code is ReasonCode.SESSION_ENTRY_UNKNOWN


def test_s5_branched_sample_path_skips_the_abandoned_branch() -> None:
    """pi-observed.md §8 (a): the line appended under the first answer leads the path Pi uses. Pi
    reopened the file with that line as its leaf and wrote the branch's prompt and answer
    below it; the entries between the branch point and that line are left behind."""
    injected = facts().injected_line
    session = read_session(sample("branched")).session
    marker = session.by_id[injected.id]
    assert (marker.line, marker.parent_id, marker.type) == (
        injected.line,
        injected.parent_id,
        "custom",
    )
    assert injected.leaf_at_reopen == injected.id  # Pi's own leaf: the appended line
    point = session.by_id[injected.parent_id]
    first_answer = next(e for e in session.entries if e.role == "assistant")
    assert point == first_answer
    assert point.parent_id is not None
    assert session.by_id[point.parent_id].role == "user"
    abandoned = [e.id for e in session.entries if point.line < e.line < marker.line]
    branch = [e for e in session.entries if e.line > marker.line]
    assert [e.role for e in branch] == ["user", "assistant"]
    ids = [e.id for e in session.path_to_root()]
    assert ids == [
        *(e.id for e in session.path_to_root(point.id)),
        marker.id,
        *(e.id for e in branch),
    ]
    assert len(abandoned) == 4  # the killed prompt, its dangling call, the restart's turn
    assert not set(abandoned) & set(ids)
    assert [e.id for e in session.children(point.id)] == [abandoned[0], marker.id]


def test_s5_branch_at_an_earlier_entry_becomes_the_leaf(tmp_path: Path) -> None:
    path = copy_sample("basic", tmp_path)
    before = read_session(path).session
    fork_point = before.entries[4]  # the first assistant reply
    built = before.branch_at(fork_point.id, {"type": "custom", "data": {}}, time_ms=1)
    assert built.parent_id == fork_point.id
    assert built.line == before.line_count + 1
    with SessionWriter.open(path, clock=StepClock()) as writer:
        entry = writer.append({"type": "custom", "customType": "x"}, parent_id=fork_point.id)
        writer.fsync()
    after = read_session(path).session
    assert after.leaf == entry
    assert after.path_to_root() == (*before.path_to_root(fork_point.id), entry)
    assert before.leaf is not None
    assert after.by_id[before.leaf.id] == before.leaf
    assert entry in after.children(fork_point.id)


def test_s5_killed_midtool_leaf_is_the_dangling_tool_call() -> None:
    """pi-observed.md §8: SIGKILL mid-tool leaves the assistant toolCall as the last line."""
    session = read_session(sample("killed_midtool")).session
    leaf = session.leaf
    assert leaf is not None
    assert leaf.role == "assistant"
    assert leaf.raw["message"]["stopReason"] == "toolUse"
    assert [c["type"] for c in leaf.raw["message"]["content"]] == ["toolCall"]
    assert all(e.role != "toolResult" for e in session.path_to_root()[-2:])


# ------------------------------------------------------------------------------- S7


def test_s7_created_session_has_pi_shape(tmp_path: Path) -> None:
    """Keys, key order and value types of the first three lines match real Pi."""
    path = tmp_path / "s.jsonl"
    session = new_session(path)
    ours = [msgspec.json.decode(line) for line in path.read_bytes().splitlines()]
    pis = [msgspec.json.decode(line) for line in sample_lines("basic")[:3]]
    assert len(ours) == 3
    assert path.read_bytes().endswith(b"\n")
    for mine, theirs in zip(ours, pis, strict=True):
        assert list(mine) == list(theirs)
        assert [type(v) for v in mine.values()] == [type(v) for v in theirs.values()]
    header, model, level = ours
    assert header["version"] == 3
    assert UUID7.match(header["id"])
    assert header["cwd"] == "/work/lane"
    assert [model["provider"], model["modelId"], level["thinkingLevel"]] == [
        "fake",
        "fake-model",
        "off",
    ]
    assert model["parentId"] is None
    assert level["parentId"] == model["id"]
    assert all(HEX8.match(e["id"]) for e in (model, level))
    assert all(ISO.match(e["timestamp"]) for e in ours)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_session(path).require_clean().to_bytes() == session.to_bytes()


def test_s7_create_is_exclusive(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    new_session(path)
    data = path.read_bytes()
    with pytest.raises(SessionError) as info:
        new_session(path)
    assert info.value.code is ReasonCode.SESSION_EXISTS
    assert path.read_bytes() == data


def test_s7_l21_a_creation_whose_directory_sync_fails_leaves_no_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S7, L21: the session is linked into place, then its directory's sync cannot open the
    directory (``EMFILE``: no descriptor left). Tries to break: the session left there with
    its name perhaps not durable, and a retry that finds it and never syncs it. Expected: the
    error is raised and no session is left, so the next try creates it whole (and syncs)."""
    path = tmp_path / "s.jsonl"
    real_open = os.open

    def no_descriptor_for_a_directory(file: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECTORY:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), file)
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", no_descriptor_for_a_directory)
    with pytest.raises(OSError, match="Too many open files") as refused:
        new_session(path)
    assert refused.value.errno == errno.EMFILE
    assert not path.exists()
    monkeypatch.setattr(os, "open", real_open)
    new_session(path)
    assert read_session(path).session.leaf is not None


def test_s7_create_keeps_given_ids_and_parent_session(tmp_path: Path) -> None:
    session = create_session(
        tmp_path / "s.jsonl",
        cwd="/c",
        provider="p",
        model_id="m",
        thinking_level="high",
        clock=StepClock(),
        session_id="01a228a6-722e-7041-b62a-95738cc013b0",
        parent_session="/old.jsonl",
    )
    assert session.id == "01a228a6-722e-7041-b62a-95738cc013b0"
    assert list(session.header)[-1] == "parentSession"
    assert session.entries[1].raw["thinkingLevel"] == "high"


def test_s7_uuid7_layout() -> None:
    """48-bit ms timestamp, version 7, variant 0b10: the layout of Pi's session ids."""
    ids = {uuid7(1_795_978_317_155) for _ in range(100)}
    assert len(ids) == 100
    assert all(UUID7.match(i) and i.startswith("01a228a6-4d63-7") for i in ids)
    assert all(UUID7.match(read_session(sample(name)).session.id) for name in SESSION_NAMES)


def test_s7_fresh_entry_ids_avoid_taken_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    draws = iter(["aaaaaaaa", "bbbbbbbb", "cccccccc"])
    monkeypatch.setattr(secrets, "token_hex", lambda _n: next(draws))
    assert _session._fresh_id({"aaaaaaaa": 1, "bbbbbbbb": 2}) == "cccccccc"


# ------------------------------------------------------------------------------- S3


def test_s3_unknown_entry_type_is_kept_verbatim(tmp_path: Path) -> None:
    path = copy_sample("basic", tmp_path)
    leaf = msgspec.json.decode(sample_lines("basic")[-1])["id"].encode()
    odd = (
        b'{"type": "future_kind", "id": "f0f0f0f0", "parentId": "' + leaf + b'", "z": 1.0, "a": []}'
    )
    with path.open("ab") as f:
        f.write(odd + b"\n")
    result = read_session(path)
    assert result.issues == ()
    assert result.session.leaf is not None
    assert result.session.leaf.raw_line == odd
    assert result.session.to_bytes() == path.read_bytes()
    entry = append_entry(path, {"type": "another_kind", "x": {"y": [1]}}, clock=StepClock())
    assert read_session(path).session.leaf == entry
    assert list(entry.raw) == ["type", "id", "parentId", "timestamp", "x"]


K = SessionIssueKind
C = b'{"type":"custom","id":"deadbeef"'  # the start of an entry line
LINE4 = b"<the id on line 4>"  # replaced by the id of basic's line 4 (its system message)
MALFORMED: list[tuple[bytes, SessionIssueKind, bool]] = [  # (line 5, issue, kept as entry)
    (C, K.BAD_JSON, False),
    (b'{"type":"custom","x":' + b"[" * 5000 + b"]" * 5000 + b"}", K.BAD_JSON, False),
    (b"[1,2,3]", K.NOT_AN_OBJECT, False),
    (b'{"type":"custom","parentId":null}', K.MISSING_FIELD, False),
    (b'{"id":"deadbeef","parentId":null}', K.MISSING_FIELD, False),
    (C + b"}", K.MISSING_FIELD, False),
    (C + b',"parentId":7}', K.MISSING_FIELD, False),
    (C + b',"parentId":"00000000"}', K.UNKNOWN_PARENT, True),
    (C + b',"parentId":"ffffffff"}', K.UNKNOWN_PARENT, True),
    (b'{"type":"custom","id":"' + LINE4 + b'","parentId":null}', K.DUPLICATE_ID, False),
    (b"", K.BLANK_LINE, False),
    (b"  \t", K.BLANK_LINE, False),
    (b'{"type":"session","version":3,"id":"x"}', K.REPEATED_HEADER, False),
]


@pytest.mark.parametrize(("bad", "kind", "kept"), MALFORMED)
def test_s3_malformed_line_is_reported_with_its_line_number(
    bad: bytes, kind: SessionIssueKind, kept: bool
) -> None:
    """Line 5 is bad; the good line 6 after it (whose parent is line 4) still counts.
    A forward reference (ffffffff is on line 6) is an unknown parent too."""
    lines = sample_lines("basic")[:4]
    line4 = msgspec.json.decode(lines[3])["id"].encode()
    bad = bad.replace(LINE4, line4)
    good = b'{"type":"custom","id":"ffffffff","parentId":"' + line4 + b'"}'
    data = b"\n".join([*lines, bad, good]) + b"\n"
    result = parse_session(data, path="x.jsonl")
    assert [(i.kind, i.line, i.raw_line) for i in result.issues] == [(kind, 5, bad)]
    assert result.issues[0].offset == len(b"\n".join(lines)) + 1
    assert [e.line for e in result.session.entries][-2:] == ([5, 6] if kept else [4, 6])
    with pytest.raises(SessionError) as info:
        result.require_clean()
    assert (info.value.code, info.value.line, info.value.path) == (
        ReasonCode.SESSION_MALFORMED,
        5,
        "x.jsonl",
    )


def _within(seconds: float, call: Callable[[], object]) -> object:
    """``call()``, or ``TimeoutError`` once ``seconds`` of real time passed (a pure-Python
    loop is interrupted between two bytecodes: the bound of a test of a would-be hang)."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    "loop",
    [
        [b'{"type":"custom","id":"aaaaaaaa","parentId":"aaaaaaaa"}'],
        [
            b'{"type":"custom","id":"aaaaaaaa","parentId":"bbbbbbbb"}',
            b'{"type":"custom","id":"bbbbbbbb","parentId":"aaaaaaaa"}',
        ],
    ],
    ids=["its-own-parent", "each-the-others-parent"],
)
def test_s4_a_parent_loop_is_refused_not_followed_for_ever(loop: list[bytes]) -> None:
    """S4: Pi only ever names an earlier line as a parent, but a damaged or edited file can
    close a loop through a forward reference: an entry that is its own parent, or two that
    are each other's. Both are kept (``unknown_parent``, as Pi keeps them), so the path from
    the leaf came back round for ever — before, ``path_to_root`` looped (memory growing) on
    whatever thread asked: the attestation, the dangling calls a relaunch settles, on the
    host's Trio thread. Now the path, the attestation and the dangling calls refuse the
    session with ``session_malformed`` at line 5, whose ``parentId`` closes the loop; paths
    that do not reach the loop are unchanged."""
    lines = sample_lines("basic")[:4]
    data = b"\n".join([*lines, *loop]) + b"\n"
    result = parse_session(data)
    assert [(i.kind, i.line) for i in result.issues] == [(K.UNKNOWN_PARENT, 5)]
    session = result.session
    for look in (
        session.path_to_root,
        lambda: attest(session),
        lambda: dangling_tool_calls(session),
    ):
        with pytest.raises(SessionError) as info:
            _within(1.0, look)
        assert (info.value.code, info.value.line) == (ReasonCode.SESSION_MALFORMED, 5)
    line4 = msgspec.json.decode(lines[3])["id"]
    assert [e.line for e in session.path_to_root(line4)] == [2, 3, 4]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\n",
        b"not json\n",
        b'{"type":"custom"}\n',
        b'{"type":"session","version":2,"id":"x"}\n',
    ],
)
def test_s11_bad_header_is_refused(data: bytes) -> None:
    with pytest.raises(SessionError) as info:
        parse_session(data)
    assert (info.value.code, info.value.line) == (ReasonCode.SESSION_HEADER_INVALID, 1)


def test_s11_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SessionError) as info:
        read_session(tmp_path / "absent.jsonl")
    assert info.value.code is ReasonCode.SESSION_MISSING


# ------------------------------------------------------------------------------- S6


@pytest.mark.parametrize("cut", ["one-byte", "half", "all-but-last", "mid-utf8", "space"])
def test_s6_torn_tail_is_detected_and_truncated(tmp_path: Path, cut: str) -> None:
    path = tmp_path / "s.jsonl"
    new_session(path)
    append_entry(path, {"type": "custom", "customType": "t", "data": "h\u00e9"}, clock=StepClock())
    whole = path.read_bytes()
    line = encode_entry({"type": "custom", "id": "abcdef01", "parentId": None, "x": "\u00e9"})
    torn = {
        "one-byte": line[:1],
        "half": line[: len(line) // 2],
        "all-but-last": line[:-1],
        "mid-utf8": line[: line.index("\u00e9".encode()) + 1],
        "space": b" ",
    }[cut]
    with path.open("ab") as f:
        f.write(torn)
    result = read_session(path)
    assert result.torn_tail is not None
    assert result.torn_tail.line == 5
    assert [(i.kind, i.line, i.offset) for i in result.issues] == [
        (SessionIssueKind.TORN_TAIL, 5, len(whole))
    ]
    assert not result.unterminated
    with pytest.raises(SessionError) as info:
        result.require_clean()
    assert (info.value.code, info.value.line) == (ReasonCode.SESSION_TORN_TAIL, 5)
    with pytest.raises(SessionError) as opening:
        SessionWriter.open(path, clock=StepClock())
    assert opening.value.code is ReasonCode.SESSION_TORN_TAIL
    assert truncate_torn_tail(path) == len(torn)
    assert path.read_bytes() == whole
    assert read_session(path).issues == ()
    assert truncate_torn_tail(path) == 0


def test_s6_complete_unterminated_last_line_is_an_entry(tmp_path: Path) -> None:
    """Pi's loader accepts it and appends the missing LF; so do we (before appending)."""
    path = tmp_path / "s.jsonl"
    session = new_session(path)
    assert session.leaf is not None
    line = encode_entry({"type": "custom", "id": "abcdef01", "parentId": session.leaf.id})
    with path.open("ab") as f:
        f.write(line)
    result = read_session(path)
    assert result.issues == ()
    assert result.unterminated
    assert result.torn_tail is None
    assert result.session.leaf is not None
    assert result.session.leaf.id == "abcdef01"
    assert truncate_torn_tail(path) == 0
    assert path.read_bytes().endswith(line)
    entry = append_entry(path, {"type": "custom"}, clock=StepClock())
    assert entry.parent_id == "abcdef01"
    assert entry.line == 5
    assert path.read_bytes().endswith(line + b"\n" + entry.raw_line + b"\n")
    after = read_session(path)
    assert after.issues == ()
    assert not after.unterminated
    assert after.session.leaf == entry


def test_s6_unterminated_header_only(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(new_session(tmp_path / "t.jsonl").header_line)
    assert read_session(path).unterminated
    entry = append_entry(path, {"type": "custom"}, parent_id=None, clock=StepClock())
    assert read_session(path).require_clean().entries == (entry,)


def test_s6_s11_a_torn_tail_is_cut_only_from_a_session(tmp_path: Path) -> None:
    """S6, S11: ``truncate_torn_tail``, which a relaunch runs first (boundaries.md B6), cuts
    only a version-3 session file; anything else is refused before a byte is cut. Before,
    a lane's session replaced by a symlink to a state file without a final LF (the token,
    raw text) had that file cut to nothing, and a torn header was cut to an empty file."""
    token = tmp_path / "token"
    token.write_bytes(b"pi-runtime-token-0123456789")
    lane = tmp_path / "lane.jsonl"
    lane.symlink_to(token)
    torn_header = tmp_path / "torn.jsonl"
    torn_header.write_bytes(b'{"type":"sess')
    for path in (lane, torn_header):
        with pytest.raises(SessionError) as info:
            truncate_torn_tail(path)
        assert info.value.code is ReasonCode.SESSION_HEADER_INVALID
    assert token.read_bytes() == b"pi-runtime-token-0123456789"
    assert torn_header.read_bytes() == b'{"type":"sess'
    with pytest.raises(SessionError) as info:
        truncate_torn_tail(tmp_path / "missing.jsonl")
    assert info.value.code is ReasonCode.SESSION_MISSING


# ------------------------------------------------------------------------------- S8


def test_s8_appends_are_whole_pi_shaped_lines(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    created = new_session(path)
    with SessionWriter.open(path, clock=StepClock()) as writer:
        custom = writer.append_custom("lane-note", {"n": 1.0, "t": "\u00fc"})
        user = writer.append_message({"role": "user", "content": [{"type": "text", "text": "hi"}]})
        writer.fsync()
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    assert lines[3:5] == [custom.raw_line, user.raw_line]
    assert custom.raw_line.endswith(b'"customType":"lane-note","data":{"n":1,"t":"\xc3\xbc"}}')
    assert list(user.raw["message"]) == ["role", "content", "timestamp"]
    assert isinstance(user.raw["message"]["timestamp"], int)
    assert user.parent_id == custom.id
    assert created.leaf is not None
    assert custom.parent_id == created.leaf.id
    assert read_session(path).require_clean().entries[-2:] == (custom, user)


def test_s8_writer_refuses_when_the_file_changed_behind_it(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    new_session(path)
    with SessionWriter.open(path, clock=StepClock()) as writer:
        with path.open("ab") as pi:  # Pi (not dead after all) appends a line
            pi.write(b'{"type":"custom","id":"99999999","parentId":null}\n')
        data = path.read_bytes()
        with pytest.raises(SessionError) as info:
            writer.append({"type": "custom"})
        assert info.value.code is ReasonCode.SESSION_CHANGED
    assert path.read_bytes() == data


@pytest.mark.parametrize(
    ("entry", "parent", "code"),
    [
        ({"type": "custom"}, "00000000", ReasonCode.SESSION_ENTRY_UNKNOWN),
        ({"data": 1}, _session.LEAF, ReasonCode.SESSION_ENTRY_INVALID),
        ({"type": "session"}, _session.LEAF, ReasonCode.SESSION_ENTRY_INVALID),
        ({"type": "custom", "id": 5}, _session.LEAF, ReasonCode.SESSION_ENTRY_INVALID),
        ({"type": "custom", "parentId": "a"}, None, ReasonCode.SESSION_ENTRY_INVALID),
        ({"type": "custom", "parentId": 3}, _session.LEAF, ReasonCode.SESSION_ENTRY_INVALID),
        ({"type": "custom", "data": float("nan")}, _session.LEAF, ReasonCode.SESSION_ENTRY_INVALID),
    ],
)
def test_s8_bad_appends_are_refused_and_write_nothing(
    tmp_path: Path, entry: dict[str, Any], parent: Any, code: ReasonCode
) -> None:
    path = tmp_path / "s.jsonl"
    session = new_session(path)
    data = path.read_bytes()
    with SessionWriter.open(path, clock=StepClock()) as writer:
        with pytest.raises(SessionError) as info:
            writer.append(entry, parent_id=parent)
        assert info.value.code is code
        with pytest.raises(SessionError):  # an id already in the file
            writer.append({"type": "custom", "id": session.entries[0].id})
        ok = writer.append({"type": "custom"})  # a refusal does not poison the writer
    assert path.read_bytes() == data + ok.raw_line + b"\n"


def test_s8_closed_writer_refuses(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    new_session(path)
    writer = SessionWriter.open(path, clock=StepClock())
    writer.close()
    writer.close()
    with pytest.raises(SessionError) as info:
        writer.append({"type": "custom"})
    assert info.value.code is ReasonCode.SESSION_CHANGED
    with pytest.raises(TypeError):
        append_entry(path, {"type": "custom"})


# ------------------------------------------------------------------------------- S9


def test_s9_attestation_is_stable_across_rereads(tmp_path: Path) -> None:
    path = copy_sample("steer", tmp_path)
    first = attest(read_session(path).session)
    again = read_session(path).session
    assert attest(again) == first
    verify_attestation(again, first)
    assert msgspec.json.decode(msgspec.json.encode(first), type=Attestation) == first
    assert first.session_id == again.id
    lines = sample_lines("steer")
    assert first.leaf_id == msgspec.json.decode(lines[-1])["id"]
    assert first.count == len(lines) - 1  # one chain: every entry is on the path


def test_s9_attestation_changes_when_the_path_changes(tmp_path: Path) -> None:
    path = copy_sample("basic", tmp_path)
    before = read_session(path).session
    attestation = attest(before)
    tampered = path.read_bytes().replace(b"please", b"Please", 1)
    assert tampered != path.read_bytes()
    changed = parse_session(tampered).session
    assert not contains_path(changed, attestation)
    with pytest.raises(SessionError) as info:
        verify_attestation(changed, attestation)
    assert info.value.code is ReasonCode.SESSION_ATTESTATION_MISMATCH
    append_entry(path, {"type": "custom"}, clock=StepClock())
    with pytest.raises(SessionError):
        verify_attestation(read_session(path).session, attestation)


def test_s9_contains_path_after_appending_below_the_leaf(tmp_path: Path) -> None:
    path = copy_sample("basic", tmp_path)
    session = read_session(path).session
    attestation = attest(session)
    with SessionWriter.open(path, clock=StepClock()) as writer:
        writer.append_custom("a", {})
        writer.append_custom("b", {})
    grown = read_session(path).session
    assert contains_path(grown, attestation)
    assert attest(grown, attestation.leaf_id) == attestation
    earlier = session.entries[3].id
    append_entry(path, {"type": "custom"}, parent_id=earlier, clock=StepClock())
    assert not contains_path(read_session(path).session, attestation)
    other = Attestation(
        session_id="other",
        leaf_id=attestation.leaf_id,
        path_digest=attestation.path_digest,
        count=attestation.count,
    )
    assert not contains_path(grown, other)


def test_s9_attest_needs_an_entry() -> None:
    header = read_session(sample("basic")).session
    empty = Session(header.header, header.header_line)
    with pytest.raises(SessionError) as info:
        attest(empty)
    assert info.value.code is ReasonCode.SESSION_ENTRY_UNKNOWN
    with pytest.raises(SessionError) as info:
        attest(header, "nope")
    assert info.value.code is ReasonCode.SESSION_ENTRY_UNKNOWN
    assert not contains_path(empty, attest(header))


# ------------------------------------------------------------------------------ S10


async def test_s10_async_wrappers(tmp_path: Path) -> None:
    """Works with MockWallClock: the wall clock is read on the Trio thread."""
    wall = MockWallClock()
    path = tmp_path / "s.jsonl"
    with trio.fail_after(10):
        created = await acreate_session(path, cwd="/c", provider="p", model_id="m", clock=wall)
        async with open_session_writer(path, clock=wall) as writer:
            entry = await aappend_entry(writer, {"type": "custom", "customType": "a"})
            await afsync(writer)
        second = await aappend_entry(path, {"type": "custom"}, clock=wall)
        with pytest.raises(TypeError):
            await aappend_entry(path, {"type": "custom"})
        result = await aread_session(path)
        assert result.session.entries == (*created.entries, entry, second)
        assert entry.timestamp is not None
        assert ISO.match(entry.timestamp)
        with path.open("ab") as f:
            f.write(b'{"type":')
        assert await atruncate_torn_tail(path) == len(b'{"type":')
        assert (await aread_session(path)).require_clean().leaf == second


# ------------------------------------------------------------------- property (S4, S5)

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53) + 1, 2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(min_value=-1, max_value=1000), JSON_VALUES), max_size=25))
def test_s4_s5_random_trees_survive_a_reread(ops: list[tuple[int, Any]]) -> None:
    """Entries appended under random parents (-1: the leaf) re-read with the same parent
    relations, the same leaf, the same bytes and the same data."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.jsonl"
        session = new_session(path)
        parents = {e.id: e.parent_id for e in session.entries}
        leaf = session.leaf
        with SessionWriter.open(path, clock=StepClock()) as writer:
            for choice, data in ops:
                ids = list(parents)
                parent = _session.LEAF if choice < 0 else ids[choice % len(ids)]
                leaf = writer.append({"type": "custom", "data": data}, parent_id=parent)
                assert encode_entry({"d": leaf.raw["data"]}) == encode_entry({"d": data})
                parents[leaf.id] = leaf.parent_id
            assert writer.session.to_bytes() == path.read_bytes()
        result = read_session(path)
        assert result.issues == ()
        assert {e.id: e.parent_id for e in result.session.entries} == parents
        assert result.session.leaf == leaf
        assert result.session.to_bytes() == path.read_bytes()
        assert os.path.getsize(path) == result.size


def test_s7_a_crash_while_a_session_is_created_leaves_none_or_a_whole_one(tmp_path: Path) -> None:
    """SIGKILLed right after the session's bytes are written and before they are linked into
    place: the path does not exist (the next start creates it whole), never an empty file
    that no reader can parse (seen as ``session_header_invalid`` after a kill right after a
    delivery was accepted)."""
    path = tmp_path / "session.jsonl"
    code = (
        "import os, signal, sys\n"
        "from runtime._clock import SystemWallClock\n"
        "from runtime._pi import _session_files as files\n"
        "real_write = os.write\n"
        "def write(fd, data):\n"
        "    n = real_write(fd, data)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return n\n"
        "files.os.write = write\n"
        "files.create_session(sys.argv[1], cwd='/', provider='p', model_id='m',\n"
        "                     clock=SystemWallClock())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, timeout=60, check=False
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not path.exists()
    create_session(path, cwd="/", provider="p", model_id="m", clock=SystemWallClock())
    assert read_session(path).session.header["cwd"] == "/"
