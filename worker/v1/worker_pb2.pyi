from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("protocol_version", "token_ids", "token_bytes", "max_new_tokens", "rollout_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_bytes: bytes
    max_new_tokens: int
    rollout_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., token_bytes: _Optional[bytes] = ..., max_new_tokens: _Optional[int] = ..., rollout_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("protocol_version", "tokens", "policy_version", "cached_tokens", "computed_tokens", "rollout_id", "host_cached_tokens")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    policy_version: int
    cached_tokens: int
    computed_tokens: int
    rollout_id: str
    host_cached_tokens: int
    def __init__(self, protocol_version: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., policy_version: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., rollout_id: _Optional[str] = ..., host_cached_tokens: _Optional[int] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("protocol_version", "version", "path")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    version: int
    path: str
    def __init__(self, protocol_version: _Optional[int] = ..., version: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("protocol_version", "policy_version", "freed_pages")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FREED_PAGES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    policy_version: int
    freed_pages: int
    def __init__(self, protocol_version: _Optional[int] = ..., policy_version: _Optional[int] = ..., freed_pages: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("protocol_version", "worker_id", "policy_version", "total_pages", "free_pages", "cached_pages", "running_requests", "queued_tokens", "generated_requests", "generated_tokens", "cached_prompt_tokens", "computed_prompt_tokens", "page_size", "model", "device", "incarnation", "synced", "host_total_pages", "host_free_pages", "host_cached_pages", "host_cached_prompt_tokens")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    HOST_TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    worker_id: str
    policy_version: int
    total_pages: int
    free_pages: int
    cached_pages: int
    running_requests: int
    queued_tokens: int
    generated_requests: int
    generated_tokens: int
    cached_prompt_tokens: int
    computed_prompt_tokens: int
    page_size: int
    model: str
    device: str
    incarnation: int
    synced: bool
    host_total_pages: int
    host_free_pages: int
    host_cached_pages: int
    host_cached_prompt_tokens: int
    def __init__(self, protocol_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., cached_pages: _Optional[int] = ..., running_requests: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., generated_requests: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., computed_prompt_tokens: _Optional[int] = ..., page_size: _Optional[int] = ..., model: _Optional[str] = ..., device: _Optional[str] = ..., incarnation: _Optional[int] = ..., synced: _Optional[bool] = ..., host_total_pages: _Optional[int] = ..., host_free_pages: _Optional[int] = ..., host_cached_pages: _Optional[int] = ..., host_cached_prompt_tokens: _Optional[int] = ...) -> None: ...
