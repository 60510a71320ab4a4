"""The report of ``scripts/flake-hunt``: read each run's JUnit XML, print per failing test how
many of the runs it failed and the first line of each distinct failure.

Usage: python scripts/flake_report.py DIR N   (DIR holds run-1.xml … run-N.xml)
Exit status 0 when no test failed in any run, 1 otherwise (a run without its XML counts as
a failure of the whole run: pytest itself broke).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def _first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:200]
    return "(no message)"


def failures(xml: Path) -> dict[str, str]:
    """Test id → the first line of its failure or error, for one run."""
    found: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        for kind in ("failure", "error"):
            problem = case.find(kind)
            if problem is not None:
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                found[name] = f"{kind}: {_first_line(problem.get('message') or problem.text)}"
    return found


def main(folder: Path, runs: int) -> int:
    failed_in: dict[str, set[int]] = defaultdict(set)
    messages: dict[str, dict[str, int]] = defaultdict(dict)
    broken = []
    for run in range(1, runs + 1):
        xml = folder / f"run-{run}.xml"
        if not xml.is_file():
            broken.append(run)
            continue
        for test, message in failures(xml).items():
            failed_in[test].add(run)
            messages[test].setdefault(message, run)
    print(f"\n{runs} runs; outputs and JUnit XML in {folder}")
    for run in broken:
        print(f"run {run}: no JUnit XML (pytest did not finish; see run-{run}.log)")
    if not failed_in:
        print("no test failed" if not broken else "")
        return 1 if broken else 0
    for test in sorted(failed_in, key=lambda t: (-len(failed_in[t]), t)):
        print(f"{test}: failed {len(failed_in[test])} of {runs} runs")
        for message, run in messages[test].items():
            print(f"    (first in run {run}) {message}")
    return 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
