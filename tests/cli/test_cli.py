"""The ``pi-runtime`` command line (``runtime/_cli/``, ``runtime/_journal/_inspect.py``); test
names cite ``docs/design/operations.md`` (O1…).

Commands run in-process through ``main(argv)`` (in a thread when the test itself runs Trio,
since ``main`` starts its own Trio run) and, once, as a real ``python -m runtime._cli``
process. State directories are written by the real store, or by a real room worker with
Fake-Pi; every wait is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio

from fake_pi.scenario import Hang, Text
from runtime._cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from runtime._cli import _serve as cli_serve
from runtime._config import ModelConfig, RoomWorkerConfig
from runtime._errors import DeliveryError, ReasonCode
from runtime._journal._store import delivery_key, lane_key, open_store
from runtime._records import Admission, Fingerprints, Outcome, Result
from runtime._rooms._outbox import ResultOutbox
from runtime._rooms._worker import open_room_worker, request_cancel
from runtime._server._admin import serve_admin
from runtime._server._serve import ServeOptions
from runtime._server._token import read_token
from runtime._version import __version__

from .._workers import scripted_upstream

LIMIT: Final = 60.0
ROOM: Final = "dm:100"
OTHER: Final = "guild:g1:c2"


def admission(delivery_id: str, room: str) -> Admission:
    return Admission(
        delivery_id=delivery_id,
        lane=lane_key(room),
        request={
            "delivery_id": delivery_id,
            "room": room,
            "author": {"id": "u1", "name": "Ann"},
            "message_id": f"m-{delivery_id}",
            "text": "hi",
        },
        fingerprints=Fingerprints(request="r", authority="a", settings="s"),
        rendered_prompt="hi",
        admitted_ms=1_000,
    )


async def _populate(state: Path) -> None:
    """d1 (ROOM) answered and acknowledged, d2 (ROOM) answered, d3 (ROOM) and d4 (OTHER)
    pending; d1 and d2 have logs of their own, d3 and d4 do not."""
    async with open_store(state) as store:
        outbox = ResultOutbox(store.results)
        for delivery_id, room in [("d1", ROOM), ("d2", ROOM), ("d3", ROOM), ("d4", OTHER)]:
            await store.admissions.append(admission(delivery_id, room))
        for delivery_id, text in [("d1", "hello there"), ("d2", "again\nand again")]:
            log = await store.create_delivery_log(delivery_id)
            await log.append(admission(delivery_id, ROOM))
            await log.append(Result(outcome=Outcome.REPLY, text=text, finished_ms=2_000))
            await outbox.publish(
                delivery_id=delivery_id, room=ROOM, outcome=Outcome.REPLY, text=text
            )
        await outbox.ack(1)


def populated(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    trio.run(_populate, state)
    return state


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    return {
        str(path.relative_to(root)): (
            path.stat().st_size,
            path.stat().st_mtime_ns,
            path.stat().st_mode,
        )
        for path in sorted(root.rglob("*"))
    }


# ------------------------------------------------------------------------- the parser


COMMANDS: Final = [
    ["version"],
    ["serve"],
    ["status"],
    ["cancel"],
    ["token"],
    ["token", "rotate"],
    ["journal"],
    ["journal", "verify"],
    ["journal", "show"],
    ["pi"],
    ["pi", "install"],
    ["doctor"],
    ["tasks"],
    ["task"],
    ["task", "run"],
    ["task", "show"],
    ["task", "reply"],
    ["task", "resume"],
    ["task", "abort"],
    ["task", "fail"],
    ["task", "grant"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_o11_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pi-runtime {' '.join(command)}")
    description = out.split("\n\n")[1]
    assert len(description.split()) >= 3, description  # says what it does


def test_o11_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("version", "serve", "status", "cancel", "token", "journal", "pi", "doctor",
                 "tasks", "task"):  # fmt: skip
        assert f"    {name} " in out


@pytest.mark.parametrize("argv", [[], ["token"], ["journal"], ["pi"], ["task"]])
def test_o11_a_group_without_its_subcommand_prints_help(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert code == EXIT_USAGE
    assert out == ""
    assert err.startswith("usage: pi-runtime")


def test_o11_version_in_process_and_as_a_real_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["version"], capsys) == (EXIT_OK, f"pi-runtime {__version__}\n", "")
    state = populated(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "runtime._cli", "version"],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=True,
    )
    assert done.stdout == f"pi-runtime {__version__}\n"
    done = subprocess.run(
        [sys.executable, "-m", "runtime._cli", "status", "--state-dir", str(state), "--json"],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=True,
    )
    assert json.loads(done.stdout)["pending"] == 2
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "runtime._cli",
            "--log-json",
            "cancel",
            "d3",
            "--state-dir",
            str(state),
        ],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=False,
    )
    assert done.returncode == EXIT_OK
    assert done.stdout == "d3: no server runs; cancelled at the next start\n"


def test_o11_serve_parses_its_options_and_runs_the_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``serve``'s flags become the configuration and the listen options the server runs
    with (``runtime/_cli/_serve.py``); the server itself is replaced here."""
    seen: list[tuple[RoomWorkerConfig, ServeOptions]] = []

    async def serve_until_signalled(config: RoomWorkerConfig, options: ServeOptions) -> None:
        await trio.lowlevel.checkpoint()
        seen.append((config, options))

    monkeypatch.setattr(cli_serve, "serve_until_signalled", serve_until_signalled)
    state = tmp_path / "state"
    argv = ["serve", "--port", "9001", "--agent", "pi", "--log-json", "--state-dir", str(state)]
    assert main([*argv, "--drain-timeout", "4"]) == EXIT_OK
    ((config, options),) = seen
    assert (options.host, options.port, options.insecure_bind) == ("127.0.0.1", 9001, False)
    assert (options.ssl_context, options.unsafe_test_timescale) == (None, 1.0)
    assert (config.agent, config.state_dir) == ("pi", str(state))
    assert config.thresholds.drain_timeout_seconds == 4.0


def test_o11_serve_refuses_a_non_loopback_bind_without_tls_before_serving(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def serve_until_signalled(config: RoomWorkerConfig, options: ServeOptions) -> None:
        raise AssertionError("served")

    monkeypatch.setattr(cli_serve, "serve_until_signalled", serve_until_signalled)
    assert main(["serve", "--host", "0.0.0.0"]) == EXIT_USAGE
    assert "pi-runtime: config_invalid: host: 0.0.0.0 is not a loopback address" in (
        capsys.readouterr().err
    )


def test_o11_c9_serve_refuses_a_retention_kept_forever_without_a_traceback(
    tmp_path: Path,
) -> None:
    """``idempotency_days = inf`` (TOML's "forever") is refused at start, naming it, exit 2:
    before, ``serve`` took it, wrote a ``retention.json`` no command could read again, and
    its first compaction stopped it with an ``OverflowError`` traceback (config.md C9)."""
    config = tmp_path / "pi-runtime.toml"
    config.write_text(
        'state_dir = "state"\nwork_root = "work"\n'
        "[retention]\nidempotency_days = inf\nforget_days = inf\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "runtime._cli", "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "Traceback" not in done.stderr
    assert "pi-runtime: config_invalid: retention.idempotency_days: " in done.stderr
    assert not (tmp_path / "state").exists()


def test_o11_serve_refuses_a_port_out_of_range_instead_of_another_port(tmp_path: Path) -> None:
    """``--port 70000`` is ``config_invalid: port``, exit 2, and nothing listens: before, the
    resolver took it modulo 65536 and the server listened on port 4464 (O11)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "runtime._cli",
            "serve",
            "--port",
            "70000",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=LIMIT / 4,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "pi-runtime: config_invalid: port: " in done.stderr
    assert "listening" not in done.stdout + done.stderr
    assert not (tmp_path / "state").exists()


# -------------------------------------------------------------------------------- token


@pytest.mark.parametrize("log_json", [[], ["--log-json"]])
def test_o3_token_rotate_prints_the_new_token_once(
    tmp_path: Path, log_json: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    code, out, err = run(["token", "rotate", "--state-dir", str(state), *log_json], capsys)
    assert code == EXIT_OK
    token = read_token(state)
    assert token is not None
    assert out == f"{token}\n"  # the only place it is ever shown
    assert token not in err
    code, out, _ = run(["token", "rotate", "--state-dir", str(state)], capsys)
    assert out.strip() != token
    assert out.strip() == read_token(state)


# ------------------------------------------------------------------------------- status


def test_o9_status_reads_the_state_directory_when_no_server_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = populated(tmp_path)
    before = snapshot(state)
    lock = os.open(state / "LOCK", os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live owner would hold it
        code, out, err = run(["status", "--state-dir", str(state), "--json"], capsys)
    finally:
        os.close(lock)
    assert (code, err) == (EXIT_OK, "")
    status = json.loads(out)
    assert status["source"] == "state_dir"
    assert status["server"] == {"running": False, "pid": None}
    assert status["pending"] == 2
    assert [(p["delivery_id"], p["room"]) for p in status["pending_deliveries"]] == [
        ("d3", ROOM),
        ("d4", OTHER),
    ]
    assert status["rooms"] == [
        {"room": ROOM, "state": "pending", "queued": 1, "live_worker": False, "last_result_seq": 2},
        {
            "room": OTHER,
            "state": "pending",
            "queued": 1,
            "live_worker": False,
            "last_result_seq": 0,
        },
    ]
    assert (status["last_seq"], status["acked_seq"]) == (2, 1)
    assert [
        (r["seq"], r["delivery_id"], r["outcome"], r["acked"]) for r in status["recent_results"]
    ] == [
        (1, "d1", "reply", True),
        (2, "d2", "reply", False),
    ]
    assert status["recent_results"][0]["text"] == "hello there"
    assert snapshot(state) == before  # nothing written, not even the lock file's time

    code, out, _ = run(["status", "--state-dir", str(state)], capsys)
    assert code == EXIT_OK
    assert out.splitlines() == [
        "server: not running; read from the state directory",
        "pending: 2",
        f"  d3  {ROOM}",
        f"  d4  {OTHER}",
        "rooms: 2",
        f"  {ROOM}  pending  queued 1  no worker  last result #2",
        f"  {OTHER}  pending  queued 1  no worker  last result #-",
        "results: last #2, acknowledged up to #1",
        f"  #1  d1  {ROOM}  reply  'hello there'",
        f"  #2  d2  {ROOM}  reply  'again and again'",
    ]


def test_o9_status_of_a_directory_that_is_not_a_state_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["status", "--state-dir", str(tmp_path / "nothing")], capsys)
    assert (code, out) == (EXIT_FAILED, "")
    assert err.startswith("pi-runtime: state_dir_invalid: ")
    assert not (tmp_path / "nothing").exists()


def test_o9_status_of_a_damaged_shared_log_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = populated(tmp_path)
    damage(state / "results.log", 30)
    code, _, err = run(["status", "--state-dir", str(state)], capsys)
    assert code == EXIT_FAILED
    assert "journal_corrupt" in err
    assert "results.log at offset 0" in err


class FakeHandler:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def status(self) -> dict[str, Any]:
        return {
            "worker_id": "w-7",
            "pending": 1,
            "rooms": [
                {
                    "room": ROOM,
                    "state": "running",
                    "queued": 0,
                    "live_worker": True,
                    "last_result_seq": 4,
                }
            ],
        }

    async def cancel(self, delivery_id: str) -> dict[str, Any]:
        if delivery_id != "d3":
            raise DeliveryError(ReasonCode.DELIVERY_UNKNOWN, f"no delivery {delivery_id}")
        self.cancelled.append(delivery_id)
        return {"delivery_id": delivery_id, "state": "cancelling"}


@contextlib.asynccontextmanager
async def admin_server(state: Path, handler: FakeHandler) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_admin, state, handler)
        yield
        nursery.cancel_scope.cancel()


async def in_thread(argv: list[str]) -> int:
    return await trio.to_thread.run_sync(main, argv)


async def test_o9_o12_status_and_cancel_go_through_a_running_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    handler = FakeHandler()
    with trio.fail_after(LIMIT):
        async with admin_server(state, handler):
            assert await in_thread(["status", "--state-dir", str(state), "--json"]) == EXIT_OK
            status = json.loads(capsys.readouterr().out)
            assert status["source"] == "server"
            assert status["worker_id"] == "w-7"
            assert "ok" not in status
            assert await in_thread(["status", "--state-dir", str(state)]) == EXIT_OK
            assert capsys.readouterr().out.splitlines() == [
                "server w-7: running (answered on its admin socket)",
                "pending: 1",
                "rooms: 1",
                f"  {ROOM}  running  queued 0  live worker  last result #4",
            ]
            assert await in_thread(["cancel", "d3", "--state-dir", str(state)]) == EXIT_OK
            assert capsys.readouterr().out == "d3: cancelling\n"
            assert await in_thread(["cancel", "zz", "--state-dir", str(state)]) == EXIT_FAILED
            out, err = capsys.readouterr()
            assert out == ""
            assert err == "pi-runtime: delivery_unknown: no delivery zz\n"
            assert await in_thread(["cancel", "d3", "--state-dir", str(state), "--json"]) == 0
            assert json.loads(capsys.readouterr().out) == {
                "ok": True,
                "delivery_id": "d3",
                "state": "cancelling",
            }
    assert handler.cancelled == ["d3", "d3"]


def test_o12_cancel_without_a_server_records_it_for_the_next_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = populated(tmp_path)
    code, out, _ = run(["cancel", "d3", "--state-dir", str(state)], capsys)
    assert (code, out) == (EXIT_OK, "d3: no server runs; cancelled at the next start\n")
    assert json.loads((state / "cancel-requests.json").read_text()) == ["d3"]
    code, out, _ = run(["cancel", "d2", "--state-dir", str(state), "--json"], capsys)
    assert code == EXIT_OK
    assert json.loads(out) == {
        "ok": True,
        "delivery_id": "d2",
        "state": "finished",
        "source": "state_dir",
    }
    code, out, err = run(["cancel", "nobody", "--state-dir", str(state)], capsys)
    assert (code, out) == (EXIT_FAILED, "")
    assert err.startswith("pi-runtime: delivery_unknown: ")
    assert json.loads((state / "cancel-requests.json").read_text()) == ["d3"]


@pytest.mark.parametrize(
    "argv", [["tasks"], ["task", "show", "t1"], ["journal", "show", "d1"]], ids=" ".join
)
@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_o11_a_read_without_a_server_of_no_state_directory_is_state_dir_invalid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], kind: str
) -> None:
    """O11: with no server, ``tasks``, ``task show`` and ``journal show`` of a directory
    that holds no journal (a typo, a regular file) say ``state_dir_invalid`` — not "(no
    tasks)" with exit 0, nor an ``errno`` without a code — and create nothing."""
    state = tmp_path / "not-a-state"
    if kind == "a file":
        state.write_text("not a directory")
    code, _, err = run([*argv, "--state-dir", str(state)], capsys)
    assert code == EXIT_FAILED
    assert "pi-runtime: state_dir_invalid: " in err
    assert state.exists() is (kind == "a file")


def test_o12_a_cancel_without_a_server_on_no_state_directory_creates_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """O12: with no server, ``cancel`` on a directory that holds no file-store journal (a
    typo, a PostgreSQL host's state directory) is ``state_dir_invalid`` and creates nothing
    there — it used to make a whole empty journal and answer ``delivery_unknown``."""
    typo = tmp_path / "no-such-state"
    code, out, err = run(["cancel", "d1", "--state-dir", str(typo)], capsys)
    assert (code, out) == (EXIT_FAILED, "")
    assert err.startswith("pi-runtime: state_dir_invalid: ")
    assert not typo.exists()


# ------------------------------------------------------------------------------ journal


def damage(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_o10_journal_verify_passes_a_sound_state_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = populated(tmp_path)
    code, out, _ = run(["journal", "verify", "--state-dir", str(state)], capsys)
    assert (code, out) == (EXIT_OK, "checked 4 logs: 0 problems\n")


def test_o10_journal_verify_reports_damage_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = populated(tmp_path)
    d1 = f"deliveries/{delivery_key('d1')}.log"
    d2 = f"deliveries/{delivery_key('d2')}.log"
    damage(state / d1, 30)  # inside the header's frame: a good frame follows
    with (state / d2).open("ab") as f:
        f.write(b"\x00\x01torn")  # a torn tail: a note, not a problem
    code, out, _ = run(["journal", "verify", "--state-dir", str(state)], capsys)
    assert code == EXIT_FAILED
    lines = out.splitlines()
    assert lines[-1] == "checked 4 logs: 1 problem"
    (problem,) = [line for line in lines if line.startswith("problem:")]
    assert problem.startswith(f"problem: {d1}: journal_corrupt: ")
    assert "at offset 0" in problem
    (note,) = [line for line in lines if line.startswith("note:")]
    assert note.startswith(f"note: {d2}: torn tail of 6 bytes")


def test_o10_journal_verify_finds_a_log_under_the_wrong_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = populated(tmp_path)
    d1 = state / f"deliveries/{delivery_key('d1')}.log"
    d1.rename(state / "deliveries" / f"{delivery_key('zz')}.log")
    code, out, _ = run(["journal", "verify", "--state-dir", str(state)], capsys)
    assert code == EXIT_FAILED
    assert "its header names 'd1'" in out


def test_o10_journal_show_prints_a_deliverys_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = populated(tmp_path)
    code, out, err = run(["journal", "show", "d1", "--state-dir", str(state)], capsys)
    assert (code, err) == (EXIT_OK, "")
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["type"] for r in records] == ["header", "admission", "result"]
    assert records[0]["subject"] == "d1"
    assert records[2]["text"] == "hello there"
    # a delivery whose turn never started: its admission from the shared log, and a note
    code, out, err = run(["journal", "show", "d4", "--state-dir", str(state)], capsys)
    assert code == EXIT_OK
    assert [json.loads(line)["type"] for line in out.splitlines()] == ["admission"]
    assert "no log of its own" in err
    code, out, err = run(["journal", "show", "nope", "--state-dir", str(state)], capsys)
    assert (code, out) == (EXIT_FAILED, "")
    assert err.startswith("pi-runtime: delivery_unknown: ")


# ---------------------------------------------------- a state directory of a real worker


async def test_o9_o10_the_state_directory_a_room_worker_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real room worker with Fake-Pi answers d1 and is stopped while d2's turn waits for
    the model: status, journal verify and journal show read what it left."""
    second_request = trio.Event()

    async def on_request(n: int) -> None:
        if n == 2:
            second_request.set()

    with trio.fail_after(LIMIT):
        async with scripted_upstream(
            [Text(text="hello there"), Hang(seconds=60)], on_request=on_request
        ) as (_model, url):
            config = RoomWorkerConfig(agent="fake", model=ModelConfig(base_url=url))
            async with open_room_worker(config, base_dir=tmp_path) as worker:
                message = {"room": ROOM, "author": {"id": "u1", "name": "Ann"}, "text": "hi"}
                await worker.deliver({**message, "delivery_id": "d1", "message_id": "m1"})
                async for result in worker.results():
                    assert result.delivery_id == "d1"
                    break
                await worker.deliver({**message, "delivery_id": "d2", "message_id": "m2"})
                await second_request.wait()
        state = str(tmp_path / "state")
        assert await in_thread(["status", "--state-dir", state, "--json"]) == EXIT_OK
        status = json.loads(capsys.readouterr().out)
        assert status["pending"] == 1
        assert [p["delivery_id"] for p in status["pending_deliveries"]] == ["d2"]
        assert status["rooms"] == [
            {
                "room": ROOM,
                "state": "pending",
                "queued": 1,
                "live_worker": False,
                "last_result_seq": 1,
            }
        ]
        (result,) = status["recent_results"]
        assert (result["delivery_id"], result["outcome"], result["text"], result["acked"]) == (
            "d1",
            "reply",
            "hello there",
            False,
        )
        assert await in_thread(["journal", "verify", "--state-dir", state]) == EXIT_OK
        assert capsys.readouterr().out.endswith(": 0 problems\n")
        assert await in_thread(["journal", "show", "d2", "--state-dir", state]) == EXIT_OK
        types_ = [
            msgspec.json.decode(line)["type"] for line in capsys.readouterr().out.splitlines()
        ]
        assert types_[:2] == ["header", "admission"]
        assert "model_request" in types_
        assert "result" not in types_


async def test_o12_a_cancel_without_a_server_ends_the_delivery_at_the_next_start(
    tmp_path: Path,
) -> None:
    """No server: the cancel is made durable in the state directory; the next start ends the
    delivery ``cancelled`` before anything runs, and a second cancel finds it finished."""
    state = tmp_path / "state"
    await _populate(state)
    with trio.fail_after(LIMIT):
        assert await request_cancel(state, "d3") == "requested"
        with pytest.raises(DeliveryError, match="delivery_unknown"):
            await request_cancel(state, "nobody")
        config = RoomWorkerConfig(state_dir=str(state), work_root=str(tmp_path / "work"))
        async with open_room_worker(config, base_dir=tmp_path) as worker:
            found = {}
            async for result in worker.results():
                found[result.delivery_id] = result
                if {"d3", "d4"} <= found.keys():
                    break
        assert await request_cancel(state, "d3") == "finished"
    assert (found["d3"].outcome, found["d3"].code) == (Outcome.CANCELLED, None)
    assert found["d4"].code == "recovery_refused:grants"  # its fingerprints are made up
