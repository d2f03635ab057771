"""Lookup, Route and RouteBatch: prompt -> page keys -> index walk -> routing decision.

No grpc or redis here: the servicer converts protos into ``PromptInput`` and ``Scope`` and the
results back. A request is served under one policy version (the one it asks for, else the
current serving version); keys are hashed under that version and only workers serving it are
considered, so a page computed under another version can never count as a hit.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from coordinator.core.errors import InvalidArgument, Unavailable
from coordinator.core.fleet import Candidate, Fleet
from coordinator.core.hashing import PageHasher
from coordinator.core.index import PrefixIndex
from coordinator.core.routing.awaited_routes import AwaitedRoutes, EndedRoutes
from coordinator.core.routing.batch_order import execution_order
from coordinator.core.routing.choosers import (
    KvAwareChooser,
    RouteChooser,
    booked_work,
    make_chooser,
)
from coordinator.core.routing.decision_trace import DecisionSink, trace_decision
from coordinator.core.routing.route_types import (
    BatchResult,
    LookupResult,
    PromptInput,
    RouteReservation,
    RouteResult,
    Scope,
)
from coordinator.core.routing.route_views import RouteViews
from coordinator.core.routing.router_books import RouterBooks
from coordinator.core.routing.routing_values import Decision, KvAwareWeights, RoutingRequest
from coordinator.core.routing.shortlists import NoEligibleWorker, Shortlist, decide
from coordinator.core.routing.version_view import VersionView
from coordinator.wire import Reason

__all__ = ["BatchResult", "LookupResult", "PromptInput", "RouteReservation", "RouteResult",
           "Router", "RouterCounters", "Scope"]


@dataclass(slots=True)
class RouterCounters:
    lookups: int = 0
    routes: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


class Router(RouterBooks):
    """Answers scheduling questions from the index and the fleet; mutates only pending entries,
    in-flight accounting and counters (a lookup mutates nothing but its counter)."""

    def __init__(
        self,
        *,
        hasher: PageHasher,
        index: PrefixIndex,
        fleet: Fleet,
        page_size: int,
        default_model: str,
        default_routing: str,
        serving_version: Callable[[], int],
        servable_versions: Callable[[], Sequence[int]] | None = None,
        clock: Callable[[], float],
        rng: random.Random | None = None,
        weights: KvAwareWeights | None = None,
        max_inflight: int = 65_536,
        awaited: AwaitedRoutes | None = None,
        on_routed: Callable[[RouteReservation], None] | None = None,
        on_routes_ended: Callable[[tuple[str, ...]], None] | None = None,
        decision_sink: DecisionSink | None = None,
    ) -> None:
        """``on_routed`` and ``on_routes_ended`` hear of every decision and every EndRoutes
        made here (the replication outbox publishes them; unset: nobody else counts them).
        ``decision_sink`` hears each route's ``DecisionTrace`` and each awaited route's end
        (a debugging aid: it reads every idle candidate, O(fleet) a route)."""
        super().__init__(index=index, fleet=fleet, clock=clock, max_inflight=max_inflight,
                         awaited=(awaited if awaited is not None  # an empty one is falsy
                                  else AwaitedRoutes(ttl_s=600.0, capacity=max_inflight)))
        self.views = RouteViews(
            hasher=hasher, index=index, fleet=fleet, page_size=page_size,
            default_model=default_model, serving_version=serving_version,
            servable_versions=servable_versions)
        self._page_size = page_size
        self._rng = rng or random.Random()
        self._weights = weights or KvAwareWeights()
        self._on_routed = on_routed
        self._on_routes_ended = on_routes_ended
        self.decision_sink = decision_sink
        self._choosers: dict[str, RouteChooser] = {}  # by routing rule name
        # Prices the one worker a shard reserves for a decision made elsewhere (``reserve``).
        self._sole_chooser = KvAwareChooser(self._weights)
        self.default_routing = self._chooser(default_routing).name
        self.counters = RouterCounters()
        # Told to callers refused for lack of a worker: about one heartbeat, when load and
        # liveness news next arrives.
        self.retry_after_ms = 500

    def _chooser(self, routing: str) -> RouteChooser:
        """The chooser of the routing rule named ``routing`` (InvalidArgument if unknown)."""
        chooser = self._choosers.get(routing)
        if chooser is None:
            try:
                chooser = make_chooser(routing, self._weights)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            self._choosers[routing] = chooser
        return chooser

    def lookup(self, prompt: PromptInput, scope: Scope) -> LookupResult:
        """Every routable worker serving the version that holds the prompt's first page, with
        its confirmed depth. Workers Route would never pick (disconnected, cordoned, fenced,
        draining, another version or model) are left out, so a scheduler acting on a lookup
        never sends work to them. Each match's pages in CPU and DISK are counted
        (``PrefixIndex.match_tiers``)."""
        ns = self.views.namespace(scope)
        keys = self.views.keys(prompt, ns)
        self.counters.lookups += 1
        matches, lower = self._index.match_tiers(keys) if keys else ({}, {})
        if not matches:
            return LookupResult({}, ns.policy_version, len(keys), self._page_size)
        routable = self._fleet.routable(
            self._clock(), version=ns.policy_version, min_version=None, model=ns.model
        )
        serving = {s.worker_id: matches[s.worker_id] for s in routable if s.worker_id in matches}
        if lower:
            lower = {w: tiers for w, tiers in lower.items() if w in serving}
        return LookupResult(serving, ns.policy_version, len(keys), self._page_size, lower)

    def route(
        self,
        prompt: PromptInput,
        scope: Scope,
        *,
        min_policy_version: int | None = None,
        routing: str = "",
        exclude: frozenset[str] = frozenset(),
        report_end: bool = False,
    ) -> RouteResult:
        """Choose a worker for one prompt; its keys become pending entries on that worker.
        Workers in ``exclude`` are not chosen (a caller routing around one that failed).
        ``report_end``: the caller will end the route by id (``end_routes``); honoured for
        external workers only (the others report their own ends).

        With several servable versions (an async update within ``max_staleness``) the prompt is
        hashed under each and every eligible worker of every version competes; the answer says
        which version serves it."""
        now = self._clock()
        views = self.views.views(prompt, scope, now, min_policy_version, exclude)
        return self._route_views(views, prompt.token_count, 1, min_policy_version, routing, now,
                                 report_end)

    # ------------------------------------------------------------------ shards

    def shortlist(
        self,
        prompt: PromptInput,
        scope: Scope,
        *,
        copies: int = 1,
        min_policy_version: int | None = None,
        routing: str = "",
        exclude: frozenset[str] = frozenset(),
        after: str | None = None,
    ) -> tuple[RoutingRequest, Shortlist]:
        """This coordinator's best candidates for ``copies`` of ``prompt`` (``shortlists``),
        for a decision over several shards; reserves nothing and draws no randomness.
        ``after``: round robin's cursor, the deciding replica's."""
        now = self._clock()
        self.awaited.expire(now)
        chooser = self._chooser(routing or self.default_routing)
        views = self.views.views(prompt, scope, now, min_policy_version, exclude)
        request = self.views.request(views, prompt.token_count, copies)
        holders, idle = self.views.candidates(views, min_policy_version, now)
        return request, chooser.shortlist(request, holders, idle, after)

    def decide(self, routing: str, request: RoutingRequest,
               shortlists: Sequence[Shortlist]) -> Decision:
        """The decision over several shards' shortlists, drawn with this router's ``rng``
        (round robin's cursor moves here). NoEligibleWorker when none has a candidate."""
        return self._chooser(routing or self.default_routing).decide(request, shortlists,
                                                                      self._rng)

    def cursor(self, routing: str) -> str | None:
        """Round robin's last choice here (for the shards asked), else None."""
        return self._chooser(routing or self.default_routing).cursor

    def reserve(
        self,
        prompt: PromptInput,
        scope: Scope,
        worker_id: str,
        *,
        copies: int = 1,
        min_policy_version: int | None = None,
        routing: str = "",
        report_end: bool = False,
    ) -> RouteResult:
        """Reserve ``worker_id`` for ``copies`` of ``prompt`` as ``route`` reserves its choice
        (the decision was made over several shards' shortlists).

        Raises:
            Unavailable: reason NO_WORKER when the worker is no longer eligible here.
        """
        now = self._clock()
        self.awaited.expire(now)
        rule = self._chooser(routing or self.default_routing).name
        views = self.views.views(prompt, scope, now, min_policy_version, frozenset(),
                                 only=worker_id)
        request = self.views.request(views, prompt.token_count, copies)
        holders, idle = self.views.candidates(views, min_policy_version, now)
        shortlist = self._sole_chooser.shortlist(request, holders, idle)
        if not shortlist.tied:
            raise Unavailable(f"worker {worker_id!r} is no longer eligible for this route",
                              reason=Reason.NO_WORKER, retry_after_ms=self.retry_after_ms)
        decision = decide([shortlist], request, self._weights, self._rng)
        return self._reserve(decision, rule, request, views, report_end, now)

    def route_batch(
        self,
        prompts: Sequence[PromptInput],
        scope: Scope,
        *,
        min_policy_version: int | None = None,
        routing: str = "",
        report_end: bool = False,
    ) -> BatchResult:
        """Route many prompts: identical prompts (GRPO siblings) go to one worker as a group,
        groups are routed in order so later ones see earlier ones' pending entries, and the
        returned order runs prompts sharing a prefix back to back."""
        first_keys, groups = self.views.group_batch(prompts, scope)
        routes: list[RouteResult | None] = [None] * len(prompts)
        for group in groups:
            lead = prompts[group.members[0]]
            now = self._clock()
            views = self.views.views(lead, scope, now, min_policy_version, frozenset(),
                                first_keys[group.members[0]])
            result = self._route_views(
                views, lead.token_count, len(group.members), min_policy_version, routing, now,
                report_end,
            )
            for member in group.members:
                routes[member] = result
        done = [r for r in routes if r is not None]
        order = execution_order(first_keys, [r.worker_id for r in done])
        return BatchResult(done, order)

    def _route_views(
        self,
        views: list[VersionView],
        token_count: int,
        copies: int,
        min_policy_version: int | None,
        routing: str,
        now: float,
        report_end: bool = False,
    ) -> RouteResult:
        """One routing decision over ``views``: choose a worker, then reserve it."""
        self.awaited.expire(now)  # an expired route's load must not weigh on this choice
        chooser = self._chooser(routing or self.default_routing)
        request = self.views.request(views, token_count, copies)
        holders, idle = self.views.candidates(views, min_policy_version, now)
        if self.decision_sink is None:
            decision = self._choose(chooser, request, holders, idle, views, min_policy_version)
            return self._reserve(decision, chooser.name, request, views, report_end, now)
        every_idle = list(idle)  # the trace prices every candidate, not only those read
        decision = self._choose(chooser, request, holders, iter(every_idle), views,
                                min_policy_version)
        result = self._reserve(decision, chooser.name, request, views, report_end, now)
        self.decision_sink.decided(trace_decision(
            request, [*holders, *every_idle], decision.worker_id, self._weights), result)
        return result

    def _choose(self, chooser: RouteChooser, request: RoutingRequest,
                holders: list[Candidate], idle: Iterator[Candidate], views: list[VersionView],
                min_policy_version: int | None) -> Decision:
        """The worker ``chooser`` picks for ``request`` among every version's ``holders`` of
        the prompt (pending entries included), then its ``idle`` eligible workers, cheapest
        load floor first. Reserves nothing and changes no books (only a chooser's own cursor
        moves); randomness is drawn from the router's ``rng``, by the chooser alone.

        Raises:
            Unavailable: reason NO_WORKER, with ``retry_after_ms``, when no worker is eligible.
        """
        try:
            return chooser.choose(request, holders, self._rng, idle=idle)
        except NoEligibleWorker:
            versions = ", ".join(str(v.ns.policy_version) for v in views)
            raise Unavailable(
                f"no routable worker serves model {views[0].ns.model!r} at policy version "
                f"{versions}" + (
                    f" (min {min_policy_version})" if min_policy_version is not None else ""
                ),
                reason=Reason.NO_WORKER, retry_after_ms=self.retry_after_ms,
            ) from None

    def _reserve(self, decision: Decision, routing_rule: str, request: RoutingRequest,
                 views: list[VersionView], report_end: bool, now: float) -> RouteResult:
        """Reserve ``decision``'s worker for ``request.copies`` routes and answer the route.
        The prompt's keys under the worker's version that it does not hold yet become pending
        entries on it; its in-flight load grows by the uncached tokens (held until
        ``end_routes`` for an external worker asked to ``report_end``, else until heartbeats
        report them), its prefill backlog by the work the decision counted on; the routing
        totals count the copies and ``on_routed`` hears of the reservation. Draws no
        randomness."""
        session = self._fleet.get(decision.worker_id)
        assert session is not None  # candidates come from the fleet
        view = next(v for v in views if v.ns.policy_version == session.policy_version)
        keys = view.keys
        token_count, copies = request.prompt_tokens, request.copies
        chosen_detail = view.details.get(decision.worker_id)
        confirmed = chosen_detail.confirmed_pages if chosen_detail is not None else 0
        # Pages the worker already holds need no pending entry.
        pending = keys[confirmed:]
        if pending:
            self._index.add_pending(decision.worker_id, pending)
        cached_tokens = min(confirmed * self._page_size, token_count)
        uncached_tokens = token_count - cached_tokens
        end_awaited = report_end and session.external
        if end_awaited:
            route_id = self.awaited.hold(session, uncached_tokens, copies, now,
                                         context_tokens=token_count)
        else:
            route_id = self.awaited.new_id()
            session.hold_inflight(uncached_tokens, copies, self.max_inflight, token_count)
        # The work the decision counted on: pages pending here (a sibling's, routed just
        # before) are computed once, by whichever route reaches the worker first.
        lower = chosen_detail.lower_tier_pages if chosen_detail is not None else 0
        work = booked_work(request, decision.cached_pages, lower, self._weights)
        session.queue_prefill(work, now, pending, token_count)
        for _ in range(copies):
            session.count_routed(token_count, cached_tokens)
        if self._on_routed is not None:
            self._on_routed(RouteReservation(
                session.worker_id, session.incarnation, route_id, tuple(pending),
                uncached_tokens, copies, end_awaited, work, token_count,
            ))
        self.counters.routes += copies
        self.counters.prompt_tokens += token_count * copies
        self.counters.cached_tokens += cached_tokens * copies
        return RouteResult(
            worker_id=session.worker_id, address=session.address, matched_pages=confirmed,
            policy_version=session.policy_version, prompt_pages=len(keys),
            page_size=self._page_size, routing_policy=routing_rule, http_url=session.http_url,
            route_id=route_id, end_awaited=end_awaited,
        )

    def end_routes(self, route_ids: Sequence[str]) -> EndedRoutes:
        """End awaited routes by id (idempotent: see ``core.awaited_routes``). Every id is
        passed on to ``on_routes_ended``, known here or not: another replica may have issued
        it."""
        if self.decision_sink is not None:
            for route_id in route_ids:
                worker_id = self.awaited.worker_of(route_id)
                if worker_id is not None:
                    self.decision_sink.ended(route_id, worker_id)
        ended = self.awaited.end(route_ids, self._clock())
        if self._on_routes_ended is not None and route_ids:
            self._on_routes_ended(tuple(route_ids))
        return ended
