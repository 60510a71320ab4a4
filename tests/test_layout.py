"""The boundaries of docs/design/index.md (Layout) as a check that fails: ``lint-imports`` with the
contracts in ``pyproject.toml`` (layers, no fake_pi in the runtime, fake_pi only through
runtime.worker_kit, pure cores, no cycles). ``scripts/test`` runs it; these tests show it passes on
the tree and that a wrong-way import fails it, with the chain printed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parents[1]
LINT_IMPORTS: Final = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the packages under ``root`` with ``root/pyproject.toml``."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def copy_tree(target: Path) -> Path:
    for package in ("runtime", "fake_pi"):
        shutil.copytree(
            REPO / package, target / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(REPO / "pyproject.toml", target / "pyproject.toml")
    return target


def test_the_tree_keeps_every_contract(tmp_path: Path) -> None:
    done = lint_imports(copy_tree(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 kept, 0 broken" in done.stdout


def test_a_lane_importing_fake_pi_fails_with_the_chain(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    lane = root / "runtime" / "_rooms" / "_lane.py"
    lane.write_text(lane.read_text() + "\nimport fake_pi.model_server  # noqa: E402, F401\n")
    done = lint_imports(root)
    assert done.returncode != 0
    assert "runtime._rooms is not allowed to import fake_pi" in done.stdout
    assert "runtime._rooms._lane -> fake_pi.model_server" in done.stdout


def test_a_lower_layer_importing_a_higher_one_fails(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    store = root / "runtime" / "_journal" / "_store.py"
    store.write_text(store.read_text() + "\nfrom .._rooms import _lane  # noqa: E402, F401\n")
    done = lint_imports(root)
    assert done.returncode != 0
    assert "runtime._journal is not allowed to import runtime._rooms" in done.stdout


def test_fake_pi_importing_a_private_runtime_module_fails(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    agent = root / "fake_pi" / "_agent.py"
    agent.write_text(agent.read_text() + "\nfrom runtime._pi import _rpc  # noqa: E402, F401\n")
    done = lint_imports(root)
    assert done.returncode != 0
    assert "fake_pi is not allowed to import runtime._pi" in done.stdout
    assert "fake_pi._agent -> runtime._pi._rpc" in done.stdout
