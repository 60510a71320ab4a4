"""Every test here that runs host processes (the ``serve`` processes of
``test_serve_e2e.py``, and the deployments of ``test_serve_hosts.py``, whose hosts are stopped
gracefully at the end and only a crashed one's leftovers swept) ends with none of their worker
processes running (``tests/_procs.py``: ``no_worker_left_by_hosts``)."""

from __future__ import annotations

import pytest

from .._procs import no_worker_left_by_hosts as no_worker_left_by_hosts


@pytest.fixture(autouse=True)
def _hosts_leave_no_worker(no_worker_left_by_hosts: None) -> None:
    """Applies :func:`~tests._procs.no_worker_left_by_hosts` to every test of the directory
    (a test that runs no host process is not looked at)."""
