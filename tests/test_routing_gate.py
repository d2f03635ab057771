"""``RoutingGate``: what a Route and a RouteBatch pass before the router decides. A route
without a pinned version waits while a sync update drains and is refused DRAINING when the
drain outlasts the wait; a replica that has not read the policy state within
``policy_stale_ms`` refuses POLICY_STALE; a refused route reserves nothing. A real replica over
the embedded store; the clock is a fake where a test moves it."""

from __future__ import annotations

import asyncio
import math

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.errors import Unavailable
from coordinator.core.fleet import RegisteredWorker
from coordinator.core.hashing.page_hasher import tokens_to_bytes
from coordinator.core.policy_state import PolicyPhase, PolicyRecord
from coordinator.core.routing import PromptInput, Scope
from coordinator.replica import CoordinatorReplica
from coordinator.store.memory import MemoryStore
from coordinator.wire import Reason

PAGE = 16
PROMPT = PromptInput(token_count=40, token_bytes=tokens_to_bytes(list(range(40))))
DRAINING_0_TO_1 = PolicyRecord(version=0, phase=PolicyPhase.DRAINING, target_version=1,
                               epoch=1)
ABORTED_BACK_TO_0 = PolicyRecord(version=0, phase=PolicyPhase.SERVING, epoch=2)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def replica(clock: FakeClock | None = None, **settings: int) -> CoordinatorReplica:
    """A replica with one READY worker serving version 0."""
    config = CoordinatorConfig(log_level="error", page_size=PAGE, route_retry_ms=321,
                               policy_stale_ms=5_000, **settings)  # type: ignore[arg-type]
    service = (CoordinatorReplica(config, MemoryStore(namespace="gate")) if clock is None
               else CoordinatorReplica(config, MemoryStore(namespace="gate"), clock=clock))
    service.fleet.put(RegisteredWorker(
        worker_id="w1", incarnation=1, address="10.0.0.1:7000", model="default",
        policy_version=0, external=False, total_pages=1024, lease_deadline=math.inf,
        connected=True,
    ))
    return service


def never_asked() -> float | None:
    raise AssertionError("a route that does not wait never reads the caller's deadline")


def assert_nothing_routed(service: CoordinatorReplica) -> None:
    assert service.router.counters.routes == 0
    assert service.index.stats().pending == 0
    assert service.fleet.get("w1").current_load().inflight_routes == 0  # type: ignore[union-attr]


async def test_with_nothing_draining_a_route_is_the_routers_decision_at_once() -> None:
    service = replica()
    route = await service.routing_gate.route(PROMPT, Scope(), time_left=never_asked)
    assert (route.worker_id, route.policy_version, route.prompt_pages) == ("w1", 0, 2)
    assert service.router.counters.routes == 1
    assert service.index.stats().pending == 2  # both pages pending on w1


async def test_a_drain_outlasting_the_wait_is_refused_draining_with_retry_info() -> None:
    service = replica(route_wait_ms=20)
    service.policy_view.set(DRAINING_0_TO_1)
    with pytest.raises(Unavailable) as refused:
        await service.routing_gate.route(PROMPT, Scope(), time_left=lambda: None)
    error = refused.value
    assert (error.reason, error.retry_after_ms, dict(error.metadata)) == (
        Reason.DRAINING, 321, {"target_version": "1"})
    assert str(error) == "policy update to version 1 is draining the fleet: retry"
    assert_nothing_routed(service)


async def test_the_callers_deadline_cuts_the_wait_for_a_drain() -> None:
    # route_wait_ms is a minute: only the deadline (50 ms short of it: none left) ends the wait.
    service = replica(route_wait_ms=60_000)
    service.policy_view.set(DRAINING_0_TO_1)
    with pytest.raises(Unavailable) as refused:
        await asyncio.wait_for(
            service.routing_gate.route(PROMPT, Scope(), time_left=lambda: 0.04), timeout=10)
    assert refused.value.reason is Reason.DRAINING
    assert_nothing_routed(service)


async def test_a_drain_that_ends_within_the_wait_lets_the_route_through() -> None:
    service = replica(route_wait_ms=60_000)
    service.policy_view.set(DRAINING_0_TO_1)
    waiting = asyncio.create_task(
        service.routing_gate.route(PROMPT, Scope(), time_left=lambda: None))
    await asyncio.sleep(0)  # the route runs up to its wait
    assert not waiting.done()
    assert service.router.counters.routes == 0
    service.policy_view.set(ABORTED_BACK_TO_0)  # wakes the waiter
    route = await asyncio.wait_for(waiting, timeout=10)
    assert (route.worker_id, route.policy_version) == ("w1", 0)
    assert service.router.counters.routes == 1


async def test_a_route_pinned_to_a_version_never_waits_for_a_drain() -> None:
    service = replica(route_wait_ms=60_000)
    service.policy_view.set(DRAINING_0_TO_1)
    route = await service.routing_gate.route(PROMPT, Scope(policy_version=0),
                                             time_left=never_asked)
    assert (route.worker_id, route.policy_version) == ("w1", 0)


async def test_a_stale_policy_state_is_refused_policy_stale_and_routes_nothing() -> None:
    clock = FakeClock()
    service = replica(clock)
    clock.now += 5.001  # past policy_stale_ms since the last read
    with pytest.raises(Unavailable) as refused:
        await service.routing_gate.route(PROMPT, Scope(), time_left=never_asked)
    assert (refused.value.reason, refused.value.retry_after_ms) == (Reason.POLICY_STALE, 321)
    assert "has not read the policy state for 5001 ms" in str(refused.value)
    assert_nothing_routed(service)
    clock.now -= 0.002  # within policy_stale_ms again: routed
    assert (await service.routing_gate.route(PROMPT, Scope(), time_left=never_asked)).worker_id \
        == "w1"


async def test_freshness_is_checked_after_the_drain_so_a_stale_drain_reads_draining() -> None:
    clock = FakeClock()  # does not move: the wait is cut by the deadline alone
    service = replica(clock)
    service.policy_view.set(DRAINING_0_TO_1)
    clock.now += 5.001
    with pytest.raises(Unavailable) as refused:
        await service.routing_gate.route(PROMPT, Scope(), time_left=lambda: 0.0)
    assert refused.value.reason is Reason.DRAINING
    assert_nothing_routed(service)


async def test_a_batch_waits_once_and_is_refused_whole_during_a_drain() -> None:
    service = replica(route_wait_ms=20)
    service.policy_view.set(DRAINING_0_TO_1)
    with pytest.raises(Unavailable) as refused:
        await service.routing_gate.route_batch([PROMPT, PROMPT], Scope(), time_left=lambda: None)
    assert refused.value.reason is Reason.DRAINING
    assert_nothing_routed(service)
    service.policy_view.set(ABORTED_BACK_TO_0)
    batch = await service.routing_gate.route_batch([PROMPT, PROMPT], Scope(),
                                                   time_left=never_asked)
    assert [r.worker_id for r in batch.routes] == ["w1", "w1"]
    assert (batch.order, service.router.counters.routes) == ([0, 1], 2)
