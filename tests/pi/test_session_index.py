"""The leaf of a long-lived session read by difference (runtime._pi._session_index), S14 of
docs/design/sessions.md: what a read costs once the history is known, and every way the
file can change behind the index — replaced, truncated, rewritten in place, a torn tail
completed, the runtime's own appends, Pi appending while it reads. Each read is checked
against a whole parse of the same bytes (``read_session``): the index must say what it says."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any, Final

import hypothesis.strategies as st
import pytest
import trio
from hypothesis import given, settings

from runtime._errors import ReasonCode, SessionError
from runtime._pi._pijson import stringify
from runtime._pi._session_files import (
    SessionWriter,
    create_session,
    read_session,
    truncate_torn_tail,
)
from runtime._pi._session_index import LeafReading, SessionIndex, WholeRead
from runtime._pi._session_settle import SettledResult, settle_dangling

LIMIT: Final = 30.0


class StepClock:
    now = 1_795_978_317_155

    def time_ms(self) -> int:
        self.now += 1
        return self.now


def new_session(path: Path) -> str:
    """A Pi-shaped session at ``path``; its leaf."""
    session = create_session(
        path, cwd="/work/lane", provider="fake", model_id="fake-model", clock=StepClock()
    )
    assert session.leaf is not None
    return session.leaf.id


def line(entry_id: str, parent: str | None, text: str = "hello", **more: Any) -> bytes:
    """One Pi-shaped ``message`` line, LF-terminated."""
    message = {"role": "user", "content": [{"type": "text", "text": text}], "timestamp": 1}
    raw = {
        "type": "message",
        "id": entry_id,
        "parentId": parent,
        "timestamp": "2026-12-01T08:58:24.759Z",
        "message": message,
        **more,
    }
    return stringify(raw) + b"\n"


def history(path: Path, entries: int, *, text: str = "x" * 200) -> str:
    """A session with ``entries`` chained messages (unique ids) after Pi's first three
    lines; its leaf."""
    leaf = new_session(path)
    lines = []
    for number in random.sample(range(1 << 32), entries):  # unique, as Pi's are
        entry_id = f"{number:08x}"
        lines.append(line(entry_id, leaf, text))
        leaf = entry_id
    with path.open("ab") as f:
        f.write(b"".join(lines))
    return leaf


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def whole_leaf(path: Path) -> str | None:
    """What a whole parse says the leaf is (S5)."""
    leaf = read_session(path).session.leaf
    return leaf.id if leaf is not None else None


def read(index: SessionIndex, path: Path) -> LeafReading:
    """``index.read()``, checked against a whole parse of the file as it now is."""
    reading = index.read()
    whole = read_session(path)
    assert reading.leaf == (whole.session.leaf.id if whole.session.leaf else None)
    assert reading.entries == len(whole.session.entries)
    assert reading.size == whole.size
    return reading


def replace(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` as a restored copy is put there: a new file renamed over."""
    temp = path.with_suffix(".new")
    temp.write_bytes(data)
    os.replace(temp, path)


def rewrite_in_place(path: Path, data: bytes) -> None:
    """Overwrite ``path``'s bytes on the same inode (truncate and write), its modification
    time a second past the last one, as a write a moment later has it (a filesystem's clock
    may not tick between two writes this close)."""
    before = path.stat().st_mtime_ns
    with path.open("r+b") as f:
        f.truncate(0)
        f.write(data)
    os.utime(path, ns=(before + 10**9, before + 10**9))


# ----------------------------------------------------------------------------- the cost


def test_s14_a_read_after_one_append_reads_that_entry_not_the_history(tmp_path: Path) -> None:
    """S14: a session with a long history (3,000 entries, ~1 MB) read once; one entry
    appended. The next read decodes that one line and reads its bytes and a few hundred
    more (what it compares before trusting the rest) — not the history. A read with
    nothing new decodes nothing."""
    path = tmp_path / "session.jsonl"
    leaf = history(path, 3000)
    index = SessionIndex(path)
    first = read(index, path)
    assert first.whole is WholeRead.FIRST
    assert first.bytes_read == path.stat().st_size > 900_000
    new = line("0000beef", leaf)
    append(path, new)
    second = read(index, path)
    assert (second.leaf, second.whole, second.lines_parsed) == ("0000beef", None, 1)
    assert len(new) <= second.bytes_read < len(new) + 1024
    idle = read(index, path)
    assert (idle.leaf, idle.whole, idle.lines_parsed) == ("0000beef", None, 0)
    assert idle.bytes_read < 1024


def test_s14_what_an_index_keeps_is_a_few_bytes_an_entry(tmp_path: Path) -> None:
    """S14: many rooms, most idle, each keeps its index between deliveries. For 20,000
    entries (~5 MB of session) it keeps under 8 bytes an entry plus a few KB — ids as
    numbers, no line text — where a whole parse held the whole file and more."""
    path = tmp_path / "session.jsonl"
    history(path, 20_000)
    tracemalloc.start()
    try:
        index = SessionIndex(path)
        before = tracemalloc.get_traced_memory()[0]
        reading = index.read()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert reading.entries == 20_002
    assert kept < 8 * reading.entries + 8192, kept


# ------------------------------------------------------------- the file changed behind it


def test_s14_a_file_replaced_by_another_of_the_same_size_is_read_whole(tmp_path: Path) -> None:
    """S14: the session replaced (renamed over, as a restored copy is) by another file of
    exactly the same size whose entries have other ids: read whole (``replaced``), its
    leaf is the new file's — never the old index's."""
    path, other = tmp_path / "session.jsonl", tmp_path / "other.jsonl"
    history(path, 200)
    history(other, 200)
    assert path.stat().st_size == other.stat().st_size
    index = SessionIndex(path)
    read(index, path)
    replace(path, other.read_bytes())
    reading = read(index, path)
    assert reading.whole is WholeRead.REPLACED
    assert reading.leaf == whole_leaf(other)


@pytest.mark.parametrize("where", ["last_line", "middle", "grown"])
def test_s14_a_file_rewritten_in_place_is_read_whole(where: str, tmp_path: Path) -> None:
    """S14: the file rewritten on the same inode: its last line replaced by a longer one
    (the bytes compared differ), one middle line changed with the size kept (the first and
    last lines still match; the file was written without growing), or a whole other
    history longer than the first. Each is read whole (``rewritten``), and a middle line
    changed to repeat the last line's id moves the leaf back, as a whole parse says."""
    path = tmp_path / "session.jsonl"
    history(path, 300)
    index = SessionIndex(path)
    read(index, path)
    lines = path.read_bytes().splitlines(keepends=True)
    last_id = read_session(path).session.entries[-1].id
    if where == "last_line":  # longer: the size differs, the bytes compared do not match
        lines[-1] = line("feedf00d", last_id, "y" * 250)
        data = b"".join(lines)
    elif where == "middle":  # the 100th entry takes the last one's id: the last is no entry
        lines[100] = lines[100][:24] + last_id.encode() + lines[100][32:]
        data = b"".join(lines)
        assert len(data) == path.stat().st_size
        assert data != path.read_bytes()
    else:
        other = tmp_path / "other.jsonl"
        history(other, 400)
        data = other.read_bytes()
    rewrite_in_place(path, data)
    reading = read(index, path)
    assert reading.whole is WholeRead.REWRITTEN
    if where == "middle":
        assert reading.leaf != last_id


def test_s14_a_truncated_file_is_read_whole_and_regrown_too(tmp_path: Path) -> None:
    """S14: the file cut back to fewer lines than were read (``truncated``); then, read
    again, cut once more and grown past its old size with other lines (``rewritten``: the
    last line read is no longer where it was)."""
    path = tmp_path / "session.jsonl"
    history(path, 300)
    index = SessionIndex(path)
    read(index, path)
    data = path.read_bytes()
    cut = data.rfind(b"\n", 0, len(data) // 2) + 1
    with path.open("r+b") as f:
        f.truncate(cut)
    assert read(index, path).whole is WholeRead.TRUNCATED
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(data.rfind(b"\n", 0, size - 100) + 1)
    while path.stat().st_size <= size + 1000:
        append(path, line(secrets.token_hex(4), None, "regrown"))
    assert read(index, path).whole is WholeRead.REWRITTEN


def test_s14_s11_a_header_damaged_behind_the_index_is_refused_as_a_whole_read_is(
    tmp_path: Path,
) -> None:
    """S14, S11: the header overwritten in place with bytes of its own length after a read
    (the lane then fails closed, L18): the next read raises ``session_header_invalid``, as
    ``read_session`` does — never the leaf kept from before. A removed file is
    ``session_missing``; created again, it is read whole."""
    path = tmp_path / "session.jsonl"
    history(path, 50)
    index = SessionIndex(path)
    read(index, path)
    data = path.read_bytes()
    header_end = data.index(b"\n")
    damaged = b'{"type":"other"' + b" " * (header_end - 16) + b"}"
    with path.open("r+b") as f:
        f.write(damaged)
    for reader in (index.read, lambda: read_session(path)):
        with pytest.raises(SessionError) as caught:
            reader()
        assert caught.value.code is ReasonCode.SESSION_HEADER_INVALID
    path.unlink()
    with pytest.raises(SessionError) as missing:
        index.read()
    assert missing.value.code is ReasonCode.SESSION_MISSING
    history(path, 10)
    assert read(index, path).whole is WholeRead.FIRST


# ---------------------------------------------------------- what Pi and the runtime append


def test_s14_s6_a_torn_tail_then_completed_is_read_as_a_whole_parse_reads_it(
    tmp_path: Path,
) -> None:
    """S14, S6: Pi killed mid-append leaves a torn last line: the leaf stays the entry
    before it, read after read. Completed (the rest of the line and its LF), it is the
    leaf. A complete last line without its LF is the leaf already, and stays so once the
    LF comes. A torn tail cut by ``truncate_torn_tail``, then another line appended: that
    line is the leaf. A torn line longer than a read chunk (2 MiB) completed later: the
    same. Every read is by difference."""
    path = tmp_path / "session.jsonl"
    leaf = history(path, 500)
    index = SessionIndex(path)
    read(index, path)
    whole = line("aaaa0001", leaf)
    append(path, whole[:40])
    assert read(index, path).leaf == leaf
    assert read(index, path).leaf == leaf
    append(path, whole[40:])
    assert read(index, path).leaf == "aaaa0001"
    unterminated = line("aaaa0002", "aaaa0001")
    append(path, unterminated[:-1])
    assert read(index, path).leaf == "aaaa0002"
    append(path, b"\n")
    assert read(index, path).leaf == "aaaa0002"
    append(path, line("aaaa0003", "aaaa0002")[:-9])
    assert read(index, path).leaf == "aaaa0002"
    assert truncate_torn_tail(path) > 0
    append(path, line("aaaa0004", "aaaa0002"))
    assert read(index, path).leaf == "aaaa0004"
    long = line("aaaa0005", "aaaa0004", "y" * (2 << 20))
    append(path, long[: len(long) // 2])
    assert read(index, path).leaf == "aaaa0004"
    append(path, long[len(long) // 2 :])
    reading = read(index, path)
    assert (reading.leaf, reading.whole) == ("aaaa0005", None)


def test_s14_s8_s13_the_runtimes_own_appends_are_read_by_difference(tmp_path: Path) -> None:
    """S14, S8, S13: what the runtime appends itself while its worker is dead — a settled
    tool call's result, a ``custom`` entry branching back to an earlier leaf (a replay),
    the LF a complete unterminated last line lacked — is read by difference like Pi's
    lines, and the leaf is the runtime's last entry."""
    path = tmp_path / "session.jsonl"
    leaf = history(path, 200)
    call = {"type": "toolCall", "id": "call_1", "name": "bash", "arguments": {}}
    assistant = {"role": "assistant", "content": [call], "stopReason": "toolUse"}
    raw = {"type": "message", "id": "bbbb0001", "parentId": leaf, "timestamp": "t"}
    append(path, stringify({**raw, "message": assistant}))  # no LF
    index = SessionIndex(path)
    assert read(index, path).leaf == "bbbb0001"
    (settled,) = settle_dangling(path, {"call_1": SettledResult([], True)}, clock=StepClock())
    reading = read(index, path)
    assert (reading.leaf, reading.whole) == (settled.id, None)
    with SessionWriter.open(path, clock=StepClock()) as writer:
        marker = writer.append_custom("pi-runtime/replay", {"replay": True}, parent_id=leaf)
        writer.fsync()
    reading = read(index, path)
    assert (reading.leaf, reading.whole) == (marker.id, None)


def test_s14_s4_an_appended_line_repeating_an_old_id_is_no_entry(tmp_path: Path) -> None:
    """S14, S4: a line appended with the id of an entry of the history read long before
    (and one with an id not of Pi's 8-hex kind, repeated too; and a complete last line
    without its LF repeating one) is no entry: the leaf stays where a whole parse keeps
    it."""
    path = tmp_path / "session.jsonl"
    history(path, 300)
    first_id = read_session(path).session.entries[5].id
    index = SessionIndex(path)
    read(index, path)
    append(path, line("not-hex-id", first_id))
    assert read(index, path).leaf == "not-hex-id"
    append(path, line(first_id, None, "again"))
    assert read(index, path).leaf == "not-hex-id"
    append(path, line("cccc0001", first_id) + line("not-hex-id", None))
    assert read(index, path).leaf == "cccc0001"
    append(path, line(first_id, "cccc0001")[:-1])  # complete, without its LF (S6)
    assert read(index, path).leaf == "cccc0001"
    append(path, b"\n" + line("cccc0002", "cccc0001")[:-1])
    assert read(index, path).leaf == "cccc0002"


async def test_s14_s10_pi_appending_while_the_index_reads(tmp_path: Path) -> None:
    """S14, S10: a real process appends 20,000 Pi-shaped lines, one ``write`` each on an
    ``O_APPEND`` descriptor (as Pi's ``appendFileSync``), in 40 bursts; after each it waits
    for a word to go on. The index reads in a Trio worker thread at each pause (the leaf is
    the burst's last line) and right after the word, while the next burst is being written.
    Every leaf read is one of the lines written, never one before an earlier read's leaf
    (the leaf only moves on), and once the writer is done the leaf is its last line."""
    path, source = tmp_path / "session.jsonl", tmp_path / "lines"
    leaf = history(path, 100)
    ids = [f"{n:08x}" for n in range(1, 20_001)]
    lines, parent = [], leaf
    for n, entry_id in enumerate(ids):
        lines.append(line(entry_id, parent, "z" * (300 if n % 97 else 20_000))[:-1])
        parent = entry_id
    source.write_bytes(b"\n".join(lines))
    script = (
        "import os, sys\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)\n"
        "lines = open(sys.argv[2], 'rb').read().split(b'\\n')\n"
        "for n, line in enumerate(lines):\n"
        "    os.write(fd, line + b'\\n')\n"
        "    if n % 500 == 499:\n"
        "        print(n, flush=True)\n"
        "        sys.stdin.read(1)\n"
    )
    index = SessionIndex(path)
    order = {entry_id: n for n, entry_id in enumerate(ids)}
    seen = [-1]

    async def leaf_read() -> int:
        reading = await index.aread()
        seen.append(order[reading.leaf or "none"])  # KeyError: a leaf never written
        assert seen[-1] >= seen[-2]
        return seen[-1]

    with trio.fail_after(LIMIT):
        writer = await trio.lowlevel.open_process(
            [sys.executable, "-c", script, str(path), str(source)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            assert writer.stdout is not None
            assert writer.stdin is not None
            said = b""
            for _ in range(40):
                while not said.endswith(b"\n"):
                    said += await writer.stdout.receive_some()
                assert await leaf_read() == int(said)  # the burst is whole: its last line
                said = b""
                await writer.stdin.send_all(b"g")
                await leaf_read()  # while the next burst is written
            assert await writer.wait() == 0
        finally:
            writer.kill()
            await writer.wait()
    reading = await index.aread()
    assert reading.leaf == ids[-1] == whole_leaf(path)
    assert reading.entries == len(read_session(path).session.entries)


# ------------------------------------------------------------------ against a whole parse

_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "entry",
                "entry",
                "entry",
                "repeat",
                "odd_id",
                "garbage",
                "blank",
                "torn",
                "complete",
                "unterminated",
                "unterminated_repeat",
                "cut_torn",
                "truncate",
                "replace",
                "rewrite",
                "header",
            ]
        ),
        st.integers(min_value=0, max_value=10**6),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS)
def test_s14_every_read_says_what_a_whole_parse_says(ops: list[tuple[str, int]]) -> None:
    """S14: any order of changes nobody planned — entries appended, ids repeated or of
    another kind, bad and blank lines, a torn tail left or completed or cut, a complete
    line without LF, the file truncated at a line, replaced, rewritten in place, its
    header damaged — and after each, one index read: the same leaf, entry count and size
    as a whole parse, or the same error."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "session.jsonl"
        history(path, 20)
        index = SessionIndex(path)
        torn = b""
        for op, n in ops:
            ids = [e.id for e in _entries(path)] or ["none"]
            data = path.read_bytes()
            if op == "entry":
                append(path, line(secrets.token_hex(4), ids[n % len(ids)]))
            elif op == "repeat":
                append(path, line(ids[n % len(ids)], None))
            elif op == "odd_id":
                append(path, line(f"id-{n % 7}", None))
            elif op == "garbage":
                append(path, b'{"type":"message","id":' + b"\n")
            elif op == "blank":
                append(path, b"\n")
            elif op == "torn" and data.endswith(b"\n"):
                whole = line(secrets.token_hex(4), ids[-1])
                torn = whole[n % (len(whole) - 2) + 1 :]
                append(path, whole[: n % (len(whole) - 2) + 1])
            elif op == "complete" and torn:
                append(path, torn)
                torn = b""
            elif op == "unterminated" and data.endswith(b"\n"):
                append(path, line(secrets.token_hex(4), ids[-1])[:-1])
            elif op == "unterminated_repeat" and data.endswith(b"\n"):
                append(path, line(ids[n % len(ids)], None)[:-1])
            elif op == "cut_torn":
                with contextlib.suppress(SessionError):  # no header: nothing cut
                    truncate_torn_tail(path)
                torn = b""
            elif op == "truncate":
                ends = [i + 1 for i, b in enumerate(data) if b == 10]
                with path.open("r+b") as f:
                    f.truncate(ends[n % len(ends)])
                torn = b""
            elif op == "replace":
                other = Path(tmp) / "other.jsonl"
                other.unlink(missing_ok=True)
                history(other, n % 30)
                replace(path, other.read_bytes())
                torn = b""
            elif op == "rewrite" and len(data) > 200:
                at = 160 + n % (len(data) - 160)
                rewrite_in_place(path, data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
            elif op == "header" and n % 4 == 0:
                rewrite_in_place(path, b'{"type":"session","version":2}' + data[data.find(b"\n") :])
            _same_as_whole(index, path)


def _entries(path: Path) -> tuple[Any, ...]:
    try:
        return read_session(path).session.entries
    except SessionError:
        return ()


def _same_as_whole(index: SessionIndex, path: Path) -> None:
    try:
        whole = read_session(path)
    except SessionError as error:
        refused = error.code
    else:
        reading = index.read()
        assert reading.leaf == (whole.session.leaf.id if whole.session.leaf else None)
        assert (reading.entries, reading.size) == (len(whole.session.entries), whole.size)
        return
    with pytest.raises(SessionError) as caught:
        index.read()
    assert caught.value.code is refused
