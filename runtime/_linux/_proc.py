"""Exact process identity on Linux: pid alone is not enough (pids are reused).

An identity is (pid, start time in clock ticks since boot, boot id). A process
"is" the recorded one only when all three match; after a reboot or a pid reuse
they do not, and nothing may be signalled on the strength of a bare pid.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import msgspec

__all__ = [
    "ProcessIdentity",
    "boot_id",
    "forbid_inspection",
    "identity_of",
    "is_alive",
    "process_start_time",
]

_PR_SET_DUMPABLE = 4
_PR_GET_DUMPABLE = 3


def forbid_inspection() -> bool:
    """Make this process undumpable (``prctl(PR_SET_DUMPABLE, 0)``): its ``/proc/<pid>``
    files (``environ``, ``mem``, ``fd``…) become root's, so a process of the same user — a
    worker it runs, a git filter or a validation check the worker wrote — can no longer read
    the upstream key or a database password from its environment or memory (G9, W-M6). The
    process itself still reads its own ``/proc/self``; its children are dumpable again after
    ``exec``; it writes no core dump. Whether it holds now (False: ``prctl`` is not there)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        return False
    return bool(libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 0)


class ProcessIdentity(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    start_time: int
    boot_id: str


@functools.cache
def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``)."""
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        return f.read().strip()


def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat``, or ``None`` if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name (field 2) is in parentheses and may contain spaces
    rest = stat[stat.rindex(b")") + 2 :].split()
    return int(rest[19])


def identity_of(pid: int) -> ProcessIdentity | None:
    start = process_start_time(pid)
    if start is None:
        return None
    return ProcessIdentity(pid=pid, start_time=start, boot_id=boot_id())


def is_alive(identity: ProcessIdentity) -> bool:
    """Whether exactly this process still runs (not a zombie, not a reused pid)."""
    if identity.boot_id != boot_id():
        return False
    if process_start_time(identity.pid) != identity.start_time:
        return False
    try:
        with open(f"/proc/{identity.pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    state = stat[stat.rindex(b")") + 2 :].split()[0]
    return state not in (b"Z", b"X")


def current_identity() -> ProcessIdentity:
    identity = identity_of(os.getpid())
    assert identity is not None
    return identity
