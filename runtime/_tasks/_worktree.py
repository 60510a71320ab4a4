"""A task's worktree manifest: what the worktree holds, as a digest that any change of a
file's content, name or presence changes (W-M1…W-M6 of ``docs/design/worktree.md``), and the
file and git helpers the candidate (``_candidate.py``) and the validation (``_validation.py``)
share; and the watchdog's bounded progress stamp (W-S1…W-S5). Blocking file and git work:
:func:`amanifest` runs it in a thread."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Final, Literal

import msgspec
import trio
import trio.lowlevel

from .._clock import own_limiter
from .._errors import ReasonCode, WorktreeError

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_TOTAL_BYTES",
    "STAMP_LIMIT",
    "FileEntry",
    "Manifest",
    "WorktreeStamp",
    "amanifest",
    "take_manifest",
    "worktree_limiter",
    "worktree_stamp",
]


_CHUNK: Final = 1024 * 1024
_DIGEST_DOMAIN: Final = b"pi-runtime.worktree-manifest.v1\0"
_STDERR_TAIL: Final = 500

MAX_FILE_BYTES: Final = 1 << 30
"""The largest file a manifest reads (1 GiB, W-M12): a larger one (a sparse file of a
terabyte takes one ``truncate``) is refused ``worktree_unreadable`` by its size, unread."""
MAX_TOTAL_BYTES: Final = 8 << 30
"""The most a manifest reads in all (8 GiB of regular files, W-M12), refused likewise: the
sizes are summed before any file is read."""


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


# --- the manifest --------------------------------------------------------------------


def check_root(root: Path) -> str:
    path = os.path.abspath(root)
    if not os.path.isdir(path):
        raise WorktreeError(
            ReasonCode.WORKTREE_MISSING, f"{path} is not a directory: check the task's worktree"
        )
    return path


def is_git(root: str) -> bool:
    return os.path.lexists(os.path.join(root, ".git"))


def unreadable(path: str, error: OSError) -> WorktreeError:
    return WorktreeError(ReasonCode.WORKTREE_UNREADABLE, f"cannot read {path}: {error}")


def hash_open_file(f: BinaryIO, limit: int | None = None) -> tuple[int, str]:
    """Size and sha256 of what ``f`` holds; with ``limit``, no more than ``limit + 1`` bytes
    are read (a size over ``limit`` says the file grew past it)."""
    digest = hashlib.sha256()
    size = 0
    while chunk := f.read(_CHUNK if limit is None else min(_CHUNK, limit + 1 - size)):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def too_large(path: str, size: int, bound: int, what: str) -> WorktreeError:
    """W-M12: a worktree over the manifest's bounds is refused, its content unread."""
    return WorktreeError(
        ReasonCode.WORKTREE_TOO_LARGE,
        f"{path}: {size} bytes, over the {what} bound of {bound} bytes a manifest reads",
    )


_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@contextlib.contextmanager
def beneath(root: str, rel: str) -> Iterator[tuple[int, str]]:
    """The directory holding ``rel`` (``/``-separated, below ``root``), opened one component
    at a time without following a symlink on the way, and ``rel``'s last name in it (W-M8).

    A listed path can have changed by the time it is read: a directory on it swapped for a
    symlink would take the read outside the worktree (to the runtime's files, to
    ``/proc/self``), and a path would follow it. A component that is no longer a directory
    raises :class:`NotADirectoryError`, as a path that vanished does."""
    *parents, name = rel.split("/")
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parents:
            try:
                below = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as error:
                if error.errno == errno.ELOOP:  # a symlink now: not the directory listed
                    raise NotADirectoryError(errno.ENOTDIR, "a symlink on the path", rel) from None
                raise
            os.close(fd)
            fd = below
        yield fd, name
    finally:
        os.close(fd)


def open_regular(directory: int, name: str) -> BinaryIO | None:
    """The file ``name`` in the open ``directory`` opened for reading if it is a regular
    file (never following a symlink, never blocking on a FIFO); ``None`` for anything
    else."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    fd = os.open(name, flags, dir_fd=directory)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def _entry(root: str, rel: str, budget: list[int]) -> FileEntry | None:
    """The entry of ``rel``, or ``None`` if it vanished or is not a file or symlink; its
    bytes are taken from ``budget[0]`` (W-M12: over it, or over :data:`MAX_FILE_BYTES`, the
    file is refused by its size, never read whole)."""
    full = os.path.join(root, rel)
    try:
        with beneath(root, rel) as (directory, name):
            st = os.stat(name, dir_fd=directory, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                target = os.fsencode(os.readlink(name, dir_fd=directory))
                return FileEntry(path=rel, size=-1, sha256=hashlib.sha256(target).hexdigest())
            if not stat.S_ISREG(st.st_mode):
                return None
            f = open_regular(directory, name)
        if f is None:
            return None
        with f:
            bound = min(MAX_FILE_BYTES, budget[0])
            size = os.fstat(f.fileno()).st_size
            if size <= bound:
                size, sha = hash_open_file(f, bound)
        if size > bound:  # by its size, or grown past the bound while it was read
            if size > MAX_FILE_BYTES:
                raise too_large(full, size, MAX_FILE_BYTES, "file")
            read = MAX_TOTAL_BYTES - budget[0] + size
            raise too_large(root, read, MAX_TOTAL_BYTES, "total")
        budget[0] -= size
        return FileEntry(path=rel, size=size, sha256=sha)
    except (FileNotFoundError, NotADirectoryError):
        return None  # it vanished: the tree is changing, and the digest will say so
    except OSError as error:
        if error.errno == errno.ELOOP:  # swapped for a symlink since its lstat
            return None
        raise unreadable(full, error) from None


def _walk(root: str, start: str = "") -> list[str]:
    """Every file and symlink under ``root`` (relative, ``/``-separated), or under its
    directory ``start`` only, never entering a symlinked directory or anything named
    ``.git``."""
    found: list[str] = []
    pending = [start]
    while pending:
        rel_dir = pending.pop()
        directory = os.path.join(root, rel_dir) if rel_dir else root
        try:
            entries = _listing_beneath(root, rel_dir)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as error:
            raise unreadable(directory, error) from None
        for name, is_dir in entries:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            (pending if is_dir else found).append(rel)
    return found


def _listing_beneath(root: str, rel_dir: str) -> list[tuple[str, bool]]:
    """The names in the directory ``rel_dir`` below ``root`` but ``.git``, each with whether
    it is a directory (never following a symlink), the directory reached without following a
    symlink on the way (W-M8): one swapped for a link since it was seen is not listed."""
    if not rel_dir:
        fd = os.open(root, _DIR_FLAGS)
    else:
        with beneath(root, rel_dir) as (parent, name):
            try:
                fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
            except OSError as error:
                if error.errno == errno.ELOOP:
                    raise NotADirectoryError(errno.ENOTDIR, "now a symlink", rel_dir) from None
                raise
    try:
        with os.scandir(fd) as it:  # looked at while ``fd`` is open: it stats through it
            return [
                (entry.name, entry.is_dir(follow_symlinks=False))
                for entry in it
                if entry.name != ".git"
            ]
    finally:
        os.close(fd)


def _sizes(root: str, paths: Iterable[str]) -> None:
    """W-M12 before a byte is read: a regular file over :data:`MAX_FILE_BYTES`, or all of them
    over :data:`MAX_TOTAL_BYTES`, is refused by ``lstat`` alone (never through a symlink on
    the path, W-M8); one that vanished is left to the read."""
    total = 0
    for rel in paths:
        try:
            with beneath(root, rel) as (directory, name):
                st = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if st.st_size > MAX_FILE_BYTES:
            raise too_large(os.path.join(root, rel), st.st_size, MAX_FILE_BYTES, "file")
        total += st.st_size
        if total > MAX_TOTAL_BYTES:
            raise too_large(root, total, MAX_TOTAL_BYTES, "total")


def _entries(root: str, paths: list[str]) -> tuple[FileEntry, ...]:
    _sizes(root, paths)
    budget = [MAX_TOTAL_BYTES]  # what may still be read: a file grown since its lstat
    entries = (_entry(root, rel, budget) for rel in sorted(paths, key=os.fsencode))
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


def git_env(**extra: str) -> dict[str, str]:
    """The environment of the runtime's own git calls on a worktree (W-M6): ``PATH`` and
    nothing else of the runtime's — the worktree is the worker's, and a filter or a hook it
    configured runs with this environment, so no key or password may be in it — with the
    system and user configuration left out, so the same tree digests alike on every host."""
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "LC_ALL": "C",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_OPTIONAL_LOCKS": "0",
        "GIT_TERMINAL_PROMPT": "0",
    }
    env.update(extra)
    return env


GIT_SECONDS: Final = 300.0
"""The longest one git call on a worktree may take (W-M6): past it, its whole process group
is killed and the call fails with its reason code."""
_GIT_OPTIONS: Final = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false")
"""No hook and no file-system monitor the worktree's configuration names runs (W-M6). Each
call also names the worktree as git's work tree (``--work-tree``): a ``core.worktree`` in the
worktree's configuration would otherwise make git add, and the candidate commit keep, another
directory's files — the runtime's, outside the worktree."""


def git(
    root: str,
    args: Sequence[str],
    *,
    env: dict[str, str],
    code: ReasonCode,
    stdin: bytes = b"",
    ok_codes: tuple[int, ...] = (0,),
    started: Callable[[int], None] | None = None,
    ended: Callable[[int], None] | None = None,
) -> tuple[int, bytes]:
    """Run git on the worktree ``root`` (W-M6, W-M9). ``started`` is called with git's pid
    before its standard input is written, ``ended`` with its return code once it is reaped
    (negative: killed by that signal), whatever the outcome."""
    try:
        process = subprocess.Popen(
            ["git", *_GIT_OPTIONS, "-C", root, f"--work-tree={root}", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # its group: whatever it started is killed with it
        )
    except OSError as error:
        raise WorktreeError(code, f"cannot run git {args[0]}: {error}") from None
    try:
        if started is not None:
            started(process.pid)
        stdout, stderr_bytes = process.communicate(stdin, timeout=GIT_SECONDS)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        raise WorktreeError(
            code, f"git {args[0]} in {root} did not finish within {GIT_SECONDS:g} s"
        ) from None
    finally:
        if process.returncode is None:  # interrupted: never left running
            _kill_group(process)
        if ended is not None:
            ended(process.returncode)
    if process.returncode not in ok_codes:
        stderr = _stderr_summary(stderr_bytes)
        raise WorktreeError(
            code, f"git {args[0]} failed in {root} (exit {process.returncode}): {stderr}"
        )
    return process.returncode, stdout


def _stderr_summary(stderr_bytes: bytes) -> str:
    """What a failed git said (W-C5): the short tail of its standard error, after git's own
    ``fatal:`` / ``error:`` lines when the tail lost them — they name what failed (a lock file
    left by a kill, W-C7, by its full path), the tail is often git's hint alone."""
    text = stderr_bytes.decode(errors="replace").strip()
    tail = text[-_STDERR_TAIL:]
    lines = [line for line in text.splitlines() if line.startswith(("fatal: ", "error: "))]
    said = "\n".join(lines)[-_STDERR_TAIL:]
    return tail if said in tail else f"{said}\n…\n{tail}"


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the git call's process group (a filter it started too) and reap it; its
    pipes are closed, whatever left the group holds them."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _back_link(git_dir: str) -> str | None:
    """The ``gitdir`` file of a linked worktree's directory: the ``.git`` file it serves."""
    try:
        directory = os.open(git_dir, _DIR_FLAGS)
        try:
            f = open_regular(directory, "gitdir")
        finally:
            os.close(directory)
    except OSError:
        return None
    if f is None:
        return None
    with f:
        return os.fsdecode(f.read(4096).strip()) or None


def repository(root: str) -> dict[str, str]:
    """The worktree's own repository, as ``GIT_DIR`` and ``GIT_COMMON_DIR`` for every later
    git call on it (W-M11): ``.git`` a directory (never a symlink) that is its own common
    directory, or a file naming a linked worktree's directory (``git worktree add``) whose
    ``gitdir`` file names this ``.git`` back. Any other — ``.git`` a symlink, a file naming
    another repository, a ``commondir`` pointing away — is ``worktree_unreadable``: the
    runtime's git would write the candidate's objects and ref into a repository outside the
    worktree, and take that repository's ``HEAD`` as the candidate's parent."""
    code = ReasonCode.WORKTREE_UNREADABLE
    dot = os.path.join(root, ".git")
    try:
        st = os.lstat(dot)
    except OSError as error:
        raise unreadable(dot, error) from None
    args = ["rev-parse", "--path-format=absolute", "--git-dir", "--git-common-dir"]
    lines = git(root, args, env=git_env(), code=code)[1].decode(errors="surrogateescape")
    git_dir, common = lines.splitlines()[:2]
    if stat.S_ISDIR(st.st_mode):
        own = _same(git_dir, dot) and _same(common, dot)
    elif stat.S_ISREG(st.st_mode):
        back = _back_link(git_dir)
        own = back is not None and _same(os.path.join(git_dir, back), dot)
    else:
        own = False
    if not own:
        raise WorktreeError(
            code,
            f"{dot} names the repository {common}, not the worktree's own (a .git directory, "
            "or a linked worktree's .git file its gitdir names back): its objects and refs "
            "are not the task's to write",
        )
    _no_way_out(git_dir, common)
    return {"GIT_DIR": git_dir, "GIT_COMMON_DIR": common}


_NEVER_OPENED: Final = frozenset({"hooks"})
"""What the runtime's git never opens in a repository (``core.hooksPath=/dev/null``, W-M6):
it may be a symlink (a shared hooks directory) and is not looked into (W-M13)."""


def _no_way_out(git_dir: str, common: str) -> None:
    """W-M13: nothing in the repository leads the runtime's git out of it. The worker writes
    its ``.git`` as it likes, and git follows a symlink in it: ``objects`` (or a fan-out
    directory, ``objects/pack``) takes the objects the manifest and the candidate write,
    ``refs/…`` the candidate's ref, an existing reflog is appended to (any file), and ``task
    forget`` rewrites ``packed-refs`` and unlinks the reflog through one — all into another
    repository or file. ``objects/info/alternates`` makes another repository's objects the
    worker's: its commits a ``HEAD`` and the candidate's parent. So a symlink anywhere in the
    git directory or the common directory (but :data:`_NEVER_OPENED`), or an ``alternates``
    file, is ``worktree_unreadable``. Every directory is listed, never followed; a name's type
    is the one the listing gives (no ``stat`` of each loose object)."""
    code = ReasonCode.WORKTREE_UNREADABLE
    tops = [common]
    real = os.path.realpath(common)
    if os.path.commonpath([os.path.realpath(git_dir), real]) != real:
        tops.append(git_dir)  # a linked worktree's directory is under its common directory
    for top in tops:
        pending = [top]
        while pending:
            directory = pending.pop()
            try:
                with os.scandir(directory) as it:
                    entries = list(it)
            except OSError as error:
                raise unreadable(directory, error) from None
            for entry in entries:
                if directory == top and entry.name in _NEVER_OPENED:
                    continue
                if entry.is_symlink():
                    target = "?"
                    with contextlib.suppress(OSError):
                        target = os.readlink(entry.path)
                    raise WorktreeError(
                        code,
                        f"{entry.path} is a symlink, to {target}: the "
                        "runtime's git would read and write through it, outside the "
                        "worktree's repository",
                    )
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
    alternates = os.path.join(common, "objects", "info", "alternates")
    if os.path.lexists(alternates):
        raise WorktreeError(
            code,
            f"{alternates} exists: another repository's objects would be the worktree's, "
            "its history the candidate's; a task's repository holds its own objects "
            "(git repack -a -d, then remove the file)",
        )


def _git_manifest(root: str) -> Manifest:
    code = ReasonCode.WORKTREE_UNREADABLE
    repo = repository(root)
    with tempfile.TemporaryDirectory(prefix="pi-runtime-index-") as scratch:
        env = git_env(GIT_INDEX_FILE=os.path.join(scratch, "index"), **repo)
        status, out = git(
            root,
            ["rev-parse", "--verify", "--quiet", "HEAD^{commit}"],
            env=env,
            code=code,
            ok_codes=(0, 1),
        )
        head = out.decode().strip() if status == 0 else None
        if head is not None:
            git(root, ["read-tree", head], env=env, code=code)
        # W-M12: what ``add`` would read, sized before it reads a byte of it
        listed = git(
            root,
            ["ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            env=env,
            code=code,
        )[1]
        _sizes(root, (os.fsdecode(p) for p in listed.split(b"\0") if p and not p.endswith(b"/")))
        git(root, ["add", "--all"], env=env, code=code)
        git_tree = git(root, ["write-tree"], env=env, code=code)[1].decode().strip()
        listing = git(root, ["ls-files", "-z", "--stage"], env=env, code=code)[1]
    paths = []
    for record in listing.split(b"\0"):
        if not record:
            continue
        meta, _, path = record.partition(b"\t")
        if meta.startswith(b"160000 "):
            # a nested repository (a submodule): the tree id holds only its HEAD commit, so
            # its files are listed here, all of them, or a change in them would change no
            # digest (W-M2, W-M3)
            paths.extend(_walk(root, os.fsdecode(path)))
            continue
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
    """The manifest of the worktree at ``root`` (blocking; W-M1…W-M6).

    A git repository gives a ``git`` manifest (tree id of the working tree, ``HEAD``,
    the files git sees); any other directory a ``files`` manifest of every file and
    symlink. Raises :class:`WorktreeError` ``worktree_missing`` or
    ``worktree_unreadable``."""
    path = check_root(root)
    if is_git(path):
        return _git_manifest(path)
    files = _entries(path, _walk(path))
    return Manifest(
        root=path, kind="files", digest=_digest("files", None, None, files), files=files
    )


WORKTREE_THREADS: Final = 4
"""Threads of a Trio run doing worktree work at once (a manifest, a candidate: git calls of up
to :data:`GIT_SECONDS` each, W-M6): they take their own tokens, never the default thread
limiter's, which the journal's file work shares."""
_WORKTREE_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar(
    "pi_runtime_worktree_limiter"
)


def worktree_limiter() -> trio.CapacityLimiter:
    """This Trio run's limiter of worktree threads (:data:`WORKTREE_THREADS`)."""
    try:
        return _WORKTREE_LIMITER.get()
    except LookupError:
        limiter = own_limiter(WORKTREE_THREADS)
        _WORKTREE_LIMITER.set(limiter)
        return limiter


async def amanifest(root: Path) -> Manifest:
    """:func:`take_manifest` off the Trio loop."""
    return await trio.to_thread.run_sync(take_manifest, root, limiter=worktree_limiter())


# --- the progress stamp (WD1; W-S1…W-S5 of docs/design/worktree.md) ------------------

STAMP_LIMIT: Final = 20_000
"""Entries a progress stamp looks at, at most, and (but for one) reads: its cost is bounded
whatever the worktree holds, a directory of millions of entries included (W-S3;
``docs/design/performance.md`` measures it)."""
_STAMP_DOMAIN: Final = b"pi-runtime.worktree-stamp.v2\0"
_PAST_THE_BOUND: Final = b"\0past the bound\0"
"""Hashed, with the directory's path and stat line, for the directory the bound ended the scan
in: none of its entries is (W-S4)."""


class WorktreeStamp(msgspec.Struct, frozen=True, kw_only=True):
    """What a cheap look at a worktree saw: a digest over the path, type, size and
    modification time (ns) of each entry looked at, in name order, never the contents
    (W-S1, W-S2). Any file written, created, removed, renamed or touched among them changes
    it. ``truncated``: a directory held more entries than the :data:`STAMP_LIMIT` bound had
    room left for, so the scan ended there, none of that directory's entries looked at but
    the directory itself (W-S4); ``entries`` is how many were looked at."""

    digest: str
    entries: int
    truncated: bool


def _listing(directory: bytes, room: int) -> list[os.DirEntry[bytes]] | None:
    """The entries of ``directory`` but ``.git``, or ``None`` when it holds more than
    ``room``: then no more than ``room + 1`` were read (W-S3). Raises :class:`OSError`."""
    entries: list[os.DirEntry[bytes]] = []
    with os.scandir(directory) as it:
        for entry in it:
            if entry.name == b".git":
                continue
            if len(entries) == room:
                return None  # one more than there is room for: the rest is never read
            entries.append(entry)
    return entries


def _stat_line(rel: bytes, info: os.stat_result) -> bytes:
    return b"%b\0%o\0%d\0%d\0" % (rel, info.st_mode, info.st_size, info.st_mtime_ns)


def worktree_stamp(root: Path, *, limit: int = STAMP_LIMIT) -> WorktreeStamp | None:
    """A bounded stat scan of ``root`` (blocking; W-S1…W-S5): each directory's entries in
    name order, then its subdirectories, depth first, never entering a symlinked directory
    or ``.git`` (git's own bookkeeping is no work on the task; a commit is a tool call,
    which is progress anyway). A directory is listed only as far as the bound has room
    for: one that holds more is not looked into, and the scan ends on it (W-S4). ``None``
    when the root cannot be read: no stamp, no claim of progress."""
    digest = hashlib.blake2b(_STAMP_DOMAIN, digest_size=16)
    seen = listed = 0  # entries looked at; entries listed (one vanished before its look too)
    pending = [b""]
    base = os.fsencode(root)
    try:
        os.stat(base)
    except OSError:
        return None
    while pending:
        rel_dir = pending.pop()
        directory = os.path.join(base, rel_dir) if rel_dir else base
        try:
            entries = _listing(directory, limit - listed)
        except OSError:  # vanished or unreadable: what it held is not looked at
            continue
        if entries is None:  # W-S4: its own path and stat line, none of its entries
            try:
                line = _stat_line(rel_dir, os.lstat(directory))
            except OSError:  # vanished meanwhile
                line = rel_dir + b"\0"
            digest.update(_PAST_THE_BOUND + line)
            return WorktreeStamp(digest=digest.hexdigest(), entries=seen, truncated=True)
        listed += len(entries)
        entries.sort(key=lambda e: e.name)  # W-S2: never the order the file system lists
        below: list[bytes] = []
        for entry in entries:
            rel = rel_dir + b"/" + entry.name if rel_dir else entry.name
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # it vanished between the listing and the look
            seen += 1
            digest.update(_stat_line(rel, info))
            if stat.S_ISDIR(info.st_mode):
                below.append(rel)
        pending.extend(reversed(below))  # the next looked into: the first by name
    return WorktreeStamp(digest=digest.hexdigest(), entries=seen, truncated=False)


# --- the candidate -------------------------------------------------------------------


# --- validation ----------------------------------------------------------------------
