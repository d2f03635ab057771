"""The decision trace (coordinator/core/routing/decision_trace.py, control/decision_log.py):
each ``kv_aware`` cost term of the chosen worker and of the best holder, summing to the cost
the chooser ranked by; a route that leaves its holder says which term sent it away; the log
line of a decision and of an awaited route's end, with the evictions reported between them."""

from __future__ import annotations

import math

import structlog
from hypothesis import given
from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig
from coordinator.core.fleet import Candidate, RegisteredWorker, WorkerLoad
from coordinator.core.hashing import Namespace
from coordinator.core.hashing.page_hasher import tokens_to_bytes
from coordinator.core.index.page_events import PagesRemoved
from coordinator.core.routing import PromptInput, Scope
from coordinator.core.routing.choosers import kv_aware_cost
from coordinator.core.routing.decision_trace import cost_terms, trace_decision
from coordinator.core.routing.routing_values import KvAwareWeights, RoutingRequest
from coordinator.replica import CoordinatorReplica
from coordinator.store.memory import MemoryStore

PAGE = 16
TOKENS = list(range(200))  # 12 full pages and an 8-token tail
PROMPT = PromptInput(token_count=200, token_bytes=tokens_to_bytes(TOKENS))

loads = st.builds(
    WorkerLoad, running_requests=st.integers(0, 50), queued_tokens=st.integers(0, 10_000),
    free_pages=st.integers(0, 500), total_pages=st.sampled_from([0, 100, 500]),
    inflight_routes=st.integers(0, 20), inflight_tokens=st.integers(0, 10_000),
    prefill_backlog_tokens=st.floats(0, 50_000), active_tokens=st.integers(0, 20_000),
    attention_tokens=st.sampled_from([math.inf, 64.0, 500.0]))
weights = st.builds(KvAwareWeights, **{name: st.floats(0, 4) for name in (
    "prefill_token", "lower_tier_token", "queued_token", "running_request", "memory_pressure",
    "duplicate_token")})


@given(load=loads, weights=weights, cached=st.integers(0, 12), lower=st.integers(0, 12),
       best=st.integers(0, 12), copies=st.integers(1, 4))
def test_the_terms_sum_to_the_cost_the_chooser_ranks_by(
    load: WorkerLoad, weights: KvAwareWeights, cached: int, lower: int, best: int, copies: int,
) -> None:
    request = RoutingRequest(prompt_pages=12, prompt_tokens=200, page_size=PAGE, copies=copies)
    candidate = Candidate("w", cached, min(lower, cached), load)
    best = max(best, cached)
    terms = cost_terms(request, candidate, weights, best)
    assert math.isclose(terms.total, kv_aware_cost(request, candidate, weights, best),
                        rel_tol=1e-9, abs_tol=1e-6)
    assert min(terms.prefill, terms.queued, terms.running, terms.memory, terms.overflow,
               terms.duplicate) >= 0


def test_a_route_that_leaves_its_holder_names_the_term_that_sent_it_away() -> None:
    request = RoutingRequest(prompt_pages=12, prompt_tokens=200, page_size=PAGE)
    holder = Candidate("holder", 10, 0, WorkerLoad(prefill_backlog_tokens=5_000.0))
    idle = Candidate("idle", 0, 0, WorkerLoad())
    trace = trace_decision(request, [holder, idle], "idle", KvAwareWeights())
    assert trace.left_holder and trace.holder is not None
    assert (trace.chosen.worker_id, trace.holder.worker_id) == ("idle", "holder")
    assert (trace.holder.queued, trace.chosen.queued) == (5_000.0, 0.0)
    assert trace.chosen.duplicate == 10 * PAGE  # the copy a move makes, priced
    assert trace.chosen.total < trace.holder.total
    stays = trace_decision(request, [holder, idle], "holder", KvAwareWeights())
    assert not stays.left_holder and stays.holder == stays.chosen
    alone = trace_decision(request, [idle], "idle", KvAwareWeights())
    assert alone.holder is None and not alone.left_holder


def traced_replica(*workers: str) -> CoordinatorReplica:
    """A replica logging its decisions, with ``workers`` ready and external (their routes'
    ends are awaited)."""
    service = CoordinatorReplica(
        CoordinatorConfig(log_level="error", page_size=PAGE, decision_log=True),
        MemoryStore(namespace="trace"))
    for worker_id in workers:
        service.fleet.put(RegisteredWorker(
            worker_id=worker_id, incarnation=1, address=f"{worker_id}:7000", model="default",
            policy_version=0, external=True, total_pages=1024, lease_deadline=math.inf,
            connected=True))
    return service


def test_the_log_has_each_decision_and_its_end_with_the_evictions_between() -> None:
    service = traced_replica("w1", "w2")
    keys = service.hasher.page_keys(tokens_to_bytes(TOKENS), Namespace(page_size=PAGE))
    service.index.store("w1", keys[:12])
    with structlog.testing.capture_logs() as logs:
        route = service.router.route(PROMPT, Scope(), report_end=True)
        w1 = service.fleet.get("w1")
        assert w1 is not None
        w1.observe_page_events([PagesRemoved(tuple(keys[8:12]))], 0.0)  # evicted meanwhile
        service.router.end_routes([route.route_id])
    decision, ended = (e for e in logs if e["event"] in ("route.decision", "route.ended"))
    assert decision["event"] == "route.decision" and decision["route_id"] == route.route_id
    assert (decision["worker"], decision["left_holder"], decision["chosen_cached_pages"],
            decision["holder_worker_id"], decision["chosen_pages_removed"]) == (
        "w1", False, 12, "w1", 0)
    assert decision["candidates"] == 2
    assert math.isclose(decision["chosen_total"], sum(decision[f"chosen_{t}"] for t in (
        "prefill", "lower_tier", "queued", "running", "memory", "overflow", "duplicate")))
    assert (ended["event"], ended["route_id"], ended["worker"], ended["pages_removed"]) == (
        "route.ended", route.route_id, "w1", 4)


def test_without_the_decision_log_nothing_is_traced() -> None:
    service = CoordinatorReplica(CoordinatorConfig(log_level="error", page_size=PAGE),
                                 MemoryStore(namespace="untraced"))
    assert service.router.decision_sink is None
