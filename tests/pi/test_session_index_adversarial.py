"""An adversary's tests of the session index (runtime._pi._session_index), S14 of
docs/design/sessions.md: each read must say what a whole parse of the file says (the reader
the index replaced) — after the file changed in ways an append-only reader does not expect,
with reads split at every byte (a chunk of 1 byte: a line, a multi-byte UTF-8 character, a
CRLF cut between two reads), while Pi appends during a read, and over thousands of reads."""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any, Final

import pytest

from runtime._errors import ReasonCode, SessionError
from runtime._pi import _session_index
from runtime._pi._pijson import stringify
from runtime._pi._session import parse_session
from runtime._pi._session_files import create_session, read_session, truncate_torn_tail
from runtime._pi._session_index import SessionIndex, WholeRead

_TEXTS: Final = ("hi", "é" * 7, "😀" * 5, "a\u0000b", "\r\n", "\u2028", "x" * 600)
"""Texts of appended lines: multi-byte characters, an escaped NUL, a CR LF inside the
JSON (escaped), a line separator, a line longer than the bytes compared (``_PROBE``)."""


class StepClock:
    now = 1_795_978_317_155

    def time_ms(self) -> int:
        self.now += 1
        return self.now


def line(entry_id: str, parent: str | None, text: str = "hi") -> bytes:
    """One Pi-shaped ``message`` line, LF-terminated."""
    message = {"role": "user", "content": [{"type": "text", "text": text}], "timestamp": 1}
    raw = {"type": "message", "id": entry_id, "parentId": parent, "timestamp": "t"}
    return stringify({**raw, "message": message}) + b"\n"


def new_session(path: Path) -> str:
    session = create_session(path, cwd="/w", provider="fake", model_id="m", clock=StepClock())
    assert session.leaf is not None
    return session.leaf.id


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def whole(path: Path) -> tuple[Any, ...]:
    """What a whole parse says: (leaf, entries, size), or the error's code."""
    try:
        read = read_session(path)
    except SessionError as error:
        return ("refused", error.code)
    leaf = read.session.leaf
    return (leaf.id if leaf is not None else None, len(read.session.entries), read.size)


def indexed(index: SessionIndex) -> tuple[Any, ...]:
    """What the index says, in :func:`whole`'s terms."""
    try:
        reading = index.read()
    except SessionError as error:
        return ("refused", error.code)
    return (reading.leaf, reading.entries, reading.size)


def bump_times(path: Path, before: int) -> None:
    """A modification time a second past ``before``: a write a moment later (a file
    system's clock may not tick between two writes this close)."""
    os.utime(path, ns=(before + 10**9, before + 10**9))


# ------------------------------------------------------------ Pi appending during a read


def test_s14_a_rewrite_in_place_after_a_read_pi_appended_during_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S14: Pi appends a line between the index's ``fstat`` and its read (the read takes it
    in: the file it read is longer than the size it saw). The file is then rewritten in
    place at the size the read reached, an earlier line taking the last line's id (so the
    last line is no entry and the leaf moves back). A rewrite that keeps the size is read
    whole (the times differ) — but the times kept were the shorter file's, and only
    compared at that shorter size: the rewrite was trusted and the index kept the old leaf.
    Now the times are kept only for the size they were read at, and the read is whole."""
    path = tmp_path / "session.jsonl"
    root = new_session(path)
    append(path, line("aaaa0001", root) + line("aaaa0002", "aaaa0001"))
    index = SessionIndex(path)
    distrust = _session_index._distrust

    def pi_appends_meanwhile(fd: int, st: os.stat_result, known: Any) -> Any:
        monkeypatch.setattr(_session_index, "_distrust", distrust)
        append(path, line("aaaa0003", "aaaa0002"))
        return distrust(fd, st, known)

    monkeypatch.setattr(_session_index, "_distrust", pi_appends_meanwhile)
    assert indexed(index) == whole(path) == ("aaaa0003", 5, path.stat().st_size)
    data = path.read_bytes()
    rewritten = data.replace(b'"id":"aaaa0001"', b'"id":"aaaa0003"', 1)
    before = path.stat().st_mtime_ns
    with path.open("r+b") as f:
        f.write(rewritten)
    bump_times(path, before)
    assert whole(path)[0] == "aaaa0002"
    reading = index.read()
    assert (reading.leaf, reading.whole) == ("aaaa0002", WholeRead.REWRITTEN)
    assert indexed(index) == whole(path)


def test_s14_a_read_pi_appended_during_costs_no_whole_read_once_the_file_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S14: the fix above costs nothing while Pi goes on appending — a read after the file
    grew past what the raced read reached is by difference, as before."""
    path = tmp_path / "session.jsonl"
    root = new_session(path)
    index = SessionIndex(path)
    distrust = _session_index._distrust

    def pi_appends_meanwhile(fd: int, st: os.stat_result, known: Any) -> Any:
        monkeypatch.setattr(_session_index, "_distrust", distrust)
        append(path, line("aaaa0001", root))
        return distrust(fd, st, known)

    index.read()
    monkeypatch.setattr(_session_index, "_distrust", pi_appends_meanwhile)
    raced = index.read()
    assert (raced.leaf, raced.whole) == ("aaaa0001", None)
    append(path, line("aaaa0002", "aaaa0001"))
    reading = index.read()
    assert (reading.leaf, reading.whole, reading.lines_parsed) == ("aaaa0002", None, 1)


# ----------------------------------------------------------- against a whole parse, by seed

_OPS: Final = (
    *("entry",) * 6,
    "upper_id",
    "repeat",
    "odd_id",
    "crlf",
    "nul",
    "bad_utf8",
    "blank",
    "header_again",
    "partial",
    "complete",
    "unterminated",
    "truncate_anywhere",
    "cut_and_reappend",
    "cut_and_branch",
    "replace",
    "recreate",
    "same_size",
    "cut_torn",
    "compaction",
)
_IN_PLACE: Final = "same_size"
"""The one change a read must come right before and right after: a byte changed in place
while the file also grew since the last read is what S14 says the checks cannot see."""


def _ids(data: bytes) -> list[str]:
    """The ids a whole parse of ``data`` keeps, else a few made up."""
    try:
        return [e.id for e in parse_session(data).session.entries] or ["none"]
    except SessionError:
        return ["none"]


def _one_change(rng: random.Random, op: str, path: Path, pending: bytes) -> bytes:
    """Make the change ``op`` to ``path``; what is left of a partly written line."""
    data = path.read_bytes() if path.exists() else b""
    ids = _ids(data)
    fresh = f"{rng.getrandbits(32):08x}"
    text = rng.choice(_TEXTS)
    ends = [i + 1 for i, byte in enumerate(data) if byte == 10]
    if op == "entry":
        append(path, line(fresh, rng.choice(ids), text))
    elif op == "upper_id":  # 8 hex chars, upper case: not Pi's, another id
        append(path, line(rng.choice([fresh, ids[-1]]).upper(), rng.choice(ids), text))
    elif op == "repeat":  # a line re-appended with an id already used
        append(path, line(rng.choice(ids), None, text))
    elif op == "odd_id":  # another kind of id, its parent one never seen (a branch)
        append(path, line(f"id-{rng.randrange(5)}", "never-seen", text))
    elif op == "crlf":
        append(path, line(fresh, rng.choice(ids), text)[:-1] + b"\r\n")
    elif op == "nul":
        append(path, b"\x00\x00" + line(fresh, ids[-1])[2:])
    elif op == "bad_utf8":
        append(path, line(fresh, ids[-1], "é")[:-3] + b'\xc3"}\n')
    elif op == "blank":
        append(path, rng.choice([b"\n", b" \n", b"\r\n"]))
    elif op == "header_again":
        append(path, data[: data.find(b"\n") + 1] if ends else b"{}\n")
    elif op == "partial" and not pending:  # cut anywhere: inside a character, before LF
        whole_line = line(fresh, rng.choice(ids), text)
        at = rng.randrange(1, len(whole_line))
        append(path, whole_line[:at])
        pending = whole_line[at:]
    elif op == "complete" and pending:  # all of the rest, or some more of it
        at = rng.randrange(len(pending) + 1)
        append(path, pending[:at])
        pending = pending[at:]
    elif op == "unterminated":  # a whole line but its LF, its id new or used (S6)
        append(path, line(rng.choice([fresh, *ids]), rng.choice(ids), text)[:-1])
        pending = b"\n"
    elif op == "truncate_anywhere" and data:  # the header too
        with path.open("r+b") as f:
            f.truncate(rng.randrange(len(data) + 1))
        pending = b""
    elif op in ("cut_and_reappend", "cut_and_branch") and ends:
        at = rng.choice(ends)  # back to an older line: a rewind
        with path.open("r+b") as f:
            f.truncate(at)
        if op == "cut_and_reappend":  # the same lines again: the same file
            append(path, data[at:])
        else:  # another line where the cut ones were
            append(path, line(fresh, rng.choice(ids), text))
            pending = b""
    elif op == "replace":  # a copy renamed into place (a restore): an older version
        temp = path.with_suffix(".new")
        temp.write_bytes(data[: rng.choice([0, *ends])] if data else b"")
        os.replace(temp, path)
        pending = b""
    elif op == "recreate":  # removed and written again: the inode may be reused
        path.unlink(missing_ok=True)
        path.write_bytes(data)
    elif op == "same_size" and len(data) > 2:  # one byte changed, the size kept
        at = rng.randrange(len(data))
        changed = data[:at] + bytes([data[at] ^ rng.choice([1, 2, 32])]) + data[at + 1 :]
        before = path.stat().st_mtime_ns
        with path.open("r+b") as f:
            f.write(changed)
        bump_times(path, before)
    elif op == "cut_torn":
        with contextlib.suppress(SessionError):  # no header: nothing is cut
            truncate_torn_tail(path)
        pending = b""
    elif op == "compaction":  # Pi's compaction appends; it shortens nothing
        compaction = {"type": "compaction", "id": fresh, "parentId": ids[-1], "timestamp": "t"}
        append(path, stringify({**compaction, "summary": "s", "firstKeptEntryId": ids[0]}) + b"\n")
    return pending


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_s14_every_read_by_seed_says_what_a_whole_parse_says(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S14: 40 sequences of 40 random changes each (a fixed seed), after which (or after
    several) the index reads: lines with multi-byte characters, upper-case hex ids, ids
    repeated, parents never seen, CRLF, NUL, invalid UTF-8, blank lines, a second header;
    a whole last line without its LF (its id new or used); a line written in pieces cut
    anywhere (inside a character, just before its LF) and completed later; the file
    truncated anywhere (the header too), cut back to an older line and the same lines
    appended again or another one, replaced by an older copy renamed over it, removed and
    written again, one byte changed in place, a torn tail cut, a compaction appended. The
    index reads in chunks of ``chunk`` bytes, so that every line, character and CR LF is
    split between reads. Every read says the leaf, the entry count and the size a whole
    parse says, or refuses as it does."""
    monkeypatch.setattr(_session_index, "_CHUNK", chunk)
    for seed in range(40):
        rng = random.Random(seed)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "session.jsonl"
            new_session(path)
            index = SessionIndex(path)
            pending, done = b"", list[str]()
            for _ in range(40):
                op = rng.choice(_OPS)
                if op == _IN_PLACE and path.exists():
                    assert indexed(index) == whole(path), (seed, done)
                pending = _one_change(rng, op, path, pending)
                done.append(op)
                if not path.exists() or (op != _IN_PLACE and rng.random() < 0.3):
                    continue
                assert indexed(index) == whole(path), (seed, done)


# -------------------------------------------------------------------------------- ids


def test_s14_s4_ids_alike_but_not_the_same_are_other_entries(tmp_path: Path) -> None:
    """S14, S4: Pi's ids are kept as numbers, so ids that are one number but not one
    string must stay apart: ``DEADBEEF`` and ``deadbeef``, ``0000000a`` and ``a``,
    `` deadbeef``. Each is an entry; each repeated is none, as a whole parse says."""
    path = tmp_path / "session.jsonl"
    root = new_session(path)
    index = SessionIndex(path)
    for entry_id in ("deadbeef", "DEADBEEF", "0000000a", "a", " deadbeef", "deadbeef ", "0xdeadbe"):
        append(path, line(entry_id, root))
        assert indexed(index) == whole(path)
        assert whole(path)[0] == entry_id
    for entry_id in ("DEADBEEF", "deadbeef", "a"):
        append(path, line(entry_id, root))
        assert indexed(index) == whole(path)
        assert index.read().leaf == "0xdeadbe"


# ----------------------------------------------------------------------------- memory


def test_s14_an_index_read_after_every_append_stays_a_few_bytes_an_entry(tmp_path: Path) -> None:
    """S14: a room read after each of 5,000 appends (one entry each, as a lane reads at
    every admission and result): what the index keeps grows by about 4 bytes an entry, no
    more — no line text, no per-read leftovers."""
    path = tmp_path / "session.jsonl"
    parent = new_session(path)
    index = SessionIndex(path)
    index.read()
    rng = random.Random(14)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(5000):
            entry_id = f"{rng.getrandbits(32):08x}"
            append(path, line(entry_id, parent, "y" * 300))
            parent = entry_id
            reading = index.read()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert (reading.leaf, reading.whole) == (parent, None)
    assert kept < 8 * 5000 + 8192, kept


# ------------------------------------------------------------------------ the header


def test_s14_s11_an_empty_or_headless_file_is_refused_as_a_whole_read_refuses_it(
    tmp_path: Path,
) -> None:
    """S14, S11: the file emptied, cut inside its header, or holding only a header without
    its LF, after the index read it: the same refusal or leaf as a whole parse."""
    path = tmp_path / "session.jsonl"
    new_session(path)
    index = SessionIndex(path)
    index.read()
    data = path.read_bytes()
    header_end = data.index(b"\n")
    for size in (0, 1, header_end // 2, header_end, header_end + 1):
        path.write_bytes(data[:size])
        assert indexed(index) == whole(path)
    path.write_bytes(b"")
    assert indexed(index) == ("refused", ReasonCode.SESSION_HEADER_INVALID)
