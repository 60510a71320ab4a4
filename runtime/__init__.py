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
from ._config import Caps as Caps
from ._config import ModelConfig as ModelConfig
from ._config import RoomConfig as RoomConfig
from ._config import RoomWorkerConfig as RoomWorkerConfig
from ._config import Thresholds as Thresholds
from ._config import WatchdogConfig as WatchdogConfig
from ._config import load_config as load_config
from ._errors import ConfigError as ConfigError
from ._errors import DeliveryError as DeliveryError
from ._errors import DiskFailedError as DiskFailedError
from ._errors import JournalError as JournalError
from ._errors import PiRuntimeError as PiRuntimeError
from ._errors import ReasonCode as ReasonCode
from ._errors import SessionError as SessionError
from ._errors import StateDirError as StateDirError
from ._errors import StateDirLockedError as StateDirLockedError
from ._errors import TaskError as TaskError
from ._errors import WatchdogConfigError as WatchdogConfigError
from ._journal._journal import Journal as Journal
from ._journal._journal import LogContents as LogContents
from ._journal._store import Store as Store
from ._journal._store import open_store as open_store
from ._records import Outcome as Outcome
from ._records import TaskEnded as TaskEnded
from ._rooms._admission import Author as Author
from ._rooms._admission import Delivery as Delivery
from ._rooms._admission import HistoryItem as HistoryItem
from ._rooms._worker import RoomWorker as RoomWorker
from ._rooms._worker import open_room_worker as open_room_worker
from ._tasks._service import TaskService as TaskService
from ._tasks._service import open_task_service as open_task_service
from ._version import __version__ as __version__
from ._wire import Accepted as Accepted
from ._wire import DeliveryResult as DeliveryResult
from ._wire import RoomEvent as RoomEvent
from ._wire import TaskEvent as TaskEvent
from ._wire import TaskSpec as TaskSpec
from ._wire import TaskView as TaskView
from ._wire import TextUpdate as TextUpdate
from ._wire import ToolActivity as ToolActivity
from ._wire import Typing as Typing
