"""The values the tool gate and the runtime tools share: a call, its result, the gate's
decision, and a runtime tool's handler. A leaf of ``_boundary``: the gate (which decides and
records) and the tools (which run) both import it and not each other."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .._records import AttachmentRef, ToolOutcome

__all__ = ["Decision", "GateCall", "GateResult", "Refuse", "RunTool", "RuntimeTool", "Saved"]


@dataclass(frozen=True, slots=True)
class GateCall:
    """One tool call as the worker asks about it."""

    tool_call_id: str
    """The provider's id: unique within a round only."""
    name: str
    args: dict[str, Any]


@dataclass(frozen=True, slots=True)
class GateResult:
    """A tool result in Pi's shape: what is (or will be) handed to the model."""

    content: list[dict[str, Any]]
    is_error: bool = False
    details: Any = None
    """Pi's ``details`` (JSON): recorded with the outcome and handed back on a replay."""
    attachments: tuple[AttachmentRef, ...] = ()
    """Files this call added to the reply (``attach``); recorded with the outcome, never
    sent to the worker."""

    @classmethod
    def text(cls, text: str, *, is_error: bool = False) -> GateResult:
        return cls(content=[{"type": "text", "text": text}], is_error=is_error)

    @classmethod
    def recorded(cls, outcome: ToolOutcome) -> GateResult:
        """The result a recorded outcome stands for, verbatim (T3, A6)."""
        return cls(
            content=outcome.content,
            is_error=outcome.is_error,
            details=outcome.details,
            attachments=tuple(outcome.attachments),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"content": self.content, "isError": self.is_error}
        if self.details is not None:
            out["details"] = self.details
        return out

    @classmethod
    def from_json(cls, value: object) -> GateResult:
        if not isinstance(value, dict):
            raise ValueError("result must be an object")
        content = value.get("content")
        if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
            raise ValueError("result.content must be a list of objects")
        is_error = value.get("isError", False)
        if not isinstance(is_error, bool):
            raise ValueError("result.isError must be a boolean")
        return cls(content=content, is_error=is_error, details=value.get("details"))


@dataclass(frozen=True, slots=True)
class RunTool:
    """Run the tool; its intent is durable (``intent_id``)."""

    intent_id: str


@dataclass(frozen=True, slots=True)
class Saved:
    """Do not run; hand this result to the model verbatim (a replayed call)."""

    result: GateResult


@dataclass(frozen=True, slots=True)
class Refuse:
    """Do not run; hand this result to the model as an error."""

    result: GateResult


Decision = RunTool | Saved | Refuse


RuntimeTool = Callable[["GateCall", str], Awaitable["GateResult"]]
"""Executes one call of a runtime tool: ``(call, intent_id) -> result``. The intent is durable
before it is called; the result is recorded before the worker sees it. An exception is
recorded as an error result with its text (and the call is settled)."""
