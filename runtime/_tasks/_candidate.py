"""A task's candidate checkpoint: exactly the manifest's content, kept where it cannot be lost
or silently changed after the Done (W-C1…W-C5 of ``docs/design/worktree.md``) — a commit
reachable from ``refs/pi-runtime/candidates/<task>`` in a git worktree, else a deterministic
``tar`` archive. Blocking file and git work: :func:`acandidate` runs it in a thread."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Final, Literal

import msgspec
import trio

from .._errors import ReasonCode, WorktreeError
from ._worktree import (
    FileEntry,
    Manifest,
    beneath,
    check_root,
    git,
    git_env,
    hash_open_file,
    is_git,
    open_regular,
    repository,
    take_manifest,
    unreadable,
    worktree_limiter,
)

__all__ = [
    "CANDIDATE_REF_PREFIX",
    "Candidate",
    "RefUpdate",
    "acandidate",
    "candidate_ref_lock",
    "take_candidate",
]


CANDIDATE_REF_PREFIX: Final = "refs/pi-runtime/candidates/"
"""Where git candidates are kept reachable, one ref per task (W-C3)."""


_IDENTITY: Final = ("pi-runtime", "pi-runtime@localhost")


_COMMIT_DATE: Final = "@0 +0000"


_SAFE_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """A checkpoint of exactly the manifest with digest ``manifest_digest`` (W-C1).

    ``ref`` is the commit id (``git_commit``) or the archive's path (``archive``),
    relative to the store root when one was given, else absolute; ``sha256`` is the
    archive's, ``git_ref`` the ref that keeps a commit reachable (W-C3)."""

    kind: Literal["git_commit", "archive"]
    ref: str
    manifest_digest: str
    sha256: str | None = None
    git_ref: str | None = None


def _safe_task_id(task_id: str) -> str:
    """``task_id`` itself when it is safe as a file name and a ref component, else a
    sanitized form with a hash of the original (so two ids never share a name)."""
    if not task_id:
        raise ValueError("task_id must not be empty")
    if _SAFE_ID.fullmatch(task_id) and ".." not in task_id and not task_id.endswith(".lock"):
        return task_id
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "_", task_id)[:60]
    return f"{cleaned}-{hashlib.sha256(task_id.encode(errors='surrogateescape')).hexdigest()[:12]}"


_SANITIZED: Final = re.compile(r"[A-Za-z0-9_-]{0,60}-[0-9a-f]{12}")
"""What :func:`_safe_task_id` makes of an id that is not safe as it is."""


def _made_by_safe_task_id(name: str) -> bool:
    """Whether ``name`` is one :func:`_safe_task_id` gives: an id safe as it is, or a
    sanitized one (which need not be safe as an id again: ``-lead_lock-…`` starts with ``-``)."""
    return bool(name) and (_safe_task_id(name) == name or _SANITIZED.fullmatch(name) is not None)


def _changed(message: str) -> WorktreeError:
    return WorktreeError(
        ReasonCode.WORKTREE_CHANGED,
        f"{message}: the worktree is not quiescent; take a new manifest when it settles",
    )


def _check_unchanged(root: str, manifest: Manifest) -> None:
    now = take_manifest(Path(root))
    if now.digest != manifest.digest:
        raise _changed(f"{now.root} changed after manifest {manifest.digest[:16]}")


def _commit_message(message: str, task: str, digest: str) -> bytes:
    body = message.strip()
    trailers = f"Pi-Runtime-Task: {task}\nPi-Runtime-Manifest: {digest}\n"
    return ((body + "\n\n" if body else "") + trailers).encode(errors="surrogateescape")


def _git_candidate(root: str, manifest: Manifest, task: str, message: str) -> Candidate:
    if manifest.git_tree is None:
        raise ValueError("a git manifest without git_tree")
    repo = repository(root)  # W-M11: never another repository's objects and refs
    name, email = _IDENTITY
    env = git_env(
        **repo,
        GIT_AUTHOR_NAME=name,
        GIT_AUTHOR_EMAIL=email,
        GIT_AUTHOR_DATE=_COMMIT_DATE,
        GIT_COMMITTER_NAME=name,
        GIT_COMMITTER_EMAIL=email,
        GIT_COMMITTER_DATE=_COMMIT_DATE,
    )
    args = ["commit-tree", "--no-gpg-sign", manifest.git_tree]
    if manifest.head is not None:
        args += ["-p", manifest.head]
    code = ReasonCode.CHECKPOINT_FAILED
    stdin = _commit_message(message, task, manifest.digest)
    commit = git(root, args, env=env, code=code, stdin=stdin)[1].decode().strip()
    _check_unchanged(root, manifest)  # W-C2: before the ref makes it a candidate
    ref = CANDIDATE_REF_PREFIX + task
    with candidate_ref_lock(repo["GIT_COMMON_DIR"], ref, code) as update:
        update(root, env, f"update {ref} {commit}\n".encode())
    return Candidate(kind="git_commit", ref=commit, manifest_digest=manifest.digest, git_ref=ref)


# --- W-C6: git's lock on the candidate ref, left by a crash --------------------------------


RefUpdate = Callable[[str, dict[str, str], bytes], None]
"""``update(root, env, commands)``: ``git update-ref --stdin`` of ``commands`` on the
worktree ``root``, its process recorded (W-C6)."""


@contextlib.contextmanager
def candidate_ref_lock(common_dir: str, ref: str, code: ReasonCode) -> Iterator[RefUpdate]:
    """W-C6, for every change the runtime makes to the candidate ref ``ref`` (taking a
    candidate; ``task forget``'s deletion, RT12): under the ref's ``flock``
    (:func:`_ref_lock`), a git lock on ``ref`` left by a git of ours that was killed holding
    it taken over (:func:`_take_over`); yields the one way to change the ref meanwhile —
    ``git update-ref --stdin``, its process recorded before it is given its commands (it
    takes no lock before), the record cleared when it exits by itself. ``code``: every
    refusal's reason code (``checkpoint_failed`` for a candidate)."""
    task = ref.removeprefix(CANDIDATE_REF_PREFIX)
    if ref == task or not _made_by_safe_task_id(task):
        raise ValueError(f"{ref!r} is not a candidate ref the runtime makes")
    with _ref_lock(common_dir, task, code) as lock:
        _take_over(lock, common_dir, ref, code)

        def update(root: str, env: dict[str, str], commands: bytes) -> None:
            git(
                root,
                ["update-ref", "-m", "pi-runtime candidate", "--stdin"],
                env=env,
                code=code,
                stdin=commands,
                started=lambda pid: _record(lock, pid),  # before git reads its command
                ended=lambda status: _ended(lock, status),
            )

        yield update


@contextlib.contextmanager
def _ref_lock(common_dir: str, task: str, code: ReasonCode) -> Iterator[int]:
    """``pi-runtime-candidate-<task>.lock`` in the repository's common directory (beside the
    ``refs/`` it guards, never through a symlink), ``flock``-ed: while it is held no other call
    changes the task's candidate ref, and the kernel releases it when its holder dies. It
    records the git process that may hold git's own lock on the task's ref (:func:`_record`)."""
    name = f"pi-runtime-candidate-{task}.lock"
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        directory = os.open(common_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = os.open(name, flags, 0o600, dir_fd=directory)
        finally:
            os.close(directory)
    except OSError as error:
        raise WorktreeError(code, f"cannot open {name} in {common_dir}: {error}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise WorktreeError(code, f"{name} is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorktreeError(
                code,
                f"the candidate ref of task {task} is being changed ({name} is locked)",
            ) from None
        yield fd
    finally:
        os.close(fd)


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id", "rb") as f:
        return f.read().decode().strip()


def _start_time(pid: int) -> int | None:
    """``pid``'s start time (clock ticks since boot), ``None`` when no live process has it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    rest = stat_line[stat_line.rindex(b")") + 2 :].split()
    return None if rest[0] in (b"Z", b"X") else int(rest[19])


def _record(lock: int, pid: int | None) -> None:
    """Write (fsynced) which git process may hold git's lock on the task's ref: its boot,
    pid and start time; nothing once it ended by itself (git removes its own lock then;
    only a kill leaves one)."""
    start = None if pid is None else _start_time(pid)
    line = b"" if start is None else f"{_boot_id()} {pid} {start}\n".encode()
    os.ftruncate(lock, 0)
    os.pwrite(lock, line, 0)
    os.fsync(lock)


def _ended(lock: int, status: int) -> None:
    if status >= 0:  # exited by itself: no lock of its is left
        _record(lock, None)


def _take_over(lock: int, common_dir: str, ref: str, code: ReasonCode) -> None:
    """W-C6: git's ``<ref>.lock`` left by a git update of ours that was killed holding it is
    removed — only when its owner is provably gone: the record names it (boot, pid, start
    time) and no live process is that one. A lock with no record of ours is left (git then
    fails with ``code``); one whose owner lives is refused ``code``."""
    record = os.pread(lock, 256, 0).split()
    if len(record) != 3:
        return
    boot, pid, start = record[0].decode(), int(record[1]), record[2].decode()
    if boot == _boot_id() and start == str(_start_time(pid)):
        raise WorktreeError(
            code, f"git (pid {pid}) of an earlier change still holds the lock on {ref}"
        )
    try:
        with beneath(common_dir, f"{ref}.lock") as (directory, name):  # W-M8: no link followed
            if stat.S_ISREG(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=directory)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as error:
        raise WorktreeError(code, f"cannot remove the stale lock on {ref}: {error}") from None
    _record(lock, None)


class _HashingReader:
    """Reads the worktree file ``f``, hashing and counting what it read (W-C1: an archive
    holds the manifest's bytes, not whatever the file holds by then). A read error is
    ``worktree_unreadable``; the archive's own write errors stay ``OSError``."""

    def __init__(self, f: BinaryIO, path: str) -> None:
        self._f = f
        self._path = path
        self.digest = hashlib.sha256()
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        try:
            chunk = self._f.read(size)
        except OSError as error:
            raise unreadable(self._path, error) from None
        self.digest.update(chunk)
        self.count += len(chunk)
        return chunk


@contextlib.contextmanager
def _reading(rel: str, full: str) -> Iterator[None]:
    """Errors reading a manifest's file while archiving it: gone or of another type is
    ``worktree_changed``, anything else ``worktree_unreadable``."""
    try:
        yield
    except (FileNotFoundError, NotADirectoryError):
        raise _changed(f"{rel} vanished") from None
    except OSError as error:
        if error.errno in (errno.EINVAL, errno.ELOOP):  # no longer a symlink / now one
            raise _changed(f"{rel} changed its type") from None
        raise unreadable(full, error) from None


def _add_to_tar(tar: tarfile.TarFile, root: str, entry: FileEntry) -> None:
    """Append ``entry`` as the manifest recorded it; ``worktree_changed`` if the file is
    not what it was. Write errors of the archive propagate as ``OSError``."""
    full = os.path.join(root, entry.path)
    info = tarfile.TarInfo(entry.path)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.size < 0:
        with _reading(entry.path, full), beneath(root, entry.path) as (directory, name):
            target = os.readlink(name, dir_fd=directory)
        if hashlib.sha256(os.fsencode(target)).hexdigest() != entry.sha256:
            raise _changed(f"symlink {entry.path} changed")
        info.type = tarfile.SYMTYPE
        info.linkname = target
        info.mode = 0o777
        tar.addfile(info)
        return
    with _reading(entry.path, full), beneath(root, entry.path) as (directory, name):
        f = open_regular(directory, name)  # never through a symlink on the path (W-M4)
    if f is None:
        raise _changed(f"{entry.path} is no longer a regular file")
    with f:
        info.size = entry.size
        info.mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
        reader = _HashingReader(f, full)
        try:
            tar.addfile(info, reader)  # reads exactly entry.size bytes
        except OSError:
            if reader.count < entry.size:  # tarfile's "unexpected end of data"
                raise _changed(f"{entry.path} shrank") from None
            raise
        if reader.digest.hexdigest() != entry.sha256 or reader.read(1):
            raise _changed(f"{entry.path} changed")


def _sha256_of(path: str) -> str:
    with open(path, "rb") as f:
        return hash_open_file(f)[1]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _archive_candidate(
    root: str, manifest: Manifest, task: str, archive_dir: Path, store_root: Path | None
) -> Candidate:
    directory = os.path.abspath(archive_dir)
    final = os.path.join(directory, f"{task}-{manifest.digest[:16]}.tar")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=directory, prefix=".candidate-", suffix=".tmp")
    except OSError as error:
        raise WorktreeError(
            ReasonCode.CHECKPOINT_FAILED, f"cannot write an archive in {directory}: {error}"
        ) from None
    published = False
    try:
        with os.fdopen(fd, "wb") as out:
            with tarfile.open(
                fileobj=out,
                mode="w",
                format=tarfile.PAX_FORMAT,
                encoding="utf-8",
                errors="surrogateescape",
            ) as tar:
                for entry in manifest.files:  # sorted by path (W-C4)
                    _add_to_tar(tar, root, entry)
            out.flush()
            os.fsync(out.fileno())
        sha = _sha256_of(temp)
        _check_unchanged(root, manifest)  # W-C2: before the archive is put in place
        if os.path.exists(final) and _sha256_of(final) == sha:
            pass  # W-C4: the same archive is in place already
        else:
            os.replace(temp, final)
            published = True
            _fsync_dir(directory)
    except WorktreeError:
        raise
    except OSError as error:
        raise WorktreeError(
            ReasonCode.CHECKPOINT_FAILED, f"cannot write the archive {final}: {error}"
        ) from None
    finally:
        if not published:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
    if store_root is None:
        ref = final
    else:
        ref = os.path.relpath(final, os.path.abspath(store_root))
        if ref == ".." or ref.startswith("../"):
            raise ValueError(f"archive_dir {directory} is not inside store_root {store_root}")
    return Candidate(kind="archive", ref=ref, manifest_digest=manifest.digest, sha256=sha)


def take_candidate(
    root: Path,
    manifest: Manifest,
    *,
    archive_dir: Path,
    task_id: str,
    message: str,
    store_root: Path | None = None,
) -> Candidate:
    """Checkpoint exactly ``manifest`` of the worktree at ``root`` (blocking; W-C1…W-C5).

    A git manifest becomes a commit kept under ``refs/pi-runtime/candidates/<task>``
    (``message`` is its message); a files manifest becomes the archive
    ``archive_dir/<task>-<digest[:16]>.tar`` (``message`` is not stored). ``ref`` is
    relative to ``store_root`` when given. Raises :class:`WorktreeError`
    ``worktree_changed`` if the worktree no longer matches ``manifest`` (nothing is
    published then), ``checkpoint_failed``, ``worktree_missing`` or
    ``worktree_unreadable``."""
    path = check_root(root)
    task = _safe_task_id(task_id)
    if is_git(path) != (manifest.kind == "git"):
        raise _changed(f"{path} is no longer a {manifest.kind} worktree")
    if manifest.kind == "git":
        return _git_candidate(path, manifest, task, message)
    return _archive_candidate(path, manifest, task, archive_dir, store_root)


async def acandidate(
    root: Path,
    manifest: Manifest,
    *,
    archive_dir: Path,
    task_id: str,
    message: str,
    store_root: Path | None = None,
) -> Candidate:
    """:func:`take_candidate` off the Trio loop."""

    def run() -> Candidate:
        return take_candidate(
            root,
            manifest,
            archive_dir=archive_dir,
            task_id=task_id,
            message=message,
            store_root=store_root,
        )

    return await trio.to_thread.run_sync(run, limiter=worktree_limiter())
