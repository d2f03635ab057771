"""The shard messages, protobuf <-> domain, for both ends (``server.peer_shards`` asks, the
servicer answers): shortlists, a route's question, and a peer's route and lookup answers."""

from __future__ import annotations

from coordinator.client.messages import scope_pb
from coordinator.control.shard_routing import ShardQuery
from coordinator.core.index import Tier
from coordinator.core.routing import (
    LookupResult,
    PromptInput,
    RouteResult,
    Scope,
    Shortlist,
    ShortlistEntry,
)
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.wire import PROTOCOL_VERSION

# round_robin ranks say only "after the cursor or not": a tie there goes to the smallest id
# (ShortlistEntry order), and the rule is the only one that says so.
_LOWEST_ID_WINS = frozenset({"round_robin"})


def prompt_to_pb(prompt: PromptInput) -> pb.Prompt:
    """A validated prompt as it travels to another shard (packed tokens, or trusted keys)."""
    if prompt.page_keys is not None:
        return pb.Prompt(page_keys=b"".join(prompt.page_keys), token_count=prompt.token_count)
    return pb.Prompt(token_bytes=prompt.token_bytes)


def scope_to_pb(scope: Scope) -> pb.Scope:
    """The scope's fields (the tenant travels as the caller's credentials, never a field)."""
    return scope_pb(scope.model, scope.adapter, scope.policy_version, scope.cache_salt)


def route_request_to_pb(query: ShardQuery) -> pb.RouteRequest:
    request = pb.RouteRequest(
        protocol_version=PROTOCOL_VERSION, prompt=prompt_to_pb(query.prompt),
        scope=scope_to_pb(query.scope), routing_policy=query.routing,
        exclude_workers=sorted(query.exclude), report_end=query.report_end,
    )
    if query.min_policy_version is not None:
        request.min_policy_version = query.min_policy_version
    return request


def shortlist_to_pb(shortlist: Shortlist) -> pb.ShardShortlistResponse:
    return pb.ShardShortlistResponse(
        protocol_version=PROTOCOL_VERSION, rank=list(shortlist.rank),
        tied=[pb.ShardCandidate(worker_id=e.worker_id, cached_pages=e.cached_pages,
                                own_cost=e.own_cost) for e in shortlist.tied],
        best_cached_pages=shortlist.best_cached,
    )


def shortlist_from_pb(answer: pb.ShardShortlistResponse, routing: str) -> Shortlist:
    return Shortlist(
        tuple(answer.rank),
        tuple(ShortlistEntry(c.worker_id, c.cached_pages, c.own_cost) for c in answer.tied),
        answer.best_cached_pages, lowest_id_wins=routing in _LOWEST_ID_WINS,
    )


def route_from_pb(answer: pb.RouteResponse, page_size: int) -> RouteResult:
    return RouteResult(
        worker_id=answer.worker_id, address=answer.address, matched_pages=answer.matched_pages,
        policy_version=answer.policy_version, prompt_pages=answer.prompt_pages,
        page_size=page_size, routing_policy=answer.routing_policy, http_url=answer.http_url,
        route_id=answer.route_id, end_awaited=answer.end_awaited,
    )


def lookup_from_pb(answer: pb.LookupResponse, page_size: int) -> LookupResult:
    matches = {m.worker_id: m.matched_pages for m in answer.matches}
    lower = {
        m.worker_id: {t: n // page_size for t, n in ((Tier.CPU, m.cpu_tokens),
                                                     (Tier.DISK, m.disk_tokens)) if n}
        for m in answer.matches if m.cpu_tokens or m.disk_tokens
    }
    return LookupResult(matches, answer.policy_version, answer.prompt_pages, page_size, lower)
