"""Driving a crash-test host process (``room_host.py``, ``task_host.py``): start it on a JSON
spec, read the facts it prints one JSON line at a time, SIGKILL it at the point a test wants.

And the hosts' side of it: :func:`emit` prints a fact, :func:`stop_here` stops the whole host
at a pause point (both hosts' ``pause`` option), :func:`pause_after_receipt_commit` is the
``receipt_commit`` point of both, :func:`pause_when_epoch_launched` their ``epoch_launched``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Final, NoReturn

import msgspec
import trio

from runtime._boundary._receipts import ReceiptStore
from runtime._pi._worker import Epoch
from runtime._records import EpochStarted

from ._procs import hosts_run_under, sweep_epochs

REPO: Final = Path(__file__).resolve().parents[1]
STOP_BOUND: Final = 10.0
"""Seconds a host that reported a pause has to be seen stopped (:meth:`Host.stopped`): it
stops itself right after the report, so only a host that does not stop there waits this."""
Fact = dict[str, Any]


class Host:
    """One run of the host process; its facts read line by line."""

    def __init__(self, process: trio.Process, stderr: Path) -> None:
        self.process = process
        self.stderr = stderr
        self._buffer = b""
        self.facts: list[Fact] = []

    def stderr_tail(self, limit: int = 4000) -> str:
        """The last ``limit`` characters the host wrote to its stderr file."""
        try:
            return self.stderr.read_text(errors="replace")[-limit:]
        except OSError as error:
            return f"(no stderr: {error})"

    def explain(self) -> str:
        """What a failing check saw: the exit status, the facts, the host's stderr tail."""
        return (
            f"host {self.stderr.stem}: exit status {self.process.returncode}\n"
            f"facts: {self.facts}\nstderr tail:\n{self.stderr_tail()}"
        )

    async def next_fact(self) -> Fact | None:
        assert self.process.stdout is not None
        while b"\n" not in self._buffer:
            data = await self.process.stdout.receive_some(65536)
            if not data:
                return None
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        fact: Fact = json.loads(line)
        self.facts.append(fact)
        return fact

    async def until(self, wanted: Callable[[Fact], bool]) -> Fact:
        while (fact := await self.next_fact()) is not None:
            if wanted(fact):
                return fact
        with trio.move_on_after(5):  # its exit status, if it is exiting; never a hang
            await self.process.wait()
        raise AssertionError(f"the host ended without the fact; {self.explain()}")

    async def finish(self) -> list[Fact]:
        while await self.next_fact() is not None:
            pass
        assert await self.process.wait() == 0, self.explain()
        return self.facts

    async def stopped(self) -> None:
        """Wait until the host has stopped itself (a pause point stops it whole:
        :func:`stop_here`) — on its state change, not by polling; raise if it ended instead,
        or is not stopped :data:`STOP_BOUND` seconds on. The stop is left for the host's
        SIGKILL (``WNOWAIT``: nothing is reaped)."""
        pid = self.process.pid

        def changed() -> os.waitid_result | None:
            return os.waitid(os.P_PID, pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)

        with trio.move_on_after(STOP_BOUND):  # the waiting thread ends with the host's kill
            seen = await trio.to_thread.run_sync(changed, abandon_on_cancel=True)
            if seen is None or seen.si_code != os.CLD_STOPPED:
                raise AssertionError(f"the host ended instead of stopping; {self.explain()}")
            return
        raise AssertionError(
            f"the host did not stop at its pause point within {STOP_BOUND} s; {self.explain()}"
        )

    async def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        await self.process.wait()


@contextlib.asynccontextmanager
async def run_host(
    script: Path, root: Path, spec: Mapping[str, Any], name: str
) -> AsyncIterator[Host]:
    """Run ``script`` on ``spec`` (written to ``root/<name>.json``, with ``base`` = ``root``);
    its stderr goes to ``root/<name>.stderr``. Killed on exit if still running. Its workers
    are looked for when the test ends (``tests/_procs.py``'s ``no_worker_left_by_hosts``)."""
    hosts_run_under(root)
    spec_path = root / f"{name}.json"
    spec_path.write_text(json.dumps({"base": str(root), **spec}))
    stderr_path = root / f"{name}.stderr"
    with stderr_path.open("wb") as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, str(script), str(spec_path)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=str(REPO),
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            yield Host(process, stderr_path)
        except BaseException as error:
            # The test failed (or was cancelled) with this host up: SIGKILLed, it would leave
            # its worker epochs running, and so may an earlier host no later one took over
            # from. Nothing any of them started outlives the test.
            with trio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                    await process.wait()
                left = await sweep_epochs(root)
            if left:
                error.add_note(f"worker epochs left running, killed as the host ended: {left}")
            raise
        finally:
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()


@contextlib.asynccontextmanager
async def no_epoch_left(root: Path) -> AsyncIterator[None]:
    """Around a crash test's hosts (every ``run_host`` on ``root``): when the block ends, kill
    whatever their worker epochs left running (:func:`~tests._procs.sweep_epochs`: each
    recorded tree from its record, as a restarted host does, and any unrecorded one by its
    nonce). A block that ended normally with anything left fails, naming the epochs and
    pids; a block that raised keeps its own error, with what was killed as a note."""
    try:
        yield
    except BaseException as error:
        with trio.CancelScope(shield=True):
            left = await sweep_epochs(root)
        if left:
            error.add_note(f"worker epochs left running, killed at the test's end: {left}")
        raise
    with trio.CancelScope(shield=True):
        left = await sweep_epochs(root)
    assert not left, f"worker epochs of the test's hosts left running (killed now): {left}"


def emit(fact: Fact) -> None:
    """In a host: print one fact, a JSON line, flushed at once (the test may kill it next)."""
    sys.stdout.write(msgspec.json.encode(fact).decode() + "\n")
    sys.stdout.flush()


def stop_here(point: str) -> NoReturn:
    """In a host, at a pause point: report the pause, then stop the whole host — every task
    and thread of it — at once (``SIGSTOP`` to itself, delivered before the call returns):
    from here on nothing of it runs, whatever the test does next, until its SIGKILL. Stopped
    again should anything continue it. Called from any of its tasks or threads.

    Not just the task that passed the point: the host's other tasks (a lane's watchdog
    ticks, another room's turn, a lease renewal, a writer thread) would go on for as long as
    the test's SIGKILL takes, and a test asserting what was durable at the point would depend
    on how loaded the machine is. Stopped, the host is as the SIGKILL at the point would have
    left it, however late the kill comes (:meth:`Host.stopped` waits for the stop)."""
    emit({"paused": point})
    while True:
        os.kill(os.getpid(), signal.SIGSTOP)


def pause_after_receipt_commit(barrier: Callable[[], Awaitable[None]]) -> None:
    """In a host: stop right after a ``write_document`` committed its revision and receipt,
    before the gate records the outcome (the ``receipt_commit`` pause point of both hosts)."""
    write = ReceiptStore.write_document

    async def after_commit(
        self: ReceiptStore, intent_id: str, args: Mapping[str, Any]
    ) -> dict[str, Any]:
        result = await write(self, intent_id, args)  # the revision and its receipt
        await barrier()  # before the gate records the outcome
        return result

    ReceiptStore.write_document = after_commit  # type: ignore[method-assign]


def pause_when_epoch_launched(nth: int) -> None:
    """In a host: stop once its ``nth`` worker epoch is launched and proven (W1) — the worker
    runs — before that epoch's ``EpochStarted`` record is built and appended: the launch
    window (``docs/design/workers.md`` W13; the ``epoch_launched`` point of both hosts)."""
    record = Epoch.record
    passed = 0

    def before_record(self: Epoch, epoch: int, *, started_ms: int) -> EpochStarted:
        nonlocal passed
        passed += 1
        if passed == nth:
            stop_here("epoch_launched")
        return record(self, epoch, started_ms=started_ms)

    Epoch.record = before_record  # type: ignore[method-assign]
