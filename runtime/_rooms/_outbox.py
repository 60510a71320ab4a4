"""The durable result outbox: one ``seq`` per server, re-delivered until acknowledged.

Every finished delivery is published once into ``results.log`` as a
:class:`~runtime._records.ResultPublished` with the next ``seq``; an acknowledgement is a
cumulative :class:`~runtime._records.ResultAcked`. After a restart the outbox is rebuilt from
the log: what was published and not acknowledged is delivered again with its original seq
(docs/design/protocol.md). ``delivery_id`` is the receiver's idempotency key.

On a store several hosts share (docs/design/scale-out.md S21) every host publishes into the
same log: an append that loses the race for the log's next number learns what the others
wrote (:meth:`ResultOutbox.sync`, which the host also calls when told of their appends) and
is decided again — the next ``seq`` after every result now known, or the result another host
already published — so ``seq`` stays one gap-free order across the deployment, and a result
is published under its lane's lease (``fence``): a host that lost the lane publishes nothing.

Resource handling: the log belongs to the store; the outbox only appends. Concurrency: one
publisher at a time in this process (a lock keeps seq order equal to log order); any number
of readers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Final

import trio

from .._clock import Clocks
from .._journal._fence import Fence
from .._journal._interface import Log
from .._logs import fields
from .._metrics import DELIVERIES_FINISHED, labelled
from .._records import (
    AttachmentRef,
    Compacted,
    Outcome,
    Record,
    ResultAcked,
    ResultPublished,
)
from .._wire import DeliveryResult

__all__ = ["DeliveryResult", "ResultOutbox"]

logger = logging.getLogger("runtime.rooms")


_NOT_PUBLISHED: Final = 0


class ResultOutbox:
    """The server's numbered results; obtain with ``ResultOutbox(store.results)``."""

    def __init__(
        self,
        log: Log,
        existing: Iterable[Record] | None = None,
        *,
        now_ms: Callable[[], int] | None = None,
    ) -> None:
        self._log = log
        self._now_ms = now_ms or Clocks.system().wall.time_ms
        """The wall clock a result's ``published_ms`` is read from (clocks.md C4: the host's
        ``clocks.wall``; the system's when none is given — an outbox only read needs none)."""
        self._lock = trio.Lock()
        self._changed = trio.Event()
        self._forget()
        self._learn(log.contents.records if existing is None else existing)

    def _forget(self) -> None:
        self._by_delivery: dict[str, DeliveryResult] = {}
        self._ordered: list[DeliveryResult] = []
        self._records: list[ResultPublished] = []
        """The record of each result of :attr:`_ordered`."""
        self._attachments: dict[str, AttachmentRef] = {}
        """Every attachment a published result names, by id (what a client may fetch)."""
        self.last_of_room: dict[str, DeliveryResult] = {}
        """Each room's latest published result."""
        self.acked = 0
        """Every seq up to this one was acknowledged."""
        self._floor = _NOT_PUBLISHED
        """The last seq published before the log was last compacted (RT8)."""

    def _learn(self, records: Iterable[Record]) -> bool:
        """Take in records of the log (from its start, or from where this outbox stopped);
        whether anything changed."""
        changed = False
        for record in records:
            if isinstance(record, ResultPublished):
                for ref in record.attachments:
                    self._attachments.setdefault(ref.id, ref)
                result = DeliveryResult.of(record)
                self._by_delivery.setdefault(result.delivery_id, result)
                self._ordered.append(result)
                self._records.append(record)
                self.last_of_room[result.room] = result
                changed = True
            elif isinstance(record, ResultAcked) and record.seq > self.acked:
                self.acked = record.seq
                changed = True
            elif isinstance(record, Compacted):
                self._floor = max(self._floor, record.last_seq)
        return changed

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def sync(self) -> list[DeliveryResult]:
        """Learn what other hosts appended to the log since this outbox last read or wrote
        it (nothing on a store with one writer); the results among it."""
        async with self._lock:
            return self._sync_locked(await self._log.refresh())

    def _sync_locked(self, records: list[Record]) -> list[DeliveryResult]:
        if self._learn(records):
            self._wake()
        return [DeliveryResult.of(r) for r in records if isinstance(r, ResultPublished)]

    @property
    def last_seq(self) -> int:
        return max(self._ordered[-1].seq if self._ordered else _NOT_PUBLISHED, self._floor)

    def published(self) -> list[ResultPublished]:
        """Every published result's record, in seq order."""
        return list(self._records)

    def result_of(self, delivery_id: str) -> DeliveryResult | None:
        """The published result of ``delivery_id``, if any (its first, original seq)."""
        return self._by_delivery.get(delivery_id)

    def attachment(self, attachment_id: str) -> AttachmentRef | None:
        """The attachment ``attachment_id`` of a published result (``None``: no result names
        it, so no client may fetch it)."""
        return self._attachments.get(attachment_id)

    def referenced(self) -> set[str]:
        """The sha256 of every attachment a published result names."""
        return {ref.sha256 for ref in self._attachments.values()}

    def acknowledged_since(self, position: int) -> Iterator[tuple[int, DeliveryResult, int]]:
        """The acknowledged results from index ``position`` of the publication order on, each
        as ``(index, result, published_ms)`` (retention reads them in that order and stops
        early)."""
        for i in range(position, len(self._ordered)):
            if self._ordered[i].seq <= self.acked:
                yield i, self._ordered[i], self._records[i].published_ms

    def unacknowledged(self) -> list[DeliveryResult]:
        return [r for r in self._ordered if r.seq > self.acked]

    async def publish(
        self,
        *,
        delivery_id: str,
        room: str,
        outcome: Outcome,
        text: str | None = None,
        code: str | None = None,
        absorbed_into: str | None = None,
        attachments: list[AttachmentRef] | None = None,
        truncated: bool = False,
        fence: Fence | None = None,
    ) -> DeliveryResult:
        """Publish a delivery's result durably, once: a second call for the same delivery
        returns the first result unchanged (and writes nothing). ``fence``: the lane's
        lease, checked with the write (``lane_fenced``: nothing was published)."""
        async with self._lock:
            while True:
                if (known := self._by_delivery.get(delivery_id)) is not None:
                    return known
                record = ResultPublished(
                    seq=self.last_seq + 1,
                    delivery_id=delivery_id,
                    room=room,
                    outcome=outcome,
                    text=text,
                    code=code,
                    absorbed_into=absorbed_into,
                    attachments=attachments or [],
                    published_ms=self._now_ms(),
                    truncated=truncated,
                )
                if await self._log.try_append(record, fence=fence) is not None:
                    self._learn([record])
                    self._wake()
                    labelled(DELIVERIES_FINISHED, str(outcome)).inc()
                    logger.info(
                        "published result %d (%s) in %s",
                        record.seq,
                        outcome,
                        room,
                        extra=fields(
                            "result_published",
                            delivery_id=delivery_id,
                            room=room,
                            outcome=outcome,
                            code=code,
                            seq=record.seq,
                        ),
                    )
                    return DeliveryResult.of(record)
                self._sync_locked(await self._log.refresh())  # another host's number

    async def ack(self, seq: int) -> None:
        """Acknowledge every result up to ``seq`` (cumulative; an older seq changes
        nothing; a seq beyond the last published one is clamped to it)."""
        async with self._lock:
            while True:
                seq = min(seq, self.last_seq)
                if seq <= self.acked:
                    return
                if await self._log.try_append(ResultAcked(seq=seq)) is not None:
                    self._learn([ResultAcked(seq=seq)])
                    self._wake()
                    return
                self._sync_locked(await self._log.refresh())

    async def rewrite(
        self,
        drop: set[str],
        replace: Callable[
            [list[Record], int, Callable[[], AbstractAsyncContextManager[list[Record]]]],
            Awaitable[object],
        ],
        current: Callable[[], Log],
    ) -> int:
        """Compact the log (docs/design/retention.md RT7, RT8): ``replace(records, last_seq,
        held)`` rewrites it holding every published result but those of ``drop`` and the
        acknowledged seq; ``held()`` holds publication and acknowledgement back — only for
        the end of the rewrite — and yields what was appended meanwhile, carried over as it
        is. ``current()`` is the log afterwards, whether the rewrite succeeded or not. Seqs
        are kept as they were, and the next one still follows the last ever published. How
        many results were left out."""
        taken, acked, last = len(self._records), self.acked, self.last_seq
        kept: list[Record] = [r for r in self._records[:taken] if r.delivery_id not in drop]
        removed = taken - len(kept)
        if acked:
            kept.append(ResultAcked(seq=acked))

        @contextlib.asynccontextmanager
        async def held() -> AsyncIterator[list[Record]]:
            async with self._lock:
                since: list[Record] = list(self._records[taken:])
                if self.acked > acked:
                    since.append(ResultAcked(seq=self.acked))
                try:
                    yield since
                finally:
                    self._log = current()  # the new file, or after a failure what is there
                self._forget()
                self._learn([Compacted(compacted_ms=0, removed=0, last_seq=last), *kept, *since])

        await replace(kept, last, held)
        return removed

    def forget(self, delivery_ids: Collection[str]) -> None:
        """Let go of the results of ``delivery_ids`` — deliveries a compaction of the shared
        store expired, by this host or another (RT11): they are no longer in the log. A
        room's latest result is never among them; the next seq still follows the last one
        ever published."""
        if not any(d in self._by_delivery for d in delivery_ids):
            return
        self._floor = self.last_seq
        kept = [(r, rec) for r, rec in zip(self._ordered, self._records, strict=True)]
        kept = [(r, rec) for r, rec in kept if r.delivery_id not in delivery_ids]
        self._ordered = [r for r, _rec in kept]
        self._records = [rec for _r, rec in kept]
        for delivery_id in delivery_ids:
            self._by_delivery.pop(delivery_id, None)
        self._attachments = {}
        for record in self._records:
            for ref in record.attachments:
                self._attachments.setdefault(ref.id, ref)

    async def follow(self, after: int | None = None) -> AsyncIterator[DeliveryResult]:
        """Every result with a seq above ``after`` (default: the acknowledged seq), in seq
        order, then each new one as it is published; never ends on its own."""
        position = self.acked if after is None else after
        while True:
            fresh = [r for r in self._ordered if r.seq > position]
            changed = self._changed
            for result in fresh:
                yield result
                position = result.seq
            if not fresh:
                await changed.wait()
