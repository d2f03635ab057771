"""One registered worker's session (``RegisteredWorker``: lease, sequence numbers, serving
version, routes in flight, load) and the states and batch verdicts it is judged by.

Pure core: no grpc, redis or asyncio; time comes from the caller.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from coordinator.core.errors import FailedPrecondition
from coordinator.core.fleet.prefill_backlog import PrefillBacklog
from coordinator.core.fleet.worker_load import Candidate, WorkerLoad
from coordinator.core.index.page_events import PageEvent, PagesRemoved, PagesStored
from coordinator.core.tier_costs import TierCosts


class WorkerStatus(enum.StrEnum):
    """Why a worker is or is not routable; the first that applies wins (see ``status``)."""

    READY = "ready"
    DRAINING = "draining"
    FENCED = "fenced"
    CORDONED = "cordoned"
    DISCONNECTED = "disconnected"


PAGE_BOUND_FACTOR = 4


class BatchVerdict(enum.Enum):
    """What to do with an incoming event batch."""

    APPLY = "apply"
    SKIP = "skip"  # a resync is in progress: the inventory will carry this batch's effect
    GAP = "gap"  # sequence numbers were skipped: the index may be wrong, ask for a resync


@dataclass(slots=True)
class RegisteredWorker:
    """One registered worker incarnation. Mutated only by ``Fleet`` and the session manager."""

    worker_id: str
    incarnation: int
    address: str
    model: str
    policy_version: int
    external: bool
    total_pages: int
    lease_deadline: float
    connected: bool = False
    disconnected_at: float | None = None
    cordoned: bool = False
    fenced: bool = False
    draining: bool = False
    next_seq: int = 1
    resync_id: int | None = None
    # The coordinator replica that holds the worker's Sync stream (its events reach the others
    # through the store's events stream); "" until one does.
    owner: str = ""
    # Base URL of the worker's OpenAI-compatible endpoint (gateways forward there); "" = none.
    http_url: str = ""
    # Pages of the worker's host-memory tier (total_pages is the device pool's); 0 = none.
    host_pages: int = 0
    load: WorkerLoad = field(default_factory=WorkerLoad)
    # Uncached prefill tokens of each route issued and not yet reported finished, oldest first.
    inflight: deque[int] = field(default_factory=deque)
    inflight_tokens: int = 0
    # Prompt tokens of the same routes, in the same order: the KV they pin until they finish.
    inflight_context: deque[int] = field(default_factory=deque)
    inflight_context_tokens: int = 0
    # Routes whose end the caller reports (core.awaited_routes); heartbeats do not settle them.
    awaited_routes: int = 0
    awaited_tokens: int = 0
    awaited_context_tokens: int = 0
    # current_load() result, rebuilt only when the load changes (it is read on every route).
    _load_view: WorkerLoad | None = None
    _idle_candidate: Candidate | None = None
    # The load terms of the router's cost (routing.load_floor) without the prefill backlog,
    # kept current on every load change; floor_at adds the backlog at a given time, so the
    # fleet can hand idle workers to the router cheapest first.
    load_floor: float = 0.0
    floor_of: Callable[[WorkerLoad], float] | None = None
    # The prefill work routed here and not yet done, and the rate it drains at
    # (core.prefill_backlog; Fleet.put shares its model's PeerCosts with it).
    backlog: PrefillBacklog = field(
        default_factory=lambda: PrefillBacklog(TierCosts().prefill_tokens_per_s))
    backlog_weight: float = 1.0  # the router's queued_token weight (set by Fleet)
    # Every version this incarnation has served: its rollout records may carry any of them.
    served_versions: set[int] = field(default_factory=set)
    routed_requests: int = 0
    routed_tokens: int = 0
    routed_cached_tokens: int = 0
    # Pages the worker reported removed (its evictions), ever: the decision trace reads it at
    # a route and at its end, so the evictions between them are known.
    pages_removed: int = 0

    def status(self, now: float) -> WorkerStatus:
        """The worker's routability; DISCONNECTED covers a closed stream and a lapsed lease."""
        if not self.connected or now >= self.lease_deadline:
            return WorkerStatus.DISCONNECTED
        if self.fenced:
            return WorkerStatus.FENCED
        if self.draining:
            return WorkerStatus.DRAINING
        if self.cordoned:
            return WorkerStatus.CORDONED
        return WorkerStatus.READY

    @property
    def page_bound(self) -> int:
        """Index entries the worker may hold at most: ``PAGE_BOUND_FACTOR`` times its pages in
        both tiers (a tier it did not register, such as an engine's own CPU offload behind a
        bridge, may hold more than its pools, not without end)."""
        return max(self.total_pages + self.host_pages, 1) * PAGE_BOUND_FACTOR

    def serves(self, version: int, floor: int, model: str) -> bool:
        """Whether this worker serves requests of ``model`` at ``version`` (>= ``floor``)."""
        return self.policy_version == version and version >= floor and self.model == model

    def takes_routes(self, version: int, floor: int, model: str) -> bool:
        """``serves`` them, attached and not fenced, draining or cordoned (the lease is the
        caller's to check: it runs out without any event)."""
        return (self.serves(version, floor, model) and self.connected
                and not (self.fenced or self.draining or self.cordoned))

    def prefill_backlog(self, now: float) -> float:
        """Prefill tokens still queued at ``now`` by the coordinator's books: every route's
        work, added as it was issued (``queue_prefill``), drained at the worker's prefill rate
        and corrected as its Stored events show prefills ending (``core.prefill_backlog``).
        It needs no load report, so it is as fresh for a bridged engine as for a reference
        worker."""
        return self.backlog.tokens(now)

    def queue_prefill(self, tokens: float, now: float,
                      pending_keys: Sequence[bytes] = (), context_tokens: int = 0) -> None:
        """Count ``tokens`` of prefill routed here at ``now`` (this replica's route or one
        another replica shared), the last of a ``context_tokens``-token prompt (0: unknown);
        ``pending_keys``: the keys the route left pending, in prompt order (its last ones mark
        its prefill's end)."""
        self.backlog.book(tokens, now, pending_keys, context_tokens)
        self._load_changed()

    def observe_page_events(self, events: Iterable[PageEvent], now: float) -> None:
        """Tell the prefill backlog which keys a batch stored: a prefill's last page marks its
        end (``prefill_backlog``); count the pages it removed (``pages_removed``)."""
        for event in events:
            if type(event) is PagesStored:
                self.observe_stored(event.keys, now)
            elif type(event) is PagesRemoved:
                self.pages_removed += len(event.keys)

    def observe_stored(self, keys: Iterable[bytes], now: float) -> None:
        """The worker reported ``keys`` stored at ``now``: the prefills they end."""
        self.backlog.observe_stored(keys, now)

    def floor_at(self, now: float) -> float:
        """``routing.load_floor`` of ``current_load(now)``."""
        # The backlog read directly, not through prefill_backlog: every route sorts the
        # fleet by this.
        return self.load_floor + self.backlog_weight * self.backlog.tokens(now)

    def current_load(self, now: float | None = None) -> WorkerLoad:
        """Heartbeat load plus the coordinator's own in-flight accounting and, given ``now``,
        the prefill backlog then (0 without ``now``)."""
        view = self._load_view
        if view is None or view.attention_tokens != self.backlog.model_attention_tokens:
            base = self.load
            view = self._load_view = WorkerLoad(
                running_requests=base.running_requests,
                queued_tokens=base.queued_tokens,
                free_pages=base.free_pages,
                total_pages=base.total_pages or self.total_pages,
                inflight_routes=len(self.inflight) + self.awaited_routes,
                inflight_tokens=self.inflight_tokens + self.awaited_tokens,
                active_tokens=self.inflight_context_tokens + self.awaited_context_tokens,
                attention_tokens=self.backlog.model_attention_tokens,
            )
        backlog = self.prefill_backlog(now) if now is not None else 0.0
        if backlog:
            return WorkerLoad(view.running_requests, view.queued_tokens, view.free_pages,
                              view.total_pages, view.inflight_routes, view.inflight_tokens,
                              backlog, view.active_tokens, view.attention_tokens)
        return view

    def idle_candidate(self, now: float) -> Candidate:
        """This worker as a routing candidate holding none of the prompt at ``now`` (the
        common case), reused while its load does not change and it has no backlog."""
        candidate = self._idle_candidate
        load = self.current_load(now)
        if candidate is None or candidate.load is not load:
            candidate = Candidate(self.worker_id, 0, 0, load)
            if load is self._load_view:
                self._idle_candidate = candidate
        return candidate

    def report_load(self, load: WorkerLoad, completed_routes: int) -> None:
        """Take a heartbeat: the worker's own load, and how many routes it finished since."""
        self.load = load
        for _ in range(min(completed_routes, len(self.inflight))):
            # Finish order is unknown: settle the oldest first.
            self._settle_oldest()
        self._load_changed()

    def _load_changed(self) -> None:
        self._load_view = None
        if self.floor_of is not None:
            self.load_floor = self.floor_of(self.current_load())

    def hold_inflight(self, uncached_tokens: int, copies: int, max_inflight: int,
                      context_tokens: int = 0) -> None:
        """Count ``copies`` routes issued to this worker (by any replica) until heartbeats
        report them finished, each of ``uncached_tokens`` to compute and ``context_tokens`` of
        prompt; at most ``max_inflight`` are remembered (the oldest are then assumed
        finished)."""
        for _ in range(copies):
            self.inflight.append(uncached_tokens)
            self.inflight_tokens += uncached_tokens
            self.inflight_context.append(context_tokens)
            self.inflight_context_tokens += context_tokens
            if len(self.inflight) > max_inflight:
                self._settle_oldest()
        self._load_changed()

    def _settle_oldest(self) -> None:
        self.inflight_tokens -= self.inflight.popleft()
        self.inflight_context_tokens -= self.inflight_context.popleft()

    def count_routed(self, prompt_tokens: int, cached_tokens: int) -> None:
        """The routing totals `kvcoord status` shows (one route)."""
        self.routed_requests += 1
        self.routed_tokens += prompt_tokens
        self.routed_cached_tokens += cached_tokens

    def hold_awaited(self, uncached_tokens: int, copies: int, context_tokens: int = 0) -> None:
        """Count ``copies`` routes as load until ``release_awaited`` (core.awaited_routes)."""
        self.awaited_routes += copies
        self.awaited_tokens += uncached_tokens * copies
        self.awaited_context_tokens += context_tokens * copies
        self._load_changed()

    def release_awaited(self, uncached_tokens: int, copies: int, context_tokens: int = 0) -> None:
        self.awaited_routes -= copies
        self.awaited_tokens -= uncached_tokens * copies
        self.awaited_context_tokens -= context_tokens * copies
        self._load_changed()

    def check_batch(self, seq: int) -> BatchVerdict:
        """Judge a batch's sequence number against the next expected one; changes nothing
        (``advance`` does, once every other check of the batch passed: a batch refused for any
        reason must be asked for again, never counted as applied).

        Raises ``FailedPrecondition`` on a regression (a replay of an applied batch is a protocol
        violation: the worker resumes from the ``next_seq`` it was told at hello).
        """
        if self.resync_id is not None:
            return BatchVerdict.SKIP
        if seq < self.next_seq:
            raise FailedPrecondition(
                f"sequence regression from worker {self.worker_id!r}: got {seq}, "
                f"expected {self.next_seq}"
            )
        if seq > self.next_seq:
            return BatchVerdict.GAP
        return BatchVerdict.APPLY

    def advance(self, seq: int) -> None:
        """Batch ``seq`` (judged APPLY by ``check_batch``) was applied: expect ``seq + 1``."""
        self.next_seq = seq + 1
