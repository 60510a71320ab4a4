"""Adversarial tests of a worker's own ``.git`` (``docs/design/worktree.md`` W-M13, W-M6): the
worker writes anything in its worktree, its repository included, and the runtime then runs git
there (the manifest, the candidate, ``task forget``'s deletion). A symlink inside that ``.git``
or an ``alternates`` file would take the runtime's git to another repository — another task's,
the operator's — or to any file the runtime may write. Real git, real files, real links."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest

from runtime._errors import ReasonCode, WorktreeError
from runtime._tasks._candidate import CANDIDATE_REF_PREFIX, take_candidate
from runtime._tasks._retention import _delete_ref
from runtime._tasks._worktree import take_manifest

from .test_worktree_adversarial import git, make_repo

REF: Final = CANDIDATE_REF_PREFIX + "t"


def _other(tmp_path: Path) -> Path:
    """Another repository on the host (another task's, the operator's), with a commit."""
    other = make_repo(tmp_path / "other", {"theirs.txt": b"theirs\n"})
    git(other, "add", "-A")
    git(other, "commit", "-qm", "theirs")
    return other


def _worker(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "w", {"mine.txt": b"mine, never another repository's\n"})


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` and its content: what a write there would change."""
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and not path.is_symlink()
    }


def _candidate(repo: Path, tmp_path: Path) -> None:
    manifest = take_manifest(repo)
    take_candidate(repo, manifest, archive_dir=tmp_path / "a", task_id="t", message="")


def _link(how: str, repo: Path, other: Path, victim: Path) -> None:
    """Plant one link inside the worker's ``.git`` that git would write through."""
    dot = repo / ".git"
    if how == "objects":  # every object the manifest and the candidate write
        (dot / "objects").rename(dot / "objects.own")
        (dot / "objects").symlink_to(other / ".git" / "objects")
    elif how == "objects-fan-out":  # one fan-out directory: the worker's file's blob
        blob = git(repo, "hash-object", "mine.txt")
        (other / ".git" / "objects" / blob[:2]).mkdir(exist_ok=True)
        (dot / "objects" / blob[:2]).symlink_to(other / ".git" / "objects" / blob[:2])
    elif how == "objects-pack":  # a big file (by the worker's threshold) is written as a pack
        git(repo, "config", "core.bigFileThreshold", "1")
        (dot / "objects" / "pack").rmdir()
        (dot / "objects" / "pack").symlink_to(other / ".git" / "objects" / "pack")
    elif how == "refs":  # the candidate's ref
        (other / ".git" / "refs" / "pi-runtime").mkdir()
        (dot / "refs" / "pi-runtime").symlink_to(other / ".git" / "refs" / "pi-runtime")
    elif how == "reflog":  # git appends to an existing reflog, through a link: any file
        logs = dot / "logs" / "refs" / "pi-runtime" / "candidates"
        logs.mkdir(parents=True)
        (logs / "t").symlink_to(victim)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["objects", "objects-fan-out", "objects-pack", "refs", "reflog"])
def test_w_m13_a_link_inside_the_workers_git_never_takes_the_runtimes_git_outside(
    tmp_path: Path, how: str
) -> None:
    """W-M13: a symlink in the worker's ``.git`` — ``objects``, one of its fan-out directories,
    ``objects/pack``, ``refs/pi-runtime``, the candidate ref's reflog — made the runtime's git
    write the worker's files as objects, the candidate commit and its ref into another
    repository (its ``for-each-ref`` then fails on a ref to an object it lacks), or append a
    line to any file the runtime may write. Refused ``worktree_unreadable``, before any git of
    the runtime's writes; the other repository and the file are unchanged."""
    other = _other(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the operator's file\n")
    repo = _worker(tmp_path)
    _link(how, repo, other, victim)
    theirs = _snapshot(other)

    with pytest.raises(WorktreeError) as caught:
        _candidate(repo, tmp_path)

    assert caught.value.code is ReasonCode.WORKTREE_UNREADABLE
    assert "symlink" in str(caught.value)
    assert _snapshot(other) == theirs
    assert victim.read_bytes() == b"the operator's file\n"


@pytest.mark.parametrize("how", ["packed-refs", "logs"])
def test_w_m13_forget_never_rewrites_or_deletes_through_a_link(tmp_path: Path, how: str) -> None:
    """W-M13 (RT12): a link planted after the candidate was taken — ``packed-refs`` naming
    another repository's, where the same ref is packed, or ``logs/refs/pi-runtime`` a directory
    outside — made ``task forget``'s deletion rewrite that repository's ``packed-refs`` (its ref
    gone) or unlink a file outside (the operator's ``candidates/t``). Refused
    ``worktree_unreadable``; nothing outside changed, the worker's ref kept."""
    other = _other(tmp_path)
    repo = _worker(tmp_path)
    _candidate(repo, tmp_path)
    dot = repo / ".git"
    if how == "packed-refs":
        git(other, "update-ref", REF, "HEAD")
        git(other, "pack-refs", "--all")
        (dot / "packed-refs").symlink_to(other / ".git" / "packed-refs")
    else:
        precious = tmp_path / "operator" / "candidates"
        precious.mkdir(parents=True)
        (precious / "t").write_bytes(b"precious\n")
        (dot / "logs" / "refs").mkdir(parents=True, exist_ok=True)
        (dot / "logs" / "refs" / "pi-runtime").symlink_to(tmp_path / "operator")
    theirs = _snapshot(tmp_path / "operator") if how == "logs" else _snapshot(other)

    with pytest.raises(WorktreeError) as caught:
        _delete_ref(str(repo), REF)

    assert caught.value.code is ReasonCode.WORKTREE_UNREADABLE
    assert (_snapshot(tmp_path / "operator") if how == "logs" else _snapshot(other)) == theirs
    assert (dot / "refs" / "pi-runtime" / "candidates" / "t").exists()


def test_w_m13_alternates_naming_another_repository_is_refused(tmp_path: Path) -> None:
    """W-M13: ``objects/info/alternates`` naming another repository's objects, and ``HEAD`` at
    one of its commits, made the manifest read that repository's tree and the candidate a
    commit parented on its history: the candidate ref then reaches objects that live outside
    the worktree (its history, its files) and that vanish when that repository is cleaned.
    Refused ``worktree_unreadable``; no candidate ref."""
    other = _other(tmp_path)
    repo = _worker(tmp_path)
    alternates = repo / ".git" / "objects" / "info" / "alternates"
    alternates.write_text(f"{other / '.git' / 'objects'}\n")
    (repo / ".git" / "refs" / "heads" / "main").write_text(git(other, "rev-parse", "HEAD") + "\n")

    with pytest.raises(WorktreeError) as caught:
        _candidate(repo, tmp_path)

    assert caught.value.code is ReasonCode.WORKTREE_UNREADABLE
    assert "alternates" in str(caught.value)
    assert not (repo / ".git" / "refs" / "pi-runtime").exists()


def test_w_m13_a_symlinked_hooks_directory_is_left_alone_and_never_run(tmp_path: Path) -> None:
    """W-M13, W-M6: ``hooks`` is the one link a repository may hold (a shared hooks directory
    is common): the runtime's git never runs a hook (``core.hooksPath=/dev/null``), so a
    repository whose ``hooks`` names a directory outside gets its candidate, and the
    ``reference-transaction`` hook there (``update-ref`` runs it) does not run."""
    ran = tmp_path / "hook-ran"
    shared = tmp_path / "shared-hooks"
    shared.mkdir()
    hook = shared / "reference-transaction"
    hook.write_text(f"#!/bin/sh\necho ran >> {ran}\n")
    hook.chmod(0o755)
    repo = _worker(tmp_path)
    hooks = repo / ".git" / "hooks"
    for sample in hooks.iterdir():
        sample.unlink()
    hooks.rmdir()
    hooks.symlink_to(shared)

    _candidate(repo, tmp_path)

    assert git(repo, "for-each-ref", "--format=%(refname)") == REF
    assert not ran.exists()


def test_w_m6_the_workers_fsmonitor_never_runs(tmp_path: Path) -> None:
    """W-M6: ``core.fsmonitor`` naming a program makes ``git add`` and ``write-tree`` run it
    (git 2.39 does, four times for a manifest): the command line's ``core.fsmonitor=false``
    wins, so the worker's program never runs in the runtime's git."""
    ran = tmp_path / "fsmonitor-ran"
    program = tmp_path / "fsmonitor"
    program.write_text(f"#!/bin/sh\necho ran >> {ran}\nexit 1\n")
    program.chmod(0o755)
    repo = _worker(tmp_path)
    git(repo, "config", "core.fsmonitor", str(program))

    _candidate(repo, tmp_path)

    assert git(repo, "for-each-ref", "--format=%(refname)") == REF
    assert not ran.exists()


@pytest.mark.parametrize("variable", ["GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES"])
def test_w_m6_the_runtimes_own_git_variables_never_reach_its_git(
    tmp_path: Path, variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W-M6: the runtime's git gets ``PATH`` and none of the runtime's own variables, so a
    ``GIT_OBJECT_DIRECTORY`` in the runtime's environment (its operator's shell) never sends
    the worker's objects to another repository, nor ``GIT_ALTERNATE_OBJECT_DIRECTORIES`` lets
    the manifest see another repository's commit (the worker's ``HEAD`` names one): the
    manifest has no ``HEAD``, every object of the candidate is the worktree's own, the other
    repository is unchanged."""
    other = _other(tmp_path)
    repo = _worker(tmp_path)
    (repo / ".git" / "refs" / "heads" / "main").write_text(git(other, "rev-parse", "HEAD") + "\n")
    theirs = _snapshot(other)
    monkeypatch.setenv(variable, str(other / ".git" / "objects"))

    manifest = take_manifest(repo)
    take_candidate(repo, manifest, archive_dir=tmp_path / "a", task_id="t", message="")
    monkeypatch.delenv(variable)

    assert manifest.head is None
    assert git(repo, "rev-list", "--objects", REF).count("\n") == 2  # commit, tree, blob
    assert _snapshot(other) == theirs
