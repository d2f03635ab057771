"""``coordinator.v1.Coordinator`` servicer: convert, delegate to the service, convert back.

No decisions are made here. Errors are domain exceptions; ``coordinator.rpc.interceptor`` maps them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeAlias

import grpc

from coordinator.control.shard_routing import ShardRouting
from coordinator.core.errors import FailedPrecondition, InvalidArgument
from coordinator.core.routing import PromptInput, Scope
from coordinator.replica import CoordinatorReplica
from coordinator.rpc.guard import caller
from coordinator.rpc.identities import (
    PermissionDenied,
    check_cordon,
    check_worker,
    may_send_page_keys,
    visible_workers,
)
from coordinator.rpc.versions import check_protocol
from coordinator.server import convert, shard_convert
from coordinator.server.convert import prompt_from, scope_from
from coordinator.server.peer_shards import forwarding, is_shard_hop
from coordinator.server.sync_stream import serve_sync
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import PROTOCOL_VERSION, Reason

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class CoordinatorServicer(pb_grpc.CoordinatorServicer):  # type: ignore[misc]
    def __init__(self, service: CoordinatorReplica,
                 sync_port: Callable[[], int] = lambda: 0,
                 shards: ShardRouting | None = None) -> None:
        """``sync_port()``: the port a registering worker opens its stream on (a sync
        frontend's, ``server.sync_relay``; 0 = this server). ``shards``: the other shards,
        when lookups and route ends span them (``control.shard_routing``; routes span them
        through the routing gate)."""
        self._service = service
        self._config = service.config
        self._sync_port = sync_port
        self._shards = shards

    def _spanning(self, context: Context) -> ShardRouting | None:
        """The shards a call spans: none for a call another shard made (``SHARD_HOP``)."""
        if self._shards is None or is_shard_hop(context.invocation_metadata()):
            return None
        return self._shards

    # ------------------------------------------------------------------ scheduler

    def _prompt(self, prompt: pb.Prompt, what: str = "prompt") -> PromptInput:
        """A validated prompt; page keys only from callers trusted with the hash key."""
        if prompt.page_keys and not may_send_page_keys(
                caller(), self._config.trust_scheduler_page_keys):
            raise PermissionDenied(
                f"{what}: page keys are accepted from workers and admins only; send token ids"
            )
        return prompt_from(prompt, self._config, what)

    @staticmethod
    def _scope(scope: pb.Scope) -> Scope:
        """The request's scope under the caller's tenant (ARCHITECTURE §0, "Who holds the key")."""
        return scope_from(scope, caller().tenant)

    async def Lookup(self, request: pb.LookupRequest, context: Context) -> pb.LookupResponse:
        check_protocol(request.protocol_version)
        prompt = self._prompt(request.prompt)
        shards = self._spanning(context)
        if shards is None:
            result = self._service.router.lookup(prompt, self._scope(request.scope))
        else:
            with forwarding(context.invocation_metadata()):
                result = await shards.lookup(prompt, self._scope(request.scope))
        return convert.lookup_to_pb(result)

    async def Route(self, request: pb.RouteRequest, context: Context) -> pb.RouteResponse:
        """The route, once ``control.routing_gate`` admits it (a drain waited out, a fresh
        policy state)."""
        check_protocol(request.protocol_version)
        prompt = self._prompt(request.prompt)
        with forwarding(context.invocation_metadata()):  # to the other shards, if any
            route = await self._service.routing_gate.route(
                prompt,
                self._scope(request.scope),
                time_left=context.time_remaining,
                min_policy_version=_optional(request, "min_policy_version"),
                routing=request.routing_policy,
                exclude=convert.excluded_workers(request.exclude_workers),
                report_end=request.report_end,
            )
        return convert.route_to_pb(route)

    async def RouteBatch(
        self, request: pb.RouteBatchRequest, context: Context
    ) -> pb.RouteBatchResponse:
        check_protocol(request.protocol_version)
        n = len(request.prompts)
        if n == 0:
            raise InvalidArgument("RouteBatch needs at least one prompt")
        if n > self._config.max_batch_prompts:
            raise InvalidArgument(
                f"batch of {n} prompts is over the limit of {self._config.max_batch_prompts}"
            )
        # Counted from field lengths, before any prompt is converted.
        total = sum(len(p.token_ids) + len(p.token_bytes) // 4 + p.token_count
                    for p in request.prompts)
        if total > self._config.max_batch_tokens:
            raise InvalidArgument(f"batch of {total} tokens is over the limit of "
                                  f"{self._config.max_batch_tokens} (max_batch_tokens)")
        prompts = [self._prompt(p, f"prompts[{i}]") for i, p in enumerate(request.prompts)]
        with forwarding(context.invocation_metadata()):  # to the other shards, if any
            batch = await self._service.routing_gate.route_batch(
                prompts,
                self._scope(request.scope),
                time_left=context.time_remaining,
                min_policy_version=_optional(request, "min_policy_version"),
                routing=request.routing_policy,
                report_end=request.report_end,
            )
        return pb.RouteBatchResponse(
            protocol_version=PROTOCOL_VERSION,
            routes=[convert.route_to_pb(r) for r in batch.routes],
            order=batch.order,
        )

    async def EndRoutes(
        self, request: pb.EndRoutesRequest, context: Context
    ) -> pb.EndRoutesResponse:
        route_ids = convert.route_ids_from(request)
        shards = self._spanning(context)
        if shards is None:
            ended = self._service.router.end_routes(route_ids)
        else:
            with forwarding(context.invocation_metadata()):
                ended = await shards.end_routes(route_ids)
        return pb.EndRoutesResponse(protocol_version=PROTOCOL_VERSION, ended=ended.ended,
                                    unknown=ended.unknown)

    async def ShardShortlist(
        self, request: pb.ShardShortlistRequest, context: Context
    ) -> pb.ShardShortlistResponse:
        """This shard's best candidates for another shard's decision (reserves nothing)."""
        check_protocol(request.protocol_version)
        route = request.route
        _, shortlist = self._service.router.shortlist(
            self._prompt(route.prompt), self._scope(route.scope), copies=max(1, request.copies),
            min_policy_version=_optional(route, "min_policy_version"),
            routing=route.routing_policy, exclude=convert.excluded_workers(route.exclude_workers),
            after=request.after_worker or None,
        )
        return shard_convert.shortlist_to_pb(shortlist)

    async def ShardReserve(
        self, request: pb.ShardReserveRequest, context: Context
    ) -> pb.RouteResponse:
        """Reserve the worker another shard chose over every shard's shortlist."""
        check_protocol(request.protocol_version)
        route = request.route
        if not request.worker_id:
            raise InvalidArgument("ShardReserve needs a worker_id")
        result = self._service.router.reserve(
            self._prompt(route.prompt), self._scope(route.scope), request.worker_id,
            copies=max(1, request.copies),
            min_policy_version=_optional(route, "min_policy_version"),
            routing=route.routing_policy, report_end=route.report_end,
        )
        return convert.route_to_pb(result)

    # ------------------------------------------------------------------ worker

    async def Register(self, request: pb.RegisterRequest, context: Context) -> pb.RegisterResponse:
        check_worker(caller(), request.worker_id)
        registration = await self._service.worker_sync.register(convert.registration_from(request))
        return pb.RegisterResponse(
            protocol_version=PROTOCOL_VERSION,
            incarnation=registration.incarnation,
            # The version to load: the target while an update is in progress (ARCHITECTURE §0:
            # a worker registering mid-update or fenced learns it here and is unroutable until
            # it serves it).
            policy_version=(
                registration.policy.target_version
                if registration.policy.target_version is not None
                else registration.policy.version
            ),
            policy_phase=convert.PHASE_TO_PB[registration.policy.phase],
            weights_uri=(
                registration.policy.target_weights_uri
                if registration.policy.target_version is not None
                else registration.policy.weights_uri
            ),
            lease_ms=registration.lease_ms,
            heartbeat_ms=registration.heartbeat_ms,
            max_events_per_batch=registration.max_events_per_batch,
            max_message_bytes=registration.max_message_bytes,
            sync_port=self._sync_port(),
        )

    async def Deregister(
        self, request: pb.DeregisterRequest, context: Context
    ) -> pb.DeregisterResponse:
        check_protocol(request.protocol_version)
        check_worker(caller(), request.worker_id)
        await self._service.worker_sync.deregister(request.worker_id, request.incarnation)
        return pb.DeregisterResponse(protocol_version=PROTOCOL_VERSION)

    async def Sync(
        self, request_iterator: AsyncIterator[pb.SyncRequest], context: Context
    ) -> AsyncIterator[pb.SyncResponse]:
        """One worker's stream (``server.sync_stream``: a reader, an ordered applier, merged
        acks while the replica is busy)."""
        async for response in serve_sync(self._service, request_iterator):
            yield response

    async def ReportRollouts(
        self, request: pb.ReportRolloutsRequest, context: Context
    ) -> pb.ReportRolloutsResponse:
        check_protocol(request.protocol_version)
        if not request.records:
            return pb.ReportRolloutsResponse(protocol_version=PROTOCOL_VERSION, accepted=0)
        worker_id = request.records[0].worker_id
        check_worker(caller(), worker_id)  # and rollouts.append checks every record is its own
        served = self._service.worker_sync.served_versions_of(worker_id)
        if served is None:
            raise FailedPrecondition(f"unknown worker {worker_id!r}: register first",
                                     reason=Reason.REREGISTER)
        accepted = await self._service.rollouts.append(
            worker_id, served, [convert.rollout_from(r) for r in request.records]
        )
        return pb.ReportRolloutsResponse(protocol_version=PROTOCOL_VERSION, accepted=accepted)

    # ------------------------------------------------------------------ trainer

    async def GetPolicy(self, request: pb.GetPolicyRequest, context: Context) -> pb.PolicyState:
        check_protocol(request.protocol_version)
        record = await self._service.refresh_policy()
        state = convert.policy_to_pb(record)
        if record.target_version is not None:
            convert.add_failures(state, await self._service.updates.failures(
                record.target_version))
        return state

    async def BeginPolicyUpdate(
        self, request: pb.BeginPolicyUpdateRequest, context: Context
    ) -> pb.PolicyState:
        check_protocol(request.protocol_version)
        mode = "async" if request.mode == pb.POLICY_MODE_ASYNC else "sync"
        record = await self._service.updates.begin(
            request.expected_version, mode, request.weights_uri, request.abort_running
        )
        return convert.policy_to_pb(record)

    async def CommitPolicyUpdate(
        self, request: pb.CommitPolicyUpdateRequest, context: Context
    ) -> pb.PolicyState:
        check_protocol(request.protocol_version)
        timeout_ms = request.timeout_ms or self._config.barrier_timeout_ms
        remaining = context.time_remaining()
        timeout = timeout_ms / 1000
        if remaining is not None:
            timeout = min(timeout, max(0.0, remaining - 0.2))  # answer before the caller gives up
        result = await self._service.updates.commit(request.version, timeout)
        state = convert.policy_to_pb(result.record)
        state.acked_workers.extend(result.acked)
        state.fenced_workers.extend(result.fenced)
        convert.add_failures(state, result.failures)
        return state

    async def AbortPolicyUpdate(
        self, request: pb.AbortPolicyUpdateRequest, context: Context
    ) -> pb.PolicyState:
        check_protocol(request.protocol_version)
        return convert.policy_to_pb(await self._service.updates.abort(request.version))

    async def WatchPolicy(
        self, request: pb.WatchPolicyRequest, context: Context
    ) -> AsyncIterator[pb.PolicyState]:
        check_protocol(request.protocol_version)
        async for record in self._service.policy_view.watch():
            yield convert.policy_to_pb(record)

    async def ReadRollouts(
        self, request: pb.ReadRolloutsRequest, context: Context
    ) -> AsyncIterator[pb.RolloutRecord]:
        check_protocol(request.protocol_version)
        async for rollout in self._service.rollouts.read(request.since or None,
                                                         follow=request.follow):
            yield convert.rollout_to_pb(rollout)

    # ------------------------------------------------------------------ operator

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: Context
    ) -> pb.ListWorkersResponse:
        check_protocol(request.protocol_version)
        views = self._service.workers()
        visible = visible_workers(caller(), [v.session.worker_id for v in views])
        workers = [convert.worker_to_pb(v) for v in views if v.session.worker_id in visible]
        return pb.ListWorkersResponse(protocol_version=PROTOCOL_VERSION, workers=workers)

    async def GetStats(self, request: pb.GetStatsRequest, context: Context) -> pb.Stats:
        check_protocol(request.protocol_version)
        stats = convert.stats_to_pb(self._service.stats())
        if request.index_digest:
            stats.index_digest = self._service.index.digest()
        return stats

    async def Cordon(self, request: pb.CordonRequest, context: Context) -> pb.CordonResponse:
        check_protocol(request.protocol_version)
        check_cordon(caller(), request.worker_id, request.cordoned)
        view = self._service.cordon(request.worker_id, request.cordoned)
        return pb.CordonResponse(
            protocol_version=PROTOCOL_VERSION, worker=convert.worker_to_pb(view)
        )


def _optional(message: Any, name: str) -> int | None:
    return int(getattr(message, name)) if message.HasField(name) else None
