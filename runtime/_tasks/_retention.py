"""Retention of ended tasks (docs/design/retention.md RT12, RT13): the task lanes' share of
what ``[retention]`` keeps, on the file store and on a shared store.

An ended task — its ``TaskEnded`` recorded — passes through the same stages as a finished
room delivery (RT2-RT4), on the host's wall clock from its end (``TaskEnded.ended_ms``):

* ``journal_days`` after its end its lane log is slimmed to its **idempotency record** — the
  submission (what a duplicate must repeat) and the end record (state, code, the manifest's
  digest, the candidate, the validation) — and its session, home and temporary directory
  are removed: a duplicate submission still gets the same answer, ``task show`` its end;
* ``idempotency_days`` after its end the task id goes into the expired-task filter
  (``tasks-expired.ids``, the expired-id filter's format), then its lane directory goes: a
  submission under the id is then ``task_expired``, never run again as new, until
  ``forget_days`` after its end;
* **candidates stay** (the ``tar`` archive under ``candidates/``, the git ref
  ``refs/pi-runtime/candidates/<task>`` in its worktree): they are the task's work, removed
  only by an operator (``pi-runtime task forget``, :func:`forget_task`).

A task's home or temporary directory that holds the worktree of a task still known — live,
or ended and not yet let go (its candidate's git ref lives there) — is not removed while it
does (RT17): the pass leaves it, and says why, until that task is let go.

What has not ended is never touched, whatever its age (RT1). Removal is ordered so a crash
between two steps leaves more, never less (RT5): the log is slimmed before the session goes
(the slimmed log names nothing the session held), the filter is durable before the lane
directory goes, and each step is idempotent, so the next pass finishes what a crash left.
A directory that goes whole (an expired task's work directories, then its lane directory) is
renamed into a ``trash/`` first and removed there (RT15), and every pass first empties the
trash: a crash in the middle of removing one leaves nothing under its name, and nothing a
later pass could fail to find. A pass and an operator's ``task forget`` never run at once on
one store (the runner's lock, the state directory's with no server), and a task whose id is
expired already is only let go, never slimmed or expired again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import trio

from .._clock import Clocks
from .._config import RetentionConfig
from .._errors import DiskFailedError, JournalError, ReasonCode, TaskError
from .._journal._interface import JournalStore, LeaseStore
from .._journal._journal import LogContents
from .._journal._store import Store, lane_key, open_store
from .._journal._trash import discard_tree, sweep_trash
from .._linux._fs import OsFileSystem
from .._records import Compacted, Header, Record, TaskEnded, TaskSubmitted, ends_at
from .._retention import RetentionSettings, check_settings
from ._candidate import CANDIDATE_REF_PREFIX, candidate_ref_lock
from ._state import session_rel
from ._worktree import git, git_env, repository

__all__ = [
    "SeenHere",
    "TaskRetention",
    "ended_tasks",
    "expired_already",
    "forget_offline",
    "forget_task",
    "retain_ended_tasks",
    "retain_offline",
    "retain_shared_tasks",
    "shared_expired_tasks",
    "task_logs",
    "task_worktrees",
    "work_dirs",
]

DAY_MS: Final = 86_400_000
LANES: Final = "lanes"
TRASH_LEFT: Final = "(trash)"
"""What :attr:`TaskRetention.left` names a trash it could not empty by (RT15)."""

Worktrees = Mapping[str, str]
"""The worktree (absolute, real) of every task still known, by task id (RT17)."""


def _nothing_in_use() -> Worktrees:
    return {}


@dataclass(frozen=True, slots=True)
class TaskRetention:
    """What one pass did: the tasks slimmed to their idempotency record, and those expired."""

    slimmed: tuple[str, ...] = ()
    expired: tuple[str, ...] = ()
    left: tuple[tuple[str, str], ...] = ()
    """Tasks the pass could not finish, with why (a damaged log, a directory it could not
    remove): each left as it was for the next pass, the others done (a fault stays with its
    task). A trash the pass could not empty (RT15) is named :data:`TRASH_LEFT`."""


@dataclass(slots=True)
class SeenHere:
    """What this process's passes on a shared store did already (RT13): the ended tasks it
    found slim, and those whose session and work directories it removed here."""

    slim: set[str] = field(default_factory=set)
    cleaned: set[str] = field(default_factory=set)

    def forget(self, task_id: str) -> None:
        self.slim.discard(task_id)
        self.cleaned.discard(task_id)


def work_dirs(work_root: Path, task_id: str) -> tuple[Path, Path]:
    """The task's home and temporary directory (``TaskLane.home``, ``TaskLane.tmp``)."""
    return _work_dirs_of(work_root, _key(task_id))


def _work_dirs_of(work_root: Path, key: str) -> tuple[Path, Path]:
    return work_root / "homes" / key, work_root / "tmp" / key


def lane_name(task_id: str) -> str:
    """The lane (and lease) name of the task ``task_id``."""
    return f"task:{task_id}"


def _lane_dir(task_id: str) -> str:
    return f"{LANES}/{_key(task_id)}"


def _key(task_id: str) -> str:
    """The task's lane key: the name of its lane directory and of its work directories."""
    return lane_key(lane_name(task_id))


async def task_logs(
    store: JournalStore, unreadable: Callable[[str, Exception], None]
) -> AsyncIterator[tuple[TaskSubmitted, LogContents]]:
    """Every task lane log of a file store's directory that holds a task's submission, with
    its records, in path order. One a crash left empty (its create cut short, J3) holds no
    task yet; one that cannot be read is told to ``unreadable`` and passed over — one task's
    damaged log never stops a start or a pass for the others (TL11)."""
    lanes = store.root / LANES
    found = await trio.to_thread.run_sync(lambda: sorted(lanes.glob("*/lane.log")))
    for path in found:
        rel = str(path.relative_to(store.root))
        try:
            contents = await store.read(rel)
        except Exception as error:
            unreadable(rel, error)
            continue
        if not contents.records:
            continue
        subject = contents.header.subject
        if not subject.startswith("task:") or path.parent.name != lane_key(subject):
            continue
        submitted = next((r for r in contents.records if isinstance(r, TaskSubmitted)), None)
        if submitted is not None:
            yield submitted, contents


async def ended_tasks(store: Store) -> dict[str, TaskEnded]:
    """Every ended task whose lane log the state directory holds, by id (what
    ``pi-runtime journal compact`` retains with no server running; a server's runner knows
    them already). A log that cannot be read is left alone: retention never removes what it
    cannot read (a damaged log is ``journal verify``'s to report)."""
    ended: dict[str, TaskEnded] = {}
    async for submitted, contents in task_logs(store, lambda rel, error: None):
        end = next((r for r in contents.records if isinstance(r, TaskEnded)), None)
        if end is not None:
            ended[submitted.task_id] = end
    return ended


async def task_worktrees(store: JournalStore) -> dict[str, str]:
    """The worktree of every task whose lane log the state directory holds, live or ended,
    by id (what a pass with no server keeps work directories for, RT17); a log that cannot
    be read names none."""
    return {
        submitted.task_id: submitted.worktree
        async for submitted, _contents in task_logs(store, lambda rel, error: None)
    }


async def retain_ended_tasks(
    store: Store,
    ended: Mapping[str, int],
    *,
    now_ms: int,
    retention: RetentionConfig,
    work_root: Path,
    in_use: Callable[[], Worktrees] = _nothing_in_use,
) -> TaskRetention:
    """One retention pass over the ended tasks ``ended`` (task id → its end's wall-clock
    ms): slim those past ``journal_days``, expire those past ``idempotency_days``; one whose
    id is expired already (a forget or a pass cut short after the filter) is let go — its
    directories removed, reported among the expired — never slimmed again. An end time of 0
    (a log written before ends were timed) is not aged: it is kept. ``in_use()``: the
    worktrees of the tasks still known, asked before each removal of a task's work
    directories (after the last await): one that holds any is kept, and reported (RT17); a
    lane directory of a task it names is never removed as another's leftover. The caller
    runs one pass or ``task forget`` at a time (RT12: :meth:`TaskRunner.retain`)."""
    journal_cut = now_ms - retention.journal_days * DAY_MS
    expiry_cut = now_ms - retention.idempotency_days * DAY_MS
    forget_ms = int(retention.forget_days * DAY_MS)
    slimmed: list[str] = []
    expired: dict[str, int] = {}
    left: list[tuple[str, str]] = []
    with _fault_stays(left, TRASH_LEFT):  # RT15: what a crash left of a removal, first
        await store.sweep_trash()
        await trio.to_thread.run_sync(sweep_trash, OsFileSystem(), str(work_root))
    going: dict[str, str] = {}  # lane key → the task whose directories go now
    for task_id, ended_ms in sorted(ended.items()):
        if expired_already(store, task_id, ended_ms, now_ms=now_ms):
            going[_key(task_id)] = task_id  # expired already (a forget or a pass cut short
            continue  # after the filter): not slimmed or expired again, its lane goes
        if ended_ms <= 0 or ended_ms > journal_cut:
            continue
        if ended_ms <= expiry_cut:
            expired[task_id] = ended_ms
            continue
        with _fault_stays(left, task_id):
            await _slim(store, task_id, work_root, in_use, slimmed)
    if expired:
        await store.expire_tasks(expired, forget_ms=forget_ms)  # RT5: the filter first
        going.update((_key(task_id), task_id) for task_id in expired)
    gone: list[str] = []
    for key, task_id in sorted(going.items(), key=lambda item: item[1]):
        with _fault_stays(left, task_id):  # (expired; its directories go next pass)
            await _remove_lane(store, key, work_root, in_use)
            gone.append(task_id)
    # what a crash between the filter and a removal left: a lane directory whole, its task
    # expired (no longer known here); the filter says whose it was (a crash *in* a removal
    # left its part in the trash, emptied above). Never a known task's: an id the filter let
    # go may be submitted again — asked now, after the last await, and at the time now (a
    # submission is admitted once the id's time has passed; a clock set back would find it
    # expired once more)
    for key in await _lane_dirs(store.root):
        if key in going or not store.expired_tasks.holds(key, now_ms=store.clocks.wall.time_ms()):
            continue
        if key in {_key(task_id) for task_id in in_use()}:
            continue
        with _fault_stays(left, key):
            await _remove_lane(store, key, work_root, in_use)
    return TaskRetention(tuple(slimmed), tuple(gone), tuple(left))


def expired_already(store: Store, task_id: str, ended_ms: int, *, now_ms: int) -> bool:
    """Whether the filter holds back ``task_id`` for *this* task — the one known as ended at
    ``ended_ms`` — so that it is let go, not aged (RT12, RT19): its entry counts from that
    end or later (a pass expires a task from its end, a forget from then or now). An entry
    from before it is an earlier task's under the same id — let go at its time, the id
    submitted again, then held back once more by a raised ``forget_days`` or a clock set
    back — and this one ages from its own end. (An earlier version's entry says no time: it
    is taken for this task's, as before.)"""
    key = _key(task_id)
    if not store.expired_tasks.holds(key, now_ms=now_ms):
        return False
    since = store.expired_tasks.since(key)
    return since is None or since >= ended_ms


async def retain_shared_tasks(
    store: LeaseStore,
    ended: Mapping[str, int],
    *,
    now_ms: int,
    retention: RetentionConfig,
    work_root: Path,
    lease_seconds: float,
    seen: SeenHere,
    in_use: Callable[[], Worktrees] = _nothing_in_use,
) -> TaskRetention:
    """One retention pass over the ended tasks of a deployment on a shared store (RT13):
    ``ended`` (task id → its end's wall-clock ms) as this host knows them.

    The database's part: each task past ``journal_days`` is slimmed, each past
    ``idempotency_days`` expired, by the host whose pass first claims the task's lane — the
    claim moves the lane's epoch on, so nothing an earlier holder still tries to append can
    land — in one transaction under that claim, released after; a lane whose lease runs (a
    holder) is left for a later pass. This host's part: the session, home and temporary
    directory of every task past ``journal_days`` it has here, and every task lane directory
    here whose task the database holds as expired. ``seen`` keeps what this process did
    already, so a task is slimmed and cleaned here once, not at every pass. A work directory
    holding a worktree ``in_use()`` names is kept, and reported (RT17)."""
    journal_cut = now_ms - retention.journal_days * DAY_MS
    expiry_cut = now_ms - retention.idempotency_days * DAY_MS
    slimmed: list[str] = []
    expired: list[str] = []
    left: list[tuple[str, str]] = []
    try:  # RT15: what a crash left of a removal here, first
        for root in (store.root, work_root):
            await trio.to_thread.run_sync(sweep_trash, OsFileSystem(), str(root))
    except OSError as exc:
        left.append((TRASH_LEFT, str(exc)))
    for task_id, ended_ms in sorted(ended.items()):
        if ended_ms <= 0 or ended_ms > journal_cut:
            continue
        if ended_ms > expiry_cut and task_id in seen.slim:
            continue
        with _fault_stays(left, task_id):
            await _retain_one_shared(
                store,
                task_id,
                ended_ms,
                expiry_cut,
                retention,
                lease_seconds,
                seen,
                slimmed,
                expired,
            )
    await store.forget_expired_tasks()  # past forget_days: an id that may be used again
    going = [t for t in sorted(ended) if 0 < ended[t] <= journal_cut and t not in seen.cleaned]
    for task_id in going:  # this host's copies: its session and work directories
        session = store.root / session_rel(task_id)
        try:
            await trio.to_thread.run_sync(
                _remove_session_and_work, session, work_root, task_id, in_use()
            )
        except (OSError, TaskError) as exc:
            left.append((task_id, str(exc)))
        else:
            seen.cleaned.add(task_id)
    here = await _lane_dirs(store.root)
    # on the database's word only, and never that of a task known here unless it is expired
    # by its own expiry (this pass's or another host's): a row under the id of a task live,
    # inside its idempotency_days or not yet expired (a pass that could not claim its lane)
    # is an earlier task's, held back again by a raised forget_days or a clock set back (RT19)
    due = await shared_expired_tasks(store, ended, now_ms=now_ms, retention=retention)
    known = {_key(task_id) for task_id in in_use() if task_id not in due}
    for key in sorted(await store.expired_task_keys(here)):
        if key in known:
            continue
        try:  # the work directories first: while the lane directory is here, a pass finds them
            await trio.to_thread.run_sync(_discard_work_dirs, work_root, key, in_use())
            await trio.to_thread.run_sync(
                discard_tree, OsFileSystem(), str(store.root), _lane_rel(key)
            )
        except (OSError, TaskError) as exc:
            left.append((key, str(exc)))
    return TaskRetention(tuple(slimmed), tuple(expired), tuple(left))


async def shared_expired_tasks(
    store: LeaseStore, ended: Mapping[str, int], *, now_ms: int, retention: RetentionConfig
) -> dict[str, int | None]:
    """Which of the ended tasks ``ended`` (task id → its end's wall-clock ms) past
    ``idempotency_days`` are expired in the database by their own expiry (RT13, RT19), each
    with the time its id is let go (``None``: let go already, nothing holds it here): its
    lane log gone — ``expire_task`` records the row and deletes the log in one transaction
    — with its key held in ``expired_tasks`` or not any more (past ``forget_days``, or
    ``forget_days`` no longer than ``idempotency_days``: expired and let go at once); or its
    lane log holding *another* task under the id (no end at this task's time: a later task,
    the id let go and submitted again while this host still remembered this one) — let go,
    ``None``: the id is that task's now, and a submission here is answered from the database.
    The row is asked before the log, so an expiry between the two looks is found. A row
    held while this task's own log is still there is an earlier task's under the id, held
    back again (a raised ``forget_days``, a clock set back) while no pass could claim this
    task's lane yet: the task is kept, ended, for a later pass to expire — never forgotten
    with its log left in the database. A log that cannot be read keeps its task."""
    cut = now_ms - retention.idempotency_days * DAY_MS
    due = {_key(t): t for t, ended_ms in ended.items() if 0 < ended_ms <= cut}
    held = await store.expired_task_keys(list(due))
    expired: dict[str, int | None] = {}
    absent: list[str] = []
    for key, task_id in sorted(due.items()):
        rel = store.lane_rel(lane_name(task_id))
        try:
            records = (await store.read(rel)).records
        except FileNotFoundError:
            expired[task_id] = held.get(key)
            absent.append(key)
            continue
        except JournalError:
            continue  # damaged: kept (``journal verify`` reports it)
        if not ends_at(records, ended[task_id]):
            expired[task_id] = None  # another task's log under the id: this one let go
    if any(expired[due[key]] is None for key in absent):  # expired since the row was asked
        again = await store.expired_task_keys([k for k in absent if expired[due[k]] is None])
        expired.update((due[key], until) for key, until in again.items())
    return expired


async def _lane_dirs(root: Path) -> list[str]:
    """The names (lane keys) of the lane directories in the state directory ``root``."""
    lanes = root / LANES
    return await trio.to_thread.run_sync(
        lambda: sorted(p.name for p in lanes.iterdir() if p.is_dir()) if lanes.is_dir() else []
    )


@contextlib.contextmanager
def _fault_stays(left: list[tuple[str, str]], task_id: str) -> Iterator[None]:
    """One task's part of a pass: a fault of that task's is noted in ``left`` and the pass
    goes on with the others (RT12); a disk failure ends the pass (the store stops
    admitting)."""
    try:
        yield
    except DiskFailedError:
        raise
    except Exception as exc:
        left.append((task_id, str(exc)))


async def _retain_one_shared(
    store: LeaseStore,
    task_id: str,
    ended_ms: int,
    expiry_cut: float,
    retention: RetentionConfig,
    lease_seconds: float,
    seen: SeenHere,
    slimmed: list[str],
    expired: list[str],
) -> None:
    """The database's part of :func:`retain_shared_tasks` for one task (RT13 (a)-(c)),
    under a claim of its lane; a lane whose lease runs (a holder) is left for a later pass."""
    subject = lane_name(task_id)
    rel = store.lane_rel(subject)
    fence = await store.claim(subject, lease_seconds)
    if fence is None:
        return
    try:
        if ended_ms <= expiry_cut:
            forget_ms = int(retention.forget_days * DAY_MS)  # RT4: from its end
            if await store.expire_task(task_id, ended_ms, forget_ms=forget_ms, fence=fence):
                expired.append(task_id)
        else:
            with contextlib.suppress(FileNotFoundError):  # expired by another host
                records = (await store.read(rel)).records  # read after the claim
                kept = [r for r in records if isinstance(r, TaskSubmitted | TaskEnded)]
                rest = [r for r in records if not isinstance(r, Header | Compacted)]
                if len(rest) == len(kept):
                    seen.slim.add(task_id)  # slim already (another host's pass)
                elif await store.slim_log(rel, kept, fence=fence):
                    seen.slim.add(task_id)
                    slimmed.append(task_id)
    finally:
        with trio.CancelScope(shield=True):
            await store.release(fence)


async def _slim(
    store: Store,
    task_id: str,
    work_root: Path,
    in_use: Callable[[], Worktrees],
    slimmed: list[str],
) -> None:
    """Slim one ended task's lane log to its idempotency record (noted in ``slimmed`` when
    written now: a slim log is not written again, but what a crash left of the rest is
    removed), then remove its session and work directories — those kept while they hold a
    worktree ``in_use()`` names (RT17: ``worktree_leased``, after the log is slim)."""
    rel = store.lane_rel(f"task:{task_id}")
    contents = await store.read(rel)
    kept: list[Record] = [r for r in contents.records if isinstance(r, TaskSubmitted | TaskEnded)]
    rest = [r for r in contents.records if not isinstance(r, Header | Compacted)]
    if len(rest) > len(kept):
        await store.slim_log(rel, kept)
        slimmed.append(task_id)
    submitted = next(r for r in kept if isinstance(r, TaskSubmitted))
    session = store.root / submitted.session_path
    await trio.to_thread.run_sync(_remove_session_and_work, session, work_root, task_id, in_use())


async def _remove_lane(
    store: Store, key: str, work_root: Path, in_use: Callable[[], Worktrees]
) -> None:
    """An expired task's work directories, then its lane directory (``key``: its lane's),
    each renamed into a trash first (RT15): the lane directory, the last to go, leads a
    later pass back to what a crash left before it — and to work directories kept while
    they hold a worktree ``in_use()`` names (RT17: ``worktree_leased``, nothing removed)."""
    await trio.to_thread.run_sync(_discard_work_dirs, work_root, key, in_use())
    await store.remove_tree(_lane_rel(key))


def _lane_rel(key: str) -> str:
    return f"{LANES}/{key}"


def _remove_session_and_work(
    session: Path, work_root: Path, task_id: str, in_use: Worktrees
) -> None:
    """An ended task's session file and its work directories (blocking; RT12, RT15, RT17)."""
    _remove_paths([session])
    _discard_work_dirs(work_root, _key(task_id), in_use)


def _discard_work_dirs(work_root: Path, key: str, in_use: Worktrees) -> None:
    """Remove a task's home and temporary directory (blocking), each by way of the work
    root's trash (RT15); a file or link where one would be is unlinked. Neither is touched
    when one of them is, or holds, a worktree of ``in_use`` (RT17)."""
    _refuse_in_use(work_root, key, in_use)
    fs = OsFileSystem()
    for path in _work_dirs_of(work_root, key):
        if path.is_dir() and not path.is_symlink():
            discard_tree(fs, str(work_root), str(path.relative_to(work_root)))
        elif path.exists() or path.is_symlink():
            _remove_paths([path])


def _refuse_in_use(work_root: Path, key: str, in_use: Worktrees) -> None:
    """``worktree_leased`` when a task's work directory (``key``: its lane key) is, or holds,
    the worktree of a task ``in_use`` names (blocking: real paths). A task's home is where
    its agent works; a later task may go on in a clone it made there (RT17)."""
    for path in _work_dirs_of(work_root, key):
        real = os.path.realpath(path)
        for task_id, tree in sorted(in_use.items()):
            if tree == real or tree.startswith(real.rstrip("/") + "/"):
                raise TaskError(
                    ReasonCode.WORKTREE_LEASED,
                    f"{path} holds the worktree {tree} of task {task_id!r}: kept while that "
                    "task is known (retention removes it once that task is let go)",
                )


def _remove_paths(paths: list[Path]) -> None:
    """Remove each file or directory tree that is there (blocking), then fsync each parent."""
    parents: set[str] = set()
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        parents.add(str(path.parent))
    fs = OsFileSystem()
    for parent in sorted(parents):
        fs.fsync_dir(parent)


async def forget_task(
    store: Store,
    ended: TaskEnded,
    submitted: TaskSubmitted,
    *,
    now_ms: int,
    retention: RetentionConfig,
    work_root: Path,
    in_use: Callable[[], Worktrees] = _nothing_in_use,
) -> list[str]:
    """``pi-runtime task forget``: remove everything that is left of an ended task now —
    its candidate (the archive, or the git ref that keeps its commit reachable), its lane
    directory and work directories — the id expired first, so a later submission under it is
    ``task_expired`` until ``forget_days`` after its end. What was removed, for the operator.
    Refused ``worktree_leased``, nothing removed, while its work directories hold a worktree
    ``in_use()`` names (RT17). Never beside a retention pass on the same store (the caller's
    to keep: :meth:`TaskRunner.forget`; with no server, the state directory's lock)."""
    key = _key(submitted.task_id)
    await trio.to_thread.run_sync(_refuse_in_use, work_root, key, in_use())
    removed: list[str] = []
    candidate = ended.candidate or {}
    if candidate.get("kind") == "archive":
        archive = Path(str(candidate.get("ref", "")))
        if not archive.is_absolute():
            archive = store.root / archive
        if await trio.to_thread.run_sync(archive.exists):
            await trio.to_thread.run_sync(_remove_paths, [archive])
            removed.append(str(archive))
    elif candidate.get("kind") == "git_commit":
        ref = str(candidate.get("git_ref") or CANDIDATE_REF_PREFIX + submitted.task_id)
        if await trio.to_thread.run_sync(_delete_ref, submitted.worktree, ref):
            removed.append(f"{ref} in {submitted.worktree}")
    since = max(ended.ended_ms, now_ms)  # held back forget_days from now, at the least
    await store.expire_tasks(
        {submitted.task_id: since}, forget_ms=int(retention.forget_days * DAY_MS)
    )
    await _remove_lane(store, key, work_root, in_use)
    removed.append(_lane_dir(submitted.task_id))
    return removed


def _delete_ref(worktree: str, ref: str) -> bool:
    """Delete the candidate's ref (blocking); whether it was there. A worktree that is gone
    has no ref left to remove. Under W-C6's lock of the ref, as taking a candidate is
    (:func:`candidate_ref_lock`): never beside a candidate of the task being taken, a git
    lock on the ref left by a git of ours killed holding it — taking a candidate or deleting
    one — is taken over once that git is provably gone, and the deleting git is recorded, so
    a lock a kill leaves now is taken over in turn (RT12; worktree.md W-C6). In the
    worktree's own repository only (W-M11)."""
    if not ref.startswith(CANDIDATE_REF_PREFIX) or not os.path.isdir(worktree):
        return False  # never a ref the runtime did not make
    code = ReasonCode.WORKTREE_UNREADABLE
    repo = repository(worktree)
    env = git_env(**repo)
    with contextlib.ExitStack() as held:
        try:
            update = held.enter_context(candidate_ref_lock(repo["GIT_COMMON_DIR"], ref, code))
        except ValueError:
            return False  # not a name the runtime gives a candidate's ref
        shown, _ = git(worktree, ["show-ref", "--verify", "--quiet", ref], env=env, code=code,
                       ok_codes=(0, 1))  # fmt: skip
        if shown != 0:
            return False
        update(worktree, env, f"delete {ref}\n".encode())
    return True


# -- with no server running (the CLI) -------------------------------------------------------


async def retain_offline(
    state_dir: Path, *, settings: RetentionSettings, clocks: Clocks
) -> TaskRetention:
    """``pi-runtime journal compact``'s share for tasks: one pass over a state directory no
    server holds (its lock is taken: ``state_dir_locked`` while one runs)."""
    async with open_store(state_dir, clocks=clocks) as store:
        await check_settings(store, settings)  # RT14, under the lock
        ended = {task_id: end.ended_ms for task_id, end in (await ended_tasks(store)).items()}
        trees = await task_worktrees(store)  # RT17: nothing else changes them meanwhile
        return await retain_ended_tasks(
            store,
            ended,
            now_ms=clocks.wall.time_ms(),
            retention=settings.retention,
            work_root=Path(settings.task_work_root),
            in_use=lambda: trees,
        )


async def forget_offline(
    state_dir: Path, task_id: str, *, settings: RetentionSettings, clocks: Clocks
) -> list[str]:
    """``pi-runtime task forget`` with no server running: :func:`forget_task` from the lane
    log; refused ``task_expired`` (its own entry in the filter: an earlier task's under the
    id, held back again, forgets nothing of it, RT19), ``task_unknown``, ``task_not_ended``."""
    async with open_store(state_dir, clocks=clocks) as store:
        await check_settings(store, settings)  # RT14, under the lock
        now = clocks.wall.time_ms()
        let_go = TaskError(ReasonCode.TASK_EXPIRED, f"task {task_id!r} was let go already")
        unknown = TaskError(ReasonCode.TASK_UNKNOWN, f"no task {task_id!r} in {state_dir}")
        held = store.expired_tasks.holds(_key(task_id), now_ms=now)
        rel = store.lane_rel(f"task:{task_id}")
        if not await store.exists(rel):
            raise let_go if held else unknown
        records = (await store.read(rel)).records
        submitted = next((r for r in records if isinstance(r, TaskSubmitted)), None)
        end = next((r for r in records if isinstance(r, TaskEnded)), None)
        if submitted is None:
            raise let_go if held else unknown
        if end is None:
            raise TaskError(
                ReasonCode.TASK_NOT_ENDED, f"task {task_id!r} has not ended: abort or fail it first"
            )
        if expired_already(store, task_id, end.ended_ms, now_ms=now):  # this task's entry:
            raise let_go  # a forget cut short; an earlier task's under the id is not (RT19)
        trees = await task_worktrees(store)  # RT17
        trees.pop(task_id, None)
        return await forget_task(
            store,
            end,
            submitted,
            now_ms=clocks.wall.time_ms(),
            retention=settings.retention,
            work_root=Path(settings.task_work_root),
            in_use=lambda: trees,
        )
