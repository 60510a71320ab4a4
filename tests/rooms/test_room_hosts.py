"""Two room workers — two hosts — on one PostgreSQL database, in one process
(docs/design/scale-out.md S11, S13, S20, S21): what a host does when another claims its
lane under it, and how deliveries and results cross between hosts. Fake-Pi workers are real
processes; the database is a real, throw-away PostgreSQL. The process-level tests (several
``pi-runtime serve``, SIGKILL, SIGSTOP) are ``tests/server/test_serve_hosts.py``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Final, cast

import pytest
import trio
import trio.testing

from fake_pi.scenario import Call, Step, Text, ToolCalls
from runtime._config import (
    DEFAULT_GRANTS,
    ModelConfig,
    RoomConfig,
    RoomWorkerConfig,
    StoreConfig,
)
from runtime._errors import DeliveryError, DiskFailedError, ReasonCode
from runtime._journal._inspect import database_status
from runtime._journal._postgres import PgStore, open_pg_store
from runtime._records import ModelResponse, Result, StepAbandoned
from runtime._rooms._worker import RoomWorker, open_room_worker, request_cancel_in_database
from runtime._wire import DeliveryResult

from .._cancelling import cancelled_once
from .._workers import scripted_upstream, tool_messages
from ..journal.pg_fixtures import (
    admin_dsn,
    database_name,
    execute,
    pg_dsn,
    pg_server,
    terminate_backends,
)
from ..journal.test_postgres import FAST
from .test_room_worker import message

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses
LIMIT: Final = 60.0


@contextlib.asynccontextmanager
async def host(
    root: Path,
    name: str,
    dsn: str,
    url: str,
    *,
    lease: float = 60,
    grants: frozenset[str] = DEFAULT_GRANTS,
    poll: float = 0.05,
    rooms: dict[str, RoomConfig] | None = None,
) -> AsyncIterator[RoomWorker]:
    """A host whose leases never run out during a test (60 s): a lane changes hands here only
    because a test expires its lease in the database, or its holder gives it up."""
    config = RoomWorkerConfig(
        state_dir=str(root / name / "state"),
        work_root=str(root / name / "work"),
        model=ModelConfig(base_url=url),
        store=StoreConfig(url=dsn, lease_seconds=lease, poll_seconds=poll, host_name=name),
        default_grants=grants,
        rooms=rooms,
    )
    async with open_room_worker(config) as worker:
        yield worker


async def hosting(
    root: Path,
    name: str,
    dsn: str,
    url: str,
    lease: float,
    *,
    task_status: trio.TaskStatus[RoomWorker] = trio.TASK_STATUS_IGNORED,
) -> None:
    """:func:`host` in a task of its own (``nursery.start``): it runs until cancelled, so
    it can start inside another host's block and outlive it."""
    async with host(root, name, dsn, url, lease=lease) as worker:
        task_status.started(worker)
        await trio.sleep_forever()


def held_request(nth: int) -> tuple[trio.Event, Callable[[int], Awaitable[None]]]:
    """An ``on_request`` for the scripted model that holds the ``nth`` model request open
    (never answered), and the event set when it arrives."""
    asked = trio.Event()

    async def on_request(n: int) -> None:
        if n == nth:
            asked.set()
            await trio.sleep_forever()

    return asked, on_request


async def result_of(worker: RoomWorker, delivery_id: str) -> DeliveryResult:
    async for result in worker.results(after=0):
        if result.delivery_id == delivery_id:
            return result
    raise AssertionError("unreachable")


async def test_s11_a_host_whose_lane_is_claimed_under_it_is_refused_and_gives_it_up(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S11: A runs d1 (its model request held open); its lease is made to run out and B
    claims dm:1, kills A's worker and answers d1. A's next write for the lane — recording
    its worker's death — is refused by epoch: A gives the lane up (its reason: a refused
    write, not its deadline, 60 s away) and publishes nothing; d1 has B's one result, and
    A's dead epoch left nothing after B's records. Both hosts stream the result (S20)."""
    asked, on_request = held_request(1)  # A's request: never answered

    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([], on_request=on_request) as (model, url),
            host(tmp_path, "a", pg_dsn, url) as a,
        ):
            accepted = await a.deliver(message("d1", room="dm:1"))
            assert accepted.disposition == "started"
            await asked.wait()
            lane = a._lanes["dm:1"]
            await execute(pg_dsn, "UPDATE pi_runtime.lanes SET lease_until = now()")
            async with host(tmp_path, "b", pg_dsn, url) as b:
                on_b = await result_of(b, "d1")
                await lane.stopped.wait()
                on_a = await result_of(a, "d1")
                status = a.status()
    assert on_a == on_b
    assert (on_b.outcome, on_b.seq) == ("reply", 1)
    assert lane.lost
    assert "refused" in lane.lost_why
    assert status == []
    async with open_pg_store(pg_dsn, root=tmp_path / "reader") as store:
        records = (await store.read_delivery_log("d1")).records
    assert [r.epoch for r in records if isinstance(r, ModelResponse)] == [2]
    assert sum(isinstance(r, Result) for r in records) == 1
    assert not any(isinstance(r, StepAbandoned) and r.epoch == 1 for r in records)
    assert model.request_count == 1  # B's; A's was never answered


async def test_s20_any_host_takes_any_client_and_the_lanes_holder_runs_it(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S20, S21: A holds dm:1 (it admitted d1 there); d2 for dm:1 sent to B is admitted by B
    (``queued``: A runs it, told by the announcement) and answered once; the same delivery
    sent again to either host is a duplicate, with another text a conflict; results are one
    seq order on both hosts, and an acknowledgement made on one is the deployment's. B starts
    once A holds dm:1: a host already up could claim it between A's admission and A's
    claim (S10)."""
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([]) as (model, url),
            host(tmp_path, "a", pg_dsn, url) as a,
        ):
            first = await a.deliver(message("d1", "one", room="dm:1"))
            await result_of(a, "d1")
            async with host(tmp_path, "b", pg_dsn, url) as b:
                second = await b.deliver(message("d2", "two", room="dm:1"))
                on_b = await result_of(b, "d2")
                on_a = await result_of(a, "d2")
                duplicate = await a.deliver(message("d2", "two", room="dm:1"))
                with pytest.raises(DeliveryError) as conflict:
                    await b.deliver(message("d1", "not one", room="dm:1"))
                await b.ack(on_b.seq)
                await a._sync()
                acked = a._host.outbox.acked
                status_b = b.status()
    assert (first.disposition, second.disposition) == ("started", "queued")
    assert on_a == on_b
    assert (on_b.outcome, on_b.seq) == ("reply", 2)
    assert on_b.text is not None
    assert "two" in on_b.text
    assert duplicate.disposition == "duplicate"
    assert conflict.value.code is ReasonCode.DELIVERY_CONFLICT
    assert acked == 2
    assert status_b == []  # B never held dm:1
    assert model.request_count == 2


async def test_s21_the_same_delivery_sent_to_two_hosts_at_once_is_admitted_once(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S21: one delivery sent to A and B at the same moment (a client retrying on another
    host): one admission in the shared log, the other answer is ``duplicate``, one result."""
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([]) as (model, url),
            host(tmp_path, "a", pg_dsn, url) as a,
            host(tmp_path, "b", pg_dsn, url) as b,
        ):
            answers: list[str] = []

            async def send(worker: RoomWorker) -> None:
                answers.append((await worker.deliver(message("d1", room="dm:3"))).disposition)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send, a)
                nursery.start_soon(send, b)
            await result_of(a, "d1")
            await result_of(b, "d1")
    assert sorted(answers)[0] == "duplicate"
    assert sorted(answers)[1] in ("started", "queued")
    rows = await execute(
        pg_dsn,
        "SELECT count(*) FROM pi_runtime.log_records WHERE log = 'admissions/admissions.log' "
        "AND seq > 0",
    )
    assert rows == [(1,)]
    assert model.request_count == 1


async def test_s12_a_host_that_stops_hands_its_lanes_over_at_once(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S12, S23: A stops (its block ends) with d1 mid-turn and d2 queued in dm:1; its leases
    are given up and announced, so B — which found dm:1 held and would otherwise wait out the
    600 s lease — claims it at once and answers both, d1 replayed (d2 as its own turn, or
    absorbed into d1's run when it was steered there). B starts once A runs d1: a host
    already up could claim dm:1 between A's admission and A's claim (S10), and then d1
    would run on B under the request held open."""
    asked, on_request = held_request(1)  # A's request: never answered

    with trio.fail_after(LIMIT):  # far less than the lease
        async with (
            scripted_upstream([], on_request=on_request) as (model, url),
            trio.open_nursery() as outlives_a,
        ):
            async with host(tmp_path, "a", pg_dsn, url, lease=600) as a:
                started = await a.deliver(message("d1", "one", room="dm:1"))
                await asked.wait()
                b = await outlives_a.start(hosting, tmp_path, "b", pg_dsn, url, 600)
                queued = await b.deliver(message("d2", "two", room="dm:1"))  # B: held by A
            d1 = await result_of(b, "d1")
            d2 = await result_of(b, "d2")
            outlives_a.cancel_scope.cancel()  # B stops
    assert (started.disposition, queued.disposition) == ("started", "queued")
    assert d1.outcome == "reply"
    assert (d1.seq, d2.seq) == (1, 2)
    if d2.outcome == "absorbed":  # steered into d1's run (on A, or on B's replay): L10
        assert d2.absorbed_into == "d1"
        assert model.request_count in (1, 2)  # B's replay of d1 carried d2, or a next step did
    else:
        assert d2.outcome == "reply"
        assert model.request_count == 2


async def test_s10_a_release_heard_while_a_refused_claim_reads_the_lease_is_not_lost(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S10, S23: B's claim of dm:1 is refused (A holds it, 600 s) and B reads A's lease to
    learn how long to wait. Before that read returns, A's lease is given up and the release
    is heard by B. The read is stale now: B must not wait out the 600 s it reports, but look
    again — it claims dm:1 at its next look and answers d1 (A, its worker killed, is fenced
    out as in S11)."""
    asked, on_request = held_request(1)  # A's request: never answered
    in_read = trio.Event()

    with trio.fail_after(LIMIT):  # far less than the lease
        async with (
            scripted_upstream([], on_request=on_request) as (_model, url),
            host(tmp_path, "a", pg_dsn, url, lease=600) as a,
        ):
            await a.deliver(message("d1", "one", room="dm:1"))
            await asked.wait()
            async with host(tmp_path, "b", pg_dsn, url, lease=600) as b:
                assert b.leases is not None
                store = b.leases.store
                read = store.lease

                async def stale_read(lane: str) -> Any:
                    found = await read(lane)
                    if lane == "dm:1" and not in_read.is_set():
                        in_read.set()
                        assert found is not None
                        assert found.live  # A's, 600 s
                        # A's lease is given up, and B hears the release, before the
                        # read returns (the release's own announcement is left out, so it
                        # cannot arrive after the read and hide the stale answer)
                        await execute(
                            pg_dsn, "UPDATE pi_runtime.lanes SET lease_until = '-infinity'"
                        )
                        b._poke(True)
                    return found

                store.lease = stale_read  # type: ignore[method-assign]
                b._poke(True)  # B looks again now, whatever it read before the patch
                await in_read.wait()
                d1 = await result_of(b, "d1")
    assert (d1.outcome, d1.seq) == ("reply", 1)


async def test_s10_s13_a_claim_whose_caller_is_cancelled_while_it_recovers_still_runs_it(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S10, S13, L1: A admitted d1 and claimed dm:1; the caller is cancelled (a client gone)
    while A recovers the lane. A half-taken lane — held, renewed, never ready — would leave
    d1 and every later delivery of the room queued everywhere until A restarts: the lane is
    given up whole instead, claimed again at a later look, and d1 answered."""
    recovering, release = trio.Event(), trio.Event()
    recover = RoomWorker._recover

    async def held_recover(self: RoomWorker, rooms: set[str]) -> None:
        if not recovering.is_set():
            recovering.set()
            await release.wait()  # the caller is cancelled meanwhile
        await recover(self, rooms)

    with trio.fail_after(LIMIT):  # far less than the lease
        async with (
            scripted_upstream([Text(text="one")]) as (_model, url),
            host(tmp_path, "a", pg_dsn, url, lease=600) as a,
        ):
            monkeypatch.setattr(RoomWorker, "_recover", held_recover)
            await cancelled_once(
                recovering, lambda: a.deliver(message("d1", "one", room="dm:1")), then=release
            )
            d1 = await result_of(a, "d1")
    assert (d1.outcome, d1.seq) == ("reply", 1)


async def test_r9_documents_and_receipts_travel_with_the_lane(tmp_path: Path, pg_dsn: str) -> None:
    """receipts.md R9: A answers d1, which wrote ``notes``; d2's ``write_document`` of
    ``other`` commits its revision and receipt and A stops right there, before its outcome is
    journaled. B claims the lane: its recovery of d2's call finds A's receipt (the saved
    result, nothing written again), and d3 on B reads the document d1 wrote on A. With a
    receipt store per host, B would have applied d2's write a second time in its own store
    and found no ``notes``."""
    documents = frozenset({"write_document", "read_document", "send_text_update"})

    def call(name: str, **args: str) -> ToolCalls:
        return ToolCalls(calls=[Call(name=name, arguments=args, id="c1")])

    steps: list[Step] = [
        call("write_document", document_id="notes", content="from a"),  # d1 on A
        Text(text="saved notes"),
        call("write_document", document_id="other", content="x"),  # d2 on A: A stops
        Text(text="saved other"),  # d2 on B, after its replayed call
        call("read_document", document_id="notes"),  # d3 on B
    ]
    committed = trio.Event()
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (model, url),
            host(tmp_path, "a", pg_dsn, url, grants=documents) as a,
        ):
            receipts = a.receipts
            assert receipts is not None
            write = receipts.write_document

            async def stop_after_second(intent_id: str, args: Mapping[str, Any]) -> dict[str, Any]:
                result = await write(intent_id, args)
                if args["document_id"] == "other":
                    committed.set()
                    await trio.sleep_forever()  # A never journals the outcome
                return result

            receipts.write_document = stop_after_second  # type: ignore[method-assign]
            await a.deliver(message("d1", room="dm:1"))
            d1 = await result_of(a, "d1")
            await a.deliver(message("d2", room="dm:1"))
            await committed.wait()
            lane = a._lanes["dm:1"]
            await execute(pg_dsn, "UPDATE pi_runtime.lanes SET lease_until = now()")
            async with host(tmp_path, "b", pg_dsn, url, grants=documents) as b:
                d2 = await result_of(b, "d2")
                await lane.stopped.wait()
                await b.deliver(message("d3", room="dm:1"))
                d3 = await result_of(b, "d3")
    assert (d1.text, d2.text) == ("saved notes", "saved other")
    assert d3.text is not None
    read = json.loads(d3.text.removeprefix("The tool said: "))
    assert (read["document_id"], read["content"]) == ("notes", "from a")
    revisions = await execute(
        pg_dsn, "SELECT document_id FROM pi_runtime.receipt_revisions ORDER BY made"
    )
    assert revisions == [("notes",), ("other",)]  # each write applied once, in the database
    (saved,) = tool_messages(model.requests[3].body).values()  # d2's call, as B replayed it
    assert json.loads(saved)["document_id"] == "other"
    assert not (tmp_path / "b" / "state" / "receipts.sqlite").exists()


ROOMS: Final = {"dm:1": RoomConfig(actors={"u2": frozenset({"read"})})}
"""u2 has more grants than the room's: its deliveries run alone (one-shot), never steered."""


async def test_s26_a_cancel_sent_to_another_host_travels_to_the_lanes_holder(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S26: A holds dm:1 and runs d1 (its model request held open); d2 (by an author with
    more grants: never steered into d1's run, L10) waits behind it.
    ``cancel`` of d2, then of d1, through B (which holds nothing): B makes each request
    durable in the database and announces it; A ends d2 ``cancelled`` from its queue and
    aborts d1's running turn, ``cancelled`` too. Both hosts stream both results; d1's model
    request was the only one. B starts once A runs d1: a host already up could claim dm:1
    between A's admission and A's claim (S10)."""
    asked = trio.Event()
    arrived = 0

    async def on_request(n: int) -> None:
        nonlocal arrived
        arrived = n
        if n == 1:
            asked.set()
            await trio.sleep_forever()  # d1's turn runs until it is cancelled

    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([], on_request=on_request) as (_model, url),
            host(tmp_path, "a", pg_dsn, url, rooms=ROOMS) as a,
            contextlib.AsyncExitStack() as stack,  # B: inside A's block
        ):
            started = await a.deliver(message("d1", "one", room="dm:1"))
            await asked.wait()
            b = await stack.enter_async_context(host(tmp_path, "b", pg_dsn, url, rooms=ROOMS))
            queued = await a.deliver(message("d2", "two", room="dm:1", author_id="u2"))
            await b._sync()  # B has learned both admissions
            await b.cancel("d2")
            d2 = await result_of(b, "d2")
            await b.cancel("d1")
            d1 = await result_of(b, "d1")
            on_a = [await result_of(a, d) for d in ("d1", "d2")]
            await b.cancel("d1")  # finished: nothing to do
            await b._sync()  # the requests of finished deliveries are removed
            left = await execute(
                pg_dsn, "SELECT name FROM pi_runtime.documents WHERE name LIKE 'cancels/%'"
            )
            status_b = b.status()
    assert (started.disposition, queued.disposition) == ("started", "queued")
    assert (d2.outcome, d1.outcome) == ("cancelled", "cancelled")
    assert on_a == [d1, d2]
    assert (d2.seq, d1.seq) == (1, 2)
    assert status_b == []  # B never held dm:1
    assert arrived == 1  # d1's, never answered; d2 never asked
    assert left == []


async def test_s26_a_cancel_of_a_lane_nobody_holds_is_carried_out_by_its_next_holder(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S26 at a claim: A admitted d1 and d2 (queued: its author has more grants) and stopped
    (its lane released, d1's turn cut short, d2 never begun). B — whose scan would claim
    the room only after a minute — is asked to cancel d2 while nobody holds dm:1 and
    records the request; C, started then,
    claims the lane and recovers the room: d1 is answered, d2 ends ``cancelled`` without a
    turn."""
    asked, on_request = held_request(1)  # A's request: A stops under it

    with trio.fail_after(LIMIT):
        async with scripted_upstream([], on_request=on_request) as (model, url):
            async with host(tmp_path, "a", pg_dsn, url, rooms=ROOMS) as a:
                await a.deliver(message("d1", "one", room="dm:1"))
                await asked.wait()
                await a.deliver(message("d2", "never-asked-xyz", room="dm:1", author_id="u2"))
            async with host(tmp_path, "b", pg_dsn, url, poll=60, rooms=ROOMS) as b:
                await b.cancel("d2")
                held_by_b = dict(b._lanes)
                async with host(tmp_path, "c", pg_dsn, url, rooms=ROOMS) as c:
                    d1 = await result_of(c, "d1")
                    d2 = await result_of(c, "d2")
    assert held_by_b == {}
    assert d1.outcome == "reply"
    assert d2.outcome == "cancelled"
    assert not any("never-asked-xyz" in str(r.body) for r in model.requests)  # d2 never ran


async def test_s26_a_cancel_made_in_the_database_without_a_host(
    tmp_path: Path, pg_dsn: str
) -> None:
    """``pi-runtime cancel --store DSN`` (``request_cancel_in_database``): no host is
    asked; the request is recorded and announced, and A — holding the room — ends the queued
    d2 ``cancelled``. Asked again it answers ``finished``; an id never admitted is
    ``delivery_unknown``."""
    asked, on_request = held_request(1)

    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([], on_request=on_request) as (_model, url),
            host(tmp_path, "a", pg_dsn, url, rooms=ROOMS) as a,
        ):
            await a.deliver(message("d1", "one", room="dm:1"))
            await asked.wait()
            await a.deliver(message("d2", "two", room="dm:1", author_id="u2"))
            first = await request_cancel_in_database(pg_dsn, "d2")
            d2 = await result_of(a, "d2")
            again = await request_cancel_in_database(pg_dsn, "d2")
            with pytest.raises(DeliveryError) as unknown:
                await request_cancel_in_database(pg_dsn, "nobody")
    assert (first, again) == ("requested", "finished")
    assert d2.outcome == "cancelled"
    assert unknown.value.code is ReasonCode.DELIVERY_UNKNOWN


async def test_the_deployments_status_is_read_from_its_database(
    tmp_path: Path, pg_dsn: str
) -> None:
    """``pi-runtime status --store DSN`` (``database_status``): with no host asked, every
    room of the deployment, its pending deliveries, and which host holds its lane at which
    epoch; the results as the shared log holds them."""
    asked, on_request = held_request(2)  # d2's turn: still running when the status is read

    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([], on_request=on_request) as (_model, url),
            host(tmp_path, "a", pg_dsn, url) as a,
        ):
            await a.deliver(message("d1", "one", room="dm:1"))
            await result_of(a, "d1")
            await a.deliver(message("d2", "two", room="dm:1"))
            await asked.wait()
            status = await database_status(pg_dsn)
    assert status["source"] == "database"
    assert [d["delivery_id"] for d in status["pending_deliveries"]] == ["d2"]
    (room,) = status["rooms"]
    assert (room["room"], room["state"], room["queued"]) == ("dm:1", "pending", 1)
    assert room["holder"] == {"host": "a", "epoch": 1, "live": True}
    assert [r["delivery_id"] for r in status["recent_results"]] == ["d1"]


async def test_pg13_an_admission_lost_to_an_outage_stops_admitting_and_the_host_reads_on(
    tmp_path: Path, pg_dsn: str
) -> None:
    """PG7, PG13, S23: the database stops taking connections while A's admission of d2 is on
    its way (held at the admission log's lock, so that it, not a read, meets the outage) —
    its retries are spent (a fast policy stands for a long outage), the admission log
    refuses appends in this process, and A stops admitting (``not_admitting``,
    ``store_unavailable``). Its follower, woken by the listener's reconnections, keeps
    reading: once the database is back, d3 for dm:1 — A's lane — admitted by B is learned by
    A, run there and answered; A's own sync works. Nothing of it tears A down."""
    admin, database = admin_dsn(pg_dsn), database_name(pg_dsn)
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([]) as (_model, url),
            host(tmp_path, "a", pg_dsn, url, poll=LIMIT) as a,
        ):
            await a.deliver(message("d1", "one", room="dm:1"))
            await result_of(a, "d1")
            store = cast(PgStore, a.store)
            store.retry = FAST
            admissions = store.admissions
            outage: list[BaseException] = []

            async def admit() -> None:
                try:
                    await a.deliver(message("d2", "two", room="dm:2"))
                except DiskFailedError as error:
                    outage.append(error)

            await execute(admin, f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
            try:
                async with trio.open_nursery() as nursery, admissions._lock:
                    nursery.start_soon(admit)
                    while not admissions._flushing:  # queued behind the lock held here
                        await trio.testing.wait_all_tasks_blocked()
                    await terminate_backends(pg_dsn)
                refused = admissions.poisoned
            finally:
                await execute(admin, f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
            async with host(tmp_path, "b", pg_dsn, url) as b:
                queued = await b.deliver(message("d3", "three", room="dm:1"))
                d3 = await result_of(b, "d3")
                on_a = await result_of(a, "d3")
            await a._sync()
            with pytest.raises(DeliveryError) as later:
                await a.deliver(message("d4", "four", room="dm:3"))
            status = a.status()
    assert [getattr(e, "code", None) for e in outage] == [ReasonCode.STORE_UNAVAILABLE]
    assert refused
    assert queued.disposition == "queued"
    assert d3 == on_a
    assert d3.outcome == "reply"
    assert later.value.code is ReasonCode.NOT_ADMITTING
    assert "store_unavailable" in str(later.value)
    assert [lane.room for lane in status] == ["dm:1"]
