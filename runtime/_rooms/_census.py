"""The room lanes summed as the metrics show them (docs/design/operations.md M8): lanes, those
running a turn, those with a live worker, the deliveries queued and pending — what
``RoomWorker.status()`` summed says, at any moment, without a status per lane.

A host that has run for months knows tens of thousands of rooms, nearly all idle: every
scrape (``GET /metrics``, every 15 s by default) built each one's status on the Trio thread
while admissions waited (29 ms at 10,000 rooms, 127 ms at 50,000). Only a lane with something
pending or a live worker can be other than idle, and the worker keeps both sets:

* a lane's queued deliveries and its running one are pending (admitted, not finished): a
  delivery leaves that set when its result is published, and its lane has let go of it by
  then — out of the queue first, or, the running one, no longer current before its task next
  yields (once its steered deliveries' own results are written: they are pending meanwhile);
* a live worker holds its live-worker place (L8) from before it starts until after it ended.

So only those lanes are read: the cost follows what is under way, not the rooms known.
``tests/server/test_metrics.py`` checks the totals against ``status()`` summed after every
task step of a real server's work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._worker import RoomWorker

__all__ = ["RoomTotals", "room_totals"]


@dataclass(frozen=True, slots=True)
class RoomTotals:
    """One room worker's lanes, summed (``status()``'s rows, counted)."""

    lanes: int
    """Room lanes this host has (``room_count``)."""
    running: int
    """Lanes with a turn running (``state == "running"``)."""
    live_workers: int
    """Lanes with a live worker process (``live_worker``)."""
    queued: int
    """Deliveries waiting behind a running turn (``queued``, summed)."""
    pending: int
    """Deliveries admitted and not finished (``len(pending())``)."""


def room_totals(worker: RoomWorker) -> RoomTotals:
    """``worker.status()`` summed, read from the lanes of a pending delivery or a live worker
    only (the module docstring says why no other lane can count): no status is built, and an
    idle room costs nothing."""
    lanes = worker._lanes
    rooms = {pending.delivery.room for pending in worker._pending.values()}
    rooms.update(lane.room for lane in worker._live.values())
    running = live = queued = 0
    for room in rooms:
        lane = lanes.get(room)  # the room's lane, as ``status()`` reads it
        if lane is None:
            continue
        running += lane.current is not None
        live += lane.live_worker
        queued += len(lane.queue)
    return RoomTotals(
        lanes=len(lanes),
        running=running,
        live_workers=live,
        queued=queued,
        pending=len(worker._pending),
    )
