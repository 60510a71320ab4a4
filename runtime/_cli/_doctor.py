"""``pi install`` and ``doctor``: the real Pi, the Node it needs, and what worker trees can
use on this machine (cgroup v2, the child subreaper)."""

from __future__ import annotations

import argparse
import math
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from .._config import redact_passwords
from .._errors import PiRuntimeError, ReasonCode
from .._linux._proctree import probe_cgroups, subreaper_supported
from .._pi._pi_install import NPM_TIMEOUT, PiInstallError, default_pi_home, find_pi, install_pi
from .._version import __version__
from ._base import Commands, fail

NODE_MINIMUM: Final = (22, 19, 0)
"""Pi 1.6.0 declares ``engines.node >=22.19.0``."""


def register(commands: Commands) -> None:
    pi = commands.group("pi", "install the real Pi", "Manage the real Pi coding agent.")
    install = pi.add(
        "install",
        "install Pi and the Node 22 it needs",
        "Install Pi 1.6.0 and a Node 22 binary from the npm registry, from the "
        "shipped lockfile with install scripts disabled (needs npm). Idempotent.",
        _pi_install,
    )
    install.add_argument(
        "--home",
        type=Path,
        help="install directory (default: $PI_RUNTIME_PI_HOME or ~/.cache/pi-runtime/pi)",
    )
    install.add_argument(
        "--timeout",
        type=_seconds,
        default=NPM_TIMEOUT,
        metavar="SECONDS",
        help=f"stop npm (and what it started) after this long (default: {NPM_TIMEOUT:g})",
    )
    doctor = commands.add(
        "doctor",
        "check what workers need here",
        "Report Pi, Node (>= 22.19) and their paths, cgroup v2 availability and "
        "child-subreaper support. Exit status 1 when Pi cannot run.",
        _doctor,
    )
    doctor.add_argument("--pi-home", type=Path, help="where Pi is installed (as for pi install)")


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (an argparse ``type``; else ``usage_invalid``)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(text)
    return value


_REASON_CHARS: Final = 2000
"""How much of npm's words a ``pi_install_failed`` line keeps."""


def _pi_install(args: argparse.Namespace) -> int:
    """Install Pi. A failure — no npm, an npm that cannot start, fails (the network, the
    registry) or outlasts ``--timeout``, no Node after it, Pi not answering its version — is
    one line ``pi_install_failed`` keeping npm's reason with its lines joined and any URL
    password hidden (O19); what the system refuses on the ``--home`` path itself stays
    ``io_failed`` (O18)."""
    try:
        pi = install_pi(args.home.absolute() if args.home else None, timeout=args.timeout)
    except (PiInstallError, subprocess.SubprocessError) as error:
        text = redact_passwords(str(error).replace(":\n", ": "))  # before it is cut short
        reason = "; ".join(line.strip() for line in text.splitlines() if line.strip())
        if len(reason) > _REASON_CHARS:
            reason = reason[: _REASON_CHARS - 1] + "…"
        raise PiRuntimeError(ReasonCode.PI_INSTALL_FAILED, reason) from None
    print(f"pi {pi.version} at {pi.cli} (node {pi.node})")
    return 0


@dataclass(frozen=True, slots=True)
class _Node:
    path: str
    version: tuple[int, int, int] | None
    text: str

    @property
    def ok(self) -> bool:
        return self.version is not None and self.version >= NODE_MINIMUM


def _node(path: str) -> _Node:
    try:
        result = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return _Node(path, None, f"does not run ({error})")
    text = result.stdout.strip()
    match = re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)", text)
    version = (int(match[1]), int(match[2]), int(match[3])) if match else None
    return _Node(path, version, text or result.stderr.strip())


def _doctor(args: argparse.Namespace) -> int:
    pi_home: Path | None = args.pi_home.absolute() if args.pi_home else None
    minimum = ".".join(map(str, NODE_MINIMUM))
    lines = [("pi-runtime", f"{__version__} (python {sys.version.split()[0]}, {sys.executable})")]
    home = pi_home or default_pi_home()
    pi = find_pi(home)
    ready = pi is not None
    if pi is None:
        lines.append(("pi", f"not installed at {home}: run `pi-runtime pi install` (needs npm)"))
    else:
        lines.append(("pi", f"{pi.version} at {pi.cli}"))
        node = _node(str(pi.node))
        verdict = "ok" if node.ok else f"needs >= {minimum}"
        lines.append(("node (pi's)", f"{node.text} at {node.path} ({verdict})"))
        ready = node.ok
    on_path = shutil.which("node")
    if on_path is None:
        lines.append(("node (PATH)", "none; `pi-runtime pi install` brings its own Node 22"))
    else:
        node = _node(on_path)
        verdict = "ok" if node.ok else f"older than {minimum}; Pi uses the one it installs"
        lines.append(("node (PATH)", f"{node.text} at {on_path} ({verdict})"))
    cgroups = probe_cgroups()
    if cgroups.usable:
        kill = "yes" if cgroups.kill else "no (members are killed one by one)"
        lines.append(("cgroup v2", f"usable: {cgroups.parent} (cgroup.kill: {kill})"))
    else:
        lines.append(
            (
                "cgroup v2",
                f"unavailable ({cgroups.reason}); worker trees are held by the child "
                "subreaper and the nonce scan instead",
            )
        )
    subreaper = "supported" if subreaper_supported() else "not supported (nonce scan only)"
    lines.append(("subreaper", subreaper))
    width = max(len(name) for name, _ in lines)
    for name, text in lines:
        print(f"{name.ljust(width)}  {text}")
    if ready:
        return 0
    sys.stdout.flush()  # the report first, then the refusal under it
    because = "it is not installed" if pi is None else f"its Node is not >= {minimum}"
    return fail(
        PiRuntimeError(ReasonCode.PI_UNAVAILABLE, f"Pi cannot run here yet: {because}; see above")
    )
