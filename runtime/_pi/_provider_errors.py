"""Provider errors Pi never retries: a usage limit, a spent quota or budget, a billing problem.

Pi's own list (``pi-ai/dist/utils/retry.js`` in Pi 1.6.0, copied verbatim): room lanes end
such a turn ``usage_limit_reached`` instead of failing it, and Fake-Pi's retry rules use the
same list. Pure: a leaf of ``_pi`` that room lanes' outcome core may import.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["PROVIDER_LIMIT_PATTERNS", "USAGE_LIMIT_PATTERN"]


PROVIDER_LIMIT_PATTERNS: Final = (
    # verbatim: Pi 1.6.0 pi-ai/dist/utils/retry.js NON_RETRYABLE_PROVIDER_LIMIT_ERROR_PATTERN
    # (Fake-Pi's retry rules use the same list: fake_pi/_retry.py)
    # OpenCode Go/free-tier account limits
    "GoUsageLimitError",
    "FreeUsageLimitError",
    "Monthly usage limit reached",
    "available balance",
    # quota / budget / billing exhaustion; insufficient_quota is OpenAI's code
    "insufficient_quota",
    "out of budget",
    "quota exceeded",
    "billing",
    # Sign in with ChatGPT: shared subscription limit, workspace per-user limit
    "subscription_sharing_usage_limit_exceeded",
    "subscription_sharing_workplace_individual_usage_limit_exceeded",
    # Zhipu/Z.ai plan limit, code 1308
    r'"code"\s*:\s*"?1308(?![0-9])',
)
"""Pi's account-limit errors, which it never retries."""


USAGE_LIMIT_PATTERN: Final = re.compile(
    "|".join(
        [
            *PROVIDER_LIMIT_PATTERNS,
            # Pi 1.6.0 pi-ai/dist/api/openai-codex-responses.js: "usage limit" is never retried
            # and usage_limit_reached becomes "You have hit your ChatGPT usage limit…";
            # pi-ai/dist/api/openai-responses.js: "…your ChatGPT workspace's usage limit…"
            r"usage.?limit",
        ]
    ),
    re.IGNORECASE,
)
"""Matches an error that reports an account usage limit (a Pi ``errorMessage``, or the
provider's response body the gateway sees): see ``runtime/_rooms/_outcome.py``."""
