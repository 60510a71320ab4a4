"""The pytest plugin's fixtures (runtime.testing) work together under virtual time."""

from __future__ import annotations

import msgspec
import trio
import trio.testing

import runtime.testing
from runtime._boundary._http import iter_sse, open_request
from runtime.testing import (
    Clocks,
    HttpServer,
    MockSilenceClock,
    MockWallClock,
    Scenario,
    ScriptedModel,
    Text,
)


async def test_clock_fixtures_follow_trio_time(
    clocks: Clocks,
    wall_clock: MockWallClock,
    silence_clock: MockSilenceClock,
    autojump_clock: trio.testing.MockClock,
) -> None:
    assert clocks.wall is wall_clock
    assert clocks.silence is silence_clock
    before_wall, before_silence = wall_clock.time_ms(), silence_clock.read()
    await trio.sleep(1200)  # twenty virtual minutes
    assert wall_clock.time_ms() - before_wall == 1_200_000
    assert silence_clock.read().boottime - before_silence.boottime == 1200


async def test_model_server_fixture_serves_the_scripted_model(
    model_server: HttpServer, scripted_model: ScriptedModel
) -> None:
    scripted_model.scenario = Scenario(steps=[Text(text="over http")])
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with trio.fail_after(10):
        async with open_request(
            "POST", f"{model_server.url}/v1/chat/completions", body=msgspec.json.encode(body)
        ) as response:
            events = [e.data async for e in iter_sse(response.iter_bytes()) if e.data]
    assert events[-1] == "[DONE]"
    text = "".join(
        c["choices"][0]["delta"].get("content", "")
        for c in map(msgspec.json.decode, events[:-1])
        if c["choices"]
    )
    assert text == "over http"
    assert scripted_model.request_count == 1


def test_public_surface_of_runtime_testing() -> None:
    exported = {name for name in vars(runtime.testing) if not name.startswith("_")}
    assert {
        "FakePi",
        "open_fake_pi",
        "ScriptedModel",
        "Scenario",
        "MockWallClock",
        "MockSilenceClock",
        "Clocks",
    } <= exported
