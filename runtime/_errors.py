"""One small error tree, each error carrying a stable reason code.

Reason codes are part of the public contract: they appear in results, logs, the
wire protocol and command exit messages. A code is never renamed or reused; new
codes are only added.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import NoReturn, ParamSpec, TypeVar

__all__ = [
    "AdminError",
    "AttachmentError",
    "ConfigError",
    "DeliveryError",
    "DiskFailedError",
    "GateError",
    "JournalError",
    "PiRuntimeError",
    "ProtocolError",
    "ReasonCode",
    "ReceiptRefusal",
    "ReplayMismatch",
    "RpcClosedError",
    "RpcCommandError",
    "RpcError",
    "RpcLineTooLongError",
    "SessionError",
    "StateDirError",
    "StateDirLockedError",
    "StepRefused",
    "TaskError",
    "WatchdogConfigError",
    "WorkerError",
    "WorkerExitedError",
    "WorkerLaunchError",
    "WorktreeError",
    "one_error",
    "raises_one_error",
    "reraise",
    "single_error",
]


class ReasonCode(enum.StrEnum):
    """Stable machine-readable reasons. Never rename, never reuse."""

    def at(self, what: str) -> str:
        """The composite code ``<code>:<what>``, e.g. ``recovery_refused:session``: the one
        place such codes are built."""
        return f"{self.value}:{what}"

    # journal damage and refusal (fail closed)
    JOURNAL_CORRUPT = "journal_corrupt"
    JOURNAL_VERSION_UNSUPPORTED = "journal_version_unsupported"
    JOURNAL_UNKNOWN_RECORD = "journal_unknown_record"
    JOURNAL_SEQUENCE_GAP = "journal_sequence_gap"
    JOURNAL_HEADER_MISSING = "journal_header_missing"
    JOURNAL_POISONED = "journal_poisoned"
    JOURNAL_CLOSED = "journal_closed"
    JOURNAL_CONFLICT = "journal_conflict"  # another writer appended that record first
    JOURNAL_IN_USE = "journal_in_use"  # the log is open already: a second create is refused
    LANE_FENCED = "lane_fenced"  # another host claimed the lane: this one's write is refused
    # the disk itself failed: the host stops admitting
    DISK_FAILED = "disk_failed"
    DISK_FULL = "disk_full"
    # the process (EMFILE) or the system (ENFILE) has no file descriptor left: not the
    # disk's fault; the lane that met it waits and tries again (docs/design/lanes.md L21)
    TOO_MANY_OPEN_FILES = "too_many_open_files"
    # the PostgreSQL journal store (docs/design/postgres-store.md); store_unavailable: the
    # database cannot be reached or failed, the host stops admitting (as for disk_failed)
    STORE_UNAVAILABLE = "store_unavailable"
    STORE_SCHEMA_MISSING = "store_schema_missing"
    STORE_SCHEMA_NEWER = "store_schema_newer"
    STORE_NOT_CONFIGURED = "store_not_configured"
    STORE_LOCKED = "store_locked"
    # state directory
    STATE_DIR_INSECURE = "state_dir_insecure"
    STATE_DIR_LOCKED = "state_dir_locked"
    STATE_DIR_INVALID = "state_dir_invalid"
    # Pi session files
    SESSION_MALFORMED = "session_malformed"
    SESSION_HEADER_INVALID = "session_header_invalid"
    SESSION_ENTRY_UNKNOWN = "session_entry_unknown"
    SESSION_MISSING = "session_missing"
    SESSION_TORN_TAIL = "session_torn_tail"
    SESSION_EXISTS = "session_exists"
    SESSION_ENTRY_INVALID = "session_entry_invalid"
    SESSION_CHANGED = "session_changed"
    SESSION_ATTESTATION_MISMATCH = "session_attestation_mismatch"
    # the RPC channel to a worker (docs/design/rpc.md)
    RPC_COMMAND_FAILED = "rpc_command_failed"
    RPC_CLOSED = "rpc_closed"
    RPC_LINE_TOO_LONG = "rpc_line_too_long"
    WORKER_EXITED = "worker_exited"
    WORKER_LAUNCH_FAILED = "worker_launch_failed"
    # worker process epochs and their process trees (docs/design/workers.md)
    WORKER_NOT_FOUND = "worker_not_found"
    WORKER_CONFIG_INVALID = "worker_config_invalid"
    WORKER_IDENTITY_MISMATCH = "worker_identity_mismatch"
    WORKER_TREE_SURVIVED = "worker_tree_survived"
    WORKER_RECORD_INVALID = "worker_record_invalid"
    PI_INSTALL_FAILED = "pi_install_failed"  # `pi-runtime pi install` (operations.md O19)
    PI_UNAVAILABLE = "pi_unavailable"  # `pi-runtime doctor`: no Pi, or its Node too old (O19)
    # the model gateway (docs/design/gateway.md)
    GATEWAY_UNAUTHORIZED = "gateway_unauthorized"
    GATEWAY_BAD_REQUEST = "gateway_bad_request"
    GATEWAY_UPSTREAM_KEY_MISSING = "gateway_upstream_key_missing"
    GATEWAY_UPSTREAM_INACTIVE = "gateway_upstream_inactive"
    GATEWAY_UPSTREAM_FAILED = "gateway_upstream_failed"
    # the tool gate (docs/design/gate.md)
    GATE_UNAUTHORIZED = "gate_unauthorized"
    GATE_BAD_REQUEST = "gate_bad_request"
    GATE_TOOL_REFUSED = "gate_tool_refused"
    GATE_TOOL_FAILED = "gate_tool_failed"  # a runtime tool raised: the model is told
    GATE_REPLAY_MISMATCH = "gate_replay_mismatch"
    GATE_JOURNAL_FAILED = "gate_journal_failed"
    GATE_UNREACHABLE = "gate_unreachable"
    # configuration (docs/design/config.md)
    CONFIG_INVALID = "config_invalid"
    # a retention pass with no server (docs/design/retention.md RT14)
    RETENTION_UNKNOWN = "retention_unknown"  # no server recorded its settings
    RETENTION_MISMATCH = "retention_mismatch"  # --config disagrees with the recorded ones
    # serve refused: pending deliveries the new configuration would strand (config.md C16)
    WORK_ROOT_CHANGED = "work_root_changed"  # admitted under another work_root
    FILE_STORE_PENDING = "file_store_pending"  # --store given; the file store has some
    # deliveries and room lanes (docs/design/lanes.md); results carry the turn codes
    ROOM_INVALID = "room_invalid"
    ROOM_REFUSED = "room_refused"
    DELIVERY_INVALID = "delivery_invalid"
    DELIVERY_CONFLICT = "delivery_conflict"
    DELIVERY_UNKNOWN = "delivery_unknown"
    DELIVERY_EXPIRED = "delivery_expired"
    QUEUE_FULL = "queue_full"
    NOT_ADMITTING = "not_admitting"
    TURN_STALLED = "turn_stalled"
    USAGE_LIMIT_REACHED = "usage_limit_reached"
    MODEL_FAILED = "model_failed"
    RESPONSE_MISSING = "response_missing"
    SILENCE_AFTER_TYPING = "silence_after_typing"
    RECOVERY_REFUSED = "recovery_refused"
    RECOVERY_EXHAUSTED = "recovery_exhausted"
    # the access token and the admin socket (docs/design/operations.md)
    TOKEN_INSECURE = "token_insecure"
    TOKEN_INVALID = "token_invalid"
    ADMIN_ALREADY_SERVING = "admin_already_serving"
    ADMIN_BAD_REQUEST = "admin_bad_request"
    ADMIN_UNKNOWN_COMMAND = "admin_unknown_command"
    ADMIN_REQUEST_TOO_LARGE = "admin_request_too_large"
    ADMIN_UNAUTHORIZED = "admin_unauthorized"
    ADMIN_TIMEOUT = "admin_timeout"
    ADMIN_FAILED = "admin_failed"
    SERVER_FAULT = "server_fault"  # the server failed on a frame (logged); the connection stays
    ADMIN_BAD_RESPONSE = "admin_bad_response"
    SERVER_NOT_RUNNING = "server_not_running"
    USAGE_INVALID = "usage_invalid"  # the command line could not be parsed (operations.md O17)
    IO_FAILED = "io_failed"  # the system refused a file or socket operation a command needed
    # the websocket wire protocol (docs/design/protocol.md): one code per bad frame
    NOT_JSON = "not_json"
    NOT_AN_OBJECT = "not_an_object"
    UNKNOWN_TYPE = "unknown_type"
    MISSING_FIELD = "missing_field"
    UNKNOWN_FIELD = "unknown_field"
    WRONG_TYPE = "wrong_type"
    FRAME_TOO_LARGE = "frame_too_large"
    BINARY_FRAME = "binary_frame"
    UNSUPPORTED_PROTOCOL = "unsupported_protocol"
    # transactional receipts and the document store (docs/design/receipts.md)
    DOCUMENT_INVALID = "document_invalid"
    DOCUMENT_STALE_BASE = "document_stale_base"
    DOCUMENT_UNKNOWN = "document_unknown"
    RECEIPT_KEY_CONFLICT = "receipt_key_conflict"
    RECEIPT_STORE_FAILED = "receipt_store_failed"
    # attachments (docs/design/attachments.md): the attach tool's refusals, a lost picture
    ATTACHMENT_ARGUMENTS = "attachment_arguments"  # no usable path, or a name not a string
    ATTACHMENT_OUTSIDE_WORKDIR = "attachment_outside_workdir"
    ATTACHMENT_SYMLINK = "attachment_symlink"
    ATTACHMENT_NOT_FILE = "attachment_not_file"
    ATTACHMENT_TOO_LARGE = "attachment_too_large"
    ATTACHMENT_TYPE_REFUSED = "attachment_type_refused"
    ATTACHMENT_LIMIT = "attachment_limit"  # the reply already carries [attachments] max_per_reply
    ATTACHMENT_MISSING = "attachment_missing"
    ATTACHMENT_DAMAGED = "attachment_damaged"
    ATTACHMENT_UNKNOWN = "attachment_unknown"
    # the websocket server (docs/design/serve.md)
    HELLO_REQUIRED = "hello_required"
    HELLO_TIMEOUT = "hello_timeout"  # no valid hello within [server] hello_seconds
    TOO_MANY_CONNECTIONS = "too_many_connections"  # [server] max_unauthenticated reached
    TOO_MANY_AUTHENTICATED = "too_many_authenticated"  # [server] max_authenticated reached
    ORIGIN_REFUSED = "origin_refused"
    TOO_MANY_IN_FLIGHT = "too_many_in_flight"
    # the operator page (docs/design/operations.md "The operator page")
    LOGIN_REQUIRED = "login_required"
    LOGIN_THROTTLED = "login_throttled"
    CSRF_REFUSED = "csrf_refused"
    PAGE_INSECURE = "page_insecure"
    PAGE_HOST_REFUSED = "page_host_refused"
    PAGE_NOT_FOUND = "page_not_found"
    PAGE_METHOD = "page_method"
    PAGE_BUSY = "page_busy"
    PAGE_FAILED = "page_failed"
    # the metrics and page listener's HTTP refusals (docs/design/operations.md M7)
    HTTP_MALFORMED = "http_malformed"  # 400: not HTTP/1.1 the listener can read
    HTTP_BODY_TOO_LARGE = "http_body_too_large"  # 413
    HTTP_HEAD_TOO_LARGE = "http_head_too_large"  # 431
    HTTP_UNSUPPORTED = "http_unsupported"  # 501: a transfer coding it cannot read
    HTTP_NOT_ACCEPTABLE = "http_not_acceptable"  # 406: an Accept the metrics cannot answer
    METRICS_FAILED = "metrics_failed"  # 500: a scrape that failed (logged with its traceback)
    # a task lane's worktree evidence: manifest and candidate checkpoint (docs/design/watchdog.md)
    WORKTREE_MISSING = "worktree_missing"
    WORKTREE_LEASED = "worktree_leased"
    WORKTREE_CHANGED = "worktree_changed"
    WORKTREE_UNREADABLE = "worktree_unreadable"
    WORKTREE_TOO_LARGE = "worktree_too_large"  # over the manifest's size bounds (W-M12)
    CHECKPOINT_FAILED = "checkpoint_failed"
    # task lanes: submission, controls, the watchdog (docs/design/watchdog.md)
    TASK_INVALID = "task_invalid"
    TASK_UNKNOWN = "task_unknown"
    TASK_ELSEWHERE = "task_elsewhere"  # another host of the deployment holds its lane
    HOST_LOST = "host_lost"  # its host's lease ran out; its session is not on this host
    TASK_CONFLICT = "task_conflict"
    TASK_NOT_DONE = "task_not_done"
    TASK_NOT_WAITING = "task_not_waiting"
    TASK_NOT_HELD = "task_not_held"
    TASK_ENDED = "task_ended"
    TASK_NOT_ENDED = "task_not_ended"  # forget: only an ended task is forgotten (RT12)
    TASK_EXPIRED = "task_expired"  # its id was retained past idempotency_days (RT12)
    TASK_LATE = "task_late"
    TASK_LANE_FAILED = "task_lane_failed"
    # the public entry points (docs/design/lanes.md L16: one typed error, never a group)
    HOST_FAILED = "host_failed"
    WATCHDOG_CONFIG_INVALID = "watchdog_config_invalid"


class PiRuntimeError(Exception):
    """Base of every error the runtime raises on purpose.

    ``code`` is the stable reason; ``str(error)`` says what happened and, where
    there is something to do, what to do.
    """

    code: ReasonCode

    def __init__(self, code: ReasonCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class JournalError(PiRuntimeError):
    """A journal file is damaged, from the future, poisoned or closed.

    ``path`` is relative to the state directory where known; ``offset`` is the
    byte offset of the first record that could not be accepted.
    """

    def __init__(
        self,
        code: ReasonCode,
        message: str,
        *,
        path: str | None = None,
        offset: int | None = None,
    ) -> None:
        where = ""
        if path is not None:
            where = f" ({path}" + (f" at offset {offset}" if offset is not None else "") + ")"
        super().__init__(code, message + where)
        self.path = path
        self.offset = offset


class DiskFailedError(JournalError):
    """The disk refused a write or a sync (EIO, ENOSPC, ...): stop admitting."""


class StateDirError(PiRuntimeError):
    """The state directory is missing, unsafe or unusable."""


class StateDirLockedError(StateDirError):
    """Another live process owns the state directory."""

    def __init__(self, message: str, *, owner_pid: int) -> None:
        super().__init__(ReasonCode.STATE_DIR_LOCKED, message)
        self.owner_pid = owner_pid


class SessionError(PiRuntimeError):
    """A Pi session file cannot be read or extended as asked."""

    def __init__(
        self, code: ReasonCode, message: str, *, path: str | None = None, line: int | None = None
    ) -> None:
        where = ""
        if path is not None:
            where = f" ({path}" + (f" line {line}" if line is not None else "") + ")"
        super().__init__(code, message + where)
        self.path = path
        self.line = line


class WorkerError(PiRuntimeError):
    """A worker process epoch could not be launched, proven or stopped whole.

    ``code`` is one of the ``worker_*`` reasons; ``stderr`` holds the tail of the
    worker's standard error when it exited during the launch.
    """

    def __init__(self, code: ReasonCode, message: str, *, stderr: bytes = b"") -> None:
        super().__init__(code, message)
        self.stderr = stderr


class WorktreeError(PiRuntimeError):
    """A task's worktree evidence could not be taken: ``worktree_missing`` (no such
    directory), ``worktree_unreadable`` (a file or git could not read it),
    ``worktree_changed`` (it changed while a candidate was taken) or
    ``checkpoint_failed`` (the candidate commit or archive could not be written)."""


class ConfigError(PiRuntimeError):
    """The configuration is invalid (``config_invalid``); ``setting`` names the offending
    setting as a dotted path (``thresholds.stall_seconds``, ``rooms."dm:1".grants``)."""

    def __init__(
        self, setting: str, message: str, *, code: ReasonCode = ReasonCode.CONFIG_INVALID
    ) -> None:
        super().__init__(code, f"{setting}: {message}")
        self.setting = setting


class AdminError(PiRuntimeError):
    """A request through the admin socket failed on the client's side: ``admin_timeout``,
    ``admin_bad_response`` or ``server_not_running``; refusals *by* the server come back as
    its ``{"ok": false, "code": …}`` response instead."""


class DeliveryError(PiRuntimeError):
    """A delivery (or a command about one) was refused; nothing was admitted. ``code`` is
    ``room_invalid``, ``room_refused``, ``delivery_invalid``, ``delivery_conflict``,
    ``delivery_unknown``, ``delivery_expired`` (its idempotency record is past retention,
    docs/design/retention.md RT4), ``queue_full`` or ``not_admitting``."""


class AttachmentError(PiRuntimeError):
    """An attachment's bytes cannot be sent (``fetch_attachment``): ``attachment_unknown``
    (no result this connection may see names it), ``attachment_missing`` or
    ``attachment_damaged``."""


class ProtocolError(PiRuntimeError):
    """A client sent a frame the wire protocol refuses; nothing was admitted. ``code`` is
    one of the protocol codes (``not_json`` ... ``unsupported_protocol``); ``ref`` is the
    ``delivery_id`` or the frame type the refusal answers, when it can be known."""

    def __init__(self, code: ReasonCode, message: str, ref: str | None = None) -> None:
        super().__init__(code, message)
        self.ref = ref


class GateError(PiRuntimeError):
    """The gate could not record a decision or an outcome (``gate_*`` reason codes)."""


class RpcError(PiRuntimeError):
    """Base of the channel's errors."""


class RpcCommandError(RpcError):
    """The worker answered ``success: false``; ``pi_error`` is its error text verbatim."""

    def __init__(self, command: str, pi_error: str | None) -> None:
        self.command = command
        self.pi_error = pi_error or ""
        super().__init__(ReasonCode.RPC_COMMAND_FAILED, f"{command!r} failed: {self.pi_error}")


class RpcClosedError(RpcError):
    """The channel was closed (``aclose``) and takes no more commands."""

    def __init__(self) -> None:
        super().__init__(ReasonCode.RPC_CLOSED, "the RPC channel is closed")


class RpcLineTooLongError(RpcError):
    """A stdout line grew past the limit; the channel stops reading (R2)."""

    def __init__(self, limit: int) -> None:
        super().__init__(ReasonCode.RPC_LINE_TOO_LONG, f"a stdout line exceeds {limit} bytes")


class WorkerExitedError(RpcError):
    """The worker's stdout ended while the channel was open (R5); ``stderr`` is its tail."""

    def __init__(
        self, message: str, *, stderr: bytes = b"", code: ReasonCode = ReasonCode.WORKER_EXITED
    ) -> None:
        text = stderr.decode("utf-8", "replace").strip()
        super().__init__(code, message + (f"; its stderr ends with:\n{text}" if text else ""))
        self.stderr = stderr


class WorkerLaunchError(WorkerExitedError):
    """The worker exited before it wrote anything, e.g. Pi with a broken extension (R6)."""

    def __init__(self, *, stderr: bytes) -> None:
        super().__init__(
            "the worker exited before it answered anything; check its command line, "
            "environment and extensions (-e), or start it by hand to see why",
            stderr=stderr,
            code=ReasonCode.WORKER_LAUNCH_FAILED,
        )


class StepRefused(PiRuntimeError):
    """A request the gateway refuses and goes on serving (409, which the worker does not
    retry): unlike a journal failure (G12) it says nothing about the journal's health."""


class ReplayMismatch(StepRefused):
    """A replayed turn asked for a model request the journal did not answer at that step
    (G13, docs/design/recovery.md "a mismatch fails closed"): refused, never sent upstream."""


class ReceiptRefusal(PiRuntimeError):
    """A definite refusal: the transaction rolled back and the call can never apply as
    given, so it settles as a tool error with :attr:`code` (R3, R4, R2)."""


class TaskError(PiRuntimeError):
    """A task request refused, with a stable reason code."""


class WatchdogConfigError(ConfigError):
    """The ``[watchdog]`` table breaks a rule of WD9 (``watchdog_config_invalid``);
    ``setting`` is ``watchdog.<setting>`` (or ``unsafe_test_timescale``)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(setting, message, code=ReasonCode.WATCHDOG_CONFIG_INVALID)


# ---------------------------------------- out of file descriptors (docs/design/lanes.md L21)

_EXHAUSTED_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})
"""No file descriptor left, in the process or the system: a resource, not the disk."""


def descriptors_exhausted(error: BaseException) -> bool:
    """Whether ``error`` is the want of a file descriptor (``EMFILE``/``ENFILE``), the only
    reason it was raised: an ``OSError`` with that errno, a runtime error carrying the code
    ``too_many_open_files`` (a log refused for it, a worker that could not be launched for
    it), or a group of such (what a nursery raises; a cancellation in it is the group's own
    business, not a cause). Not a disk failure, nor a poison, nor a worker's death: what
    met it is tried again once descriptors are free (L21)."""
    if isinstance(error, BaseExceptionGroup):
        leaves = _leaves(error)
        return all(descriptors_exhausted(leaf) for leaf in leaves) and bool(leaves)
    if isinstance(error, PiRuntimeError):
        return error.code is ReasonCode.TOO_MANY_OPEN_FILES
    return isinstance(error, OSError) and error.errno in _EXHAUSTED_ERRNOS


# ---------------------------------------- one error out of a public API (docs/design/lanes.md L16)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for error in group.exceptions:
        found.extend(_leaves(error) if isinstance(error, BaseExceptionGroup) else [error])
    return found


def one_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """What a public entry point raises instead of ``group`` (L16: no ``ExceptionGroup``
    leaks): its only exception, however deeply wrapped, as itself; for several, one
    :class:`PiRuntimeError` with the first typed one's code (``host_failed`` when none is
    typed) and the group as its cause. A group holding anything that is not an
    ``Exception`` (a cancellation, an interrupt: Trio's and the caller's to handle) is
    returned as it is."""
    leaves = _leaves(group)
    if any(not isinstance(error, Exception) for error in leaves):
        return group
    if len(leaves) == 1:
        return leaves[0]
    typed = [error for error in leaves if isinstance(error, PiRuntimeError)]
    code = typed[0].code if typed else ReasonCode.HOST_FAILED
    error = PiRuntimeError(code, f"{len(leaves)} failures at once; the first: {leaves[0]}")
    error.__cause__ = group
    return error


@contextlib.contextmanager
def single_error() -> Iterator[None]:
    """Raise :func:`one_error` of any exception group the block raises; a lone exception
    keeps its own context and cause (it is re-raised as itself)."""
    try:
        yield
    except BaseExceptionGroup as group:
        error = one_error(group)
        if error is group:
            raise
        reraise(error)


def reraise(error: BaseException) -> NoReturn:
    """Raise ``error`` as itself, out of the group that held it, with its own context and
    cause kept (a bare ``raise error`` in an ``except`` block would chain the group)."""
    context, cause, suppress = error.__context__, error.__cause__, error.__suppress_context__
    try:
        raise error
    finally:
        error.__context__, error.__cause__ = context, cause
        error.__suppress_context__ = suppress
        del error


_P = ParamSpec("_P")
_T = TypeVar("_T")


def raises_one_error(
    open_: Callable[_P, contextlib.AbstractAsyncContextManager[_T]],
) -> Callable[_P, contextlib.AbstractAsyncContextManager[_T]]:
    """An ``async with`` entry point whose block — its own start, its tasks and the
    caller's body — raises one exception, never a group (:func:`single_error`)."""

    @functools.wraps(open_)
    @contextlib.asynccontextmanager
    async def opened(*args: _P.args, **kwargs: _P.kwargs) -> AsyncIterator[_T]:
        with single_error():
            async with open_(*args, **kwargs) as value:
                yield value

    return opened
