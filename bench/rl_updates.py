"""The two ways ``kvcoord bench rl`` moves a running fleet to new weights, and the probe that
looks for KV reused across them.

- ``kvcoord_update``: a sync policy update through the coordinator (``begin_policy_update``
  then ``commit_policy_update``): each bridge drains its engine, reloads ``v<N>`` under its
  weights root, resets the prefix cache, sets the weight version and resumes; the gateway holds
  requests meanwhile. Its pause is measured twice: at the trainer (begin to commit returning)
  and by each bridge (``kvcoord_bridge_last_pause_seconds``: gate closed to gate open).
- ``NoBarrierTrainer``: what many RL stacks do today, straight to each engine in turn, with
  nothing paused: ``/collective_rpc reload_weights``, ``/reset_prefix_cache`` (with
  ``reset_running_requests=true``, which preempts running requests so the reset always succeeds
  under load: they go on from where they were, under the new weights) and
  ``/update_weight_version``; then its version counter moves on, the version its clients
  attribute the samples they send from then on to.
- ``probe``: a prompt of its own sent to each engine (twice before an update, so it is cached;
  once after). Any cached token on the send after the update is KV of the old weights reused
  under the new ones. In the no-barrier arm the probe comes after the reset, so it finds none:
  the old KV that practice reuses is reused by the requests that reach an engine between its
  reload and its reset, and those show among its wrong samples.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.engines_procs import EnginesError, http_get, http_post, metric_samples
from bench.rl_fleet import MODEL, RlFleet
from bench.rl_samples import complete
from coordinator.client import CoordinatorClient

PROBE_TOKENS = 160  # five engine blocks
GAUGE_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class Update:
    """One move to ``version``: when it began (monotonic), how long the trainer waited for it,
    each bridge's pause (kvcoord) and what went wrong (empty when nothing did)."""

    version: int
    began_at: float
    took_s: float
    bridge_pause_s: tuple[float, ...] = ()
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Probe:
    """``before``: each engine's cached tokens on the second send before the update (> 0: the
    probe was cached); ``after``: on the first send after it (> 0: stale reuse)."""

    version: int
    before: tuple[int, ...]
    after: tuple[int, ...]
    after_versions: tuple[int, ...]


def kvcoord_update(client: CoordinatorClient, fleet: RlFleet, version: int,
                   timeout_s: float) -> Update:
    """Move the fleet from ``version - 1`` to ``version`` (weights ``v<version>``), sync."""
    began = time.monotonic()
    client.begin_policy_update(version - 1, weights_uri=f"v{version}")
    state = client.commit_policy_update(version, timeout=timeout_s)
    took = time.monotonic() - began
    problems = []
    everyone = sorted(e.worker_id for e in fleet.engines)
    if state.version != version or sorted(state.acked_workers) != everyone:
        problems.append(f"commit of v{version}: version {state.version}, acked "
                        f"{list(state.acked_workers)}, fenced {list(state.fenced_workers)}, "
                        f"failures {dict(state.failures)}")
    pauses = tuple(_bridge_pause(e.metrics_url, version) for e in fleet.engines)
    return Update(version, began, took, pauses, tuple(problems))


def _bridge_pause(metrics_url: str, version: int) -> float:
    """The bridge's last pause, once it reports ``version`` confirmed."""
    deadline = time.monotonic() + GAUGE_WAIT_S
    while True:
        body = http_get(metrics_url)
        text = body.decode() if body is not None else ""
        confirmed = metric_samples(text, "kvcoord_bridge_policy_version")
        if confirmed and max(confirmed.values()) >= version:
            return float(max(metric_samples(text, "kvcoord_bridge_last_pause_seconds").values()))
        if time.monotonic() > deadline:
            raise EnginesError(f"{metrics_url} did not report version {version} confirmed "
                               f"within {GAUGE_WAIT_S:.0f} s: {confirmed}")
        time.sleep(0.1)


class NoBarrierTrainer:
    """The no-barrier practice (module docstring) over ``engine_urls``. ``version`` is the
    counter its clients read when they send."""

    def __init__(self, engine_urls: Sequence[str], checkpoints: dict[int, Path]) -> None:
        self.engine_urls, self.checkpoints = list(engine_urls), checkpoints
        self._version = 0
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def update(self, version: int) -> Update:
        began = time.monotonic()
        problems = []
        for url in self.engine_urls:
            reload = {"method": "reload_weights",
                      "kwargs": {"weights_path": str(self.checkpoints[version])}}
            http_post(f"{url}/collective_rpc", json.dumps(reload).encode())
            answer = http_post(f"{url}/reset_prefix_cache?reset_running_requests=true")
            if json.loads(answer).get("success") is not True:
                problems.append(f"{url}/reset_prefix_cache answered {answer!r}")
            http_post(f"{url}/update_weight_version",
                      json.dumps({"new_version": str(version)}).encode())
        with self._lock:
            self._version = version
        return Update(version, began, time.monotonic() - began, (), tuple(problems))


def probe_prompt(index: int) -> tuple[int, ...]:
    """A prompt no other request sends (the load's ids are random; these step by 7 from an
    offset of their own) and no other probe starts with."""
    return tuple(3 + (index * 131 + 7 * j) % 497 for j in range(PROBE_TOKENS))


def probe(urls: Sequence[str], prompt: Sequence[int], sends: int) -> tuple[list[int], list[int]]:
    """Send ``prompt`` ``sends`` times to each URL, one at a time: the last send's cached tokens
    and version at each (EnginesError when one is not answered)."""
    cached, versions = [], []
    for url in urls:
        for _ in range(sends):
            answer = complete(url, MODEL, prompt, 1)
            if answer.sample is None:
                raise EnginesError(f"probe at {url}: {answer.status} {answer.body}")
        cached.append(answer.sample.cached_tokens)
        versions.append(answer.sample.version)
    return cached, versions
