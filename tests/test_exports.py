"""The public surface of ``runtime`` is pinned: a change here is an API change."""

from __future__ import annotations

import types
from pathlib import Path

import runtime
import runtime.testing

PUBLIC = {
    "Accepted",
    "Author",
    "Caps",
    "Clocks",
    "ConfigError",
    "Delivery",
    "DeliveryError",
    "DeliveryResult",
    "DiskFailedError",
    "HistoryItem",
    "Journal",
    "JournalError",
    "LogContents",
    "MockSilenceClock",
    "MockWallClock",
    "ModelConfig",
    "Outcome",
    "PiRuntimeError",
    "ReasonCode",
    "RoomConfig",
    "RoomEvent",
    "RoomWorker",
    "RoomWorkerConfig",
    "SessionError",
    "SilenceClock",
    "SilenceReading",
    "StateDirError",
    "StateDirLockedError",
    "Store",
    "SystemSilenceClock",
    "SystemWallClock",
    "TaskEnded",
    "TaskError",
    "TaskEvent",
    "TaskService",
    "TaskSpec",
    "TaskView",
    "TextUpdate",
    "Thresholds",
    "ToolActivity",
    "Typing",
    "WallClock",
    "WatchdogConfig",
    "WatchdogConfigError",
    "load_config",
    "open_room_worker",
    "open_store",
    "open_task_service",
}


def test_public_names() -> None:
    exported = {
        name
        for name, value in vars(runtime).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert exported == PUBLIC


def test_reason_codes_are_stable() -> None:
    """Reason codes are a contract: never renamed, never reused."""
    assert {code.name: code.value for code in runtime.ReasonCode} == {
        code.name: code.name.lower() for code in runtime.ReasonCode
    }
    assert str(runtime.ReasonCode.JOURNAL_CORRUPT) == "journal_corrupt"


REASON_CODES = Path(__file__).with_name("data") / "reason_codes.txt"


def test_every_reason_code_is_pinned() -> None:
    """The whole set, against the committed list: a new code is added there on purpose, and
    none is ever removed or renamed (wire clients and scripts match on them)."""
    pinned = REASON_CODES.read_text().split()
    assert sorted(code.value for code in runtime.ReasonCode) == pinned


def test_composite_codes_are_built_by_the_enum() -> None:
    assert runtime.ReasonCode.RECOVERY_REFUSED.at("session") == "recovery_refused:session"


TESTING = {
    "AllowAllGate", "Attach", "Behaviours", "Call", "Clocks", "Cut", "Empty", "FakePi",
    "GateDecision",
    "Hang", "HttpError", "HttpServer", "MockSilenceClock", "MockWallClock", "Refused",
    "RetrySettings", "Run", "SavedResult", "Scenario", "ScriptedModel", "StaySilent", "Text",
    "Thinking", "ToolCall", "ToolCalls", "ToolGate", "ToolResult", "UsageLimit",
    "io_aware_autojump_clock", "open_fake_pi", "serve_model",
}  # fmt: skip


def test_runtime_testing_names() -> None:
    exported = {
        name
        for name, value in vars(runtime.testing).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert exported == TESTING
