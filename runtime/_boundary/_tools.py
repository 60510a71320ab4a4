"""The runtime's own tools: declared to the worker, executed in the runtime behind the gate.

Pi's tools (``read``, ``bash``, ``edit``, ``write``) run inside the worker once the gate says
*run*. The tools below are different: the worker only carries the call. The gate records the
intent, runs the tool's :data:`RuntimeTool` handler here, records the outcome and answers the
worker with the result (``saved``), which the worker hands to the model verbatim. So a runtime
tool's effect never depends on the worker staying alive, and its outcome is durable before the
model sees it.

One declaration serves both workers: the runtime hands :func:`tools_environment`'s JSON to the
worker in :data:`TOOLS_ENV`; the real Pi's extension (``runtime/_boundary/pi_extension/gate.ts``)
and Fake-Pi register exactly these names, descriptions and JSON Schemas (Pi validates arguments
against any JSON Schema), so both workers show the model the same tools.

``effect`` is the test tool: one fsynced JSON line per execution in a ledger, so a test can
count how often an effect happened across crashes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
import trio

from .._errors import GateError, PiRuntimeError, ReasonCode, ReceiptRefusal
from .._records import ReplayClass
from ._calls import GateCall, GateResult, RuntimeTool
from ._receipts import ReceiptStore

__all__ = [
    "RUNTIME_TOOLS",
    "TOOLS_ENV",
    "DocumentTools",
    "EffectLedger",
    "ToolSpec",
    "tools_environment",
]

TOOLS_ENV: Final = "PI_RUNTIME_TOOLS"
"""The worker's environment variable carrying the runtime tools to declare (a JSON list)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    """One tool as the model sees it, and its replay class (docs/design/gate.md)."""

    name: str
    description: str
    parameters: dict[str, Any]
    """A JSON Schema object."""
    replay_class: ReplayClass = ReplayClass.NEVER

    def declaration(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


def _object(*required: str, **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required)}


def _string(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


RUNTIME_TOOLS: Final[Mapping[str, ToolSpec]] = {
    spec.name: spec
    for spec in (
        ToolSpec(
            name="send_text_update",
            description="Send a short progress update to the conversation. "
            "It does not end the turn.",
            parameters=_object("text", text=_string("The update (at most 600 characters)",
                                                    maxLength=600)),
        ),
        ToolSpec(
            name="attach",
            description="Attach a file from your working directory (a picture, a chart, a "
            "document you made) to your reply. It is sent with your answer's text.",
            parameters=_object(
                "path",
                path=_string("The file's path, relative to your working directory"),
                name=_string("The name to show (default: the file's name)"),
            ),
            replay_class=ReplayClass.RECEIPT,
        ),
        ToolSpec(
            name="task_done",
            description="Report that the task is complete. Call it once, when the work is "
            "finished.",
            parameters=_object("summary", summary=_string("What was done")),
        ),
        ToolSpec(
            name="task_fail",
            description="Report that the task cannot be completed.",
            parameters=_object("reason", reason=_string("Why the task cannot be completed")),
        ),
        ToolSpec(
            name="task_wait",
            description="Ask the user a question and wait for the answer before going on.",
            parameters=_object("question", question=_string("The question to ask")),
        ),
        ToolSpec(
            name="write_document",
            description="Write a new revision of a document. Name the revision you read "
            "(base_revision_id; omit it for a new document): if the document changed since, "
            "the write is refused and you should read it again.",
            parameters=_object(
                "document_id", "content",
                document_id=_string("Which document"),
                content=_string("The document's full new content"),
                base_revision_id=_string("The revision this content was made from"),
            ),
            replay_class=ReplayClass.RECEIPT,
        ),
        ToolSpec(
            name="read_document",
            description="Read the current revision of a document.",
            parameters=_object("document_id", document_id=_string("Which document")),
            replay_class=ReplayClass.SAFE,
        ),
        ToolSpec(
            name="effect",
            description="Apply the side effect named by key, once per call (a test tool: it "
            "appends one line to the effect ledger).",
            parameters=_object("key", key=_string("Name of the side effect to apply")),
        ),
    )
}  # fmt: skip
"""Every runtime tool by name: the runtime owns their declarations and their execution."""


def tools_environment(names: Iterable[str]) -> dict[str, str]:
    """The worker's ``extra_env`` declaring the named runtime tools (unknown names: KeyError).
    Empty when no name is given, so a worker without runtime tools sees no variable."""
    chosen = [RUNTIME_TOOLS[name].declaration() for name in names]
    if not chosen:
        return {}
    return {TOOLS_ENV: json.dumps(chosen, separators=(",", ":"), ensure_ascii=False)}


@dataclass(frozen=True, slots=True)
class DocumentTools:
    """``write_document`` and ``read_document`` on the receipt store
    (``runtime/_boundary/_receipts.py``):
    a definite refusal is the tool's error result, with its code (R5); any other failure of
    the store raises ``receipt_store_failed``, so the call stays unsettled and the gate stops
    (the next epoch runs the same guarded write). A transient error (SQLite busy or locked)
    has already been retried by the store, within its bound, before it gets here (R8): the
    store owns the retry because only it knows SQLite's error codes, reruns the whole
    transaction as one attempt, and pauses outside its one-at-a-time limiter."""

    store: ReceiptStore

    async def write(self, call: GateCall, intent_id: str) -> GateResult:
        return await self._answer(self.store.write_document(intent_id, call.args))

    async def read(self, call: GateCall, intent_id: str) -> GateResult:
        return await self._answer(self.store.read_document(call.args))

    @staticmethod
    async def _answer(work: Awaitable[dict[str, Any]]) -> GateResult:
        try:
            result = await work
        except ReceiptRefusal as refusal:
            return GateResult.text(f"{refusal.code}: {refusal.message}", is_error=True)
        except PiRuntimeError:
            raise
        except Exception as error:  # the store failed (R8: retries spent): not settled (R5)
            detail = "; ".join([str(error), *getattr(error, "__notes__", ())])
            raise GateError(ReasonCode.RECEIPT_STORE_FAILED, f"receipt store: {detail}") from error
        return GateResult.text(json.dumps(result, ensure_ascii=False, sort_keys=True))

    def handlers(self) -> dict[str, RuntimeTool]:
        return {"write_document": self.write, "read_document": self.read}


@dataclass(frozen=True, slots=True)
class EffectLedger:
    """The ``effect`` tool's :data:`RuntimeTool`: one fsynced JSON line per execution at
    ``path`` (``{"key", "intent_id", "tool_call_id"}``), written off the Trio loop. When it
    returns, the effect is durable; a test counts lines to see how often it happened."""

    path: Path

    async def __call__(self, call: GateCall, intent_id: str) -> GateResult:
        key = call.args.get("key")
        if not isinstance(key, str):
            return GateResult.text("effect needs a string key", is_error=True)
        line = msgspec.json.encode(
            {"key": key, "intent_id": intent_id, "tool_call_id": call.tool_call_id}
        )
        await trio.to_thread.run_sync(self._append, line + b"\n")
        return GateResult.text(f"effect {key} applied")

    def _append(self, line: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def entries(self) -> list[dict[str, Any]]:
        """Every execution recorded so far (blocking; for tests and tools)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        return [msgspec.json.decode(line) for line in data.splitlines() if line]
