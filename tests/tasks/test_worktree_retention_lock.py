"""``task forget``'s deletion of a candidate's git ref (RT12 of ``docs/design/retention.md``)
killed while its git holds both locks a deletion takes — the ref's own
(``refs/pi-runtime/candidates/<task>.lock``, W-C6) and the repository-wide ``packed-refs.lock``
(W-C7 of ``docs/design/worktree.md``). Real git, real processes, a real ``SIGKILL``: git is
stopped inside the deletion, both locks held, by a ``packed-refs`` that is a FIFO (git opens
it to read the packed refs once it holds ``packed-refs.lock``, and blocks there)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Final

import pytest

from runtime._errors import ReasonCode, WorktreeError
from runtime._linux._proctree import is_alive_pid
from runtime._tasks._candidate import CANDIDATE_REF_PREFIX, take_candidate
from runtime._tasks._retention import _delete_ref
from runtime._tasks._worktree import take_manifest

from .test_worktree_adversarial import git, make_repo
from .test_worktree_adversarial_2 import _wait_for, crash_holding_the_ref_lock, killed

__all__ = ["killed"]  # the fixture this module uses

REF: Final = CANDIDATE_REF_PREFIX + "t"

FORGET: Final = """
import sys
from runtime._tasks._retention import _delete_ref
_delete_ref(sys.argv[1], sys.argv[2])
"""


def _worktree(tmp_path: Path) -> Path:
    """A worktree with a candidate of task ``t``, at a long path (as a worker's may be: git's
    message names the lock by its full path)."""
    repo = make_repo(tmp_path / ("d" * 100) / ("e" * 100) / "w", {"a.txt": b"a\n"})
    take_candidate(repo, take_manifest(repo), archive_dir=tmp_path / "a", task_id="t", message="")
    return repo


def _locks(repo: Path) -> list[str]:
    """Git's lock files in ``repo`` (the runtime's own ``pi-runtime-candidate-*`` left out)."""
    git_dir = repo / ".git"
    return sorted(
        str(path.relative_to(git_dir))
        for path in git_dir.rglob("*.lock")
        if not path.name.startswith("pi-runtime-candidate-")
    )


def test_w_c7_a_killed_forget_s_packed_refs_lock_is_named_never_taken(
    tmp_path: Path, killed: list[int]
) -> None:
    """W-C6, W-C7: the runtime and its ``git update-ref`` deleting ``refs/pi-runtime/
    candidates/t`` are killed while git holds ``t.lock`` and ``packed-refs.lock``. While git
    lives neither is taken. Once it is gone the next forget takes ``t.lock`` over (W-C6, the
    record names that git) but never ``packed-refs.lock``: any git in the worker's repository
    takes it, so no record of ours proves it stale. The forget fails ``worktree_unreadable``
    naming ``packed-refs.lock`` (the operator's to remove), the ref and the lock are still
    there; once the operator removed it the next forget deletes the ref. Before, git's
    message was cut to its last 500 characters — its hint — and named no lock
    ("…fs.lock': File exists. Another git process seems to be running…")."""
    repo = _worktree(tmp_path)
    packed = repo / ".git" / "packed-refs"
    os.mkfifo(packed)  # git blocks opening it, once it holds packed-refs.lock
    packed_lock = repo / ".git" / "packed-refs.lock"
    git_pid = crash_holding_the_ref_lock([FORGET, str(repo), REF], packed_lock, killed)
    assert _locks(repo) == ["packed-refs.lock", "refs/pi-runtime/candidates/t.lock"]

    with pytest.raises(WorktreeError) as caught:
        _delete_ref(str(repo), REF)
    assert caught.value.code is ReasonCode.WORKTREE_UNREADABLE
    assert f"pid {git_pid}" in str(caught.value)
    assert _locks(repo) == ["packed-refs.lock", "refs/pi-runtime/candidates/t.lock"]

    os.kill(git_pid, signal.SIGKILL)  # now git too: both its locks stay behind
    _wait_for("git is gone", lambda: not is_alive_pid(git_pid))
    packed.unlink()  # the stop is over; nothing else is cleaned up

    with pytest.raises(WorktreeError) as caught:
        _delete_ref(str(repo), REF)
    assert caught.value.code is ReasonCode.WORKTREE_UNREADABLE
    assert f"{packed_lock}': File exists" in str(caught.value)
    assert _locks(repo) == ["packed-refs.lock"]  # the ref's lock taken over (W-C6), no other
    assert git(repo, "for-each-ref", "--format=%(refname)") == REF

    packed_lock.unlink()  # the operator, once no git of the worker's runs
    assert _delete_ref(str(repo), REF)
    assert git(repo, "for-each-ref") == ""
    assert _locks(repo) == []


def test_w_c7_a_live_git_s_packed_refs_lock_is_never_taken(tmp_path: Path) -> None:
    """W-C7: a ``packed-refs.lock`` of the worker's (a live ``pack-refs``: a file standing for
    it) is git's, even when the runtime's record names a git of its that is gone (a forget
    killed before it took any lock): the forget takes over nothing but its own record, fails
    ``worktree_unreadable`` naming the lock, and leaves the lock and the ref. The task's next
    candidate (an update, not a deletion) does not need that lock and is published."""
    repo = _worktree(tmp_path)
    record = repo / ".git" / "pi-runtime-candidate-t.lock"
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    record.write_text(f"{boot} {2**22 + 1} 1\n")  # a git of ours no live process is
    packed_lock = repo / ".git" / "packed-refs.lock"
    packed_lock.write_bytes(b"")
    with pytest.raises(WorktreeError) as caught:
        _delete_ref(str(repo), REF)
    assert caught.value.code is ReasonCode.WORKTREE_UNREADABLE
    assert f"{packed_lock}': File exists" in str(caught.value)
    assert packed_lock.exists()
    assert record.read_bytes() == b""  # its own record cleared: git exited by itself
    assert git(repo, "for-each-ref", "--format=%(refname)") == REF
    (repo / "a.txt").write_bytes(b"again\n")  # a candidate, an update, never takes that lock
    again = take_candidate(
        repo, take_manifest(repo), archive_dir=tmp_path / "a", task_id="t", message=""
    )
    assert git(repo, "rev-parse", REF) == again.ref
    assert packed_lock.exists()
