"""``pi-runtime serve``: the command line's half of the websocket room worker; the server
itself is ``runtime/_server/_serve.py``."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path
from typing import Any

import msgspec
import trio

from .._config import RoomWorkerConfig, load_config, validate_config
from .._errors import ConfigError, PiRuntimeError
from .._linux._proc import forbid_inspection
from .._server._serve import ServeOptions, check_bind, serve_until_signalled
from ._base import EXIT_OK, EXIT_USAGE, Commands, logger, timescale_option


def register(commands: Commands) -> None:
    serve = commands.add(
        "serve",
        "run the websocket room worker",
        "Serve chat bridges over a websocket: admit room messages durably, run them in one "
        "agent session per room, send replies. Runs until SIGINT/SIGTERM, then drains.",
        run,
    )
    add_serve_arguments(serve)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The ``serve`` command's options (``runtime/_server/_serve.py`` reads them)."""
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8765, help="port to bind (default: 8765)")
    serve.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="the state directory (default: the configuration's state_dir, else ./state)",
    )
    serve.add_argument("--config", type=Path, help="the TOML configuration file")
    serve.add_argument(
        "--store",
        default=None,
        metavar="DSN",
        help="keep the journal in this PostgreSQL database (made by `pi-runtime db migrate`; "
        "no password in it: PGPASSWORD, ~/.pgpass or a service file) instead of the state "
        "directory (default: the configuration's [store] url, else the state directory)",
    )
    serve.add_argument(
        "--agent",
        choices=("fake", "pi"),
        default=None,
        help="the worker: fake (Fake-Pi) or pi (the real Pi) (default: the configuration's, "
        "else fake)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long running turns may finish (default: the "
        "configuration's, 30; 0 = none)",
    )
    serve.add_argument("--tls-cert", type=Path, help="serve wss:// with this certificate (PEM)")
    serve.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    serve.add_argument(
        "--metrics",
        default=None,
        metavar="HOST:PORT",
        help="answer GET /metrics (Prometheus) on this address, e.g. 127.0.0.1:9464 "
        "(default: the configuration's [metrics] listen, else none)",
    )
    serve.add_argument(
        "--insecure-bind",
        action="store_true",
        help="allow binding a non-loopback address without TLS",
    )
    timescale_option(serve)


def run(args: argparse.Namespace) -> int:
    """Exit 0 after a drained stop, 2 (usage) for refused settings."""
    if not forbid_inspection():  # G9: its keys out of reach of its workers' user
        logger.warning(
            "this process stays inspectable: a process of its user can read its environment",
            extra={"event": "inspection_allowed"},
        )
    try:
        config = _config(args)
        options = _options(args)
        check_bind(options, config)  # C16 is the room worker's start's (open_room_worker)
        trio.run(serve_until_signalled, config, options)
    except PiRuntimeError as error:  # O11: `pi-runtime: <code>: <message>`, as every command
        logger.error("%s", error.message, extra={"code": error.code})
        return EXIT_USAGE
    return EXIT_OK


def _options(args: argparse.Namespace) -> ServeOptions:
    if not 0 <= args.port <= 65535:  # the resolver would take it modulo 65536 (O11)
        raise ConfigError("port", f"{args.port} is not a TCP port (0 to 65535)")
    context = None
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if (cert is None) != (key is None):
        raise ConfigError("tls", "give both --tls-cert and --tls-key, or neither")
    if cert is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as error:
            raise ConfigError("tls", f"cannot load the certificate and key: {error}") from None
    scale = getattr(args, "unsafe_test_timescale", None)  # 0 is refused, not "not given" (O15)
    return ServeOptions(
        host=args.host,
        port=args.port,
        ssl_context=context,
        insecure_bind=bool(getattr(args, "insecure_bind", False)),
        unsafe_test_timescale=1.0 if scale is None else float(scale),
    )


def _config(args: argparse.Namespace) -> RoomWorkerConfig:
    config = load_config(args.config) if args.config is not None else RoomWorkerConfig()
    changes: dict[str, Any] = {}
    if args.state_dir is not None:
        changes["state_dir"] = str(Path(args.state_dir).absolute())
    if args.agent is not None:
        changes["agent"] = args.agent
    if getattr(args, "store", None) is not None:
        changes["store"] = msgspec.structs.replace(config.store, url=args.store)
    if getattr(args, "metrics", None) is not None:
        changes["metrics"] = msgspec.structs.replace(config.metrics, listen=args.metrics)
    if args.drain_timeout is not None:
        thresholds = msgspec.structs.replace(
            config.thresholds, drain_timeout_seconds=args.drain_timeout
        )
        changes["thresholds"] = thresholds
    return validate_config(msgspec.structs.replace(config, **changes))
