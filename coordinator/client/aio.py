"""``AsyncCoordinatorClient``: the asyncio twin of ``coordinator.client.blocking``, with the same
targets, failover, retry and credential rules."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from coordinator.client.blocking import DEFAULT_TIMEOUT, Prompt, R
from coordinator.client.channels import (
    ClientTls,
    call_metadata,
    client_channel_options,
    open_aio_channel,
)
from coordinator.client.errors import (
    KvcoordError,
    another_target_may_serve,
    is_transport_failure,
    retry_pause,
)
from coordinator.client.messages import (
    batch_from,
    batch_request,
    begin_request,
    end_routes_request,
    ended_from,
    lookup_from,
    lookup_request,
    policy_from,
    rollout_from,
    route_from,
    route_request,
    stats_from,
    worker_from,
)
from coordinator.client.targets import Targets
from coordinator.client.types import (
    EndedRoutes,
    LookupResult,
    PolicyState,
    PolicyUpdate,
    RolloutRecord,
    Route,
    RouteBatch,
    Stats,
    WorkerInfo,
)
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc


class AsyncCoordinatorClient:
    """The asyncio twin of ``CoordinatorClient``: same methods, awaited, with the same
    arguments, failover, retries and refusals (each method's contract is stated there), but
    for a view from ``as_caller``, which raises the first refusal instead of waiting it out."""

    def __init__(
        self, targets: str, token: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
        max_message_bytes: int = 16 * 1024 * 1024, tls: ClientTls | None = None,
    ) -> None:
        self._targets = Targets.parse(targets)
        self._metadata = call_metadata(token)
        self._timeout = timeout
        options = client_channel_options(max_message_bytes)
        self._channels = [open_aio_channel(t, options, tls) for t in self._targets]
        self._stubs = [pb_grpc.CoordinatorStub(c) for c in self._channels]
        self._retry = True

    @classmethod
    def over_stub(cls, stub: Any, target: str, *,
                  timeout: float = DEFAULT_TIMEOUT) -> AsyncCoordinatorClient:
        """A client whose unary calls go to ``stub`` rather than a channel: a coordinator
        serving in this very process (``coordinator.server.in_process.InProcessStub``), named
        ``target`` in errors. The same retries and refusals; ``close`` closes nothing."""
        client = cls.__new__(cls)
        client._targets = Targets.parse(target)
        client._metadata = call_metadata(None)
        client._timeout = timeout
        client._channels = []
        client._stubs = [stub]
        client._retry = True
        return client

    def as_caller(self, token: str | None) -> AsyncCoordinatorClient:
        """A view of this client that calls with ``token`` (a gateway passing on its client's
        own credentials) and does not wait out RetryInfo delays itself (the caller decides);
        it shares the channels: close the client, never a view."""
        # NOTE: a shallow copy: the view shares the channels, stubs and ``Targets`` (so a
        # failover seen by one is seen by all); only the metadata and the retry switch are its.
        view = copy.copy(self)
        view._metadata = call_metadata(token)
        view._retry = False
        return view

    async def __aenter__(self) -> AsyncCoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """``CoordinatorClient._call``, awaited (without the ``RetryInfo`` waits in a view)."""
        deadline = time.monotonic() + (timeout or self._timeout)
        while True:
            try:
                return await self._call_once(method, request, deadline - time.monotonic())
            except KvcoordError as error:
                pause = retry_pause(error, deadline) if self._retry else None
                if pause is None:
                    raise
                await asyncio.sleep(pause)

    async def _call_once(self, method: str, request: Any, timeout: float) -> Any:
        """``CoordinatorClient._call_once``, awaited."""
        last: KvcoordError | None = None
        for stub in self._targets.rotation(self._stubs):
            try:
                return await getattr(stub, method)(
                    request, timeout=timeout, metadata=self._metadata
                )
            except grpc.RpcError as exc:
                error = KvcoordError.from_rpc(exc)
                if not another_target_may_serve(error):
                    raise error from None
                self._targets.failed()
                last = error
        assert last is not None
        raise last

    async def _parsed(self, method: str, request: Any, parse: Callable[[Any], R]) -> R:
        return parse(await self._call(method, request))

    async def lookup(
        self, tokens: Prompt, *, model: str | None = None, adapter: str | None = None,
        policy_version: int | None = None, cache_salt: str | None = None,
    ) -> LookupResult:
        request = lookup_request(tokens, model, adapter, policy_version, cache_salt)
        return await self._parsed("Lookup", request, lookup_from)

    async def route(
        self, tokens: Prompt, *, model: str | None = None, adapter: str | None = None,
        min_policy_version: int | None = None, policy_version: int | None = None,
        routing_policy: str = "", exclude_workers: Sequence[str] = (), report_end: bool = False,
        cache_salt: str | None = None,
    ) -> Route:
        """The worker for ``tokens`` (never one of ``exclude_workers``). ``report_end``: you
        will call ``end_routes`` when the request ends (see ``Route.end_awaited``)."""
        request = route_request(tokens, model, adapter, min_policy_version, policy_version,
                                routing_policy, exclude_workers, report_end, cache_salt)
        return await self._parsed("Route", request, route_from)

    async def route_batch(
        self, prompts: Sequence[Prompt], *, model: str | None = None, adapter: str | None = None,
        min_policy_version: int | None = None, policy_version: int | None = None,
        routing_policy: str = "", report_end: bool = False, cache_salt: str | None = None,
    ) -> RouteBatch:
        request = batch_request(prompts, model, adapter, min_policy_version, policy_version,
                                routing_policy, report_end, cache_salt)
        return await self._parsed("RouteBatch", request, batch_from)

    async def end_routes(self, route_ids: Sequence[str]) -> EndedRoutes:
        """Report that these routes' requests ended (idempotent: an id ends once)."""
        return await self._parsed("EndRoutes", end_routes_request(route_ids), ended_from)

    async def policy(self) -> PolicyState:
        return await self._parsed("GetPolicy", pb.GetPolicyRequest(), policy_from)

    async def begin_policy_update(
        self, expected_version: int, mode: str = "sync", weights_uri: str = "",
        abort_running: bool = False,
    ) -> PolicyState:
        """As ``CoordinatorClient.begin_policy_update`` (POLICY_RESTORED is not retried)."""
        request = begin_request(expected_version, mode, weights_uri, abort_running)
        return await self._parsed("BeginPolicyUpdate", request, policy_from)

    @contextlib.asynccontextmanager
    async def policy_update(
        self, expected_version: int, mode: str = "sync", weights_uri: str = "",
        timeout: float = 30.0,
    ) -> AsyncIterator[PolicyUpdate]:
        """``async with client.policy_update(v) as update:`` as ``CoordinatorClient``'s: commit
        on exit, abort (refusals ignored) if the block raises, cancellation included."""
        state = await self.begin_policy_update(expected_version, mode, weights_uri)
        update = PolicyUpdate(version=state.target_version or expected_version + 1, begun=state)
        try:
            yield update
        except BaseException:
            with contextlib.suppress(KvcoordError):
                await self.abort_policy_update(update.version)
            raise
        update.result = await self.commit_policy_update(update.version, timeout=timeout)

    async def watch_policy(self) -> AsyncIterator[PolicyState]:
        """The policy state now, then every change (a server stream, moved to another target
        when its coordinator goes away)."""
        last: PolicyState | None = None
        async for message in self._stream("WatchPolicy", pb.WatchPolicyRequest):
            state = policy_from(message)
            if state != last:
                last = state
                yield state

    async def rollouts(
        self, since: str | None = None, follow: bool = False
    ) -> AsyncIterator[RolloutRecord]:
        """As ``CoordinatorClient.rollouts``: a failover resumes after the last record."""
        cursor = since or ""

        def request() -> pb.ReadRolloutsRequest:
            return pb.ReadRolloutsRequest(since=cursor, follow=follow)

        async for record in self._stream("ReadRollouts", request):
            cursor = record.cursor
            yield rollout_from(record)

    async def _stream(self, method: str, request: Callable[[], Any]) -> AsyncIterator[Any]:
        """``CoordinatorClient._stream``, awaited."""
        failures = 0
        while True:
            stub = next(self._targets.rotation(self._stubs))
            try:
                async for message in getattr(stub, method)(request(),
                                                           metadata=self._metadata):
                    failures = 0
                    yield message
                return
            except grpc.RpcError as exc:
                error = KvcoordError.from_rpc(exc)
                if not is_transport_failure(error):
                    raise error from None
                self._targets.failed()
                failures += 1
                if failures >= len(self._stubs):
                    raise error from None

    async def commit_policy_update(self, version: int, timeout: float = 30.0) -> PolicyState:
        """As ``CoordinatorClient.commit_policy_update`` (the same 5 s margin on the deadline,
        so the coordinator answers whom it fenced before the caller gives up)."""
        request = pb.CommitPolicyUpdateRequest(version=version, timeout_ms=int(timeout * 1000))
        return policy_from(await self._call("CommitPolicyUpdate", request, timeout=timeout + 5))

    async def abort_policy_update(self, version: int) -> PolicyState:
        request = pb.AbortPolicyUpdateRequest(version=version)
        return await self._parsed("AbortPolicyUpdate", request, policy_from)

    async def workers(self) -> list[WorkerInfo]:
        response = await self._call("ListWorkers", pb.ListWorkersRequest())
        return [worker_from(w) for w in response.workers]

    async def stats(self) -> Stats:
        return await self._parsed("GetStats", pb.GetStatsRequest(), stats_from)

    async def cordon(self, worker_id: str, cordoned: bool = True) -> WorkerInfo:
        request = pb.CordonRequest(worker_id=worker_id, cordoned=cordoned)
        response = await self._call("Cordon", request)
        return worker_from(response.worker)
