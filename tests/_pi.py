"""Where the tests find the real Pi: ``$PI_RUNTIME_PI_HOME`` or ``<repo>/.cache/pi``.

``scripts/test`` installs Pi there before the suite starts (so parallel test
workers never race to install it) and exports the variable.
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime._pi._pi_install import PiInstall, install_pi

REPO = Path(__file__).resolve().parents[1]


def pi_home() -> Path:
    configured = os.environ.get("PI_RUNTIME_PI_HOME")
    return Path(configured) if configured else REPO / ".cache" / "pi"


def real_pi() -> PiInstall:
    """The installed real Pi (installing it if needed; fails loudly if it cannot)."""
    return install_pi(pi_home())
