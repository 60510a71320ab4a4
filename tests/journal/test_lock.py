"""The state-directory lock across processes, and the directory's private modes.

J9: one owner. ``open_store`` takes an exclusive ``flock`` on ``LOCK`` and
records its exact identity (pid, start time, boot id, nonce) in
``owner.json``; a second owner is refused with ``state_dir_locked`` naming
the holder, and a previous owner is taken over only once proven dead — its
flock gone *and* its identity no longer a live process.

The holders here are real processes (``tests/journal/crash_writer.py --hold``, which
opens the store and waits); their identities are read from ``/proc`` by this
test, independently of :mod:`runtime._linux._proc`.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec
import pytest
import trio

from runtime import ReasonCode, StateDirError, StateDirLockedError, open_store
from runtime._journal._store import OwnerRecord, runtime_dir
from runtime._records import StepAbandoned

WRITER: Final = Path(__file__).with_name("crash_writer.py")
TIMEOUT: Final = 20.0


@dataclass(frozen=True)
class Identity:
    pid: int
    start_time: int
    boot_id: str


def proc_identity(pid: int) -> Identity:
    """``/proc/<pid>/stat`` field 22 and this boot's id, read directly."""
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    fields = raw[raw.rindex(b")") + 2 :].split()  # fields 3.. (the name may hold spaces)
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return Identity(pid=pid, start_time=int(fields[22 - 3]), boot_id=boot)


def proc_state(pid: int) -> bytes:
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    return raw[raw.rindex(b")") + 2 :].split()[0]


def owner_of(owner: OwnerRecord | None) -> Identity | None:
    if owner is None:
        return None
    return Identity(pid=owner.pid, start_time=owner.start_time, boot_id=owner.boot_id)


def write_owner(root: Path, identity: Identity) -> OwnerRecord:
    """Plant an owner record, as a crashed owner would have left it."""
    record = OwnerRecord(
        pid=identity.pid,
        start_time=identity.start_time,
        boot_id=identity.boot_id,
        nonce=secrets.token_hex(16),
        started_ms=1,
    )
    (root / "owner.json").write_bytes(msgspec.json.encode(record))
    return record


@dataclass
class Holder:
    process: trio.Process
    identity: Identity
    nonce: str


@asynccontextmanager
async def hold_state_dir(root: Path, tmp: Path) -> AsyncIterator[Holder]:
    """A separate process that owns ``root`` (``crash_writer.py --hold``) until killed."""
    errors = tmp / f"holder-{secrets.token_hex(4)}.stderr"
    with errors.open("wb") as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, str(WRITER), str(root), "0", "0", "--hold"],
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    try:
        assert process.stdout is not None
        buffer = b""
        lines: list[str] = []
        while not any(line.startswith("R ") for line in lines):  # complete lines only
            data = await process.stdout.receive_some(4096)
            assert data, f"the holder exited: {errors.read_text()}"
            *complete, buffer = (buffer + bytes(data)).split(b"\n")
            lines += [line.decode() for line in complete]
        ready = next(line for line in lines if line.startswith("R "))
        _, pid, start_time, boot, nonce, _previous = ready.split(" ")
        identity = proc_identity(process.pid)
        assert Identity(int(pid), int(start_time), boot) == identity
        yield Holder(process, identity, nonce)
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
            if process.stdout is not None:
                await process.stdout.aclose()


@asynccontextmanager
async def live_process() -> AsyncIterator[trio.Process]:
    """Some other live process (it owns nothing)."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        yield process
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
            if process.stdin is not None:
                await process.stdin.aclose()


async def test_live_owner_refuses_a_second_and_a_killed_one_is_taken_over(
    tmp_path: Path,
) -> None:
    """J9: a live holder refuses others (naming its pid); once SIGKILLed it is taken over.

    The new owner's ``previous_owner`` is exactly the killed process: pid,
    start time from /proc, boot id and the nonce it reported.
    """
    root = tmp_path / "state"
    with trio.fail_after(TIMEOUT):
        async with hold_state_dir(root, tmp_path) as holder:
            with pytest.raises(StateDirLockedError) as refused:
                async with open_store(root):
                    pass
            assert refused.value.code is ReasonCode.STATE_DIR_LOCKED
            assert refused.value.owner_pid == holder.identity.pid
            assert f"pid {holder.identity.pid}" in str(refused.value)
            # the refused attempt left the holder's owner record alone
            owner = msgspec.json.decode((root / "owner.json").read_bytes(), type=OwnerRecord)
            assert owner.nonce == holder.nonce
            assert owner_of(owner) == holder.identity

            holder.process.send_signal(signal.SIGKILL)
            assert await holder.process.wait() == -signal.SIGKILL

        async with open_store(root) as store:
            assert owner_of(store.previous_owner) == holder.identity
            assert store.previous_owner is not None
            assert store.previous_owner.nonce == holder.nonce
            assert owner_of(store.owner) == proc_identity(os.getpid())
            await store.admissions.append(StepAbandoned(step=1, reason="taken over", epoch=1))


async def test_a_zombie_owner_counts_as_dead(tmp_path: Path) -> None:
    """J9: a SIGKILLed owner not yet reaped (a zombie) is proven dead: taken over."""
    root = tmp_path / "state"
    with trio.fail_after(TIMEOUT):
        async with hold_state_dir(root, tmp_path) as holder:
            pid = holder.identity.pid
            holder.process.send_signal(signal.SIGKILL)
            # wait for it to exit without reaping it
            await trio.to_thread.run_sync(
                os.waitid, os.P_PID, pid, os.WEXITED | os.WNOWAIT, abandon_on_cancel=True
            )
            assert proc_state(pid) == b"Z"
            async with open_store(root) as store:
                assert owner_of(store.previous_owner) == holder.identity
            assert await holder.process.wait() == -signal.SIGKILL


async def test_a_live_recorded_owner_is_not_taken_over_without_its_lock(tmp_path: Path) -> None:
    """J9: flock gone is not enough: while the recorded process lives, it stays the owner."""
    root = tmp_path / "state"
    with trio.fail_after(TIMEOUT):
        async with open_store(root):
            pass
        async with live_process() as other:
            identity = proc_identity(other.pid)
            planted = write_owner(root, identity)
            with pytest.raises(StateDirLockedError) as refused:
                async with open_store(root):
                    pass
            assert refused.value.code is ReasonCode.STATE_DIR_LOCKED
            assert refused.value.owner_pid == other.pid
            assert f"pid {other.pid}" in str(refused.value)

            other.kill()
            await other.wait()

        async with open_store(root) as store:
            assert store.previous_owner == planted


@pytest.mark.parametrize("stale", ["start_time", "boot_id"])
async def test_a_reused_pid_is_not_the_recorded_owner(tmp_path: Path, stale: str) -> None:
    """J9: a live pid whose start time or boot id differs is another process: taken over."""
    root = tmp_path / "state"
    with trio.fail_after(TIMEOUT):
        async with open_store(root):
            pass
        async with live_process() as other:
            real = proc_identity(other.pid)
            if stale == "start_time":
                recorded = Identity(real.pid, real.start_time + 1, real.boot_id)
            else:
                recorded = Identity(real.pid, real.start_time, "0" * 8 + real.boot_id[8:])
            planted = write_owner(root, recorded)
            async with open_store(root) as store:
                assert store.previous_owner == planted


async def test_second_open_in_the_same_process_is_refused(tmp_path: Path) -> None:
    """J9: the lock is per open, not per process: a second open_store here is refused too.

    The refused attempt changes nothing: the first owner keeps its record and
    can still append.
    """
    root = tmp_path / "state"
    with trio.fail_after(TIMEOUT):
        async with open_store(root) as first:
            with pytest.raises(StateDirLockedError) as refused:
                async with open_store(root):
                    pass
            assert refused.value.code is ReasonCode.STATE_DIR_LOCKED
            assert refused.value.owner_pid == os.getpid()
            owner = msgspec.json.decode((root / "owner.json").read_bytes(), type=OwnerRecord)
            assert owner == first.owner
            assert await first.admissions.append(StepAbandoned(step=1, reason="x", epoch=1)) == 1


async def test_an_insecure_state_dir_is_refused(tmp_path: Path) -> None:
    """J9/J10: a state directory others can read (0755) is refused, untouched."""
    root = tmp_path / "state"
    root.mkdir()
    root.chmod(0o755)
    with trio.fail_after(TIMEOUT):
        with pytest.raises(StateDirError) as refused:
            async with open_store(root):
                pass
    assert refused.value.code is ReasonCode.STATE_DIR_INSECURE
    assert str(root) in str(refused.value)
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    assert list(root.iterdir()) == []
    assert f"fix it with: chmod 700 {root}" in str(refused.value)


async def test_a_state_dir_of_another_user_is_refused_with_the_owner_to_change(
    tmp_path: Path,
) -> None:
    """J9/J10: a private state directory owned by another user is refused, and the advice
    changes its owner first — ``chmod`` alone would leave it refused."""
    if os.geteuid() != 0:
        pytest.fail("this test changes a directory's owner: run it as root, as CI does")
    root = tmp_path / "state"
    root.mkdir(mode=0o700)
    os.chown(root, 4242, -1)
    with trio.fail_after(TIMEOUT):
        with pytest.raises(StateDirError) as refused:
            async with open_store(root):
                pass
    assert refused.value.code is ReasonCode.STATE_DIR_INSECURE
    assert f"fix it with: chown {os.geteuid()} {root} (as root), then chmod 700 {root}" in str(
        refused.value
    )


async def test_a_new_state_dir_is_created_private(tmp_path: Path) -> None:
    """J10: a missing state directory is created 0700 (its lock and owner record 0600)."""
    root = tmp_path / "new" / "state"
    with trio.fail_after(TIMEOUT):
        async with open_store(root):
            assert stat.S_IMODE((root / "owner.json").stat().st_mode) == 0o600
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "LOCK").stat().st_mode) == 0o600
    assert not (root / "owner.json").exists()  # a clean release removes the owner record


@pytest.mark.parametrize("xdg", [False, True])
def test_runtime_dir_is_short_and_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, xdg: bool
) -> None:
    """J10: sockets live in a short 0700 directory, whatever the state directory's path."""
    deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 6, "state")
    deep.mkdir(parents=True, mode=0o700)
    with tempfile.TemporaryDirectory(dir="/tmp") as xdg_dir:  # mkdtemp: 0700
        if xdg:
            monkeypatch.setenv("XDG_RUNTIME_DIR", xdg_dir)
        else:
            monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        existed = set()
        base = Path(xdg_dir) / "pi-runtime" if xdg else Path(f"/tmp/pi-runtime-{os.geteuid()}")
        if base.exists():
            existed = set(base.iterdir())
        path = runtime_dir(deep)
        try:
            assert len(str(path)) < 60
            assert path.parent == base
            assert runtime_dir(deep) == path  # stable for one state directory
            for directory in (path, base):
                info = directory.stat()
                assert stat.S_IMODE(info.st_mode) == 0o700
                assert info.st_uid == os.geteuid()
            sock = path / "admin.sock"
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
                listener.bind(str(sock))  # fits the 107-byte limit
            sock.unlink()
        finally:
            if path not in existed:
                path.rmdir()
