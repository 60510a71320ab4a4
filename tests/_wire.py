"""A websocket client of the wire protocol for the server tests (JSON text frames)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from trio_websocket import WebSocketConnection

Frame = dict[str, Any]


def message(delivery_id: str, text: str = "hi", room: str = "dm:1") -> Frame:
    return {
        "type": "deliver",
        "delivery_id": delivery_id,
        "room": room,
        "author": {"id": "u1", "name": "Ann"},
        "message_id": f"m-{delivery_id}",
        "text": text,
    }


class Client:
    """One websocket client speaking the protocol as JSON text."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws

    async def send(self, frame: Frame | str | bytes) -> None:
        await self.ws.send_message(frame if isinstance(frame, str | bytes) else json.dumps(frame))

    async def receive(self) -> Frame:
        frame: Frame = json.loads(await self.ws.get_message())
        return frame

    async def until(self, wanted: Callable[[Frame], bool]) -> Frame:
        """The next frame ``wanted`` accepts; signals (typing, tool activity) are skipped."""
        while True:
            frame = await self.receive()
            if wanted(frame):
                return frame

    async def result(self, delivery_id: str) -> Frame:
        return await self.until(lambda f: f["type"] == "result" and f["delivery_id"] == delivery_id)

    async def hello(self, token: str, **extra: Any) -> Frame:
        await self.send({"type": "hello", "protocol": 1, "token": token, "client": "t", **extra})
        return await self.receive()
