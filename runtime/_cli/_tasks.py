"""``tasks`` and the ``task`` group (task lanes, ``docs/design/watchdog.md``): through the
server that owns the state directory, or — ``tasks`` and ``task show`` read from the lane
logs, ``task run`` runs the task here — without one."""

from __future__ import annotations

import argparse
import functools
import math
import os
import secrets
import shlex
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import trio

from .._boundary._receipts import receipt_store
from .._clock import Clocks
from .._config import RoomWorkerConfig, load_config, validate_config
from .._errors import AdminError, ConfigError, DeliveryError, PiRuntimeError, ReasonCode
from .._journal._store import open_store, require_journal
from .._retention import offline_settings, recorded_settings
from .._server._admin import admin_request, serve_admin
from .._tasks._policy import loud_logging, policy_dict, watchdog_policy
from .._tasks._retention import forget_offline
from .._tasks._service import TaskService, open_task_service
from .._tasks._view import database_views, offline_view, offline_views
from ._base import (
    DEFAULT_STATE_DIR,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    JSON,
    Commands,
    config_option,
    load_room_config,
    logger,
    no_server,
    offline_target,
    refused,
    short_class,
    silence_text,
    state_dir_option,
    store_option,
    timescale_option,
)
from ._task_text import event_line, task_lines


def register(commands: Commands) -> None:
    tasks = commands.add(
        "tasks",
        "list task lanes",
        "List every task lane with its state, watchdog classification, phase, epoch, "
        "silence and next safe operator action: from the running server, or read from the "
        "lane logs when no server runs. Changes nothing.",
        _tasks_cmd,
    )
    state_dir_option(tasks, with_config=True)
    config_option(tasks)
    store_option(tasks, STORE_HELP)
    tasks.add_argument("--json", action="store_true", help="print one JSON object")
    task = commands.group(
        "task", "run and control task lanes", "Run, inspect and control task lanes."
    )
    run = task.add(
        "run",
        "run a coding task in a worktree",
        "Submit a task (a prompt in a worktree) to the server that owns the state directory; "
        "with --wait, follow its events until it ends. With no server running, run it here "
        "(standalone: open the state directory, run the task to its end or until Ctrl-C, "
        "printing its events). Exit status 0 when the task is done, 1 otherwise (its code).",
        _task_run,
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
        type=finite,
        metavar="SECONDS",
        help="how long the --validate command may run before it is killed (default: 600)",
    )
    run.add_argument(
        "--agent",
        choices=("fake", "pi"),
        default=None,
        help="standalone: the worker, fake (Fake-Pi) or pi (default: the configuration's)",
    )
    state_dir_option(run, with_config=True)
    config_option(run)
    timescale_option(run)
    run.add_argument(
        "--wait",
        action="store_true",
        help="through a server: follow the task until it ends (standalone always does)",
    )
    show = task.add(
        "show",
        "show everything about one task",
        "Print every diagnostic of a task: ids and epochs, session and route, the exact "
        "process identity, classification and phase, progress and silence, the soft "
        "threshold and the probe's result, the hard threshold and the grace, receipts, the "
        "prompt marker, the budget, the pending outbox action, the next safe operator "
        "action, and the production thresholds. Read from the lane log when no server runs.",
        _task_show,
    )
    show.add_argument("task_id", metavar="ID", help="the task's id")
    state_dir_option(show, with_config=True)
    config_option(show)
    store_option(show, STORE_HELP)
    show.add_argument("--json", action="store_true", help="print one JSON object")
    reply = task.add(
        "reply",
        "answer a waiting task",
        "Answer a task that waits for the user (its task_wait), through the running server. "
        "Only a reply to the current wait wakes it.",
        functools.partial(_task_control, "reply"),
    )
    reply.add_argument("task_id", metavar="ID", help="the task's id")
    reply.add_argument("text", metavar="TEXT", help="the answer")
    reply.add_argument("--correlation", help="the wait's intent id (default: the current wait)")
    state_dir_option(reply)
    for name, summary, description in (
        ("resume", "resume a held task",
         "Resume a task the watchdog holds (StalledOperatorRequired) through the running "
         "server: what is left of its worker is fenced and the same session resumed."),
        ("abort", "abort a task", "Abort a task through the running server (first terminal "
         "outcome wins; the worker is stopped)."),
        ("fail", "fail a task", "Mark a task failed through the running server (first "
         "terminal outcome wins; the worker is stopped)."),
    ):  # fmt: skip
        control = task.add(name, summary, description, functools.partial(_task_control, name))
        control.add_argument("task_id", metavar="ID", help="the task's id")
        control.add_argument("--reason", help="why (recorded)")
        state_dir_option(control)
    forget = task.add(
        "forget",
        "remove what is left of an ended task",
        "Remove what is left of an ended task now — its candidate (the archive, or the git "
        "ref refs/pi-runtime/candidates/ID in its worktree), its lane log, session and work "
        "directories (docs/design/retention.md RT12). A later submission under its id is "
        "refused task_expired. Through the running server, or on the state directory when "
        "none runs.",
        _task_forget,
    )
    forget.add_argument("task_id", metavar="ID", help="the task's id")
    state_dir_option(forget, with_config=True)
    forget.add_argument(
        "--config",
        type=Path,
        help="with no server: the configuration the server runs with (its [retention] and "
        "work_root; default: the settings the server recorded in the state directory)",
    )
    grant = task.add(
        "grant",
        "grant a task more recovery budget",
        "Grant a task more recovery budget (replacement epochs and/or seconds) through the "
        "running server; audited: the grant and its reason are recorded in the task's log.",
        functools.partial(_task_control, "grant"),
    )
    grant.add_argument("task_id", metavar="ID", help="the task's id")
    grant.add_argument("--epochs", type=int, default=0, help="replacement epochs to add")
    grant.add_argument("--seconds", type=finite, default=0.0, help="recovery seconds to add")
    grant.add_argument("--reason", required=True, help="why (recorded)")
    state_dir_option(grant)


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


STORE_HELP = (
    "read the deployment's PostgreSQL database instead (several hosts): every task, and "
    "which host holds it"
)


def _in_database(args: argparse.Namespace) -> list[dict[str, Any]]:
    policy = watchdog_policy(load_room_config(args.config))
    found = trio.run(database_views, args.store, policy)
    return [msgspec.to_builtins(view) | {"holder": holder} for view, holder in found]


def _state_dir(args: argparse.Namespace) -> Path:
    """``--state-dir``, else ``--config``'s ``state_dir`` (the one ``serve --config`` runs
    on), else ``./state`` (O13). Before, ``--config``'s was ignored: ``task run --config F``
    did not find the server ``serve --config F`` runs, and ran the task standalone in
    ``./state`` beside it, with the same work root."""
    if args.state_dir is not None:
        given: Path = args.state_dir
        return given
    if args.config is not None:
        return Path(load_config(args.config).state_dir)
    return DEFAULT_STATE_DIR


def _tasks_cmd(args: argparse.Namespace) -> int:
    if args.store:
        listing: dict[str, Any] = {"source": "database", "tasks": _in_database(args)}
        return _print_tasks(listing, json=args.json)
    state_dir = _state_dir(args)
    response = trio.run(_ask, state_dir, {"command": "tasks"})
    if response is not None and not response.get("ok"):
        return refused(response)
    if response is None:
        require_journal(state_dir)  # a typo is state_dir_invalid, not "no tasks"
        policy = watchdog_policy(load_room_config(args.config))
        views = [msgspec.to_builtins(v) for v in offline_views(state_dir, policy)]
        listing = {"source": "state_dir", "tasks": views}
    else:
        listing = {"source": "server"} | {k: v for k, v in response.items() if k != "ok"}
    return _print_tasks(listing, json=args.json)


def _print_tasks(listing: dict[str, Any], *, json: bool) -> int:
    if json:
        print(JSON.encode(listing).decode())
        return EXIT_OK
    warning = listing.get("warning")
    if warning:
        print(f"!!! {warning} !!!")
    source = listing["source"]
    hosts = source == "database" or bool(listing.get("deployment"))
    if source == "server" and hosts:
        print(
            "server: running (answered on its admin socket): every task of its deployment, "
            "each run by the host holding it"
        )
    elif source == "server":
        print("server: running (answered on its admin socket)")
    elif source == "database":
        print("deployment: read from its database (each task runs on the host holding it)")
    else:
        print("server: not running; read from the lane logs")
    if listing.get("deployment_error"):
        print(f"!!! the deployment's database not read now ({listing['deployment_error']}): "
              "this host's tasks only !!!")  # fmt: skip
    head = ("TASK", "STATE", "HOST") if hosts else ("TASK", "STATE")
    rows = [(*head, "CLASSIFICATION", "PHASE", "EPOCH", "SILENCE", "NEXT ACTION")]
    for view in listing["tasks"]:
        offline = str(view.get("classification", "")).startswith("unknown:")
        holder = view.get("holder")
        host = (
            (f"{holder['host']}" if holder["live"] else f"({holder['host']}, lease out)")
            if holder
            else "-"
        )
        rows.append(
            (
                str(view.get("task_id")),
                str(view.get("state")),
                *((host,) if hosts else ()),
                short_class(view.get("classification")),
                "-" if offline else str(view.get("phase")),
                str(view.get("process_epoch")),
                "-" if offline else silence_text(view),
                str(view.get("next_action")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    if len(rows) == 1:
        print("(no tasks)")
    return EXIT_OK


def _task_show(args: argparse.Namespace) -> int:
    task_id: str = args.task_id
    if args.store:
        return _task_show_in_database(args, task_id)
    state_dir = _state_dir(args)
    response = trio.run(_ask, state_dir, {"command": "task_show", "task_id": task_id})
    if response is not None and not response.get("ok"):
        return refused(response)
    if response is None:
        require_journal(state_dir)
        policy = watchdog_policy(load_room_config(args.config))
        view: dict[str, Any] = msgspec.to_builtins(offline_view(state_dir, task_id, policy))
        view["production"] = policy_dict(policy)
        source = "state_dir"
    else:
        view = response["task"]
        source = "server"
    if args.json:
        print(JSON.encode({"source": source, "task": view}).decode())
        return EXIT_OK
    lines = task_lines(view, view.get("production"))
    if "holder" in view:  # another host's task, read from the deployment's database
        lines.insert(1, f"  (read from the database; its lane is held by {_held(view['holder'])})")
    if source == "state_dir":
        lines.insert(1, "  (no server runs: read from the lane log; the watchdog runs only in "
                        "the owner)")  # fmt: skip
    print("\n".join(lines))
    return EXIT_OK


def _task_show_in_database(args: argparse.Namespace, task_id: str) -> int:
    found = [view for view in _in_database(args) if view["task_id"] == task_id]
    if not found:
        message = f"no task {task_id!r} in the database"
        return refused({"code": ReasonCode.TASK_UNKNOWN, "message": message})
    (view,) = found
    if args.json:
        print(JSON.encode({"source": "database", "task": view}).decode())
        return EXIT_OK
    lines = task_lines(view, None)
    lines.insert(1, f"  (read from the database; its lane is held by {_held(view['holder'])})")
    print("\n".join(lines))
    return EXIT_OK


def _held(holder: dict[str, Any] | None) -> str:
    """Who holds a task's lane, as the database says."""
    if holder is None:
        return "nobody"
    lease = "its lease runs" if holder["live"] else "its lease ran out"
    return f"{holder['host']} (epoch {holder['epoch']}, {lease})"


def finite(text: str) -> float:
    """A number of seconds JSON can carry (an argparse ``type``): ``inf`` and ``nan`` are a
    usage error (O17), never sent as JSON ``null``, which the server then read as another
    value than the one typed (the default, or a refusal naming ``null``)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _task_control(command: str, args: argparse.Namespace) -> int:
    request: dict[str, Any] = {"command": f"task_{command}", "task_id": args.task_id}
    if command == "reply":
        request |= {"text": args.text, "correlation": args.correlation}
    elif command == "grant":
        request |= {"epochs": args.epochs, "seconds": args.seconds, "reason": args.reason}
    else:
        request["reason"] = args.reason
    response = trio.run(admin_request, args.state_dir, request)
    if response is None:
        raise no_server(args.state_dir)
    if not response.get("ok"):
        return refused(response)
    view = response.get("task") or {}
    print(
        f"task {args.task_id}: {command} accepted; state {view.get('state')}, "
        f"{short_class(view.get('classification'))}"
    )
    return EXIT_OK


def _task_forget(args: argparse.Namespace) -> int:
    request = {"command": "task_forget", "task_id": args.task_id}
    state_dir, given = offline_target(args.state_dir, args.config)
    response = trio.run(admin_request, state_dir, request)
    if response is None:  # no server: the state directory itself, its lock taken
        settings = offline_settings(state_dir, given)  # RT14
        removed = trio.run(
            functools.partial(
                forget_offline,
                state_dir,
                args.task_id,
                settings=settings,
                clocks=Clocks.system(),
            )
        )
    elif not response.get("ok"):
        return refused(response)
    else:
        removed = list(response.get("removed") or [])
    print(f"task {args.task_id} forgotten; removed:")
    for item in removed:
        print(f"  {item}")
    return EXIT_OK


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
                print(event_line(event, scale), flush=True)
        after = int(answer.get("last", after))
        if answer.get("ended"):
            view: dict[str, Any] = answer["task"]
            return view


def _ended(view: dict[str, Any]) -> int:
    """Report how the task ended; the exit status (0 only for done)."""
    ended = view.get("ended") or {}
    state = ended.get("state")
    task_id = view.get("task_id")
    failure = view.get("failure")
    if not ended and failure:  # TL11: its lane stopped; the task stays unfinished
        logger.error(
            "task %s: its lane failed (%s): %s; it stays unfinished in its log, and the next "
            "start resumes it",
            task_id,
            failure.get("code"),
            failure.get("message"),
            extra={"code": ReasonCode.TASK_LANE_FAILED},
        )
        return EXIT_FAILED
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
    state_dir = args.state_dir = _state_dir(args)
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
        return refused(response)
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
            raise no_server(state_dir)
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
    config = load_room_config(args.config)
    if config.store.url is not None:  # (its tasks would not be in the deployment's database)
        raise ConfigError(
            "store.url",
            "a task run with no server runs on this state directory's file store; on a "
            "PostgreSQL deployment submit the task to a running server",
        )
    changes: dict[str, Any] = {"state_dir": str(Path(args.state_dir).absolute())}
    recorded = None if args.config is not None else recorded_settings(Path(args.state_dir))
    if recorded is not None:  # RT14 d: with no --config, the days and work root in force
        changes["retention"] = recorded.retention
        changes["work_root"] = str(Path(recorded.task_work_root).parent)
    if args.agent is not None:
        changes["agent"] = args.agent
    config = validate_config(msgspec.structs.replace(config, **changes))
    scale = args.unsafe_test_timescale  # 0 is refused, not "not given" (O15)
    timescale = 1.0 if scale is None else scale
    watchdog_policy(config, timescale=timescale)  # refused before anything starts (WD9)
    return trio.run(_standalone, config, spec, timescale)


async def _standalone(config: RoomWorkerConfig, spec: dict[str, Any], timescale: float) -> int:
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
