"""The state directory layout and the store's API (runtime._journal._store)."""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path
from typing import cast

import pytest
import trio
import trio.testing

from runtime import JournalError, ReasonCode, open_store
from runtime._journal._journal import encode_record
from runtime._journal._store import delivery_key, lane_key
from runtime._linux._fs import FileSystem, OsFileSystem
from runtime._records import LogKind, Poison, ReplayClass, StepAbandoned, ToolIntent

from .test_writer_wakeup import _HeldWrite


def _step(n: int) -> StepAbandoned:
    return StepAbandoned(step=n, reason="test", epoch=1)


async def test_layout_and_private_modes(tmp_path: Path) -> None:
    """J10: the state directory is created 0700 with the documented layout."""
    root = tmp_path / "state"
    with trio.fail_after(10):
        async with open_store(root) as store:
            assert (root / "owner.json").exists()
            assert store.admissions.rel == "admissions/admissions.log"
            assert store.results.rel == "results.log"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    names = sorted(p.name for p in root.iterdir())
    # owner.json is there while the store is open and removed on a clean release (J9)
    assert names == ["LOCK", "admissions", "deliveries", "lanes", "results.log", "sync"]
    assert not list((root / "sync").iterdir())  # J12: a clean release leaves nothing owed
    assert stat.S_IMODE((root / "results.log").stat().st_mode) == 0o600


async def test_file_names_are_hashes_of_client_ids(tmp_path: Path) -> None:
    """J10: a client-chosen id never appears raw in a path."""
    nasty = "../../etc/passwd\0:room"
    with trio.fail_after(10):
        async with open_store(tmp_path / "s") as store:
            log = await store.create_delivery_log(nasty)
            lane = await store.open_lane_log("guild:1:2")
            assert log.rel == f"deliveries/{delivery_key(nasty)}.log"
            assert lane.rel == f"lanes/{lane_key('guild:1:2')}/lane.log"
            assert not os.path.isabs(log.rel)
    assert all("passwd" not in p.name for p in (tmp_path / "s").rglob("*"))


async def test_append_and_reopen(tmp_path: Path) -> None:
    """J2: appended records come back, in order, after the store is reopened."""
    intent = ToolIntent(
        intent_id="k:1",
        step=0,
        tool_call_id="call_1",
        name="bash",
        args="{}",
        replay_class=ReplayClass.NEVER,
        epoch=1,
    )
    with trio.fail_after(10):
        async with open_store(tmp_path / "s") as store:
            log = await store.create_delivery_log("d1")
            assert await log.append(intent) == 1
            assert await log.append(_step(1)) == 2
            lane = await store.open_lane_log("dm:7")
            await lane.append(_step(9))
            assert await store.admissions.append(_step(3)) == 1
        async with open_store(tmp_path / "s") as store:
            contents = await store.read_delivery_log("d1")
            assert contents.records[1:] == (intent, _step(1))
            assert contents.header.kind is LogKind.DELIVERY
            assert contents.header.subject == "d1"
            reopened = await store.open_delivery_log("d1")
            assert await reopened.append(_step(2)) == 3
            lane = await store.open_lane_log("dm:7")
            assert lane.contents.records[1:] == (_step(9),)
            assert store.admissions.contents.records[1:] == (_step(3),)
            assert store.admissions.next_seq == 2


async def test_create_existing_delivery_log_is_refused(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with open_store(tmp_path / "s") as store:
            await store.create_delivery_log("d1")
            with pytest.raises(JournalError):
                await store.create_delivery_log("d1")
        async with open_store(tmp_path / "s") as store:
            with pytest.raises(FileExistsError):
                await store.create_delivery_log("d1")


async def test_open_missing_delivery_log(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with open_store(tmp_path / "s") as store:
            with pytest.raises(FileNotFoundError):
                await store.open_delivery_log("nope")


async def test_documents_replace_atomically(tmp_path: Path) -> None:
    """J7: a document is replaced whole; no temporary file is left behind."""
    with trio.fail_after(10):
        async with open_store(tmp_path / "s") as store:
            assert await store.read_document("lanes/state.json") is None
            await store.write_document("lanes/state.json", b"one")
            await store.write_document("lanes/state.json", b"two")
            assert await store.read_document("lanes/state.json") == b"two"
    assert sorted(p.name for p in (tmp_path / "s" / "lanes").iterdir()) == ["state.json"]


async def test_appends_after_close_are_refused(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with open_store(tmp_path / "s") as store:
            log = await store.create_delivery_log("d1")
        with pytest.raises(JournalError) as info:
            await log.append(_step(1))
    assert info.value.code is ReasonCode.JOURNAL_CLOSED


async def test_concurrent_admissions_get_distinct_consecutive_seqs(tmp_path: Path) -> None:
    """J8: concurrent producers each get their own seq; all are durable on reopen."""
    seqs: list[int] = []

    async def produce(n: int) -> None:
        for i in range(n):
            seqs.append(await store.admissions.append(_step(i)))

    with trio.fail_after(20):
        async with open_store(tmp_path / "s") as store, trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(produce, 25)
        assert sorted(seqs) == list(range(1, 501))
        async with open_store(tmp_path / "s") as store:
            assert store.admissions.next_seq == 501


@pytest.mark.parametrize("which", ["expire_tasks", "expire"])
async def test_rt4_rt12_two_expiries_at_once_both_stand(tmp_path: Path, which: str) -> None:
    """RT4, RT12: an expiry adds ids to the expired filter by reading it, replacing the file
    and reading it back. Two at once (the periodic task retention and an operator's
    ``task forget``) must not build on the same filter and leave only the second: every id
    of both stands, in memory and on disk — else an expired task (or delivery) could be
    submitted again as new."""
    since = 2_000_000_000_000  # far in the future: held back whatever forget_days
    async with open_store(tmp_path / "state") as store:
        expire = functools.partial(getattr(store, which), forget_ms=86_400_000)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expire, {"first": since})
            nursery.start_soon(expire, {"second": since})
        held = store.expired_tasks if which == "expire_tasks" else store.expired
    async with open_store(tmp_path / "state") as reopened:
        again = reopened.expired_tasks if which == "expire_tasks" else reopened.expired

    def key(name: str) -> str:
        return lane_key(f"task:{name}") if which == "expire_tasks" else delivery_key(name)

    for ids in (held, again):
        assert key("first") in ids
        assert key("second") in ids


@pytest.mark.parametrize("there", [True, False], ids=["existing", "missing"])
async def test_two_opens_of_one_log_at_once_share_one_journal(tmp_path: Path, there: bool) -> None:
    """J1, J8: two tasks open the same lane log at once (a parked task lane woken by two
    appends): both get the one journal, so their records are numbered once, in sequence —
    two journals would both number theirs 1, and the log would then read as a sequence gap."""
    root = tmp_path / "state"
    async with open_store(root) as store:
        if there:
            await store.close_log(await store.open_lane_log("x"))
        opened: list[object] = []

        async def open_and_append(n: int) -> None:
            journal = await store.open_lane_log("x")
            opened.append(journal)
            await journal.append(StepAbandoned(step=n, reason="test", epoch=1))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_and_append, 1)
            nursery.start_soon(open_and_append, 2)
        assert opened[0] is opened[1]
        contents = await store.read(store.lane_rel("x"))
        assert sorted(r.step for r in contents.records[1:] if isinstance(r, StepAbandoned)) == [
            1,
            2,
        ]


@pytest.mark.parametrize("other", ["create", "open_or_create"])
async def test_j19_two_tasks_creating_one_delivery_log_at_once_never_both_write_it(
    tmp_path: Path, other: str
) -> None:
    """J19, J1: two tasks create the same delivery's log at once (``create_delivery_log``
    racing another create, or an ``open_or_create_delivery_log``). Exactly one journal may
    come of it: two would each write their header at offset 0 and their records over each
    other's (a log written in place, J19), and the log would lose acknowledged records. The
    loser of a create is refused as a create of an existing log is (``FileExistsError``, or
    ``journal_in_use`` for a log already open — never ``journal_corrupt``: the log is
    healthy), or handed the one journal, and every record either appends is read back."""
    root = tmp_path / "state"
    async with open_store(root) as store:
        journals: list[object] = []
        refused: list[BaseException] = []
        appended: list[int] = []

        async def create(n: int) -> None:
            try:
                if n == 1 and other == "open_or_create":
                    journal = await store.open_or_create_delivery_log("d")
                else:
                    journal = await store.create_delivery_log("d")
            except (FileExistsError, JournalError) as exc:
                refused.append(exc)
                return
            journals.append(journal)
            await journal.append(_step(n))
            appended.append(n)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(create, 0)
            nursery.start_soon(create, 1)
        assert len(journals) + len(refused) == 2
        codes = [exc.code for exc in refused if isinstance(exc, JournalError)]
        assert all(code is ReasonCode.JOURNAL_IN_USE for code in codes), codes
        assert len({id(j) for j in journals}) == 1, "two journals write one log"
        records = (await store.read(store.delivery_rel("d"))).records[1:]
        steps = [r.step for r in records if isinstance(r, StepAbandoned)]
        assert sorted(steps) == sorted(appended)


async def test_tl9_an_opening_while_the_log_closes_waits_and_gets_a_journal_of_its_own(
    tmp_path: Path,
) -> None:
    """TL9, J8: a parked lane's log is being closed (its close waits behind another log's
    write on the same writer thread) when the lane is woken and opens it again. The opening
    waits for the close and gets a new journal, the one the store holds open — never the
    journal being closed, which the store then forgets while the lane goes on appending to
    it (a third opening would read the file and number its records from the same place)."""
    fs = _HeldWrite(OsFileSystem())
    root = tmp_path / "state"
    with trio.fail_after(20):
        async with open_store(root, fs=cast(FileSystem, fs), writer_shards=1) as store:
            lane = await store.open_lane_log("x")
            other = await store.create_delivery_log("other")
            reopened: list[object] = []

            async def reopen() -> None:
                journal = await store.open_lane_log("x")
                reopened.append(journal)
                await journal.append(StepAbandoned(step=2, reason="test", epoch=1))

            async with trio.open_nursery() as nursery:
                fs.holding = True
                nursery.start_soon(other.append, StepAbandoned(step=1, reason="held", epoch=1))
                await trio.to_thread.run_sync(fs.held.wait, 10)
                nursery.start_soon(store.close_log, lane)  # queued behind the held write
                await trio.testing.wait_all_tasks_blocked(cushion=0.01)
                nursery.start_soon(reopen)
                await trio.testing.wait_all_tasks_blocked(cushion=0.01)
                fs.go.set()
            assert reopened[0] is not lane
            assert store._open[store.lane_rel("x")] is reopened[0]
            again = await store.open_lane_log("x")
            assert again is reopened[0]
            await again.append(StepAbandoned(step=3, reason="test", epoch=1))
        async with open_store(root) as store:
            contents = await store.read(store.lane_rel("x"))
            steps = [r.step for r in contents.records[1:] if isinstance(r, StepAbandoned)]
            assert steps == [2, 3]


async def test_tl9_a_close_called_in_a_cancelled_scope_still_closes(tmp_path: Path) -> None:
    """TL9: a log closed from a scope already cancelled (a lane's ``finally`` on its way out)
    is closed all the same — its journal forgotten, its file closed — and the cancellation
    arrives after, as for the close's own hand-off. The wait for the log's opening lock must
    not be where the cancellation lands and the close is skipped."""
    async with open_store(tmp_path / "state") as store:
        journal = await store.open_lane_log("x")
        await journal.append(StepAbandoned(step=1, reason="test", epoch=1))
        with trio.CancelScope() as scope:
            scope.cancel()
            await store.close_log(journal)
            await trio.lowlevel.checkpoint()
        assert scope.cancelled_caught
        assert store.lane_rel("x") not in store._open
        assert (await store.open_lane_log("x")) is not journal


async def test_j22_a_poison_a_crash_left_without_its_log_never_poisons_a_new_log(
    tmp_path: Path,
) -> None:
    """J22: a removal unlinks a log, then its poison document; a crash between the two leaves
    the poison with no log. A log created under the name later (its delivery id forgotten,
    then admitted anew) is a new one: the old poison is removed first, so the new log reads
    whole and opens for appending after a restart (it read as poisoned, and was refused)."""
    root = tmp_path / "state"
    with trio.fail_after(10):
        async with open_store(root) as store:
            rel = store.delivery_rel("d0")
        stale = Poison(log_path=rel, good_length=4096, reason="old", errno=5, poisoned_ms=1)
        (root / f"{rel}.poison").write_bytes(encode_record(stale))
        async with open_store(root) as store:
            log = await store.create_delivery_log("d0")
            assert await log.append(_step(1)) == 1
            await store.close_log(log)
        assert not (root / f"{rel}.poison").exists()
        async with open_store(root) as store:
            contents = await store.read_delivery_log("d0")
            assert contents.poison is None
            assert list(contents.records[1:]) == [_step(1)]
            reopened = await store.open_delivery_log("d0")
            assert await reopened.append(_step(2)) == 2


async def test_j22_a_removed_log_takes_its_poison_document_with_it(tmp_path: Path) -> None:
    """J22: retention's removal of a poisoned log removes its poison document too (as the
    PostgreSQL store deletes the poison row with the rows): nothing of it stays to meet a
    log made again under the name."""
    root = tmp_path / "state"
    with trio.fail_after(10):
        async with open_store(root) as store:
            log = await store.create_delivery_log("d0")
            await log.append(_step(1))
            await store.close_log(log)
            rel = log.rel
        poison = Poison(log_path=rel, good_length=1, reason="a fault", errno=5, poisoned_ms=1)
        (root / f"{rel}.poison").write_bytes(encode_record(poison))
        async with open_store(root) as store:
            assert await store.remove_logs([rel]) == 1
        assert sorted(p.name for p in (root / "deliveries").iterdir()) == []
