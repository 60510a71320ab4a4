"""The operator page in a real browser (issue #22 item 3; docs/design/operations.md "The
operator page"): Debian's headless Chromium driven by Playwright, against a real
``pi-runtime serve`` process with a real Fake-Pi task worker and a scripted model on loopback.

The operator logs in (a wrong token first), watches a task go ``Suspect`` and be held
(its worker SIGSTOPped: the probe is never answered) under the test time scale, resumes it from
the page and sees it end ``done``; a page of another origin that posts a control to the page
with the operator's cookie is refused and changes nothing. The screenshots are saved in the
test's directory (and in ``$PI_RUNTIME_SCREENSHOTS`` when it is set).

Playwright's synchronous API runs in a thread of its own (``trio.to_thread``); it waits for
what the page shows (bounded), never on the clock. The scripted model runs on the test's Trio
loop, which the thread reaches through ``trio.from_thread``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Final

import trio
from playwright.sync_api import Page, expect, sync_playwright

from fake_pi.scenario import Hang, Step, Text
from runtime._boundary._http import Request, ResponseWriter, serve_http

from .._workers import scripted_upstream
from ..cli.test_task_cli import cli, run_task, serve, write_config
from ..task_harness import done, make_worktree

LIMIT: Final = 180.0
WAIT_MS: Final = 60_000
"""How long the browser waits for one thing the page should show."""
CHROMIUM: Final = "/usr/bin/chromium"
CHROMIUM_ARGS: Final = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PAGE_AT: Final = re.compile(rb"the operator page on (http://127\.0\.0\.1:\d+/)")
SEEN: Final = """() => {
  window.__seen = [];
  const body = document.querySelector('#tasks tbody');
  new MutationObserver(() => {
    for (const cell of body.querySelectorAll('tr[data-task="t1"] .classification')) {
      const last = window.__seen[window.__seen.length - 1];
      if (cell.textContent !== last) window.__seen.push(cell.textContent);
    }
  }).observe(body, { childList: true, subtree: true, characterData: true });
}"""
"""Record every classification of t1 the page shows, as it shows it."""


def chromium() -> str:
    found = shutil.which("chromium") or (CHROMIUM if os.path.exists(CHROMIUM) else None)
    assert found is not None, (
        "Debian's chromium is not installed: scripts/test installs it (apt-get install chromium)"
    )
    return found


def attacker_page(target: str) -> bytes:
    """A page of another origin that posts a control to the operator page: a form (a JSON
    body in text/plain, the classic trick), then a fetch with the header the page uses."""
    field = '{"command":"task_abort","task_id":"t1","reason":"evil","x":"'
    return f"""<!doctype html><html><body>
<form id="f" method="post" action="{target}api/command" enctype="text/plain">
<input type="hidden" name='{field}' value='"}}'></form>
<p id="fetch">pending</p>
<script>
fetch("{target}api/command", {{method: "POST", credentials: "include",
  headers: {{"content-type": "application/json", "x-csrf-token": "guess"}},
  body: JSON.stringify({{command: "task_abort", task_id: "t1", reason: "evil"}})}})
  .then(r => {{ document.getElementById("fetch").textContent = "answered " + r.status; }})
  .catch(() => {{ document.getElementById("fetch").textContent = "blocked"; }});
</script></body></html>""".encode()


def save(page: Page, root: Path, name: str) -> None:
    page.screenshot(path=str(root / name), full_page=True)
    extra = os.environ.get("PI_RUNTIME_SCREENSHOTS")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(root / name, Path(extra) / name)


def row(page: Page, part: str) -> Any:
    return page.locator(f'#tasks tr[data-task="t1"] {part}')


def drive(
    url: str, token: str, evil: str, root: Path, worktree: Path, first: trio.Event
) -> dict[str, Any]:
    """The operator's session, in the browser; returns what the test checks after."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.goto(url)
            # a wrong token is refused: the form again, with the code
            page.fill("#token", "not-the-token")
            page.click("#login")
            expect(page.locator("#login-error")).to_contain_text("token_invalid")
            assert page.locator("#tasks").count() == 0
            page.fill("#token", token)
            page.click("#login")
            expect(page.locator("#live")).to_have_text("live", timeout=WAIT_MS)
            page.evaluate(SEEN)
            submitted = trio.from_thread.run(cli, root, *run_task(worktree, "t1"))
            assert submitted.returncode == 0, submitted.stderr
            expect(row(page, ".classification")).to_have_text("Active", timeout=WAIT_MS)
            trio.from_thread.run(first.wait)  # its model request is in flight
            shown = page.request.get(f"{url}api/tasks/t1").json()
            pid = shown["task"]["process"]["pid"]
            os.kill(pid, signal.SIGSTOP)  # wedged: it will answer no probe
            expect(row(page, ".classification")).to_have_text(
                "StalledOperatorRequired", timeout=WAIT_MS
            )
            expect(row(page, ".hold")).to_have_text("probe_unanswered")
            expect(row(page, ".next")).not_to_be_empty()
            page.click('#tasks tr[data-task="t1"] a')
            expect(page.locator("#detail-id")).to_have_text("t1")
            expect(page.locator("#timeline circle")).to_have_count(4, timeout=WAIT_MS)
            save(page, root, "operator-page-held.png")
            held = {"seen": page.evaluate("window.__seen"), "next": row(page, ".next").inner_text()}
            # another origin posts a control with the operator's cookie: refused, nothing done
            other = context.new_page()
            other.goto(evil)
            expect(other.locator("#fetch")).not_to_have_text("pending", timeout=WAIT_MS)
            fetched = other.locator("#fetch").inner_text()
            with other.expect_navigation():
                other.evaluate("document.getElementById('f').submit()")
            posted = other.content()
            other.close()
            assert page.request.get(f"{url}api/tasks/t1").json()["task"]["state"] == "open"
            # resume from the page: the stopped worker is fenced, the task resumes and ends
            page.fill("#reason", "resumed from the browser test")
            page.click('#tasks tr[data-task="t1"] button[data-action="resume"]')
            expect(page.locator("#message")).to_have_text("task_resume t1: done")
            expect(row(page, ".state")).to_have_text("done", timeout=WAIT_MS)
            save(page, root, "operator-page-done.png")
            timeline = page.request.get(f"{url}api/tasks/t1").json()["timeline"]
            # the token file turns group-readable: the page's stream ends and it says why (OP2)
            token_file = root / "state" / "token"
            token_file.chmod(0o640)
            expect(page.locator("#message")).to_contain_text(
                "logged out: token_insecure", timeout=WAIT_MS
            )
            expect(page.locator("#live")).to_have_text("logged out")
            token_file.chmod(0o600)
            page.click("#logout")
            expect(page.locator("#token")).to_be_visible()
            after = page.request.get(f"{url}api/state")
            return {
                **held,
                "fetched": fetched,
                "posted": posted,
                "timeline": timeline,
                "after_logout": after.status,
            }
        finally:
            browser.close()


async def test_op10_log_in_watch_a_task_held_resume_it_from_the_page_and_see_it_end(
    tmp_path: Path,
) -> None:
    chromium()
    worktree = make_worktree(tmp_path)
    first = trio.Event()

    async def on_request(n: int) -> None:
        if n == 1:
            first.set()
        await trio.lowlevel.checkpoint()

    steps: list[Step] = [Hang(seconds=3600), done(), Text(text="finished")]
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps, on_request=on_request) as (_model, model_url),
            trio.open_nursery() as nursery,
        ):
            config = write_config(tmp_path, model_url, '\n[metrics]\nlisten = "127.0.0.1:0"\n')
            async with serve(tmp_path, config, "--unsafe-test-timescale", "200") as server:
                url = (await server.printed(PAGE_AT.pattern))[1].decode()
                token = (tmp_path / "state" / "token").read_text().strip()
                evil_body = attacker_page(url)

                async def evil_handler(request: Request, response: ResponseWriter) -> None:
                    await response.respond(200, evil_body, "text/html; charset=utf-8")

                evil = await nursery.start(serve_http, evil_handler)
                seen = await trio.to_thread.run_sync(
                    drive, url, token, f"{evil.url}/", tmp_path, worktree, first
                )
                nursery.cancel_scope.cancel()
    # what the operator watched, live: Active, then Suspect, then held
    assert "Suspect" in seen["seen"], seen["seen"]
    assert seen["seen"].index("Suspect") < seen["seen"].index("StalledOperatorRequired")
    assert "resume" in seen["next"]
    classes = [point["classification"] for point in seen["timeline"]]
    assert classes[:4] == ["Active", "Suspect", "HardResumeEligible", "StalledOperatorRequired"]
    assert seen["timeline"][-1]["state"] == "done"
    assert seen["fetched"] == "blocked"  # the preflight is refused: the browser never sent it
    assert "csrf_refused" in seen["posted"]
    assert seen["after_logout"] == 401
    assert (tmp_path / "operator-page-held.png").stat().st_size > 10_000
    assert (tmp_path / "operator-page-done.png").stat().st_size > 10_000
