"""C16 in the room worker's own start (docs/design/config.md): an embedder that calls
:func:`~runtime.open_room_worker` directly — no ``serve``, no command line — is refused a
configuration that would strand the deliveries the state directory's file store holds
pending, under the directory's lock, before ``retention.json`` is recorded again and before
any delivery is resumed.

The pending delivery is made by a real first run: the crash tests' room-worker host
(``tests/rooms/room_host.py``, :func:`~runtime.open_room_worker` in a process of its own)
SIGKILLed while d1's model request is open (its turn begun)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from fake_pi.scenario import Step, Text
from runtime._config import RoomWorkerConfig, config_from_dict
from runtime._errors import ConfigError, ReasonCode
from runtime._retention import SETTINGS_DOC
from runtime._rooms._worker import open_room_worker, request_cancel
from runtime._wire import DeliveryResult

from .._workers import scripted_upstream
from ..journal.pg_fixtures import pg_dsn, pg_server
from .test_room_crash import LIMIT, Killer, config, host, message

__all__ = ["pg_dsn", "pg_server"]  # the fixtures used here


def embedded(root: Path, url: str, **changes: Any) -> RoomWorkerConfig:
    """The embedder's configuration: the first run's (Fake-Pi, ``state``, ``work`` below
    ``root``) with ``changes``."""
    return config_from_dict({**config("fake", url), **changes}, base=root)


async def pending_d1(root: Path, url: str, killer: Killer) -> None:
    """d1 admitted and its turn begun (its model request open) when its host is SIGKILLed:
    pending in ``root/state``'s file store, admitted while ``work_root`` was ``root/work``."""
    async with host(
        root, {"config": config("fake", url), "deliver": [message("d1")], "expect": 1}, "a"
    ) as h:
        killer.host = h
        await killer.killed.wait()


async def first_result(root: Path, settings: RoomWorkerConfig, delivery_id: str) -> DeliveryResult:
    """Open the room worker on ``settings`` (delivering ``delivery_id`` unless it is pending
    already) until its result, acknowledged."""
    async with open_room_worker(settings, base_dir=root) as worker:
        if delivery_id not in worker.pending():
            await worker.deliver(message(delivery_id))
        async for result in worker.results():
            if result.delivery_id == delivery_id:
                await worker.ack(result.seq)
                return result
    raise AssertionError("the results ended")


async def test_c16_an_embedder_opening_the_worker_with_a_changed_work_root_is_refused(
    tmp_path: Path,
) -> None:
    """C16, ``work_root_changed``: d1 was admitted (its turn begun) with ``work_root =
    work``. ``open_room_worker`` with ``work_root = moved`` raises ``ConfigError``
    ``work_root_changed`` naming d1 and both roots, before anything is written or run:
    ``retention.json`` still records the old root (byte for byte), ``moved`` is not created,
    no model request is made. With the old root d1 is answered; then the new root is taken.
    Before, the check was ``serve``'s only: the embedder's start was taken, recorded the new
    root and replayed d1 below it."""
    killer = Killer(at=1)
    steps: list[Step] = [Text(text="never seen"), Text(text="answered where it began")]
    steps.append(Text(text="d2, moved"))
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=killer) as (model, url):
            await pending_d1(tmp_path, url, killer)
            recorded = (tmp_path / "state" / SETTINGS_DOC).read_bytes()
            moved = embedded(tmp_path, url, work_root="moved")
            with pytest.raises(ConfigError) as raised:
                async with open_room_worker(moved, base_dir=tmp_path):
                    pass
            asked = model.request_count
            assert (tmp_path / "state" / SETTINGS_DOC).read_bytes() == recorded
            assert not (tmp_path / "moved").exists()
            answered = await first_result(tmp_path, embedded(tmp_path, url), "d1")
            second = await first_result(tmp_path, moved, "d2")
    error = raised.value
    assert (error.code, error.setting) == (ReasonCode.WORK_ROOT_CHANGED, "work_root")
    assert "1 pending delivery ('d1')" in error.message
    assert f"work_root was {tmp_path / 'work'}" in error.message
    assert f"not below {tmp_path / 'moved'}" in error.message
    assert asked == 1  # the first run's request only: the refused start ran nothing
    assert (answered.outcome, answered.text) == ("reply", "answered where it began")
    assert (second.outcome, second.text) == ("reply", "d2, moved")


async def test_c16_a_cancel_recorded_with_no_server_lets_the_embedder_take_the_new_root(
    tmp_path: Path,
) -> None:
    """C16: d1's cancel recorded with no server running (``request_cancel``) is not counted:
    ``open_room_worker`` with the new ``work_root`` starts and ends d1 ``cancelled`` before
    anything runs — no model request below the new root."""
    killer = Killer(at=1)
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="never seen")], on_request=killer) as (
            model,
            url,
        ):
            await pending_d1(tmp_path, url, killer)
            moved = embedded(tmp_path, url, work_root="moved")
            with pytest.raises(ConfigError):
                async with open_room_worker(moved, base_dir=tmp_path):
                    pass
            assert await request_cancel(tmp_path / "state", "d1") == "requested"
            ended = await first_result(tmp_path, moved, "d1")
    assert ended.outcome == "cancelled"
    assert model.request_count == 1


async def test_c16_an_embedder_on_postgresql_over_a_file_store_with_a_pending_delivery_is_refused(
    tmp_path: Path, pg_dsn: str
) -> None:
    """C16, ``file_store_pending``: ``open_room_worker`` with ``[store] url`` on the state
    directory whose file store holds d1 pending raises ``ConfigError`` naming d1 — the
    database's hosts never read the file store. Served once on the file store, d1 is answered;
    then the PostgreSQL start is taken. Before, the embedder's start was taken and d1 never
    ran."""
    killer = Killer(at=1)
    steps: list[Step] = [Text(text="never seen"), Text(text="answered on the file store")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=killer) as (model, url):
            await pending_d1(tmp_path, url, killer)
            on_pg = embedded(tmp_path, url, store={"url": pg_dsn})
            with pytest.raises(ConfigError) as raised:
                async with open_room_worker(on_pg, base_dir=tmp_path):
                    pass
            asked = model.request_count
            answered = await first_result(tmp_path, embedded(tmp_path, url), "d1")
            async with open_room_worker(on_pg, base_dir=tmp_path) as worker:
                started = worker.pending()
    error = raised.value
    assert (error.code, error.setting) == (ReasonCode.FILE_STORE_PENDING, "store.url")
    assert "1 pending delivery ('d1')" in error.message
    assert "without --store" in error.message
    assert asked == 1
    assert (answered.outcome, answered.text) == ("reply", "answered on the file store")
    assert started == []
