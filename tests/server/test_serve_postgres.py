"""``pi-runtime serve --store DSN``: a real server process on the PostgreSQL journal store
(docs/design/scale-out.md, postgres-store.md PG14), against a throw-away PostgreSQL
(``tests/journal/pg_fixtures.py``) and real websocket clients."""

from __future__ import annotations

from pathlib import Path

import trio

from fake_pi.scenario import Step, Text
from runtime._journal._postgres import PgStore

from .._wire import message
from .._workers import scripted_upstream
from ..journal.pg_fixtures import execute, pg_dsn, pg_server
from .test_serve_e2e import LIMIT, serve, write_config

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses


async def test_serve_on_postgresql_survives_sigkill_mid_turn_with_one_result_each(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S3, S10: a host serving from the database answers d1 (acknowledged) and is SIGKILLed
    while d2's model request is open. Started again under the same host name, it takes its
    lane back at once (a new epoch), and gets d2's result once (seq 2) and never d1's again;
    every record is in the database, none in the state directory."""
    arrived, killed = trio.Event(), trio.Event()

    async def on_request(n: int) -> None:
        if n == 2:
            arrived.set()
            await killed.wait()  # d2's first request never answers: the server dies

    steps: list[Step] = [Text(text="one"), Text(text="never sent"), Text(text="two")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=on_request) as (model, url):
            config = write_config(tmp_path, url)
            async with (
                serve(tmp_path, config, "--store", pg_dsn) as server,
                server.connect() as client,
            ):
                await client.send(message("d1"))
                first = await client.result("d1")
                await client.send({"type": "ack", "seq": first["seq"]})
                await client.send(message("d2"))
                await client.until(lambda f: f["type"] == "accepted")
                await arrived.wait()
                await server.kill()
                killed.set()
            async with (
                serve(tmp_path, config, "--store", pg_dsn) as server,
                server.connect() as client,
            ):
                second = await client.until(lambda f: f["type"] == "result")
                await client.send({"type": "status"})
                rest = await client.until(lambda f: f["type"] in ("status", "result"))
    assert (first["delivery_id"], first["seq"]) == ("d1", 1)
    assert (second["delivery_id"], second["outcome"], second["text"]) == ("d2", "reply", "two")
    assert second["seq"] == 2
    assert rest["type"] == "status"  # no other result came: d1 was acknowledged
    assert model.request_count == 3
    epochs = await execute(
        pg_dsn, "SELECT epoch FROM pi_runtime.lanes WHERE lane = %s", [PgStore.lane_rel("dm:1")]
    )
    assert epochs == [(2,)]  # claimed by the first life, then again by the second
    logs = {
        row[0] for row in await execute(pg_dsn, "SELECT DISTINCT log FROM pi_runtime.log_records")
    }
    assert {"admissions/admissions.log", "results.log"} <= logs
    assert sum(log.startswith("deliveries/") for log in logs) == 2
    state = tmp_path / "state"
    assert not (state / "deliveries").exists()
    assert not (state / "results.log").exists()
