"""An adversary's tests of a worker's process boundary (docs/design/workers.md W1…).

Real processes, the real clock, every wait bounded by ``trio.fail_after``; nothing sleeps
to wait for something: a tree's death is proven by a pipe every member holds reaching its
end (only the death of the last holder closes it).
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import pytest
import trio
import trio.lowlevel

from runtime._errors import ReasonCode, WorkerError
from runtime._pi._rpc import open_rpc_channel
from runtime._pi._worker import Containment, StopPolicy, open_epoch

from .test_worker import CONTAINMENTS, _restore_subreaper  # noqa: F401 (an autouse fixture)

LIMIT: Final = 20.0
WORM: Final = """
import os, sys, time
flag, fifo = sys.argv[1], sys.argv[2]
out = os.open(fifo, os.O_WRONLY)  # every generation holds it: EOF only when all are dead
generation = 0
while os.path.exists(flag):  # the test's own way out, whatever the stop did
    time.sleep(0.002)
    if os.fork():
        os._exit(0)  # the parent goes at once: each generation lives a few milliseconds
    generation += 1
    if generation == 20:  # on the move: the worker itself is long gone
        os.write(out, b"ready\\n")
"""
"""A tree that is never the same process for long: fork, let the parent exit, repeat. A
scan of ``/proc`` takes longer than one generation lives."""


@contextmanager
def worm(root: Path) -> Iterator[tuple[list[str], int]]:
    """(the worm's argv, the read end of the pipe every generation holds)."""
    flag, fifo = root / "alive", root / "worm.fifo"
    flag.touch()
    os.mkfifo(fifo)
    read_end = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    assert stat.S_ISFIFO(os.fstat(read_end).st_mode)
    try:
        yield [sys.executable, "-c", WORM, str(flag), str(fifo)], read_end
    finally:
        flag.unlink()  # a survivor ends itself within milliseconds
        os.close(read_end)


async def _read_to_end(fd: int) -> bytes:
    data = b""
    while True:
        await trio.lowlevel.wait_readable(fd)
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            continue
        if not chunk:
            return data
        data += chunk


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_w3_w6_a_tree_that_forks_on_and_on_is_killed_or_reported(
    tmp_path: Path, containment: Containment
) -> None:
    """W3, W6: a process that forks and lets its parent exit every few milliseconds is a
    moving target (its pid changes faster than a scan of /proc reads the table). A stop
    kills it, or it reports a survivor (the block ends ``worker_tree_survived``); never
    "clean" while a generation lives. Before, without a cgroup, the stop found nothing,
    reported clean, and the worm ran on for ever."""
    with worm(tmp_path) as (argv, read_end), trio.fail_after(LIMIT):
        policy = StopPolicy(term_grace=0.5, kill_bound=3)
        survived: list[WorkerError] = []
        try:
            async with open_epoch(
                argv,
                env={"PATH": os.environ["PATH"]},
                cwd=tmp_path,
                containment=containment,
                policy=policy,
            ) as epoch:
                await trio.lowlevel.wait_readable(read_end)
                assert os.read(read_end, 6) == b"ready\n"
                report = await epoch.stop()
        except WorkerError as error:
            survived.append(error)
        if survived:  # reported: the block said so, and so did the report
            assert [error.code for error in survived] == [ReasonCode.WORKER_TREE_SURVIVED]
            assert not report.clean
            return
        assert report.clean
        with trio.fail_after(2):  # clean: every generation is dead, so the pipe has ended
            await _read_to_end(read_end)


async def test_w6_w10_r3_a_fence_ends_in_its_bounds_though_the_worker_reads_no_stdin(
    tmp_path: Path,
) -> None:
    """W6, W10, R3: the worker never reads its stdin and ignores SIGTERM, and a prompt larger
    than the pipe is being written when the fence lands: the block is still left within the
    write's bound (``stdin_stall``) and the stop's (``term_grace``, ``kill_bound``), and
    nothing of the tree is alive."""
    policy = StopPolicy(term_grace=1, kill_bound=2)
    argv = ["sh", "-c", "trap '' TERM; sleep 300"]
    with trio.fail_after(LIMIT):
        began = trio.current_time()
        with trio.move_on_after(0.5) as fence:
            async with (
                open_epoch(
                    argv, env={"PATH": os.environ["PATH"]}, cwd=tmp_path, policy=policy
                ) as epoch,
                open_rpc_channel(
                    epoch.stdin, epoch.stdout, stderr=epoch.stderr_tail, stdin_stall=1
                ) as rpc,
            ):
                await rpc.prompt("x" * 1_000_000)
        took = trio.current_time() - began
    assert fence.cancelled_caught
    report = await epoch.stop()  # idempotent: the report of the stop the block made
    assert report.clean, report
    assert not report.graceful  # SIGTERM was ignored: killed after the grace
    assert 1 + 1 <= took < 0.5 + 1 + 1 + 2 + 1 + 2  # stall, grace: both waited, no more
