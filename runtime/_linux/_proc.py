"""Exact process identity on Linux: pid alone is not enough (pids are reused).

An identity is (pid, start time in clock ticks since boot, boot id). A process
"is" the recorded one only when all three match; after a reboot or a pid reuse
they do not, and nothing may be signalled on the strength of a bare pid.
"""

from __future__ import annotations

import functools
import os

import msgspec

__all__ = ["ProcessIdentity", "boot_id", "identity_of", "is_alive", "process_start_time"]


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
