"""The runtime's Prometheus metrics (docs/design/operations.md "Metrics"; issue #22).

One registry, :data:`REGISTRY` — the runtime's own, not ``prometheus_client``'s global one, so
an application embedding the runtime keeps its registry to itself — holding the metrics the
runtime's parts record into where the thing happens (a delivery admitted, a model answer
replayed, a record made durable), plus the process collector (CPU, memory, descriptors).
What is a state rather than an event — live lanes, connections, unacknowledged results, task
lanes by classification — is read when scraped, by the collector ``serve`` registers
(``runtime/_server/_metrics.py``); the exposition is ``prometheus_client``'s.

**Labels are bounded.** Every label value comes from a closed set: an outcome, a reason code,
a replay class, a classification, a tool name of the configuration's tools. Never a delivery
id, a room, a task id, message text or anything secret.

**Cheap where it is hot.** An increment or an observation is a lock and an add
(``prometheus_client``'s thread-safe value); the journal's writer threads observe their own
``fdatasync`` and batch sizes. Measurements read :func:`~runtime._clock.perf_seconds`, never
a clock a decision depends on. A scrape costs the same whatever the rooms the host knows
(docs/design/operations.md M8): the process collector counts the open descriptors — one per
room lane's log — without listing them (:class:`ProcessMetrics`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Final, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = [
    "DELIVERIES_ADMITTED",
    "DELIVERIES_FINISHED",
    "FIRST_TOKEN_SECONDS",
    "GC_PAUSE_SECONDS",
    "JOURNAL_APPEND_SECONDS",
    "JOURNAL_BATCH_RECORDS",
    "JOURNAL_FDATASYNC_SECONDS",
    "MODEL_REQUESTS",
    "PROCESS",
    "RECOVERY_ATTEMPTS",
    "RECOVERY_REFUSALS",
    "REGISTRY",
    "TASK_BUDGET_CHARGES",
    "TASK_CONTINUATIONS",
    "TASK_FENCES",
    "TASK_PROBES",
    "TOOL_CALLS",
    "TURN_SECONDS",
    "ProcessMetrics",
    "labelled",
    "open_descriptors",
]


def open_descriptors(fd_dir: str) -> int:
    """How many descriptors are open in the process of ``fd_dir`` (``/proc/<pid>/fd``): the
    size Linux gives the directory (since 6.2, the count it keeps), else — a size of 0, an
    older kernel — the entries listed, as ``prometheus_client`` counts them."""
    return os.stat(fd_dir).st_size or len(os.listdir(fd_dir))


class ProcessMetrics(ProcessCollector):
    """``prometheus_client``'s process collector — CPU, memory, start time, descriptors, the
    same metrics, read the same way — but for how it counts the open descriptors
    (:func:`open_descriptors`): the library lists ``/proc/self/fd``, and the serve process
    keeps a descriptor open per room lane's log, so every scrape listed one entry per room on
    the Trio thread (13 ms at 15,000 rooms; M8). The count Linux keeps is one fewer than the
    library's listing gave: that counted the descriptor it opened to list the others."""

    def collect(self) -> Iterable[Metric]:
        if not self._btime:
            return []
        proc = os.path.join(self._proc, str(self._pid()).strip())
        prefix = self._prefix
        result: list[Metric] = []
        try:
            with open(os.path.join(proc, "stat"), "rb") as stat:
                parts = stat.read().split(b")")[-1].split()
            result += [
                GaugeMetricFamily(
                    prefix + "virtual_memory_bytes",
                    "Virtual memory size in bytes.",
                    value=float(parts[20]),
                ),
                GaugeMetricFamily(
                    prefix + "resident_memory_bytes",
                    "Resident memory size in bytes.",
                    value=float(parts[21]) * self._pagesize,
                ),
                GaugeMetricFamily(
                    prefix + "start_time_seconds",
                    "Start time of the process since unix epoch in seconds.",
                    value=float(parts[19]) / self._ticks + self._btime,
                ),
                CounterMetricFamily(
                    prefix + "cpu_seconds_total",
                    "Total user and system CPU time spent in seconds.",
                    value=(float(parts[11]) + float(parts[12])) / self._ticks,
                ),
            ]
        except OSError:
            pass
        try:
            with open(os.path.join(proc, "limits"), "rb") as limits:
                most = next(line for line in limits if line.startswith(b"Max open file"))
            result += [
                GaugeMetricFamily(
                    prefix + "open_fds",
                    "Number of open file descriptors.",
                    value=open_descriptors(os.path.join(proc, "fd")),
                ),
                GaugeMetricFamily(
                    prefix + "max_fds",
                    "Maximum number of open file descriptors.",
                    value=float(most.split()[3]),
                ),
            ]
        except (OSError, StopIteration):
            pass
        return result


REGISTRY: Final = CollectorRegistry(auto_describe=True)
"""The runtime's registry: what ``GET /metrics`` exposes."""
PROCESS: Final = ProcessMetrics(registry=REGISTRY)
"""The process's CPU, memory and descriptors, in :data:`REGISTRY`."""

_TURN_BUCKETS: Final = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_DISK_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1,
)  # fmt: skip
_BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

DELIVERIES_ADMITTED: Final = Counter(
    "pi_runtime_deliveries_admitted",
    "Room deliveries admitted (durable) by this host; a duplicate is not counted.",
    registry=REGISTRY,
)
DELIVERIES_FINISHED: Final = Counter(
    "pi_runtime_deliveries_finished",
    "Room deliveries whose result this host published, by outcome.",
    ["outcome"],
    registry=REGISTRY,
)
TURN_SECONDS: Final = Histogram(
    "pi_runtime_turn_seconds",
    "A room turn, from its prompt to the worker's settle (Trio time).",
    buckets=_TURN_BUCKETS,
    registry=REGISTRY,
)
FIRST_TOKEN_SECONDS: Final = Histogram(
    "pi_runtime_first_token_seconds",
    "A room turn's time to its first streamed text (Trio time).",
    buckets=_TURN_BUCKETS,
    registry=REGISTRY,
)
MODEL_REQUESTS: Final = Counter(
    "pi_runtime_model_requests",
    "Model requests the gateway answered: from the upstream (source=upstream, paid) or "
    "from the step journal (source=journal, not asked again).",
    ["source"],
    registry=REGISTRY,
)
TOOL_CALLS: Final = Counter(
    "pi_runtime_tool_calls",
    "Tool intents the gate recorded, by tool and replay class.",
    ["tool", "replay_class"],
    registry=REGISTRY,
)
JOURNAL_APPEND_SECONDS: Final = Histogram(
    "pi_runtime_journal_append_seconds",
    "A journal append, from its hand-over to the writer until it is durable.",
    buckets=_DISK_BUCKETS,
    registry=REGISTRY,
)
JOURNAL_FDATASYNC_SECONDS: Final = Histogram(
    "pi_runtime_journal_fdatasync_seconds",
    "One fdatasync of a journal file by a writer thread.",
    buckets=_DISK_BUCKETS,
    registry=REGISTRY,
)
JOURNAL_BATCH_RECORDS: Final = Histogram(
    "pi_runtime_journal_batch_records",
    "Records made durable by one group commit (one write and fdatasync).",
    buckets=_BATCH_BUCKETS,
    registry=REGISTRY,
)
RECOVERY_ATTEMPTS: Final = Counter(
    "pi_runtime_recovery_attempts",
    "Room turns replayed after a worker or host died (each charged to its delivery).",
    registry=REGISTRY,
)
RECOVERY_REFUSALS: Final = Counter(
    "pi_runtime_recovery_refusals",
    "Room deliveries whose replay failed closed, by code.",
    ["code"],
    registry=REGISTRY,
)
TASK_PROBES: Final = Counter(
    "pi_runtime_task_probes",
    "Read-only probes the task watchdog sent, by purpose.",
    ["purpose"],
    registry=REGISTRY,
)
TASK_FENCES: Final = Counter(
    "pi_runtime_task_fences",
    "Task worker epochs fenced (every guard held past the hard threshold and its grace).",
    registry=REGISTRY,
)
TASK_CONTINUATIONS: Final = Counter(
    "pi_runtime_task_continuations",
    "Continuation prompts sent to task workers (completion, replacement, reply, unpark).",
    registry=REGISTRY,
)
TASK_BUDGET_CHARGES: Final = Counter(
    "pi_runtime_task_budget_charges",
    "Replacement epochs charged to task recovery budgets.",
    registry=REGISTRY,
)
GC_PAUSE_SECONDS: Final = Histogram(
    "pi_runtime_gc_pause_seconds",
    "Garbage-collector pauses of the serve process, by kind: young (generations 0-1), full "
    "(generation 2) or sweep (the frozen heap collected, docs/design/serve.md S7).",
    ["kind"],
    buckets=_DISK_BUCKETS,
    registry=REGISTRY,
)


_M = TypeVar("_M", Counter, Histogram)


@functools.lru_cache(maxsize=4096)
def labelled(metric: _M, *values: str) -> _M:
    """``metric.labels(*values)``, looked up once (the library's lookup takes a lock and
    builds a key each time; label sets are few and bounded, so they are kept)."""
    return metric.labels(*values)
