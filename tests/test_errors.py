"""No public entry point leaks an ``ExceptionGroup`` (``docs/design/lanes.md`` L16, issue #18
item 4): the ``async with`` of ``open_room_worker``, ``open_task_service`` and ``open_server``
raises one exception — the caller's own, or one typed :class:`PiRuntimeError` with its code and
the group as its cause (``runtime/_errors.py`` :func:`one_error`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from runtime import (
    PiRuntimeError,
    ReasonCode,
    RoomWorkerConfig,
    open_room_worker,
    open_task_service,
)
from runtime._errors import JournalError, TaskError, one_error
from runtime._server._serve import ServeOptions, open_server

LIMIT = 60.0


class Boom(Exception):
    pass


def test_e1_one_error_unwraps_a_lone_exception_however_deep() -> None:
    boom = Boom("x")
    group = BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [boom])])
    assert one_error(group) is boom


def test_e1_several_failures_are_one_typed_error_with_the_group_as_cause() -> None:
    journal = JournalError(ReasonCode.JOURNAL_POISONED, "poisoned")
    group = ExceptionGroup("lanes", [Boom("a"), ExceptionGroup("in", [journal, Boom("b")])])
    error = one_error(group)
    assert isinstance(error, PiRuntimeError)
    assert error.code is ReasonCode.JOURNAL_POISONED  # the first typed one's code
    assert error.__cause__ is group
    untyped = one_error(ExceptionGroup("lanes", [Boom("a"), Boom("b")]))
    assert isinstance(untyped, PiRuntimeError)
    assert untyped.code is ReasonCode.HOST_FAILED


def test_e1_a_group_with_an_interrupt_is_left_to_the_caller() -> None:
    group = BaseExceptionGroup("x", [Boom("a"), KeyboardInterrupt()])
    assert one_error(group) is group


def _config(tmp_path: Path) -> RoomWorkerConfig:
    return RoomWorkerConfig(
        agent="fake", state_dir=str(tmp_path / "state"), work_root=str(tmp_path / "work")
    )


async def test_e1_the_room_worker_raises_the_callers_own_exception(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT), pytest.raises(Boom, match="from the body"):
        async with open_room_worker(_config(tmp_path), base_dir=tmp_path):
            raise Boom("from the body")


async def test_e1_the_task_service_raises_one_typed_error(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT), pytest.raises(TaskError) as raised:
        async with (
            open_room_worker(_config(tmp_path), base_dir=tmp_path) as worker,
            open_task_service(_config(tmp_path), store=worker.store) as tasks,
        ):
            await tasks.reply("no-such-task", "hi")
    assert raised.value.code is ReasonCode.TASK_UNKNOWN


async def test_e1_the_server_raises_the_callers_own_exception(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT), pytest.raises(Boom):
        async with open_server(_config(tmp_path), ServeOptions(port=0), base_dir=tmp_path):
            raise Boom("from the body")
