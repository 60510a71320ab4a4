"""Looking for survivors: every descendant of an epoch inherits its nonce in its environment.

And leaving none: :func:`sweep_epochs` kills what the worker epochs of a test's hosts left
running, from their ``EpochStarted`` records (with the runtime's own
:func:`~runtime._pi._worker.kill_epoch_leftovers`, what a restarted host does) and, for an
epoch a host launched but never recorded, by its nonce."""

from __future__ import annotations

from pathlib import Path
from typing import Final

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
