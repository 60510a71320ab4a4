"""Retention of ended tasks (docs/design/retention.md RT12), on a real file store with the
in-process runner on virtual time; the wall clock (what retention ages by) is moved by days.

An ended task is slimmed to its idempotency record (submission and end) ``journal_days``
after its end — its session, home and temporary directory removed, its candidate kept — and
expired ``idempotency_days`` after it (its id in ``tasks-expired.ids``, its lane directory
gone: a resubmission is ``task_expired``, never run again). A task that has not ended is
never touched. ``task forget`` removes the rest of an ended task now, its candidate too."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Final

import pytest
import trio
import trio.testing

from fake_pi.scenario import Step
from runtime._clock import Clocks, MockWallClock
from runtime._config import RetentionConfig
from runtime._errors import ReasonCode, TaskError
from runtime._journal._inspect import verify_journal
from runtime._journal._store import lane_key
from runtime._records import Compacted, Header, TaskEnded, TaskSubmitted
from runtime._retention import RetentionSettings
from runtime._tasks._retention import TaskRetention, forget_offline, retain_offline, work_dirs
from runtime._wire import TaskSpec

from ..task_harness import TASK, Rig, done, open_rig, say, wait
from .test_task_crash import crash_rig, kill_when_paused, recover, task_spec
from .test_worktree import commit_all, git, make_repo

pytestmark = pytest.mark.trio

DAY: Final = 86_400.0
RETENTION: Final = RetentionConfig(journal_days=7, idempotency_days=30, forget_days=365)
LIVE: Final = "task-live"
STEPS: Final[list[Step]] = [done(), say("finished"), wait("which one?")]
"""The ended task's answer and reply, then the live task's wait."""
CRASH_STEPS: Final[list[Step]] = [done(), say("finished")]


def lane_dir(rig: Rig, task_id: str = TASK) -> Path:
    return rig.store.root / "lanes" / lane_key(f"task:{task_id}")


class _Refused:
    """``with _Refused(code):`` — the block raises a :class:`TaskError` with ``code``."""

    def __init__(self, code: ReasonCode) -> None:
        self.code = code

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> bool:
        assert isinstance(error, TaskError), f"expected {self.code}, got {error!r}"
        assert error.code == self.code, error
        return True


async def submit_beside(rig: Rig, task_id: str) -> None:
    """Submit ``task_id``, the rig's task with a worktree of its own beside the rig's."""
    tree = rig.worktree.parent / task_id
    tree.mkdir(exist_ok=True)
    spec = rig.spec()
    await rig.runner.submit(
        TaskSpec(task_id=task_id, prompt=spec.prompt, worktree=str(tree), grants=spec.grants)
    )


async def ended_and_live(rig: Rig) -> None:
    """TASK ends done; LIVE waits for the user (open, never ended)."""
    await rig.runner.submit(rig.spec())
    await rig.ended(TASK)
    await submit_beside(rig, LIVE)
    await rig.until(lambda: rig.runner.show(LIVE).state == "waiting")


async def test_rt12_an_ended_task_is_slimmed_then_expired_its_candidate_kept(
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    """RT12 (RT1-RT4 for tasks): day 6 nothing; day 8 the ended task's lane log holds only its
    submission and end (after a new header and a ``Compacted`` mark), its session and work
    directories are gone, its candidate archive is there, a duplicate gets the same view and
    a changed one ``task_conflict`` — also after a restart, which reads the slim log; a second
    pass changes nothing. Day 31 its lane directory is gone, the candidate still there, and
    its id is ``task_expired`` for a submission and for ``task show``, after a restart too.
    The waiting task of the same age is untouched throughout (RT1)."""
    steps = STEPS
    async with open_rig(tmp_path, clocks, steps) as rig:
        await ended_and_live(rig)
        ended = rig.runner.show(TASK)
        candidate = rig.store.root / str((ended.ended or {})["candidate"]["ref"])
        home, tmp = work_dirs(tmp_path / "work", TASK)
        session = rig.store.root / ended.session_path
        assert home.is_dir()
        assert session.is_file()
        assert candidate.is_file()
        before = await rig.records()
        live_before = await rig.records(LIVE)

        wall_clock.advance(6 * DAY)
        assert await rig.runner.retain(RETENTION) == TaskRetention()
        assert await rig.records() == before

        wall_clock.advance(2 * DAY)
        done_ = await rig.runner.retain(RETENTION)
        assert done_.slimmed == (TASK,)
        assert done_.expired == ()
        slim = await rig.records()
        assert [type(r) for r in slim] == [Header, Compacted, TaskSubmitted, TaskEnded]
        assert slim[2:] == [r for r in before if isinstance(r, TaskSubmitted | TaskEnded)]
        assert not session.exists()
        assert not home.exists()
        assert not tmp.exists()
        assert candidate.is_file()
        assert (await rig.runner.retain(RETENTION)).slimmed == ()  # once
        assert (await rig.runner.submit(rig.spec())).state == "done"  # a duplicate
        with _Refused(ReasonCode.TASK_CONFLICT):
            await rig.runner.submit(rig.spec(prompt="another task"))
        live_after = await rig.records(LIVE)  # it may still be parking its lane: it grows
        assert live_after[: len(live_before)] == live_before
        assert not [r for r in live_after if isinstance(r, Compacted)]
        assert (rig.store.root / rig.runner.show(LIVE).session_path).is_file()

    wall_clock.advance(23 * DAY)  # day 31, after a restart on the same state
    async with open_rig(tmp_path, clocks, steps) as rig:
        assert rig.runner.show(TASK).state == "done"  # restored from the slim log
        assert rig.runner.show(TASK).ended is not None
        done_ = await rig.runner.retain(RETENTION)
        assert done_.expired == (TASK,)
        assert not lane_dir(rig).exists()
        assert candidate.is_file()  # the task's work: only an operator removes it
        with _Refused(ReasonCode.TASK_EXPIRED):
            await rig.runner.submit(rig.spec())
        with _Refused(ReasonCode.TASK_EXPIRED):
            rig.runner.show(TASK)
        assert TASK not in rig.runner.task_ids()
        assert rig.runner.show(LIVE).state == "waiting"
        assert lane_dir(rig, LIVE).is_dir()

    async with open_rig(tmp_path, clocks, steps) as rig:  # the filter is durable
        with _Refused(ReasonCode.TASK_EXPIRED):
            await rig.runner.submit(rig.spec())
        assert rig.runner.show(LIVE).state == "waiting"


async def test_rt12_task_forget_removes_the_rest_of_an_ended_task_and_its_git_candidate(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """``task forget``: an ended task in a git worktree — its candidate the ref
    ``refs/pi-runtime/candidates/<task>`` — is forgotten at once: the ref deleted (the
    user's branches untouched), the lane directory and work directories gone, its id
    ``task_expired``. A live task is refused ``task_not_ended``, an unknown one
    ``task_unknown``, a forgotten one ``task_expired``."""
    repo = make_repo(tmp_path / "worktree")
    (repo / "README.md").write_text("a task's worktree\n")
    commit_all(repo)
    steps = STEPS
    async with open_rig(tmp_path, clocks, steps) as rig:
        await ended_and_live(rig)
        ref = (rig.runner.show(TASK).ended or {})["candidate"]["git_ref"]
        assert ref == f"refs/pi-runtime/candidates/{TASK}"
        assert git(repo, "show-ref", ref)
        with _Refused(ReasonCode.TASK_NOT_ENDED):
            await rig.runner.forget(LIVE, RETENTION)
        with _Refused(ReasonCode.TASK_UNKNOWN):
            await rig.runner.forget("no-such-task", RETENTION)
        removed = await rig.runner.forget(TASK, RETENTION)
        assert any(ref in item for item in removed)
        shown = await trio.run_process(
            ["git", "-C", str(repo), "show-ref", ref], check=False, capture_stdout=True
        )
        assert shown.returncode != 0
        assert git(repo, "rev-parse", "main")  # the user's branch is there
        assert not lane_dir(rig).exists()
        assert not work_dirs(tmp_path / "work", TASK)[0].exists()
        with _Refused(ReasonCode.TASK_EXPIRED):
            await rig.runner.submit(rig.spec())
        with _Refused(ReasonCode.TASK_EXPIRED):
            await rig.runner.forget(TASK, RETENTION)
        assert rig.runner.show(LIVE).state == "waiting"


async def test_rt12_with_no_server_journal_compact_and_task_forget_act_on_the_directory(
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    """The offline paths (``journal compact``, ``task forget`` with no server): the same
    stages from the lane logs; a live task refused, an ended one forgotten with its archive."""
    steps = STEPS
    async with open_rig(tmp_path, clocks, steps) as rig:
        await ended_and_live(rig)
        archive = rig.store.root / str((rig.runner.show(TASK).ended or {})["candidate"]["ref"])
    state, work = tmp_path / "state", tmp_path / "work"
    settings = RetentionSettings(retention=RETENTION, task_work_root=str(work))
    wall_clock.advance(8 * DAY)
    done_ = await retain_offline(state, settings=settings, clocks=clocks)
    assert done_.slimmed == (TASK,)
    checked, findings = await trio.to_thread.run_sync(verify_journal, state)
    assert checked >= 2
    assert findings == []  # a slim lane log verifies
    with _Refused(ReasonCode.TASK_NOT_ENDED):
        await forget_offline(state, LIVE, settings=settings, clocks=clocks)
    removed = await forget_offline(state, TASK, settings=settings, clocks=clocks)
    assert str(archive) in removed
    assert not archive.exists()
    with _Refused(ReasonCode.TASK_EXPIRED):
        await forget_offline(state, TASK, settings=settings, clocks=clocks)
    async with open_rig(tmp_path, clocks, steps) as rig:
        with _Refused(ReasonCode.TASK_EXPIRED):
            await rig.runner.submit(rig.spec())
        assert rig.runner.show(LIVE).state == "waiting"


# -- RT5 for tasks: a host killed in the middle of a retention pass ---------------------------


@pytest.mark.parametrize(
    "point", ["retention:slim_log", "retention:expire_tasks", "retention:inside_remove_tree"]
)
async def test_rt12_a_host_killed_in_a_retention_pass_loses_nothing_and_runs_nothing_again(
    point: str, tmp_path: Path
) -> None:
    """A task-runner host (``tests/tasks/task_host.py``, real Fake-Pi workers, the real
    clock moved on by days) is SIGKILLed right after a step of the retention pass — the lane
    log slimmed (its session not yet removed), the id expired (its lane directory not yet
    removed), or half-way through removing the lane directory (its log gone, the rest in the
    trash, RT15) — and a new host on the same state directory runs the passes again: the task
    ends up let go exactly as without the crash (its lane directory and session gone, its id
    ``task_expired``, its candidate archive there), and the model is asked nothing more —
    the task never ran again."""
    async with crash_rig(tmp_path, CRASH_STEPS) as (model, url, _workers):
        spec = {
            **task_spec(url),
            "retention": {"journal_days": 7, "idempotency_days": 30, "forget_days": 365},
            "retain_at_days": [8, 31],
        }
        facts = await kill_when_paused(tmp_path, spec, point)
        (ended,) = [f["ended"] for f in facts if "ended" in f]
        asked = model.request_count
        facts = await recover(tmp_path, spec)
    assert model.request_count == asked
    retained = [f["retained"] for f in facts if "retained" in f]
    assert [r["days"] for r in retained] == [8, 31]
    assert [f["resubmitted"] for f in facts if "resubmitted" in f] == ["task_expired"]
    lanes = tmp_path / "state" / "lanes" / lane_key(f"task:{TASK}")
    assert not lanes.exists()
    archive = tmp_path / "state" / ended["candidate"]["ref"]
    assert archive.is_file()
    assert not work_dirs(tmp_path / "work", TASK)[0].exists()


async def test_rt15_a_lane_directory_half_removed_by_a_crash_frees_its_name_at_once(
    tmp_path: Path,
) -> None:
    """RT15: a task-runner host (``tests/tasks/task_host.py``, a real process) whose first
    pass comes at day 31 is SIGKILLed half-way through removing the expired task's lane
    directory (its log gone, its session still there). Its name is free at once — nothing
    of the old lane (its session) is left where a lane under the id would be made again
    once the id is forgotten, nor in ``lanes/`` at all — and what the crash left lies in
    ``trash/`` only, which the next host's pass empties; the work directories went first,
    the candidate stays, the id is ``task_expired``."""
    state = tmp_path / "state"
    async with crash_rig(tmp_path, CRASH_STEPS) as (model, url, _workers):
        spec = {
            **task_spec(url),
            "retention": {"journal_days": 7, "idempotency_days": 30, "forget_days": 365},
            "retain_at_days": [31],
        }
        facts = await kill_when_paused(tmp_path, spec, "retention:inside_remove_tree")
        (ended,) = [f["ended"] for f in facts if "ended" in f]
        assert not (state / "lanes" / lane_key(f"task:{TASK}")).exists()
        assert not work_dirs(tmp_path / "work", TASK)[0].exists()
        (left,) = (state / "trash").iterdir()
        assert (left / "session.jsonl").is_file()  # the crash came half-way through it
        assert not (left / "lane.log").exists()
        asked = model.request_count
        facts = await recover(tmp_path, spec)
    assert model.request_count == asked
    assert [f["resubmitted"] for f in facts if "resubmitted" in f] == ["task_expired"]
    assert not list((state / "trash").iterdir())
    assert (state / ended["candidate"]["ref"]).is_file()


async def test_rt15_a_pass_empties_the_trash_first_and_touches_nothing_live(
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    """RT15: what a crash left in the trash — part of a lane directory in the state
    directory's ``trash/``, part of a home in the work root's — is removed by the next pass,
    the first one, with nothing due, whatever the expired-task filter holds (the trash holds
    only what a removal put there). The waiting task's lane directory, session and home, and
    the ended task not yet due, are untouched."""
    async with open_rig(tmp_path, clocks, STEPS) as rig:
        await ended_and_live(rig)
        gone = rig.store.root / "trash" / f"{lane_key('task:old')}.gone-0123456789abcdef"
        (gone / "nested").mkdir(parents=True)
        (gone / "session.jsonl").write_text("{}\n")
        (gone / "nested" / "part").write_text("x")
        home_gone = tmp_path / "work" / "trash" / f"{lane_key('task:old')}.gone-fedcba9876543210"
        home_gone.mkdir(parents=True)
        (home_gone / ".profile").write_text("x")
        live = rig.runner.show(LIVE)
        live_before = await rig.records(LIVE)
        before = await rig.records()

        assert await rig.runner.retain(RETENTION) == TaskRetention()
        assert not list((rig.store.root / "trash").iterdir())
        assert not list((tmp_path / "work" / "trash").iterdir())
        assert (rig.store.root / live.session_path).is_file()
        assert work_dirs(tmp_path / "work", LIVE)[0].is_dir()
        assert (await rig.records(LIVE))[: len(live_before)] == live_before
        assert rig.runner.show(LIVE).state == "waiting"
        assert await rig.records() == before
        assert (rig.store.root / rig.runner.show(TASK).session_path).is_file()


async def test_rt12_a_task_the_pass_cannot_slim_stays_with_that_task(
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    """RT12, a fault stays where it happened: the first ended task's lane log is damaged
    (one flipped byte: ``journal_corrupt``), so the pass cannot slim it. The pass goes on:
    the second ended task is slimmed, the first is reported left (with its reason) and kept
    as it is — retention never rewrites what it cannot read. At day 31 both are expired:
    an expiry goes by the end this process knows, not by reading the log."""
    other = "task-2"
    async with open_rig(tmp_path, clocks, [done(), say("one"), done(), say("two")]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        await submit_beside(rig, other)
        await rig.ended(other)
        log = lane_dir(rig) / "lane.log"
        data = bytearray(log.read_bytes())
        data[len(data) // 2] ^= 0x40
        log.write_bytes(bytes(data))
        damaged = bytes(data)

        wall_clock.advance(8 * DAY)
        done_ = await rig.runner.retain(RETENTION)
        assert done_.slimmed == (other,)
        assert [task for task, _ in done_.left] == [TASK]
        assert "journal_corrupt" in done_.left[0][1]
        assert log.read_bytes() == damaged
        assert [type(r) for r in await rig.records(other)] == [
            Header,
            Compacted,
            TaskSubmitted,
            TaskEnded,
        ]

        wall_clock.advance(23 * DAY)
        done_ = await rig.runner.retain(RETENTION)
        assert done_.expired == (TASK, other)
        assert done_.left == ()
        assert not lane_dir(rig).exists()
        assert not lane_dir(rig, other).exists()


async def test_rt17_a_work_directory_holding_another_tasks_worktree_is_kept(
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    """RT17: a task that goes on from where an ended one left its work — its worktree the
    clone the first task made in its own home — is live while the first task's days pass.
    Its worktree is in use: the pass that slims the first task (day 8) keeps the home and
    temporary directory that hold it and says why (``left``, naming the live task), an
    operator's ``task forget`` of the first task is refused ``worktree_leased`` and removes
    nothing, and the expiry (day 31) keeps them still — the first task stays known, as one
    whose directory could not go does, until they can. They were removed — renamed into the
    trash and deleted — under the live task's feet."""
    async with open_rig(tmp_path, clocks, STEPS) as rig:
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        home, tmp = work_dirs(tmp_path / "work", TASK)
        tree = home / "clone"
        tree.mkdir()
        (tree / "notes.md").write_text("work in progress\n")
        spec = rig.spec()
        live = TaskSpec(task_id=LIVE, prompt=spec.prompt, worktree=str(tree), grants=spec.grants)
        await rig.runner.submit(live)
        await rig.until(lambda: rig.runner.show(LIVE).state == "waiting")

        wall_clock.advance(8 * DAY)
        slim = await rig.runner.retain(RETENTION)
        kept_at_8 = (tree / "notes.md").read_text()
        with _Refused(ReasonCode.WORKTREE_LEASED):
            await rig.runner.forget(TASK, RETENTION)
        forgotten = rig.runner.show(TASK).state

        wall_clock.advance(23 * DAY)
        expiry = await rig.runner.retain(RETENTION)
        duplicate = (await rig.runner.submit(rig.spec())).state
        kept_at_31 = (tree / "notes.md").read_text()
        live_state = rig.runner.show(LIVE).state
    assert slim.slimmed == (TASK,)
    assert [task for task, _ in slim.left] == [TASK]
    assert repr(LIVE) in slim.left[0][1]
    assert kept_at_8 == kept_at_31 == "work in progress\n"
    assert forgotten == "done"
    assert expiry.expired == ()  # its id is in the filter; it stays known until it can go
    assert [task for task, _ in expiry.left] == [TASK]
    assert duplicate == "done"  # (a task whose directory could not go stays known, RT12)
    assert home.is_dir()
    assert tmp.is_dir()  # (both of the task's work directories, or neither)
    assert live_state == "waiting"


# -- RT12: an operator's ``task forget`` and the retention pass, on one task ------------------


async def _quiet() -> None:
    """Until every task waits and no thread works: virtual time (the I/O-aware autojump
    clock) moves only then, so a virtual second has passed once nothing can go on."""
    await trio.sleep(1)


@pytest.mark.parametrize("inside", ["forget-inside-pass", "pass-inside-forget"])
async def test_rt12_task_forget_and_a_retention_pass_on_one_task_run_one_after_the_other(
    inside: str,
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    """RT12: an operator's ``task forget`` lands between two awaits of the retention pass on
    the same ended task (day 8: the pass has read the lane log and is about to slim it), or
    the pass lands between two of the forget's (its id expired, its directories not yet
    removed). Each must act as if the other came wholly before or after it: the pass
    reports no fault and slims only a task not forgotten yet, the forget removes everything,
    and the task is ``task_expired`` after. They ran at once: the pass slimmed a task the
    operator was forgetting, or reported the forgotten task's missing log as a fault of
    its own (``left``: no such file) for the next pass."""
    async with open_rig(tmp_path, clocks, STEPS[:2]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        home, _tmp = work_dirs(tmp_path / "work", TASK)
        store = rig.store
        reached, go = trio.Event(), trio.Event()
        hooked = "slim_log" if inside == "forget-inside-pass" else "expire_tasks"
        real = getattr(store, hooked)

        async def pausing(*args: object, **kwargs: object) -> object:
            if inside == "forget-inside-pass":  # the pass read the log; its slim comes next
                reached.set()
                await go.wait()
                return await real(*args, **kwargs)
            done = await real(*args, **kwargs)  # the forget's expiry; its removal comes next
            reached.set()
            await go.wait()
            return done

        setattr(store, hooked, pausing)
        wall_clock.advance(8 * DAY)
        passes: list[TaskRetention] = []
        forgotten: list[list[str]] = []

        async def retain() -> None:
            passes.append(await rig.runner.retain(RETENTION))

        async def forget() -> None:
            forgotten.append(await rig.runner.forget(TASK, RETENTION))

        first, second = (retain, forget) if inside == "forget-inside-pass" else (forget, retain)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await reached.wait()
            nursery.start_soon(second)
            await _quiet()  # the second has done what it could meanwhile
            go.set()
        setattr(store, hooked, real)
        with _Refused(ReasonCode.TASK_EXPIRED):
            rig.runner.show(TASK)
        with _Refused(ReasonCode.TASK_EXPIRED):
            await rig.runner.submit(rig.spec())
        again = await rig.runner.retain(RETENTION)
    (done,) = passes
    if inside == "forget-inside-pass":  # the pass, then the forget
        assert done == TaskRetention(slimmed=(TASK,))
    else:  # the forget, then a pass with nothing to do
        assert done == TaskRetention()
    assert again == TaskRetention()
    assert any(lane_key(f"task:{TASK}") in item for item in forgotten[0])
    assert not lane_dir(rig).exists()
    assert not home.exists()
    assert not list((tmp_path / "state" / "trash").iterdir())


@pytest.mark.parametrize("cut", ["failed", "cancelled"])
async def test_rt12_a_forget_cut_short_after_the_expiry_leaves_its_task_let_go(
    cut: str,
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    """RT12: a ``task forget`` whose id is expired but whose lane directory is not removed
    yet is cut short there — the removal fails (``EACCES`` renaming it), or its caller gives
    up waiting (the admin socket's deadline cancels the handler). The task must not come
    back: it is ``task_expired`` (for ``task show``, a submission, another forget) from then
    on, as after a restart, and the next pass removes what is left. A cancelled forget runs
    to its end (its removals are bounded; one cut half-way would leave the rest to a pass).
    Before, the host kept the task as ended in memory — ``task show`` said ``done`` and a
    duplicate submission was answered from the record of a task whose id was expired and
    whose log the next pass removed, until a restart said ``task_expired``."""
    async with open_rig(tmp_path, clocks, STEPS[:2]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        store = rig.store
        real = store.remove_tree
        reached, go = trio.Event(), trio.Event()

        async def cut_short(rel: str) -> bool:
            if cut == "failed":
                raise PermissionError(errno.EACCES, "Permission denied", rel)
            reached.set()
            await go.wait()
            return await real(rel)

        store.remove_tree = cut_short  # type: ignore[method-assign]
        wall_clock.advance(8 * DAY)
        forgotten: list[object] = []
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def forget() -> None:
                with scope:
                    try:
                        forgotten.append(await rig.runner.forget(TASK, RETENTION))
                    except OSError as error:
                        forgotten.append(error)

            nursery.start_soon(forget)
            if cut == "cancelled":
                await reached.wait()
                scope.cancel()  # the caller gives up waiting
                await _quiet()
                go.set()
        store.remove_tree = real  # type: ignore[method-assign]
        with _Refused(ReasonCode.TASK_EXPIRED):
            rig.runner.show(TASK)
        with _Refused(ReasonCode.TASK_EXPIRED):
            await rig.runner.submit(rig.spec())
        with _Refused(ReasonCode.TASK_EXPIRED):
            await rig.runner.forget(TASK, RETENTION)
        assert TASK not in rig.runner.task_ids()
        done = await rig.runner.retain(RETENTION)
    assert done.left == ()
    assert not lane_dir(rig).exists()
    if cut == "failed":
        (error,) = forgotten
        assert isinstance(error, PermissionError)
    else:  # it ran to its end
        (removed,) = forgotten
        assert isinstance(removed, list)
        assert any(lane_key(f"task:{TASK}") in item for item in removed)


async def test_rt12_a_host_killed_in_a_task_forget_lets_the_task_go_at_the_next_pass(
    tmp_path: Path,
) -> None:
    """RT12: a task-runner host (``tests/tasks/task_host.py``, real Fake-Pi workers) ends a
    task, and an operator forgets it at day 8; the host is SIGKILLed right after the forget
    made the id expired, before its lane directory went. The next host on the same state
    directory runs its first pass (day 8: past ``journal_days`` of the task's end, inside
    ``idempotency_days``): it removes the lane directory and lets the task go, and a
    resubmission is ``task_expired`` — the task never runs again, the model is asked
    nothing more. Before, the pass took the task for one still to slim: it slimmed the log
    of a forgotten task, removed its directory as expired, but kept it known as ended — a
    resubmission was answered ``done`` from memory until the next restart."""
    async with crash_rig(tmp_path, CRASH_STEPS) as (model, url, _workers):
        spec = {
            **task_spec(url),
            "retention": {"journal_days": 7, "idempotency_days": 30, "forget_days": 365},
            "resubmit": False,
            "forget_at_days": 8,
        }
        facts = await kill_when_paused(tmp_path, spec, "retention:expire_tasks")
        (ended,) = [f["ended"] for f in facts if "ended" in f]
        assert not [f for f in facts if "forgotten" in f]
        asked = model.request_count
        del spec["forget_at_days"]
        facts = await recover(tmp_path, {**spec, "retain_at_days": [8], "resubmit": True})
    assert model.request_count == asked
    (retained,) = [f["retained"] for f in facts if "retained" in f]
    assert retained == {"days": 8, "slimmed": [], "expired": [TASK]}
    assert [f["resubmitted"] for f in facts if "resubmitted" in f] == ["task_expired"]
    assert not (tmp_path / "state" / "lanes" / lane_key(f"task:{TASK}")).exists()
    assert not work_dirs(tmp_path / "work", TASK)[0].exists()
    assert not (tmp_path / "state" / ended["candidate"]["ref"]).exists()  # the forget's first


async def test_rt4_rt12_a_task_id_let_go_at_its_time_is_new_again_and_kept(
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    """RT4, RT12: a task expired at day 31 with ``forget_days`` 40 is let go at day 40 by the
    lookup itself — a submission under its id at day 41 is a new task, although nothing
    rewrote the filter since (before, it was ``task_expired`` until some later expiry did).
    That new task, waiting, is never taken for the old one's leftover: a pass with the wall
    clock set back two days — the old entry holding its id back again — keeps its lane."""
    retention = RetentionConfig(journal_days=7, idempotency_days=30, forget_days=40)
    async with open_rig(tmp_path, clocks, STEPS) as rig:
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        wall_clock.advance(31 * DAY)
        assert (await rig.runner.retain(retention)).expired == (TASK,)
        wall_clock.advance(10 * DAY)
        again = await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        wall_clock.advance(-2 * DAY)
        done_ = await rig.runner.retain(retention)
        state = rig.runner.show(TASK).state
        kept = lane_dir(rig).is_dir()
    assert again.state != "done"  # a new task, not the old one's record
    assert done_ == TaskRetention()
    assert state == "waiting"
    assert kept
