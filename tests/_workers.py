"""A worker in a test sandbox: its directories, its session, one prompted turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime._clock import Clocks
from runtime._launch import ModelRoute, RetrySettings, WorkerLaunch, WorkerProgram
from runtime._rpc import Event, open_rpc_channel
from runtime._session import create_session
from runtime._worker import open_worker

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
