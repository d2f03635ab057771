"""RL on real vLLM engines: two engines (the CPU build, real checkpoints of the tiny model), each
behind its own policy-controlled ``kvcoord bridge``, a coordinator and a gateway; GRPO groups
flow through the gateway while the trainer moves the fleet v0 -> v1 (sync), v1 -> v2 (async)
and v2 -> v3 (sync, one engine cannot load v3). Checked, in order:

1. every sample says the weights that made it: each is regenerated greedily on a fresh engine
   loaded with its version's checkpoint, and the token ids must be equal;
2. no reuse across versions: a prompt cached under v0 reports ``cached_tokens == 0`` under v1,
   and the index holds no v0 key for either engine;
3. requests arriving during the drain wait and then run at v1: none fails with a 5xx;
4. an engine whose reload fails (its weights root has no ``v3``) is fenced, the commit's answer
   names it with the reason, and the other engine serves v3; the fenced engine stays paused,
   at v2, answering 503 through its bridge;
5. async mode: routes flow while the update is open, no request waits for a drain, and every
   sample's version is within ``max_staleness`` of the fleet's (1 or 2 while v1 -> v2 is open,
   2 after); that each one was made by the version it names is check 1's. On this machine each
   engine's reload takes about 0.1 s, so most samples of the window are already at 2.

Run by ``make test-vllm``. Checkpoints: ``tiny_model.write_checkpoint`` (seed = version).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.engines_fleet import vllm_python
from bench.rl_fleet import MODEL, RlFleet, running_rl_fleet
from bench.rl_samples import Sample, complete, regenerate
from coordinator.client import CoordinatorClient
from tests_vllm.tiny_model import write_checkpoint

MAX_STALENESS = 1
GROUP = 4  # samples of one prompt, sent together (a GRPO group)
ANSWER_TOKENS = 12
COMMIT_S = 120.0
TEST_TIMEOUT_S = 900
# What the coordinator runs with: a commit waits up to COMMIT_S, routes wait out a drain.
COORDINATOR_ENV = {"KVCOORD_MAX_STALENESS": str(MAX_STALENESS),
                   "KVCOORD_BARRIER_TIMEOUT_MS": str(int(COMMIT_S * 1000)),
                   "KVCOORD_ROUTE_WAIT_MS": "10000"}


@dataclass
class Flow:
    """GRPO groups sent through the gateway from a background thread until ``stop``."""

    gateway: str
    seed: int
    samples: dict[str, Sample] = field(default_factory=dict)  # request id -> sample
    answered_at: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def prompt(self, i: int) -> list[int]:
        # Distinct token ids (3..500) per prompt, a few hundred long: several engine blocks.
        return [3 + (self.seed * 7919 + i * 104_729 + j * 31) % 497 for j in range(96 + i % 5 * 32)]

    def run(self) -> None:
        i = 0
        while not self.stopping.is_set():
            prompt = self.prompt(i)
            threads = [threading.Thread(target=self._one, args=(prompt,)) for _ in range(GROUP)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            i += 1

    def _one(self, prompt: list[int]) -> None:
        request_id = uuid.uuid4().hex
        answer = complete(self.gateway, MODEL, prompt, ANSWER_TOKENS,
                          headers={"x-request-id": request_id})
        if answer.sample is None:
            self.failures.append(f"{answer.status}: {answer.body}")
            return
        self.samples[request_id] = answer.sample
        self.answered_at[request_id] = time.monotonic()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    base = tmp_path_factory.mktemp("checkpoints")
    return {v: write_checkpoint(base / f"v{v}", seed=v) for v in range(4)}


@pytest.fixture(scope="module")
def fleet(checkpoints: dict[int, Path], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[RlFleet]:
    python = vllm_python()
    if python is None:
        pytest.fail("no vLLM interpreter: run `make test-vllm` (it builds vLLM's environment)")
    roots = []
    for name, versions in (("root-0", (1, 2, 3)), ("root-1", (1, 2))):  # vllm-1 has no v3
        root = tmp_path_factory.mktemp(name)
        for v in versions:
            (root / f"v{v}").symlink_to(checkpoints[v])
        roots.append(root)
    log_dir = tmp_path_factory.mktemp("logs")
    with running_rl_fleet(python, checkpoints[0], roots, log_dir,
                          coordinator_env=COORDINATOR_ENV) as running:
        yield running


@pytest.fixture(scope="module")
def client(fleet: RlFleet) -> Iterator[CoordinatorClient]:
    with CoordinatorClient(fleet.coordinator, timeout=COMMIT_S + 10) as c:
        yield c


ALL_SAMPLES: dict[str, Sample] = {}


def _flowing(fleet: RlFleet, seed: int) -> tuple[Flow, threading.Thread]:
    flow = Flow(fleet.gateway_url, seed)
    thread = threading.Thread(target=flow.run, daemon=True)
    thread.start()
    return flow, thread


def _wait_samples(flow: Flow, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(flow.samples) < count:
        assert time.monotonic() < deadline, f"only {len(flow.samples)} samples answered"
        assert not flow.failures, flow.failures[:3]
        time.sleep(0.1)


def _stop(flow: Flow, thread: threading.Thread) -> None:
    flow.stopping.set()
    thread.join(timeout=180)
    ALL_SAMPLES.update(flow.samples)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_sync_update_drains_reloads_and_no_kv_crosses_versions(
    fleet: RlFleet, client: CoordinatorClient,
) -> None:
    cached = [500 - j % 400 for j in range(160)]  # five blocks, cached on both engines at v0
    for engine in fleet.engines:
        for _ in range(2):
            answer = complete(engine.proxy_url, MODEL, cached, 4)
            assert answer.sample is not None and answer.sample.version == 0, answer
        assert answer.sample.cached_tokens >= 128  # the second send hit the first's blocks

    def v0_indexed() -> bool:
        return set(client.lookup(cached, model=MODEL, policy_version=0).matches) == \
            {e.worker_id for e in fleet.engines}

    _until(v0_indexed, "both engines' v0 blocks in the index")

    flow, thread = _flowing(fleet, seed=1)
    try:
        _wait_samples(flow, 3 * GROUP)
        client.begin_policy_update(0, weights_uri="v1")
        state = client.commit_policy_update(1, timeout=COMMIT_S)
        assert sorted(state.acked_workers) == ["vllm-0", "vllm-1"], state
        assert state.fenced_workers == () and state.failures == {}
        after_commit = len(flow.samples)
        _wait_samples(flow, after_commit + 3 * GROUP)
    finally:
        _stop(flow, thread)
    assert flow.failures == []  # requests that came during the drain waited, none failed
    versions = {s.version for s in flow.samples.values()}
    assert versions == {0, 1}, versions
    # No v0 key left for either engine, and v0's KV is never reused under v1.
    assert client.lookup(cached, model=MODEL, policy_version=0).matches == {}
    for engine in fleet.engines:
        answer = complete(engine.proxy_url, MODEL, cached, 4)
        assert answer.sample is not None and answer.sample.version == 1
        assert answer.sample.cached_tokens == 0, f"{engine.worker_id} reused v0's KV under v1"
    _check_rollout_records(client, flow)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_an_async_update_keeps_routes_flowing_within_the_staleness_bound(
    fleet: RlFleet, client: CoordinatorClient,
) -> None:
    flow, thread = _flowing(fleet, seed=2)
    try:
        _wait_samples(flow, 2 * GROUP)
        began = time.monotonic()
        client.begin_policy_update(1, mode="async", weights_uri="v2")
        # No drain: routes keep flowing while the engines move one by one (and after, until
        # the commit), to whichever version is servable.
        _wait_samples(flow, len(flow.samples) + 2 * GROUP)
        state = client.commit_policy_update(2, timeout=COMMIT_S)
        committed = time.monotonic()
        assert sorted(state.acked_workers) == ["vllm-0", "vllm-1"], state
        _wait_samples(flow, len(flow.samples) + 2 * GROUP)
    finally:
        _stop(flow, thread)
    assert flow.failures == []
    during = [s for rid, s in flow.samples.items() if began < flow.answered_at[rid] < committed]
    after = [s for rid, s in flow.samples.items() if flow.answered_at[rid] > committed]
    assert during, "nothing was answered while the async update rolled"
    # While v1 -> v2 rolled, v1 and v2 were both servable (max_staleness 1); after it, v2 only.
    assert {s.version for s in during} <= {1, 2}
    assert {s.version for s in after} == {2}
    _check_rollout_records(client, flow)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_an_engine_that_cannot_load_is_fenced_and_the_other_serves(
    fleet: RlFleet, client: CoordinatorClient,
) -> None:
    client.begin_policy_update(2, weights_uri="v3")  # vllm-1's weights root has no v3
    state = client.commit_policy_update(3, timeout=COMMIT_S)
    assert state.version == 3 and state.acked_workers == ("vllm-0",), state
    assert state.fenced_workers == ("vllm-1",)
    assert list(state.failures) == ["vllm-1"] and "load" in state.failures["vllm-1"], state
    flow, thread = _flowing(fleet, seed=3)
    try:
        _wait_samples(flow, 2 * GROUP)
    finally:
        _stop(flow, thread)
    assert flow.failures == []
    assert {(s.worker, s.version) for s in flow.samples.values()} == {("vllm-0", 3)}
    fenced = fleet.engines[1]
    assert complete(fenced.proxy_url, MODEL, [5, 6, 7], 2).status == 503
    assert "vllm-1" not in {w.worker_id for w in client.workers() if w.state == "ready"}
    # Never silently left serving: the engine is paused, still tagged with the weights it had.
    import json
    import urllib.request

    with urllib.request.urlopen(f"{fenced.url}/is_paused", timeout=10) as answer:
        assert json.loads(answer.read())["is_paused"] is True
    with urllib.request.urlopen(f"{fenced.url}/weight_info", timeout=10) as answer:
        assert json.loads(answer.read())["weight_version"] == "2"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_every_sample_was_made_by_the_weights_it_names(
    fleet: RlFleet, checkpoints: dict[int, Path],
) -> None:
    python = vllm_python()
    assert python is not None
    samples = list(ALL_SAMPLES.values())
    assert {s.version for s in samples} == {0, 1, 2, 3}, "run the update tests first"
    wrong = regenerate(python, checkpoints, samples, fleet.log_dir, MODEL)
    assert wrong == [], f"{len(wrong)} of {len(samples)} samples differ from their version's " \
                        f"weights, e.g. {wrong[:2]}"


def _check_rollout_records(client: CoordinatorClient, flow: Flow) -> None:
    """Every sample's rollout record (reported by its engine's bridge, keyed by the request id
    the gateway passed on) names the same worker and version as the answer."""
    deadline = time.monotonic() + 30
    while True:
        records = {r.rollout_id: r for r in client.rollouts()}
        missing = [rid for rid in flow.samples if rid not in records]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert missing == [], f"{len(missing)} samples have no rollout record"
    for rid, sample in flow.samples.items():
        record = records[rid]
        assert (record.worker_id, record.policy_version) == (sample.worker, sample.version)
        assert record.completion_tokens == len(sample.tokens)


def _until(condition: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
