"""Process epochs and whole-tree ownership (``runtime/_pi/_worker.py``,
``runtime/_linux/_proctree.py``).

Invariants W1-W11 are in ``docs/design/workers.md``; each test names the ones it proves.

Everything here runs real processes on the real clock: every wait is bounded by
:func:`trio.fail_after` and waits on a pipe, a pidfd or an exit — never on a sleep. The
process-tree tests use a plain shell script as the "worker" (``worker_helpers/tree.sh``: a
setsid'ed double-forked daemon plus a backgrounded sleep), because the tree machinery must not
depend on Pi; the launch tests use Fake-Pi and the real Pi. Survivors are looked for in
``/proc`` by the epoch nonce, which every descendant inherits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio
import trio.lowlevel

from runtime._cli import main as cli_main
from runtime._errors import ReasonCode, WorkerError, WorkerExitedError
from runtime._linux._proc import ProcessIdentity, boot_id, identity_of, is_alive
from runtime._linux._proctree import (
    EPOCH_ENV,
    cgroup_member,
    is_child_subreaper,
    new_nonce,
    probe_cgroups,
    proc_table,
    remove_cgroup,
    set_child_subreaper,
    settled_environ,
    trio_managed,
)
from runtime._pi import _worker
from runtime._pi._pi_install import PiInstall
from runtime._pi._rpc import open_rpc_channel
from runtime._pi._worker import (
    ENV_ALLOWED,
    QUIET_FLAGS,
    Containment,
    Epoch,
    ModelRoute,
    RetrySettings,
    StopPolicy,
    WorkerKind,
    WorkerLaunch,
    WorkerProgram,
    kill_epoch_leftovers,
    kill_launch_leftovers,
    open_epoch,
    open_worker,
    worker_argv,
    worker_environment,
    write_agent_files,
)
from runtime._records import EpochStarted

from .._descriptors import descriptors_left
from .._pi import real_pi
from .._procs import alive_with_nonce

REPO: Final = Path(__file__).resolve().parents[2]
HELPERS: Final = Path(__file__).with_name("worker_helpers")
TREE: Final = HELPERS / "tree.sh"
HOST: Final = HELPERS / "host.py"
LIMIT: Final = 20.0
"""Bound on any one test's waits (a loaded CI box included)."""
SECRET_NAME: Final = "PI_RUNTIME_TEST_UPSTREAM_API_KEY"
SECRET: Final = "sk-live-do-not-leak-0123456789"
RUNTIME_SET: Final = {
    EPOCH_ENV,
    "HOME",
    "PI_CODING_AGENT_DIR",
    "PI_OFFLINE",
    "PI_TELEMETRY",
    "PI_SKIP_VERSION_CHECK",
    "PWD",
}

CGROUPS = probe_cgroups()
# cgroup v2 is writable on the machines this project runs on (root, hybrid mount): the
# CGROUP cases are never skipped; on a machine without it they fail and say why.
CONTAINMENTS: Final = [Containment.CGROUP, Containment.SUBREAPER, Containment.SCAN]


@pytest.fixture(autouse=True)
def _restore_subreaper() -> Iterator[None]:
    """A subreaper test leaves the pytest process as it found it (other tests look for orphans)."""
    before = is_child_subreaper()
    yield
    if not before:
        set_child_subreaper(False)


# ------------------------------------------------------------------------------ helpers


class Lines:
    """Lines from a byte stream, split on ``b"\\n"`` only."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def line(self) -> bytes:
        while (end := self.buffer.find(b"\n")) < 0:
            data = await self.stream.receive_some(65536)
            if not data:
                raise EOFError(f"stream ended; partial line {bytes(self.buffer)!r}")
            self.buffer += data
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 1]
        return line


def exists(path: str | Path) -> bool:
    return os.path.exists(path)


def proc_file(pid: int, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


async def environ_of(pid: int) -> dict[str, str]:
    """The process's environment, read once its exec has published it: ``tree.sh`` reports
    the daemon's and the background job's pids before they finish exec'ing ``sleep``, and a
    read inside an exec comes back empty."""
    raw = await settled_environ(pid) or b""
    pairs = (item.decode().partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


def tree_env(root: Path, **extra: str) -> dict[str, str]:
    return worker_environment(
        home=root / "home", agent_dir=root / "home" / "agent", cwd=root, extra=extra
    )


def tree_argv(root: Path) -> list[str]:
    return ["sh", str(TREE), str(root)]


async def tree_ready(epoch: Epoch) -> tuple[int, int]:
    """Wait for ``ready <daemon> <background>``; the two pids the worker's "tool" left behind."""
    word, daemon, background = (await Lines(epoch.stdout).line()).split()
    assert word == b"ready"
    return int(daemon), int(background)


async def wait_exited(pid: int) -> None:
    """Wait until ``pid`` has exited, without reaping it (its pidfd polls readable)."""
    fd = os.pidfd_open(pid)
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


def identities(pids: list[int]) -> list[ProcessIdentity]:
    found = [identity_of(pid) for pid in pids]
    assert all(found), pids
    return [identity for identity in found if identity is not None]


def pi_install() -> PiInstall:
    return real_pi()  # fails loudly when Pi cannot be installed: never skipped


def launch_for(root: Path, program: WorkerProgram, **changes: Any) -> WorkerLaunch:
    for directory in ("work", "home", "tmp", "state"):
        (root / directory).mkdir(exist_ok=True)
    launch = WorkerLaunch(
        program=program,
        cwd=root / "work",
        home=root / "home",
        agent_dir=root / "home" / "agent",
        tmp_dir=root / "tmp",
        session=root / "lane.jsonl",
        route=ModelRoute(provider="fake", model="fake-model", base_url="http://127.0.0.1:9/v1"),
        persona="Answer tersely.",
        retry=RetrySettings(max_retries=2, base_delay_ms=20),
        state_dir=root / "state",
    )
    return dataclasses.replace(launch, **changes)


# --------------------------------------------------------------------------- launching


@pytest.mark.parametrize("kind", [WorkerKind.FAKE_PI, WorkerKind.PI])
async def test_worker_launch_reads_identity_and_nonce_back(
    tmp_path: Path, kind: WorkerKind, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W1, W8, W9: Fake-Pi and the real Pi, launched the same way, answer RPC; the epoch's
    identity (pid, start time, boot id) and nonce are read back from /proc; the record keeps
    them; the secret in the runtime's environment never reaches the worker; stop leaves nothing.
    """
    monkeypatch.setenv(SECRET_NAME, SECRET)
    program = WorkerProgram.pi(pi_install()) if kind is WorkerKind.PI else WorkerProgram.fake_pi()
    launch = launch_for(tmp_path, program)
    with trio.fail_after(LIMIT):
        async with open_worker(launch) as epoch:
            await epoch.stdin.send_all(b'{"type":"get_state","id":"s1"}\n')
            reply = json.loads(await Lines(epoch.stdout).line())
            assert reply["id"] == "s1"
            assert reply["success"] is True, reply
            assert reply["data"]["model"]["id"] == "fake-model"

            assert epoch.identity == identity_of(epoch.pid)
            assert epoch.identity.boot_id == boot_id()
            environ = await environ_of(epoch.pid)
            assert environ[EPOCH_ENV] == epoch.nonce
            assert SECRET_NAME not in environ
            assert SECRET not in "".join(environ.values())
            assert environ["HOME"] == str(launch.home)
            assert environ["PI_CODING_AGENT_DIR"] == str(launch.agent_dir)
            assert environ["PI_OFFLINE"] == "1"
            assert environ["PI_TELEMETRY"] == "0"
            if kind is WorkerKind.FAKE_PI:  # Pi renames its process title to "pi"
                assert proc_file(epoch.pid, "cmdline").split(b"\0")[:-1] == [
                    arg.encode() for arg in worker_argv(launch)
                ]
            assert os.readlink(f"/proc/{epoch.pid}/cwd") == str(launch.cwd)
            if epoch.containment is Containment.CGROUP:
                assert epoch.cgroup is not None
                assert cgroup_member(epoch.pid, epoch.cgroup)

            record = epoch.record(3, started_ms=1234)
            decoded = msgspec.json.decode(msgspec.json.encode(record), type=EpochStarted)
            assert decoded == record
            assert (record.pid, record.start_time, record.boot_id, record.nonce) == (
                epoch.pid,
                epoch.identity.start_time,
                boot_id(),
                epoch.nonce,
            )
            assert record.cgroup == (None if epoch.cgroup is None else str(epoch.cgroup))
            tree = await epoch.members()
        report = await epoch.stop()
    assert report.clean
    assert report.graceful
    assert not any(is_alive(member) for member in tree)
    assert alive_with_nonce(epoch.nonce) == []
    if epoch.cgroup is not None:
        assert not exists(epoch.cgroup)


def test_pi_and_fake_pi_get_the_same_launch(tmp_path: Path) -> None:
    """W9: one command line for both, bar the program and Pi's own --no-approve."""
    pi = PiInstall(home=tmp_path, node=tmp_path / "node", cli=tmp_path / "cli.js", version="1.6.0")
    fake = launch_for(tmp_path, WorkerProgram.fake_pi())
    real = dataclasses.replace(fake, program=WorkerProgram.pi(pi))
    fake_args = worker_argv(fake)[len(fake.program.command) :]
    real_args = worker_argv(real)[len(real.program.command) :]
    assert worker_argv(real)[:2] == [str(pi.node), str(pi.cli)]
    assert worker_argv(fake)[1:3] == ["-m", "fake_pi"]
    assert [arg for arg in real_args if arg != "--no-approve"] == fake_args
    assert fake_args == [
        "--mode",
        "rpc",
        *QUIET_FLAGS,
        "--provider",
        "fake",
        "--model",
        "fake-model",
        "--session",
        str(tmp_path / "lane.jsonl"),
        "--append-system-prompt",
        "Answer tersely.",
    ]
    assert "--no-session" in worker_argv(dataclasses.replace(fake, session=None))


def test_agent_files_are_written_with_explicit_retry(tmp_path: Path) -> None:
    """W9: models.json names the route; settings.json always carries retry and no telemetry."""
    launch = launch_for(tmp_path, WorkerProgram.fake_pi(), settings={"httpIdleTimeoutMs": 1})
    write_agent_files(launch)
    settings = json.loads((launch.agent_dir / "settings.json").read_text())
    assert settings == {
        "httpIdleTimeoutMs": 1,
        "retry": {
            "enabled": True,
            "maxRetries": 2,
            "baseDelayMs": 20,
            "maxAgentDelayMs": 60000,
            "provider": {"maxRetries": 0},
        },
        "enableInstallTelemetry": False,
    }
    provider = json.loads((launch.agent_dir / "models.json").read_text())["providers"]["fake"]
    assert provider["baseUrl"] == "http://127.0.0.1:9/v1"
    assert [model["id"] for model in provider["models"]] == ["fake-model"]
    assert (launch.agent_dir / "settings.json").stat().st_mode & 0o777 == 0o600
    assert launch.agent_dir.stat().st_mode & 0o777 == 0o700


async def test_environment_is_allow_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W8: neither the worker nor the daemon its tool left behind sees the runtime's secrets;
    only allow-listed names, the runtime's own and explicit extras get through."""
    monkeypatch.setenv(SECRET_NAME, SECRET)
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    env = tree_env(tmp_path, FAKE_PI_CONFIG="/dev/null")
    assert SECRET_NAME not in env
    assert env["LC_ALL"] == "C.UTF-8"
    with trio.fail_after(LIMIT):
        async with open_epoch(tree_argv(tmp_path), env=env, cwd=tmp_path) as epoch:
            daemon, background = await tree_ready(epoch)
            for pid in (epoch.pid, daemon, background):
                seen = await environ_of(pid)
                assert SECRET_NAME not in seen, pid
                assert seen[EPOCH_ENV] == epoch.nonce
                assert seen["HOME"] == str(tmp_path / "home")
                extra = {
                    name
                    for name in seen
                    if name not in ENV_ALLOWED and name not in RUNTIME_SET
                    if not name.startswith("LC_")
                }
                assert extra == {"FAKE_PI_CONFIG"}, seen


@pytest.mark.parametrize("name", sorted(RUNTIME_SET))
def test_extras_cannot_replace_what_the_runtime_sets(tmp_path: Path, name: str) -> None:
    """W8: HOME, the agent dir, Pi's offline switches and the nonce are not for extras."""
    with pytest.raises(WorkerError) as caught:
        tree_env(tmp_path, **{name: "x"})
    assert caught.value.code is ReasonCode.WORKER_CONFIG_INVALID


async def test_launch_problems_are_typed(tmp_path: Path) -> None:
    """W2, W10: launch errors carry worker_* reason codes (never a group) and leave no cgroup."""
    env = tree_env(tmp_path)
    with pytest.raises(WorkerError) as caught:
        async with open_epoch(["no-such-worker-program"], env=env, cwd=tmp_path):
            pass  # pragma: no cover
    assert caught.value.code is ReasonCode.WORKER_NOT_FOUND

    nonce = new_nonce()
    with pytest.raises(WorkerError) as caught:
        async with open_epoch(["sh", "-c", ":"], env=env, cwd=tmp_path / "gone", nonce=nonce):
            pass  # pragma: no cover
    assert caught.value.code is ReasonCode.WORKER_LAUNCH_FAILED
    if CGROUPS.parent is not None:
        assert not exists(CGROUPS.parent / nonce)

    inside = launch_for(tmp_path, WorkerProgram.fake_pi(), home=tmp_path / "state" / "home")
    with pytest.raises(WorkerError) as caught:
        async with open_worker(inside):
            pass  # pragma: no cover
    assert caught.value.code is ReasonCode.WORKER_CONFIG_INVALID

    (tmp_path / "work" / "persona.md").write_text("x")
    named = launch_for(tmp_path, WorkerProgram.fake_pi(), persona="persona.md")
    with pytest.raises(WorkerError) as caught:
        async with open_worker(named):
            pass  # pragma: no cover
    assert caught.value.code is ReasonCode.WORKER_CONFIG_INVALID


@pytest.mark.parametrize(
    "persona",
    [
        pytest.param("Answer tersely, in the language of the room. " * 6, id="a-long-line"),
        pytest.param("Keep answers short/plain. " * 200, id="longer-than-a-path"),
    ],
)
async def test_w9_a_persona_that_can_name_no_file_is_launched(tmp_path: Path, persona: str) -> None:
    """W9: a persona that names an existing file is refused (Pi would read the file), and the
    check asks what Pi asks, ``existsSync``: false for a text no file can have as its name —
    a line over 255 bytes, a text over 4095. Before, the check's ``Path.exists()`` raised
    ``OSError`` (``File name too long``) for such a text: every launch of a lane with an
    ordinary paragraph of persona failed, and not with a ``worker_*`` code."""
    launch = launch_for(tmp_path, WorkerProgram.fake_pi(), persona=persona)
    with trio.fail_after(LIMIT):
        async with (
            open_worker(launch) as epoch,
            open_rpc_channel(epoch.stdin, epoch.stdout, stderr=epoch.stderr_tail) as channel,
        ):
            assert (await channel.request({"type": "get_state"})).success
    argv = worker_argv(launch)
    assert argv[argv.index("--append-system-prompt") + 1] == persona


async def test_w12_a_launch_fenced_while_its_cgroup_is_made_leaves_no_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W12: a fence that lands while the epoch's cgroup is being made (in a thread, so the
    cancellation waits for it) stops the launch before the worker starts, and the new cgroup
    goes with it. Before, it stayed: the sweep runs once per process, so a host that lives
    on kept every such cgroup until its next start."""
    assert CGROUPS.parent is not None
    nonce = new_nonce()
    choose = _worker._choose
    with trio.fail_after(LIMIT), trio.CancelScope() as fence:

        def fenced_meanwhile(containment: Containment | None, chosen: str) -> Any:
            made = choose(containment, chosen)
            trio.from_thread.run_sync(fence.cancel)
            return made

        monkeypatch.setattr(_worker, "_choose", fenced_meanwhile)
        async with open_epoch(
            ["sleep", "30"],
            env=tree_env(tmp_path),
            cwd=tmp_path,
            containment=Containment.CGROUP,
            nonce=nonce,
        ):
            pass  # pragma: no cover
    assert fence.cancelled_caught
    leaked = CGROUPS.parent / nonce
    try:
        assert not exists(leaked)
    finally:
        if exists(leaked):
            leaked.rmdir()


async def test_w6_a_failed_launch_whose_stop_left_a_survivor_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W6, W10: a launch whose proof fails is stopped like any epoch; when that stop leaves
    a survivor, the launch raises ``worker_tree_survived`` (from the launch's error), so a
    caller never takes ``worker_launch_failed`` for "nothing of it is alive" (TL12)."""
    from runtime._pi import _worker

    async def unproven(epoch: Epoch) -> None:
        raise WorkerError(ReasonCode.WORKER_LAUNCH_FAILED, "the worker exited during launch")

    stop = Epoch._stop

    async def survived(epoch: Epoch) -> Any:
        report = await stop(epoch)  # the real stop: nothing is left behind by the test
        kill = dataclasses.replace(report.kill, survivors=(4242,))
        return dataclasses.replace(report, kill=kill)

    monkeypatch.setattr(_worker, "_prove", unproven)
    monkeypatch.setattr(Epoch, "_stop", survived)
    with trio.fail_after(LIMIT), pytest.raises(WorkerError) as caught:
        async with open_epoch(["sleep", "30"], env=tree_env(tmp_path), cwd=tmp_path):
            pass  # pragma: no cover
    assert caught.value.code is ReasonCode.WORKER_TREE_SURVIVED
    assert "4242" in str(caught.value)
    assert isinstance(caught.value.__cause__, WorkerError)
    assert caught.value.__cause__.code is ReasonCode.WORKER_LAUNCH_FAILED


def test_w2_l21_a_cgroup_probe_out_of_descriptors_is_no_answer() -> None:
    """W2, L21: the host's first look for a cgroup v2 mount (``/proc/self/mounts``) meets the
    kernel's own ``EMFILE``. Tries to break: "no cgroup2 mount" taken as the answer — and
    cached for the life of the process, so every later worker is contained less (by the
    subreaper) on a host whose cgroups work. Expected: the look is refused
    (``too_many_open_files``, the launch waits and tries again), nothing is cached, and once
    descriptors are free the epoch gets its cgroup."""
    assert CGROUPS.usable, CGROUPS.reason
    probe_cgroups.cache_clear()
    try:
        with descriptors_left(0), pytest.raises(WorkerError) as refused:
            _worker._choose(None, new_nonce())
        assert refused.value.code is ReasonCode.TOO_MANY_OPEN_FILES, refused.value
        mode, cgroup = _worker._choose(None, new_nonce())
        assert cgroup is not None
        remove_cgroup(cgroup)
        assert mode is Containment.CGROUP
    finally:
        probe_cgroups.cache_clear()
        probe_cgroups()


@pytest.mark.parametrize("stop", ["clean", "survivor"])
async def test_w6_l21_a_launch_whose_proof_wants_a_descriptor_is_stopped_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    """W6, W10, L21: the read of a new worker's environment (its nonce, the launch's proof)
    finds no file descriptor (``EMFILE``, injected: the process's own exhaustion cannot
    reach that read, the spawn having just freed its pipes' far ends). Tries to break: the
    raw ``OSError`` raised out of the launch without the stop's verdict, so a stop that left
    a survivor reads as "nothing launched, try again" (two trees). Expected: the launch's
    epoch is stopped; a clean stop makes it ``too_many_open_files`` (nothing of it alive:
    the caller waits and launches again), one that left a survivor ``worker_tree_survived``."""
    from runtime._pi import _worker

    def wanting(pid: int) -> bytes | None:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), f"/proc/{pid}/environ")

    real_stop = Epoch._stop

    async def survived(epoch: Epoch) -> Any:
        report = await real_stop(epoch)  # the real stop: nothing is left behind by the test
        return dataclasses.replace(report, kill=dataclasses.replace(report.kill, survivors=(4242,)))

    monkeypatch.setattr(_worker, "read_environ", wanting)
    if stop == "survivor":
        monkeypatch.setattr(Epoch, "_stop", survived)
    with trio.fail_after(LIMIT), pytest.raises(WorkerError) as caught:
        async with open_epoch(["sleep", "30"], env=tree_env(tmp_path), cwd=tmp_path):
            pass  # pragma: no cover
    if stop == "clean":
        assert caught.value.code is ReasonCode.TOO_MANY_OPEN_FILES, caught.value
    else:
        assert caught.value.code is ReasonCode.WORKER_TREE_SURVIVED, caught.value
        assert "4242" in str(caught.value)


# --------------------------------------------------------------------------- the tree


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_stop_leaves_no_descendant(tmp_path: Path, containment: Containment) -> None:
    """W2, W3, W6: a daemonised (setsid, double-forked) grandchild and a background job are
    part of the tree, and stop leaves none of them alive — with a cgroup and without one."""
    with trio.fail_after(LIMIT):
        async with open_epoch(
            tree_argv(tmp_path), env=tree_env(tmp_path), cwd=tmp_path, containment=containment
        ) as epoch:
            assert epoch.containment is containment
            daemon, background = await tree_ready(epoch)
            tree = await epoch.members()
            assert {epoch.pid, daemon, background} <= {member.pid for member in tree}
            if containment is Containment.CGROUP:
                assert epoch.cgroup is not None
                assert all(cgroup_member(pid, epoch.cgroup) for pid in (daemon, background))
            else:
                assert epoch.cgroup is None
                assert is_child_subreaper() is (containment is Containment.SUBREAPER)
            report = await epoch.stop()
    assert report.clean, report
    assert report.graceful
    assert report.exit_status == -signal.SIGTERM
    assert not any(is_alive(member) for member in tree)
    assert alive_with_nonce(epoch.nonce) == []
    if epoch.cgroup is not None:
        assert not exists(epoch.cgroup)


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_w6_l21_a_stop_out_of_descriptors_reports_what_it_knows(
    tmp_path: Path, containment: Containment
) -> None:
    """W6, L21: a tree is stopped while the process has no file descriptor left, for each
    number of free descriptors from 0 to 5 (the kernel's own ``EMFILE``): the scans of
    ``/proc``, the pidfds and the reads of each process's identity all want one. Tries to
    break: a stop that raises a raw ``OSError`` (stop is bounded and returns a report, never
    an exception), or one that reports clean while a member of the tree lives (a process
    whose ``/proc`` could not be read taken for one that is gone). Expected: each stop
    returns a report; it is clean only when nothing of the tree is alive, and one that is
    not ends the block ``worker_tree_survived``, as any unproven stop does."""
    policy = StopPolicy(term_grace=1.0, kill_bound=0.5)
    for left in range(6):
        survived: WorkerError | None = None
        with trio.fail_after(LIMIT):
            try:
                async with open_epoch(
                    tree_argv(tmp_path),
                    env=tree_env(tmp_path),
                    cwd=tmp_path,
                    containment=containment,
                    policy=policy,
                ) as epoch:
                    await tree_ready(epoch)
                    tree = await epoch.members()
                    with descriptors_left(left):
                        report = await epoch.stop()
            except WorkerError as error:
                survived = error
        alive = [member.pid for member in tree if is_alive(member)] + alive_with_nonce(epoch.nonce)
        for pid in alive:  # (what an unproven stop left, stopped by the test)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not (report.clean and alive), (left, report, alive)
        assert (survived is None) is report.clean, (left, report, survived)
        assert survived is None or survived.code is ReasonCode.WORKER_TREE_SURVIVED, survived


NESTED_CGROUP: Final = """
set -e
inner="$CGROUP_MOUNT$(sed -n 's/^0:://p' /proc/self/cgroup)/inner"
mkdir "$inner"
fifo="$1/daemon.fifo"
rm -f "$fifo"
mkfifo "$fifo"
(setsid env -i sh -c 'echo $$ > "$1/cgroup.procs"; echo $$ > "$0"; exec sleep 300' \
    "$fifo" "$inner" </dev/null >/dev/null 2>&1 &)
read -r daemon < "$fifo"
echo "ready $daemon"
exec sleep 300
"""
"""A worker whose tool makes a cgroup inside the epoch's own and leaves there a daemon that
carries no nonce (``env -i``) and is orphaned (setsid, double fork): only the cgroup holds it."""


async def test_w2_w6_a_cgroup_the_tree_made_inside_its_own_is_killed_and_removed(
    tmp_path: Path,
) -> None:
    """W2, W6: a process in a cgroup the tree made below the epoch's is a member (the
    kernel's ``cgroup.kill`` kills it with the rest), and stop removes that cgroup too, so
    the stop is clean. Before, the member was not seen, and the epoch's cgroup could never
    be removed (the kernel refuses to remove a cgroup with a child): every stop reported
    ``worker_tree_survived`` with no survivor, and the cgroup stayed for good."""
    assert CGROUPS.mount is not None
    env = tree_env(tmp_path, CGROUP_MOUNT=str(CGROUPS.mount))
    daemon: ProcessIdentity | None = None
    cgroup: Path | None = None
    try:
        with trio.fail_after(LIMIT):
            async with open_epoch(
                ["sh", "-c", NESTED_CGROUP, str(tmp_path)],
                env=env,
                cwd=tmp_path,
                containment=Containment.CGROUP,
            ) as epoch:
                cgroup = epoch.cgroup
                word, pid = (await Lines(epoch.stdout).line()).split()
                assert word == b"ready"
                daemon = identity_of(int(pid))
                assert daemon is not None
                assert EPOCH_ENV.encode() not in (await settled_environ(daemon.pid) or b"")
                assert daemon in await epoch.members()
                report = await epoch.stop()
        assert report.clean, report
        assert not is_alive(daemon)
        assert cgroup is not None
        assert not exists(cgroup)
    finally:  # a failed test must not leave its daemon or its cgroups behind
        if daemon is not None and is_alive(daemon):
            os.kill(daemon.pid, signal.SIGKILL)
            with trio.fail_after(LIMIT):
                await wait_exited(daemon.pid)
        if cgroup is not None and exists(cgroup / "inner"):
            (cgroup / "inner").rmdir()
            cgroup.rmdir()


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_a_fence_is_a_cancellation(tmp_path: Path, containment: Containment) -> None:
    """W6, W10: cancelling the epoch's scope stops the whole tree before the block is left."""
    with trio.fail_after(LIMIT), trio.CancelScope() as fence:
        async with open_epoch(
            tree_argv(tmp_path), env=tree_env(tmp_path), cwd=tmp_path, containment=containment
        ) as epoch:
            await tree_ready(epoch)
            tree = await epoch.members()
            fence.cancel()
            await trio.sleep_forever()
    assert fence.cancelled_caught
    assert len(tree) == 3
    assert not any(is_alive(member) for member in tree)
    assert alive_with_nonce(epoch.nonce) == []


HOLDS_STDOUT: Final = (
    "sleep 300 & "  # a descendant that inherited the worker's stdout, and outlives it
    "read -r line; "
    'echo \'{"id":"rpc-1","type":"response","command":"get_state","success":true}\'; '
    "echo 'worker: gone' >&2; exit 3"
)
"""A stand-in worker: answers one command, then exits while a background job it started
still holds its stdout open (a tool's daemon, an extension's helper with inherited stdio)."""


async def test_w14_a_dead_workers_stdout_ends_though_a_descendant_holds_it(
    tmp_path: Path,
) -> None:
    """W14, R5: the worker answers, then exits; a background job it started still holds the
    write end of its stdout. Before, the RPC channel never saw the end: a run's events were
    waited for until something stopped the epoch (a room turn's 300 s backstop, a task's
    hard threshold), where a worker's death is a replay at once. Now what the worker wrote
    is read, then its stdout ends ``exit_linger`` after the exit and the channel says
    ``worker_exited``, quoting its stderr."""
    policy = StopPolicy(exit_linger=0.2)
    env = tree_env(tmp_path)
    with trio.fail_after(LIMIT):
        async with (
            open_epoch(["sh", "-c", HOLDS_STDOUT], env=env, cwd=tmp_path, policy=policy) as epoch,
            open_rpc_channel(epoch.stdin, epoch.stdout, stderr=epoch.stderr_tail) as channel,
        ):
            assert (await channel.request({"type": "get_state"})).success
            holder = next(m for m in await epoch.members() if m.pid != epoch.pid)
            assert await epoch.wait() == 3
            assert is_alive(holder)
            with pytest.raises(WorkerExitedError) as ended:
                await channel.next_event()
            assert b"worker: gone" in ended.value.stderr
            report = await epoch.stop()
    assert report.clean
    assert not is_alive(holder)


WRITES_THEN_EXITS: Final = (
    "sleep 300 & "  # a descendant holding the worker's stdout, as above
    "read -r line; "  # launched and proved: then its last words, and exit
    'i=0; while [ $i -lt 200 ]; do echo "line $i of the worker\'s last words"; i=$((i+1)); done; '
    "exit 0"
)


async def test_w14_a_dead_workers_last_words_are_never_cut_off_by_the_linger(
    tmp_path: Path,
) -> None:
    """W14's other side: stdout ends ``exit_linger`` after the exit only once the reader has
    taken what the worker wrote. Here the reader comes late (a loop busy past the linger:
    it starts reading three lingers after the exit), and still reads every line the worker
    wrote before the end of stream. Closing at the linger alone dropped them unread."""
    policy = StopPolicy(exit_linger=0.1)
    env = tree_env(tmp_path)
    with trio.fail_after(LIMIT):
        async with open_epoch(
            ["sh", "-c", WRITES_THEN_EXITS], env=env, cwd=tmp_path, policy=policy
        ) as epoch:
            await epoch.stdin.send_all(b"go\n")  # once launched: speak, and exit
            assert await epoch.wait() == 0
            await trio.sleep(3 * policy.exit_linger)  # the late reader: the fault injected
            data = bytearray()
            with contextlib.suppress(trio.ClosedResourceError):
                while chunk := await epoch.stdout.receive_some():
                    data += chunk
            await epoch.stop()
    lines = data.decode().splitlines()
    assert lines == [f"line {i} of the worker's last words" for i in range(200)]


async def test_term_ignoring_worker_is_killed_after_the_bound(tmp_path: Path) -> None:
    """W6: SIGTERM, a bounded wait, then SIGKILL for the whole tree."""
    policy = StopPolicy(term_grace=0.3, kill_bound=5.0)
    env = tree_env(tmp_path, TREE_MODE="ignore_term")
    with trio.fail_after(LIMIT):
        async with open_epoch(tree_argv(tmp_path), env=env, cwd=tmp_path, policy=policy) as epoch:
            await tree_ready(epoch)
            tree = await epoch.members()
            started = trio.current_time()
            report = await epoch.stop()
            waited = trio.current_time() - started
    assert not report.graceful
    assert report.exit_status == -signal.SIGKILL
    assert policy.term_grace <= waited < policy.term_grace + policy.kill_bound
    assert report.clean
    assert not any(is_alive(member) for member in tree)


async def test_trio_keeps_exit_statuses_while_adopted_orphans_are_reaped(tmp_path: Path) -> None:
    """W4: as subreaper the runtime reaps the orphans it adopted from the tree, and only them:
    Trio still gets the worker's own status and an unrelated child's (no waitpid(-1))."""
    bystander = await trio.lowlevel.open_process(
        ["sh", "-c", "read line; exit 9"], stdin=subprocess.PIPE
    )
    env = tree_env(tmp_path, TREE_MODE="exit7")
    with trio.fail_after(LIMIT):
        async with open_epoch(
            tree_argv(tmp_path), env=env, cwd=tmp_path, containment=Containment.SUBREAPER
        ) as epoch:
            daemon, background = await tree_ready(epoch)
            assert bystander.stdin is not None
            await bystander.stdin.aclose()
            await wait_exited(bystander.pid)  # a zombie child of ours, not the epoch's
            await epoch.stdin.send_all(b"exit now\n")
            assert await epoch.wait() == 7
            adopted = {pid for pid, info in proc_table().items() if info.ppid == os.getpid()}
            assert {daemon, background} <= adopted
            report = await epoch.stop()
        assert report.exit_status == 7
        assert report.graceful
        assert set(report.kill.reaped) == {daemon, background}
        assert bystander.pid not in report.kill.reaped
        assert await bystander.wait() == 9


# ------------------------------------------------------------------------------ takeover


@pytest.mark.parametrize("by", ["record", "nonce"])
@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_a_new_host_kills_the_tree_of_a_sigkilled_one(
    tmp_path: Path, containment: Containment, by: str
) -> None:
    """W7: the host is SIGKILLed with its worker tree running; another process kills the whole
    old tree from the epoch record alone — with a cgroup and without one. W13: or from the
    nonce alone, as journaled before the launch (the cgroup found by its name)."""
    record_path = tmp_path / "epoch.json"
    host = await trio.lowlevel.open_process(
        [sys.executable, str(HOST), str(record_path), str(tmp_path), str(containment)],
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    nonce = None
    try:
        with trio.fail_after(LIMIT):
            assert host.stdout is not None
            _, daemon, background = (await Lines(host.stdout).line()).split()
            record = msgspec.json.decode(record_path.read_bytes(), type=EpochStarted)
            nonce = record.nonce
            assert (record.cgroup is not None) is (containment is Containment.CGROUP)
            host.kill()
            assert await host.wait() == -signal.SIGKILL
            # the old tree outlived its host ...
            orphans = set(alive_with_nonce(record.nonce))
            assert {record.pid, int(daemon), int(background)} <= orphans
            tree = identities(sorted(orphans))

            if by == "record":
                report = await kill_epoch_leftovers(record)
            else:
                report = await kill_launch_leftovers(record.nonce)
    finally:
        if host.returncode is None:  # pragma: no cover - only when the test failed early
            host.kill()
        if nonce is not None:  # a failed test must not leave its tree behind
            for pid in alive_with_nonce(nonce):
                os.kill(pid, signal.SIGKILL)
    # ... and nothing of it survives the new host
    assert report.clean, report
    assert not any(is_alive(member) for member in tree)
    assert alive_with_nonce(record.nonce) == []
    if record.cgroup is not None:
        assert report.cgroup_killed
        assert not exists(record.cgroup)


async def test_identity_mismatch_is_never_killed() -> None:
    """W5: a recorded pid whose start time or boot id does not match is left alone; the same pid
    with a matching identity, or any process proven by the nonce, is killed."""
    bystander = await trio.lowlevel.open_process(["sleep", "300"])
    nonce = new_nonce()
    carrier = await trio.lowlevel.open_process(
        ["sleep", "300"], env={"PATH": os.environ["PATH"], EPOCH_ENV: nonce}
    )
    with trio_managed(bystander.pid), trio_managed(carrier.pid), trio.fail_after(LIMIT):
        try:
            real = identity_of(bystander.pid)
            assert real is not None
            for start_time, boot in ((real.start_time - 1, real.boot_id), (real.start_time, "0")):
                record = EpochStarted(
                    epoch=1,
                    pid=real.pid,
                    start_time=start_time,
                    boot_id=boot,
                    nonce=new_nonce(),
                    started_ms=0,
                )
                report = await kill_epoch_leftovers(record)
                assert report.killed == ()
                assert report.clean
                assert is_alive(real)

            # reused pid, but the process carries the record's nonce: proven, killed
            carried = identity_of(carrier.pid)
            assert carried is not None
            record = EpochStarted(
                epoch=1,
                pid=carrier.pid,
                start_time=carried.start_time + 1,
                boot_id=carried.boot_id,
                nonce=nonce,
                started_ms=0,
            )
            assert (await kill_epoch_leftovers(record)).killed == (carrier.pid,)
            assert await carrier.wait() == -signal.SIGKILL

            # the exact recorded identity: killed (and left for Trio to reap)
            record = EpochStarted(
                epoch=1,
                pid=real.pid,
                start_time=real.start_time,
                boot_id=real.boot_id,
                nonce=new_nonce(),
                started_ms=0,
            )
            assert (await kill_epoch_leftovers(record)).killed == (real.pid,)
            assert await bystander.wait() == -signal.SIGKILL
        finally:
            for process in (bystander, carrier):
                if process.returncode is None:  # pragma: no cover - only on failure
                    process.kill()


@pytest.mark.parametrize(
    "cgroup",
    ["/sys/fs/cgroup/unified", "/sys/fs/cgroup/unified/pi-runtime/{other}", "/tmp/{nonce}"],
)
async def test_a_record_cannot_aim_the_kill_elsewhere(cgroup: str) -> None:
    """W5: a damaged or forged record names no cgroup but the epoch's own, and a real nonce."""
    nonce = new_nonce()
    record = EpochStarted(
        epoch=1,
        pid=1,
        start_time=0,
        boot_id="x",
        nonce=nonce,
        cgroup=cgroup.format(nonce=nonce, other=new_nonce()),
        started_ms=0,
    )
    with pytest.raises(WorkerError) as caught:
        await kill_epoch_leftovers(record)
    assert caught.value.code is ReasonCode.WORKER_RECORD_INVALID
    with pytest.raises(WorkerError) as caught:
        await kill_epoch_leftovers(msgspec.structs.replace(record, nonce="", cgroup=None))
    assert caught.value.code is ReasonCode.WORKER_RECORD_INVALID


@pytest.mark.parametrize("nonce", ["", "../../x", "0" * 31, "g" * 32])
async def test_w5_w13_a_launch_record_cannot_aim_the_kill_elsewhere(nonce: str) -> None:
    """W5, W13: a launch record's nonce names the cgroup the kill removes; one that is not
    32 hex digits (a damaged or forged record: a path, a short one) is refused, nothing
    scanned or signalled on it."""
    with pytest.raises(WorkerError) as caught:
        await kill_launch_leftovers(nonce)
    assert caught.value.code is ReasonCode.WORKER_RECORD_INVALID


# ----------------------------------------------------------------------------------- CLI


def test_doctor_reports_pi_node_cgroups_and_subreaper(capsys: pytest.CaptureFixture[str]) -> None:
    home = pi_install().home
    assert cli_main(["doctor", "--pi-home", str(home)]) == 0
    out = capsys.readouterr().out
    assert f"1.6.0 at {home}" in out
    assert "node (pi's)" in out
    assert "(ok)" in out
    assert "cgroup v2" in out
    assert "subreaper    supported" in out


def test_doctor_says_how_to_get_pi(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["doctor", "--pi-home", str(tmp_path)]) == 1
    assert "run `pi-runtime pi install`" in capsys.readouterr().out


def test_pi_install_is_idempotent(capsys: pytest.CaptureFixture[str]) -> None:
    home = pi_install().home
    assert cli_main(["pi", "install", "--home", str(home)]) == 0
    assert capsys.readouterr().out.startswith(f"pi 1.6.0 at {home}")
    assert cli_main(["version"]) == 0


async def test_w12_the_first_cgroup_epoch_sweeps_what_dead_hosts_left_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W12: before a process's first epoch cgroup is made, the stale ones under the shared
    parent are swept (off the Trio loop), and only once per process."""
    calls: list[tuple[Path, bool]] = []

    def sweep(parent: Path) -> int:
        calls.append((parent, trio.lowlevel.in_trio_run()))
        return 0

    monkeypatch.setattr(_worker, "sweep_stale_cgroups", sweep)
    _worker._sweep_once.cache_clear()
    try:
        for _ in range(2):
            with trio.fail_after(LIMIT):
                async with open_epoch(
                    tree_argv(tmp_path),
                    env=tree_env(tmp_path),
                    cwd=tmp_path,
                    containment=Containment.CGROUP,
                ) as epoch:
                    await tree_ready(epoch)
                    report = await epoch.stop()
            assert report.clean, report
    finally:
        _worker._sweep_once.cache_clear()
    assert calls == [(CGROUPS.parent, False)]
