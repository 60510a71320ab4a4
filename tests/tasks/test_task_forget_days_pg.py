"""An expired task's id on a shared store follows ``[retention] forget_days`` (docs/design/
retention.md RT4, RT13): two hosts of one deployment on a real PostgreSQL, in one process, the
in-process Fake-Pi on the scripted model; the wall clock one mock clock both hosts read, moved
by days. The store's side alone, and the same answers as the file store's, are in
``tests/journal/test_postgres_compaction.py`` and ``tests/journal/test_conformance_stores.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import trio

from fake_pi.scenario import Step
from runtime._clock import Clocks, MockWallClock
from runtime._config import RetentionConfig
from runtime._errors import ReasonCode, TaskError
from runtime._retention import follow_forget_days
from runtime._tasks._retention import TaskRetention

from ..journal.pg_fixtures import pg_dsn, pg_server
from ..task_harness import TASK, done, say
from .test_task_hosts import LIMIT, TaskHost, spec, task_host
from .test_task_retention import _Refused

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses

pytestmark = pytest.mark.trio

DAY: Final = 86_400.0


def _retention(forget_days: int) -> RetentionConfig:
    return RetentionConfig(journal_days=7, idempotency_days=30, forget_days=forget_days)


@pytest.mark.parametrize(
    ("first_days", "then_days"),
    [(40, 40), (400, 40), (40, 400)],
    ids=["unchanged", "lowered", "raised"],
)
async def test_rt4_rt13_an_expired_task_id_follows_forget_days_on_every_host(
    tmp_path: Path, pg_dsn: str, first_days: int, then_days: int
) -> None:
    """RT4, RT13: TASK ends on A at day 0 under ``forget_days`` = ``first_days`` (a host's
    start recorded it); A's pass expires it at day 31, B learns it at its own. A host started
    at day 35 with ``then_days`` sets the count. At day 41, before any pass, a submission to
    A — which holds the expiry in memory — is new past ``forget_days`` (40 from its end) and
    ``task_expired`` within them (400); after both hosts' passes a submission to B is never
    run as new: that new task's, or ``task_expired`` inside the window. Before, A refused
    from memory until its next pass, a lowered count held the row to the old time, and a
    raised one let a pass remove the row at day 40 — the task ran again on B inside the
    configured window."""
    wall = MockWallClock()
    clocks = Clocks(wall=wall)
    a_steps: list[Step] = [done(), say("finished"), done(), say("again")]
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "a", pg_dsn, a_steps, clocks=clocks) as a,
            task_host(tmp_path, "b", pg_dsn, [done(), say("again")], clocks=clocks) as b,
        ):
            await follow_forget_days(a.runner.host.store, _retention(first_days))
            await a.runner.submit(spec(tmp_path))
            await a.runner.wait(TASK)
            await b.runner.claim_orphans()  # B learns TASK ended
            wall.advance(31 * DAY)
            assert await a.runner.retain(_retention(first_days)) == TaskRetention(expired=(TASK,))
            assert await b.runner.retain(_retention(first_days)) == TaskRetention()
            for host in (a, b):
                with _Refused(ReasonCode.TASK_EXPIRED):
                    await host.runner.submit(spec(tmp_path))
            wall.advance(4 * DAY)  # day 35: a host starts
            await follow_forget_days(b.runner.host.store, _retention(then_days))
            wall.advance(6 * DAY)  # day 41
            on_a = await _submitted(a, tmp_path)
            await b.runner.retain(_retention(then_days))
            await a.runner.retain(_retention(then_days))
            on_b = await _submitted(b, tmp_path)
    if then_days > 41:
        assert (on_a, on_b) == ("task_expired", "task_expired")
        assert (a.model.request_count, b.model.request_count) == (2, 0)  # its one run
    else:
        assert on_a == "new"  # the documented bound: run again, once
        assert on_b != "new"  # B: that new task's (answered, or held by A)
        assert (a.model.request_count, b.model.request_count) == (4, 0)


async def _submitted(host: TaskHost, root: Path) -> str:
    """How a submission of TASK to ``host`` is answered: ``new`` (run to its end),
    ``answered`` (an ended task's view), or the refusal's code."""
    try:
        view = await host.runner.submit(spec(root))
    except TaskError as error:
        return str(error.code)
    if view.ended is not None:
        return "answered"
    await host.runner.wait(TASK)
    return "new"
