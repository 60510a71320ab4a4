"""The public surface of ``runtime`` is pinned: a change here is an API change."""

from __future__ import annotations

import types

import runtime

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
