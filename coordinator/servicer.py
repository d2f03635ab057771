"""``coordinator.v1.Coordinator`` servicer: convert, delegate to the service, convert back.

No decisions are made here. Errors are domain exceptions; ``coordinator.interceptor`` maps them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from coordinator import convert
from coordinator.convert import PROTOCOL_VERSION, check_protocol, prompt_from, scope_from
from coordinator.errors import FailedPrecondition, InvalidArgument, Unimplemented
from coordinator.fleet import WorkerSession
from coordinator.service import CoordinatorService
from coordinator.sessions import Outbound
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc

_POLICY_LATER = "arrives with policy versions (issue 4); GetPolicy is served"

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class CoordinatorServicer(pb_grpc.CoordinatorServicer):  # type: ignore[misc]
    def __init__(self, service: CoordinatorService) -> None:
        self._service = service
        self._config = service.config

    # ------------------------------------------------------------------ scheduler

    async def Lookup(self, request: pb.LookupRequest, context: Context) -> pb.LookupResponse:
        check_protocol(request.protocol_version)
        prompt = prompt_from(request.prompt, self._config)
        result = self._service.scheduler.lookup(prompt, scope_from(request.scope))
        return convert.lookup_to_pb(result)

    async def Route(self, request: pb.RouteRequest, context: Context) -> pb.RouteResponse:
        check_protocol(request.protocol_version)
        prompt = prompt_from(request.prompt, self._config)
        route = self._service.scheduler.route(
            prompt,
            scope_from(request.scope),
            min_policy_version=_optional(request, "min_policy_version"),
            policy=request.routing_policy,
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
        prompts = [
            prompt_from(p, self._config, what=f"prompts[{i}]")
            for i, p in enumerate(request.prompts)
        ]
        batch = self._service.scheduler.route_batch(
            prompts,
            scope_from(request.scope),
            min_policy_version=_optional(request, "min_policy_version"),
            policy=request.routing_policy,
        )
        return pb.RouteBatchResponse(
            protocol_version=PROTOCOL_VERSION,
            routes=[convert.route_to_pb(r) for r in batch.routes],
            order=batch.order,
        )

    # ------------------------------------------------------------------ worker

    async def Register(self, request: pb.RegisterRequest, context: Context) -> pb.RegisterResponse:
        registration = await self._service.sessions.register(convert.registration_from(request))
        return pb.RegisterResponse(
            protocol_version=PROTOCOL_VERSION,
            incarnation=registration.incarnation,
            policy_version=registration.policy.version,
            policy_phase=convert.PHASE_TO_PB[registration.policy.phase],
            lease_ms=registration.lease_ms,
            heartbeat_ms=registration.heartbeat_ms,
            max_events_per_batch=registration.max_events_per_batch,
            max_message_bytes=registration.max_message_bytes,
        )

    async def Deregister(
        self, request: pb.DeregisterRequest, context: Context
    ) -> pb.DeregisterResponse:
        check_protocol(request.protocol_version)
        await self._service.sessions.deregister(request.worker_id, request.incarnation)
        return pb.DeregisterResponse(protocol_version=PROTOCOL_VERSION)

    async def Sync(
        self, request_iterator: AsyncIterator[pb.SyncRequest], context: Context
    ) -> AsyncIterator[pb.SyncResponse]:
        """One worker's stream. A reader task applies what the worker sends; replies (and, later,
        coordinator-initiated commands) go out through one queue so writes never interleave."""
        outbox: asyncio.Queue[pb.SyncResponse | BaseException | None] = asyncio.Queue()
        reader = asyncio.create_task(self._read_sync(request_iterator, outbox))
        try:
            while True:
                item = await outbox.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            reader.cancel()

    async def _read_sync(
        self,
        requests: AsyncIterator[pb.SyncRequest],
        outbox: asyncio.Queue[pb.SyncResponse | BaseException | None],
    ) -> None:
        sessions = self._service.sessions
        session: WorkerSession | None = None
        stream_id = 0

        def send(replies: list[Outbound]) -> None:
            for reply in replies:
                outbox.put_nowait(convert.outbound_to_pb(reply))

        try:
            first = await anext(aiter(requests), None)
            if first is None:
                outbox.put_nowait(None)
                return
            check_protocol(first.protocol_version)
            if first.WhichOneof("body") != "hello":
                raise FailedPrecondition("the first Sync message must be a hello")
            hello = first.hello
            session, stream_id, replies = sessions.hello(
                hello.worker_id, hello.incarnation, hello.last_acked_seq,
                close=outbox.put_nowait,
            )
            send(replies)
            async for request in requests:
                check_protocol(request.protocol_version)
                if not sessions.owns(session, stream_id):
                    return  # _detach already queued the FAILED_PRECONDITION that ends us
                send(await self._dispatch(session, request))
            outbox.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            outbox.put_nowait(exc)
        finally:
            if session is not None:
                sessions.disconnect(session, stream_id)

    async def _dispatch(self, session: WorkerSession, request: pb.SyncRequest) -> list[Outbound]:
        sessions = self._service.sessions
        body = request.WhichOneof("body")
        if body == "events":
            events = convert.events_from(request.events)
            return sessions.events(session, request.events.seq, events)
        if body == "heartbeat":
            return await sessions.heartbeat(session, convert.heartbeat_from(request.heartbeat))
        if body == "inventory":
            return sessions.inventory(session, convert.inventory_from(request.inventory))
        if body == "hello":
            raise FailedPrecondition("hello sent twice on one stream")
        if body == "policy_ack":
            raise FailedPrecondition("policy ack received but no policy update is in progress")
        raise InvalidArgument("empty Sync message: set one body")

    async def ReportRollouts(self, request: Any, context: Context) -> Any:
        raise Unimplemented(f"ReportRollouts {_POLICY_LATER}")

    # ------------------------------------------------------------------ trainer

    async def GetPolicy(self, request: pb.GetPolicyRequest, context: Context) -> pb.PolicyState:
        check_protocol(request.protocol_version)
        return convert.policy_to_pb(await self._service.refresh_policy())

    async def BeginPolicyUpdate(self, request: Any, context: Context) -> Any:
        raise Unimplemented(f"BeginPolicyUpdate {_POLICY_LATER}")

    async def CommitPolicyUpdate(self, request: Any, context: Context) -> Any:
        raise Unimplemented(f"CommitPolicyUpdate {_POLICY_LATER}")

    async def AbortPolicyUpdate(self, request: Any, context: Context) -> Any:
        raise Unimplemented(f"AbortPolicyUpdate {_POLICY_LATER}")

    async def WatchPolicy(self, request: Any, context: Context) -> AsyncIterator[Any]:
        raise Unimplemented(f"WatchPolicy {_POLICY_LATER}")
        yield  # pragma: no cover - makes this an async generator like the stub expects

    async def ReadRollouts(self, request: Any, context: Context) -> AsyncIterator[Any]:
        raise Unimplemented(f"ReadRollouts {_POLICY_LATER}")
        yield  # pragma: no cover

    # ------------------------------------------------------------------ operator

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: Context
    ) -> pb.ListWorkersResponse:
        check_protocol(request.protocol_version)
        workers = [convert.worker_to_pb(view) for view in self._service.workers()]
        return pb.ListWorkersResponse(protocol_version=PROTOCOL_VERSION, workers=workers)

    async def GetStats(self, request: pb.GetStatsRequest, context: Context) -> pb.Stats:
        check_protocol(request.protocol_version)
        return convert.stats_to_pb(self._service.stats())

    async def Cordon(self, request: pb.CordonRequest, context: Context) -> pb.CordonResponse:
        check_protocol(request.protocol_version)
        view = self._service.cordon(request.worker_id, request.cordoned)
        return pb.CordonResponse(
            protocol_version=PROTOCOL_VERSION, worker=convert.worker_to_pb(view)
        )


def _optional(message: Any, name: str) -> int | None:
    return int(getattr(message, name)) if message.HasField(name) else None
