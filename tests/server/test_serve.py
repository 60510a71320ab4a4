"""The websocket server (runtime._server._serve): tests named after the invariants S1… of
``docs/design/serve.md``, against a real server on 127.0.0.1 with real websocket clients and
a real Fake-Pi worker; each bad-input case of the wire protocol once, end to end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import trio.testing
import trustme
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    open_websocket_url,
)

from fake_pi.scenario import Step, Text
from runtime._cli._serve import _options
from runtime._config import config_from_dict
from runtime._server._serve import RoomServer, ServeOptions, check_bind, open_server
from runtime._server._token import rotate_token

from .._wire import Client, Frame, message
from .._workers import scripted_upstream

LIMIT: Final = 60.0


class Rig:
    def __init__(self, server: RoomServer, root: Path) -> None:
        self.server = server
        self.root = root

    @property
    def token(self) -> str:
        return (self.root / "state" / "token").read_text()

    @contextlib.asynccontextmanager
    async def connect(
        self, *, hello: bool = True, origin: str | None = None, max_message_size: int = 2**20
    ) -> AsyncIterator[Client]:
        """A client; ``max_message_size``: the largest frame it takes (trio-websocket's
        default, 1 MiB); a larger one closes the connection (1009)."""
        headers = [(b"Origin", origin.encode())] if origin is not None else None
        url = f"ws://127.0.0.1:{self.server.port}/"
        async with open_websocket_url(
            url, extra_headers=headers, max_message_size=max_message_size
        ) as ws:
            client = Client(ws)
            if hello:
                welcome = await client.hello(self.token)
                assert welcome["type"] == "welcome", welcome
            yield client


@contextlib.asynccontextmanager
async def rig(
    root: Path, settings: dict[str, Any] | None = None, steps: list[Step] | None = None
) -> AsyncIterator[Rig]:
    async with contextlib.AsyncExitStack() as stack:
        data = dict(settings or {})
        if steps is not None:
            _, url = await stack.enter_async_context(scripted_upstream(steps))
            data["model"] = {"base_url": url}
        config = config_from_dict(data, base=root)
        server = await stack.enter_async_context(
            open_server(config, ServeOptions(port=0), base_dir=root)
        )
        yield Rig(server, root)


def error(frame: Frame) -> tuple[str, str | None]:
    assert frame["type"] == "error", frame
    return frame["code"], frame.get("ref")


async def still_usable(client: Client) -> None:
    await client.send({"type": "status"})
    assert (await client.until(lambda f: f["type"] == "status"))["pending"] >= 0


# -- S1: who may connect ---------------------------------------------------------------


async def test_s1_hello_with_the_token_is_welcomed_and_a_wrong_one_closes(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r:
            assert r.server.new_token == r.token  # created at this first start
            async with r.connect(hello=False) as client:
                welcome = await client.hello(r.token)
                assert welcome == {
                    "type": "welcome",
                    "protocol": 1,
                    "worker_id": r.server.worker_id,
                }
            async with r.connect(hello=False) as client:
                assert error(await client.hello("not-the-token")) == ("token_invalid", "hello")
                with pytest.raises(ConnectionClosed) as closed:
                    await client.receive()
                assert closed.value.reason is not None
                assert closed.value.reason.code == 1008


async def test_s1_a_hello_without_a_token_is_refused_and_may_be_sent_again(
    tmp_path: Path,
) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect(hello=False) as client:
            await client.send({"type": "hello", "protocol": 1, "client": "t"})
            assert error(await client.receive()) == ("missing_field", "hello")
            assert (await client.hello(r.token))["type"] == "welcome"


async def test_s1_a_rotated_token_acts_at_the_next_hello(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r:
            old = r.token
            new = await trio.to_thread.run_sync(rotate_token, tmp_path / "state")
            async with r.connect(hello=False) as client:
                assert error(await client.hello(old))[0] == "token_invalid"
            async with r.connect(hello=False) as client:
                assert (await client.hello(new))["type"] == "welcome"


async def test_s1_a_foreign_origin_is_refused_an_allowed_one_served(tmp_path: Path) -> None:
    settings = {"server": {"allowed_origins": ["https://ok.example"]}}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings) as r:
            with pytest.raises(ConnectionRejected) as rejected:
                async with r.connect(origin="https://evil.example"):
                    pass
            assert rejected.value.status_code == 403
            assert json.loads(rejected.value.body or b"{}")["code"] == "origin_refused"
            async with r.connect(origin="https://ok.example") as client:
                await still_usable(client)


async def test_s1_an_unsupported_protocol_is_refused_and_closed(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect(hello=False) as client:
            reply = await client.hello(r.token, protocol=[7, 9])
            assert error(reply) == ("unsupported_protocol", "hello")
            with pytest.raises(ConnectionClosed):
                await client.receive()


# -- S2: bad input ---------------------------------------------------------------------


BAD_FRAMES: Final = [
    ("not json", "not_json"),
    ("[1, 2]", "not_an_object"),
    ('{"type": "shout"}', "unknown_type"),
    ('{"type": "cancel"}', "missing_field"),
    ('{"type": "ack", "seq": 1, "extra": true}', "unknown_field"),
    ('{"type": "ack", "seq": "one"}', "wrong_type"),
    (json.dumps({"type": "status", "room": "x" * 300_000}), "frame_too_large"),
    (b"\x00\x01", "binary_frame"),
]


@pytest.mark.parametrize(("frame", "code"), BAD_FRAMES, ids=[c for _, c in BAD_FRAMES])
async def test_s2_each_bad_frame_gets_its_code_and_the_connection_stays_usable(
    tmp_path: Path, frame: str | bytes, code: str
) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r:
            async with r.connect() as client:  # after hello
                await client.send(frame)
                assert error(await client.receive())[0] == code
                await still_usable(client)
            async with r.connect(hello=False) as client:  # before hello, too
                await client.send(frame)
                assert error(await client.receive())[0] == code
                assert (await client.hello(r.token))["type"] == "welcome"


async def test_s2_frames_before_hello_are_refused_and_hello_still_works(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect(hello=False) as client:
            await client.send(message("d1"))
            assert error(await client.receive()) == ("hello_required", "deliver")
            assert (await client.hello(r.token))["type"] == "welcome"
            assert r.server.worker.pending() == []  # nothing was admitted before hello


async def test_s2_refusals_of_the_worker_carry_the_delivery_id(tmp_path: Path) -> None:
    """Invalid and refused rooms, a conflicting repeat, a cancel of an unknown delivery."""
    settings: dict[str, Any] = {"rooms": {"dm:1": {}}}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings) as r, r.connect() as client:
            await client.send(message("d1", room="no room"))
            assert error(await client.receive()) == ("room_invalid", "d1")
            await client.send(message("d2", room="dm:2"))
            assert error(await client.receive()) == ("room_refused", "d2")
            await client.send(message("d3"))
            await client.until(lambda f: f["type"] == "accepted")
            await client.send(message("d3", text="changed"))
            assert error(await client.until(lambda f: f["type"] == "error")) == (
                "delivery_conflict",
                "d3",
            )
            await client.send({"type": "cancel", "delivery_id": "nobody"})
            assert error(await client.until(lambda f: f["type"] == "error")) == (
                "delivery_unknown",
                "nobody",
            )
            result = await client.result("d3")
            assert result["outcome"] == "reply"


# -- S3: durable results ---------------------------------------------------------------


async def test_s3_results_reach_every_connection_and_come_again_until_acknowledged(
    tmp_path: Path,
) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r:
            async with r.connect() as first, r.connect() as second:
                await first.send(message("d1"))
                accepted = await first.receive()
                assert accepted == {
                    "type": "accepted",
                    "delivery_id": "d1",
                    "room": "dm:1",
                    "disposition": "started",
                }
                mine, theirs = await first.result("d1"), await second.result("d1")
                assert mine == theirs
                assert mine["seq"] == 1
            async with r.connect() as again:  # nothing acknowledged: re-sent with its seq
                assert await again.result("d1") == mine
                await again.send({"type": "ack", "seq": 1})
                await again.send(message("d2"))
                assert (await again.result("d2"))["seq"] == 2
            async with r.connect(hello=False) as late:
                assert (await late.hello(r.token, ack_seq=2))["type"] == "welcome"
                await late.send(message("d3"))
                assert (await late.until(lambda f: f["type"] == "result"))["delivery_id"] == "d3"


async def test_s3_a_repeated_delivery_is_a_duplicate_with_its_stored_result(
    tmp_path: Path,
) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as client:
            await client.send(message("d1"))
            first = await client.result("d1")
            await client.send({"type": "ack", "seq": first["seq"]})
            await client.send(message("d1"))
            accepted = await client.until(lambda f: f["type"] == "accepted")
            assert accepted["disposition"] == "duplicate"
            assert await client.until(lambda f: f["type"] == "result") == first


async def test_s3_a_client_gone_mid_turn_gets_the_result_after_it_reconnects(
    tmp_path: Path,
) -> None:
    release = trio.Event()
    steps: list[Step] = [Text(text="waited for you")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=lambda n: release.wait()) as (_, url):
            config = config_from_dict({"model": {"base_url": url}}, base=tmp_path)
            async with open_server(config, ServeOptions(port=0), base_dir=tmp_path) as server:
                r = Rig(server, tmp_path)
                async with r.connect() as client:
                    await client.send(message("d1"))
                    await client.until(lambda f: f["type"] == "accepted")
                # the client is gone; the turn goes on
                release.set()
                async with r.connect() as client:
                    result = await client.result("d1")
    assert (result["outcome"], result["text"]) == ("reply", "waited for you")


# -- S4: backpressure ------------------------------------------------------------------


async def test_s4_one_delivery_over_the_in_flight_cap_is_refused_not_dropped(
    tmp_path: Path,
) -> None:
    release = trio.Event()
    steps: list[Step] = [Text(text="one"), Text(text="two")]
    settings: dict[str, Any] = {"server": {"max_in_flight": 1}}
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=lambda n: release.wait()) as (_, url):
            config = config_from_dict({**settings, "model": {"base_url": url}}, base=tmp_path)
            async with open_server(config, ServeOptions(port=0), base_dir=tmp_path) as server:
                r = Rig(server, tmp_path)
                async with r.connect() as client:
                    await client.send(message("d1"))
                    await client.until(lambda f: f["type"] == "accepted")
                    await client.send(message("d2", room="dm:2"))
                    assert error(await client.until(lambda f: f["type"] == "error")) == (
                        "too_many_in_flight",
                        "d2",
                    )
                    assert server.worker.pending() == ["d1"]  # d2 was never admitted
                    release.set()
                    await client.result("d1")
                    await client.send(message("d2", room="dm:2"))  # room again: accepted
                    assert (await client.result("d2"))["outcome"] == "reply"


async def test_s4_a_retry_of_a_finished_delivery_is_answered_at_the_cap(tmp_path: Path) -> None:
    """S4: the in-flight cap counts what a connection would have admitted and unfinished; a
    retried ``deliver`` of a finished delivery admits nothing, so a connection at its cap
    still gets ``accepted{duplicate}`` and the stored result. Before, it was refused
    ``too_many_in_flight`` (a reconnecting client re-sending what it has no result for was
    told to wait for results it already had)."""
    release = trio.Event()

    async def hold_the_second(n: int) -> None:
        if n > 1:
            await release.wait()

    steps: list[Step] = [Text(text="zero"), Text(text="one")]
    settings: dict[str, Any] = {"server": {"max_in_flight": 1}}
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=hold_the_second) as (_, url):
            config = config_from_dict({**settings, "model": {"base_url": url}}, base=tmp_path)
            async with open_server(config, ServeOptions(port=0), base_dir=tmp_path) as server:
                r = Rig(server, tmp_path)
                async with r.connect() as client:
                    await client.send(message("d0"))
                    first = await client.result("d0")
                    await client.send(message("d1", room="dm:2"))  # held: the cap is reached
                    await client.until(lambda f: f["type"] == "accepted")
                    await client.send(message("d0"))  # the retry of a finished one
                    answer = await client.until(lambda f: f["type"] in ("accepted", "error"))
                    again = await client.result("d0") if answer["type"] == "accepted" else None
                    release.set()
                    await client.result("d1")
    assert (answer["type"], answer.get("disposition")) == ("accepted", "duplicate")
    assert again is not None
    assert again["seq"] == first["seq"]


# -- S6: where it may listen -----------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.1", "example.com"])
def test_s6_a_non_loopback_bind_needs_tls_or_the_insecure_flag(host: str) -> None:
    with pytest.raises(Exception, match="config_invalid: host"):
        check_bind(ServeOptions(host=host))
    check_bind(ServeOptions(host=host, insecure_bind=True))


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.8.9.10"])
def test_s6_loopback_binds_need_nothing(host: str) -> None:
    check_bind(ServeOptions(host=host))


async def test_s6_with_tls_a_client_that_trusts_the_certificate_is_served(
    tmp_path: Path,
) -> None:
    """The certificate and key files of ``--tls-cert`` / ``--tls-key``, served over wss."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    args = argparse.Namespace(
        host="0.0.0.0", port=0, tls_cert=cert, tls_key=key, insecure_bind=False
    )
    options = _options(args)
    check_bind(options)  # TLS: a non-loopback address is allowed
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    config = config_from_dict({}, base=tmp_path)
    served = ServeOptions(host="127.0.0.1", port=0, ssl_context=options.ssl_context)
    with trio.fail_after(LIMIT):
        async with open_server(config, served, base_dir=tmp_path) as server:
            token = (tmp_path / "state" / "token").read_text()
            url = f"wss://127.0.0.1:{server.port}/"
            async with open_websocket_url(url, ssl_context=trusting) as ws:
                assert (await Client(ws).hello(token))["type"] == "welcome"


def test_s6_tls_needs_both_files(tmp_path: Path) -> None:
    args = argparse.Namespace(host="127.0.0.1", port=0, tls_cert=tmp_path / "c.pem", tls_key=None)
    with pytest.raises(Exception, match="config_invalid: tls"):
        _options(args)


async def test_s5_a_flush_does_not_wait_on_a_connection_that_closed() -> None:
    """S5: on the way out the server lets each connection receive the results published so
    far, for a bounded time. A connection that closes meanwhile will never receive them: the
    flush stops waiting on it at once, instead of spending the rest of its time there."""
    from runtime._server._serve import _Connection

    connection = _Connection(ws=None, peer="127.0.0.1:1")  # type: ignore[arg-type]
    with trio.fail_after(5):  # a bound, never reached when the close wakes the wait
        async with trio.open_nursery() as nursery:
            nursery.start_soon(connection.sent_up_to, 3)  # results 1-3 not sent yet
            await trio.testing.wait_all_tasks_blocked()
            connection.close()
    assert connection.closed
