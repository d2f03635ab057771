"""The engines bench's decision trace summary (bench/engines_trace.py) from log lines the real
decision log writes (a coordinator replica routing with ``decision_log``), joined by route id
to gateway lines: routes that left their holder and the term that sent them away, the
index's match against what the engine served, the evictions while a route ran. (make
test-vllm checks the join on a real gateway's log: every route traced and answered.)"""

from __future__ import annotations

import json
from pathlib import Path

import structlog

from bench.engines_trace import read_trace, sent_away_by, trace_text
from bench.engines_turns import turn_order
from coordinator.core.hashing import Namespace
from coordinator.core.hashing.page_hasher import tokens_to_bytes
from coordinator.core.index.page_events import PagesRemoved
from coordinator.core.routing import PromptInput, Scope
from tests.test_decision_trace import traced_replica

PAGE = 16
TOKENS = list(range(200))
PROMPT = PromptInput(token_count=200, token_bytes=tokens_to_bytes(TOKENS))


def test_the_trace_joins_decisions_ends_and_answers_by_route_id(tmp_path: Path) -> None:
    service = traced_replica("busy", "idle")
    keys = service.hasher.page_keys(tokens_to_bytes(TOKENS), Namespace(page_size=PAGE))
    service.index.store("busy", keys[:12])
    busy = service.fleet.get("busy")
    assert busy is not None
    with structlog.testing.capture_logs() as logs:
        stays = service.router.route(PROMPT, Scope(), report_end=True)
        busy.observe_page_events([PagesRemoved(tuple(keys[10:12]))], 0.0)
        service.router.end_routes([stays.route_id])
        busy.queue_prefill(50_000, 0.0, [])  # a long backlog: the next route leaves it
        leaves = service.router.route(PROMPT, Scope(), report_end=True)
        service.router.end_routes([leaves.route_id])
    assert (stays.worker_id, leaves.worker_id) == ("busy", "idle")
    gateway = [
        {"event": "gateway.request", "route_id": stays.route_id, "cached_tokens": 160},
        # The idle engine served two blocks the index did not know of when it routed.
        {"event": "gateway.request", "route_id": leaves.route_id, "cached_tokens": 64},
        {"event": "gateway.request", "status": 400, "outcome": "refused"},  # never routed
    ]
    log = tmp_path / "gateway.log"
    log.write_text("not json: a plain line\n" + "".join(
        json.dumps(entry) + "\n" for entry in [*logs, *gateway]))
    trace = read_trace([log, tmp_path / "absent.log"], PAGE)
    assert trace == {
        "routes": 2, "with_holder": 2, "left_holder": 1, "sent_away_by": {"queued": 1},
        "answered": 2, "matched_tokens": 12 * PAGE, "served_cached_tokens": 160 + 64,
        "shortfall_routes": 1, "shortfall_tokens": 12 * PAGE - 160,
        "surplus_routes": 1, "surplus_tokens": 64, "ended": 2,
        "evicted_pages": 2, "routes_with_evictions": 1}
    decision = next(e for e in logs if e.get("route_id") == leaves.route_id)
    assert sent_away_by(decision) == "queued"
    assert "1 left their holder (sent away by: queued 1)" in trace_text(trace)


def test_each_repeat_starts_with_the_next_router() -> None:
    routers = ("kv_aware", "smg_cache_aware", "smg_round_robin", "kvcoord_round_robin")
    assert [turn_order(routers, r)[0] for r in range(5)] == [
        "kv_aware", "smg_cache_aware", "smg_round_robin", "kvcoord_round_robin", "kv_aware"]
    assert sorted(turn_order(routers, 2)) == sorted(routers)
