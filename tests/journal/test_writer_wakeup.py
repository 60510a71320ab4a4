"""How an append's task is woken once its record is durable (journal.md J8b, J20).

The writer thread passes a settled batch to the pool's acker, a Trio task that reschedules
its tasks (J21), or writes the shard's eventfd for a task that handed its item over alone
(J20). The wait
refuses cancellation (a record handed over always reports its fate to its caller; the cancel
comes after), and a batch's disk failure is reported before any of its tasks runs on.
"""

from __future__ import annotations

import collections
import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from runtime import DiskFailedError, JournalError, ReasonCode, open_store
from runtime._journal._sync_log import SYNC_DIR
from runtime._journal._writer import WriterPool, handoffs_in_flight
from runtime._linux._fs import FileSystem, OsFileSystem
from runtime._records import OutboxAction

from ..faultfs import Fault, FaultyFileSystem
from .test_grouped_handoffs import shared_target
from .test_sync_log import Holding, _one_batch


def _record(name: str) -> OutboxAction:
    return OutboxAction(action_id=name, kind="step", state="done")


class _HeldWrite:
    """Holds the next ``write`` or ``pwrite`` on the writer thread until released."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.held = threading.Event()
        self.go = threading.Event()
        self.holding = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _hold(self) -> None:
        if self.holding:
            self.holding = False
            self.held.set()
            self.go.wait(10)

    def write(self, handle: int, data: bytes) -> int:
        self._hold()
        return int(self.inner.write(handle, data))

    def pwrite(self, handle: int, data: bytes, offset: int) -> int:
        self._hold()
        return int(self.inner.pwrite(handle, data, offset))


@pytest.mark.parametrize("others", [0, 3], ids=["alone", "with-others"])
async def test_j8b_an_append_cancelled_while_it_waits_gets_its_number_then_the_cancel(
    tmp_path: Path, others: int
) -> None:
    """J8b: a caller cancelled while its record is being made durable still gets its
    number (the record is in the log), and the cancel arrives at its next checkpoint — alone
    in its batch, or with other logs' records queued behind it (one sync log batch)."""
    fs = _HeldWrite(OsFileSystem())
    got: list[object] = []
    with trio.fail_after(20):
        async with open_store(tmp_path / "state", fs=cast(FileSystem, fs)) as store:
            log = await store.create_delivery_log("d")
            extra = [await store.create_delivery_log(f"e{i}") for i in range(others)]
            fs.holding = True
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()

                async def append() -> None:
                    with scope:
                        got.append(await log.append(_record("mine")))
                        await trio.lowlevel.checkpoint()
                        got.append("not cancelled")

                nursery.start_soon(append)
                await trio.to_thread.run_sync(fs.held.wait, 10)
                for i, other in enumerate(extra):  # queued behind the held batch
                    nursery.start_soon(other.append, _record(f"other-{i}"))
                while handoffs_in_flight() < 1 + others:
                    await trio.testing.wait_all_tasks_blocked(cushion=0.005)
                scope.cancel()
                await trio.testing.wait_all_tasks_blocked(cushion=0.01)
                assert got == []  # still waiting: the cancel does not end the wait
                fs.go.set()
            assert got == [1]
            assert scope.cancelled_caught
            assert (await store.read(log.rel)).records[1:] == (_record("mine"),)


async def test_j8b_an_appends_disk_failure_is_reported_before_it_runs_on(
    tmp_path: Path,
) -> None:
    """J8b, J6: an append whose record cannot be made durable (its file's write fails: EIO;
    a sync log write before it too) raises the disk failure, and the store has reported it
    (it stops admitting) before that task runs on."""
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    with trio.fail_after(20):
        async with open_store(tmp_path / "state", fs=faulty) as store:
            log = await store.create_delivery_log("d")
            faulty.arm(
                [
                    Fault("write", 1, "before", errno.EIO, path_contains=f"/{SYNC_DIR}/"),
                    Fault("write", 1, "before", errno.EIO, path_contains="/deliveries/"),
                ]
            )
            with pytest.raises(DiskFailedError):
                await log.append(_record("lost"))
            assert store.disk_failure is not None
            assert log.poisoned


class _BrokenSync(Holding):
    """The next ``fdatasync`` of a path containing :attr:`part` raises an error that is not
    an ``OSError`` (a bug below the writer, say)."""

    part: str | None = None

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.broke = threading.Event()

    times = 1
    """How many syncs of that path in a row fail so."""

    def fdatasync(self, handle: int) -> None:
        if self.part is not None and self.part in self._paths.get(handle, ""):
            self.times -= 1
            if not self.times:
                self.part = None
                self.broke.set()
            raise RuntimeError("injected: not an OSError")
        super().fdatasync(handle)


async def test_j5_j8b_an_error_that_is_not_the_disks_poisons_its_log_and_hangs_no_one(
    tmp_path: Path,
) -> None:
    """J5, J8b: an exception that is not an ``OSError`` while a writer thread writes a batch
    (a bug, or a frame past the largest body) leaves no caller waiting forever: what reached
    the disk is unknown, so the batch's log is poisoned and its append refused
    (``journal_poisoned``); the thread goes on, so the next append to another log of the same
    shard is acknowledged; after a restart the log is refused for appending and reads only
    what was acknowledged."""
    fs = _BrokenSync(OsFileSystem())
    root = tmp_path / "state"
    with trio.fail_after(20):
        async with open_store(root, fs=cast(FileSystem, fs)) as store:
            broken = await store.create_delivery_log("broken")
            other = await store.create_delivery_log("other")
            fs.part = broken.rel
            with pytest.raises(JournalError) as refused:
                await broken.append(_record("lost"))
            assert refused.value.code is ReasonCode.JOURNAL_POISONED
            assert broken.poisoned
            assert await other.append(_record("kept")) == 1
            assert store.disk_failure is None  # not the disk's
        async with open_store(root) as store:
            with pytest.raises(JournalError) as refused:
                await store.open_delivery_log("broken")
            assert refused.value.code is ReasonCode.JOURNAL_POISONED
            assert (await store.read_delivery_log("broken")).records[1:] == ()
            assert (await store.read_delivery_log("other")).records[1:] == (_record("kept"),)


@pytest.mark.parametrize("poison", ["recorded", "unrecorded"])
async def test_j8b_an_error_that_is_not_the_disks_while_owed_records_trickle_out(
    tmp_path: Path, poison: str
) -> None:
    """J8b, J5, J12: an exception that is not an ``OSError`` while a full sync log
    generation's records are written into one log's file, between batches, poisons that log
    and leaves the writer thread running: a later append on the same shard is acknowledged,
    the other logs get their records, the store closes, and every acknowledged record is in
    its log after a restart. Before, the thread died there and every later append of the
    shard waited forever. ``unrecorded`` (J15): the poisoning fails the same way too (its
    file's sync raises again), so no poison document is written; the log is refused for the
    rest of the run and reads with the record it owed, and the generation holding that record
    is kept for the next start's redo (J14) — it is never dropped."""
    fs = _BrokenSync(OsFileSystem())
    root = tmp_path / "state"
    with trio.fail_after(20):
        async with open_store(root, fs=cast(FileSystem, fs)) as store:
            store._pool._rotate_bytes = 1  # every batch fills its generation
            logs = [await store.create_delivery_log(f"d{i}") for i in range(3)]
            # its file's sync when its records trickle out (and then the poison's)
            fs.part, fs.times = logs[0].rel, 1 if poison == "recorded" else 2
            assert await _one_batch(fs, store, logs, "a") == [1, 1, 1]
            await trio.to_thread.run_sync(fs.broke.wait, 10)
            after = await store.create_delivery_log("after")
            assert await after.append(_record("after")) == 1  # the thread went on
            with pytest.raises(JournalError) as refused:
                await logs[0].append(_record("refused"))
            assert refused.value.code is ReasonCode.JOURNAL_POISONED
            assert (await store.read(logs[0].rel)).records[1:] == (_record("a-0"),)
            assert await logs[1].append(_record("more")) == 2
            if poison == "unrecorded":
                assert os.listdir(root / SYNC_DIR)  # kept for the redo
        async with open_store(root) as store:  # each acknowledged record is there (J5)
            for i in (0, 1, 2):
                records = (await store.read_delivery_log(f"d{i}")).records[1:]
                assert records[0] == _record(f"a-{i}")
            assert (await store.read_delivery_log("d1")).records[2:] == (_record("more"),)
            if poison == "recorded":
                with pytest.raises(JournalError) as refused:
                    await store.open_delivery_log("d0")
                assert refused.value.code is ReasonCode.JOURNAL_POISONED


class _CountedHandOvers:
    """Counts the settled batches a writer thread passes to the pool's acker (J21)."""

    def __init__(self, pool: Any) -> None:
        self.inner = pool._hand_over
        self.calls = 0
        pool._hand_over = self

    def __call__(self, *args: Any) -> None:
        self.calls += 1
        self.inner(*args)


async def test_j20_a_lone_append_is_woken_without_a_loop_callback(tmp_path: Path) -> None:
    """J20: one lane's appends, each alone in flight, are woken through their shard's
    eventfd — nothing passed to the acker; appends arriving together on one shard still are
    all acknowledged, in order, the ones behind the first through the acker (J21)."""
    with trio.fail_after(20):
        async with open_store(tmp_path / "state") as store:
            log = await store.create_delivery_log("d")
            others = [await store.create_delivery_log(f"e{i}") for i in range(4)]
            handed = _CountedHandOvers(store._pool)
            for i in range(20):
                assert await log.append(_record(f"step-{i}")) == 1 + i
            assert handed.calls == 0
            got: dict[str, int] = {}

            async def append(journal: Any, name: str) -> None:
                got[name] = await journal.append(_record(name))

            async with trio.open_nursery() as nursery:
                for i, other in enumerate(others):  # one shard: delivery logs share shard 0
                    nursery.start_soon(append, other, f"other-{i}")
            assert got == {f"other-{i}": 1 for i in range(4)}
            assert handed.calls >= 1
            assert (await store.read(log.rel)).records[1:] == tuple(
                _record(f"step-{i}") for i in range(20)
            )


@pytest.mark.parametrize("before", ["with-others", "cancelled", "failed"])
async def test_j20_no_signal_is_left_over_to_wake_the_next_lone_append_early(
    tmp_path: Path, before: str
) -> None:
    """J20: however a lone append was settled — in a batch with others behind it, its wait
    cancelled, or its write failed (the loop callback then wakes it) — the next lone append
    of the shard is not woken before its own record is written: its task still waits while
    its write is held."""
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    fs = _HeldWrite(faulty)
    results: list[object] = []
    with trio.fail_after(20):
        async with open_store(tmp_path / "state", fs=cast(FileSystem, fs)) as store:
            first = await store.create_delivery_log("first")
            extra = [await store.create_delivery_log(f"e{i}") for i in range(3)]
            later = await store.create_delivery_log("later")

            async def append(journal: Any, name: str, scope: trio.CancelScope) -> None:
                with scope:
                    try:
                        results.append(await journal.append(_record(name)))
                    except JournalError as exc:
                        results.append(exc.code)

            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()
                if before == "failed":
                    faulty.arm([Fault("write", 1, "before", errno.EIO, path_contains=first.rel)])
                fs.holding = True
                nursery.start_soon(append, first, "first", scope)
                await trio.to_thread.run_sync(fs.held.wait, 10)
                if before == "with-others":
                    for i, other in enumerate(extra):
                        nursery.start_soon(append, other, f"other-{i}", trio.CancelScope())
                    while handoffs_in_flight() < 4:
                        await trio.testing.wait_all_tasks_blocked(cushion=0.005)
                if before == "cancelled":
                    scope.cancel()
                    await trio.testing.wait_all_tasks_blocked(cushion=0.01)
                fs.held.clear()
                fs.go.set()
            expected: dict[str, list[object]] = {
                "with-others": [1, 1, 1, 1],
                "cancelled": [1],
                "failed": [ReasonCode.DISK_FAILED],
            }
            assert results == expected[before]
            results.clear()
            fs.go.clear()
            fs.holding = True
            async with trio.open_nursery() as nursery:
                nursery.start_soon(append, later, "later", trio.CancelScope())
                await trio.to_thread.run_sync(fs.held.wait, 10)
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                assert results == []  # held: not acknowledged before its write
                fs.go.set()
            assert results == [1]


async def test_j20_closing_the_pool_while_a_lone_append_is_written(tmp_path: Path) -> None:
    """J20: the writer pool closed while a lone append is being written: the append still
    gets its number — its eventfd stays open until its task has read it — and the close
    ends. Repeated, since the loop may run the two tasks in either order."""
    for attempt in range(20):
        fs = _HeldWrite(OsFileSystem())
        got: list[int] = []
        with trio.fail_after(20):
            async with open_store(tmp_path / f"state-{attempt}", fs=cast(FileSystem, fs)) as store:
                log = await store.create_delivery_log("d")
                fs.holding = True

                async def append(log: Any, got: list[int]) -> None:
                    got.append(await log.append(_record("mine")))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(append, log, got)
                    await trio.to_thread.run_sync(fs.held.wait, 10)
                    nursery.start_soon(store._pool.aclose)
                    await trio.testing.wait_all_tasks_blocked(cushion=0.005)
                    fs.go.set()
        assert got == [1]


class _Interrupted(BaseException):
    """Stands in for a ``KeyboardInterrupt`` raised where a lone append waits."""


async def test_j20_a_wait_ended_by_an_exception_leaves_no_signal_for_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """J20: a lone append whose wait ends with an exception that is not a cancellation (a
    ``KeyboardInterrupt``, say) leaves its signal to come; the shard's next lone append must
    not be woken by it before its own write: it waits on another eventfd."""
    fs = _HeldWrite(OsFileSystem())
    results: list[object] = []
    with trio.fail_after(20):
        async with open_store(tmp_path / "state", fs=cast(FileSystem, fs)) as store:
            first = await store.create_delivery_log("first")
            later = await store.create_delivery_log("later")
            signals = set(store._pool._signals)
            real_wait = trio.lowlevel.wait_readable

            async def interrupted(fd: Any) -> None:
                if fd in signals:
                    signals.clear()
                    raise _Interrupted
                await real_wait(fd)

            monkeypatch.setattr(trio.lowlevel, "wait_readable", interrupted)
            fs.holding = True
            with pytest.raises(_Interrupted):
                await first.append(_record("first"))
            await trio.to_thread.run_sync(fs.held.wait, 10)
            fs.held.clear()
            fs.go.set()  # the first one's write goes on, and its signal comes
            while handoffs_in_flight():  # (the interrupted one no longer counts)
                await trio.testing.wait_all_tasks_blocked(cushion=0.01)
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            fs.go.clear()
            fs.holding = True

            async def append() -> None:
                results.append(await later.append(_record("later")))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(append)
                await trio.to_thread.run_sync(fs.held.wait, 10)
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                assert results == []  # held: not acknowledged before its write
                fs.go.set()
            assert results == [1]
            assert (await store.read(first.rel)).records[1:] == (_record("first"),)


async def test_j21_closing_the_pool_while_a_batch_is_written(tmp_path: Path) -> None:
    """J21: the pool closed while a batch of several appends (delivered by the acker, not by
    a lone append's eventfd) is being written: every append still gets its number, the
    close ends, and the acker has stopped before its eventfd is closed. Repeated, since the
    loop may run the close and the acker in either order."""
    for attempt in range(20):
        fs = _HeldWrite(OsFileSystem())
        got: dict[str, int] = {}
        with trio.fail_after(20):
            async with open_store(tmp_path / f"state-{attempt}", fs=cast(FileSystem, fs)) as store:
                logs = [await store.create_delivery_log(f"d{i}") for i in range(4)]
                fs.holding = True

                async def append(log: Any, name: str, got: dict[str, int]) -> None:
                    got[name] = await log.append(_record(name))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(append, logs[0], "first", got)
                    await trio.to_thread.run_sync(fs.held.wait, 10)
                    for i, log in enumerate(logs[1:]):  # queued behind the held write: a batch
                        nursery.start_soon(append, log, f"other-{i}", got)
                    while handoffs_in_flight() < len(logs):
                        await trio.testing.wait_all_tasks_blocked(cushion=0.005)
                    nursery.start_soon(store._pool.aclose)
                    await trio.testing.wait_all_tasks_blocked(cushion=0.005)
                    fs.go.set()
                assert store._pool._acker_stopped.is_set()
        assert got == {"first": 1, "other-0": 1, "other-1": 1, "other-2": 1}


def test_j21_a_pool_never_closed_does_not_keep_the_run_from_ending(tmp_path: Path) -> None:
    """J21: the acker is a system task of the run: a pool left open (a bug in its owner)
    neither hangs the run's end nor crashes it; its appends were all acknowledged."""
    pools: list[WriterPool] = []

    async def main() -> list[int]:
        path = tmp_path / "shared.log"
        pool = WriterPool(
            OsFileSystem(), shards=1, poison_document=lambda *_: b"{}", on_disk_failure=print
        )
        pools.append(pool)
        target = shared_target(path)
        numbers: list[int] = []

        async def append(n: int) -> None:
            numbers.append(await pool.append(target, b"record %d" % n))

        async with trio.open_nursery() as nursery:
            for n in range(10):
                nursery.start_soon(append, n)
        return sorted(numbers)

    assert trio.run(main) == list(range(10))
    assert pools[0]._acker_stopped.is_set()
    for q in pools[0]._queues:  # let the threads go (what aclose would have done)
        q.put(None)


class _Gates(Holding):
    """Holds the first ``write``/``pwrite`` to a path containing each of its parts (on the
    writer thread) until that part's gate is opened; several at once."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.gates: dict[str, tuple[threading.Event, threading.Event]] = {}

    def gate(self, part: str) -> tuple[threading.Event, threading.Event]:
        """``(held, go)`` for the next write to a path containing ``part``."""
        self.gates[part] = gate = (threading.Event(), threading.Event())
        return gate

    def _maybe_hold(self, handle: int) -> None:
        path = self._paths.get(handle, "")
        for part, (held, go) in list(self.gates.items()):
            if part in path:
                del self.gates[part]
                held.set()
                go.wait(10)


async def test_j21_a_failure_met_after_the_close_began_is_still_reported(
    tmp_path: Path,
) -> None:
    """J21: the pool is being closed while a batch is written; after the batch is
    acknowledged, writing a full generation's owed records into a log's file fails (EIO).
    That failure reaches the store (it stops admitting) although every task had already been
    woken: the acker stops only once the threads have ended, not when the close begins."""
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    fs = _Gates(faulty)
    results: list[int] = []
    with trio.fail_after(20):
        async with open_store(tmp_path / "state", fs=cast(FileSystem, fs)) as store:
            pool = store._pool
            pool._rotate_bytes = 1  # every sync log batch fills its generation
            logs = [await store.create_delivery_log(f"d{i}") for i in range(3)]
            holder = await store.create_delivery_log("hold")
            first_held, first_go = fs.gate(holder.rel)
            trickle_held, trickle_go = fs.gate(logs[0].rel)  # its owed record, written alone
            faulty.arm([Fault("write", 1, "before", errno.EIO, path_contains=logs[0].rel)])

            async def append(log: Any, name: str) -> None:
                results.append(await log.append(_record(name)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(append, holder, "hold")
                await trio.to_thread.run_sync(first_held.wait, 10)
                for i, log in enumerate(logs):  # one batch, behind the held one
                    nursery.start_soon(append, log, f"a-{i}")
                while handoffs_in_flight() < 1 + len(logs):
                    await trio.testing.wait_all_tasks_blocked(cushion=0.005)
                nursery.start_soon(pool.aclose)
                await trio.testing.wait_all_tasks_blocked(cushion=0.005)
                assert pool._closed
                first_go.set()
                await trio.to_thread.run_sync(trickle_held.wait, 10)
                while len(results) < 1 + len(logs):  # every task woken, the close under way
                    await trio.testing.wait_all_tasks_blocked(cushion=0.005)
                assert store.disk_failure is None
                trickle_go.set()
            assert pool._acker_stopped.is_set()
            assert len(faulty.hits) == 1, faulty.hits
            reported: DiskFailedError | None = store.disk_failure  # (set meanwhile)
            assert reported is not None
            assert reported.path == logs[0].rel
    assert results == [1, 1, 1, 1]


class _LateHandOver(collections.deque[Any]):
    """The acker's deque, where the first time the acker finds it empty a writer's hand-over
    lands just after that look: its append, then its eventfd write — between two lines of the
    acker with no await between them, a window no scheduling can aim at."""

    def __init__(self, land: Callable[[], None]) -> None:
        super().__init__()
        self.land: Callable[[], None] | None = land

    def __bool__(self) -> bool:
        empty = not len(self)
        if empty and self.land is not None:
            land, self.land = self.land, None
            land()  # after the look: the acker goes on as if it had seen nothing
        return not empty


async def test_j21_a_hand_over_just_after_the_acker_found_nothing_is_still_delivered(
    tmp_path: Path,
) -> None:
    """J21: the acker reads its eventfd *before* it reads the deque, so a hand-over that lands
    just after the acker found the deque empty wrote the eventfd after that read: the acker
    wakes again and delivers it. In the other order the read would swallow that write, and the
    entry — here a disk failure met between batches, which must stop the host's admissions —
    would wait for the next hand-over: for ever on a host that is idle."""
    reported: list[DiskFailedError] = []
    pool = WriterPool(
        OsFileSystem(), shards=1, poison_document=lambda *_: b"{}", on_disk_failure=reported.append
    )
    late = DiskFailedError(ReasonCode.DISK_FAILED, "met between batches", path="late.log")
    pool._acked = _LateHandOver(lambda: pool._hand_over([], late))  # before the acker starts
    try:
        with trio.fail_after(5):
            pool._hand_over([], None)  # a writer's hand-over: the acker wakes, finds one entry
            while not reported:
                await trio.testing.wait_all_tasks_blocked(cushion=0.005)
    finally:
        await pool.aclose()
    assert reported == [late]
