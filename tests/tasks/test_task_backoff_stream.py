"""Task lanes meeting an outage the provider reports inside a 200 stream (docs/design/
retention.md PB1, PB6; gateway.md G10): parked as a 503 is, not left to the worker's own
retries. The rig of ``test_task_backoff.py`` — real worker processes behind the lane's
gateway, the production policy and the backoff scaled down — with an upstream that answers
200, sends its role and then ``overloaded``. Nothing sleeps on the real clock to wait."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from runtime._records import ContinuationSent, EpochStarted, Parked

from ..rooms.test_room_backoff import OVERLOADED, Outage
from .test_task_backoff import BACKOFF, NEVER_SILENT
from .test_task_fence import KINDS, LIMIT, TASK, DoneOnEveryPrompt, open_fence_rig, until_ended

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", KINDS)
async def test_pb1_pb6_an_outage_reported_inside_a_200_stream_parks_the_task(
    kind: str, tmp_path: Path
) -> None:
    """PB1, PB6: the provider answers 200 and reports ``overloaded`` in its stream before any
    of the answer, for three seconds: the task is parked each time (``Parked``, the status of
    the error's class, 503; its own tries counted; the classification ``Parked``, never
    suspected), one request per try, the same worker prompted again after each wait, and it
    ends done once the provider is back — as for a 503 status."""
    model = DoneOnEveryPrompt()
    outage = Outage(seconds=3.0, at_least=2, model=model, in_stream=OVERLOADED)
    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path, kind, model, handler=outage.handle, backoff=BACKOFF
        ) as rig:
            await rig.runner.submit(rig.spec())
            ended = await until_ended(rig)
            records = await rig.records()
            view = rig.runner.show(TASK)
    assert ended.state == "done", ended
    seen = rig.classifications()
    assert "Parked" in seen, seen
    assert not set(seen) & set(NEVER_SILENT), seen
    parks = [r for r in records if isinstance(r, Parked)]
    assert len(parks) == len(outage.down) >= 2  # one try, one request, one park
    assert [p.attempt for p in parks] == list(range(1, len(parks) + 1))
    assert all(p.status == 503 and not p.by_route for p in parks)
    sent = [r for r in records if isinstance(r, ContinuationSent)]
    assert [s.action_id.rsplit("/", 1)[-1] for s in sent] == [f"unpark{p.attempt}" for p in parks]
    assert [r.epoch for r in records if isinstance(r, EpochStarted)] == [1]
    assert view.budget["epochs_used"] == 0
