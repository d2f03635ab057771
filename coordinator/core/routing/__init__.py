"""Routing: which worker a prompt runs on, and in what order a batch runs.

- ``router``: ``Router``, the decision a ``Route``/``RouteBatch`` gets: the workers eligible at
  a version and their matches in the index (``version_view``), a chooser's pick (``_choose``),
  and the reservation of it (``_reserve``).
- ``choosers``: the routing rules (``kv_aware``, ``round_robin``, ``least_loaded``) behind
  one ``RouteChooser`` protocol, and the ``kv_aware`` cost; ``CHOOSERS`` names them. (A
  request's ``routing_policy`` field names one of these rules; "policy" alone means the
  weights version.)
- ``routing_values``: what a chooser reads and returns (``RoutingRequest``, ``KvAwareWeights``,
  ``Decision``); ``route_types``: what the router returns (``RouteResult``, ``BatchResult``, ...).
- ``shortlists``: a rule's choice in two steps (the candidates tied at the lowest rank, then
  the pick among several such lists), so the shards of a fleet decide as one coordinator.
- ``batch_order``: identical prompts grouped, and the order a batch runs in.
- ``awaited_routes``: routes issued and not yet ended, held until their end or their TTL;
  ends are remembered, so a route that arrives after its end is settled at once.
- ``inflight_snapshot``: a worker's in-flight routes as one value (``InFlightRoutes``), for a
  replica that joins later.
- ``router_books``: ``RouterBooks``, the in-flight books ``Router`` keeps, fed by other
  replicas' decisions too.
- ``decision_trace``: a decision taken apart, term by term, for the chosen worker and the
  best holder (``DecisionTrace``), and the ``DecisionSink`` that hears them.

Pure core: no I/O; randomness comes in as a ``random.Random``.
"""

from coordinator.core.routing import route_types
from coordinator.core.routing.awaited_routes import HeldRoute
from coordinator.core.routing.batch_order import BatchGroup, execution_order, group_identical
from coordinator.core.routing.choosers import (
    CHOOSERS,
    KvAwareChooser,
    LeastLoadedChooser,
    RoundRobinChooser,
    RouteChooser,
    booked_work,
    kv_aware_cost,
    load_floor,
    make_chooser,
    overflow_tokens,
    prefill_work,
)
from coordinator.core.routing.inflight_snapshot import InFlightRoutes
from coordinator.core.routing.route_types import *  # noqa: F403 (route_types.__all__, below)
from coordinator.core.routing.router import Router, RouterCounters
from coordinator.core.routing.routing_values import Decision, KvAwareWeights, RoutingRequest
from coordinator.core.routing.shortlists import (
    NoEligibleWorker,
    Shortlist,
    ShortlistEntry,
    decide,
)

__all__ = [
    "CHOOSERS", "BatchGroup", "Decision", "HeldRoute", "InFlightRoutes", "KvAwareChooser",
    "KvAwareWeights", "LeastLoadedChooser", "NoEligibleWorker", "RoundRobinChooser",
    "RouteChooser", "Router", "RouterCounters", "RoutingRequest", "Shortlist",
    "ShortlistEntry", "booked_work", "decide", "execution_order", "group_identical",
    "kv_aware_cost", "load_floor", "make_chooser", "overflow_tokens", "prefill_work",
]
__all__ += route_types.__all__
