"""The lifecycle kernel of a task lane (runtime._tasks._lifecycle): first terminal wins, the
Done tuple.

Pure core, plain synchronous tests named after the invariants of docs/design/watchdog.md
(``test_lk<N>_…``); docs/design/watchdog.md groups 5 (explicit outcomes, the layered Done), 7
(waits) and 9
(terminal-vs-epoch-CAS races, first terminal wins, late evidence).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime._records import LifecycleKind, LifecycleReceipt
from runtime._tasks._lifecycle import (
    OPERATOR_EPOCH,
    DoneEvidence,
    EpochKey,
    LifecycleKernel,
    Report,
    TaskState,
    Verdict,
    done_missing,
)

K = LifecycleKind
TERMINAL_KINDS = (K.DONE, K.FAIL, K.ABORT, K.OPERATOR_FAIL)
OPERATOR_KINDS = (K.ABORT, K.OPERATOR_FAIL)
OUTCOME = {
    K.DONE: TaskState.SUCCESS_INTENT,
    K.FAIL: TaskState.FAILED,
    K.ABORT: TaskState.ABORTED,
    K.OPERATOR_FAIL: TaskState.FAILED,
    K.WAIT: TaskState.WAITING,
}


def kernel(epoch: int = 1) -> LifecycleKernel:
    """A kernel whose first process epoch owns the task."""
    k = LifecycleKernel("task-1")
    assert k.begin_epoch(epoch, fenced=False)
    return k


def state(k: LifecycleKernel) -> TaskState:
    """The task state (a call, so that a type checker does not narrow it)."""
    return k.state


def report(k: LifecycleKernel, intent: str, kind: LifecycleKind, **key: Any) -> Verdict:
    """A report of ``kind``: from the operator for abort / operator_fail, else from the current
    worker; ``key`` changes fields of its epoch key."""
    base = k.operator_key() if kind in OPERATOR_KINDS else k.current
    return k.report(
        Report(key=dataclasses.replace(base, **key), intent_id=intent, kind=kind, detail=intent)
    )


def accepted_terminals(k: LifecycleKernel) -> list[LifecycleReceipt]:
    return [r for r in k.receipts if r.accepted and OUTCOME[r.kind].terminal]


# ------------------------------------------------------------------- LK1 first terminal wins


def first_terminal_wins(order: tuple[LifecycleKind, ...]) -> tuple[LifecycleKind, list[bool]]:
    """The terminal in force after ``order`` and which reports were accepted: the first wins,
    except that a success intent (``done``, not finalized) may still be ended by the first
    operator abort or fail after it (LK9)."""
    winner, accepted = order[0], [True]
    for kind in order[1:]:
        overrides = winner is K.DONE and kind in OPERATOR_KINDS
        accepted.append(overrides)
        winner = kind if overrides else winner
    return winner, accepted


@pytest.mark.parametrize("order", list(itertools.permutations(TERMINAL_KINDS)))
def test_lk1_first_terminal_wins_in_every_order(order: tuple[LifecycleKind, ...]) -> None:
    k = kernel()
    verdicts = [report(k, f"intent-{n}", kind) for n, kind in enumerate(order)]
    winner, accepted = first_terminal_wins(order)
    assert verdicts == [Verdict.ACCEPTED if a else Verdict.LATE_TERMINAL for a in accepted]
    assert k.state is OUTCOME[winner]
    assert k.state.terminal
    assert k.wait_correlation is None
    assert len(k.receipts) == 4  # every later report is recorded, as late evidence
    assert [r.accepted for r in k.receipts] == accepted
    assert k.terminal is not None
    assert k.terminal.kind is winner


@pytest.mark.parametrize("first", TERMINAL_KINDS)
def test_lk1_a_wait_or_reply_after_a_terminal_changes_nothing(first: LifecycleKind) -> None:
    k = kernel()
    report(k, "first", first)
    assert report(k, "wait", K.WAIT) is Verdict.LATE_TERMINAL
    assert k.reply(None) is Verdict.NOT_WAITING
    assert k.state is OUTCOME[first]
    assert k.wait_correlation is None


def test_lk1_a_done_task_stays_done() -> None:
    k = kernel()
    report(k, "done", K.DONE)
    k.finalize()
    assert k.state is TaskState.DONE
    for n, kind in enumerate((*TERMINAL_KINDS, K.WAIT)):
        assert report(k, f"late-{n}", kind) is Verdict.LATE_TERMINAL
    assert state(k) is TaskState.DONE


@pytest.mark.parametrize("state_", [TaskState.OPEN, TaskState.WAITING, TaskState.FAILED,
                                    TaskState.ABORTED])  # fmt: skip
def test_lk1_only_a_success_intent_can_be_finalized(state_: TaskState) -> None:
    k = kernel()
    k.state = state_
    with pytest.raises(ValueError, match="success intent"):
        k.finalize()
    assert k.state is state_


# ---------------------------------------------------------- LK2 only the current epoch decides


def fenced_kernel() -> LifecycleKernel:
    """Generation 2, attempt 3; epoch 1 was fenced and epoch 2 owns the task (fence 1)."""
    k = LifecycleKernel("task-1", generation=2, attempt=3)
    assert k.begin_epoch(1, fenced=False)
    assert k.begin_epoch(2, fenced=True)
    assert (k.epoch, k.fence) == (2, 1)
    return k


STALE_KEYS: list[dict[str, Any]] = [
    {"epoch": 1},  # an old process epoch
    {"fence": 0},  # an old fence
    {"epoch": 1, "fence": 0},  # the fenced epoch itself
    {"epoch": 3},  # an epoch that does not own the task (yet)
    {"attempt": 2},  # another attempt
    {"attempt": 4},
    {"generation": 1},  # another generation
    {"generation": 3},
    {"task_id": "task-2"},  # another task
]


@pytest.mark.parametrize("stale", STALE_KEYS)
@pytest.mark.parametrize("kind", [K.DONE, K.FAIL, K.WAIT])
def test_lk2_a_stale_worker_report_is_late_and_changes_nothing(
    stale: dict[str, Any], kind: LifecycleKind
) -> None:
    k = fenced_kernel()
    assert report(k, "stale", kind, **stale) is Verdict.LATE_EPOCH
    assert k.state is TaskState.OPEN
    assert k.wait_correlation is None
    assert k.terminal is None
    assert (k.epoch, k.fence) == (2, 1)
    (receipt,) = k.receipts
    assert (receipt.accepted, receipt.verdict, receipt.intent_id) == (False, "late_epoch", "stale")
    assert receipt.epoch == stale.get("epoch", 2)  # the receipt names whose report it was
    # the current epoch still decides
    assert report(k, "current", kind) is Verdict.ACCEPTED
    assert state(k) is OUTCOME[kind]


@pytest.mark.parametrize("stale", STALE_KEYS)
def test_lk2_a_stale_report_after_a_terminal_is_still_late_by_epoch(stale: dict[str, Any]) -> None:
    k = fenced_kernel()
    report(k, "fail", K.FAIL)
    assert report(k, "stale", K.DONE, **stale) is Verdict.LATE_EPOCH
    assert k.state is TaskState.FAILED
    assert k.terminal is k.receipts[0]


@pytest.mark.parametrize(
    "other", [{"attempt": 2}, {"generation": 1}, {"generation": 3}, {"task_id": "task-2"}]
)
@pytest.mark.parametrize("kind", OPERATOR_KINDS)
def test_lk2_an_operator_report_for_another_attempt_is_late(
    other: dict[str, Any], kind: LifecycleKind
) -> None:
    k = fenced_kernel()
    assert report(k, "op", kind, **other) is Verdict.LATE_EPOCH
    assert k.state is TaskState.OPEN
    assert k.terminal is None


@pytest.mark.parametrize("kind", OPERATOR_KINDS)
def test_lk2_an_operator_report_is_never_late_by_epoch(kind: LifecycleKind) -> None:
    k = fenced_kernel()
    key = k.operator_key()
    assert key.epoch == OPERATOR_EPOCH
    assert (key.task_id, key.generation, key.attempt, key.fence) == ("task-1", 2, 3, 1)
    assert report(k, "op", kind) is Verdict.ACCEPTED
    assert k.state is OUTCOME[kind]


def test_lk2_the_current_key_is_the_kernels() -> None:
    k = fenced_kernel()
    assert k.current == EpochKey(task_id="task-1", generation=2, attempt=3, fence=1, epoch=2)


# ---------------------------------------------------------------------- LK3 consumed once


@pytest.mark.parametrize("kind", [*TERMINAL_KINDS, K.WAIT])
def test_lk3_the_same_intent_twice_is_a_duplicate(kind: LifecycleKind) -> None:
    k = kernel()
    assert report(k, "intent-1", kind) is Verdict.ACCEPTED
    after = (k.state, k.wait_correlation)
    assert report(k, "intent-1", kind) is Verdict.DUPLICATE
    assert len(k.receipts) == 1
    assert (k.state, k.wait_correlation) == after


def test_lk3_a_duplicate_of_another_kind_is_still_a_duplicate() -> None:
    k = kernel()
    assert report(k, "intent-1", K.FAIL) is Verdict.ACCEPTED
    assert report(k, "intent-1", K.DONE) is Verdict.DUPLICATE
    assert k.state is TaskState.FAILED
    assert len(k.receipts) == 1


def test_lk3_late_evidence_is_consumed_once_too() -> None:
    k = fenced_kernel()
    assert report(k, "old", K.DONE, epoch=1, fence=0) is Verdict.LATE_EPOCH
    assert report(k, "old", K.DONE, epoch=1, fence=0) is Verdict.DUPLICATE
    assert report(k, "old", K.DONE) is Verdict.DUPLICATE  # even re-keyed to the current epoch
    assert k.state is TaskState.OPEN
    report(k, "fail", K.FAIL)
    assert report(k, "late", K.DONE) is Verdict.LATE_TERMINAL
    assert report(k, "late", K.DONE) is Verdict.DUPLICATE
    assert len(k.receipts) == 3


def test_lk3_a_replayed_wait_does_not_park_again() -> None:
    k = kernel()
    assert report(k, "wait-1", K.WAIT) is Verdict.ACCEPTED
    assert k.reply("wait-1") is Verdict.ACCEPTED
    assert report(k, "wait-1", K.WAIT) is Verdict.DUPLICATE
    assert k.state is TaskState.OPEN
    assert k.wait_correlation is None


# ------------------------------------------------------------------------ LK4 Done is a tuple


MANIFEST = "sha256:manifest-after-quiescence"


def done_kernel() -> LifecycleKernel:
    """Epoch 2 (fenced in) reported done."""
    k = fenced_kernel()
    assert report(k, "done", K.DONE) is Verdict.ACCEPTED
    assert k.state is TaskState.SUCCESS_INTENT
    return k


def evidence(k: LifecycleKernel, **changes: Any) -> DoneEvidence:
    """Complete evidence for the kernel's Done; ``changes`` take pieces away."""
    complete = DoneEvidence(
        terminal=k.terminal,
        quiescent_epoch=k.epoch,
        manifest_digest=MANIFEST,
        candidate_manifest_digest=MANIFEST,
    )
    return dataclasses.replace(complete, **changes)


def test_lk4_complete_evidence_is_done() -> None:
    k = done_kernel()
    assert done_missing(k, evidence(k)) == []
    k.finalize()
    assert k.state is TaskState.DONE


@pytest.mark.parametrize(
    ("changes", "missing"),
    [
        ({"terminal": None}, ["terminal_receipt", "quiescence"]),
        ({"quiescent_epoch": None}, ["quiescence"]),
        ({"quiescent_epoch": 1}, ["quiescence"]),  # the fenced epoch's tree, not this one's
        ({"quiescent_epoch": 3}, ["quiescence"]),
        ({"manifest_digest": None}, ["manifest", "candidate"]),
        ({"manifest_digest": None, "candidate_manifest_digest": None}, ["manifest", "candidate"]),
        ({"candidate_manifest_digest": None}, ["candidate"]),
        ({"candidate_manifest_digest": "sha256:before-quiescence"}, ["candidate"]),
        ({"validation_required": True}, ["validation"]),
        ({"validation_required": True, "validation_passed": False,
          "validation_manifest_digest": MANIFEST}, ["validation"]),
        ({"validation_required": True, "validation_passed": True}, ["validation"]),
        ({"validation_required": True, "validation_passed": True,
          "validation_manifest_digest": "sha256:other"}, ["validation"]),
        ({"validation_required": True, "validation_passed": None,
          "validation_manifest_digest": MANIFEST}, ["validation"]),
        ({"validation_required": False, "validation_passed": False}, []),
        ({"validation_required": True, "validation_passed": True,
          "validation_manifest_digest": MANIFEST}, []),
        ({"terminal": None, "quiescent_epoch": None, "manifest_digest": None,
          "candidate_manifest_digest": None, "validation_required": True},
         ["terminal_receipt", "quiescence", "manifest", "candidate", "validation"]),
    ],
)  # fmt: skip
def test_lk4_done_missing_lists_exactly_the_missing_pieces(
    changes: dict[str, Any], missing: list[str]
) -> None:
    k = done_kernel()
    assert done_missing(k, evidence(k, **changes)) == missing


def test_lk4_an_old_epoch_done_never_satisfies_it() -> None:
    k = fenced_kernel()
    assert report(k, "old-done", K.DONE, epoch=1, fence=0) is Verdict.LATE_EPOCH
    old = k.receipts[-1]
    assert k.terminal is None
    assert k.state is TaskState.OPEN
    assert "terminal_receipt" in done_missing(k, evidence(k, terminal=old, quiescent_epoch=1))
    assert "terminal_receipt" in done_missing(k, evidence(k, terminal=old))


def test_lk4_a_receipt_that_is_not_the_kernels_terminal_never_satisfies_it() -> None:
    k = done_kernel()
    forged = LifecycleReceipt(
        task_id="task-1", generation=2, attempt=3, fence=0, epoch=1, intent_id="old-done",
        kind=K.DONE, accepted=True, verdict="accepted",
    )  # fmt: skip
    assert done_missing(k, evidence(k, terminal=forged, quiescent_epoch=1)) == ["terminal_receipt"]


@pytest.mark.parametrize("kind", [K.FAIL, K.ABORT, K.OPERATOR_FAIL])
def test_lk4_a_failure_terminal_never_satisfies_it(kind: LifecycleKind) -> None:
    k = fenced_kernel()
    report(k, "end", kind)
    assert "terminal_receipt" in done_missing(k, evidence(k))
    assert report(k, "done", K.DONE) is Verdict.LATE_TERMINAL
    late = k.receipts[-1]
    assert done_missing(k, evidence(k, terminal=late)) == ["terminal_receipt"]


def test_lk4_a_late_done_after_a_done_never_satisfies_it() -> None:
    k = done_kernel()
    assert report(k, "done-again", K.DONE) is Verdict.LATE_TERMINAL
    late = k.receipts[-1]
    assert done_missing(k, evidence(k, terminal=late)) == ["terminal_receipt"]
    assert done_missing(k, evidence(k)) == []


# ---------------------------------------------------------------------------- LK5 waits


def waiting_kernel() -> LifecycleKernel:
    k = kernel()
    assert report(k, "wait-1", K.WAIT) is Verdict.ACCEPTED
    assert k.state is TaskState.WAITING
    assert k.wait_correlation == "wait-1"
    assert k.terminal is None  # a wait is not a terminal
    return k


@pytest.mark.parametrize("correlation", ["wait-1", None])
def test_lk5_the_correlated_reply_wakes(correlation: str | None) -> None:
    k = waiting_kernel()
    assert k.reply(correlation) is Verdict.ACCEPTED
    assert k.state is TaskState.OPEN
    assert k.wait_correlation is None
    assert k.reply(correlation) is Verdict.NOT_WAITING  # only once


@pytest.mark.parametrize("correlation", ["wait-2", "", "WAIT-1"])
def test_lk5_a_reply_with_another_correlation_does_not_wake(correlation: str) -> None:
    k = waiting_kernel()
    assert k.reply(correlation) is Verdict.NOT_WAITING
    assert k.state is TaskState.WAITING
    assert k.wait_correlation == "wait-1"


@pytest.mark.parametrize("correlation", ["wait-1", None, "x"])
def test_lk5_a_reply_when_nothing_waits_is_refused(correlation: str | None) -> None:
    k = kernel()
    assert k.reply(correlation) is Verdict.NOT_WAITING
    assert k.state is TaskState.OPEN


@pytest.mark.parametrize("kind", [K.DONE, K.FAIL, K.WAIT])
def test_lk5_a_parked_workers_reports_are_late(kind: LifecycleKind) -> None:
    k = waiting_kernel()
    assert report(k, "more", kind) is Verdict.LATE_TERMINAL
    assert k.state is TaskState.WAITING
    assert k.wait_correlation == "wait-1"
    assert not k.receipts[-1].accepted


@pytest.mark.parametrize("kind", OPERATOR_KINDS)
def test_lk5_the_operator_may_end_a_waiting_task(kind: LifecycleKind) -> None:
    k = waiting_kernel()
    assert report(k, "op", kind) is Verdict.ACCEPTED
    assert k.state is OUTCOME[kind]
    assert k.wait_correlation is None
    assert k.reply("wait-1") is Verdict.NOT_WAITING


def test_lk5_after_the_reply_the_worker_decides_again() -> None:
    k = waiting_kernel()
    k.reply("wait-1")
    k.reply_heard()  # the prompt carrying the reply reached the worker (LK8)
    assert report(k, "wait-2", K.WAIT) is Verdict.ACCEPTED
    assert k.wait_correlation == "wait-2"
    assert k.reply("wait-1") is Verdict.NOT_WAITING  # the old wait's reply
    assert k.reply("wait-2") is Verdict.ACCEPTED
    k.reply_heard()
    assert report(k, "done", K.DONE) is Verdict.ACCEPTED
    assert k.state is TaskState.SUCCESS_INTENT


def test_lk8_a_report_before_the_worker_heard_the_reply_is_not_accepted() -> None:
    k = waiting_kernel()
    assert k.reply("wait-1") is Verdict.ACCEPTED
    assert report(k, "guess", K.DONE) is Verdict.REPLY_PENDING
    assert report(k, "guess", K.DONE) is Verdict.DUPLICATE  # consumed once (LK3)
    assert k.state is TaskState.OPEN
    k.reply_heard()
    assert report(k, "done", K.DONE) is Verdict.ACCEPTED
    assert [r.verdict for r in k.receipts][-2:] == ["reply_pending", "accepted"]


# ------------------------------------------------------------------ LK6 epoch compare-and-set


@pytest.mark.parametrize("kind", TERMINAL_KINDS)
@pytest.mark.parametrize("fenced", [True, False])
def test_lk6_a_terminal_before_the_cas_prevents_the_launch(
    kind: LifecycleKind, fenced: bool
) -> None:
    k = kernel()
    report(k, "end", kind)
    assert k.begin_epoch(2, fenced=fenced) is False
    assert (k.epoch, k.fence) == (1, 0)
    assert k.state is OUTCOME[kind]


@pytest.mark.parametrize("kind", [K.DONE, K.FAIL, K.WAIT])
def test_lk6_after_the_cas_the_old_epochs_report_is_late(kind: LifecycleKind) -> None:
    k = kernel()
    old = k.current
    assert k.begin_epoch(2, fenced=True)
    assert k.report(Report(key=old, intent_id="old", kind=kind)) is Verdict.LATE_EPOCH
    assert k.state is TaskState.OPEN
    assert report(k, "new", kind) is Verdict.ACCEPTED  # the new epoch decides


def test_lk6_an_accepted_wait_before_the_cas_prevents_the_launch() -> None:
    """Seed 002: an accepted done/fail/wait/abort before the continuation-epoch CAS prevents
    the launch; a parked task is woken by its reply, not by a continuation."""
    k = waiting_kernel()
    assert k.begin_epoch(2, fenced=True) is False
    assert (k.epoch, k.fence) == (1, 0)
    assert k.state is TaskState.WAITING
    assert k.reply("wait-1") is Verdict.ACCEPTED
    assert k.begin_epoch(2, fenced=False)  # the woken task's worker
    assert (k.epoch, k.fence) == (2, 0)


def test_lk6_fenced_moves_the_fence_and_the_old_fence_is_late() -> None:
    k = kernel()
    assert k.begin_epoch(2, fenced=True)
    assert (k.epoch, k.fence) == (2, 1)
    assert report(k, "old-fence", K.DONE, fence=0) is Verdict.LATE_EPOCH
    assert k.begin_epoch(3, fenced=False)
    assert (k.epoch, k.fence) == (3, 1)
    assert report(k, "old-epoch", K.DONE, epoch=2) is Verdict.LATE_EPOCH
    assert k.state is TaskState.OPEN
    assert report(k, "current", K.DONE) is Verdict.ACCEPTED


@pytest.mark.parametrize("epoch", [0, 1])
def test_lk6_an_epoch_must_move_forward(epoch: int) -> None:
    k = kernel()
    with pytest.raises(ValueError, match="not after"):
        k.begin_epoch(epoch, fenced=True)
    assert (k.epoch, k.fence) == (1, 0)


# -------------------------------------------------------------------------- LK7 durable


def restored(k: LifecycleKernel, *, done: bool = False, replies: tuple[str, ...] = ()) -> (
    LifecycleKernel
):  # fmt: skip
    return LifecycleKernel.restore(
        k.task_id, list(k.receipts), generation=k.generation, attempt=k.attempt, fence=k.fence,
        epoch=k.epoch, done=done, replies=replies,
    )  # fmt: skip


def assert_same(a: LifecycleKernel, b: LifecycleKernel) -> None:
    assert b.state is a.state
    assert b.wait_correlation == a.wait_correlation
    assert b.current == a.current
    assert b.receipts == a.receipts
    assert b.terminal == a.terminal
    assert b.operator_key() == a.operator_key()
    for receipt in a.receipts:  # every intent is consumed in the restored kernel too
        assert (
            b.report(Report(key=b.current, intent_id=receipt.intent_id, kind=K.FAIL))
            is Verdict.DUPLICATE
        )
    assert b.receipts == a.receipts


def test_lk7_restore_reproduces_a_success_intent() -> None:
    k = fenced_kernel()
    report(k, "stale", K.DONE, epoch=1, fence=0)
    report(k, "wait-1", K.WAIT)
    report(k, "parked", K.FAIL)
    assert k.reply("wait-1") is Verdict.ACCEPTED
    k.reply_heard()
    report(k, "done", K.DONE)
    report(k, "late", K.FAIL)
    again = restored(k, replies=("wait-1",))
    assert_same(k, again)
    assert again.state is TaskState.SUCCESS_INTENT
    assert done_missing(again, evidence(again)) == []


def test_lk7_restore_with_done_is_done() -> None:
    k = done_kernel()
    k.finalize()
    again = restored(k, done=True)
    assert_same(k, again)
    assert again.state is TaskState.DONE


def test_lk7_done_without_a_success_intent_is_not_restored_as_done() -> None:
    k = kernel()
    report(k, "fail", K.FAIL)
    assert restored(k, done=True).state is TaskState.FAILED


def test_lk7_restore_reproduces_an_unanswered_wait() -> None:
    k = waiting_kernel()
    report(k, "parked", K.DONE)
    again = restored(k)
    assert again.state is TaskState.WAITING
    assert again.wait_correlation == "wait-1"
    assert again.reply("wait-2") is Verdict.NOT_WAITING
    assert again.reply("wait-1") is Verdict.ACCEPTED
    assert state(again) is TaskState.OPEN
    assert_same(waiting_kernel_after_reply(), again)


def waiting_kernel_after_reply() -> LifecycleKernel:
    k = waiting_kernel()
    report(k, "parked", K.DONE)
    k.reply("wait-1")
    return k


def test_lk7_restore_reproduces_an_answered_wait() -> None:
    k = waiting_kernel_after_reply()
    again = restored(k, replies=("wait-1",))
    assert_same(k, again)
    assert again.state is TaskState.OPEN
    assert again.wait_correlation is None


@pytest.mark.parametrize("kind", OPERATOR_KINDS)
def test_lk7_restore_reproduces_a_wait_ended_by_the_operator(kind: LifecycleKind) -> None:
    k = waiting_kernel()
    report(k, "op", kind)
    assert k.wait_correlation is None
    again = restored(k)
    assert_same(k, again)
    assert again.wait_correlation is None


@pytest.mark.parametrize("order", list(itertools.permutations(TERMINAL_KINDS)))
def test_lk7_restore_keeps_the_first_terminal(order: tuple[LifecycleKind, ...]) -> None:
    k = kernel()
    for n, kind in enumerate(order):
        report(k, f"intent-{n}", kind)
    again = restored(k)
    assert_same(k, again)
    assert again.state is OUTCOME[first_terminal_wins(order)[0]]
    assert again.begin_epoch(2, fenced=True) is False


def test_lk7_a_restored_kernel_goes_on_judging() -> None:
    k = fenced_kernel()
    report(k, "stale", K.FAIL, epoch=1, fence=0)
    again = restored(k)
    assert_same(k, again)
    assert again.state is TaskState.OPEN
    assert report(again, "done", K.DONE) is Verdict.ACCEPTED
    assert report(again, "fail", K.FAIL) is Verdict.LATE_TERMINAL


def test_lk7_the_receipt_records_the_verdict() -> None:
    k = fenced_kernel()
    report(k, "stale", K.DONE, epoch=1, fence=0)
    report(k, "done", K.DONE)
    report(k, "late", K.FAIL)
    stale, done, late = k.receipts
    assert (stale.verdict, stale.accepted, stale.epoch, stale.fence) == ("late_epoch", False, 1, 0)
    assert (done.verdict, done.accepted, done.epoch, done.fence) == ("accepted", True, 2, 1)
    assert (late.verdict, late.accepted) == ("late_terminal", False)
    assert (done.task_id, done.generation, done.attempt, done.detail) == ("task-1", 2, 3, "done")


# ------------------------------------------------------------------------- property: LK1-LK6


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("report"),
            st.sampled_from(["current", "old_epoch", "old_fence", "operator", "other_attempt"]),
            st.sampled_from(list(LifecycleKind)),
            st.integers(0, 12).map(lambda n: f"intent-{n}"),
        ),
        st.tuples(st.just("begin"), st.booleans(), st.just(K.DONE), st.just("")),
        st.tuples(st.just("heard"), st.just(""), st.just(K.DONE), st.just("")),
        st.tuples(
            st.just("reply"),
            st.sampled_from(["current", "none", "other"]),
            st.just(K.DONE),
            st.just(""),
        ),
    ),
    max_size=40,
)


def key_for(k: LifecycleKernel, whose: str) -> EpochKey:
    current = k.current
    return {
        "current": current,
        "old_epoch": dataclasses.replace(current, epoch=current.epoch - 1),
        "old_fence": dataclasses.replace(current, fence=current.fence - 1),
        "operator": k.operator_key(),
        "other_attempt": dataclasses.replace(current, attempt=current.attempt + 1),
    }[whose]


@settings(max_examples=1000, deadline=None)
@given(OPS)
def test_lk1_property_at_most_one_terminal_and_never_leaving_it(
    ops: list[tuple[str, Any, LifecycleKind, str]],
) -> None:
    k = kernel()
    terminal_state: TaskState | None = None
    answered: list[str] = []
    for op, arg, kind, intent in ops:
        before = (k.epoch, k.fence, len(k.receipts))
        if op == "report":
            verdict = k.report(Report(key=key_for(k, arg), intent_id=intent, kind=kind))
            if verdict is Verdict.DUPLICATE:
                assert len(k.receipts) == before[2]
            else:
                assert len(k.receipts) == before[2] + 1
        elif op == "begin":
            moved = k.begin_epoch(k.epoch + 1, fenced=arg)
            if terminal_state is not None:
                assert moved is False
                assert (k.epoch, k.fence) == before[:2]
        elif op == "heard":
            k.reply_heard()
        else:
            waiting = k.wait_correlation
            correlation = {"current": waiting, "none": None, "other": "other"}[arg]
            if k.reply(correlation) is Verdict.ACCEPTED:
                assert waiting is not None
                answered.append(waiting)
        terminals = accepted_terminals(k)
        assert len(terminals) <= 2
        if len(terminals) == 2:  # LK9: an operator ended a success intent before its Done
            assert (terminals[0].kind, terminals[1].kind in OPERATOR_KINDS) == (K.DONE, True)
        assert len({r.intent_id for r in k.receipts}) == len(k.receipts)  # consumed once
        if terminal_state is TaskState.SUCCESS_INTENT and k.state is not terminal_state:
            assert k.state in (TaskState.ABORTED, TaskState.FAILED)
            terminal_state = k.state
        if terminal_state is not None:
            assert k.state is terminal_state
        elif k.state.terminal:
            terminal_state = k.state
        if terminals:
            assert k.terminal is terminals[-1]
    assert_same(k, restored(k, replies=tuple(answered)))
