"""The ``pi-runtime`` command line (``docs/design/operations.md``).

Commands: ``version``; ``serve`` (the websocket room worker, ``runtime/_serve.py``); ``status``
and ``cancel`` (through the running server's admin socket; without one, ``status`` reads the
state directory and ``cancel`` records the request there for the next start); ``token
rotate``; ``journal verify`` and ``journal show``; ``pi install`` and ``doctor``. Every
command and subcommand has ``--help``.

Exit status: 0 done; 1 refused or failed (the message names a stable code); 2 usage;
3 ``server_not_running`` (a command that needs the server found none).

Logging goes to standard error, plain text, or JSON lines with ``--log-json``. Nothing here
logs or prints a secret; ``token rotate`` prints the new token once, on standard output.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import logging
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

import msgspec
import trio

from ._admin import admin_request
from ._errors import AdminError, PiRuntimeError, ReasonCode
from ._inspect import delivery_records, offline_status, verify_journal
from ._pi_install import PiInstallError, default_pi_home, find_pi, install_pi
from ._proctree import probe_cgroups, subreaper_supported
from ._room_worker import request_cancel
from ._token import rotate_token
from ._version import __version__

__all__ = [
    "EXIT_FAILED",
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
    """The ``serve`` command's options (``runtime/_serve.py`` reads them)."""
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
    return parser


# -- serve -------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    """``runtime._serve.run_serve(args)``, imported only when serving."""
    try:
        module = importlib.import_module("runtime._serve")
    except ModuleNotFoundError as exc:
        if exc.name != "runtime._serve":
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
