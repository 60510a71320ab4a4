"""What a worker epoch runs: the program, its model route, flags, environment and files.

The same launch serves the real Pi and Fake-Pi (W9): Pi's flags that keep stray
context out, an allow-listed environment (W8), HOME and the Pi agent directory
outside the state directory, ``models.json`` and ``settings.json`` written into
the agent directory. :mod:`runtime._pi._worker` runs what this module describes.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec

from .._errors import ReasonCode, WorkerError
from .._linux._proctree import EPOCH_ENV
from .._version import __version__
from ._pi_install import PiInstall

__all__ = [
    "ENV_ALLOWED",
    "QUIET_FLAGS",
    "ModelRoute",
    "RetrySettings",
    "WorkerKind",
    "WorkerLaunch",
    "WorkerProgram",
    "check_launch",
    "worker_argv",
    "worker_environment",
    "write_agent_files",
]

ENV_ALLOWED: Final = frozenset(
    {"PATH", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL"}
)
"""Names a worker inherits from the runtime's environment (plus ``LC_*``). Nothing else."""
_RESERVED: Final = frozenset(
    {
        EPOCH_ENV,
        "HOME",
        "PI_CODING_AGENT_DIR",
        "PI_OFFLINE",
        "PI_TELEMETRY",
        "PI_SKIP_VERSION_CHECK",
        "PWD",
    }
)
QUIET_FLAGS: Final = ("-nc", "-ns", "-np", "-ne", "--no-mcp")
"""Pi flags that keep stray context out: context files, skills, prompt templates,
extensions (other than the ones passed with ``-e``) and MCP."""
_encode = msgspec.json.Encoder()


# ---------------------------------------------------------------------------- what to run


class WorkerKind(enum.StrEnum):
    PI = "pi"
    FAKE_PI = "fake_pi"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerProgram:
    """Which worker runs: its command line prefix, version and install path.

    The kind, version and install path are part of a lane's settings fingerprint.
    """

    kind: WorkerKind
    command: tuple[str, ...]
    version: str
    install_path: str
    extra_flags: tuple[str, ...] = ()
    """Flags only this program takes (Pi: ``--no-approve``, keeps a cwd's ``.pi/`` out)."""

    @classmethod
    def pi(cls, install: PiInstall) -> WorkerProgram:
        return cls(
            kind=WorkerKind.PI,
            command=tuple(install.argv()),
            version=install.version,
            install_path=str(install.home),
            extra_flags=("--no-approve",),
        )

    @classmethod
    def fake_pi(cls, python: str | None = None) -> WorkerProgram:
        spec = importlib.util.find_spec("fake_pi")
        where = spec.origin if spec is not None and spec.origin else "fake_pi"
        return cls(
            kind=WorkerKind.FAKE_PI,
            command=(python or sys.executable, "-m", "fake_pi"),
            version=__version__,
            install_path=str(Path(where).parent),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRoute:
    """The model a worker uses, written into ``models.json`` as one provider."""

    provider: str
    model: str
    base_url: str | None = None
    """``None`` leaves the provider without an endpoint (Fake-Pi then uses its scripted model)."""
    api: str = "openai-completions"
    api_key: str = "pi-runtime"
    """Pi counts a model as available only with some key; never a real credential."""
    context_window: int = 128_000
    max_tokens: int = 4096
    thinking_level: str = "off"
    """The reasoning level a session of this route is created with (its
    ``thinking_level_change``); a model with a level other than ``off`` is declared reasoning."""

    def models_json(self) -> dict[str, Any]:
        provider: dict[str, Any] = {"api": self.api, "apiKey": self.api_key}
        if self.base_url is not None:
            provider["baseUrl"] = self.base_url
        provider["models"] = [
            {
                "id": self.model,
                "name": self.model,
                "reasoning": self.thinking_level != "off",
                "input": ["text"],
                "contextWindow": self.context_window,
                "maxTokens": self.max_tokens,
                "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
            }
        ]
        return {"providers": {self.provider: provider}}


@dataclass(frozen=True, slots=True, kw_only=True)
class RetrySettings:
    """Pi's own retry settings, always written explicitly (``settings.json`` ``retry``)."""

    enabled: bool = True
    max_retries: int = 3
    base_delay_ms: int = 2000
    max_agent_delay_ms: int = 60_000
    provider_max_retries: int = 0

    def settings_json(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "maxRetries": self.max_retries,
            "baseDelayMs": self.base_delay_ms,
            "maxAgentDelayMs": self.max_agent_delay_ms,
            "provider": {"maxRetries": self.provider_max_retries},
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerLaunch:
    """Everything one worker launch needs; the same for Pi and Fake-Pi (W9)."""

    program: WorkerProgram
    cwd: Path
    """The lane's stable working directory (part of Pi's system prompt)."""
    home: Path
    agent_dir: Path
    """``PI_CODING_AGENT_DIR``; ``models.json`` and ``settings.json`` are written here."""
    session: Path | None = None
    """``--session FILE``; ``None`` runs with ``--no-session``."""
    route: ModelRoute | None = None
    persona: str | None = None
    """The operator's instructions, passed as ``--append-system-prompt``."""
    retry: RetrySettings = field(default_factory=RetrySettings)
    settings: Mapping[str, Any] = field(default_factory=dict)
    """More ``settings.json`` keys (``retry`` and telemetry are set by the runtime)."""
    extensions: tuple[Path, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    tmp_dir: Path | None = None
    state_dir: Path | None = None
    """When given, ``cwd``, ``home`` and ``agent_dir`` must lie outside it."""


def _inside(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())


def check_launch(launch: WorkerLaunch) -> None:
    for name in ("cwd", "home", "agent_dir"):
        path: Path = getattr(launch, name)
        if not path.is_absolute():
            raise WorkerError(ReasonCode.WORKER_CONFIG_INVALID, f"{name} must be absolute: {path}")
        if launch.state_dir is not None and _inside(path, launch.state_dir):
            raise WorkerError(
                ReasonCode.WORKER_CONFIG_INVALID,
                f"{name} {path} is inside the state directory; give workers a directory outside it",
            )
    # Pi reads the persona from a file when ``existsSync(text)`` (its cwd is the lane's); asked
    # the way Node asks it: a text no file can be named by (a line over 255 bytes, a text over
    # 4095) names none, where ``Path.exists()`` raised ``OSError`` (W9)
    if launch.persona is not None and (
        os.path.exists(launch.persona) or os.path.exists(launch.cwd / launch.persona)
    ):
        raise WorkerError(
            ReasonCode.WORKER_CONFIG_INVALID,
            "the persona text names an existing file, which Pi would read instead of the text",
        )


def worker_environment(
    *,
    home: Path,
    agent_dir: Path,
    cwd: Path,
    tmp_dir: Path | None = None,
    extra: Mapping[str, str] | None = None,
    parent: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The allow-listed environment for a worker (W8).

    Only :data:`ENV_ALLOWED` and ``LC_*`` come from ``parent`` (default
    ``os.environ``); HOME, the agent directory and Pi's offline switches are
    set here; ``extra`` adds explicit names but cannot replace those. The epoch
    nonce is added at launch.
    """
    parent = os.environ if parent is None else parent
    env = {k: v for k, v in parent.items() if k in ENV_ALLOWED or k.startswith("LC_")}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    for name, value in (extra or {}).items():
        if name in _RESERVED:
            raise WorkerError(
                ReasonCode.WORKER_CONFIG_INVALID, f"{name} is set by the runtime, not by extras"
            )
        env[name] = value
    env.update(
        HOME=str(home),
        PI_CODING_AGENT_DIR=str(agent_dir),
        PI_OFFLINE="1",
        PI_TELEMETRY="0",
        PI_SKIP_VERSION_CHECK="1",
        PWD=str(cwd),
    )
    if tmp_dir is not None:
        env["TMPDIR"] = str(tmp_dir)
    return env


def worker_argv(launch: WorkerLaunch) -> list[str]:
    """The worker's command line: the program, RPC mode and the quiet flags (W9)."""
    argv = [*launch.program.command, "--mode", "rpc", *QUIET_FLAGS, *launch.program.extra_flags]
    for extension in launch.extensions:
        argv += ["-e", str(extension)]
    if launch.route is not None:
        argv += ["--provider", launch.route.provider, "--model", launch.route.model]
    argv += ["--session", str(launch.session)] if launch.session else ["--no-session"]
    if launch.persona is not None:
        argv += ["--append-system-prompt", launch.persona]
    return [*argv, *launch.extra_args]


def write_agent_files(launch: WorkerLaunch) -> None:
    """Create HOME and the agent directory (0700); write ``models.json`` and ``settings.json``."""
    for directory in (launch.home, launch.agent_dir):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    settings = {**launch.settings, "retry": launch.retry.settings_json()}
    settings["enableInstallTelemetry"] = False
    _write_private(launch.agent_dir / "settings.json", _encode.encode(settings))
    if launch.route is not None:
        _write_private(launch.agent_dir / "models.json", _encode.encode(launch.route.models_json()))


def _write_private(path: Path, data: bytes) -> None:
    """Replace ``path`` (mode 0600) by rename; Pi never sees a half-written file."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(temp, path)
