"""The README's examples run as written (docs move with code)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
_EXAMPLE = re.compile(r"<!-- readme-example: (\S+) -->\n```python\n(.*?)```", re.S)


def _examples() -> dict[str, str]:
    return dict(_EXAMPLE.findall(README.read_text()))


def test_readme_has_the_example_test() -> None:
    assert "test_example.py" in _examples()


def test_readme_example_test_passes(tmp_path: Path) -> None:
    """F8: the README's complete example test runs as written, with the plugin."""
    example = tmp_path / "test_example.py"
    example.write_text(_examples()["test_example.py"])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(example)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_readme_embedding_example_runs(tmp_path: Path) -> None:
    """L1/L5 as a newcomer sees them: the embedding example admits a message and prints its
    durable, acknowledged result."""
    example = tmp_path / "embed.py"
    example.write_text(_examples()["embed.py"])
    result = subprocess.run(
        [sys.executable, str(example)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "started"
    assert lines[1].startswith("1 reply ")
