"""Fake-Pi's automatic compaction, in-process under virtual time.

Mirrors Pi 1.6.0's ``_checkCompaction`` / ``_runAutoCompaction`` (``agent-session.js``)
and ``compaction/compaction.js``: past ``contextWindow - reserveTokens`` the older
history is summarized by an ordinary streamed request to the session's model, a
``compaction`` entry is appended, and later requests carry summary + kept messages.

The scripted model reports ``prompt_tokens`` as a quarter of the request's message
JSON and one completion token per word, so the replies below (1000 words, about 1250
estimated tokens each) cross a 2000-token threshold on the second prompt and not on
the first; after compaction the context is well below it again.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from fake_pi._app import FakePi, _setup, open_fake_pi, parse_args
from fake_pi._compaction import (
    SUMMARIZATION_PROMPT,
    SUMMARIZATION_SYSTEM_PROMPT,
    TURN_PREFIX_SUMMARIZATION_PROMPT,
    CompactionSettings,
    estimate_tokens,
)
from fake_pi._messages import COMPACTION_SUMMARY_PREFIX, COMPACTION_SUMMARY_SUFFIX
from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import Call, Scenario, Text, ToolCalls, UsageLimit
from runtime._clock import MockWallClock
from runtime._pi._session_files import read_session

WINDOW = 20000
THRESHOLD = 2000
REPLY1 = "word " * 999 + "end"
REPLY2 = "more " * 999 + "end"
SUMMARY = "THE SUMMARY"
# keeps the second exchange (its reply plus the 1-token "two"), summarizes the first
KEEP_SECOND_EXCHANGE = (
    estimate_tokens({"role": "assistant", "content": [{"type": "text", "text": REPLY2}]}) + 1
)
SETTINGS = CompactionSettings(
    reserve_tokens=WINDOW - THRESHOLD, keep_recent_tokens=KEEP_SECOND_EXCHANGE
)


def _model(*steps: Any) -> ScriptedModel:
    return ScriptedModel(scenario=Scenario(steps=list(steps)))


async def _prompt(fake: FakePi, text: str) -> list[dict[str, Any]]:
    await fake.send({"id": "p", "type": "prompt", "message": text})
    return await fake.receive_until("agent_settled")


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events if e["type"] != "message_update"]


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


class _FixedClock:
    def time_ms(self) -> int:
        return 1_795_000_000_000


def _ms(iso: str) -> int:
    return int(datetime.datetime.fromisoformat(iso).timestamp() * 1000 + 0.5)


async def test_threshold_compaction_events_and_summarization_request(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """After the run that crosses the threshold: agent_end, compaction_start{threshold},
    one summarization request to the model, compaction_end{result}, agent_settled."""
    model = _model(Text(text=REPLY1), Text(text=REPLY2), Text(text=SUMMARY))
    session = tmp_path / "s.jsonl"
    async with open_fake_pi(
        cwd=tmp_path,
        model=model,
        session=session,
        clock=MockWallClock(),
        compaction=SETTINGS,
        context_window=WINDOW,
    ) as fake:
        first = await _prompt(fake, "one")
        assert "compaction_start" not in _types(first)
        assert model.request_count == 1
        second = await _prompt(fake, "two")
        await fake.send({"id": "s", "type": "get_state"})
        state = (await fake.receive())["data"]
    assert _types(second)[-5:] == [
        "turn_end",
        "agent_end",
        "compaction_start",
        "compaction_end",
        "agent_settled",
    ]
    assert second[-1] == {"type": "agent_settled", "aborted": False}
    start, end = second[-3], second[-2]
    assert start == {"type": "compaction_start", "reason": "threshold"}
    assert list(end) == ["type", "reason", "result", "aborted", "willRetry"]
    assert (end["reason"], end["aborted"], end["willRetry"]) == ("threshold", False, False)
    result = end["result"]
    assert list(result) == [
        "summary",
        "firstKeptEntryId",
        "tokensBefore",
        "estimatedTokensAfter",
        "usage",
        "details",
    ]
    assert result["summary"] == SUMMARY
    assert result["details"] == {"readFiles": [], "modifiedFiles": []}
    reply2 = second[-6]["message"]
    assert reply2["role"] == "assistant"
    # no context edits: the last reply's usage is the context size
    assert result["tokensBefore"] == reply2["usage"]["totalTokens"] > THRESHOLD
    assert result["estimatedTokensAfter"] < result["tokensBefore"]
    assert state["isCompacting"] is False
    assert state["autoCompactionEnabled"] is True
    # the summarization request: an ordinary streamed chat/completions call
    assert model.request_count == 3
    body = model.requests[2].body
    assert body["model"] == "fake-model"
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert "tools" not in body
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["messages"][0]["content"] == SUMMARIZATION_SYSTEM_PROMPT
    prompt = body["messages"][1]["content"][0]["text"]
    assert prompt == (
        f"<conversation>\n[User]: one\n\n[Assistant]: {REPLY1}\n</conversation>\n\n"
        + SUMMARIZATION_PROMPT
    )
    summary_usage = result["usage"]
    assert summary_usage["output"] == len(SUMMARY.split())
    assert summary_usage["totalTokens"] == summary_usage["input"] + summary_usage["output"]


async def test_compaction_entry_and_the_next_request(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The ``compaction`` entry has Pi's keys; the next request is the system prompt,
    the summary as a user message, the kept exchange and the new prompt."""
    model = _model(Text(text=REPLY1), Text(text=REPLY2), Text(text=SUMMARY), Text(text="ok"))
    session = tmp_path / "s.jsonl"
    async with open_fake_pi(
        cwd=tmp_path,
        model=model,
        session=session,
        clock=MockWallClock(),
        compaction=SETTINGS,
        context_window=WINDOW,
    ) as fake:
        await _prompt(fake, "one")
        second = await _prompt(fake, "two")
        third = await _prompt(fake, "three")
        await fake.send({"id": "m", "type": "get_messages"})
        messages = (await fake.receive())["data"]["messages"]
    assert "compaction_start" not in _types(third)
    entries = read_session(session).session.entries
    raw = [dict(e.raw) for e in entries]
    assert [e["type"] for e in raw] == [
        "model_change",
        "thinking_level_change",
        "message",
        "message",
        "message",
        "message",
        "message",
        "compaction",
        "message",
        "message",
    ]
    compaction = raw[7]
    assert list(compaction) == [
        "type",
        "id",
        "parentId",
        "timestamp",
        "summary",
        "firstKeptEntryId",
        "tokensBefore",
        "details",
        "usage",
        "fromHook",
        "systemMessage",
    ]
    assert compaction["parentId"] == raw[6]["id"]
    second_user = raw[5]
    assert second_user["message"]["content"][0]["text"] == "two"
    assert compaction["firstKeptEntryId"] == second_user["id"]
    assert compaction["summary"] == SUMMARY
    assert compaction["fromHook"] is False
    assert compaction["details"] == {"readFiles": [], "modifiedFiles": []}
    result = second[-2]["result"]
    assert compaction["usage"] == result["usage"]
    assert compaction["tokensBefore"] == result["tokensBefore"]
    system = raw[2]["message"]
    assert compaction["systemMessage"] == {
        "role": "system",
        "content": "",
        "sections": system["sections"],
        "toolsAdded": system["toolsAdded"],
        "timestamp": _ms(compaction["timestamp"]),
    }
    # the request after compaction
    assert model.request_count == 4
    sent = model.requests[3].body["messages"]
    first_request = model.requests[0].body["messages"]
    assert sent[0] == first_request[0]  # the same system prompt
    assert sent[1:] == [
        _user(COMPACTION_SUMMARY_PREFIX + SUMMARY + COMPACTION_SUMMARY_SUFFIX),
        _user("two"),
        {"role": "assistant", "content": REPLY2},
        _user("three"),
    ]
    # get_messages shows Pi's projection: system, summary, kept and new messages
    assert [m["role"] for m in messages] == [
        "system",
        "compactionSummary",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert messages[1] == {
        "role": "compactionSummary",
        "summary": SUMMARY,
        "tokensBefore": compaction["tokensBefore"],
        "timestamp": _ms(compaction["timestamp"]),
    }


async def test_resumed_session_keeps_the_compacted_context(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A resumed session file with a compaction entry is read the same way."""
    session = tmp_path / "s.jsonl"
    model = _model(Text(text=REPLY1), Text(text=REPLY2), Text(text=SUMMARY))
    async with open_fake_pi(
        cwd=tmp_path,
        model=model,
        session=session,
        clock=MockWallClock(),
        compaction=SETTINGS,
        context_window=WINDOW,
    ) as fake:
        await _prompt(fake, "one")
        await _prompt(fake, "two")
    again = _model(Text(text="ok"))
    async with open_fake_pi(
        cwd=tmp_path, model=again, session=session, clock=MockWallClock()
    ) as fake:
        await _prompt(fake, "three")
    sent = again.requests[0].body["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "user", "assistant", "user"]
    assert SUMMARY in sent[1]["content"][0]["text"]


async def test_no_compaction_below_the_threshold(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """With Pi's defaults (128000 window, 16384 reserved) the same talk never compacts."""
    model = _model(Text(text=REPLY1), Text(text=REPLY2), Text(text="ok"))
    session = tmp_path / "s.jsonl"
    async with open_fake_pi(
        cwd=tmp_path, model=model, session=session, clock=MockWallClock()
    ) as fake:
        events = [e for text in ("one", "two", "three") for e in await _prompt(fake, text)]
    assert not [e for e in events if e["type"].startswith("compaction")]
    assert model.request_count == 3
    assert "compaction" not in [e.type for e in read_session(session).session.entries]


async def test_compaction_disabled_by_settings(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """``compaction.enabled: false`` in settings.json: past the threshold, nothing happens."""
    settings = CompactionSettings.from_settings(
        {
            "compaction": {
                "enabled": False,
                "reserveTokens": WINDOW - THRESHOLD,
                "keepRecentTokens": KEEP_SECOND_EXCHANGE,
            }
        }
    )
    assert settings == CompactionSettings(
        enabled=False, reserve_tokens=WINDOW - THRESHOLD, keep_recent_tokens=KEEP_SECOND_EXCHANGE
    )
    model = _model(Text(text=REPLY1), Text(text=REPLY2), Text(text="ok"))
    async with open_fake_pi(
        cwd=tmp_path,
        model=model,
        clock=MockWallClock(),
        compaction=settings,
        context_window=WINDOW,
    ) as fake:
        events = [e for text in ("one", "two", "three") for e in await _prompt(fake, text)]
        await fake.send({"id": "s", "type": "get_state"})
        state = (await fake.receive())["data"]
    assert not [e for e in events if e["type"].startswith("compaction")]
    assert model.request_count == 3
    assert state["autoCompactionEnabled"] is False
    last = [m["role"] for m in model.requests[2].body["messages"]]
    assert last == ["system", "user", "assistant", "user", "assistant", "user"]


async def test_compaction_between_turns_splits_the_turn(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Pi's ``_compactBeforeNextAssistantResponse``: after a tool round that crosses the
    threshold, compaction runs between turn_end and the next turn_start. Cutting inside
    the turn summarizes the history and the turn's prefix with two requests, and the
    summary lists the file the summarized part wrote (Pi leaves out the kept part's)."""
    (tmp_path / "big.txt").write_text("line of text\n" * 400)
    model = _model(
        ToolCalls(calls=[Call(name="write", arguments={"path": "notes.txt", "content": "x"})]),
        Text(text=REPLY1),
        ToolCalls(calls=[Call(name="read", arguments={"path": "big.txt"})]),
        Text(text="HISTORY"),
        Text(text="PREFIX"),
        Text(text="done"),
    )
    settings = CompactionSettings(reserve_tokens=WINDOW - THRESHOLD, keep_recent_tokens=700)
    async with open_fake_pi(
        cwd=tmp_path,
        model=model,
        clock=MockWallClock(),
        compaction=settings,
        context_window=WINDOW,
    ) as fake:
        await _prompt(fake, "one")
        events = await _prompt(fake, "two")
    types = _types(events)
    at = types.index("compaction_start")
    assert types[at - 4 : at + 6] == [
        "tool_execution_end",
        "message_start",
        "message_end",
        "turn_end",
        "compaction_start",
        "compaction_end",
        "turn_start",
        "message_start",
        "message_end",
        "turn_end",
    ]
    assert types[-2:] == ["agent_end", "agent_settled"]
    assert model.request_count == 6
    history, prefix = model.requests[3].body, model.requests[4].body
    history_text = history["messages"][1]["content"][0]["text"]
    assert history_text.startswith(
        '<conversation>\n[User]: one\n\n[Assistant tool calls]: write(path="notes.txt", '
        'content="x")\n\n[Tool result]: '
    )
    assert f"[Assistant]: {REPLY1}\n</conversation>" in history_text
    prefix_text = prefix["messages"][1]["content"][0]["text"]
    assert prefix_text == (
        "# Conversation\n[User]: two\n\n# Instructions\n" + TURN_PREFIX_SUMMARIZATION_PROMPT
    )
    end = next(e for e in events if e["type"] == "compaction_end")
    assert end["result"]["summary"] == (
        "HISTORY\n\n---\n\n**Turn Context (split turn):**\n\nPREFIX"
        "\n\n<modified-files>\nnotes.txt\n</modified-files>"
    )
    assert end["result"]["details"] == {"readFiles": [], "modifiedFiles": ["notes.txt"]}
    usage = end["result"]["usage"]
    assert usage["output"] == 2  # one word from each summary
    # the next turn starts from the tool call the cut kept
    sent = model.requests[5].body["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool"]
    assert sent[2]["tool_calls"][0]["function"]["name"] == "read"


async def test_abort_during_compaction(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Abort while the summary streams: compaction_end{aborted:true}, no entry."""
    model = _model(
        Text(text=REPLY1), Text(text=REPLY2), Text(text="slow summary", first_token_delay=30)
    )
    session = tmp_path / "s.jsonl"
    async with open_fake_pi(
        cwd=tmp_path,
        model=model,
        session=session,
        clock=MockWallClock(),
        compaction=SETTINGS,
        context_window=WINDOW,
    ) as fake:
        await _prompt(fake, "one")
        await fake.send({"id": "p", "type": "prompt", "message": "two"})
        events = await fake.receive_until("compaction_start")
        await fake.send({"id": "s", "type": "get_state"})
        state = await fake.receive()
        await fake.send({"id": "a", "type": "abort"})
        events += await fake.receive_until("response")
    assert state["data"]["isCompacting"] is True
    assert _types(events)[-4:] == [
        "compaction_start",
        "compaction_end",
        "agent_settled",
        "response",
    ]
    assert events[-3] == {
        "type": "compaction_end",
        "reason": "threshold",
        "aborted": True,
        "willRetry": False,
    }
    assert events[-2] == {"type": "agent_settled", "aborted": True}
    assert events[-1]["command"] == "abort"
    assert "compaction" not in [e.type for e in read_session(session).session.entries]


async def test_failed_summarization_reports_the_error(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A summarization request that fails ends compaction with Pi's errorMessage and
    leaves the history as it was."""
    model = _model(Text(text=REPLY1), Text(text=REPLY2), UsageLimit(), Text(text="ok"))
    async with open_fake_pi(
        cwd=tmp_path,
        model=model,
        clock=MockWallClock(),
        compaction=SETTINGS,
        context_window=WINDOW,
    ) as fake:
        await _prompt(fake, "one")
        events = await _prompt(fake, "two")
        await _prompt(fake, "three")
    end = events[-2]
    assert list(end) == ["type", "reason", "aborted", "willRetry", "errorMessage"]
    assert end["aborted"] is False
    assert end["errorMessage"].startswith("Auto-compaction failed: Summarization failed: 429: ")
    assert "insufficient_quota" in end["errorMessage"]
    sent = [m["role"] for m in model.requests[3].body["messages"]]
    assert sent == ["system", "user", "assistant", "user", "assistant", "user"]


def test_settings_json_keys_and_model_overrides() -> None:
    """Pi's keys and defaults; ``modelOverrides["provider/id"]`` wins for token settings."""
    assert CompactionSettings.from_settings({}) == CompactionSettings(
        enabled=True, reserve_tokens=16384, keep_recent_tokens=20000
    )
    settings = {
        "compaction": {
            "reserveTokens": 1000,
            "keepRecentTokens": 2000,
            "modelOverrides": {"fake/small": {"reserveTokens": 10}},
        }
    }
    assert CompactionSettings.from_settings(settings, "fake/small") == CompactionSettings(
        reserve_tokens=10, keep_recent_tokens=2000
    )
    assert CompactionSettings.from_settings(settings, "fake/other") == CompactionSettings(
        reserve_tokens=1000, keep_recent_tokens=2000
    )


def test_process_setup_reads_settings_and_context_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The subprocess reads ``compaction`` from settings.json and ``contextWindow``
    from models.json, as Pi does."""
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    (agent_dir / "settings.json").write_bytes(
        msgspec.json.encode({"compaction": {"enabled": False, "reserveTokens": 100}})
    )
    (agent_dir / "models.json").write_bytes(
        msgspec.json.encode(
            {"providers": {"fake": {"models": [{"id": "small", "contextWindow": 4096}]}}}
        )
    )
    monkeypatch.setenv("PI_CODING_AGENT_DIR", os.fspath(agent_dir))
    monkeypatch.chdir(tmp_path)
    args = parse_args(["--mode", "rpc", "--provider", "fake", "--model", "small", "--no-session"])
    options = _setup(args, clock=_FixedClock()).options
    assert options.compaction == CompactionSettings(
        enabled=False, reserve_tokens=100, keep_recent_tokens=20000
    )
    assert options.model.context_window == 4096
