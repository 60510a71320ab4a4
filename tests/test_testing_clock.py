"""The I/O-aware virtual clock users test with (``runtime.testing.io_aware_autojump_clock``):
virtual time holds while a child process of the test lives — and only while it lives."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio
import trio._core._thread_cache as thread_cache
import trio.testing


async def test_time_holds_while_a_child_runs_though_the_thread_that_started_it_retires(
    io_autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child belongs to the Trio worker thread that started it until that thread retires
    (``IDLE_TIMEOUT``, 10 s; shortened here to meet the moment often). The per-thread child
    lists then miss it for a moment, and a clock reading them jumped a 300 s watchdog over a
    0.1 s child (34 times in 100). The parent in ``/proc/<pid>/stat`` never misses it."""
    monkeypatch.setattr(thread_cache, "IDLE_TIMEOUT", 0.02)
    fired = 0
    for _ in range(20):
        process = await trio.lowlevel.open_process(["sleep", "0.1"])
        with trio.move_on_after(300) as watchdog:
            await process.wait()
        if watchdog.cancelled_caught:
            fired += 1
            process.kill()
            await process.wait()
    assert fired == 0


_ZOMBIE_CHECK = """
import os, subprocess
from runtime.testing._clock import _children_running
seen = [_children_running()]
child = subprocess.Popen(["true"])
os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, left unreaped
seen.append(_children_running())
child.wait()
sleeper = subprocess.Popen(["sleep", "600"])
seen.append(_children_running())
sleeper.kill()
sleeper.wait()
print(seen)
"""


def test_a_child_that_ended_but_is_not_reaped_holds_nothing() -> None:
    """A zombie is not a running child: code that waits on a timer before it reaps (a poll
    loop, a kill's grace) would otherwise hold virtual time for good, with no word why. (In
    a process of its own, whose children the test alone makes.)"""
    done = subprocess.run(
        [sys.executable, "-c", _ZOMBIE_CHECK], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[False, False, True]"
