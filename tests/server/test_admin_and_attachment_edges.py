"""Two small edges: the admin socket's task numbers are bounded as the websocket's are
(operations.md O7, protocol.md P18), and the attachment store's settling rule and its own
directory (attachments.md A13, A2). Real Unix sockets and real files in ``tmp_path``; the
attachment store's wall clock is virtual, and a read's pieces are where a test moves that clock
or writes the file as a second writer would."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import msgspec
import pytest
import trio

from runtime._boundary._attach import AttachTool
from runtime._boundary._calls import GateCall
from runtime._config import DEFAULT_MEDIA_TYPES
from runtime._errors import ReasonCode
from runtime._journal._attachments import SETTLE_MS, AttachmentNameTaken, AttachmentStore
from runtime._server import _admin, _protocol
from runtime._server._admin import admin_request, serve_admin
from runtime._tasks._guards import MAX_GRANT_EPOCHS, MAX_GRANT_SECONDS

LIMIT: Final = 10.0
PNG: Final = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3


# ------------------------------------------------------------------ the admin socket (O7, P18)


class _Rooms:
    async def status(self) -> dict[str, Any]:
        return {}

    async def cancel(self, delivery_id: str) -> dict[str, Any]:
        return {}


class _Tasks:
    """Records what reached it; answers every command ``{}``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def task_submit(self, request: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("task_submit", request.get("validation_timeout")))
        return {}

    async def task_list(self) -> dict[str, Any]:
        return {}

    async def task_show(self, task_id: str) -> dict[str, Any]:
        return {}

    async def task_reply(
        self, task_id: str, text: str, correlation: str | None = None
    ) -> dict[str, Any]:
        return {}

    async def task_control(
        self,
        task_id: str,
        action: Literal["resume", "abort", "fail", "grant"],
        *,
        reason: str | None = None,
        epochs: int = 0,
        seconds: float = 0.0,
    ) -> dict[str, Any]:
        self.calls.append((action, (epochs, seconds)))
        return {}

    async def task_wait(
        self, task_id: str, after: int = 0, seconds: float = 10.0
    ) -> dict[str, Any]:
        return {}

    async def task_forget(self, task_id: str) -> dict[str, Any]:
        return {}


@contextlib.asynccontextmanager
async def _serving(state: Path, tasks: _Tasks) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        await nursery.start(_serve_tasks, state, tasks)
        yield
        nursery.cancel_scope.cancel()


async def _serve_tasks(
    state: Path, tasks: _Tasks, *, task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED
) -> None:
    await serve_admin(state, _Rooms(), tasks=tasks, task_status=task_status)


def _submit(command: str = "task_submit", **extra: object) -> dict[str, Any]:
    return {"command": command, "task_id": "t1", "prompt": "p", "worktree": "/w", **extra}


def _grant(**extra: object) -> dict[str, Any]:
    return {"command": "task_grant", "task_id": "t1", "reason": "r", **extra}


OUT_OF_RANGE: Final = [
    ("grant seconds 1e308", _grant(seconds=1e308), "$.seconds", "<= 86400.0"),
    ("grant seconds past the bound", _grant(seconds=MAX_GRANT_SECONDS + 0.5), "$.seconds", "<="),
    ("grant epochs 101", _grant(epochs=MAX_GRANT_EPOCHS + 1), "$.epochs", "<= 100"),
    ("grant epochs 10**30", _grant(epochs=10**30), "$.epochs", ""),
    ("grant seconds -1", _grant(seconds=-1.0), "$.seconds", ">= 0"),
    ("submit validation_timeout 0", _submit(validation_timeout=0), "$.validation_timeout", "> 0"),
    ("submit validation_timeout -1", _submit(validation_timeout=-1.0), "$.validation_timeout", ""),
    (
        "submit validation_timeout 86401",
        _submit(validation_timeout=86_401),
        "$.validation_timeout",
        "<= 86400.0",
    ),
    (
        "run validation_timeout 1e308",
        _submit("task_run", validation_timeout=1e308),
        "$.validation_timeout",
        "<= 86400.0",
    ),
]


async def test_o7_p18_the_admin_sockets_task_numbers_out_of_range_are_admin_bad_request(
    tmp_path: Path,
) -> None:
    """O7, P18: over a real admin socket, a ``task_grant`` of more than one grant's bound
    (``1e308`` seconds, 101 epochs) and a ``task_submit``/``task_run`` whose
    ``validation_timeout`` is not above 0 and at most a day are refused ``admin_bad_request``
    naming the field and its bound, and never reach the task service — the websocket's
    bounds, refused the way the admin refuses any mistyped field. Before, the admin bounded
    them only at ``>= 0``: a grant of ``1e308`` seconds or 101 epochs and a
    ``validation_timeout`` of ``1e308`` reached the service (which alone looked at them, once
    it had found the task). The bounds themselves are taken."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    tasks = _Tasks()
    answers: list[tuple[str, dict[str, Any] | None]] = []
    with trio.fail_after(LIMIT):
        async with _serving(state, tasks):
            for label, request, _field, _bound in OUT_OF_RANGE:
                answers.append((label, await admin_request(state, request)))
            assert tasks.calls == []  # none reached the task service
            at_bound = [
                _grant(epochs=MAX_GRANT_EPOCHS, seconds=MAX_GRANT_SECONDS),
                _submit(validation_timeout=_protocol.MAX_VALIDATION_TIMEOUT),
                _submit("task_run", validation_timeout=0.001),
            ]
            taken = [await admin_request(state, request) for request in at_bound]
    for (label, response), (_, _, field, bound) in zip(answers, OUT_OF_RANGE, strict=True):
        assert response is not None, label
        assert (response["ok"], response["code"]) == (False, "admin_bad_request"), label
        assert f"at `{field}`" in response["message"], (label, response)
        assert bound in response["message"], (label, response)
    assert [r is not None and r["ok"] for r in taken] == [True, True, True]
    assert tasks.calls == [
        ("grant", (MAX_GRANT_EPOCHS, MAX_GRANT_SECONDS)),
        ("task_submit", _protocol.MAX_VALIDATION_TIMEOUT),
        ("task_submit", 0.001),
    ]


def _constraints(struct: type[msgspec.Struct], name: str) -> object:
    """The decoder's view of one field's type, its bounds included."""
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    return next(f.type for f in info.fields if f.name == name)


def test_o7_p18_the_admin_socket_and_the_websocket_decode_task_numbers_alike() -> None:
    """O7, P18: the admin's fields are the protocol's types — one definition — so a bound
    moved in one moves in the other."""
    timeout = "validation_timeout"
    pairs: list[tuple[type[msgspec.Struct], str, type[msgspec.Struct]]] = [
        (_admin.TaskGrantRequest, "epochs", _protocol.TaskControl),
        (_admin.TaskGrantRequest, "seconds", _protocol.TaskControl),
        (_admin.TaskSubmitRequest, timeout, _protocol.TaskSubmit),
        (_admin.TaskRunRequest, timeout, _protocol.TaskSubmit),
    ]
    for admin_type, name, wire_type in pairs:
        assert _constraints(admin_type, name) == _constraints(wire_type, name)


# ---------------------------------------------------------------- the attachment store (A13, A2)


@dataclass
class _Wall:
    now_ms: int

    def time_ms(self) -> int:
        return self.now_ms


def _changed_ms(path: Path) -> int:
    return os.stat(path).st_ctime_ns // 1_000_000


def _during_each_read(monkeypatch: pytest.MonkeyPatch, then: Callable[[], None]) -> list[int]:
    """Run ``then`` after each piece the store reads from a file (``os.preadv``: its bytes
    are read for real first); the pieces' sizes."""
    pieces: list[int] = []
    preadv = os.preadv

    def reading(fd: int, buffers: Sequence[Any], offset: int, /) -> int:
        count = preadv(fd, buffers, offset)
        pieces.append(count)
        then()
        return count

    monkeypatch.setattr(os, "preadv", reading)
    return pieces


def _read_by(how: str, store: AttachmentStore, digest: str, size: int) -> bool:
    """Whether ``how`` (``read``, ``check``, ``open``) found the attachment intact."""
    if how == "read":
        return store.read(digest, size) == PNG
    if how == "check":
        return store.check(digest, size) is None
    opened = store.open(digest, size)
    if isinstance(opened, ReasonCode):
        return False
    opened.close()
    return True


@pytest.mark.parametrize("how", ["read", "check", "open"])
def test_a13_a_file_fresh_when_its_read_began_is_not_remembered_however_long_the_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A13: the 2 s a file must have been left alone are counted to the moment its read
    begins. The file here was changed just as its read began (the virtual clock at its
    ctime), and the read lasted 3 s (the clock moved on while its bytes were read): its bytes
    are intact, yet it is not remembered — a change in its last stamp during the read would
    leave ``stat`` as it was. Before, the clock was read after the read: 3 s on, the fresh
    file counted as settled, and ``unchanged`` vouched for it from then on with no read."""
    wall = _Wall(0)
    store = AttachmentStore(tmp_path / "attachments", wall=wall)
    digest = store.put(PNG)
    wall.now_ms = _changed_ms(store.path_of(digest))  # changed just now

    def three_seconds_pass() -> None:
        wall.now_ms += SETTLE_MS + 1_000

    pieces = _during_each_read(monkeypatch, three_seconds_pass)
    assert _read_by(how, store, digest, len(PNG))
    assert pieces  # the bytes were read, and the clock moved meanwhile
    assert not store.unchanged(digest, len(PNG))
    monkeypatch.undo()
    assert _read_by(how, store, digest, len(PNG))  # now settled before the read began
    assert store.unchanged(digest, len(PNG))


def _after_the_file_system_clock_passes(path: Path) -> None:
    """Return once a change made now gets a ctime other than ``path``'s (a file system stamps
    changes with a coarse clock) — a condition, polled; bounded by the test's clock tick."""
    probe = path.parent.parent / "clock-probe"
    for _ in range(1_000_000):
        probe.write_bytes(b"")
        if os.stat(probe).st_ctime_ns > os.stat(path).st_ctime_ns:
            return
    raise AssertionError("the file system's clock never moved")


@pytest.mark.parametrize("how", ["read", "check"])
def test_a13_a_file_written_over_while_it_is_read_is_not_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A13: a settled file is written over in place by a second writer (its own descriptor,
    the same size, its mtime set back) once its bytes were read, before the read ends. The
    read found the bytes it read intact, but the file's ``stat`` after the read is not the one
    before it: it is not remembered, and the next check reads it and finds it damaged. (A
    guard: the ctime such a write moves kept the identity taken before the read from matching
    again before too.)"""
    wall = _Wall(0)
    store = AttachmentStore(tmp_path / "attachments", wall=wall)
    digest = store.put(PNG)
    path = store.path_of(digest)
    wall.now_ms = _changed_ms(path) + SETTLE_MS + 1  # settled
    _after_the_file_system_clock_passes(path)
    damaged = bytearray(PNG)
    damaged[-1] ^= 0x01
    written: list[bool] = []

    def second_writer() -> None:
        if written:
            return
        before = os.stat(path)
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.pwrite(fd, bytes(damaged), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        written.append(True)

    _during_each_read(monkeypatch, second_writer)
    assert _read_by(how, store, digest, len(PNG))  # what it read was the attachment
    monkeypatch.undo()
    assert written
    assert not store.unchanged(digest, len(PNG))
    assert store.check(digest, len(PNG)) == ReasonCode.ATTACHMENT_DAMAGED


def test_a2_a_directory_under_the_sha256s_name_is_damage_reported_and_left(
    tmp_path: Path,
) -> None:
    """A2: the store writes only files under a sha256's name; a real directory there (with
    something in it) is its root damaged. ``put`` of those bytes raises
    ``AttachmentNameTaken``, code ``attachment_damaged``, still an ``OSError`` (the server
    keeping a shared store's copy goes on as for a full disk, A11); the directory and what it
    holds are left, no temporary file stays, and other bytes are stored as ever. Before, the
    rename over it raised a bare ``IsADirectoryError``."""
    root = tmp_path / "attachments"
    store = AttachmentStore(root)
    digest = hashlib.sha256(PNG).hexdigest()
    root.mkdir(mode=0o700)
    (root / digest).mkdir()
    (root / digest / "keep.txt").write_bytes(b"not the store's")
    with pytest.raises(AttachmentNameTaken) as taken:
        store.put(PNG)
    assert taken.value.code == ReasonCode.ATTACHMENT_DAMAGED
    assert isinstance(taken.value, OSError)
    assert str(root / digest) in str(taken.value)
    assert sorted(os.listdir(root)) == [digest]
    assert (root / digest / "keep.txt").read_bytes() == b"not the store's"
    assert store.read(digest, len(PNG)) == ReasonCode.ATTACHMENT_MISSING
    other = store.put(PNG + b"!")
    assert store.read(other, len(PNG) + 1) == PNG + b"!"


async def test_a2_a5_attach_onto_a_directory_in_the_root_is_refused_attachment_damaged(
    tmp_path: Path,
) -> None:
    """A2, A5: ``attach`` of a picture whose sha256 names a directory in the root answers the
    model ``attach refused (attachment_damaged)``, attaches nothing and reserves nothing (the
    reply's count, A12); once the directory is gone the same call attaches. Before, the store's
    ``IsADirectoryError`` escaped the tool, and the gate told the worker
    ``gate_tool_failed`` with the error's text."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "chart.png").write_bytes(PNG)
    root = tmp_path / "state" / "attachments"
    root.mkdir(mode=0o700, parents=True)
    digest = hashlib.sha256(PNG).hexdigest()
    (root / digest).mkdir()
    tool = AttachTool(
        AttachmentStore(root),
        lambda: work,
        max_bytes=1 << 20,
        media_types=DEFAULT_MEDIA_TYPES,
        max_per_reply=1,
    )
    call = GateCall("c1", "attach", {"path": "chart.png"})
    with trio.fail_after(LIMIT):
        refused = await tool(call, "k:1:1")
        assert refused.is_error
        assert refused.attachments == ()
        said = str(refused.content[0]["text"])
        assert said.startswith(f"attach refused ({ReasonCode.ATTACHMENT_DAMAGED}): "), said
        assert "nothing was attached" in said
        assert str(root) not in said  # the server's paths are not the model's to read
        (root / digest).rmdir()
        attached = await tool(call, "k:1:2")  # max_per_reply 1: nothing was reserved
    assert not attached.is_error
    assert [a.sha256 for a in attached.attachments] == [digest]
    assert (root / digest).read_bytes() == PNG
