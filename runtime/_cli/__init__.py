"""The ``pi-runtime`` command line (``docs/design/operations.md``).

Commands: ``version``; ``serve`` (the websocket room worker, ``_serve.py``); ``status`` and
``cancel`` (through the running server's admin socket; without one, ``status`` reads the state
directory and ``cancel`` records the request there for the next start) and ``token rotate``
(``_status.py``); ``journal verify`` and ``journal show`` (``_journal.py``); ``pi install`` and
``doctor`` (``_doctor.py``); task lanes (``_tasks.py``): ``task run`` (through the server, or
standalone), ``tasks`` and ``task show`` (through the server, or read from the lane logs),
``task reply|resume|abort|fail|grant`` (through the server), ``task forget`` (through the
server, or on the state directory); ``db migrate`` (the PostgreSQL store's schema,
``_db.py``). Every command and subcommand has ``--help``.

Each module registers its commands with :class:`~runtime._cli._base.Commands`, which ties
each to the function that runs it (``set_defaults(run=…)``): :func:`main` parses and calls
``args.run(args)``; a group given without its subcommand prints its help.

Exit status: 0 done; 1 refused or failed (the message names a stable code); 2 usage
(``usage_invalid``: a command line that does not parse, or a group without its subcommand;
no password an argument holds is quoted, O17); 3 ``server_not_running`` (a command that needs
the server found none); 130 a standalone ``task run`` interrupted (the task stays unfinished
in its log).

Logging goes to standard error, plain text, or JSON lines with ``--log-json``. Nothing here
logs or prints a secret; ``token rotate`` prints the new token once, on standard output.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .._errors import PiRuntimeError, ReasonCode
from .._version import __version__
from . import _db, _doctor, _journal, _serve, _status, _tasks
from ._base import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NO_SERVER,
    EXIT_OK,
    EXIT_USAGE,
    Commands,
    Parser,
    Unparsed,
    asks_for_json,
    fail,
    log_json_option,
)
from ._logging import configure_logging
from ._serve import add_serve_arguments

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_NO_SERVER",
    "EXIT_OK",
    "EXIT_USAGE",
    "add_serve_arguments",
    "configure_logging",
    "main",
]


def _version(args: argparse.Namespace) -> int:
    print(f"pi-runtime {__version__}")
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    """Every command, each tied to the function that runs it."""
    common = Parser(add_help=False)
    log_json_option(common, argparse.SUPPRESS)  # never overwrite one given before the command
    top = Parser(
        prog="pi-runtime",
        description="A durable, supervised runtime for Pi coding-agent workers.",
    )
    log_json_option(top, False)
    commands = Commands(top.add_subparsers(metavar="COMMAND"), common)
    commands.add("version", "print the pi-runtime version", "Print the version.", _version)
    for part in (_serve, _status, _journal, _doctor, _tasks, _db):
        part.register(commands)
    return top


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status."""
    arguments = sys.argv[1:] if argv is None else argv
    top = parser()
    unparsed: PiRuntimeError | None = None
    try:
        args = top.parse_args(arguments)
    except Unparsed as refusal:  # O17: reported as every other error, in the same format
        args = argparse.Namespace(log_json=asks_for_json(arguments))
        unparsed = refusal.error(arguments)
    handler = configure_logging(json_lines=args.log_json, argv=arguments)
    try:
        if unparsed is not None:
            return fail(unparsed)
        if not hasattr(args, "run"):  # no command, or a group without its subcommand
            group: argparse.ArgumentParser = getattr(args, "help_for", top)
            if not args.log_json:  # (standard error stays JSON lines)
                group.print_help(sys.stderr)
            needed = f"{group.prog}: a command is needed; see `{group.prog} --help`"
            return fail(PiRuntimeError(ReasonCode.USAGE_INVALID, needed))
        status: int = args.run(args)
        return status
    except PiRuntimeError as error:
        return fail(error)
    except OSError as error:  # O18: a path or socket of the user's the system refused
        return fail(PiRuntimeError(ReasonCode.IO_FAILED, str(error)))
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()  # every line still waiting is written first
