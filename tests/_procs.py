"""Looking for survivors: every descendant of an epoch inherits its nonce in its environment."""

from __future__ import annotations

from pathlib import Path

from runtime._linux._proctree import EPOCH_ENV, TreeProof, kill_tree, proc_table, read_environ


def alive_with_nonce(nonce: str) -> list[int]:
    """Every live process whose environment carries the nonce (what a survivor check asks)."""
    marker = f"{EPOCH_ENV}={nonce}".encode()
    return [
        pid
        for pid, info in proc_table().items()
        if info.alive and marker in (read_environ(pid) or b"").split(b"\0")
    ]


def epoch_nonces(root: Path) -> set[str]:
    """The nonces of every live epoch whose worker runs with its HOME under ``root``."""
    prefix, home = f"{EPOCH_ENV}=".encode(), f"HOME={root}".encode()
    nonces = set()
    for pid, info in proc_table().items():
        environ = (read_environ(pid) or b"").split(b"\0") if info.alive else []
        if any(entry.startswith(home) for entry in environ):
            nonces |= {e[len(prefix) :].decode() for e in environ if e.startswith(prefix)}
    return nonces


async def kill_orphaned_epochs(root: Path) -> set[str]:
    """Kill the whole tree of every epoch whose worker runs with its HOME under ``root`` (what
    a SIGKILLed host left running); return their nonces. For a test that must change a
    worker's files while no host runs without the orphan changing them too."""
    nonces = epoch_nonces(root)
    for nonce in nonces:
        report = await kill_tree(TreeProof(nonce=nonce), give_up_after=10.0)
        assert report.clean, report
    return nonces
