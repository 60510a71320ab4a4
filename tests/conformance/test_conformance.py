"""Fake-Pi against the real Pi 1.6.0, scenario by scenario.

Every scenario runs on the worker under test and, in the same Trio run, on a
reference real Pi (a fresh sandbox and scripted model each). Both captures
must pass the scenario's behavioural checks, and their normalized outputs
(:mod:`.shapes`) must be equal. For ``worker="pi"`` the reference is a second
real Pi run: that cell proves the checks hold for Pi and that the normalizers
only remove what varies between two runs of Pi itself.

The real Pi is installed on first use (``runtime._pi._pi_install``); if it cannot
be, the tests fail with the installer's message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from .harness import WORKERS, WorkerKind, pi_install
from .scenarios import SCENARIOS, Capture, run_scenario
from .shapes import (
    diff,
    entry_shapes,
    event_sequence,
    event_shapes,
    key_order_mismatches,
    queue_updates,
    request_shape,
    response_shapes,
)


def normalized(capture: Capture) -> dict[str, Any]:
    """Every compared aspect of a capture, by name."""
    out: dict[str, Any] = {}
    for i, records in enumerate(capture.launches):
        out[f"launch {i}: event sequence"] = event_sequence(records)
        out[f"launch {i}: event shapes"] = event_shapes(records)
        out[f"launch {i}: queue updates"] = queue_updates(records)
        out[f"launch {i}: responses"] = response_shapes(records)
    out["launches"] = len(capture.launches)
    out["exit codes"] = capture.returncodes
    out["stderr is empty"] = [not err.strip() for err in capture.stderr]
    out["model requests"] = [request_shape(body, descriptions=True) for body in capture.requests]
    out["session entries"] = entry_shapes(capture.session)
    return out


def compare(reference: Capture, capture: Capture) -> list[str]:
    """One readable diff per aspect that differs."""
    expected, actual = normalized(reference), normalized(capture)
    name = capture.kind if capture.kind != "pi" else "pi (second run)"
    problems = []
    for aspect in sorted(set(expected) | set(actual)):
        text = diff(expected.get(aspect), actual.get(aspect), actual_name=name)
        if text:
            problems.append(f"--- {aspect} differs:\n{text}")
    order = key_order_mismatches(reference.session, capture.session)
    if order:
        problems.append("--- session key order differs (shared keys only):\n" + "\n".join(order))
    return problems


def test_real_pi_is_installed() -> None:
    """Fails loudly (never skips) when the real Pi cannot be installed."""
    install = pi_install()
    assert install.version == "1.6.0"
    assert install.node.is_file()
    assert install.cli.is_file()


async def _run_both(scenario: str, worker: WorkerKind, root: Path) -> tuple[Capture, Capture]:
    definition = SCENARIOS[scenario]
    captures: dict[str, Capture] = {}

    async def one(key: str, kind: WorkerKind) -> None:
        captures[key] = await run_scenario(definition, kind, root / key)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "reference", "pi")
        nursery.start_soon(one, "subject", worker)
    return captures["reference"], captures["subject"]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("worker", WORKERS)
def test_scenario(worker: WorkerKind, scenario: str, tmp_path: Path) -> None:
    # A synchronous test running its own trio.run, so that a failure is reported as
    # itself and not wrapped in the exception group of pytest-trio's nursery.
    pi_install()  # outside the timed part: the first call may install
    reference, subject = trio.run(_run_both, scenario, worker, tmp_path)
    definition = SCENARIOS[scenario]
    definition.check(reference)  # the checks are Pi's behaviour: they must hold for Pi
    failures = []
    try:
        definition.check(subject)
    except Exception as exc:  # an IndexError is as much a failed check as an AssertionError
        failures.append(f"--- behaviour: {type(exc).__name__}: {exc}")
    failures += compare(reference, subject)
    for i, err in enumerate(subject.stderr):
        if err.strip():
            failures.append(
                f"--- launch {i}: {worker} stderr:\n{err[-2000:].decode(errors='replace')}"
            )
    if failures:
        pytest.fail(
            f"{scenario}: {worker} does not behave like the real Pi:\n" + "\n".join(failures),
            pytrace=False,
        )
