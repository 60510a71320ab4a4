"""The route breaker and the failure classification behind the provider backoff
(docs/design/retention.md PB1-PB4), on virtual time: pure rules, no worker."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from runtime._backoff import (
    RouteBreaker,
    episode_bounds,
    failure_park,
    give_up_ms,
    past_bounds,
    route_park,
)
from runtime._boundary._stream import (
    UpstreamFailure,
    carries_answer,
    retry_after_seconds,
    stream_failure,
)
from runtime._clock import Clocks, MockSilenceClock, MockWallClock
from runtime._config import BackoffConfig, config_from_dict
from runtime._records import Parked, Record

CONFIG = BackoffConfig(first_seconds=5, max_seconds=300, deadline_minutes=30, max_attempts=12)


def breaker(seed: int = 1) -> tuple[RouteBreaker, MockWallClock]:
    wall = MockWallClock()
    clocks = Clocks(silence=MockSilenceClock(), wall=wall)
    return RouteBreaker(CONFIG, clocks, rng=random.Random(seed)), wall


@pytest.mark.parametrize(
    ("failure", "unavailable"),
    [
        (UpstreamFailure(None), True),
        (UpstreamFailure(503), True),
        (UpstreamFailure(500), True),
        (UpstreamFailure(429), True),
        (UpstreamFailure(408), True),
        (UpstreamFailure(400), False),
        (UpstreamFailure(401), False),
        (UpstreamFailure(403), False),
        (UpstreamFailure(404), False),
        (UpstreamFailure(429, account_limit=True), False),  # a quota: waiting will not help
        (UpstreamFailure(429, retry_after=60, account_limit=True), True),  # it resets
    ],
)
def test_pb1_pb3_which_failures_park(failure: UpstreamFailure, unavailable: bool) -> None:
    assert failure.unavailable is unavailable


def _in_stream(error: object) -> str:
    return json.dumps({"id": "c", "object": "chat.completion.chunk", "error": error})


_FINISHED_IN_ERROR = json.dumps(
    {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]}
)


@pytest.mark.parametrize(
    ("payload", "retry_after", "status", "unavailable"),
    [
        # the outage's classes: what the error names — its status, else its type or code
        (_in_stream({"type": "overloaded_error", "message": "Overloaded"}), None, 503, True),
        (_in_stream({"type": "server_error", "code": None, "message": "oops"}), None, 500, True),
        (_in_stream({"type": "api_error", "message": "Internal server error"}), None, 500, True),
        (_in_stream({"type": "tokens", "code": "rate_limit_exceeded"}), None, 429, True),
        (_in_stream({"type": "rate_limit_error", "message": "slow down"}), 30.0, 429, True),
        (_in_stream({"code": 502, "message": "Provider disconnected"}), None, 502, True),
        (_in_stream({"code": "503", "message": "busy"}), None, 503, True),
        (_in_stream({"code": 503, "status": "UNAVAILABLE"}), None, 503, True),
        (_in_stream({"type": "InternalServerError", "code": 500}), None, 500, True),
        (_in_stream({"type": "timeout_error"}), None, 504, True),
        (_in_stream({"status": "RESOURCE_EXHAUSTED"}), None, 429, True),
        # the request's own fault: a definite refusal (PB3)
        (
            _in_stream({"type": "invalid_request_error", "code": "context_length_exceeded"}),
            None,
            400,
            False,
        ),
        (_in_stream({"type": "BadRequestError", "code": 400}), None, 400, False),
        (_in_stream({"type": "authentication_error", "message": "bad key"}), None, 400, False),
        (_in_stream({"code": 401, "type": "server_error"}), None, 401, False),  # the status wins
        # an account limit: parked only with its reset time, as a 429's
        (
            _in_stream({"type": "insufficient_quota", "code": "insufficient_quota"}),
            None,
            429,
            False,
        ),
        (_in_stream({"type": "insufficient_quota", "code": "insufficient_quota"}), 60.0, 429, True),
        (_in_stream({"code": 1308, "message": "plan limit"}), None, 429, False),
        # naming no class: the 200 it came in, not an outage
        (_in_stream({"message": "The service is overloaded"}), None, 200, False),
        (_in_stream("overloaded"), None, 200, False),
        (_FINISHED_IN_ERROR, None, 200, False),
    ],
)
def test_pb1_pb3_which_errors_inside_a_200_stream_park(
    payload: str, retry_after: float | None, status: int, unavailable: bool
) -> None:
    """PB1: an error inside a 200 stream is an outage by the same rules as a status — the
    status it names, or the status of the class its type or code names (429 rate limited,
    503 overloaded or unavailable, 504 timed out, 500 a server error, 400 any other
    class); an account limit only with its reset time (the response's ``Retry-After``).
    One that names nothing is not taken for an outage (its words are not read)."""
    failure = stream_failure(payload, retry_after)
    assert (failure.status, failure.unavailable) == (status, unavailable)
    assert failure.retry_after == retry_after


@pytest.mark.parametrize(
    ("delta", "answer"),
    [
        ({"role": "assistant", "content": ""}, False),
        ({"role": "assistant"}, False),
        ({"content": None, "tool_calls": []}, False),
        ({"content": "Hel"}, True),
        ({"reasoning_content": "hmm"}, True),
        ({"tool_calls": [{"index": 0, "function": {"name": "ls"}}]}, True),
        ({"refusal": "no"}, True),
    ],
)
def test_pb1_what_counts_as_part_of_the_answer(delta: dict[str, Any], answer: bool) -> None:
    """PB1: the park message may end a turn only while nothing of the answer reached the
    worker: a role, an empty delta or a chunk with no choices gives it nothing; text,
    reasoning, a tool call or a refusal does, and so does anything that is not a JSON object."""
    payload = json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    assert carries_answer(payload) is answer
    assert not carries_answer(json.dumps({"id": "c", "choices": []}))
    assert carries_answer("not json")


def test_retry_after_reads_seconds_only() -> None:
    assert retry_after_seconds("30") == 30.0
    assert retry_after_seconds(" 1.5 ") == 1.5
    assert retry_after_seconds("Wed, 21 Oct 2026 07:28:00 GMT") is None
    assert retry_after_seconds("-3") is None
    assert retry_after_seconds("nan") is None
    assert retry_after_seconds("1e9") == 86_400.0
    assert retry_after_seconds(None) is None


async def test_pb2_pb4_the_breaker_opens_waits_lets_one_probe_and_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Closed: go. A failure opens it for half to all of ``first_seconds`` (equal jitter),
    never less than ``Retry-After``; at that time exactly one turn probes, the others wait;
    the probe's failure doubles the wait, its success closes the breaker for all."""
    route, wall = breaker()
    assert route.admit().until_ms is None
    opened = wall.time_ms()
    until = route.failed(UpstreamFailure(503))
    assert 2_500 <= until - opened <= 5_000
    assert route.admit().until_ms == until  # open: everyone waits
    assert route.failed(UpstreamFailure(503)) == until  # a second failure meanwhile: same
    await trio.sleep((until - wall.time_ms()) / 1000 + 0.01)
    probe = route.admit()
    assert probe.probe is not None
    assert probe.until_ms is None
    waiting = route.admit()
    assert waiting.until_ms is not None
    assert waiting.probe is None
    again = route.failed(UpstreamFailure(503))
    assert 5_000 <= again - wall.time_ms() <= 10_000  # doubled
    route.abandoned(probe.probe)  # that probe's token is spent: changes nothing
    assert route.admit().until_ms == again
    await trio.sleep((again - wall.time_ms()) / 1000 + 0.01)
    second = route.admit()
    assert second.probe is not None
    route.succeeded()
    assert route.admit().until_ms is None
    assert route.failures == 0
    hinted = route.failed(UpstreamFailure(429, retry_after=120))
    assert hinted - wall.time_ms() >= 120_000  # never sooner than Retry-After


async def test_pb4_an_abandoned_probe_lets_the_next_turn_probe(
    autojump_clock: trio.testing.MockClock,
) -> None:
    route, wall = breaker()
    until = route.failed(UpstreamFailure(None))
    await trio.sleep((until - wall.time_ms()) / 1000 + 0.01)
    first = route.admit()
    assert route.admit().probe is None
    route.abandoned(first.probe)
    assert route.admit().probe is not None


async def test_pb2_a_resumed_schedule_holds_until_this_process_knows_better(
    autojump_clock: trio.testing.MockClock,
) -> None:
    route, wall = breaker()
    recorded = Parked(
        attempt=3,
        first_failure_ms=wall.time_ms() - 60_000,
        next_attempt_ms=wall.time_ms() + 40_000,
        status=503,
        code="model_failed",
    )
    route.resume(recorded)
    assert route.admit().until_ms == recorded.next_attempt_ms
    assert route.failures == 3
    route.succeeded()
    route.resume(recorded)  # a turn of this process has spoken since: the record is older
    assert route.admit().until_ms is None


class _Ticking(MockWallClock):
    """A wall clock whose every reading is a millisecond after the last: as a real one is
    when the reading thread is preempted between two reads (a loaded machine)."""

    def time_ms(self) -> int:
        self.advance(0.001)
        return super().time_ms()


async def test_pb2_a_resumed_schedule_is_the_recorded_time_to_the_millisecond(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """PB2: a restart's breaker is open until exactly the park's ``next_attempt_ms``. Before,
    it read the wall clock twice (the wait left, then the time it opens from); a tick between
    the reads opened it a millisecond later than the park said, so the turn's look at the
    breaker (``until_ms != next_attempt_ms``) recorded a second park of the same try
    (``attempt`` repeated): a crash test read parks 1, 1, 2 on a loaded machine."""
    wall = _Ticking()
    route = RouteBreaker(CONFIG, Clocks(silence=MockSilenceClock(), wall=wall))
    recorded = Parked(
        attempt=1,
        first_failure_ms=wall.time_ms(),
        next_attempt_ms=wall.time_ms() + 6_000,
        status=503,
        code="model_failed",
    )
    route.resume(recorded)
    assert route.admit().until_ms == recorded.next_attempt_ms


async def test_pb2_a_resumed_breaker_goes_on_from_the_routes_recorded_failures(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """PB2: the route's failures in a row are in the park (``route_failures``), so the next
    host's breaker waits as long after its next failure as this one's would have — not the
    delivery's own (smaller) try count, not a fresh first wait."""
    route, wall = breaker()
    recorded = Parked(
        attempt=2,  # this delivery tried twice; the route failed four times in a row
        first_failure_ms=wall.time_ms() - 600_000,
        next_attempt_ms=wall.time_ms() + 1_000,
        status=503,
        code="model_failed",
        route_failures=4,
    )
    route.resume(recorded)
    assert route.failures == 4
    await trio.sleep(1.0)
    probe = route.admit().probe
    assert probe is not None
    before = wall.time_ms()
    until = route.failed(UpstreamFailure(503), probe)
    full = min(CONFIG.max_seconds, CONFIG.first_seconds * 2**4) * 1000  # 80 s, not 20
    assert full / 2 <= until - before <= full


async def test_wait_wakes_on_a_change_or_a_cancel(autojump_clock: trio.testing.MockClock) -> None:
    route, wall = breaker()
    until = route.failed(UpstreamFailure(503))
    cancelled = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(route.wait, until + 10_000_000, cancelled)
        await trio.sleep(1)
        route.succeeded()
    assert wall.time_ms() < until + 10_000  # woke at the change, not at the time
    async with trio.open_nursery() as nursery:
        nursery.start_soon(route.wait, wall.time_ms() + 10_000_000, cancelled)
        await trio.sleep(1)
        cancelled.set()


def test_pb3_the_bounds() -> None:
    def parked(attempt: int, first: int) -> Parked:
        return Parked(
            attempt=attempt, first_failure_ms=first, next_attempt_ms=0, code="model_failed"
        )

    assert not past_bounds(CONFIG, [], 10**12)
    assert not past_bounds(CONFIG, [parked(11, 0)], 29 * 60_000)
    assert past_bounds(CONFIG, [parked(12, 0)], 0)
    assert past_bounds(CONFIG, [parked(1, 0)], 30 * 60_000)


def test_pb3_pb7_no_wait_outlasts_the_episodes_deadline() -> None:
    """PB3: the time a parked delivery's waits end by at the latest is its episode's deadline
    — the one its first park recorded (PB7), not the configuration of the host deciding — and
    at that time it is past its bounds; nothing before its first park."""
    promised = BackoffConfig(deadline_minutes=0.5)
    down = UpstreamFailure(503)
    first = failure_park(
        promised, [], down, next_attempt_ms=9, now_ms=1_000, code="model_failed", route_failures=1
    )
    assert give_up_ms(CONFIG, []) is None
    assert give_up_ms(CONFIG, [first]) == 31_000  # 30 s after the first failure, not 30 min
    assert not past_bounds(CONFIG, [first], 30_999)
    assert past_bounds(CONFIG, [first], 31_000)
    # a park that kept no bounds (an older version's) reads the configuration; 0.6 ms is
    # rounded up, so that the wait's end is past its bounds, never a millisecond before
    older = msgspec.structs.replace(first, deadline_minutes=None, max_attempts=None)
    odd = BackoffConfig(deadline_minutes=1e-5)
    assert give_up_ms(odd, [older]) == 1_001
    assert past_bounds(odd, [older], 1_001)


def test_pb7_an_episode_gives_up_by_the_bounds_of_its_first_failure() -> None:
    """PB7: the bounds an episode parked under go with it — every park repeats its first
    one's — and decide when it gives up, whatever the configuration of the host deciding:
    lowered (12 tries to 2, 30 minutes to 1) they end nothing sooner, raised (2 tries to
    12) nothing later. A new episode takes the configuration in force."""
    promised = BackoffConfig(deadline_minutes=30, max_attempts=12)
    lowered = BackoffConfig(deadline_minutes=1, max_attempts=2)
    down = UpstreamFailure(503)
    first = failure_park(
        promised, [], down, next_attempt_ms=5_000, now_ms=0, code="model_failed", route_failures=1
    )
    assert (first.deadline_minutes, first.max_attempts) == (30, 12)
    parks = [first]
    for n in range(2, 6):  # a later host, configured otherwise, parks it on
        parks.append(
            failure_park(
                lowered,
                parks,
                down,
                next_attempt_ms=n * 5_000,
                now_ms=n * 1_000,
                code="model_failed",
                route_failures=n,
            )
        )
    parks.append(route_park(lowered, parks, until_ms=40_000, now_ms=30_000, route_failures=5))
    assert {(p.deadline_minutes, p.max_attempts) for p in parks} == {(30, 12)}
    assert episode_bounds(lowered, parks) == (30, 12)
    assert not past_bounds(lowered, parks, 10 * 60_000)  # 5 tries, 10 minutes: within
    assert past_bounds(lowered, parks, 30 * 60_000)  # the deadline it was promised
    raised = BackoffConfig(deadline_minutes=60, max_attempts=12)
    short = failure_park(
        BackoffConfig(max_attempts=2),
        [],
        down,
        next_attempt_ms=1,
        now_ms=0,
        code="model_failed",
        route_failures=1,
    )
    second = failure_park(
        raised, [short], down, next_attempt_ms=2, now_ms=1, code="model_failed", route_failures=2
    )
    assert past_bounds(raised, [short, second], 1)  # its second try was its last
    assert episode_bounds(lowered, []) == (1, 2)  # a new episode: the configuration now


def test_pb7_a_park_written_before_the_bounds_were_kept_decodes_and_reads_the_config() -> None:
    """PB7, schema evolution: a ``Parked`` line an older version wrote (no bounds) still
    decodes, and its episode is judged as that version judged it — by the configuration of
    the host deciding — until a park of this version records one: from then on those."""
    old_line = (
        b'{"type":"parked","attempt":3,"first_failure_ms":0,"next_attempt_ms":9000,'
        b'"status":503,"by_route":false,"code":"model_failed","route_failures":3}'
    )
    old = msgspec.json.decode(old_line, type=Record)
    assert isinstance(old, Parked)
    assert (old.deadline_minutes, old.max_attempts) == (None, None)
    assert not past_bounds(CONFIG, [old], 29 * 60_000)  # as before: 30 minutes, 12 tries
    assert past_bounds(CONFIG, [old], 30 * 60_000)
    assert past_bounds(BackoffConfig(max_attempts=3), [old], 0)
    assert not past_bounds(BackoffConfig(deadline_minutes=60), [old], 45 * 60_000)
    now = failure_park(
        CONFIG,
        [old],
        UpstreamFailure(503),
        next_attempt_ms=20_000,
        now_ms=10_000,
        code="model_failed",
        route_failures=4,
    )
    assert (now.attempt, now.first_failure_ms) == (4, 0)
    assert (now.deadline_minutes, now.max_attempts) == (30, 12)
    later = BackoffConfig(deadline_minutes=1, max_attempts=4)
    assert episode_bounds(later, [old, now]) == (30, 12)
    assert not past_bounds(later, [old, now], 10 * 60_000)
    encoded = msgspec.json.encode(now)
    assert msgspec.json.decode(encoded, type=Record) == now


async def test_pb4_a_late_failure_of_another_turn_does_not_end_the_probe(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A turn that began before the breaker opened and fails while a probe runs re-opens
    the breaker but leaves the probe running: when the new wait is over nobody else probes
    until the probe has its answer (two probes never overlap)."""
    route, wall = breaker()
    until = route.failed(UpstreamFailure(503))
    await trio.sleep((until - wall.time_ms()) / 1000 + 0.01)
    probe = route.admit()
    assert probe.probe is not None
    later = route.failed(UpstreamFailure(503))  # not the probe: a turn already under way
    await trio.sleep((later - wall.time_ms()) / 1000 + 0.01)
    assert route.admit().probe is None  # the probe still runs
    route.failed(UpstreamFailure(503), probe.probe)  # its answer
    assert route.admit().until_ms is not None


async def test_pb2_pb4_a_route_down_for_days_keeps_to_the_longest_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """PB2, PB4: a provider down for days (one probe every 150-300 s: about 1,100 failures of
    the route in a row in three days) keeps each wait between half and all of
    ``max_seconds`` — the doubling stops at the longest wait, it does not overflow — and so
    does the next host, resumed from the last park's ``route_failures``. The shipped
    defaults, as a configuration file gives them (floats)."""
    config = config_from_dict({}).backoff
    longest = config.max_seconds * 1000

    def route(seed: int) -> tuple[RouteBreaker, MockWallClock]:
        wall = MockWallClock()
        return RouteBreaker(config, Clocks(MockSilenceClock(), wall), rng=random.Random(seed)), wall

    breaker, wall = route(1)
    for _ in range(1_100):
        now = wall.time_ms()
        until = breaker.failed(UpstreamFailure(503), breaker.admit().probe)
        assert until - now <= longest
        await trio.sleep((until - now) / 1000 + 0.01)
    assert breaker.failures == 1_100
    assert until - now >= longest / 2
    recorded = Parked(
        attempt=12,
        first_failure_ms=wall.time_ms() - 3 * 86_400_000,
        next_attempt_ms=wall.time_ms(),
        status=503,
        code="model_failed",
        route_failures=breaker.failures,
    )
    restarted, wall = route(2)
    restarted.resume(recorded)
    await trio.sleep(0.01)
    now = wall.time_ms()
    until = restarted.failed(UpstreamFailure(503), restarted.admit().probe)
    assert longest / 2 <= until - now <= longest


async def test_pb3_pb4_a_wall_clock_set_back_during_a_wait_does_not_lengthen_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """PB3, PB4: the breaker opens for at most ``first_seconds`` after a first failure; the
    host's wall clock set back an hour one second into the wait (an operator, a bad NTP
    source) does not keep a turn waiting an hour: the wait is measured on Trio's clock in
    this process, and the time it gives for the record moves back with the wall clock."""
    route, wall = breaker()
    opened = trio.current_time()
    route.failed(UpstreamFailure(503))
    await trio.sleep(1)
    wall.advance(-3600)
    while (admit := route.admit()).until_ms is not None:  # as a lane waits (PB4)
        assert admit.until_ms - wall.time_ms() <= CONFIG.first_seconds * 1000
        await route.wait(admit.until_ms, trio.Event())
    assert admit.probe is not None
    assert trio.current_time() - opened <= CONFIG.first_seconds


async def test_pb4_a_failure_told_twice_is_counted_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """PB4: the gateway tells the breaker of an outage as it meets it, and the turn's end
    tells the same failure again. It is one failure of the route: counted once, and the
    second telling gets the time the first opened the breaker until — even after that wait
    ran out (a short step, a slow turn end: counted twice, the next wait was doubled) or an
    answer closed the breaker meanwhile (the route is up: nothing opens it again). Another
    failure is counted as ever."""
    route, wall = breaker()
    probe = route.admit().probe  # closed: go
    down = UpstreamFailure(503)
    until = route.failed(down, probe)
    await trio.sleep((until - wall.time_ms()) / 1000 + 0.01)  # the wait ran out: half-open
    assert route.failed(down, probe) == until
    assert route.failures == 1
    assert route.admit().probe is not None  # still half-open: the next turn probes
    route.succeeded()
    assert route.failed(down) == until
    assert (route.open_until_ms, route.failures) == (None, 0)  # the answer stands
    again = route.failed(UpstreamFailure(503))
    assert again > wall.time_ms()
    assert route.failures == 1


async def test_pb3_the_route_knows_since_when_it_is_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """PB3: the breaker keeps when the route's failures in a row began (``down_since_ms``) —
    its first failure this process saw, kept through later failures and the half-open
    breaker, or the earliest first failure of the parks a start resumed (PB2) — and forgets
    it once the route answers: a delivery that waited for the outage before it could park
    counts its deadline from then at the earliest."""
    route, wall = breaker()
    assert [route.down_since_ms] == [None]  # (not narrowed: it changes below)
    began = wall.time_ms()
    until = route.failed(UpstreamFailure(503))
    await trio.sleep((until - wall.time_ms()) / 1000 + 0.01)
    probe = route.admit().probe
    route.failed(UpstreamFailure(503), probe)
    assert route.down_since_ms == began
    route.succeeded()
    assert [route.down_since_ms] == [None]
    resumed, _ = breaker()
    for first in (5_000, 2_000, 9_000):
        resumed.resume(
            Parked(
                attempt=1,
                first_failure_ms=first,
                next_attempt_ms=wall.time_ms() + first,
                code="model_failed",
            )
        )
    assert resumed.down_since_ms == 2_000


def test_pb3_a_delivery_that_waited_before_its_first_park_counts_its_deadline_from_then() -> None:
    """PB3: a delivery that waited for the route's outage before it could park (``since_ms``:
    queued behind a parked delivery of its room) is past its deadline ``deadline_minutes``
    after that, before any park of its own; its first park — by the route or its own try —
    records that time as its episode's first, never one later than now; a delivery that did
    not wait is judged as before (nothing before its first park)."""
    minutes = int(CONFIG.deadline_minutes * 60_000)
    assert not past_bounds(CONFIG, [], 10**12)
    assert not past_bounds(CONFIG, [], minutes - 1, since_ms=0)
    assert past_bounds(CONFIG, [], minutes, since_ms=0)
    by_route = route_park(
        CONFIG, [], until_ms=99_000, now_ms=60_000, route_failures=3, since_ms=1_000
    )
    own = failure_park(
        CONFIG,
        [],
        UpstreamFailure(503),
        next_attempt_ms=99_000,
        now_ms=60_000,
        code="model_failed",
        route_failures=3,
        since_ms=1_000,
    )
    assert by_route.first_failure_ms == own.first_failure_ms == 1_000
    assert give_up_ms(CONFIG, [by_route]) == 1_000 + minutes
    ahead = route_park(
        CONFIG, [], until_ms=99_000, now_ms=60_000, route_failures=3, since_ms=70_000
    )
    assert ahead.first_failure_ms == 60_000
    later = route_park(
        CONFIG, [own], until_ms=99_000, now_ms=90_000, route_failures=4, since_ms=50_000
    )
    assert later.first_failure_ms == 1_000  # the episode's first park governs
