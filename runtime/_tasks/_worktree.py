"""A task's worktree evidence: manifest, candidate checkpoint, validation receipt.

A task lane may call a task Done only with evidence beside its lifecycle receipt
(docs/design/watchdog.md): the exact process tree is quiescent, a **manifest** says what the
worktree holds, and a **candidate checkpoint** preserves exactly that content, bound to the manifest
by its digest. Without the manifest a Done names no result; without the candidate the result can be
lost or silently changed after the Done; without the binding the two can describe different trees. A
**validation receipt** records a check run against the manifest (command, exit status, output tail),
so "tests passed" names the tree they passed on.

Everything here is blocking file and git work except :func:`run_validation`; the ``a*``
wrappers run it through ``trio.to_thread``, never on the Trio loop.

Invariants (the tests cite them by name):

* **W-M1** The manifest digest is a deterministic function of the worktree's content:
  the same tree gives the same digest, twice in a row and for a copy of the tree in
  another directory. The root path is recorded but is not part of the digest.
* **W-M2** Any change of a file's content, name or presence, or of a symlink's target,
  changes the digest. (A files manifest does not record permission bits; a git tree id
  records the executable bit.)
* **W-M3** In a git repository (``.git`` directory or file at the root) ``git_tree`` is
  the tree id of the working tree *including untracked, non-ignored files* — what
  ``git add -A && git write-tree`` gives on an index read from ``HEAD`` — and ``head`` is
  the ``HEAD`` commit (``None`` on an unborn branch). The digest covers ``git_tree``,
  ``head`` and the files git sees (tracked plus untracked non-ignored; ignored build
  output does not change it). It is computed on a temporary index with
  ``GIT_OPTIONAL_LOCKS=0``: the user's index, ``HEAD``, branch and refs are never touched.
* **W-M4** Symlinks are never followed: each is recorded with ``size=-1`` and the sha256
  of its target string. Other non-regular files (FIFOs, sockets, devices) are never
  opened and not recorded; nothing named ``.git`` is walked. Files are read in chunks.
* **W-M5** A missing root is ``worktree_missing``; a file or a git command that cannot
  read the worktree is ``worktree_unreadable``.
* **W-C1** A candidate carries its manifest's digest and preserves exactly that manifest:
  a git candidate is a commit of ``manifest.git_tree`` with parent ``manifest.head`` and
  trailers naming the task and the digest; an archive holds exactly ``manifest.files``,
  each file hashed while it is written and compared with its entry.
* **W-C2** After the candidate is written the manifest is taken again; if the worktree
  changed meanwhile the call raises ``worktree_changed`` and publishes nothing (no ref
  moved, no archive renamed into place).
* **W-C3** A git candidate is reachable from ``refs/pi-runtime/candidates/<task>`` (so it
  is never garbage collected) and never changes the user's branch, ``HEAD`` or index. Its
  author, committer and dates are fixed, so the same manifest gives the same commit id.
* **W-C4** An archive is a deterministic ``tar`` (entries sorted, mtime 0, uid/gid 0, no
  owner names, modes kept), written to a temporary file, fsynced, renamed and its
  directory fsynced. An archive already in place with the same sha256 is reused: taking
  the candidate twice leaves one file and returns the same candidate.
* **W-C5** A git command that fails while the candidate is written is
  ``checkpoint_failed`` with (the short tail of) git's standard error; so is an archive
  that cannot be written.
* **W-V1** A validation receipt names the command, the manifest digest it ran against,
  its exit status and the last 4 KiB of its combined output; it passed iff the exit
  status is 0.
* **W-V2** A validation is bounded: at the timeout its whole process group is killed,
  the receipt's output tail starts ``timed out after Ns`` and its exit status is the
  killed process's return code (``-9``). Nothing left in its process group outlives the
  call, timed out or not.
* **W-V3** The validation child gets an environment built only from :data:`VALIDATION_ENV`
  (no secrets pass), stdin from ``/dev/null``, and the worktree as its working directory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import signal
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Final, Literal

import msgspec
import trio
import trio.lowlevel

from .._errors import ReasonCode, WorktreeError

__all__ = [
    "CANDIDATE_REF_PREFIX",
    "OUTPUT_TAIL_BYTES",
    "VALIDATION_ENV",
    "Candidate",
    "FileEntry",
    "Manifest",
    "ValidationReceipt",
    "acandidate",
    "amanifest",
    "run_validation",
    "take_candidate",
    "take_manifest",
]

CANDIDATE_REF_PREFIX: Final = "refs/pi-runtime/candidates/"
"""Where git candidates are kept reachable, one ref per task (W-C3)."""
VALIDATION_ENV: Final = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "TMPDIR")
"""The only variables a validation child inherits (W-V3)."""
OUTPUT_TAIL_BYTES: Final = 4096
"""How much of a validation's combined output its receipt keeps (W-V1)."""

_CHUNK: Final = 1024 * 1024
_DIGEST_DOMAIN: Final = b"pi-runtime.worktree-manifest.v1\0"
_IDENTITY: Final = ("pi-runtime", "pi-runtime@localhost")
_COMMIT_DATE: Final = "@0 +0000"
_STDERR_TAIL: Final = 500
_DRAIN_SECONDS: Final = 1.0
_REAP_SECONDS: Final = 5.0
_SAFE_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


class FileEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One file of a manifest: ``path`` relative to the root with ``/`` separators,
    ``size`` in bytes and the sha256 of its content; a symlink has ``size=-1`` and the
    sha256 of its target string (W-M4)."""

    path: str
    size: int
    sha256: str


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a worktree holds. ``digest`` is the sha256 over the canonical manifest (kind,
    ``git_tree``, ``head`` and ``files``, never ``root``: W-M1); ``git_tree`` and ``head``
    are set for a git worktree only (W-M3). ``files`` are sorted by path."""

    root: str
    kind: Literal["git", "files"]
    digest: str
    git_tree: str | None = None
    head: str | None = None
    files: tuple[FileEntry, ...] = ()


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


class ValidationReceipt(msgspec.Struct, frozen=True, kw_only=True):
    """A check run against the manifest with digest ``manifest_digest`` (W-V1)."""

    command: tuple[str, ...]
    exit_status: int
    manifest_digest: str
    output_tail: str
    duration_ms: int

    @property
    def passed(self) -> bool:
        """The check passed: it exited with status 0 (a killed check has a negative one)."""
        return self.exit_status == 0


# --- the manifest --------------------------------------------------------------------


def _check_root(root: Path) -> str:
    path = os.path.abspath(root)
    if not os.path.isdir(path):
        raise WorktreeError(
            ReasonCode.WORKTREE_MISSING, f"{path} is not a directory: check the task's worktree"
        )
    return path


def _is_git(root: str) -> bool:
    return os.path.lexists(os.path.join(root, ".git"))


def _unreadable(path: str, error: OSError) -> WorktreeError:
    return WorktreeError(ReasonCode.WORKTREE_UNREADABLE, f"cannot read {path}: {error}")


def _hash_open_file(f: BinaryIO) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def _open_regular(full: str) -> BinaryIO | None:
    """The file at ``full`` opened for reading if it is a regular file (never following
    a symlink, never blocking on a FIFO); ``None`` for anything else."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    fd = os.open(full, flags)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def _entry(root: str, rel: str) -> FileEntry | None:
    """The entry of ``rel``, or ``None`` if it vanished or is not a file or symlink."""
    full = os.path.join(root, rel)
    try:
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode):
            target = os.fsencode(os.readlink(full))
            return FileEntry(path=rel, size=-1, sha256=hashlib.sha256(target).hexdigest())
        if not stat.S_ISREG(st.st_mode):
            return None
        f = _open_regular(full)
        if f is None:
            return None
        with f:
            size, sha = _hash_open_file(f)
        return FileEntry(path=rel, size=size, sha256=sha)
    except (FileNotFoundError, NotADirectoryError):
        return None  # it vanished: the tree is changing, and the digest will say so
    except OSError as error:
        raise _unreadable(full, error) from None


def _walk(root: str) -> list[str]:
    """Every file and symlink under ``root`` (relative, ``/``-separated), never entering
    a symlinked directory or anything named ``.git``."""
    found: list[str] = []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        directory = os.path.join(root, rel_dir) if rel_dir else root
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as error:
            raise _unreadable(directory, error) from None
        for entry in entries:
            if entry.name == ".git":
                continue
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(rel)
                else:
                    found.append(rel)
            except OSError as error:
                raise _unreadable(entry.path, error) from None
    return found


def _entries(root: str, paths: list[str]) -> tuple[FileEntry, ...]:
    entries = (_entry(root, rel) for rel in sorted(paths, key=os.fsencode))
    return tuple(entry for entry in entries if entry is not None)


def _digest(kind: str, git_tree: str | None, head: str | None, files: tuple[FileEntry, ...]) -> str:
    # NUL-terminated fields: no path, id or number contains NUL, so the encoding is
    # unambiguous; paths are hashed as their file-system bytes
    digest = hashlib.sha256(_DIGEST_DOMAIN)
    for field in (kind, git_tree or "", head or ""):
        digest.update(field.encode() + b"\0")
    for f in files:
        digest.update(b"%s\0%d\0%s\0" % (os.fsencode(f.path), f.size, f.sha256.encode()))
    return digest.hexdigest()


def _git_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
    env.update(GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", **extra)
    return env


def _git(
    root: str,
    args: Sequence[str],
    *,
    env: dict[str, str],
    code: ReasonCode,
    stdin: bytes = b"",
    ok_codes: tuple[int, ...] = (0,),
) -> tuple[int, bytes]:
    try:
        done = subprocess.run(
            ["git", "-C", root, *args], input=stdin, capture_output=True, env=env, check=False
        )
    except OSError as error:
        raise WorktreeError(code, f"cannot run git {args[0]}: {error}") from None
    if done.returncode not in ok_codes:
        stderr = done.stderr.decode(errors="replace").strip()[-_STDERR_TAIL:]
        raise WorktreeError(
            code, f"git {args[0]} failed in {root} (exit {done.returncode}): {stderr}"
        )
    return done.returncode, done.stdout


def _git_manifest(root: str) -> Manifest:
    code = ReasonCode.WORKTREE_UNREADABLE
    with tempfile.TemporaryDirectory(prefix="pi-runtime-index-") as scratch:
        env = _git_env(GIT_INDEX_FILE=os.path.join(scratch, "index"))
        status, out = _git(
            root,
            ["rev-parse", "--verify", "--quiet", "HEAD^{commit}"],
            env=env,
            code=code,
            ok_codes=(0, 1),
        )
        head = out.decode().strip() if status == 0 else None
        if head is not None:
            _git(root, ["read-tree", head], env=env, code=code)
        _git(root, ["add", "--all"], env=env, code=code)
        git_tree = _git(root, ["write-tree"], env=env, code=code)[1].decode().strip()
        listing = _git(root, ["ls-files", "-z", "--stage"], env=env, code=code)[1]
    paths = []
    for record in listing.split(b"\0"):
        if not record:
            continue
        meta, _, path = record.partition(b"\t")
        if meta.startswith(b"160000 "):
            continue  # a submodule: its commit is in the tree id, it has no file content
        paths.append(os.fsdecode(path))
    files = _entries(root, paths)
    return Manifest(
        root=root,
        kind="git",
        digest=_digest("git", git_tree, head, files),
        git_tree=git_tree,
        head=head,
        files=files,
    )


def take_manifest(root: Path) -> Manifest:
    """The manifest of the worktree at ``root`` (blocking; W-M1…W-M5).

    A git repository gives a ``git`` manifest (tree id of the working tree, ``HEAD``,
    the files git sees); any other directory a ``files`` manifest of every file and
    symlink. Raises :class:`WorktreeError` ``worktree_missing`` or
    ``worktree_unreadable``."""
    path = _check_root(root)
    if _is_git(path):
        return _git_manifest(path)
    files = _entries(path, _walk(path))
    return Manifest(
        root=path, kind="files", digest=_digest("files", None, None, files), files=files
    )


async def amanifest(root: Path) -> Manifest:
    """:func:`take_manifest` off the Trio loop."""
    return await trio.to_thread.run_sync(take_manifest, root)


# --- the candidate -------------------------------------------------------------------


def _safe_task_id(task_id: str) -> str:
    """``task_id`` itself when it is safe as a file name and a ref component, else a
    sanitized form with a hash of the original (so two ids never share a name)."""
    if not task_id:
        raise ValueError("task_id must not be empty")
    if _SAFE_ID.fullmatch(task_id) and ".." not in task_id and not task_id.endswith(".lock"):
        return task_id
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "_", task_id)[:60]
    return f"{cleaned}-{hashlib.sha256(task_id.encode(errors='surrogateescape')).hexdigest()[:12]}"


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
    name, email = _IDENTITY
    env = _git_env(
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
    commit = _git(root, args, env=env, code=code, stdin=stdin)[1].decode().strip()
    _check_unchanged(root, manifest)  # W-C2: before the ref makes it a candidate
    ref = CANDIDATE_REF_PREFIX + task
    _git(root, ["update-ref", "-m", "pi-runtime candidate", ref, commit], env=env, code=code)
    return Candidate(kind="git_commit", ref=commit, manifest_digest=manifest.digest, git_ref=ref)


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
            raise _unreadable(self._path, error) from None
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
        raise _unreadable(full, error) from None


def _add_to_tar(tar: tarfile.TarFile, root: str, entry: FileEntry) -> None:
    """Append ``entry`` as the manifest recorded it; ``worktree_changed`` if the file is
    not what it was. Write errors of the archive propagate as ``OSError``."""
    full = os.path.join(root, entry.path)
    info = tarfile.TarInfo(entry.path)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.size < 0:
        with _reading(entry.path, full):
            target = os.readlink(full)
        if hashlib.sha256(os.fsencode(target)).hexdigest() != entry.sha256:
            raise _changed(f"symlink {entry.path} changed")
        info.type = tarfile.SYMTYPE
        info.linkname = target
        info.mode = 0o777
        tar.addfile(info)
        return
    with _reading(entry.path, full):
        f = _open_regular(full)
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
        return _hash_open_file(f)[1]


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
    path = _check_root(root)
    task = _safe_task_id(task_id)
    if _is_git(path) != (manifest.kind == "git"):
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

    return await trio.to_thread.run_sync(run)


# --- validation ----------------------------------------------------------------------


class _Tail:
    """The last ``limit`` bytes of a stream."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._data = bytearray()
        self._cut = False

    def feed(self, chunk: bytes | bytearray) -> None:
        self._data += chunk
        if len(self._data) > self._limit:
            del self._data[: len(self._data) - self._limit]
            self._cut = True

    def text(self) -> str:
        data = bytes(self._data)
        if self._cut:  # do not start inside a UTF-8 sequence
            skip = 0
            while skip < min(3, len(data)) and data[skip] & 0xC0 == 0x80:
                skip += 1
            data = data[skip:]
        return data.decode("utf-8", errors="replace")


async def _pump(stream: trio.abc.ReceiveStream, tail: _Tail, done: trio.Event) -> None:
    while chunk := await stream.receive_some(65536):
        tail.feed(chunk)
    done.set()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def run_validation(
    root: Path,
    command: Sequence[str],
    manifest: Manifest,
    *,
    timeout: float,  # noqa: ASYNC109
) -> ValidationReceipt:
    """Run ``command`` in the worktree at ``root`` and receipt it against ``manifest``
    (W-V1…W-V3). The command is not re-checked against the worktree: a check that
    writes caches would otherwise never pass.

    It runs in a new session (its own process group), with stdin ``/dev/null`` and the
    allow-listed environment, at most ``timeout`` seconds; then (or as soon as it exits)
    its process group is killed. A command that cannot be started gives a receipt with
    exit status 127 and the reason as output. Cancellation kills the group too.
    Raises :class:`WorktreeError` ``worktree_missing`` if ``root`` is not a directory."""
    path = _check_root(root)
    argv = tuple(command)
    if not argv:
        raise ValueError("an empty validation command")
    env = {key: os.environ[key] for key in VALIDATION_ENV if key in os.environ}
    tail = _Tail(OUTPUT_TAIL_BYTES)
    started = trio.current_time()

    def receipt(exit_status: int, prefix: str = "") -> ValidationReceipt:
        return ValidationReceipt(
            command=argv,
            exit_status=exit_status,
            manifest_digest=manifest.digest,
            output_tail=prefix + tail.text(),
            duration_ms=round((trio.current_time() - started) * 1000),
        )

    try:
        proc = await trio.lowlevel.open_process(
            list(argv),
            cwd=path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as error:
        return receipt(127, f"cannot start {argv[0]}: {error}\n")
    stdout = proc.stdout
    assert stdout is not None
    pidfd: int | None = None
    timed_out = False
    try:
        # our own pidfd: it shows the exit without reaping, so the group id we kill is
        # still the child's (a reaped leader's pid could be reused)
        pidfd = os.pidfd_open(proc.pid)
        async with trio.open_nursery() as nursery:
            drained = trio.Event()
            nursery.start_soon(_pump, stdout, tail, drained)
            with trio.move_on_after(timeout) as bound:
                await trio.lowlevel.wait_readable(pidfd)
            timed_out = bound.cancelled_caught
            _kill_group(proc.pid)  # W-V2: nothing it left behind outlives it
            with trio.move_on_after(_DRAIN_SECONDS):
                await drained.wait()
            nursery.cancel_scope.cancel()
    finally:
        _kill_group(proc.pid)
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_REAP_SECONDS):
                await proc.wait()
            await stdout.aclose()
        if pidfd is not None:
            os.close(pidfd)
    status = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    return receipt(status, f"timed out after {timeout:g}s\n" if timed_out else "")
