from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_CPU: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_FENCED: _ClassVar[WorkerState]
    WORKER_STATE_CORDONED: _ClassVar[WorkerState]
    WORKER_STATE_DISCONNECTED: _ClassVar[WorkerState]

class PolicyPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_PHASE_UNSPECIFIED: _ClassVar[PolicyPhase]
    POLICY_PHASE_SERVING: _ClassVar[PolicyPhase]
    POLICY_PHASE_DRAINING: _ClassVar[PolicyPhase]

class PolicyMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_MODE_UNSPECIFIED: _ClassVar[PolicyMode]
    POLICY_MODE_SYNC: _ClassVar[PolicyMode]
    POLICY_MODE_ASYNC: _ClassVar[PolicyMode]
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_CPU: Tier
TIER_DISK: Tier
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_FENCED: WorkerState
WORKER_STATE_CORDONED: WorkerState
WORKER_STATE_DISCONNECTED: WorkerState
POLICY_PHASE_UNSPECIFIED: PolicyPhase
POLICY_PHASE_SERVING: PolicyPhase
POLICY_PHASE_DRAINING: PolicyPhase
POLICY_MODE_UNSPECIFIED: PolicyMode
POLICY_MODE_SYNC: PolicyMode
POLICY_MODE_ASYNC: PolicyMode

class Prompt(_message.Message):
    __slots__ = ("token_ids", "page_keys", "token_count", "token_bytes")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    page_keys: bytes
    token_count: int
    token_bytes: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., page_keys: _Optional[bytes] = ..., token_count: _Optional[int] = ..., token_bytes: _Optional[bytes] = ...) -> None: ...

class Scope(_message.Message):
    __slots__ = ("model", "adapter", "policy_version", "cache_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    adapter: str
    policy_version: int
    cache_salt: str
    def __init__(self, model: _Optional[str] = ..., adapter: _Optional[str] = ..., policy_version: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("protocol_version", "prompt", "scope")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    prompt: Prompt
    scope: Scope
    def __init__(self, protocol_version: _Optional[int] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., scope: _Optional[_Union[Scope, _Mapping]] = ...) -> None: ...

class WorkerMatch(_message.Message):
    __slots__ = ("worker_id", "matched_pages", "matched_tokens", "gpu_tokens", "cpu_tokens", "disk_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GPU_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CPU_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    matched_pages: int
    matched_tokens: int
    gpu_tokens: int
    cpu_tokens: int
    disk_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., matched_pages: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., gpu_tokens: _Optional[int] = ..., cpu_tokens: _Optional[int] = ..., disk_tokens: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("protocol_version", "matches", "policy_version", "prompt_pages")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    matches: _containers.RepeatedCompositeFieldContainer[WorkerMatch]
    policy_version: int
    prompt_pages: int
    def __init__(self, protocol_version: _Optional[int] = ..., matches: _Optional[_Iterable[_Union[WorkerMatch, _Mapping]]] = ..., policy_version: _Optional[int] = ..., prompt_pages: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("protocol_version", "prompt", "scope", "min_policy_version", "routing_policy", "exclude_workers", "report_end")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTING_POLICY_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    REPORT_END_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    prompt: Prompt
    scope: Scope
    min_policy_version: int
    routing_policy: str
    exclude_workers: _containers.RepeatedScalarFieldContainer[str]
    report_end: bool
    def __init__(self, protocol_version: _Optional[int] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., scope: _Optional[_Union[Scope, _Mapping]] = ..., min_policy_version: _Optional[int] = ..., routing_policy: _Optional[str] = ..., exclude_workers: _Optional[_Iterable[str]] = ..., report_end: _Optional[bool] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("protocol_version", "worker_id", "address", "matched_pages", "matched_tokens", "policy_version", "prompt_pages", "routing_policy", "http_url", "route_id", "end_awaited")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    ROUTING_POLICY_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    ROUTE_ID_FIELD_NUMBER: _ClassVar[int]
    END_AWAITED_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    worker_id: str
    address: str
    matched_pages: int
    matched_tokens: int
    policy_version: int
    prompt_pages: int
    routing_policy: str
    http_url: str
    route_id: str
    end_awaited: bool
    def __init__(self, protocol_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., address: _Optional[str] = ..., matched_pages: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., policy_version: _Optional[int] = ..., prompt_pages: _Optional[int] = ..., routing_policy: _Optional[str] = ..., http_url: _Optional[str] = ..., route_id: _Optional[str] = ..., end_awaited: _Optional[bool] = ...) -> None: ...

class RouteBatchRequest(_message.Message):
    __slots__ = ("protocol_version", "prompts", "scope", "min_policy_version", "routing_policy", "report_end")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTING_POLICY_FIELD_NUMBER: _ClassVar[int]
    REPORT_END_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    scope: Scope
    min_policy_version: int
    routing_policy: str
    report_end: bool
    def __init__(self, protocol_version: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., scope: _Optional[_Union[Scope, _Mapping]] = ..., min_policy_version: _Optional[int] = ..., routing_policy: _Optional[str] = ..., report_end: _Optional[bool] = ...) -> None: ...

class RouteBatchResponse(_message.Message):
    __slots__ = ("protocol_version", "routes", "order")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    routes: _containers.RepeatedCompositeFieldContainer[RouteResponse]
    order: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, protocol_version: _Optional[int] = ..., routes: _Optional[_Iterable[_Union[RouteResponse, _Mapping]]] = ..., order: _Optional[_Iterable[int]] = ...) -> None: ...

class EndRoutesRequest(_message.Message):
    __slots__ = ("protocol_version", "route_ids")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTE_IDS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    route_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., route_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EndRoutesResponse(_message.Message):
    __slots__ = ("protocol_version", "ended", "unknown")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    ended: int
    unknown: int
    def __init__(self, protocol_version: _Optional[int] = ..., ended: _Optional[int] = ..., unknown: _Optional[int] = ...) -> None: ...

class ShardShortlistRequest(_message.Message):
    __slots__ = ("protocol_version", "route", "copies", "after_worker")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    AFTER_WORKER_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    route: RouteRequest
    copies: int
    after_worker: str
    def __init__(self, protocol_version: _Optional[int] = ..., route: _Optional[_Union[RouteRequest, _Mapping]] = ..., copies: _Optional[int] = ..., after_worker: _Optional[str] = ...) -> None: ...

class ShardCandidate(_message.Message):
    __slots__ = ("worker_id", "cached_pages", "own_cost")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    OWN_COST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    cached_pages: int
    own_cost: float
    def __init__(self, worker_id: _Optional[str] = ..., cached_pages: _Optional[int] = ..., own_cost: _Optional[float] = ...) -> None: ...

class ShardShortlistResponse(_message.Message):
    __slots__ = ("protocol_version", "rank", "tied", "best_cached_pages")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIED_FIELD_NUMBER: _ClassVar[int]
    BEST_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    rank: _containers.RepeatedScalarFieldContainer[float]
    tied: _containers.RepeatedCompositeFieldContainer[ShardCandidate]
    best_cached_pages: int
    def __init__(self, protocol_version: _Optional[int] = ..., rank: _Optional[_Iterable[float]] = ..., tied: _Optional[_Iterable[_Union[ShardCandidate, _Mapping]]] = ..., best_cached_pages: _Optional[int] = ...) -> None: ...

class ShardReserveRequest(_message.Message):
    __slots__ = ("protocol_version", "route", "copies", "worker_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    route: RouteRequest
    copies: int
    worker_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., route: _Optional[_Union[RouteRequest, _Mapping]] = ..., copies: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class HashConfig(_message.Message):
    __slots__ = ("algorithm", "page_size", "fingerprint")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    algorithm: str
    page_size: int
    fingerprint: bytes
    def __init__(self, algorithm: _Optional[str] = ..., page_size: _Optional[int] = ..., fingerprint: _Optional[bytes] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("protocol_version", "worker_id", "address", "hash_config", "total_pages", "policy_version", "external", "model", "http_url", "host_pages")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HASH_CONFIG_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    worker_id: str
    address: str
    hash_config: HashConfig
    total_pages: int
    policy_version: int
    external: bool
    model: str
    http_url: str
    host_pages: int
    def __init__(self, protocol_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., address: _Optional[str] = ..., hash_config: _Optional[_Union[HashConfig, _Mapping]] = ..., total_pages: _Optional[int] = ..., policy_version: _Optional[int] = ..., external: _Optional[bool] = ..., model: _Optional[str] = ..., http_url: _Optional[str] = ..., host_pages: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("protocol_version", "incarnation", "policy_version", "policy_phase", "lease_ms", "heartbeat_ms", "max_events_per_batch", "max_message_bytes", "weights_uri", "sync_port")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_PHASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_URI_FIELD_NUMBER: _ClassVar[int]
    SYNC_PORT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    incarnation: int
    policy_version: int
    policy_phase: PolicyPhase
    lease_ms: int
    heartbeat_ms: int
    max_events_per_batch: int
    max_message_bytes: int
    weights_uri: str
    sync_port: int
    def __init__(self, protocol_version: _Optional[int] = ..., incarnation: _Optional[int] = ..., policy_version: _Optional[int] = ..., policy_phase: _Optional[_Union[PolicyPhase, str]] = ..., lease_ms: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ..., max_events_per_batch: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., weights_uri: _Optional[str] = ..., sync_port: _Optional[int] = ...) -> None: ...

class SyncRequest(_message.Message):
    __slots__ = ("protocol_version", "hello", "events", "heartbeat", "policy_ack", "inventory")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    POLICY_ACK_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    hello: SyncHello
    events: EventBatch
    heartbeat: Heartbeat
    policy_ack: PolicyAck
    inventory: InventoryChunk
    def __init__(self, protocol_version: _Optional[int] = ..., hello: _Optional[_Union[SyncHello, _Mapping]] = ..., events: _Optional[_Union[EventBatch, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., policy_ack: _Optional[_Union[PolicyAck, _Mapping]] = ..., inventory: _Optional[_Union[InventoryChunk, _Mapping]] = ...) -> None: ...

class SyncHello(_message.Message):
    __slots__ = ("worker_id", "incarnation", "last_acked_seq")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAST_ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    last_acked_seq: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., last_acked_seq: _Optional[int] = ...) -> None: ...

class PageEvent(_message.Message):
    __slots__ = ("kind", "page_keys", "tier")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[PageEvent.Kind]
        KIND_STORED: _ClassVar[PageEvent.Kind]
        KIND_REMOVED: _ClassVar[PageEvent.Kind]
        KIND_CLEARED: _ClassVar[PageEvent.Kind]
    KIND_UNSPECIFIED: PageEvent.Kind
    KIND_STORED: PageEvent.Kind
    KIND_REMOVED: PageEvent.Kind
    KIND_CLEARED: PageEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAGE_KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    kind: PageEvent.Kind
    page_keys: bytes
    tier: Tier
    def __init__(self, kind: _Optional[_Union[PageEvent.Kind, str]] = ..., page_keys: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("seq", "events")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[PageEvent]
    def __init__(self, seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[PageEvent, _Mapping]]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("running_requests", "queued_tokens", "free_pages", "total_pages", "completed_routes", "policy_version")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_ROUTES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    queued_tokens: int
    free_pages: int
    total_pages: int
    completed_routes: int
    policy_version: int
    def __init__(self, running_requests: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., completed_routes: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class PolicyAck(_message.Message):
    __slots__ = ("stage", "version", "reason")
    class Stage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STAGE_UNSPECIFIED: _ClassVar[PolicyAck.Stage]
        STAGE_DRAINED: _ClassVar[PolicyAck.Stage]
        STAGE_APPLIED: _ClassVar[PolicyAck.Stage]
        STAGE_FAILED: _ClassVar[PolicyAck.Stage]
    STAGE_UNSPECIFIED: PolicyAck.Stage
    STAGE_DRAINED: PolicyAck.Stage
    STAGE_APPLIED: PolicyAck.Stage
    STAGE_FAILED: PolicyAck.Stage
    STAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stage: PolicyAck.Stage
    version: int
    reason: str
    def __init__(self, stage: _Optional[_Union[PolicyAck.Stage, str]] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class InventoryChunk(_message.Message):
    __slots__ = ("resync_id", "page_keys", "tier", "last", "seq")
    RESYNC_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    resync_id: int
    page_keys: bytes
    tier: Tier
    last: bool
    seq: int
    def __init__(self, resync_id: _Optional[int] = ..., page_keys: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., last: _Optional[bool] = ..., seq: _Optional[int] = ...) -> None: ...

class SyncResponse(_message.Message):
    __slots__ = ("protocol_version", "ack", "resync", "command", "welcome")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    ack: EventAck
    resync: ResyncRequest
    command: PolicyCommand
    welcome: SyncWelcome
    def __init__(self, protocol_version: _Optional[int] = ..., ack: _Optional[_Union[EventAck, _Mapping]] = ..., resync: _Optional[_Union[ResyncRequest, _Mapping]] = ..., command: _Optional[_Union[PolicyCommand, _Mapping]] = ..., welcome: _Optional[_Union[SyncWelcome, _Mapping]] = ...) -> None: ...

class SyncWelcome(_message.Message):
    __slots__ = ("next_seq",)
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    next_seq: int
    def __init__(self, next_seq: _Optional[int] = ...) -> None: ...

class EventAck(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class ResyncRequest(_message.Message):
    __slots__ = ("resync_id", "reason")
    RESYNC_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    resync_id: int
    reason: str
    def __init__(self, resync_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class PolicyCommand(_message.Message):
    __slots__ = ("kind", "version", "weights_uri", "abort_running")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[PolicyCommand.Kind]
        KIND_DRAIN: _ClassVar[PolicyCommand.Kind]
        KIND_APPLY: _ClassVar[PolicyCommand.Kind]
        KIND_RESUME: _ClassVar[PolicyCommand.Kind]
    KIND_UNSPECIFIED: PolicyCommand.Kind
    KIND_DRAIN: PolicyCommand.Kind
    KIND_APPLY: PolicyCommand.Kind
    KIND_RESUME: PolicyCommand.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_URI_FIELD_NUMBER: _ClassVar[int]
    ABORT_RUNNING_FIELD_NUMBER: _ClassVar[int]
    kind: PolicyCommand.Kind
    version: int
    weights_uri: str
    abort_running: bool
    def __init__(self, kind: _Optional[_Union[PolicyCommand.Kind, str]] = ..., version: _Optional[int] = ..., weights_uri: _Optional[str] = ..., abort_running: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("protocol_version", "worker_id", "incarnation")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    worker_id: str
    incarnation: int
    def __init__(self, protocol_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class PolicyState(_message.Message):
    __slots__ = ("protocol_version", "version", "phase", "target_version", "mode", "acked_workers", "fenced_workers", "epoch", "failures", "weights_uri")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ACKED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    FENCED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_URI_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    version: int
    phase: PolicyPhase
    target_version: int
    mode: PolicyMode
    acked_workers: _containers.RepeatedScalarFieldContainer[str]
    fenced_workers: _containers.RepeatedScalarFieldContainer[str]
    epoch: int
    failures: _containers.RepeatedCompositeFieldContainer[PolicyFailure]
    weights_uri: str
    def __init__(self, protocol_version: _Optional[int] = ..., version: _Optional[int] = ..., phase: _Optional[_Union[PolicyPhase, str]] = ..., target_version: _Optional[int] = ..., mode: _Optional[_Union[PolicyMode, str]] = ..., acked_workers: _Optional[_Iterable[str]] = ..., fenced_workers: _Optional[_Iterable[str]] = ..., epoch: _Optional[int] = ..., failures: _Optional[_Iterable[_Union[PolicyFailure, _Mapping]]] = ..., weights_uri: _Optional[str] = ...) -> None: ...

class PolicyFailure(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class BeginPolicyUpdateRequest(_message.Message):
    __slots__ = ("protocol_version", "expected_version", "mode", "weights_uri", "abort_running")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_URI_FIELD_NUMBER: _ClassVar[int]
    ABORT_RUNNING_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    expected_version: int
    mode: PolicyMode
    weights_uri: str
    abort_running: bool
    def __init__(self, protocol_version: _Optional[int] = ..., expected_version: _Optional[int] = ..., mode: _Optional[_Union[PolicyMode, str]] = ..., weights_uri: _Optional[str] = ..., abort_running: _Optional[bool] = ...) -> None: ...

class CommitPolicyUpdateRequest(_message.Message):
    __slots__ = ("protocol_version", "version", "timeout_ms")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    version: int
    timeout_ms: int
    def __init__(self, protocol_version: _Optional[int] = ..., version: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class AbortPolicyUpdateRequest(_message.Message):
    __slots__ = ("protocol_version", "version")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    version: int
    def __init__(self, protocol_version: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class WatchPolicyRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class RolloutRecord(_message.Message):
    __slots__ = ("protocol_version", "rollout_id", "policy_version", "worker_id", "prompt_tokens", "cached_tokens", "completion_tokens", "cursor")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    rollout_id: str
    policy_version: int
    worker_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cursor: str
    def __init__(self, protocol_version: _Optional[int] = ..., rollout_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cursor: _Optional[str] = ...) -> None: ...

class ReportRolloutsRequest(_message.Message):
    __slots__ = ("protocol_version", "records")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    records: _containers.RepeatedCompositeFieldContainer[RolloutRecord]
    def __init__(self, protocol_version: _Optional[int] = ..., records: _Optional[_Iterable[_Union[RolloutRecord, _Mapping]]] = ...) -> None: ...

class ReportRolloutsResponse(_message.Message):
    __slots__ = ("protocol_version", "accepted")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    accepted: int
    def __init__(self, protocol_version: _Optional[int] = ..., accepted: _Optional[int] = ...) -> None: ...

class ReadRolloutsRequest(_message.Message):
    __slots__ = ("protocol_version", "since", "follow")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    since: str
    follow: bool
    def __init__(self, protocol_version: _Optional[int] = ..., since: _Optional[str] = ..., follow: _Optional[bool] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "incarnation", "policy_version", "state", "external", "cached_pages", "total_pages", "free_pages", "running_requests", "queued_tokens", "inflight_routes", "routed_requests", "routed_tokens", "routed_cached_tokens", "owner_replica", "http_url", "host_pages", "cached_gpu_pages", "cached_cpu_pages", "cached_disk_pages", "prefill_backlog_tokens", "prefill_tokens_per_s", "prefill_route_seconds", "prefill_attention_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_ROUTES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OWNER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_GPU_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_CPU_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_DISK_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BACKLOG_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ROUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ATTENTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    incarnation: int
    policy_version: int
    state: WorkerState
    external: bool
    cached_pages: int
    total_pages: int
    free_pages: int
    running_requests: int
    queued_tokens: int
    inflight_routes: int
    routed_requests: int
    routed_tokens: int
    routed_cached_tokens: int
    owner_replica: str
    http_url: str
    host_pages: int
    cached_gpu_pages: int
    cached_cpu_pages: int
    cached_disk_pages: int
    prefill_backlog_tokens: float
    prefill_tokens_per_s: float
    prefill_route_seconds: float
    prefill_attention_tokens: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ..., policy_version: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., external: _Optional[bool] = ..., cached_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., running_requests: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., inflight_routes: _Optional[int] = ..., routed_requests: _Optional[int] = ..., routed_tokens: _Optional[int] = ..., routed_cached_tokens: _Optional[int] = ..., owner_replica: _Optional[str] = ..., http_url: _Optional[str] = ..., host_pages: _Optional[int] = ..., cached_gpu_pages: _Optional[int] = ..., cached_cpu_pages: _Optional[int] = ..., cached_disk_pages: _Optional[int] = ..., prefill_backlog_tokens: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., prefill_route_seconds: _Optional[float] = ..., prefill_attention_tokens: _Optional[float] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("protocol_version", "workers")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, protocol_version: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("protocol_version", "index_digest")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_DIGEST_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    index_digest: bool
    def __init__(self, protocol_version: _Optional[int] = ..., index_digest: _Optional[bool] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("protocol_version", "workers", "routable_workers", "index_keys", "index_entries", "pending_entries", "lookups", "routes", "prompt_tokens", "cached_tokens", "hit_ratio", "events_applied", "resyncs", "policy_version", "policy_phase", "store", "replica_id", "replicas", "replication_published", "replication_applied", "replication_lag_p50_ms", "replication_lag_p99_ms", "index_digest")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    INDEX_KEYS_FIELD_NUMBER: _ClassVar[int]
    INDEX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PENDING_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_PHASE_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_APPLIED_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_LAG_P50_MS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_LAG_P99_MS_FIELD_NUMBER: _ClassVar[int]
    INDEX_DIGEST_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
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
    policy_phase: PolicyPhase
    store: str
    replica_id: str
    replicas: _containers.RepeatedScalarFieldContainer[str]
    replication_published: int
    replication_applied: int
    replication_lag_p50_ms: float
    replication_lag_p99_ms: float
    index_digest: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., workers: _Optional[int] = ..., routable_workers: _Optional[int] = ..., index_keys: _Optional[int] = ..., index_entries: _Optional[int] = ..., pending_entries: _Optional[int] = ..., lookups: _Optional[int] = ..., routes: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., hit_ratio: _Optional[float] = ..., events_applied: _Optional[int] = ..., resyncs: _Optional[int] = ..., policy_version: _Optional[int] = ..., policy_phase: _Optional[_Union[PolicyPhase, str]] = ..., store: _Optional[str] = ..., replica_id: _Optional[str] = ..., replicas: _Optional[_Iterable[str]] = ..., replication_published: _Optional[int] = ..., replication_applied: _Optional[int] = ..., replication_lag_p50_ms: _Optional[float] = ..., replication_lag_p99_ms: _Optional[float] = ..., index_digest: _Optional[bytes] = ...) -> None: ...

class CordonRequest(_message.Message):
    __slots__ = ("protocol_version", "worker_id", "cordoned")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    worker_id: str
    cordoned: bool
    def __init__(self, protocol_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., cordoned: _Optional[bool] = ...) -> None: ...

class CordonResponse(_message.Message):
    __slots__ = ("protocol_version", "worker")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    worker: WorkerInfo
    def __init__(self, protocol_version: _Optional[int] = ..., worker: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...
