"""The RPC channel to one worker (Pi 1.6.0 or Fake-Pi) over its stdin and stdout: the Trio
shell around the pure protocol of :mod:`runtime._pi._rpc_protocol`.

:func:`open_rpc_channel` yields an :class:`RpcChannel` that runs a reader task, an answerer
for extension dialogs and, if given, a stderr drain. The invariants R1… are stated in
``docs/design/rpc.md`` and cited by ``tests/pi/test_rpc.py``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec
import trio

from .._errors import (
    RpcClosedError,
    RpcCommandError,
    RpcError,
    RpcLineTooLongError,
    WorkerExitedError,
    WorkerLaunchError,
)
from ._pijson import stringify
from ._rpc_protocol import (
    MAX_LINE,
    ChannelStatistics,
    Event,
    LineSplitter,
    Prompted,
    ProtocolState,
    Response,
    UiCancel,
    UiPolicy,
    UiReply,
    UiRequest,
    _disposition,
    cancel_dialogs,
    chat_text,
    ui_response,
)

__all__ = [
    "RpcChannel",
    "open_rpc_channel",
]

_CHUNK: Final = 65536
_STDERR_TAIL: Final = 64 * 1024
STDIN_STALL_SECONDS: Final = 10.0
"""How long one line's write may wait for a worker that does not read its stdin (R3): its
write is shielded, so without a bound a fence could never leave the block."""
_encoder: Final = msgspec.json.Encoder()


def _command_line(record: Mapping[str, Any]) -> bytes:
    """One command as a JSON line. Text holding a lone surrogate (a model's text read
    through ``_pijson.loads`` can) is written as ``JSON.stringify`` writes it, a ``\\udxxx``
    escape Pi's ``JSON.parse`` reads back: msgspec cannot encode it (R3)."""
    try:
        return _encoder.encode(record) + b"\n"
    except UnicodeEncodeError:
        return stringify(record) + b"\n"


# -- errors ------------------------------------------------------------------------------


# -- records ---------------------------------------------------------------------------


# -- pure core -------------------------------------------------------------------------


@dataclass
class _Slot:
    done: trio.Event = field(default_factory=trio.Event)
    response: Response | None = None
    settled_before: int = 0
    error: RpcError | None = None


class RpcChannel:
    """A live channel to one worker; made by :func:`open_rpc_channel`.

    Commands may be sent from many tasks at once; each line is written whole (R3). Events are
    read with ``async for event in channel`` or :meth:`next_event`, by one consumer, in stdout
    order; they are buffered without bound, so a consumer must keep reading (R4).
    """

    def __init__(
        self,
        stdin: trio.abc.SendStream,
        stdout: trio.abc.ReceiveStream,
        *,
        stderr: Callable[[], bytes] | None,
        ui_policy: UiPolicy,
        ui_timeout: float,
        max_line: int,
        exit_grace: float,
        stdin_stall: float = STDIN_STALL_SECONDS,
    ) -> None:
        self._stdin, self._stdout = stdin, stdout
        self._stdin_stall = stdin_stall
        self._stderr_capture = stderr
        self._stderr_tail = bytearray()
        self._stderr_done = trio.Event()
        self._ui_policy, self._ui_timeout, self._exit_grace = ui_policy, ui_timeout, exit_grace
        self._splitter = LineSplitter(max_line)
        self._state = ProtocolState()
        self._slots: dict[str, _Slot] = {}
        self._send_lock = trio.StrictFIFOLock()
        self._events_in, self._events_out = trio.open_memory_channel[Event](math.inf)
        self._ui_in, self._ui_out = trio.open_memory_channel[UiRequest](math.inf)
        self._changed = trio.Event()
        self._eof = trio.Event()
        self._exit_error: RpcError | None = None
        self._closing = self._stdin_closed = False
        self._ui_answered = 0
        self._dialogs_open = 0
        """Dialogs read and not yet answered (R8): stdin is not closed under them (R11)."""

    # -- commands --------------------------------------------------------------------

    async def request(self, command: Mapping[str, Any]) -> Response:
        """Send ``command`` (``type`` set, no ``id``) and return its successful response.

        Raises :class:`RpcCommandError` for ``success: false`` (Pi's text in ``pi_error``),
        :class:`WorkerExitedError` / :class:`WorkerLaunchError` if the worker's stdout ends
        first (R5, R6), :class:`RpcClosedError` once :meth:`aclose` began (``abort`` is still
        accepted then). If the caller is cancelled, the late response is dropped.
        """
        return (await self._call(command))[0]

    async def prompt(
        self, text: str, *, streaming_behavior: Literal["steer", "followUp"] | None = None
    ) -> Prompted:
        """Send chat ``text`` as a ``prompt``; a leading ``/`` is never run as a command (R9)."""
        command: dict[str, Any] = {"type": "prompt", "message": chat_text(text)}
        if streaming_behavior is not None:
            command["streamingBehavior"] = streaming_behavior
        response, settled_before = await self._call(command)
        return Prompted(
            disposition=_disposition(response),
            text=command["message"],
            settled_before=settled_before,
        )

    async def steer(self, text: str) -> str:
        """Queue chat ``text`` into the running turn (R9); returns Pi's disposition."""
        return _disposition(await self.request({"type": "steer", "message": chat_text(text)}))

    async def follow_up(self, text: str) -> str:
        """Queue chat ``text`` for when the run would stop (R9); returns Pi's disposition."""
        return _disposition(await self.request({"type": "follow_up", "message": chat_text(text)}))

    async def clear_queue(self) -> dict[str, Any]:
        """Take back every queued steer and follow-up (Pi's ``clear_queue``): the removed
        texts, ``{"steering": [...], "followUp": [...]}``."""
        response = await self.request({"type": "clear_queue"})
        return response.data if isinstance(response.data, dict) else {}

    async def abort(self) -> None:
        """Abort the run in flight and wait for the response, which Pi sends after the run's
        ``agent_settled{aborted: true}`` (R7); harmless when idle."""
        await self.request({"type": "abort"})

    # -- events ----------------------------------------------------------------------

    async def next_event(self) -> Event:
        """The next event. Once the worker's stdout ended and the buffer is empty, raises the
        reason: :class:`WorkerExitedError` (or a subclass), :class:`RpcLineTooLongError`, or
        :class:`RpcClosedError` after :meth:`aclose`."""
        try:
            return await self._events_out.receive()
        except trio.EndOfChannel:
            assert self._exit_error is not None
            raise self._exit_error from None

    def __aiter__(self) -> RpcChannel:
        return self

    async def __anext__(self) -> Event:
        """Like :meth:`next_event`, but iteration ends cleanly after :meth:`aclose`."""
        try:
            return await self.next_event()
        except RpcClosedError:
            raise StopAsyncIteration from None

    async def wait_settled(self, since: int) -> Event:
        """The first ``agent_settled`` event after ``since`` of them (``Prompted.settled_before``).

        Does not consume the event stream. Raises like :meth:`next_event` if stdout ends first.
        """
        await trio.lowlevel.checkpoint()
        while len(self._state.settled) <= since:
            if self._exit_error is not None:
                raise self._exit_error
            await self._changed.wait()
        return self._state.settled[since]

    @property
    def running(self) -> bool:
        """A run is in flight (R7)."""
        return self._state.running and self._exit_error is None

    @property
    def idle(self) -> bool:
        """No run in flight, no request pending and no dialog unanswered, or the worker is
        gone."""
        busy = self._state.running or self._slots or self._dialogs_open
        return self._exit_error is not None or not busy

    async def wait_idle(self) -> None:
        while not self.idle:
            await self._changed.wait()

    # -- closing ---------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close stdin once idle (R11), then wait up to ``exit_grace`` for stdout to end.

        Closing stdin during a run would abort it, so this first waits for ``agent_settled``
        and pending responses; new commands are refused meanwhile. Call :meth:`abort` first
        to stop a run. If cancelled while waiting, stdin stays open: the process owner kills
        the worker instead. Idempotent.
        """
        self._closing = True
        while True:  # a dialog may be read while the write lock is taken: then wait again
            await self.wait_idle()
            if await self._close_stdin(only_idle=True):
                break
        with trio.move_on_after(self._exit_grace):
            await self._eof.wait()

    # -- introspection ---------------------------------------------------------------

    @property
    def stderr_tail(self) -> bytes:
        """The last 64 KiB the worker wrote to stderr (when the channel drains it)."""
        return bytes(self._stderr_tail)

    def statistics(self) -> ChannelStatistics:
        state = self._state
        return ChannelStatistics(
            records=state.records,
            events_buffered=self._events_out.statistics().current_buffer_used,
            pending_requests=len(self._slots),
            running=self.running,
            settled=len(state.settled),
            ui_answered=self._ui_answered,
            malformed_lines=state.malformed,
            longest_line=self._splitter.longest,
            ended=self._eof.is_set(),
        )

    # -- internals -------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _call(self, command: Mapping[str, Any]) -> tuple[Response, int]:
        await trio.lowlevel.checkpoint()  # a checkpoint even when refused at once
        if self._exit_error is not None:
            raise self._exit_error
        if self._stdin_closed or (self._closing and command.get("type") != "abort"):
            raise RpcClosedError
        record = self._state.command(command)
        rid = record["id"]
        slot = self._slots[rid] = _Slot()
        try:
            try:
                await self._write(record)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                with trio.move_on_after(self._exit_grace):  # let the reader name the reason
                    await self._eof.wait()
                raise self._exit_error or WorkerExitedError(
                    "the worker's stdin is closed"
                ) from None
            await slot.done.wait()
        finally:
            if not slot.done.is_set():
                self._slots.pop(rid, None)
                self._state.abandon(rid)
                self._notify()
        if slot.error is not None:
            raise slot.error
        assert slot.response is not None
        if not slot.response.success:
            raise RpcCommandError(slot.response.command, slot.response.error)
        return slot.response, slot.settled_before

    async def _write(self, record: Mapping[str, Any]) -> None:
        """Write one line whole: shielded, so a cancelled caller never leaves half a line —
        but for at most ``stdin_stall`` seconds (R3): a worker that has stopped reading its
        stdin would otherwise hold even a fence's cancellation here for ever, and the tree
        would never be stopped (W10). Then stdin is closed (half a line may be in it: no
        later line may follow) and the worker is taken as gone."""
        data = _command_line(record)
        async with self._send_lock:
            if self._stdin_closed:
                raise trio.ClosedResourceError
            with trio.CancelScope(shield=True) as bounded:
                bounded.deadline = trio.current_time() + self._stdin_stall
                await self._stdin.send_all(data)
            if bounded.cancelled_caught:
                self._stdin_closed = True
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._stdin.aclose()
                gone = WorkerExitedError(
                    f"the worker has not read its stdin for {self._stdin_stall:g} s"
                )
                self._end(gone)  # taken as gone: every waiter learns it, not this one alone
                raise gone

    async def _close_stdin(self, *, only_idle: bool = False) -> bool:
        """Close stdin (under the write lock, so never inside a line); with ``only_idle``
        only if the worker is still idle once the lock is taken. Whether it is closed."""
        async with self._send_lock:
            if only_idle and not self.idle:
                return False
            if not self._stdin_closed:
                self._stdin_closed = True
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._stdin.aclose()
            return True

    async def _read(self) -> None:
        """The reader (R4): drains stdout, never awaits a consumer, a policy or stdin."""
        error: RpcError | None = None
        try:
            while data := await self._stdout.receive_some(_CHUNK):
                for line in self._splitter.feed(data):
                    self._dispatch(line)
                if self._splitter.overflowed:  # after the lines before the long one (R2)
                    raise RpcLineTooLongError(self._splitter.max_line)
            if (tail := self._splitter.finish()) is not None:
                self._dispatch(tail)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except RpcLineTooLongError as exc:
            error = exc
        if error is None:
            error = RpcClosedError() if self._stdin_closed else await self._exit_reason()
        self._end(error)

    def _end(self, error: RpcError) -> None:
        """Stdout ended (or the channel's block did): every waiter learns ``error``."""
        if self._exit_error is not None:
            return
        self._exit_error = error
        for slot in self._slots.values():
            slot.error = error
            slot.done.set()
        self._slots.clear()
        self._events_in.close()
        self._ui_in.close()
        self._eof.set()
        self._notify()

    def _dispatch(self, line: bytes) -> None:
        if self._exit_error is not None:  # the worker was taken as gone (R3): nobody listens
            return
        received = self._state.receive(line)
        if received.response is not None:
            slot = self._slots.pop(received.response.id or "", None)
            if slot is not None:
                slot.response, slot.settled_before = received.response, received.settled_before
                slot.done.set()
        if received.ui is not None:
            self._dialogs_open += 1
            self._ui_in.send_nowait(received.ui)
        if received.event is not None:
            self._events_in.send_nowait(received.event)
        self._notify()

    async def _exit_reason(self) -> WorkerExitedError:
        with trio.move_on_after(self._exit_grace):  # the process is exiting: stderr ends soon
            await self._stderr_done.wait()
        stderr = self._stderr_capture() if self._stderr_capture else self.stderr_tail
        if self._state.records == 0:
            return WorkerLaunchError(stderr=stderr)
        return WorkerExitedError(
            "the worker's stdout ended (it exited or was killed)", stderr=stderr
        )

    async def _drain_stderr(self, stream: trio.abc.ReceiveStream) -> None:
        try:
            while data := await stream.receive_some(_CHUNK):
                self._stderr_tail += data
                del self._stderr_tail[:-_STDERR_TAIL]
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._stderr_done.set()

    async def _answer_dialogs(self, nursery: trio.Nursery) -> None:
        async for request in self._ui_out:
            nursery.start_soon(self._answer, request)

    async def _answer(self, request: UiRequest) -> None:
        """Every dialog gets exactly one answer (R8): the policy's, or a cancel if the policy
        takes longer than ``ui_timeout`` or raises (the error then propagates)."""
        reply: UiReply = UiCancel()
        try:
            with trio.move_on_after(self._ui_timeout):
                reply = await self._ui_policy(request)
        finally:
            try:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._write(ui_response(request.id, reply))
                    self._ui_answered += 1  # only an answer that was written counts
            finally:
                self._dialogs_open -= 1
                self._notify()


@contextlib.asynccontextmanager
async def open_rpc_channel(
    stdin: trio.abc.SendStream,
    stdout: trio.abc.ReceiveStream,
    *,
    stderr: trio.abc.ReceiveStream | Callable[[], bytes] | None = None,
    ui_policy: UiPolicy = cancel_dialogs,
    ui_timeout: float = 60.0,
    max_line: int = MAX_LINE,
    exit_grace: float = 5.0,
    stdin_stall: float = STDIN_STALL_SECONDS,
) -> AsyncIterator[RpcChannel]:
    """Drive a worker over ``stdin``/``stdout`` for the duration of the block.

    ``stderr`` is the worker's stderr stream (drained continuously, its tail kept) or a
    function returning what the caller captured; either way it is quoted when the worker
    exits unexpectedly (R5, R6). ``ui_policy`` answers extension dialogs (default: cancel).

    Resource handling: when the block ends normally, :meth:`RpcChannel.aclose` runs (it waits
    for a running turn to settle, R11); when it ends with an error, stdin is closed only if
    the worker is idle. The streams' owner stops the process. Error handling: errors leave the
    block as themselves, never wrapped in an ExceptionGroup.
    """
    capture = None if isinstance(stderr, trio.abc.ReceiveStream) else stderr
    channel = RpcChannel(
        stdin,
        stdout,
        stderr=capture,
        ui_policy=ui_policy,
        ui_timeout=ui_timeout,
        max_line=max_line,
        exit_grace=exit_grace,
        stdin_stall=stdin_stall,
    )
    try:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(channel._read)
                nursery.start_soon(channel._answer_dialogs, nursery)
                if isinstance(stderr, trio.abc.ReceiveStream):
                    nursery.start_soon(channel._drain_stderr, stderr)
                else:
                    channel._stderr_done.set()
                try:
                    yield channel
                    await channel.aclose()
                finally:
                    if channel.idle:
                        with trio.move_on_after(exit_grace, shield=True):
                            await channel._close_stdin(only_idle=True)
                    nursery.cancel_scope.cancel()
        finally:
            # the reader may be cancelled before stdout ended (the epoch was fenced): a
            # consumer still waiting for an event learns the channel is gone, never hangs
            channel._end(RpcClosedError())
    except BaseExceptionGroup as group:
        error: BaseException = group
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        if error is group:
            raise
        raise error from None
