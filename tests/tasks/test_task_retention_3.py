"""Task retention (``docs/design/retention.md``), third part: ``task forget``'s deletion of a
candidate's git ref killed while git holds the ref's lock (RT12 with ``worktree.md`` W-C6), and
a task id used again whose expiry a pass could not claim on PostgreSQL (RT13, RT19). Real git
and real processes stopped where the crash must come; real PostgreSQL (pgserver), the wall
clock a mock moved on by days."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Final

import pytest
import trio

from runtime._clock import Clocks, MockWallClock
from runtime._errors import ReasonCode, TaskError, WorktreeError
from runtime._journal._postgres import open_pg_store
from runtime._journal._store import lane_key
from runtime._linux._proctree import is_alive_pid
from runtime._retention import follow_forget_days
from runtime._tasks._candidate import CANDIDATE_REF_PREFIX, take_candidate
from runtime._tasks._retention import TaskRetention, _delete_ref
from runtime._tasks._worktree import take_manifest

from ..journal.pg_fixtures import execute, pg_dsn, pg_server
from ..task_harness import TASK
from .test_task_hosts import LIMIT
from .test_task_hosts import task_host as pg_task_host
from .test_task_retention_budget_adversarial import (
    DAY,
    DAY_MS,
    TWO_LIVES,
    _days,
    _let_go_then_used_again,
    _shared,
)
from .test_worktree_adversarial import git, make_repo
from .test_worktree_adversarial_2 import _wait_for, crash_holding_the_ref_lock, killed

__all__ = ["killed", "pg_dsn", "pg_server"]  # the fixtures this module uses

REF: Final = CANDIDATE_REF_PREFIX + "t"

FORGET: Final = """
import sys
from runtime._tasks._retention import _delete_ref
_delete_ref(sys.argv[1], sys.argv[2])
"""


# -- RT12, W-C6: git's lock on the candidate ref, left by a killed ``task forget`` ------------


@pytest.mark.parametrize("then", ["forget", "candidate"])
def test_rt12_w_c6_a_ref_lock_left_by_a_killed_forget_is_taken_over_once_its_owner_is_gone(
    tmp_path: Path, killed: list[int], then: str
) -> None:
    """RT12, W-C6: ``task forget`` deletes the task's candidate ref with ``git update-ref``;
    the runtime and that git are killed (``SIGKILL``) while git holds
    ``refs/pi-runtime/candidates/t.lock``. A real stop at that moment: another git of the
    worker's holds ``packed-refs.lock`` (a ``pack-refs`` at work; here a file standing for it)
    and the worker's configuration makes git wait for it (``core.packedRefsTimeout = -1``),
    so git waits inside the deletion, the ref's lock held. While git lives its lock is never
    taken; once it is gone (and the other git is done), the next forget deletes the ref — or
    the next candidate of the task is published. Before, the deletion recorded nothing and
    took no part in W-C6: its lock stayed for ever, every later forget and every candidate of
    the task (an id used again) failing "File exists" (``checkpoint_failed``)."""
    repo = make_repo(tmp_path / "w", {"a.txt": b"a\n"})
    manifest = take_manifest(repo)
    take_candidate(repo, manifest, archive_dir=tmp_path / "a", task_id="t", message="")
    packed_lock = repo / ".git" / "packed-refs.lock"
    packed_lock.write_bytes(b"")  # the worker's pack-refs, at work
    git(repo, "config", "core.packedRefsTimeout", "-1")
    git_lock = repo / ".git" / "refs" / "pi-runtime" / "candidates" / "t.lock"
    git_pid = crash_holding_the_ref_lock([FORGET, str(repo), REF], git_lock, killed)

    with pytest.raises(WorktreeError) as caught:
        _delete_ref(str(repo), REF)
    assert caught.value.code is ReasonCode.WORKTREE_UNREADABLE
    assert git_lock.exists(), "a lock whose owner lives was taken"

    os.kill(git_pid, signal.SIGKILL)  # now git too: its lock stays behind
    _wait_for("git is gone", lambda: not is_alive_pid(git_pid))
    assert git_lock.exists()
    packed_lock.unlink()  # the worker's pack-refs is done; nothing of ours is cleaned up
    git(repo, "config", "--unset", "core.packedRefsTimeout")

    if then == "forget":
        assert _delete_ref(str(repo), REF)
        assert git(repo, "for-each-ref", "refs/pi-runtime") == ""
    else:  # the id used again: its next candidate
        (repo / "a.txt").write_bytes(b"again\n")
        again = take_manifest(repo)
        candidate = take_candidate(repo, again, archive_dir=tmp_path / "a", task_id="t", message="")
        assert git(repo, "rev-parse", REF) == candidate.ref
    assert not git_lock.exists()


# -- RT13, RT19 on PostgreSQL: a task id used again whose lane a pass could not claim ----------


@pytest.mark.trio
async def test_rt13_rt19_a_task_id_used_again_is_kept_until_its_own_expiry(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT13, RT19: TASK ends at day 0, is expired at day 31 and let go at day 40; submitted
    again at day 41 it ends there, and a host's start raises ``forget_days`` to 400, so the
    earlier task's row holds the id back once more. At day 72 the new task is past
    ``idempotency_days`` but its lane is held (another host's lease runs): the pass cannot
    claim it, and the new task's log stays in the database, not expired. Its host keeps it
    as ended (``task show`` answers its end), and once the lease is gone the next pass
    expires it: its log deleted, its row moved to its own end. Before, the host took the
    earlier task's row for the new task's expiry and forgot it — no later pass of its looked
    at it again, and its log stayed in the database, never expired, until a restart."""
    wall = MockWallClock()
    clocks = Clocks(wall=wall)
    subject = f"task:{TASK}"
    key = lane_key(subject)
    with trio.fail_after(LIMIT):
        async with (
            pg_task_host(tmp_path, "a", pg_dsn, [*TWO_LIVES, *TWO_LIVES], clocks=clocks) as a,
            open_pg_store(pg_dsn, root=tmp_path / "z" / "state", owner="z", clocks=clocks) as z,
        ):  # fmt: skip
            await _let_go_then_used_again(a, wall, tmp_path)
            ended_ms = (await a.runner.wait(TASK)).ended_ms
            store = _shared(a)
            await follow_forget_days(a.runner.host.store, _days(400))
            wall.advance(31 * DAY)  # day 72: past idempotency_days, the earlier row held
            held = await store.expired_task_keys([key])
            assert await z.claim(subject, 600.0) is not None  # a holder: the pass cannot claim
            first = await a.runner.retain(_days(400))
            try:
                state = a.runner.show(TASK).state
            except TaskError as error:
                state = str(error.code)
            log_kept = await store.exists(store.lane_rel(subject))
            gone = "UPDATE pi_runtime.lanes SET lease_until = now() WHERE owner = 'z'"
            await execute(pg_dsn, gone)  # the holder's lease ran out
            second = await a.runner.retain(_days(400))
            log_after = await store.exists(store.lane_rel(subject))
            until = (await store.expired_task_keys([key]))[key]
    assert key in held
    assert held[key] < ended_ms + 400 * DAY_MS  # the earlier task's row
    assert first == TaskRetention()
    assert log_kept
    assert state == "done"
    assert second.expired == (TASK,)
    assert not log_after
    assert until == ended_ms + 400 * DAY_MS
