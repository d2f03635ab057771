"""``GenerationRunner``: one generation on the reference runtime, for every front end (the gRPC
``Generate`` and the OpenAI-compatible HTTP endpoint alike): admission through the gate, the
runtime's work in a thread, the counters, and the rollout record of each answered request
(ARCHITECTURE §0, invariant 4)."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.core.rollout_records import Rollout
from worker.metrics import WorkerMetrics
from worker.runtime import Generation
from worker.runtime.runtime import WorkerRuntime
from worker.serving.gate import GenerationGate


@dataclass(frozen=True, slots=True)
class SyncState:
    """What GetStats reports about the coordinator link."""

    worker_id: str
    incarnation: int
    synced: bool


class GenerationRunner:
    """Runs generations (see the module docstring). The runtime serializes them; callers that
    wait show up in its ``queued_tokens``. ``report`` (e.g. ``RolloutReporter.add``) receives, on
    the event loop, one ``Rollout`` per generation answered to its caller (not for a caller
    that gave up before the answer)."""

    def __init__(self, runtime: WorkerRuntime, gate: GenerationGate, metrics: WorkerMetrics,
                 sync_state: Callable[[], SyncState],
                 report: Callable[[Rollout], None] | None = None) -> None:
        self.runtime = runtime
        self.sync_state = sync_state
        self._gate = gate
        self._metrics = metrics
        self._report = report

    def start(
        self, tokens: list[int], max_new_tokens: int, tenant: str, *,
        on_token: Callable[[int], None] | None = None, cancel: threading.Event | None = None,
    ) -> asyncio.Future[Generation]:
        """Run one generation in a thread through the gate. The gate is left when the thread
        finishes, not when the caller stops waiting (a cancelled call's generation still runs
        until it sees ``cancel``, and a drain must wait for it): the caller awaits a shield.
        ``on_token`` is called on the runtime's thread (see ``WorkerRuntime.generate``)."""
        self._gate.enter()
        future = asyncio.get_running_loop().run_in_executor(None, functools.partial(
            self.runtime.generate, tokens, max_new_tokens, tenant=tenant, on_token=on_token,
            cancel=cancel))
        future.add_done_callback(self._finished)
        return asyncio.shield(future)

    def answered(self, generation: Generation, rollout_id: str, prompt_tokens: int) -> None:
        """The caller got ``generation``: report its rollout record."""
        if self._report is not None:
            self._report(Rollout(
                rollout_id, generation.policy_version, self.sync_state().worker_id,
                prompt_tokens=prompt_tokens, cached_tokens=generation.cached_tokens,
                completion_tokens=len(generation.tokens),
            ))

    def _finished(self, future: asyncio.Future[Generation]) -> None:
        self._gate.leave()
        if not future.cancelled() and future.exception() is None:
            self._count(future.result())

    def _count(self, generation: Generation) -> None:
        totals = self._gate.totals
        totals.requests += 1
        totals.tokens += len(generation.tokens)
        totals.cached_prompt_tokens += generation.cached_tokens
        totals.host_cached_prompt_tokens += generation.host_cached_tokens
        totals.computed_prompt_tokens += generation.computed_tokens
        self._metrics.generated_tokens.inc(len(generation.tokens))
        self._metrics.prompt_tokens.labels("cached").inc(generation.cached_tokens)
        self._metrics.prompt_tokens.labels("computed").inc(generation.computed_tokens)
        host = generation.host_cached_tokens
        self._metrics.cache_hit_tokens.labels("gpu").inc(generation.cached_tokens - host)
        self._metrics.cache_hit_tokens.labels("cpu").inc(host)
