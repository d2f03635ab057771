"""``ShardRouting``: routes, lookups and route ends over every shard of a fleet.

A shard is a replica set that ingests only its own workers (``CoordinatorConfig.shard``). A
replica given its peers (``peer_shards``) decides a route over all of them: it asks every other
shard for its shortlist while it computes its own, decides over the shortlists with its own
router (``core.routing.shortlists``: the decision one coordinator holding every worker would
make), and reserves the chosen worker on the shard that holds it. A batch routes its groups of
identical prompts one after another, so later groups see the earlier ones' reservations, as
on one coordinator. Lookups are the union of every shard's; an ``EndRoutes`` goes to every
shard (route ids are unique per process, so it ends on the one that issued it).

A shard that does not answer within ``peer_timeout_s`` is left out of that decision (logged,
counted in ``unanswered``): a route goes on with the workers that can be seen, as it does when
a replica cannot see a worker. Asyncio, no grpc: the peers are ``PeerShard`` objects
(``server.peer_shards`` speaks gRPC to them).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import structlog

from coordinator.core.errors import Unavailable
from coordinator.core.routing import (
    BatchResult,
    LookupResult,
    PromptInput,
    Router,
    RouteResult,
    Scope,
    Shortlist,
    execution_order,
)
from coordinator.core.routing.awaited_routes import EndedRoutes
from coordinator.core.routing.shortlists import NoEligibleWorker
from coordinator.wire import Reason

log = structlog.get_logger("kvcoord.shards")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ShardQuery:
    """One routing decision's question, as every shard is asked it."""

    prompt: PromptInput
    scope: Scope
    copies: int
    min_policy_version: int | None
    routing: str
    exclude: frozenset[str]
    report_end: bool


class PeerShard(Protocol):
    """Another shard's replicas, as this replica asks them. Each call raises
    ``Unavailable`` when the shard cannot answer, and passes its refusals on."""

    name: str

    async def shortlist(self, query: ShardQuery, after: str | None) -> Shortlist: ...

    async def reserve(self, query: ShardQuery, worker_id: str) -> RouteResult: ...

    async def lookup(self, prompt: PromptInput, scope: Scope) -> LookupResult: ...

    async def end_routes(self, route_ids: Sequence[str]) -> EndedRoutes: ...

    async def close(self) -> None: ...


class ShardRouting:
    """Decides over this replica's router and its ``peers``; mutates only the router's books
    (through ``Router.reserve``) and the peers' (through theirs)."""

    def __init__(self, router: Router, peers: Sequence[PeerShard], *,
                 peer_timeout_s: float = 0.5) -> None:
        self._router = router
        self.peers = list(peers)
        self._timeout_s = peer_timeout_s
        self.unanswered: Counter[str] = Counter()  # by shard name

    async def close(self) -> None:
        await asyncio.gather(*(p.close() for p in self.peers), return_exceptions=True)

    async def route(self, prompt: PromptInput, scope: Scope, *,
                    min_policy_version: int | None = None, routing: str = "",
                    exclude: frozenset[str] = frozenset(),
                    report_end: bool = False) -> RouteResult:
        """The route one coordinator holding every shard's workers would answer."""
        return await self._decide_and_reserve(ShardQuery(
            prompt, scope, 1, min_policy_version, self._rule(routing), exclude, report_end))

    async def route_batch(self, prompts: Sequence[PromptInput], scope: Scope, *,
                          min_policy_version: int | None = None, routing: str = "",
                          report_end: bool = False) -> BatchResult:
        """``Router.route_batch`` over every shard: each group of identical prompts is one
        decision, in the router's order; the answer's order runs shared prefixes together."""
        first_keys, groups = self._router.views.group_batch(prompts, scope)
        rule = self._rule(routing)
        routes: list[RouteResult | None] = [None] * len(prompts)
        for group in groups:
            lead = prompts[group.members[0]]
            result = await self._decide_and_reserve(ShardQuery(
                lead, scope, len(group.members), min_policy_version, rule, frozenset(),
                report_end))
            for member in group.members:
                routes[member] = result
        done = [r for r in routes if r is not None]
        return BatchResult(done, execution_order(first_keys, [r.worker_id for r in done]))

    async def lookup(self, prompt: PromptInput, scope: Scope) -> LookupResult:
        """Every shard's matches together (a shard that does not answer is left out)."""
        own = self._router.lookup(prompt, scope)
        answers = await self._ask_all([p.lookup(prompt, scope) for p in self.peers])
        matches, lower = dict(own.matches), dict(own.lower_tiers)
        for answer in answers:
            if answer is not None:
                matches.update(answer.matches)
                lower.update(answer.lower_tiers)
        return LookupResult(matches, own.policy_version, own.prompt_pages, own.page_size, lower)

    async def end_routes(self, route_ids: Sequence[str]) -> EndedRoutes:
        """End the routes on every shard: ``ended`` counts them wherever they were issued, and
        the rest are unknown."""
        own = self._router.end_routes(route_ids)
        answers = await self._ask_all([p.end_routes(route_ids) for p in self.peers])
        ended = own.ended + sum(a.ended for a in answers if a is not None)
        return EndedRoutes(ended, max(0, len(route_ids) - ended))

    # ------------------------------------------------------------------ the decision

    def _rule(self, routing: str) -> str:
        """The rule's name, resolved here so every shard applies this replica's default."""
        return routing or self._router.default_routing

    async def _decide_and_reserve(self, query: ShardQuery) -> RouteResult:
        """Shortlists from every shard, the decision, the reservation. A chosen worker gone
        from its shard by the time it is reserved is left out and the route decided again,
        once; then the refusal stands."""
        for attempt in (1, 2):
            chosen, owner = await self._decide(query)
            try:
                if owner is None:
                    return self._router.reserve(
                        query.prompt, query.scope, chosen, copies=query.copies,
                        min_policy_version=query.min_policy_version, routing=query.routing,
                        report_end=query.report_end)
                return await self._reserve_on(owner, query, chosen)
            except Unavailable as exc:
                if attempt == 2 or exc.reason is not Reason.NO_WORKER:
                    raise
                log.info("shards.reserve_refused", worker=chosen,
                         shard=owner.name if owner else "own", reason=str(exc))
                query = ShardQuery(query.prompt, query.scope, query.copies,
                                   query.min_policy_version, query.routing,
                                   query.exclude | {chosen}, query.report_end)
        raise AssertionError("unreachable")

    async def _reserve_on(self, owner: PeerShard, query: ShardQuery,
                          chosen: str) -> RouteResult:
        """The reservation on ``owner``; UNAVAILABLE (retry after a heartbeat) when it does not
        answer in time: it may or may not have reserved, and its heartbeats settle either."""
        try:
            return await asyncio.wait_for(owner.reserve(query, chosen), self._timeout_s)
        except TimeoutError:
            self.unanswered[owner.name] += 1
            raise Unavailable(f"shard {owner.name} did not answer the reservation of "
                              f"{chosen!r} in time",
                              retry_after_ms=self._router.retry_after_ms) from None

    async def _decide(self, query: ShardQuery) -> tuple[str, PeerShard | None]:
        """The chosen worker and the peer shard holding it (None: this one)."""
        after = self._router.cursor(query.routing)
        asked = asyncio.gather(*(self._ask(p, p.shortlist(query, after)) for p in self.peers))
        try:
            request, own = self._router.shortlist(
                query.prompt, query.scope, copies=query.copies,
                min_policy_version=query.min_policy_version, routing=query.routing,
                exclude=query.exclude, after=after)
        except BaseException:
            asked.cancel()
            raise
        peers = await asked
        shortlists = [own, *(s for s in peers if s is not None)]
        owners: dict[str, PeerShard | None] = {e.worker_id: None for e in own.tied}
        for peer, shortlist in zip(self.peers, peers, strict=True):
            if shortlist is not None:
                owners.update((e.worker_id, peer) for e in shortlist.tied)
        try:
            decision = self._router.decide(query.routing, request, shortlists)
        except NoEligibleWorker:
            raise Unavailable(
                f"no routable worker on any shard serves model {query.scope.model or ''!r} "
                f"for this request", reason=Reason.NO_WORKER,
                retry_after_ms=self._router.retry_after_ms) from None
        return decision.worker_id, owners[decision.worker_id]

    async def _ask_all(self, calls: Sequence[Awaitable[T]]) -> list[T | None]:
        return list(await asyncio.gather(
            *(self._ask(p, c) for p, c in zip(self.peers, calls, strict=True))))

    async def _ask(self, peer: PeerShard, call: Awaitable[T]) -> T | None:
        """``call``'s answer; None, logged and counted, when the shard does not answer in
        time or is unavailable. Other refusals (a bad request) pass through."""
        try:
            return await asyncio.wait_for(call, self._timeout_s)
        except (TimeoutError, Unavailable) as exc:
            self.unanswered[peer.name] += 1
            log.warning("shards.peer_unanswered", shard=peer.name,
                        reason=str(exc) or type(exc).__name__)
            return None
