"""Owning a worker's whole process tree: cgroup v2, child subreaper, nonce scan.

Nothing here knows about Pi. A *tree* is everything one process epoch started,
and membership is only ever decided by proof (``docs/design/workers.md``):

* **cgroup** — the process is in the epoch's own cgroup v2 (entered before the
  worker's first instruction, so no fork escapes it);
* **nonce** — the process's ``/proc/<pid>/environ`` (its environment at exec)
  carries ``PI_RUNTIME_EPOCH=<nonce>``; every descendant inherits it;
* **root** — the process is a root the caller proved (pid, start time and boot
  id all match), or a descendant by parent pid of a proven member.

Signals go through a pidfd opened *after* the proof and re-checked against the
start time the proof was read with, so a reused pid is never signalled. Reaping
is only ever ``waitpid(pid, WNOHANG)`` of a proven member that is this process's
child and not registered as waited for by someone else (Trio): never
``waitpid(-1)``, which would steal exit statuses Trio waits for.

Error handling: reading ``/proc`` races with processes exiting; a process that
vanished is simply not a member any more. It also races with ``execve``: between
the exec's point of no return and the kernel publishing the new image, a live
process's ``cmdline`` and ``environ`` both read empty (seen in about one read of
three right after a launch). Such a process is *undecided*, never "not a member":
:func:`scan_tree` reads again until it is decided or its bound runs out.
:func:`kill_tree` never raises for a process it could not kill; it reports it as
a survivor.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import secrets
import signal
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import trio
import trio.lowlevel

from .._clock import SystemWallClock
from .._errors import descriptors_exhausted
from ._proc import ProcessIdentity, boot_id, process_start_time

__all__ = [
    "CGROUP_PARENT_NAME",
    "EPOCH_ENV",
    "CgroupSupport",
    "KillReport",
    "ProcInfo",
    "TreeProof",
    "TreeScan",
    "carries_nonce",
    "cgroup2_mount",
    "cgroup_member",
    "cgroup_pids",
    "create_cgroup",
    "exec_pending",
    "find_members",
    "has_nonce",
    "is_alive_pid",
    "is_child_subreaper",
    "kill_tree",
    "new_nonce",
    "probe_cgroups",
    "proc_table",
    "read_environ",
    "reap_proven",
    "remove_cgroup",
    "scan_tree",
    "set_child_subreaper",
    "settled_environ",
    "subreaper_supported",
    "sweep_stale_cgroups",
    "trio_managed",
    "valid_nonce",
]

EPOCH_ENV: Final = "PI_RUNTIME_EPOCH"
"""The environment variable that carries an epoch's nonce to every descendant."""
CGROUP_PARENT_NAME: Final = "pi-runtime"
"""Epoch cgroups are ``<cgroup2 mount>/pi-runtime/<nonce>``."""
_NONCE: Final = re.compile(r"[0-9a-f]{32}")
STALE_CGROUP_SECONDS: Final = 3600.0
"""An empty epoch cgroup unchanged this long was left by a host that died before removing it."""
_PR_SET_CHILD_SUBREAPER: Final = 36
_PR_GET_CHILD_SUBREAPER: Final = 37
_GONE: Final = (b"Z", b"X")
_PF_KTHREAD: Final = 0x00200000
"""``/proc/<pid>/stat`` flags bit of a kernel thread (no user memory: nothing to read)."""
_ENV_END: Final = 51
"""``/proc/<pid>/stat`` field (1-based) ``env_end``: where the image's environment ends. An
exec's new image starts with it zero, and the kernel sets it last, once it has laid out the
arguments and the environment (``create_elf_tables``); no process can set it to zero."""
_EXEC_SETTLE: Final = 0.001
"""How long to wait before reading an undecided (mid-exec) process again: an exec takes
microseconds to a few milliseconds to publish its new image, and the kernel sends no event."""


def new_nonce() -> str:
    """A fresh epoch nonce: 128 random bits as 32 lowercase hex digits."""
    return secrets.token_hex(16)


def valid_nonce(nonce: str) -> bool:
    """Whether ``nonce`` has the shape :func:`new_nonce` gives (never a short or empty one)."""
    return _NONCE.fullmatch(nonce) is not None


# ---------------------------------------------------------------------------------- /proc


@dataclass(frozen=True, slots=True)
class ProcInfo:
    """One line of the process table (from ``/proc/<pid>/stat``)."""

    pid: int
    ppid: int
    start_time: int
    state: bytes

    @property
    def alive(self) -> bool:
        """Not a zombie (a zombie holds only its pid and exit status)."""
        return self.state not in _GONE


def _read_stat(pid: int) -> ProcInfo | None:
    stat = _read_bytes(f"/proc/{pid}/stat")
    if stat is None:  # gone, or never there
        return None
    rest = stat[stat.rindex(b")") + 2 :].split()
    state = rest[0]
    if state in _GONE:  # only its main thread may have ended: the process lives while any does
        state = _live_thread(pid)[1] or state
    return ProcInfo(pid=pid, ppid=int(rest[1]), start_time=int(rest[19]), state=state)


def _live_thread(pid: int) -> tuple[int, bytes | None]:
    """A thread of ``pid`` other than its main one that has not exited, and its state, or
    ``(pid, None)``. A process whose main thread called ``exit`` (not ``exit_group``) reads as
    a zombie in ``/proc/<pid>/stat`` while its other threads run on: it is alive, and its
    environment is read through a live thread (``/proc/<pid>/environ`` reads empty)."""
    try:
        tids = [int(name) for name in os.listdir(f"/proc/{pid}/task") if int(name) != pid]
    except OSError as error:
        if descriptors_exhausted(error):  # not looked at (L21): raised, never "no thread"
            raise
        return pid, None
    for tid in tids:
        stat = _read_bytes(f"/proc/{pid}/task/{tid}/stat")
        if stat is None:  # exited meanwhile
            continue
        state = stat[stat.rindex(b")") + 2 :].split()[0]
        if state not in _GONE:
            return tid, state
    return pid, None


def is_alive_pid(pid: int) -> bool:
    """Whether some process (not a zombie) has this pid now."""
    info = _read_stat(pid)
    return info is not None and info.alive


def proc_table() -> dict[int, ProcInfo]:
    """Every process visible in ``/proc`` now."""
    table: dict[int, ProcInfo] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = _read_stat(int(name))
            if info is not None:
                table[info.pid] = info
    return table


def read_environ(pid: int) -> bytes | None:
    """The process's environment at exec (``/proc/<pid>/environ``); ``None`` if unreadable.

    Empty for a zombie, and for a moment right after an exec, before the kernel
    has published the new image's environment.
    """
    environ = _read_bytes(f"/proc/{pid}/environ")
    if environ:
        return environ
    tid, state = _live_thread(pid)  # a main thread that exited: the live threads share the mm
    if state is None:
        return environ
    return _read_bytes(f"/proc/{pid}/task/{tid}/environ")


def _read_bytes(path: str) -> bytes | None:
    """``path``'s bytes, or ``None`` when it is gone or not ours to read. A want of file
    descriptors is raised (L21): a file not looked at is never taken for one that is gone."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as error:  # gone, or not ours to read — or not looked at (L21): raised
        if descriptors_exhausted(error):
            raise
        return None


def exec_pending(pid: int) -> bool:
    """Whether ``pid`` is a live user process caught inside an ``execve``: its new image's
    arguments and environment are not published yet, so both read empty, and its
    ``env_end`` reads zero. (A kernel thread reads empty too, always; it is never pending.
    Nor is a process whose ``env_end`` is set but whose arguments read empty: it unmapped
    or emptied them, and stays so; any unprivileged process can.)"""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read(1):
                return False
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError as error:  # gone, or not ours to read — or not looked at (L21): raised
        if descriptors_exhausted(error):
            raise
        return False
    rest = stat[stat.rindex(b")") + 2 :].split()
    # (a kernel before 3.5 has no such field: the empty reads alone decide, as before)
    unpublished = len(rest) <= _ENV_END - 3 or int(rest[_ENV_END - 3]) == 0
    return rest[0] not in _GONE and not int(rest[6]) & _PF_KTHREAD and unpublished


def _decided_environ(pid: int) -> bytes | None:
    """The environment, ``None`` if unreadable, or ``b""`` only when it is truly empty (or the
    process is a zombie or kernel thread, or hid it); raises :class:`_Undecided` while an
    exec is under way. An empty read followed by a published ``cmdline`` or ``env_end`` is
    read again: the exec finished in between."""
    environ = read_environ(pid)
    if environ != b"":
        return environ
    if exec_pending(pid):
        raise _Undecided(pid)
    return read_environ(pid)


class _Undecided(Exception):
    """A process inside an exec: its environment cannot be read yet."""


async def settled_environ(pid: int, *, bound: float = 1.0) -> bytes | None:
    """:func:`read_environ`, but never the empty read of a process inside an exec: read again
    (every millisecond, at most ``bound`` seconds of Trio's clock) until the exec published
    the new image. After the bound, the empty read is returned."""
    with trio.move_on_after(bound):
        while True:
            try:
                return _decided_environ(pid)
            except _Undecided:
                await trio.sleep(_EXEC_SETTLE)
    return read_environ(pid)


def has_nonce(environ: bytes | None, nonce: str) -> bool:
    return environ is not None and f"{EPOCH_ENV}={nonce}".encode() in environ.split(b"\0")


def carries_nonce(pid: int, nonce: str) -> bool:
    """Whether the process's environment at exec holds ``PI_RUNTIME_EPOCH=<nonce>``."""
    return has_nonce(read_environ(pid), nonce)


def _ancestors(table: dict[int, ProcInfo]) -> set[int]:
    """This process and every ancestor of it: never signalled, whatever a record says."""
    mine = {0, 1}
    pid = os.getpid()
    while pid > 1 and pid not in mine:
        mine.add(pid)
        info = table.get(pid) or _read_stat(pid)
        pid = info.ppid if info is not None else 0
    return mine


# --------------------------------------------------------------------------------- cgroup


def cgroup2_mount(mounts: str | None = None) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted, if anywhere.

    ``/sys/fs/cgroup`` on a unified host, ``/sys/fs/cgroup/unified`` on a hybrid
    one; any other cgroup2 mount as a last resort.
    """
    if mounts is None:
        data = _read_bytes("/proc/self/mounts")
        if data is None:
            return None
        mounts = os.fsdecode(data)
    found = [line.split()[1] for line in mounts.splitlines() if line.split()[2:3] == ["cgroup2"]]
    for preferred in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if preferred in found:
            return Path(preferred)
    return Path(found[0]) if found else None


@dataclass(frozen=True, slots=True)
class CgroupSupport:
    """Whether epochs can get their own cgroup here, and why not."""

    mount: Path | None
    parent: Path | None
    """``<mount>/pi-runtime`` when a child cgroup could be created in it."""
    kill: bool
    """The kernel has ``cgroup.kill`` (5.14+); without it members are killed one by one."""
    reason: str = ""
    """Why epochs cannot get a cgroup (empty when they can)."""

    @property
    def usable(self) -> bool:
        return self.parent is not None


@functools.cache
def probe_cgroups(mount: Path | None = None) -> CgroupSupport:
    """Try to create (and remove) a cgroup under ``<mount>/pi-runtime``; cached per mount.
    A want of file descriptors is raised, never cached as an answer (L21)."""
    mount = mount or cgroup2_mount()
    if mount is None:
        return CgroupSupport(mount=None, parent=None, kill=False, reason="no cgroup2 mount")
    parent = mount / CGROUP_PARENT_NAME
    probe = parent / f"probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        parent.mkdir(exist_ok=True)
        probe.mkdir()
    except OSError as error:
        reason = f"cannot create cgroups under {parent}: {error.strerror or error}"
        return CgroupSupport(mount=mount, parent=None, kill=False, reason=reason)
    try:
        kill = (probe / "cgroup.kill").exists()
        procs = (probe / "cgroup.procs").exists()
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    if not procs:
        return CgroupSupport(mount=mount, parent=None, kill=False, reason="no cgroup.procs")
    return CgroupSupport(mount=mount, parent=parent, kill=kill)


def create_cgroup(parent: Path, nonce: str) -> Path:
    """Create the epoch's cgroup ``<parent>/<nonce>`` (it must not exist yet)."""
    path = parent / nonce
    path.mkdir()
    return path


def sweep_stale_cgroups(
    parent: Path, *, older_than: float = STALE_CGROUP_SECONDS, now: float | None = None
) -> int:
    """Remove the empty epoch cgroups under ``parent`` unchanged for ``older_than`` seconds
    (by the wall clock against the directory's change time); return how many went.

    A host removes its epochs' cgroups when it stops them; one killed first (SIGKILL, a
    power loss) leaves them, and the next start of that state directory removes only the
    ones its records name. Every host on the machine shares ``parent``, so none may take
    another's: a cgroup with a member, in it or in a cgroup below it (which the tree may have
    made, and which goes with it), is left whole, and an epoch enters its cgroup moments
    after creating it, so the age leaves alone the only empty cgroup a live epoch has.

    The system's wall clock, never an injected one (docs/design/clocks.md C4): it is compared
    with the ctime the kernel stamped on that clock. A step of it moves the age by as much: set
    back, an empty cgroup stays that much longer (removed by a later start); set forward by
    more than ``older_than`` in the moment between a live epoch's ``mkdir`` and its entering,
    that one launch fails (``worker_launch_failed``: its cgroup is gone), as any failed launch
    does."""
    now = SystemWallClock().time_ms() / 1000 if now is None else now
    removed = 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    for name in names:
        if not (valid_nonce(name) or name.startswith("probe-")):
            continue
        path = parent / name
        try:
            if now - path.stat().st_ctime < older_than or _populated(path):
                continue
        except OSError:  # gone, or not ours to read
            continue
        removed += remove_cgroup(path)
    return removed


def _populated(path: Path) -> bool:
    """Whether some process is in the cgroup or in one below it (``cgroup.events``, the
    kernel's own count); ``True`` when it cannot be read, so nothing is removed on a guess."""
    try:
        events = (path / "cgroup.events").read_text()
    except OSError:
        return True
    return "populated 0" not in events.splitlines()


def _cgroups_below(path: Path) -> list[Path]:
    """The cgroups below ``path`` (a tree's processes may make some), deepest first."""
    below: list[Path] = []
    for top, names, _ in os.walk(path, topdown=False):
        below += (Path(top, name) for name in names)
    return below


def cgroup_pids(path: Path) -> list[int]:
    """The live members of a cgroup and of every cgroup below it (zombies are not listed);
    none if it is gone."""
    pids: list[int] = []
    for cgroup in (path, *_cgroups_below(path)):
        try:
            text = (cgroup / "cgroup.procs").read_text()
        except OSError:
            continue
        pids += (int(word) for word in text.split())
    return pids


def _cgroup_kill(path: Path) -> bool:
    try:
        (path / "cgroup.kill").write_text("1")
    except OSError:
        return False
    return True


def cgroup_member(pid: int, path: Path) -> bool:
    """Whether ``pid`` is in the cgroup at ``path`` (its ``0::`` line names it)."""
    mount = cgroup2_mount()
    if mount is None:
        return False
    try:
        relative = "/" + str(path.relative_to(mount))
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except (OSError, ValueError):
        return False
    return f"0::{relative}" in lines


def remove_cgroup(path: Path) -> bool:
    """Remove an (empty) epoch cgroup, and first every (empty) cgroup below it, which the
    tree may have made (the kernel refuses to remove a cgroup that has a child); ``True``
    when it is gone."""
    for below in _cgroups_below(path):
        with contextlib.suppress(OSError):  # populated yet, or gone: the last rmdir tells
            below.rmdir()
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


async def _remove_when_empty(path: Path, bound: float) -> bool:
    """Remove a killed tree's cgroup once the kernel has let go of it. A process whose main
    thread is already a zombie can still have a thread exiting: ``cgroup.procs`` is empty
    while ``cgroup.threads`` is not, and ``rmdir`` fails with EBUSY until that thread is gone.
    So retry within ``bound`` seconds (Trio's clock), polling every few milliseconds."""
    with trio.move_on_after(bound):
        while not remove_cgroup(path):  # noqa: ASYNC110 - the kernel sends no event we own
            await trio.sleep(0.005)
        return True
    return remove_cgroup(path)


# ------------------------------------------------------------------------------ subreaper


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def set_child_subreaper(enabled: bool = True) -> bool:
    """Make this process the child subreaper for its descendants (or stop being one)."""
    return int(_libc().prctl(_PR_SET_CHILD_SUBREAPER, int(enabled), 0, 0, 0)) == 0


def subreaper_supported() -> bool:
    """Whether the kernel knows child subreapers (``PR_GET_CHILD_SUBREAPER`` works; 3.4+)."""
    value = ctypes.c_int(0)
    return int(_libc().prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0)) == 0


def is_child_subreaper() -> bool:
    """Whether this process is a child subreaper (``PR_GET_CHILD_SUBREAPER``)."""
    value = ctypes.c_int(0)
    if int(_libc().prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0)) != 0:
        return False
    return value.value != 0


_MANAGED: set[int] = set()


@contextlib.contextmanager
def trio_managed(pid: int) -> Iterator[None]:
    """Mark ``pid`` as a child whose exit status someone else waits for: never reaped here."""
    _MANAGED.add(pid)
    try:
        yield
    finally:
        _MANAGED.discard(pid)


def reap_proven(proven: dict[int, int]) -> list[int]:
    """Reap the proven members (pid → start time) that are our own unwaited zombies.

    Only ``waitpid(pid, WNOHANG)``, only for a child of this process, only when
    its start time is the one it was proven with, never for a Trio-managed pid.
    """
    me = os.getpid()
    reaped = []
    for pid, start_time in list(proven.items()):
        try:
            info = _read_stat(pid)
        except OSError:  # not looked at for want of a descriptor (L21): a later call reaps it
            continue
        if info is None or info.start_time != start_time:
            proven.pop(pid, None)
            continue
        if info.ppid != me or pid in _MANAGED or info.alive:
            continue
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done == pid:
            reaped.append(pid)
            proven.pop(pid, None)
    return reaped


# ---------------------------------------------------------------------------- membership


@dataclass(frozen=True, slots=True)
class TreeProof:
    """What proves membership in one epoch's tree."""

    nonce: str
    roots: tuple[ProcessIdentity, ...] = ()
    """Identities the caller proved (e.g. the worker it launched)."""
    cgroup: Path | None = None


@dataclass(frozen=True, slots=True)
class TreeScan:
    """One scan of the process table against a :class:`TreeProof`."""

    members: dict[int, ProcInfo]
    """Every process proven to belong to the tree (zombies included)."""
    undecided: frozenset[int] = frozenset()
    """Processes caught inside an exec, whose nonce could not be read: neither proven
    members nor proven strangers. Never signalled; a later scan decides them."""

    def live(self) -> dict[int, ProcInfo]:
        return {pid: info for pid, info in self.members.items() if info.alive}


def find_members(proof: TreeProof, table: dict[int, ProcInfo]) -> TreeScan:
    """Scan ``table`` for the members of the tree (see :class:`TreeScan`)."""
    members: dict[int, ProcInfo] = {}
    undecided: set[int] = set()
    if proof.cgroup is not None:
        for pid in cgroup_pids(proof.cgroup):
            if pid in table:
                members[pid] = table[pid]
    this_boot = boot_id()
    for root in proof.roots:
        info = table.get(root.pid)
        if info is not None and root.boot_id == this_boot and info.start_time == root.start_time:
            members[root.pid] = info
    for pid, info in table.items():
        if pid in members:
            continue
        try:
            if has_nonce(_decided_environ(pid), proof.nonce):
                members[pid] = info
        except _Undecided:
            undecided.add(pid)
    # the runtime, its ancestors and PID 1 are never members, nor a way in: a root that names
    # one of them (a record's exact identity) must not make their other children members (W5)
    mine = _ancestors(table)
    for pid in mine:
        members.pop(pid, None)
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    todo = list(members)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in members and child not in mine:
                members[child] = table[child]
                todo.append(child)
    return TreeScan(members, frozenset(undecided - members.keys() - mine))


async def scan_tree(proof: TreeProof, *, bound: float = 1.0) -> TreeScan:
    """:func:`find_members` over the live process table, scanned again (every millisecond, at
    most ``bound`` seconds of Trio's clock) while some process is undecided (inside an exec).
    The last scan is returned; its ``undecided`` is empty unless the bound ran out."""
    scan = find_members(proof, proc_table())
    with trio.move_on_after(bound):
        while scan.undecided:
            await trio.sleep(_EXEC_SETTLE)
            scan = find_members(proof, proc_table())
    return scan


# ---------------------------------------------------------------------------------- kill


@dataclass(frozen=True, slots=True)
class KillReport:
    """What a :func:`kill_tree` did."""

    killed: tuple[int, ...] = ()
    """Pids sent SIGKILL."""
    reaped: tuple[int, ...] = ()
    """Adopted pids this process reaped."""
    survivors: tuple[int, ...] = ()
    """Members still alive when the bound ran out (or that refused the signal)."""
    undecided: tuple[int, ...] = ()
    """Processes still inside an exec at the last scan: perhaps members, perhaps not."""
    cgroup_killed: bool = False
    cgroup_removed: bool = True
    """The tree's cgroup (if any) is gone."""

    @property
    def clean(self) -> bool:
        """Nothing of the tree is alive (proven: no process left undecided) and its cgroup
        is gone."""
        return not self.survivors and not self.undecided and self.cgroup_removed


def _open_verified(pid: int, start_time: int) -> int | None:
    """A pidfd for ``pid`` if it is still the process that started at ``start_time``."""
    try:
        fd = os.pidfd_open(pid)
    except OSError as error:
        if descriptors_exhausted(error):  # not looked at (L21): raised
            raise
        return None
    if process_start_time(pid) != start_time:
        os.close(fd)
        return None
    return fd


async def _wait_exited(fds: Iterable[int]) -> None:
    """Wait until every pidfd's process has exited (a pidfd polls readable then)."""
    for fd in fds:
        await trio.lowlevel.wait_readable(fd)


def _last_pid() -> int:
    """The pid the kernel gave out last (the end of ``/proc/loadavg``); 0 if unknown."""
    loadavg = _read_bytes("/proc/loadavg")
    try:
        return int(loadavg.split()[-1]) if loadavg else 0
    except ValueError:
        return 0


def _newest_first(pids: Iterable[int], last: int) -> list[int]:
    """``pids`` from the most recently made back: the kernel gives pids out in a cycle, and
    ``last`` is the last one it gave (``pid_max`` is 32768 on many hosts: the cycle wraps
    within minutes on a busy one, so the highest pid is not the newest)."""
    return sorted(pids, key=lambda pid: (pid > last, -pid))


def _made_since(before: int, now: int) -> list[int]:
    """The pids given out after ``before`` up to ``now``, newest first (``[]`` when the cycle
    wrapped meanwhile: the caller lists ``/proc`` again)."""
    return list(range(now, before, -1)) if now > before else []


_CHASES: Final = 64
"""How many times one sweep follows the pids made while it read (a tree that forks on)."""


@dataclass
class _Kill:
    proof: TreeProof
    proven: dict[int, int] = field(default_factory=dict)
    killed: set[int] = field(default_factory=set)
    reaped: list[int] = field(default_factory=list)
    refused: set[int] = field(default_factory=set)

    async def scan(self, bound: float) -> TreeScan:
        scan = await scan_tree(self.proof, bound=bound)
        for pid, info in scan.members.items():
            self.proven[pid] = info.start_time
        return scan

    def sweep(self) -> list[int]:
        """Kill at once every live process that carries the nonce, newest first, each one
        the moment it is proven (its stat, then its environment, then the pidfd): a process
        that lives shorter than a scan of the whole table (a tree that forks and lets its
        parent exit, on and on) is met while it lives, and cannot fork again. The pids it
        signalled: the tree was not gone then, whatever the next scan finds (W3, W6)."""
        mine = _ancestors({})
        found: list[int] = []
        last = _last_pid()
        pids = _newest_first((int(name) for name in os.listdir("/proc") if name.isdigit()), last)
        self._sweep(pids, mine, found)
        for _ in range(_CHASES):  # then the pids made meanwhile: a forking tree's newest
            newest = _last_pid()
            if newest == last:
                break
            made = _made_since(last, newest)
            if not made:  # wrapped: list again
                made = _newest_first(
                    (int(name) for name in os.listdir("/proc") if name.isdigit()), newest
                )
            self._sweep(made, mine, found)
            last = newest
        return found

    def _sweep(self, pids: Iterable[int], mine: set[int], found: list[int]) -> None:
        for pid in pids:
            if pid in mine or pid in self.refused:
                continue
            info = _read_stat(pid)
            if info is None or not info.alive:
                continue
            if not has_nonce(read_environ(pid), self.proof.nonce):
                continue  # a stranger, or inside an exec: the scan decides it
            fd = _open_verified(pid, info.start_time)
            if fd is None:
                continue
            try:
                sent = self._kill(fd, pid)
            finally:
                os.close(fd)
            if sent:
                self.proven[pid] = info.start_time
                found.append(pid)

    def _kill(self, fd: int, pid: int) -> bool:
        """SIGKILL through ``fd`` (``pid``'s verified pidfd); whether it was sent — not to a
        process already gone, nor to one that refused it (kept in :attr:`refused`)."""
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            return False
        except PermissionError:
            self.refused.add(pid)
            return False
        self.killed.add(pid)
        return True

    async def round(self, live: dict[int, ProcInfo]) -> bool:
        """Kill one scan's members and wait for them; ``False`` when all refused the signal."""
        fds = []
        try:
            for pid, info in live.items():
                if pid in self.refused:
                    continue
                fd = _open_verified(pid, info.start_time)
                if fd is None:
                    continue
                fds.append(fd)
                self._kill(fd, pid)
            await _wait_exited(fds)
        finally:
            for fd in fds:
                os.close(fd)
        await trio.lowlevel.checkpoint()
        self.reaped += reap_proven(self.proven)
        return any(pid not in self.refused for pid in live)


_WANT_AGAIN: Final = 0.01
"""How long a kill waits before it looks again after a want of file descriptors (seconds)."""
_FINAL_SCAN_BOUND: Final = 1.0
"""How long the scan that writes the report may wait for a process inside an exec."""


async def kill_tree(proof: TreeProof, *, give_up_after: float) -> KillReport:
    """SIGKILL every member of the tree until none is alive, reap what is ours, remove the cgroup.

    With a cgroup, ``cgroup.kill`` goes first (it cannot miss a fork); then scan
    rounds kill every proven member (cgroup, nonce, roots and their descendants)
    and wait for each one's exit on its pidfd, until a scan finds none alive or
    ``give_up_after`` seconds (Trio's clock) pass. Without a cgroup each round starts
    with a sweep that kills every nonce carrier the moment it is proven, newest first
    (:meth:`_Kill.sweep`: a tree that forks and exits faster than a scan reads the table
    is met only so); the rounds go on until a sweep and a scan both find nothing, and
    what a sweep still kills once the bound ran out is reported a survivor. A scan that
    meets a process inside an exec reads again until it is decided, so "none alive" is
    proven, not the result of an empty read; the last scan may take up to one more second.
    It returns a report either way: a process it could not kill is a survivor,
    never an exception (an enclosing cancel scope still cancels it like any other
    call).
    """
    state = _Kill(proof)
    cgroup_killed = proof.cgroup is not None and _cgroup_kill(proof.cgroup)
    sweeps = proof.cgroup is None  # with a cgroup, cgroup.kill cannot miss a fork
    with trio.move_on_after(give_up_after) as bounded:
        while True:
            try:
                swept = state.sweep() if sweeps else []
                live = (await state.scan(give_up_after)).live()
                if not live and not swept:
                    break
                if live and not await state.round(live) and not swept:
                    break
                await trio.lowlevel.checkpoint()
            except OSError as error:  # a scan or a pidfd wanted a descriptor (L21): again
                if not descriptors_exhausted(error):
                    raise
                await trio.sleep(_WANT_AGAIN)
    try:
        last = await state.scan(_FINAL_SCAN_BOUND)
    except OSError as error:  # the last look could not be taken: nothing is proven gone
        if not descriptors_exhausted(error):
            raise
        last = TreeScan({}, frozenset(state.proven) | {root.pid for root in proof.roots})
    alive = set(last.live())
    if sweeps and bounded.cancelled_caught:  # the tree may be outrunning the scans: look again
        try:
            alive.update(state.sweep())
        except OSError as error:  # the last scan's report stands (undecided, when it could not)
            if not descriptors_exhausted(error):
                raise
    state.reaped += reap_proven(state.proven)
    removed = True
    if proof.cgroup is not None and not alive:
        removed = await _remove_when_empty(proof.cgroup, give_up_after)
    return KillReport(
        killed=tuple(sorted(state.killed)),
        reaped=tuple(sorted(state.reaped)),
        survivors=tuple(sorted(alive)),
        undecided=tuple(sorted(last.undecided)),
        cgroup_killed=cgroup_killed,
        cgroup_removed=removed,
    )
