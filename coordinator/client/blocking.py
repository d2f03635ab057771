"""``CoordinatorClient``: the blocking scheduler/operator SDK client.

It takes TARGETS: ``host:port``, a comma-separated list of them, or a gRPC name such as
``dns:///name:port``. With a list, a unary call answered UNAVAILABLE (the target unreachable,
or a replica that cannot serve now: its policy state stale, its store down, the fleet
draining) moves on to the next target at once; once every target refused, it waits out the
coordinator's ``RetryInfo`` delay and goes round again, within its deadline. Server streams
move on only when the transport fails. Client-side validation raises
``ValueError``; a refused call raises ``KvcoordError`` whose ``.code`` is the gRPC status and
``.reason`` the coordinator's ``coordinator.wire.Reason``.
``token`` goes out as ``authorization: Bearer`` metadata on every call; ``tls`` (a ``ClientTls``)
makes every channel TLS, mutual when it carries a client certificate.
Request building and response parsing live in ``coordinator.client.messages``, shared by both
clients (``coordinator.client.aio`` is the asyncio twin).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from coordinator.client.channels import (
    ClientTls,
    call_metadata,
    client_channel_options,
    open_channel,
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
    PageKeys,
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

Prompt = Sequence[int] | PageKeys
R = TypeVar("R")
DEFAULT_TIMEOUT = 10.0


class CoordinatorClient:
    """Blocking client. Thread-safe (grpc channels are); close it or use it as a context manager.

    Any call may also raise ``ValueError`` (its arguments, checked before a round trip) and
    ``KvcoordError``: UNAUTHENTICATED / PERMISSION_DENIED (the token, its role), DEADLINE_EXCEEDED
    (the call's timeout), FAILED_PRECONDITION ``PROTOCOL_VERSION``, none of them retried; and
    UNAVAILABLE (every target unreachable, or ``STORE_UNAVAILABLE``) or RESOURCE_EXHAUSTED
    ``RATE_LIMITED`` once their ``RetryInfo`` delays have run past the deadline.
    """

    def __init__(
        self, targets: str, token: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
        max_message_bytes: int = 16 * 1024 * 1024, tls: ClientTls | None = None,
    ) -> None:
        """One channel per target, connected on first use. ``timeout``: seconds per call, its
        retries and failovers included. ValueError for TARGETS that name no HOST:PORT."""
        self._targets = Targets.parse(targets)
        self._metadata = call_metadata(token)
        self._timeout = timeout
        options = client_channel_options(max_message_bytes)
        self._channels = [open_channel(t, options, tls) for t in self._targets]
        self._stubs = [pb_grpc.CoordinatorStub(c) for c in self._channels]

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """One call, failing over across targets on UNAVAILABLE (module docstring) and
        retrying, within the call's deadline, when the coordinator answers with
        ``RetryInfo`` (UNAVAILABLE from every target: an update draining the fleet, no
        worker yet, stale policy state; RESOURCE_EXHAUSTED: over the rate limit)."""
        deadline = time.monotonic() + (timeout or self._timeout)
        while True:
            try:
                return self._call_once(method, request, deadline - time.monotonic())
            except KvcoordError as error:
                pause = retry_pause(error, deadline)
                if pause is None:
                    raise
                time.sleep(pause)

    def _call_once(self, method: str, request: Any, timeout: float) -> Any:
        """Each target once, from the last that answered, until one does; the last UNAVAILABLE
        when none does, any other refusal at once."""
        last: KvcoordError | None = None
        for stub in self._targets.rotation(self._stubs):
            try:
                return getattr(stub, method)(request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                error = KvcoordError.from_rpc(exc)
                if not another_target_may_serve(error):
                    raise error from None
                self._targets.failed()
                last = error
        assert last is not None
        raise last

    def lookup(
        self, tokens: Prompt, *, model: str | None = None, adapter: str | None = None,
        policy_version: int | None = None, cache_salt: str | None = None,
    ) -> LookupResult:
        """Where is this prompt's prefix cached? Reads the index; changes nothing.

        Args:
            tokens: the prompt's token ids (or packed ``token_bytes``), hashed by the server
                under ``model``/``adapter``, the caller's tenant and ``policy_version``
                (None: the version serving now).
            cache_salt: the engine's per-request salt the prompt is sent with (vLLM's
                ``cache_salt``): only blocks made with the same salt match.

        Returns:
            ``LookupResult``: ``matches`` maps each holding worker's id to its matched tokens.

        Raises:
            KvcoordError: INVALID_ARGUMENT for a bad prompt; UNAUTHENTICATED or
                PERMISSION_DENIED for the caller's token; UNAVAILABLE when no target serves.
        """
        return lookup_from(self._call("Lookup", lookup_request(tokens, model, adapter,
                                                               policy_version, cache_salt)))

    def route(
        self, tokens: Prompt, *, model: str | None = None, adapter: str | None = None,
        min_policy_version: int | None = None, policy_version: int | None = None,
        routing_policy: str = "", exclude_workers: Sequence[str] = (), report_end: bool = False,
        cache_salt: str | None = None,
    ) -> Route:
        """Where should this prompt go? Marks it pending on the chosen worker, so the next
        route of the same prefix sees it there before the worker confirms its pages.

        Args:
            tokens: the prompt's token ids (or packed ``token_bytes``).
            min_policy_version: only a worker serving at least this version may be chosen.
            policy_version: the version to hash and route under (None: the serving one).
            routing_policy: a chooser's name (``kv_aware``, ``round_robin``,
                ``least_loaded``); empty for the coordinator's default.
            exclude_workers: never chosen (a retry after a worker failed the request).
            report_end: you will call ``end_routes`` when the request ends, so its load is
                released at once rather than at the next heartbeat (``Route.end_awaited``).
            cache_salt: as for ``lookup``.

        Returns:
            ``Route``: the worker, its address and HTTP URL, the matched tokens, the version
            the prompt was hashed under, and the route id.

        Raises:
            KvcoordError: INVALID_ARGUMENT (a bad prompt, an unknown ``routing_policy``);
                UNAVAILABLE with reason ``NO_WORKER``, ``DRAINING`` (a sync update drains the
                fleet: retried here within the deadline, as its ``RetryInfo`` says),
                ``POLICY_STALE`` or ``STORE_UNAVAILABLE`` once every target refused;
                RESOURCE_EXHAUSTED with ``RATE_LIMITED`` past the caller's rate.
        """
        request = route_request(tokens, model, adapter, min_policy_version, policy_version,
                                routing_policy, exclude_workers, report_end, cache_salt)
        return route_from(self._call("Route", request))

    def route_batch(
        self, prompts: Sequence[Prompt], *, model: str | None = None, adapter: str | None = None,
        min_policy_version: int | None = None, policy_version: int | None = None,
        routing_policy: str = "", report_end: bool = False, cache_salt: str | None = None,
    ) -> RouteBatch:
        """Route many prompts in one call, with ``route``'s arguments and refusals.

        Identical prompts (a GRPO group) are routed as one group with their copies counted;
        the answer's ``order`` runs siblings sharing a prefix back to back, so the first one's
        pages are cached when the rest arrive.

        Raises:
            KvcoordError: as ``route``; INVALID_ARGUMENT also past the batch size limits.
        """
        request = batch_request(prompts, model, adapter, min_policy_version, policy_version,
                                routing_policy, report_end, cache_salt)
        return batch_from(self._call("RouteBatch", request))

    def end_routes(self, route_ids: Sequence[str]) -> EndedRoutes:
        """Report that these routes' requests ended (idempotent: an id ends once)."""
        return ended_from(self._call("EndRoutes", end_routes_request(route_ids)))

    def policy(self) -> PolicyState:
        """The policy (weights) version and phase as the store holds them now, with the
        workers that failed an update in progress."""
        return policy_from(self._call("GetPolicy", pb.GetPolicyRequest()))

    def begin_policy_update(
        self, expected_version: int, mode: str = "sync", weights_uri: str = "",
        abort_running: bool = False,
    ) -> PolicyState:
        """Start moving the fleet from ``expected_version`` to the next one.

        Args:
            expected_version: the version serving now (compare-and-set: a concurrent trainer
                that moved it first makes this call fail, never both succeed).
            mode: ``sync`` (drain, every worker loads and acks, then Commit serves it) or
                ``async`` (workers move one at a time within ``max_staleness``).
            weights_uri: what the workers load (or empty: the trainer pushes them).
            abort_running: the drain stops running generations instead of waiting for them.

        Returns:
            ``PolicyState``: the update's record (target version, phase DRAINING in sync mode).

        Raises:
            ValueError: a ``mode`` other than ``sync``/``async``, a negative version.
            KvcoordError: ABORTED when ``expected_version`` is not the serving one (or an
                update is already open); FAILED_PRECONDITION ``POLICY_RESTORED`` within one
                lease of the store's state being restored (its ``retry_after_ms`` is not
                waited out here: begin again after it); UNAVAILABLE with
                ``STORE_UNAVAILABLE`` when the store is down.
        """
        request = begin_request(expected_version, mode, weights_uri, abort_running)
        return policy_from(self._call("BeginPolicyUpdate", request))

    @contextlib.contextmanager
    def policy_update(
        self, expected_version: int, mode: str = "sync", weights_uri: str = "",
        timeout: float = 30.0,
    ) -> Iterator[PolicyUpdate]:
        """``with client.policy_update(v) as update:`` push weights for ``update.version``
        inside; commit on exit (``update.result`` then holds the committed state with acked and
        fenced workers), abort if the block raises (any ``BaseException``; a refused abort is
        ignored and the block's exception goes on). Raises as ``begin_policy_update`` on entry
        and ``commit_policy_update`` on exit."""
        state = self.begin_policy_update(expected_version, mode, weights_uri)
        update = PolicyUpdate(version=state.target_version or expected_version + 1, begun=state)
        try:
            yield update
        except BaseException:
            with contextlib.suppress(KvcoordError):
                self.abort_policy_update(update.version)
            raise
        update.result = self.commit_policy_update(update.version, timeout=timeout)

    def commit_policy_update(self, version: int, timeout: float = 30.0) -> PolicyState:
        """Serve ``version`` once every member of the update acknowledged it, waiting up to
        ``timeout`` seconds. Members that did not ack in time are fenced (``fenced_workers``;
        those that reported a failure are in ``failures`` with its reason); the others serve
        ``version``.

        Raises:
            KvcoordError: ABORTED when no update to ``version`` is open (a repeated commit
                included); FAILED_PRECONDITION when members failed and none applied it (the
                update is then aborted: nothing would serve ``version``); DEADLINE_EXCEEDED
                past ``timeout`` plus a margin. A commit retried after its answer was lost reads
                ABORTED: ``policy()`` tells whether it committed.
        """
        request = pb.CommitPolicyUpdateRequest(version=version, timeout_ms=int(timeout * 1000))
        # NOTE: the call's deadline outlasts the barrier wait, so the coordinator (which answers
        # 0.2 s before the deadline it is given) reports whom it fenced instead of timing out.
        return policy_from(self._call("CommitPolicyUpdate", request, timeout=timeout + 5))

    def abort_policy_update(self, version: int) -> PolicyState:
        """Abandon the open update to ``version``: the fleet resumes serving the version before
        it. ABORTED (a ``KvcoordError``) when no update to ``version`` is open."""
        request = pb.AbortPolicyUpdateRequest(version=version)
        return policy_from(self._call("AbortPolicyUpdate", request))

    def rollouts(self, since: str | None = None, follow: bool = False) -> Iterator[RolloutRecord]:
        """Rollout records after cursor ``since`` (oldest kept when None); ``follow`` keeps the
        stream open for new ones. Each record's ``cursor`` resumes after it (a failover
        does). KvcoordError INVALID_ARGUMENT for a malformed cursor; RESOURCE_EXHAUSTED
        ``STREAM_LIMIT`` when the caller holds its limit of open streams."""
        cursor = since or ""

        def request() -> pb.ReadRolloutsRequest:  # a failover resumes after the last record
            return pb.ReadRolloutsRequest(since=cursor, follow=follow)

        for record in self._stream("ReadRollouts", request):
            cursor = record.cursor
            yield rollout_from(record)

    def watch_policy(self) -> Iterator[PolicyState]:
        """The policy state now, then every change (a server stream, moved to another target
        when its coordinator goes away)."""
        last: PolicyState | None = None
        for message in self._stream("WatchPolicy", pb.WatchPolicyRequest):
            state = policy_from(message)
            if state != last:  # a new stream starts with the state we may have seen
                last = state
                yield state

    def _stream(self, method: str, request: Callable[[], Any]) -> Iterator[Any]:
        """A server stream that moves to the next target on a transport failure, asking
        ``request()`` again (so it can resume); gives up once every target failed in a row
        without a message."""
        failures = 0
        while True:
            stub = next(self._targets.rotation(self._stubs))
            try:
                for message in getattr(stub, method)(request(), metadata=self._metadata):
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

    def workers(self) -> list[WorkerInfo]:
        """The registered workers (a worker identity sees only its own entry)."""
        response = self._call("ListWorkers", pb.ListWorkersRequest())
        return [worker_from(w) for w in response.workers]

    def stats(self) -> Stats:
        """The answering replica's index and routing counters (trainer and admin roles)."""
        return stats_from(self._call("GetStats", pb.GetStatsRequest()))

    def cordon(self, worker_id: str, cordoned: bool = True) -> WorkerInfo:
        """Take ``worker_id`` out of routing (``cordoned=False``: put it back); returns its entry.
        KvcoordError NOT_FOUND for an unknown worker; PERMISSION_DENIED for a worker identity
        naming another worker, or uncordoning itself."""
        request = pb.CordonRequest(worker_id=worker_id, cordoned=cordoned)
        return worker_from(self._call("Cordon", request).worker)

    def deregister(self, worker_id: str) -> bool:
        """Remove ``worker_id``'s current incarnation (its pages leave the index at once);
        False when no such worker is registered. What a worker pod's preStop hook calls.
        Two calls (ListWorkers, then Deregister): a worker that registered again in between
        is refused FAILED_PRECONDITION ``REREGISTER`` and its new incarnation stays."""
        current = [w for w in self.workers() if w.worker_id == worker_id]
        if not current:
            return False
        request = pb.DeregisterRequest(worker_id=worker_id, incarnation=current[0].incarnation)
        self._call("Deregister", request)
        return True
