"""A caller that goes away mid-call — a client whose connection closes while its frame is
acted on: the runtime's controls must not leave what they decided unrecorded."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


async def cancelled_once(
    begun: trio.Event, call: Callable[[], Awaitable[object]], *, then: trio.Event | None = None
) -> None:
    """Run ``call()`` as a caller cancelled the moment ``begun`` is set (the write it must not
    give up is under way); ``then``, if given, is set right after the cancel, to let that
    write go on. What ``call`` returns or raises once cancelled is dropped."""
    with trio.CancelScope() as caller:

        async def cancel_once_begun() -> None:
            await begun.wait()
            caller.cancel()
            if then is not None:
                then.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_once_begun)
            await call()
