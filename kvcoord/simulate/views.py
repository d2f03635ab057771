"""What each routing system knows of the workers, and how late it learns it.

No simulated router reads a worker's exact state: each sees what its real system sees.

- **Sync delay**: every worker -> coordinator message (Stored/Removed page events and
  heartbeats) reaches its reader :data:`SYNC_DELAY_S` after the worker sent it, in send order.
  The index every policy reads (the production :class:`~coordinator.index.PrefixIndex`; for
  ``dynamo_like`` its KV-event indexer) is fed only this way, so all see the same stale index.
- ``kv_aware`` (and the other production policies, ``round_robin`` and ``least_loaded``) read
  :class:`CoordinatorLoads`: the production coordinator's own per-worker books
  (:class:`coordinator.core.fleet.fleet.RegisteredWorker`): the last heartbeat's load plus the
  routes the
  coordinator issued and no heartbeat has yet reported finished.
- ``sglang_like`` reads only its own count of requests it sent and has not seen complete
  (the router proxies the response, so it sees completion at once).
- ``dynamo_like`` reads its own books of active blocks and prefill tokens (updated as the
  router sees the first token and the end of each response) plus the delayed index.

Heartbeats follow the worker's Sync client (``worker/sync/sync_client.py``): one every
:data:`HEARTBEAT_S`, or :data:`COMPLETION_COALESCE_S` after the first generation that finishes
since the last one (whichever comes first); every worker beats at time 0.

Constants (the production defaults; the same for every policy):

- ``SYNC_DELAY_S = 0.01``: a worker cuts event batches within ``event_flush_ms`` (5 ms,
  ``worker/config.py``) and a coordinator applies one in ~0.2 ms (docs/ARCHITECTURE.md); 10 ms
  leaves a few ms for the network hop.
- ``HEARTBEAT_S = 2.0``: ``heartbeat_ms`` (``coordinator/config.py``).
- ``COMPLETION_COALESCE_S = 0.02``: ``BEAT_COALESCE_S`` (``worker/sync/sync_client.py``).
- ``MAX_INFLIGHT = 65_536``: ``max_inflight_per_worker`` (``coordinator/config.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from coordinator.core.fleet import RegisteredWorker, WorkerLoad

SYNC_DELAY_S = 0.01
HEARTBEAT_S = 2.0
COMPLETION_COALESCE_S = 0.02
MAX_INFLIGHT = 65_536


class CoordinatorLoads:
    """The production coordinator's load view of the fleet (workers by position), kept by the
    production session code: ``heartbeat`` delivers a worker's report, ``routed`` counts a
    route the coordinator issued, ``load`` is what the router reads."""

    def __init__(self, worker_ids: Sequence[str], total_pages: int) -> None:
        self._sessions = [
            RegisteredWorker(
                worker_id=worker_id, incarnation=1, address="", model="simulate",
                policy_version=0, external=False, total_pages=total_pages,
                lease_deadline=math.inf, connected=True,
            )
            for worker_id in worker_ids
        ]

    def load(self, worker: int, now: float) -> WorkerLoad:
        """Last heartbeat + in-flight routes + the prefill backlog at ``now``
        (``RegisteredWorker.current_load``)."""
        return self._sessions[worker].current_load(now)

    def heartbeat(self, worker: int, load: WorkerLoad, completed_routes: int) -> None:
        self._sessions[worker].report_load(load, completed_routes)

    def routed(self, worker: int, prompt_tokens: int, cached_tokens: int, prefill_work: int,
               now: float, pending_keys: Sequence[bytes]) -> None:
        """The coordinator issued a route at ``now``, counting on ``prefill_work`` tokens of
        prefill there (``routing.booked_work``) and leaving ``pending_keys`` pending, as
        ``Router`` books it."""
        session = self._sessions[worker]
        session.hold_inflight(prompt_tokens - cached_tokens, 1, MAX_INFLIGHT, prompt_tokens)
        session.queue_prefill(prefill_work, now, pending_keys, prompt_tokens)
        session.count_routed(prompt_tokens, cached_tokens)

    def stored(self, worker: int, keys: Sequence[bytes], now: float) -> None:
        """A Stored event from ``worker`` reached the coordinator at ``now``."""
        self._sessions[worker].observe_stored(keys, now)


class HeartbeatClock:
    """When each worker sends its next heartbeat (the reference worker's rule, above).

    ``due[w]`` is the next beat's time and ``generation[w]`` its number: a beat scheduled under
    an older generation is stale (a completion brought the beat forward)."""

    def __init__(self, workers: int) -> None:
        self.due = [0.0] * workers
        self.generation = [0] * workers
        self._armed = [False] * workers  # waiting for a completion to bring the beat forward

    def sent(self, worker: int, now: float) -> float:
        """``worker`` beat at ``now``: returns the next beat's time (the period's)."""
        self.generation[worker] += 1
        self.due[worker] = now + HEARTBEAT_S + COMPLETION_COALESCE_S
        self._armed[worker] = True
        return self.due[worker]

    def completed(self, worker: int, now: float) -> float | None:
        """A generation finished on ``worker`` at ``now``: the new, earlier beat time, or None
        when the next beat stays as it was."""
        if not self._armed[worker]:
            return None
        self._armed[worker] = False
        soon = now + COMPLETION_COALESCE_S
        if soon >= self.due[worker]:
            return None
        self.generation[worker] += 1
        self.due[worker] = soon
        return soon
