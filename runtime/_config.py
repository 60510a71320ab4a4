"""The room worker's typed configuration (``docs/design/config.md``; also boundaries.md,
lanes.md, protocol.md, serve.md).

One frozen :class:`RoomWorkerConfig` holds everything an operator decides: where state and the
lanes' working directories live, which worker runs with which model route, the persona, which
rooms are served with which grants, replay-class overrides, thresholds and caps. The server
reads it from a TOML file with :func:`load_config`; an embedder builds the object and hands it
to :func:`validate_config` (``open_room_worker`` does). Either way an invalid configuration is
refused before anything starts, with a :class:`~runtime._errors.ConfigError` (``config_invalid``)
whose ``setting`` names the offending setting as a dotted path (``thresholds.stall_seconds``,
``rooms."dm:42".grants``). The rules are the invariants C1… of ``docs/design/config.md``.

Relative paths resolve against the TOML file's directory (:func:`load_config`) or against the
``base`` given to :func:`validate_config` (default: the process's working directory); a
validated configuration holds absolute paths only. No secret is ever part of a configuration:
the upstream key is named by the environment variable that holds it (``model.api_key_env``),
read by the gateway at call time.
"""

from __future__ import annotations

import math
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal
from urllib.parse import parse_qs, parse_qsl, urlsplit

import msgspec

from ._boundary._gate import PI_TOOL_CLASSES
from ._boundary._tools import RUNTIME_TOOLS
from ._errors import ConfigError, DeliveryError, ReasonCode
from ._journal._attachments import attachment_root
from ._records import ReplayClass
from ._room_ids import room_problem
from ._wire import largest_update_bytes, least_room_for_text

__all__ = [
    "DEFAULT_GRANTS",
    "KNOWN_TOOLS",
    "MAX_ACTOR_ID",
    "PERSONA_MAX_BYTES",
    "Caps",
    "MetricsConfig",
    "ModelConfig",
    "RoomConfig",
    "RoomWorkerConfig",
    "ServerConfig",
    "StoreConfig",
    "Thresholds",
    "WatchdogConfig",
    "config_from_dict",
    "declared_class",
    "load_config",
    "metrics_address",
    "redact_passwords",
    "validate_config",
]

DEFAULT_GRANTS: Final = frozenset({"send_text_update", "attach"})
"""A room's grant when the configuration says nothing: no read, no shell, no write
(docs/design/lanes.md)."""
KNOWN_TOOLS: Final = frozenset(PI_TOOL_CLASSES) | frozenset(RUNTIME_TOOLS)
"""Every tool a grant may name: Pi's gated tools and the runtime's own tools."""
PERSONA_MAX_BYTES: Final = 64 * 1024
"""The persona travels as one command-line argument (``--append-system-prompt``); Linux caps
one argument at 128 KiB."""
MAX_ACTOR_ID: Final = 200
"""Longest actor id, the same bound a delivery's author id has."""

_ENV_NAME: Final = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The upstream model route the gateway calls on the worker's behalf
    (docs/design/boundaries.md)."""

    provider: str = "fake"
    """The provider name the worker sees (its ``models.json`` key)."""
    model: str = "fake-model"
    base_url: str | None = None
    """The upstream's OpenAI-compatible base URL (``…/v1``). ``None``: the runtime serves
    Fake-Pi's plain scripted model itself, with either agent (no upstream, no credentials)."""
    api_key_env: str | None = None
    """The *name* of the environment variable holding the upstream key, never the key."""
    scenario: str | None = None
    """Without ``base_url``: a Fake-Pi scenario file (``.toml`` or ``.json``,
    docs/design/fake-pi.md) the runtime's own scripted model answers by, in order, then
    plainly; a demo or a test of a whole deployment (no upstream, no credentials)."""
    context_window: int = 128_000
    max_tokens: int = 4096


class RoomConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One served room: its standing grants and extra grants per actor (docs/design/lanes.md)."""

    grants: frozenset[str] | None = None
    """The tools every delivery in this room may use; ``None``: the configuration's
    ``default_grants``."""
    actors: dict[str, frozenset[str]] = {}
    """Extra tools per actor id; a delivery by such an actor beyond the standing grants is
    privileged (it runs in a one-shot session)."""


class Thresholds(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Timing, in seconds (docs/design/boundaries.md, lanes.md)."""

    stall_seconds: float = 300.0
    """A turn with no worker event (and no tool lease) this long is aborted ``turn_stalled``."""
    abort_grace_seconds: float = 30.0
    """After the stall backstop's abort, how long the worker has to settle; one that has not
    is presumed wedged and its epoch is fenced (lanes.md L20). Less than ``stall_seconds``."""
    tool_lease_max_seconds: float = 600.0
    """The longest a gated tool's lease holds the stall backstop off: a tool's own ``timeout``
    above it leases only this, and a ``bash`` call with no timeout gets it (lanes.md L20)."""
    tick_seconds: float = 5.0
    """How often the suspend-aware clock is re-read; a host that slept overshoots by one tick."""
    typing_refresh_seconds: float = 8.0
    upstream_inactivity_seconds: float = 270.0
    """A silent upstream stream is aborted (and retried by the worker) after this long."""
    keepalive_seconds: float = 15.0
    """SSE keepalive comments to the worker while the gateway holds or the upstream is silent."""
    idle_stop_seconds: float = 600.0
    """A lane's worker idle this long is stopped (its session stays)."""
    drain_timeout_seconds: float = 30.0
    """On shutdown, how long running turns may finish before they are cancelled."""


class Caps(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Bounds (docs/design/lanes.md, protocol.md)."""

    max_live_workers: int = 4
    """Live worker processes; the least recently used lane stops beyond it."""
    queue_limit: int = 32
    """Queued deliveries per room; one more is refused ``queue_full``."""
    recovery_attempts: int = 3
    """Recoveries of one delivery before it fails ``recovery_exhausted``."""
    text_update_chars: int = 600
    """Longest ``send_text_update`` text."""
    max_text_chars: int = 16_000
    """Longest delivery text (and history item text)."""
    max_history_items: int = 50
    """Most backlog items a delivery may carry."""


class StoreConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the journal lives (docs/design/scale-out.md, postgres-store.md)."""

    url: str | None = None
    """``None``: the file store in ``state_dir`` (the embedded default). A PostgreSQL DSN
    (``postgresql://host/db`` or ``host=… dbname=…``): the PostgreSQL store, its schema made by
    ``pi-runtime db migrate``; never with a password in it (C4): libpq reads ``PGPASSWORD``,
    ``~/.pgpass`` or a service file."""
    lease_seconds: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """On PostgreSQL, how long a host's lease on a lane lasts without a renewal (renewed every
    third of it; docs/design/scale-out.md S10-S12): a host that dies has its lanes claimed by
    the others after at most this long, and one that cannot renew stops its workers itself
    before it runs out."""
    host_name: str | None = None
    """On PostgreSQL, this host's name in the lease rows (S10). Each host of a deployment
    needs its own; the same host started again keeps it and so takes its lanes back at once
    (a claim always moves the epoch on, so even a second process under the same name cannot
    write with the first's lease). Default: the machine's host name and the state
    directory's path."""
    poll_seconds: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """On PostgreSQL, how often a host reads the shared logs without being told to (S23), and
    looks for lanes whose holder's lease ran out while deliveries wait in them (S13) or a
    task runs in them (S32)."""
    shared_worktrees: bool = False
    """On PostgreSQL: task worktrees and the task lanes' directories (``lanes/`` of the state
    directory: their Pi sessions) are on storage every host sees at the same paths. Then a
    task whose host's lease ran out resumes on the host that claims it; without it (the
    default) that host holds the task ``host_lost:<host>`` for an operator (S32)."""
    task_takeover_seconds: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    """On PostgreSQL without ``shared_worktrees``: how long a host's lease on a task lane must
    have run out before another host claims the task (and holds it ``host_lost``). A host
    that comes back sooner — a restart, a deploy — takes its tasks back itself (S32)."""


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The websocket server of ``pi-runtime serve`` (docs/design/protocol.md, serve.md;
    ``docs/design/serve.md``)."""

    allowed_origins: frozenset[str] = frozenset()
    """Browser ``Origin`` values allowed to connect. A handshake carrying any other ``Origin``
    is refused (``origin_refused``); a client that sends none (a bot, a script) is allowed."""
    max_frame_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 256 * 1024
    """Largest client frame answered normally; a larger one gets ``frame_too_large`` (and
    one over four times this closes the connection). No ``result`` frame is larger either:
    a reply's text is cut to fit (protocol.md P14, C15)."""
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] = 64
    """Deliveries one connection may have admitted and unfinished; one more is refused
    ``too_many_in_flight`` (backpressure, never a silent drop)."""
    hello_seconds: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """How long a client has, from its TCP connect, to send its upgrade request and then a
    valid ``hello``; then the connection is closed (``hello_timeout``, 1008)."""
    max_unauthenticated: Annotated[int, msgspec.Meta(ge=1)] = 64
    """Connections at once that have not said a valid ``hello`` yet; one more handshake is
    refused HTTP 503 (``too_many_connections``): idle sockets cannot use up the server's
    file descriptors."""
    max_authenticated: Annotated[int, msgspec.Meta(ge=1)] = 256
    """Connections at once past a valid ``hello``; one more valid hello is answered
    ``too_many_authenticated`` and its connection closed (1013, try again later): clients
    holding the token cannot open connections without bound either."""
    heap_freeze_seconds: Annotated[float, msgspec.Meta(ge=0)] = 0.25
    """How often ``serve`` freezes what survived in its heap, so no collection walks the
    long-lived state (docs/design/serve.md S7); 0 leaves Python's collector as it is."""


class WatchdogConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The task lanes' watchdog, in seconds (docs/design/watchdog.md; ``docs/design/watchdog.md``,
    WD9).

    Only the types are checked here: the rules (soft is 300 s, hard thresholds at least 900 s
    and longer than soft, …) depend on ``--unsafe-test-timescale`` and are checked when task
    lanes start (``runtime/_tasks/_service.py``: ``watchdog_config_invalid`` naming
    ``watchdog.<setting>``)."""

    soft_seconds: float = 300.0
    hard_provider_seconds: float = 900.0
    """Silence before the first token of a model request (time to first token)."""
    hard_generation_seconds: float = 900.0
    """Silence between tokens of a streaming answer."""
    grace_seconds: float = 120.0
    max_replacements: int = 3
    """Replacement epochs per attempt (the recovery budget)."""
    recovery_seconds: float = 1800.0
    """Recovery time per attempt (the recovery budget)."""


DEFAULT_MEDIA_TYPES: Final = frozenset(
    {
        "image/png",
        "image/jpeg",
        "image/gif",
        "image/webp",
        "application/pdf",
        "text/plain",
        "text/markdown",
        "text/csv",
        "application/json",
    }
)
"""What ``attach`` accepts when the configuration says nothing (docs/design/attachments.md)."""


class AttachmentsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Files the agent attaches to its replies (docs/design/attachments.md)."""

    root: str | None = None
    """Where their bytes are kept; ``None``: ``attachments/`` in ``state_dir`` (A1). Outside
    ``work_root``: no worker's tool may reach it."""
    max_bytes: Annotated[int, msgspec.Meta(ge=1)] = 10 * 1024 * 1024
    """The largest file ``attach`` accepts (``attachment_too_large`` beyond it)."""
    media_types: frozenset[str] = DEFAULT_MEDIA_TYPES
    """The media types ``attach`` accepts (``attachment_type_refused`` for any other)."""
    max_per_reply: Annotated[int, msgspec.Meta(ge=1)] = 16
    """The most distinct files one reply carries; ``attach`` past it is refused
    ``attachment_limit`` (A12). At most 64 (C13): a reply's ``result`` frame stays small."""
    fetch_bytes_per_second: Annotated[int, msgspec.Meta(ge=1024)] = 8 * 1024 * 1024
    """How fast one connection is sent attachment bytes (``fetch_attachment``)."""


class RetentionConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What is kept, and for how long (docs/design/retention.md)."""

    journal_days: Annotated[float, msgspec.Meta(gt=0)] = 7.0
    """A finished delivery's step journal is removed this long after its result was
    published, once that result is acknowledged (RT2)."""
    sweep_hours: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """How often ``serve`` looks for step journals past ``journal_days``."""
    idempotency_days: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """A finished delivery's idempotency record (its request fingerprint and result) is kept
    this long after its result was published (RT3); at least ``journal_days``."""
    forget_days: Annotated[float, msgspec.Meta(gt=0)] = 365.0
    """An expired delivery's id is kept in the expired-id filter this long after its result
    was published (RT4: a duplicate is ``delivery_expired``); at least ``idempotency_days``.
    After it, the same id would be admitted as new."""
    compact_hours: Annotated[float, msgspec.Meta(gt=0)] = 6.0
    """How often ``serve`` compacts the shared logs (RT6-RT10)."""
    compact_bytes_per_second: Annotated[int, msgspec.Meta(ge=0)] = 32 * 1024 * 1024
    """How fast a running server's compaction writes the new logs (RT10's byte budget), so a
    compaction never takes the disk from the journal's own appends; ``0``: as fast as it can
    (what ``pi-runtime journal compact`` does, with no server running)."""


class MetricsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where ``serve`` answers ``GET /metrics`` (docs/design/operations.md "Metrics")."""

    listen: str | None = None
    """``HOST:PORT`` (``127.0.0.1:9464``); ``None``: no metrics listener. A non-loopback
    address needs TLS (``serve --tls-cert``, which this listener then speaks too) or
    ``serve --insecure-bind`` (the metrics have no token)."""
    page: bool = True
    """Serve the operator page at ``/`` of the same listener (docs/design/operations.md "The
    operator page"): behind the access token, on loopback or over TLS only."""


class BackoffConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a turn waits out an unavailable provider (docs/design/retention.md PB1-PB4)."""

    enabled: bool = True
    """``false``: a provider failure ends the turn at once, as before."""
    first_seconds: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    """The first wait; each later one doubles, up to ``max_seconds``, with full jitter."""
    max_seconds: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    deadline_minutes: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """After its first failure a delivery waits at most this long, then ends with the
    provider's failure code."""
    max_attempts: Annotated[int, msgspec.Meta(ge=1)] = 12
    """A delivery's own failed tries before it ends with the provider's failure code."""
    notify: bool = False
    """PB5: send the room one ``text_update`` (:attr:`notify_text`) when a delivery parks."""
    notify_text: Annotated[str, msgspec.Meta(min_length=1, max_length=600)] = (
        "The model provider is unavailable right now; I will answer as soon as it is back."
    )


class RoomWorkerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the room worker is configured with. Build it, then :func:`validate_config`
    it (or :func:`load_config` a TOML file, which does both)."""

    state_dir: str = "state"
    work_root: str = "work"
    """Each room lane works in a stable directory below it; outside ``state_dir``
    (docs/design/boundaries.md)."""
    agent: Literal["fake", "pi"] = "fake"
    pi_home: str | None = None
    """Where the pinned Pi is installed (``agent = "pi"``); ``None``: the default location."""
    model: ModelConfig = ModelConfig()
    persona: str | None = None
    """Appended to the worker's system prompt; may say when to answer ``[[stay-silent]]``."""
    default_grants: frozenset[str] = DEFAULT_GRANTS
    rooms: dict[str, RoomConfig] | None = None
    """``None``: every valid room is served with ``default_grants``; a table: only those rooms
    are served, every other room is refused ``room_refused`` (docs/design/lanes.md)."""
    tool_classes: dict[str, ReplayClass] = {}
    """Replay-class overrides; each only as strict as or stricter than the declared class."""
    thresholds: Thresholds = Thresholds()
    caps: Caps = Caps()
    server: ServerConfig = ServerConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    store: StoreConfig = StoreConfig()
    """Task lanes only (``pi-runtime task``, the wire's task frames)."""
    attachments: AttachmentsConfig = AttachmentsConfig()
    retention: RetentionConfig = RetentionConfig()
    backoff: BackoffConfig = BackoffConfig()
    metrics: MetricsConfig = MetricsConfig()

    def attachment_root(self) -> Path:
        """The attachment root (A1): every part that writes or reads attachments asks here."""
        return attachment_root(self.state_dir, self.attachments.root)

    def check_served(self, room: str) -> str:
        """``room`` when it is served; else :class:`DeliveryError` with ``room_invalid`` (not
        a room id) or ``room_refused`` (a room the ``rooms`` table does not list)."""
        problem = room_problem(room)
        if problem is not None:
            raise DeliveryError(ReasonCode.ROOM_INVALID, problem)
        if self.rooms is not None and room not in self.rooms:
            raise DeliveryError(
                ReasonCode.ROOM_REFUSED, f"room {room!r} is not served by this configuration"
            )
        return room

    def standing_grants(self, room: str) -> frozenset[str]:
        """The room's own grants: the tools of its durable session. Raises like
        :meth:`check_served` for a room that is not served."""
        self.check_served(room)
        listed = None if self.rooms is None else self.rooms[room].grants
        return self.default_grants if listed is None else listed

    def grants_for(self, room: str, actor_id: str) -> frozenset[str] | None:
        """The tools a delivery by ``actor_id`` in ``room`` may use; ``None`` when the room is
        not served (an invalid id or a room the ``rooms`` table does not list)."""
        authority = self.authority_of(room, actor_id)
        return None if authority is None else authority[0]

    def authority_of(self, room: str, actor_id: str) -> tuple[frozenset[str], bool] | None:
        """:meth:`grants_for` and :meth:`is_privileged` with the room looked up once (every
        admission asks both); ``None`` when the room is not served."""
        try:
            standing = self.standing_grants(room)
        except DeliveryError:
            return None
        if self.rooms is None:
            return standing, False
        granted = standing | self.rooms[room].actors.get(actor_id, frozenset())
        return granted, not granted <= standing

    def is_privileged(self, room: str, actor_id: str) -> bool:
        """Whether the actor's grants go beyond the room's standing grants (docs/design/lanes.md):
        such a delivery runs in a one-shot session and is never steered into (or from) a room run.
        ``False`` for a room that is not served (it runs nothing)."""
        authority = self.authority_of(room, actor_id)
        return authority is not None and authority[1]

    def replay_classes(self) -> dict[str, ReplayClass]:
        """Every known tool's replay class: the declared class, or its (stricter) override.
        Hand it to the gate as the declared classes."""
        return {name: self.tool_classes.get(name, declared_class(name)) for name in KNOWN_TOOLS}


def declared_class(tool: str) -> ReplayClass:
    """The replay class the runtime declares for ``tool``; ``never`` for an unknown tool."""
    if tool in PI_TOOL_CLASSES:
        return PI_TOOL_CLASSES[tool]
    spec = RUNTIME_TOOLS.get(tool)
    return ReplayClass.NEVER if spec is None else spec.replay_class


# ------------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike[str]) -> RoomWorkerConfig:
    """Read, type-check and validate a TOML configuration file. Relative paths in it resolve
    against the file's directory. Raises :class:`ConfigError` naming the setting; for a file
    that cannot be read, is not a regular file, not UTF-8 or not TOML, ``setting`` is the
    file's path (C14)."""
    file = Path(path)
    try:
        data = tomllib.loads(_read_text(file))
    except OSError as exc:
        raise ConfigError(str(file), f"cannot read the configuration file: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            str(file), f"not UTF-8 text (byte {exc.start}): a TOML file is UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(file), f"not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(
            str(file), "not readable TOML: its arrays or tables are nested too deeply"
        ) from None
    return config_from_dict(data, base=file.absolute().parent)


def _read_text(file: Path) -> str:
    """The text of ``file``, a regular file (C14). Opened without waiting (a FIFO with no
    writer blocks a plain open forever) and checked before a byte is read (a device such as
    ``/dev/zero`` never ends, ``/dev/null`` would be a configuration of defaults)."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(str(file), "not a regular file: the configuration is a TOML file")
        with open(fd, "rb", closefd=False) as stream:
            return stream.read().decode("utf-8")
    finally:
        os.close(fd)


def config_from_dict(data: Mapping[str, Any], *, base: Path | None = None) -> RoomWorkerConfig:
    """Type-check and validate a configuration given as plain data (a TOML document's shape).
    Relative paths resolve against ``base`` (default: the working directory)."""
    return validate_config(_convert(data), base=base)


def validate_config(config: RoomWorkerConfig, *, base: Path | None = None) -> RoomWorkerConfig:
    """The configuration checked against C1…C15 (``docs/design/config.md``), with every field's
    type checked too (a Struct does not check types when built in Python) and every path made
    absolute against ``base`` (default: the working directory). Returns the normalised
    configuration to run with; raises :class:`ConfigError` naming the first invalid setting."""
    checked = _convert(msgspec.to_builtins(config, enc_hook=_enc_hook))
    checked = _resolve_paths(checked, Path.cwd() if base is None else base.absolute())
    for check in _CHECKS:
        check(checked)
    return checked


def _enc_hook(value: object) -> object:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    # fails every setting's type, so conversion names the setting it was given for
    return {"unsupported": type(value).__name__}


def _convert(data: object) -> RoomWorkerConfig:
    try:
        return msgspec.convert(data, RoomWorkerConfig)
    except msgspec.ValidationError as exc:
        setting, message = _locate(str(exc), data)
        raise ConfigError(setting, message) from None


# msgspec names a dict entry ``[...]``; these are the value types to find which entry failed
_DICT_VALUES: Final[Mapping[str, Any]] = {
    ".rooms": RoomConfig,
    ".rooms[...].actors": frozenset[str],
    ".tool_classes": ReplayClass,
}
_ERROR: Final = re.compile(r"(?P<what>.*?)(?: - at `(?:key` in `)?(?P<path>\$[^`]*)`)?", re.S)
_SEGMENT: Final = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+|\.\.\.)\]")
_UNKNOWN: Final = re.compile(r"Object contains unknown field `(?P<name>[^`]*)`")
_MISSING: Final = re.compile(r"Object missing required field `(?P<name>[^`]*)`")


def _locate(error: str, data: object) -> tuple[str, str]:
    """``(setting, message)`` for a msgspec validation error about ``data``: its ``$.a[...].b``
    path turned into a dotted setting name, dict entries named by their keys."""
    match = _ERROR.fullmatch(error)
    assert match is not None  # the pattern matches any text
    what, path = match["what"], match["path"] or "$"
    parts: list[str] = []
    shape = ""
    node: object = data
    for segment in _SEGMENT.finditer(path):
        field, index = segment.groups()
        if field is not None:
            parts.append(field)
            shape += f".{field}"
            node = node.get(field) if isinstance(node, Mapping) else None
        elif index == "...":
            key = _failing_key(node, _DICT_VALUES.get(shape))
            parts.append("[...]" if key is None else _key(key))
            shape += "[...]"
            node = node.get(key) if isinstance(node, Mapping) and key is not None else None
        else:
            what = f"item {index}: {what}"
            node = None
    named = _UNKNOWN.fullmatch(what) or _MISSING.fullmatch(what)
    if named is not None:
        parts.append(_key(named["name"]))
        what = "unknown setting" if named.re is _UNKNOWN else "required setting missing"
    if error.endswith(f"` in `{path}`"):
        what = f"a key: {what}"
    return (".".join(parts) or "(top level)"), what


def _failing_key(node: object, value_type: Any) -> str | None:
    """The first key of ``node`` whose value does not convert to ``value_type`` (msgspec stops
    at the first failing entry, in order)."""
    if not isinstance(node, Mapping) or value_type is None:
        return None
    for key, value in node.items():
        try:
            msgspec.convert(value, value_type)
        except msgspec.ValidationError:
            return str(key)
    return None


def _key(name: str) -> str:
    """One dotted-path component, quoted like a TOML key when it is not bare."""
    if _BARE_KEY.fullmatch(name):
        return name
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _resolve_paths(config: RoomWorkerConfig, base: Path) -> RoomWorkerConfig:
    def absolute(setting: str, value: str) -> str:
        if not value or "\0" in value:
            raise ConfigError(setting, "a path must be non-empty and contain no NUL character")
        try:
            expanded = Path(value).expanduser()
        except RuntimeError as exc:  # ~user unknown, or no home directory
            raise ConfigError(setting, f"cannot expand ~: {exc}") from None
        path = os.path.normpath(base / expanded)
        try:  # (a name of bytes that are not UTF-8 reaches Python as lone surrogates)
            path.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(
                setting,
                f"{path!r} is not valid UTF-8: the journal records paths as text; choose a "
                "directory whose path is UTF-8",
            ) from None
        return path

    attachments = config.attachments
    if attachments.root is not None:
        root = absolute("attachments.root", attachments.root)
        attachments = msgspec.structs.replace(attachments, root=root)
    model = config.model
    if model.scenario is not None:
        model = msgspec.structs.replace(model, scenario=absolute("model.scenario", model.scenario))
    return msgspec.structs.replace(
        config,
        model=model,
        attachments=attachments,
        state_dir=absolute("state_dir", config.state_dir),
        work_root=absolute("work_root", config.work_root),
        pi_home=None if config.pi_home is None else absolute("pi_home", config.pi_home),
    )


# ---------------------------------------------------------------------------- the checks
# One function per invariant of docs/design/config.md, run in this order; the first invalid
# setting is named. C1 (types, unknown settings) is _convert's.


def _check_directories(config: RoomWorkerConfig) -> None:
    """C2: the lanes' working directories and the state directory do not contain one another."""
    state, work = Path(config.state_dir).resolve(), Path(config.work_root).resolve()
    if work.is_relative_to(state) or state.is_relative_to(work):
        raise ConfigError(
            "work_root",
            f"{config.work_root} and the state directory {config.state_dir} must not contain "
            "one another: a worker's tools run below work_root and must not see the state "
            "directory; choose a directory beside it",
        )
    root = config.attachment_root().resolve()
    if root.is_relative_to(work) or work.is_relative_to(root):
        raise ConfigError(
            "attachments.root",
            f"{root} and work_root {config.work_root} must not contain one another: a "
            "worker's tools run below work_root and must not reach the attachments",
        )


def _check_model(config: RoomWorkerConfig) -> None:
    """C3: a usable model route."""
    model = config.model
    for name in ("provider", "model"):
        value = getattr(model, name)
        if not value or not value.isprintable() or any(c.isspace() for c in value):
            raise ConfigError(f"model.{name}", "must be non-empty, printable, without spaces")
    if model.base_url is not None:
        if not model.base_url.isprintable() or any(c.isspace() for c in model.base_url):
            raise ConfigError(  # urlsplit drops \t \r \n silently, and keeps \x00 (C3)
                "model.base_url", "must be printable, without spaces or control characters"
            )
        try:
            url = urlsplit(model.base_url)
            host = url.hostname
            url.port  # noqa: B018 (raises for a port out of range, as every later reader would)
        except ValueError:
            url, host = urlsplit(""), None
        if url.scheme not in ("http", "https") or not host:
            raise ConfigError(
                "model.base_url",
                "must be an http:// or https:// URL with a host (and a port from 0 to 65535)",
            )
    if model.scenario is not None and model.base_url is not None:
        raise ConfigError(
            "model.scenario", "is for the runtime's own scripted model: set no model.base_url"
        )
    for name in ("context_window", "max_tokens"):
        if getattr(model, name) < 1:
            raise ConfigError(f"model.{name}", "must be at least 1")
    if model.max_tokens > model.context_window:
        raise ConfigError("model.max_tokens", "must not exceed model.context_window")


def _check_no_secret(config: RoomWorkerConfig) -> None:
    """C4: no secret in the configuration: the key is named by its variable; the URL carries
    no credentials. The value is never echoed: it may be the key itself."""
    model = config.model
    if model.api_key_env is not None and not _ENV_NAME.fullmatch(model.api_key_env):
        raise ConfigError(
            "model.api_key_env",
            "must be the NAME of an environment variable (upper-case letters, digits and _, "
            "such as OPENAI_API_KEY), never the key itself",
        )
    if model.base_url is not None:
        url = urlsplit(model.base_url)  # C3 parsed it
        secret = any(
            _SECRET_PARAM.search(name) for name, _ in parse_qsl(url.query, keep_blank_values=True)
        )
        if url.username is not None or url.password is not None or secret:
            raise ConfigError(
                "model.base_url",
                "must not carry credentials (in its user part or a query parameter such as "
                "?key=); put the key in an environment variable and name it in "
                "model.api_key_env",
            )
    if config.store.url is not None and _dsn_has_password(config.store.url):
        raise ConfigError(
            "store.url",
            "must not carry a password; give it to libpq through PGPASSWORD, ~/.pgpass or a "
            "service file",
        )


_SECRET_PARAM: Final = re.compile(
    r"key|token|secret|passw|pwd|sig|auth|credential|session", re.IGNORECASE
)
"""A query parameter of ``model.base_url`` whose name says it carries a secret (C4)."""


def _dsn_has_password(dsn: str) -> bool:
    """Whether a PostgreSQL DSN (a URI or ``key=value`` pairs) holds a password (an empty
    one, as in ``postgresql://user:@host/db``, is none)."""
    if dsn.startswith(("postgresql://", "postgres://")):
        url = urlsplit(dsn)
        query = parse_qs(url.query)
        return bool(url.password) or any(query.get(key) for key in ("password", "sslpassword"))
    return re.search(r"(?:^|\s)(?:ssl)?password\s*=\s*(?:'[^']|[^\s'])", dsn) is not None


_URL_USERINFO: Final = r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:]*):"
_KEY: Final = r"(?P<head>password\s*=\s*)"
_PASSWORDS: Final = (
    re.compile(_URL_USERINFO + r"\S*@"),
    re.compile(_KEY + r"""(?:\*\*\*(?=[\s'";,)]|$)|'[^\n]*|\S*)""", re.I),
)
"""In text: a URL's password up to the last ``@`` before a space; a ``password=`` value up
to a space, or, quoted, the rest of its line (where a quoted value ends cannot be told once
the text quoted it again); one already hidden (``***``) stays as it is."""
_PASSWORDS_IN_VALUE: Final = (
    re.compile(_URL_USERINFO + r".*@", re.S),
    re.compile(_KEY + r"(?:(?:'(?:[^'\\]|\\.)*'?)+|\S*)", re.I | re.S),
)
"""In one argument as typed: a URL's password up to its last ``@``, spaces too; a quoted
``password=`` value where libpq ends it."""


def redact_passwords(text: str, *, one_value: bool = False) -> str:
    """``text`` with every password a DSN in it may carry replaced by ``***``: a URL's
    ``user:password@`` (up to its last ``@``) and any ``…password=value`` (a libpq pair, quoted
    or not, a URL's query, ``PGPASSWORD=``), for text that quotes what a user typed (C4,
    docs/design/operations.md O17). Generous: what cannot be told from a password is hidden
    too. ``one_value``: ``text`` is one argument as typed, so a URL's password may hold
    spaces and a quoted one ends where libpq ends it. (The PostgreSQL store's own messages
    use ``redact_dsn``, which parses the DSN.)"""
    url, pair = _PASSWORDS_IN_VALUE if one_value else _PASSWORDS
    return pair.sub(r"\g<head>***", url.sub(r"\g<head>:***@", text))


def _check_persona(config: RoomWorkerConfig) -> None:
    """C5: a persona is non-empty text that fits one command-line argument."""
    persona = config.persona
    if persona is None:
        return
    if not persona.strip():
        raise ConfigError("persona", "is empty; omit it for no persona")
    if "\0" in persona:
        raise ConfigError("persona", "must not contain a NUL character")
    if len(persona.encode("utf-8", "surrogatepass")) > PERSONA_MAX_BYTES:
        raise ConfigError("persona", f"is longer than {PERSONA_MAX_BYTES} bytes (UTF-8)")


def _check_tools(setting: str, tools: frozenset[str]) -> None:
    unknown = sorted(tools - KNOWN_TOOLS)
    if unknown:
        raise ConfigError(
            setting,
            f"unknown tool {', '.join(map(repr, unknown))}; known tools: "
            f"{', '.join(sorted(KNOWN_TOOLS))}",
        )


def _check_rooms(config: RoomWorkerConfig) -> None:
    """C6: a rooms table lists at least one room, each a valid room id; actor ids are valid
    author ids."""
    if config.rooms is None:
        return
    if not config.rooms:
        raise ConfigError("rooms", "lists no room; omit it to serve every valid room")
    for room, settings in config.rooms.items():
        problem = room_problem(room)
        if problem is not None:
            raise ConfigError(f"rooms.{_key(room)}", problem)
        for actor in settings.actors:
            if not 0 < len(actor) <= MAX_ACTOR_ID or not actor.isprintable():
                raise ConfigError(
                    f"rooms.{_key(room)}.actors.{_key(actor)}",
                    f"an actor id is 1 to {MAX_ACTOR_ID} printable characters",
                )


def _check_grants(config: RoomWorkerConfig) -> None:
    """C7: every grant names a known tool."""
    _check_tools("default_grants", config.default_grants)
    for room, settings in (config.rooms or {}).items():
        if settings.grants is not None:
            _check_tools(f"rooms.{_key(room)}.grants", settings.grants)
        for actor, tools in settings.actors.items():
            _check_tools(f"rooms.{_key(room)}.actors.{_key(actor)}", tools)


def _check_tool_classes(config: RoomWorkerConfig) -> None:
    """C8: a replay-class override names a known tool and is at least as strict as declared."""
    for tool, cls in config.tool_classes.items():
        setting = f"tool_classes.{_key(tool)}"
        _check_tools(setting, frozenset({tool}))
        declared = declared_class(tool)
        if cls.strictness < declared.strictness:
            raise ConfigError(
                setting,
                f"{tool} is declared {declared}; an override may only make it stricter "
                "(safe < receipt < never): a looser class could let a crash re-run a tool "
                "that has effects",
            )


def _check_threshold_values(config: RoomWorkerConfig) -> None:
    """C9: every threshold is finite and more than 0 (the drain timeout: 0 or more)."""
    for field in msgspec.structs.fields(Thresholds):
        value = getattr(config.thresholds, field.name)
        zero_ok = field.name == "drain_timeout_seconds"
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            bound = "0 or more" if zero_ok else "more than 0"
            raise ConfigError(f"thresholds.{field.name}", f"must be a finite number, {bound}")


_LONGEST_DAYS: Final = 36_500
"""A hundred years: the longest time a setting may give (C9)."""
_UNITS: Final = {"_seconds": 86_400.0, "_minutes": 1_440.0, "_hours": 24.0, "_days": 1.0}
"""Each time setting's unit, by its name's ending, in units per day."""
_TIMED: Final = ("thresholds", "store", "server", "retention", "backoff")
"""The tables whose times C9 bounds (``[watchdog]``'s are WD9's, checked when task lanes
start)."""


def _check_times(config: RoomWorkerConfig) -> None:
    """C9: every time of every table (but ``[watchdog]``) is finite and at most a hundred
    years: each becomes a wall-clock time in milliseconds in a record (a forget-after time,
    a park's next attempt, a lease's end), a 64-bit number; ``inf`` (TOML's "forever")
    would stop the server at its first compaction or park."""
    for table in _TIMED:
        settings = getattr(config, table)
        for field in msgspec.structs.fields(settings):
            unit = next((u for end, u in _UNITS.items() if field.name.endswith(end)), None)
            value = getattr(settings, field.name)
            if unit is None or not isinstance(value, int | float):
                continue
            longest = _LONGEST_DAYS * unit
            if not math.isfinite(value) or value > longest:
                raise ConfigError(
                    f"{table}.{field.name}",
                    f"must be a finite number, at most a hundred years ({longest:g})",
                )


def _check_threshold_order(config: RoomWorkerConfig) -> None:
    """C10: the timers fit inside the stall backstop: tick <= stall; abort grace < stall;
    typing refresh < stall; upstream inactivity < stall; keepalive < upstream inactivity."""
    t = config.thresholds
    rules = (
        ("tick_seconds", t.tick_seconds <= t.stall_seconds, "at most", "stall_seconds"),
        ("abort_grace_seconds", t.abort_grace_seconds < t.stall_seconds, "less than",
         "stall_seconds"),
        ("typing_refresh_seconds", t.typing_refresh_seconds < t.stall_seconds, "less than",
         "stall_seconds"),
        ("upstream_inactivity_seconds", t.upstream_inactivity_seconds < t.stall_seconds,
         "less than", "stall_seconds"),
        ("keepalive_seconds", t.keepalive_seconds < t.upstream_inactivity_seconds, "less than",
         "upstream_inactivity_seconds"),
    )  # fmt: skip
    for name, holds, relation, other in rules:
        if not holds:
            raise ConfigError(f"thresholds.{name}", f"must be {relation} thresholds.{other}")


def _check_caps(config: RoomWorkerConfig) -> None:
    """C11: every cap is at least 1."""
    for field in msgspec.structs.fields(Caps):
        if getattr(config.caps, field.name) < 1:
            raise ConfigError(f"caps.{field.name}", "must be at least 1")


_MOST: Final = 2**31 - 1
"""The largest value of an integer setting that :data:`_INTEGER_BOUNDS` does not name (C13)."""
_MOST_WHY: Final = (
    "every count, size and rate fits a signed 32-bit integer; a larger one is a typo, or a "
    '"no limit" this setting does not mean'
)
_INTEGER_BOUNDS: Final[Mapping[str, tuple[int, str]]] = {
    "model.context_window": (
        _MOST,
        "a token count, sent to Pi (models.json) and to the upstream as a JSON number",
    ),
    "model.max_tokens": (
        _MOST,
        "a token count, sent to Pi (models.json) and to the upstream in every request",
    ),
    "caps.max_live_workers": (
        4_194_304,
        "each worker is a process, and Linux runs at most 4194304 (PID_MAX_LIMIT)",
    ),
    "attachments.max_bytes": (2**30, "1 GiB: an attached file is read whole into memory"),
    "attachments.max_per_reply": (
        64,
        "every file is named in the reply's result frame, which must stay far below a "
        "client's frame limit (attachments.md A12)",
    ),
    "caps.text_update_chars": (
        2**24,
        "a text update is sent as one frame, which must fit server.max_frame_bytes (at most "
        "2**28 bytes, C15)",
    ),
    "server.max_frame_bytes": (
        2**28,
        "256 MiB: a frame is held whole in memory, and one of four times this is read before "
        "the connection is closed",
    ),
}
"""Integer settings whose bound is not :data:`_MOST`, or that say why it is theirs."""


def _check_integers(config: RoomWorkerConfig) -> None:
    """C13: every integer setting (but ``[watchdog]``'s, WD9's) is at most its bound: each
    ends up in a C call (a read size), a JSON number another program reads (Pi's
    ``models.json``, the upstream's request) or a count of processes or bytes in memory."""
    for table in msgspec.structs.fields(RoomWorkerConfig):
        settings = getattr(config, table.name)
        if table.name == "watchdog" or not isinstance(settings, msgspec.Struct):
            continue
        for field in msgspec.structs.fields(settings):
            value = getattr(settings, field.name)
            if type(value) is not int:  # (a bool is an int too)
                continue
            setting = f"{table.name}.{field.name}"
            bound, why = _INTEGER_BOUNDS.get(setting, (_MOST, _MOST_WHY))
            if value > bound:
                raise ConfigError(setting, f"must be at most {bound} ({why})")


def _check_result_frame(config: RoomWorkerConfig) -> None:
    """C15: a reply's ``result`` frame at its largest leaves at least half of
    ``[server] max_frame_bytes`` for the reply's text (protocol.md P14); a ``text_update``
    frame at its largest fits the bound."""
    frame = config.server.max_frame_bytes
    attachments = config.attachments
    room = least_room_for_text(
        max_frame_bytes=frame,
        max_per_reply=attachments.max_per_reply,
        media_types=attachments.media_types,
        max_bytes=attachments.max_bytes,
    )
    if room < frame // 2:
        raise ConfigError(
            "server.max_frame_bytes",
            f"{frame} leaves {max(room, 0)} bytes of a reply's result frame for its text once "
            f"its attachments.max_per_reply = {attachments.max_per_reply} attachments and ids "
            "are at their longest; it must leave at least half: raise server.max_frame_bytes "
            "or lower attachments.max_per_reply",
        )
    update = largest_update_bytes(config.caps.text_update_chars)
    if update > frame:
        raise ConfigError(
            "caps.text_update_chars",
            f"{config.caps.text_update_chars} characters make a text_update frame of up to "
            f"{update} bytes, more than server.max_frame_bytes = {frame}: lower it or raise "
            "server.max_frame_bytes",
        )


def _check_backoff(config: RoomWorkerConfig) -> None:
    """PB2: the first wait is at most the longest."""
    if config.backoff.first_seconds > config.backoff.max_seconds:
        raise ConfigError("backoff.first_seconds", "must be at most backoff.max_seconds")


def metrics_address(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as a host and a port; ``ConfigError`` naming
    ``metrics.listen`` when it is not one."""
    host, sep, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    # ASCII digits only: "²" is a digit int() refuses (a traceback), an Arabic-Indic one a
    # digit it takes (another port than the operator sees)
    digits = port.isascii() and port.isdigit()
    if not sep or not host or not digits or not 0 <= int(port) <= 65535:
        raise ConfigError("metrics.listen", f"{listen!r} is not HOST:PORT (127.0.0.1:9464)")
    return host, int(port)


def _check_metrics(config: RoomWorkerConfig) -> None:
    if config.metrics.listen is not None:
        metrics_address(config.metrics.listen)


def _check_retention(config: RoomWorkerConfig) -> None:
    """RT3, RT4: an idempotency record outlives its step journal; an expired id its record."""
    retention = config.retention
    if retention.idempotency_days < retention.journal_days:
        raise ConfigError("retention.idempotency_days", "must be at least retention.journal_days")
    if retention.forget_days < retention.idempotency_days:
        raise ConfigError("retention.forget_days", "must be at least retention.idempotency_days")


_CHECKS: Final = (
    _check_directories,
    _check_model,
    _check_no_secret,
    _check_persona,
    _check_rooms,
    _check_grants,
    _check_tool_classes,
    _check_threshold_values,
    _check_times,
    _check_threshold_order,
    _check_caps,
    _check_integers,
    _check_result_frame,
    _check_retention,
    _check_backoff,
    _check_metrics,
)
