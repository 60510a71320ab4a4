"""The clocks rules of docs/design/clocks.md as checks that fail.

C4: no module of ``runtime/`` reads a clock of its own — only ``runtime/_clock.py`` asks the
kernel what time it is (and sleeps on the real clock); every other module is handed its clocks
(a :class:`~runtime._clock.Clocks`, Trio's) or, where it compares with a time the kernel
stamped, names the system wall clock of ``_clock.py`` on purpose (the named exceptions). The
scan reads every module's syntax tree and follows its imports, so ``from time import time as
now`` or ``import datetime as dt; dt.datetime.now()`` is found as surely as ``time.time()``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

REPO: Final = Path(__file__).resolve().parents[1]
RUNTIME: Final = REPO / "runtime"

CLOCK_READS: Final = frozenset(
    {
        "time.time",
        "time.time_ns",
        "time.monotonic",
        "time.monotonic_ns",
        "time.perf_counter",
        "time.perf_counter_ns",
        "time.process_time",
        "time.process_time_ns",
        "time.thread_time",
        "time.thread_time_ns",
        "time.clock_gettime",
        "time.clock_gettime_ns",
        "time.sleep",
        "datetime.datetime.now",
        "datetime.datetime.utcnow",
        "datetime.datetime.today",
        "datetime.date.today",
    }
)
"""What reads (or sleeps on) the real clock, behind an injected one's back: a mock clock in a
test cannot move it, and a stray read there decides on a time no test controls."""
READ_WHEN_CALLED_BARE: Final = frozenset(
    {"time.localtime", "time.gmtime", "time.ctime", "time.asctime", "time.strftime"}
)
"""Conversions that read the clock when given no time (``strftime``: only a format)."""

READERS: Final = frozenset({"_clock.py"})
"""The one module that reads the kernel's clocks (docs/design/clocks.md C4)."""

SYSTEM_CLOCKS: Final = frozenset({"SystemWallClock", "SystemSilenceClock"})
SYSTEM_CLOCK_USERS: Final = {
    "_clock.py": "defines them",
    "__init__.py": "the public surface re-exports them",
    "worker_kit.py": "re-exports the wall clock to Fake-Pi",
    "_journal/_attachments.py": "compares the wall clock with a file's ctime (A13's settle)",
    "_linux/_proctree.py": "compares the wall clock with a cgroup's ctime (the stale sweep)",
}
"""The modules that name a system clock rather than take an injected one, each for the reason
docs/design/clocks.md gives (C4): a time the kernel stamped is on the system's clock, and a
mock clock compared with it would be meaningless."""


def _qualified(node: ast.expr, names: dict[str, str]) -> str | None:
    """``node``'s dotted name with its first part resolved through the module's imports
    (``names``: local name → what it was imported as); ``None`` when it is no such name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    return ".".join([names[node.id], *reversed(parts)])


def clock_reads(source: str) -> Iterator[tuple[int, str]]:
    """Every place ``source`` reads the real clock: ``(line, what)``. A reference counts as
    much as a call (``default_factory=time.time`` reads it later)."""
    tree = ast.parse(source)
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname is not None:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    bare_calls = {
        id(node.func)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and len(node.args) + len(node.keywords) <= (1 if _is(node.func, names, "strftime") else 0)
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Name | ast.Attribute):
            continue
        name = _qualified(node, names)
        if name in CLOCK_READS or (name in READ_WHEN_CALLED_BARE and id(node) in bare_calls):
            yield node.lineno, name


def _is(func: ast.expr, names: dict[str, str], what: str) -> bool:
    return _qualified(func, names) == f"time.{what}"


def _modules() -> Iterator[tuple[str, str]]:
    for path in sorted(RUNTIME.rglob("*.py")):
        yield path.relative_to(RUNTIME).as_posix(), path.read_text()


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import time\nx = time.time()", ["time.time"]),
        ("import time as t\nx = t.monotonic_ns()", ["time.monotonic_ns"]),
        ("from time import time_ns as now\nx = now() // 1_000_000", ["time.time_ns"]),
        ("import time\nf = lambda: time.time_ns() // 1_000_000", ["time.time_ns"]),
        (
            "import time\nfrom dataclasses import field\nf = field(default_factory=time.time)",
            ["time.time"],
        ),
        ("import datetime\nx = datetime.datetime.now(datetime.UTC)", ["datetime.datetime.now"]),
        ("import datetime as dt\nx = dt.datetime.utcnow()", ["datetime.datetime.utcnow"]),
        ("from datetime import datetime\nx = datetime.now()", ["datetime.datetime.now"]),
        ("from datetime import date\nx = date.today()", ["datetime.date.today"]),
        ("import time\nx = time.perf_counter()", ["time.perf_counter"]),
        ("import time\ntime.sleep(1)", ["time.sleep"]),
        ("import time\nx = time.clock_gettime(time.CLOCK_BOOTTIME)", ["time.clock_gettime"]),
        ("import time\nx = time.localtime()", ["time.localtime"]),
        ("import time\nx = time.strftime('%H')", ["time.strftime"]),
        # conversions of a given time read nothing; nor does Trio's clock
        ("import time\nx = time.localtime(0)", []),
        ("import time\nx = time.strftime('%H', time.gmtime(0))", []),
        ("import datetime\nx = datetime.datetime.fromtimestamp(0, datetime.UTC)", []),
        ("import trio\nx = trio.current_time()", []),
        ("def time():\n    return 0\nx = time()", []),
    ],
)
def test_c4_the_scan_finds_a_clock_read_however_it_is_spelled(
    source: str, found: list[str]
) -> None:
    """C4: the check below is only as good as its scan — an alias, a reference passed as a
    callback, a ``from`` import are each found; a conversion of a given time is not."""
    assert [what for _line, what in clock_reads(source)] == found


def test_c4_no_module_of_the_runtime_reads_a_clock_of_its_own() -> None:
    """C4 (C3's rule made a check): outside ``runtime/_clock.py`` nothing reads the wall,
    monotonic, boot-time or performance clock, or sleeps on the real clock. Before, the
    result outbox stamped results with ``time.time_ns()`` when it was given no clock, and the
    stale-cgroup sweep read ``time.time()``."""
    found = [
        f"runtime/{rel}:{line}: {what}"
        for rel, source in _modules()
        if rel not in READERS
        for line, what in clock_reads(source)
    ]
    assert found == [], "read the clock through runtime/_clock.py:\n" + "\n".join(found)


def test_c4_only_the_named_exceptions_take_the_system_clock_instead_of_an_injected_one() -> None:
    """C4: a module names ``SystemWallClock`` or ``SystemSilenceClock`` only for a reason
    docs/design/clocks.md gives; every other module is handed its clocks (a ``Clocks``: the
    entry points build ``Clocks.system()``), so a test's mock clocks reach it."""
    found = {
        rel
        for rel, source in _modules()
        for node in ast.walk(ast.parse(source))
        if (isinstance(node, ast.Name) and node.id in SYSTEM_CLOCKS)
        or (isinstance(node, ast.Attribute) and node.attr in SYSTEM_CLOCKS)
        or (isinstance(node, ast.alias) and node.name in SYSTEM_CLOCKS)
    }
    assert found <= SYSTEM_CLOCK_USERS.keys(), sorted(found - SYSTEM_CLOCK_USERS.keys())
    clocks_page = (REPO / "docs" / "design" / "clocks.md").read_text()
    for rel in SYSTEM_CLOCK_USERS.keys() - {"_clock.py", "__init__.py", "worker_kit.py"}:
        assert f"runtime/{rel}" in clocks_page, f"clocks.md does not name runtime/{rel}"
