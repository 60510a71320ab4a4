"""The access token (``runtime/_server/_token.py``); test names cite ``docs/design/operations.md``
(O1…). Files only under ``tmp_path``; no clock."""

from __future__ import annotations

import hmac
import os
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime._errors import ReasonCode, StateDirError
from runtime._journal._writer import TMP_MARK
from runtime._server import _token
from runtime._server._token import (
    TOKEN_FILE,
    ensure_token,
    read_token,
    rotate_token,
    token_matches,
    token_path,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_o1_first_start_creates_a_private_token(tmp_path: Path) -> None:
    state = tmp_path / "state"
    token, created = ensure_token(state)
    assert created
    assert len(token) == 43  # secrets.token_urlsafe(32)
    assert token_path(state).read_text() == token  # raw text, nothing else
    assert mode(token_path(state)) == 0o600
    assert mode(state) == 0o700
    assert ensure_token(state) == (token, False)  # the next start keeps it
    assert read_token(state) == token
    assert not [name for name in os.listdir(state) if TMP_MARK in name]


def test_o1_two_starters_agree_on_the_first_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Creation never replaces a token another process created meanwhile: its token wins."""
    tmp_path.chmod(0o700)
    write_temp = _token._write_temp

    def racing(state_dir: Path, token: str) -> str:
        other = tmp_path / "other"
        other.write_text("the-other-starters-token")
        other.chmod(0o600)
        other.rename(tmp_path / TOKEN_FILE)
        return write_temp(state_dir, token)

    monkeypatch.setattr(_token, "_write_temp", racing)
    assert ensure_token(tmp_path) == ("the-other-starters-token", False)
    assert not [name for name in os.listdir(tmp_path) if TMP_MARK in name]


@pytest.mark.parametrize("bits", [0o640, 0o604, 0o660, 0o644, 0o601])
def test_o2_a_token_others_may_read_is_refused(tmp_path: Path, bits: int) -> None:
    token, _ = ensure_token(tmp_path / "s")
    token_path(tmp_path / "s").chmod(bits)
    for call in (read_token, ensure_token):
        with pytest.raises(StateDirError) as refused:
            call(tmp_path / "s")
        assert refused.value.code is ReasonCode.TOKEN_INSECURE
        assert "token rotate" in str(refused.value)
        assert token not in str(refused.value)  # O4: never in a message


def test_o2_a_link_a_directory_or_an_empty_file_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "s"
    ensure_token(state)
    path = token_path(state)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("abc")
    elsewhere.chmod(0o600)
    path.unlink()
    path.symlink_to(elsewhere)
    with pytest.raises(StateDirError) as link:
        read_token(state)
    assert link.value.code is ReasonCode.TOKEN_INSECURE
    path.unlink()
    path.mkdir(mode=0o700)
    with pytest.raises(StateDirError) as directory:
        read_token(state)
    assert directory.value.code is ReasonCode.TOKEN_INSECURE
    path.rmdir()
    for content in (b"", b"  \n", b"\xff\xfe", b"two words"):
        path.write_bytes(content)
        path.chmod(0o600)
        with pytest.raises(StateDirError) as empty:
            read_token(state)
        assert empty.value.code is ReasonCode.TOKEN_INVALID


def _read_within(call: Callable[[Path], object], state: Path, path: Path) -> object:
    """``call(state)``'s result or exception, from a thread given 10 s; a FIFO at ``path``
    that keeps it waiting is opened for writing (which releases it) and the test fails."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call(state))
        except Exception as exc:  # handed to the test
            outcome.append(exc)

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a writer: the open returns
        reader.join(timeout=10)
        pytest.fail(f"{call.__name__} waited for a writer of the FIFO at the token's path")
    (found,) = outcome
    return found


def test_o2_a_fifo_or_a_socket_at_the_tokens_path_is_refused_at_once(tmp_path: Path) -> None:
    """O2: a FIFO or a Unix socket where the token should be is no regular file:
    ``token_insecure``, at once. Before, opening the FIFO waited for a writer — ``serve``
    never started, and a running server's every ``hello`` and page request held one of its
    worker threads for ever (forty of them stall everything else the process does in a
    thread) — and opening the socket failed ``ENXIO``, an ``OSError`` (``server_fault``)
    instead of the token's code."""
    state = tmp_path / "s"
    ensure_token(state)
    path = token_path(state)
    path.unlink()
    os.mkfifo(path, 0o600)
    for call in (read_token, ensure_token):
        refused = _read_within(call, state, path)
        assert isinstance(refused, StateDirError), refused
        assert refused.code is ReasonCode.TOKEN_INSECURE
        assert "token rotate" in str(refused)
    path.unlink()
    directory = os.open(state, os.O_PATH | os.O_DIRECTORY)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
            listening.bind(f"/proc/self/fd/{directory}/{TOKEN_FILE}")  # any length of path
            for call in (read_token, ensure_token):
                refused = _read_within(call, state, path)
                assert isinstance(refused, StateDirError), refused
                assert refused.code is ReasonCode.TOKEN_INSECURE
    finally:
        os.close(directory)
    path.unlink()
    assert read_token(state) is None  # and nothing was left in its place


def test_o2_a_state_directory_others_can_read_is_refused(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    with pytest.raises(StateDirError) as refused:
        ensure_token(tmp_path)
    assert refused.value.code is ReasonCode.STATE_DIR_INSECURE
    assert not token_path(tmp_path).exists()


def test_o3_rotate_replaces_the_token(tmp_path: Path) -> None:
    state = tmp_path / "s"
    first, _ = ensure_token(state)
    second = rotate_token(state)
    assert second != first
    assert len(second) == 43
    assert read_token(state) == second
    assert mode(token_path(state)) == 0o600
    assert ensure_token(state) == (second, False)
    assert not [name for name in os.listdir(state) if TMP_MARK in name]


def test_o3_rotate_replaces_an_insecure_token_and_creates_a_missing_one(tmp_path: Path) -> None:
    state = tmp_path / "s"
    ensure_token(state)
    token_path(state).chmod(0o644)
    fresh = rotate_token(state)
    assert mode(token_path(state)) == 0o600
    assert read_token(state) == fresh
    other = tmp_path / "other"
    assert rotate_token(other) == read_token(other)


def test_o4_tokens_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert token_matches("s3cret", "s3cret")
    assert not token_matches("s3cret", "s3cres")
    assert not token_matches("s3cret", "")
    assert not token_matches("s3cret", "sécret")  # non-ASCII is compared, not an error
    assert len(calls) == 4
    assert all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in calls)
