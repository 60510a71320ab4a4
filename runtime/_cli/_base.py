"""What every command shares: exit statuses, the command logger, how a refusal is reported,
the options several commands take, and the builder that ties a command to its ``run``."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NoReturn

import msgspec

from .._config import RoomWorkerConfig, load_config, redact_passwords
from .._errors import AdminError, ConfigError, PiRuntimeError, ReasonCode
from .._retention import RetentionSettings

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_NO_SERVER: Final = 3
EXIT_INTERRUPTED: Final = 130

logger = logging.getLogger("runtime.cli")
"""The commands' own words (``pi-runtime: <code>: <message>`` in plain text)."""
JSON: Final = msgspec.json.Encoder()

Run = Callable[[argparse.Namespace], int]
"""A command: the parsed arguments in, the exit status out."""


class Parser(argparse.ArgumentParser):
    """An argument parser that raises its refusal (:class:`Unparsed`) instead of printing
    argparse's usage block and exiting: :func:`~runtime._cli.main` reports it as every other
    error, ``usage_invalid`` (O17). The parsers of its subcommands are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise Unparsed(self.prog, message)


class Unparsed(Exception):
    """The command line did not parse; ``message`` is argparse's, which may quote what was
    typed: :meth:`error` is the refusal to report."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(prog, message)
        self.prog = prog
        self.message = message

    def error(self, argv: Sequence[str]) -> PiRuntimeError:
        """``usage_invalid``, its text with every password an argument of ``argv`` holds
        hidden (O17)."""
        text = hide_passwords(f"{self.prog}: {self.message}", argv)
        return PiRuntimeError(ReasonCode.USAGE_INVALID, f"{text}; see `{self.prog} --help`")


def hide_passwords(text: str, argv: Sequence[str]) -> str:
    """``text``, which may quote arguments of ``argv`` (whole, ``repr``-quoted, or the value
    of an ``--option=value``), with the password of any DSN in them replaced by ``***``
    (:func:`~runtime._config.redact_passwords`): each argument is read whole first (so a
    quoted password is cut where libpq would cut it), then the text itself."""
    values = {*argv} | {arg.partition("=")[2] for arg in argv if arg.startswith("-")}
    for value in sorted(values, key=len, reverse=True):
        hidden = redact_passwords(value, one_value=True)
        if hidden != value:
            text = text.replace(repr(value), repr(hidden)).replace(value, hidden)
    return redact_passwords(text)


def asks_for_json(argv: Sequence[str]) -> bool:
    """Whether ``argv`` holds ``--log-json`` (or an abbreviation argparse takes for it) before
    any ``--``: for a command line that did not parse."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return any(arg.startswith("--log") and "--log-json".startswith(arg) for arg in options)


@dataclass(frozen=True, slots=True)
class Commands:
    """A level of subcommands. :meth:`add` makes one that runs; :meth:`group` one that only
    holds subcommands (given alone, it prints its help and exits ``EXIT_USAGE``)."""

    choices: argparse._SubParsersAction[Parser]
    common: Parser
    """The options every command takes (``--log-json``)."""

    def add(self, name: str, summary: str, description: str, run: Run) -> argparse.ArgumentParser:
        parser = self._parser(name, summary, description)
        parser.set_defaults(run=run)
        return parser

    def group(self, name: str, summary: str, description: str) -> Commands:
        parser = self._parser(name, summary, description)
        parser.set_defaults(help_for=parser)
        choices = parser.add_subparsers(metavar=f"{name.upper()}_COMMAND")
        return Commands(choices, self.common)

    def _parser(self, name: str, summary: str, description: str) -> Parser:
        return self.choices.add_parser(
            name, help=summary, description=description, parents=[self.common]
        )


def log_json_option(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--log-json",
        action="store_true",
        default=default,
        help="log JSON lines on stderr (default: plain text)",
    )


DEFAULT_STATE_DIR: Final = Path("state")


def state_dir_option(parser: argparse.ArgumentParser, *, with_config: bool = False) -> None:
    """``--state-dir``; ``with_config``: the command also takes ``--config``, whose
    ``state_dir`` is the default (:func:`offline_target`)."""
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None if with_config else DEFAULT_STATE_DIR,
        help=(
            "the state directory (default: --config's state_dir, else ./state)"
            if with_config
            else "the state directory (default: ./state)"
        ),
    )


def store_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--store DSN``: read (or act on) a deployment's PostgreSQL database; ``what`` says
    what the command does there."""
    parser.add_argument("--store", default=None, metavar="DSN", help=what)


def config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, help="the TOML configuration file (its [watchdog] table)"
    )


def timescale_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--unsafe-test-timescale",
        type=float,
        default=None,
        metavar="FACTOR",
        help="TESTS ONLY: divide every task-lane watchdog threshold by FACTOR and lift the "
        "900 s floor; every log line and status say so",
    )


def fail(error: PiRuntimeError) -> int:
    logger.error("%s", error.message, extra={"code": error.code})
    if error.code == ReasonCode.USAGE_INVALID:
        return EXIT_USAGE
    return EXIT_NO_SERVER if error.code == ReasonCode.SERVER_NOT_RUNNING else EXIT_FAILED


def refused(response: dict[str, Any]) -> int:
    """Report a server's ``{"ok": false, ...}`` answer."""
    message = response.get("message", "the server refused")
    logger.error("%s", message, extra={"code": response.get("code", ReasonCode.ADMIN_FAILED)})
    return EXIT_FAILED


def no_server(state_dir: Path) -> AdminError:
    return AdminError(
        ReasonCode.SERVER_NOT_RUNNING,
        f"no server answers on {state_dir}; start `pi-runtime serve --state-dir "
        f"{state_dir}` (or a `pi-runtime task run`) and try again",
    )


def load_room_config(path: Path | None) -> RoomWorkerConfig:
    return load_config(path) if path is not None else RoomWorkerConfig()


def snippet(text: object, width: int = 60) -> str:
    if not isinstance(text, str) or not text:
        return ""
    flat = " ".join(text.split())
    return "  " + (repr(flat) if len(flat) <= width else repr(flat[: width - 1] + "…"))


def short_class(classification: object) -> str:
    text = str(classification or "-")
    return "-" if text.startswith("unknown:") else text


def seconds_text(value: object) -> str:
    """``12.5 s`` for a number of seconds; ``-`` for anything else (a field not sent)."""
    return f"{float(value):g} s" if isinstance(value, int | float) else "-"


def silence_text(view: Mapping[str, Any]) -> str:
    """A task view's silence: ``12.5 s`` while the watchdog measures it, else ``not watched``
    — never a ``0 s`` that is no measurement (OP11)."""
    if not view.get("silence_watched"):
        return "not watched"
    return seconds_text(view.get("silence_seconds"))


def offline_target(
    state_dir: Path | None, config: Path | None
) -> tuple[Path, RetentionSettings | None]:
    """The state directory a retention command acts on, and the settings ``--config``
    gives (``None``: the ones the server recorded, RT14): ``--state-dir``, else the
    configuration's ``state_dir``, else ``./state``. Both given and naming different
    directories is ``config_invalid``: that configuration is not the one the server of that
    directory runs with."""
    configured, given = given_retention(config)
    if (
        state_dir is not None
        and configured is not None
        and state_dir.absolute() != configured.absolute()
    ):
        raise ConfigError(
            "state_dir",
            f"--state-dir {state_dir} is not the configuration's state_dir {configured}",
        )
    return state_dir or configured or DEFAULT_STATE_DIR, given


def given_retention(config: Path | None) -> tuple[Path | None, RetentionSettings | None]:
    """For a retention pass with no server: ``--config``'s state directory and the settings
    it gives, or ``(None, None)`` — the pass then acts with the ones the server recorded
    (docs/design/retention.md RT14). File store only."""
    if config is None:
        return None, None
    loaded = load_config(config)
    if loaded.store.url is not None:
        raise ConfigError("store.url", "a retention pass with no server is for the file store")
    return Path(loaded.state_dir), RetentionSettings.of(loaded)
