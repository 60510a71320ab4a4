"""A task's worktree evidence (``runtime/_tasks/_worktree.py``, ``_candidate.py``,
``_validation.py``): tests named after the invariants W-M1…, W-C1… and W-V1… of
``docs/design/worktree.md``, on real files, real git repositories and real child processes
(so the real clock with short bounds)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

import msgspec
import pytest
import trio
import trio.lowlevel

from runtime._errors import ReasonCode, WorktreeError
from runtime._linux._proctree import is_alive_pid
from runtime._tasks import _worktree
from runtime._tasks._candidate import CANDIDATE_REF_PREFIX, Candidate, acandidate, take_candidate
from runtime._tasks._validation import (
    OUTPUT_TAIL_BYTES,
    VALIDATION_ENV,
    ValidationReceipt,
    run_validation,
)
from runtime._tasks._worktree import Manifest, amanifest, take_manifest, worktree_stamp

LIMIT: Final = 30.0
TREE: Final[Mapping[str, bytes]] = {
    "README.md": b"# task\n",
    "src/main.py": b"print('hello')\n",
    "src/pkg/__init__.py": b"",
    "data/blob.bin": bytes(range(256)) * 64,
}


def write_tree(root: Path, files: Mapping[str, bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return root


def git(cwd: Path, *args: str) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
    done = subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, check=True, text=True
    )
    return done.stdout.strip()


def make_repo(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.name", "Test")
    git(root, "config", "user.email", "test@example.invalid")
    git(root, "config", "commit.gpgsign", "false")
    return root


def commit_all(root: Path, message: str = "commit") -> str:
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)
    return git(root, "rev-parse", "HEAD")


def head_of(root: Path) -> str:
    """HEAD's commit id, or "" on an unborn branch."""
    done = subprocess.run(
        ["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=root, capture_output=True, text=True
    )
    return done.stdout.strip()


def user_state(root: Path) -> tuple[str, bytes, str, str, str]:
    """What the user sees of a repository: status, index bytes, HEAD, branch, refs."""
    index = root / ".git" / "index"
    return (
        git(root, "status", "--porcelain", "--untracked-files=all"),
        index.read_bytes() if index.exists() else b"",
        head_of(root),
        git(root, "symbolic-ref", "HEAD"),
        git(root, "for-each-ref", "--format=%(refname) %(objectname)", "refs/heads", "refs/tags"),
    )


def scratch_tree_id(repo: Path, scratch: Path) -> str:
    """What ``git add -A && git write-tree`` gives in a clone carrying repo's worktree."""
    git(repo.parent, "clone", "-q", str(repo), str(scratch))
    for child in scratch.iterdir():
        if child.name != ".git":
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    shutil.copytree(
        repo, scratch, symlinks=True, ignore=shutil.ignore_patterns(".git"), dirs_exist_ok=True
    )
    git(scratch, "add", "-A")
    return git(scratch, "write-tree")


def tar_members(path: Path) -> list[tarfile.TarInfo]:
    with tarfile.open(path) as tar:
        return tar.getmembers()


# --- the manifest: W-M1…W-M5 ---------------------------------------------------------


def test_wm1_same_tree_same_digest_twice_and_in_a_copy_elsewhere(tmp_path: Path) -> None:
    """The digest depends on the content only: twice in a row, and for a copy of the tree
    in another directory (the root is recorded, but is not part of the digest)."""
    first = write_tree(tmp_path / "a" / "work", TREE)
    (first / "link").symlink_to("src/main.py")
    copy = tmp_path / "b" / "elsewhere"
    shutil.copytree(first, copy, symlinks=True)

    one, two, other = take_manifest(first), take_manifest(first), take_manifest(copy)

    assert one == two
    assert one.kind == "files"
    assert one.git_tree is None
    assert one.head is None
    assert one.root == str(first)
    assert other.root == str(copy)
    assert other.digest == one.digest
    assert other.files == one.files
    assert [f.path for f in one.files] == sorted([*TREE, "link"])
    blob = next(f for f in one.files if f.path == "data/blob.bin")
    assert blob.size == len(TREE["data/blob.bin"])
    assert blob.sha256 == hashlib.sha256(TREE["data/blob.bin"]).hexdigest()


def test_wm1_a_large_file_is_hashed_whole(tmp_path: Path) -> None:
    """Files are read in chunks, but every byte counts (a change in the last chunk too)."""
    content = os.urandom(3 * 1024 * 1024 + 17)
    root = write_tree(tmp_path / "work", {"big.bin": content})
    entry = take_manifest(root).files[0]
    assert (entry.size, entry.sha256) == (len(content), hashlib.sha256(content).hexdigest())
    before = take_manifest(root).digest
    (root / "big.bin").write_bytes(content[:-1] + bytes([content[-1] ^ 1]))
    assert take_manifest(root).digest != before


def _edit(path: str, content: bytes) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        (root / path).write_bytes(content)

    return change


def _rename(src: str, dst: str) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        (root / src).rename(root / dst)

    return change


def _delete(path: str) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        (root / path).unlink()

    return change


def _retarget(path: str, target: str) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        (root / path).unlink()
        (root / path).symlink_to(target)

    return change


def _link_to_file(path: str) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        target = os.readlink(root / path)
        (root / path).unlink()
        (root / path).write_bytes(target.encode())

    return change


CHANGES: Final[Mapping[str, Callable[[Path], None]]] = {
    "content": _edit("src/main.py", b"print('goodbye')\n"),
    "same_size_content": _edit("src/main.py", b"print('HELLO')\n"),
    "empty_file_filled": _edit("src/pkg/__init__.py", b"\n"),
    "rename": _rename("README.md", "README.txt"),
    "move_to_other_dir": _rename("README.md", "src/README.md"),
    "new_file": _edit("src/new.py", b""),
    "deletion": _delete("data/blob.bin"),
    "symlink_target": _retarget("link", "README.md"),
    "symlink_replaced_by_file": _link_to_file("link"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_wm2_every_change_changes_the_digest(tmp_path: Path, change: str) -> None:
    root = write_tree(tmp_path / "work", TREE)
    (root / "link").symlink_to("src/main.py")
    before = take_manifest(root)
    CHANGES[change](root)
    after = take_manifest(root)
    assert after.digest != before.digest
    assert after.files != before.files


def test_wm2_distinct_changes_give_distinct_digests(tmp_path: Path) -> None:
    digests = set()
    for name, change in CHANGES.items():
        root = write_tree(tmp_path / name, TREE)
        (root / "link").symlink_to("src/main.py")
        change(root)
        digests.add(take_manifest(root).digest)
    assert len(digests) == len(CHANGES)


def test_wm4_symlinks_are_recorded_never_followed_fifos_and_dot_git_skipped(
    tmp_path: Path,
) -> None:
    outside = write_tree(tmp_path / "outside", {"secret.txt": b"not in the worktree"})
    root = write_tree(tmp_path / "work", {"a.txt": b"a", "sub/.git/config": b"[core]\n"})
    (root / "to_file").symlink_to(outside / "secret.txt")
    (root / "to_dir").symlink_to(outside, target_is_directory=True)
    (root / "dangling").symlink_to("nowhere")
    os.mkfifo(root / "pipe")  # opening it would block: it must never be opened

    manifest = take_manifest(root)

    by_path = {f.path: f for f in manifest.files}
    assert sorted(by_path) == ["a.txt", "dangling", "to_dir", "to_file"]
    for name in ("to_file", "to_dir", "dangling"):
        target = os.readlink(root / name).encode()
        assert by_path[name].size == -1
        assert by_path[name].sha256 == hashlib.sha256(target).hexdigest()
    (outside / "secret.txt").write_bytes(b"changed outside")
    assert take_manifest(root).digest == manifest.digest


def test_wm5_a_missing_root_is_worktree_missing(tmp_path: Path) -> None:
    with pytest.raises(WorktreeError) as missing:
        take_manifest(tmp_path / "nope")
    assert missing.value.code == ReasonCode.WORKTREE_MISSING
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(WorktreeError) as not_dir:
        take_manifest(tmp_path / "file")
    assert not_dir.value.code == ReasonCode.WORKTREE_MISSING


def test_wm5_a_git_worktree_git_cannot_read_is_worktree_unreadable(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "work", {"a.txt": b"a"})
    (root / ".git").write_text(f"gitdir: {tmp_path / 'gone'}\n")
    with pytest.raises(WorktreeError) as caught:
        take_manifest(root)
    assert caught.value.code == ReasonCode.WORKTREE_UNREADABLE
    assert "git rev-parse failed" in caught.value.message


async def test_wm5_amanifest_runs_off_the_loop_with_the_same_result(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "work", TREE)
    with trio.fail_after(LIMIT):
        manifest = await amanifest(root)
        with pytest.raises(WorktreeError) as caught:
            await amanifest(tmp_path / "nope")
    assert manifest == take_manifest(root)
    assert caught.value.code == ReasonCode.WORKTREE_MISSING


# --- git worktrees: W-M3 ------------------------------------------------------------


def dirty_repo(root: Path) -> Path:
    """A repository with a commit, a staged change, a modified file, an untracked file,
    an ignored file and a deleted file."""
    make_repo(root)
    write_tree(root, {**TREE, ".gitignore": b"*.log\nbuild/\n", "gone.txt": b"x"})
    commit_all(root)
    write_tree(root, {"README.md": b"# staged\n"})
    git(root, "add", "README.md")
    write_tree(
        root,
        {
            "README.md": b"# staged, then modified\n",
            "src/main.py": b"print('modified')\n",
            "src/untracked.py": b"new = True\n",
            "debug.log": b"ignored\n",
            "build/out.o": b"ignored\n",
        },
    )
    (root / "gone.txt").unlink()
    return root


def test_wm3_git_tree_is_the_working_tree_with_untracked_files_and_the_index_is_untouched(
    tmp_path: Path,
) -> None:
    repo = dirty_repo(tmp_path / "repo")
    before = user_state(repo)

    manifest = take_manifest(repo)

    assert user_state(repo) == before
    assert manifest.kind == "git"
    assert manifest.head == git(repo, "rev-parse", "HEAD")
    assert manifest.git_tree == scratch_tree_id(repo, tmp_path / "scratch")
    assert [f.path for f in manifest.files] == [
        ".gitignore",
        "README.md",
        "data/blob.bin",
        "src/main.py",
        "src/pkg/__init__.py",
        "src/untracked.py",
    ]
    main = next(f for f in manifest.files if f.path == "src/main.py")
    assert main.sha256 == hashlib.sha256(b"print('modified')\n").hexdigest()
    assert take_manifest(repo) == manifest  # W-M1 for git too


def test_wm3_an_unborn_branch_has_no_head(tmp_path: Path) -> None:
    repo = write_tree(make_repo(tmp_path / "repo"), TREE)
    before = user_state(repo)
    manifest = take_manifest(repo)
    assert user_state(repo) == before
    assert manifest.head is None
    assert manifest.git_tree == scratch_tree_id_unborn(repo, tmp_path / "index")


def scratch_tree_id_unborn(repo: Path, index: Path) -> str:
    env = {**os.environ, "GIT_INDEX_FILE": str(index)}
    subprocess.run(["git", "add", "-A"], cwd=repo, env=env, check=True)
    done = subprocess.run(
        ["git", "write-tree"], cwd=repo, env=env, check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def test_wm3_ignored_output_leaves_the_digest_a_tracked_change_or_commit_moves_it(
    tmp_path: Path,
) -> None:
    repo = dirty_repo(tmp_path / "repo")
    manifest = take_manifest(repo)
    write_tree(repo, {"build/more.o": b"x", "other.log": b"y"})
    assert take_manifest(repo).digest == manifest.digest
    write_tree(repo, {"src/untracked.py": b"new = False\n"})
    changed = take_manifest(repo)
    assert changed.digest != manifest.digest
    assert changed.git_tree != manifest.git_tree
    commit_all(repo)
    committed = take_manifest(repo)
    assert committed.git_tree == changed.git_tree
    assert committed.digest != changed.digest  # HEAD is part of the digest


# --- git candidates: W-C1…W-C3, W-C5 --------------------------------------------------


def test_wc1_wc3_a_git_candidate_is_a_reachable_commit_of_the_manifest_tree(
    tmp_path: Path,
) -> None:
    repo = dirty_repo(tmp_path / "repo")
    before = user_state(repo)
    manifest = take_manifest(repo)

    candidate = take_candidate(
        repo, manifest, archive_dir=tmp_path / "unused", task_id="task-1", message="Done: x"
    )

    assert user_state(repo) == before
    assert not (tmp_path / "unused").exists()
    assert candidate.kind == "git_commit"
    assert candidate.sha256 is None
    assert candidate.manifest_digest == manifest.digest
    assert candidate.git_ref == CANDIDATE_REF_PREFIX + "task-1"
    assert git(repo, "rev-parse", candidate.git_ref) == candidate.ref
    assert git(repo, "rev-parse", f"{candidate.ref}^{{tree}}") == manifest.git_tree
    assert git(repo, "rev-parse", f"{candidate.ref}^") == manifest.head
    body = git(repo, "log", "-1", "--format=%an <%ae>|%cn <%ce>|%B", candidate.ref)
    assert body.startswith("pi-runtime <pi-runtime@localhost>|pi-runtime <pi-runtime@localhost>|")
    assert "Done: x" in body
    assert f"Pi-Runtime-Manifest: {manifest.digest}" in body
    # kept from garbage collection by its ref
    git(repo, "gc", "-q", "--prune=now")
    assert git(repo, "cat-file", "-t", candidate.ref) == "commit"
    # the same manifest gives the same commit
    again = take_candidate(
        repo, manifest, archive_dir=tmp_path / "unused", task_id="task-1", message="Done: x"
    )
    assert again == candidate
    assert user_state(repo) == before


def test_wc3_an_unsafe_task_id_gives_a_valid_distinct_ref(tmp_path: Path) -> None:
    repo = write_tree(make_repo(tmp_path / "repo"), TREE)  # unborn: a root commit
    manifest = take_manifest(repo)
    refs = set()
    for task_id in ("room/1 task..x", "room_1_task__x", "-lead.lock"):
        candidate = take_candidate(
            repo, manifest, archive_dir=tmp_path, task_id=task_id, message=""
        )
        assert candidate.git_ref is not None
        git(repo, "check-ref-format", candidate.git_ref)
        assert git(repo, "rev-parse", candidate.git_ref) == candidate.ref
        refs.add(candidate.git_ref)
    assert len(refs) == 3
    assert git(repo, "rev-list", "--parents", "-n1", candidate.ref) == candidate.ref


def test_wc5_a_git_failure_is_checkpoint_failed_with_gits_stderr(tmp_path: Path) -> None:
    repo = write_tree(make_repo(tmp_path / "repo"), TREE)
    manifest = msgspec.structs.replace(take_manifest(repo), git_tree="0" * 40)
    with pytest.raises(WorktreeError) as caught:
        take_candidate(repo, manifest, archive_dir=tmp_path, task_id="t", message="m")
    assert caught.value.code == ReasonCode.CHECKPOINT_FAILED
    assert "commit-tree" in caught.value.message
    assert "0" * 40 in caught.value.message
    assert git(repo, "for-each-ref", "refs/pi-runtime") == ""


# --- archive candidates: W-C1, W-C4 ---------------------------------------------------


def archive_tree(root: Path) -> Path:
    write_tree(root, TREE)
    (root / "src" / "main.py").chmod(0o755)
    (root / "link").symlink_to("src/main.py")
    return root


def test_wc4_an_archive_is_deterministic_and_idempotent(tmp_path: Path) -> None:
    root = archive_tree(tmp_path / "work")
    store = tmp_path / "store"
    manifest = take_manifest(root)

    first = take_candidate(
        root, manifest, archive_dir=store / "archives", task_id="t-1", message="m", store_root=store
    )
    second = take_candidate(
        root, manifest, archive_dir=store / "archives", task_id="t-1", message="m", store_root=store
    )

    assert first == second
    assert first.kind == "archive"
    assert first.manifest_digest == manifest.digest
    assert first.ref == f"archives/t-1-{manifest.digest[:16]}.tar"
    assert os.listdir(store / "archives") == [Path(first.ref).name]  # one file, no temp left
    archive = store / first.ref
    assert hashlib.sha256(archive.read_bytes()).hexdigest() == first.sha256
    # the same content elsewhere archives to the same bytes
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, symlinks=True)
    elsewhere = take_candidate(
        copy, take_manifest(copy), archive_dir=tmp_path / "other", task_id="t-1", message="m"
    )
    assert elsewhere.sha256 == first.sha256
    assert elsewhere.ref == str(tmp_path / "other" / Path(first.ref).name)


def test_wc1_wc4_the_archive_holds_exactly_the_manifest(tmp_path: Path) -> None:
    root = archive_tree(tmp_path / "work")
    manifest = take_manifest(root)
    candidate = take_candidate(root, manifest, archive_dir=tmp_path / "a", task_id="t", message="")
    members = tar_members(Path(candidate.ref))

    assert [m.name for m in members] == [f.path for f in manifest.files]
    assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 for m in members)
    assert all(m.uname == "" and m.gname == "" for m in members)
    modes = {m.name: m.mode for m in members}
    assert modes["src/main.py"] == 0o755
    assert modes["README.md"] == (root / "README.md").stat().st_mode & 0o777
    link = next(m for m in members if m.name == "link")
    assert link.issym()
    assert link.linkname == "src/main.py"
    with tarfile.open(candidate.ref) as tar:
        for path, content in TREE.items():
            extracted = tar.extractfile(path)
            assert extracted is not None
            assert extracted.read() == content


def test_wc4_an_archive_in_place_with_other_bytes_is_replaced(tmp_path: Path) -> None:
    root = archive_tree(tmp_path / "work")
    manifest = take_manifest(root)
    candidate = take_candidate(root, manifest, archive_dir=tmp_path / "a", task_id="t", message="")
    Path(candidate.ref).write_bytes(b"torn")
    again = take_candidate(root, manifest, archive_dir=tmp_path / "a", task_id="t", message="")
    assert again == candidate
    assert hashlib.sha256(Path(again.ref).read_bytes()).hexdigest() == candidate.sha256


# --- a worktree that changed: W-C2 ----------------------------------------------------


@pytest.mark.parametrize("change", ["content", "new_file", "deletion", "symlink_target"])
def test_wc2_a_files_worktree_changed_after_its_manifest_publishes_no_archive(
    tmp_path: Path, change: str
) -> None:
    root = write_tree(tmp_path / "work", TREE)
    (root / "link").symlink_to("src/main.py")
    manifest = take_manifest(root)
    CHANGES[change](root)
    archives = tmp_path / "archives"
    with pytest.raises(WorktreeError) as caught:
        take_candidate(root, manifest, archive_dir=archives, task_id="t", message="m")
    assert caught.value.code == ReasonCode.WORKTREE_CHANGED
    assert os.listdir(archives) == []


def test_wc2_a_git_worktree_changed_after_its_manifest_moves_no_ref(tmp_path: Path) -> None:
    repo = dirty_repo(tmp_path / "repo")
    manifest = take_manifest(repo)
    write_tree(repo, {"src/late.py": b"late = True\n"})
    with pytest.raises(WorktreeError) as caught:
        take_candidate(repo, manifest, archive_dir=tmp_path, task_id="t", message="m")
    assert caught.value.code == ReasonCode.WORKTREE_CHANGED
    assert git(repo, "for-each-ref", "refs/pi-runtime") == ""


def test_wc2_a_worktree_that_became_a_repository_is_changed(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "work", TREE)
    manifest = take_manifest(root)
    make_repo(root)
    with pytest.raises(WorktreeError) as caught:
        take_candidate(root, manifest, archive_dir=tmp_path / "a", task_id="t", message="m")
    assert caught.value.code == ReasonCode.WORKTREE_CHANGED


async def test_wc2_acandidate_runs_off_the_loop_and_a_missing_root_is_missing(
    tmp_path: Path,
) -> None:
    root = write_tree(tmp_path / "work", TREE)
    with trio.fail_after(LIMIT):
        manifest = await amanifest(root)
        candidate = await acandidate(
            root, manifest, archive_dir=tmp_path / "a", task_id="t", message="m"
        )
        shutil.rmtree(root)
        with pytest.raises(WorktreeError) as caught:
            await acandidate(root, manifest, archive_dir=tmp_path / "a", task_id="t", message="m")
    assert isinstance(candidate, Candidate)
    assert await trio.Path(candidate.ref).exists()
    assert caught.value.code == ReasonCode.WORKTREE_MISSING


# --- validation: W-V1…W-V3 ------------------------------------------------------------


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.fixture
def manifest(tmp_path: Path) -> Manifest:
    return take_manifest(write_tree(tmp_path / "work", TREE))


async def test_wv1_a_passing_check_is_receipted_against_the_manifest(
    tmp_path: Path, manifest: Manifest
) -> None:
    code = "import os, sys; print(os.getcwd()); print(repr(sys.stdin.read()))"
    with trio.fail_after(LIMIT):
        receipt = await run_validation(Path(manifest.root), python(code), manifest, timeout=LIMIT)
    assert receipt.passed
    assert receipt.exit_status == 0
    assert receipt.command == tuple(python(code))
    assert receipt.manifest_digest == manifest.digest
    assert receipt.output_tail == f"{manifest.root}\n''\n"  # cwd is the worktree; stdin empty
    assert receipt.duration_ms >= 0


async def test_wv1_the_receipt_names_the_tree_the_check_ran_on_not_the_one_it_was_given(
    manifest: Manifest,
) -> None:
    """The digest is taken when the check starts, never copied from the manifest handed in:
    a tree changed in between gives another digest, so the Done tuple's "same manifest"
    check can fail (LK4)."""
    (Path(manifest.root) / "changed-after-the-manifest.txt").write_text("new\n")
    with trio.fail_after(LIMIT):
        receipt = await run_validation(Path(manifest.root), python("pass"), manifest, timeout=LIMIT)
    assert receipt.passed
    assert receipt.manifest_digest != manifest.digest
    assert receipt.manifest_digest == take_manifest(Path(manifest.root)).digest


async def test_wv1_a_failing_check_keeps_its_status_and_output_tail(manifest: Manifest) -> None:
    code = (
        "import sys; sys.stdout.write('x' * 10000); sys.stdout.flush();"
        "sys.stderr.write('\\u00e9 FAILED at the end'); sys.exit(3)"
    )
    with trio.fail_after(LIMIT):
        receipt = await run_validation(Path(manifest.root), python(code), manifest, timeout=LIMIT)
    assert not receipt.passed
    assert receipt.exit_status == 3
    assert receipt.output_tail.endswith("\u00e9 FAILED at the end")
    assert len(receipt.output_tail.encode()) <= OUTPUT_TAIL_BYTES
    assert receipt.output_tail.startswith("xxx")


async def test_wv1_a_command_that_cannot_start_is_a_failed_receipt(manifest: Manifest) -> None:
    with trio.fail_after(LIMIT):
        receipt = await run_validation(
            Path(manifest.root), ["/nonexistent/check"], manifest, timeout=LIMIT
        )
    assert receipt.exit_status == 127
    assert not receipt.passed
    assert receipt.output_tail.startswith("cannot start /nonexistent/check")


async def test_wv1_a_missing_root_is_worktree_missing(tmp_path: Path, manifest: Manifest) -> None:
    with pytest.raises(WorktreeError) as caught:
        await run_validation(tmp_path / "nope", python("pass"), manifest, timeout=LIMIT)
    assert caught.value.code == ReasonCode.WORKTREE_MISSING


SPAWNER: Final = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
print(f"pids {__import__('os').getpid()} {child.pid}", flush=True)
if sys.argv[1] == "wait":
    time.sleep(30)
"""


def spawned_pids(output: str) -> list[int]:
    line = next(line for line in output.splitlines() if line.startswith("pids "))
    return [int(pid) for pid in line.split()[1:]]


async def wait_gone(pids: list[int]) -> None:
    """Wait until the killed processes have exited (SIGKILL takes effect asynchronously)."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)
        assert not is_alive_pid(pid)


async def test_wv2_a_check_over_its_timeout_is_killed_with_its_whole_group(
    manifest: Manifest,
) -> None:
    with trio.fail_after(LIMIT):
        receipt = await run_validation(
            Path(manifest.root), [*python(SPAWNER), "wait"], manifest, timeout=0.5
        )
        pids = spawned_pids(receipt.output_tail)
        await wait_gone(pids)
    assert receipt.output_tail.startswith("timed out after 0.5s\n")
    assert receipt.exit_status == -9
    assert not receipt.passed
    assert receipt.duration_ms < 10_000


async def test_wv2_what_a_check_leaves_behind_in_its_group_is_killed(
    manifest: Manifest,
) -> None:
    """A check that exits leaving a child holding its output does not hang the receipt."""
    with trio.fail_after(LIMIT):
        receipt = await run_validation(
            Path(manifest.root), [*python(SPAWNER), "exit"], manifest, timeout=LIMIT
        )
        await wait_gone(spawned_pids(receipt.output_tail))
    assert receipt.passed
    assert "timed out" not in receipt.output_tail
    assert receipt.duration_ms < LIMIT * 1000 / 2


async def test_wv3_the_child_sees_only_the_allow_listed_environment(
    manifest: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PI_TEST_SECRET", "hunter2")
    monkeypatch.setenv("LANG", "C.UTF-8")
    code = "import os; print('\\n'.join(f'{k}={v}' for k, v in os.environ.items()))"
    with trio.fail_after(LIMIT):
        receipt = await run_validation(Path(manifest.root), python(code), manifest, timeout=LIMIT)
    seen = dict(line.split("=", 1) for line in receipt.output_tail.splitlines())
    assert "PI_TEST_SECRET" not in seen
    assert "hunter2" not in receipt.output_tail
    assert seen["LANG"] == "C.UTF-8"
    assert seen["PATH"] == os.environ["PATH"]
    # Python itself may add LC_CTYPE (PEP 538 locale coercion) in the child
    assert set(seen) - {"LC_CTYPE"} <= set(VALIDATION_ENV)


def test_wv1_a_receipt_is_a_plain_record(manifest: Manifest) -> None:
    """Receipts are frozen records that round-trip (``passed`` is derived, not stored)."""
    receipt = msgspec.json.decode(
        msgspec.json.encode(
            {
                "command": ["true"],
                "exit_status": 0,
                "manifest_digest": manifest.digest,
                "output_tail": "",
                "duration_ms": 1,
            }
        ),
        type=ValidationReceipt,
    )
    assert receipt.passed
    assert b"passed" not in msgspec.json.encode(receipt)


# --- the progress stamp (WD1 of docs/design/watchdog.md) ------------------------------


def _stamp(root: Path, limit: int = 20_000) -> str:
    stamp = worktree_stamp(root, limit=limit)
    assert stamp is not None
    return stamp.digest


def test_wd1_the_stamp_changes_with_every_kind_of_write_and_not_with_a_read(
    tmp_path: Path,
) -> None:
    root = tmp_path / "tree"
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("a = 1\n")
    before = _stamp(root)
    assert (root / "src" / "a.py").read_text() == "a = 1\n"
    assert _stamp(root) == before  # a read is no change
    changes: list[Callable[[], object]] = [
        lambda: (root / "src" / "a.py").write_text("a = 2\n"),  # same size, new mtime
        lambda: (root / "src" / "b.py").write_text(""),  # created
        lambda: (root / "src" / "b.py").rename(root / "src" / "c.py"),  # renamed
        lambda: (root / "src" / "c.py").unlink(),  # removed
        lambda: os.utime(root / "src" / "a.py", ns=(1, 1)),  # touched back in time
        lambda: (root / "src" / "a.py").chmod(0o600),  # mode
        lambda: (root / "deep" / "er").mkdir(parents=True),  # a directory
    ]
    seen = {before}
    for change in changes:
        change()
        digest = _stamp(root)
        assert digest not in seen, change
        seen.add(digest)


def test_wd1_the_stamp_ignores_git_and_is_bounded(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    (root / ".git").mkdir(parents=True)
    for n in range(50):
        (root / f"f{n:02}").write_text("x")
    before = worktree_stamp(root)
    assert before is not None
    assert (before.entries, before.truncated) == (50, False)
    (root / ".git" / "index").write_text("refreshed by git status")
    assert _stamp(root) == before.digest
    os.utime(root, ns=(1, 1))  # a new name below changes it, whatever the clock's grain
    bounded = worktree_stamp(root, limit=10)
    assert bounded is not None
    # past the bound (W-S4 of worktree.md): the root's 50 are not looked at, the root is
    assert (bounded.entries, bounded.truncated) == (0, True)
    (root / "f00").write_text("past the limit")  # a write inside is never looked at
    assert _stamp(root, limit=10) == bounded.digest
    (root / "f50").write_text("a new name")  # the root's own mtime
    assert _stamp(root, limit=10) != bounded.digest
    assert worktree_stamp(tmp_path / "gone") is None


# -- W-M6: the runtime's git calls on a worktree the worker controls ---------------------------


def _filtered_repo(root: Path, clean: str) -> Path:
    """A git worktree whose own configuration runs ``clean`` on every ``*.txt`` it adds."""
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitattributes").write_text("*.txt filter=mine\n")
    subprocess.run(["git", "-C", str(root), "config", "filter.mine.clean", clean], check=True)
    (root / "a.txt").write_text("hello\n")
    return root


def test_w_m6_a_filter_or_hook_of_the_worktree_never_sees_the_runtimes_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W-M6: the worker can write its worktree's git configuration, and a filter there runs
    when the runtime takes the manifest: it runs with ``PATH`` and no other variable of the
    runtime's (its upstream key was written to disk before); a hook of the worktree's does not
    run at all when the candidate's ref is made."""
    monkeypatch.setenv("UPSTREAM_API_KEY", "sk-secret-123")
    seen = tmp_path / "seen-by-the-filter"
    repo = _filtered_repo(tmp_path / "w", f"sh -c 'printenv UPSTREAM_API_KEY >> {seen}; cat'")
    hooked = tmp_path / "hook-ran"
    hook = repo / ".git" / "hooks" / "reference-transaction"
    hook.write_text(f"#!/bin/sh\necho ran >> {hooked}\n")
    hook.chmod(0o755)
    manifest = take_manifest(repo)
    take_candidate(repo, manifest, archive_dir=tmp_path / "archives", task_id="t1", message="done")
    assert seen.read_text() == "", "the filter ran, without the key"
    assert not hooked.exists()


async def test_w_m6_a_git_call_that_does_not_finish_is_killed_with_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W-M6: a git call on a worktree is bounded (``GIT_SECONDS``): a filter that never ends
    makes the manifest fail ``worktree_unreadable`` at the bound, and the filter's process —
    started by git, in git's process group — is killed with it, never left running."""
    monkeypatch.setattr(_worktree, "GIT_SECONDS", 1.0)
    pid_file = tmp_path / "filter.pid"
    repo = _filtered_repo(tmp_path / "w", f"sh -c 'echo $$ > {pid_file}; exec sleep 600'")
    with pytest.raises(WorktreeError) as failed:
        take_manifest(repo)
    assert failed.value.code is ReasonCode.WORKTREE_UNREADABLE
    assert "did not finish within 1 s" in str(failed.value)
    pid = int(pid_file.read_text())
    with trio.fail_after(LIMIT):  # SIGKILLed with git's group: dead once the kernel runs it
        await wait_gone([pid])
