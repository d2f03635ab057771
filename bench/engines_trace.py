"""The engines bench's decision trace: why each ``kv_aware`` route went where it went, and what
the chosen engine then served from its cache.

Our router runs with ``KVCOORD_DECISION_LOG=1``: its coordinator logs each decision
(``route.decision``: the chosen worker's and the best holder's cost term by term, with the
evictions each engine has reported so far) and each route's end (``route.ended``); the gateway
logs each request (``gateway.request``: the route's id, the tokens the index matched and the
tokens the engine then reported cached). Joined by route id, per turn:

- **routes** traced; **left_holder**: routes sent elsewhere than the engine caching the most
  of the prompt, and for each the **term** that sent it away (the term by which the holder's
  cost exceeded the chosen one's most: ``queued``, ``running``, ``memory``...);
- **matched** tokens (the index, at routing) against **served** (the engine's usage): a route
  whose engine served fewer than the index matched lost holdings between the route and the
  prefill (**shortfall**); one whose engine served more held pages the index did not know of
  when it routed (**surplus**: events not yet in, or a pending entry expired before its prefill
  ran);
- **evicted**: pages the chosen engine reported removed between the decision and the route's
  end.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.engines_fleet import ENGINE_BLOCK

TERMS = ("prefill", "lower_tier", "queued", "running", "memory", "overflow", "duplicate")
DECISION_LOG_VAR = "KVCOORD_DECISION_LOG"


def _lines(paths: Iterable[Path]) -> Iterable[dict[str, Any]]:
    for path in paths:
        if not path.exists():
            continue
        for raw in path.read_text(errors="replace").splitlines():
            if not raw.startswith("{"):
                continue
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if isinstance(entry, dict):
                yield entry


def sent_away_by(decision: dict[str, Any]) -> str:
    """The term by which the holder's cost exceeded the chosen worker's most."""
    return max(TERMS, key=lambda t: decision[f"holder_{t}"] - decision[f"chosen_{t}"])


def read_trace(log_paths: Iterable[Path], page_size: int) -> dict[str, Any]:
    """The turn's trace summary from its router's log files (module docstring)."""
    decisions: dict[str, dict[str, Any]] = {}
    ends: dict[str, dict[str, Any]] = {}
    requests: dict[str, dict[str, Any]] = {}
    for entry in _lines(log_paths):
        route_id = entry.get("route_id")
        if not route_id:
            continue
        kind = entry.get("event")
        if kind == "route.decision":
            decisions[route_id] = entry
        elif kind == "route.ended":
            ends[route_id] = entry
        elif kind == "gateway.request":
            requests[route_id] = entry
    away: Counter[str] = Counter()
    matched = served = short_routes = short_tokens = evicted = evicting_routes = 0
    surplus_routes = surplus_tokens = 0
    answered = 0
    for route_id, decision in decisions.items():
        if decision.get("left_holder"):
            away[sent_away_by(decision)] += 1
        request = requests.get(route_id)
        if request is not None and request.get("cached_tokens") is not None:
            answered += 1
            match = decision["chosen_cached_pages"] * page_size
            cached = int(request["cached_tokens"])
            matched += match
            served += cached
            if cached < match:
                short_routes += 1
                short_tokens += match - cached
            # vLLM reuses whole blocks and recomputes a prompt's last token: a surplus is a
            # block or more beyond the pages matched.
            elif cached >= match + ENGINE_BLOCK:
                surplus_routes += 1
                surplus_tokens += cached - match
        end = ends.get(route_id)
        if end is not None:
            removed = end["pages_removed"] - decision["chosen_pages_removed"]
            evicted += removed
            evicting_routes += removed > 0
    return {
        "routes": len(decisions), "with_holder": sum(
            1 for d in decisions.values() if d.get("holder_worker_id") is not None),
        "left_holder": sum(away.values()), "sent_away_by": dict(away.most_common()),
        "answered": answered, "matched_tokens": matched, "served_cached_tokens": served,
        "shortfall_routes": short_routes, "shortfall_tokens": short_tokens,
        "surplus_routes": surplus_routes, "surplus_tokens": surplus_tokens,
        "ended": sum(1 for r in decisions if r in ends), "evicted_pages": evicted,
        "routes_with_evictions": evicting_routes,
    }


def trace_text(trace: dict[str, Any]) -> str:
    """One paragraph for the case's printout."""
    away = ", ".join(f"{term} {n}" for term, n in trace["sent_away_by"].items()) or "none"
    return (f"decision trace: {trace['routes']} routes, {trace['left_holder']} left their "
            f"holder (sent away by: {away}); the index matched {trace['matched_tokens']:,} "
            f"tokens, the engines served {trace['served_cached_tokens']:,} from cache "
            f"({trace['shortfall_routes']} routes short by {trace['shortfall_tokens']:,}, "
            f"{trace['surplus_routes']} over by {trace['surplus_tokens']:,}); "
            f"{trace['evicted_pages']:,} pages evicted on the chosen engine while "
            f"{trace['routes_with_evictions']} routes ran")
