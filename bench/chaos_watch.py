"""What ``bench/chaos.py`` observes while it injects faults: one thread per replica that keeps
routing there, and the judgement of those samples afterwards.

- ``Watch`` runs one sampler thread per replica (so a call blocked on one replica never blinds
  the other): while the replica is in ``serving`` it asks it for a round-robin ``Route`` about
  every ``ROUTE_EVERY_S`` and records the answer (worker, policy version) or the refusal, with
  the time the request was sent (``time.monotonic``, the clock every process on this machine
  shares). The injector tells it which replicas serve (``serving``), when a worker became
  unreachable and when it was repaired (``unreachable`` / ``repaired``), which workers were
  SIGKILLed (``killed``), and every sync policy update (``committed``).

Judged afterwards, from the samples (each over a window ``[start, end)``):

- ``stale_routes``: routes naming a worker that was unreachable (killed, cut off, fenced after
  being cut off, cut from its owner until READY on the other replica: ``failover_spell``, or
  its lease lapsed under packet loss: ``lapse_spells``) for longer than its lease plus
  ``STALE_SLACK_S`` when the route was sent, and not yet repaired;
- ``version_violations``: routes sent more than ``policy_stale_s`` after
  ``CommitPolicyUpdate(v)`` returned that carry a version below v;
- each rule's own stake, the answered routes it covered when they were sent: ``stale_stake``
  (some worker was past its lease plus slack unreachable) and ``policy_stake`` (a commit had
  returned more than ``policy_stale_s`` earlier). Kept apart because only the faults that make
  a worker unreachable give the stale rule anything to check, while every route after the
  warm-up update is at stake for the version rule;
- ``critical_samples``: every route (answered or refused) sent in a round between
  ``policy_stale_s`` after its commit returned and the fault's end, the window the version
  rule is judged on; ``burst`` samples it densely;
- ``availability``: refused or failed routes, and the seconds in which no replica answered one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from itertools import pairwise
from typing import NamedTuple

from coordinator.client import CoordinatorClient, KvcoordError
from tests.multihost_cluster import LEASE_S, PROMPTS, REPLICAS, WORKERS, Cluster

ROUTE_EVERY_S = 0.05
# A remote replica renews a worker's lease when it applies the owner's event, milliseconds after
# the owner did; 0.25 s covers that lag and a request's scheduling on 2 busy cores.
STALE_SLACK_S = 0.25
# Ten route periods without an answer from any replica: unavailable for that whole stretch.
UNSERVED_GAP_S = 0.5
ROUTE_TIMEOUT_S = 1.5
# ``burst``: a replica that refuses a route makes it wait out the deadline (1.5 s above), so the
# sampler threads fall into a 1 s judged window about once a round; several threads with a short
# deadline put tens of samples there instead.
BURST_THREADS = 4
BURST_DEADLINE_S = 0.2
BURST_EVERY_S = 0.02  # per thread: answered routes come back in ms; no spinning on 2 cores


@dataclass(frozen=True, slots=True)
class RouteSample:
    sent: float
    replica: str
    worker_id: str | None  # None: refused or failed (``error``)
    version: int | None = None  # the policy version the route was answered under
    error: str = ""


@dataclass(frozen=True, slots=True)
class Window:
    """``[start, end)`` in monotonic seconds; ``end`` None while still open."""

    start: float
    end: float | None = None

    def covers(self, t: float) -> bool:
        return self.start <= t and (self.end is None or t < self.end)


@dataclass(frozen=True, slots=True)
class Commit:
    """A sync policy update: ``BeginPolicyUpdate`` sent at ``begun``, ``CommitPolicyUpdate``
    to ``version`` returned at ``returned``, fencing ``fenced``."""

    version: int
    begun: float
    returned: float
    fenced: tuple[str, ...] = ()


@dataclass(slots=True)
class Watch:
    cluster: Cluster
    serving: frozenset[str]  # replaced whole, never mutated: the threads read it
    routes: list[RouteSample] = field(default_factory=list)  # appended by several threads
    down: dict[str, list[Window]] = field(default_factory=dict)  # worker -> unreachable spells
    kills: list[tuple[str, float]] = field(default_factory=list)  # (worker, SIGKILLed at)
    commits: list[Commit] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    # ------------------------------------------------------------------ the injector's notes

    def unreachable(self, worker_id: str, since: float) -> None:
        self.down.setdefault(worker_id, []).append(Window(since))

    def repaired(self, worker_id: str, at: float) -> None:
        spells = self.down[worker_id]
        spells[-1] = Window(spells[-1].start, at)

    def spells(self, worker_id: str, windows: list[Window]) -> None:
        """Unreachable spells worked out after the fault (``lapse_spells``, ``failover_spell``)."""
        self.down.setdefault(worker_id, []).extend(windows)

    def killed(self, worker_id: str, at: float) -> None:
        self.kills.append((worker_id, at))

    def committed(self, commit: Commit) -> None:
        self.commits.append(commit)

    # ------------------------------------------------------------------ sampling

    def start(self) -> None:
        for replica in REPLICAS:
            thread = threading.Thread(target=self._sample, args=(replica,),
                                      name=f"chaos-watch-{replica}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def burst(self, replica: str, until: float, threads: int = BURST_THREADS,
              deadline_s: float = BURST_DEADLINE_S) -> None:
        """Route on ``replica`` from ``threads`` threads, each call with ``deadline_s``, until
        ``until`` (monotonic); returns then. The samples join ``routes`` as the sampler's do."""
        workers = [threading.Thread(target=self._sample,
                                    args=(replica, until, deadline_s, BURST_EVERY_S),
                                    name=f"chaos-burst-{replica}-{n}", daemon=True)
                   for n in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()

    def _sample(self, replica: str, until: float | None = None,
                deadline_s: float = ROUTE_TIMEOUT_S, every_s: float = ROUTE_EVERY_S) -> None:
        """Route on ``replica`` every ``every_s`` while it serves, until stopped (or ``until``)."""
        prompts = [PROMPTS[w] for w in WORKERS]
        client: CoordinatorClient | None = None
        turn = 0
        try:
            while not self._stop.wait(every_s) and (until is None or time.monotonic() < until):
                if replica not in self.serving:
                    if client is not None:
                        client.close()  # a killed replica: dial afresh once it is back
                        client = None
                    continue
                client = client or self.cluster.client(replica, timeout=deadline_s)
                sent = time.monotonic()
                try:
                    route = client.route(prompts[turn % len(prompts)],
                                         routing_policy="round_robin")
                    self.routes.append(RouteSample(sent, replica, route.worker_id,
                                                   route.policy_version))
                except KvcoordError as exc:
                    self.routes.append(RouteSample(sent, replica, None, None, exc.code.name))
                turn += 1
        finally:
            if client is not None:
                client.close()


# ---------------------------------------------------------------------- judgement


def _late(spell: Window) -> Window:
    """The part of an unreachable spell in which a route to the worker is stale."""
    return Window(spell.start + LEASE_S + STALE_SLACK_S, spell.end)


def _answered(routes: list[RouteSample], start: float, end: float) -> list[RouteSample]:
    return [s for s in routes if start <= s.sent < end and s.worker_id is not None]


def stale_routes(routes: list[RouteSample], down: dict[str, list[Window]], start: float,
                 end: float) -> list[RouteSample]:
    """Routes sent in ``[start, end)`` naming a worker unreachable (a spell in ``down``) for
    longer than its lease plus ``STALE_SLACK_S``, and not yet repaired."""
    return [s for s in _answered(routes, start, end)
            if any(_late(spell).covers(s.sent) for spell in down.get(s.worker_id or "", ()))]


def version_violations(routes: list[RouteSample], commits: list[Commit], policy_stale_s: float,
                       start: float, end: float) -> list[RouteSample]:
    """Routes sent in ``[start, end)`` more than ``policy_stale_s`` after a commit to v
    returned, answered under a version below v."""
    return [s for s in _answered(routes, start, end)
            if any(s.sent > c.returned + policy_stale_s and (s.version or 0) < c.version
                   for c in commits)]


Poll = tuple[float, bool]
"""A fault's poll of its victim: (sent at, whether it was READY as the poll asked)."""


def lapse_spells(polls: list[Poll], healed: float) -> list[Window]:
    """Unreachable spells from polls of a worker whose lease may lapse (packet loss): one per
    run of not-READY polls. Its lease ran out at or before the first such poll, so the spell
    starts ``LEASE_S`` before it (the stale window opens ``STALE_SLACK_S`` after the lapse was
    seen, never before it happened). It ends at the last not-READY poll before one saw it READY
    (it re-registered somewhere between the two: ending at the later poll would judge a
    legitimate route in between stale), or at ``healed``."""
    out: list[Window] = []
    opened: float | None = None
    last = 0.0
    for t, ready in polls:
        if not ready and opened is None:
            opened = t
        elif ready and opened is not None:
            out.append(Window(opened - LEASE_S, last))
            opened = None
        last = t
    if opened is not None:
        out.append(Window(opened - LEASE_S, healed))
    return out


def failover_spell(polls: list[Poll], fault_at: float, healed: float) -> Window:
    """The spell of a worker cut from its owner (asymmetric): from the fault until it is READY
    on another replica (``polls``: whether it was), ending at the last poll before the first
    that saw it so, or at ``healed``."""
    last = fault_at
    for t, ready_elsewhere in polls:
        if ready_elsewhere:
            return Window(fault_at, last)
        last = t
    return Window(fault_at, healed)


def stale_stake(routes: list[RouteSample], down: dict[str, list[Window]], start: float,
                end: float) -> list[RouteSample]:
    """Answered routes sent in ``[start, end)`` while some worker had been unreachable longer
    than its lease plus ``STALE_SLACK_S`` (and was not yet repaired): what ``stale_routes``
    could have caught. Empty when no worker was past its lease: nothing at stake."""
    late = [_late(spell) for spells in down.values() for spell in spells]
    return [s for s in _answered(routes, start, end) if any(w.covers(s.sent) for w in late)]


def policy_stake(routes: list[RouteSample], commits: list[Commit], policy_stale_s: float,
                 start: float, end: float) -> list[RouteSample]:
    """Answered routes sent in ``[start, end)`` more than ``policy_stale_s`` after some commit
    returned: what ``version_violations`` could have caught."""
    return [s for s in _answered(routes, start, end)
            if any(s.sent > c.returned + policy_stale_s for c in commits)]


def critical_samples(routes: list[RouteSample], commits: list[Commit], policy_stale_s: float,
                     start: float, end: float) -> list[RouteSample]:
    """Routes, answered or refused, sent from ``policy_stale_s`` after a commit that returned in
    ``[start, end)`` until ``end``: the window in which a replica that missed the commit must
    stop answering at the old version (how densely the version rule was tested)."""
    opens = [c.returned + policy_stale_s for c in commits if start <= c.returned < end]
    return [s for s in routes if s.sent < end and any(s.sent > t for t in opens)]


class Availability(NamedTuple):
    """``errors``: routes refused or failed; ``unserved_s``: the seconds of the window inside
    stretches longer than ``UNSERVED_GAP_S`` in which no replica answered a route."""

    errors: int
    unserved_s: float


def availability(routes: list[RouteSample], start: float, end: float) -> Availability:
    """Over routes sent in ``[start, end)`` (every replica together); the window's edges count
    as stretch ends, so a window with no answer at all is unserved throughout."""
    errors = sum(1 for s in routes if start <= s.sent < end and s.worker_id is None)
    times = [start, *sorted(s.sent for s in _answered(routes, start, end)), end]
    gaps = (b - a for a, b in pairwise(times))
    return Availability(errors, sum(g for g in gaps if g > UNSERVED_GAP_S))
