"""What a room worker tells its clients while turns run (not durable; brief §5, §8).

These are signals, not records: ``typing`` once the reply can no longer become silent (and
every ``typing_refresh`` seconds after), ``text_update`` when the agent calls
``send_text_update``, ``tool_activity`` when a tool starts and ends. They are msgspec Structs
tagged by ``type`` so that the server can send them as wire frames unchanged.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["RoomEvent", "TextUpdate", "ToolActivity", "Typing"]


class Typing(msgspec.Struct, frozen=True, kw_only=True, tag="typing"):
    room: str
    delivery_id: str


class TextUpdate(msgspec.Struct, frozen=True, kw_only=True, tag="text_update"):
    room: str
    delivery_id: str
    reply_to: str
    """The message id of the message being answered (the update is threaded on it)."""
    text: str


class ToolActivity(msgspec.Struct, frozen=True, kw_only=True, tag="tool_activity"):
    room: str
    delivery_id: str
    tool: str
    phase: Literal["start", "end"]


RoomEvent = Typing | TextUpdate | ToolActivity
