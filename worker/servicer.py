"""``worker.v1.Worker`` servicer: convert, run the runtime off the event loop, convert back.

No decisions here: input checks the proto alone can settle (one token body, whole u32s, the
protocol version) raise ``coordinator.core.errors`` domain errors; the runtime raises
``InvalidRequest`` / ``PoolExhausted``; ``coordinator.rpc.interceptor.ErrorMappingInterceptor``
(with ``worker.server.EXPECTED_ERRORS``) turns all of them into status codes in one place.
Each answered Generate is handed to ``report`` as a rollout record (ARCHITECTURE §0, invariant 4).
"""

from __future__ import annotations

import asyncio
import functools
import sys
import uuid
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc

from coordinator.core.errors import InvalidArgument
from coordinator.core.rollout_records import MAX_ROLLOUT_ID_CHARS, Rollout
from coordinator.rpc.guard import caller
from coordinator.rpc.versions import check_protocol
from coordinator.wire import PROTOCOL_VERSION
from worker.gate import GenerationGate
from worker.metrics import WorkerMetrics
from worker.runtime import Generation, WorkerRuntime
from worker.v1 import worker_pb2 as wpb

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


@dataclass(frozen=True, slots=True)
class SyncState:
    """What GetStats reports about the coordinator link."""

    worker_id: str
    incarnation: int
    synced: bool


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
    """Generate runs ``runtime.generate`` in a thread (the runtime serializes requests; waiting
    callers show up in its ``queued_tokens``); admission goes through the ``GenerationGate``.
    ``report`` (e.g. ``RolloutReporter.add``) receives, on the event loop, one ``Rollout`` per
    generation answered to its caller (not for a caller that gave up before the answer)."""

    def __init__(
        self, runtime: WorkerRuntime, gate: GenerationGate, metrics: WorkerMetrics,
        sync_state: Callable[[], SyncState], *, model: str, device: str,
        report: Callable[[Rollout], None] | None = None,
    ) -> None:
        self._report = report
        self._runtime = runtime
        self._gate = gate
        self._metrics = metrics
        self._sync_state = sync_state
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
        generation: Generation = await self._admitted(tokens, request.max_new_tokens,
                                                      caller().tenant)
        if self._report is not None:
            self._report(Rollout(
                rollout_id, generation.policy_version, self._sync_state().worker_id,
                prompt_tokens=len(tokens), cached_tokens=generation.cached_tokens,
                completion_tokens=len(generation.tokens),
            ))
        return wpb.GenerateResponse(
            protocol_version=PROTOCOL_VERSION, tokens=generation.tokens,
            policy_version=generation.policy_version, cached_tokens=generation.cached_tokens,
            computed_tokens=generation.computed_tokens, rollout_id=rollout_id,
        )

    def _admitted(
        self, tokens: list[int], max_new_tokens: int, tenant: str
    ) -> asyncio.Future[Generation]:
        """Run one generation in a thread through the gate. The gate is left when the thread
        finishes, not when the caller stops waiting (a cancelled call's generation still runs
        to the end, and a drain must wait for it): the caller awaits a shield."""
        self._gate.enter()
        future = asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self._runtime.generate, tokens, max_new_tokens, tenant=tenant)
        )
        future.add_done_callback(self._finished)
        return asyncio.shield(future)

    def _finished(self, future: asyncio.Future[Generation]) -> None:
        self._gate.leave()
        if not future.cancelled() and future.exception() is None:
            self._count(future.result())

    def _count(self, generation: Generation) -> None:
        totals = self._gate.totals
        totals.requests += 1
        totals.tokens += len(generation.tokens)
        totals.cached_prompt_tokens += generation.cached_tokens
        totals.computed_prompt_tokens += generation.computed_tokens
        self._metrics.generated_tokens.inc(len(generation.tokens))
        self._metrics.prompt_tokens.labels("cached").inc(generation.cached_tokens)
        self._metrics.prompt_tokens.labels("computed").inc(generation.computed_tokens)

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
        )
