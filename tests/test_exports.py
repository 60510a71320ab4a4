"""The public surface of ``runtime`` is pinned: a change here is an API change."""

from __future__ import annotations

import types

import runtime

PUBLIC = {
    "Accepted",
    "Author",
    "Caps",
    "ConfigError",
    "Delivery",
    "DeliveryError",
    "DeliveryResult",
    "HistoryItem",
    "ModelConfig",
    "Outcome",
    "RoomConfig",
    "RoomEvent",
    "RoomWorker",
    "RoomWorkerConfig",
    "TextUpdate",
    "Thresholds",
    "ToolActivity",
    "Typing",
    "load_config",
    "open_room_worker",
    "Clocks",
    "DiskFailedError",
    "Journal",
    "JournalError",
    "LogContents",
    "MockSilenceClock",
    "MockWallClock",
    "PiRuntimeError",
    "ReasonCode",
    "SessionError",
    "SilenceClock",
    "SilenceReading",
    "StateDirError",
    "StateDirLockedError",
    "Store",
    "SystemSilenceClock",
    "SystemWallClock",
    "WallClock",
    "open_store",
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
