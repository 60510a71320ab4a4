"""A task's validation receipt: the task's check command run on the final worktree, bounded,
with an allow-listed environment, and bound to the manifest it ran against (W-V1…W-V3 of
``docs/design/worktree.md``), so "tests passed" names the tree they passed on."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import msgspec
import trio
import trio.lowlevel

from .._linux._proctree import EPOCH_ENV, TreeProof, kill_tree, new_nonce, trio_managed
from ._worktree import Manifest, amanifest, check_root

__all__ = ["OUTPUT_TAIL_BYTES", "VALIDATION_ENV", "ValidationReceipt", "run_validation"]


VALIDATION_ENV: Final = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "TMPDIR", EPOCH_ENV)
"""The only variables a validation child gets (W-V3): the runtime's values of the others, and
for ``PI_RUNTIME_EPOCH`` a fresh nonce of the check's own, never the runtime's — what it starts
inherits it, so what left its process group is still found and killed (W-V2)."""


OUTPUT_TAIL_BYTES: Final = 4096
"""How much of a validation's combined output its receipt keeps (W-V1)."""


_DRAIN_SECONDS: Final = 1.0


_REAP_SECONDS: Final = 5.0


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


async def _kill_escaped(nonce: str) -> None:
    """SIGKILL every process carrying the check's nonce — what it started that left its
    process group (``setsid``, a double fork) — and wait for their exits, at most
    :data:`_REAP_SECONDS` (W-V2). A process that cleared its environment is not found: only
    a cgroup would contain that, and the check runs in none."""
    await kill_tree(TreeProof(nonce=nonce), give_up_after=_REAP_SECONDS)


async def run_validation(
    root: Path,
    command: Sequence[str],
    manifest: Manifest,
    *,
    timeout: float,  # noqa: ASYNC109
) -> ValidationReceipt:
    """Run ``command`` in the worktree at ``root`` and receipt it (W-V1…W-V3) with the digest
    of the tree it ran on, taken here just before it starts — not ``manifest``'s copied: a
    tree that changed after ``manifest`` was taken gives another digest, and the Done tuple
    then finds the validation not of its manifest (LK4). The tree is not taken again after
    the command: a check that writes caches would otherwise never pass.

    It runs in a new session (its own process group), with stdin ``/dev/null`` and the
    allow-listed environment, at most ``timeout`` seconds; then (or as soon as it exits)
    its process group is killed. A command that cannot be started gives a receipt with
    exit status 127 and the reason as output. Cancellation kills the group too.
    Raises :class:`WorktreeError` ``worktree_missing`` if ``root`` is not a directory."""
    path = check_root(root)
    argv = tuple(command)
    if not argv:
        raise ValueError("an empty validation command")
    nonce = new_nonce()
    env = {key: os.environ[key] for key in VALIDATION_ENV if key in os.environ}
    env[EPOCH_ENV] = nonce
    ran_on = (await amanifest(root)).digest
    tail = _Tail(OUTPUT_TAIL_BYTES)
    started = trio.current_time()

    def receipt(exit_status: int, prefix: str = "") -> ValidationReceipt:
        return ValidationReceipt(
            command=argv,
            exit_status=exit_status,
            manifest_digest=ran_on,
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
    swept = False
    with trio_managed(proc.pid):  # its exit status is Trio's, never reaped by a sweep
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
                await _kill_escaped(nonce)  # nor what left its group (setsid, a daemon)
                swept = True
                with trio.move_on_after(_DRAIN_SECONDS):
                    await drained.wait()
                nursery.cancel_scope.cancel()
        finally:
            _kill_group(proc.pid)
            with trio.CancelScope(shield=True):
                if not swept:  # cancelled or failed before the sweep: it is done here
                    await _kill_escaped(nonce)
                with trio.move_on_after(_REAP_SECONDS):
                    await proc.wait()
                await stdout.aclose()
            if pidfd is not None:
                os.close(pidfd)
    status = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    return receipt(status, f"timed out after {timeout:g}s\n" if timed_out else "")
