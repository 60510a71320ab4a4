"""The whole deployment SIGKILLed at random moments (issue #19; docs/design/scale-out.md).

Two ``pi-runtime serve`` hosts on one PostgreSQL database (each a real process in its own
mount namespace, ``test_serve_hosts.deployment``), clients on both sending deliveries to a
few rooms — new ones, and again ones sent before (a client retrying). In each round every
host is SIGKILLed at once at a moment drawn from the seed: as soon as they are up, after the
k-th ``accepted`` or ``result`` frame, or inside the k-th model request (a turn mid-flight).
The hosts are then started again on their own directories (new processes: new lease
owners, so every lane is claimed anew once its dead owner's lease ran out) and the next
round goes on. A last round only restarts them and waits until every admitted delivery is
answered. Then, from the database:

* every delivery admitted is admitted once, and every one the clients saw ``accepted`` is
  among them (S21: nothing acknowledged is lost);
* every admitted delivery has exactly one result, and nothing else has one;
* the results are numbered 1…n without a gap (S21), and each client of the last round got
  each result once, with the number the database holds;
* a result is a reply, or absorbed into another delivery's reply (L10).

The seed is printed (and named in a failure); ``PI_HOSTS_FUZZ_SEED`` replays one and
``PI_HOSTS_FUZZ_ROUNDS`` changes the number of rounds. No test step sleeps to wait for
something: a round ends on the event it drew; the model's small random latency only spreads
the moments a kill can meet.
"""

from __future__ import annotations

import os
import random
import signal
from collections import Counter
from pathlib import Path
from typing import Any, Final

import trio
from trio_websocket import ConnectionClosed, HandshakeError

from runtime._config import Caps
from runtime._journal._postgres import open_pg_store
from runtime._journal._store import ADMISSIONS, RESULTS
from runtime._records import Admission, ResultPublished, StepAbandoned

from .._wire import Frame, message
from .._workers import scripted_upstream
from ..journal.pg_fixtures import execute, pg_dsn, pg_server
from .test_serve_hosts import HostProcess, deployment

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses
SEED: Final = int(os.environ.get("PI_HOSTS_FUZZ_SEED", random.randrange(2**32)))
ROUNDS: Final = int(os.environ.get("PI_HOSTS_FUZZ_ROUNDS", "6"))
LEASE: Final = 2.0
"""Short: each round waits for the dead hosts' leases to run out. A host a loaded machine
starves past it loses its lanes and they are claimed again — part of what is exercised."""
ROUND_LIMIT: Final = 60.0
"""The longest a round may take to reach its moment, or to answer everything sent."""
LIMIT: Final = 2 * ROUND_LIMIT * (ROUNDS + 1)
ROOMS: Final = ("dm:1", "dm:2", "dm:3")
PER_ROUND: Final = 6
"""New deliveries sent in a round (and as many again of earlier ones, resent)."""
MOMENTS: Final = ("up", "accepted", "result", "request")
RECOVERY_ATTEMPTS: Final = Caps().recovery_attempts
"""A delivery whose turn the kills met more often than this ends ``recovery_exhausted``
(lanes.md L19): the crash-loop bound, not a loss."""


class Round:
    """One life of the deployment: what its clients saw, and when it is to be killed."""

    def __init__(self, moment: str, k: int, expected: set[str]) -> None:
        self.moment = moment
        self.k = 1 if moment == "up" else k
        self.counts: Counter[str] = Counter()
        self.kill = trio.Event()
        self.expected = expected
        """Every delivery this round sends: once each has a result, the round is over."""
        self.answered: set[str] = set()

    def saw(self, what: str, delivery_id: str | None = None) -> None:
        self.counts[what] += 1
        if what == self.moment and self.counts[what] >= self.k:
            self.kill.set()
        if what == "result" and delivery_id is not None:
            self.answered.add(delivery_id)
            if self.expected <= self.answered:
                self.kill.set()


async def _admitted_and_answered(dsn: str, root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Every admission's delivery id, and every published result (delivery id, seq), as the
    store's own decoder reads the shared logs (damage would fail the test)."""
    async with open_pg_store(dsn, root=root / "reader") as store:
        admissions = (await store.read(ADMISSIONS)).records
        results = (await store.read(RESULTS)).records
    admitted = [r.delivery_id for r in admissions if isinstance(r, Admission)]
    answered = [(r.delivery_id, r.seq) for r in results if isinstance(r, ResultPublished)]
    return admitted, answered


async def _unanswered(dsn: str, root: Path, plan: list[str]) -> str:
    """What a failure reports: the admitted deliveries without a result, and their logs."""
    admitted, answered = await _admitted_and_answered(dsn, root)
    missing = sorted(set(admitted) - {d for d, _ in answered})
    lines = [f"seed {SEED}, rounds {plan}: no result for {missing}"]
    async with open_pg_store(dsn, root=root / "reader") as store:
        for delivery_id in missing:
            lines.append(f"-- {delivery_id}")
            if await store.exists(store.delivery_rel(delivery_id)):
                for record in (await store.read_delivery_log(delivery_id)).records:
                    lines.append(f"   {record!r}"[:300])
    leases = await execute(
        dsn, "SELECT lane, owner, epoch, lease_until > now() FROM pi_runtime.lanes"
    )
    lines.extend(f"-- lease {row}" for row in leases)
    return "\n".join(lines)


async def _client(host: HostProcess, outgoing: list[Frame], life: Round, seen: set[str]) -> None:
    """Send ``outgoing`` to ``host`` and read its frames until the host dies."""
    try:  # a kill ends the connection anywhere: in the handshake, a send or a receive
        async with host.connect() as client:

            async def send() -> None:
                for frame in outgoing:
                    await client.send(frame)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                while True:
                    frame = await client.receive()
                    if frame["type"] == "accepted":
                        seen.add(frame["delivery_id"])
                        life.saw("accepted")
                    elif frame["type"] == "result":
                        life.saw("result", frame["delivery_id"])
    except* (ConnectionClosed, HandshakeError, OSError, trio.BrokenResourceError):
        pass  # the host was killed under the connection


async def _answers(host: HostProcess, wanted: set[str]) -> dict[str, Frame]:
    """Every result frame ``host`` streams until each of ``wanted`` has one (each once)."""
    seen: dict[str, Frame] = {}
    async with host.connect() as client:
        while not wanted <= set(seen):
            frame = await client.until(lambda f: f["type"] == "result")
            assert frame["delivery_id"] not in seen, f"a second result: {frame}"
            seen[frame["delivery_id"]] = frame
    return seen


async def test_the_whole_deployment_killed_at_random_moments_answers_every_delivery_once(
    tmp_path: Path, pg_dsn: str
) -> None:
    rng = random.Random(SEED)
    print(f"PI_HOSTS_FUZZ_SEED={SEED}")
    life = Round("up", 1, set())
    sent: list[Frame] = []
    accepted: set[str] = set()
    plan: list[str] = []

    async def on_request(n: int) -> None:
        life.saw("request")
        await trio.sleep(rng.uniform(0, 0.02))  # the model's latency

    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([], on_request=on_request) as (_model, url),
            deployment(tmp_path, pg_dsn, url, lease=LEASE) as start,
        ):
            for number in range(ROUNDS):
                fresh = [
                    message(f"r{number}d{i}", f"round {number} item {i}", room=rng.choice(ROOMS))
                    for i in range(PER_ROUND)
                ]
                again = rng.sample(sent, min(len(sent), PER_ROUND))
                sent.extend(fresh)
                outgoing = fresh + again
                expected = {frame["delivery_id"] for frame in outgoing}
                life = Round(rng.choice(MOMENTS), rng.randint(1, PER_ROUND), expected)
                plan.append(f"{life.moment}#{life.k}")
                rng.shuffle(outgoing)
                began = trio.current_time()
                hosts = [await start(name) for name in "ab"]
                life.saw("up")
                async with trio.open_nursery() as nursery:
                    for i, host in enumerate(hosts):
                        share = outgoing[i :: len(hosts)]
                        nursery.start_soon(_client, host, share, life, accepted)
                    with trio.move_on_after(ROUND_LIMIT) as waiting:
                        await life.kill.wait()
                    if waiting.cancelled_caught:  # hosts up, and something never answered
                        raise AssertionError(await _unanswered(pg_dsn, tmp_path, plan))
                    for host in hosts:  # the whole deployment, at once
                        host.signal(signal.SIGKILL)
                    for host in hosts:
                        await host.process.wait()
                    nursery.cancel_scope.cancel()  # a client mid-handshake would wait 60 s
                print(f"round {number}: killed at {plan[-1]}, {trio.current_time() - began:.1f} s")
            began = trio.current_time()
            hosts = [await start(name) for name in "ab"]
            admitted, _ = await _admitted_and_answered(pg_dsn, tmp_path)
            got: list[dict[str, Frame]] = []
            with trio.move_on_after(ROUND_LIMIT) as waiting:
                got = [await _answers(host, set(admitted)) for host in hosts]
            if waiting.cancelled_caught:
                raise AssertionError(await _unanswered(pg_dsn, tmp_path, plan))
            print(f"last round: everything answered, {trio.current_time() - began:.1f} s")
        admitted, answered = await _admitted_and_answered(pg_dsn, tmp_path)
    report = f"seed {SEED}, rounds {plan}"
    assert len(admitted) == len(set(admitted)), report  # S21: each admitted once
    assert accepted <= set(admitted), report  # nothing acknowledged was lost
    results = Counter(delivery for delivery, _ in answered)
    assert set(results) == set(admitted), report  # every admitted one answered, nothing else
    assert set(results.values()) <= {1}, report  # and once
    assert sorted(seq for _, seq in answered) == list(range(1, len(answered) + 1)), report
    numbers = dict(answered)
    for frames in got:
        assert {d: f["seq"] for d, f in frames.items()} == numbers, report
        for frame in frames.values():
            outcome: Any = frame["outcome"]
            if outcome == "absorbed":
                assert frames[frame["absorbed_into"]]["outcome"] == "reply", report
            elif outcome == "failed":  # L19 only: its turn met more host deaths than allowed
                assert frame["code"] == "recovery_exhausted", f"{report}: {frame}"
                charged = await _charges(pg_dsn, tmp_path, frame["delivery_id"])
                assert charged > RECOVERY_ATTEMPTS, f"{report}: {frame}, charged {charged}"
            else:
                assert outcome == "reply", f"{report}: {frame}"


async def _charges(dsn: str, root: Path, delivery_id: str) -> int:
    """The recovery attempts charged to a delivery (its ``StepAbandoned`` records, L19)."""
    async with open_pg_store(dsn, root=root / "reader") as store:
        records = (await store.read_delivery_log(delivery_id)).records
    return sum(isinstance(r, StepAbandoned) for r in records)
