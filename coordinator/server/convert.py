"""Proto <-> domain conversion and request validation for the coordinator API.

Every decodable message is validated here before the core sees it: a bad field becomes an
``InvalidArgument`` (or ``FailedPrecondition`` for another protocol version) with a message that
names the field and the limit.
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Mapping, Sequence

from coordinator.config import CoordinatorConfig
from coordinator.control.sessions.sync_messages import (
    Ack,
    Command,
    HeartbeatIn,
    InventoryIn,
    Outbound,
    RegistrationRequest,
    Resync,
    Welcome,
)
from coordinator.core.errors import InvalidArgument
from coordinator.core.fleet import WorkerLoad
from coordinator.core.hashing.page_hasher import tokens_to_bytes
from coordinator.core.index import Tier
from coordinator.core.policy_state import PolicyPhase, PolicyRecord
from coordinator.core.rollout_records import Rollout
from coordinator.core.routing import LookupResult, PromptInput, RouteResult, Scope
from coordinator.core.routing.awaited_routes import MAX_ROUTE_ID_LENGTH
from coordinator.replica import StatsSnapshot, WorkerView
from coordinator.rpc.versions import check_protocol
from coordinator.sync_codec import page_keys_from, tier_from_pb
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.wire import PROTOCOL_VERSION

STATE_TO_PB = {
    "ready": pb.WORKER_STATE_READY, "draining": pb.WORKER_STATE_DRAINING,
    "fenced": pb.WORKER_STATE_FENCED, "cordoned": pb.WORKER_STATE_CORDONED,
    "disconnected": pb.WORKER_STATE_DISCONNECTED,
}
COMMAND_TO_PB = {
    "drain": pb.PolicyCommand.KIND_DRAIN, "apply": pb.PolicyCommand.KIND_APPLY,
    "resume": pb.PolicyCommand.KIND_RESUME,
}
ACK_STAGE_FROM_PB = {
    pb.PolicyAck.STAGE_DRAINED: "drained", pb.PolicyAck.STAGE_APPLIED: "applied",
    pb.PolicyAck.STAGE_FAILED: "failed",
}
PHASE_TO_PB = {
    PolicyPhase.SERVING: pb.POLICY_PHASE_SERVING, PolicyPhase.DRAINING: pb.POLICY_PHASE_DRAINING,
}


def prompt_from(prompt: pb.Prompt, config: CoordinatorConfig, what: str = "prompt") -> PromptInput:
    """Validate one prompt: exactly one body, within the token limit, whole 16-byte keys."""
    n_tokens = len(prompt.token_ids)
    n_key_bytes = len(prompt.page_keys)
    n_token_bytes = len(prompt.token_bytes)
    limit = config.max_prompt_tokens
    if (n_tokens > 0) + (n_key_bytes > 0) + (n_token_bytes > 0) > 1:
        raise InvalidArgument(f"{what}: set one of token_ids, token_bytes or page_keys, not both")
    if prompt.token_count and not n_key_bytes:
        raise InvalidArgument(f"{what}: token_count is only for prompts sent as page_keys")
    if n_token_bytes:
        if n_token_bytes % 4:
            raise InvalidArgument(
                f"{what}: {n_token_bytes} bytes of token_bytes is not a multiple of 4"
            )
        if n_token_bytes // 4 > limit:
            raise InvalidArgument(
                f"{what}: {n_token_bytes // 4} tokens is over the limit of {limit}"
            )
        return PromptInput(token_count=n_token_bytes // 4, token_bytes=prompt.token_bytes)
    if n_tokens:
        if n_tokens > limit:
            raise InvalidArgument(f"{what}: {n_tokens} tokens is over the limit of {limit}")
        # One conversion to little-endian u32 bytes; the hasher never re-reads tokens.
        return PromptInput(token_count=n_tokens, token_bytes=tokens_to_bytes(prompt.token_ids))
    if not n_key_bytes:
        raise InvalidArgument(f"{what} is empty: send token_ids, token_bytes or page_keys")
    keys = page_keys_from(prompt.page_keys, what)
    covered = len(keys) * config.page_size
    token_count = prompt.token_count or covered
    if token_count < covered or token_count >= covered + config.page_size:
        raise InvalidArgument(
            f"{what}: token_count {token_count} does not fit {len(keys)} full pages of "
            f"{config.page_size} tokens"
        )
    if token_count > limit:
        raise InvalidArgument(f"{what}: {token_count} tokens is over the limit of {limit}")
    return PromptInput(token_count=token_count, page_keys=tuple(keys))


MAX_CACHE_SALT_CHARS = 1024


def scope_from(scope: pb.Scope, tenant: str = "") -> Scope:
    """The request's scope under ``tenant`` (the caller's, from its identity: the proto has
    no tenant field, and an unknown field smuggled in is dropped by the parser).
    InvalidArgument for a cache salt over ``MAX_CACHE_SALT_CHARS``."""
    if len(scope.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(f"scope.cache_salt: {len(scope.cache_salt)} characters is over "
                              f"the limit of {MAX_CACHE_SALT_CHARS}")
    return Scope(
        model=scope.model or None,
        adapter=scope.adapter,
        policy_version=scope.policy_version if scope.HasField("policy_version") else None,
        tenant=tenant,
        cache_salt=scope.cache_salt,
    )


def lookup_to_pb(result: LookupResult) -> pb.LookupResponse:
    """Matches deepest first (then by id), each with its tokens per tier."""
    page, lower = result.page_size, result.lower_tiers
    matches = [
        pb.WorkerMatch(worker_id=w, matched_pages=d, matched_tokens=d * page, gpu_tokens=d * page)
        if w not in lower else _tiered_match(w, d, page, lower[w])
        for w, d in sorted(result.matches.items(), key=lambda item: (-item[1], item[0]))
    ]
    return pb.LookupResponse(
        protocol_version=PROTOCOL_VERSION, matches=matches,
        policy_version=result.policy_version, prompt_pages=result.prompt_pages,
    )


def _tiered_match(worker: str, pages: int, page_size: int,
                  lower: dict[Tier, int]) -> pb.WorkerMatch:
    cpu, disk = lower.get(Tier.CPU, 0), lower.get(Tier.DISK, 0)
    return pb.WorkerMatch(
        worker_id=worker, matched_pages=pages, matched_tokens=pages * page_size,
        gpu_tokens=(pages - cpu - disk) * page_size, cpu_tokens=cpu * page_size,
        disk_tokens=disk * page_size,
    )


def route_to_pb(route: RouteResult) -> pb.RouteResponse:
    return pb.RouteResponse(
        protocol_version=PROTOCOL_VERSION, worker_id=route.worker_id, address=route.address,
        matched_pages=route.matched_pages, matched_tokens=route.matched_tokens,
        policy_version=route.policy_version, prompt_pages=route.prompt_pages,
        routing_policy=route.routing_policy, http_url=route.http_url,
        route_id=route.route_id, end_awaited=route.end_awaited,
    )


def registration_from(req: pb.RegisterRequest) -> RegistrationRequest:
    check_protocol(req.protocol_version)
    return RegistrationRequest(
        worker_id=req.worker_id, address=req.address, algorithm=req.hash_config.algorithm,
        page_size=req.hash_config.page_size, fingerprint=req.hash_config.fingerprint,
        total_pages=req.total_pages, policy_version=req.policy_version,
        external=req.external, model=req.model, http_url=http_url_from(req.http_url),
        host_pages=req.host_pages,
    )


MAX_EXCLUDED_WORKERS = 64
_NO_WORKERS: frozenset[str] = frozenset()


def excluded_workers(worker_ids: Sequence[str]) -> frozenset[str]:
    """A Route's ``exclude_workers``; InvalidArgument past ``MAX_EXCLUDED_WORKERS`` or for an
    empty id."""
    if not worker_ids:  # every Route but a gateway's retry: nothing to build
        return _NO_WORKERS
    if len(worker_ids) > MAX_EXCLUDED_WORKERS:
        raise InvalidArgument(f"exclude_workers has {len(worker_ids)} ids; at most "
                              f"{MAX_EXCLUDED_WORKERS}")
    if any(not w for w in worker_ids):
        raise InvalidArgument("exclude_workers holds an empty worker id")
    return frozenset(worker_ids)


MAX_ENDED_ROUTES = 1024


def route_ids_from(req: pb.EndRoutesRequest) -> list[str]:
    """An EndRoutes request's ids; InvalidArgument past ``MAX_ENDED_ROUTES`` ids or for an
    empty or overlong one."""
    check_protocol(req.protocol_version)
    ids = list(req.route_ids)
    if not ids:
        raise InvalidArgument("EndRoutes needs at least one route id")
    if len(ids) > MAX_ENDED_ROUTES:
        raise InvalidArgument(f"EndRoutes has {len(ids)} ids; at most {MAX_ENDED_ROUTES}")
    if any(not i or len(i) > MAX_ROUTE_ID_LENGTH for i in ids):
        raise InvalidArgument(f"a route id is empty or over {MAX_ROUTE_ID_LENGTH} characters")
    return ids


MAX_HTTP_URL_CHARS = 2048


def http_url_from(url: str) -> str:
    """A worker's OpenAI base URL: empty, or ``http(s)://host[:port][/path]`` without a trailing
    slash, query or whitespace; InvalidArgument otherwise."""
    if not url:
        return ""
    parsed = urllib.parse.urlsplit(url)
    if (len(url) > MAX_HTTP_URL_CHARS or parsed.scheme not in ("http", "https")
            or not parsed.hostname or parsed.query or parsed.fragment
            or any(c.isspace() for c in url)):
        raise InvalidArgument(f"http_url must be an http:// or https:// base URL of at most "
                              f"{MAX_HTTP_URL_CHARS} characters, got {url[:200]!r}")
    try:
        parsed.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        raise InvalidArgument(f"http_url has a bad port: {url[:200]!r}") from None
    return url.rstrip("/")


def heartbeat_from(beat: pb.Heartbeat) -> HeartbeatIn:
    load = WorkerLoad(
        running_requests=beat.running_requests, queued_tokens=beat.queued_tokens,
        free_pages=beat.free_pages, total_pages=beat.total_pages,
    )
    return HeartbeatIn(load, beat.completed_routes, beat.policy_version)


def inventory_from(chunk: pb.InventoryChunk) -> InventoryIn:
    tier = tier_from_pb(chunk.tier, "inventory chunk")
    keys = page_keys_from(chunk.page_keys, "inventory chunk")
    return InventoryIn(chunk.resync_id, keys, tier, chunk.last, chunk.seq)


def outbound_to_pb(message: Outbound) -> pb.SyncResponse:
    response = pb.SyncResponse(protocol_version=PROTOCOL_VERSION)
    if isinstance(message, Ack):
        response.ack.seq = message.seq
    elif isinstance(message, Resync):
        response.resync.resync_id = message.resync_id
        response.resync.reason = message.reason
    elif isinstance(message, Welcome):
        response.welcome.next_seq = message.next_seq
    elif isinstance(message, Command):
        response.command.kind = COMMAND_TO_PB[message.kind]
        response.command.version = message.version
        response.command.weights_uri = message.weights_uri
        response.command.abort_running = message.abort_running
    return response


def policy_to_pb(policy: PolicyRecord) -> pb.PolicyState:
    state = pb.PolicyState(
        protocol_version=PROTOCOL_VERSION, version=policy.version,
        phase=PHASE_TO_PB[policy.phase], epoch=policy.epoch,
        mode=pb.POLICY_MODE_ASYNC if policy.mode == "async" else pb.POLICY_MODE_SYNC,
    )
    if policy.target_version is not None:
        state.target_version = policy.target_version
    state.weights_uri = policy.weights_uri
    return state


def add_failures(state: pb.PolicyState, failures: Mapping[str, str]) -> None:
    """Append ``failures`` (worker -> reason) to ``state``, in worker order."""
    for worker_id, reason in sorted(failures.items()):
        state.failures.append(pb.PolicyFailure(worker_id=worker_id, reason=reason))


def worker_to_pb(view: WorkerView) -> pb.WorkerInfo:
    s = view.session
    load = s.current_load()
    return pb.WorkerInfo(
        worker_id=s.worker_id, address=s.address, incarnation=s.incarnation,
        policy_version=s.policy_version, state=STATE_TO_PB[view.status.value],
        external=s.external, cached_pages=view.cached_pages, total_pages=s.total_pages,
        free_pages=load.free_pages, running_requests=load.running_requests,
        queued_tokens=load.queued_tokens, inflight_routes=load.inflight_routes,
        routed_requests=s.routed_requests, routed_tokens=s.routed_tokens,
        routed_cached_tokens=s.routed_cached_tokens, owner_replica=s.owner,
        http_url=s.http_url, host_pages=s.host_pages,
        cached_gpu_pages=view.cached_by_tier[Tier.GPU],
        cached_cpu_pages=view.cached_by_tier[Tier.CPU],
        cached_disk_pages=view.cached_by_tier[Tier.DISK],
        prefill_backlog_tokens=view.prefill_backlog_tokens,
        prefill_tokens_per_s=s.backlog.tokens_per_s,
        prefill_route_seconds=s.backlog.per_route_s,
        prefill_attention_tokens=(0.0 if math.isinf(s.backlog.attention_tokens)
                                  else s.backlog.attention_tokens),
    )


def stats_to_pb(stats: StatsSnapshot) -> pb.Stats:
    return pb.Stats(
        protocol_version=PROTOCOL_VERSION, workers=stats.workers,
        routable_workers=stats.routable_workers, index_keys=stats.index_keys,
        index_entries=stats.index_entries, pending_entries=stats.pending_entries,
        lookups=stats.lookups, routes=stats.routes, prompt_tokens=stats.prompt_tokens,
        cached_tokens=stats.cached_tokens, hit_ratio=stats.hit_ratio,
        events_applied=stats.events_applied, resyncs=stats.resyncs,
        policy_version=stats.policy.version, policy_phase=PHASE_TO_PB[stats.policy.phase],
        store=stats.store, replica_id=stats.replica_id, replicas=stats.replicas,
        replication_published=stats.replication_published,
        replication_applied=stats.replication_applied,
        replication_lag_p50_ms=stats.replication_lag_p50_ms,
        replication_lag_p99_ms=stats.replication_lag_p99_ms,
    )


def rollout_from(record: pb.RolloutRecord) -> Rollout:
    return Rollout(
        rollout_id=record.rollout_id, policy_version=record.policy_version,
        worker_id=record.worker_id, prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens, completion_tokens=record.completion_tokens,
    )


def rollout_to_pb(rollout: Rollout) -> pb.RolloutRecord:
    return pb.RolloutRecord(
        protocol_version=PROTOCOL_VERSION, rollout_id=rollout.rollout_id,
        policy_version=rollout.policy_version, worker_id=rollout.worker_id,
        prompt_tokens=rollout.prompt_tokens, cached_tokens=rollout.cached_tokens,
        completion_tokens=rollout.completion_tokens, cursor=rollout.cursor,
    )
