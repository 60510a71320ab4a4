"""Tools for people who test code built on pi-runtime.

Everything here is public and stable like :mod:`runtime` itself. The pytest
plugin (:mod:`runtime.testing.plugin`, registered automatically when pi-runtime
is installed) offers these fixtures, for Trio tests run by pytest-trio:

``scripted_model``
    A fresh :class:`ScriptedModel`; set ``scripted_model.scenario`` to script it.
``wall_clock``, ``silence_clock``, ``clocks``
    :class:`MockWallClock`, :class:`MockSilenceClock` and a :class:`Clocks`
    holding both; they follow Trio's clock, so ``autojump_clock`` drives them.
``fake_pi``
    An in-process Fake-Pi (:class:`FakePi`) on ``scripted_model`` in
    ``tmp_path``, with its session file at ``tmp_path / "session.jsonl"``.
``io_autojump_clock``
    A MockClock (:func:`io_aware_autojump_clock`): autojump that waits for the runtime's
    own I/O threads
    (journal appends, session reads) before it jumps, for in-process runtime tests.
``model_server``
    ``scripted_model`` served over HTTP on 127.0.0.1 (an :class:`HttpServer`
    with ``.url``), for a Pi or Fake-Pi subprocess.
"""

from fake_pi._app import FakePi as FakePi
from fake_pi._app import open_fake_pi as open_fake_pi
from fake_pi._behaviours import Behaviours as Behaviours
from fake_pi._gate import AllowAllGate as AllowAllGate
from fake_pi._gate import GateDecision as GateDecision
from fake_pi._gate import Refused as Refused
from fake_pi._gate import Run as Run
from fake_pi._gate import SavedResult as SavedResult
from fake_pi._gate import ToolCall as ToolCall
from fake_pi._gate import ToolGate as ToolGate
from fake_pi._gate import ToolResult as ToolResult
from fake_pi._retry import RetrySettings as RetrySettings
from fake_pi.model_server import ScriptedModel as ScriptedModel
from fake_pi.model_server import serve_model as serve_model
from fake_pi.scenario import Attach as Attach
from fake_pi.scenario import Call as Call
from fake_pi.scenario import Cut as Cut
from fake_pi.scenario import Empty as Empty
from fake_pi.scenario import Hang as Hang
from fake_pi.scenario import HttpError as HttpError
from fake_pi.scenario import Scenario as Scenario
from fake_pi.scenario import StaySilent as StaySilent
from fake_pi.scenario import Text as Text
from fake_pi.scenario import Thinking as Thinking
from fake_pi.scenario import ToolCalls as ToolCalls
from fake_pi.scenario import UsageLimit as UsageLimit

from .._boundary._http import HttpServer as HttpServer
from .._clock import Clocks as Clocks
from .._clock import MockSilenceClock as MockSilenceClock
from .._clock import MockWallClock as MockWallClock
from ._clock import io_aware_autojump_clock as io_aware_autojump_clock
