"""``worker.v1.Worker`` servicer: convert, run the generation (``worker.serving.generations``),
convert back.

No decisions here: input checks the proto alone can settle (one token body, whole u32s, the
protocol version) raise ``coordinator.core.errors`` domain errors; the runtime raises
``InvalidRequest`` / ``PoolExhausted``; ``coordinator.rpc.interceptor.ErrorMappingInterceptor``
(with ``worker.main.EXPECTED_ERRORS``) turns all of them into status codes in one place.
Each answered Generate becomes a rollout record (``GenerationRunner.answered``).
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from array import array
from typing import Any, TypeAlias

import grpc

from coordinator.core.errors import InvalidArgument
from coordinator.core.rollout_records import MAX_ROLLOUT_ID_CHARS
from coordinator.rpc.guard import caller
from coordinator.rpc.versions import check_protocol
from coordinator.wire import PROTOCOL_VERSION
from worker.runtime import Generation
from worker.serving.gate import GenerationGate
from worker.serving.generations import GenerationRunner
from worker.v1 import worker_pb2 as wpb

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


def tokens_from(request: wpb.GenerateRequest, max_tokens: int) -> list[int]:
    """The prompt from ``token_ids`` or ``token_bytes`` (packed little-endian u32). A prompt
    over ``max_tokens`` is refused before it is converted (a message near the size limit holds
    millions of ids: converting them first would cost the server a second or two each)."""
    if request.token_ids and request.token_bytes:
        raise InvalidArgument("set one of token_ids and token_bytes, not both")
    count = len(request.token_ids) or len(request.token_bytes) // 4
    if count > max_tokens:
        raise InvalidArgument(f"prompt of {count} tokens exceeds the model context of "
                              f"{max_tokens} tokens")
    if not request.token_bytes:
        return list(request.token_ids)
    if len(request.token_bytes) % 4:
        raise InvalidArgument(
            f"{len(request.token_bytes)} bytes of token_bytes is not a multiple of 4"
        )
    packed = array("I")
    packed.frombytes(request.token_bytes)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


class WorkerServicer:
    """Generate runs through the ``GenerationRunner`` (shared with the HTTP endpoint);
    LoadWeights and GetStats answer from the runtime."""

    def __init__(self, generations: GenerationRunner, gate: GenerationGate, *, model: str,
                 device: str) -> None:
        self._generations = generations
        self._runtime = generations.runtime
        self._sync_state = generations.sync_state
        self._gate = gate
        self._model = model
        self._device = device

    async def Generate(
        self, request: wpb.GenerateRequest, context: Context
    ) -> wpb.GenerateResponse:
        check_protocol(request.protocol_version)
        tokens = tokens_from(request, self._runtime.model.max_context)
        if len(request.rollout_id) > MAX_ROLLOUT_ID_CHARS:
            raise InvalidArgument(f"rollout_id is {len(request.rollout_id)} characters; "
                                  f"at most {MAX_ROLLOUT_ID_CHARS}")
        rollout_id = request.rollout_id or uuid.uuid4().hex
        # Hashed under the caller's tenant: another tenant's cached pages never hit (their
        # cached_tokens and speed would tell this caller what the other tenant sent).
        generation: Generation = await self._generations.start(
            tokens, request.max_new_tokens, caller().tenant)
        self._generations.answered(generation, rollout_id, len(tokens))
        return wpb.GenerateResponse(
            protocol_version=PROTOCOL_VERSION, tokens=generation.tokens,
            policy_version=generation.policy_version, cached_tokens=generation.cached_tokens,
            computed_tokens=generation.computed_tokens, rollout_id=rollout_id,
            host_cached_tokens=generation.host_cached_tokens,
        )

    async def LoadWeights(
        self, request: wpb.LoadWeightsRequest, context: Context
    ) -> wpb.LoadWeightsResponse:
        check_protocol(request.protocol_version)
        freed = await asyncio.to_thread(
            self._runtime.load_weights, request.version, request.path or None
        )
        return wpb.LoadWeightsResponse(
            protocol_version=PROTOCOL_VERSION, policy_version=self._runtime.policy_version,
            freed_pages=freed,
        )

    async def GetStats(self, request: wpb.GetStatsRequest, context: Context) -> wpb.WorkerStats:
        check_protocol(request.protocol_version)
        s = self._runtime.stats()
        sync = self._sync_state()
        totals = self._gate.totals
        return wpb.WorkerStats(
            protocol_version=PROTOCOL_VERSION, worker_id=sync.worker_id,
            policy_version=s.policy_version, total_pages=s.total_pages,
            free_pages=s.free_pages, cached_pages=s.cached_pages,
            running_requests=s.running_requests, queued_tokens=s.queued_tokens,
            generated_requests=totals.requests, generated_tokens=totals.tokens,
            cached_prompt_tokens=totals.cached_prompt_tokens,
            computed_prompt_tokens=totals.computed_prompt_tokens,
            page_size=self._runtime.page_size, model=self._model, device=self._device,
            incarnation=sync.incarnation, synced=sync.synced,
            host_total_pages=s.host_total_pages, host_free_pages=s.host_free_pages,
            host_cached_pages=s.host_cached_pages,
            host_cached_prompt_tokens=totals.host_cached_prompt_tokens,
        )
