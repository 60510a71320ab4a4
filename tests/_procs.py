"""Looking for survivors: every descendant of an epoch inherits its nonce in its environment."""

from __future__ import annotations

from runtime._proctree import EPOCH_ENV, proc_table, read_environ


def alive_with_nonce(nonce: str) -> list[int]:
    """Every live process whose environment carries the nonce (what a survivor check asks)."""
    marker = f"{EPOCH_ENV}={nonce}".encode()
    return [
        pid
        for pid, info in proc_table().items()
        if info.alive and marker in (read_environ(pid) or b"").split(b"\0")
    ]
