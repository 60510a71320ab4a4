"""How a finished room turn ends (runtime._rooms._outcome): every rule, on Pi's own message shapes.

Message shapes are those of Pi 1.6.0's sessions and ``agent_end.messages``
(``docs/design/fake-pi.md`` F2, F4-F6; the real Pi's ``tests/data/pi-1.6.0/session_*.jsonl``);
the end-to-end cases run the in-process Fake-Pi on scripted model steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio.testing

from fake_pi._app import open_fake_pi
from fake_pi._retry import RetrySettings, is_retryable
from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import (
    Call,
    Empty,
    HttpError,
    Scenario,
    StaySilent,
    Step,
    Text,
    Thinking,
    ToolCalls,
    UsageLimit,
)
from runtime._errors import ReasonCode
from runtime._pi._pijson import loads
from runtime._records import Outcome, Result
from runtime._rooms._outcome import (
    STAY_SILENT,
    TurnEnd,
    classify_turn,
    could_still_be_silent,
    is_usage_limit,
)

REPLY = Outcome.REPLY
SILENT = Outcome.SILENT
FAILED = Outcome.FAILED
CANCELLED = Outcome.CANCELLED
MISSING = ReasonCode.RESPONSE_MISSING
MODEL_FAILED = ReasonCode.MODEL_FAILED
USAGE = ReasonCode.USAGE_LIMIT_REACHED


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}], "timestamp": 1}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def thinking(value: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": value, "thinkingSignature": "reasoning_content"}


def tool_call(call_id: str = "call_fake_11") -> dict[str, Any]:
    return {
        "type": "toolCall",
        "id": call_id,
        "name": "bash",
        "arguments": {"command": "echo hi >> out.txt; cat out.txt"},
    }


def tool_result(call_id: str = "call_fake_11") -> dict[str, Any]:
    return {
        "role": "toolResult",
        "toolCallId": call_id,
        "toolName": "bash",
        "content": [{"type": "text", "text": "hi\n"}],
        "isError": False,
    }


def assistant(*content: dict[str, Any], stop: str = "stop", error: str | None = None) -> Any:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": list(content),
        "api": "openai-completions",
        "provider": "fake",
        "model": "fake-model",
        "stopReason": stop,
    }
    if error is not None:
        message["errorMessage"] = error
    return message


# --- errorMessage texts, from what Pi 1.6.0 and Fake-Pi record -----------------------------

# Fake-Pi's UsageLimit step (fake_pi/scenario.py) answers 429 with OpenAI's error object;
# Pi's openai-completions provider records formatProviderError's "<status>: <body JSON>"
# (pi-ai/dist/utils/error-body.js), and so does Fake-Pi (fake_pi/_model.py).
FAKE_PI_QUOTA = (
    '429: {"message":"You exceeded your current quota, please check your plan and billing '
    'details.","type":"insufficient_quota","code":"insufficient_quota"}'
)
# The same 429 from OpenAI itself, whose error object also carries "param".
OPENAI_QUOTA = (
    '429: {"message":"You exceeded your current quota, please check your plan and billing '
    "details. For more information on this error, read the docs: "
    'https://platform.openai.com/docs/guides/error-codes/api-errors.",'
    '"type":"insufficient_quota","param":null,"code":"insufficient_quota"}'
)
# pi-ai/dist/api/openai-codex-responses.js parseErrorResponse's friendly message.
CODEX_USAGE = "You have hit your ChatGPT usage limit (plus plan). Try again in ~42 min."
# pi-ai/dist/api/openai-responses.js: the message plus CHATGPT_WORKSPACE_LIMIT_HINT.
WORKSPACE_USAGE = (
    "OpenAI API error (429): subscription_sharing_workplace_individual_usage_limit_exceeded\n"
    "You've reached your ChatGPT workspace's usage limit. Ask your workspace admin to "
    "increase it at admin.openai.com → Workspace → Usage limits."
)
# Anthropic's credit exhaustion, matched by Pi's "billing" pattern.
ANTHROPIC_CREDIT = (
    '400: {"type":"error","error":{"type":"invalid_request_error","message":"Your credit '
    "balance is too low to access the Anthropic API. Please go to Plans & Billing to upgrade "
    'or purchase credits."}}'
)
# Zhipu/Z.ai plan limit, code 1308 (retry.js, Pi issue #11537).
ZAI_PLAN = '429: {"code":1308,"message":"Usage limit reached for 5 hour."}'
# OpenCode Go subscription limit (retry.js).
OPENCODE_GO = '429: {"type":"GoUsageLimitError","message":"Monthly usage limit reached."}'

# Not usage limits:
# tests/data/pi-1.6.0/session_retry.jsonl (the real Pi, after a 500 from the scripted model)
REAL_PI_500 = '500: {"message":"fake transient failure","type":"server_error","code":null}'
# fake_pi/_model.py CUT_MESSAGE: what Pi (Node's fetch) reports for a dropped stream
CUT = "terminated: other side closed (UND_ERR_SOCKET)"
# OpenAI's transient throttle: Pi retries it (rate.?limit, 429) and it may outlive the retries
RATE_LIMIT = (
    '429: {"message":"Rate limit reached for gpt-4o in organization org-x on tokens per min '
    '(TPM): Limit 30000, Used 29500, Requested 900. Please try again in 2s.",'
    '"type":"tokens","param":null,"code":"rate_limit_exceeded"}'
)
# fake_pi/_agent.py: an auto-compaction that failed ends the run with this error
COMPACTION = "Auto-compaction failed: 500: internal server error"
CONTEXT_OVERFLOW = (
    '400: {"message":"This model\'s maximum context length is 128000 tokens.",'
    '"code":"context_length_exceeded"}'
)

USAGE_LIMIT_TEXTS = [
    FAKE_PI_QUOTA,
    OPENAI_QUOTA,
    CODEX_USAGE,
    WORKSPACE_USAGE,
    ANTHROPIC_CREDIT,
    ZAI_PLAN,
    OPENCODE_GO,
]
OTHER_ERROR_TEXTS = [REAL_PI_500, CUT, RATE_LIMIT, COMPACTION, CONTEXT_OVERFLOW, ""]


# --- classify_turn ---------------------------------------------------------------------------

CASES: list[tuple[str, list[Any], TurnEnd]] = [
    (
        "plain reply (session_basic.jsonl)",
        [user("hi"), assistant(text("DONE: tool output was 'hi'."))],
        TurnEnd(REPLY, "DONE: tool output was 'hi'."),
    ),
    (
        "surrounding whitespace stripped",
        [user("hi"), assistant(text("\n  hello there \n"))],
        TurnEnd(REPLY, "hello there"),
    ),
    (
        "text blocks joined as Pi joins them (no separator)",
        [user("hi"), assistant(text("one, "), text("two"), text(" and three"))],
        TurnEnd(REPLY, "one, two and three"),
    ),
    (
        "thinking blocks are not visible",
        [user("hi"), assistant(thinking("let me think"), text("thought it through"))],
        TurnEnd(REPLY, "thought it through"),
    ),
    (
        "thinking between text blocks",
        [user("hi"), assistant(text("a"), thinking("hmm"), text("b"))],
        TurnEnd(REPLY, "ab"),
    ),
    (
        "length with text is a (truncated) reply",
        [user("hi"), assistant(text("a long answer that was cut"), stop="length")],
        TurnEnd(REPLY, "a long answer that was cut"),
    ),
    (
        "tools then a final reply: the last assistant decides",
        [
            user("hi"),
            assistant(tool_call(), stop="toolUse"),
            tool_result(),
            assistant(text("DONE")),
        ],
        TurnEnd(REPLY, "DONE"),
    ),
    (
        "text beside a tool call in the final message",
        [
            user("hi"),
            assistant(text("checking"), tool_call()),
            tool_result(),
            assistant(text("ok")),
        ],
        TurnEnd(REPLY, "ok"),
    ),
    (
        "a failed request retried successfully (session_retry.jsonl)",
        [user("hi"), assistant(stop="error", error=REAL_PI_500), assistant(text("Hello"))],
        TurnEnd(REPLY, "Hello"),
    ),
    (
        "exactly the marker is silent",
        [user("hi"), assistant(text(STAY_SILENT))],
        TurnEnd(SILENT),
    ),
    (
        "the marker with surrounding whitespace is silent",
        [user("hi"), assistant(text("\n " + STAY_SILENT + " \n"))],
        TurnEnd(SILENT),
    ),
    (
        "the marker split over blocks, after thinking, is silent",
        [user("hi"), assistant(thinking("quiet"), text("[[stay-"), text("silent]]"))],
        TurnEnd(SILENT),
    ),
    (
        "the marker with length is silent",
        [user("hi"), assistant(text(STAY_SILENT), stop="length")],
        TurnEnd(SILENT),
    ),
    (
        "words around the marker are a reply, marker included",
        [user("hi"), assistant(text("Sure. [[stay-silent]]"))],
        TurnEnd(REPLY, "Sure. [[stay-silent]]"),
    ),
    (
        "a marker followed by words is a reply",
        [user("hi"), assistant(text("[[stay-silent]] actually, hi"))],
        TurnEnd(REPLY, "[[stay-silent]] actually, hi"),
    ),
    (
        "a misspelt marker is a reply",
        [user("hi"), assistant(text("[[stay silent]]"))],
        TurnEnd(REPLY, "[[stay silent]]"),
    ),
    (
        "no content at all (Fake-Pi's Empty step)",
        [user("hi"), assistant()],
        TurnEnd(FAILED, code=MISSING),
    ),
    (
        "whitespace only",
        [user("hi"), assistant(text("  \n\t"))],
        TurnEnd(FAILED, code=MISSING),
    ),
    (
        "thinking only",
        [user("hi"), assistant(thinking("nothing to say"))],
        TurnEnd(FAILED, code=MISSING),
    ),
    (
        "length with no text",
        [user("hi"), assistant(thinking("ran out"), stop="length")],
        TurnEnd(FAILED, code=MISSING),
    ),
    (
        "tool-call-only final message (session_basic.jsonl first reply)",
        [user("hi"), assistant(tool_call(), stop="toolUse")],
        TurnEnd(FAILED, code=MISSING),
    ),
    (
        "tool-call final message with preamble text, then its result",
        [user("hi"), assistant(text("let me check"), tool_call(), stop="toolUse"), tool_result()],
        TurnEnd(FAILED, code=MISSING),
    ),
    (
        "a stop reason Pi does not document",
        [user("hi"), assistant(text("hm"), stop="pending")],
        TurnEnd(FAILED, code=MISSING),
    ),
    (
        "no stop reason",
        [user("hi"), {"role": "assistant", "content": [text("hm")]}],
        TurnEnd(FAILED, code=MISSING),
    ),
    ("no assistant message", [user("hi")], TurnEnd(FAILED, code=MISSING)),
    ("no messages at all", [], TurnEnd(FAILED, code=MISSING)),
    (
        "only tool results",
        [user("hi"), tool_result()],
        TurnEnd(FAILED, code=MISSING),
    ),
    (
        "aborted between requests (session_abort.jsonl)",
        [
            user("hi"),
            assistant(tool_call("call_fake_20"), stop="toolUse"),
            tool_result("call_fake_20"),
            assistant(stop="aborted", error="This operation was aborted"),
        ],
        TurnEnd(CANCELLED),
    ),
    (
        "aborted while streaming keeps partial text, which is no reply (session_abort.jsonl)",
        [user("hi"), assistant(text("chunk0 "), stop="aborted", error="Request was aborted")],
        TurnEnd(CANCELLED),
    ),
    (
        "aborted during a retry back-off: Pi drops errorMessage (retry.js)",
        [user("hi"), assistant(stop="aborted")],
        TurnEnd(CANCELLED),
    ),
    (
        "error without errorMessage",
        [user("hi"), assistant(stop="error")],
        TurnEnd(FAILED, code=MODEL_FAILED),
    ),
    (
        "error with partial text is not a reply",
        [user("hi"), assistant(text("half an"), stop="error", error=CUT)],
        TurnEnd(FAILED, code=MODEL_FAILED),
    ),
    (
        "a reply followed by a failed one: the last decides",
        [user("hi"), assistant(text("first")), user("more"), assistant(stop="error", error=CUT)],
        TurnEnd(FAILED, code=MODEL_FAILED),
    ),
]


@pytest.mark.parametrize(
    ("messages", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_classify_turn(messages: list[Any], expected: TurnEnd) -> None:
    assert classify_turn(messages) == expected


@pytest.mark.parametrize("error", USAGE_LIMIT_TEXTS)
def test_usage_limit_errors(error: str) -> None:
    """Pi's account-limit notion (retry.js, openai-codex-responses.js) → usage_limit_reached."""
    assert is_usage_limit(error)
    end = classify_turn([user("hi"), assistant(stop="error", error=error)])
    assert end == TurnEnd(FAILED, code=USAGE)


@pytest.mark.parametrize("error", OTHER_ERROR_TEXTS)
def test_other_model_errors(error: str) -> None:
    """Transient failures, rate limits that outlived Pi's retries, overflow → model_failed."""
    assert not is_usage_limit(error)
    end = classify_turn([user("hi"), assistant(stop="error", error=error)])
    assert end == TurnEnd(FAILED, code=MODEL_FAILED)


@pytest.mark.parametrize("error", [e for e in USAGE_LIMIT_TEXTS if e != CODEX_USAGE])
def test_usage_limits_are_what_pi_does_not_retry(error: str) -> None:
    """Our notion agrees with Pi's: every account limit Pi knows is one it will not retry
    (Fake-Pi's mirror of retry.js). The Codex message is excluded only because the Codex
    provider, not the agent's retry rule, is what stops retrying it."""
    assert not is_retryable(error)


def test_transient_errors_are_what_pi_retries() -> None:
    """The other errors are ones Pi retries, so a final one means the retries ran out."""
    assert all(is_retryable(e) for e in (REAL_PI_500, CUT, RATE_LIMIT))


@pytest.mark.parametrize("error", USAGE_LIMIT_TEXTS + OTHER_ERROR_TEXTS)
def test_provider_text_never_leaks(error: str) -> None:
    """Results and logs carry only the code: no part of errorMessage is in the TurnEnd."""
    end = classify_turn([user("hi"), assistant(text("partial"), stop="error", error=error)])
    assert end.text is None
    assert end.code in (USAGE, MODEL_FAILED)
    assert error == "" or error not in repr(end)
    assert "partial" not in repr(end)


def test_turn_end_is_frozen() -> None:
    end = TurnEnd(REPLY, "hi")
    with pytest.raises(AttributeError):
        end.text = "other"  # type: ignore[misc]


# --- could_still_be_silent -------------------------------------------------------------------

MARKER_PREFIXES = [STAY_SILENT[:n] for n in range(len(STAY_SILENT) + 1)]


@pytest.mark.parametrize("partial", MARKER_PREFIXES)
def test_every_prefix_of_the_marker_could_still_be_silent(partial: str) -> None:
    assert could_still_be_silent(partial)
    assert could_still_be_silent("\n  " + partial)


@pytest.mark.parametrize(
    ("partial", "expected"),
    [
        ("", True),
        ("   \n", True),
        (STAY_SILENT + "\n", True),
        (STAY_SILENT + "  \n ", True),
        ("Sure", False),
        ("[", True),
        ("[x", False),
        ("[[stay-up", False),
        ("[[stay ", False),
        (" [[stay silent", False),
        (STAY_SILENT + " ok", False),
        (STAY_SILENT + "!", False),
        ("[[STAY-SILENT]]", False),
    ],
)
def test_could_still_be_silent(partial: str, expected: bool) -> None:
    assert could_still_be_silent(partial) is expected


@pytest.mark.parametrize(
    "final",
    [
        STAY_SILENT,
        "  " + STAY_SILENT + "\n",
        "Sure. [[stay-silent]]",
        "[[stay-silent]] hi",
        "[[stay-",
        "hello",
        "",
    ],
)
def test_typing_never_lights_a_silent_turn(final: str) -> None:
    """Streamed token by token, the lane starts typing at the first prefix that can no longer be
    silent: never for a turn that ends silent (docs/design/lanes.md), and for every reply except
    one that is itself a prefix of the marker (a reply of ``[[stay-`` gets no typing)."""
    typed = any(not could_still_be_silent(final[:n]) for n in range(len(final) + 1))
    end = classify_turn([assistant(text(final))])
    if end.outcome is SILENT:
        assert not typed
    elif end.outcome is REPLY and not STAY_SILENT.startswith(final.strip()):
        assert typed


# --- end to end: what Fake-Pi's scripted model makes Pi record --------------------------------


async def _turn_messages(tmp_path: Path, *steps: Step, retries: bool = True) -> list[Any]:
    """The messages of the last ``agent_end`` of one prompt to an in-process Fake-Pi."""
    model = ScriptedModel(scenario=Scenario(steps=list(steps)))
    retry = RetrySettings(base_delay_ms=10) if retries else RetrySettings(enabled=False)
    async with open_fake_pi(cwd=tmp_path, model=model, retry=retry) as fake:
        await fake.send({"id": "p", "type": "prompt", "message": "hi"})
        events = await fake.receive_until("agent_settled")
    ends = [e for e in events if e["type"] == "agent_end"]
    assert ends[-1]["willRetry"] is False
    messages: list[Any] = ends[-1]["messages"]
    return messages


E2E: list[tuple[str, list[Step], TurnEnd]] = [
    ("text", [Text(text="hello there")], TurnEnd(REPLY, "hello there")),
    (
        "thinking then text",
        [Thinking(thinking="let me think", text="thought it through")],
        TurnEnd(REPLY, "thought it through"),
    ),
    ("stay silent", [StaySilent()], TurnEnd(SILENT)),
    ("empty", [Empty()], TurnEnd(FAILED, code=MISSING)),
    ("usage limit", [UsageLimit()], TurnEnd(FAILED, code=USAGE)),
    (
        "500 retried then answered",
        [HttpError(), Text(text="recovered")],
        TurnEnd(REPLY, "recovered"),
    ),
    (
        "500 until the retries run out",
        [HttpError(), HttpError(), HttpError(), HttpError()],
        TurnEnd(FAILED, code=MODEL_FAILED),
    ),
    (
        "429 rate limit until the retries run out",
        [HttpError(status=429, message="Rate limit reached for requests")] * 4,
        TurnEnd(FAILED, code=MODEL_FAILED),
    ),
    (
        "a tool call, then the answer",
        [ToolCalls(calls=[Call(name="bash", arguments={"command": "echo hi"})]), Text(text="hi")],
        TurnEnd(REPLY, "hi"),
    ),
]


@pytest.mark.parametrize(("steps", "expected"), [c[1:] for c in E2E], ids=[c[0] for c in E2E])
async def test_fake_pi_turns(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    steps: list[Step],
    expected: TurnEnd,
) -> None:
    messages = await _turn_messages(tmp_path, *steps)
    assert classify_turn(messages) == expected


async def test_fake_pi_usage_limit_error_message(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The errorMessage Fake-Pi records for its UsageLimit step is the one quoted above."""
    messages = await _turn_messages(tmp_path, UsageLimit(), retries=False)
    assert messages[-1]["errorMessage"] == FAKE_PI_QUOTA


def test_l7_a_lone_surrogate_in_the_reply_is_shown_as_a_replacement_character() -> None:
    """L7: Pi writes a string holding half a surrogate pair (a model that streamed one half
    of an emoji and never the other) as a lone ``\\udxxx`` escape, which the runtime reads as
    it is written; no UTF-8 record or frame can hold it (msgspec refuses to encode it), so
    the delivery's ``Result`` could not be written. The reply keeps its words, each lone
    surrogate shown as U+FFFD, as a renderer shows it; a whole pair stays the character."""
    line = (  # as Pi's JSON.stringify writes it, read as the RPC channel reads it
        b'{"role": "assistant", "stopReason": "stop", "content": [{"type": "text", '
        b'"text": "half \\ud83d, whole \\ud83d\\ude00, half \\ude00"}]}'
    )
    end = classify_turn([loads(line)])
    assert end == TurnEnd(outcome=Outcome.REPLY, text="half \ufffd, whole \U0001f600, half \ufffd")
    assert end.text is not None
    msgspec.json.encode(Result(outcome=end.outcome, text=end.text, finished_ms=1))
