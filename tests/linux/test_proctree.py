"""Membership scans against processes caught inside an exec (docs/design/workers.md W3, W11).

Right after a launch returns, the new image's ``cmdline`` and ``environ`` are often not yet
published (about one read in three on this machine): an empty read must never count as
"not a member". These tests launch real processes and scan at once, many times over.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import pytest
import trio

from runtime._linux import _proctree
from runtime._linux._proctree import (
    EPOCH_ENV,
    TreeProof,
    exec_pending,
    find_members,
    kill_tree,
    new_nonce,
    proc_table,
    scan_tree,
    settled_environ,
    sweep_stale_cgroups,
)

ROUNDS = 200


@contextmanager
def sleeper(nonce: str) -> Iterator[subprocess.Popen[bytes]]:
    """``sleep`` carrying the nonce (found by it alone: the proofs below name no root). Popen
    returns once the exec passed its point of no return, often before the kernel published
    the new image."""
    env = {"PATH": os.environ["PATH"], EPOCH_ENV: nonce}
    process = subprocess.Popen(["sleep", "30"], env=env)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


async def test_w11_a_process_inside_an_exec_is_undecided_never_a_stranger() -> None:
    """W11: each scan, taken the moment the launch returns, either proves the process a
    member or names it undecided; the settled scan always proves it."""
    undecided = 0
    for _ in range(ROUNDS):
        nonce = new_nonce()
        with sleeper(nonce) as process:
            info = _proctree._read_stat(process.pid)  # a table of one: read at once
            assert info is not None
            first = find_members(TreeProof(nonce=nonce), {process.pid: info})
            assert process.pid in first.members.keys() | first.undecided
            undecided += process.pid in first.undecided
            settled = await scan_tree(TreeProof(nonce=nonce))
            assert process.pid in settled.members
            assert not settled.undecided
    print(f"undecided at the first scan: {undecided} of {ROUNDS}")


async def test_w11_the_settled_environment_is_never_the_empty_read_of_an_exec() -> None:
    for _ in range(ROUNDS):
        nonce = new_nonce()
        with sleeper(nonce) as process:
            environ = await settled_environ(process.pid)
            assert environ is not None
            assert f"{EPOCH_ENV}={nonce}".encode() in environ.split(b"\0")


async def test_w11_kill_tree_kills_a_root_it_met_inside_an_exec() -> None:
    """The kill's "none alive" is proven by a scan that decided every process."""
    for _ in range(ROUNDS // 4):
        nonce = new_nonce()
        with sleeper(nonce) as process:
            report = await kill_tree(TreeProof(nonce=nonce), give_up_after=5.0)
            assert report.clean, report
            assert process.pid in report.killed
            assert process.pid in report.reaped  # our own child, proven: reaped (W4)


def test_w11_kernel_threads_and_zombies_are_never_pending() -> None:
    """Both read empty forever; they must not hold a scan up."""
    kthreads = [pid for pid, info in proc_table().items() if 2 in (pid, info.ppid)]
    assert not any(exec_pending(pid) for pid in kthreads)
    zombie = subprocess.Popen(["true"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    try:
        assert not exec_pending(zombie.pid)
    finally:
        zombie.wait()
    assert not exec_pending(os.getpid())


HIDDEN: Final = """
import ctypes, os, sys
stat = open("/proc/self/stat", "rb").read().rsplit(b")", 1)[1].split()
arg_start, env_end = int(stat[48 - 3]), int(stat[51 - 3])
if arg_start % 4096:  # the strings sit at the stack's top: a longer last argument moves them down
    if len(sys.argv) > 1:
        raise SystemExit("the arguments are not page-aligned after one padding")
    os.execv(sys.executable, [sys.executable, sys.argv[0], "p" * (arg_start % 4096 - 1)])
libc = ctypes.CDLL(None, use_errno=True)
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.clearenv()  # libc's environ no longer points into the pages about to go
if libc.munmap(arg_start, ((env_end + 4095) & ~4095) - arg_start) != 0:
    raise OSError(ctypes.get_errno(), "munmap")
sys.stdout.write("hidden\\n")
sys.stdout.flush()
sys.stdin.read()
"""
"""Any unprivileged process can make its ``cmdline`` and ``environ`` read empty for good.
It unmaps only the pages of its strings: it first execs itself again with one padding argument
that puts them at a page's start, so nothing below them (auxv, the pointer arrays, the first
stack frames, which the kernel places a random distance below) shares an unmapped page.
Unmapping from the page below, as before, killed it in about one start in five."""


async def test_w11_a_process_that_hides_its_environment_is_decided_not_undecided(
    tmp_path: Path,
) -> None:
    """W11: an empty read is undecided only inside an exec (the new image's argument and
    environment bounds not set yet). A process that unmapped its arguments and environment
    — any process on the machine can, a tool of another lane included — reads empty for
    good but is decided: not a member of a tree it has no other proof for. Before, it was
    undecided for ever: the kill of every other tree waited out its bounds and reported it,
    not clean (``worker_tree_survived`` for every epoch stopped on the machine)."""
    with hidden(tmp_path / "hidden.py") as process:
        assert process.stdout is not None
        assert await trio.to_thread.run_sync(process.stdout.readline) == b"hidden\n"
        assert _proctree.read_environ(process.pid) == b""
        assert not exec_pending(process.pid)
        with trio.fail_after(30):
            report = await kill_tree(TreeProof(nonce=new_nonce()), give_up_after=2.0)
        assert report.clean, report
        assert process.poll() is None  # a stranger: never signalled


@contextmanager
def hidden(script: Path) -> Iterator[subprocess.Popen[bytes]]:
    """:data:`HIDDEN`, running until its stdin closes; its stdout says when it hid."""
    script.write_text(HIDDEN)
    process = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        yield process
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(10)


async def test_w11_a_scan_left_undecided_is_not_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that stays inside its exec past the bound is reported, and the kill is not
    clean: no proof that nothing of the tree is alive (a simulated /proc)."""
    nonce = new_nonce()
    with sleeper(new_nonce()) as process:
        real = _proctree.read_environ
        monkeypatch.setattr(
            _proctree, "read_environ", lambda pid: b"" if pid == process.pid else real(pid)
        )
        monkeypatch.setattr(_proctree, "exec_pending", lambda pid: pid == process.pid)
        with trio.fail_after(30):
            report = await kill_tree(TreeProof(nonce=nonce), give_up_after=0.05)
        assert report.undecided == (process.pid,)
        assert not report.clean
        assert process.poll() is None  # never signalled: not proven a member


LEADER_GONE: Final = """
import ctypes, sys, threading, time
main = threading.get_native_id()
def other():
    while open(f"/proc/self/task/{main}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)  # (the child's own wait: no event says its main thread has ended)
    sys.stdout.write("leader gone\\n")
    sys.stdout.flush()
    threading.Event().wait()  # alive until killed
threading.Thread(target=other).start()
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: the main thread alone ends; the process lives on
"""


@contextmanager
def leader_gone(script: Path, nonce: str) -> Iterator[subprocess.Popen[bytes]]:
    """:data:`LEADER_GONE` carrying the nonce; its stdout says when the main thread is gone."""
    script.write_text(LEADER_GONE)
    env = {"PATH": os.environ["PATH"], EPOCH_ENV: nonce}
    process = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


async def test_w3_w6_a_process_whose_main_thread_exited_is_a_live_member_and_is_killed(
    tmp_path: Path,
) -> None:
    """W3, W6: a process whose main thread called ``exit`` (not ``exit_group``) reads as a
    zombie in ``/proc/<pid>/stat``, and its ``/proc/<pid>/environ`` as nothing, while its
    other threads run on. It is alive and a member (its nonce read through a live thread),
    and a kill of the tree kills it — before, it was counted gone and never signalled, and
    the stop reported clean while it ran."""
    nonce = new_nonce()
    proof = TreeProof(nonce=nonce, roots=(), cgroup=None)
    with leader_gone(tmp_path / "leader_gone.py", nonce) as process:
        assert process.stdout is not None
        assert await trio.to_thread.run_sync(process.stdout.readline) == b"leader gone\n"
        live = find_members(proof, proc_table()).live()
        with trio.fail_after(30):
            report = await kill_tree(proof, give_up_after=10)
        ended = await trio.to_thread.run_sync(process.wait, 10)
    assert process.pid in live
    assert process.pid in report.killed
    assert report.clean
    assert ended is not None


@contextmanager
def _private_cgroups() -> Iterator[Path]:
    """A cgroup of this test's own under the machine's ``pi-runtime`` one, removed after: a
    sweep of it can touch no other test's epoch (its name is not epoch-shaped, so no other
    process's sweep touches it either)."""
    support = _proctree.probe_cgroups()
    assert support.parent is not None, f"cgroup v2 is not usable here: {support.reason}"
    root = support.parent / f"sweep-test-{os.getpid()}-{new_nonce()[:8]}"
    root.mkdir()
    try:
        yield root
    finally:
        for child in root.iterdir():
            if child.is_dir():
                child.rmdir()
        root.rmdir()


def test_w12_a_sweep_removes_only_old_empty_epoch_cgroups() -> None:
    """W12: the empty epoch cgroups a dead host left are removed once old; a fresh one (an
    epoch about to enter it), one with a live member, and one not named like an epoch's
    stay."""
    with _private_cgroups() as root:
        empty = root / new_nonce()
        probe = root / "probe-1-abcd"
        populated = root / new_nonce()
        foreign = root / "not-an-epoch"
        for path in (empty, probe, populated, foreign):
            path.mkdir()
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        try:
            (populated / "cgroup.procs").write_text(str(child.pid))
            assert _proctree.cgroup_pids(populated) == [child.pid]
            assert sweep_stale_cgroups(root) == 0, "fresh cgroups stay"
            assert all(p.exists() for p in (empty, probe, populated, foreign))
            later = empty.stat().st_ctime + _proctree.STALE_CGROUP_SECONDS + 1
            assert sweep_stale_cgroups(root, now=later) == 2
            assert not empty.exists()
            assert not probe.exists()
            assert populated.exists(), "the kernel refuses a cgroup with a member"
            assert foreign.exists()
        finally:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(10)


def test_w12_a_sweep_removes_the_cgroups_a_dead_tree_made_inside_its_own() -> None:
    """W12: a stale epoch cgroup that holds an empty cgroup its tree made is removed with it
    (before, the kernel refused to remove the epoch's and it stayed for good); one whose
    inner cgroup still has a member is left whole, inner cgroup included."""
    with _private_cgroups() as root:
        dead, live = root / new_nonce(), root / new_nonce()
        for path in (dead / "inner" / "deeper", live / "inner"):
            path.mkdir(parents=True)
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        try:
            (live / "inner" / "cgroup.procs").write_text(str(child.pid))
            later = max(p.stat().st_ctime for p in (dead, live)) + _proctree.STALE_CGROUP_SECONDS
            assert sweep_stale_cgroups(root, now=later + 1) == 1
            assert not dead.exists()
            assert (live / "inner").exists()
        finally:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(10)
            for path in (live / "inner", *(dead / "inner" / "deeper", dead / "inner", dead)):
                if path.exists():
                    path.rmdir()
