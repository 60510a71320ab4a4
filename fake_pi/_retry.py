"""Which model errors Pi retries by itself (mirrors Pi 1.6.0's auto-retry rules).

Pi retries an assistant reply that ended in ``error`` when its message matches
a transient-failure pattern and no account-limit pattern, up to
``retry.maxRetries`` times, waiting ``retry.baseDelayMs * 2**(attempt-1)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from runtime.worker_kit import PROVIDER_LIMIT_PATTERNS

__all__ = ["RetrySettings", "is_retryable"]

_NON_RETRYABLE: Final = re.compile("|".join(PROVIDER_LIMIT_PATTERNS), re.IGNORECASE)
_RETRYABLE: Final = re.compile(
    "|".join(
        [
            "overloaded",
            "server_busy",
            "servers are currently busy",
            "currently experiencing high demand",
            "model is at capacity",
            "rate.?limit",
            "too many requests",
            r"(?<![a-z0-9])(?:429|500|502|503|504|520|524)(?![a-z0-9])",
            r"service.?(?:is.?)?(?:temporarily.?)?unavailable",
            "server.?error",
            "internal.?error",
            r"provider.?returned.?(?:an.?)?error",
            "stream was interrupted",
            "network.?error",
            "connection.?error",
            "connection.?refused",
            "connection.?lost",
            "connection.?closed",
            "other side closed",
            "fetch failed",
            r"(?<![a-z0-9_])(?:ECONNRESET|ECONNABORTED|ECONNREFUSED|ETIMEDOUT|EPIPE)(?![a-z0-9_])",
            "connection reset by peer",
            "terminated",
            "timed? ?out",
        ]
    ),
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class RetrySettings:
    """Pi's ``retry`` settings (``settings.json``)."""

    enabled: bool = True
    max_retries: int = 3
    base_delay_ms: int = 2000

    def delay_ms(self, attempt: int) -> int:
        return int(self.base_delay_ms * 2 ** (attempt - 1))

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> RetrySettings:
        """``retry.{enabled,maxRetries,baseDelayMs}``; a value of the wrong type (or a
        ``retry`` that is not an object) is ignored, its default kept, as compaction's
        settings are read (before, ``"retry": 5`` or ``"maxRetries": "x"`` was a traceback
        at start)."""
        retry = settings.get("retry")
        retry = retry if isinstance(retry, dict) else {}
        default = cls()

        def count(key: str, fallback: int) -> int:
            value = retry.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
            return fallback

        enabled = retry.get("enabled", default.enabled)
        return cls(
            enabled=enabled if isinstance(enabled, bool) else default.enabled,
            max_retries=count("maxRetries", default.max_retries),
            base_delay_ms=count("baseDelayMs", default.base_delay_ms),
        )


def is_retryable(error_message: str) -> bool:
    if _NON_RETRYABLE.search(error_message):
        return False
    return bool(_RETRYABLE.search(error_message))
