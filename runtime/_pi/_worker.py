"""Process epochs: launching a worker (the real Pi or Fake-Pi) and owning its whole tree.

An *epoch* is one launch of a worker process for a lane. Its identity is
``(pid, start time, boot id, nonce)``: the nonce is handed over at launch in the
environment (``PI_RUNTIME_EPOCH``) and read back from ``/proc/<pid>/environ``
before the launch counts, so a record can never name someone else's process.
Every descendant inherits the nonce; with a cgroup v2 per epoch the tree is
also held by the kernel. The invariants (W1…) are in ``docs/design/workers.md``.

Resource handling: :func:`open_epoch` / :func:`open_worker` run the epoch in its
own nursery; leaving the block (normally, by an exception, or by cancellation —
a fence) stops it: SIGTERM to the worker, a bounded wait, SIGKILL to the whole
tree, reap, remove the cgroup. Nothing the worker started outlives the block.
:func:`kill_epoch_leftovers` does the same from an :class:`EpochStarted` record
alone, for a host taking over after a crash; :func:`kill_launch_leftovers` from the nonce
a caller journaled before the launch, for a crash before that record was written.

Error handling: launch problems raise :class:`WorkerError` with a ``worker_*``
reason code; a stop that leaves a live descendant raises ``worker_tree_survived``
when the block ends (never masking an exception from the block itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import functools
import os
import shutil
import signal
import struct
import subprocess
import termios
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NoReturn

import msgspec
import trio
import trio.lowlevel

from .._errors import ReasonCode, WorkerError, descriptors_exhausted, reraise
from .._linux._proc import ProcessIdentity, boot_id, process_start_time
from .._linux._proctree import (
    CGROUP_PARENT_NAME,
    EPOCH_ENV,
    KillReport,
    TreeProof,
    carries_nonce,
    cgroup2_mount,
    create_cgroup,
    has_nonce,
    is_child_subreaper,
    kill_tree,
    new_nonce,
    probe_cgroups,
    proc_table,
    read_environ,
    reap_proven,
    remove_cgroup,
    scan_tree,
    set_child_subreaper,
    sweep_stale_cgroups,
    trio_managed,
    valid_nonce,
)
from .._records import EpochStarted
from ._launch import ENV_ALLOWED as ENV_ALLOWED
from ._launch import QUIET_FLAGS as QUIET_FLAGS
from ._launch import ModelRoute as ModelRoute
from ._launch import RetrySettings as RetrySettings
from ._launch import WorkerKind as WorkerKind
from ._launch import WorkerLaunch as WorkerLaunch
from ._launch import WorkerProgram as WorkerProgram
from ._launch import check_launch
from ._launch import worker_argv as worker_argv
from ._launch import worker_environment as worker_environment
from ._launch import write_agent_files as write_agent_files

__all__ = [
    "ENV_ALLOWED",
    "QUIET_FLAGS",
    "Containment",
    "Epoch",
    "ModelRoute",
    "RetrySettings",
    "StopPolicy",
    "StopReport",
    "WorkerKind",
    "WorkerLaunch",
    "WorkerProgram",
    "kill_epoch_leftovers",
    "kill_launch_leftovers",
    "open_epoch",
    "open_worker",
    "worker_argv",
    "worker_environment",
    "write_agent_files",
]
_SHELL: Final = "/bin/sh"
_ENTER_CGROUP: Final = 'echo $$ > "$0" || exit 126; exec "$@"'
"""The launch shim: the worker's pid enters the epoch's cgroup before exec (W2)."""
_STDERR_TAIL: Final = 64 * 1024
_REDACTED: Final = b"[secret]"
_FRAGMENT: Final = 4
"""The shortest piece of a secret that a cut edge of the stderr tail is taken to have kept
(G9). A piece of 1 to 3 bytes is left as it is, and is no leak: it is all of that occurrence
the text holds (the rest was dropped before the tail, or is not read yet), so it tells at most
3 of the 43 characters of an epoch secret (18 of its 256 bits) or of a provider key (at its
start the key's public format prefix, at its end fewer than the last four characters most
providers show in their own errors and consoles). Quotes of the tail taken at different times,
put together, show at most a secret's first three and last three bytes (36 of 256 bits).
Matching so few bytes would also blot out ordinary text at many cuts."""
_encode = msgspec.json.Encoder()
_LINGERS: Final = 15
"""W14: how many more ``exit_linger`` periods a dead worker's stdout stays open while it
still holds unread bytes (30 s at the default)."""


def _unread(stream: trio.abc.ReceiveStream) -> int:
    """Bytes waiting in a pipe stream's kernel buffer (``FIONREAD``); 0 when unknown (closed,
    or no descriptor)."""
    fileno = getattr(stream, "fileno", None)
    if fileno is None:
        return 0
    try:
        answer = fcntl.ioctl(fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):  # closed meanwhile
        return 0
    count: int = struct.unpack("i", answer)[0]
    return count


def _redacted(data: bytes, secrets: Sequence[bytes], *, cut: bool) -> bytes:
    """``data`` with every occurrence of each secret (longest first) replaced by ``[secret]``;
    also the beginning of a secret that ends ``data`` — a tail read while the worker writes:
    one read brought the secret's first part and the next its rest, and the tail was taken
    between them — and, with ``cut`` (``data`` is a tail cut at an arbitrary byte), the end of
    a secret that the cut left at its start; either at least :data:`_FRAGMENT` bytes long."""
    for secret in secrets:
        data = data.replace(secret, _REDACTED)
    for secret in secrets:
        for size in range(len(secret) - 1, _FRAGMENT - 1, -1):
            if data.endswith(secret[:size]):
                data = data[:-size] + _REDACTED
                break
    if cut:
        for secret in secrets:
            for size in range(len(secret) - 1, _FRAGMENT - 1, -1):
                if data.startswith(secret[-size:]):
                    data = _REDACTED + data[size:]
                    break
    return data


# ---------------------------------------------------------------------------------- epochs


class Containment(enum.StrEnum):
    """How an epoch's tree is held (W2, W3)."""

    CGROUP = "cgroup"
    """A cgroup v2 per epoch, killed with ``cgroup.kill``; plus the nonce scan."""
    SUBREAPER = "subreaper"
    """The runtime is child subreaper; the nonce and parent-pid scan finds the tree."""
    SCAN = "scan"
    """Neither is available: the nonce and parent-pid scan alone."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StopPolicy:
    """Bounds of a stop, in seconds of Trio's clock."""

    term_grace: float = 5.0
    """How long the worker has to exit after SIGTERM before the tree is killed."""
    kill_bound: float = 5.0
    """How long killing the tree and reaping may take before survivors are reported."""
    reap_interval: float = 5.0
    """How often a subreaper epoch reaps the adopted orphans it proved while they lived."""
    exit_linger: float = 2.0
    """How long the worker's stdout is still read after the worker exited before it is
    ended (W14): what the worker wrote is read by then, and a descendant that inherited the
    pipe cannot hold it open."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StopReport:
    """How an epoch ended."""

    exit_status: int | None
    """The worker's status as Trio's ``Process.returncode`` reports it (``-9`` = SIGKILL)."""
    graceful: bool
    """The worker exited (by itself or after SIGTERM) before the tree was killed."""
    kill: KillReport

    @property
    def clean(self) -> bool:
        """The worker was reaped, nothing of the tree is alive and its cgroup is gone."""
        return self.kill.clean and self.exit_status is not None


class Epoch:
    """One running process epoch. Made by :func:`open_epoch` / :func:`open_worker`."""

    def __init__(
        self,
        *,
        process: trio.Process,
        identity: ProcessIdentity,
        nonce: str,
        cgroup: Path | None,
        containment: Containment,
        policy: StopPolicy,
        secrets: Collection[str] = (),
    ) -> None:
        self.process = process
        self.identity = identity
        self.nonce = nonce
        self.cgroup = cgroup
        self.containment = containment
        self.policy = policy
        self._stderr = bytearray()
        self._stderr_cut = False
        self._secrets = sorted({s.encode() for s in secrets if s}, key=len, reverse=True)
        self._adopted: dict[int, int] = {}
        self._stop_lock = trio.Lock()
        self._report: StopReport | None = None

    @property
    def pid(self) -> int:
        return self.identity.pid

    @property
    def stdin(self) -> trio.abc.SendStream:
        assert self.process.stdin is not None
        return self.process.stdin

    @property
    def stdout(self) -> trio.abc.ReceiveStream:
        assert self.process.stdout is not None
        return self.process.stdout

    def stderr_tail(self) -> bytes:
        """The last 64 KiB the worker (or anything it started) wrote to stderr, with every
        secret the epoch was given to hide (``secrets`` of :func:`open_epoch`) replaced by
        ``[secret]`` — also a piece of one that an edge of the tail cut (G9): this text is
        quoted in the error a worker's exit raises, which reaches logs and the API, and a
        worker may print a provider's error quoting the key."""
        return _redacted(bytes(self._stderr), self._secrets, cut=self._stderr_cut)

    def proof(self) -> TreeProof:
        """What proves membership in this epoch's tree (W1, W3)."""
        return TreeProof(nonce=self.nonce, roots=(self.identity,), cgroup=self.cgroup)

    async def members(self) -> list[ProcessIdentity]:
        """The live processes of the tree now, the worker included (a process caught inside
        an exec is read again until it is decided, bounded at one second)."""
        here = boot_id()
        scan = await scan_tree(self.proof())
        return [
            ProcessIdentity(pid=pid, start_time=info.start_time, boot_id=here)
            for pid, info in sorted(scan.live().items())
        ]

    def record(self, epoch: int, *, started_ms: int) -> EpochStarted:
        """The lane-log record a host needs to find and kill this tree after a crash (W7)."""
        return EpochStarted(
            epoch=epoch,
            pid=self.identity.pid,
            start_time=self.identity.start_time,
            boot_id=self.identity.boot_id,
            nonce=self.nonce,
            cgroup=None if self.cgroup is None else str(self.cgroup),
            started_ms=started_ms,
        )

    async def wait(self) -> int:
        """Wait for the worker process itself to exit; its status (Trio reaps it)."""
        return await self.process.wait()

    def hurry(self) -> None:
        """Its stop, from now on, kills the whole tree at once: no SIGTERM, no grace (a lane
        that another host may own now, scale-out.md S12)."""
        self.policy = dataclasses.replace(self.policy, term_grace=0.0)

    async def stop(self) -> StopReport:
        """SIGTERM, bounded wait, SIGKILL the whole tree, reap, remove the cgroup (W6).

        Idempotent; shielded from cancellation and bounded by :class:`StopPolicy`.
        """
        with trio.CancelScope(shield=True):
            async with self._stop_lock:
                if self._report is None:
                    self._report = await self._stop()
        assert self._report is not None
        return self._report

    async def _stop(self) -> StopReport:
        graceful = self.process.returncode is not None
        if not graceful and self.policy.term_grace > 0:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            with trio.move_on_after(self.policy.term_grace):
                await self.process.wait()
                graceful = True
        kill = await kill_tree(self.proof(), give_up_after=self.policy.kill_bound)
        with trio.move_on_after(self.policy.kill_bound):
            await self.process.wait()
        reap_proven(self._adopted)
        return StopReport(exit_status=self.process.returncode, graceful=graceful, kill=kill)

    async def _drain_stderr(self) -> None:
        assert self.process.stderr is not None
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            while data := await self.process.stderr.receive_some(65536):
                self._stderr += data
                if len(self._stderr) > _STDERR_TAIL:
                    self._stderr_cut = True
                    del self._stderr[:-_STDERR_TAIL]

    async def _end_stdout_after_exit(self) -> None:
        """W14: the worker's exit ends its stdout, ``exit_linger`` later, even while a
        descendant holds the pipe's write end (stdout would otherwise end only when the tree
        is stopped): a reader blocked on it gets ``ClosedResourceError``, its end of stream.
        Never while the pipe still holds bytes the reader has not taken (a loop busy past the
        linger: what the worker wrote last is its turn's end, and is read first), for up to
        :data:`_LINGERS` lingers more — a descendant that writes on and on is not waited for."""
        await self.process.wait()
        await trio.sleep(self.policy.exit_linger)
        for _ in range(_LINGERS):
            if not _unread(self.stdout):
                break
            await trio.sleep(self.policy.exit_linger)
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            await self.stdout.aclose()

    async def _reap_adopted(self) -> None:
        """As subreaper: prove adopted orphans while they live, reap them once they die (W4)."""
        me = os.getpid()
        while True:
            await trio.sleep(self.policy.reap_interval)
            try:
                for info in proc_table().values():
                    if info.ppid == me and info.alive and carries_nonce(info.pid, self.nonce):
                        self._adopted[info.pid] = info.start_time
            except OSError as error:  # no descriptor to look with (L21): next time
                if not descriptors_exhausted(error):
                    raise
            reap_proven(self._adopted)

    async def _close_streams(self) -> None:
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                    await stream.aclose()


@functools.cache
def _sweep_once(parent: Path) -> int:
    """The stale epoch cgroups hosts that died left under ``parent``, removed once per
    process (before its first epoch's cgroup)."""
    return sweep_stale_cgroups(parent)


def _choose(containment: Containment | None, nonce: str) -> tuple[Containment, Path | None]:
    """How the epoch is contained (blocking: called in a thread)."""
    try:
        support = probe_cgroups()
    except OSError as error:  # a want of descriptors (L21): never contained less for it
        raise _launch_failed(f"cannot look for a cgroup v2 mount: {error}", error) from error
    if containment in (None, Containment.CGROUP) and support.parent is not None:
        _sweep_once(support.parent)
        try:
            return Containment.CGROUP, create_cgroup(support.parent, nonce)
        except OSError as error:
            # for want of a descriptor it is not the cgroup's fault: never contained less
            if descriptors_exhausted(error) or containment is Containment.CGROUP:
                why = f"cannot create the epoch's cgroup: {error}"
                raise _launch_failed(why, error) from error
    elif containment is Containment.CGROUP:
        raise WorkerError(
            ReasonCode.WORKER_LAUNCH_FAILED, f"no usable cgroup v2 here: {support.reason}"
        )
    if containment is not Containment.SCAN and set_child_subreaper():
        return Containment.SUBREAPER, None
    return Containment.SCAN, None


def _launch_failed(why: str, error: OSError) -> WorkerError:
    """A launch that failed for ``error``: ``worker_launch_failed``, or, for want of a file
    descriptor (``EMFILE``/``ENFILE``), ``too_many_open_files`` — no worker ran, so nothing
    of it died: the caller waits and launches again (lanes.md L21)."""
    exhausted = descriptors_exhausted(error)
    code = ReasonCode.TOO_MANY_OPEN_FILES if exhausted else ReasonCode.WORKER_LAUNCH_FAILED
    return WorkerError(code, why)


def _resolve(argv0: str, env: Mapping[str, str]) -> str:
    found = shutil.which(argv0, path=env.get("PATH"))
    if found is None:
        raise WorkerError(ReasonCode.WORKER_NOT_FOUND, f"{argv0} was not found (PATH or path)")
    return found


async def _launch(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    containment: Containment | None,
    nonce: str | None,
    policy: StopPolicy,
    secrets: Collection[str],
) -> Epoch:
    nonce = nonce or new_nonce()
    if not valid_nonce(nonce):
        raise WorkerError(ReasonCode.WORKER_CONFIG_INVALID, "an epoch nonce is 32 hex digits")
    if not argv:
        raise WorkerError(ReasonCode.WORKER_CONFIG_INVALID, "an empty command line")
    full_env = {**env, EPOCH_ENV: nonce}
    full_env.setdefault("PWD", str(cwd))
    command = [_resolve(argv[0], full_env), *argv[1:]]
    mode, cgroup = await trio.to_thread.run_sync(_choose, containment, nonce)
    if cgroup is not None:
        command = [_SHELL, "-c", _ENTER_CGROUP, str(cgroup / "cgroup.procs"), *command]
    try:
        process = await trio.lowlevel.open_process(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=full_env,
            start_new_session=True,
        )
    except BaseException as error:  # a failed spawn, or a fence that landed first (W12)
        if cgroup is not None:
            remove_cgroup(cgroup)
        if not isinstance(error, OSError):
            raise
        raise _launch_failed(f"cannot start {argv[0]} in {cwd}: {error}", error) from error
    start_time = process_start_time(process.pid)
    identity = ProcessIdentity(pid=process.pid, start_time=start_time or 0, boot_id=boot_id())
    return Epoch(
        process=process,
        identity=identity,
        nonce=nonce,
        cgroup=cgroup,
        containment=mode,
        policy=policy,
        secrets=secrets,
    )


async def _environ_after_exec(process: trio.Process, nonce: str) -> bytes | None:
    """The environment of a process that has just exec'd, once it shows the nonce.

    The parent learns of a successful exec before the kernel has published the
    new image's environment, and the cgroup shim execs once more: a read can
    come back empty or partial while an exec is under way. Reads are retried
    (bounded at one second) until one shows the nonce or the process exited;
    that read is returned (re-reading could land inside the next exec).
    """
    environ = read_environ(process.pid)
    with trio.move_on_after(1.0):
        while not has_nonce(environ, nonce) and process.poll() is None:
            await trio.sleep(0.001)
            environ = read_environ(process.pid)
    return environ


async def _prove(epoch: Epoch) -> None:
    """Read the identity back: the new process must carry the nonce and be in its cgroup (W1).
    An identity that could not be read (for want of a file descriptor, L21) fails the launch
    as a ``WorkerError`` too, so the caller stops the epoch before it says so (W6)."""
    try:
        await _proven(epoch)
    except OSError as error:
        why = f"epoch {epoch.nonce}: the worker's identity could not be read back: {error}"
        raise _launch_failed(why, error) from error


async def _proven(epoch: Epoch) -> None:
    """:func:`_prove`'s reads and checks."""
    process = epoch.process
    if epoch.cgroup is not None:
        try:  # the shim already did this before exec; a second write is a no-op
            (epoch.cgroup / "cgroup.procs").write_text(str(process.pid))
        except OSError as error:
            if process_start_time(process.pid) is not None and process.returncode is None:
                raise WorkerError(
                    ReasonCode.WORKER_LAUNCH_FAILED,
                    f"cannot put the worker into {epoch.cgroup}: {error}",
                ) from error
    environ = await _environ_after_exec(process, epoch.nonce)
    if epoch.identity.start_time and has_nonce(environ, epoch.nonce):
        return
    if process.poll() is not None or process_start_time(process.pid) is None:
        with trio.move_on_after(1.0):
            await epoch._drain_stderr()
        tail = epoch.stderr_tail()
        said = tail[-600:].decode(errors="replace").strip()
        raise WorkerError(
            ReasonCode.WORKER_LAUNCH_FAILED,
            f"the worker exited during launch with status {process.returncode}"
            + (f"; it said: {said}" if said else ""),
            stderr=tail,
        )
    raise WorkerError(
        ReasonCode.WORKER_IDENTITY_MISMATCH,
        f"pid {process.pid} does not carry the epoch nonce in its environment",
    )


def _reraise_single(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Re-raise a group's only exception as itself, with its own context kept (no group leaks)."""
    if len(group.exceptions) != 1:
        raise group
    reraise(group.exceptions[0])


@contextlib.asynccontextmanager
async def open_epoch(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    containment: Containment | None = None,
    nonce: str | None = None,
    policy: StopPolicy | None = None,
    secrets: Collection[str] = (),
) -> AsyncIterator[Epoch]:
    """Launch ``argv`` as one process epoch and own its whole tree until the block ends.

    ``env`` is used as given (build it with :func:`worker_environment`) plus
    ``PI_RUNTIME_EPOCH``; stdin, stdout and stderr are pipes (stderr is drained
    into :meth:`Epoch.stderr_tail`). ``containment`` ``None`` picks a cgroup where
    one can be created, else the subreaper. ``nonce`` may be chosen (and
    journaled) by the caller before the launch; by default it is fresh. ``secrets``
    (the upstream key, the epoch's secrets) never leave in the stderr it quotes: they are
    blotted out of :meth:`Epoch.stderr_tail`, so of every error that quotes it.
    """
    policy = policy or StopPolicy()
    epoch = await _launch(
        argv,
        env=env,
        cwd=cwd,
        containment=containment,
        nonce=nonce,
        policy=policy,
        secrets=secrets,
    )
    with trio_managed(epoch.pid):
        try:
            async with trio.open_nursery() as nursery:
                try:
                    try:
                        await _prove(epoch)
                    except WorkerError as error:
                        # A launch that failed is stopped like any epoch; no block of the
                        # caller's ran, so a survivor of that stop is news it must get (W6):
                        # its "launch failed" then never reads as "nothing is left alive".
                        failed = await epoch.stop()
                        if not failed.clean:
                            raise WorkerError(
                                ReasonCode.WORKER_TREE_SURVIVED,
                                f"epoch {epoch.nonce}: its launch failed ({error.code}) and "
                                f"its stop left survivors {list(failed.kill.survivors)}",
                            ) from error
                        raise
                    nursery.start_soon(epoch._drain_stderr)
                    nursery.start_soon(epoch._end_stdout_after_exit)
                    if epoch.containment is Containment.SUBREAPER or is_child_subreaper():
                        nursery.start_soon(epoch._reap_adopted)
                    yield epoch
                finally:
                    report = await epoch.stop()
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            _reraise_single(group)
        finally:
            with trio.CancelScope(shield=True):
                await epoch.stop()
                await epoch._close_streams()
    if not report.clean:
        raise WorkerError(
            ReasonCode.WORKER_TREE_SURVIVED,
            f"epoch {epoch.nonce}: survivors {list(report.kill.survivors)}, undecided "
            f"{list(report.kill.undecided)}, worker status "
            f"{report.exit_status}, cgroup removed: {report.kill.cgroup_removed}",
        )


@contextlib.asynccontextmanager
async def open_worker(
    launch: WorkerLaunch,
    *,
    containment: Containment | None = None,
    nonce: str | None = None,
    policy: StopPolicy | None = None,
    secrets: Collection[str] = (),
) -> AsyncIterator[Epoch]:
    """Launch Pi or Fake-Pi (the same way, W9) as one epoch: :func:`open_epoch` for workers.
    ``secrets`` as there (a lane passes ``Boundaries.worker_secrets()``)."""
    check_launch(launch)
    try:
        write_agent_files(launch)
    except OSError as error:  # the worker's home: this launch's failure, never the host's
        why = f"cannot write the worker's settings in {launch.agent_dir}: {error}"
        raise _launch_failed(why, error) from error
    env = worker_environment(
        home=launch.home,
        agent_dir=launch.agent_dir,
        cwd=launch.cwd,
        tmp_dir=launch.tmp_dir,
        extra=launch.extra_env,
    )
    async with open_epoch(
        worker_argv(launch),
        env=env,
        cwd=launch.cwd,
        containment=containment,
        nonce=nonce,
        policy=policy,
        secrets=secrets,
    ) as epoch:
        yield epoch


# -------------------------------------------------------------------------------- takeover


def _recorded_cgroup(record: EpochStarted) -> Path | None:
    """The record's cgroup, only if it is an epoch cgroup this runtime made (W5)."""
    if record.cgroup is None:
        return None
    path = Path(record.cgroup)
    mount = cgroup2_mount()
    if (
        mount is None
        or path.name != record.nonce
        or path.parent != mount / CGROUP_PARENT_NAME
        or ".." in path.parts
    ):
        raise WorkerError(
            ReasonCode.WORKER_RECORD_INVALID,
            f"epoch record names cgroup {record.cgroup}, not {CGROUP_PARENT_NAME}/<nonce> "
            "under this host's cgroup2 mount",
        )
    return path if path.is_dir() else None


async def kill_epoch_leftovers(
    record: EpochStarted, *, policy: StopPolicy | None = None
) -> KillReport:
    """Kill whatever is left of a recorded epoch's tree, from the record alone (W7).

    Proof is the record's cgroup, the nonce in a process's environment, or the
    recorded identity (pid, start time *and* boot id all matching) and the
    descendants of proven members. A pid whose identity does not match is
    never signalled unless its own environment carries the nonce (W5). The
    cgroup is removed once empty. Safe to call for an epoch that is long gone.
    """
    policy = policy or StopPolicy()
    if not valid_nonce(record.nonce):
        raise WorkerError(ReasonCode.WORKER_RECORD_INVALID, "the epoch record's nonce is invalid")
    cgroup = _recorded_cgroup(record)
    root = ProcessIdentity(pid=record.pid, start_time=record.start_time, boot_id=record.boot_id)
    proof = TreeProof(nonce=record.nonce, roots=(root,), cgroup=cgroup)
    return await kill_tree(proof, give_up_after=policy.kill_bound)


async def kill_launch_leftovers(nonce: str, *, policy: StopPolicy | None = None) -> KillReport:
    """Kill whatever is left of a launch a crash cut before its :class:`EpochStarted` record,
    from the nonce its caller journaled before the spawn (W13).

    Proof is the nonce in a process's environment and the descendants of proven members,
    and the epoch's cgroup, whose name is the nonce (W2), if the launch made one. With no
    recorded identity no pid is signalled on its pid alone (W5). Safe to call for a launch
    that never spawned, or whose tree is long gone.
    """
    policy = policy or StopPolicy()
    if not valid_nonce(nonce):
        raise WorkerError(ReasonCode.WORKER_RECORD_INVALID, "the launch record's nonce is invalid")
    mount = cgroup2_mount()
    cgroup = None if mount is None else mount / CGROUP_PARENT_NAME / nonce
    proof = TreeProof(
        nonce=nonce, cgroup=cgroup if cgroup is not None and cgroup.is_dir() else None
    )
    return await kill_tree(proof, give_up_after=policy.kill_bound)
