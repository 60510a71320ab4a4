"""Task lanes as a service: the runner built from the room worker's configuration (issue #8).

:func:`open_task_service` is what ``pi-runtime serve`` (beside its room worker, on the same
store) and a standalone ``pi-runtime task run`` open: a :class:`~runtime._tasks._runner.TaskRunner`
whose epochs are real worker processes (:class:`~runtime._tasks._workers.ProcessWorkers`, Fake-Pi
or the real Pi as configured) behind a per-epoch gateway and gate, with

* the configuration's model route; without ``model.base_url`` the plain scripted model of
  Fake-Pi is served here, as the room worker does;
* an upstream whose inactivity bound is the hard threshold of the (scaled) policy, so a dead
  upstream stream is ended by the gateway first (docs/design/watchdog.md, layered remedies);
* the gate sockets in the state directory's short runtime directory (one per lane);
* the :class:`~runtime._tasks._watchdog.WatchdogPolicy` of the ``[watchdog]`` table, checked at
  start (WD9, ``_policy.py``).

:class:`TaskService` adds what the wire protocol and the admin socket need on top of the
runner: an event history per task (``task_wait`` follows it), plain-dict answers for the admin
socket, a status summary. (The lane logs of a state directory no server runs on are read by
``_view.py``'s ``offline_views``.)

Resource handling: everything runs in the service's own nursery (the embedded model, the event
collector, the runner's lanes); leaving the block cancels it, which stops every epoch's tree and
leaves unfinished tasks in their logs for the next start.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any, Final, Literal

import msgspec
import trio

from .._boundary._gateway import GatewayConfig
from .._boundary._receipts import ReceiptStore
from .._clock import Clocks
from .._config import RetentionConfig, RoomWorkerConfig, validate_config
from .._errors import JournalError, ReasonCode, TaskError, raises_one_error
from .._hosting import start_model, worker_program
from .._journal._interface import JournalStore
from .._journal._store import Store, runtime_dir
from .._logs import fields
from .._records import TaskEnded
from .._retention import RetentionSettings, join_settings
from .._wire import DEFAULT_TASK_GRANTS, TaskEvent, TaskSpec, TaskView
from ._policy import policy_dict, timescale_marker, timescale_warning, watchdog_policy
from ._runner import DuplicateElsewhere, SharedTasks, TaskRunner, open_task_runner
from ._view import store_view, store_views
from ._watchdog import WatchdogPolicy
from ._workers import ProcessWorkers

__all__ = [
    "HISTORY_LIMIT",
    "TaskService",
    "open_task_service",
    "task_spec",
]

HISTORY_LIMIT: Final = 1000
"""Task events kept per task for ``task_wait`` (older ones are dropped, counted)."""
WAIT_LIMIT: Final = 25.0
"""The longest one ``task_wait`` blocks (the admin socket answers within 30 s)."""

logger = logging.getLogger("runtime.tasks")


# -- plain data ------------------------------------------------------------------------------


def task_spec(request: dict[str, Any]) -> TaskSpec:
    """A :class:`TaskSpec` from plain data (the wire, the admin socket): ``grants`` and
    ``validation`` may be absent or null. Raises ``task_invalid``."""
    data = {k: v for k, v in request.items() if v is not None and k not in ("type", "command")}
    data.setdefault("grants", sorted(DEFAULT_TASK_GRANTS))
    try:
        return msgspec.convert(data, TaskSpec)
    except msgspec.ValidationError as error:
        raise TaskError(ReasonCode.TASK_INVALID, str(error)) from error


# -- the service -------------------------------------------------------------------------------


class TaskService:
    """A task runner plus what the wire and the admin socket need; from
    :func:`open_task_service`."""

    def __init__(
        self,
        runner: TaskRunner,
        policy: WatchdogPolicy,
        production: WatchdogPolicy,
        retention: RetentionConfig | None = None,
    ) -> None:
        self.runner = runner
        self.retention = retention or RetentionConfig()
        """What ``[retention]`` keeps of ended tasks (RT12)."""
        self.policy = policy
        """The policy in effect (scaled under the unsafe time scale)."""
        self.production = production
        """The same configuration at scale 1 (what ``task show`` prints as production)."""
        self._history: dict[str, list[TaskEvent]] = {}
        self._dropped: dict[str, int] = {}
        self._changed = trio.Event()

    @property
    def warning(self) -> str | None:
        """The loud line of the unsafe test time scale, or ``None`` at production scale."""
        return timescale_warning(self.policy)

    # -- typed API ---------------------------------------------------------------------

    async def submit(self, spec: TaskSpec | dict[str, Any]) -> tuple[TaskView, bool]:
        """Submit (idempotent by task id): the view, and whether the task was new."""
        if not isinstance(spec, TaskSpec):
            spec = task_spec(spec)
        try:
            view, new = await self.runner.admit(spec)
        except DuplicateElsewhere as duplicate:  # S30: admitted by another host already
            if duplicate.view is None:
                raise
            return duplicate.view, False
        return view, new

    def show(self, task_id: str) -> TaskView:
        """Every diagnostic of one task (``task_unknown`` if there is none)."""
        return self.runner.show(task_id)  # an ended task's lane is rebuilt from its log

    def tasks(self) -> list[TaskView]:
        """Every task of the state directory, ended ones too, by id."""
        return self.runner.tasks()

    def rows(self, task_ids: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Every task's overview, by id — of ``task_ids`` only, in that order, when given:
        what the operator page's task table shows (the fields of ``tasks()``'s views, built
        without them)."""
        return self.runner.rows(task_ids)

    def ends(self) -> dict[str, bool]:
        """Every task's id, by id, and whether it has ended, built without its row."""
        return self.runner.ends()

    def classifications(self) -> dict[str, tuple[str, str]]:
        """Every task's id, by id, with its classification and state, built without its
        row: where the operator page's timelines start."""
        return self.runner.classifications()

    async def reply(self, task_id: str, text: str, correlation: str | None = None) -> TaskView:
        """Answer the task's ``task_wait`` (its correlation, default: the open one); refused
        ``task_not_waiting`` when it waits for nothing or for another correlation."""
        await self.runner.reply(task_id, text, correlation)
        return self.show(task_id)

    def events(
        self, buffer: int = 256
    ) -> contextlib.AbstractAsyncContextManager[trio.MemoryReceiveChannel[TaskEvent]]:
        """A channel of every task's changes (classification, state, hold, end) while the
        block runs; events beyond ``buffer`` unread are dropped, never the runtime's work."""
        return self.runner.events(buffer)

    async def ended(self, task_id: str) -> TaskEnded:
        """Wait until the task ends; its end record (``state`` ``done``, ``failed``,
        ``aborted`` or ``held``, with the candidate and validation of a ``done``)."""
        return await self.runner.wait(task_id)

    async def control(
        self,
        task_id: str,
        action: Literal["resume", "abort", "fail", "grant"],
        *,
        reason: str | None = None,
        epochs: int = 0,
        seconds: float = 0.0,
    ) -> TaskView:
        """An operator control with its stable refusals (``task_unknown``, ``task_ended``,
        ``task_not_held``, ``task_late``, ``task_invalid``)."""
        if action == "resume":
            self.runner.resume(task_id)
            logger.info(
                "task %s: resumed by the operator (%s)",
                task_id,
                reason or "no reason",
                extra=fields("task_resumed", task=task_id),
            )
        elif action == "abort":
            await self.runner.abort(task_id, reason or "aborted by the operator")
        elif action == "fail":
            await self.runner.fail(task_id, reason or "failed by the operator")
        elif action == "grant":
            if not reason:
                raise TaskError(ReasonCode.TASK_INVALID, "a grant needs a reason (it is audited)")
            await self.runner.grant(task_id, epochs=epochs, seconds=seconds, reason=reason)
        else:
            raise TaskError(ReasonCode.TASK_INVALID, f"unknown action {action!r}")
        return self.show(task_id)

    async def forget(self, task_id: str) -> list[str]:
        """Remove what is left of an ended task now, its candidate too (RT12): a later
        submission under its id is ``task_expired``. Refused ``task_not_ended``,
        ``task_unknown``, ``task_expired``. What was removed."""
        removed = await self.runner.forget(task_id, self.retention)
        self._let_go([task_id])
        logger.info(
            "task %s: forgotten by the operator",
            task_id,
            extra=fields("task_forgotten", task=task_id),
        )
        return removed

    async def _retain_periodically(self) -> None:
        """Retention of ended tasks (RT12) now and every ``[retention] sweep_hours``; a
        failure is logged and the next look tries again."""
        while True:
            try:
                done = await self.runner.retain(self.retention)
            except Exception:
                logger.exception(
                    "task retention failed; the next pass tries again",
                    extra=fields("task_retention_failed"),
                )
            else:
                self._let_go(done.expired)
                if done.slimmed or done.expired:
                    logger.info(
                        "task retention: %d ended tasks slimmed, %d expired",
                        len(done.slimmed),
                        len(done.expired),
                        extra=fields("task_retention"),
                    )
                for task_id, why in done.left:
                    logger.warning(
                        "task retention left task %s for the next pass: %s",
                        task_id,
                        why,
                        extra=fields("task_retention_left", task=task_id),
                    )
            await trio.sleep(self.retention.sweep_hours * 3600)

    def _let_go(self, task_ids: Iterable[str]) -> None:
        """Forget the event history of tasks expired or forgotten (their ids are
        ``task_expired`` now): a service that runs for months keeps only what it can show."""
        for task_id in task_ids:
            self._history.pop(task_id, None)
            self._dropped.pop(task_id, None)

    def events_of(self, task_id: str, after: int = 0) -> tuple[list[TaskEvent], int]:
        """The task's events numbered above ``after`` (1-based, as counted since the service
        started), and the number of the last one."""
        history = self._history.get(task_id, [])
        dropped = self._dropped.get(task_id, 0)
        last = dropped + len(history)
        start = max(0, after - dropped)
        return history[start:], last

    async def wait(self, task_id: str, after: int = 0, seconds: float = WAIT_LIMIT) -> bool:
        """Return once the task has an event numbered above ``after`` or has ended, or after
        ``seconds``; whether it has ended."""
        if not self.runner.known(task_id):
            self.runner.show(task_id)  # task_unknown
        with trio.move_on_after(max(0.0, min(seconds, WAIT_LIMIT))):
            while not self._ended(task_id) and self.events_of(task_id, after)[1] <= after:
                await self._changed.wait()
        return self._ended(task_id)

    def _ended(self, task_id: str) -> bool:
        """The task has ended — or its lane failed, which nothing ends here (TL11) — and
        its last event (if it ran here) is in the history."""
        if self.runner.has_failed(task_id):
            return True
        if not self.runner.has_ended(task_id):
            return False
        history = self._history.get(task_id)
        return not history or history[-1].ended is not None

    def status(self) -> dict[str, Any]:
        """A summary for ``status``: each task's state and classification, the time scale."""
        report: dict[str, Any] = {
            "tasks": [_summary(view) for view in self.tasks()],
            "unsafe_test_timescale": self.policy.timescale,
        }
        if self.warning is not None:
            report["warning"] = self.warning
        return report

    # -- the admin socket's task commands (runtime/_server/_admin.py) ------------------------------

    async def task_submit(self, request: dict[str, Any]) -> dict[str, Any]:
        view, new = await self.submit(request)
        return {"task": self._view(view), "disposition": "started" if new else "duplicate"}

    async def task_list(self) -> dict[str, Any]:
        """Every task of this host; on a shared store every task of the deployment (S30),
        each with the host holding it (``holder``), ``deployment`` true — or, when the
        database cannot be read now, this host's with ``deployment_error`` saying why."""
        listed = [self._view(v) for v in self.tasks()]
        shared = self.runner.shared
        if shared is None:
            await trio.lowlevel.checkpoint()
            return {"tasks": listed, **self._scale()}
        for data in listed:
            lane = self.runner.lanes.get(data["task_id"])
            lease = lane.lease if lane is not None else None
            data["holder"] = (
                None if lease is None else {"host": lease.owner, "epoch": lease.epoch, "live": True}
            )
        try:
            found = await store_views(shared.store, self.policy)
        except (JournalError, OSError) as error:
            return {"tasks": listed, "deployment_error": str(error), **self._scale()}
        here = {data["task_id"] for data in listed}
        listed += [
            self._view(view) | {"holder": holder}
            for view, holder in found
            if view.task_id not in here
        ]
        listed.sort(key=lambda data: str(data["task_id"]))
        return {"tasks": listed, "deployment": True, **self._scale()}

    async def task_show(self, task_id: str) -> dict[str, Any]:
        """One task's view; on a shared store one this host does not hold is read from the
        database, with the host holding it (``holder``, S30)."""
        try:
            view = self.show(task_id)
        except TaskError as error:
            shared = self.runner.shared
            if shared is None or error.code not in (
                ReasonCode.TASK_ELSEWHERE,
                ReasonCode.TASK_UNKNOWN,
            ):
                raise
            try:
                found = await store_view(shared.store, task_id, self.policy)
            except (JournalError, OSError):
                raise error from None  # (the host's own answer, naming the holder it knows)
            if found is None:
                raise
            return {"task": self._view(found[0]) | {"holder": found[1]}, **self._scale()}
        await trio.lowlevel.checkpoint()
        return {"task": self._view(view), **self._scale()}

    async def task_reply(
        self, task_id: str, text: str, correlation: str | None = None
    ) -> dict[str, Any]:
        return {"task": self._view(await self.reply(task_id, text, correlation))}

    async def task_control(
        self,
        task_id: str,
        action: Literal["resume", "abort", "fail", "grant"],
        *,
        reason: str | None = None,
        epochs: int = 0,
        seconds: float = 0.0,
    ) -> dict[str, Any]:
        view = await self.control(task_id, action, reason=reason, epochs=epochs, seconds=seconds)
        return {"task": self._view(view), "action": action}

    async def task_forget(self, task_id: str) -> dict[str, Any]:
        return {"task_id": task_id, "removed": await self.forget(task_id)}

    async def task_wait(
        self, task_id: str, after: int = 0, seconds: float = 10.0
    ) -> dict[str, Any]:
        ended = await self.wait(task_id, after, seconds)
        events, last = self.events_of(task_id, after)
        return {
            "events": [msgspec.to_builtins(e) for e in events],
            "last": last,
            "ended": ended,
            "task": self._view(self.show(task_id)),
            **self._scale(),
        }

    def _view(self, view: TaskView) -> dict[str, Any]:
        data: dict[str, Any] = msgspec.to_builtins(view)
        data["production"] = policy_dict(self.production)
        return data

    def _scale(self) -> dict[str, Any]:
        scale: dict[str, Any] = {"unsafe_test_timescale": self.policy.timescale}
        if self.warning is not None:
            scale["warning"] = self.warning
        return scale

    # -- the event history ---------------------------------------------------------------

    async def _collect(self, *, task_status: trio.TaskStatus[None]) -> None:
        async with self.runner.events(buffer=10_000) as events:
            task_status.started()
            async for event in events:
                history = self._history.setdefault(event.task_id, [])
                history.append(event)
                if len(history) > HISTORY_LIMIT:
                    del history[0]
                    self._dropped[event.task_id] = self._dropped.get(event.task_id, 0) + 1
                self._changed.set()
                self._changed = trio.Event()


_TASK_OF: Final = re.compile(r"^task (\S+?):? ")


def _log_line(text: str) -> None:
    """A task lane's line (``TaskHost.log``) as a log event ``task_lane``, with its task."""
    found = _TASK_OF.match(text)
    logger.info("%s", text, extra=fields("task_lane", task=found[1] if found else None))


def _summary(view: TaskView) -> dict[str, Any]:
    return {
        "task_id": view.task_id,
        "state": view.state,
        "classification": view.classification,
        "phase": view.phase,
        "process_epoch": view.process_epoch,
        "silence_seconds": view.silence_seconds,
        "silence_watched": view.silence_watched,
        "hold_reason": view.hold_reason,
        "ended": view.ended.get("state") if view.ended else None,
        "next_action": view.next_action,
    }


@raises_one_error
@contextlib.asynccontextmanager
async def open_task_service(
    config: RoomWorkerConfig,
    *,
    store: JournalStore,
    receipts: ReceiptStore | None = None,
    clocks: Clocks | None = None,
    timescale: float = 1.0,
    log: Callable[[str], None] | None = None,
    shared: SharedTasks | None = None,
) -> AsyncIterator[TaskService]:
    """Run task lanes on ``store`` with ``config``'s worker, model and ``[watchdog]`` policy
    (divided by ``timescale``) until the block ends; unfinished tasks are resumed at once.

    ``config`` is validated here (``ConfigError`` naming the setting); the state is
    ``store``'s (``config.state_dir`` is not read), the work directories are below
    ``config.work_root``. ``shared``: ``store`` is several hosts', whose task lanes are held
    under leases (docs/design/scale-out.md S30-S32). Raises :class:`WatchdogConfigError`
    before anything starts when the policy breaks a rule, :class:`ConfigError` when the real
    Pi is configured but not installed."""
    config = validate_config(config)
    policy = watchdog_policy(config, timescale=timescale)
    production = watchdog_policy(config) if timescale != 1.0 else policy
    program = worker_program(config)
    clocks = clocks or store.clocks
    model = config.model
    work_root = Path(config.work_root) / "tasks"
    state_dir = store.root
    say = log or _log_line
    warning = timescale_warning(policy)

    def line(text: str) -> None:
        """Every line of the task lanes says so under the unsafe time scale (WD9)."""
        say(text if warning is None or "UNSAFE" in text else f"{timescale_marker(policy)} {text}")

    async with trio.open_nursery() as nursery:
        base_url, route = await start_model(model, nursery)
        inactivity = min(policy.hard_seconds.values())
        upstream = GatewayConfig(
            upstream_url=base_url,
            upstream_key_env=model.api_key_env,
            keepalive_interval=min(config.thresholds.keepalive_seconds, inactivity / 2),
            upstream_inactivity=inactivity,
            upstream_data_inactivity=inactivity,
            park_unavailable=config.backoff.enabled,  # PB6
        )
        workers = ProcessWorkers(  # one gate socket per lane, named by its key
            program=program,
            route=route,
            upstream=upstream,
            socket_dir=await trio.to_thread.run_sync(runtime_dir, state_dir),
            state_dir=state_dir,
        )
        if warning is not None:
            (log or logger.warning)(warning)
        if isinstance(store, Store):  # the task passes act with the directory's (RT14 d)
            await join_settings(store, RetentionSettings.of(config))
        async with open_task_runner(
            store,
            workers=workers,
            route=route,
            policy=policy,
            clocks=clocks,
            upstream=upstream,
            receipts=receipts,
            ledger=work_root / "effects.jsonl",
            work_root=work_root,
            log=line,
            shared=shared,
            backoff=config.backoff,
        ) as runner:
            service = TaskService(runner, policy, production, config.retention)
            await nursery.start(service._collect)
            nursery.start_soon(service._retain_periodically)
            try:
                yield service
            finally:
                nursery.cancel_scope.cancel()
