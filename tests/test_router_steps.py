"""``Router``'s two steps, choose then reserve: a route no worker can take is refused by the
choose step before the reserve step changes anything, and the worker chosen is the one
reserved. A real replica over the embedded store, sessions installed directly."""

from __future__ import annotations

import math

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.errors import Unavailable
from coordinator.core.fleet import RegisteredWorker
from coordinator.core.hashing import Namespace
from coordinator.core.hashing.page_hasher import tokens_to_bytes
from coordinator.core.routing import PromptInput, Scope
from coordinator.replica import CoordinatorReplica
from coordinator.store.memory import MemoryStore
from coordinator.wire import Reason

PAGE = 16
TOKENS = list(range(40))  # two full pages and an 8-token tail
PROMPT = PromptInput(token_count=40, token_bytes=tokens_to_bytes(TOKENS))


def replica() -> CoordinatorReplica:
    """Two READY workers at version 0; w1 holds the prompt's first page."""
    service = CoordinatorReplica(CoordinatorConfig(log_level="error", page_size=PAGE),
                                 MemoryStore(namespace="steps"))
    for worker_id in ("w1", "w2"):
        service.fleet.put(RegisteredWorker(
            worker_id=worker_id, incarnation=1, address=f"{worker_id}:7000", model="default",
            policy_version=0, external=False, total_pages=1024, lease_deadline=math.inf,
            connected=True,
        ))
    service.index.store("w1", keys(service)[:1])
    return service


def keys(service: CoordinatorReplica) -> list[bytes]:
    return service.hasher.page_keys(tokens_to_bytes(TOKENS), Namespace(page_size=PAGE))


def books(service: CoordinatorReplica) -> tuple[object, ...]:
    """Everything a reservation changes."""
    loads = [(s.worker_id, s.current_load(), s.routed_requests, s.prefill_backlog(0.0))
             for s in service.fleet]
    return (service.router.counters, service.index.stats(), loads, len(service.router.awaited))


def test_a_route_no_worker_can_take_is_refused_no_worker_and_reserves_nothing() -> None:
    service = replica()
    before = repr(books(service))
    with pytest.raises(Unavailable) as refused:
        service.router.route(PROMPT, Scope(), exclude=frozenset({"w1", "w2"}))
    assert (refused.value.reason, refused.value.retry_after_ms) == (Reason.NO_WORKER, 500)
    assert str(refused.value) == (
        "no routable worker serves model 'default' at policy version 0")
    assert repr(books(service)) == before
    # No route id was spent either: the next route gets the first one.
    assert service.router.route(PROMPT, Scope()).route_id.endswith("-1")


def test_the_worker_chosen_is_the_one_reserved_for_the_pages_it_lacks() -> None:
    service = replica()
    route = service.router.route(PROMPT, Scope())
    assert (route.worker_id, route.matched_pages, route.prompt_pages) == ("w1", 1, 2)
    assert service.index.match_detail(keys(service), include_pending=True)["w1"].pages == 2
    assert "w2" not in service.index.match_detail(keys(service), include_pending=True)
    w1, w2 = service.fleet.get("w1"), service.fleet.get("w2")
    assert w1 is not None and w2 is not None
    assert (w1.current_load().inflight_routes, w1.current_load().inflight_tokens) == (1, 24)
    assert (w2.current_load().inflight_routes, w1.routed_requests, w2.routed_requests) == (0, 1, 0)
    counters = service.router.counters
    assert (counters.routes, counters.prompt_tokens, counters.cached_tokens) == (1, 40, 16)
