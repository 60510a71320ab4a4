"""A task lane's log and the step and tool journals kept on it, open or parked (TL9 of
``docs/design/watchdog.md``): a lane that waits for a reply, or is held with no worker, holds
no file descriptor and no journal; the first append after that reopens the log and rebuilds
the journals from its records."""

from __future__ import annotations

from collections.abc import Callable

from .._boundary._gate import RecordingGateJournal
from .._boundary._steps import DeliveryStepJournal
from .._journal._fence import Fence
from .._journal._interface import JournalStore, Log
from .._records import Record

__all__ = ["LaneLog"]

Journals = tuple[DeliveryStepJournal, RecordingGateJournal]


class LaneLog:
    """The log of the lane ``subject`` on ``store``; ``journals(log)`` builds the step and
    tool journals from a log's records."""

    __slots__ = ("_journals", "_log", "_make", "_parked", "_store", "_subject", "fence")

    def __init__(
        self,
        store: JournalStore,
        subject: str,
        log: Log,
        journals: Callable[[Log], Journals],
        *,
        fence: Fence | None = None,
    ) -> None:
        self._store, self._subject, self._log, self._make = store, subject, log, journals
        self.fence = fence
        """On a shared store, the lane's lease: every append, after a park too (S31)."""
        self._parked = False
        self._journals: Journals | None = None

    @property
    def journal(self) -> Log:
        """The log (reopened by :meth:`append` or :meth:`unpark` after a park)."""
        return self._log

    @property
    def parked(self) -> bool:
        return self._parked

    def journals(self) -> Journals:
        """The step and tool journals (built by :meth:`rebuild`; none while parked)."""
        assert self._journals is not None, "the lane log is parked or not built"
        return self._journals

    def rebuild(self) -> None:
        """Build the journals from every record the log holds."""
        self._journals = self._make(self._log)

    async def append(self, record: Record) -> int:
        if self._parked:
            await self.unpark()
        return await self._log.append(record)

    async def park(self) -> None:
        """Close the log and drop the journals (TL9); again is a no-op."""
        if self._parked:
            return
        self._parked = True
        self._journals = None
        await self._store.close_log(self._log)

    async def unpark(self) -> None:
        if not self._parked:
            return
        self._log = await self._store.open_lane_log(self._subject, fence=self.fence)
        self._parked = False
        self.rebuild()
