"""The real Pi 1.6.0 samples the tests read, and the recorder's facts about them.

The samples live in the repository, in ``tests/data/pi-1.6.0/`` (its ``README.md`` says what
each file is and which of its facts the tests rely on). ``scripts/record-pi-samples`` records
them again by running the installed real Pi against the scripted model
(:mod:`tests.record_pi_samples`); ids and timestamps differ from run to run, so the tests take
entry ids, call ids and line numbers from the files themselves or from ``facts.json``, which the
recorder writes beside them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import msgspec

__all__ = [
    "FACTS",
    "FIRST_REQUEST",
    "PI_VERSION",
    "SAMPLES",
    "SESSION_NAMES",
    "DanglingCallFact",
    "InjectedLineFact",
    "SampleFacts",
    "facts",
    "session_sample",
]

PI_VERSION: Final = "1.6.0"
SAMPLES: Final = Path(__file__).resolve().parent / "data" / f"pi-{PI_VERSION}"
SESSION_NAMES: Final = ("basic", "steer", "abort", "retry", "branched", "fork", "killed_midtool")
FIRST_REQUEST: Final = SAMPLES / "llm_request_first_full.json"
"""The first request Pi sent to the model (``basic``): method, path, non-secret headers, body."""
FACTS: Final = SAMPLES / "facts.json"


class DanglingCallFact(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The bash call ``killed_midtool`` leaves without a result."""

    tool_call_id: str
    name: str
    arguments: dict[str, Any]
    """The call as the recorder scripted it (the model sent exactly this)."""
    assistant_entry_id: str
    """Pi's ``get_entries`` ``leafId`` while the tool ran: the entry holding the call."""


class InjectedLineFact(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The one line of ``branched`` that Pi did not write: the recorder appended it (with
    Python's ``json.dumps`` separators, as another program would) under an earlier entry."""

    line: int
    """Its 1-based line number in ``session_branched.jsonl``."""
    id: str
    parent_id: str
    """The branch point: the first assistant answer."""
    leaf_at_reopen: str
    """Pi's ``get_entries`` ``leafId`` when it reopened the file right after the append."""


class SampleFacts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pi_version: str
    recorded: str
    """The UTC date of the recording (ISO)."""
    dangling_call: DanglingCallFact
    injected_line: InjectedLineFact


def session_sample(name: str) -> Path:
    """``tests/data/pi-1.6.0/session_<name>.jsonl``."""
    return SAMPLES / f"session_{name}.jsonl"


def facts() -> SampleFacts:
    """``facts.json`` (a missing or malformed file fails the test that asks)."""
    return msgspec.json.decode(FACTS.read_bytes(), type=SampleFacts)
