"""The grow-only smoke manifest (``tests/smoke/manifest.toml``, issues #8 and #17): every
scenario it registers names a test function that exists and is never skipped, every subcase
it lists is described (as ``name``) in that test module's docstring, and it still holds every
scenario and subcase ever pinned in ``tests/data/smoke_manifest_pinned.txt`` — an entry can be
added, never dropped or renamed silently."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from typing import Any, Final

REPO: Final = Path(__file__).resolve().parents[1]
MANIFEST: Final = REPO / "tests" / "smoke" / "manifest.toml"
PINNED: Final = REPO / "tests" / "data" / "smoke_manifest_pinned.txt"
OWNER: Final = "task lanes"
"""The owner of every scenario the manifest registers today (the task lanes' smoke)."""


def scenarios() -> list[dict[str, Any]]:
    with MANIFEST.open("rb") as file:
        manifest = tomllib.load(file)
    assert set(manifest) == {"scenario"}, f"only [[scenario]] tables: {sorted(manifest)}"
    found: list[dict[str, Any]] = manifest["scenario"]
    return found


def pinned() -> list[tuple[str, str]]:
    """``(scenario, subcase)`` of every line of the pinned list (comments and blanks skipped)."""
    pairs = []
    for number, line in enumerate(PINNED.read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        words = text.split()
        assert len(words) == 2, f"{PINNED.name}:{number}: not '<scenario> <subcase>': {line!r}"
        pairs.append((words[0], words[1]))
    return pairs


def module_of(test: str) -> tuple[Path, str]:
    """The file and the function a ``path::function`` node id names."""
    path, sep, function = test.partition("::")
    assert sep, f"not path::function: {test!r}"
    assert function, f"not path::function: {test!r}"
    assert "::" not in function, f"not path::function: {test!r}"
    return REPO / path, function


def test_every_scenario_has_a_name_an_owner_a_test_and_subcases() -> None:
    found = scenarios()
    assert found
    names = [s.get("name") for s in found]
    assert len(set(names)) == len(names), names
    for scenario in found:
        assert set(scenario) == {"name", "owner", "test", "subcases"}, scenario
        assert isinstance(scenario["name"], str), scenario
        assert scenario["name"], scenario
        assert scenario["owner"] == OWNER, scenario
        subcases = scenario["subcases"]
        assert isinstance(subcases, list), scenario
        assert subcases, scenario
        assert all(isinstance(s, str) and s for s in subcases), scenario
        assert len(set(subcases)) == len(subcases), scenario


def test_every_test_named_is_a_test_function_that_is_never_skipped() -> None:
    for scenario in scenarios():
        path, function = module_of(scenario["test"])
        assert path.is_file(), scenario
        tree = ast.parse(path.read_text())
        defined = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert function.startswith("test_"), scenario
        assert function in defined, scenario
        decorators = [ast.unparse(d) for d in defined[function].decorator_list]
        assert not [d for d in decorators if "skip" in d or "xfail" in d], (scenario, decorators)
        marks = [
            ast.unparse(node)
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        ]
        assert not [m for m in marks if "skip" in m or "xfail" in m], (scenario, marks)


def test_every_subcase_is_described_in_its_test_module() -> None:
    for scenario in scenarios():
        path, _ = module_of(scenario["test"])
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        missing = [s for s in scenario["subcases"] if f"``{s}``" not in docstring]
        assert not missing, f"{scenario['name']}: not in {path.name}'s docstring: {missing}"


def test_the_manifest_keeps_every_pinned_scenario_and_subcase() -> None:
    registered = {(s["name"], subcase) for s in scenarios() for subcase in s["subcases"]}
    entries = pinned()
    assert entries
    assert len(set(entries)) == len(entries), "a pinned line twice"
    dropped = [entry for entry in entries if entry not in registered]
    assert not dropped, f"the manifest dropped pinned entries (it only grows): {dropped}"


def test_every_registered_entry_is_pinned() -> None:
    """Adding an entry means pinning it too, so that it cannot be dropped later unnoticed."""
    registered = {(s["name"], subcase) for s in scenarios() for subcase in s["subcases"]}
    unpinned = sorted(registered - set(pinned()))
    assert not unpinned, f"pin these in {PINNED.name}: {unpinned}"
