"""``GrpcPeerShard``: another shard's replicas as this replica asks them (``PeerShard``).

One channel per replica of the shard; calls go to them in turn (a shard's replicas share the
shortlists it is asked for), and a transport failure moves to the next. A call carries the
caller's own credentials (``forwarding``: the bearer token the call into this replica came
with), so the shard checks the same identity, role and tenant this replica did. The hop is
marked (``SHARD_HOP``), and a replica answers a marked Lookup or EndRoutes from its own shard
alone, so a call never loops.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from coordinator.client.channels import client_channel_options
from coordinator.client.errors import KvcoordError, is_transport_failure
from coordinator.control.shard_routing import PeerShard, ShardQuery
from coordinator.core.errors import (
    DomainError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from coordinator.core.routing import LookupResult, PromptInput, RouteResult, Scope, Shortlist
from coordinator.core.routing.awaited_routes import EndedRoutes
from coordinator.server import shard_convert
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import PROTOCOL_VERSION

SHARD_HOP = ("kvcoord-shard-hop", "1")
"""Call metadata of a call one shard makes to another (answered from that shard alone)."""

_FORWARDED: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "kvcoord_forwarded_metadata", default=())

T = TypeVar("T")

_ERRORS: dict[grpc.StatusCode, type[DomainError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.NOT_FOUND: NotFound,
}


def is_shard_hop(metadata: Sequence[tuple[str, Any]] | None) -> bool:
    """Whether a call came from another shard (``SHARD_HOP`` in its metadata)."""
    return any(k == SHARD_HOP[0] for k, _ in metadata or ())


@contextlib.contextmanager
def forwarding(metadata: Sequence[tuple[str, Any]] | None) -> Iterator[None]:
    """Within the block, calls to other shards carry the ``authorization`` entry of
    ``metadata`` (the call being served)."""
    entries = tuple((k, v) for k, v in metadata or () if k == "authorization"
                    and isinstance(v, str))
    token = _FORWARDED.set(entries)
    try:
        yield
    finally:
        _FORWARDED.reset(token)


def _domain_error(error: KvcoordError, shard: str) -> DomainError:
    """The refusal a shard answered, as this replica's own (its reason and retry kept);
    UNAVAILABLE for anything that says the shard could not answer."""
    kind = _ERRORS.get(error.code, Unavailable)
    return kind(f"shard {shard}: {error.details}", reason=error.reason,
                retry_after_ms=error.retry_after_ms)


class GrpcPeerShard(PeerShard):
    """A shard named ``name`` whose replicas listen at ``targets`` (plaintext)."""

    def __init__(self, name: str, targets: Sequence[str], *, page_size: int,
                 max_message_bytes: int) -> None:
        if not targets:
            raise ValueError(f"shard {name!r} has no targets")
        self.name = name
        self._page_size = page_size
        self._targets = tuple(targets)
        self._options = client_channel_options(max_message_bytes)
        # Opened on the first call, in the serving loop (grpc.aio binds a channel to a loop).
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[pb_grpc.CoordinatorStub] = []
        self._next = 0  # the replica asked first next time

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels, self._stubs = [], []

    def _opened(self) -> list[pb_grpc.CoordinatorStub]:
        if not self._stubs:
            self._channels = [grpc.aio.insecure_channel(t, options=self._options)
                              for t in self._targets]
            self._stubs = [pb_grpc.CoordinatorStub(c) for c in self._channels]
        return self._stubs

    async def _call(self, rpc: Callable[[pb_grpc.CoordinatorStub], Callable[..., Awaitable[T]]],
                    request: Any) -> T:
        """``rpc`` on the shard's replicas in turn until one answers; a replica's refusal is
        raised as a domain error, and the last transport failure as UNAVAILABLE."""
        metadata = (*_FORWARDED.get(), SHARD_HOP)
        stubs = self._opened()
        last: KvcoordError | None = None
        for i in range(len(stubs)):
            index = (self._next + i) % len(stubs)
            try:
                answer = await rpc(stubs[index])(request, metadata=metadata)
            except grpc.RpcError as exc:
                last = KvcoordError.from_rpc(exc)
                if is_transport_failure(last):
                    continue
                raise _domain_error(last, self.name) from None
            self._next = index + 1  # the shard's replicas take its calls in turn
            return answer
        assert last is not None
        raise _domain_error(last, self.name)

    async def shortlist(self, query: ShardQuery, after: str | None) -> Shortlist:
        request = pb.ShardShortlistRequest(
            protocol_version=PROTOCOL_VERSION, route=shard_convert.route_request_to_pb(query),
            copies=query.copies, after_worker=after or "")
        answer = await self._call(lambda s: s.ShardShortlist, request)
        return shard_convert.shortlist_from_pb(answer, query.routing)

    async def reserve(self, query: ShardQuery, worker_id: str) -> RouteResult:
        request = pb.ShardReserveRequest(
            protocol_version=PROTOCOL_VERSION, route=shard_convert.route_request_to_pb(query),
            copies=query.copies, worker_id=worker_id)
        answer = await self._call(lambda s: s.ShardReserve, request)
        return shard_convert.route_from_pb(answer, self._page_size)

    async def lookup(self, prompt: PromptInput, scope: Scope) -> LookupResult:
        request = pb.LookupRequest(protocol_version=PROTOCOL_VERSION,
                                   prompt=shard_convert.prompt_to_pb(prompt),
                                   scope=shard_convert.scope_to_pb(scope))
        answer = await self._call(lambda s: s.Lookup, request)
        return shard_convert.lookup_from_pb(answer, self._page_size)

    async def end_routes(self, route_ids: Sequence[str]) -> EndedRoutes:
        request = pb.EndRoutesRequest(protocol_version=PROTOCOL_VERSION,
                                      route_ids=list(route_ids))
        answer = await self._call(lambda s: s.EndRoutes, request)
        return EndedRoutes(answer.ended, answer.unknown)


def peer_shards(targets: dict[str, tuple[str, ...]], *, page_size: int,
                max_message_bytes: int) -> list[GrpcPeerShard]:
    """A peer for each shard of ``CoordinatorConfig.peer_shard_targets()``."""
    return [GrpcPeerShard(name, hosts, page_size=page_size, max_message_bytes=max_message_bytes)
            for name, hosts in sorted(targets.items())]
