"""G9, W-M6: the runtime's process cannot be inspected by a process of its own user.

A worker, a git filter or a validation check the worker wrote runs as the runtime's user and
could read ``/proc/<runtime pid>/environ`` (the upstream key, a database password) or its
memory. ``pi-runtime serve`` makes its process undumpable at its start
(``runtime._linux._proc.forbid_inspection``): those files become root's. Tested with real
processes: a target holding a secret in its environment, dropped to an unprivileged user
(nobody, 65534; the tests run as root, as CI does) and made inspectable again as a plain
process of that user is, and a reader forked from it — the same user — reading its
``environ``; with the call, the reader is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

SECRET: Final = "upstream-key-in-the-environment"
_TARGET: Final = """
import ctypes, os, sys
sys.path.insert(0, sys.argv[1])
from runtime._linux._proc import forbid_inspection
if os.getuid() == 0:  # as another user: root reads every /proc file anyway
    os.setgid(65534)
    os.setuid(65534)  # resets the dumpable flag: set back as a plain process of that user has it
libc = ctypes.CDLL(None)
assert libc.prctl(4, 1, 0, 0, 0) == 0  # PR_SET_DUMPABLE 1
if sys.argv[2] == "forbid":
    assert forbid_inspection()
target = os.getpid()
reader = os.fork()
if reader == 0:  # the same user, another process: what a worker's tool is
    try:
        with open(f"/proc/{target}/environ", "rb") as file:
            os._exit(10 if sys.argv[3].encode() in file.read() else 11)
    except PermissionError:
        os._exit(12)
_, status = os.waitpid(reader, 0)
print({10: "read", 11: "not-there", 12: "refused"}[os.waitstatus_to_exitcode(status)])
"""


def _reader_of_target(forbid: bool) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _TARGET,
            str(Path(__file__).resolve().parents[2]),
            "forbid" if forbid else "allow",
            SECRET,
        ],
        env={**os.environ, "PI_RUNTIME_TEST_SECRET": SECRET},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(("forbid", "seen"), [(False, "read"), (True, "refused")])
def test_g9_a_process_of_the_runtimes_user_cannot_read_its_environment(
    forbid: bool, seen: str
) -> None:
    """G9: without ``forbid_inspection`` a process of the same user reads the secret in the
    target's environment (the control: the test can see the leak); with it, it is refused."""
    assert _reader_of_target(forbid) == seen


def test_g9_serve_makes_its_process_undumpable_before_it_reads_a_secret() -> None:
    """G9: ``pi-runtime serve`` calls ``forbid_inspection`` first, before its configuration
    (and with it any key's variable) is read: its ``run`` is the command's entry."""
    import inspect

    from runtime._cli import _serve

    source = inspect.getsource(_serve.run)
    assert source.index("forbid_inspection()") < source.index("_config(args)")
