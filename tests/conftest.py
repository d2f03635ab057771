"""Shared fixtures: a real redis-server for the session, a fresh DB per test, and ``store``,
parametrized over the in-memory and the Redis implementation of ``MetadataStore``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis

from coordinator.core import accel
from coordinator.core.index.holdings import compiled_available
from coordinator.server.main import RunningCoordinator
from coordinator.store.memory import MemoryStore
from coordinator.store.protocol import MetadataStore
from coordinator.store.redis_store import RedisStore
from tests.auth_fixtures import IdentityFile, write_identities
from tests.coordinator_fixtures import running_coordinator
from tests.redis_server import RedisServer, redis_server_available

NAMESPACE = "test"

OpenPeer = Callable[[], Awaitable[MetadataStore]]


class FakeClock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def skip_without_redis() -> None:
    if not redis_server_available():
        pytest.skip("redis-server binary not found on PATH (apt-get install redis-server)")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One throwaway redis-server (no persistence) for the whole session."""
    skip_without_redis()
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, its DB flushed before the test."""
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushdb()
    return redis_server.url


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store_url(request: pytest.FixtureRequest) -> str | None:
    """None for the memory store, a flushed Redis URL for the Redis one."""
    if request.param == "memory":
        return None
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
async def store(store_url: str | None, clock: FakeClock) -> AsyncIterator[MetadataStore]:
    opened: MetadataStore
    if store_url is None:
        opened = MemoryStore(namespace=NAMESPACE, clock=clock)
    else:
        opened = await RedisStore.connect(store_url, namespace=NAMESPACE)
    yield opened
    await opened.close()


@pytest.fixture
async def open_peer(store: MetadataStore, store_url: str | None) -> AsyncIterator[OpenPeer]:
    """Opens another handle on the same state as ``store``, as another coordinator replica
    would: a separate connection for Redis, the very same object for memory (which cannot be
    shared any other way). Peers are closed after the test."""
    peers: list[MetadataStore] = []

    async def open_one() -> MetadataStore:
        if store_url is None:
            return store
        peer = await RedisStore.connect(store_url, namespace=NAMESPACE)
        peers.append(peer)
        return peer

    yield open_one
    for peer in peers:
        await peer.close()


@pytest.fixture
def identities(tmp_path: Path) -> IdentityFile:
    """An identities file (``tests.auth_fixtures.IDENTITIES``) with fresh tokens."""
    return write_identities(tmp_path)


@pytest.fixture
async def auth_coordinator(identities: IdentityFile) -> AsyncIterator[RunningCoordinator]:
    """A coordinator with auth on, serving ``identities``."""
    async with running_coordinator(auth_file=str(identities.path)) as running:
        yield running


INDEX_PATHS = [
    pytest.param(False, id="pure"),
    pytest.param(True, id="compiled",
                 marks=pytest.mark.skipif(not compiled_available(), reason=accel.status())),
]
"""Both holdings of the prefix index (coordinator.core.index.holdings), for tests to run on each."""
