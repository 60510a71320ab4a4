"""Every third-party module the package and the benchmarks import is declared in
``pyproject.toml``: the product's in ``dependencies``, ``runtime.testing``'s (the pytest
plugin users load) in the ``testing`` extra or there, the benchmarks' in the ``bench``
extra or there, an optional part's (the PostgreSQL store's) in its own extra or there. An
import that only arrives because another package happens to depend on it (``h11`` through
trio-websocket → wsproto, once) fails here."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parents[1]
FIRST_PARTY: Final = {"runtime", "fake_pi", "tests", "bench"}
PYPROJECT: Final = tomllib.loads((REPO / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    """The normalized distribution name of a PEP 508 requirement (PEP 503)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match[0]).lower()


def declared(*extras: str) -> set[str]:
    """The dependencies plus the named extras (extras naming this project are followed)."""
    project = PYPROJECT["project"]
    names = {_name(r) for r in project["dependencies"]}
    todo = list(extras)
    while todo:
        for requirement in project["optional-dependencies"][todo.pop()]:
            name = _name(requirement)
            if name == _name(project["name"]):
                todo += re.findall(r"[\w-]+", requirement.partition("[")[2])
            else:
                names.add(name)
    return names


def imported(files: list[Path]) -> dict[str, list[str]]:
    """Top-level third-party modules imported anywhere in ``files`` (function bodies too),
    each with the places that import it."""
    found: dict[str, list[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.partition(".")[0]
                if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                    where = f"{path.relative_to(REPO)}:{node.lineno}"
                    found.setdefault(top, []).append(where)
    return found


def distributions(module: str) -> set[str]:
    """The distributions providing ``module``; for one not installed here (an extra that
    was not installed, such as ``bench``'s dbos), the module's own name."""
    names = importlib.metadata.packages_distributions().get(module) or [module]
    return {_name(name) for name in names}


def undeclared(files: list[Path], allowed: set[str]) -> dict[str, list[str]]:
    return {
        module: places
        for module, places in imported(files).items()
        if not distributions(module) & allowed
    }


def _py(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


OPTIONAL: Final = {
    "runtime/_journal/_postgres.py": "postgres",
    "runtime/_journal/_pg_log.py": "postgres",
    "runtime/_journal/_pg_rows.py": "postgres",
    "runtime/_journal/_pg_connection.py": "postgres",
    "runtime/_journal/_pg_schema.py": "postgres",
    "runtime/_boundary/_receipts_pg.py": "postgres",
}
"""Product modules that need an extra, each imported only where that extra is used (the
PostgreSQL store and its receipt store: by ``pi-runtime db migrate`` and a room worker whose
``[store] url`` names a database, inside the function)."""


def _product() -> list[Path]:
    testing = REPO / "runtime" / "testing"
    optional = {REPO / path for path in OPTIONAL}
    return [
        p for p in _py("runtime") + _py("fake_pi") if testing not in p.parents and p not in optional
    ]


def test_the_product_imports_only_its_dependencies() -> None:
    assert undeclared(_product(), declared()) == {}


def test_an_optional_module_imports_only_its_extra() -> None:
    for path, extra in OPTIONAL.items():
        assert undeclared([REPO / path], declared(extra)) == {}, path


def test_the_package_and_its_command_import_no_extra() -> None:
    """Without the postgres extra, ``runtime`` and the ``pi-runtime`` command still import:
    nothing imports an optional module at import time."""
    code = "import sys, runtime, runtime._cli; print(sorted({'psycopg'} & set(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout == "[]\n"


def test_runtime_testing_imports_only_the_testing_extra() -> None:
    assert undeclared(_py("runtime/testing"), declared("testing")) == {}


def test_the_benchmarks_import_only_the_bench_extra() -> None:
    assert undeclared(_py("bench"), declared("bench")) == {}


def test_the_check_sees_an_undeclared_import() -> None:
    """The check can fail: h11 is imported by the product (Fake-Pi's gate client; the runtime's
    HTTP shell has its own codec), so without its declaration it would be reported — with every
    place that imports it."""
    missing = undeclared(_product(), declared() - {"h11"})
    assert set(missing) == {"h11"}
    assert any(place.startswith("fake_pi/_gate_client.py:") for place in missing["h11"])
