"""S36 (docs/design/scale-out.md): a lane's session file is kept in the shared store by
difference — the bytes past what is stored — and rebuilt whole, on a real PostgreSQL."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from runtime._errors import JournalError, ReasonCode
from runtime._journal._fence import Fence
from runtime._journal._postgres import PgStore, open_pg_store
from runtime._journal._store import delivery_key, lane_key
from runtime._rooms._retention import remove_step_journals
from runtime._rooms._session_copies import KEPT, SessionCopies, part_name

from ..journal.pg_fixtures import pg_dsn, pg_server

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses
BASE: Final = "sessions/lanes/k/session.jsonl"
LIMIT: Final = 30.0


@contextlib.asynccontextmanager
async def host(tmp_path: Path, dsn: str, owner: str) -> AsyncIterator[tuple[PgStore, Fence]]:
    """A host's store and its lease on the lane."""
    async with open_pg_store(dsn, root=tmp_path / owner, owner=owner) as store:
        fence = await store.claim("room:k", 60.0)
        assert fence is not None
        yield store, fence


class Counting:
    """The store's document writes, counted (names and bytes)."""

    def __init__(self, store: PgStore) -> None:
        self.writes: list[tuple[str, int]] = []
        self.write = store.write_document

        async def counted(rel: str, data: bytes, **kwargs: Any) -> None:
            await self.write(rel, data, **kwargs)
            self.writes.append((rel, len(data)))

        store.write_document = counted  # type: ignore[method-assign]


async def test_s36_a_growing_session_is_stored_by_its_new_bytes(
    tmp_path: Path, pg_dsn: str
) -> None:
    """Each store writes only what was appended; another host rebuilds the file whole."""
    session = tmp_path / "session.jsonl"
    with trio.fail_after(LIMIT):
        async with host(tmp_path, pg_dsn, "a") as (store, fence):
            counting = Counting(store)
            copies = SessionCopies(store)
            session.write_bytes(b"h" * 100)
            await copies.restore_file(BASE, tmp_path / "a.jsonl")  # nothing stored yet
            for more in (b"", b"x" * 50, b"", b"y" * 30):
                with session.open("ab") as file:
                    file.write(more)
                await copies.store_file(BASE, session, fence)
            stored = await store.documents(BASE)
        async with open_pg_store(pg_dsn, root=tmp_path / "b", owner="b") as other:
            rebuilt = tmp_path / "rebuilt.jsonl"
            await SessionCopies(other).restore_file(BASE, rebuilt)
    assert counting.writes == [
        (part_name(BASE, 1, 0), 100),
        (part_name(BASE, 1, 100), 50),
        (part_name(BASE, 1, 150), 30),
    ]  # an unchanged file: nothing written
    assert sorted(stored) == [name for name, _ in counting.writes]
    assert rebuilt.read_bytes() == session.read_bytes()


async def test_s36_a_rewritten_session_is_a_new_generation(tmp_path: Path, pg_dsn: str) -> None:
    """A file whose stored prefix changed is stored whole as the next generation, and the
    older generation's parts are removed; so is one at the part limit."""
    session = tmp_path / "session.jsonl"
    with trio.fail_after(LIMIT):
        async with host(tmp_path, pg_dsn, "a") as (store, fence):
            copies = SessionCopies(store, part_limit=3)
            session.write_bytes(b"one\n")
            await copies.store_file(BASE, session, fence)
            session.write_bytes(b"One\ntwo\n")  # the first line rewritten
            await copies.store_file(BASE, session, fence)
            rewritten = sorted(await store.documents(BASE))
            for line in (b"3\n", b"4\n", b"5\n"):
                with session.open("ab") as file:
                    file.write(line)
                await copies.store_file(BASE, session, fence)
            limited = sorted(await store.documents(BASE))
            rebuilt = tmp_path / "rebuilt.jsonl"
            await SessionCopies(store).restore_file(BASE, rebuilt)
    assert rewritten == [part_name(BASE, 2, 0)]
    assert limited == [part_name(BASE, 3, 0)]  # 2@0, 2@8, 2@10 were 3 parts: whole again
    assert rebuilt.read_bytes() == b"One\ntwo\n3\n4\n5\n"


async def test_s36_a_session_stored_whole_before_s36_is_rebuilt_and_superseded(
    tmp_path: Path, pg_dsn: str
) -> None:
    """A document named as the session itself (a store from before S36) is generation 0:
    rebuilt as it is, and the next store writes generation 1 and removes it."""
    session = tmp_path / "session.jsonl"
    with trio.fail_after(LIMIT):
        async with host(tmp_path, pg_dsn, "a") as (store, fence):
            await store.write_document(BASE, b"old whole\n", fence=fence)
            copies = SessionCopies(store)
            await copies.restore_file(BASE, session)
            assert session.read_bytes() == b"old whole\n"
            with session.open("ab") as file:
                file.write(b"new\n")
            await copies.store_file(BASE, session, fence)
            names = sorted(await store.documents(BASE))
    assert names == [part_name(BASE, 1, 0)]


async def test_s36_a_write_whose_outcome_is_unknown_is_never_built_on(
    tmp_path: Path, pg_dsn: str
) -> None:
    """A write that failed after reaching the database (its outcome unknown to the host):
    what the host remembered is dropped, so the next store reads the database first and
    never appends to a generation that is no longer the newest."""
    session = tmp_path / "session.jsonl"
    with trio.fail_after(LIMIT):
        async with host(tmp_path, pg_dsn, "a") as (store, fence):
            copies = SessionCopies(store)
            session.write_bytes(b"one\n")
            await copies.store_file(BASE, session, fence)
            write = store.write_document

            async def lost_answer(rel: str, data: bytes, **kwargs: Any) -> None:
                await write(rel, data, **kwargs)
                raise JournalError(ReasonCode.STORE_UNAVAILABLE, "the answer was lost")

            store.write_document = lost_answer  # type: ignore[method-assign]
            session.write_bytes(b"ONE\n")  # rewritten: generation 2 written, answer lost
            with pytest.raises(JournalError):
                await copies.store_file(BASE, session, fence)
            store.write_document = write  # type: ignore[method-assign]
            session.write_bytes(b"one\ntwo\n")  # generation 1's bytes and more: no append
            await copies.store_file(BASE, session, fence)  # to it, generation 2 is newer
            rebuilt = tmp_path / "rebuilt.jsonl"
            await SessionCopies(store).restore_file(BASE, rebuilt)
    assert rebuilt.read_bytes() == b"one\ntwo\n"


async def test_s36_a_zombie_writes_no_part_and_a_gap_is_damage(tmp_path: Path, pg_dsn: str) -> None:
    """A host whose lease another host took writes nothing (``lane_fenced``); a generation
    whose parts are not contiguous is refused ``journal_corrupt``, never rebuilt shorter."""
    session = tmp_path / "session.jsonl"
    session.write_bytes(b"one\n")
    with trio.fail_after(LIMIT):
        async with open_pg_store(pg_dsn, root=tmp_path / "z", owner="z") as zombie:
            stale = Fence(lane="room:k", owner="z", epoch=99)
            with pytest.raises(JournalError) as fenced:
                await SessionCopies(zombie).store_file(BASE, session, stale)
            assert fenced.value.code is ReasonCode.LANE_FENCED
            assert await zombie.documents(BASE) == {}
        async with host(tmp_path, pg_dsn, "a") as (store, fence):
            await store.write_document(part_name(BASE, 1, 0), b"one\n", fence=fence)
            await store.write_document(part_name(BASE, 1, 9), b"three\n", fence=fence)
            with pytest.raises(JournalError) as damaged:
                await SessionCopies(store).restore_file(BASE, tmp_path / "rebuilt.jsonl")
    assert damaged.value.code is ReasonCode.JOURNAL_CORRUPT
    assert not (tmp_path / "rebuilt.jsonl").exists()


async def test_s36_retention_removes_a_one_shot_sessions_parts(tmp_path: Path, pg_dsn: str) -> None:
    """RT11 with S36: removing a finished delivery's step journal removes its one-shot
    session's parts from the database — every generation — and nothing else."""
    room, delivery = "dm:ann", "d-1"
    oneshot = f"sessions/lanes/{lane_key(room)}/oneshot/{delivery_key(delivery)}.jsonl"
    other = f"sessions/lanes/{lane_key(room)}/oneshot/{delivery_key('d-2')}.jsonl"
    session = tmp_path / "session.jsonl"
    with trio.fail_after(LIMIT):
        async with host(tmp_path, pg_dsn, "a") as (store, fence):
            copies = SessionCopies(store)
            for base in (oneshot, other):
                session.write_bytes(b"one\n")
                await copies.store_file(base, session, fence)
                session.write_bytes(b"one\ntwo\n")
                await copies.store_file(base, session, fence)
            await store.write_document(part_name(oneshot, 7, 0), b"left over", fence=fence)
            await remove_step_journals(store, [(delivery, room)])
            left = sorted(await store.documents("sessions/"))
    assert left == [part_name(other, 1, 0), part_name(other, 1, 4)]


async def test_s36_a_lane_remembers_its_last_files_and_reads_a_forgotten_one_again(
    tmp_path: Path, pg_dsn: str
) -> None:
    """A lane remembers what it stored of its last ``KEPT`` session files (its one-shot
    sessions come and go); one it forgot is read from the database when stored again, and
    still stored by its new bytes."""
    session = tmp_path / "session.jsonl"
    with trio.fail_after(LIMIT):
        async with host(tmp_path, pg_dsn, "a") as (store, fence):
            copies = SessionCopies(store)
            session.write_bytes(b"one\n")
            for i in range(KEPT + 1):
                await copies.store_file(f"{BASE}.{i}", session, fence)
            assert len(copies._stored) == KEPT
            assert f"{BASE}.0" not in copies._stored
            session.write_bytes(b"one\ntwo\n")
            await copies.store_file(f"{BASE}.0", session, fence)
            names = sorted(await store.documents(f"{BASE}.0"))
    assert names == [part_name(f"{BASE}.0", 1, 0), part_name(f"{BASE}.0", 1, 4)]
