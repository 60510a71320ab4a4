"""pytest fixtures for testing with Fake-Pi and virtual clocks (see :mod:`runtime.testing`).

Registered as the ``pi_runtime`` pytest plugin through the ``pytest11`` entry
point. The async fixtures need pytest-trio (``trio_mode = true`` or
``@pytest.mark.trio``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from . import (
    Clocks,
    FakePi,
    HttpServer,
    MockSilenceClock,
    MockWallClock,
    ScriptedModel,
    io_aware_autojump_clock,
    open_fake_pi,
    serve_model,
)


@pytest.fixture
def io_autojump_clock() -> trio.testing.MockClock:
    """Autojump virtual time that holds still while the runtime's I/O threads work."""
    return io_aware_autojump_clock()


@pytest.fixture
def scripted_model() -> ScriptedModel:
    """A fresh scripted model; assign ``.scenario`` to script its answers."""
    return ScriptedModel()


@pytest.fixture
def wall_clock() -> MockWallClock:
    """A wall clock that follows Trio's (mock) clock."""
    return MockWallClock()


@pytest.fixture
def silence_clock() -> MockSilenceClock:
    """A suspend-aware clock that follows Trio's clock; ``.suspend(s)`` simulates sleep."""
    return MockSilenceClock()


@pytest.fixture
def clocks(silence_clock: MockSilenceClock, wall_clock: MockWallClock) -> Clocks:
    return Clocks(silence=silence_clock, wall=wall_clock)


@pytest.fixture
async def fake_pi(
    tmp_path: Path, scripted_model: ScriptedModel, wall_clock: MockWallClock
) -> AsyncIterator[FakePi]:
    """An in-process Fake-Pi working in ``tmp_path`` on ``scripted_model``."""
    async with open_fake_pi(
        cwd=tmp_path,
        model=scripted_model,
        session=tmp_path / "session.jsonl",
        clock=wall_clock,
    ) as fake:
        yield fake


@pytest.fixture
async def model_server(scripted_model: ScriptedModel) -> AsyncIterator[HttpServer]:
    """``scripted_model`` over HTTP on 127.0.0.1 for the duration of the test."""
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(
            lambda task_status: serve_model(scripted_model, task_status=task_status)
        )
        yield server
        nursery.cancel_scope.cancel()
