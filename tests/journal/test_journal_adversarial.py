"""Adversarial checks of the file journal's rules (docs/design/journal.md J3-J6, J12-J16):
each test tries to break one of "a process can die at any instant; on restart every admitted
request finishes exactly once", "intent before effect" and "a fault stays in the delivery or
lane where it happened".

The crash tests SIGKILL a real writer process (:data:`_CHILD`) while records it had
acknowledged through the step sync log are owed to their files — the crash between the two
writes of a deferred step: the sync log's frame synced, the delivery's own file not yet
written — and restart in this process, with another configuration.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest
import trio
import trio.testing

from runtime import DiskFailedError, JournalError, ReasonCode, Store, open_store
from runtime._journal._frame import HEADER_SIZE, SECTOR, FrameDamage, encode_frame, scan
from runtime._journal._journal import Journal, decode_log, encode_record, read_log
from runtime._journal._sync_log import SYNC_DIR, generation_name, read_owed
from runtime._linux._fs import OsFileSystem
from runtime._records import SCHEMA_VERSION, Header, LogKind, OutboxAction, Poison, Record
from tests.faultfs import Fault, FaultyFileSystem
from tests.journal.test_sync_log import Holding, _fs

_INTENT: Final = b'{"type":"tool_intent","name":"bash","args":{"command":"rm -rf build"}}'


def _record(name: str) -> Record:
    return OutboxAction(action_id=name, kind="step", state="done")


def _log(*batches: list[bytes]) -> bytes:
    out, seq = b"", 0
    for batch in batches:
        out += encode_frame(seq, batch)
        seq += len(batch)
    return out


# -- the frame: torn tail or damage, and the proof of it ---------------------------------


@pytest.mark.parametrize("records", [1, 2, 4])
def test_j3a_j4_a_flipped_bit_anywhere_but_the_length_of_the_last_frame_is_damage(
    records: int,
) -> None:
    """J3a, J4: every single-bit flip in the last acknowledged frame — header fields the crc
    covers (sequence number, **count**) and body alike — fails closed, at the end of the file
    and before the zeros of a log allocated ahead (J19). A count of 1 (every delivery step)
    or of 2 and 4 (a sync log frame of two or four lanes) is one flipped bit from 0, and a
    zero count was read as a torn write: the last intent vanished and its tool could run
    again. (The length field, which the crc does not cover, is the documented exception.)"""
    good = _log([b"1"], [b"2", b"3"])
    last = encode_frame(3, [_INTENT] * records)
    for position in range(4, len(last)):
        for bit in range(8):
            flipped = bytearray(last)
            flipped[position] ^= 1 << bit
            for after in (b"", bytes(1 << 16)):
                with pytest.raises(FrameDamage) as info:
                    scan(good + bytes(flipped) + after)
                assert info.value.code is ReasonCode.JOURNAL_CORRUPT, (position, bit)
                assert info.value.offset == len(good), (position, bit)


def test_j3a_j4_a_length_flipped_to_zero_in_the_last_frame_is_damage() -> None:
    """J3a, J4: a body of 64 bytes has a length of one set bit; flipped, the length reads 0
    while the rest of the header is whole — no torn write leaves that (its unwritten part is
    zeros from a sector boundary on), so it is damage, not a torn tail."""
    good = _log([b"1"])
    body = b'"' + b"x" * 60 + b'"'
    last = bytearray(encode_frame(1, [body]))
    assert int.from_bytes(last[:4], "little") == 64
    last[0] = 0
    for after in (b"", bytes(1 << 16)):
        with pytest.raises(FrameDamage) as info:
            scan(good + bytes(last) + after)
        assert info.value.code is ReasonCode.JOURNAL_CORRUPT


def test_j4_every_flipped_bit_in_a_middle_frame_fails_closed_at_that_frame() -> None:
    """J4: a middle frame with any one bit flipped — its length too — is damage at its own
    offset, proven by the valid frame after it, whether the file ends there or zeros
    allocated ahead follow (J19); never a torn tail that drops it and what follows."""
    first = encode_frame(0, [b'{"type":"header"}'])
    middle = encode_frame(1, [_INTENT])
    last = encode_frame(2, [b'{"type":"tool_outcome"}'])
    for position in range(len(middle)):
        for bit in range(8):
            flipped = bytearray(middle)
            flipped[position] ^= 1 << bit
            for after in (b"", bytes(4096)):
                with pytest.raises(FrameDamage) as info:
                    scan(first + bytes(flipped) + last + after)
                assert info.value.code is ReasonCode.JOURNAL_CORRUPT, (position, bit)
                assert info.value.offset == len(first), (position, bit)


def test_j3_j19_a_frame_torn_at_every_sector_boundary_is_torn_and_keeps_the_prefix() -> None:
    """J3, J19: the last frame, its header straddling a sector boundary, torn at every byte
    as a disk tears a write — its bytes kept up to a sector boundary of the file, the zeros
    of the space allocated ahead after them, or the file ending at the cut — is a torn tail:
    the frames before it are read whole and nothing more. Torn inside its header, its count
    reads 0 while its length does not: the zero sector after it, not the zero count, is the
    proof (J3a), so a count flipped to 0 in a whole frame stays damage."""
    first = encode_frame(0, [b'{"type":"header"}'])
    pad = SECTOR - 12 - len(first) - HEADER_SIZE - 4  # the last frame begins 12 bytes before
    good = first + encode_frame(1, [b'"' + b"i" * pad + b'"'])  # a sector boundary
    assert len(good) == SECTOR - 12
    last = encode_frame(2, [b'"' + b"z" * 1200 + b'"'])
    zeros = bytes(1 << 16)
    for cut in range(len(last)):
        kept = min(len(last), cut + (-(len(good) + cut)) % SECTOR)
        for torn in (good + last[:cut], good + last[:kept] + zeros):
            if torn.startswith(good + last):
                continue  # the sector held the whole frame: written, not torn
            found = scan(torn)
            assert [f.first_seq for f in found.frames] == [0, 1], cut
            assert found.good_length == len(good), cut
    assert scan(good + last + zeros).next_seq == 3


# -- a fault stays in its log --------------------------------------------------------------


async def _batch_outcomes(
    fs: Holding, store: Store, logs: list[Journal], tag: str
) -> list[int | Exception]:
    """Append ``<tag>-<i>`` to each of ``logs`` as one writer batch (held behind a log of its
    own, as :func:`tests.journal.test_sync_log._one_batch`); each append's number or error."""
    holder = await store.create_delivery_log(f"hold-{tag}")
    fs.hold(holder.rel)
    outcomes: list[int | Exception] = [0] * len(logs)

    async def append(i: int) -> None:
        try:
            outcomes[i] = await logs[i].append(_record(f"{tag}-{i}"))
        except (JournalError, DiskFailedError) as exc:
            outcomes[i] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder.append, _record(f"{tag}-hold"))
        await trio.to_thread.run_sync(fs.held.wait, 10)
        for i in range(len(logs)):
            nursery.start_soon(append, i)
        await trio.testing.wait_all_tasks_blocked()
        fs.release()
    return outcomes


async def test_j15_j5_a_sync_log_sync_that_fails_then_a_lanes_own_sync_poisons_that_lane_alone(
    tmp_path: Path,
) -> None:
    """J15, J5, J6: the sync log's ``fdatasync`` fails once, so each log of the batch takes its
    own path; there the first lane's own ``fdatasync`` fails too. Only that lane is poisoned
    (its append refused, its poison document written); the other lanes' records are
    acknowledged and they go on appending — syncs succeed again — and after a restart the
    poisoned lane reads exactly its acknowledged prefix, the others whole."""
    root = tmp_path / "state"
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    fs = Holding(faulty)
    with trio.fail_after(20):
        async with open_store(root, fs=_fs(fs)) as store:
            logs = [await store.create_delivery_log(f"d{i}") for i in range(3)]
            for i, log in enumerate(logs):
                await log.append(_record(f"a-{i}"))
            faulty.arm(
                [
                    Fault("sync", 1, "after", path_contains=f"/{SYNC_DIR}/"),
                    Fault("sync", 1, "after", path_contains=logs[0].rel),
                ]
            )
            outcomes = await _batch_outcomes(fs, store, logs, "b")
            assert outcomes[1:] == [2, 2], outcomes
            assert isinstance(outcomes[0], DiskFailedError), outcomes
            assert outcomes[0].code is ReasonCode.DISK_FAILED
            assert len(faulty.hits) == 2, faulty.hits
            assert logs[0].poisoned
            assert not any(log.poisoned for log in logs[1:])
            faulty.disarm()
            for i, log in enumerate(logs[1:], start=1):
                assert await log.append(_record(f"c-{i}")) == 3
            with pytest.raises(JournalError) as refused:
                await logs[0].append(_record("c-0"))
            assert refused.value.code is ReasonCode.JOURNAL_POISONED
        assert [p.name for p in (root / "deliveries").glob("*.poison")] == [
            Path(logs[0].rel).name + ".poison"
        ]
        async with open_store(root) as store:
            assert (await store.read(logs[0].rel)).records[1:] == (_record("a-0"),)
            for i, log in enumerate(logs[1:], start=1):
                assert (await store.read(log.rel)).records[1:] == (
                    _record(f"a-{i}"),
                    _record(f"b-{i}"),
                    _record(f"c-{i}"),
                )


async def test_j6_j5_enospc_in_the_middle_of_a_frame_is_disk_full_and_cut_back(
    tmp_path: Path,
) -> None:
    """J6, J5: the disk fills up in the middle of a lane's frame: ``write`` writes part of it
    and returns the short count (as Linux does), the rest fails with ``ENOSPC``. That is a
    full disk (``disk_full``, the poison document naming ``ENOSPC``) — not ``disk_failed``,
    which sends an operator after a broken disk when freeing space would do — and the log is
    cut back to its last acknowledged frame: after a restart it reads exactly that prefix."""
    root = tmp_path / "state"
    faulty = FaultyFileSystem(OsFileSystem(), (), armed=False)
    with trio.fail_after(20):
        async with open_store(root, fs=faulty) as store:
            lane = await store.open_lane_log("lane-full")
            await lane.append(_record("kept"))
            faulty.arm(
                [
                    Fault("write", 1, "short", path_contains=lane.rel),
                    Fault("write", 2, "before", errno.ENOSPC, path_contains=lane.rel),
                ]
            )
            with pytest.raises(DiskFailedError) as failed:
                await lane.append(_record("x" * 4000))
            assert failed.value.code is ReasonCode.DISK_FULL
            assert store.disk_failure is not None
            assert store.disk_failure.code is ReasonCode.DISK_FULL
            faulty.disarm()
        poison = (root / (lane.rel + ".poison")).read_bytes()
        assert json.loads(poison)["errno"] == errno.ENOSPC
        contents = read_log(OsFileSystem(), str(root), lane.rel)
        assert contents.records[1:] == (_record("kept"),)
        assert (root / lane.rel).stat().st_size == contents.good_length


# -- SIGKILL between the sync log's write and the file's ----------------------------------

_CHILD: Final = r"""
import json, os, sys, threading
import trio, trio.testing
from runtime import open_store
from runtime._linux._fs import OsFileSystem
from runtime._records import OutboxAction


class Holding(OsFileSystem):
    # holds the next pwrite to a file whose path contains ``part`` until released
    part = None
    held = threading.Event()
    go = threading.Event()

    def pwrite(self, handle, data, offset):
        part = self.part
        if part is not None and part in os.readlink(f"/proc/self/fd/{handle}"):
            self.part = None
            self.held.set()
            self.go.wait(10)
        return super().pwrite(handle, data, offset)


def record(name):
    return OutboxAction(action_id=name, kind="step", state="done")


def say(**line):
    os.write(1, (json.dumps(line) + "\n").encode())


async def main(root):
    fs = Holding()
    async with open_store(root, fs=fs) as store:
        logs = {name: await store.create_delivery_log(name) for name in ("lane-a", "lane-b")}
        holder = await store.create_delivery_log("holder")
        for name, log in logs.items():  # alone: written to its own file
            say(rel=log.rel, seq=await log.append(record(f"{name}-1")), name=f"{name}-1")
        for step in range(2, 5):  # together: one sync log frame, owed to the files
            fs.held.clear()
            fs.go.clear()
            fs.part = holder.rel

            async def append(name, log):
                seq = await log.append(record(f"{name}-{step}"))
                say(rel=log.rel, seq=seq, name=f"{name}-{step}")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(holder.append, record(f"hold-{step}"))
                await trio.to_thread.run_sync(fs.held.wait, 10)
                for name, log in logs.items():
                    nursery.start_soon(append, name, log)
                await trio.testing.wait_all_tasks_blocked()
                fs.go.set()
        say(ready=True)
        await trio.sleep_forever()


trio.run(main, sys.argv[1])
"""


async def _kill_after_owed_steps(root: Path) -> dict[str, list[tuple[int, str]]]:
    """Run :data:`_CHILD` on ``root`` and SIGKILL it once its lanes' steps 2-4 were
    acknowledged through the sync log; the acknowledged records by log."""
    acked: dict[str, list[tuple[int, str]]] = {}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", _CHILD, str(root)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert process.stdout is not None
        buffer = b""
        while b'"ready"' not in buffer:
            chunk = await process.stdout.receive_some()
            assert chunk, f"the writer ended early: {buffer!r}"
            buffer += chunk
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        assert await process.wait() == -signal.SIGKILL
        if process.stdout is not None:
            await process.stdout.aclose()
    for line in buffer.decode().splitlines():
        event = json.loads(line)
        if "rel" in event:
            acked.setdefault(event["rel"], []).append((event["seq"], event["name"]))
    owed = read_owed(OsFileSystem(), str(root))
    for rel in acked:  # the crash came between the two writes: steps 2-4 are owed
        assert [first for first, _ in owed[rel]] == [2, 3, 4], owed
        assert read_log(OsFileSystem(), str(root), rel).next_seq == 2
    return acked


def _expect(records: tuple[Record, ...], acked: list[tuple[int, str]]) -> None:
    assert [(seq, records[seq]) for seq, _ in acked] == [(s, _record(n)) for s, n in acked]
    assert len(records) == 1 + len(acked)


@pytest.mark.parametrize(("shards", "sync_log"), [(1, False), (3, True)])
async def test_j14_a_kill_with_steps_owed_loses_none_under_another_configuration(
    tmp_path: Path, shards: int, sync_log: bool
) -> None:
    """J14, J2: a writer SIGKILLed while its lanes' steps were durable only in the sync log
    restarts with another number of writer shards, the sync log off or on: the replay
    writes every acknowledged step into its lane's file before anything reads it, and the
    lanes go on appending from the right sequence number."""
    root = tmp_path / "state"
    with trio.fail_after(60):
        acked = await _kill_after_owed_steps(root)
        async with open_store(root, writer_shards=shards, sync_log=sync_log) as store:
            assert store.redone.records == 6
            for name in ("lane-a", "lane-b"):
                rel = Store.delivery_rel(name)
                _expect((await store.read(rel)).records, acked[rel])
                log = await store.open_delivery_log(name)
                assert await log.append(_record("after")) == 5
        assert not os.listdir(root / SYNC_DIR)


async def test_j15_j4_one_lanes_damaged_file_never_costs_the_other_lane_its_owed_steps(
    tmp_path: Path,
) -> None:
    """J15, J4, J14: two lanes' steps share sync log frames; after a SIGKILL one lane's own
    file is damaged (a bit flipped in its header frame). The open still starts, the other
    lane's steps are replayed whole, and the damaged lane fails closed naming its file and
    the offset — the fault stays in the lane where it happened."""
    root = tmp_path / "state"
    with trio.fail_after(60):
        acked = await _kill_after_owed_steps(root)
        damaged, whole = sorted(acked)
        path = root / damaged
        data = bytearray(path.read_bytes())
        data[HEADER_SIZE + 3] ^= 0x10
        path.write_bytes(bytes(data))
        async with open_store(root, writer_shards=2) as store:
            _expect((await store.read(whole)).records, acked[whole])
            with pytest.raises(JournalError) as refused:
                await store.read(damaged)
            assert refused.value.code is ReasonCode.JOURNAL_CORRUPT
            assert refused.value.path == damaged
            assert refused.value.offset == 0


async def test_j3a_j14_a_flipped_count_in_the_sync_logs_last_frame_stops_the_open(
    tmp_path: Path,
) -> None:
    """J3a, J14, J4: the last frame of the sync log, which acknowledged both lanes' last step
    and whose count (2) is one bit from 0, gets that bit flipped after a SIGKILL. It is
    whole and its bytes are no torn write, so the open stops with ``journal_corrupt`` naming
    the generation and the offset; read as a torn tail it would drop both lanes' last
    acknowledged step in silence (an intent forgotten: its tool run again)."""
    root = tmp_path / "state"
    with trio.fail_after(60):
        await _kill_after_owed_steps(root)
        path = root / SYNC_DIR / generation_name(0)
        data = bytearray(path.read_bytes())
        last = scan(bytes(data)).frames[-1]
        assert last.count == 2
        data[last.offset + 16] ^= 0x02
        path.write_bytes(bytes(data))
        with pytest.raises(JournalError) as refused:
            async with open_store(root):
                pass
        assert refused.value.code is ReasonCode.JOURNAL_CORRUPT
        assert refused.value.path == f"{SYNC_DIR}/{generation_name(0)}"
        assert refused.value.offset == last.offset


def test_j5_a_poison_document_bounds_a_log_whose_tail_was_rewritten_after_it() -> None:
    """J5: a second writer rewrote the bytes after a poisoned log's good length — a valid
    frame continuing its sequence. The poison document bounds what is read: none of it is
    taken, only the good length and the records the poison carries."""
    header = encode_frame(
        0,
        [
            encode_record(
                Header(
                    schema_version=SCHEMA_VERSION, kind=LogKind.DELIVERY, subject="d", created_ms=1
                )
            )
        ],
    )
    owed = encode_frame(1, [encode_record(_record("owed"))])
    later = encode_frame(1, [encode_record(_record("written after the poison"))])
    poison = Poison(
        log_path="d.log", good_length=len(header), reason="test", poisoned_ms=1, owed=owed
    )
    contents = decode_log(header + later, rel="d.log", poison=poison)
    assert contents.records[1:] == (_record("owed"),)
