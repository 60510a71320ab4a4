"""A result frame fits ``[server] max_frame_bytes`` (docs/design/protocol.md P14), over the
wire: a real server on 127.0.0.1, a real websocket client that takes frames of at most that
size, a real Fake-Pi worker answering from the runtime's scripted model.

Results go out in seq order and are sent again until acknowledged: one frame larger than a
client takes closes its connection (1009), and at every reconnect it comes first again — every
later result of every room waits behind it for ever."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import trio

from fake_pi.scenario import Text
from runtime._records import Result

from .._wire import message
from .test_serve import LIMIT, rig

BOUND: Final = 64 * 1024
SETTINGS: Final = {"server": {"max_frame_bytes": BOUND}}
LONG: Final = "x\x01é\U0001f600" * 40_000
"""160,000 characters, about 520 KB as JSON (a control character is six bytes escaped)."""


async def test_p14_a_reply_too_long_for_a_frame_is_cut_and_the_results_behind_it_arrive(
    tmp_path: Path,
) -> None:
    """P14: the long reply's result comes within the bound, its text the reply's beginning
    and ``truncated: true``; the next delivery's result follows; both come again, the same,
    to a client that reconnects without acknowledging them; the delivery's own log records
    the same words."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SETTINGS, [Text(text=LONG), Text(text="short")]) as r:
            async with r.connect(max_message_size=BOUND) as client:
                await client.send(message("d1"))
                await client.send(message("d2"))
                first = await client.result("d1")
                second = await client.result("d2")
            async with r.connect(max_message_size=BOUND) as client:
                again = [await client.result("d1"), await client.result("d2")]
            store = r.server.worker.store
            log = await store.read(store.delivery_rel("d1"))
    assert first["outcome"] == "reply"
    assert first["truncated"] is True
    assert LONG.startswith(first["text"])
    assert len(first["text"]) > 10_000
    assert (second["text"], second["truncated"]) == ("short", False)
    assert again == [first, second]
    (recorded,) = [record for record in log.records if isinstance(record, Result)]
    assert (recorded.text, recorded.truncated) == (first["text"], True)  # the log's words too


async def test_p14_a_result_recorded_under_a_larger_bound_is_sent_cut_after_a_restart(
    tmp_path: Path,
) -> None:
    """P14: a reply published whole under the default bound (256 KiB), not acknowledged, and
    the server restarted with a smaller one: the result comes again within the new bound, its
    text cut and ``truncated``, the same seq; the record keeps the whole reply."""
    whole = "y\x01" * 20_000  # 140,000 bytes as JSON: whole under 256 KiB, not under 64 KiB
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {}, [Text(text=whole)]) as r, r.connect() as client:
            await client.send(message("d1"))
            first = await client.result("d1")
        async with rig(tmp_path, SETTINGS) as r:
            async with r.connect(max_message_size=BOUND) as client:
                again = await client.result("d1")
            store = r.server.worker.store
            log = await store.read(store.delivery_rel("d1"))
    assert (first["text"], first["truncated"]) == (whole, False)
    assert again["seq"] == first["seq"]
    assert again["truncated"] is True
    assert whole.startswith(again["text"])
    assert len(again["text"]) > 1_000
    (recorded,) = [record for record in log.records if isinstance(record, Result)]
    assert (recorded.text, recorded.truncated) == (whole, False)
