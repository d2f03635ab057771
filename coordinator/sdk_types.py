"""Values, errors, target lists, channels (TLS, tokens), request builders and response parsers
shared by both SDK clients and by the worker's own clients.

Builders validate on the client so a mistake fails fast with ``ValueError`` before a round trip.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from coordinator.hashing import tokens_to_bytes
from coordinator.v1 import coordinator_pb2 as pb

KEY_BYTES = 16
T = TypeVar("T")


class KvcoordError(Exception):
    """A call the coordinator (or the transport) refused. ``code`` is the ``grpc.StatusCode``."""

    def __init__(
        self, code: grpc.StatusCode, details: str, *, retry_after_ms: int | None = None
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_after_ms = retry_after_ms

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> KvcoordError:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
        retry_after: int | None = None
        trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
        for key, value in trailing or ():
            if key == "retry-after-ms":
                retry_after = int(value)
        return cls(code, details, retry_after_ms=retry_after)


RETRYABLE_WITH_HINT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""Codes a server may send with ``retry-after-ms``: an update draining the fleet, no worker yet,
the metadata store down (UNAVAILABLE); the caller over its rate limit (RESOURCE_EXHAUSTED)."""


def retry_pause(error: KvcoordError, deadline: float) -> float | None:
    """Seconds to wait before retrying a call the server asked to retry (a code of
    ``RETRYABLE_WITH_HINT`` with ``retry-after-ms``), or None when it must not be retried or
    the deadline would pass."""
    if error.code not in RETRYABLE_WITH_HINT or error.retry_after_ms is None:
        return None
    pause = error.retry_after_ms / 1000
    if time.monotonic() + pause >= deadline:
        return None
    return pause


def is_transport_failure(error: KvcoordError) -> bool:
    """UNAVAILABLE raised by the transport (worth another target), not by the coordinator
    (which always says when to retry)."""
    return error.code == grpc.StatusCode.UNAVAILABLE and error.retry_after_ms is None


def another_target_may_serve(error: KvcoordError) -> bool:
    """UNAVAILABLE, from the transport or from the coordinator: this replica cannot serve the
    call now (unreachable; its policy state older than ``policy_stale_ms``, its store down, no
    routable worker, the fleet draining), and another replica may. A unary call tries the next
    target at once rather than waiting out ``retry-after-ms`` on this one."""
    return bool(error.code == grpc.StatusCode.UNAVAILABLE)


class Targets(Sequence[str]):
    """TARGETS: ``host:port``, a comma-separated list, or one gRPC name (``dns:///...``)."""

    def __init__(self, targets: list[str]) -> None:
        self._targets = targets
        self._current = 0

    @classmethod
    def parse(cls, spec: str) -> Targets:
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if not parts:
            raise ValueError("no coordinator target given (expected HOST:PORT[,HOST:PORT...])")
        for part in parts:
            if "://" not in part and ":" not in part:
                raise ValueError(f"coordinator target {part!r} is not HOST:PORT")
        return cls(parts)

    def __getitem__(self, i: Any) -> Any:
        return self._targets[i]

    def __len__(self) -> int:
        return len(self._targets)

    def rotation(self, items: Sequence[T]) -> Iterator[T]:
        """Each item once, starting at the target that last worked."""
        start = self._current
        for offset in range(len(items)):
            self._current = (start + offset) % len(items)
            yield items[self._current]

    def failed(self) -> None:
        """The current target failed; the next call starts at the one after it."""
        self._current = (self._current + 1) % len(self._targets)


def client_channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """``channel_options`` plus what a failover client needs: its own subchannels (grpc shares
    connections between channels to one address, and with them the reconnect backoff a channel
    to a dead coordinator built up: a new client could not reach the restarted one for up to
    two minutes) and a reconnect backoff capped at 1 s."""
    return [
        *channel_options(max_message_bytes),
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Message-size limits shared by servers and clients (grpc answers RESOURCE_EXHAUSTED)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata of a call made with bearer ``token`` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


# ---------------------------------------------------------------- channels: TLS and tokens

_PEM_MARKER = b"-----BEGIN"


@dataclass(frozen=True, slots=True)
class ClientTls:
    """TLS for a client channel: the CA bundle that verifies the server, and optionally this
    client's certificate chain and key (mutual TLS). ``server_name`` overrides the name the
    server's certificate is checked against (``grpc.ssl_target_name_override``), for a target
    dialled by an address its certificate does not name.

    ValueError for a certificate without its key (or the reverse) or input that is not PEM.
    """

    ca_pem: bytes = field(repr=False)
    cert_pem: bytes | None = field(default=None, repr=False)
    key_pem: bytes | None = field(default=None, repr=False)  # never log a private key
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_pem is None) != (self.key_pem is None):
            raise ValueError("a client certificate needs its key and a key its certificate: "
                             "give both or neither")
        for name in ("ca_pem", "cert_pem", "key_pem"):
            value = getattr(self, name)
            if value is not None and _PEM_MARKER not in value:
                raise ValueError(f"{name} is not PEM (no '-----BEGIN' line)")
        if self.server_name is not None and not self.server_name.strip():
            raise ValueError("server_name must not be blank")

    @classmethod
    def from_files(
        cls, ca: str, cert: str | None = None, key: str | None = None,
        server_name: str | None = None,
    ) -> ClientTls:
        """Read the PEM files; ValueError naming the file when one is missing, unreadable or
        not PEM, or when only one of ``cert`` and ``key`` is given."""
        if (cert is None) != (key is None):
            raise ValueError(f"a client certificate needs its key and a key its certificate: "
                             f"give both or neither (got cert={cert!r}, key={key!r})")
        return cls(
            ca_pem=_read_pem(ca, "CA bundle"),
            cert_pem=None if cert is None else _read_pem(cert, "client certificate"),
            key_pem=None if key is None else _read_pem(key, "client key"),
            server_name=server_name,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials: verify the server with ``ca_pem``, present the certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem,
            certificate_chain=self.cert_pem,
        )

    def options(self) -> list[tuple[str, str]]:
        """Channel options TLS adds (the server name override, when set)."""
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def open_channel(
    target: str, options: Sequence[tuple[str, Any]], tls: ClientTls | None
) -> grpc.Channel:
    """A blocking channel to ``target``: plaintext when ``tls`` is None, else TLS with it."""
    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, tls.credentials(), options=[*options, *tls.options()])


def open_aio_channel(
    target: str, options: Sequence[tuple[str, Any]], tls: ClientTls | None, *,
    token: str | None = None,
) -> grpc.aio.Channel:
    """``open_channel`` for asyncio. With ``token``, every call on the channel carries it as
    ``authorization: Bearer`` metadata, including calls made through stubs by code that never
    sees the token (the worker agent's rollout reporter): an interceptor adds it, so callers
    must not add it again."""
    interceptors = _bearer_interceptors(token) if token else None
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options),
                                         interceptors=interceptors)
    return grpc.aio.secure_channel(target, tls.credentials(),
                                   options=[*options, *tls.options()],
                                   interceptors=interceptors)


def read_token_file(path: str) -> str:
    """The bearer token in ``path``, surrounding whitespace stripped (re-read on each call, so
    a rotated file is picked up by the next channel). ValueError naming the file when it is
    missing, unreadable, empty, or holds whitespace inside the token (two tokens, a stray
    line), which the server would never accept."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"token file {path}: cannot read it ({reason})") from None
    if not token:
        raise ValueError(f"token file {path} is empty")
    if any(c.isspace() for c in token):
        raise ValueError(f"token file {path} holds more than one token (whitespace or a "
                         "newline inside); it must hold exactly one")
    return token  # never echoed: errors name the file, not its content


def _read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    if _PEM_MARKER not in data:
        raise ValueError(f"{what} {path} is not PEM (no '-----BEGIN' line)")
    return data


class _Bearer:
    """Adds ``authorization: Bearer`` to a call's metadata. grpc.aio files each interceptor
    under one call kind only, hence one subclass per kind below."""

    def __init__(self, token: str) -> None:
        self._pair = call_metadata(token)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()),
                                                           *self._pair))


class _BearerUnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _BearerUnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _BearerStreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(details), request_iterator)


class _BearerStreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(details), request_iterator)


def _bearer_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    return [kind(token) for kind in (_BearerUnaryUnary, _BearerUnaryStream, _BearerStreamUnary,
                                     _BearerStreamStream)]


@dataclass(frozen=True, slots=True)
class PageKeys:
    """A prompt sent as page keys (trusted roles): concatenated 16-byte digests."""

    keys: bytes
    token_count: int | None = None

    def __post_init__(self) -> None:
        if not self.keys or len(self.keys) % KEY_BYTES:
            raise ValueError(
                f"page keys must be a non-empty multiple of {KEY_BYTES} bytes, "
                f"got {len(self.keys)}"
            )


@dataclass(frozen=True, slots=True)
class LookupResult:
    matches: dict[str, int]  # worker id -> matched tokens
    policy_version: int
    prompt_pages: int = 0


@dataclass(frozen=True, slots=True)
class Route:
    worker_id: str
    address: str
    matched_tokens: int
    policy_version: int
    matched_pages: int = 0
    routing_policy: str = ""


@dataclass(frozen=True, slots=True)
class RouteBatch:
    routes: list[Route]
    order: list[int]


@dataclass(frozen=True, slots=True)
class PolicyState:
    version: int
    phase: str  # "serving" | "draining"
    target_version: int | None = None
    mode: str = "sync"
    acked_workers: tuple[str, ...] = ()
    fenced_workers: tuple[str, ...] = ()


@dataclass(slots=True)
class PolicyUpdate:
    """An update in progress (``policy_update``): push weights for ``version``; after the
    block, ``result`` is the committed state (its acked and fenced workers)."""

    version: int
    begun: PolicyState
    result: PolicyState | None = None


@dataclass(frozen=True, slots=True)
class RolloutRecord:
    """Which policy version generated a sample, on which worker (invariant 4)."""

    rollout_id: str
    policy_version: int
    worker_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cursor: str


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str
    address: str
    policy_version: int
    state: str
    incarnation: int = 0
    external: bool = False
    cached_pages: int = 0
    total_pages: int = 0
    free_pages: int = 0
    running_requests: int = 0
    queued_tokens: int = 0
    inflight_routes: int = 0
    routed_requests: int = 0
    routed_tokens: int = 0
    routed_cached_tokens: int = 0
    owner_replica: str = ""

    @property
    def hit_ratio(self) -> float:
        return self.routed_cached_tokens / self.routed_tokens if self.routed_tokens else 0.0


@dataclass(frozen=True, slots=True)
class Stats:
    workers: int
    routable_workers: int
    index_keys: int
    index_entries: int
    pending_entries: int
    lookups: int
    routes: int
    prompt_tokens: int
    cached_tokens: int
    hit_ratio: float
    events_applied: int
    resyncs: int
    policy_version: int
    policy_phase: str
    store: str
    replica_id: str = ""
    replicas: tuple[str, ...] = ()
    replication_published: int = 0
    replication_applied: int = 0
    replication_lag_p50_ms: float = 0.0
    replication_lag_p99_ms: float = 0.0


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


def scope_pb(model: str | None, adapter: str | None, version: int | None) -> pb.Scope:
    scope = pb.Scope(model=model or "", adapter=adapter or "")
    if version is not None:
        scope.policy_version = version
    return scope


def lookup_request(
    tokens: Sequence[int] | PageKeys, model: str | None, adapter: str | None, version: int | None
) -> pb.LookupRequest:
    return pb.LookupRequest(prompt=prompt_pb(tokens), scope=scope_pb(model, adapter, version))


def route_request(
    tokens: Sequence[int] | PageKeys, model: str | None, adapter: str | None,
    min_version: int | None, version: int | None, routing_policy: str,
) -> pb.RouteRequest:
    request = pb.RouteRequest(
        prompt=prompt_pb(tokens), scope=scope_pb(model, adapter, version),
        routing_policy=routing_policy,
    )
    if min_version is not None:
        request.min_policy_version = min_version
    return request


def batch_request(
    prompts: Sequence[Sequence[int] | PageKeys], model: str | None, adapter: str | None,
    min_version: int | None, version: int | None, routing_policy: str,
) -> pb.RouteBatchRequest:
    if not prompts:
        raise ValueError("route_batch needs at least one prompt")
    request = pb.RouteBatchRequest(
        prompts=[prompt_pb(p) for p in prompts], scope=scope_pb(model, adapter, version),
        routing_policy=routing_policy,
    )
    if min_version is not None:
        request.min_policy_version = min_version
    return request


# ---------------------------------------------------------------- responses

_PHASES = {pb.POLICY_PHASE_SERVING: "serving", pb.POLICY_PHASE_DRAINING: "draining"}
_STATES = {
    pb.WORKER_STATE_READY: "ready", pb.WORKER_STATE_DRAINING: "draining",
    pb.WORKER_STATE_FENCED: "fenced", pb.WORKER_STATE_CORDONED: "cordoned",
    pb.WORKER_STATE_DISCONNECTED: "disconnected",
}


def lookup_from(response: pb.LookupResponse) -> LookupResult:
    matches = {m.worker_id: m.matched_tokens for m in response.matches}
    return LookupResult(matches, response.policy_version, response.prompt_pages)


def route_from(response: pb.RouteResponse) -> Route:
    return Route(
        response.worker_id, response.address, response.matched_tokens, response.policy_version,
        response.matched_pages, response.routing_policy,
    )


def batch_from(response: pb.RouteBatchResponse) -> RouteBatch:
    return RouteBatch([route_from(r) for r in response.routes], list(response.order))


def policy_from(state: pb.PolicyState) -> PolicyState:
    return PolicyState(
        version=state.version,
        phase=_PHASES.get(state.phase, "unspecified"),
        target_version=state.target_version if state.HasField("target_version") else None,
        mode="async" if state.mode == pb.POLICY_MODE_ASYNC else "sync",
        acked_workers=tuple(state.acked_workers),
        fenced_workers=tuple(state.fenced_workers),
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
