"""RT14 (docs/design/retention.md): a retention pass with no server running — ``pi-runtime
journal compact``, ``task forget`` — acts with the settings the server ran with, which it
recorded in the state directory; it never guesses them. A real room worker on a real state
directory, its wall clock set back so that its results were published ten days ago."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import msgspec
import pytest
import trio

from fake_pi.scenario import Text
from runtime._cli import main
from runtime._clock import Clocks, MockWallClock, SystemSilenceClock
from runtime._config import ModelConfig, RetentionConfig, RoomWorkerConfig
from runtime._errors import ConfigError, ReasonCode
from runtime._journal._store import open_store
from runtime._retention import (
    SETTINGS_DOC,
    RetentionSettings,
    offline_settings,
    recorded_settings,
)
from runtime._rooms._retention import compact_journals
from runtime._rooms._worker import open_room_worker
from runtime._tasks._service import open_task_service

from .._workers import scripted_upstream
from .test_room_worker import message, next_results

LIMIT: Final = 60.0
DAY: Final = 86_400.0
A: Final = "dm:1"
MONTH: Final = RetentionConfig(journal_days=30, idempotency_days=60, forget_days=400)
"""The server's retention: longer than the defaults (7 / 30 / 365 days)."""


@contextlib.asynccontextmanager
async def served_ten_days_ago(tmp_path: Path, retention: RetentionConfig) -> AsyncIterator[Path]:
    """A state directory whose server (``retention``, work root ``tmp_path/w``) answered
    ``a1`` ten days ago and had it acknowledged, then stopped; yields the delivery's step
    journal, still there."""
    ten_days_ago = MockWallClock.reading(time.time_ns() // 1_000_000 - int(10 * DAY * 1000))
    clocks = Clocks(silence=SystemSilenceClock(), wall=ten_days_ago)
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="old")]) as (_model, url):
            config = RoomWorkerConfig(
                model=ModelConfig(base_url=url), retention=retention, work_root="w"
            )
            async with open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker:
                await worker.deliver(message("a1", room=A))
                (result,) = await next_results(worker, 1)
                await worker.ack(result.seq)
                log = tmp_path / "state" / worker.store.delivery_rel("a1")
    assert log.exists()
    yield log


def _config_file(tmp_path: Path, retention: RetentionConfig, work_root: str = "w") -> Path:
    path = tmp_path / f"config-{retention.journal_days:g}.toml"
    path.write_text(
        f'state_dir = "{tmp_path / "state"}"\nwork_root = "{tmp_path / work_root}"\n'
        f"[retention]\njournal_days = {retention.journal_days}\n"
        f"idempotency_days = {retention.idempotency_days}\n"
        f"forget_days = {retention.forget_days}\n"
    )
    return path


def _refused_with(caplog: pytest.LogCaptureFixture) -> str:
    return str(getattr(caplog.records[-1], "code", ""))


async def _main(*argv: str) -> int:
    return await trio.to_thread.run_sync(main, list(argv))


async def test_rt14_a_journal_compact_acts_with_the_days_the_server_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """RT14 (a): the server kept step journals 30 days; ``journal compact`` with no
    ``--config`` keeps a ten-day-old one (the default, 7 days, would remove it) and says
    which days it acted with; the record is ``retention.json``, with the task work root."""
    async with served_ten_days_ago(tmp_path, MONTH) as log:
        state = tmp_path / "state"
        recorded = offline_settings(state, None)
        assert await _main("journal", "compact", "--state-dir", str(state)) == 0
        assert log.exists()
    assert recorded == RetentionSettings(retention=MONTH, task_work_root=str(tmp_path / "w/tasks"))
    assert "removed 0 step journals older than 30 days" in capsys.readouterr().out


async def test_rt14_b_a_config_that_would_remove_sooner_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """RT14 (b): ``--config`` with the default days (7) against a server that ran with 30 is
    refused ``retention_mismatch`` naming both values, and nothing is removed; so is one with
    the server's days but another work root (``task forget`` would look for the wrong
    directories). The server's own configuration is accepted."""
    async with served_ten_days_ago(tmp_path, MONTH) as log:
        week = _config_file(tmp_path, RetentionConfig())
        assert await _main("journal", "compact", "--config", str(week)) == 1
        week_code = _refused_with(caplog)
        elsewhere = _config_file(tmp_path, MONTH, work_root="other")
        forget = ["task", "forget", "t1", "--state-dir", str(tmp_path / "state")]
        assert await _main(*forget, "--config", str(elsewhere)) == 1
        root_code = _refused_with(caplog)
        kept = log.exists()
        month = _config_file(tmp_path, MONTH)
        accepted = await _main("journal", "compact", "--config", str(month))
    assert week_code == root_code == ReasonCode.RETENTION_MISMATCH
    assert "[retention] journal_days is 7 here, 30 where recorded" in caplog.text
    assert f"the task work root is {tmp_path / 'other/tasks'} here" in caplog.text
    assert kept
    assert accepted == 0


async def test_rt14_a_with_nothing_recorded_no_pass_guesses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RT14 (a): a state directory with no recorded settings (an older version served it):
    ``journal compact`` and ``task forget`` with no ``--config`` are refused
    ``retention_unknown`` and remove nothing; with ``--config`` the compaction acts."""
    async with served_ten_days_ago(tmp_path, MONTH) as log:
        state = tmp_path / "state"
        (state / SETTINGS_DOC).unlink()
        assert await _main("journal", "compact", "--state-dir", str(state)) == 1
        compact_code = _refused_with(caplog)
        assert await _main("task", "forget", "t1", "--state-dir", str(state)) == 1
        forget_code = _refused_with(caplog)
        kept = log.exists()
        week = _config_file(tmp_path, RetentionConfig(journal_days=7))
        assert await _main("journal", "compact", "--config", str(week)) == 0
    assert compact_code == forget_code == ReasonCode.RETENTION_UNKNOWN
    assert kept
    assert not log.exists()  # 7 days, as the operator said


async def test_rt14_c_a_damaged_record_is_refused_not_read_as_absent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RT14 (c): one digit of the record changed (30 → 10 days, which would remove the
    journal) fails its checksum: ``journal_corrupt``, with or without ``--config``."""
    async with served_ten_days_ago(tmp_path, MONTH) as log:
        record = tmp_path / "state" / SETTINGS_DOC
        data = record.read_bytes()
        assert data.count(b'"journal_days":30.0') == 1
        record.write_bytes(data.replace(b'"journal_days":30.0', b'"journal_days":10.0'))
        assert await _main("journal", "compact", "--state-dir", str(tmp_path / "state")) == 1
        bare = _refused_with(caplog)
        month = _config_file(tmp_path, MONTH)
        assert await _main("journal", "compact", "--config", str(month)) == 1
        configured = _refused_with(caplog)
    assert bare == configured == ReasonCode.JOURNAL_CORRUPT
    assert log.exists()


async def test_rt14_settings_read_before_the_lock_are_checked_again_under_it(
    tmp_path: Path,
) -> None:
    """RT14: the settings a pass read without the lock are checked again once it holds it.
    A server that started with 7 days and stopped in between has recorded them: the pass
    that read 30 is refused ``retention_mismatch`` rather than act on what it no longer is."""
    async with served_ten_days_ago(tmp_path, MONTH) as log:
        state = tmp_path / "state"
        read_before = offline_settings(state, None)
        with trio.fail_after(LIMIT):
            async with scripted_upstream([]) as (_model, url):
                config = RoomWorkerConfig(model=ModelConfig(base_url=url), work_root="w")
                async with open_room_worker(config, base_dir=tmp_path):
                    pass
        with pytest.raises(ConfigError) as refused:
            await compact_journals(state, settings=read_before, clocks=Clocks.system())
        kept = log.exists()
    assert refused.value.code is ReasonCode.RETENTION_MISMATCH
    assert kept


async def test_rt14_the_record_is_written_only_when_the_settings_change(tmp_path: Path) -> None:
    """A restart with the same settings leaves the record as it is (no write at every
    start); one with other settings replaces it."""
    async with served_ten_days_ago(tmp_path, MONTH):
        record = tmp_path / "state" / SETTINGS_DOC
        before = record.stat().st_ino
        for retention, expected in ((MONTH, MONTH), (RetentionConfig(), RetentionConfig())):
            with trio.fail_after(LIMIT):
                async with scripted_upstream([]) as (_model, url):
                    config = RoomWorkerConfig(
                        model=ModelConfig(base_url=url), retention=retention, work_root="w"
                    )
                    async with open_room_worker(config, base_dir=tmp_path):
                        pass
            assert offline_settings(tmp_path / "state", None).retention == expected
            if retention is MONTH:
                assert record.stat().st_ino == before
        assert record.stat().st_ino != before


async def test_rt14_d_task_lanes_alone_never_override_the_days_a_room_server_recorded(
    tmp_path: Path,
) -> None:
    """RT14 (d): a host of task lanes alone (an embedded task service, a standalone
    ``task run``) on a directory a room server recorded 30 days in is refused
    ``retention_mismatch`` with other days, and the record stays; with the recorded days it
    runs. On a directory with nothing recorded it records its own."""
    async with served_ten_days_ago(tmp_path, MONTH):
        state = tmp_path / "state"

        def config(retention: RetentionConfig) -> RoomWorkerConfig:
            return RoomWorkerConfig(
                agent="fake", state_dir=str(state), work_root=str(tmp_path / "w"),
                retention=retention,
            )  # fmt: skip

        with trio.fail_after(LIMIT):
            async with open_store(state, clocks=Clocks.system()) as store:
                with pytest.raises(ConfigError) as refused:
                    async with open_task_service(config(RetentionConfig()), store=store):
                        pass
                async with open_task_service(config(MONTH), store=store):
                    pass
            kept = offline_settings(state, None)
            fresh = tmp_path / "fresh"
            async with (
                open_store(fresh, clocks=Clocks.system()) as store,
                open_task_service(
                    msgspec.structs.replace(config(RetentionConfig()), state_dir=str(fresh)),
                    store=store,
                ),
            ):
                pass
    assert refused.value.code is ReasonCode.RETENTION_MISMATCH
    assert kept.retention == MONTH
    assert recorded_settings(fresh) == RetentionSettings(
        retention=RetentionConfig(), task_work_root=str(tmp_path / "w/tasks")
    )


async def test_rt14_a_task_run_with_no_server_is_refused_a_postgresql_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RT14, RT13: ``task run`` with no server runs on the state directory's file store; a
    configuration naming a PostgreSQL store is refused before anything is created there
    (its task would not be in the deployment's database, and the directory would look like a
    file store to every later command)."""
    config = tmp_path / "pg.toml"
    config.write_text('[store]\nurl = "postgresql://127.0.0.1:1/nodb"\n')
    state = tmp_path / "pg-state"
    ran = await _main(
        "task", "run", "--worktree", str(tmp_path), "--prompt", "p", "--task-id", "t1",
        "--state-dir", str(state), "--config", str(config),
    )  # fmt: skip
    assert ran == 1
    assert _refused_with(caplog) == ReasonCode.CONFIG_INVALID
    assert "a task run with no server runs on this state directory's file store" in caplog.text
    assert not state.exists()


async def test_rt12_journal_compact_passes_over_a_lane_log_a_crash_left_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """J3, RT12: a lane log a crash left empty (its create cut short: no header yet, which
    ``journal verify`` notes as holding nothing) is no task: ``journal compact`` passes over
    it — it used to stop with an ``IndexError`` after the room compaction had run."""
    async with served_ten_days_ago(tmp_path, MONTH):
        lane = tmp_path / "state" / "lanes" / ("0" * 32)
        lane.mkdir(mode=0o700)
        (lane / "lane.log").write_bytes(b"")
        compacted = await _main("journal", "compact", "--state-dir", str(tmp_path / "state"))
    assert compacted == 0
    assert "slimmed 0 ended tasks" in capsys.readouterr().out


async def test_rt14_a_retention_command_acts_on_the_configurations_state_dir_or_refuses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """RT14: ``journal compact`` and ``task forget`` with no server take the state directory
    the same way: ``--state-dir``, else ``--config``'s ``state_dir``, else ``./state``.
    Both given and naming different directories is refused ``config_invalid`` naming
    ``state_dir``, and nothing is acted on: that configuration is not the one the server of
    that directory runs with."""
    async with served_ten_days_ago(tmp_path, MONTH) as log:
        month = _config_file(tmp_path, MONTH)
        other = tmp_path / "other-state"
        assert (
            await _main("journal", "compact", "--config", str(month), "--state-dir", str(other))
            == 1
        )
        compact_code = _refused_with(caplog)
        named = f"is not the configuration's state_dir {tmp_path / 'state'}" in caplog.text
        forget = ["task", "forget", "t1", "--config", str(month)]
        assert await _main(*forget, "--state-dir", str(other)) == 1
        forget_code = _refused_with(caplog)
        assert not other.exists()
        caplog.clear()
        assert await _main(*forget) == 1  # the configuration's directory: no such task there
        unknown = _refused_with(caplog)
        same = await _main(
            "journal", "compact", "--config", str(month), "--state-dir", str(tmp_path / "state")
        )
        assert log.exists()
    assert compact_code == forget_code == ReasonCode.CONFIG_INVALID
    assert named
    assert unknown == ReasonCode.TASK_UNKNOWN
    assert same == 0
