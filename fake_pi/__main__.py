"""``python -m fake_pi --mode rpc …``: a credential-free Pi, launched like Pi."""

import sys

from ._app import main

sys.exit(main())
