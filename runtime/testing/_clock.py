"""A virtual clock that does not jump while the runtime waits on its own I/O threads."""

from __future__ import annotations

import os

import trio
import trio.testing

from .._journal._writer import handoffs_in_flight

__all__ = ["io_aware_autojump_clock"]


def io_aware_autojump_clock(autojump_threshold: float = 0.0) -> trio.testing.MockClock:
    """A :class:`~trio.testing.MockClock` with autojump, except while work is off the loop.

    Plain autojump jumps to the next deadline as soon as every task is blocked — also when a
    task only waits for a thread (a journal ``fdatasync``, a session read). Virtual time then
    races ahead a timer per jump while real I/O completes, and a test of a 300 s threshold
    sees timers fire that the worker never had a chance to beat. The clock returned here
    puts a jump off while a journal hand-off to a writer thread or a ``trio.to_thread`` call
    on the default limiter is in flight, or a child process of this process runs (a
    validation command, git), and jumps once they settle (``clock.skipped_jumps`` counts the
    put-off jumps). Work on other capacity limiters (the receipt store's) is not seen. A
    child that never exits holds virtual time still: such a test hangs rather than lies.

    It wraps the instance's own autojump hook (``_autojump``, which Trio's run loop calls
    once every task has been blocked for ``autojump_threshold`` seconds of real time):
    ``MockClock`` cannot be subclassed.
    """
    clock = trio.testing.MockClock(autojump_threshold=autojump_threshold)
    jump = clock._autojump
    clock.skipped_jumps = 0  # type: ignore[attr-defined]

    def autojump() -> None:
        if handoffs_in_flight() or _threads_in_flight() or _children_running():
            clock.skipped_jumps += 1  # type: ignore[attr-defined]
            return
        jump()

    clock._autojump = autojump  # type: ignore[method-assign]
    return clock


def _children_running() -> bool:
    """Whether a child process of this process is alive (Linux; a child belongs to the
    thread that started it, and Trio starts processes from worker threads)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as children:
                if children.read().strip():
                    return True
        except OSError:
            continue
    return False


def _threads_in_flight() -> int:
    limiter = trio.to_thread.current_default_thread_limiter()
    return int(limiter.statistics().borrowed_tokens)
