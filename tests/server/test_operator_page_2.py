"""The operator page's silence column and the metrics listener's coalesced scrapes
(docs/design/operations.md OP11, M10).

OP11: a real server with a real Fake-Pi task worker behind a scripted model on loopback — one
task waiting for its user (its watchdog disarmed: no silence measured), one whose model request
hangs (armed: its silence measured) — read through ``/api/state`` and in Debian's headless
Chromium driven by Playwright (its thread of its own, ``trio.to_thread``; it waits for what the
page shows, bounded, never on the clock).

M10: the metrics listener (``serve_metrics``) on a real socket on 127.0.0.1, under Trio's
virtual clock: a collector of the test's, registered in the runtime's registry, makes each
build take virtual time (``MockClock.jump``) and counts the builds.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import msgspec
import trio
import trio.testing
from playwright.sync_api import expect, sync_playwright
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from fake_pi.scenario import Hang, Step
from runtime._boundary._http import HttpServer, open_request
from runtime._config import config_from_dict
from runtime._metrics import REGISTRY
from runtime._server import _metrics
from runtime._server._serve import ServeOptions, open_server

from .._workers import scripted_upstream
from ..task_harness import make_worktree, say, wait
from .test_operator_browser import CHROMIUM_ARGS, WAIT_MS, chromium
from .test_serve import Rig

LIMIT: Final = 120.0

# -- OP11: a silence not measured is not shown as one ------------------------------------------


@contextlib.asynccontextmanager
async def two_tasks(root: Path) -> AsyncIterator[tuple[Rig, int]]:
    """A server whose task ``t1`` waits for its user (``task_wait``: its watchdog disarmed)
    and whose ``t2`` has its model request in flight, never answered (armed); its metrics
    port, the page's."""
    arrived = {2: trio.Event(), 3: trio.Event()}

    async def on_request(n: int) -> None:
        if n in arrived:
            arrived[n].set()
        await trio.lowlevel.checkpoint()

    # t1: its question, then its turn's last words; t2: a request never answered
    steps: list[Step] = [wait("which one?"), say("asked"), Hang(seconds=3600)]
    async with scripted_upstream(steps, on_request=on_request) as (_model, url):
        settings = {"model": {"base_url": url}, "metrics": {"listen": "127.0.0.1:0"}}
        config = config_from_dict(settings, base=root)
        async with open_server(config, ServeOptions(port=0), base_dir=root) as server:
            r = Rig(server, root)
            async with r.connect() as client:
                for task_id in ("t1", "t2"):
                    worktree = make_worktree(root / task_id)
                    await client.send(
                        {
                            "type": "task_submit",
                            "task_id": task_id,
                            "prompt": "do the task",
                            "worktree": str(worktree),
                        }
                    )
                    if task_id == "t1":
                        await client.until(
                            lambda f: (
                                f["type"] == "task_event"
                                and f["task_id"] == "t1"
                                and f["classification"] == "WaitingUser"
                            )
                        )
                        await arrived[2].wait()  # t1's last request: the next one is t2's
                await arrived[3].wait()  # t2 was prompted: its watchdog is armed
                assert server.metrics_port is not None
                yield r, server.metrics_port


async def api_state(port: int, token: str) -> dict[str, Any]:
    headers = [("authorization", f"Bearer {token}")]
    async with open_request("GET", f"http://127.0.0.1:{port}/api/state", headers=headers) as got:
        assert got.status == 200
        state: dict[str, Any] = msgspec.json.decode(await got.read())
    return state


def tasks_of(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {task["task_id"]: task for task in state["tasks"]}


async def test_op11_a_silence_not_watched_is_null_and_said_so_in_the_state(
    tmp_path: Path,
) -> None:
    """OP11: a task whose silence the watchdog does not measure — waiting for its user, then
    ended — has ``silence_watched: false`` and ``silence_seconds: null`` in the page's state
    (before, ``0.0``: the page said it was silent for 0.0 s); one whose prompt is being
    worked on has ``silence_watched: true`` and its silence, a number."""
    with trio.fail_after(LIMIT):
        async with two_tasks(tmp_path) as (r, port):
            tasks = tasks_of(await api_state(port, r.token))
            waiting, working = tasks["t1"], tasks["t2"]
            assert waiting["classification"] == "WaitingUser"
            assert (waiting["silence_watched"], waiting["silence_seconds"]) == (False, None)
            assert waiting["soft_seconds"] > 0  # its thresholds are still shown
            assert working["silence_watched"] is True
            assert isinstance(working["silence_seconds"], float)
            assert working["silence_seconds"] >= 0.0
            # what ``task show`` says stays the command line's (OP7)
            assert r.server.tasks.show("t1").silence_seconds == 0.0
            aborted = await r.server.tasks.control("t1", "abort", reason="done with it")
            assert aborted.task_id == "t1"
            await r.server.tasks.ended("t1")
            ended = tasks_of(await api_state(port, r.token))["t1"]
            assert ended["ended"] == "aborted"
            assert (ended["silence_watched"], ended["silence_seconds"]) == (False, None)


SILENCE_BAR: Final = """(task) => {
  const cell = silenceBar(task);
  const fill = cell.querySelector('.bar span');
  return { text: cell.textContent, width: fill ? fill.style.width : null,
           classes: cell.querySelector('.bar')?.className ?? null };
}"""
"""The page's own ``silenceBar`` (page.js) on one task row: its text and its bar's fill."""


def watch_in_browser(url: str, token: str) -> dict[str, Any]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url)
            page.fill("#token", token)
            page.click("#login")
            expect(page.locator("#live")).to_have_text("live", timeout=WAIT_MS)
            waiting = page.locator('#tasks tr[data-task="t1"] td.silence')
            working = page.locator('#tasks tr[data-task="t2"] td.silence')
            expect(waiting).to_contain_text("not watched", timeout=WAIT_MS)
            expect(working).to_have_text(
                re.compile(r"\d+\.\d s \(300\.0 · 900\.0\)"), timeout=WAIT_MS
            )
            row = {"soft_seconds": 150.0, "silence_watched": True}
            return {
                "waiting": waiting.inner_text(),
                "waiting_bars": page.locator('#tasks tr[data-task="t1"] .bar').count(),
                "working_bars": page.locator('#tasks tr[data-task="t2"] .bar').count(),
                # a phase with no hard threshold: drawn against the soft one, the real one
                "no_hard": page.evaluate(
                    SILENCE_BAR, row | {"silence_seconds": 75.0, "hard_seconds": None}
                ),
                "past_soft": page.evaluate(
                    SILENCE_BAR, row | {"silence_seconds": 200.0, "hard_seconds": None}
                ),
                "with_hard": page.evaluate(
                    SILENCE_BAR, row | {"silence_seconds": 75.0, "hard_seconds": 600.0}
                ),
                "unwatched": page.evaluate(
                    SILENCE_BAR,
                    {
                        "soft_seconds": 150.0,
                        "hard_seconds": None,
                        "silence_watched": False,
                        "silence_seconds": None,
                    },
                ),
            }
        finally:
            browser.close()


async def test_op11_the_page_says_not_watched_with_no_bar_and_scales_by_a_real_threshold(
    tmp_path: Path,
) -> None:
    """OP11, in a real browser: the waiting task's silence cell says ``not watched`` and has
    no bar (before: a bar and ``0.0 s``); the working task's has a bar and its seconds. The
    page's ``silenceBar`` draws a silence against its hard threshold, or with none known the
    soft one (before: three times the soft one, a threshold that does not exist)."""
    with trio.fail_after(LIMIT):
        async with two_tasks(tmp_path) as (r, port):
            seen = await trio.to_thread.run_sync(
                watch_in_browser, f"http://127.0.0.1:{port}/", r.token
            )
    assert seen["waiting"].strip() == "not watched (300.0 · —)"  # settled: no hard one
    assert "0.0 s" not in seen["waiting"]
    assert (seen["waiting_bars"], seen["working_bars"]) == (0, 1)
    assert seen["no_hard"]["width"] == "50%"  # 75 of the soft 150 (before: of 450)
    assert seen["no_hard"]["classes"] == "bar"
    assert seen["past_soft"]["width"] == "100%"
    assert seen["past_soft"]["classes"] == "bar over-soft"
    assert seen["with_hard"]["width"] == "12.5%"  # 75 of the hard 600
    assert seen["unwatched"] == {
        "text": "not watched (150.0 · —)",
        "width": None,
        "classes": None,
    }


# -- M10: scrapes at once cost one build -----------------------------------------------------


class Slow(Collector):
    """A gauge whose value the test sets; each read takes ``took`` seconds of virtual time."""

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self.clock = clock
        self.value = 1.0
        self.took = 0.05
        self.builds = 0

    def describe(self) -> Iterator[Metric]:
        """What registering reads (not a build)."""
        yield GaugeMetricFamily("pi_runtime_test_slow", "A test's gauge.")

    def collect(self) -> Iterator[Metric]:
        self.builds += 1
        self.clock.jump(self.took)
        yield GaugeMetricFamily("pi_runtime_test_slow", "A test's gauge.", value=self.value)


@contextlib.contextmanager
def registered(collector: Collector) -> Iterator[None]:
    REGISTRY.register(collector)
    try:
        yield
    finally:
        REGISTRY.unregister(collector)


@contextlib.asynccontextmanager
async def listener() -> AsyncIterator[HttpServer]:
    async with trio.open_nursery() as nursery:
        yield await nursery.start(functools.partial(_metrics.serve_metrics, "127.0.0.1", 0))
        nursery.cancel_scope.cancel()


async def scrape(server: HttpServer, accept: str | None = None) -> float:
    """One ``GET /metrics`` on a new connection: the test gauge's value in it."""
    headers = [("accept", accept)] if accept is not None else None
    async with open_request("GET", f"{server.url}/metrics", headers=headers) as response:
        assert response.status == 200
        body = (await response.read()).decode()
    line = next(x for x in body.splitlines() if x.startswith("pi_runtime_test_slow "))
    return float(line.split()[1])


async def test_m10_scrapes_at_once_are_answered_from_one_build(
    mock_clock: trio.testing.MockClock,
) -> None:
    """M10: twenty scrapes sent at once cost one build (before: twenty, back to back on the
    Trio thread), and every one gets that build's answer."""
    slow = Slow(mock_clock)
    answers: list[float] = []
    with registered(slow):
        async with listener() as server:

            async def one() -> None:
                answers.append(await scrape(server))

            async with trio.open_nursery() as nursery:
                for _ in range(20):
                    nursery.start_soon(one)
    assert answers == [1.0] * 20
    assert slow.builds == 1


async def test_m10_an_answer_is_never_older_than_its_build_took(
    mock_clock: trio.testing.MockClock,
) -> None:
    """M10: a scrape that comes less than a build's duration after that build ended gets its
    answer (a change meanwhile is in the next); one that comes as late as the build took, or
    later, gets a new build that shows the change. A build that took long is reused at most
    ``REUSE_SECONDS``. Each format has its own."""
    slow = Slow(mock_clock)
    with registered(slow):
        async with listener() as server:
            assert await scrape(server) == 1.0
            slow.value = 2.0
            mock_clock.jump(0.049)  # within the 0.05 s the build took
            assert await scrape(server) == 1.0
            assert slow.builds == 1
            mock_clock.jump(0.001)  # as long after it as it took: built again
            assert await scrape(server) == 2.0
            assert slow.builds == 2
            # OpenMetrics is answered from a build of its own
            assert await scrape(server, "application/openmetrics-text; version=1.0.0") == 2.0
            assert slow.builds == 3
            # a build of 5 s is reused for at most a second
            slow.took = 5.0
            mock_clock.jump(1.0)
            assert await scrape(server) == 2.0
            assert slow.builds == 4
            slow.value = 3.0
            mock_clock.jump(_metrics.REUSE_SECONDS - 0.001)
            assert await scrape(server) == 2.0
            mock_clock.jump(0.001)
            assert await scrape(server) == 3.0
            assert slow.builds == 5


async def test_m10_a_build_that_takes_no_time_is_never_reused(
    mock_clock: trio.testing.MockClock,
) -> None:
    """M10: the window is the build's own duration, so scrapes of a build that took no time
    (on Trio's clock) are each built: a change is in the very next scrape."""
    slow = Slow(mock_clock)
    slow.took = 0.0
    with registered(slow):
        async with listener() as server:
            assert await scrape(server) == 1.0
            slow.value = 2.0
            assert await scrape(server) == 2.0
    assert slow.builds == 2
