"""What an implementation of a Pi worker may use of the runtime — Fake-Pi is one.

A worker speaks the runtime's contracts from the other side: the environment names it is
handed (the gateway's per-epoch secret, the runtime tools it may declare), the session file
format it writes exactly as Pi does, the HTTP helpers its model client and scripted model
server use, the digest that identifies a model request, and the provider-limit texts a
provider retry must not retry. These names are public so that ``fake_pi`` never imports a
private runtime module (a contract in ``pyproject.toml``, docs/design/index.md).
"""

from __future__ import annotations

from ._boundary._gateway import GATEWAY_SECRET_ENV
from ._boundary._http import (
    ConnectionPool,
    HttpClientError,
    HttpServer,
    Request,
    ResponseWriter,
    iter_sse,
    open_request,
    serve_http,
)
from ._boundary._stream import request_digest
from ._boundary._tools import RUNTIME_TOOLS, TOOLS_ENV
from ._clock import SystemWallClock, WallClock
from ._pi._pijson import iso_timestamp, stringify
from ._pi._provider_errors import PROVIDER_LIMIT_PATTERNS
from ._pi._session import Session, uuid7
from ._pi._session_files import SessionWriter, read_session, truncate_torn_tail

__all__ = [
    "GATEWAY_SECRET_ENV",
    "PROVIDER_LIMIT_PATTERNS",
    "RUNTIME_TOOLS",
    "TOOLS_ENV",
    "ConnectionPool",
    "HttpClientError",
    "HttpServer",
    "Request",
    "ResponseWriter",
    "Session",
    "SessionWriter",
    "SystemWallClock",
    "WallClock",
    "iso_timestamp",
    "iter_sse",
    "open_request",
    "read_session",
    "request_digest",
    "serve_http",
    "stringify",
    "truncate_torn_tail",
    "uuid7",
]
