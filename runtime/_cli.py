"""The ``pi-runtime`` command line (``docs/design/operations.md``).

Commands: ``version``; ``serve`` (the websocket room worker, ``runtime/_server/_serve.py``);
``status`` and ``cancel`` (through the running server's admin socket; without one, ``status`` reads
the state directory and ``cancel`` records the request there for the next start); ``token rotate``;
``journal verify`` and ``journal show``; ``pi install`` and ``doctor``; task lanes: ``task run``
(through the server, or standalone), ``tasks`` and ``task show`` (through the server, or read from
the lane logs), ``task reply|resume|abort|fail|grant`` (through the server). Every command and
subcommand has ``--help``.

Exit status: 0 done; 1 refused or failed (the message names a stable code); 2 usage;
3 ``server_not_running`` (a command that needs the server found none); 130 a standalone
``task run`` interrupted (the task stays unfinished in its log).

Logging goes to standard error, plain text, or JSON lines with ``--log-json``. Nothing here
logs or prints a secret; ``token rotate`` prints the new token once, on standard output.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

import msgspec
import trio

from ._config import RoomWorkerConfig, load_config, validate_config
from ._errors import AdminError, DeliveryError, PiRuntimeError, ReasonCode
from ._journal._inspect import delivery_records, offline_status, verify_journal
from ._linux._proctree import probe_cgroups, subreaper_supported
from ._pi._pi_install import PiInstallError, default_pi_home, find_pi, install_pi
from ._rooms._worker import request_cancel
from ._server._admin import admin_request
from ._server._token import rotate_token
from ._version import __version__

if TYPE_CHECKING:
    from ._tasks._service import TaskService

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_NO_SERVER",
    "EXIT_OK",
    "EXIT_USAGE",
    "add_serve_arguments",
    "configure_logging",
    "main",
]

NODE_MINIMUM: Final = (22, 19, 0)
"""Pi 1.6.0 declares ``engines.node >=22.19.0``."""
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_NO_SERVER: Final = 3
EXIT_INTERRUPTED: Final = 130

logger = logging.getLogger("runtime.cli")
_JSON: Final = msgspec.json.Encoder()


# -- logging -----------------------------------------------------------------------------


class _JsonLines(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and ``code`` when given."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        code = getattr(record, "code", None)
        if code is not None:
            entry["code"] = str(code)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return _JSON.encode(entry).decode()


class _Plain(logging.Formatter):
    """``pi-runtime: message`` for the command's own words; time, level and logger for the
    rest (the server's logs)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if record.name == logger.name:
            code = getattr(record, "code", None)
            text = f"pi-runtime: {code}: " if code is not None else "pi-runtime: "
            text += record.getMessage()
            if record.exc_info:
                text += "\n" + self.formatException(record.exc_info)
            return text
        return super().format(record)


def configure_logging(*, json_lines: bool, level: int = logging.INFO) -> logging.Handler:
    """Send every log record to standard error, as JSON lines or plain text (O11); the
    handler installed on the root logger (remove it to undo)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLines() if json_lines else _Plain())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def _fail(error: PiRuntimeError) -> int:
    logger.error("%s", error.message, extra={"code": error.code})
    return EXIT_NO_SERVER if error.code == ReasonCode.SERVER_NOT_RUNNING else EXIT_FAILED


# -- the parser --------------------------------------------------------------------------


def _log_json(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--log-json",
        action="store_true",
        default=default,
        help="log JSON lines on stderr (default: plain text)",
    )


def _common() -> argparse.ArgumentParser:
    """Options every command takes (also accepted before the command)."""
    common = argparse.ArgumentParser(add_help=False)
    _log_json(common, argparse.SUPPRESS)  # never overwrite one given before the command
    return common


def _state_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path("state"),
        help="the state directory (default: ./state)",
    )


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The ``serve`` command's options (``runtime/_server/_serve.py`` reads them)."""
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8765, help="port to bind (default: 8765)")
    serve.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="the state directory (default: the configuration's state_dir, else ./state)",
    )
    serve.add_argument("--config", type=Path, help="the TOML configuration file")
    serve.add_argument(
        "--agent",
        choices=("fake", "pi"),
        default=None,
        help="the worker: fake (Fake-Pi) or pi (the real Pi) (default: the configuration's, "
        "else fake)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long running turns may finish (default: the "
        "configuration's, 30; 0 = none)",
    )
    serve.add_argument("--tls-cert", type=Path, help="serve wss:// with this certificate (PEM)")
    serve.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    serve.add_argument(
        "--insecure-bind",
        action="store_true",
        help="allow binding a non-loopback address without TLS",
    )
    _timescale(serve)


def _timescale(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--unsafe-test-timescale",
        type=float,
        default=None,
        metavar="FACTOR",
        help="TESTS ONLY: divide every task-lane watchdog threshold by FACTOR and lift the "
        "900 s floor; every log line and status say so",
    )


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, help="the TOML configuration file (its [watchdog] table)"
    )


def _parser() -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="pi-runtime",
        description="A durable, supervised runtime for Pi coding-agent workers.",
    )
    _log_json(parser, False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(
        group: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        summary: str,
        description: str,
    ) -> argparse.ArgumentParser:
        return group.add_parser(name, help=summary, description=description, parents=[common])

    command(commands, "version", "print the pi-runtime version", "Print the version.")
    serve = command(
        commands,
        "serve",
        "run the websocket room worker",
        "Serve chat bridges over a websocket: admit room messages durably, run them in one "
        "agent session per room, send replies. Runs until SIGINT/SIGTERM, then drains.",
    )
    add_serve_arguments(serve)
    status = command(
        commands,
        "status",
        "show pending deliveries, rooms and recent results",
        "Show pending deliveries, per-room state and recent results: from the running "
        "server through its admin socket, or read from the state directory when no server "
        "runs. Changes nothing.",
    )
    _state_dir(status)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    cancel = command(
        commands,
        "cancel",
        "cancel a queued or running delivery",
        "Cancel a delivery through the running server's admin socket: a queued one is "
        "removed, a running one aborted; either ends `cancelled`. With no server running, "
        "the cancel is recorded in the state directory and the next start ends the "
        "delivery `cancelled` before anything runs.",
    )
    cancel.add_argument("delivery_id", metavar="DELIVERY_ID", help="the client's delivery id")
    _state_dir(cancel)
    cancel.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    token = command(
        commands, "token", "manage the websocket access token", "Manage the access token."
    )
    token.set_defaults(help_for=token)
    token_commands = token.add_subparsers(dest="token_command", metavar="TOKEN_COMMAND")
    rotate = command(
        token_commands,
        "rotate",
        "replace the token and print the new one",
        "Write a new random token to <state>/token (mode 0600, atomically) and print it "
        "once. Clients holding the old one must be given the new one.",
    )
    _state_dir(rotate)
    journal = command(
        commands, "journal", "check or show the durable journal", "Inspect the journal."
    )
    journal.set_defaults(help_for=journal)
    journal_commands = journal.add_subparsers(dest="journal_command", metavar="JOURNAL_COMMAND")
    verify = command(
        journal_commands,
        "verify",
        "check every log's frames and checksums",
        "Read every log of the state directory (admissions, results, deliveries, lanes) and "
        "check its frames, checksums, sequence and records. Prints each problem; exit "
        "status 1 if there is any. Read-only; safe while a server runs.",
    )
    _state_dir(verify)
    show = command(
        journal_commands,
        "show",
        "print one delivery's records",
        "Print a delivery's journal records in order, one JSON object per line.",
    )
    show.add_argument("delivery_id", metavar="DELIVERY_ID", help="the client's delivery id")
    _state_dir(show)
    pi = command(commands, "pi", "install the real Pi", "Manage the real Pi coding agent.")
    pi.set_defaults(help_for=pi)
    pi_commands = pi.add_subparsers(dest="pi_command", metavar="PI_COMMAND")
    install = command(
        pi_commands,
        "install",
        "install Pi and the Node 22 it needs",
        "Install Pi 1.6.0 and a Node 22 binary from the npm registry, from the "
        "shipped lockfile with install scripts disabled (needs npm). Idempotent.",
    )
    install.add_argument(
        "--home",
        type=Path,
        help="install directory (default: $PI_RUNTIME_PI_HOME or ~/.cache/pi-runtime/pi)",
    )
    doctor = command(
        commands,
        "doctor",
        "check what workers need here",
        "Report Pi, Node (>= 22.19) and their paths, cgroup v2 availability and "
        "child-subreaper support. Exit status 1 when Pi cannot run.",
    )
    doctor.add_argument("--pi-home", type=Path, help="where Pi is installed (as for pi install)")
    _task_commands(commands, command)
    return parser


def _task_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    command: Callable[..., argparse.ArgumentParser],
) -> None:
    """``tasks`` and the ``task`` group (task lanes, ``docs/design/watchdog.md``)."""
    tasks = command(
        commands,
        "tasks",
        "list task lanes",
        "List every task lane with its state, watchdog classification, phase, epoch, "
        "silence and next safe operator action: from the running server, or read from the "
        "lane logs when no server runs. Changes nothing.",
    )
    _state_dir(tasks)
    _config_option(tasks)
    tasks.add_argument("--json", action="store_true", help="print one JSON object")
    task = command(
        commands, "task", "run and control task lanes", "Run, inspect and control task lanes."
    )
    task.set_defaults(help_for=task)
    group = task.add_subparsers(dest="task_command", metavar="TASK_COMMAND")
    run = command(
        group,
        "run",
        "run a coding task in a worktree",
        "Submit a task (a prompt in a worktree) to the server that owns the state directory; "
        "with --wait, follow its events until it ends. With no server running, run it here "
        "(standalone: open the state directory, run the task to its end or until Ctrl-C, "
        "printing its events). Exit status 0 when the task is done, 1 otherwise (its code).",
    )
    run.add_argument("--worktree", type=Path, required=True, help="the directory to work in")
    run.add_argument("--prompt", required=True, help="what the task is")
    run.add_argument("--task-id", help="the task's id (default: a new random one)")
    run.add_argument(
        "--grant",
        action="append",
        metavar="TOOL",
        help="a tool the worker may use (repeat; default: read, bash, edit, write)",
    )
    run.add_argument(
        "--validate",
        metavar="CMD",
        help="a command (shell words) that must pass on the final worktree for done",
    )
    run.add_argument(
        "--validation-timeout",
        type=float,
        metavar="SECONDS",
        help="how long the --validate command may run before it is killed (default: 600)",
    )
    run.add_argument(
        "--agent",
        choices=("fake", "pi"),
        default=None,
        help="standalone: the worker, fake (Fake-Pi) or pi (default: the configuration's)",
    )
    _state_dir(run)
    _config_option(run)
    _timescale(run)
    run.add_argument(
        "--wait",
        action="store_true",
        help="through a server: follow the task until it ends (standalone always does)",
    )
    show = command(
        group,
        "show",
        "show everything about one task",
        "Print every diagnostic of a task: ids and epochs, session and route, the exact "
        "process identity, classification and phase, progress and silence, the soft "
        "threshold and the probe's result, the hard threshold and the grace, receipts, the "
        "prompt marker, the budget, the pending outbox action, the next safe operator "
        "action, and the production thresholds. Read from the lane log when no server runs.",
    )
    show.add_argument("task_id", metavar="ID", help="the task's id")
    _state_dir(show)
    _config_option(show)
    show.add_argument("--json", action="store_true", help="print one JSON object")
    reply = command(
        group,
        "reply",
        "answer a waiting task",
        "Answer a task that waits for the user (its task_wait), through the running server. "
        "Only a reply to the current wait wakes it.",
    )
    reply.add_argument("task_id", metavar="ID", help="the task's id")
    reply.add_argument("text", metavar="TEXT", help="the answer")
    reply.add_argument("--correlation", help="the wait's intent id (default: the current wait)")
    _state_dir(reply)
    for name, summary, description in (
        ("resume", "resume a held task",
         "Resume a task the watchdog holds (StalledOperatorRequired) through the running "
         "server: what is left of its worker is fenced and the same session resumed."),
        ("abort", "abort a task", "Abort a task through the running server (first terminal "
         "outcome wins; the worker is stopped)."),
        ("fail", "fail a task", "Mark a task failed through the running server (first "
         "terminal outcome wins; the worker is stopped)."),
    ):  # fmt: skip
        control = command(group, name, summary, description)
        control.add_argument("task_id", metavar="ID", help="the task's id")
        control.add_argument("--reason", help="why (recorded)")
        _state_dir(control)
    grant = command(
        group,
        "grant",
        "grant a task more recovery budget",
        "Grant a task more recovery budget (replacement epochs and/or seconds) through the "
        "running server; audited: the grant and its reason are recorded in the task's log.",
    )
    grant.add_argument("task_id", metavar="ID", help="the task's id")
    grant.add_argument("--epochs", type=int, default=0, help="replacement epochs to add")
    grant.add_argument("--seconds", type=float, default=0.0, help="recovery seconds to add")
    grant.add_argument("--reason", required=True, help="why (recorded)")
    _state_dir(grant)


# -- serve -------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    """``runtime._server._serve.run_serve(args)``, imported only when serving."""
    try:
        module = importlib.import_module("runtime._server._serve")
    except ModuleNotFoundError as exc:
        if exc.name != "runtime._server._serve":
            raise
        logger.error("serve is not built yet in this version")
        return EXIT_FAILED
    run_serve = cast(Callable[[argparse.Namespace], int], module.run_serve)
    return run_serve(args)


# -- token -------------------------------------------------------------------------------


def _token_rotate(state_dir: Path) -> int:
    token = rotate_token(state_dir)
    print(token)
    print(f"new token written to {state_dir / 'token'}; give it to your clients", file=sys.stderr)
    return EXIT_OK


# -- status ------------------------------------------------------------------------------


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


def _refused(response: dict[str, Any]) -> int:
    """Report a server's ``{"ok": false, ...}`` answer."""
    message = response.get("message", "the server refused")
    logger.error("%s", message, extra={"code": response.get("code", ReasonCode.ADMIN_FAILED)})
    return EXIT_FAILED


def _status(state_dir: Path, as_json: bool) -> int:
    response = trio.run(_status_via_server, state_dir)
    if response is None:
        status = offline_status(state_dir)
        from ._tasks._service import offline_views

        views = offline_views(state_dir)
        if views:
            status["tasks"] = [_offline_summary(v) for v in views]
    elif not response.get("ok"):
        return _refused(response)
    else:
        status = {"source": "server"} | {k: v for k, v in response.items() if k != "ok"}
    if as_json:
        print(_JSON.encode(status).decode())
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
                f"{_short_class(task.get('classification'))}{end}"
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
            text = _snippet(result.get("text"))
            lines.append(
                f"  #{result.get('seq')}  {result.get('delivery_id')}  {result.get('room')}  "
                f"{result.get('outcome')}{code}{text}"
            )
    return lines


def _snippet(text: object, width: int = 60) -> str:
    if not isinstance(text, str) or not text:
        return ""
    flat = " ".join(text.split())
    return "  " + (repr(flat) if len(flat) <= width else repr(flat[: width - 1] + "…"))


# -- cancel ------------------------------------------------------------------------------


def _cancel(state_dir: Path, delivery_id: str, as_json: bool) -> int:
    response = trio.run(admin_request, state_dir, {"command": "cancel", "delivery_id": delivery_id})
    if response is None:  # no server: recorded in the state directory for the next start
        recorded = trio.run(request_cancel, state_dir, delivery_id)
        response = {"ok": True, "delivery_id": delivery_id, "state": recorded}
        response["source"] = "state_dir"
        if not as_json:
            done = "already finished" if recorded == "finished" else "cancelled at the next start"
            print(f"{delivery_id}: no server runs; {done}")
            return EXIT_OK
    if as_json:
        print(_JSON.encode(response).decode())
    if not response.get("ok"):
        return _refused(response)
    if not as_json:
        state = response.get("state")
        print(f"{delivery_id}: {state}" if state else f"{delivery_id}: cancel requested")
    return EXIT_OK


# -- task lanes --------------------------------------------------------------------------


def _offline_summary(view: Any) -> dict[str, Any]:
    return {
        "task_id": view.task_id,
        "state": view.state,
        "classification": "-",
        "ended": view.ended.get("state") if view.ended else None,
    }


def _short_class(classification: object) -> str:
    text = str(classification or "-")
    return "-" if text.startswith("unknown:") else text


def _load_config(path: Path | None) -> RoomWorkerConfig:
    return load_config(path) if path is not None else RoomWorkerConfig()


def _no_server(state_dir: Path) -> AdminError:
    return AdminError(
        ReasonCode.SERVER_NOT_RUNNING,
        f"no server answers on {state_dir}; start `pi-runtime serve --state-dir "
        f"{state_dir}` (or a `pi-runtime task run`) and try again",
    )


async def _ask(state_dir: Path, request: dict[str, Any]) -> dict[str, Any] | None:
    """A server's answer, or None when none runs (an unanswering socket is logged)."""
    try:
        return await admin_request(state_dir, request)
    except AdminError as error:
        if request.get("command") not in ("tasks", "task_show"):
            raise
        logger.warning(
            "the server's admin socket did not answer (%s); reading the lane logs",
            error.message,
            extra={"code": error.code},
        )
        return None


def _thresholds(view: dict[str, Any], production: dict[str, Any] | None) -> list[str]:
    from ._tasks._service import threshold_lines
    from ._tasks._watchdog import Phase, WatchdogPolicy

    data = production or {}
    base = WatchdogPolicy(
        soft_seconds=float(data.get("soft_seconds", 300.0)),
        hard_seconds={
            Phase(p): float(s)
            for p, s in (data.get("hard_seconds") or {"provider": 900, "generation": 900}).items()
        },
        grace_seconds=float(data.get("grace_seconds", 120.0)),
    )
    scale = float(view.get("timescale") or 1.0)
    return threshold_lines(base.scaled(scale) if scale != 1.0 else base, base)


def _seconds(value: object) -> str:
    return "-" if value is None else f"{float(value):g} s"  # type: ignore[arg-type]


def _task_lines(view: dict[str, Any], production: dict[str, Any] | None) -> list[str]:
    """``task show`` for people: every field of the view, then the thresholds."""
    process = view.get("process")
    budget = view.get("budget") or {}
    receipts = view.get("receipts") or []
    route = view.get("route") or {}
    ended = view.get("ended")
    rows: list[tuple[str, str]] = [
        ("state", str(view.get("state"))),
        ("ids", f"generation {view.get('generation')}, attempt {view.get('attempt')}, "
                f"fence {view.get('fence')}"),
        ("epochs", f"process epoch {view.get('process_epoch')}, continuation epoch "
                   f"{view.get('continuation_epoch')}"),
        ("session", f"{view.get('session_path')}"
                    + (f" (id {view['session_id']})" if view.get("session_id") else "")),
        ("route", f"{route.get('provider', '?')}/{route.get('model', '?')}"),
        ("worktree", str(view.get("worktree"))),
        ("process", "none (no live worker)" if not process else
         f"pid {process.get('pid')}, start time {process.get('start_time')}, "
         f"boot id {process.get('boot_id')}, nonce {process.get('nonce')}"),
        ("classification", str(view.get("classification"))),
        ("phase", str(view.get("phase"))),
        ("progress", f"seq {view.get('progress_seq')}, silence "
                     f"{_seconds(view.get('silence_seconds'))}"),
        ("soft threshold", f"{_seconds(view.get('soft_seconds'))}; probe: "
                           f"{view.get('probe') or 'none sent'}"),
        ("hard threshold", (_seconds(view.get("hard_seconds")) + " (this phase)")
         if view.get("hard_seconds") is not None else "none for this phase"),
        ("grace", f"{_seconds(view.get('grace_seconds'))} ({view.get('grace')})"),
        ("receipts", str(len(receipts)) if receipts else "none"),
    ]  # fmt: skip
    for receipt in receipts:
        verdict = "accepted" if receipt.get("accepted") else receipt.get("verdict", "late")
        detail = _snippet(receipt.get("detail"))
        rows.append(("", f"{receipt.get('kind')} {verdict} (epoch {receipt.get('epoch')}, "
                         f"intent {receipt.get('intent_id')}){detail}"))  # fmt: skip
    rows += [
        ("prompt marker", str(view.get("prompt_marker") or "none")),
        ("budget", f"epochs used {budget.get('epochs_used')}, left {budget.get('epochs_left')}"
                   f" (granted {budget.get('granted_epochs')}); seconds used "
                   f"{budget.get('seconds_used')}, left {budget.get('seconds_left')} "
                   f"(granted {budget.get('granted_seconds')})"),
        ("pending action", str(view.get("pending_action") or "none")),
        ("hold reason", str(view.get("hold_reason") or "none")),
        ("next action", str(view.get("next_action"))),
        ("time scale", f"x{float(view.get('timescale') or 1.0):g}"),
        ("telemetry", ", ".join(f"{k} {v}" for k, v in (view.get("telemetry") or {}).items())
         or "none"),
    ]  # fmt: skip
    costs = view.get("costs")
    if costs:
        rows.append(("costs", _costs_text(costs)))
    if ended:
        text = str(ended.get("state"))
        if ended.get("code"):
            text += f" ({ended['code']})"
        if ended.get("detail"):
            text += f": {ended['detail']}"
        rows.append(("ended", text))
        candidate = ended.get("candidate")
        if candidate:
            where = f"{candidate.get('kind')} {candidate.get('ref')}"
            rows.append(("candidate", f"{where} (manifest {candidate.get('manifest_digest')})"))
        if ended.get("validation"):
            rows.append(("validation", json.dumps(ended["validation"], sort_keys=True)))
    else:
        rows.append(("ended", "no"))
    width = max(len(name) for name, _ in rows)
    lines = [f"task {view.get('task_id')}"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in rows]
    lines += [f"  {line}" for line in _thresholds(view, production)]
    return lines


def _tasks_cmd(state_dir: Path, config: Path | None, as_json: bool) -> int:
    response = trio.run(_ask, state_dir, {"command": "tasks"})
    if response is not None and not response.get("ok"):
        return _refused(response)
    if response is None:
        from ._tasks._service import offline_views, watchdog_policy

        policy = watchdog_policy(_load_config(config))
        views = [msgspec.to_builtins(v) for v in offline_views(state_dir, policy)]
        listing: dict[str, Any] = {"source": "state_dir", "tasks": views}
    else:
        listing = {"source": "server"} | {k: v for k, v in response.items() if k != "ok"}
    if as_json:
        print(_JSON.encode(listing).decode())
        return EXIT_OK
    warning = listing.get("warning")
    if warning:
        print(f"!!! {warning} !!!")
    if listing["source"] == "server":
        print("server: running (answered on its admin socket)")
    else:
        print("server: not running; read from the lane logs")
    rows = [("TASK", "STATE", "CLASSIFICATION", "PHASE", "EPOCH", "SILENCE", "NEXT ACTION")]
    for view in listing["tasks"]:
        offline = str(view.get("classification", "")).startswith("unknown:")
        rows.append(
            (
                str(view.get("task_id")),
                str(view.get("state")),
                _short_class(view.get("classification")),
                "-" if offline else str(view.get("phase")),
                str(view.get("process_epoch")),
                "-" if offline else _seconds(view.get("silence_seconds")),
                str(view.get("next_action")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    if len(rows) == 1:
        print("(no tasks)")
    return EXIT_OK


def _task_show(state_dir: Path, task_id: str, config: Path | None, as_json: bool) -> int:
    response = trio.run(_ask, state_dir, {"command": "task_show", "task_id": task_id})
    if response is not None and not response.get("ok"):
        return _refused(response)
    if response is None:
        from ._tasks._service import offline_view, policy_dict, watchdog_policy

        policy = watchdog_policy(_load_config(config))
        view: dict[str, Any] = msgspec.to_builtins(offline_view(state_dir, task_id, policy))
        view["production"] = policy_dict(policy)
        source = "state_dir"
    else:
        view = response["task"]
        source = "server"
    if as_json:
        print(_JSON.encode({"source": source, "task": view}).decode())
        return EXIT_OK
    lines = _task_lines(view, view.get("production"))
    if source == "state_dir":
        lines.insert(1, "  (no server runs: read from the lane log; the watchdog runs only in "
                        "the owner)")  # fmt: skip
    print("\n".join(lines))
    return EXIT_OK


def _task_control(args: argparse.Namespace) -> int:
    command = args.task_command
    request: dict[str, Any] = {"command": f"task_{command}", "task_id": args.task_id}
    if command == "reply":
        request |= {"text": args.text, "correlation": args.correlation}
    elif command == "grant":
        request |= {"epochs": args.epochs, "seconds": args.seconds, "reason": args.reason}
    else:
        request["reason"] = args.reason
    response = trio.run(admin_request, args.state_dir, request)
    if response is None:
        raise _no_server(args.state_dir)
    if not response.get("ok"):
        return _refused(response)
    view = response.get("task") or {}
    print(
        f"task {args.task_id}: {command} accepted; state {view.get('state')}, "
        f"{_short_class(view.get('classification'))}"
    )
    return EXIT_OK


def _costs_text(costs: dict[str, Any]) -> str:
    """``task: 2 answers, 310+95 tokens; continuation: …; 0 requests without answer``."""
    parts = []
    for bucket in ("task", "continuation"):
        c = costs.get(bucket) or {}
        parts.append(
            f"{bucket}: {c.get('answers', 0)} answers, "
            f"{c.get('prompt_tokens', 0)}+{c.get('completion_tokens', 0)} tokens"
        )
    parts.append(f"{costs.get('requests_without_answer', 0)} requests without answer")
    return "; ".join(parts)


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    worktree = args.worktree.expanduser().absolute()
    spec: dict[str, Any] = {
        "task_id": args.task_id or f"task-{secrets.token_hex(4)}",
        "prompt": args.prompt,
        "worktree": str(worktree),
    }
    if args.grant:
        spec["grants"] = sorted(set(args.grant))
    if args.validate:
        spec["validation"] = shlex.split(args.validate)
    if args.validation_timeout is not None:
        spec["validation_timeout"] = args.validation_timeout
    return spec


def _event_line(event: dict[str, Any], scale: float) -> str:
    text = (
        f"task {event.get('task_id')}: {event.get('classification')} state={event.get('state')} "
        f"phase={event.get('phase')} epoch={event.get('process_epoch')}"
    )
    if event.get("hold_reason"):
        text += f" hold={event['hold_reason']}"
    if event.get("ended"):
        text += f" ended={event['ended']}"
    if scale != 1.0:
        text = f"[UNSAFE TEST TIMESCALE x{scale:g}] {text}"
    return text


async def _follow(
    task_id: str, fetch: Callable[[int], Any], *, quiet: bool = False
) -> dict[str, Any]:
    """Print the task's events as lines until it ends; its last view. ``fetch(after)`` is a
    ``task_wait`` answer (from the server, or the standalone service)."""
    after = 0
    while True:
        answer: dict[str, Any] = await fetch(after)
        if not answer.get("ok", True):
            raise PiRuntimeError(
                ReasonCode(answer.get("code", ReasonCode.ADMIN_FAILED)),
                str(answer.get("message", "the server refused")),
            )
        scale = float(answer.get("unsafe_test_timescale") or 1.0)
        for event in answer.get("events", []):
            if not quiet:
                print(_event_line(event, scale), flush=True)
        after = int(answer.get("last", after))
        if answer.get("ended"):
            view: dict[str, Any] = answer["task"]
            return view


def _ended(view: dict[str, Any]) -> int:
    """Report how the task ended; the exit status (0 only for done)."""
    ended = view.get("ended") or {}
    state = ended.get("state")
    task_id = view.get("task_id")
    if state == "done":
        candidate = ended.get("candidate") or {}
        print(
            f"task {task_id} ended done: candidate {candidate.get('kind')} "
            f"{candidate.get('ref')} (manifest {ended.get('manifest_digest')})",
            flush=True,
        )
        return EXIT_OK
    code = ended.get("code") or ReasonCode.TASK_NOT_DONE
    detail = f": {ended['detail']}" if ended.get("detail") else ""
    logger.error("task %s ended %s%s", task_id, state, detail, extra={"code": code})
    return EXIT_FAILED


def _task_run(args: argparse.Namespace) -> int:
    spec = _spec(args)
    state_dir: Path = args.state_dir
    response = trio.run(admin_request, state_dir, {"command": "task_run", **spec})
    if response is not None:
        ignored = [
            flag
            for flag, value in (
                ("--agent", args.agent),
                ("--config", args.config),
                ("--unsafe-test-timescale", args.unsafe_test_timescale),
            )
            if value is not None
        ]
        if ignored:
            logger.warning(
                "a server owns %s: its configuration applies, not %s",
                state_dir,
                ", ".join(ignored),
            )
        return _task_via_server(state_dir, spec["task_id"], response, wait=args.wait)
    return _task_standalone(args, spec)


def _task_via_server(state_dir: Path, task_id: str, response: dict[str, Any], *, wait: bool) -> int:
    if not response.get("ok"):
        return _refused(response)
    view = response.get("task") or {}
    print(
        f"task {task_id}: {response.get('disposition', 'started')} on the server "
        f"(state {view.get('state')})",
        flush=True,
    )
    if not wait:
        return EXIT_OK

    async def fetch(after: int) -> dict[str, Any]:
        request = {"command": "task_wait", "task_id": task_id, "after": after, "seconds": 20}
        answer = await admin_request(state_dir, request)
        if answer is None:
            raise _no_server(state_dir)
        return answer

    return _ended(trio.run(_follow, task_id, fetch))


class _StandaloneAdmin:
    """The admin socket of a standalone ``task run``: ``status`` and the task commands (so
    ``task reply``, ``abort``, … reach it from another terminal); no deliveries here."""

    def __init__(self, service: TaskService) -> None:
        self.service = service

    async def status(self) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        report: dict[str, Any] = {
            "worker_id": f"task run {os.getpid()}",
            "pending": 0,
            "rooms": [],
        }
        return report | self.service.status()

    async def cancel(self, delivery_id: str) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        raise DeliveryError(
            ReasonCode.DELIVERY_UNKNOWN,
            f"no delivery {delivery_id}: this is a standalone task run; start the server",
        )


def _task_standalone(args: argparse.Namespace, spec: dict[str, Any]) -> int:
    from ._tasks._service import watchdog_policy

    config = _load_config(args.config)
    changes: dict[str, Any] = {"state_dir": str(Path(args.state_dir).absolute())}
    if args.agent is not None:
        changes["agent"] = args.agent
    config = validate_config(msgspec.structs.replace(config, **changes))
    timescale = args.unsafe_test_timescale or 1.0
    watchdog_policy(config, timescale=timescale)  # refused before anything starts (WD9)
    return trio.run(_standalone, config, spec, timescale)


async def _standalone(config: RoomWorkerConfig, spec: dict[str, Any], timescale: float) -> int:
    from ._boundary._receipts import receipt_store
    from ._clock import Clocks
    from ._journal._store import open_store
    from ._server._admin import serve_admin
    from ._tasks._service import loud_logging, open_task_service, watchdog_policy

    state_dir = Path(config.state_dir)
    task_id = spec["task_id"]
    clocks = Clocks.system()
    policy = watchdog_policy(config, timescale=timescale)
    interrupted: list[str] = []
    with (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
        loud_logging(policy),
    ):
        async with (
            open_store(state_dir, clocks=clocks) as store,
            receipt_store(state_dir, now_ms=clocks.wall.time_ms) as receipts,
            open_task_service(
                config, store=store, receipts=receipts, timescale=timescale
            ) as service,
            trio.open_nursery() as nursery,
        ):
            handler = _StandaloneAdmin(service)
            await nursery.start(functools.partial(serve_admin, tasks=service), state_dir, handler)

            async def watch_signals() -> None:
                async for signum in signals:
                    interrupted.append(signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch_signals)
            warning = service.warning
            if warning is not None:
                print(f"pi-runtime task run: !!! {warning} !!!", flush=True)
            answer = await service.task_submit(spec)
            print(
                f"task {task_id}: {answer['disposition']} here (standalone; state {state_dir})",
                flush=True,
            )
            view = await _follow(task_id, lambda after: service.task_wait(task_id, after, 20.0))
            nursery.cancel_scope.cancel()
    if interrupted:
        logger.error(
            "task %s interrupted (%s): it stays unfinished in %s; `pi-runtime task run` "
            "again or `pi-runtime serve` resumes it",
            task_id,
            interrupted[0],
            state_dir,
            extra={"code": ReasonCode.TASK_NOT_DONE},
        )
        return EXIT_INTERRUPTED
    return _ended(view)


# -- journal -----------------------------------------------------------------------------


def _journal_verify(state_dir: Path) -> int:
    checked, findings = verify_journal(state_dir)
    for finding in findings:
        code = f"{finding.code}: " if finding.code else ""
        kind = "problem" if finding.problem else "note"
        print(f"{kind}: {finding.rel}: {code}{finding.message}")
    problems = sum(f.problem for f in findings)
    print(f"checked {checked} logs: {problems} problem{'s' if problems != 1 else ''}")
    return EXIT_FAILED if problems else EXIT_OK


def _journal_show(state_dir: Path, delivery_id: str) -> int:
    records, note = delivery_records(state_dir, delivery_id)
    if note is not None:
        logger.info("%s", note)
    for record in records:
        print(_JSON.encode(record).decode())
    return EXIT_OK


def _pi_install(home: Path | None) -> int:
    try:
        pi = install_pi(home)
    except PiInstallError as error:
        print(f"pi-runtime: {error}", file=sys.stderr)
        return 1
    print(f"pi {pi.version} at {pi.cli} (node {pi.node})")
    return 0


@dataclass(frozen=True, slots=True)
class _Node:
    path: str
    version: tuple[int, int, int] | None
    text: str

    @property
    def ok(self) -> bool:
        return self.version is not None and self.version >= NODE_MINIMUM


def _node(path: str) -> _Node:
    try:
        result = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return _Node(path, None, f"does not run ({error})")
    text = result.stdout.strip()
    match = re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)", text)
    version = (int(match[1]), int(match[2]), int(match[3])) if match else None
    return _Node(path, version, text or result.stderr.strip())


def _doctor(pi_home: Path | None) -> int:
    minimum = ".".join(map(str, NODE_MINIMUM))
    lines = [("pi-runtime", f"{__version__} (python {sys.version.split()[0]}, {sys.executable})")]
    home = pi_home or default_pi_home()
    pi = find_pi(home)
    ready = pi is not None
    if pi is None:
        lines.append(("pi", f"not installed at {home}: run `pi-runtime pi install` (needs npm)"))
    else:
        lines.append(("pi", f"{pi.version} at {pi.cli}"))
        node = _node(str(pi.node))
        verdict = "ok" if node.ok else f"needs >= {minimum}"
        lines.append(("node (pi's)", f"{node.text} at {node.path} ({verdict})"))
        ready = node.ok
    on_path = shutil.which("node")
    if on_path is None:
        lines.append(("node (PATH)", "none; `pi-runtime pi install` brings its own Node 22"))
    else:
        node = _node(on_path)
        verdict = "ok" if node.ok else f"older than {minimum}; Pi uses the one it installs"
        lines.append(("node (PATH)", f"{node.text} at {on_path} ({verdict})"))
    cgroups = probe_cgroups()
    if cgroups.usable:
        kill = "yes" if cgroups.kill else "no (members are killed one by one)"
        lines.append(("cgroup v2", f"usable: {cgroups.parent} (cgroup.kill: {kill})"))
    else:
        lines.append(
            (
                "cgroup v2",
                f"unavailable ({cgroups.reason}); worker trees are held by the child "
                "subreaper and the nonce scan instead",
            )
        )
    subreaper = "supported" if subreaper_supported() else "not supported (nonce scan only)"
    lines.append(("subreaper", subreaper))
    width = max(len(name) for name, _ in lines)
    for name, text in lines:
        print(f"{name.ljust(width)}  {text}")
    if not ready:
        print("\nPi cannot run here yet; see the lines above.", file=sys.stderr)
    return 0 if ready else 1


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    command = args.command
    if command == "version":
        print(f"pi-runtime {__version__}")
        return EXIT_OK
    if command == "serve":
        return _serve(args)
    if command == "status":
        return _status(args.state_dir, args.json)
    if command == "cancel":
        return _cancel(args.state_dir, args.delivery_id, args.json)
    if command == "token" and args.token_command == "rotate":
        return _token_rotate(args.state_dir)
    if command == "journal" and args.journal_command == "verify":
        return _journal_verify(args.state_dir)
    if command == "journal" and args.journal_command == "show":
        return _journal_show(args.state_dir, args.delivery_id)
    if command == "pi" and args.pi_command == "install":
        return _pi_install(args.home.absolute() if args.home else None)
    if command == "doctor":
        return _doctor(args.pi_home.absolute() if args.pi_home else None)
    if command == "tasks":
        return _tasks_cmd(args.state_dir, args.config, args.json)
    if command == "task" and args.task_command == "run":
        return _task_run(args)
    if command == "task" and args.task_command == "show":
        return _task_show(args.state_dir, args.task_id, args.config, args.json)
    if command == "task" and args.task_command in ("reply", "resume", "abort", "fail", "grant"):
        return _task_control(args)
    getattr(args, "help_for", parser).print_help(sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    handler = configure_logging(json_lines=args.log_json)
    try:
        return _dispatch(parser, args)
    except PiRuntimeError as error:
        return _fail(error)
    except OSError as error:
        logger.error("%s", error)
        return EXIT_FAILED
    finally:
        logging.getLogger().removeHandler(handler)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
