"""A method that raises on its first call and works after: how the fault-isolation tests
(a failing scrape, view or follower stays in its request) plant one bug."""

from __future__ import annotations

from typing import Any

import pytest


def fails_once(monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> list[int]:
    """Patch ``owner.name`` to raise ``RuntimeError`` on its first call, then call through;
    the returned list holds the number of calls so far (``[n]``)."""
    calls = [0]
    original = getattr(owner, name)

    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError(f"a planted bug in {owner.__name__}.{name}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, patched)
    return calls
