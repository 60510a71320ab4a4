"""The process really out of file descriptors: the kernel's own ``EMFILE``, for the tests of
docs/design/lanes.md L21 (rooms and tasks alike)."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable, Iterator

import trio

__all__ = ["descriptors_left", "then_cancel"]


@contextlib.contextmanager
def descriptors_left(left: int) -> Iterator[Callable[[], None]]:
    """The process's descriptor table made small and filled but for ``left`` free places
    (``RLIMIT_NOFILE``, real ``EMFILE`` from the kernel); yields the release, which frees
    them all and puts the limit back (also when the block ends)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64, hard))
    hog: list[int] = []

    def release() -> None:
        while hog:
            os.close(hog.pop())
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    try:
        with contextlib.suppress(OSError):
            while True:
                hog.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        for _ in range(left):
            os.close(hog.pop())
        yield release
    finally:
        release()


async def then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once ``event`` is set (the first of several events to happen)."""
    await event.wait()
    scope.cancel()
