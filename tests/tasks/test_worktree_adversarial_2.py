"""Adversarial tests of a task's worktree evidence (``docs/design/worktree.md``), second part: a
crash that leaves git's lock on the candidate ref (W-C6), a worktree too large to read (W-M12),
a ``.git`` that names another repository (W-M11). Real git, real processes, real (sparse)
files; where a crash must come at one moment, a real process is stopped there and killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import pytest

from runtime._errors import ReasonCode, WorktreeError
from runtime._linux._proctree import is_alive_pid, proc_table
from runtime._tasks._candidate import CANDIDATE_REF_PREFIX, take_candidate
from runtime._tasks._worktree import MAX_FILE_BYTES, MAX_TOTAL_BYTES, take_manifest

from .test_worktree_adversarial import git, make_repo

LIMIT: Final = 30.0
REF: Final = CANDIDATE_REF_PREFIX + "t"

CHILD: Final = """
import sys
from pathlib import Path
from runtime._tasks._candidate import take_candidate
from runtime._tasks._worktree import take_manifest
root = Path(sys.argv[1])
take_candidate(root, take_manifest(root), archive_dir=root.parent / "a", task_id="t", message="")
"""


def _wait_for(condition: str, check: Callable[[], bool]) -> None:
    """Poll a real condition (a file git made, a process gone), bounded by a deadline."""
    deadline = time.monotonic() + LIMIT
    while not check():
        assert time.monotonic() < deadline, f"never: {condition}"
        time.sleep(0.01)


def _children(pid: int) -> list[int]:
    return [info.pid for info in proc_table().values() if info.ppid == pid and info.alive]


def crash_holding_the_ref_lock(script: list[str], git_lock: Path, killed: list[int]) -> int:
    """Run ``python -c *script`` (the runtime, changing a candidate ref) until its git holds
    ``git_lock``, then SIGKILL the runtime — its git, in a session of its own, lives on
    holding the lock: the crash W-C6 is about. The git's pid (in ``killed`` too)."""
    runtime = subprocess.Popen(
        [sys.executable, "-c", *script],
        cwd=Path(__file__).parents[2],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    killed.append(runtime.pid)
    _wait_for("git holds the ref's lock", git_lock.exists)
    (git_pid,) = _children(runtime.pid)
    killed.append(git_pid)
    runtime.kill()  # the crash: the runtime first, its git (in a session of its own) lives on
    runtime.wait()
    return git_pid


@pytest.fixture
def killed() -> Iterator[list[int]]:
    """Pids the test started; whatever of them still runs is killed after it."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if is_alive_pid(pid):
            os.kill(pid, signal.SIGKILL)


# --- W-C6: git's lock on the candidate ref, left by a crash ------------------------------


def test_w_c6_a_ref_lock_left_by_a_crash_is_taken_over_once_its_owner_is_gone(
    tmp_path: Path, killed: list[int]
) -> None:
    """W-C6: the runtime and its ``git update-ref`` are killed (``SIGKILL``: a cgroup kill, the
    OOM killer) while git holds ``refs/pi-runtime/candidates/t.lock``. Git removes its lock on
    any signal it can catch, never on this one: the lock stays, and every later update of the
    ref fails "File exists" — the task could never have a candidate again. A real crash at that
    moment: the reflog of the ref is a FIFO, so git stops inside the update, lock held; the
    test kills the runtime process, then git. While git lives its lock is never taken over;
    once it is gone, the next candidate takes it over and is published."""
    repo = make_repo(tmp_path / "w", {"a.txt": b"a\n"})
    logs = repo / ".git" / "logs" / "refs" / "pi-runtime" / "candidates"
    logs.mkdir(parents=True)
    os.mkfifo(logs / "t")  # git opens it to log the update and blocks there, holding its lock
    git_lock = repo / ".git" / "refs" / "pi-runtime" / "candidates" / "t.lock"
    git_pid = crash_holding_the_ref_lock([CHILD, str(repo)], git_lock, killed)

    manifest = take_manifest(repo)
    with pytest.raises(WorktreeError) as caught:
        take_candidate(repo, manifest, archive_dir=tmp_path / "a", task_id="t", message="")
    assert caught.value.code is ReasonCode.CHECKPOINT_FAILED
    assert git_lock.exists(), "a lock whose owner lives was taken"

    os.kill(git_pid, signal.SIGKILL)  # now git too: its lock stays behind
    _wait_for("git is gone", lambda: not is_alive_pid(git_pid))
    assert git_lock.exists()
    (logs / "t").unlink()  # the stop is over; nothing else is cleaned up

    candidate = take_candidate(repo, manifest, archive_dir=tmp_path / "a", task_id="t", message="")
    assert git(repo, "rev-parse", REF) == candidate.ref
    assert not git_lock.exists()


def test_w_c6_a_ref_lock_the_runtime_never_recorded_is_never_taken(tmp_path: Path) -> None:
    """W-C6: a ``t.lock`` no git of the runtime's was recorded holding (the worker's own, or a
    live git of the worker's) is not the runtime's to remove: the candidate fails
    ``checkpoint_failed`` and the lock stays."""
    repo = make_repo(tmp_path / "w", {"a.txt": b"a\n"})
    git_lock = repo / ".git" / "refs" / "pi-runtime" / "candidates" / "t.lock"
    git_lock.parent.mkdir(parents=True)
    git_lock.write_bytes(b"")
    manifest = take_manifest(repo)
    with pytest.raises(WorktreeError) as caught:
        take_candidate(repo, manifest, archive_dir=tmp_path / "a", task_id="t", message="")
    assert caught.value.code is ReasonCode.CHECKPOINT_FAILED
    assert git_lock.exists()


# --- W-M12: the bounds of what a manifest reads -------------------------------------------


@pytest.mark.parametrize("kind", ["files", "git"])
def test_w_m12_a_sparse_terabyte_is_refused_by_its_size_never_read(
    tmp_path: Path, kind: str
) -> None:
    """W-M12: one ``truncate`` makes a terabyte file that takes no disk; reading it to hash it
    (or ``git add`` it) would take hours and, in git, fill the object store. It is refused
    ``worktree_too_large`` by its size, before a byte is read."""
    root = tmp_path / "w"
    if kind == "git":
        make_repo(root, {"a.txt": b"a\n"})
    else:
        root.mkdir()
    with open(root / "huge.bin", "wb") as f:
        os.truncate(f.fileno(), 1 << 40)
        os.fsync(f.fileno())
    with pytest.raises(WorktreeError) as caught:
        take_manifest(root)
    assert caught.value.code is ReasonCode.WORKTREE_TOO_LARGE
    assert "huge.bin" in str(caught.value)
    assert str(MAX_FILE_BYTES) in str(caught.value)


def test_w_m12_files_each_under_the_bound_are_refused_over_the_total(tmp_path: Path) -> None:
    """W-M12: files each within :data:`MAX_FILE_BYTES` but more than :data:`MAX_TOTAL_BYTES`
    in all are refused too, by their summed sizes, before any is read."""
    root = tmp_path / "w"
    root.mkdir()
    for number in range(MAX_TOTAL_BYTES // MAX_FILE_BYTES + 1):
        with open(root / f"part{number}.bin", "wb") as f:
            os.truncate(f.fileno(), MAX_FILE_BYTES)
    with pytest.raises(WorktreeError) as caught:
        take_manifest(root)
    assert caught.value.code is ReasonCode.WORKTREE_TOO_LARGE
    assert str(MAX_TOTAL_BYTES) in str(caught.value)


# --- W-M11: the repository a worktree's .git names ----------------------------------------


def _point_elsewhere(how: str, repo: Path, other: Path) -> None:
    dot = repo / ".git"
    if how == "file":
        dot.write_text(f"gitdir: {other / '.git'}\n")
    elif how == "symlink":
        dot.symlink_to(other / ".git", target_is_directory=True)
    else:  # a .git directory of the worker's whose commondir names the other repository
        dot.mkdir()
        (dot / "HEAD").write_text("ref: refs/heads/main\n")
        (dot / "commondir").write_text(str(other / ".git") + "\n")


@pytest.mark.parametrize("how", ["file", "symlink", "commondir"])
def test_w_m11_a_git_that_names_another_repository_never_writes_into_it(
    tmp_path: Path, how: str
) -> None:
    """W-M11: the worker writes ``.git`` as ``gitdir: /elsewhere/.git`` (or a symlink to it, or
    a ``commondir`` in a ``.git`` of its own). The runtime's git would then write the worker's
    files as objects into that repository, and the candidate's commit — parented on *its*
    ``HEAD`` — and the ref ``refs/pi-runtime/candidates/t`` into it: another task's repository,
    or the operator's. Refused ``worktree_unreadable``; the other repository is unchanged."""
    other = make_repo(tmp_path / "other", {"theirs.txt": b"theirs\n"})
    git(other, "add", "-A")
    git(other, "commit", "-qm", "theirs")
    before = git(other, "count-objects", "-v")
    repo = tmp_path / "w"
    repo.mkdir()
    (repo / "mine.txt").write_bytes(b"mine\n")
    _point_elsewhere(how, repo, other)

    with pytest.raises(WorktreeError) as caught:
        take_manifest(repo)
    assert caught.value.code is ReasonCode.WORKTREE_UNREADABLE
    assert git(other, "for-each-ref", "refs/pi-runtime") == ""
    assert git(other, "count-objects", "-v") == before


def test_w_m11_a_linked_worktree_of_git_worktree_add_is_its_own_repository(
    tmp_path: Path,
) -> None:
    """W-M11: a linked worktree (``git worktree add``) has a ``.git`` file naming the main
    repository's ``worktrees/<name>``, whose ``gitdir`` names it back: a git manifest and a
    candidate, its ref kept in the main repository (where its refs are)."""
    main = make_repo(tmp_path / "main", {"a.txt": b"a\n"})
    git(main, "add", "-A")
    git(main, "commit", "-qm", "one")
    linked = tmp_path / "linked"
    git(main, "worktree", "add", "-q", "-b", "side", str(linked))
    (linked / "b.txt").write_bytes(b"b\n")

    manifest = take_manifest(linked)
    candidate = take_candidate(
        linked, manifest, archive_dir=tmp_path / "a", task_id="t", message=""
    )

    assert manifest.kind == "git"
    assert [f.path for f in manifest.files] == ["a.txt", "b.txt"]
    assert git(main, "rev-parse", REF) == candidate.ref
    assert git(linked, "status", "--porcelain") == "?? b.txt"
