"""Power loss under a running room worker (issue #5: the crash matrix's power-loss variant;
``docs/design/lanes.md`` "Crashes of the host", ``docs/design/recovery.md``).

A SIGKILL (``tests/rooms/test_room_crash.py``) keeps the page cache; a power loss does not. Here the
room worker's journal store runs on :class:`tests.faultfs.PowerLossFileSystem` (sessions, work
directories and the ``effect`` ledger stay on the real disk, as ``open_room_worker(fs=)``
does). Two rooms get several deliveries, some with a tool round (the runtime's ``effect``
tool, one ledger line per execution), in two waves so that later ones are queued or steered
into running turns. The power is cut at a random file-system operation within a calibrated
budget; the first refused operation cancels the worker at once (``PowerLossFileSystem.on_cut``
→ ``run_sync_soon``), the disk image a real machine could find is built
(:meth:`~tests.faultfs.PowerLossFileSystem.crash`) and a new room worker opens on it. Then:

* every delivery accepted before the cut ends with exactly one result; sent again it is
  ``duplicate`` (L1, L2);
* every result seen before the cut is delivered again identical, with its seq (L5); the
  results not acknowledged come again, the acknowledged ones do not;
* seqs run 1, 2, … without gaps, no delivery has two results, nothing is left pending, every
  result is a ``reply`` or ``absorbed`` (a power loss is not a reason to fail a delivery);
* a steer the owner's model request carried (its ``AbsorbedInput`` durable in the owner's log)
  ends ``absorbed`` into that owner when the owner answered (L10);
* every ``effect`` call (key and tool-call id) is in the ledger at most once (T2, T5) — a
  replay answers a journaled call from its outcome or "possibly ran", never runs it again —
  and no model request was asked more than twice (before the cut, and once by the replay);
* a delivery not accepted may or may not have been admitted: sent again after the restart it
  is ``duplicate`` or freshly accepted, and ends with exactly one result like every other;
* a second power loss after the restart finished loses nothing: the same results, all
  acknowledged, nothing pending, the model not asked again.

Fake-Pi only: the real Pi takes seconds to start per epoch, and a seed restarts every lane's
epoch. The scripted model answers by directive (``#effect=KEY`` in the message asks for one
``effect`` call, once), so what a request gets does not depend on how the two rooms' requests
interleave; after a restart a reply's text may differ, so texts are compared only for results
seen before the cut. Every assertion names the seed; rerun one with ``-k seed-3``.

Three steering bugs were found here, each now fixed and pinned by a deterministic test at the
end of this file: a steer carried into an owner whose result was durable before the cut ran
again as its own turn (recovery now reads the latest finished owner of each room too); a steer
never seen was re-sent right after the replayed prompt, so the replay diverged (it is re-sent
once the last answered step is answered, L10); a steer accepted after the worker's last
steering check stayed queued in the worker and was carried twice (the lane takes it back with
``clear_queue`` when the owner settles).
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio
import trio.testing

from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import Call, Step, Text, ToolCalls
from runtime._boundary._steps import DeliveryStepJournal
from runtime._config import RoomWorkerConfig, config_from_dict
from runtime._errors import PiRuntimeError
from runtime._pi._rpc import RpcChannel
from runtime._pi._rpc_protocol import Event as RpcEvent
from runtime._records import AbsorbedInput, ModelResponse, Outcome, Record
from runtime._rooms._worker import RoomWorker, open_room_worker
from runtime._wire import DeliveryResult, Typing

from .._pi import pi_home
from .._workers import scripted_upstream
from ..faultfs import PowerLossFileSystem

SEEDS: Final = 6
KINDS: Final = ("fake", "pi")
LIMIT: Final = 45.0
ROOMS: Final = ("dm:301", "dm:302")


@dataclass(frozen=True, slots=True)
class Message:
    delivery_id: str
    room: str
    text: str

    def request(self) -> dict[str, Any]:
        return {
            "delivery_id": self.delivery_id,
            "room": self.room,
            "author": {"id": "u1", "name": "Ann"},
            "message_id": f"m-{self.delivery_id}",
            "text": self.text,
        }


def _effect_key(delivery_id: str) -> str:
    return f"fx-{delivery_id}"


def _messages() -> tuple[tuple[Message, ...], ...]:
    """Two waves of four: two per room each, half of them with a tool round."""
    waves: list[tuple[Message, ...]] = []
    n = 0
    for _wave in range(2):
        batch: list[Message] = []
        for _round in range(2):
            for room in ROOMS:
                delivery_id = f"d{n}"
                text = f"#effect={_effect_key(delivery_id)}" if n % 2 == 0 else f"hello {n}"
                batch.append(Message(delivery_id, room, text))
                n += 1
        waves.append(tuple(batch))
    return tuple(waves)


WAVES: Final = _messages()
MESSAGES: Final = tuple(m for wave in WAVES for m in wave)
SECOND_WAVE_AFTER: Final = 2
"""The second wave is delivered once this many results were published (rooms are busy)."""


def _config(base: Path, url: str, kind: str = "fake") -> RoomWorkerConfig:
    grants = ["effect", "send_text_update"]
    settings: dict[str, Any] = {
        "agent": kind,
        "model": {"base_url": url},
        "rooms": {room: {"grants": grants} for room in ROOMS},
    }
    if kind == "pi":
        settings["pi_home"] = str(pi_home())
    return config_from_dict(settings, base=base)


def _state_dir(base: Path) -> Path:
    """The state directory (sessions live in its real-disk ``lanes/``)."""
    state = base / "state"
    (state / "lanes").mkdir(mode=0o700, parents=True, exist_ok=True)
    state.chmod(0o700)
    return state


@contextlib.asynccontextmanager
async def _upstream() -> AsyncIterator[tuple[ScriptedModel, str]]:
    async with scripted_upstream([]) as (model, url):
        model.directives = True  # '#effect=KEY' asks for one effect call, once
        yield model, url


# ------------------------------------------------------------------------- before the cut


@dataclass
class Before:
    """What the first run was told before the power went."""

    accepted: dict[str, str] = field(default_factory=dict)
    """delivery id -> disposition, for every ``deliver`` that returned."""
    results: list[DeliveryResult] = field(default_factory=list)
    """Every published result the client saw (each durable when it was published)."""
    ack_attempted: int = 0
    ack_returned: int = 0
    _changed: trio.Event = field(default_factory=trio.Event)

    def saw(self, result: DeliveryResult) -> None:
        self.results.append(result)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_results(self, count: int) -> None:
        while len(self.results) < count:
            await self._changed.wait()


async def _follow_before(worker: RoomWorker, fs: PowerLossFileSystem, before: Before) -> None:
    """Collect every result; acknowledge each even seq (cumulative)."""
    acking = True
    async for result in worker.results(after=0):
        before.saw(result)
        if acking and result.seq % 2 == 0:
            before.ack_attempted = result.seq
            try:
                await worker.ack(result.seq)
            except (PiRuntimeError, OSError):
                if not fs.power_cut:
                    raise
                acking = False
                continue
            before.ack_returned = result.seq


async def _workload(worker: RoomWorker, *, fs: PowerLossFileSystem, before: Before) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_follow_before, worker, fs, before)
        for number, wave in enumerate(WAVES):
            if number:
                await before.wait_results(SECOND_WAVE_AFTER)
            for message in wave:
                try:
                    accepted = await worker.deliver(message.request())
                except (PiRuntimeError, OSError):
                    if not fs.power_cut:
                        raise
                    continue
                before.accepted[message.delivery_id] = accepted.disposition
        await before.wait_results(len(MESSAGES))
        nursery.cancel_scope.cancel()


async def _until_the_cut(
    cfg: RoomWorkerConfig,
    base: Path,
    fs: PowerLossFileSystem,
    body: Callable[[RoomWorker], Awaitable[None]],
    cut: int | None = None,
) -> None:
    """Run ``body`` on a room worker; the power goes after ``cut`` more operations (or when
    ``body`` cuts it) and the worker is stopped right there — whatever it raises from then
    on is a dying machine's. Anything raised before the cut fails the test."""
    token = trio.lowlevel.current_trio_token()
    failure: Exception | None = None
    try:
        with trio.CancelScope() as scope:

            def power_gone() -> None:
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(scope.cancel)

            fs.on_cut = power_gone
            async with open_room_worker(cfg, base_dir=base, fs=fs) as worker:
                if cut is not None:
                    fs.cut_after(cut)
                await body(worker)
    except Exception as exc:
        failure = exc
    finally:
        fs.on_cut = None
    if failure is not None and not fs.power_cut:
        raise failure


_OPS_BUDGET: dict[str, int] = {}


async def _workload_ops(root: Path) -> int:
    """How many file-system operations the workload takes after the worker opened (once per
    test process)."""
    if "ops" not in _OPS_BUDGET:
        fs = PowerLossFileSystem(_state_dir(root))
        async with _upstream() as (_model, url):
            cfg = _config(root, url)
            async with open_room_worker(cfg, base_dir=root, fs=fs) as worker:
                start = fs.ops
                await _workload(worker, fs=fs, before=Before())
                end = fs.ops
        _OPS_BUDGET["ops"] = end - start
    return _OPS_BUDGET["ops"]


# -------------------------------------------------------------------------- after the cut


async def _drain(iterator: AsyncIterator[DeliveryResult]) -> list[DeliveryResult]:
    """What ``iterator`` yields until every task is blocked (nothing more is coming now)."""
    found: list[DeliveryResult] = []

    async def collect() -> None:
        async for result in iterator:
            found.append(result)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(collect)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    return found


async def _wait_for(wanted: set[str], worker: RoomWorker) -> None:
    """Until each of ``wanted`` has a published result."""
    seen: set[str] = set()
    async for result in worker.results(after=0):
        seen.add(result.delivery_id)
        if wanted <= seen:
            return


@dataclass
class Journaled:
    """What the delivery logs hold about steering (read after the restart finished)."""

    carried: dict[str, str] = field(default_factory=dict)
    """Steered delivery -> owner, for every steer a model request of the owner carried (an
    ``AbsorbedInput`` with its first step)."""
    unseen_before_answered: set[str] = field(default_factory=set)
    """Owners whose log holds a steer never seen (``AbsorbedInput`` without a step) and an
    answered step after the first one (a ``ModelResponse`` at step >= 1)."""
    unseen: set[str] = field(default_factory=set)
    """Deliveries steered into an owner that no model request of the owner carried (they
    ran as turns of their own)."""
    logs: dict[str, list[str]] = field(default_factory=dict)
    """Each delivery log in short, for failure reports."""


def _short(record: Record) -> str:
    fields = {
        name: getattr(record, name)
        for name in ("delivery_id", "step", "first_step", "tool_call_id", "reason", "epoch")
        if hasattr(record, name)
    }
    digest = getattr(record, "request_digest", None)
    if digest is not None:
        fields["digest"] = digest[:8]
    for name in ("outcome", "code"):
        if getattr(record, name, None) is not None:
            fields[name] = str(getattr(record, name))
    return f"{type(record).__name__}{fields or ''}"


async def _journaled(worker: RoomWorker) -> Journaled:
    found = Journaled()
    for message in MESSAGES:
        try:
            contents = await worker.store.read_delivery_log(message.delivery_id)
        except FileNotFoundError:
            continue
        found.logs[message.delivery_id] = [_short(r) for r in contents.records]
        steered: set[str] = set()
        answered_later = False
        for record in contents.records:
            if isinstance(record, AbsorbedInput):
                steered.add(record.delivery_id)
                if record.first_step is not None:
                    found.carried[record.delivery_id] = message.delivery_id
            elif isinstance(record, ModelResponse) and record.step >= 1:
                answered_later = True
        unseen = steered - found.carried.keys()
        found.unseen |= unseen
        if answered_later and unseen:
            found.unseen_before_answered.add(message.delivery_id)
    found.unseen -= found.carried.keys()
    return found


@dataclass
class After:
    redelivered: dict[str, str]
    final: list[DeliveryResult]
    unacked: list[DeliveryResult]
    pending: list[str]
    journaled: Journaled


async def _restart(cfg: RoomWorkerConfig, base: Path, fs: PowerLossFileSystem) -> After:
    """Open on the crashed image, send every message again, wait until each has a result."""
    async with open_room_worker(cfg, base_dir=base, fs=fs) as worker:
        redelivered: dict[str, str] = {}
        for message in MESSAGES:
            redelivered[message.delivery_id] = (await worker.deliver(message.request())).disposition
        await _wait_for({m.delivery_id for m in MESSAGES}, worker)
        final = await _drain(worker.results(after=0))
        unacked = await _drain(worker.results())
        pending = worker.pending()
        journaled = await _journaled(worker)
        if final:
            await worker.ack(final[-1].seq)
    return After(redelivered, final, unacked, pending, journaled)


def _check(seed: int, before: Before, after: After, ledger: Path) -> None:
    """Assert the invariants (the module docstring), naming the seed."""
    where = f"seed {seed}"
    final = after.final
    assert [r.seq for r in final] == list(range(1, len(final) + 1)), f"{where}: seqs {final}"
    ids = [r.delivery_id for r in final]
    assert len(set(ids)) == len(ids), f"{where}: a delivery has two results: {final}"
    assert sorted(ids) == sorted(m.delivery_id for m in MESSAGES), f"{where}: {final}"
    assert after.pending == [], f"{where}: still pending after every result: {after.pending}"
    for result in before.results:  # durable when published: the same, with its seq
        assert result in final, f"{where}: {result} was seen before the cut, then {final}"
    for delivery_id in before.accepted:
        assert after.redelivered[delivery_id] == "duplicate", (
            f"{where}: {delivery_id} was accepted before the cut, and is "
            f"{after.redelivered[delivery_id]} after it"
        )
    for result in final:
        assert result.outcome in (Outcome.REPLY, Outcome.ABSORBED), (
            f"{where}: {result}; its log: {after.journaled.logs.get(result.delivery_id)}"
        )
    acks = range(before.ack_returned, before.ack_attempted + 1)
    assert any(after.unacked == [r for r in final if r.seq > a] for a in acks), (
        f"{where}: acknowledged up to {before.ack_returned} (tried {before.ack_attempted}); "
        f"delivered again: {[r.seq for r in after.unacked]}"
    )
    # each effect call ran at most once: a replay answers a journaled tool call (same id)
    # from its outcome or "possibly ran", never by running it again
    entries = _ledger(ledger)
    calls = [(e["key"], e["tool_call_id"]) for e in entries]
    assert len(set(calls)) == len(calls), f"{where}: an effect ran twice: {sorted(calls)}"
    keys = {_effect_key(m.delivery_id) for m in MESSAGES}
    assert {key for key, _call in calls} <= keys, f"{where}: {entries}"
    # L10: a steer a model request of its owner carried ends absorbed when the owner answered
    by_id = {r.delivery_id: r for r in final}
    for steered, owner in sorted(after.journaled.carried.items()):
        if by_id[owner].outcome not in (Outcome.REPLY, Outcome.SILENT):
            continue
        got = by_id[steered]
        if (got.outcome, got.absorbed_into) == (Outcome.ABSORBED, owner):
            continue
        problem = f"{steered} was carried into {owner}'s answered turn, then ended {got}"
        raise AssertionError(f"{where}: {problem}")


def _ledger(path: Path) -> list[dict[str, Any]]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [msgspec.json.decode(line) for line in data.splitlines() if line]


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed-{s}") for s in range(SEEDS)])
async def test_power_loss_under_a_room_worker(tmp_path: Path, seed: int) -> None:
    """The power goes at a random operation while two rooms run deliveries with tool rounds,
    queued and steered; after the crash every accepted delivery ends with exactly one result,
    every result seen stays the same, no effect ran twice, and a second crash loses nothing
    (see the module docstring for each check)."""
    rng = random.Random(seed)
    base = tmp_path / "run"
    fs = PowerLossFileSystem(_state_dir(base))
    with trio.fail_after(LIMIT):
        budget = await _workload_ops(tmp_path / "calibration")
        async with _upstream() as (model, url):
            cfg = _config(base, url)
            before = Before()
            workload = functools.partial(_workload, fs=fs, before=before)
            await _until_the_cut(cfg, base, fs, workload, cut=rng.randrange(budget + 1))
            fs.crash(rng)
            try:
                after = await _restart(cfg, base, fs)
            except PiRuntimeError as exc:  # pragma: no cover - the failure report
                raise AssertionError(f"seed {seed}: the worker does not reopen: {exc!r}") from exc
            _check(seed, before, after, base / "work" / "effects.jsonl")
            asked = model.request_count
            repeats = {r.digest: model.count(r.digest) for r in model.requests}
            assert max(repeats.values(), default=0) <= 2, f"seed {seed}: asked again and again"

            fs.crash(rng)  # nothing was left unsynced: a second power loss loses nothing
            async with open_room_worker(cfg, base_dir=base, fs=fs) as worker:
                assert worker.pending() == [], f"seed {seed}: {worker.pending()}"
                assert await _drain(worker.results(after=0)) == after.final, f"seed {seed}"
                assert await _drain(worker.results()) == [], f"seed {seed}: acks were lost"
                for message in MESSAGES:
                    again = await worker.deliver(message.request())
                    assert again.disposition == "duplicate", f"seed {seed}: {again}"
            assert model.request_count == asked, f"seed {seed}: the model was asked again"


@pytest.mark.parametrize("kind", KINDS)
async def test_power_loss_between_the_owners_result_and_the_steers_absorbed_result(
    kind: str,
    tmp_path: Path,
) -> None:
    """L10 under power loss, the minimal case: a second message is steered into a running
    turn and carried by its next model request (its ``AbsorbedInput`` with the step durable
    in the owner's log); the owner's reply is published; the power goes before the steered
    delivery's ``absorbed`` result is durable. After the restart the steered delivery must
    end ``absorbed`` into the owner — it was answered — and the model must not be asked
    again. (Today it runs as a turn of its own: a second answer, paid again.)"""
    room = ROOMS[0]
    base = tmp_path
    fs = PowerLossFileSystem(_state_dir(base))
    seen: list[DeliveryResult] = []
    dispositions: list[str] = []

    async def steer_then_cut(worker: RoomWorker) -> None:
        first = await worker.deliver(Message("d0", room, "first").request())
        async for event in worker.events():  # the reply streams: the turn takes steers
            if isinstance(event, Typing):
                break
        second = await worker.deliver(Message("d1", room, "second").request())
        dispositions.extend([first.disposition, second.disposition])
        async for result in worker.results():
            seen.append(result)
            fs.cut_after(0)  # the owner's result is durable; the power goes now
            break
        await trio.sleep_forever()  # until the next operation is refused

    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="one two three four", delay=0.3)]) as (
            model,
            url,
        ):
            cfg = _config(base, url)
            await _until_the_cut(cfg, base, fs, steer_then_cut)
            asked = model.request_count
            fs.crash(random.Random(0))
            async with open_room_worker(cfg, base_dir=base, fs=fs) as worker:
                await _wait_for({"d0", "d1"}, worker)
                final = await _drain(worker.results(after=0))
                journaled = await _journaled(worker)
    assert dispositions == ["started", "steered"]
    assert [(r.delivery_id, r.outcome) for r in seen] == [("d0", Outcome.REPLY)]
    assert journaled.carried == {"d1": "d0"}  # the owner's second request carried the steer
    assert final[0] == seen[0]
    got = [(r.delivery_id, r.outcome, r.absorbed_into) for r in final]
    assert got == [("d0", Outcome.REPLY, None), ("d1", Outcome.ABSORBED, "d0")], final
    assert model.request_count == asked


@pytest.mark.parametrize("kind", KINDS)
async def test_power_loss_after_an_answered_step_that_did_not_carry_a_steer(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery of a steer never seen, the minimal case: the owner's tool round is done, its
    reply streams (step 1, asked before the steer arrived) and a second message is steered in
    (its ``AbsorbedInput`` durable, no step yet); the reply is journaled; the power goes
    before the next request. The replay answers step 0 and step 1 from the journal and sends
    the steer again only while step 1 is answered (L10), so step 2 carries it — as it would
    have without the cut — and the steered message ends ``absorbed`` into the owner's reply.
    (Sent right after the prompt, it made the replayed step-1 request differ from the one the
    journal answered: ``recovery_refused:replay``, G13.)"""
    room = ROOMS[0]
    base = tmp_path
    fs = PowerLossFileSystem(_state_dir(base))
    record_response = DeliveryStepJournal.record_response
    responses = 0

    async def cut_after_the_second(
        self: DeliveryStepJournal, digest: str, chunks: list[str]
    ) -> None:
        nonlocal responses
        await record_response(self, digest, chunks)
        responses += 1
        if responses == 2:  # step 1 (the reply) is durable: the power goes now
            fs.cut_after(0)

    monkeypatch.setattr(DeliveryStepJournal, "record_response", cut_after_the_second)
    dispositions: list[str] = []

    async def steer_during_the_reply(worker: RoomWorker) -> None:
        first = await worker.deliver(Message("d0", room, "first").request())
        async for event in worker.events():  # step 1 streams: the turn takes steers
            if isinstance(event, Typing):
                break
        second = await worker.deliver(Message("d1", room, "second").request())
        dispositions.extend([first.disposition, second.disposition])
        await trio.sleep_forever()  # until the next operation is refused

    steps: list[Step] = [
        ToolCalls(calls=[Call(name="effect", arguments={"key": "fx-once"}, id="c1")]),
        Text(text="one two three four", delay=0.3),
        Text(text="for both"),
    ]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            cfg = _config(base, url)
            await _until_the_cut(cfg, base, fs, steer_during_the_reply)
            monkeypatch.undo()
            fs.crash(random.Random(0))
            async with open_room_worker(cfg, base_dir=base, fs=fs) as worker:
                await _wait_for({"d0", "d1"}, worker)
                final = {r.delivery_id: r for r in await _drain(worker.results(after=0))}
                journaled = await _journaled(worker)
    assert dispositions == ["started", "steered"]
    assert model.requests[1].step == steps[1]  # both steps were paid before the cut
    assert model.request_count == 3  # and only step 2 after it
    assert journaled.carried == {"d1": "d0"}
    assert "second" in str(model.requests[2].body["messages"])
    got = (final["d0"].outcome, final["d0"].code, final["d0"].text)
    assert got == (Outcome.REPLY, None, "for both"), final
    assert (final["d1"].outcome, final["d1"].absorbed_into) == (Outcome.ABSORBED, "d0")
    assert [e["key"] for e in _ledger(base / "work" / "effects.jsonl")] == ["fx-once"]


@pytest.mark.parametrize("kind", KINDS)
async def test_power_loss_in_the_own_turn_of_a_steer_the_worker_still_holds(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A steer that arrives after the worker's last steering check, the minimal case: the
    owner's run has ended (``agent_end``) but not settled, so the second message is
    ``steered`` (never carried: it runs as a turn of its own next). The lane takes it back
    from the worker's queue when the owner's turn settles (``clear_queue``), so its own turn
    carries it once; the power goes once that turn's tool round is answered, and the replay
    on a new worker ends with the reply. (Left queued, the worker sent it a second time after
    the tool round, and the replay — on a worker without the stale copy — diverged:
    ``recovery_refused:replay``.) The moment is reached by holding the ``agent_end`` event in
    the runtime's RPC channel until the second message was delivered."""
    room = ROOMS[0]
    base = tmp_path
    fs = PowerLossFileSystem(_state_dir(base))
    hold: list[Callable[[], Awaitable[None]]] = []
    receive = RpcChannel.__anext__

    async def hold_agent_end(self: RpcChannel) -> RpcEvent:
        event = await receive(self)
        if event.type == "agent_end" and hold:
            await hold.pop()()
        return event

    record_response = DeliveryStepJournal.record_response
    responses = 0

    async def cut_after_the_third(
        self: DeliveryStepJournal, digest: str, chunks: list[str]
    ) -> None:
        nonlocal responses
        await record_response(self, digest, chunks)
        responses += 1
        if responses == 3:  # d0's step 0, d1's steps 0 and 1 are durable: the power goes
            fs.cut_after(0)

    monkeypatch.setattr(RpcChannel, "__anext__", hold_agent_end)
    monkeypatch.setattr(DeliveryStepJournal, "record_response", cut_after_the_third)
    dispositions: list[str] = []

    async def steer_after_the_last_check(worker: RoomWorker) -> None:
        async def deliver_second() -> None:
            second = await worker.deliver(Message("d1", room, "#effect=fx-d1").request())
            dispositions.append(second.disposition)

        hold.append(deliver_second)
        first = await worker.deliver(Message("d0", room, "first").request())
        dispositions.insert(0, first.disposition)
        await trio.sleep_forever()  # until the next operation is refused

    steps: list[Step] = [
        Text(text="answer zero"),
        ToolCalls(calls=[Call(name="effect", arguments={"key": "fx-d1"}, id="c1")]),
        Text(text="after the tool"),
    ]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            cfg = _config(base, url)
            await _until_the_cut(cfg, base, fs, steer_after_the_last_check)
            monkeypatch.undo()
            fs.crash(random.Random(0))
            async with open_room_worker(cfg, base_dir=base, fs=fs) as worker:
                await _wait_for({"d0", "d1"}, worker)
                final = {r.delivery_id: r for r in await _drain(worker.results(after=0))}
                journaled = await _journaled(worker)
    assert dispositions == ["started", "steered"]
    assert journaled.unseen == {"d1"}
    second_message = [m for m in model.requests[2].body["messages"] if "m-d1" in str(m)]
    assert len(second_message) == 1  # taken back from the worker: carried once
    got = (final["d1"].outcome, final["d1"].code)
    assert got == (Outcome.REPLY, None), final
    assert [e["key"] for e in _ledger(base / "work" / "effects.jsonl")] == ["fx-d1"]
