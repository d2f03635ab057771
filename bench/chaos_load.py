"""Generation during every fault, as a scheduler and an RL trainer's rollout loop do it, and
the reconciliation of what was generated against what ``ReadRollouts`` returns.

``Load`` runs one thread per replica; while ``running`` is set and its replica serves, a thread
routes a prompt there (the default, cache-aware policy) and asks the chosen worker to generate
it under a rollout id of our own (``GenerateRequest.rollout_id``), recording a ``Generation``.
Prompts come from a few families sharing a prefix, so routes hit and miss the cache.

Judged afterwards:

- ``reconcile``: every answered generation's rollout id must be read back with the worker and
  version that answered it. A record missing because its worker was SIGKILLed within
  ``UNREPORTED_S`` of answering died unreported in that worker's queue (it reports every
  ~100 ms); those are counted apart, as ``died_with_worker``, not as lost.
- ``overlaps``: generations that overlapped a sync weight update (``Commit``): one under an older
  version whose route was sent more than ``policy_stale_s`` after the commit returned, or one
  under an older version answered more than ``ANSWER_SLACK_S`` after the commit returned (it ran
  across the update: the drain should have waited for it). Fenced workers are left out: they
  took no part in that update.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc

from bench.chaos_watch import Commit, Watch
from coordinator.client import CoordinatorClient, KvcoordError, RolloutRecord
from tests.multihost_cluster import PAGE, REPLICAS, Cluster
from worker.client import generate_request
from worker.v1 import worker_pb2_grpc as wpb_grpc

GENERATE_EVERY_S = 0.2  # per replica
GENERATE_TIMEOUT_S = 3.0
UNREPORTED_S = 1.0  # a worker reports its records every ~100 ms; retries back off further
ANSWER_SLACK_S = 0.5  # an answer sent before the drain ack, read late by a busy client thread
FAMILIES = 4  # prompt prefixes (two pages each) shared by generations
LOAD_PREFIX = "chaos-"  # every generation's rollout id starts so
_Dialed = tuple[grpc.Channel, wpb_grpc.WorkerStub]  # a worker's channel and stub, by address


@dataclass(frozen=True, slots=True)
class Generation:
    sent: float  # when its Route was sent
    answered: float  # when the generation (or the failure) came back
    replica: str
    rollout_id: str
    worker_id: str | None = None  # None: the route failed
    route_version: int | None = None
    version: int | None = None  # the version the worker generated under; None: it failed
    error: str = ""


@dataclass(slots=True)
class Load:
    cluster: Cluster
    watch: Watch  # its ``serving`` says where to route
    generations: list[Generation] = field(default_factory=list)
    running: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _busy: set[str] = field(default_factory=set)  # replicas with a generation in flight
    _idle: threading.Condition = field(default_factory=threading.Condition)

    def start(self) -> None:
        for replica in REPLICAS:
            thread = threading.Thread(target=self._generate, args=(replica,),
                                      name=f"chaos-load-{replica}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def stop(self) -> None:
        self.running.clear()
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def pause(self) -> None:
        """Stop starting generations; returns once those in flight have come back."""
        self.running.clear()
        with self._idle:
            self._idle.wait_for(lambda: not self._busy, timeout=2 * GENERATE_TIMEOUT_S + 1)

    def _generate(self, replica: str) -> None:
        rng = random.Random(replica)
        families = [[rng.randrange(500) for _ in range(2 * PAGE)] for _ in range(FAMILIES)]
        client: CoordinatorClient | None = None
        workers: dict[str, _Dialed] = {}
        n = 0
        try:
            while not self._stop.wait(GENERATE_EVERY_S):
                if not self.running.is_set() or replica not in self.watch.serving:
                    if client is not None and replica not in self.watch.serving:
                        client.close()
                        client = None
                    continue
                with self._idle:
                    if not self.running.is_set():
                        continue  # paused meanwhile: pause() may already have returned
                    self._busy.add(replica)
                try:
                    client = client or self.cluster.client(replica, timeout=GENERATE_TIMEOUT_S)
                    prompt = rng.choice(families) + [rng.randrange(500) for _ in range(PAGE + 1)]
                    self.generations.append(self._one(client, workers, replica, prompt,
                                                      f"{LOAD_PREFIX}{replica}-{n}"))
                    n += 1
                finally:
                    with self._idle:
                        self._busy.discard(replica)
                        self._idle.notify_all()
        finally:
            if client is not None:
                client.close()
            for channel, _ in workers.values():
                channel.close()

    @staticmethod
    def _one(client: CoordinatorClient, workers: dict[str, _Dialed], replica: str,
             prompt: list[int], rollout_id: str) -> Generation:
        sent = time.monotonic()
        try:
            route = client.route(prompt)
        except KvcoordError as exc:
            return Generation(sent, time.monotonic(), replica, rollout_id,
                              error=f"route {exc.code.name}")
        if route.address not in workers:
            channel = grpc.insecure_channel(route.address)
            workers[route.address] = (channel, wpb_grpc.WorkerStub(channel))
        request = generate_request(prompt, 2)
        request.rollout_id = rollout_id
        try:
            answer = workers[route.address][1].Generate(request, timeout=GENERATE_TIMEOUT_S)
        except grpc.RpcError as exc:
            return Generation(sent, time.monotonic(), replica, rollout_id, route.worker_id,
                              route.policy_version, error=f"generate {exc.code().name}")
        return Generation(sent, time.monotonic(), replica, rollout_id, route.worker_id,
                          route.policy_version, answer.policy_version)


class Reconciled(NamedTuple):
    """Over the answered generations of a window: how many were checked, the ids missing or
    read back with another worker or version (``lost``), and those missing that died unreported
    with a SIGKILLed worker (``died_with_worker``)."""

    checked: int
    lost: list[str]
    died_with_worker: list[str]


def answered(generations: list[Generation], start: float, end: float) -> list[Generation]:
    return [g for g in generations if start <= g.sent < end and g.version is not None]


def reconcile(generations: list[Generation], records: dict[str, RolloutRecord],
              kills: list[tuple[str, float]], start: float, end: float) -> Reconciled:
    """Every generation answered in ``[start, end)`` against ``records`` (by rollout id)."""
    done = answered(generations, start, end)
    lost, died = [], []
    for g in done:
        record = records.get(g.rollout_id)
        if record is None and any(w == g.worker_id and 0 <= t - g.answered < UNREPORTED_S
                                  for w, t in kills):
            died.append(g.rollout_id)
        elif record is None or (record.worker_id, record.policy_version) != (g.worker_id,
                                                                             g.version):
            lost.append(g.rollout_id)
    return Reconciled(len(done), lost, died)


def overlaps(generations: list[Generation], commits: list[Commit], policy_stale_s: float,
             start: float, end: float) -> list[Generation]:
    """Generations in ``[start, end)`` that overlapped a weight update (module docstring)."""
    return [g for g in answered(generations, start, end)
            if any((g.version or 0) < c.version and g.worker_id not in c.fenced
                   and (g.sent > c.returned + policy_stale_s
                        or g.answered > c.returned + ANSWER_SLACK_S)
                   for c in commits)]
