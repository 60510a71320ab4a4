"""The access token: the secret a websocket client presents in ``hello``
(docs/design/protocol.md, serve.md).

It lives in ``<state>/token`` as raw text (no newline), mode 0600, owned by the user running
the server. :func:`ensure_token` creates it at first start; :func:`rotate_token` replaces it
(``pi-runtime token rotate``); :func:`read_token` reads the current one; clients are checked
with :func:`token_matches`. The invariants (O1…) are in ``docs/design/operations.md``.

* Creation and replacement are atomic and durable: an exclusive temp file (0600), fsync, then
  a hard link (create: fails if another process created the token first, whose token then
  wins) or a rename (rotate), then a directory fsync. A crash leaves either no token, the old
  one, or the new one — never a torn or empty file.
* A token file that others may read (any group or other permission bit), that is not a regular
  file, or that another user owns is refused (``token_insecure``); an empty or non-text one is
  refused (``token_invalid``). Nothing is repaired silently: the message says what to do.
* The token never appears in a log, a record or an error message. The only place it is shown is
  the one-time print of the command that made it.

Every function here is blocking (small file I/O); call them off the Trio loop.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Final

from .._errors import ReasonCode, StateDirError
from .._journal._store import _check_private
from .._journal._writer import TMP_MARK, atomic_write
from .._linux._fs import OsFileSystem

__all__ = [
    "TOKEN_BYTES",
    "TOKEN_FILE",
    "ensure_token",
    "read_token",
    "rotate_token",
    "token_matches",
    "token_path",
]

TOKEN_FILE: Final = "token"
TOKEN_BYTES: Final = 32
"""Random bytes in a token (``secrets.token_urlsafe(32)``: 43 URL-safe characters)."""
_MAX_TOKEN: Final = 4096


def token_path(state_dir: Path | str) -> Path:
    return Path(state_dir) / TOKEN_FILE


def _new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def _prepare(state_dir: Path) -> None:
    """The state directory exists (created 0700 if missing) and is private."""
    if not state_dir.exists():
        state_dir.mkdir(mode=0o700, parents=True)
    _check_private(state_dir)


def read_token(state_dir: Path | str) -> str | None:
    """The current token, or ``None`` when there is none yet.

    Raises :class:`StateDirError` ``token_insecure`` when the file is not a private regular
    file of this user (O2), ``token_invalid`` when it holds no usable token.
    """
    path = token_path(state_dir)
    try:
        # O_NONBLOCK: a FIFO's open returns at once, not once a writer comes (then refused
        # below as no regular file); a regular file's reads are what they are without it
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symbolic link: never followed
            raise StateDirError(
                ReasonCode.TOKEN_INSECURE,
                f"{path} is a symbolic link; remove it and run `pi-runtime token rotate`",
            ) from None
        if exc.errno == errno.ENXIO:  # a Unix socket (or a device without its driver)
            raise StateDirError(
                ReasonCode.TOKEN_INSECURE,
                f"{path} is not a regular file; remove it and run `pi-runtime token rotate`",
            ) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StateDirError(
                ReasonCode.TOKEN_INSECURE,
                f"{path} is not a regular file; remove it and run `pi-runtime token rotate`",
            )
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid != os.geteuid() or mode & 0o077:
            raise StateDirError(
                ReasonCode.TOKEN_INSECURE,
                f"{path} must be owned by uid {os.geteuid()} with mode 0600 (it is uid "
                f"{info.st_uid}, mode {mode:o}); others may have read the token, so replace "
                "it: `pi-runtime token rotate` (which writes a new one with mode 0600)",
            )
        data = os.read(fd, _MAX_TOKEN + 1)
    finally:
        os.close(fd)
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        token = ""
    if not token or len(data) > _MAX_TOKEN or not token.isprintable() or " " in token:
        raise StateDirError(
            ReasonCode.TOKEN_INVALID,
            f"{path} holds no usable token; replace it with `pi-runtime token rotate`",
        )
    return token


def _write_temp(state_dir: Path, token: str) -> str:
    """An exclusive, fsynced temp file holding ``token``; its path."""
    fs = OsFileSystem()
    tmp = str(token_path(state_dir)) + f"{TMP_MARK}{secrets.token_hex(8)}"
    handle = fs.open_exclusive(tmp)
    try:
        data = token.encode("ascii")
        if fs.write(handle, data) != len(data):
            raise OSError(errno.EIO, "short write of the token")
        fs.fsync(handle)
    except BaseException:
        fs.close(handle)
        with contextlib.suppress(OSError):
            fs.unlink(tmp)
        raise
    fs.close(handle)
    return tmp


def ensure_token(state_dir: Path | str) -> tuple[str, bool]:
    """The state directory's token, created if there is none: ``(token, created)``.

    The server calls this at start and prints the token only when ``created`` is true (O1).
    Creating the state directory (0700) if it is missing; a state directory others can read is
    refused (``state_dir_insecure``), as is an unsafe token file (``token_insecure``, O2).
    """
    root = Path(state_dir)
    _prepare(root)
    existing = read_token(root)
    if existing is not None:
        return existing, False
    token = _new_token()
    tmp = _write_temp(root, token)
    try:
        os.link(tmp, token_path(root))
    except FileExistsError:
        # another process created it between our read and our link: its token wins
        token_now = read_token(root)
        if token_now is None:  # pragma: no cover - removed again at once
            raise
        return token_now, False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    OsFileSystem().fsync_dir(str(root))
    return token, True


def rotate_token(state_dir: Path | str) -> str:
    """Replace the token (atomically and durably, mode 0600) and return the new one (O3).

    Works whether or not a token exists, and whatever the old file's mode was: an insecure
    token is exactly what rotation is for.
    """
    root = Path(state_dir)
    _prepare(root)
    token = _new_token()
    atomic_write(OsFileSystem(), str(token_path(root)), token.encode("ascii"))
    return token


def token_matches(expected: str, presented: str) -> bool:
    """Whether ``presented`` is the token, compared in constant time (O4)."""
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8"))
