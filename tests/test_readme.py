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
