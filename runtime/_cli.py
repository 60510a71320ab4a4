"""The ``pi-runtime`` command line.

Only ``version`` exists so far; ``serve`` and the other commands arrive with
the server issue (see the README).
"""

from __future__ import annotations

import argparse
import sys

from ._version import __version__

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pi-runtime",
        description="A durable, supervised runtime for Pi coding-agent workers.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "version", help="print the pi-runtime version", description="Print the version."
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "version":
        print(f"pi-runtime {__version__}")
        return 0
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
