"""The durable result outbox: one ``seq`` per server, re-delivered until acknowledged.

Every finished delivery is published once into ``results.log`` as a
:class:`~runtime._records.ResultPublished` with the next ``seq``; an acknowledgement is a
cumulative :class:`~runtime._records.ResultAcked`. After a restart the outbox is rebuilt from
the log: what was published and not acknowledged is delivered again with its original seq
(docs/design/protocol.md). ``delivery_id`` is the receiver's idempotency key.

Resource handling: the log belongs to the store; the outbox only appends. Concurrency: one
publisher at a time (a lock keeps seq order equal to log order); any number of readers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Final

import trio

from .._journal._interface import Log
from .._records import Outcome, Record, ResultAcked, ResultPublished
from .._wire import DeliveryResult

__all__ = ["DeliveryResult", "ResultOutbox"]


_NOT_PUBLISHED: Final = 0


class ResultOutbox:
    """The server's numbered results; obtain with ``ResultOutbox(store.results)``."""

    def __init__(self, log: Log, existing: Iterable[Record] | None = None) -> None:
        self._log = log
        self._by_delivery: dict[str, DeliveryResult] = {}
        self._ordered: list[DeliveryResult] = []
        self.last_of_room: dict[str, DeliveryResult] = {}
        """Each room's latest published result."""
        self.acked = 0
        """Every seq up to this one was acknowledged."""
        self._lock = trio.Lock()
        self._changed = trio.Event()
        for record in log.contents.records if existing is None else existing:
            if isinstance(record, ResultPublished):
                self._learn(DeliveryResult.of(record))
            elif isinstance(record, ResultAcked):
                self.acked = max(self.acked, record.seq)

    def _learn(self, result: DeliveryResult) -> None:
        self._by_delivery.setdefault(result.delivery_id, result)
        self._ordered.append(result)
        self.last_of_room[result.room] = result

    @property
    def last_seq(self) -> int:
        return self._ordered[-1].seq if self._ordered else _NOT_PUBLISHED

    def result_of(self, delivery_id: str) -> DeliveryResult | None:
        """The published result of ``delivery_id``, if any (its first, original seq)."""
        return self._by_delivery.get(delivery_id)

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
    ) -> DeliveryResult:
        """Publish a delivery's result durably, once: a second call for the same delivery
        returns the first result unchanged (and writes nothing)."""
        async with self._lock:
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
            )
            await self._log.append(record)
            result = DeliveryResult.of(record)
            self._learn(result)
            self._changed.set()
            self._changed = trio.Event()
            return result

    async def ack(self, seq: int) -> None:
        """Acknowledge every result up to ``seq`` (cumulative; an older seq changes
        nothing; a seq beyond the last published one is clamped to it)."""
        seq = min(seq, self.last_seq)
        async with self._lock:
            if seq <= self.acked:
                return
            await self._log.append(ResultAcked(seq=seq))
            self.acked = seq
            self._changed.set()
            self._changed = trio.Event()

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
