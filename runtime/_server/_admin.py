"""The admin socket: how commands reach the server that owns a state directory
(docs/design/journal.md).

A Unix socket ``<state>/admin.sock`` (0600, in the 0700 state directory) speaking JSON lines:
one request object per connection, one response object back, then the server closes::

    → {"command": "status"}
    ← {"ok": true, ...the handler's status...}
    → {"command": "cancel", "delivery_id": "d1"}
    ← {"ok": false, "code": "delivery_unknown", "message": "no delivery d1"}

While a handler works on its answer the server sends a blank line every
:data:`KEEPALIVE_SECONDS`; the client skips them and gives up only after
:data:`CLIENT_TIMEOUT` seconds with nothing received. So the client waits as long as the
server's own deadline for the command — a ``cancel``'s follows the configured abort grace
(O7) — and no longer.

:func:`serve_admin` runs the server side until cancelled, answering through an
:class:`AdminHandler` (the ``serve`` command passes one over its room worker) and, for the
``task_*`` and ``tasks`` commands, a :class:`TaskAdminHandler` (its task service; a server
without one refuses them ``admin_unknown_command``);
:func:`admin_request` is the client side (``pi-runtime status``, ``pi-runtime cancel``). The
invariants (O5…) are in ``docs/design/operations.md``.

Security: the socket is reachable only by its owner (file mode 0600 inside the private state
directory), and the server also checks the peer's uid (``SO_PEERCRED``). No token travels here.

Socket paths are limited to 107 bytes; a longer state directory path is reached through
``/proc/self/fd/<directory fd>/admin.sock`` (Linux), so the socket always lives in the state
directory, where the CLI finds it from ``--state-dir`` alone.

Error handling: a bad request is answered ``{"ok": false, "code": …}`` with a stable code and
never reaches the handler; a handler error becomes ``admin_failed`` (or its own code when it
is a :class:`~runtime._errors.PiRuntimeError`); nothing a client sends stops the server.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import secrets
import socket
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Final, Literal, Protocol, get_args

import msgspec
import trio

from .._boundary._http import drain
from .._config import Thresholds
from .._errors import AdminError, PiRuntimeError, ReasonCode, StateDirError
from .._journal._store import _check_private
from .._journal._writer import TMP_MARK
from .._logs import fields
from ._protocol import GrantEpochs, GrantSeconds, ValidationTimeout

__all__ = [
    "ADMIN_SOCKET",
    "COMMANDS",
    "MAX_ID_CHARS",
    "MAX_REQUEST",
    "AdminHandler",
    "TaskAdminHandler",
    "admin_request",
    "admin_socket_path",
    "answer",
    "handler_deadline",
    "id_problem",
    "serve_admin",
]

ADMIN_SOCKET: Final = "admin.sock"
MAX_ID_CHARS: Final = 200
"""Longest ``task_id`` or ``delivery_id`` a request may carry (:func:`id_problem`)."""
MAX_REQUEST: Final = 64 * 1024
"""Longest request line, in bytes (a longer one is ``admin_request_too_large``)."""
MAX_RESPONSE: Final = 64 * 1024 * 1024
"""Longest response the client reads (a status of many pending deliveries fits)."""
REQUEST_TIMEOUT: Final = 5.0
"""A connection that has not sent its whole request by then is answered ``admin_timeout``."""
HANDLER_TIMEOUT: Final = 30.0
"""A handler that has not answered by then is cancelled; the answer is ``admin_timeout``.
A ``cancel`` gets the abort grace on top (:func:`handler_deadline`)."""
DEFAULT_ABORT_GRACE: Final = Thresholds().abort_grace_seconds
"""The abort grace a server is given when its caller names none (the configuration's
default ``thresholds.abort_grace_seconds``)."""
KEEPALIVE_SECONDS: Final = 10.0
"""While a handler works, a blank line this often, so the client knows the server is still
at it (less than :data:`CLIENT_TIMEOUT`)."""
CLIENT_TIMEOUT: Final = 40.0
"""How long :func:`admin_request` waits with nothing received (a keepalive counts)."""
_SEND_TIMEOUT: Final = 5.0
_MAX_SUN_PATH: Final = 107
_PEERCRED: Final = struct.Struct("3i")

logger = logging.getLogger("runtime.admin")


class AdminHandler(Protocol):
    """What the admin socket asks of the server. Each method returns a JSON-encodable dict
    that becomes the response (with ``"ok": true``); a :class:`PiRuntimeError` it raises
    becomes ``{"ok": false, "code": error.code, "message": error.message}``."""

    async def status(self) -> dict[str, Any]: ...

    async def cancel(self, delivery_id: str) -> dict[str, Any]: ...


class TaskAdminHandler(Protocol):
    """What the task commands ask of the server (``runtime/_tasks/_service.py``'s
    ``TaskService``); the same conventions as :class:`AdminHandler`."""

    async def task_submit(self, request: dict[str, Any]) -> dict[str, Any]: ...

    async def task_list(self) -> dict[str, Any]: ...

    async def task_show(self, task_id: str) -> dict[str, Any]: ...

    async def task_reply(
        self, task_id: str, text: str, correlation: str | None = None
    ) -> dict[str, Any]: ...

    async def task_control(
        self,
        task_id: str,
        action: Literal["resume", "abort", "fail", "grant"],
        *,
        reason: str | None = None,
        epochs: int = 0,
        seconds: float = 0.0,
    ) -> dict[str, Any]: ...

    async def task_wait(
        self, task_id: str, after: int = 0, seconds: float = 10.0
    ) -> dict[str, Any]: ...

    async def task_forget(self, task_id: str) -> dict[str, Any]: ...


# -- requests ----------------------------------------------------------------------------


class _Request(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="command", forbid_unknown_fields=True
):
    pass


class StatusRequest(_Request, tag="status", frozen=True, kw_only=True):
    pass


class CancelRequest(_Request, tag="cancel", frozen=True, kw_only=True):
    delivery_id: str


class TaskSubmitRequest(_Request, tag="task_submit", frozen=True, kw_only=True):
    task_id: str
    prompt: str
    worktree: str
    grants: list[str] | None = None
    validation: list[str] | None = None
    validation_timeout: ValidationTimeout | None = None
    """Seconds the validation may run (``task run --validation-timeout``): above 0, at most
    the task lanes' bound (the websocket's own type, protocol.md P18; else
    ``admin_bad_request`` naming the field, O7); absent or null: the default."""


class TaskRunRequest(TaskSubmitRequest, tag="task_run", frozen=True, kw_only=True):
    """``task_run`` is ``task_submit`` (the name ``pi-runtime task run`` sends)."""


class TasksRequest(_Request, tag="tasks", frozen=True, kw_only=True):
    pass


class TaskShowRequest(_Request, tag="task_show", frozen=True, kw_only=True):
    task_id: str


class TaskReplyRequest(_Request, tag="task_reply", frozen=True, kw_only=True):
    task_id: str
    text: str
    correlation: str | None = None


class TaskResumeRequest(_Request, tag="task_resume", frozen=True, kw_only=True):
    task_id: str
    reason: str | None = None


class TaskAbortRequest(TaskResumeRequest, tag="task_abort", frozen=True, kw_only=True):
    pass


class TaskFailRequest(TaskResumeRequest, tag="task_fail", frozen=True, kw_only=True):
    pass


class TaskForgetRequest(_Request, tag="task_forget", frozen=True, kw_only=True):
    """Remove what is left of an ended task, its candidate too (RT12)."""

    task_id: str


class TaskGrantRequest(_Request, tag="task_grant", frozen=True, kw_only=True):
    task_id: str
    epochs: GrantEpochs = 0
    """0 to one grant's bound of epochs (the websocket's own type, protocol.md P18; else
    ``admin_bad_request`` naming the field, O7)."""
    seconds: GrantSeconds = 0.0
    """0 to one grant's bound of seconds (likewise)."""
    reason: str


class TaskWaitRequest(_Request, tag="task_wait", frozen=True, kw_only=True):
    """Block until the task has an event numbered above ``after`` or has ended (at most
    ``seconds``, at most 25): how ``pi-runtime task run --wait`` follows a task."""

    task_id: str
    after: Annotated[int, msgspec.Meta(ge=0)] = 0
    seconds: Annotated[float, msgspec.Meta(ge=0, le=25)] = 10.0


_TaskRequest = (
    TaskSubmitRequest
    | TaskRunRequest
    | TasksRequest
    | TaskShowRequest
    | TaskReplyRequest
    | TaskResumeRequest
    | TaskAbortRequest
    | TaskFailRequest
    | TaskGrantRequest
    | TaskWaitRequest
    | TaskForgetRequest
)
_AnyRequest = StatusRequest | CancelRequest | _TaskRequest
_TASK_TYPES: Final[tuple[type[_Request], ...]] = get_args(_TaskRequest)
_TASK_COMMANDS: Final = frozenset(str(t.__struct_config__.tag) for t in _TASK_TYPES)
COMMANDS: Final = frozenset({"status", "cancel"}) | _TASK_COMMANDS
"""Every command the admin socket answers."""
_REQUEST: Final = msgspec.json.Decoder(_AnyRequest)
_LOOSE: Final = msgspec.json.Decoder(Any)
_ENCODER: Final = msgspec.json.Encoder()


def _refusal(code: ReasonCode | str, message: str) -> dict[str, Any]:
    return {"ok": False, "code": str(code), "message": message}


def _parse(line: bytes, commands: frozenset[str] = COMMANDS) -> _AnyRequest | dict[str, Any]:
    """The request, or the refusal to answer with (O7)."""
    try:
        loose = _LOOSE.decode(line)
    except msgspec.DecodeError:
        return _refusal(ReasonCode.ADMIN_BAD_REQUEST, "a request is one JSON object on one line")
    except RecursionError:  # nested deeper than the decoder goes: no request is (O7)
        return _refusal(ReasonCode.ADMIN_BAD_REQUEST, "a request is not nested this deep")
    if not isinstance(loose, dict):
        return _refusal(ReasonCode.ADMIN_BAD_REQUEST, "a request is a JSON object")
    command = loose.get("command")
    if not isinstance(command, str) or command not in commands:
        return _refusal(
            ReasonCode.ADMIN_UNKNOWN_COMMAND,
            f"unknown command {command!r}; known: {', '.join(sorted(commands))}",
        )
    try:
        request = _REQUEST.decode(line)
    except msgspec.ValidationError as exc:
        return _refusal(ReasonCode.ADMIN_BAD_REQUEST, f"{command}: {exc}")
    for name in ("delivery_id", "task_id"):
        value = getattr(request, name, None)
        if value is not None and (problem := id_problem(name, value)) is not None:
            return _refusal(ReasonCode.ADMIN_BAD_REQUEST, f"{command}: {problem}")
    return request


def id_problem(name: str, value: str) -> str | None:
    """Why ``value`` is no ``name`` (``task_id``, ``delivery_id``) a request may carry, or
    ``None``: an id is 1 to ``MAX_ID_CHARS`` printable characters (O7; the operator page's
    views check theirs with it too, OP7). What is answered for one is ``admin_bad_request``."""
    if 0 < len(value) <= MAX_ID_CHARS and value.isprintable():
        return None
    return f"{name} must be 1 to {MAX_ID_CHARS} printable characters"


# -- paths -------------------------------------------------------------------------------


def admin_socket_path(state_dir: Path | str) -> Path:
    return Path(state_dir).absolute() / ADMIN_SOCKET


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """An address for ``path`` that fits a socket address (107 bytes): the path itself, or
    the same file through an open descriptor of its directory."""
    if len(os.fsencode(path)) <= _MAX_SUN_PATH:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


# -- the server --------------------------------------------------------------------------


def _probe(address: str) -> bool:
    """Whether a server accepts connections at ``address``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(2.0)
    try:
        probe.connect(address)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            return False
        raise
    finally:
        probe.close()
    return True


def _bind(state_dir: Path | str) -> tuple[socket.socket, Path, os.stat_result]:
    """Bind and listen at ``<state>/admin.sock`` (O5, O6); blocking.

    The socket is bound under a temporary name, made 0600, then renamed over ``admin.sock``
    (replacing a stale one atomically) and only then listens: no client ever reaches a socket
    with a wider mode.
    """
    path = admin_socket_path(state_dir)
    _check_private(path.parent)
    with _address(path) as address:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(info.st_mode):
                raise StateDirError(
                    ReasonCode.STATE_DIR_INVALID,
                    f"{path} exists and is not a socket; remove it",
                )
            if _probe(address):
                raise StateDirError(
                    ReasonCode.ADMIN_ALREADY_SERVING,
                    f"a server already answers on {path}; stop it before starting another "
                    "on this state directory",
                )
    tmp_path = path.parent / f"{ADMIN_SOCKET}{TMP_MARK}{secrets.token_hex(4)}"
    # the temporary name is longer than admin.sock: its own address (a path that fits, or
    # the directory's descriptor), or one of 95 to 107 bytes fits while its temporary does not
    with _address(tmp_path) as tmp_address:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(tmp_address)
            try:
                os.chmod(tmp_path, 0o600)
                os.rename(tmp_path, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp_path)
                raise
            sock.listen(socket.SOMAXCONN)
            bound = os.lstat(path)
        except BaseException:
            sock.close()
            raise
    return sock, path, bound


def _unbind(path: Path, bound: os.stat_result) -> None:
    """Remove the socket file if it is still the one this server bound."""
    with contextlib.suppress(OSError):
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino):
            os.unlink(path)


def _peer_uid(stream: trio.SocketStream) -> int:
    data = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    _pid, uid, _gid = _PEERCRED.unpack(data)
    return int(uid)


async def serve_admin(
    state_dir: Path | str,
    handler: AdminHandler,
    *,
    tasks: TaskAdminHandler | None = None,
    abort_grace: float = DEFAULT_ABORT_GRACE,
    task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer admin requests on ``<state>/admin.sock`` until cancelled; the task commands
    through ``tasks`` (without it they are ``admin_unknown_command``). ``abort_grace`` is
    the server's ``thresholds.abort_grace_seconds``: a ``cancel`` may wait that long for its
    abort (lanes.md L13), so its handler gets that much more time (:func:`handler_deadline`).

    ``task_status.started(path)`` once the socket listens. Raises
    :class:`~runtime._errors.StateDirError` ``admin_already_serving`` when a live server
    answers there already (a stale socket of a dead server is replaced), ``state_dir_insecure``
    / ``state_dir_invalid`` for an unsafe state directory.

    Resource handling: on the way out (cancellation) the listener closes and the socket file
    is removed, if it is still the one this call bound. Connections run in their own tasks;
    a connection's failure is logged and never ends the server.
    """
    sock, path, bound = await trio.to_thread.run_sync(_bind, state_dir)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    try:
        async with trio.open_nursery() as nursery:
            task_status.started(path)
            await trio.serve_listeners(
                functools.partial(_serve_connection, handler, tasks, abort_grace),
                [listener],
                handler_nursery=nursery,
            )
    finally:
        with trio.CancelScope(shield=True):
            await listener.aclose()
            await trio.to_thread.run_sync(_unbind, path, bound)


async def _serve_connection(
    handler: AdminHandler,
    tasks: TaskAdminHandler | None,
    abort_grace: float,
    stream: trio.SocketStream,
) -> None:
    try:
        async with stream:
            response = await _answer(handler, tasks, stream, abort_grace)
            if response is None:
                return
            with trio.move_on_after(_SEND_TIMEOUT):
                await stream.send_all(_ENCODER.encode(response) + b"\n")
            if response.get("ok") is False:  # refused, perhaps unread: read what came first
                with trio.move_on_after(_SEND_TIMEOUT):
                    await drain(stream, MAX_REQUEST)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the client went away: nothing to answer
    except Exception:
        logger.exception("admin connection failed", extra=fields("admin_connection_failed"))


async def _answer(
    handler: AdminHandler,
    tasks: TaskAdminHandler | None,
    stream: trio.SocketStream,
    abort_grace: float,
) -> dict[str, Any] | None:
    """The response to one connection's request (``None``: it sent nothing)."""
    if _peer_uid(stream) != os.geteuid():
        return _refusal(ReasonCode.ADMIN_UNAUTHORIZED, "only the server's own user may ask")
    line: bytes | None = None
    with trio.move_on_after(REQUEST_TIMEOUT):
        line = await _read_line(stream, MAX_REQUEST)
    if line is None:
        return _refusal(ReasonCode.ADMIN_TIMEOUT, f"no complete request in {REQUEST_TIMEOUT} s")
    if len(line) > MAX_REQUEST:
        return _refusal(
            ReasonCode.ADMIN_REQUEST_TOO_LARGE, f"a request is at most {MAX_REQUEST} bytes"
        )
    if not line.strip():
        return None
    response: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_keep_alive, stream)
        response = await answer(handler, tasks, line, abort_grace=abort_grace)
        nursery.cancel_scope.cancel()
    return response


async def _keep_alive(stream: trio.SocketStream) -> None:
    """A blank line every :data:`KEEPALIVE_SECONDS` until cancelled (the answer is ready);
    a client gone or not reading ends them, never the handler's work."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        while True:
            await trio.sleep(KEEPALIVE_SECONDS)
            with trio.move_on_after(_SEND_TIMEOUT) as unsent:
                await stream.send_all(b"\n")  # one byte: sent whole, or not at all
            if unsent.cancelled_caught:
                return


async def answer(
    handler: AdminHandler,
    tasks: TaskAdminHandler | None,
    line: bytes,
    *,
    commands: frozenset[str] = COMMANDS,
    abort_grace: float = DEFAULT_ABORT_GRACE,
) -> dict[str, Any]:
    """The response to one request ``line`` (a JSON object): checked (O7), then answered by
    the handlers within :func:`handler_deadline` — what the command line's requests and the
    operator page's controls both go through. A command not in ``commands`` is
    ``admin_unknown_command``."""
    request = _parse(line, commands)
    if isinstance(request, dict):
        return request
    if isinstance(request, _TASK_TYPES) and tasks is None:
        return _refusal(
            ReasonCode.ADMIN_UNKNOWN_COMMAND,
            f"{request.__struct_config__.tag}: this server runs no task lanes",
        )
    return await _dispatch(handler, tasks, request, handler_deadline(request, abort_grace))


def handler_deadline(request: object, abort_grace: float) -> float:
    """Seconds the handler has to answer ``request`` (O7): :data:`HANDLER_TIMEOUT`; a
    ``cancel`` that much past ``abort_grace``, since the lane waits up to the grace —
    shielded: the cancel happens whatever the caller does — for a running delivery's abort
    (lanes.md L13). With no more than the grace, a cancel whose abort took it all would be
    answered ``admin_timeout`` although it happened."""
    return HANDLER_TIMEOUT + (abort_grace if isinstance(request, CancelRequest) else 0.0)


async def _call(
    handler: AdminHandler, tasks: TaskAdminHandler | None, request: _AnyRequest
) -> dict[str, Any]:
    if isinstance(request, CancelRequest):
        return await handler.cancel(request.delivery_id)
    if isinstance(request, StatusRequest):
        return await handler.status()
    assert tasks is not None
    if isinstance(request, TaskSubmitRequest):
        return await tasks.task_submit(msgspec.to_builtins(request))
    if isinstance(request, TasksRequest):
        return await tasks.task_list()
    if isinstance(request, TaskShowRequest):
        return await tasks.task_show(request.task_id)
    if isinstance(request, TaskReplyRequest):
        return await tasks.task_reply(request.task_id, request.text, request.correlation)
    if isinstance(request, TaskGrantRequest):
        return await tasks.task_control(
            request.task_id,
            "grant",
            reason=request.reason,
            epochs=request.epochs,
            seconds=request.seconds,
        )
    if isinstance(request, TaskWaitRequest):
        return await tasks.task_wait(request.task_id, request.after, request.seconds)
    if isinstance(request, TaskForgetRequest):
        return await tasks.task_forget(request.task_id)
    action: Literal["resume", "abort", "fail"] = (
        "abort"
        if isinstance(request, TaskAbortRequest)
        else "fail"
        if isinstance(request, TaskFailRequest)
        else "resume"
    )
    return await tasks.task_control(request.task_id, action, reason=request.reason)


async def _dispatch(
    handler: AdminHandler, tasks: TaskAdminHandler | None, request: _AnyRequest, deadline: float
) -> dict[str, Any]:
    result: object = None
    waited = trio.move_on_after(deadline)
    try:
        with waited:
            result = await _call(handler, tasks, request)
    except PiRuntimeError as error:
        return _refusal(error.code, error.message)
    except Exception:
        logger.exception(
            "admin handler failed on %s",
            type(request).__name__,
            extra=fields("admin_failed", code=ReasonCode.ADMIN_FAILED),
        )
        return _refusal(ReasonCode.ADMIN_FAILED, "the server failed to answer; see its log")
    if not isinstance(result, dict) and waited.cancel_called:
        return _refusal(ReasonCode.ADMIN_TIMEOUT, f"no answer within {deadline:g} s")
    try:
        if not isinstance(result, dict):  # nothing, a list, …: no response (O7)
            raise TypeError(f"an answer is a JSON object, not {type(result).__name__}")
        msgspec.json.encode(result)
    except (TypeError, msgspec.EncodeError):
        logger.exception(
            "admin handler answered with data that is not a JSON object",
            extra=fields("admin_failed", code=ReasonCode.ADMIN_FAILED),
        )
        return _refusal(ReasonCode.ADMIN_FAILED, "the server failed to answer; see its log")
    return {**result, "ok": True}


async def _read_line(stream: trio.abc.ReceiveStream, limit: int) -> bytes:
    """Bytes up to the first newline (or the end of the stream); more than ``limit`` bytes
    without a newline returns what was read so far (the caller refuses it)."""
    buffer = bytearray()
    while True:
        end = buffer.find(b"\n")
        if end >= 0:
            return bytes(buffer[:end])
        if len(buffer) > limit:
            return bytes(buffer)
        chunk = await stream.receive_some(65536)
        if not chunk:
            return bytes(buffer)
        buffer += chunk


# -- the client --------------------------------------------------------------------------


async def admin_request(state_dir: Path | str, request: dict[str, Any]) -> dict[str, Any] | None:
    """Send one request to the server owning ``state_dir``; its response, or ``None`` when no
    server listens there (no socket, or a stale one) (O8).

    Raises :class:`~runtime._errors.AdminError` ``admin_timeout`` when the server sends
    nothing for :data:`CLIENT_TIMEOUT` seconds — while it works on the answer it sends
    keepalives, so the wait follows the server's own deadline for the command, a
    ``cancel``'s too, whatever its abort grace (wrap the call in ``trio.fail_after`` for
    less) — and ``admin_bad_response`` when the answer is not a response.
    """
    path = admin_socket_path(state_dir)
    timeout = CLIENT_TIMEOUT
    try:
        with trio.fail_after(timeout):
            stream = await _connect(path)
            if stream is None:
                return None
        async with stream:
            with trio.fail_after(timeout), contextlib.suppress(trio.BrokenResourceError):
                # a server refusing a request closes early; its answer is still readable
                await stream.send_all(_ENCODER.encode(request) + b"\n")
            try:
                line = await _read_response(stream, MAX_RESPONSE, timeout)
            except trio.BrokenResourceError:
                line = b""
    except trio.TooSlowError:
        raise AdminError(
            ReasonCode.ADMIN_TIMEOUT,
            f"the server at {path} sent nothing for {timeout:g} s",
        ) from None
    try:
        response = _LOOSE.decode(line)
    except msgspec.DecodeError:
        response = None
    if not isinstance(response, dict) or not isinstance(response.get("ok"), bool):
        raise AdminError(
            ReasonCode.ADMIN_BAD_RESPONSE, f"the server at {path} did not answer with a response"
        )
    return response


async def _read_response(stream: trio.abc.ReceiveStream, limit: int, idle: float) -> bytes:
    """The response line, the server's keepalives (blank lines) skipped; like
    :func:`_read_line` otherwise. Raises :class:`trio.TooSlowError` after ``idle`` seconds
    with nothing received."""
    buffer = bytearray()
    while True:
        end = buffer.find(b"\n")
        if end == 0:  # a keepalive: the server is still at it
            del buffer[:1]
            continue
        if end > 0:
            return bytes(buffer[:end])
        if len(buffer) > limit:
            return bytes(buffer)
        with trio.fail_after(idle):
            chunk = await stream.receive_some(65536)
        if not chunk:
            return bytes(buffer)
        buffer += chunk


async def _connect(path: Path) -> trio.SocketStream | None:
    try:
        with _address(path) as address:
            return await trio.open_unix_socket(address)
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK, errno.ENOTDIR):
            return None
        raise
