"""Adversarial tests of a task's worktree evidence (``docs/design/worktree.md``): the worktree,
its git configuration, its symlinks and the validation check are the worker's, so each test here
plays a worker trying to break one rule — the candidate is exactly the worktree's content, a
check is bounded and killed with everything it started, nothing the worker controls reads
outside its worktree. Real files, real git, real processes; where a race needs the worker to
act at one moment, the test acts at that moment through a wrapper of the runtime's own step."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import pytest
import trio

from runtime._errors import ReasonCode, WorktreeError
from runtime._linux._proctree import is_alive_pid
from runtime._tasks import _candidate, _worktree
from runtime._tasks._candidate import take_candidate
from runtime._tasks._validation import run_validation
from runtime._tasks._worktree import take_manifest

LIMIT: Final = 30.0
SECRET: Final = b"the runtime's secret, outside the worktree\n"


def git(cwd: Path, *args: str) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
    done = subprocess.run(
        ["git", "-c", "user.name=T", "-c", "user.email=t@example.invalid", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        check=True,
    )
    return done.stdout.decode(errors="surrogateescape").strip()


def make_repo(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True)
    git(root, "init", "-q", "-b", "main")
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    return root


def outside(tmp_path: Path) -> Path:
    """A directory beside the worktree holding a file the worker must never get."""
    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "secret.txt").write_bytes(SECRET)
    return secret


def tree_paths(repo: Path, treeish: str) -> list[str]:
    return [p for p in git(repo, "ls-tree", "-r", "--name-only", "-z", treeish).split("\0") if p]


# --- W-M6: the worker's git configuration ------------------------------------------------


def test_w_m6_core_worktree_in_the_workers_config_never_takes_git_outside(
    tmp_path: Path,
) -> None:
    """W-M9 (W-M6): ``core.worktree`` in the worktree's own ``.git/config`` would make every
    git call work on another directory: the manifest's tree, and the candidate commit the
    worker can read back with ``git cat-file``, would hold the runtime's files from outside.
    The runtime names the work tree itself: the tree is the worktree's, wherever the config
    points."""
    secret_dir = outside(tmp_path)
    repo = make_repo(tmp_path / "w", {"mine.txt": b"mine\n"})
    git(repo, "config", "core.worktree", str(secret_dir))

    manifest = take_manifest(repo)
    candidate = take_candidate(repo, manifest, archive_dir=tmp_path / "a", task_id="t", message="")

    assert [f.path for f in manifest.files] == ["mine.txt"]
    assert tree_paths(repo, candidate.ref) == ["mine.txt"]
    assert git(repo, "cat-file", "-p", f"{candidate.ref}:mine.txt") == "mine"


def test_w_m6_hooks_of_every_kind_never_run_for_the_manifest_or_the_candidate(
    tmp_path: Path,
) -> None:
    """W-M6: no hook of the worktree runs, neither from ``.git/hooks`` nor from a
    ``core.hooksPath`` its config names (the command line's ``/dev/null`` wins)."""
    ran = tmp_path / "hook-ran"
    repo = make_repo(tmp_path / "w", {"a.txt": b"a\n"})
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "one", "--no-verify")
    hooks = tmp_path / "their-hooks"
    hooks.mkdir()
    for directory in (repo / ".git" / "hooks", hooks):
        for name in ("reference-transaction", "post-index-change", "pre-commit", "post-commit"):
            hook = directory / name
            hook.write_text(f"#!/bin/sh\necho {name} >> {ran}\n")
            hook.chmod(0o755)
    git(repo, "config", "core.hooksPath", str(hooks))
    (repo / "b.txt").write_text("b\n")

    manifest = take_manifest(repo)
    take_candidate(repo, manifest, archive_dir=tmp_path / "a", task_id="t", message="")

    assert not ran.exists()


# --- W-M4: symlinks, in the tree and in the path -----------------------------------------


@pytest.mark.parametrize("kind", ["files", "git"])
def test_w_m4_a_symlink_to_proc_self_environ_is_kept_as_a_link_never_read(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W-M4, W-C1: a link to ``/proc/self/environ`` (the reader's own environment) or to a
    file outside is recorded by its target string and kept as a link, in an archive and in
    a commit alike: the runtime's environment reaches neither."""
    monkeypatch.setenv("UPSTREAM_API_KEY", "sk-never-in-a-candidate")
    secret_dir = outside(tmp_path)
    files = {"a.txt": b"a\n"}
    root = make_repo(tmp_path / "w", files) if kind == "git" else tmp_path / "w"
    if kind == "files":
        root.mkdir()
        (root / "a.txt").write_bytes(files["a.txt"])
    (root / "env").symlink_to("/proc/self/environ")
    (root / "secret").symlink_to(secret_dir / "secret.txt")
    (root / "dir").symlink_to(secret_dir, target_is_directory=True)

    manifest = take_manifest(root)
    candidate = take_candidate(root, manifest, archive_dir=tmp_path / "a", task_id="t", message="")

    links = {f.path: f for f in manifest.files if f.size == -1}
    assert sorted(links) == ["dir", "env", "secret"]
    assert links["env"].sha256 == hashlib.sha256(b"/proc/self/environ").hexdigest()
    if kind == "files":
        with tarfile.open(candidate.ref) as tar:
            members = {m.name: m for m in tar.getmembers()}
        assert all(members[name].issym() for name in links)
        assert members["env"].linkname == "/proc/self/environ"
        data = Path(candidate.ref).read_bytes()
    else:
        data = git(root, "cat-file", "-p", f"{candidate.ref}:env").encode()
        assert data == b"/proc/self/environ"
    assert b"sk-never-in-a-candidate" not in data
    assert SECRET not in data


def _swap_after_walk(
    monkeypatch: pytest.MonkeyPatch, root: Path, target: Path
) -> Callable[[], None]:
    """The worker's timing: each time the runtime has listed the tree, ``root/sub`` (a
    directory when listed) is swapped for a symlink to ``target``, and swapped back before
    the next listing. Returns the swap back, for the test's own cleanup."""
    real_walk = _worktree._walk
    sub, parked = root / "sub", root.parent / "parked-sub"

    def to_dir() -> None:
        if sub.is_symlink():
            sub.unlink()
            parked.rename(sub)

    def walk(path: str) -> list[str]:
        to_dir()
        found = real_walk(path)
        sub.rename(parked)
        sub.symlink_to(target, target_is_directory=True)
        return found

    monkeypatch.setattr(_worktree, "_walk", walk)
    return to_dir


def test_w_m4_a_directory_swapped_for_a_symlink_after_the_listing_is_never_read_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W-M8 (W-M4): symlinks are never followed — not as a file's last component, nor as a
    directory on its path. ``sub/secret.txt`` is listed as a file of the directory ``sub``;
    by the time it is read, ``sub`` is a link to a directory outside: the manifest must not
    record the outside file's content (its hash and size)."""
    secret_dir = outside(tmp_path)
    root = tmp_path / "w"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "secret.txt").write_bytes(b"the worker's own file\n")
    _swap_after_walk(monkeypatch, root, secret_dir)

    manifest = take_manifest(root)

    secret_sha = hashlib.sha256(SECRET).hexdigest()
    assert all(f.sha256 != secret_sha for f in manifest.files)


def test_w_c1_an_archive_never_holds_a_file_read_through_a_swapped_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W-M8 (W-C1, W-M4): a worker that swaps ``sub`` for a link to a directory outside after
    every listing (and back before the next) would see every read go through the link —
    the manifest's, the archive's, and the check's — and agree: the archive, published,
    would hold the runtime's file. Nothing may be read through the link, so no archive
    holds it; the worktree, seen changing, publishes none."""
    secret_dir = outside(tmp_path)
    root = tmp_path / "w"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "secret.txt").write_bytes(b"the worker's own file\n")
    (root / "a.txt").write_bytes(b"a\n")
    archives = tmp_path / "archives"
    restore = _swap_after_walk(monkeypatch, root, secret_dir)

    try:
        manifest = take_manifest(root)
        candidate = take_candidate(root, manifest, archive_dir=archives, task_id="t", message="")
    finally:
        restore()
    assert os.listdir(archives) == [Path(candidate.ref).name]
    with tarfile.open(candidate.ref) as tar:
        assert tar.getnames() == [f.path for f in manifest.files] == ["a.txt"]
    assert SECRET not in Path(candidate.ref).read_bytes()


# --- odd entries: FIFOs, names, submodules ------------------------------------------------


def test_w_m4_a_fifo_in_a_git_worktree_is_never_opened_and_is_not_content(
    tmp_path: Path,
) -> None:
    """W-M4: a FIFO (which would block a reader forever) in a git worktree is neither opened
    by the runtime nor by git, and is in neither the manifest nor the candidate."""
    repo = make_repo(tmp_path / "w", {"a.txt": b"a\n"})
    os.mkfifo(repo / "pipe")
    os.mkfifo(repo / "pipe.txt")
    (repo / ".gitattributes").write_text("* text\n")

    manifest = take_manifest(repo)
    candidate = take_candidate(repo, manifest, archive_dir=tmp_path / "a", task_id="t", message="")

    assert [f.path for f in manifest.files] == [".gitattributes", "a.txt"]
    assert tree_paths(repo, candidate.ref) == [".gitattributes", "a.txt"]


NAMES: Final = [
    b"new\nline",
    b"tab\there",
    b"bad\xff\xfeutf8",
    b"\xc3\xa9t\xc3\xa9",
    b"back\\slash",
]


@pytest.mark.parametrize("kind", ["files", "git"])
def test_w_c1_names_with_newlines_and_invalid_utf8_survive_byte_for_byte(
    tmp_path: Path, kind: str
) -> None:
    """W-C1, W-M2: a file name is its bytes — a newline, a tab, invalid UTF-8 — in the
    manifest and in the candidate, and renaming one to another changes the digest."""
    root = tmp_path / "w"
    if kind == "git":
        make_repo(root, {})
    else:
        root.mkdir()
    for name in NAMES:
        (root / os.fsdecode(name)).write_bytes(name)

    manifest = take_manifest(root)
    candidate = take_candidate(root, manifest, archive_dir=tmp_path / "a", task_id="t", message="")

    assert sorted(os.fsencode(f.path) for f in manifest.files) == sorted(NAMES)
    if kind == "files":
        with tarfile.open(candidate.ref, encoding="utf-8", errors="surrogateescape") as tar:
            got = {}
            for member in tar.getmembers():
                extracted = tar.extractfile(member)
                assert extracted is not None
                got[os.fsencode(member.name)] = extracted.read()
    else:
        got = {
            os.fsencode(path): git(root, "cat-file", "-p", f"{candidate.ref}:{path}").encode(
                errors="surrogateescape"
            )
            for path in tree_paths(root, candidate.ref)
        }
    assert got == {name: name for name in NAMES}
    (root / os.fsdecode(b"bad\xff\xfeutf8")).rename(root / os.fsdecode(b"bad\xff\xfdutf8"))
    assert take_manifest(root).digest != manifest.digest


# --- W-C2: a write while the candidate is taken -------------------------------------------


def test_w_c2_a_write_in_the_middle_of_archiving_a_file_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W-C2: the worker (or a check it left) writes a file while the archive is being
    written — after its first chunk was read, keeping its size. Nothing is published."""
    root = tmp_path / "w"
    root.mkdir()
    big = root / "big.bin"
    big.write_bytes(b"\0" * (3 * 1024 * 1024))
    manifest = take_manifest(root)
    real_read = _candidate._HashingReader.read

    def read(self: _candidate._HashingReader, size: int = -1) -> bytes:
        chunk = real_read(self, size)
        if self.count and self.count == len(chunk):  # the first chunk: now the worker writes
            with open(big, "r+b") as f:
                f.seek(2 * 1024 * 1024)
                f.write(b"late")
        return chunk

    monkeypatch.setattr(_candidate._HashingReader, "read", read)
    archives = tmp_path / "archives"
    with pytest.raises(WorktreeError) as caught:
        take_candidate(root, manifest, archive_dir=archives, task_id="t", message="")
    assert caught.value.code is ReasonCode.WORKTREE_CHANGED
    assert os.listdir(archives) == []


# --- W-V2: a check that leaves its process group ------------------------------------------


DAEMON: Final = """
import os, sys, time
if os.fork() == 0:
    os.setsid()  # leaves the check's process group and session
    if os.fork() == 0:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        time.sleep(600)
        os._exit(0)
    os._exit(0)
os.wait()
print("daemon", flush=True)
"""


def _daemon_pids(marker: str) -> list[int]:
    """Live processes whose command line carries ``marker`` (what the check left)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read() and is_alive_pid(int(name)):
                    found.append(int(name))
        except OSError:
            continue
    return found


@pytest.fixture
def reap_daemons() -> Iterator[str]:
    """A marker for the test's daemons; whatever carries it is killed after the test."""
    marker = f"pi-runtime-test-daemon-{os.getpid()}-{os.urandom(4).hex()}"
    yield marker
    for pid in _daemon_pids(marker):
        os.kill(pid, signal.SIGKILL)


async def test_w_v2_a_daemon_the_check_started_with_setsid_does_not_outlive_it(
    tmp_path: Path, reap_daemons: str
) -> None:
    """W-V4 (W-V2): a check that double-forks a daemon into a session of its own (``setsid``, its
    output on ``/dev/null``) has left its process group; the check is still killed with
    everything it started, so nothing of it runs on after the receipt (writing into the
    worktree after the candidate was taken, holding a port, spending the host's CPU)."""
    root = tmp_path / "w"
    root.mkdir()
    manifest = take_manifest(root)
    command = [sys.executable, "-c", DAEMON, reap_daemons]
    with trio.fail_after(LIMIT):
        receipt = await run_validation(root, command, manifest, timeout=LIMIT)
    assert receipt.passed, receipt.output_tail
    assert receipt.output_tail == "daemon\n"
    assert _daemon_pids(reap_daemons) == []


def test_w_m2_a_change_inside_a_nested_repository_changes_the_digest(tmp_path: Path) -> None:
    """W-M10 (W-M2, W-M3): a nested repository (a submodule, or a clone the worker made inside its
    worktree) is a commit id in git's tree; a file edited, added or removed in it — nothing
    committed — must still change the digest, or a tree that changed after its manifest (or
    after its validation began) would pass for the same tree."""
    repo = make_repo(tmp_path / "w", {"a.txt": b"a\n"})
    nested = make_repo(repo / "sub", {"in.txt": b"one\n"})
    git(nested, "add", "-A")
    git(nested, "commit", "-qm", "nested")
    manifest = take_manifest(repo)
    assert "sub/in.txt" in [f.path for f in manifest.files]
    digests = {manifest.digest}
    for change in (
        lambda: (nested / "in.txt").write_bytes(b"two\n"),
        lambda: (nested / "new.txt").write_bytes(b""),
        lambda: (nested / "in.txt").unlink(),
    ):
        change()
        digest = take_manifest(repo).digest
        assert digest not in digests
        digests.add(digest)
