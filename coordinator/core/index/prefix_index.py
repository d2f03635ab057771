"""The global prefix index: which worker holds which page key, and how deep a prompt matches.

Layout: every worker owns a *slot*, one bit in the masks (Python ints). ``_holdings``: the
confirmed ``(slot, key)`` pairs and the prefix walk over them (``holdings``: compiled where
built). ``_lower[key]`` / ``_pending[key]``: masks of the workers holding it only below GPU /
routed to and not yet confirming it (a zero mask is never stored). ``_workers[w]``: the reverse
side (``WorkerRecord``). ``_queue``: pending records oldest first (expiry, ``max_pending``).

Page keys are chained (a key names its whole prefix), so a worker's depth is the length of
its leading run of held keys. ``match`` sees confirmed holdings only and is exact;
``match_detail`` (the router's view) may count live pending entries as held.

Pure core: no I/O; time comes from the injected ``clock`` (monotonic seconds). Not thread-safe.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import reduce
from operator import or_

from coordinator.core.index import index_audit
from coordinator.core.index.holder_masks import (
    by_depth,
    clear_bit,
    clear_bits,
    set_bits,
    slot_names,
    tier_counts,
)
from coordinator.core.index.holdings import MAX_SLOTS, make_holdings
from coordinator.core.index.index_types import (
    IndexStats,
    IndexTables,
    MatchDetail,
    Tier,
    TierMatch,
    WorkerRecord,
    check_keys,
    check_read_keys,
    check_worker,
)
from coordinator.core.index.page_events import PageEvent, PagesRemoved, PagesStored, WorkerCleared

_NAMES_MEMO = 1024  # masks whose worker lists are memoised (each a tuple of names)


class PrefixIndex:
    """``key -> holders`` with per-holder tier, a reverse map and TTL'd pending entries.

    Mutators validate all input before changing anything: worker ids are non-empty strings,
    keys are 16-byte ``bytes``, tiers are :class:`Tier` values (ValueError otherwise).
    """

    def __init__(
        self, *, clock: Callable[[], float], pending_ttl: float = 2.0,
        max_pending: int = 1_000_000, accelerated: bool | None = None,
    ) -> None:
        """``accelerated``: the compiled holdings (None: when built and not disabled by
        ``KVCOORD_NO_ACCEL=1``; see ``coordinator.core.index.holdings``)."""
        if pending_ttl <= 0 or max_pending < 0:
            raise ValueError("pending_ttl must be > 0 and max_pending >= 0")
        self._clock = clock
        self._pending_ttl = pending_ttl
        self._max_pending = max_pending
        self._workers: dict[str, WorkerRecord] = {}
        self._slots: list[str | None] = []  # slot -> worker; None when free
        # mask -> its workers, memoised: a popular prefix's holder mask recurs across lookups,
        # and decoding a 1,000-slot mask costs ~10 us. Cleared whenever the slot table changes.
        self._names: dict[int, tuple[str, ...]] = {}
        self._free_slots: list[int] = []  # heap: reuse low slots so masks stay short
        self._holdings = make_holdings(accelerated)
        self._lower: dict[bytes, int] = {}
        self._pending: dict[bytes, int] = {}
        self._pending_count = 0
        self._queue: deque[tuple[float, str, tuple[bytes, ...]]] = deque()
        self._queued = 0  # keys referenced by _queue, live or not: at most max_pending

    # ---- confirmed holdings -------------------------------------------------------------

    def store(self, worker_id: str, keys: Sequence[bytes], tier: Tier | str = Tier.GPU) -> int:
        """Record that ``worker_id`` holds ``keys`` in ``tier``; returns how many are new.

        Keys already held move to ``tier``. The worker's pending entries for these keys are
        confirmed (they stop being pending).
        """
        tier = Tier(tier)
        check_worker(worker_id)
        check_keys(keys)
        w = self._worker(worker_id)
        added = self._holdings.add(keys, w.slot)
        if tier is not Tier.GPU:
            set_bits(self._lower, keys, w.bit)
            self._spill(w, keys, tier)
        elif w.spilled:  # most workers never spill: skip the scan
            self._unspill(w, w.spilled.keys() & set(keys))
        if w.pending:
            # Held and pending keys were disjoint: the pending entries confirmed now are the
            # pending keys held now (a scan of the shorter side).
            if len(w.pending) <= len(keys):
                holds, slot = self._holdings.holds, w.slot
                confirmed: Iterable[bytes] = [k for k in w.pending if holds(k, slot)]
            else:
                confirmed = w.pending.keys() & set(keys)
            self._drop_pending(w, confirmed)
        return added

    def remove(self, worker_id: str, keys: Sequence[bytes]) -> int:
        """Forget that ``worker_id`` holds ``keys``, and any pending entry for them.

        Keys it does not hold are ignored; an unknown worker is a no-op. Returns how many
        holdings were removed.
        """
        check_worker(worker_id)
        check_keys(keys)
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        if w.pending:
            self._drop_pending(w, w.pending.keys() & set(keys))
        if w.spilled:
            self._unspill(w, w.spilled.keys() & set(keys))
        return self._holdings.discard(keys, w.slot)

    def drop_worker(self, worker_id: str) -> int:
        """Forget the worker entirely (holdings, pending entries, slot); returns holdings
        dropped. O(its pages). A later worker reusing the slot starts with nothing."""
        check_worker(worker_id)
        w = self._workers.pop(worker_id, None)
        if w is None:
            return 0
        self._drop_pending(w, list(w.pending))
        self._unspill(w, list(w.spilled))
        dropped = self._holdings.drop_slot(w.slot)
        self._slots[w.slot] = None
        heapq.heappush(self._free_slots, w.slot)
        return dropped

    def apply(self, worker_id: str, events: Iterable[PageEvent]) -> None:
        """One batch of ``worker_id``'s page events, in order: each as :meth:`store`,
        :meth:`remove` or :meth:`drop_worker` does it (ValueError as they raise it)."""
        for event in events:
            match event:
                case PagesStored(keys, tier):
                    self.store(worker_id, keys, tier)
                case PagesRemoved(keys):
                    self.remove(worker_id, keys)
                case WorkerCleared():
                    self.drop_worker(worker_id)

    def replace_worker(self, worker_id: str, keys_by_tier: Mapping[str, Sequence[bytes]]) -> None:
        """Resync: the worker's holdings become exactly this inventory.

        A key listed under several tiers is kept in the fastest (GPU over CPU over DISK).
        Pending entries for keys in the inventory are confirmed; other pending entries stay.
        O(the keys it held and the inventory's), not O(the index).
        """
        check_worker(worker_id)
        inventory = {Tier(tier): keys for tier, keys in keys_by_tier.items()}
        wanted: set[bytes] = set()
        for keys in inventory.values():
            check_keys(keys)
            wanted.update(keys)
        w = self._worker(worker_id)
        stale = [k for k in self._holdings.keys_by_slot([w.slot])[w.slot] if k not in wanted]
        self._unspill(w, w.spilled.keys() & set(stale))
        self._holdings.discard(stale, w.slot)
        for tier in (Tier.DISK, Tier.CPU, Tier.GPU):  # slowest first: the fastest wins
            self.store(worker_id, inventory.get(tier, ()), tier)

    # ---- queries --------------------------------------------------------------------------

    def match(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Every confirmed holder of ``keys[0]`` -> its depth (leading run of held keys).

        Exact even when a worker lost a middle page: its depth stops there. Does not mutate.
        """
        check_read_keys(keys)
        return by_depth(self._holdings.runs(keys, None), self._workers_in, int)

    def match_tiers(self, keys: Sequence[bytes]) -> TierMatch:
        """:meth:`match`, with each holder's matched pages in CPU and DISK counted.

        A prompt with no key in a lower tier (of any worker) costs ``match`` plus one set check
        in C; otherwise the workers holding some of its keys below GPU are read off their
        masks, and only those that matched have their run's tiers counted. Does not mutate.
        """
        check_read_keys(keys)
        depths = by_depth(self._holdings.runs(keys, None), self._workers_in, int)
        lower: dict[str, dict[Tier, int]] = {}
        masks = self._lower
        if masks and not masks.keys().isdisjoint(keys):
            spilling = reduce(or_, map(masks.__getitem__, filter(masks.__contains__, keys)))
            for worker in slot_names(spilling, self._slots):
                depth = depths.get(worker)
                if depth:
                    counts = Counter(map(self._workers[worker].spilled.get, keys[:depth]))
                    tiers = {tier: n for tier, n in counts.items() if tier is not None}
                    if tiers:  # None counted the GPU keys
                        lower[worker] = tiers
        return TierMatch(depths, lower)

    def match_detail(
        self, keys: Sequence[bytes], *, include_pending: bool = False
    ) -> dict[str, MatchDetail]:
        """Like :meth:`match`, with tier and pending counts per worker.

        With ``include_pending`` a live pending entry counts as held (``pages``), and
        ``confirmed_pages`` still gives the confirmed depth, from the same walk: a router needs
        no second :meth:`match`. Expired entries are dropped first (the only mutation,
        invisible to callers but for the memory it frees).
        """
        check_read_keys(keys)
        if include_pending:
            self.expire_pending()
        with_pending = include_pending and bool(self._pending)
        runs = self._holdings.runs(keys, self._pending if with_pending else None)
        lower = tier_counts(self._lower, keys, runs, self._workers_in)
        first_pending: dict[str, int] = {}
        pend = (
            tier_counts(self._pending, keys, runs, self._workers_in, first_pending)
            if with_pending
            else Counter[str]()
        )
        # Details are immutable: share one per depth among the (usual) workers with nothing in
        # lower tiers or pending, so a 1,000-worker answer builds a handful of objects.
        out = by_depth(runs, self._workers_in, MatchDetail.plain)
        for worker in lower.keys() | pend.keys():
            depth = out[worker].pages
            # Held and pending keys are disjoint, so the confirmed run ends at the first
            # pending key of the worker's run.
            confirmed = first_pending.get(worker, depth)
            out[worker] = MatchDetail(depth, lower[worker], pend[worker], confirmed)
        return out

    def held_count(self, worker_id: str) -> int:
        """How many keys ``worker_id`` holds (confirmed; pending entries not counted)."""
        w = self._workers.get(worker_id)
        return self._holdings.count(w.slot) if w else 0

    def held_by_tier(self, worker_id: str) -> dict[Tier, int]:
        """:meth:`held_count` split by tier, every tier named. O(1): ListWorkers (a gateway's
        readiness probe) asks it of every worker, whose host tiers may hold millions of keys."""
        w = self._workers.get(worker_id)
        if w is None:
            return dict.fromkeys(Tier, 0)
        lower = w.spilled_by_tier
        gpu = self._holdings.count(w.slot) - len(w.spilled)
        return {Tier.GPU: gpu, Tier.CPU: lower[Tier.CPU], Tier.DISK: lower[Tier.DISK]}

    def worker_keys(self, worker_id: str) -> frozenset[bytes]:
        """The keys ``worker_id`` holds (confirmed), any tier. O(those keys)."""
        w = self._workers.get(worker_id)
        return frozenset(self._holdings.keys_by_slot([w.slot])[w.slot] if w else ())

    def worker_inventory(self, worker_id: str) -> dict[str, list[bytes]]:
        """The keys ``worker_id`` holds by tier value (the form ``replace_worker`` takes)."""
        return self.worker_inventories([worker_id]).get(worker_id, {})

    def worker_inventories(self, worker_ids: Iterable[str]) -> dict[str, dict[str, list[bytes]]]:
        """``worker_inventory`` of each known worker of ``worker_ids``: O(the keys they hold)."""
        known = {w: self._workers[w] for w in worker_ids if w in self._workers}
        by_slot = self._holdings.keys_by_slot([w.slot for w in known.values()])
        inventories: dict[str, dict[str, list[bytes]]] = {}
        for worker_id, w in known.items():
            inventory = inventories[worker_id] = {}
            for key in by_slot[w.slot]:
                inventory.setdefault(w.spilled.get(key, Tier.GPU).value, []).append(key)
        return inventories

    def tier_of(self, worker_id: str, key: bytes) -> Tier | None:
        """The tier in which ``worker_id`` holds ``key``, or None if it does not hold it."""
        w = self._workers.get(worker_id)
        if w is None or not self._holdings.holds(key, w.slot):
            return None
        return w.spilled.get(key, Tier.GPU)

    def pending_keys(self, worker_id: str) -> frozenset[bytes]:
        """Keys with a pending entry for ``worker_id`` (expired ones too, until expired)."""
        w = self._workers.get(worker_id)
        return frozenset(w.pending if w else ())

    def workers(self) -> list[str]:
        """Known workers (stored or routed to, not dropped since), in slot order."""
        return [w for w in self._slots if w is not None]

    def stats(self) -> IndexStats:
        holdings = sum(self._holdings.count(w.slot) for w in self._workers.values())
        return IndexStats(len(self._holdings), holdings, self._pending_count, len(self._workers))

    def digest(self) -> bytes:
        """16 bytes naming the confirmed ``(worker, key, tier)`` entries as a set: the sum mod
        2**128 of each entry's BLAKE2b, so two indexes holding the same entries agree whatever
        order they were built in (replicas compare it). Pending entries are left out. All zero
        for an empty index. O(entries); for operators and checks, not for a hot path."""
        return index_audit.digest(self.tables())

    def tables(self) -> IndexTables:
        """The tables as they are (views, read-only by type): for ``index_audit`` alone."""
        return IndexTables(self._workers, self._slots, self._free_slots, self._holdings,
                           self._lower, self._pending, self._pending_count, self._queue,
                           self._queued, self._max_pending)

    # ---- pending entries ------------------------------------------------------------------

    def add_pending(self, worker_id: str, keys: Sequence[bytes]) -> int:
        """Mark ``keys`` as routed to ``worker_id``, live for ``pending_ttl``; returns how many
        entries are new (refreshed ones restart their TTL; confirmed holdings are skipped).

        At most ``max_pending`` keys are queued: the oldest records are evicted first, and a
        call longer than the bound keeps its leading keys.
        """
        check_worker(worker_id)
        check_keys(keys)
        self.expire_pending()
        w = self._worker(worker_id)
        fresh = tuple(dict.fromkeys(self._holdings.not_held(keys, w.slot)))[: self._max_pending]
        while self._queue and self._queued + len(fresh) > self._max_pending:
            self._pop_oldest()
        if not fresh:
            return 0
        deadline = self._clock() + self._pending_ttl
        added = len(fresh) - len(w.pending.keys() & fresh)
        w.pending.update(dict.fromkeys(fresh, deadline))
        set_bits(self._pending, fresh, w.bit)
        self._queue.append((deadline, worker_id, fresh))
        self._queued += len(fresh)
        self._pending_count += added
        return added

    def expire_pending(self) -> int:
        """Drop pending entries whose deadline has passed; returns how many."""
        now = self._clock()
        before = self._pending_count
        while self._queue and self._queue[0][0] <= now:
            self._pop_oldest()
        return before - self._pending_count

    def check_integrity(self) -> None:
        """Raise IndexIntegrityError unless every structure agrees with every other. O(size)."""
        index_audit.check_integrity(self.tables())

    # ---- internals ------------------------------------------------------------------------

    def _worker(self, worker_id: str) -> WorkerRecord:
        w = self._workers.get(worker_id)
        if w is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
                self._slots[slot] = worker_id
            else:
                slot = len(self._slots)
                if slot >= MAX_SLOTS:
                    raise ValueError(f"the index holds at most {MAX_SLOTS} workers")
                self._slots.append(worker_id)
            w = self._workers[worker_id] = WorkerRecord(slot, 1 << slot)
            self._names.clear()
        return w

    def _spill(self, w: WorkerRecord, keys: Sequence[bytes], tier: Tier) -> None:
        spilled, counts = w.spilled, w.spilled_by_tier
        for key in keys:
            old = spilled.get(key)
            if old is not tier:
                if old is not None:
                    counts[old] -= 1
                counts[tier] += 1
                spilled[key] = tier

    def _unspill(self, w: WorkerRecord, keys: Iterable[bytes]) -> None:
        for key in keys:
            w.spilled_by_tier[w.spilled.pop(key)] -= 1
            clear_bit(self._lower, key, w.bit)

    def _drop_pending(self, w: WorkerRecord, keys: Iterable[bytes]) -> None:
        # Their queue records stay until they expire or are evicted; _pop_oldest skips them.
        gone = [k for k in keys if w.pending.pop(k, None) is not None]
        clear_bits(self._pending, gone, w.bit)
        self._pending_count -= len(gone)

    def _pop_oldest(self) -> None:
        deadline, worker_id, keys = self._queue.popleft()
        self._queued -= len(keys)
        w = self._workers.get(worker_id)
        if w is not None and w.pending:
            # Only entries still carrying this record's deadline are its own: a later
            # add_pending refreshed the others, or store/remove/drop_worker took them.
            self._drop_pending(w, [k for k in keys if w.pending.get(k) == deadline])

    def _workers_in(self, mask: int) -> tuple[str, ...]:
        names = self._names.get(mask)
        if names is None:
            names = slot_names(mask, self._slots)
            if len(self._names) >= _NAMES_MEMO:
                self._names.clear()
            self._names[mask] = names
        return names
