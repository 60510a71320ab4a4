"""pi-runtime: a durable, supervised Trio runtime for Pi coding-agent workers.

The public surface is re-exported here; every other module is private.
"""

from ._clock import Clocks as Clocks
from ._clock import MockSilenceClock as MockSilenceClock
from ._clock import MockWallClock as MockWallClock
from ._clock import SilenceClock as SilenceClock
from ._clock import SilenceReading as SilenceReading
from ._clock import SystemSilenceClock as SystemSilenceClock
from ._clock import SystemWallClock as SystemWallClock
from ._clock import WallClock as WallClock
from ._errors import DiskFailedError as DiskFailedError
from ._errors import JournalError as JournalError
from ._errors import PiRuntimeError as PiRuntimeError
from ._errors import ReasonCode as ReasonCode
from ._errors import SessionError as SessionError
from ._errors import StateDirError as StateDirError
from ._errors import StateDirLockedError as StateDirLockedError
from ._journal import Journal as Journal
from ._journal import LogContents as LogContents
from ._store import Store as Store
from ._store import open_store as open_store
from ._version import __version__ as __version__
