"""Retention of room deliveries' step journals (docs/design/retention.md RT1-RT3), shared by the
room worker (at its start and every ``[retention] sweep_hours``) and ``pi-runtime journal
compact`` (on demand, with no server running).

A delivery's step journal (``deliveries/<key>.log``) and one-shot session are removed —
unlink, directory fsync — once its result is acknowledged and was published before
``cutoff_ms``. Kept whatever their age (RT1): an unacknowledged result's journal, and every
journal of a room with an unfinished delivery (its replay may read its owners' logs). The
admission and the published result stay in the shared logs, so a duplicate still gets its
result (RT3). File store only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import trio

from .._clock import Clocks
from .._errors import ReasonCode, StateDirError
from .._journal._store import ADMISSIONS, Store, delivery_key, lane_key, open_store
from .._records import Admission
from ._outbox import ResultOutbox

__all__ = ["compact_journals", "expire_step_journals"]


async def expire_step_journals(
    store: Store,
    outbox: ResultOutbox,
    busy: Callable[[str], bool],
    *,
    cutoff_ms: int,
    start: int = 0,
) -> tuple[int, int]:
    """Remove the expired step journals among the results from index ``start`` of the
    publication order on: ``(journals removed, where the next look may start)`` — the index
    after the last result before which every one is expired (a result of a room ``busy``
    says has an unfinished delivery holds it back, so it is looked at again). ``busy`` is
    asked after the last await before each removal."""
    removed, position, settled = 0, start, True
    for index, result, published_ms in outbox.acknowledged_since(start):
        rel = store.delivery_rel(result.delivery_id)
        when = published_ms or await _modified_ms(store.path(rel))
        if when is not None and when > cutoff_ms:
            break  # published in order: the rest are younger
        if when is not None and busy(result.room):
            settled = False  # RT1: looked at again once the room is idle
            continue
        if when is not None:
            removed += await store.remove_log(rel)
            oneshot = store.root / "lanes" / lane_key(result.room) / "oneshot"
            with contextlib.suppress(FileNotFoundError):
                name = f"{delivery_key(result.delivery_id)}.jsonl"
                await trio.to_thread.run_sync(os.unlink, oneshot / name)
        if settled:
            position = index + 1
    return removed, position


async def _modified_ms(path: str) -> int | None:
    """A log's last write (its result's), for a result published before the publication time
    was recorded; ``None`` when there is no log (already removed, or never written)."""
    try:
        info = await trio.to_thread.run_sync(os.stat, path)
    except FileNotFoundError:
        return None
    return info.st_mtime_ns // 1_000_000


async def compact_journals(state_dir: Path, *, journal_days: float, clocks: Clocks) -> int:
    """``pi-runtime journal compact``: :func:`expire_step_journals` over a state directory no
    server holds (its lock is taken: ``state_dir_locked`` while one runs — it does the same
    every ``[retention] sweep_hours``); how many step journals were removed. A directory that
    holds no file-store journal (a host of a PostgreSQL deployment, a typo) is refused
    ``state_dir_invalid``, and nothing is created there."""
    if not await trio.to_thread.run_sync((state_dir / ADMISSIONS).exists):
        raise StateDirError(
            ReasonCode.STATE_DIR_INVALID,
            f"{state_dir} holds no file-store journal (no {ADMISSIONS}); check --state-dir",
        )
    async with open_store(state_dir, clocks=clocks) as store:
        outbox = ResultOutbox(store.results)
        busy = {
            str(record.request.get("room"))
            for record in store.admissions.contents.records
            if isinstance(record, Admission) and outbox.result_of(record.delivery_id) is None
        }  # nothing admits here: the store's lock is held
        cutoff = clocks.wall.time_ms() - journal_days * 86_400_000
        removed, _ = await expire_step_journals(
            store, outbox, busy.__contains__, cutoff_ms=int(cutoff)
        )
    return removed
