"""What ``bench/chaos.py`` observes while it injects faults: a thread that keeps routing and
looking up on every serving replica, and the judgement of those samples afterwards.

- ``Watch`` asks each serving replica for a round-robin ``Route`` about every ``ROUTE_EVERY_S``
  and for the probe prompts' ``Lookup`` about every ``LOOKUP_EVERY_S``; it records what came back
  with the time the request was sent (``time.monotonic``, the clock every process on this machine
  shares). The injector tells it which replicas serve (``serving``), when a worker became
  unreachable and when it was repaired (``unreachable`` / ``repaired``), and when replication was
  impossible (``replication_down``: Redis stopped).

Judged afterwards, from the samples:

- ``stale_routes``: routes naming a worker that was unreachable (killed, cut off, or fenced
  after being cut off) for longer than its lease plus ``STALE_SLACK_S`` when the route was sent,
  and not yet repaired;
- ``disagreements``: episodes in which the serving replicas answered the same Lookups
  differently for longer than the lag bound, not counting time when replication was impossible.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from coordinator.client import CoordinatorClient, KvcoordError
from tests.multihost_cluster import LEASE_S, PROMPTS, WORKERS, Cluster, Holdings, holdings

ROUTE_EVERY_S = 0.05
LOOKUP_EVERY_S = 0.2
# A remote replica renews a worker's lease when it applies the owner's event, milliseconds after
# the owner did; 0.25 s covers that lag and a request's scheduling on 2 busy cores.
STALE_SLACK_S = 0.25


@dataclass(frozen=True, slots=True)
class RouteSample:
    sent: float
    replica: str
    worker_id: str | None  # None: refused or failed (``error``)
    error: str = ""


@dataclass(frozen=True, slots=True)
class LookupSample:
    sent: float
    answers: dict[str, Holdings]  # every serving replica that answered


@dataclass(frozen=True, slots=True)
class Window:
    """``[start, end)`` in monotonic seconds; ``end`` None while still open."""

    start: float
    end: float | None = None

    def covers(self, t: float) -> bool:
        return self.start <= t and (self.end is None or t < self.end)


@dataclass(slots=True)
class Watch:
    cluster: Cluster
    serving: frozenset[str]  # replaced whole, never mutated: the thread iterates it
    routes: list[RouteSample] = field(default_factory=list)
    lookups: list[LookupSample] = field(default_factory=list)
    down: dict[str, list[Window]] = field(default_factory=dict)  # worker -> unreachable spells
    no_replication: list[Window] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the injector's notes

    def unreachable(self, worker_id: str, since: float) -> None:
        self.down.setdefault(worker_id, []).append(Window(since))

    def repaired(self, worker_id: str, at: float) -> None:
        spells = self.down[worker_id]
        spells[-1] = Window(spells[-1].start, at)

    def replication_down(self, since: float, until: float) -> None:
        self.no_replication.append(Window(since, until))

    # ------------------------------------------------------------------ sampling

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="chaos-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        clients: dict[str, CoordinatorClient] = {}
        prompts = [PROMPTS[w] for w in WORKERS]
        next_lookup, turn = 0.0, 0
        try:
            while not self._stop.is_set():
                serving = sorted(self.serving)
                for replica in serving:
                    client = clients.get(replica)
                    if client is None:
                        client = clients[replica] = self.cluster.client(replica, timeout=1.5)
                    sent = time.monotonic()
                    try:
                        route = client.route(prompts[turn % len(prompts)],
                                             routing_policy="round_robin")
                        self.routes.append(RouteSample(sent, replica, route.worker_id))
                    except KvcoordError as exc:
                        self.routes.append(RouteSample(sent, replica, None, exc.code.name))
                        clients.pop(replica).close()  # a restarted replica: dial afresh
                turn += 1
                if time.monotonic() >= next_lookup:
                    next_lookup = time.monotonic() + LOOKUP_EVERY_S
                    self._sample_lookups(clients, serving)
                self._stop.wait(ROUTE_EVERY_S)
        finally:
            for client in clients.values():
                client.close()

    def _sample_lookups(self, clients: dict[str, CoordinatorClient], serving: list[str]) -> None:
        sent, answers = time.monotonic(), {}
        for replica in serving:
            if replica not in clients:
                continue
            try:
                answers[replica] = holdings(clients[replica])
            except KvcoordError:
                return  # a replica going down: this sample compares nothing
        if len(answers) > 1:
            self.lookups.append(LookupSample(sent, answers))


# ---------------------------------------------------------------------- judgement


def _late(spell: Window) -> Window:
    """The part of an unreachable spell in which a route to the worker is stale."""
    return Window(spell.start + LEASE_S + STALE_SLACK_S, spell.end)


def stale_routes(routes: list[RouteSample], down: dict[str, list[Window]], start: float,
                 end: float) -> list[RouteSample]:
    """Routes sent in ``[start, end)`` naming a worker unreachable (a spell in ``down``) for
    longer than its lease plus ``STALE_SLACK_S``, and not yet repaired."""
    return [s for s in at_stake(routes, down, start, end)
            if any(_late(spell).covers(s.sent) for spell in down.get(s.worker_id or "", ()))]


def at_stake(routes: list[RouteSample], down: dict[str, list[Window]], start: float,
             end: float) -> list[RouteSample]:
    """Answered routes sent in ``[start, end)`` while some worker's routes would be stale:
    the routes that could have been stale (none: the check had nothing to catch)."""
    late = [_late(spell) for spells in down.values() for spell in spells]
    return [s for s in routes if start <= s.sent < end and s.worker_id is not None
            and any(w.covers(s.sent) for w in late)]


@dataclass(frozen=True, slots=True)
class Episode:
    """Replicas answering the same Lookups differently from ``since`` for ``lasted_s`` seconds
    (first to last disagreeing sample); ``answers``: the last such sample's."""

    since: float
    lasted_s: float
    answers: dict[str, Holdings]


def disagreements(lookups: list[LookupSample], no_replication: list[Window], start: float,
                  end: float, bound: float) -> list[Episode]:
    """Episodes in ``[start, end)`` where consecutive Lookup samples disagreed for longer than
    ``bound`` seconds. Samples inside a replication outage are skipped and end an episode
    (replicas that cannot hear each other are expected to differ)."""
    episodes: list[Episode] = []
    since: float | None = None
    for sample in lookups:
        if not start <= sample.sent < end:
            continue
        if any(w.covers(sample.sent) for w in no_replication):
            since = None
            continue
        if len({repr(a) for a in sample.answers.values()}) == 1:
            since = None
            continue
        if since is None:
            since = sample.sent
        if sample.sent - since > bound:
            if episodes and episodes[-1].since == since:
                episodes.pop()  # the same episode, lasting longer
            episodes.append(Episode(since, sample.sent - since, sample.answers))
    return episodes
