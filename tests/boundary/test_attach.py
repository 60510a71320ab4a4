"""The ``attach`` tool and the attachment root (``runtime/_boundary/_attach.py``,
``runtime/_journal/_attachments.py``); test names cite docs/design/attachments.md (A1…).

Real files in a temporary directory: each refusal is tried the way an agent (or an adversary
steering one) would try it, and after each the root holds nothing."""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import stat
import threading
from pathlib import Path

import msgspec
import pytest
import trio

from fake_pi.scenario import TINY_PNG
from runtime._boundary._attach import AttachTool, sniff_media_type
from runtime._boundary._calls import GateCall, GateResult
from runtime._config import (
    DEFAULT_MEDIA_TYPES,
    AttachmentsConfig,
    RoomWorkerConfig,
    validate_config,
)
from runtime._errors import ConfigError, ReasonCode
from runtime._journal._attachments import AttachmentStore, attachment_root
from runtime._records import AttachmentRef, Outcome
from runtime._server._protocol import encode_server_frame
from runtime._wire import MAX_ATTACHMENT_NAME, Attachment, DeliveryResult

PNG = base64.b64decode(TINY_PNG)


def tool(root: Path, workdir: Path, *, max_bytes: int = 1 << 20) -> AttachTool:
    return AttachTool(
        AttachmentStore(root), lambda: workdir, max_bytes=max_bytes, media_types=DEFAULT_MEDIA_TYPES
    )


async def attach(t: AttachTool, path: str, **args: str) -> GateResult:
    return await t(GateCall("c1", "attach", {"path": path, **args}), "k:1")


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    work = tmp_path / "work"
    work.mkdir()
    return tmp_path / "state" / "attachments", work


def text(result: GateResult) -> str:
    return str(result.content[0]["text"])


async def test_a2_a4_a_file_is_stored_once_by_its_sha256_0600_in_a_0700_root(
    dirs: tuple[Path, Path],
) -> None:
    """A2: the bytes are in the root under their sha256, 0600 in a 0700 directory, before the
    result names them; the same bytes attached again are the same one file. A4: the result
    names the attachment (id, name, media type, size, sha256) and says so to the model."""
    root, work = dirs
    (work / "charts").mkdir()
    (work / "charts" / "q3.png").write_bytes(PNG)
    t = tool(root, work)
    first = await attach(t, "charts/q3.png")
    again = await attach(t, str(work / "charts" / "q3.png"), name="Q3 chart.png")
    digest = hashlib.sha256(PNG).hexdigest()
    assert not first.is_error
    assert not again.is_error
    (ref,) = first.attachments
    assert (ref.id, ref.name, ref.media_type, ref.size, ref.sha256) == (
        digest,
        "q3.png",
        "image/png",
        len(PNG),
        digest,
    )
    assert again.attachments[0].name == "Q3 chart.png"
    for given, shown in (
        ("../../etc/x.png", "x.png"),
        ("..", "attachment"),
        ("a\x1b[2J.png", "a[2J.png"),
    ):
        named = await attach(t, "charts/q3.png", name=given)
        assert named.attachments[0].name == shown  # a name to show, never a path
    assert "attached q3.png (image/png" in text(first)
    assert first.details == {"attachment": {"id": digest, "name": "q3.png", "sha256": digest}}
    assert os.listdir(root) == [digest]
    assert (root / digest).read_bytes() == PNG
    assert stat.S_IMODE((root / digest).stat().st_mode) == 0o600
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("../outside.png", ReasonCode.ATTACHMENT_OUTSIDE_WORKDIR),
        ("sub/../../outside.png", ReasonCode.ATTACHMENT_OUTSIDE_WORKDIR),
        ("/etc/passwd", ReasonCode.ATTACHMENT_OUTSIDE_WORKDIR),
        ("", ReasonCode.ATTACHMENT_ARGUMENTS),
        ("a\0b.png", ReasonCode.ATTACHMENT_ARGUMENTS),
        ("link-out.png", ReasonCode.ATTACHMENT_SYMLINK),
        ("link-dir/outside.png", ReasonCode.ATTACHMENT_SYMLINK),
        ("link-in.png", ReasonCode.ATTACHMENT_SYMLINK),
        ("missing.png", ReasonCode.ATTACHMENT_NOT_FILE),
        ("sub", ReasonCode.ATTACHMENT_NOT_FILE),
        ("pipe", ReasonCode.ATTACHMENT_NOT_FILE),
        ("big.png", ReasonCode.ATTACHMENT_TOO_LARGE),
        ("program.bin", ReasonCode.ATTACHMENT_TYPE_REFUSED),
        ("fake.txt", ReasonCode.ATTACHMENT_TYPE_REFUSED),
    ],
)
async def test_a5_a_refused_path_attaches_nothing_and_says_why(
    dirs: tuple[Path, Path], path: str, code: ReasonCode
) -> None:
    """A5: a path that leaves the working directory, goes through a symbolic link (out, or
    even in), is not a regular file (a FIFO is not waited on), is too large or of a type not
    allowed is the tool's error result with its code — and nothing is stored."""
    root, work = dirs
    outside = work.parent / "outside.png"
    outside.write_bytes(PNG)
    (work / "sub").mkdir()
    (work / "inside.png").write_bytes(PNG)
    (work / "link-out.png").symlink_to(outside)
    (work / "link-in.png").symlink_to(work / "inside.png")
    (work / "link-dir").symlink_to(work.parent)
    os.mkfifo(work / "pipe")
    (work / "big.png").write_bytes(PNG + b"\0" * 2048)
    (work / "program.bin").write_bytes(b"\x7fELF\x02\x01\x01")
    (work / "fake.txt").write_bytes(b"\xff\xfe not utf-8 \xc3")
    with trio.fail_after(10):
        result = await attach(tool(root, work, max_bytes=len(PNG) + 1024), path)
    assert result.is_error
    assert result.attachments == ()
    assert f"({code})" in text(result)
    assert not root.exists() or os.listdir(root) == []


async def test_a5_arguments_that_name_no_file_are_refused_with_their_code(
    dirs: tuple[Path, Path],
) -> None:
    """A5: a path that is not a string, or a name that is not one, is refused
    ``attachment_arguments`` like every other refusal: a stable code the model reads, and
    nothing stored."""
    root, work = dirs
    (work / "inside.png").write_bytes(PNG)
    for arguments in ({"path": 7}, {"path": None}, {"path": "inside.png", "name": 3}):
        result = await tool(root, work)(GateCall("c1", "attach", arguments), "k:1")
        assert result.is_error
        assert f"attach refused ({ReasonCode.ATTACHMENT_ARGUMENTS})" in text(result)
        assert result.attachments == ()
    assert not root.exists() or os.listdir(root) == []


async def test_a5_a_working_directory_swapped_for_a_symlink_is_not_followed(
    tmp_path: Path,
) -> None:
    """A5: the working directory is opened without following a link too. A worker that
    replaces its own working directory by a link elsewhere (``rm -r k; ln -s ~/.ssh k``)
    attaches nothing from there, by a relative or by an absolute path: ``attachment_symlink``.
    (It was opened by path, and an absolute path matched against its resolved form.)"""
    outside = tmp_path / "home" / ".ssh"
    outside.mkdir(parents=True)
    (outside / "id.txt").write_text("PRIVATE KEY\n")
    work = tmp_path / "rooms" / "k"
    work.mkdir(parents=True)
    t = tool(tmp_path / "attachments", work)
    work.rmdir()
    work.symlink_to(outside)
    for path in ("id.txt", str(outside / "id.txt")):
        result = await attach(t, path)
        assert result.is_error
        assert f"({ReasonCode.ATTACHMENT_SYMLINK})" in text(result)
        assert result.attachments == ()


def test_a5_media_types_come_from_the_bytes_for_pictures_and_the_name_for_text() -> None:
    """A5: a picture is what its bytes say, whatever its name; text is its name's type only
    when it is UTF-8."""
    assert sniff_media_type("looks.txt", PNG) == "image/png"
    assert sniff_media_type("a.jpg", b"\xff\xd8\xff\xe0rest") == "image/jpeg"
    assert sniff_media_type("a.webp", b"RIFF\0\0\0\0WEBPVP8 ") == "image/webp"
    assert sniff_media_type("doc", b"%PDF-1.7") == "application/pdf"
    assert sniff_media_type("notes.md", "héllo".encode()) == "text/markdown"
    assert sniff_media_type("notes.md", b"\xff") is None
    assert sniff_media_type("x.png", b"not a png") is None


def test_a3_a_damaged_or_missing_file_is_told_apart(tmp_path: Path) -> None:
    """A3: reading an attachment checks its size and sha256: a flipped bit is
    ``attachment_damaged``, a removed file ``attachment_missing``; an intact one is its bytes."""
    store = AttachmentStore(tmp_path / "attachments")
    digest = store.put(PNG)
    assert store.read(digest, len(PNG)) == PNG
    path = store.path_of(digest)
    data = bytearray(PNG)
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    assert store.check(digest, len(PNG)) is ReasonCode.ATTACHMENT_DAMAGED
    assert store.put(PNG) == digest  # a damaged copy is replaced when the bytes come again
    assert store.check(digest, len(PNG)) is None
    path.unlink()
    assert store.check(digest, len(PNG)) is ReasonCode.ATTACHMENT_MISSING


def test_a3_a_file_the_disk_cannot_read_is_damaged_not_an_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A3, serve.md S2: a read the disk fails (``EIO``) is ``attachment_damaged`` — the
    result goes out with the attachment marked lost — never an exception that would end the
    connection sending it."""
    store = AttachmentStore(tmp_path / "attachments")
    digest = store.put(PNG)

    def failing(fd: int) -> os.stat_result:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patched:
        patched.setattr(os, "fstat", failing)
        found = store.read(digest, len(PNG))
    assert found is ReasonCode.ATTACHMENT_DAMAGED


def test_a3_a_fifo_under_an_attachments_name_is_missing_and_blocks_no_one(
    tmp_path: Path,
) -> None:
    """A3: a named pipe where an attachment's file should be (no writer at its other end) is
    not a regular file: ``attachment_missing``, at once. Opened for reading without
    ``O_NONBLOCK`` it would block for ever, holding one worker thread per send of that
    result and per fetch, until no thread call of the process could run."""
    store = AttachmentStore(tmp_path / "attachments")
    digest = store.put(PNG)
    path = store.path_of(digest)
    path.unlink()
    os.mkfifo(path)
    found: list[bytes | ReasonCode] = []
    reader = threading.Thread(target=lambda: found.append(store.read(digest, len(PNG))))
    reader.start()
    reader.join(5)  # at once, unless the open blocks
    blocked = reader.is_alive()
    if blocked:  # let the blocked open go: a writer at the other end
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
    assert not blocked
    assert found == [ReasonCode.ATTACHMENT_MISSING]


def test_a8_sweep_removes_what_no_record_names_and_keeps_the_rest(tmp_path: Path) -> None:
    """A8: the sweep removes files no record names and temporary files a crash left, and
    keeps every referenced one."""
    store = AttachmentStore(tmp_path / "attachments")
    kept, orphan = store.put(PNG), store.put(b"orphan bytes")
    (store.root / f"{kept}.tmp-0123").write_bytes(b"torn")
    removed = store.sweep({kept})
    assert sorted(removed) == sorted([orphan, f"{kept}.tmp-0123"])
    assert store.names() == [kept]


def test_a1_the_root_is_derived_in_one_place_and_kept_out_of_work_root(tmp_path: Path) -> None:
    """A1: ``<state>/attachments`` by default, the configured directory otherwise (relative to
    the configuration's directory); one inside ``work_root`` is refused, since the worker's
    tools run there."""
    config = validate_config(RoomWorkerConfig(), base=tmp_path)
    assert config.attachment_root() == tmp_path / "state" / "attachments"
    assert attachment_root(tmp_path / "state") == config.attachment_root()
    moved = RoomWorkerConfig(attachments=AttachmentsConfig(root="pictures"))
    assert validate_config(moved, base=tmp_path).attachment_root() == tmp_path / "pictures"
    inside = RoomWorkerConfig(attachments=AttachmentsConfig(root="work/pictures"))
    with pytest.raises(ConfigError) as refused:
        validate_config(inside, base=tmp_path)
    assert refused.value.setting == "attachments.root"


async def test_a12_a_reply_carries_at_most_max_per_reply_files(dirs: tuple[Path, Path]) -> None:
    """A12: past ``max_per_reply`` distinct files in one delivery, ``attach`` is refused
    ``attachment_limit`` and stores nothing — counted over the outcomes recorded (after a
    restart too) and the results this tool handed out whose outcomes are not recorded yet
    (calls of one round run side by side); a file the reply already carries is no new one;
    the next delivery starts again from none."""
    root, work = dirs
    for i in range(4):
        (work / f"f{i}.txt").write_text(f"file {i}")
    recorded: list[AttachmentRef] = []

    def tool() -> AttachTool:  # (a new one: as after a restart)
        return AttachTool(
            AttachmentStore(root),
            lambda: work,
            max_bytes=1 << 20,
            media_types=DEFAULT_MEDIA_TYPES,
            max_per_reply=2,
            attached=lambda: recorded,
        )

    t = tool()

    async def call(path: str, intent_id: str) -> GateResult:
        return await t(GateCall("c", "attach", {"path": path}), intent_id)

    assert not (await call("f0.txt", "k1:1")).is_error
    assert not (await call("f1.txt", "k1:3")).is_error  # neither outcome is recorded yet
    refused = await call("f2.txt", "k1:5")
    assert refused.is_error
    assert refused.attachments == ()
    assert f"({ReasonCode.ATTACHMENT_LIMIT})" in text(refused)
    assert "max_per_reply" in text(refused)
    assert len(os.listdir(root)) == 2  # the refused file was not stored
    assert not (await call("f0.txt", "k1:7")).is_error  # already carried: nothing new
    assert not (await call("f2.txt", "k2:1")).is_error  # the next delivery: from none
    # after a restart: a new tool, the delivery's recorded outcomes name two files already
    again = tool()
    recorded[:] = [r for i in (0, 1) for r in (await call(f"f{i}.txt", f"k3:{i}")).attachments]
    limited = await again(GateCall("c", "attach", {"path": "f3.txt"}), "k3:9")
    assert f"({ReasonCode.ATTACHMENT_LIMIT})" in text(limited)


def test_a12_the_attachments_of_a_result_frame_stay_within_a_quarter_of_a_frame() -> None:
    """A12: ``max_per_reply`` is at most 64, and with it at that bound, every attachment's
    name the longest (``MAX_ATTACHMENT_NAME`` characters of four UTF-8 bytes each), its size
    the largest and marked lost, the ``result`` frame's attachments take at most a quarter of
    the default ``[server] max_frame_bytes``: attachments cannot grow a reply's frame past
    what a client is told frames are."""
    most = 64
    with pytest.raises(ConfigError) as refused:
        validate_config(RoomWorkerConfig(attachments=AttachmentsConfig(max_per_reply=most + 1)))
    assert refused.value.setting == "attachments.max_per_reply"
    validate_config(RoomWorkerConfig(attachments=AttachmentsConfig(max_per_reply=most)))
    sha = "f" * 64
    worst = Attachment(
        id=sha,
        name="\U0001f600" * MAX_ATTACHMENT_NAME,
        media_type="application/json",
        size=2**30,
        sha256=sha,
        lost=True,
        code=str(ReasonCode.ATTACHMENT_DAMAGED),
    )
    bare = DeliveryResult(seq=1, delivery_id="d", room="r", outcome=Outcome.REPLY)
    full = msgspec.structs.replace(bare, attachments=[worst] * most)
    grown = len(encode_server_frame(full)) - len(encode_server_frame(bare))
    assert grown <= RoomWorkerConfig().server.max_frame_bytes // 4
