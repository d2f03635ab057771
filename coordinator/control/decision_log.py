"""The decision log (``--decision-log``, ``KVCOORD_DECISION_LOG``): each routing decision and
each awaited route's end as a structlog line, so that anyone can see why a route went where it
went, and what happened to the chosen worker's cache until the route ended.

- ``route.decision``: ``route_id``, ``worker``, ``left_holder`` (the route went elsewhere than
  the best holder), the prompt's pages and tokens, and for ``chosen`` and ``holder`` each
  ``kv_aware`` cost term (``core.routing.decision_trace.CostTerms``) flattened as
  ``chosen_<term>`` / ``holder_<term>``, with each worker's ``pages_removed`` so far (the
  evictions it has reported, ever).
- ``route.ended``: ``route_id``, ``worker`` and its ``pages_removed`` then: the difference
  from the decision's is what it evicted while the request ran.
"""

from __future__ import annotations

from typing import Any

import structlog

from coordinator.core.fleet import Fleet
from coordinator.core.routing.decision_trace import CostTerms, DecisionTrace
from coordinator.core.routing.route_types import RouteResult

log = structlog.get_logger("kvcoord.decisions")


class DecisionLog:
    """A ``DecisionSink`` that logs (see the module docstring); reads ``fleet`` for each
    worker's evictions so far."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def _removed(self, worker_id: str) -> int:
        session = self._fleet.get(worker_id)
        return session.pages_removed if session is not None else 0

    def _terms(self, prefix: str, terms: CostTerms | None) -> dict[str, Any]:
        if terms is None:
            return {}
        fields = terms.as_json()
        fields["pages_removed"] = self._removed(terms.worker_id)
        return {f"{prefix}_{name}": value for name, value in fields.items()}

    def decided(self, trace: DecisionTrace, route: RouteResult) -> None:
        log.info("route.decision", route_id=route.route_id, worker=route.worker_id,
                 left_holder=trace.left_holder, prompt_pages=trace.prompt_pages,
                 prompt_tokens=trace.prompt_tokens, candidates=trace.candidates,
                 **self._terms("chosen", trace.chosen), **self._terms("holder", trace.holder))

    def ended(self, route_id: str, worker_id: str) -> None:
        log.info("route.ended", route_id=route_id, worker=worker_id,
                 pages_removed=self._removed(worker_id))
