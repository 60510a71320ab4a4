"""Worktree work takes threads of its own (docs/design/worktree.md W-M7)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio
import trio.testing

from runtime import open_store
from runtime._errors import ReasonCode, WorktreeError
from runtime._tasks import _worktree
from runtime._tasks._worktree import WORKTREE_THREADS, Manifest, amanifest, worktree_limiter


async def test_w_m7_slow_worktree_work_leaves_the_journals_threads_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W-M7: more worktree manifests than there are worktree threads, each stuck in its
    (git) work, while Trio's default thread limiter has only two tokens: a journal read still
    runs, and no more than ``WORKTREE_THREADS`` manifests are taken at once. Before, each took
    a token of the default limiter, and the journal's file work waited behind them."""
    release = threading.Event()
    running: list[int] = []
    most = 0
    lock = threading.Lock()

    def stuck(root: Path) -> Manifest:
        nonlocal most
        with lock:
            running.append(1)
            most = max(most, len(running))
        release.wait(20)
        with lock:
            running.pop()
        raise WorktreeError(ReasonCode.WORKTREE_UNREADABLE, "stuck")

    monkeypatch.setattr(_worktree, "take_manifest", stuck)
    trio.to_thread.current_default_thread_limiter().total_tokens = 2
    ended: list[str] = []

    async def manifest() -> None:
        with pytest.raises(WorktreeError):
            await amanifest(tmp_path)
        ended.append("manifest")

    with trio.fail_after(20):
        async with open_store(tmp_path / "state") as store:
            log = await store.create_delivery_log("d")
            async with trio.open_nursery() as nursery:
                try:
                    for _ in range(WORKTREE_THREADS + 2):
                        nursery.start_soon(manifest)
                    while len(running) < 2:  # (two: all the default limiter has)
                        await trio.testing.wait_all_tasks_blocked(cushion=0.005)
                    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                    with trio.fail_after(5):  # (it never comes when they hold its tokens)
                        contents = await store.read(log.rel)  # the journal's thread work
                    assert contents.next_seq == 1
                    assert ended == []  # the worktree work is still stuck meanwhile
                    assert worktree_limiter().borrowed_tokens == WORKTREE_THREADS
                finally:
                    release.set()
    assert most == WORKTREE_THREADS
    assert ended == ["manifest"] * (WORKTREE_THREADS + 2)
