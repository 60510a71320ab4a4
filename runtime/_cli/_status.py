"""``status``, ``cancel`` and ``token rotate``: the room side of a state directory, through
the running server's admin socket, or read from (``cancel``: recorded in) the directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import trio

from .._errors import AdminError
from .._journal._inspect import database_status, offline_status
from .._rooms._worker import request_cancel, request_cancel_in_database
from .._server._admin import admin_request
from .._server._token import rotate_token
from .._tasks._view import offline_views
from ._base import (
    EXIT_OK,
    JSON,
    Commands,
    logger,
    refused,
    short_class,
    snippet,
    state_dir_option,
    store_option,
)


def register(commands: Commands) -> None:
    status = commands.add(
        "status",
        "show pending deliveries, rooms and recent results",
        "Show pending deliveries, per-room state and recent results: from the running "
        "server through its admin socket, or read from the state directory when no server "
        "runs. Changes nothing.",
        _status,
    )
    state_dir_option(status)
    store_option(
        status,
        "read the deployment's PostgreSQL database instead (several hosts): every room, "
        "and which host holds it",
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    cancel = commands.add(
        "cancel",
        "cancel a queued or running delivery",
        "Cancel a delivery through the running server's admin socket: a queued one is "
        "removed, a running one aborted; either ends `cancelled`. With no server running, "
        "the cancel is recorded in the state directory and the next start ends the "
        "delivery `cancelled` before anything runs.",
        _cancel,
    )
    cancel.add_argument("delivery_id", metavar="DELIVERY_ID", help="the client's delivery id")
    state_dir_option(cancel)
    store_option(
        cancel,
        "cancel in this PostgreSQL deployment (several hosts): recorded in the database "
        "and carried out by the host that holds the delivery's room",
    )
    cancel.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    token = commands.group("token", "manage the websocket access token", "Manage the access token.")
    rotate = token.add(
        "rotate",
        "replace the token and print the new one",
        "Write a new random token to <state>/token (mode 0600, atomically) and print it "
        "once. Clients holding the old one must be given the new one.",
        _token_rotate,
    )
    state_dir_option(rotate)


def _token_rotate(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir
    token = rotate_token(state_dir)
    print(token)
    print(f"new token written to {state_dir / 'token'}; give it to your clients", file=sys.stderr)
    return EXIT_OK


async def _status_via_server(state_dir: Path) -> dict[str, Any] | None:
    try:
        response = await admin_request(state_dir, {"command": "status"})
    except AdminError as error:
        logger.warning(
            "the server's admin socket did not answer (%s); reading the state directory",
            error.message,
            extra={"code": error.code},
        )
        return None
    return response


def _status(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir
    response = None if args.store else trio.run(_status_via_server, state_dir)
    if args.store:
        status = trio.run(database_status, args.store)
    elif response is None:
        status = offline_status(state_dir)
        views = offline_views(state_dir)
        if views:
            status["tasks"] = [_offline_summary(v) for v in views]
    elif not response.get("ok"):
        return refused(response)
    else:
        status = {"source": "server"} | {k: v for k, v in response.items() if k != "ok"}
    if args.json:
        print(JSON.encode(status).decode())
    else:
        print("\n".join(_status_lines(status)))
    return EXIT_OK


def _status_lines(status: dict[str, Any]) -> list[str]:
    """The status for people; tolerant of fields a server does not send."""
    lines = _room_status_lines(status)
    tasks = status.get("tasks")
    if tasks:
        lines.append(f"tasks: {len(tasks)}")
        for task in tasks:
            end = f" ended {task['ended']}" if task.get("ended") else ""
            lines.append(
                f"  {task.get('task_id')}  {task.get('state')}  "
                f"{short_class(task.get('classification'))}{end}"
            )
    warning = status.get("warning")
    if warning:
        lines = [f"!!! {warning} !!!", *lines, f"!!! {warning} !!!"]
    return lines


def _room_status_lines(status: dict[str, Any]) -> list[str]:
    server = status.get("server") or {}
    if status.get("source") == "server":
        who = f" {status['worker_id']}" if status.get("worker_id") else ""
        extra = ""
        if isinstance(status.get("connections"), int):
            extra += f", {status['connections']} connection(s)"
        if status.get("admitting") is False:
            extra += ", not admitting (draining)"
        lines = [f"server{who}: running (answered on its admin socket){extra}"]
    elif server.get("running"):
        lines = [
            f"server: pid {server.get('pid')} owns the state directory but its admin socket "
            "did not answer; read from the state directory"
        ]
    elif status.get("source") == "database":
        lines = ["deployment: read from its database (no host asked)"]
    else:
        lines = ["server: not running; read from the state directory"]
    pending = status.get("pending")
    details = status.get("pending_deliveries") or []
    count = pending if isinstance(pending, int) else len(pending or details)
    lines.append(f"pending: {count}")
    for item in details if details else (pending if isinstance(pending, list) else []):
        if isinstance(item, dict):
            lines.append(f"  {item.get('delivery_id')}  {item.get('room', '')}".rstrip())
        else:
            lines.append(f"  {item}")
    rooms = status.get("rooms") or []
    lines.append(f"rooms: {len(rooms)}")
    for room in rooms:
        if "holder" in room:  # a deployment's database: which host holds the room's lane
            holder = room["holder"]
            worker = (
                "held by nobody"
                if holder is None
                else (
                    f"held by {holder['host']} (epoch {holder['epoch']}"
                    + ("" if holder["live"] else ", lease run out")
                    + ")"
                )
            )
        else:
            worker = "live worker" if room.get("live_worker") else "no worker"
        lines.append(
            f"  {room.get('room')}  {room.get('state', '?')}  queued {room.get('queued', 0)}"
            f"  {worker}  last result #{room.get('last_result_seq') or '-'}"
        )
    results = status.get("recent_results")
    if results is not None:
        lines.append(
            f"results: last #{status.get('last_seq', 0)}, acknowledged up to "
            f"#{status.get('acked_seq', 0)}"
        )
        for result in results:
            code = f" {result['code']}" if result.get("code") else ""
            text = snippet(result.get("text"))
            lines.append(
                f"  #{result.get('seq')}  {result.get('delivery_id')}  {result.get('room')}  "
                f"{result.get('outcome')}{code}{text}"
            )
    return lines


def _offline_summary(view: Any) -> dict[str, Any]:
    return {
        "task_id": view.task_id,
        "state": view.state,
        "classification": "-",
        "ended": view.ended.get("state") if view.ended else None,
    }


def _cancel(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir
    delivery_id: str = args.delivery_id
    if args.store:  # S26: any host of the deployment, or the next one, carries it out
        recorded = trio.run(request_cancel_in_database, args.store, delivery_id)
        if args.json:
            answer = {"ok": True, "delivery_id": delivery_id, "state": recorded}
            print(JSON.encode(answer | {"source": "database"}).decode())
        else:
            done = "already finished" if recorded == "finished" else "cancel requested"
            print(f"{delivery_id}: {done}")
        return EXIT_OK
    response = trio.run(admin_request, state_dir, {"command": "cancel", "delivery_id": delivery_id})
    if response is None:  # no server: recorded in the state directory for the next start
        recorded = trio.run(request_cancel, state_dir, delivery_id)
        response = {"ok": True, "delivery_id": delivery_id, "state": recorded}
        response["source"] = "state_dir"
        if not args.json:
            done = "already finished" if recorded == "finished" else "cancelled at the next start"
            print(f"{delivery_id}: no server runs; {done}")
            return EXIT_OK
    if args.json:
        print(JSON.encode(response).decode())
    if not response.get("ok"):
        return refused(response)
    if not args.json:
        state = response.get("state")
        print(f"{delivery_id}: {state}" if state else f"{delivery_id}: cancel requested")
    return EXIT_OK
