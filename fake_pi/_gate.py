"""The tool-gate interface: every tool call asks before it starts, reports after.

Fake-Pi calls :meth:`ToolGate.before` before a tool starts. The gate answers
:class:`Run` (execute it), :class:`SavedResult` (return this result verbatim,
do not execute — a replayed call), or :class:`Refused` (return this result as
an error, do not execute). After a tool that ran, Fake-Pi calls
:meth:`ToolGate.after` with the result it hands to the model. Without a runtime,
:class:`AllowAllGate` runs everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "TOOL_ABORTED_TEXT",
    "AllowAllGate",
    "GateDecision",
    "Refused",
    "Run",
    "SavedResult",
    "ToolCall",
    "ToolGate",
    "ToolResult",
]

TOOL_ABORTED_TEXT = "Operation aborted"
"""The result Fake-Pi's loop records for a call aborted before its tool started (Pi's text):
``run_tool_call``'s, and the one its gate client reports for a call aborted while the gate
decided it (docs/design/gate.md T23)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    """The provider's tool-call id (unique within a round only)."""
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a tool hands back, in Pi's ``toolResult`` message shape."""

    content: list[dict[str, Any]]
    """Content parts, e.g. ``[{"type": "text", "text": "…"}]``."""
    is_error: bool = False
    details: dict[str, Any] | None = None
    structured: Any = None
    """Pi's ``structuredContent``: bash's ``{output, truncated, exit_code,
    wall_time_seconds}``, read's returned text; ``None`` when the tool has none."""

    @classmethod
    def text(cls, text: str, *, is_error: bool = False) -> ToolResult:
        return cls(content=[{"type": "text", "text": text}], is_error=is_error)

    @property
    def text_content(self) -> str:
        return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")


@dataclass(frozen=True, slots=True)
class Run:
    """Execute the tool."""


@dataclass(frozen=True, slots=True)
class SavedResult:
    """Do not execute; hand this result to the model verbatim."""

    result: ToolResult


@dataclass(frozen=True, slots=True)
class Refused:
    """Do not execute; hand this result to the model as an error."""

    result: ToolResult


GateDecision = Run | SavedResult | Refused


class ToolGate(Protocol):
    async def before(self, call: ToolCall) -> GateDecision: ...

    async def after(self, call: ToolCall, result: ToolResult) -> None: ...


@dataclass
class AllowAllGate:
    """Runs every call; remembers what it saw (for tests)."""

    seen: list[ToolCall] = field(default_factory=list)

    async def before(self, call: ToolCall) -> GateDecision:
        self.seen.append(call)
        return Run()

    async def after(self, call: ToolCall, result: ToolResult) -> None:
        return None
