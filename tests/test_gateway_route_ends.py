"""The gateway ends its routes by id for engines behind a bridge, and only for them: an
external worker (a scripted bridge whose heartbeats settle every route, as ``kvcoord bridge``'s
do) serving through a reference worker's OpenAI endpoint carries a streamed request as load for
as long as the stream runs, and not a moment longer; a reference worker's routes are settled by
its own heartbeats (the gateway sends nothing for them)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient
from coordinator.client.types import Route
from kvcoord.gateway.routing import END_BATCH_S, RouteEnds
from tests.coordinator_fixtures import DEV_HASH, eventually, running_coordinator, target
from tests.test_gateway import MODEL, PAGE, Fleet, running_fleet

SETTLE_ALL = 1 << 30  # a bridge's heartbeat (worker/bridge/bridge.py)


class HeldRelay:
    """A loopback TCP relay in front of a real endpoint whose answers wait while ``held`` is
    clear: a generation made to last as long as the test needs (the reference model answers
    in milliseconds), without touching either side."""

    def __init__(self, port: int) -> None:
        self._port = port
        self.held = asyncio.Event()
        self.held.set()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _relay(self, client_in: asyncio.StreamReader,
                     client_out: asyncio.StreamWriter) -> None:
        upstream_in, upstream_out = await asyncio.open_connection("127.0.0.1", self._port)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter,
                       gated: bool) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await source.read(65536):
                    if gated:
                        await self.held.wait()
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pump(client_in, upstream_out, False),
                             pump(upstream_in, client_out, True))

    async def close(self) -> None:
        self.held.set()
        if self._server is not None:
            self._server.close()


@contextlib.asynccontextmanager
async def bridged_engine(fleet: Fleet, relay: HeldRelay | None = None
                         ) -> AsyncIterator[ScriptedWorker]:
    """An external worker "engine" whose OpenAI endpoint is w0's (through ``relay`` when
    given), heartbeating as a bridge does; the reference workers cordoned, so every route goes
    to the engine."""
    w0 = fleet.workers[0]
    assert w0.http_port is not None
    port = w0.http_port if relay is None else await relay.start()
    engine = ScriptedWorker(target(fleet.coordinator), "engine", external=True,
                            hash_config=DEV_HASH.__class__(key=DEV_HASH.key, page_size=PAGE),
                            http_url=f"http://127.0.0.1:{port}")
    await engine.start()

    async def heartbeats() -> None:
        while True:
            await engine.heartbeat(completed_routes=SETTLE_ALL)
            await asyncio.sleep(0.1)

    beating = asyncio.create_task(heartbeats())
    try:
        async with AsyncCoordinatorClient(target(fleet.coordinator)) as admin:
            for worker in fleet.workers:
                await admin.cordon(worker.worker_id)
        yield engine
    finally:
        beating.cancel()
        await engine.close()


async def _held_request(fleet: Fleet, relay: HeldRelay, session: aiohttp.ClientSession,
                        body: dict[str, Any]) -> asyncio.Task[aiohttp.ClientResponse]:
    """``body`` sent through the gateway, its answer held at the relay: the task, once the
    coordinator counts the engine's route."""
    relay.held.clear()
    answering = asyncio.create_task(session.post(f"{fleet.url}/v1/completions", json=body))

    async def routed() -> bool:
        return await _inflight(fleet, "engine") == 1

    await eventually(routed, what="the engine's route held")
    return answering


async def _inflight(fleet: Fleet, worker_id: str) -> int:
    async with AsyncCoordinatorClient(target(fleet.coordinator)) as client:
        (info,) = [w for w in await client.workers() if w.worker_id == worker_id]
    return info.inflight_routes


async def test_a_bridged_engine_carries_a_request_as_load_until_the_gateway_ends_it() -> None:
    async with running_fleet() as fleet:
        relay = HeldRelay(fleet.workers[0].http_port or 0)
        async with bridged_engine(fleet, relay):
            body = {"model": MODEL, "prompt": "a long stream for the engine", "max_tokens": 20,
                    "stream": True}
            async with aiohttp.ClientSession() as session:
                answering = await _held_request(fleet, relay, session, body)
                await asyncio.sleep(0.35)  # several settle-all heartbeats meanwhile
                assert await _inflight(fleet, "engine") == 1
                relay.held.set()
                async with await answering as response:
                    assert response.headers["x-kvcoord-worker"] == "engine"
                    assert response.headers["x-kvcoord-route-id"]
                    rest = (await response.read()).decode()
            assert rest.rstrip().endswith("data: [DONE]")

            async def ended() -> bool:
                return await _inflight(fleet, "engine") == 0

            await eventually(ended, timeout=2.0, what="the gateway ending the engine's route")
            assert fleet.gateway._routes.ends.sent == 1
            await relay.close()


async def test_a_client_gone_before_the_answer_ends_the_engines_route_too() -> None:
    async with running_fleet() as fleet:
        relay = HeldRelay(fleet.workers[0].http_port or 0)
        async with bridged_engine(fleet, relay):
            body = {"model": MODEL, "prompt": "leave the engine waiting", "max_tokens": 20}
            async with aiohttp.ClientSession() as session:
                answering = await _held_request(fleet, relay, session, body)
                answering.cancel()  # the client goes away
                with contextlib.suppress(asyncio.CancelledError):
                    await answering

            async def ended() -> bool:
                return await _inflight(fleet, "engine") == 0

            await eventually(ended, timeout=3.0, what="the abandoned request's route ended")
            await relay.close()


async def test_reference_workers_routes_are_not_awaited_and_settle_by_heartbeat() -> None:
    async with running_fleet() as fleet:
        body = {"model": MODEL, "prompt": "a reference worker's request", "max_tokens": 4}
        async with aiohttp.ClientSession() as session, \
                session.post(f"{fleet.url}/v1/completions", json=body) as response:
            worker = response.headers["x-kvcoord-worker"]
            assert response.status == 200 and worker in ("w0", "w1")
        assert fleet.gateway._routes.ends.sent == 0  # nothing to end: the worker reports it

        async def settled() -> bool:
            return await _inflight(fleet, worker) == 0

        await eventually(settled, timeout=3.0, what="the worker's heartbeat settling its route")


async def test_ends_close_together_go_in_one_call_per_caller() -> None:
    """Ends within ``END_BATCH_S`` of each other are one ``EndRoutes`` per caller token (one
    call per request cost a tenth of the picker's CPU); a later end is a call of its own; a
    flush sends what is gathered at once."""
    def routes(*ids: str) -> list[Route]:
        return [Route("w", "w:1", 0, 0, route_id=i, end_awaited=True) for i in ids]

    async with running_coordinator() as coordinator, AsyncCoordinatorClient(
            f"127.0.0.1:{coordinator.port}") as client:
        ends = RouteEnds(client)
        for i in range(5):
            ends.end(routes(f"a{i}"), None)
        ends.end(routes("b0", "b1"), "another-token")
        ends.end([Route("w", "w:1", 0, 0, route_id="reported", end_awaited=False)], None)
        assert ends.calls == 0  # gathered, not yet sent
        await asyncio.sleep(END_BATCH_S * 4)
        assert (ends.sent, ends.calls) == (7, 2)
        ends.end(routes("c0"), None)
        await ends.flush()
        assert (ends.sent, ends.calls) == (8, 3)
