"""``pi-runtime serve`` hosts of one deployment on one machine, for ``bench/failover.py`` and
the README's demo (``scripts/several-hosts``): each in a private mount namespace that shows it
its own directory at one common path, as separate machines would each have
``/srv/pi-runtime`` (``unshare --mount``; root, or a kernel that allows user namespaces)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import trio
from trio_websocket import open_websocket_url

__all__ = ["ask", "start_host"]


async def start_host(
    common: Path, own: Path, *, stderr: int | IO[Any] = subprocess.DEVNULL
) -> tuple[trio.Process, int]:
    """Start a host whose directory ``own`` (holding its ``config.toml``) it sees at
    ``common``; its process and the port it listens on."""
    serve = f"{Path(sys.executable).parent}/pi-runtime serve --port 0 --config config.toml"
    script = f"mount --bind {own} {common} && cd {common} && exec {serve}"
    unshare = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        unshare.append("--map-root-user")
    process = await trio.lowlevel.open_process(
        [*unshare, "sh", "-c", script], stdout=subprocess.PIPE, stderr=stderr
    )
    assert process.stdout is not None
    seen = b""
    while (found := re.search(rb"listening on ws://[0-9.]+:(\d+)", seen)) is None:
        data = await process.stdout.receive_some(4096)
        if not data:
            raise SystemExit(f"the host in {own} did not start")
        seen += data
    return process, int(found.group(1))


async def ask(own: Path, port: int, delivery_id: str, room: str) -> dict[str, Any]:
    """Send one message into ``room`` through the host of ``own`` on ``port`` and wait for
    its result: how it was accepted, its outcome and its seq."""
    token = (own / "state" / "token").read_text()
    async with open_websocket_url(f"ws://127.0.0.1:{port}/") as ws:
        hello = {"type": "hello", "protocol": 1, "token": token, "client": "several-hosts"}
        await ws.send_message(json.dumps(hello))
        welcome = json.loads(await ws.get_message())
        if welcome["type"] != "welcome":
            raise SystemExit(f"the host in {own} refused the client: {welcome}")
        message = {
            "type": "deliver",
            "delivery_id": delivery_id,
            "room": room,
            "author": {"id": "u-1", "name": "Ann"},
            "message_id": f"m-{delivery_id}",
            "text": f"hello, {room}",
        }
        await ws.send_message(json.dumps(message))
        accepted = None
        while True:
            frame = json.loads(await ws.get_message())
            if frame["type"] == "error":
                raise SystemExit(f"the host in {own} refused {delivery_id}: {frame}")
            if frame["type"] == "accepted" and frame["delivery_id"] == delivery_id:
                accepted = frame["disposition"]
            if frame["type"] == "result" and frame["delivery_id"] == delivery_id:
                return {"accepted": accepted, "outcome": frame["outcome"], "seq": frame["seq"]}
