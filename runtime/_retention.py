"""The retention settings a state directory is served with (docs/design/retention.md RT14).

A host that runs retention on a file store records what decides what a pass removes — the
``[retention]`` days and the task work root — in ``retention.json``. A pass run with no
server (``journal compact``, ``task forget``) reads it under the state directory's lock and
acts with it: it never guesses the days a server that is not running was configured with.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Final, cast

import msgspec

from ._config import RetentionConfig, RoomWorkerConfig
from ._errors import ConfigError, JournalError, ReasonCode
from ._journal._interface import JournalStore, LeaseStore
from ._journal._store import Store, require_journal

__all__ = [
    "SETTINGS_DOC",
    "RetentionSettings",
    "check_settings",
    "follow_forget_days",
    "join_settings",
    "offline_settings",
    "read_settings",
    "record_settings",
    "recorded_settings",
]

SETTINGS_DOC: Final = "retention.json"
DAY_MS: Final = 86_400_000

_DECIDING: Final = ("journal_days", "idempotency_days", "forget_days")
"""The ``[retention]`` settings that decide what a pass removes (the others say when)."""


class RetentionSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a retention pass acts with."""

    retention: RetentionConfig
    task_work_root: str
    """The absolute directory the task lanes' work directories are below."""

    @classmethod
    def of(cls, config: RoomWorkerConfig) -> RetentionSettings:
        """A validated configuration's (its ``work_root`` is absolute)."""
        task_root = Path(config.work_root) / "tasks"
        return cls(retention=config.retention, task_work_root=str(task_root))

    def disagreement(self, other: RetentionSettings) -> str | None:
        """The first setting by which ``other`` would remove differently, both values said."""
        for name in _DECIDING:
            mine, theirs = getattr(self.retention, name), getattr(other.retention, name)
            if mine != theirs:
                return f"[retention] {name} is {theirs:g} here, {mine:g} where recorded"
        if self.task_work_root != other.task_work_root:
            return (
                f"the task work root is {other.task_work_root} here, "
                f"{self.task_work_root} where recorded"
            )
        return None


class _Document(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    settings: RetentionSettings
    sha256: str


def _digest(settings: RetentionSettings) -> str:
    return hashlib.sha256(msgspec.json.encode(settings)).hexdigest()


def _encode(settings: RetentionSettings) -> bytes:
    return msgspec.json.encode(_Document(settings, _digest(settings)))


def _decode(data: bytes) -> RetentionSettings:
    damaged = JournalError(
        ReasonCode.JOURNAL_CORRUPT,
        f"{SETTINGS_DOC} is damaged: the retention settings the server ran with are unknown",
    )
    try:
        document = msgspec.json.decode(data, type=_Document)
    except msgspec.DecodeError as error:
        raise damaged from error
    if _digest(document.settings) != document.sha256:
        raise damaged
    return document.settings


async def record_settings(store: JournalStore, settings: RetentionSettings) -> None:
    """Record ``settings`` as the ones ``store``'s directory is served with (a write only
    when they changed): the room worker's, whose retention covers the whole directory. A
    damaged record is replaced: this host's are the ones in force."""
    data = _encode(settings)
    if await store.read_document(SETTINGS_DOC) != data:
        await store.write_document(SETTINGS_DOC, data)
    await follow_forget_days(store, settings.retention)


async def join_settings(store: JournalStore, settings: RetentionSettings) -> None:
    """A host that runs only task lanes on ``store`` (an embedded task service, a standalone
    ``task run``) acts with ``settings``: recorded when none are, else they must agree with
    the recorded ones — it never overrides the days a room server recorded (RT14 d)."""
    data = await store.read_document(SETTINGS_DOC)
    if data is None:
        await store.write_document(SETTINGS_DOC, _encode(settings))
    else:
        _refuse_disagreement(_decode(data), settings)
    await follow_forget_days(store, settings.retention)


async def follow_forget_days(store: JournalStore, retention: RetentionConfig) -> None:
    """Make a store's expired ids (the deliveries', the tasks') count with ``retention``'s
    ``forget_days`` before anything asks them (RT4): a host started with another
    ``forget_days`` than the one that wrote a file store's filter rewrites it, so that every
    id in it is held back ``forget_days`` from its own time — at once, not from the next
    expiry on — and those already past it are let go. Nothing is written when they count
    with it already (or hold nothing). On a shared store (RT11, RT13) the database records
    the count for every host: this host's start sets it."""
    forget_ms = int(retention.forget_days * DAY_MS)
    if not isinstance(store, Store):  # the only other store is a shared one
        await cast(LeaseStore, store).follow_forget_days(forget_ms)
        return
    if not store.expired.counts_with(forget_ms):
        await store.expire({}, forget_ms=forget_ms)
    if not store.expired_tasks.counts_with(forget_ms):
        await store.expire_tasks({}, forget_ms=forget_ms)


async def read_settings(store: JournalStore) -> RetentionSettings | None:
    """The settings recorded in ``store``'s directory, or ``None``, read through ``store``
    (under the state directory's lock when it is a file store it holds); a damaged record is
    ``journal_corrupt``."""
    data = await store.read_document(SETTINGS_DOC)
    return None if data is None else _decode(data)


def recorded_settings(state_dir: Path) -> RetentionSettings | None:
    """The settings recorded in ``state_dir``, or ``None``; a damaged record is
    ``journal_corrupt``. Read without the lock: whoever acts checks them again under it."""
    try:
        data = (state_dir / SETTINGS_DOC).read_bytes()
    except FileNotFoundError:
        return None
    return _decode(data)


def offline_settings(state_dir: Path, given: RetentionSettings | None) -> RetentionSettings:
    """What a pass with no server acts with: ``given`` (from ``--config``), else the settings
    recorded in ``state_dir``; refused ``retention_unknown`` when neither is there (RT14 a),
    ``state_dir_invalid`` when it holds no file-store journal.
    Read without the lock: each pass checks them again under it (:func:`check_settings`)."""
    require_journal(state_dir)
    if given is not None:
        return given
    recorded = recorded_settings(state_dir)
    if recorded is None:
        raise ConfigError(
            "retention",
            f"no server recorded its retention settings in {state_dir} ({SETTINGS_DOC}); "
            "pass --config with the configuration the server runs with",
            code=ReasonCode.RETENTION_UNKNOWN,
        )
    return recorded


async def check_settings(store: JournalStore, settings: RetentionSettings) -> None:
    """Under the state directory's lock (``store`` is open, no server runs): refuse
    ``settings`` when the recorded ones would remove differently (``retention_mismatch``) or
    are damaged (``journal_corrupt``); with none recorded, ``settings`` stand (RT14 b, c)."""
    data = await store.read_document(SETTINGS_DOC)
    if data is not None:
        _refuse_disagreement(_decode(data), settings)


def _refuse_disagreement(recorded: RetentionSettings, settings: RetentionSettings) -> None:
    if (why := recorded.disagreement(settings)) is not None:
        raise ConfigError(
            "retention",
            f"{why}: pass the configuration the server runs with, or start the server with "
            "this one (it records it)",
            code=ReasonCode.RETENTION_MISMATCH,
        )
