"""The task-lane watchdog, fencing guards and recovery budget (runtime._tasks._watchdog, _guards).

Pure cores, plain synchronous tests named after the invariants of docs/design/watchdog.md
(``test_wd<N>_…``). Time is plain numbers: a :class:`Tick` carries the boottime reading
(``now``, counts a suspend) and the monotonic reading (``awake``, does not); while the host is
awake both advance together. The clock matrix is docs/design/watchdog.md's "RED-first permanent
validation"
list (groups 1, 2, 3, 4, 7, 9, 10).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Final

import pytest

from runtime._tasks._guards import Budget, GuardEvidence, failed_guards
from runtime._tasks._watch import watch_event
from runtime._tasks._watchdog import (
    ACTION_TABLE,
    HARD_FLOOR_SECONDS,
    Action,
    CheckGuards,
    Classification,
    Event,
    Exited,
    FenceStarted,
    GuardsFailed,
    Hold,
    Lease,
    LeaseEnded,
    Phase,
    Probe,
    ProbeAnswered,
    Progress,
    PromptCompletion,
    Prompted,
    ProviderParked,
    Relaunched,
    Settled,
    TerminalAccepted,
    Tick,
    Watchdog,
    WatchdogPolicy,
    Woken,
)

MINUTE = 60.0
HOUR = 3600.0
SOFT = Probe("soft")
FENCE = Probe("fence")
C = Classification


def prompted(at: float = 0.0, policy: WatchdogPolicy | None = None) -> Watchdog:
    """A watchdog whose lane was prompted at ``at`` (both clocks): its clocks run (WD7)."""
    wd = Watchdog(policy=WatchdogPolicy() if policy is None else policy)
    assert wd.feed(Prompted(at, at)) == []
    assert wd.armed
    assert wd.phase is Phase.PROVIDER
    return wd


def view(wd: Watchdog) -> Classification:
    """The current classification (a call, so that a type checker does not narrow it)."""
    return wd.classification


def grace(wd: Watchdog) -> float | None:
    """When the grace started (awake time), if it did."""
    return wd.grace_started_awake


def tick(wd: Watchdog, awake: float, *, asleep: float = 0.0) -> list[Action]:
    """One tick at monotonic ``awake``; boottime is ``awake + asleep`` (time spent suspended)."""
    return wd.feed(Tick(awake + asleep, awake))


def drive(
    wd: Watchdog, start: float, stop: float, *, step: float = 5.0, asleep: float = 0.0
) -> list[tuple[float, Action]]:
    """Tick every ``step`` awake seconds from ``start`` to ``stop`` inclusive; every action due,
    with the awake time of its tick."""
    out: list[tuple[float, Action]] = []
    for i in range(int((stop - start) // step) + 1):
        awake = start + i * step
        out.extend((awake, action) for action in tick(wd, awake, asleep=asleep))
    return out


def suspect_at_300() -> Watchdog:
    wd = prompted()
    assert drive(wd, 5.0, 300.0) == [(300.0, SOFT)]
    return wd


def eligible_at_1020() -> Watchdog:
    wd = suspect_at_300()
    assert drive(wd, 305.0, 1020.0) == [(1020.0, FENCE)]
    assert view(wd) is C.HARD_RESUME_ELIGIBLE
    return wd


# ------------------------------------------------------------------ WD1 progress, meaningful


def test_wd1_progress_advances_the_sequence_and_the_clock_monotonically() -> None:
    wd = prompted()
    assert wd.progress_seq == 0
    for n in range(1, 4):
        assert wd.feed(Progress(10.0 * n, 10.0 * n, Phase.GENERATION, "token")) == []
        assert wd.progress_seq == n
    assert wd.last_progress == 30.0
    assert wd.last_progress_awake == 30.0
    wd.feed(Progress(20.0, 20.0, Phase.GENERATION, "token"))  # an older reading: no going back
    assert (wd.progress_seq, wd.last_progress, wd.last_progress_awake) == (4, 30.0, 30.0)


_ASSISTANT: Final = {"message": {"role": "assistant", "content": []}}
_DELTA: Final = {**_ASSISTANT, "assistantMessageEvent": {"type": "text_delta", "delta": "a"}}
_THINK: Final = {**_ASSISTANT, "assistantMessageEvent": {"type": "thinking_delta", "delta": "h"}}


@pytest.mark.parametrize(
    ("kind", "record", "expected"),
    [
        ("turn_start", {}, ("progress", Phase.PROVIDER)),
        ("auto_retry_start", {"attempt": 1}, ("progress", Phase.PROVIDER)),
        ("compaction_start", {}, ("progress", Phase.PROVIDER)),
        ("message_start", _ASSISTANT, ("progress", Phase.GENERATION)),
        ("message_update", _DELTA, ("progress", Phase.GENERATION)),
        ("message_update", _THINK, ("progress", Phase.GENERATION)),
        ("message_end", _ASSISTANT, ("progress", Phase.UNKNOWN)),
        ("tool_execution_start", {"toolCallId": "c1", "args": {}}, ("progress", Phase.TOOL)),
        ("tool_execution_start", {"toolCallId": "c1", "args": {"timeout": 60}}, ("lease", 60.0)),
        ("tool_execution_update", {"toolCallId": "c1", "partialResult": {}},
         ("progress", Phase.TOOL)),
        ("tool_execution_end", {"toolCallId": "c1"}, ("lease_ended", "c1")),
        ("message_start", {"message": {"role": "user", "content": []}}, None),
        ("message_end", {"message": {"role": "toolResult", "content": []}}, None),
        ("agent_start", {}, None),
        ("agent_end", {"messages": []}, None),
        ("queue_update", {}, None),
        ("extension_ui_request", {}, None),
        ("response", {"command": "get_state"}, None),
    ],
)  # fmt: skip
def test_wd1_watch_event_maps_pi_events_to_progress_and_nothing_else(
    kind: str, record: dict[str, Any], expected: tuple[str, Any] | None
) -> None:
    """The real mapping from Pi's events to the core's (``watch_event``): what is progress,
    in which phase, and what is not progress at all (a probe's answer, the prompt echoed, a
    tool result echoed, the end of a run)."""
    seen = watch_event(kind, record, 100.0, 90.0)
    if expected is None:
        assert seen is None
        return
    what, value = expected
    if what == "progress":
        assert isinstance(seen, Progress)
        assert (seen.now, seen.awake, seen.phase, seen.kind) == (100.0, 90.0, value, kind)
    elif what == "lease":
        assert isinstance(seen, Lease)
        assert (seen.key, seen.deadline) == ("c1", 100.0 + value)
    else:
        assert isinstance(seen, LeaseEnded)
        assert seen.key == value


def test_wd1_a_streaming_tool_without_a_deadline_is_never_suspect_while_it_prints() -> None:
    """A live ``bash`` with no declared timeout prints a line a minute for 20 minutes: its
    output is progress, so the watchdog never suspects it (it was held at 300 s before)."""
    wd = prompted()
    started = watch_event("tool_execution_start", {"toolCallId": "b", "args": {}}, 0.0, 0.0)
    assert started is not None
    wd.feed(started)
    for minute in range(1, 21):
        now = 60.0 * minute
        update = {"toolCallId": "b", "partialResult": {"content": [{"type": "text"}]}}
        output = watch_event("tool_execution_update", update, now - 1, now - 1)
        assert output is not None  # live tool output is progress (WD1)
        assert wd.feed(output) == []
        assert wd.feed(Tick(now, now)) == []
        assert view(wd) is not C.SUSPECT
    assert wd.suspicions == 0


def test_wd1_leases_are_progress_too() -> None:
    wd = prompted()
    wd.feed(Lease(10.0, 10.0, "tool-1", deadline=100.0))
    assert wd.progress_seq == 1
    wd.feed(LeaseEnded(20.0, 20.0, "tool-1"))
    assert wd.progress_seq == 2
    assert wd.last_progress == 20.0


def test_wd1_progress_seq_is_monotonic_even_for_out_of_order_timestamps() -> None:
    wd = prompted()
    wd.feed(Progress(100.0, 100.0, Phase.GENERATION, "token"))
    wd.feed(Progress(50.0, 50.0, Phase.GENERATION, "token"))  # a late-delivered event
    assert wd.progress_seq == 2
    assert wd.last_progress == 100.0  # the clock never moves backwards
    assert wd.last_progress_awake == 100.0


@pytest.mark.parametrize("phase", [Phase.PROVIDER, Phase.GENERATION, Phase.TOOL, Phase.UNKNOWN])
def test_wd1_progress_resets_the_soft_clock(phase: Phase) -> None:
    wd = prompted()
    wd.feed(Progress(200.0, 200.0, phase, "token"))
    assert drive(wd, 5.0, 499.0, step=1.0) == []
    assert view(wd) is C.ACTIVE
    assert tick(wd, 500.0) == [SOFT]
    assert view(wd) is C.SUSPECT


def test_wd1_progress_resets_the_hard_clock_and_its_grace() -> None:
    wd = suspect_at_300()
    assert drive(wd, 305.0, 950.0) == []
    assert grace(wd) == 900.0
    wd.feed(Progress(950.0, 950.0, Phase.GENERATION, "token"))
    assert grace(wd) is None
    # the hard clock counts again from 950: eligible at 950 + 900 + 120, not at 1020
    actions = drive(wd, 955.0, 2070.0)
    assert actions == [(1250.0, SOFT), (1970.0, FENCE)]


def test_wd1_a_progressing_twenty_minute_run_is_untouched() -> None:
    """Seed group 2: a token every 4 minutes for 20 minutes; total runtime is irrelevant."""
    wd = prompted()
    actions: list[tuple[float, Action]] = []
    for awake in range(5, 20 * 60 + 1, 5):
        if awake % (4 * 60) == 0:
            wd.feed(Progress(float(awake), float(awake), Phase.GENERATION, "token"))
        actions.extend((awake, a) for a in tick(wd, float(awake)))
        assert view(wd) is C.ACTIVE
    assert actions == []
    assert wd.progress_seq == 5
    assert wd.suspicions == 0


def test_wd1_a_progressing_run_of_hours_never_probes() -> None:
    wd = prompted()
    for awake in range(5, int(6 * HOUR) + 1, 5):
        if awake % 295 == 0:
            wd.feed(Progress(float(awake), float(awake), Phase.GENERATION, "thinking"))
        assert tick(wd, float(awake)) == []
    assert wd.suspicions == 0


def test_wd1_ticks_and_probe_answers_never_advance_progress_seq() -> None:
    wd = prompted()
    wd.feed(Progress(1.0, 1.0, Phase.PROVIDER, "token"))
    drive(wd, 5.0, 1100.0)
    for answer in (
        ProbeAnswered("soft", False),
        ProbeAnswered("soft", None),
        ProbeAnswered("fence", False),
        ProbeAnswered("fence", None),
        ProbeAnswered("soft", True),
    ):
        wd.feed(answer)
        assert wd.progress_seq == 1
        assert wd.last_progress == 1.0
        assert wd.last_progress_awake == 1.0


def test_wd1_a_probe_answer_does_not_reset_the_clock() -> None:
    wd = prompted()
    assert tick(wd, 150.0) == []
    wd.feed(ProbeAnswered("soft", True))  # not an event of the core: no clock moves
    assert drive(wd, 155.0, 300.0) == [(300.0, SOFT)]
    assert wd.false_suspects == 0  # nothing was suspected when it arrived


def test_wd1_progress_clears_suspicion_and_counts_a_false_suspect() -> None:
    wd = suspect_at_300()
    wd.feed(Progress(310.0, 310.0, Phase.GENERATION, "token"))
    assert view(wd) is C.ACTIVE
    assert wd.false_suspects == 1
    assert wd.probes == {}
    # a new suspicion episode gets its own (one) probe
    assert drive(wd, 315.0, 1000.0) == [(610.0, SOFT)]
    assert wd.suspicions == 2


def test_wd1_progress_clears_eligibility_and_counts_a_false_suspect() -> None:
    wd = eligible_at_1020()
    wd.feed(Progress(1021.0, 1021.0, Phase.GENERATION, "token"))
    assert view(wd) is C.ACTIVE
    assert wd.false_suspects == 1
    assert grace(wd) is None
    wd.feed(ProbeAnswered("fence", False))  # the stale fence probe's answer: too late
    assert view(wd) is C.ACTIVE


def test_wd1_one_suspicion_episode_counts_one_false_suspect() -> None:
    """Progress clears the suspicion; the soft probe's answer then sees that same progress."""
    wd = suspect_at_300()
    wd.feed(Progress(302.0, 302.0, Phase.GENERATION, "token"))
    assert wd.feed(ProbeAnswered("soft", True)) == []
    assert wd.false_suspects == 1
    assert view(wd) is C.ACTIVE


# ------------------------------------------------------------------------- WD2 soft threshold


def test_wd2_299s_of_silence_is_active_without_a_probe() -> None:
    wd = prompted()
    assert drive(wd, 1.0, 299.0, step=1.0) == []
    assert view(wd) is C.ACTIVE
    assert wd.suspicions == 0
    assert wd.probes == {}


def test_wd2_exactly_300s_is_one_suspect_and_one_soft_probe() -> None:
    wd = prompted()
    assert tick(wd, 299.0) == []
    assert tick(wd, 300.0) == [SOFT]
    assert view(wd) is C.SUSPECT
    assert wd.suspicions == 1


def test_wd2_repeated_ticks_send_no_second_soft_probe() -> None:
    wd = suspect_at_300()
    assert tick(wd, 300.0) == []  # a duplicate tick
    assert drive(wd, 305.0, 895.0) == []
    assert view(wd) is C.SUSPECT
    assert wd.suspicions == 1
    assert wd.probes == {"soft": 1}


def test_wd2_a_late_first_tick_still_sends_exactly_one_probe() -> None:
    wd = prompted()
    assert tick(wd, 450.0) == [SOFT]
    assert tick(wd, 455.0) == []


@pytest.mark.parametrize("answer", [False, None])
def test_wd2_the_soft_probe_answer_authorizes_nothing(answer: bool | None) -> None:
    wd = suspect_at_300()
    assert wd.feed(ProbeAnswered("soft", answer)) == []
    assert view(wd) is C.SUSPECT
    assert drive(wd, 305.0, 1015.0) == []  # the hard threshold and grace still rule


def test_wd2_a_noisy_soft_probe_answer_clears_the_suspicion() -> None:
    wd = suspect_at_300()
    assert wd.feed(ProbeAnswered("soft", True)) == []
    assert view(wd) is C.ACTIVE
    assert wd.false_suspects == 1


# ------------------------------------------------------------------ WD3 hard threshold, grace


def test_wd3_no_fence_at_300s_plus_an_old_180s_grace() -> None:
    wd = suspect_at_300()
    assert drive(wd, 305.0, 480.0, step=1.0) == []
    assert view(wd) is C.SUSPECT
    assert grace(wd) is None
    assert "fence" not in wd.probes


def test_wd3_899s_is_not_eligible() -> None:
    wd = suspect_at_300()
    assert drive(wd, 301.0, 899.0, step=1.0) == []
    assert view(wd) is C.SUSPECT
    assert grace(wd) is None


def test_wd3_at_900s_the_grace_starts_but_nothing_is_eligible() -> None:
    wd = suspect_at_300()
    assert tick(wd, 899.0) == []
    assert grace(wd) is None
    assert tick(wd, 900.0) == []
    assert grace(wd) == 900.0
    assert view(wd) is C.SUSPECT


def test_wd3_900s_plus_119_is_not_eligible() -> None:
    wd = suspect_at_300()
    assert drive(wd, 301.0, 1019.0, step=1.0) == []
    assert view(wd) is C.SUSPECT
    assert grace(wd) == 900.0


def test_wd3_900s_plus_120_is_eligible_with_exactly_one_fence_probe() -> None:
    wd = suspect_at_300()
    assert drive(wd, 301.0, 1019.0, step=1.0) == []
    assert tick(wd, 1020.0) == [FENCE]
    assert view(wd) is C.HARD_RESUME_ELIGIBLE
    assert tick(wd, 1020.0) == []  # a duplicate tick
    assert drive(wd, 1021.0, 3 * HOUR, step=1.0) == []
    assert view(wd) is C.HARD_RESUME_ELIGIBLE


def test_wd3_the_whole_clock_matrix_second_by_second() -> None:
    wd = prompted()
    assert drive(wd, 1.0, 2 * HOUR, step=1.0) == [(300.0, SOFT), (1020.0, FENCE)]


def test_wd3_a_late_tick_starts_the_grace_where_the_threshold_was_crossed() -> None:
    wd = suspect_at_300()
    assert tick(wd, 960.0) == []
    assert grace(wd) == 900.0
    assert tick(wd, 1020.0) == [FENCE]


def test_wd3_a_quiet_fence_probe_answer_asks_for_the_guards() -> None:
    wd = eligible_at_1020()
    assert wd.feed(ProbeAnswered("fence", False)) == [CheckGuards()]
    assert view(wd) is C.HARD_RESUME_ELIGIBLE


def test_wd3_a_noisy_fence_probe_answer_is_back_to_active() -> None:
    wd = eligible_at_1020()
    assert wd.feed(ProbeAnswered("fence", True)) == []
    assert view(wd) is C.ACTIVE
    assert wd.false_suspects == 1
    assert grace(wd) is None
    assert wd.probes == {}


def test_wd3_an_unanswered_fence_probe_holds() -> None:
    wd = eligible_at_1020()
    assert wd.feed(ProbeAnswered("fence", None)) == []
    assert view(wd) is C.STALLED_OPERATOR_REQUIRED
    assert wd.hold_reason == "probe_unanswered"
    assert drive(wd, 1025.0, 4 * HOUR) == []


def test_wd3_a_quiet_soft_answer_never_asks_for_the_guards() -> None:
    wd = eligible_at_1020()
    assert wd.feed(ProbeAnswered("soft", False)) == []


def test_wd3_guards_are_asked_only_after_eligibility() -> None:
    wd = suspect_at_300()
    drive(wd, 305.0, 1015.0)
    assert wd.feed(ProbeAnswered("fence", False)) == []  # no fence probe was due yet


def test_wd3_failed_guards_hold() -> None:
    wd = eligible_at_1020()
    wd.feed(ProbeAnswered("fence", False))
    assert wd.feed(GuardsFailed(("process_identity", "attested"))) == []
    assert view(wd) is C.STALLED_OPERATOR_REQUIRED
    assert wd.hold_reason == "guard:process_identity,attested"
    assert drive(wd, 1025.0, 4 * HOUR) == []


def test_wd3_the_generation_phase_has_the_same_clocks() -> None:
    wd = prompted()
    wd.feed(Progress(10.0, 10.0, Phase.GENERATION, "token"))
    assert drive(wd, 15.0, 2 * HOUR) == [(310.0, SOFT), (1030.0, FENCE)]


def test_wd3_a_longer_route_threshold_is_honoured() -> None:
    policy = WatchdogPolicy(hard_seconds={Phase.PROVIDER: 1800.0, Phase.GENERATION: 900.0})
    assert policy.problems() == []
    wd = prompted(policy=policy)
    assert drive(wd, 5.0, 2 * HOUR) == [(300.0, SOFT), (1920.0, FENCE)]


def test_wd3_a_fence_runs_only_when_the_shell_starts_it() -> None:
    wd = eligible_at_1020()
    assert wd.feed(ProbeAnswered("fence", False)) == [CheckGuards()]
    assert wd.feed(FenceStarted()) == []
    assert view(wd) is C.FENCING
    assert drive(wd, 1025.0, 3 * HOUR) == []
    assert wd.feed(Relaunched(3 * HOUR + 1, 3 * HOUR + 1)) == []
    assert view(wd) is C.RESUMING
    assert wd.phase is Phase.UNKNOWN
    assert wd.probes == {}
    wd.feed(Prompted(3 * HOUR + 2, 3 * HOUR + 2))
    wd.feed(Progress(3 * HOUR + 3, 3 * HOUR + 3, Phase.GENERATION, "token"))
    assert view(wd) is C.ACTIVE


# ------------------------------------------------------------ WD4 no automatic hard threshold


@pytest.mark.parametrize("phase", [Phase.UNKNOWN, Phase.TOOL])
def test_wd4_a_silent_unknown_or_tool_phase_probes_then_holds(phase: Phase) -> None:
    wd = prompted()
    wd.feed(Progress(10.0, 10.0, phase, "event"))
    assert wd.hard_threshold() is None
    assert drive(wd, 15.0, 309.0) == []
    assert tick(wd, 310.0) == [SOFT]
    assert wd.feed(ProbeAnswered("soft", False)) == []
    assert view(wd) is C.STALLED_OPERATOR_REQUIRED
    assert wd.hold_reason == f"silent_in_{phase}_phase"
    assert drive(wd, 315.0, 6 * HOUR) == []
    assert wd.feed(ProbeAnswered("fence", False)) == []  # nothing makes it fence
    assert view(wd) is C.STALLED_OPERATOR_REQUIRED


@pytest.mark.parametrize("answer", [False, None])
def test_wd4_a_soft_probes_answer_read_before_new_progress_holds_nothing(
    answer: bool | None,
) -> None:
    """WD1, WD4: the soft probe of a silent tool phase finds nothing (or no answer), and the
    worker shows progress before that answer is fed (the lane was writing the probe's
    record). The answer is stale: the worker is active again, and it is not held."""
    wd = prompted()
    wd.feed(Progress(10.0, 10.0, Phase.TOOL, "event"))
    assert tick(wd, 310.0) == [SOFT]
    wd.feed(Progress(311.0, 311.0, Phase.TOOL, "tool_execution_update"))
    assert view(wd) is C.ACTIVE
    assert wd.feed(ProbeAnswered("soft", answer)) == []
    assert view(wd) is C.ACTIVE
    assert wd.hold_reason is None


@pytest.mark.parametrize("phase", [Phase.UNKNOWN, Phase.TOOL])
def test_wd4_an_unanswered_probe_in_an_unknown_or_tool_phase_holds(phase: Phase) -> None:
    wd = prompted()
    wd.feed(Progress(10.0, 10.0, phase, "event"))
    assert tick(wd, 310.0) == [SOFT]
    assert wd.feed(ProbeAnswered("soft", None)) == []
    assert view(wd) is C.STALLED_OPERATOR_REQUIRED


@pytest.mark.parametrize("phase", [Phase.UNKNOWN, Phase.TOOL])
def test_wd4_an_unknown_or_tool_phase_is_never_fenced_even_after_hours(phase: Phase) -> None:
    """The soft probe is never answered at all: still only observed, never eligible."""
    wd = prompted()
    wd.feed(Progress(10.0, 10.0, phase, "event"))
    actions = drive(wd, 15.0, 8 * HOUR)
    assert actions == [(310.0, SOFT)]
    assert view(wd) is C.SUSPECT
    assert grace(wd) is None


def test_wd4_the_settled_phase_has_no_hard_threshold() -> None:
    wd = prompted()
    wd.feed(Progress(10.0, 10.0, Phase.SETTLED, "event"))
    assert drive(wd, 15.0, 8 * HOUR) == [(310.0, SOFT)]
    assert wd.feed(ProbeAnswered("soft", False)) == []
    assert view(wd) is not C.HARD_RESUME_ELIGIBLE


def test_wd4_the_default_policy_has_hard_thresholds_only_for_provider_and_generation() -> None:
    policy = WatchdogPolicy()
    assert policy.hard_for(Phase.PROVIDER) == 900.0
    assert policy.hard_for(Phase.GENERATION) == 900.0
    for phase in (Phase.UNKNOWN, Phase.TOOL, Phase.SETTLED):
        assert policy.hard_for(phase) is None


# ---------------------------------------------------------------------- WD5 a valid lease holds


def test_wd5_a_valid_lease_is_long_tool_without_any_probe() -> None:
    wd = prompted()
    wd.feed(Lease(10.0, 10.0, "pytest", deadline=10.0 + 2 * HOUR))
    assert view(wd) is C.LONG_TOOL
    assert wd.phase is Phase.TOOL
    for awake in (310.0, 910.0, 1030.0, 1130.0, HOUR):
        assert drive(wd, awake - 5.0, awake) == []
        assert view(wd) is C.LONG_TOOL
    assert drive(wd, HOUR, 2 * HOUR + 5.0) == []
    assert wd.suspicions == 0


def test_wd5_silence_counts_from_the_deadline_once_it_passed() -> None:
    wd = prompted()
    wd.feed(Lease(10.0, 10.0, "pytest", deadline=2000.0))
    assert drive(wd, 15.0, 1995.0) == []
    assert tick(wd, 2000.0) == []
    assert view(wd) is C.ACTIVE  # the lease is no longer valid
    assert drive(wd, 2005.0, 2299.0, step=1.0) == []
    assert tick(wd, 2300.0) == [SOFT]
    assert view(wd) is C.SUSPECT


def test_wd5_a_silent_tool_after_its_lease_probes_then_holds() -> None:
    wd = prompted()
    wd.feed(Lease(10.0, 10.0, "pytest", deadline=2000.0))
    assert drive(wd, 15.0, 6 * HOUR) == [(2300.0, SOFT)]  # never a fence probe
    assert view(wd) is C.SUSPECT
    assert wd.feed(ProbeAnswered("soft", False)) == []
    assert view(wd) is C.STALLED_OPERATOR_REQUIRED
    assert wd.hold_reason == "silent_in_tool_phase"


def test_wd5_the_latest_of_several_leases_holds() -> None:
    wd = prompted()
    wd.feed(Lease(10.0, 10.0, "a", deadline=500.0))
    wd.feed(Lease(20.0, 20.0, "b", deadline=3000.0))
    assert drive(wd, 25.0, 995.0) == []
    wd.feed(LeaseEnded(1000.0, 1000.0, "a"))  # "b" still runs under its lease
    assert view(wd) is C.LONG_TOOL
    assert wd.phase is Phase.TOOL
    assert drive(wd, 1000.0, 2995.0) == []
    assert view(wd) is C.LONG_TOOL
    assert drive(wd, 3000.0, 6 * HOUR) == [(3300.0, SOFT)]


def test_wd5_a_lease_ending_returns_to_the_provider_clocks() -> None:
    wd = prompted()
    wd.feed(Lease(10.0, 10.0, "pytest", deadline=5000.0))
    drive(wd, 15.0, 1500.0)
    wd.feed(LeaseEnded(1500.0, 1500.0, "pytest"))
    assert view(wd) is C.ACTIVE
    assert wd.phase is Phase.PROVIDER
    assert wd.leases == {}
    assert drive(wd, 1505.0, 4 * HOUR) == [(1800.0, SOFT), (2520.0, FENCE)]


def test_wd5_a_lease_clears_an_earlier_suspicion() -> None:
    wd = suspect_at_300()
    wd.feed(Lease(310.0, 310.0, "pytest", deadline=5000.0))
    assert view(wd) is C.LONG_TOOL
    assert wd.false_suspects == 1
    assert drive(wd, 315.0, 4995.0) == []


# ----------------------------------------------------------------------------- WD6 suspend


def test_wd6_a_suspend_counts_toward_suspect_but_hard_clocks_restart_after_wake() -> None:
    """Seed §6.3: 20 minutes of suspend; Suspect at the first tick after wake, and hard
    eligibility and its grace only after 900 + 120 s of awake time after the wake."""
    wd = prompted()
    assert drive(wd, 5.0, 200.0) == []
    asleep = 20 * MINUTE
    assert tick(wd, 205.0, asleep=asleep) == [SOFT]  # first tick after the wake
    assert view(wd) is C.SUSPECT
    assert wd.wake_awake == 205.0
    actions = drive(wd, 210.0, 2 * HOUR, asleep=asleep)
    assert actions == [(205.0 + 900.0 + 120.0, FENCE)]


def test_wd6_the_grace_starts_only_after_900s_awake_after_the_wake() -> None:
    wd = prompted()
    drive(wd, 5.0, 200.0)
    asleep = 20 * MINUTE
    tick(wd, 205.0, asleep=asleep)
    assert drive(wd, 210.0, 1100.0, asleep=asleep) == []
    assert grace(wd) is None
    assert tick(wd, 1105.0, asleep=asleep) == []
    assert grace(wd) == 1105.0
    assert drive(wd, 1110.0, 1220.0, asleep=asleep) == []
    assert view(wd) is C.SUSPECT


def test_wd6_a_suspend_restarts_a_nearly_elapsed_hard_clock() -> None:
    """800 s of awake silence, a suspend: 100 s more would have crossed 900 s without it."""
    wd = prompted()
    assert drive(wd, 5.0, 800.0) == [(300.0, SOFT)]
    asleep = 10 * MINUTE
    assert drive(wd, 805.0, 1700.0, asleep=asleep) == []
    assert grace(wd) is None
    assert view(wd) is C.SUSPECT
    assert drive(wd, 1705.0, 2 * HOUR, asleep=asleep) == [(805.0 + 1020.0, FENCE)]


def test_wd6_a_suspend_during_the_grace_restarts_it() -> None:
    wd = suspect_at_300()
    assert drive(wd, 305.0, 950.0) == []
    assert grace(wd) == 900.0
    asleep = 5 * MINUTE
    assert drive(wd, 955.0, 1700.0, asleep=asleep) == []
    assert view(wd) is C.SUSPECT
    assert drive(wd, 1705.0, 2 * HOUR, asleep=asleep) == [(955.0 + 1020.0, FENCE)]


def test_wd6_a_suspend_after_eligibility_takes_the_eligibility_back() -> None:
    """Eligible before a suspend; the fence probe's answer arrives after the wake. The hard
    clock restarted, so a quiet answer must not ask for the guards."""
    wd = eligible_at_1020()
    asleep = 30 * MINUTE
    assert tick(wd, 1025.0, asleep=asleep) == []
    assert view(wd) is C.SUSPECT
    assert wd.feed(ProbeAnswered("fence", False)) == []
    assert view(wd) is C.SUSPECT
    actions = drive(wd, 1030.0, 3 * HOUR, asleep=asleep)
    assert actions == [(1025.0 + 1020.0, FENCE)]
    assert view(wd) is C.HARD_RESUME_ELIGIBLE
    assert wd.feed(ProbeAnswered("fence", False)) == [CheckGuards()]


def test_wd6_clock_jitter_is_not_a_suspend() -> None:
    wd = prompted()
    assert drive(wd, 5.0, 600.0) == [(300.0, SOFT)]
    assert drive(wd, 605.0, 2 * HOUR, asleep=0.5) == [(1020.0, FENCE)]
    assert wd.wake_awake == -math.inf


def test_wd6_a_suspend_before_the_prompt_changes_nothing_after_it() -> None:
    wd = Watchdog(policy=WatchdogPolicy())
    assert drive(wd, 5.0, 100.0) == []
    asleep = HOUR
    assert drive(wd, 105.0, 200.0, asleep=asleep) == []  # not armed: nothing measured
    wd.feed(Prompted(200.0 + asleep, 200.0))
    assert drive(wd, 205.0, 2 * HOUR, asleep=asleep) == [(500.0, SOFT), (1220.0, FENCE)]


# --------------------------------------------------------------- WD7 clocks only while prompted


def test_wd7_no_probe_before_the_first_prompt() -> None:
    wd = Watchdog(policy=WatchdogPolicy())
    assert drive(wd, 5.0, 4 * HOUR) == []
    assert view(wd) is C.ACTIVE
    assert not wd.armed


@pytest.mark.parametrize("kind", ["done", "fail", "abort", "operator_fail"])
def test_wd7_no_probe_after_a_terminal_receipt(kind: str) -> None:
    wd = prompted()
    wd.feed(Progress(100.0, 100.0, Phase.GENERATION, "token"))
    assert wd.feed(TerminalAccepted(kind)) == []
    assert not wd.armed
    assert drive(wd, 105.0, 4 * HOUR) == []
    assert view(wd) is C.ACTIVE
    assert wd.feed(Settled()) == []  # a terminal was accepted: nothing to finalize
    assert wd.feed(Exited(0)) == []


def test_wd7_a_terminal_receipt_disarms_a_suspect_lane() -> None:
    wd = eligible_at_1020()
    wd.feed(TerminalAccepted("done"))
    assert view(wd) is C.ACTIVE
    assert wd.probes == {}
    assert wd.feed(ProbeAnswered("fence", False)) == []  # no guards, nothing to fence
    assert drive(wd, 1025.0, 4 * HOUR) == []


def test_wd7_no_probe_while_waiting_for_the_user() -> None:
    wd = prompted()
    assert wd.feed(TerminalAccepted("wait")) == []
    assert view(wd) is C.WAITING_USER
    assert drive(wd, 5.0, 12 * HOUR) == []
    assert wd.feed(Settled()) == []
    assert wd.feed(Exited(0)) == []  # the parked worker stops
    assert view(wd) is C.WAITING_USER


def test_wd7_a_woken_wait_measures_from_the_next_prompt() -> None:
    wd = prompted()
    wd.feed(TerminalAccepted("wait"))
    drive(wd, 5.0, HOUR)
    assert wd.feed(Woken()) == []
    assert view(wd) is C.ACTIVE
    assert drive(wd, HOUR + 5, 2 * HOUR) == []  # woken, not yet prompted
    wd.feed(Prompted(2 * HOUR, 2 * HOUR))
    assert drive(wd, 2 * HOUR + 5, 2 * HOUR + 300.0) == [(2 * HOUR + 300.0, SOFT)]


def test_wd7_no_probe_while_fencing_or_held() -> None:
    wd = eligible_at_1020()
    wd.feed(FenceStarted())
    assert drive(wd, 1025.0, 3 * HOUR) == []
    held = suspect_at_300()
    assert held.feed(Hold("budget_exhausted")) == []
    assert view(held) is C.STALLED_OPERATOR_REQUIRED
    assert held.hold_reason == "budget_exhausted"
    assert drive(held, 305.0, 6 * HOUR) == []


# ------------------------------------------------------------------ WD8 NeedsFinalization


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (Settled(), "settled"),
        (Exited(0), "exited"),
        (Exited(1), "exited"),
        (Exited(-9), "exited"),
        (Exited(None), "exited"),
    ],
)
def test_wd8_settled_or_exited_needs_finalization_at_once(event: Event, reason: str) -> None:
    wd = prompted()
    wd.feed(Progress(10.0, 10.0, Phase.GENERATION, "token"))
    assert wd.feed(event) == [PromptCompletion(reason)]  # no tick, no 300 s wait
    assert view(wd) is C.NEEDS_FINALIZATION
    assert wd.terminal is None  # neither done nor failed
    assert drive(wd, 15.0, 4 * HOUR) == []
    assert view(wd) is C.NEEDS_FINALIZATION


@pytest.mark.parametrize("event", [Settled(), Exited(0), Exited(1), Exited(-9), Exited(None)])
def test_wd8_a_suspect_lane_is_finalized_at_once(event: Event) -> None:
    wd = eligible_at_1020()
    assert len(wd.feed(event)) == 1
    assert view(wd) is C.NEEDS_FINALIZATION


@pytest.mark.parametrize("second", [Settled(), Exited(0), Exited(-9), Exited(None)])
def test_wd8_a_second_settle_without_terminal_holds(second: Event) -> None:
    wd = prompted()
    assert wd.feed(Settled()) == [PromptCompletion("settled")]
    wd.feed(Prompted(20.0, 20.0))  # the completion prompt
    wd.feed(Progress(30.0, 30.0, Phase.GENERATION, "token"))
    assert wd.feed(second) == []
    assert view(wd) is C.STALLED_OPERATOR_REQUIRED
    assert wd.hold_reason is not None
    assert wd.hold_reason.startswith("no_terminal_after_completion_prompt")
    assert wd.completion_prompts == 1
    assert drive(wd, 35.0, 4 * HOUR) == []


def test_wd8_a_relaunch_allows_one_more_completion_prompt() -> None:
    wd = prompted()
    assert wd.feed(Settled()) == [PromptCompletion("settled")]
    wd.feed(Prompted(20.0, 20.0))
    assert wd.feed(Settled()) == []
    assert view(wd) is C.STALLED_OPERATOR_REQUIRED
    wd.feed(Relaunched(100.0, 100.0))  # a new process epoch
    assert wd.completion_prompts == 0
    wd.feed(Prompted(110.0, 110.0))
    assert wd.feed(Exited(1)) == [PromptCompletion("exited")]
    wd.feed(Prompted(120.0, 120.0))
    assert wd.feed(Exited(1)) == []
    assert view(wd) is C.STALLED_OPERATOR_REQUIRED


def test_wd8_a_completion_prompt_answered_by_a_terminal_receipt() -> None:
    wd = prompted()
    assert wd.feed(Exited(0)) == [PromptCompletion("exited")]
    wd.feed(Relaunched(10.0, 10.0))
    wd.feed(Prompted(11.0, 11.0))
    wd.feed(TerminalAccepted("done"))
    assert wd.feed(Settled()) == []
    assert wd.feed(Exited(0)) == []
    assert view(wd) is C.ACTIVE


@pytest.mark.parametrize("status", [0, 1, -9, None])
def test_wd8_an_exit_while_fencing_or_resuming_is_ignored(status: int | None) -> None:
    wd = eligible_at_1020()
    wd.feed(FenceStarted())
    assert wd.feed(Exited(status)) == []
    assert view(wd) is C.FENCING
    wd.feed(Relaunched(1100.0, 1100.0))
    assert wd.feed(Exited(status)) == []
    assert view(wd) is C.RESUMING
    assert wd.completion_prompts == 0


# --------------------------------------------------------------------------- WD9 policy


def test_wd9_the_default_policy_is_valid_and_follows_the_brief() -> None:
    policy = WatchdogPolicy()
    assert policy.problems() == []
    assert policy.soft_seconds == 300.0
    assert policy.grace_seconds == 120.0
    assert policy.tick_seconds == 5.0
    assert policy.max_replacements == 3
    assert policy.recovery_seconds == 1800.0
    assert policy.timescale == 1.0
    assert HARD_FLOOR_SECONDS == 900.0
    assert all(s >= HARD_FLOOR_SECONDS for s in policy.hard_seconds.values())


def settings(policy: WatchdogPolicy) -> set[str]:
    return {setting for setting, _why in policy.problems()}


@pytest.mark.parametrize("phase", [Phase.PROVIDER, Phase.GENERATION])
def test_wd9_a_hard_threshold_under_the_floor_is_named(phase: Phase) -> None:
    hard = {Phase.PROVIDER: 900.0, Phase.GENERATION: 900.0, phase: 899.0}
    assert settings(WatchdogPolicy(hard_seconds=hard)) == {f"hard_seconds.{phase}"}


@pytest.mark.parametrize("phase", [Phase.TOOL, Phase.UNKNOWN, Phase.SETTLED])
def test_wd9_a_hard_threshold_for_an_unwatched_phase_is_named(phase: Phase) -> None:
    hard = {Phase.PROVIDER: 900.0, Phase.GENERATION: 900.0, phase: 3600.0}
    assert settings(WatchdogPolicy(hard_seconds=hard)) == {f"hard_seconds.{phase}"}


@pytest.mark.parametrize("seconds", [math.inf, math.nan, -1.0, 0.0])
def test_wd9_a_hard_threshold_must_be_finite_and_positive(seconds: float) -> None:
    hard = {Phase.PROVIDER: seconds, Phase.GENERATION: 900.0}
    assert settings(WatchdogPolicy(hard_seconds=hard)) == {"hard_seconds.provider"}


@pytest.mark.parametrize("soft", [299.0, 301.0, 600.0])
def test_wd9_the_soft_threshold_is_static(soft: float) -> None:
    assert settings(WatchdogPolicy(soft_seconds=soft)) == {"soft_seconds"}


def test_wd9_a_hard_threshold_must_be_longer_than_soft() -> None:
    policy = WatchdogPolicy(
        soft_seconds=1000.0, hard_seconds={Phase.PROVIDER: 950.0, Phase.GENERATION: 1200.0}
    )
    assert settings(policy) == {"soft_seconds", "hard_seconds.provider"}


@pytest.mark.parametrize(
    "name",
    [
        "soft_seconds",
        "grace_seconds",
        "tick_seconds",
        "probe_timeout_seconds",
        "recovery_seconds",
        "term_grace_seconds",
        "kill_bound_seconds",
    ],
)
@pytest.mark.parametrize("value", [-1.0, 0.0, math.nan, math.inf, -math.inf])
def test_wd9_every_duration_is_positive_and_finite(name: str, value: float) -> None:
    changes: dict[str, Any] = {name: value}
    policy = dataclasses.replace(WatchdogPolicy(), **changes)
    assert name in settings(policy)
    if name != "soft_seconds":
        assert settings(policy) == {name}


@pytest.mark.parametrize("grace", [-1.0, math.nan, math.inf])
def test_wd9_a_bad_grace_is_named(grace: float) -> None:
    problems = WatchdogPolicy(grace_seconds=grace).problems()
    assert [setting for setting, _ in problems] == ["grace_seconds"]
    assert "positive" in problems[0][1]


@pytest.mark.parametrize("count", [0, -1, 11, 1_000_000])
def test_wd9_max_replacements_is_bounded_both_ways(count: int) -> None:
    assert settings(WatchdogPolicy(max_replacements=count)) == {"max_replacements"}


@pytest.mark.parametrize("count", [1, 10])
def test_wd9_max_replacements_within_its_bounds_is_accepted(count: int) -> None:
    assert settings(WatchdogPolicy(max_replacements=count)) == set()


@pytest.mark.parametrize("timescale", [0.5, 0.0, -60.0, math.nan, math.inf])
def test_wd9_a_bad_timescale_is_named(timescale: float) -> None:
    assert "timescale" in settings(WatchdogPolicy(timescale=timescale))


def test_wd9_scaled_divides_every_threshold_and_lifts_the_floor() -> None:
    base = WatchdogPolicy()
    fast = base.scaled(60)
    assert fast.timescale == 60
    assert fast.soft_seconds == 5.0
    assert fast.hard_seconds == {Phase.PROVIDER: 15.0, Phase.GENERATION: 15.0}
    assert fast.grace_seconds == 2.0
    assert fast.tick_seconds == base.tick_seconds / 60
    assert fast.probe_timeout_seconds == 2.0  # a bound for an answer: floored, not a threshold
    assert fast.recovery_seconds == 30.0
    assert fast.max_replacements == base.max_replacements  # a count, not a duration
    assert fast.problems() == []
    assert base.problems() == []  # the original is untouched
    assert base.timescale == 1.0


def test_wd9_scaled_twice_multiplies_the_timescale() -> None:
    fast = WatchdogPolicy().scaled(10).scaled(6)
    assert fast.timescale == 60
    assert fast.soft_seconds == pytest.approx(5.0)
    assert fast.problems() == []


@pytest.mark.parametrize("factor", [0.5, 0.0, -2.0, math.nan])
def test_wd9_scaled_below_one_raises(factor: float) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        WatchdogPolicy().scaled(factor)


def test_wd9_a_short_hard_threshold_is_refused_unless_scaled() -> None:
    hard = {Phase.PROVIDER: 15.0, Phase.GENERATION: 15.0}
    assert settings(WatchdogPolicy(soft_seconds=5.0, hard_seconds=hard)) == {
        "soft_seconds",
        "hard_seconds.provider",
        "hard_seconds.generation",
    }
    assert WatchdogPolicy(soft_seconds=5.0, hard_seconds=hard, timescale=60.0).problems() == []


def test_wd9_a_scaled_policy_still_refuses_a_hard_threshold_for_a_tool() -> None:
    fast = WatchdogPolicy().scaled(60)
    bad = dataclasses.replace(fast, hard_seconds={**fast.hard_seconds, Phase.TOOL: 30.0})
    assert settings(bad) == {"hard_seconds.tool"}


def test_wd9_the_scaled_clocks_follow_the_scaled_policy() -> None:
    wd = prompted(policy=WatchdogPolicy().scaled(60))
    actions = drive(wd, 0.25, 60.0, step=0.25)
    assert actions == [(5.0, SOFT), (17.0, FENCE)]


def test_wd9_the_policy_is_frozen() -> None:
    policy = WatchdogPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.soft_seconds = 1.0  # type: ignore[misc]


# --------------------------------------------------------------------------- WD10 guards


def all_hold() -> GuardEvidence:
    return GuardEvidence(**{f.name: True for f in dataclasses.fields(GuardEvidence)})


GUARDS = [f.name for f in dataclasses.fields(GuardEvidence)]


def test_wd10_every_guard_of_the_brief_is_there() -> None:
    assert GUARDS == [
        "progress_unchanged",
        "session_unchanged",
        "process_identity",
        "fresh_probe_quiet",
        "effects_safe",
        "no_terminal",
        "budget_left",
        "attested",
    ]


def test_wd10_all_guards_holding_fail_nothing() -> None:
    assert failed_guards(all_hold()) == ()


def test_wd10_unchecked_guards_all_fail() -> None:
    assert failed_guards(GuardEvidence()) == tuple(GUARDS)


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("value", [False, None])
def test_wd10_a_failed_or_unknown_guard_is_named(guard: str, value: bool | None) -> None:
    evidence = dataclasses.replace(all_hold(), **{guard: value})
    assert failed_guards(evidence) == (guard,)


def test_wd10_several_failed_guards_are_named_in_order() -> None:
    evidence = dataclasses.replace(all_hold(), attested=None, process_identity=False)
    assert failed_guards(evidence) == ("process_identity", "attested")


def test_wd10_failed_guards_hold_the_lane() -> None:
    wd = eligible_at_1020()
    assert wd.feed(ProbeAnswered("fence", False)) == [CheckGuards()]
    reasons = failed_guards(dataclasses.replace(all_hold(), budget_left=None))
    assert wd.feed(GuardsFailed(reasons)) == []
    assert view(wd) is C.STALLED_OPERATOR_REQUIRED
    assert wd.hold_reason == "guard:budget_left"


# --------------------------------------------------------------------------- WD11 budget


def test_wd11_three_epochs_then_exhausted() -> None:
    budget = Budget()
    assert (budget.epochs_left, budget.seconds_left, budget.exhausted) == (3, 1800.0, False)
    for left in (2, 1, 0):
        budget = budget.charge_epoch()
        assert budget.epochs_left == left
    assert budget.exhausted
    with pytest.raises(ValueError, match="no replacement epoch"):
        budget.charge_epoch()
    assert budget.used_epochs == 3


def test_wd11_recovery_seconds_exhaust_at_1800() -> None:
    budget = Budget().charge_seconds(1799.0)
    assert not budget.exhausted
    budget = budget.charge_seconds(1.0)
    assert budget.seconds_left == 0.0
    assert budget.exhausted


def test_wd11_the_defaults_match_the_policy() -> None:
    policy = WatchdogPolicy()
    assert Budget().max_epochs == policy.max_replacements
    assert Budget().max_seconds == policy.recovery_seconds


def test_wd11_nothing_ever_refunds() -> None:
    budget = Budget().charge_epoch().charge_seconds(100.0)
    for seconds in (-50.0, 0.0, -math.inf, math.nan):
        after = budget.charge_seconds(seconds)
        assert after.used_seconds == 100.0
        assert after.used_epochs == 1
    granted = budget.grant(epochs=1, seconds=10.0)
    assert (granted.used_epochs, granted.used_seconds) == (1, 100.0)


def test_wd11_the_budget_is_immutable() -> None:
    budget = Budget()
    budget.charge_epoch()
    budget.charge_seconds(500.0)
    assert budget == Budget()
    with pytest.raises(dataclasses.FrozenInstanceError):
        budget.used_epochs = 0  # type: ignore[misc]


def test_wd11_a_grant_adds_a_finite_amount() -> None:
    budget = Budget().charge_epoch().charge_epoch().charge_epoch().charge_seconds(1800.0)
    assert budget.exhausted
    more = budget.grant(epochs=1)
    assert more.epochs_left == 1
    assert more.exhausted  # seconds are still spent
    more = more.grant(seconds=600.0)
    assert (more.epochs_left, more.seconds_left, more.exhausted) == (1, 600.0, False)
    assert (more.granted_epochs, more.granted_seconds) == (1, 600.0)
    more = more.charge_epoch()
    assert more.exhausted
    with pytest.raises(ValueError, match="no replacement epoch"):
        more.charge_epoch()


@pytest.mark.parametrize(
    ("epochs", "seconds"),
    [(0, 0.0), (-1, 0.0), (0, -1.0), (-1, 60.0), (1, -60.0), (0, math.inf), (0, math.nan),
     (1, math.nan)],
)  # fmt: skip
def test_wd11_an_empty_negative_or_unbounded_grant_raises(epochs: int, seconds: float) -> None:
    with pytest.raises(ValueError, match="grant"):
        Budget().grant(epochs=epochs, seconds=seconds)


# ------------------------------------------------------------------------- the action table


def test_wd9_the_action_table_covers_every_classification() -> None:
    assert set(ACTION_TABLE) == set(Classification)
    for classification, action in ACTION_TABLE.items():
        assert isinstance(action, str)
        assert action.strip(), classification
    assert "pi-runtime task" in ACTION_TABLE[C.STALLED_OPERATOR_REQUIRED]
    assert "pi-runtime task reply" in ACTION_TABLE[C.WAITING_USER]


def test_wd14_a_snapshot_reads_back_as_the_same_policy_and_refuses_a_damaged_one() -> None:
    policy = WatchdogPolicy(max_replacements=2).scaled(10)
    assert WatchdogPolicy.from_snapshot(policy.snapshot()) == policy
    for damage, setting in (
        ({"max_replacements": True}, "max_replacements"),
        ({"soft_seconds": "300"}, "soft_seconds"),
        ({"hard_seconds": {"tool": 900.0}}, "hard_seconds.tool"),
        ({"hard_seconds": {"dreaming": 900.0}}, "hard_seconds.dreaming"),
        ({"grace_seconds": -1.0}, "grace_seconds"),
    ):
        with pytest.raises(ValueError, match=f"^{setting}"):
            WatchdogPolicy.from_snapshot({**WatchdogPolicy().snapshot(), **damage})


# ------------------------------------------------------------------ PB6 an outage is not silence


@pytest.mark.parametrize("when", ["active", "suspect", "eligible"])
def test_pb6_a_parked_lane_is_never_probed_charged_or_fenced(when: str) -> None:
    """docs/design/retention.md PB6: a turn parked for an unavailable provider disarms the
    clocks — hours of waiting bring no probe, no eligibility, no guard check — whatever the
    watchdog thought before (a suspicion episode ends with the park); the next prompt arms
    them again, from its own time."""
    wd = {"active": prompted, "suspect": suspect_at_300, "eligible": eligible_at_1020}[when]()
    assert wd.feed(ProviderParked()) == []
    assert view(wd) is C.PARKED
    assert not wd.armed
    assert wd.probes == {}
    assert drive(wd, 1025.0, 1025.0 + 6 * HOUR, step=MINUTE) == []
    assert view(wd) is C.PARKED
    assert "abort" in ACTION_TABLE[C.PARKED]
    at = 1025.0 + 6 * HOUR
    assert wd.feed(Prompted(at, at)) == []
    assert view(wd) is C.ACTIVE
    assert drive(wd, at + 5.0, at + 295.0) == []
    assert tick(wd, at + 300.0) == [SOFT]  # the clocks run again, from the new prompt
