"""The worker reports what it generated (ARCHITECTURE §0, invariant 4).

``RolloutReporter.add`` queues one rollout record per answered Generate; a background task sends
them to the coordinator's ``ReportRollouts`` in batches (every ``flush_ms``, or at once when
``batch_size`` are waiting), over the agent's current channel. Delivery is at least once: a
batch whose answer was lost is sent again (readers de-duplicate by ``rollout_id``).

- No coordinator link (the stub callable returns None), or a transient error (UNAVAILABLE,
  DEADLINE_EXCEEDED, ...): the records stay queued and are retried after a backoff, so records
  survive reconnects and coordinator restarts.
- FAILED_PRECONDITION or INVALID_ARGUMENT: the coordinator refused the batch for good (e.g. a
  version this incarnation was not registered at); the batch is logged and dropped. Except a
  refusal with reason REREGISTER (the coordinator does not know this worker, yet): after a
  coordinator restart the agent registers again, and the batch is retried then.
- The queue is bounded (``max_pending``): beyond it the oldest records are dropped, counted in
  ``dropped`` and logged.

A batch holds records of one policy version only, so a version the coordinator refuses costs
only that version's records.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from itertools import islice, takewhile

import grpc
import structlog

from coordinator.client.outcomes import outcome_of
from coordinator.core.rollout_records import Rollout
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import PROTOCOL_VERSION, Reason

log = structlog.get_logger(__name__)

_REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
_MAX_BACKOFF_S = 5.0


class RolloutReporter:
    """Queues rollout records and sends them to the coordinator (see the module docstring).

    ``stub`` returns the coordinator stub to use now, or None while disconnected. Runs on the
    event loop: ``add`` must be called there. Counters: ``sent`` (records the coordinator
    accepted), ``refused`` (dropped on a refusal), ``dropped`` (dropped by the queue bound).
    """

    def __init__(
        self, stub: Callable[[], pb_grpc.CoordinatorStub | None], *, worker_id: str,
        flush_ms: int = 100, batch_size: int = 256, max_pending: int = 100_000,
        rpc_timeout_s: float = 5.0,
    ) -> None:
        if flush_ms <= 0 or not 0 < batch_size <= max_pending or rpc_timeout_s <= 0:
            raise ValueError("flush_ms, rpc_timeout_s and 0 < batch_size <= max_pending must "
                             "hold")
        self.worker_id = worker_id
        self.sent = 0
        self.refused = 0
        self.dropped = 0
        self._stub = stub
        self._flush_s = flush_ms / 1000
        self._batch_size = batch_size
        self._max_pending = max_pending
        self._timeout_s = rpc_timeout_s
        self._pending: deque[Rollout] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._stopped = asyncio.Event()  # ends a backoff at once (new records must not)

    @property
    def pending(self) -> int:
        """Records queued and not yet accepted by the coordinator."""
        return len(self._pending)

    def start(self) -> None:
        """Start the background sender (returns at once). Idempotent."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"rollouts-{self.worker_id}")

    def add(self, rollout: Rollout) -> None:
        """Queue one record (never blocks, never raises); the oldest go beyond the bound."""
        self._pending.append(rollout)
        if len(self._pending) > self._max_pending:
            self._pending.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10_000 == 0:
                log.warning("rollouts.dropped", worker=self.worker_id, dropped=self.dropped,
                            max_pending=self._max_pending)
        if len(self._pending) >= self._batch_size:
            self._wake.set()

    async def stop(self, timeout_s: float | None = None) -> None:
        """Stop the sender, then try to send what is queued for up to ``timeout_s`` (default:
        the RPC timeout). Records still unsent after that (no link, errors) are logged and
        lost. Call it while the coordinator link is still up."""
        if self._task is not None:
            # The sender finishes the batch it may be sending (cancelling that call would leave
            # a batch the coordinator took still queued, and it would be sent twice), then ends.
            self._stopping = True
            self._stopped.set()
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self._timeout_s + 1)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        while self._pending and time.monotonic() < deadline:
            if not await self._send_one(min(self._timeout_s, deadline - time.monotonic())):
                break
        if self._pending:
            log.warning("rollouts.unsent_at_stop", worker=self.worker_id,
                        records=len(self._pending))

    async def _run(self) -> None:
        failures = 0
        while not self._stopping:
            if len(self._pending) < self._batch_size:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._flush_s)
            self._wake.clear()
            while self._pending and not self._stopping and self._stub() is not None:
                if not await self._send_one(self._timeout_s):
                    failures += 1
                    backoff = min(_MAX_BACKOFF_S, self._flush_s * 2 ** min(failures, 8))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopped.wait(), backoff)
                    break
                failures = 0

    async def _send_one(self, timeout_s: float) -> bool:
        """Send the oldest batch (one policy version, at most ``batch_size`` records). True when
        it is settled (accepted, or refused for good and dropped); False to retry later."""
        stub = self._stub()
        if stub is None or not self._pending:
            return False
        version = self._pending[0].policy_version
        # The oldest records of one version, so records stay in generation order across batches.
        batch = list(takewhile(lambda r: r.policy_version == version,
                               islice(self._pending, self._batch_size)))
        dropped_before = self.dropped
        request = pb.ReportRolloutsRequest(
            protocol_version=PROTOCOL_VERSION, records=[_to_pb(r) for r in batch]
        )
        try:
            await stub.ReportRollouts(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            outcome = outcome_of(exc)
            # Not registered (any more): the agent registers again, then this batch is retried.
            if outcome.code not in _REFUSED or outcome.reason is Reason.REREGISTER:
                log.info("rollouts.report_failed", worker=self.worker_id,
                         code=outcome.code.name, reason=outcome.reason,
                         details=outcome.message, pending=len(self._pending))
                return False
            self._settle(len(batch), self.dropped - dropped_before)
            self.refused += len(batch)
            log.error("rollouts.refused", worker=self.worker_id, code=outcome.code.name,
                      reason=outcome.reason, details=outcome.message, records=len(batch),
                      policy_version=version)
            return True
        self._settle(len(batch), self.dropped - dropped_before)
        self.sent += len(batch)
        return True

    def _settle(self, n: int, overflowed: int) -> None:
        """Remove the ``n`` records just sent from the head of the queue; ``overflowed`` of
        the oldest were already pushed out by ``add`` while the call was in flight."""
        for _ in range(max(0, n - overflowed)):
            self._pending.popleft()


def _to_pb(rollout: Rollout) -> pb.RolloutRecord:
    return pb.RolloutRecord(
        protocol_version=PROTOCOL_VERSION, rollout_id=rollout.rollout_id,
        policy_version=rollout.policy_version, worker_id=rollout.worker_id,
        prompt_tokens=rollout.prompt_tokens, cached_tokens=rollout.cached_tokens,
        completion_tokens=rollout.completion_tokens,
    )
