"""The watchdog policy of a configuration (WD9 of ``docs/design/watchdog.md``), and how the
unsafe test time scale is said loudly: in every log line, in ``status`` and in ``task show``.

:func:`watchdog_policy` checks the ``[watchdog]`` table at start: a breach raises
:class:`~runtime._errors.WatchdogConfigError` (``watchdog_config_invalid``) naming
``watchdog.<setting>``. Only ``--unsafe-test-timescale FACTOR`` divides every threshold by
FACTOR and lifts the 900 s floor, and then every log line says so (:func:`loud_logging`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any, Final

from .._config import RoomWorkerConfig, WatchdogConfig
from .._errors import WatchdogConfigError
from ._watchdog import Phase, WatchdogPolicy

__all__ = [
    "loud_logging",
    "policy_dict",
    "threshold_lines",
    "timescale_marker",
    "timescale_warning",
    "watchdog_policy",
]


_SETTINGS: Final = {
    "hard_seconds.provider": "hard_provider_seconds",
    "hard_seconds.generation": "hard_generation_seconds",
    "timescale": "unsafe_test_timescale",
}


def watchdog_policy(
    config: RoomWorkerConfig | WatchdogConfig, *, timescale: float = 1.0
) -> WatchdogPolicy:
    """The checked policy of ``config``'s ``[watchdog]`` table, divided by ``timescale`` when
    it is not 1 (the unsafe test time scale, which also lifts the 900 s floor). Raises
    :class:`WatchdogConfigError` naming the first setting that breaks a rule (WD9)."""
    table = config.watchdog if isinstance(config, RoomWorkerConfig) else config
    policy = WatchdogPolicy(
        soft_seconds=table.soft_seconds,
        hard_seconds={
            Phase.PROVIDER: table.hard_provider_seconds,
            Phase.GENERATION: table.hard_generation_seconds,
        },
        grace_seconds=table.grace_seconds,
        max_replacements=table.max_replacements,
        recovery_seconds=table.recovery_seconds,
    )
    if not (isinstance(timescale, int | float) and math.isfinite(timescale) and timescale >= 1):
        raise WatchdogConfigError(
            "unsafe_test_timescale", f"must be a finite number, at least 1, not {timescale!r}"
        )
    if timescale != 1.0:
        policy = policy.scaled(float(timescale))
    problems = policy.problems()
    if problems:
        setting, why = problems[0]
        name = _SETTINGS.get(setting, setting)
        prefix = "" if name == "unsafe_test_timescale" else "watchdog."
        raise WatchdogConfigError(prefix + name, why)
    return policy


def timescale_warning(policy: WatchdogPolicy) -> str | None:
    """The loud line every log and ``status`` carry under the unsafe time scale, else None."""
    if policy.timescale == 1.0:
        return None
    factor = f"{policy.timescale:g}"
    return (
        f"UNSAFE TEST TIMESCALE x{factor}: thresholds divided by {factor} "
        f"({_thresholds(policy)}); never use this in production"
    )


def timescale_marker(policy: WatchdogPolicy) -> str:
    """``[UNSAFE TEST TIMESCALE xF]``: what begins every log line under the time scale."""
    return f"[UNSAFE TEST TIMESCALE x{policy.timescale:g}]"


def _thresholds(policy: WatchdogPolicy) -> str:
    hard = ", ".join(f"{phase} {seconds:g} s" for phase, seconds in policy.hard_seconds.items())
    return f"soft {policy.soft_seconds:g} s, hard {hard}, grace {policy.grace_seconds:g} s"


def threshold_lines(policy: WatchdogPolicy, production: WatchdogPolicy) -> list[str]:
    """What ``task show`` prints about the clocks: the production thresholds, and under the
    unsafe time scale the scaled ones with the warning."""
    lines = [f"production thresholds: {_thresholds(production)}"]
    warning = timescale_warning(policy)
    if warning is not None:
        lines.append(f"in effect: {_thresholds(policy)}")
        lines.append(f"!!! {warning} !!!")
    return lines


class _Loud(logging.Filter):
    """Prefixes every record's message with the time-scale warning, once per record."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if "UNSAFE" not in str(record.msg) and "UNSAFE" not in record.getMessage():
            record.msg = f"{self.prefix} {record.msg}"
        return True


@contextlib.contextmanager
def loud_logging(policy: WatchdogPolicy) -> Iterator[None]:
    """Under the unsafe time scale, every log line of this process (every handler of the root
    logger) says so for the block: a line that does not already starts with
    ``[UNSAFE TEST TIMESCALE xF]``. Nothing happens at scale 1."""
    if policy.timescale == 1.0:
        yield
        return
    loud = _Loud(timescale_marker(policy))
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(loud)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(loud)


def policy_dict(policy: WatchdogPolicy) -> dict[str, Any]:
    """The thresholds and budgets of ``policy`` as plain data (``task show``'s production)."""
    return {k: v for k, v in policy.snapshot().items() if k in _SHOWN}


_SHOWN: Final = frozenset(
    {"soft_seconds", "hard_seconds", "grace_seconds", "max_replacements", "recovery_seconds"}
)
