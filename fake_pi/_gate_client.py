"""Fake-Pi's client of the runtime's tool gate (``runtime/_boundary/_gate.py``): a ToolGate over
its socket.

The same protocol as the real Pi's extension (``runtime/_boundary/pi_extension/gate.ts``): JSON over
HTTP/1.1 on a Unix socket, ``POST /before`` and ``POST /after`` with
``authorization: Bearer <secret>``. Configured from the environment the runtime sets
(:data:`GATE_SOCKET_ENV`, :data:`GATE_SECRET_ENV`); :func:`gate_from_environ` removes the
secret from the environment it is given, so the tools Fake-Pi runs never see it.

Error handling: a gate that cannot be reached or answers an error fails closed — ``before``
returns :class:`~fake_pi._gate.Refused` with the reason, so the tool does not run. A failed
``after`` is written to stderr (Fake-Pi's loop cannot change a result after the tool ran); as
with Pi's extension, every ``before`` names the call reported last (``follows``), and the gate
refuses the call while that call's outcome is missing in its delivery and epoch
(docs/design/gate.md T21). A ``/before`` is asked in a task of its own, so a call aborted while
the gate decides it still reads the answer, and reports "Operation aborted" (what Fake-Pi's
loop records) when the gate let it run (T23). A ``/before`` that got no answer (the connection
failed: the gate may have let it run) is reported the same way, with the result Fake-Pi
records for the call, aborted or not (T24). A runtime tool's call, which the gate runs whatever
the worker does, is not given up on an abort once asked: its answer is the call's result (T25).
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Final

import h11
import msgspec
import trio

from runtime.worker_kit import RUNTIME_TOOLS

from ._gate import TOOL_ABORTED_TEXT, GateDecision, Refused, Run, SavedResult, ToolCall, ToolResult

__all__ = [
    "GATE_SECRET_ENV",
    "GATE_SOCKET_ENV",
    "GateClientError",
    "RuntimeGate",
    "gate_from_environ",
    "post_json",
]

GATE_SOCKET_ENV: Final = "PI_RUNTIME_GATE_SOCKET"
GATE_SECRET_ENV: Final = "PI_RUNTIME_GATE_SECRET"
_READ: Final = 65536
_GRACE: Final = 5.0
"""How long an aborted call's report may still take (as ``run_tool_call``'s ``after``)."""


@dataclass(slots=True)
class _Asked:
    """One ``/before`` on its way: its answer (or error) once ``done``; ``abandoned`` set by a
    caller aborted meanwhile, and set by the report once made (T23)."""

    done: trio.Event = field(default_factory=trio.Event)
    answer: Any = None
    error: GateClientError | None = None
    abandoned: trio.Event | None = None


class GateClientError(Exception):
    """The gate could not be reached or did not answer 200."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def unanswered(self) -> bool:
        """Whether no answer the gate could have meant came (the connection failed, or a 200
        whose body is not JSON): the gate may have acted on the request (T24). An answer that
        is not 200 says it did not."""
        return self.status is None or self.status == 200


async def post_json(
    socket_path: str, target: str, body: Any, *, secret: str | None
) -> tuple[int, Any]:
    """One ``POST`` on a fresh connection to a Unix socket; ``(status, decoded JSON body)``."""
    try:
        stream = await trio.open_unix_socket(socket_path)
    except OSError as error:
        raise GateClientError(f"cannot connect to {socket_path}: {error}") from error
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        data = msgspec.json.encode(body)
        headers = [
            ("host", "gate"),
            ("content-type", "application/json"),
            ("content-length", str(len(data))),
        ]
        if secret is not None:
            headers.append(("authorization", f"Bearer {secret}"))
        try:
            await stream.send_all(
                conn.send(h11.Request(method="POST", target=target, headers=headers))
                + conn.send(h11.Data(data=data))
                + conn.send(h11.EndOfMessage())
            )
            status = 0
            payload = bytearray()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(bytes(await stream.receive_some(_READ)))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    payload += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise GateClientError("the gate closed the connection")
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as error:
            raise GateClientError(f"request to the gate failed: {error}") from error
    try:
        decoded = msgspec.json.decode(bytes(payload)) if payload else None
    except msgspec.DecodeError as error:
        raise GateClientError(f"the gate answered non-JSON: {error}", status) from error
    return status, decoded


def _result(value: Any) -> ToolResult:
    if not isinstance(value, dict) or not isinstance(value.get("content"), list):
        raise GateClientError(f"a malformed result from the gate: {value!r}")
    details = value.get("details")
    return ToolResult(
        content=value["content"],
        is_error=value.get("isError") is True,
        details=details if isinstance(details, dict) else None,
    )


@dataclass(frozen=True, slots=True)
class RuntimeGate:
    """A :class:`~fake_pi._gate.ToolGate` that asks the runtime's gate."""

    socket_path: str
    secret: str = ""
    _follows: list[str] = field(default_factory=list, compare=False)
    """The tool-call id of the call reported last (empty before the first): what every
    ``/before`` names as ``follows`` (T21)."""
    _pending: list[trio.Event] = field(default_factory=list, compare=False)
    """Set once the report of a call aborted while the gate decided it is done (T23): the next
    ``/before`` waits for it, as for any report (T18)."""

    def __repr__(self) -> str:  # never show the secret
        return f"RuntimeGate(socket_path={self.socket_path!r})"

    async def _post(self, target: str, body: dict[str, Any]) -> Any:
        status, answer = await post_json(self.socket_path, target, body, secret=self.secret)
        if status != 200:
            raise GateClientError(f"tool gate {target}: HTTP {status}: {answer}", status)
        return answer

    async def before(self, call: ToolCall) -> GateDecision:
        for pending in list(self._pending):  # T18: an abandoned call's report comes first
            await pending.wait()
        body = {"tool_call_id": call.id, "name": call.name, "args": call.arguments}
        if self._follows:
            body["follows"] = self._follows[0]
        asked = _Asked()
        # T23: asked outside the caller's scope, so an abort cannot drop the request unanswered
        trio.lowlevel.spawn_system_task(self._ask, call, body, asked)
        try:
            await asked.done.wait()
        except trio.Cancelled:  # aborted while the gate decides: Fake-Pi records "aborted"
            if call.name in RUNTIME_TOOLS:
                # T25: but a runtime tool is the gate's to run, and an abort cannot stop it
                # there: its answer is the call's result, aborted or not, as with Pi
                with trio.CancelScope(shield=True):
                    await asked.done.wait()
                return self._decision(call, asked)
            if asked.done.is_set():
                with trio.CancelScope(shield=True, deadline=trio.current_time() + _GRACE):
                    await self._abandoned(call, asked)
            else:
                asked.abandoned = trio.Event()
                self._pending.append(asked.abandoned)
            raise
        if asked.error is not None:  # fail closed: the tool does not run
            refused = ToolResult.text(_failed(call, asked.error), is_error=True)
            if self._reports(call, asked.error):  # T24: the gate may have let it run
                with trio.CancelScope(shield=True, deadline=trio.current_time() + _GRACE):
                    await self.after(call, refused)  # an abort meanwhile: still reported
            return Refused(refused)
        return self._decision(call, asked)

    @staticmethod
    def _decision(call: ToolCall, asked: _Asked) -> GateDecision:
        """The decision ``asked``'s answer holds; a failed ``/before`` or a malformed answer
        fails closed (the tool does not run)."""
        if asked.error is not None:
            return Refused(ToolResult.text(_failed(call, asked.error), is_error=True))
        try:
            answer = asked.answer
            decision = answer.get("decision") if isinstance(answer, dict) else None
            if decision == "run":
                return Run()
            if decision == "saved":
                return SavedResult(_result(answer["result"]))
            if decision == "refused":
                refused = _result(answer["result"])
                return Refused(ToolResult(content=refused.content, is_error=True))
            raise GateClientError(f"tool gate: unknown decision {answer!r}")
        except GateClientError as error:  # fail closed: the tool does not run
            return Refused(ToolResult.text(str(error), is_error=True))

    async def _ask(self, call: ToolCall, body: dict[str, Any], asked: _Asked) -> None:
        """Ask ``/before`` for ``call`` into ``asked``; if its caller was aborted meanwhile,
        report what Fake-Pi recorded for it once the gate let it run (T23)."""
        try:
            asked.answer = await self._post("/before", body)
        except GateClientError as error:
            asked.error = error
        except Exception as error:  # a system task: nothing may escape it
            asked.error = GateClientError(f"request to the gate failed: {error!r}")
        finally:
            asked.done.set()
        if asked.abandoned is not None:
            try:
                with trio.move_on_after(_GRACE):
                    await self._abandoned(call, asked)
            except Exception as error:  # a system task: nothing may escape it
                print(f"fake-pi: the gate did not record {call.id}: {error!r}", file=sys.stderr)
            finally:
                self._pending.remove(asked.abandoned)
                asked.abandoned.set()

    @staticmethod
    def _reports(call: ToolCall, error: GateClientError) -> bool:
        """Whether a call whose ``/before`` failed with ``error`` is reported (T24): when no
        answer came, so the gate may have let it run — not for a runtime tool, whose outcome
        is the gate's own (T10, T19)."""
        return error.unanswered and call.name not in RUNTIME_TOOLS

    async def _abandoned(self, call: ToolCall, asked: _Asked) -> None:
        """Report an aborted call's outcome if the gate let it run (T23) — or may have: no
        answer came (T24): the error result Fake-Pi's loop recorded for it (``run_tool_call``:
        "Operation aborted", the tool did not start), so the journal holds what the model is
        told and the model request carrying it passes the gateway's barrier (T11)."""
        answer = asked.answer
        let_run = isinstance(answer, dict) and answer.get("decision") == "run"
        if let_run or (asked.error is not None and self._reports(call, asked.error)):
            aborted = ToolResult(
                content=[{"type": "text", "text": TOOL_ABORTED_TEXT}], is_error=True, details={}
            )
            await self.after(call, aborted)

    async def after(self, call: ToolCall, result: ToolResult) -> None:
        reported: dict[str, Any] = {"content": result.content, "isError": result.is_error}
        if result.details is not None:
            reported["details"] = result.details
        body = {"tool_call_id": call.id, "name": call.name, "result": reported}
        self._follows[:] = [call.id]
        try:
            await self._post("/after", body)
        except GateClientError as error:
            print(f"fake-pi: the tool gate did not record {call.id}: {error}", file=sys.stderr)


def _failed(call: ToolCall, error: GateClientError) -> str:
    """What the model is told of a call whose ``/before`` failed: why — and, for a runtime tool
    that got no answer, that it may have run (T26): the gate runs it inside ``/before``, so an
    answer lost after the gate acted leaves its effect done (Pi's extension says the same)."""
    if error.unanswered and call.name in RUNTIME_TOOLS:
        return f"{error}; {POSSIBLY_RAN.format(name=call.name)}"
    return str(error)


POSSIBLY_RAN: Final = "{name} may have run in the runtime (possibly ran): inspect before repeating"
"""T26's words, as Pi's extension writes them (``gate.ts``)."""


def gate_from_environ(environ: MutableMapping[str, str]) -> RuntimeGate | None:
    """The runtime's gate if ``environ`` names one; removes the secret from ``environ``."""
    secret = environ.pop(GATE_SECRET_ENV, None)
    path = environ.get(GATE_SOCKET_ENV)
    if not path:
        return None
    return RuntimeGate(socket_path=path, secret=secret or "")
