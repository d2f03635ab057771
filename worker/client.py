"""The worker SDK: ``WorkerClient`` (blocking) and ``AsyncWorkerClient``, one worker each.

``generate`` sends the prompt as packed little-endian u32 (``token_bytes``). Client-side
validation raises ``ValueError`` before a round trip; a refused call raises
``coordinator.client.KvcoordError`` whose ``.code`` is the gRPC status (INVALID_ARGUMENT for bad
input, RESOURCE_EXHAUSTED when the prompt cannot fit the worker's KV pool, UNAVAILABLE with
reason DRAINING and ``retry_after_ms`` while the worker drains for a policy update). ``token``
goes out as ``authorization: Bearer`` metadata on every call; ``tls`` (a ``ClientTls``) makes the
channel TLS, mutual when it carries a client certificate. Imports no torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from coordinator.client.channels import (
    ClientTls,
    call_metadata,
    channel_options,
    open_aio_channel,
    open_channel,
)
from coordinator.client.errors import KvcoordError, retry_pause
from coordinator.core.hashing.page_hasher import tokens_to_bytes
from coordinator.wire import PROTOCOL_VERSION
from worker.runtime import Generation
from worker.v1 import worker_pb2 as wpb
from worker.v1 import worker_pb2_grpc as wpb_grpc

__all__ = ["AsyncWorkerClient", "ClientTls", "Generation", "KvcoordError", "LoadedWeights",
           "WorkerClient", "WorkerStats"]

DEFAULT_TIMEOUT = 60.0
U32_MAX = 2**32 - 1


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    policy_version: int
    freed_pages: int


@dataclass(frozen=True, slots=True)
class WorkerStats:
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
    host_total_pages: int = 0
    host_free_pages: int = 0
    host_cached_pages: int = 0
    host_cached_prompt_tokens: int = 0


def generate_request(tokens: Sequence[int], max_new_tokens: int) -> wpb.GenerateRequest:
    """Validate and pack; ValueError for an empty prompt, ids outside uint32, a bad count."""
    if isinstance(tokens, (str, bytes)) or len(tokens) == 0:
        raise ValueError("a prompt is a non-empty sequence of integer token ids")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or not 1 <= max_new_tokens <= U32_MAX:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    try:
        packed = tokens_to_bytes(tokens)
    except (ValueError, OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    return wpb.GenerateRequest(protocol_version=PROTOCOL_VERSION, token_bytes=packed,
                               max_new_tokens=max_new_tokens)


def load_weights_request(version: int, path: str | None) -> wpb.LoadWeightsRequest:
    """ValueError for a version that is not an integer in uint64."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**64:
        raise ValueError(f"policy version must be an integer in [0, 2**64), got {version!r}")
    return wpb.LoadWeightsRequest(protocol_version=PROTOCOL_VERSION, version=version,
                                  path=path or "")


def _checked(response: Any) -> Any:
    """``response``, unless a worker newer than this client answered it (KvcoordError
    FAILED_PRECONDITION: its fields may mean what this client cannot know)."""
    if response.protocol_version > PROTOCOL_VERSION:
        raise KvcoordError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"worker answered protocol version {response.protocol_version}, "
                           f"newer than this client's {PROTOCOL_VERSION}")
    return response


def generation_from(response: wpb.GenerateResponse) -> Generation:
    r = _checked(response)
    return Generation(list(r.tokens), r.policy_version, r.cached_tokens, r.computed_tokens,
                      r.host_cached_tokens)


def loaded_from(response: wpb.LoadWeightsResponse) -> LoadedWeights:
    r = _checked(response)
    return LoadedWeights(r.policy_version, r.freed_pages)


def stats_from(response: wpb.WorkerStats) -> WorkerStats:
    r = _checked(response)
    return WorkerStats(
        worker_id=r.worker_id, policy_version=r.policy_version, total_pages=r.total_pages,
        free_pages=r.free_pages, cached_pages=r.cached_pages,
        running_requests=r.running_requests, queued_tokens=r.queued_tokens,
        generated_requests=r.generated_requests, generated_tokens=r.generated_tokens,
        cached_prompt_tokens=r.cached_prompt_tokens,
        computed_prompt_tokens=r.computed_prompt_tokens, page_size=r.page_size, model=r.model,
        device=r.device, incarnation=r.incarnation, synced=r.synced,
        host_total_pages=r.host_total_pages, host_free_pages=r.host_free_pages,
        host_cached_pages=r.host_cached_pages,
        host_cached_prompt_tokens=r.host_cached_prompt_tokens,
    )


class WorkerClient:
    """Blocking client of one worker (``host:port``). Thread-safe; close it or use ``with``.

    Any call may raise ``KvcoordError``: UNAUTHENTICATED / PERMISSION_DENIED (the token, its
    role), DEADLINE_EXCEEDED (``timeout``), UNAVAILABLE (the worker unreachable, or draining
    past the timeout), FAILED_PRECONDITION ``PROTOCOL_VERSION`` (a worker at another protocol
    version). There is no failover: one client, one worker.
    """

    def __init__(
        self, target: str, *, timeout: float = DEFAULT_TIMEOUT,
        max_message_bytes: int = 16 * 1024 * 1024, token: str | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        """The channel connects on the first call. ``timeout``: seconds per call, its retries
        included. ValueError for a ``target`` without a port."""
        if ":" not in target:
            raise ValueError(f"worker target must be HOST:PORT, got {target!r}")
        self._timeout = timeout
        self._metadata = call_metadata(token)
        self._channel = open_channel(target, channel_options(max_message_bytes), tls)
        self._stub = wpb_grpc.WorkerStub(self._channel)

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request: Any) -> Any:
        """One call; a worker answering with ``RetryInfo`` (UNAVAILABLE: draining for a
        policy update, resuming after one; RESOURCE_EXHAUSTED: over the rate limit) is retried
        within the call's timeout."""
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                return getattr(self._stub, method)(
                    request, timeout=max(0.001, deadline - time.monotonic()),
                    metadata=self._metadata,
                )
            except grpc.RpcError as exc:
                error = KvcoordError.from_rpc(exc)
                pause = retry_pause(error, deadline)
                if pause is None:
                    raise error from None
                time.sleep(pause)

    def generate(self, tokens: Sequence[int], max_new_tokens: int) -> Generation:
        """Greedy completion of ``tokens``: exactly ``max_new_tokens`` tokens.

        Returns:
            ``Generation``: the completion, the policy version that produced it, and the
            prompt tokens served from the prefix cache (``cached_tokens``, of them
            ``host_cached_tokens`` from host memory) and computed.

        Raises:
            ValueError: an empty prompt, an id outside uint32, ``max_new_tokens`` not >= 1.
            KvcoordError: INVALID_ARGUMENT (an id outside the vocabulary, ``max_new_tokens``
                over the worker's limit, prompt plus completion past the context);
                RESOURCE_EXHAUSTED when the prompt cannot fit the KV pool (not retried);
                ABORTED when a policy drain with ``abort_running`` stopped it (route it
                again); UNAVAILABLE ``DRAINING`` once its retries ran past the timeout.
        """
        return generation_from(self._call("Generate", generate_request(tokens, max_new_tokens)))

    def load_weights(self, version: int, path: str | None = None) -> LoadedWeights:
        """Swap to policy ``version`` (from ``path`` on the worker, else seeded weights), once
        the running request ends; every reusable cached page is freed (``freed_pages``). Any
        version is taken, lower ones too. KvcoordError INVALID_ARGUMENT for unusable weights,
        and then nothing changed."""
        return loaded_from(self._call("LoadWeights", load_weights_request(version, path)))

    def stats(self) -> WorkerStats:
        """The worker's pools, counters and sync state now."""
        request = wpb.GetStatsRequest(protocol_version=PROTOCOL_VERSION)
        return stats_from(self._call("GetStats", request))


class AsyncWorkerClient:
    """The asyncio twin of ``WorkerClient``: same methods, arguments and refusals, awaited."""

    def __init__(
        self, target: str, *, timeout: float = DEFAULT_TIMEOUT,
        max_message_bytes: int = 16 * 1024 * 1024, token: str | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        if ":" not in target:
            raise ValueError(f"worker target must be HOST:PORT, got {target!r}")
        self._timeout = timeout
        self._metadata = call_metadata(token)
        self._channel = open_aio_channel(target, channel_options(max_message_bytes), tls)
        self._stub = wpb_grpc.WorkerStub(self._channel)

    async def __aenter__(self) -> AsyncWorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: str, request: Any) -> Any:
        """``WorkerClient._call``, awaited."""
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                return await getattr(self._stub, method)(
                    request, timeout=max(0.001, deadline - time.monotonic()),
                    metadata=self._metadata,
                )
            except grpc.RpcError as exc:
                error = KvcoordError.from_rpc(exc)
                pause = retry_pause(error, deadline)
                if pause is None:
                    raise error from None
                await asyncio.sleep(pause)

    async def generate(self, tokens: Sequence[int], max_new_tokens: int) -> Generation:
        request = generate_request(tokens, max_new_tokens)
        return generation_from(await self._call("Generate", request))

    async def load_weights(self, version: int, path: str | None = None) -> LoadedWeights:
        request = load_weights_request(version, path)
        return loaded_from(await self._call("LoadWeights", request))

    async def stats(self) -> WorkerStats:
        request = wpb.GetStatsRequest(protocol_version=PROTOCOL_VERSION)
        return stats_from(await self._call("GetStats", request))
