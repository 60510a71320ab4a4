"""Adversarial tests of the attachment root and the ``attach`` tool (docs/design/attachments.md
A2, A3, A5, A8): each tries to break one rule the way an adversary — a killed process, a worker
racing the tool, a second writer, a name meant to become a path — would.

Real files, real threads and real processes (SIGKILL); where a race needs one precise moment,
the adversary's move is made at that moment from inside a system call the code under test
makes (the move itself is a real ``unlink`` of a real file)."""

from __future__ import annotations

import base64
import hashlib
import os
import signal
import subprocess
import sys
import threading
import unicodedata
from pathlib import Path
from typing import Final

import pytest
import trio

from fake_pi.scenario import TINY_PNG
from runtime._boundary._attach import AttachTool
from runtime._boundary._calls import GateCall, GateResult
from runtime._config import DEFAULT_MEDIA_TYPES
from runtime._errors import ReasonCode
from runtime._journal._attachments import AttachmentStore
from runtime._wire import MAX_ATTACHMENT_NAME

PNG: Final = base64.b64decode(TINY_PNG)
LIMIT: Final = 30.0
LONG: Final = "d" * 200


def _tool(root: Path, work: Path, *, max_bytes: int = 1 << 20) -> AttachTool:
    return AttachTool(
        AttachmentStore(root), lambda: work, max_bytes=max_bytes, media_types=DEFAULT_MEDIA_TYPES
    )


async def _attach(t: AttachTool, path: str, delivery: str = "k", **args: str) -> GateResult:
    return await t(GateCall("c1", "attach", {"path": path, **args}), f"{delivery}:1:1")


def _text(result: GateResult) -> str:
    return str(result.content[0]["text"])


def _stored(root: Path) -> list[str]:
    return sorted(os.listdir(root)) if root.exists() else []


# --- A2, A8: a process killed between the bytes and their name -----------------------------

_KILLED_PUT: Final = """
import os, sys, time
from pathlib import Path
from runtime._journal._attachments import AttachmentStore
from runtime._linux._fs import OsFileSystem

root, where = Path(sys.argv[1]), sys.argv[2]

def pause() -> None:
    os.write(1, b"paused\\n")
    time.sleep(3600)

class Pausing(OsFileSystem):
    def fsync(self, handle: int) -> None:  # the temporary file written, not synced or renamed
        if where == "written":
            pause()
        super().fsync(handle)

    def fsync_dir(self, path: str) -> None:  # renamed into place, the name not synced
        if where == "renamed" and path == str(root):
            pause()
        super().fsync_dir(path)

AttachmentStore(root, Pausing()).put(sys.stdin.buffer.read())
os.write(1, b"returned\\n")
"""


async def _killed_while_putting(root: Path, data: bytes, where: str) -> None:
    """Run ``put(data)`` in a real process and SIGKILL it at ``where``."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", _KILLED_PUT, str(root), where],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert process.stdin is not None
    assert process.stdout is not None
    await process.stdin.send_all(data)
    await process.stdin.aclose()
    said = b""
    while b"\n" not in said:
        piece = await process.stdout.receive_some()
        assert piece, f"the writer ended before {where}"
        said += piece
    assert said.startswith(b"paused"), said
    process.send_signal(signal.SIGKILL)
    assert await process.wait() == -signal.SIGKILL


@pytest.mark.parametrize("where", ["written", "renamed"])
async def test_a2_a8_a_put_killed_before_its_name_is_durable_is_never_trusted_half(
    tmp_path: Path, where: str
) -> None:
    """A2, A8: a real process storing an attachment is SIGKILLed with its temporary file
    written but not synced (``written``), or renamed into place with the root's entry not
    synced (``renamed``). Killed ``written``: nothing is under the sha256's name (a read says
    ``attachment_missing``, ``names`` lists nothing) and the next start sweeps the temporary
    file. Killed ``renamed``: no record names the file yet, so the next start sweeps it as an
    orphan — unless a record names it, when it stays and a put of the same bytes (the intent
    run again) finds it intact. Either way the bytes stored again are whole."""
    root = tmp_path / "attachments"
    data = PNG + os.urandom(4096)
    digest = hashlib.sha256(data).hexdigest()
    with trio.fail_after(LIMIT):
        await _killed_while_putting(root, data, where)
    store = AttachmentStore(root)
    left = _stored(root)
    if where == "written":
        (temporary,) = left
        assert temporary.startswith(f"{digest}.tmp-")
        assert store.names() == []
        assert store.check(digest, len(data)) is ReasonCode.ATTACHMENT_MISSING
        assert store.sweep(set()) == [temporary]
    else:
        assert left == [digest]
        assert store.sweep({digest}) == []  # a record names it: kept
        assert store.put(data) == digest  # found intact: not written again
        assert store.sweep(set()) == [digest]  # no record names it: an orphan
    assert _stored(root) == []
    assert store.put(data) == digest
    assert store.read(digest, len(data)) == data
    assert _stored(root) == [digest]


# --- A8: the sweep removes only what the store wrote ----------------------------------------


def test_a8_the_sweep_removes_only_temporary_files_of_the_stores_own_shape(
    tmp_path: Path,
) -> None:
    """A8: the sweep removes a temporary file a crash left — ``<sha256>.tmp-<16 hex>``, the
    one shape the store's writes make. A file of the root whose name merely contains
    ``.tmp-`` (``notes.tmp-draft``, ``x.tmp-1``) is not one the store wrote: it stays, like
    any other name that is no sha256. Before, any name containing ``.tmp-`` was deleted — the
    one branch of the sweep that deleted on a name alone, with no proof the store made it."""
    store = AttachmentStore(tmp_path / "attachments")
    kept = store.put(PNG)
    crashed = store.root / f"{kept}.tmp-0123456789abcdef"
    crashed.write_bytes(PNG[:10])
    foreign = ["notes.tmp-draft", "x.tmp-1", f"{kept[:10]}.tmp-0123456789abcdef", "README"]
    for name in foreign:
        (store.root / name).write_bytes(b"not the store's")
    removed = store.sweep({kept})
    assert removed == [crashed.name]
    assert sorted(os.listdir(store.root)) == sorted([kept, *foreign])
    assert all((store.root / n).read_bytes() == b"not the store's" for n in foreign)


# --- A2: the same bytes stored at once ------------------------------------------------------


def test_a2_the_same_bytes_put_at_once_by_many_threads_are_one_intact_file(
    tmp_path: Path,
) -> None:
    """A2: eight threads put the same bytes twenty times each, at once, while a ninth damages
    the stored file in place (a flipped bit) now and then: every put returns the sha256,
    nothing is left but the one file, and after the last put it is intact (a put that finds
    a damaged copy replaces it; a put that finds it intact leaves it)."""
    root = tmp_path / "attachments"
    data = PNG + os.urandom(64 * 1024)
    digest = hashlib.sha256(data).hexdigest()
    store = AttachmentStore(root)
    got: list[str] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def putter() -> None:
        try:
            for _ in range(20):
                got.append(store.put(data))
        except BaseException as error:  # reported below
            errors.append(error)

    def damager() -> None:
        flipped = bytearray(data)
        flipped[100] ^= 0x01
        while not done.is_set():
            try:
                with open(root / digest, "r+b") as file:
                    file.write(bytes(flipped[:200]))
            except FileNotFoundError:
                pass
            done.wait(0.001)

    threads = [threading.Thread(target=putter) for _ in range(8)]
    spoiler = threading.Thread(target=damager)
    for thread in threads:
        thread.start()
    spoiler.start()
    for thread in threads:
        thread.join(LIMIT)
    done.set()
    spoiler.join(LIMIT)
    assert not errors
    assert got == [digest] * 160
    assert store.put(data) == digest  # the damage (if the last word was the damager's) repaired
    assert _stored(root) == [digest]
    assert store.read(digest, len(data)) == data


# --- A5: the file changes while it is copied ------------------------------------------------


async def test_a5_a_file_rewritten_while_it_is_copied_is_stored_under_the_sha256_of_what_was_read(
    tmp_path: Path,
) -> None:
    """A5, A2: a worker rewrites its picture in place, over and over, while ``attach`` copies
    it. Whatever the copy read — one version, the other, or a mix — the file stored is named
    by the sha256 of exactly its bytes and the result's size is its size: a send's check
    (A3) never finds the reply's own attachment damaged."""
    root, work = tmp_path / "attachments", tmp_path / "work"
    work.mkdir()
    versions = [PNG + bytes([i]) * (256 * 1024) for i in (1, 2)]
    picture = work / "chart.png"
    picture.write_bytes(versions[0])
    done = threading.Event()

    def redraw() -> None:
        with open(picture, "r+b") as file:
            i = 0
            while not done.is_set():
                i ^= 1
                file.seek(0)
                file.write(versions[i])

    t = _tool(root, work)
    writer = threading.Thread(target=redraw)
    writer.start()
    try:
        with trio.fail_after(LIMIT):
            results = [await _attach(t, "chart.png", f"k{i}") for i in range(20)]  # A12
    finally:
        done.set()
        writer.join(LIMIT)
    store = AttachmentStore(root)
    for result in results:
        assert not result.is_error, _text(result)
        (ref,) = result.attachments
        assert store.check(ref.sha256, ref.size) is None
    for name in _stored(root):
        assert hashlib.sha256((root / name).read_bytes()).hexdigest() == name


# --- A5: a hard link whose inside name goes between the open and the check ------------------


async def test_a5_a_hard_link_unlinked_after_the_open_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A5: ``secret.png`` lies outside the working directory; the worker links it in as
    ``innocent.png`` and — once ``attach`` has opened that name, before it counts the file's
    names — removes the link. The file ``attach`` holds open then has one name, and that name
    is outside: its bytes must not be attached. Before, ``st_nlink == 1`` at the check was
    taken as proof the file's one name was the path opened, and the secret was stored and
    attached; now the name is looked up again after the bytes are read, and a file whose one
    name is not the path's is refused ``attachment_outside_workdir``."""
    root, work = tmp_path / "attachments", tmp_path / "work"
    work.mkdir()
    secret = tmp_path / "secret.png"
    secret.write_bytes(PNG + b"the secret")
    link = work / "innocent.png"
    os.link(secret, link)
    inode = secret.stat().st_ino
    real_fstat = os.fstat
    moved: list[int] = []

    def racing_fstat(fd: int) -> os.stat_result:
        if not moved and real_fstat(fd).st_ino == inode:
            moved.append(fd)
            link.unlink()  # the adversary's move, at the worst moment for the tool
        return real_fstat(fd)

    monkeypatch.setattr(os, "fstat", racing_fstat)
    with trio.fail_after(LIMIT):
        result = await _attach(_tool(root, work), "innocent.png")
    monkeypatch.undo()
    assert moved, "the race was not run"
    assert result.is_error
    assert result.attachments == ()
    assert f"({ReasonCode.ATTACHMENT_OUTSIDE_WORKDIR})" in _text(result)
    assert _stored(root) == []


def _deep_file(work: Path, data: bytes) -> None:
    """``deep.png`` holding ``data`` under 21 directories of 200-character names below
    ``work``: a path of 4,221 characters, past ``PATH_MAX`` (4,096)."""
    fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(21):
            os.mkdir(LONG, dir_fd=fd)
            below = os.open(LONG, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
        with open(os.open("deep.png", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "wb") as f:
            f.write(data)
    finally:
        os.close(fd)


# --- A5: names and paths --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("a\0b.png", "ab.png"),
        ("..", "attachment"),
        ("\u2025", "attachment"),  # TWO DOT LEADER: ".." once compatibility-normalised
        ("\uff0e\uff0e", "attachment"),  # FULLWIDTH FULL STOPs
        ("..\\..\\evil.png", "evil.png"),  # a Windows path
        ("..\uff0f..\uff0fevil.png", "evil.png"),  # FULLWIDTH SOLIDUS
        ("..\u2215..\u2215evil.png", "..\u2215..\u2215evil.png"),  # DIVISION SLASH: no separator
        ("\u202egnp.exe", "gnp.exe"),  # a right-to-left override
        ("x" * 10_000 + ".png", "x" * MAX_ATTACHMENT_NAME),
        ("caf\u0065\u0301.png", "caf\u0065\u0301.png"),  # decomposed: kept as given
    ],
)
async def test_a5_a_name_is_a_name_to_show_never_a_path(
    tmp_path: Path, given: str, shown: str
) -> None:
    """A5: the ``name`` argument is what a client shows and may save the file as, so it is
    never a path — not with ``/``, not with ``\\`` (a Windows client's separator), not with
    a character that compatibility normalisation (NFKC, which clients and file systems apply)
    turns into one, nor ``..`` in any of those spellings; control and format characters go;
    it is at most ``MAX_ATTACHMENT_NAME`` characters. Before, ``..\\..\\evil.png``, a
    fullwidth solidus and a two-dot leader were shown as they came."""
    root, work = tmp_path / "attachments", tmp_path / "work"
    work.mkdir()
    (work / "chart.png").write_bytes(PNG)
    with trio.fail_after(LIMIT):
        result = await _attach(_tool(root, work), "chart.png", name=given)
    assert not result.is_error, _text(result)
    (ref,) = result.attachments
    assert ref.name == shown
    plain = unicodedata.normalize("NFKC", ref.name)
    assert "/" not in plain
    assert "\\" not in plain
    assert plain not in ("", ".", "..")


async def test_a5_paths_with_nul_dot_dot_long_components_and_other_spellings(
    tmp_path: Path,
) -> None:
    """A5: a NUL anywhere in the path is ``attachment_arguments``; ``..`` after a directory
    that exists, or an absolute path that climbs back in, ``attachment_outside_workdir``; a
    component longer than a file system allows ``attachment_not_file``; a name spelt in
    another Unicode normal form than the file's is another name (no normalisation: the bytes
    are the name) and is not found; a path deeper than ``PATH_MAX`` still attaches (each
    component is opened below the one before). Nothing refused is stored."""
    root, work = tmp_path / "attachments", tmp_path / "work"
    work.mkdir()
    (work / "sub").mkdir()
    (work / "caf\u00e9.png").write_bytes(PNG)  # composed é
    t = _tool(root, work)
    refused = {
        "sub/\0/../../x.png": ReasonCode.ATTACHMENT_ARGUMENTS,
        "caf\u00e9.png\0": ReasonCode.ATTACHMENT_ARGUMENTS,
        "sub/../../secret.png": ReasonCode.ATTACHMENT_OUTSIDE_WORKDIR,
        f"{work}/sub/../../secret.png": ReasonCode.ATTACHMENT_OUTSIDE_WORKDIR,
        f"{work}": ReasonCode.ATTACHMENT_OUTSIDE_WORKDIR,
        "x" * 300 + ".png": ReasonCode.ATTACHMENT_NOT_FILE,
        "cafe\u0301.png": ReasonCode.ATTACHMENT_NOT_FILE,  # decomposed é: another name
    }
    with trio.fail_after(LIMIT):
        for path, code in refused.items():
            result = await _attach(t, path)
            assert result.is_error, path
            assert f"({code})" in _text(result), (path, _text(result))
        assert _stored(root) == []
        _deep_file(work, PNG)
        result = await _attach(t, f"{LONG}/" * 21 + "deep.png")
        assert not result.is_error, _text(result)
        assert [a.sha256 for a in result.attachments] == [hashlib.sha256(PNG).hexdigest()]
        ok = await _attach(t, "caf\u00e9.png")
        assert not ok.is_error
