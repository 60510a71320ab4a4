"""``python -m runtime._cli``: the ``pi-runtime`` command."""

import sys

from . import main

sys.exit(main())
