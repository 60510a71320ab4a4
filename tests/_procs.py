"""Looking for survivors: every descendant of an epoch inherits its nonce in its environment.

And leaving none: :func:`sweep_epochs` kills what the worker epochs of a test's hosts left
running, from their ``EpochStarted`` records (with the runtime's own
:func:`~runtime._pi._worker.kill_epoch_leftovers`, what a restarted host does) and, for an
epoch a host launched but never recorded, by its nonce.

And checking none is left at a test's end: a test that starts host processes registers the
directory they run under (:func:`hosts_run_under`; ``tests/_host_process.py``'s ``run_host``
does it), and the :func:`no_worker_left_by_hosts` fixture (autouse in ``tests/rooms`` and
``tests/server``) fails the test if a worker process of theirs still runs when it ended.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final

import pytest

from runtime._errors import PiRuntimeError
from runtime._journal._journal import read_log
from runtime._linux._fs import OsFileSystem
from runtime._linux._proc import boot_id, process_start_time
from runtime._linux._proctree import (
    EPOCH_ENV,
    TreeProof,
    cgroup_pids,
    is_alive_pid,
    kill_tree,
    probe_cgroups,
    proc_table,
    read_environ,
    valid_nonce,
)
from runtime._pi._worker import kill_epoch_leftovers
from runtime._records import EpochStarted

KILL_BOUND: Final = 10.0
"""Seconds a sweep's kill of one tree may take before it reports survivors."""


def alive_with_nonce(nonce: str) -> list[int]:
    """Every live process whose environment carries the nonce (what a survivor check asks)."""
    marker = f"{EPOCH_ENV}={nonce}".encode()
    return [
        pid
        for pid, info in proc_table().items()
        if info.alive and marker in (read_environ(pid) or b"").split(b"\0")
    ]


def epoch_nonces(root: Path) -> set[str]:
    """The nonces of every live epoch whose worker runs with its HOME under ``root`` (never a
    sibling whose name only starts like it: ``…/test_x10`` is not under ``…/test_x1``)."""
    prefix, home = f"{EPOCH_ENV}=".encode(), f"HOME={root}".encode()
    nonces = set()
    for pid, info in proc_table().items():
        environ = (read_environ(pid) or b"").split(b"\0") if info.alive else []
        if any(entry == home or entry.startswith(home + b"/") for entry in environ):
            nonces |= {e[len(prefix) :].decode() for e in environ if e.startswith(prefix)}
    return nonces


async def kill_orphaned_epochs(root: Path) -> set[str]:
    """Kill the whole tree of every epoch whose worker runs with its HOME under ``root`` (what
    a SIGKILLed host left running); return their nonces. For a test that must change a
    worker's files while no host runs without the orphan changing them too."""
    nonces = epoch_nonces(root)
    for nonce in nonces:
        report = await kill_tree(TreeProof(nonce=nonce), give_up_after=KILL_BOUND)
        assert report.clean, report
    return nonces


def recorded_epochs(root: Path) -> list[EpochStarted]:
    """The ``EpochStarted`` record of every epoch in the lane logs of the file store at
    ``root/state`` (where the crash-test hosts keep theirs). A log that cannot be read (a
    torn last record a SIGKILL left) gives none; the nonce scan of :func:`sweep_epochs`
    still finds its workers by their HOME."""
    fs, state = OsFileSystem(), root / "state"
    found: list[EpochStarted] = []
    for log in sorted((state / "lanes").glob("*/lane.log")):
        try:
            records = read_log(fs, str(state), str(log.relative_to(state))).records
        except (OSError, PiRuntimeError):
            continue
        found += [record for record in records if isinstance(record, EpochStarted)]
    return found


def recorded_alive(record: EpochStarted) -> list[int]:
    """The live processes of a recorded epoch's tree: the recorded pid (if it is still the
    recorded process: start time and boot id), the members of its cgroup, and every process
    carrying its nonce."""
    pids = set(alive_with_nonce(record.nonce))
    if record.cgroup is not None:
        pids |= set(cgroup_pids(Path(record.cgroup)))
    if (
        record.boot_id == boot_id()
        and process_start_time(record.pid) == record.start_time
        and is_alive_pid(record.pid)
    ):
        pids.add(record.pid)
    return sorted(pids)


async def sweep_epochs(root: Path) -> dict[str, list[int]]:
    """Kill whatever the worker epochs of the hosts run under ``root`` left running: each
    recorded epoch's tree from its record, as a restarted host would (the runtime's
    :func:`~runtime._pi._worker.kill_epoch_leftovers`: cgroup, nonce, recorded identity),
    then any tree of an epoch never recorded (its worker's HOME under ``root``).

    Returns what was still alive before the kill, by epoch (pids), and what survived it:
    empty when the hosts left nothing. Never raises for what it finds; the caller decides
    whether a leftover fails the test."""
    left: dict[str, list[int]] = {}
    for record in recorded_epochs(root):
        name = f"epoch {record.epoch} ({record.nonce})"
        alive = recorded_alive(record)
        try:
            report = await kill_epoch_leftovers(record)
        except PiRuntimeError as error:  # a record it cannot act on: the nonce scan below
            left[f"{name}, not killed from its record ({error})"] = alive
            continue
        if alive:
            left[name] = alive
        if not report.clean:
            left[f"{name}, survived its kill"] = list(report.survivors + report.undecided)
    parent = probe_cgroups().parent
    for nonce in epoch_nonces(root):  # launched by a host killed before it was recorded
        alive = alive_with_nonce(nonce)
        mine = parent is not None and valid_nonce(nonce) and (parent / nonce).is_dir()
        cgroup = parent / nonce if mine and parent is not None else None
        proof = TreeProof(nonce=nonce, cgroup=cgroup)
        report = await kill_tree(proof, give_up_after=KILL_BOUND)
        left[f"unrecorded epoch ({nonce})"] = alive
        if not report.clean:
            left[f"unrecorded epoch ({nonce}), survived its kill"] = list(
                report.survivors + report.undecided
            )
    return left


HOST_ROOTS: Final[list[Path]] = []
"""The directories the current test ran host processes under (:func:`hosts_run_under`)."""
EXIT_BOUND: Final = 10.0
"""Seconds a worker still exiting as its test ends is waited for (on its pidfd)."""


def hosts_run_under(root: Path) -> None:
    """The current test runs host processes under ``root``: their workers are checked for at
    its end (:func:`no_worker_left_by_hosts`)."""
    if root not in HOST_ROOTS:
        HOST_ROOTS.append(root)


def workers_under(root: Path) -> dict[int, str]:
    """Every live process of a worker epoch run under ``root``, with its command line: one
    whose ``HOME`` is ``root`` or under it (every lane's worker gets a HOME of its own in the
    host's work root) and one carrying the nonce of such an epoch, or of an epoch recorded in
    ``root``'s lane logs (a descendant that set another HOME). Exact: a process of another
    test — of this run or of another checkout's — has neither (its HOME is under its own
    ``tmp_path``; a nonce is random per epoch)."""
    prefix, home = f"{EPOCH_ENV}=".encode(), f"HOME={root}".encode()
    environs = {
        pid: (read_environ(pid) or b"").split(b"\0")
        for pid, info in proc_table().items()
        if info.alive
    }
    markers = {f"{EPOCH_ENV}={r.nonce}".encode() for r in recorded_epochs(root)}
    for environ in environs.values():
        if any(entry == home or entry.startswith(home + b"/") for entry in environ):
            markers |= {entry for entry in environ if entry.startswith(prefix)}
    return {
        pid: _command_line(pid)
        for pid, environ in environs.items()
        if any(e == home or e.startswith(home + b"/") or e in markers for e in environ)
    }


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _pidfds(pids: Iterable[int], root: Path) -> dict[int, int]:
    """A pidfd for each of ``pids`` that still is a worker under ``root`` once the pidfd is
    open (so a pid reused since the scan is never waited on, nor signalled)."""
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        if pid in workers_under(root):
            fds[pid] = fd
        else:
            os.close(fd)
    return fds


def _wait_exits(fds: dict[int, int], bound: float) -> list[int]:
    """Wait up to ``bound`` seconds for the processes of ``fds`` to exit — on their pidfds,
    which become readable at the exit: no sleeping, no polling of the process table. The
    pids that have not exited by then."""
    poller = select.poll()
    for fd in fds.values():
        poller.register(fd, select.POLLIN)
    running = {fd: pid for pid, fd in fds.items()}
    deadline = time.monotonic() + bound
    while running and (left := deadline - time.monotonic()) > 0:
        for fd, _events in poller.poll(left * 1000):
            poller.unregister(fd)
            running.pop(fd, None)
    return sorted(running.values())


def leave_no_worker(root: Path, bound: float = EXIT_BOUND) -> dict[int, str]:
    """What :func:`workers_under` ``root`` finds still running once each has had ``bound``
    seconds to exit (a worker legitimately still exiting as its test ends is waited for);
    those are killed (SIGKILL through the pidfd: that process, no other) and returned, by pid,
    with their command lines. Empty: nothing was left."""
    found = workers_under(root)
    fds = _pidfds(found, root)
    try:
        left = _wait_exits(fds, bound)
        for pid in left:
            signal.pidfd_send_signal(fds[pid], signal.SIGKILL)
        _wait_exits({pid: fds[pid] for pid in left}, bound)
        return {pid: found[pid] for pid in left}
    finally:
        for fd in fds.values():
            os.close(fd)


@pytest.fixture
def no_worker_left_by_hosts() -> Iterator[None]:
    """After a test that ran host processes (:func:`hosts_run_under`): no worker process any
    of them started is still running — a host that stopped cleanly stopped its workers, and
    one SIGKILLed had its orphans killed by the host that recovered after it (W7), or the test
    killed them itself. One still exiting is waited for, a bounded while, on its pidfd; what
    is left is killed and fails the test (a teardown error naming each process). The same
    check as ``tests/_host_process.py``'s ``no_epoch_left`` (task crash tests), found by what
    every worker carries — its HOME under the test's directory, its epoch's nonce — since a
    room worker's epochs may be in no file the test can read (a PostgreSQL store)."""
    HOST_ROOTS.clear()
    yield
    roots = list(HOST_ROOTS)
    HOST_ROOTS.clear()
    left = {f"{root}: {pid}": line for root in roots for pid, line in leave_no_worker(root).items()}
    assert not left, f"worker processes of the test's hosts left running (killed now): {left}"
