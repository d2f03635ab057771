"""Request builders and response parsers shared by both SDK clients and the worker's clients.

Builders validate on the client so a mistake fails fast with ``ValueError`` before a round trip.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.client.types import (
    EndedRoutes,
    LookupResult,
    PageKeys,
    PolicyState,
    RolloutRecord,
    Route,
    RouteBatch,
    Stats,
    WorkerInfo,
)
from coordinator.core.hashing.page_hasher import tokens_to_bytes
from coordinator.v1 import coordinator_pb2 as pb

# ---------------------------------------------------------------- requests


def prompt_pb(tokens: Sequence[int] | PageKeys) -> pb.Prompt:
    """Validate and pack one prompt; ValueError for empty prompts or ids outside uint32."""
    if isinstance(tokens, PageKeys):
        return pb.Prompt(page_keys=tokens.keys, token_count=tokens.token_count or 0)
    if isinstance(tokens, (str, bytes)):
        raise ValueError("a prompt is a sequence of integer token ids (or PageKeys)")
    if len(tokens) == 0:
        raise ValueError("empty prompt: at least one token id is required")
    try:
        packed = tokens_to_bytes(tokens)
    except (ValueError, OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    # Packed bytes, not the repeated field: see Prompt.token_bytes in the proto.
    return pb.Prompt(token_bytes=packed)


def scope_pb(model: str | None, adapter: str | None, version: int | None,
             cache_salt: str | None = None) -> pb.Scope:
    """The request's scope; "" and an unset version mean the coordinator's defaults."""
    scope = pb.Scope(model=model or "", adapter=adapter or "", cache_salt=cache_salt or "")
    # NOTE: optional fields are set only when given: the server reads their presence
    # (``HasField``), so version 0 is a real request and unset leaves it to the coordinator.
    if version is not None:
        scope.policy_version = version
    return scope


def lookup_request(
    tokens: Sequence[int] | PageKeys, model: str | None, adapter: str | None, version: int | None,
    cache_salt: str | None = None,
) -> pb.LookupRequest:
    return pb.LookupRequest(prompt=prompt_pb(tokens),
                            scope=scope_pb(model, adapter, version, cache_salt))


def route_request(
    tokens: Sequence[int] | PageKeys, model: str | None, adapter: str | None,
    min_version: int | None, version: int | None, routing_policy: str,
    exclude_workers: Sequence[str] = (), report_end: bool = False,
    cache_salt: str | None = None,
) -> pb.RouteRequest:
    request = pb.RouteRequest(
        prompt=prompt_pb(tokens), scope=scope_pb(model, adapter, version, cache_salt),
        routing_policy=routing_policy, exclude_workers=list(exclude_workers),
        report_end=report_end,
    )
    if min_version is not None:
        request.min_policy_version = min_version
    return request


def batch_request(
    prompts: Sequence[Sequence[int] | PageKeys], model: str | None, adapter: str | None,
    min_version: int | None, version: int | None, routing_policy: str,
    report_end: bool = False, cache_salt: str | None = None,
) -> pb.RouteBatchRequest:
    """``route_request`` for many prompts; ValueError for none, or for any bad prompt."""
    if not prompts:
        raise ValueError("route_batch needs at least one prompt")
    request = pb.RouteBatchRequest(
        prompts=[prompt_pb(p) for p in prompts],
        scope=scope_pb(model, adapter, version, cache_salt),
        routing_policy=routing_policy, report_end=report_end,
    )
    if min_version is not None:
        request.min_policy_version = min_version
    return request


def end_routes_request(route_ids: Sequence[str]) -> pb.EndRoutesRequest:
    return pb.EndRoutesRequest(route_ids=list(route_ids))


# ---------------------------------------------------------------- responses

_PHASES = {pb.POLICY_PHASE_SERVING: "serving", pb.POLICY_PHASE_DRAINING: "draining"}
_STATES = {
    pb.WORKER_STATE_READY: "ready", pb.WORKER_STATE_DRAINING: "draining",
    pb.WORKER_STATE_FENCED: "fenced", pb.WORKER_STATE_CORDONED: "cordoned",
    pb.WORKER_STATE_DISCONNECTED: "disconnected",
}


def lookup_from(response: pb.LookupResponse) -> LookupResult:
    matches = {m.worker_id: m.matched_tokens for m in response.matches}
    tiers = {m.worker_id: {"gpu": m.gpu_tokens, "cpu": m.cpu_tokens, "disk": m.disk_tokens}
             for m in response.matches}
    return LookupResult(matches, response.policy_version, response.prompt_pages, tiers)


def route_from(response: pb.RouteResponse) -> Route:
    return Route(
        response.worker_id, response.address, response.matched_tokens, response.policy_version,
        response.matched_pages, response.routing_policy, response.http_url,
        response.route_id, response.end_awaited,
    )


def batch_from(response: pb.RouteBatchResponse) -> RouteBatch:
    return RouteBatch([route_from(r) for r in response.routes], list(response.order))


def ended_from(response: pb.EndRoutesResponse) -> EndedRoutes:
    return EndedRoutes(response.ended, response.unknown)


def policy_from(state: pb.PolicyState) -> PolicyState:
    return PolicyState(
        version=state.version,
        phase=_PHASES.get(state.phase, "unspecified"),
        target_version=state.target_version if state.HasField("target_version") else None,
        mode="async" if state.mode == pb.POLICY_MODE_ASYNC else "sync",
        acked_workers=tuple(state.acked_workers),
        fenced_workers=tuple(state.fenced_workers),
        failures={f.worker_id: f.reason for f in state.failures},
        weights_uri=state.weights_uri,
    )


def worker_from(info: pb.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        worker_id=info.worker_id, address=info.address, policy_version=info.policy_version,
        state=_STATES.get(info.state, "unspecified"), incarnation=info.incarnation,
        external=info.external, cached_pages=info.cached_pages, total_pages=info.total_pages,
        free_pages=info.free_pages, running_requests=info.running_requests,
        queued_tokens=info.queued_tokens, inflight_routes=info.inflight_routes,
        routed_requests=info.routed_requests, routed_tokens=info.routed_tokens,
        routed_cached_tokens=info.routed_cached_tokens, owner_replica=info.owner_replica,
        http_url=info.http_url, host_pages=info.host_pages,
        cached_gpu_pages=info.cached_gpu_pages, cached_cpu_pages=info.cached_cpu_pages,
        cached_disk_pages=info.cached_disk_pages,
        prefill_backlog_tokens=info.prefill_backlog_tokens,
        prefill_tokens_per_s=info.prefill_tokens_per_s,
        prefill_route_seconds=info.prefill_route_seconds,
        prefill_attention_tokens=info.prefill_attention_tokens,
    )


def stats_from(stats: pb.Stats) -> Stats:
    return Stats(
        workers=stats.workers, routable_workers=stats.routable_workers,
        index_keys=stats.index_keys, index_entries=stats.index_entries,
        pending_entries=stats.pending_entries, lookups=stats.lookups, routes=stats.routes,
        prompt_tokens=stats.prompt_tokens, cached_tokens=stats.cached_tokens,
        hit_ratio=stats.hit_ratio, events_applied=stats.events_applied, resyncs=stats.resyncs,
        policy_version=stats.policy_version,
        policy_phase=_PHASES.get(stats.policy_phase, "unspecified"), store=stats.store,
        replica_id=stats.replica_id, replicas=tuple(stats.replicas),
        replication_published=stats.replication_published,
        replication_applied=stats.replication_applied,
        replication_lag_p50_ms=stats.replication_lag_p50_ms,
        replication_lag_p99_ms=stats.replication_lag_p99_ms,
    )



def begin_request(
    expected_version: int, mode: str, weights_uri: str, abort_running: bool = False
) -> pb.BeginPolicyUpdateRequest:
    """ValueError for a mode other than "sync"/"async" or a negative ``expected_version``."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
    if expected_version < 0:
        raise ValueError(f"expected_version must be >= 0, got {expected_version}")
    mode_pb = pb.POLICY_MODE_ASYNC if mode == "async" else pb.POLICY_MODE_SYNC
    return pb.BeginPolicyUpdateRequest(
        expected_version=expected_version, mode=mode_pb, weights_uri=weights_uri,
        abort_running=abort_running,
    )


def rollout_from(record: pb.RolloutRecord) -> RolloutRecord:
    return RolloutRecord(
        rollout_id=record.rollout_id, policy_version=record.policy_version,
        worker_id=record.worker_id, prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens, completion_tokens=record.completion_tokens,
        cursor=record.cursor,
    )
