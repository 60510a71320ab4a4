"""How a task's view and its events read for people (``task show``, ``task run``)."""

from __future__ import annotations

import json
from typing import Any

from .._tasks._policy import threshold_lines
from .._tasks._watchdog import Phase, WatchdogPolicy
from ._base import seconds_text, silence_text, snippet


def _thresholds(view: dict[str, Any], production: dict[str, Any] | None) -> list[str]:
    data = production or {}
    base = WatchdogPolicy(
        soft_seconds=float(data.get("soft_seconds", 300.0)),
        hard_seconds={
            Phase(p): float(s)
            for p, s in (data.get("hard_seconds") or {"provider": 900, "generation": 900}).items()
        },
        grace_seconds=float(data.get("grace_seconds", 120.0)),
    )
    scale = float(view.get("timescale") or 1.0)
    return threshold_lines(base.scaled(scale) if scale != 1.0 else base, base)


def task_lines(view: dict[str, Any], production: dict[str, Any] | None) -> list[str]:
    """``task show`` for people: every field of the view, then the thresholds."""
    process = view.get("process")
    budget = view.get("budget") or {}
    receipts = view.get("receipts") or []
    route = view.get("route") or {}
    ended = view.get("ended")
    rows: list[tuple[str, str]] = [
        ("state", str(view.get("state"))),
        ("ids", f"generation {view.get('generation')}, attempt {view.get('attempt')}, "
                f"fence {view.get('fence')}"),
        ("epochs", f"process epoch {view.get('process_epoch')}, continuation epoch "
                   f"{view.get('continuation_epoch')}"),
        ("session", f"{view.get('session_path')}"
                    + (f" (id {view['session_id']})" if view.get("session_id") else "")),
        ("route", f"{route.get('provider', '?')}/{route.get('model', '?')}"),
        ("worktree", str(view.get("worktree"))),
        ("process", "none (no live worker)" if not process else
         f"pid {process.get('pid')}, start time {process.get('start_time')}, "
         f"boot id {process.get('boot_id')}, nonce {process.get('nonce')}"),
        ("classification", str(view.get("classification"))),
        ("phase", str(view.get("phase"))),
        ("progress", f"seq {view.get('progress_seq')}, silence {silence_text(view)}"),
        ("soft threshold", f"{seconds_text(view.get('soft_seconds'))}; probe: "
                           f"{view.get('probe') or 'none sent'}"),
        ("hard threshold", (seconds_text(view.get("hard_seconds")) + " (this phase)")
         if view.get("hard_seconds") is not None else "none for this phase"),
        ("grace", f"{seconds_text(view.get('grace_seconds'))} ({view.get('grace')})"),
        ("receipts", str(len(receipts)) if receipts else "none"),
    ]  # fmt: skip
    for receipt in receipts:
        verdict = "accepted" if receipt.get("accepted") else receipt.get("verdict", "late")
        detail = snippet(receipt.get("detail"))
        rows.append(("", f"{receipt.get('kind')} {verdict} (epoch {receipt.get('epoch')}, "
                         f"intent {receipt.get('intent_id')}){detail}"))  # fmt: skip
    rows += [
        ("prompt marker", str(view.get("prompt_marker") or "none")),
        ("budget", f"epochs used {budget.get('epochs_used')}, left {budget.get('epochs_left')}"
                   f" (granted {budget.get('granted_epochs')}); seconds used "
                   f"{budget.get('seconds_used')}, left {budget.get('seconds_left')} "
                   f"(granted {budget.get('granted_seconds')})"),
        ("pending action", str(view.get("pending_action") or "none")),
        ("hold reason", str(view.get("hold_reason") or "none")),
        ("next action", str(view.get("next_action"))),
        ("time scale", f"x{float(view.get('timescale') or 1.0):g}"),
        ("telemetry", ", ".join(f"{k} {v}" for k, v in (view.get("telemetry") or {}).items())
         or "none"),
    ]  # fmt: skip
    costs = view.get("costs")
    if costs:
        rows.append(("costs", costs_text(costs)))
    if ended:
        text = str(ended.get("state"))
        if ended.get("code"):
            text += f" ({ended['code']})"
        if ended.get("detail"):
            text += f": {ended['detail']}"
        rows.append(("ended", text))
        candidate = ended.get("candidate")
        if candidate:
            where = f"{candidate.get('kind')} {candidate.get('ref')}"
            rows.append(("candidate", f"{where} (manifest {candidate.get('manifest_digest')})"))
        if ended.get("validation"):
            rows.append(("validation", json.dumps(ended["validation"], sort_keys=True)))
    else:
        rows.append(("ended", "no"))
    width = max(len(name) for name, _ in rows)
    lines = [f"task {view.get('task_id')}"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in rows]
    lines += [f"  {line}" for line in _thresholds(view, production)]
    return lines


def costs_text(costs: dict[str, Any]) -> str:
    """``task: 2 answers, 310+95 tokens; continuation: …; 0 requests without answer``."""
    parts = []
    for bucket in ("task", "continuation"):
        c = costs.get(bucket) or {}
        parts.append(
            f"{bucket}: {c.get('answers', 0)} answers, "
            f"{c.get('prompt_tokens', 0)}+{c.get('completion_tokens', 0)} tokens"
        )
    parts.append(f"{costs.get('requests_without_answer', 0)} requests without answer")
    return "; ".join(parts)


def event_line(event: dict[str, Any], scale: float) -> str:
    text = (
        f"task {event.get('task_id')}: {event.get('classification')} state={event.get('state')} "
        f"phase={event.get('phase')} epoch={event.get('process_epoch')}"
    )
    if event.get("hold_reason"):
        text += f" hold={event['hold_reason']}"
    if event.get("ended"):
        text += f" ended={event['ended']}"
    if scale != 1.0:
        text = f"[UNSAFE TEST TIMESCALE x{scale:g}] {text}"
    return text
