"""Journal records: the durable facts the runtime acts on.

Every record is a frozen, keyword-only :class:`msgspec.Struct` in one tagged
union; the tag (``"type"`` in the encoded form) is an explicit, stable string
that is never renamed or reused. Evolution rules (see ``docs/design/journal.md``):

* fields are only *added*, always with a default, never retyped or removed;
* unknown fields in a persisted record are ignored (an older reader may read a
  newer record of the *same* schema version);
* a new record type or a meaning change bumps :data:`SCHEMA_VERSION`; a reader
  refuses a log whose header names a version newer than its own
  (``journal_version_unsupported``) and any record whose tag it does not know
  (``journal_unknown_record``).

Persisted records never forbid unknown fields; inbound commands and
configuration do (they live elsewhere).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Final

import msgspec

__all__ = [
    "SCHEMA_VERSION",
    "AbsorbedInput",
    "Admission",
    "AttachmentRef",
    "Compacted",
    "ContinuationSent",
    "EpochFenced",
    "EpochLaunching",
    "EpochStarted",
    "Fingerprints",
    "Header",
    "LifecycleKind",
    "LifecycleReceipt",
    "LogKind",
    "ModelRequestIntent",
    "ModelResponse",
    "OutboxAction",
    "Outcome",
    "Parked",
    "Poison",
    "Record",
    "ReplayClass",
    "Result",
    "ResultAcked",
    "ResultPublished",
    "Settled",
    "StepAbandoned",
    "TaskEnded",
    "TaskReply",
    "TaskSubmitted",
    "ToolIntent",
    "ToolOutcome",
    "record_tag",
]

SCHEMA_VERSION: Final = 4
"""The journal schema this code writes and the newest it reads."""


class LogKind(enum.StrEnum):
    """What a log file holds; written into its header."""

    DELIVERY = "delivery"
    LANE = "lane"
    ADMISSIONS = "admissions"
    RESULTS = "results"


class ReplayClass(enum.StrEnum):
    """How a tool may be treated after a crash (docs/design/gate.md). Stricter wins."""

    SAFE = "safe"
    RECEIPT = "receipt"
    NEVER = "never"

    @property
    def strictness(self) -> int:
        return _STRICTNESS[self]

    @classmethod
    def stricter(cls, a: ReplayClass, b: ReplayClass) -> ReplayClass:
        """The stricter of a recorded and a declared class."""
        return a if a.strictness >= b.strictness else b


_STRICTNESS: Final = {ReplayClass.SAFE: 0, ReplayClass.RECEIPT: 1, ReplayClass.NEVER: 2}


class Outcome(enum.StrEnum):
    """How a delivery ended (docs/design/lanes.md)."""

    REPLY = "reply"
    ABSORBED = "absorbed"
    SILENT = "silent"
    CANCELLED = "cancelled"
    FAILED = "failed"


class LifecycleKind(enum.StrEnum):
    DONE = "done"
    FAIL = "fail"
    WAIT = "wait"
    ABORT = "abort"
    """An operator's ``task abort``."""
    OPERATOR_FAIL = "operator_fail"
    """An operator's ``task fail``."""


class _Record(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", gc=False):
    """Base of every journal record (not itself a record).

    ``gc=False`` (inherited): a record is immutable data decoded or built from plain values and
    never refers to itself, so it can be in no reference cycle; the cycle collector need not
    track it. Tens of thousands stay alive while deliveries are pending, and a full collection
    walks every tracked object (docs/design/performance.md "Garbage collection")."""


class Header(_Record, tag="header", frozen=True, kw_only=True):
    """First record of every log file."""

    schema_version: int
    kind: LogKind
    subject: str
    """The delivery id, lane key or log name this file belongs to."""
    created_ms: int


class Fingerprints(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The three fingerprints an admission pins (docs/design/journal.md)."""

    request: str
    """Over the canonical request, excluding channel history and display names."""
    authority: str
    """Over the grants that decided what the delivery may do."""
    settings: str
    """Over model route and parameters, tool names, schemas and replay classes,
    worker kind/version/install path and a digest of the persona text."""


class Admission(_Record, tag="admission", frozen=True, kw_only=True):
    """An admitted request, durable before it is ``accepted``."""

    delivery_id: str
    lane: str
    request: dict[str, Any]
    """The admitted request as received (canonical form)."""
    fingerprints: Fingerprints
    rendered_prompt: str
    """The prompt exactly as it will be sent to the worker."""
    session_path: str | None = None
    """Relative to the state directory."""
    session_leaf: str | None = None
    admitted_ms: int
    privileged: bool | None = None
    """Whether it was admitted privileged: it runs in a one-shot session (L6), so it warms
    no room (L3; kept by its :class:`Settled` record, docs/design/retention.md RT16).
    ``None``: written before this was recorded — the configuration decides, as it did."""


class ModelRequestIntent(_Record, tag="model_request", frozen=True, kw_only=True):
    """A model request is about to be answered (upstream or from the journal)."""

    step: int
    request_digest: str
    """sha256 of the canonical request body."""
    epoch: int


class ModelResponse(_Record, tag="model_response", frozen=True, kw_only=True):
    """A complete model response, durable before its terminal chunk is released."""

    step: int
    request_digest: str
    chunks: list[str]
    """The SSE ``data:`` payloads in order, exactly as relayed."""
    epoch: int


class ToolIntent(_Record, tag="tool_intent", frozen=True, kw_only=True):
    """A tool call is about to run; durable before it starts."""

    intent_id: str
    """Runtime-minted: ``<delivery key>:<log created_ms>:<journal seq>`` (``<delivery key>:<journal
    seq>`` before receipts R1, and in a log with no header); never minted twice, never the
    provider's id."""
    step: int
    tool_call_id: str
    name: str
    args: str
    """Canonical JSON of the arguments."""
    replay_class: ReplayClass
    epoch: int


class AttachmentRef(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A file the agent attached to its reply (docs/design/attachments.md): its bytes are in
    the attachment root under ``sha256``, durable before any record names them (A2)."""

    id: str
    """What a client fetches it by (``fetch_attachment``); opaque to clients."""
    name: str
    """The file's name as the reply shows it (no directory)."""
    media_type: str
    size: int
    sha256: str
    """Hex digest of the bytes: their name in the attachment root."""


class ToolOutcome(_Record, tag="tool_outcome", frozen=True, kw_only=True):
    """A tool's result exactly as handed to the model: its content blocks (text and image
    blocks, verbatim), Pi's ``details`` and the attachments it made, all handed back as they
    are on a replay (A6)."""

    intent_id: str
    tool_call_id: str
    content: list[dict[str, Any]]
    is_error: bool = False
    details: Any = None
    """Pi's ``details`` of the result (JSON), ``None`` when it had none."""
    attachments: list[AttachmentRef] = msgspec.field(default_factory=list)
    """The files an ``attach`` call added to the reply."""


class AbsorbedInput(_Record, tag="absorbed_input", frozen=True, kw_only=True):
    """A message steered into this delivery's run."""

    delivery_id: str
    """The absorbed delivery (not the owner)."""
    text: str
    first_step: int | None = None
    """The step whose model request first carried it; ``None`` until seen."""


class StepAbandoned(_Record, tag="step_abandoned", frozen=True, kw_only=True):
    step: int
    reason: str
    epoch: int


class Result(_Record, tag="result", frozen=True, kw_only=True):
    """How the delivery ended; written once, last."""

    outcome: Outcome
    text: str | None = None
    code: str | None = None
    absorbed_into: str | None = None
    session_leaf: str | None = None
    finished_ms: int
    attachments: list[AttachmentRef] = msgspec.field(default_factory=list)
    """A reply's attachments, in the order they were attached (A4)."""
    truncated: bool = False
    """``text`` is the beginning of a reply too long for a result frame (protocol.md P14)."""


class Poison(_Record, tag="poison", frozen=True, kw_only=True):
    """The poison document of a log whose write or sync failed."""

    log_path: str
    """Relative to the state directory."""
    good_length: int
    """The log was truncated back to this many bytes (its last good record)."""
    reason: str
    errno: int | None = None
    poisoned_ms: int
    owed: bytes = b""
    """The frame of the records the log had acknowledged through the sync log and its file
    lacked when it was poisoned (journal.md J5, J12): a reader appends it after
    ``good_length``. Empty for a log that owed nothing."""


class EpochLaunching(_Record, tag="epoch_launching", frozen=True, kw_only=True):
    """A room lane's intent to launch epoch ``epoch``, durable before the spawn
    (docs/design/workers.md W13): the nonce the worker will carry, and so its cgroup's name.
    A host that dies before the epoch's :class:`EpochStarted` leaves a tree only this
    record names; the next start kills it by the nonce."""

    epoch: int
    nonce: str
    boot_id: str
    """The boot the launch was on (``/proc/sys/kernel/random/boot_id``)."""
    launching_ms: int


class EpochStarted(_Record, tag="epoch_started", frozen=True, kw_only=True):
    epoch: int
    pid: int
    start_time: int
    """Process start time in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    boot_id: str
    nonce: str
    cgroup: str | None = None
    started_ms: int


class EpochFenced(_Record, tag="epoch_fenced", frozen=True, kw_only=True):
    epoch: int
    reason: str
    fenced_ms: int


class ContinuationSent(_Record, tag="continuation_sent", frozen=True, kw_only=True):
    epoch: int
    action_id: str
    marker: str
    prompt_version: int


class OutboxAction(_Record, tag="outbox_action", frozen=True, kw_only=True):
    action_id: str
    kind: str
    state: str
    """``reserved`` before the effect, ``done`` after it."""
    detail: dict[str, Any] = msgspec.field(default_factory=dict)


class LifecycleReceipt(_Record, tag="lifecycle_receipt", frozen=True, kw_only=True):
    task_id: str
    generation: int
    attempt: int
    fence: int
    epoch: int
    intent_id: str
    kind: LifecycleKind
    detail: str = ""
    accepted: bool = True
    """False: recorded as late evidence, never a disposition."""
    verdict: str = ""
    """The kernel's verdict (``accepted``, ``late_epoch``, ``late_terminal``)."""


class ResultPublished(_Record, tag="result_published", frozen=True, kw_only=True):
    """A result in the server's outbox, numbered by ``seq``."""

    seq: int
    delivery_id: str
    room: str
    outcome: Outcome
    text: str | None = None
    code: str | None = None
    absorbed_into: str | None = None
    attachments: list[AttachmentRef] = msgspec.field(default_factory=list)
    published_ms: int = 0
    """When it was published (wall clock); 0 in a record written before this was kept."""
    truncated: bool = False
    """``text`` is the beginning of a reply too long for a result frame (protocol.md P14)."""


class ResultAcked(_Record, tag="result_acked", frozen=True, kw_only=True):
    """Every result up to ``seq`` was acknowledged (cumulative)."""

    seq: int


class Settled(_Record, tag="settled", frozen=True, kw_only=True):
    """A finished delivery's idempotency record (docs/design/retention.md RT3), written by a
    compaction of the admission log in place of its :class:`Admission` once its step journal
    has gone: what a duplicate is answered from (its result stays in the result log)."""

    delivery_id: str
    room: str
    request: str
    """The request fingerprint (:attr:`Fingerprints.request`): a different request under
    the same id is still a ``delivery_conflict``."""
    admitted_ms: int
    privileged: bool | None = None
    """Its admission's (:attr:`Admission.privileged`): a privileged delivery's record does
    not warm its room at a start (L3, RT16). ``None``: not known (written before this was
    kept, or slimmed from an admission that did not say) — it warms, as it did."""


class Parked(_Record, tag="parked", frozen=True, kw_only=True):
    """A delivery's turn met an unavailable provider and waits to be tried again, the same
    turn from its journal (docs/design/retention.md PB1-PB4): the schedule is durable, so a
    restart resumes it at ``next_attempt_ms`` instead of failing or charging it."""

    attempt: int
    """Its own failed tries so far (a park the route's breaker decided, with no try of its
    own, repeats the count)."""
    first_failure_ms: int
    """Wall clock of its first failure: the deadline runs from here."""
    next_attempt_ms: int
    status: int | None = None
    """The provider's HTTP status (``None``: no response), or ``None`` for a breaker's park."""
    by_route: bool = False
    """Parked because the route's breaker was open, not by a failure of its own."""
    code: str
    """What it ends with past the deadline or the attempts (``model_failed``,
    ``usage_limit_reached``)."""
    route_failures: int = 0
    """The route's failures in a row when this was recorded — the exponent of the breaker's
    next wait — so a restart's breaker goes on from there instead of from 5 s (PB2); 0 in a
    record written before it was kept (the delivery's ``attempt`` stands in)."""
    deadline_minutes: float | None = None
    """The episode's deadline (``[backoff] deadline_minutes`` when it first failed; PB3, PB7):
    every park of an episode repeats its first one's, so a restart with another configuration
    neither ends it sooner nor keeps it longer. ``None`` in a record written before it was
    kept: the configuration of the host deciding stands in."""
    max_attempts: int | None = None
    """The episode's ``[backoff] max_attempts`` when it first failed (PB3, PB7), as
    :attr:`deadline_minutes`; ``None`` in a record written before it was kept."""


class Compacted(_Record, tag="compacted", frozen=True, kw_only=True):
    """Second record of a shared log a compaction rewrote (RT6, RT7): what it left out."""

    compacted_ms: int
    removed: int
    """Records of the previous file not carried over."""
    last_seq: int = 0
    """In the result log: the last seq published before the compaction (RT8: the next
    result is numbered after it, whatever was removed)."""


class TaskSubmitted(_Record, tag="task_submitted", frozen=True, kw_only=True):
    """A task lane's admission (docs/design/watchdog.md): the task, its worktree and its frozen
    route."""

    task_id: str
    prompt: str
    worktree: str
    """Absolute path of the worktree the worker works in (its stable cwd)."""
    grants: list[str]
    session_path: str
    """Relative to the state directory."""
    route: dict[str, Any]
    """The frozen route snapshot (provider, model, endpoint; never a key)."""
    generation: int = 1
    attempt: int = 1
    validation: list[str] = msgspec.field(default_factory=list)
    """A command whose passing receipt Done needs (empty: none)."""
    validation_timeout: float = 600.0
    """Seconds the validation command may run (killed and not passed after them)."""
    submitted_ms: int = 0
    policy: dict[str, Any] = msgspec.field(default_factory=dict)
    """The watchdog policy frozen at submission (thresholds, grace, budgets: WD14); a new
    configuration applies to new tasks only. Empty in a log written before it was frozen."""


class TaskReply(_Record, tag="task_reply", frozen=True, kw_only=True):
    """The correlated reply that wakes an accepted ``task_wait``."""

    correlation: str
    text: str


class TaskEnded(_Record, tag="task_ended", frozen=True, kw_only=True):
    """A task's final state: done (with its evidence), failed or aborted."""

    state: str
    code: str | None = None
    detail: str = ""
    manifest_digest: str | None = None
    candidate: dict[str, Any] | None = None
    validation: dict[str, Any] | None = None
    ended_ms: int = 0
    costs: dict[str, Any] | None = None
    """The task's model answers and tokens, the original work and its continuations apart
    (:func:`runtime._tasks._state.inference_costs`)."""


Record = (
    Header
    | Admission
    | ModelRequestIntent
    | ModelResponse
    | ToolIntent
    | ToolOutcome
    | AbsorbedInput
    | StepAbandoned
    | Result
    | Poison
    | EpochLaunching
    | EpochStarted
    | EpochFenced
    | ContinuationSent
    | OutboxAction
    | LifecycleReceipt
    | ResultPublished
    | ResultAcked
    | Settled
    | Compacted
    | Parked
    | TaskSubmitted
    | TaskReply
    | TaskEnded
)
"""Every journal record type."""

RECORD_TYPES: Final[tuple[type[_Record], ...]] = Record.__args__
KNOWN_TAGS: Final = frozenset(str(t.__struct_config__.tag) for t in RECORD_TYPES)


def ends_at(records: Iterable[Record], ended_ms: int) -> bool:
    """Whether a task lane log's ``records`` end with the end of the task that ended at
    ``ended_ms`` (its last ``TaskEnded``): a later task under the id would follow it
    (retention.md RT20)."""
    ends = [r.ended_ms for r in records if isinstance(r, TaskEnded)]
    return bool(ends) and ends[-1] == ended_ms


def record_tag(record: Record) -> str:
    """The stable tag of a record."""
    return str(type(record).__struct_config__.tag)
