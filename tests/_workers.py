"""A worker in a test sandbox: its directories, its session, one prompted turn, and the
scripted model it talks to."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import Call, Scenario, Step, ToolCalls
from runtime._boundary._http import Request, ResponseWriter, serve_http
from runtime._clock import Clocks
from runtime._pi._launch import ModelRoute, RetrySettings, WorkerLaunch, WorkerProgram
from runtime._pi._rpc import open_rpc_channel
from runtime._pi._rpc_protocol import Event
from runtime._pi._session_files import create_session
from runtime._pi._worker import open_worker

from ._pi import real_pi


def sandbox_launch(
    kind: str, root: Path, *, base_url: str | None = None, **fields: Any
) -> WorkerLaunch:
    """A launch of the real Pi (``kind == "pi"``) or Fake-Pi in ``root``: ``work``, ``home``
    and ``tmp`` below it, a Pi-shaped session at ``root/lane.jsonl`` (created once), model
    ``fake/fake-model`` at ``base_url``, no retries; ``fields`` override the rest."""
    program = WorkerProgram.pi(real_pi()) if kind == "pi" else WorkerProgram.fake_pi()
    for sub in ("work", "home", "tmp"):
        (root / sub).mkdir(exist_ok=True)
    session = root / "lane.jsonl"
    if not session.exists():
        create_session(
            session,
            cwd=str(root / "work"),
            provider="fake",
            model_id="fake-model",
            clock=Clocks.system().wall,
        )
    launch: dict[str, Any] = {
        "program": program,
        "cwd": root / "work",
        "home": root / "home",
        "agent_dir": root / "home" / "agent",
        "tmp_dir": root / "tmp",
        "session": session,
        "route": ModelRoute(provider="fake", model="fake-model", base_url=base_url),
        "retry": RetrySettings(max_retries=0),
    }
    return WorkerLaunch(**(launch | fields))


async def one_turn(launch: WorkerLaunch, text: str = "go") -> list[Event]:
    """Launch, prompt once and wait for ``agent_settled``; the events up to it."""
    async with (
        open_worker(launch) as worker,
        open_rpc_channel(worker.stdin, worker.stdout, stderr=worker.stderr_tail) as rpc,
    ):
        prompted = await rpc.prompt(text)
        settled = await rpc.wait_settled(prompted.settled_before)
        assert settled.record["aborted"] is False
        events = []
        async for event in rpc:
            events.append(event)
            if event.type == "agent_settled":
                break
        return events


@contextlib.asynccontextmanager
async def scripted_upstream(
    steps: Sequence[Step], *, on_request: Callable[[int], Awaitable[None]] | None = None
) -> AsyncIterator[tuple[ScriptedModel, str]]:
    """The scripted model on loopback: ``(model, base_url)`` with ``base_url`` ending in
    ``/v1``. ``on_request(n)`` is awaited when the ``n``-th model request (1-based) arrives,
    before it is answered (a crash test kills its host there)."""
    model = ScriptedModel(scenario=Scenario(steps=list(steps)))
    arrived = 0

    async def handle(request: Request, response: ResponseWriter) -> None:
        nonlocal arrived
        if on_request is not None and request.target.rstrip("/").endswith("/chat/completions"):
            arrived += 1
            await on_request(arrived)
        await model.handle(request, response)

    async with trio.open_nursery() as nursery:
        server = await nursery.start(functools.partial(serve_http, handle))
        yield model, f"{server.url}/v1"
        nursery.cancel_scope.cancel()


def tool_messages(body: dict[str, Any]) -> dict[str, str]:
    """The text of each ``role: tool`` message of a chat request, by tool-call id."""
    out = {}
    for message in body["messages"]:
        if message.get("role") == "tool":
            content = message["content"]
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content)
            out[message["tool_call_id"]] = content
    return out


def waiting_bash(root: Path) -> tuple[Path, Path, Step]:
    """A ``bash`` tool call that reports it started and then waits to be released:
    ``(started, release, step)``; read ``started`` (a FIFO) to know it runs, write
    ``release`` to let it end. The turn it belongs to can be steered meanwhile."""
    started, release = root / "started.fifo", root / "release.fifo"
    os.mkfifo(started)
    os.mkfifo(release)
    command = f"echo go > {started}; cat {release}"
    step = ToolCalls(calls=[Call(name="bash", arguments={"command": command}, id="c1")])
    return started, release, step
