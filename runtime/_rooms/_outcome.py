"""How a finished room turn ends (docs/design/lanes.md "Outcomes"): a pure classifier, no I/O.

A room lane hands :func:`classify_turn` the agent messages of one turn, in order, as Pi
reports them (``agent_end.messages`` or ``get_messages``: ``user``, ``assistant`` and
``toolResult`` messages; ``docs/design/pi-observed.md`` §4, §5, §7). The **last assistant message
decides**:

* ``stopReason`` ``stop`` or ``length`` with visible text → ``reply`` with that text (the
  text blocks joined as Pi's ``getLastAssistantText`` joins them, then stripped);
* … whose whole text is ``[[stay-silent]]`` → ``silent``, no text;
* … with no visible text → ``failed`` / ``response_missing``;
* ``error`` with a usage-limit ``errorMessage`` → ``failed`` / ``usage_limit_reached``;
* ``error`` otherwise → ``failed`` / ``model_failed``;
* ``aborted`` → ``cancelled`` with no code: the lane knows whether it aborted the turn for a
  cancel or a stall, and replaces the code for a stall (``turn_stalled``);
* any other ``stopReason`` (``toolUse``: the turn ended on tool calls; missing) → ``failed`` /
  ``response_missing``;
* no assistant message at all → ``failed`` / ``response_missing``.

Thinking and tool-call blocks are never visible text. An aborted turn's partial text is not a
reply.

**Silence is the whole reply.** A turn is silent only when its entire text (after stripping
surrounding whitespace) is the marker; a reply that merely *contains* the marker is a reply.
This is what lets :func:`could_still_be_silent` start ``typing`` the moment the streamed text
stops being a prefix of the marker without ever lighting a turn that ends silent
(docs/design/lanes.md:
``typing`` "never for a silent turn").

**The provider's words stay in the session.** A failed :class:`TurnEnd` carries only its
reason code, never ``errorMessage``: results and logs must not hold provider response bodies
(docs/design/lanes.md). :func:`classify_turn` reads ``errorMessage`` only to choose the code.

**Usage limits are what Pi itself calls an account limit.** Pi 1.6.0 does not retry an error
whose message matches its ``NON_RETRYABLE_PROVIDER_LIMIT_ERROR_PATTERN``
(``@earendil-works/pi-ai/dist/utils/retry.js``; mirrored by ``fake_pi/_retry.py``):
subscription, quota, budget and billing exhaustion, "not transient throttles". Its Codex
provider adds "usage limit" (``pi-ai/dist/api/openai-codex-responses.js``: it never retries a
message containing ``usage limit``, and reports ``usage_limit_reached`` and every 429 as "You
have hit your ChatGPT usage limit…"). :data:`USAGE_LIMIT_PATTERN` is the union. A transient
rate limit (``429`` "Rate limit reached…", ``rate_limit_exceeded``) that outlived Pi's own
retries is ``model_failed``, not a usage limit: Pi retries it because it passes in seconds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from .._errors import ReasonCode
from .._pi._provider_errors import USAGE_LIMIT_PATTERN
from .._records import Outcome

__all__ = [
    "STAY_SILENT",
    "USAGE_LIMIT_PATTERN",
    "TurnEnd",
    "classify_turn",
    "could_still_be_silent",
    "is_usage_limit",
]

STAY_SILENT: Final = "[[stay-silent]]"
"""The whole reply of a turn that chooses to say nothing (the persona tells the model when)."""


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """How one room turn ended: an outcome, the reply text, the failure code.

    ``text`` is set only for ``reply``; ``code`` only for ``failed`` (and for a ``cancelled``
    turn the lane re-labels, e.g. ``turn_stalled``). Never holds provider text.
    """

    outcome: Outcome
    text: str | None = None
    code: ReasonCode | None = None


_MISSING: Final = TurnEnd(outcome=Outcome.FAILED, code=ReasonCode.RESPONSE_MISSING)


def is_usage_limit(error_message: str) -> bool:
    """Whether Pi's ``errorMessage`` reports a usage (quota, billing, plan) limit."""
    return USAGE_LIMIT_PATTERN.search(error_message) is not None


_LONE_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def _visible_text(message: Mapping[str, Any]) -> str:
    """The text blocks of an assistant message, joined and stripped (thinking and tool calls
    are not visible), each lone surrogate — half a pair, which JavaScript strings may hold
    and no UTF-8 record can — shown as U+FFFD, as a renderer shows it."""
    content = message.get("content")
    if isinstance(content, str):
        parts = [content]
    elif isinstance(content, Sequence):
        parts = [
            block["text"]
            for block in content
            if isinstance(block, Mapping)
            and block.get("type") == "text"
            and isinstance(block.get("text"), str)
        ]
    else:
        return ""
    return _LONE_SURROGATE.sub("\ufffd", "".join(parts)).strip()


def classify_turn(messages: Sequence[Mapping[str, Any]]) -> TurnEnd:
    """How the turn whose agent messages are ``messages`` (in order) ended.

    Only the last assistant message is read; see the module doc for the table.
    """
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    if last is None:
        return _MISSING
    match last.get("stopReason"):
        case "stop" | "length":
            text = _visible_text(last)
            if not text:
                return _MISSING
            if text == STAY_SILENT:
                return TurnEnd(outcome=Outcome.SILENT)
            return TurnEnd(outcome=Outcome.REPLY, text=text)
        case "error":
            error = last.get("errorMessage")
            if isinstance(error, str) and is_usage_limit(error):
                return TurnEnd(outcome=Outcome.FAILED, code=ReasonCode.USAGE_LIMIT_REACHED)
            return TurnEnd(outcome=Outcome.FAILED, code=ReasonCode.MODEL_FAILED)
        case "aborted":
            return TurnEnd(outcome=Outcome.CANCELLED)
        case _:
            return _MISSING


def could_still_be_silent(partial_text: str) -> bool:
    """Whether the assistant's text so far may still end as exactly :data:`STAY_SILENT`.

    Leading whitespace is ignored, and so is trailing whitespace after a complete marker
    (:func:`classify_turn` strips both). The lane starts ``typing`` the first time this is
    ``False`` and, since a silent turn's text is a prefix of the marker all along, never for
    a silent turn.

    >>> [could_still_be_silent(t) for t in ("", "  [[stay", "[[stay-silent]]\\n", "[[stay-up")]
    [True, True, True, False]
    """
    text = partial_text.lstrip()
    if STAY_SILENT.startswith(text):
        return True
    return text.startswith(STAY_SILENT) and not text[len(STAY_SILENT) :].strip()
