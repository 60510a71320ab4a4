"""An adversary's tests of session appends (runtime._pi._session_files), S8 of
docs/design/sessions.md: the clause "a failed or short write poisons the writer", which no
test made fail — the file system really refuses the write here (``RLIMIT_FSIZE``)."""

from __future__ import annotations

import contextlib
import errno
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime._errors import ReasonCode, SessionError
from runtime._pi._session_files import (
    SessionWriter,
    create_session,
    read_session,
    truncate_torn_tail,
)


class StepClock:
    now = 1_795_978_317_155

    def time_ms(self) -> int:
        self.now += 1
        return self.now


@contextlib.contextmanager
def file_size_limit(size: int) -> Iterator[None]:
    """Files this process writes may not grow past ``size`` bytes: a write past it is cut
    short, or fails with ``EFBIG`` (``SIGXFSZ`` ignored meanwhile, as a full disk would
    not signal)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, before)


@pytest.mark.parametrize("room", [10, 0])
def test_s8_a_short_or_failed_write_poisons_the_writer(tmp_path: Path, room: int) -> None:
    """S8, S6: an append the file system cuts short (room for 10 bytes of the line) raises
    ``session_torn_tail``; one it refuses outright (no room: ``EFBIG``) raises the
    ``OSError``. Either way the writer is poisoned: a second append, with room again,
    writes nothing and raises ``session_changed`` — never a line glued to the torn bytes.
    The torn bytes are a torn tail that ``truncate_torn_tail`` cuts back to the file
    before the append."""
    path = tmp_path / "s.jsonl"
    create_session(path, cwd="/w", provider="fake", model_id="m", clock=StepClock())
    before = path.read_bytes()
    with SessionWriter.open(path, clock=StepClock()) as writer:
        with file_size_limit(len(before) + room), pytest.raises((OSError, SessionError)) as failed:
            writer.append({"type": "custom", "customType": "note", "data": "x" * 100})
        if room:
            assert isinstance(failed.value, SessionError)
            assert failed.value.code is ReasonCode.SESSION_TORN_TAIL
        else:
            assert isinstance(failed.value, OSError)
            assert failed.value.errno == errno.EFBIG
        assert len(path.read_bytes()) == len(before) + room
        with pytest.raises(SessionError) as poisoned:
            writer.append({"type": "custom", "customType": "again"})
        assert poisoned.value.code is ReasonCode.SESSION_CHANGED
    assert len(path.read_bytes()) == len(before) + room
    assert (read_session(path).torn_tail is not None) == bool(room)
    assert truncate_torn_tail(path) == room
    assert path.read_bytes() == before
