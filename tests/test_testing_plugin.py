"""The pytest plugin's fixtures (runtime.testing) work together under virtual time."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import trio
import trio.testing

import runtime.testing
from runtime._boundary._http import iter_sse, open_request
from runtime.testing import (
    Call,
    Clocks,
    HttpServer,
    MockSilenceClock,
    MockWallClock,
    Scenario,
    ScriptedModel,
    Text,
    ToolCalls,
    open_fake_pi,
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


async def test_leaving_open_fake_pi_during_a_tool_persists_its_abort(tmp_path: Path) -> None:
    """F4: leaving ``open_fake_pi`` while a ``bash`` tool runs is the end of its stdin: the
    run is aborted and the abort is in the session — the tool's result, then an aborted
    reply — as with Pi. The session used to be closed before that shutdown wrote it (a
    ``SessionError`` out of the block, the abort lost)."""
    model = ScriptedModel()
    model.scenario = Scenario(
        steps=[
            ToolCalls(calls=[Call(name="bash", arguments={"command": "echo started; sleep 30"})]),
            Text(text="done"),
        ]
    )
    session = tmp_path / "s.jsonl"
    with trio.fail_after(30):
        async with open_fake_pi(cwd=tmp_path, model=model, session=session) as fake:
            await fake.send({"id": "1", "type": "prompt", "message": "go"})
            while (await fake.receive()).get("type") != "tool_execution_update":
                pass
    lines = [json.loads(line) for line in session.read_text().splitlines()]
    messages = [line["message"] for line in lines if line["type"] == "message"]
    ends = [(m["role"], m.get("stopReason")) for m in messages[-2:]]
    assert ends == [("toolResult", None), ("assistant", "aborted")]
