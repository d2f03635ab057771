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

- ``stale_routes``: routes naming a worker that was unreachable (killed, cut off, or fenced
  after being cut off) for longer than its lease plus ``STALE_SLACK_S`` when the route was sent,
  and not yet repaired;
- ``version_violations``: routes sent more than ``policy_stale_s`` after
  ``CommitPolicyUpdate(v)`` returned that carry a version below v;
- ``at_stake``: the answered routes one of those two rules covered when they were sent;
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

    def _sample(self, replica: str) -> None:
        """Route on ``replica`` every ``ROUTE_EVERY_S`` while it serves, until stopped."""
        prompts = [PROMPTS[w] for w in WORKERS]
        client: CoordinatorClient | None = None
        turn = 0
        try:
            while not self._stop.wait(ROUTE_EVERY_S):
                if replica not in self.serving:
                    if client is not None:
                        client.close()  # a killed replica: dial afresh once it is back
                        client = None
                    continue
                client = client or self.cluster.client(replica, timeout=ROUTE_TIMEOUT_S)
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


def at_stake(routes: list[RouteSample], down: dict[str, list[Window]], commits: list[Commit],
             policy_stale_s: float, start: float, end: float) -> list[RouteSample]:
    """Answered routes sent in ``[start, end)`` that a rule could have caught: some worker's
    routes were stale then (``stale_routes``), or a commit had returned more than
    ``policy_stale_s`` earlier (``version_violations``). None: the checks had nothing to catch."""
    late = [_late(spell) for spells in down.values() for spell in spells]
    return [s for s in _answered(routes, start, end)
            if any(w.covers(s.sent) for w in late)
            or any(s.sent > c.returned + policy_stale_s for c in commits)]


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
