"""A virtual clock that does not jump while the runtime waits on its own I/O threads."""

from __future__ import annotations

import os
from typing import Final

import trio
import trio.testing

from .._clock import OWN_LIMITERS
from .._journal._writer import handoffs_in_flight
from .._linux._proctree import proc_table

__all__ = ["io_aware_autojump_clock"]


def io_aware_autojump_clock(
    autojump_threshold: float = 0.0, *, follow_children: bool = False
) -> trio.testing.MockClock:
    """A :class:`~trio.testing.MockClock` with autojump, except while work is off the loop.

    Plain autojump jumps to the next deadline as soon as every task is blocked — also when a
    task only waits for a thread (a journal ``fdatasync``, a session read). Virtual time then
    races ahead a timer per jump while real I/O completes, and a test of a 300 s threshold
    sees timers fire that the worker never had a chance to beat. The clock returned here
    puts a jump off while a journal hand-off to a writer thread or a ``trio.to_thread`` call
    is in flight, or a child process of this process runs (a validation command, git, a
    worker; one that has exited is not waited for), and jumps once they settle
    (``clock.skipped_jumps`` counts the put-off jumps). The ``to_thread`` calls it sees are
    those on Trio's default limiter and on the runtime's own (the receipt store's, the
    PostgreSQL store's: :func:`runtime._clock.own_limiter`); a call on a limiter of a test's
    own, or a thread of its own reporting through ``trio.from_thread``, is not seen.

    While a child process runs, virtual time by default holds still: a child that never
    exits holds it still for good, and such a test hangs rather than lies. That suits a
    command that runs to its end; it does not suit a worker process the runtime talks to,
    whose launch, stop and turn wait on short timers of their own (a launch's proof polls
    every millisecond, a stop's grace is timed). With ``follow_children=True`` virtual time
    instead runs at the real clock's rate while a child process lives (the clock's ``rate``
    is 1 then; the loop looks again every ``FOLLOW_POLL`` seconds of real time) — what
    passes in virtual time is what really passed — and only once none lives, and no
    hand-off or thread is in flight, does it jump again. A test of a room worker with real
    Fake-Pi processes waits out a 20-minute provider outage this way in seconds: while every
    delivery is parked no worker lives.

    It wraps the instance's own autojump hook (``_autojump``, which Trio's run loop calls
    once every task has been blocked for ``autojump_threshold`` seconds of real time):
    ``MockClock`` cannot be subclassed.
    """
    clock = trio.testing.MockClock(autojump_threshold=autojump_threshold)
    jump = clock._autojump
    clock.skipped_jumps = 0  # type: ignore[attr-defined]

    def follow(following: bool) -> None:
        if following != (clock.rate > 0):
            clock.rate = 1.0 if following else 0.0
            clock.autojump_threshold = FOLLOW_POLL if following else autojump_threshold

    def autojump() -> None:
        children = _children_running()
        if follow_children:
            follow(children)
        holding = bool(handoffs_in_flight() or _threads_in_flight() or children)
        if clock.rate == 0:
            # while it holds, the loop waits for I/O up to HOLD_POLL before it asks again
            # (a thread's or a child's end wakes it at once) instead of spinning a core
            clock.autojump_threshold = (
                max(autojump_threshold, HOLD_POLL) if holding else (autojump_threshold)
            )
        if holding:
            clock.skipped_jumps += 1  # type: ignore[attr-defined]
            return
        jump()

    clock._autojump = autojump  # type: ignore[method-assign]
    return clock


FOLLOW_POLL: Final = 0.005
"""How often (real seconds) a clock following its children's real time looks whether they
have all ended, when nothing else wakes the loop."""


HOLD_POLL: Final = 0.001
"""How long (real seconds) the loop waits for I/O before it looks again whether a held
jump may be made (what it waits for ends with I/O that wakes it sooner)."""


def _children_running() -> bool:
    """Whether a child process of this process is alive (Linux). A child that has exited
    but is not reaped yet (a zombie) is not: code that waits on a timer before it reaps
    would otherwise hold virtual time for good.

    ``waitid`` with ``WNOWAIT`` answers without reaping: no child at all, or children none
    of which has exited (alive, then). Only with an exited one among them are the children
    looked up one by one, by their parent in ``/proc/<pid>/stat`` (the process's id, which
    no thread's start or end changes — the per-thread ``children`` lists do, a moment when
    the thread that started a child exits)."""
    try:
        exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    if exited is None:
        return True
    me = os.getpid()
    return any(info.ppid == me and info.alive for info in proc_table().values())


def _threads_in_flight() -> int:
    """Calls of ``trio.to_thread`` not yet back in Trio: on the default limiter, or on a
    store's own (:func:`runtime._clock.own_limiter`: the receipt store's, the PostgreSQL
    store's). A limiter's token is given back only once its caller runs again, so a call
    whose thread has finished but whose result Trio has not yet taken in still counts."""
    limiters = [trio.to_thread.current_default_thread_limiter(), *OWN_LIMITERS]
    return sum(int(limiter.statistics().borrowed_tokens) for limiter in limiters)
