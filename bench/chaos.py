"""``make chaos``: faults injected, round after round, into the multi-host cluster of
``tests/multihost_cluster.py`` (Redis on ``db``, coordinator replicas ``c1`` and ``c2``, workers
``w1``..``w3``, each in its own network namespace), with generation running on every replica
throughout, and what each fault kind does to the invariants and to availability. Prints a table,
each figure beside its target with a verdict ("-" where nothing was at stake), and writes
``chaos.json``: provenance, the definitions, every round and every raw sample.

The faults and the rounds are ``bench/chaos_faults.py`` (``chaos_round.py`` around them); the
threads that route on each replica ``bench/chaos_watch.py``; generation and the rollout
reconciliation ``bench/chaos_load.py``; after the rounds, ``bench/chaos_lag.py`` measures c2's
replication lag under steady page events on c1. ``bench/chaos_report.py`` defines every figure.

    python -m bench.chaos [--rounds N] [--out DIR]    # the full run (make chaos), as root
    python -m bench.chaos --quick --out DIR           # one round of each fault, short lag phase

Exit status: 1 when an invariant breaks (a stale route, a policy violation, a lost rollout
record, replica digests differing, a round that could not finish or a crash) or, in a full run,
a target is missed. A missing capability (not root, no ``ip``, ``redis-server`` or ``nft``) is
a failure under CI (``CI=true``); otherwise the run is skipped with the reason printed (exit 0
for ``--quick``, 2 for a full run, which someone asked for by name). Without ``nft`` outside
CI, only the nftables faults are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

from bench.chaos_faults import FAULTS, nft_missing, run_round, schedule
from bench.chaos_lag import LagProbeEnded, sustained_lag
from bench.chaos_report import (
    DEFINITIONS,
    invariants_broken,
    lag_rows,
    summarize,
    table_rows,
)
from bench.chaos_round import POLICY_STALE_S, Chaos, Round
from bench.chaos_watch import STALE_SLACK_S
from coordinator.client import KvcoordError
from coordinator.logs import configure_logging
from kvcoord import machine_load
from kvcoord.provenance import provenance
from kvcoord.tables import render_table
from tests.multihost_cluster import LAG_BOUND_S, LEASE_S, PAGE, REPLICAS, running_cluster

OUT_DIR = Path(__file__).resolve().parent / "results"
LAG_RATE = 250  # page-event batches per second, from one scripted worker on c1
LAG_SECONDS = 18.0  # at LAG_RATE, more events than c2's lag window (4096) holds
QUICK_LAG_SECONDS = 2.0  # exercises the phase; too short to fill the window, so not judged


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"true", "1"}


def _preflight() -> str | None:
    """Why this machine cannot run chaos at all, or None."""
    if not sys.platform.startswith("linux") or shutil.which("ip") is None:
        return "needs Linux with iproute2 (`ip netns`)"
    if os.geteuid() != 0:
        return "needs root (network namespaces): run `sudo make chaos`"
    if shutil.which("redis-server") is None:
        return "needs redis-server on PATH (apt-get install redis-server)"
    return None


def _round_json(rnd: Round, began: float) -> dict[str, Any]:
    """The round with its times in seconds since the run began."""
    out = {**asdict(rnd), "recovery_s": rnd.recovery_s}
    for key in ("began", "fault_at", "repaired_at", "recovered_at", "ended"):
        if out[key] is not None:
            out[key] = round(out[key] - began, 3)
    return out


def _samples_json(chaos: Chaos, began: float) -> dict[str, Any]:
    """Every route sample as ``[t, replica, worker or null, version or null, error]`` and
    every generation as ``[t sent, t answered, replica, rollout id, worker, route version,
    version, error]`` (t: seconds since the run began), and every commit."""
    def t(x: float) -> float:
        return round(x - began, 3)
    return {
        "routes": [[t(s.sent), s.replica, s.worker_id, s.version, s.error]
                   for s in chaos.watch.routes],
        "generations": [[t(g.sent), t(g.answered), g.replica, g.rollout_id, g.worker_id,
                         g.route_version, g.version, g.error] for g in chaos.load.generations],
        "commits": [{**asdict(c), "begun": t(c.begun), "returned": t(c.returned)}
                    for c in chaos.watch.commits],
    }


def _run_rounds(chaos: Chaos, plan: list[tuple[str, int]]) -> list[Round]:
    rounds: list[Round] = []
    for kind, index in plan:
        rnd = run_round(chaos, kind, index)
        rounds.append(rnd)
        recovery = "-" if rnd.recovery_s is None else f"{rnd.recovery_s:.2f} s"
        print(f"  {kind:<17} #{index} victim {rnd.victim:<3} recovery {recovery}"
              + (f"  ERROR {rnd.error}" if rnd.error else ""), flush=True)
        if rnd.error:
            break  # the fleet is not whole: later rounds would measure the wreck
    return rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each fault kind")
    parser.add_argument("--quick", action="store_true",
                        help="one round of each fault, a short lag phase (the CI smoke run)")
    parser.add_argument("--lag-rate", type=int, default=LAG_RATE, help="batches/s on c1")
    parser.add_argument("--lag-seconds", type=float, default=None)
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated fault kinds (default all: {','.join(FAULTS)})")
    parser.add_argument("--out", type=Path, default=OUT_DIR,
                        help="directory for chaos.json (default bench/results/), or a "
                             "path ending in .json")
    parser.add_argument("--allow-busy", action="store_true",
                        help="run even when other processes use more than half a core at the "
                        "start (by default it refuses, exit 2, naming them)")
    args = parser.parse_args(argv)
    kinds = [k for k in args.faults.split(",") if k]
    if unknown := sorted(set(kinds) - set(FAULTS)):
        parser.error(f"--faults: unknown fault kinds {unknown}; known: {', '.join(FAULTS)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    rounds_each = 1 if args.quick else args.rounds
    lag_seconds = args.lag_seconds or (QUICK_LAG_SECONDS if args.quick else LAG_SECONDS)
    out_dir = args.out.parent if args.out.suffix == ".json" else args.out
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {args.out}: cannot create {out_dir} ({exc.strerror})")
    problem = _preflight() or (nft_missing() if _in_ci() else None)
    if problem:
        if _in_ci():
            print(f"chaos: FAILED: {problem} (CI=true: chaos must run)", file=sys.stderr)
            return 1
        print(f"chaos: skipped: {problem}", file=sys.stderr)
        return 0 if args.quick else 2
    if (no_nft := nft_missing()) is not None:
        kinds = [k for k in kinds if not FAULTS[k].needs_nft]
        print(f"chaos: skipping the nftables faults: {no_nft}", file=sys.stderr)
    machine = machine_load.measure()
    if machine.busy() and not args.allow_busy:
        print(machine.refusal("chaos"), file=sys.stderr)
        return 2
    configure_logging("error")  # the SDK's hashing warning; the fleet logs to files
    logs = Path(tempfile.mkdtemp(prefix="kvcoord-chaos-logs-"))
    began = time.monotonic()
    rounds: list[Round] = []
    lag: dict[str, Any] | None = None
    crash: str | None = None
    with running_cluster(logs) as cluster:
        chaos = Chaos(cluster)
        chaos.watch.start()
        chaos.load.start()
        try:
            # One healthy update first: from then on every route is checked for its version.
            warmup = chaos.update(0)
            print(f"  warm-up sync update 0 -> {warmup.version}", flush=True)
            rounds = _run_rounds(chaos, schedule(rounds_each, kinds))
        except (KvcoordError, AssertionError) as exc:
            crash = f"warm-up update: {type(exc).__name__}: {exc}"
        finally:
            chaos.load.stop()
            chaos.watch.stop()
        if crash is None and not any(r.error for r in rounds):
            try:
                lag = asyncio.run(sustained_lag(cluster.target("c1"), cluster.target("c2"),
                                                args.lag_rate, lag_seconds, page_size=PAGE))
            except (LagProbeEnded, grpc.RpcError, KvcoordError, EOFError, TimeoutError) as exc:
                crash = f"sustained lag: {type(exc).__name__}: {exc}"
                print(f"  {crash}", flush=True)
    summary = summarize(rounds, chaos.watch, chaos.load, began)
    rows = table_rows(summary)
    if lag is not None:
        rows += lag_rows(lag, judged=not args.quick)
    # Redis keeps the stream across its restarts here (AOF, fsync always): a replica that
    # reports it lost re-publishes and re-asks every worker's snapshot for nothing.
    resnapshots = {r: (logs / f"{r}.log").read_text(errors="replace").count(
        '"replication.stream_lost"') for r in REPLICAS}
    rows.append(["whole run (the stream is never lost)",
                 "re-snapshots for a 'lost' stream (log)", str(sum(resnapshots.values())), "-",
                 "-"])
    print()
    print(render_table(["fault", "measure", "value", "target", "verdict"], rows))
    print("\n".join(f"\n{name}: {text}" for name, text in DEFINITIONS.items()))
    broken = invariants_broken(summary) + ([crash] if crash else [])
    results = {
        **provenance(), "machine_at_start": machine.as_json(),
        "definitions": DEFINITIONS, "summary": summary, "lag": lag,
        "invariants_broken": broken, "stream_lost_warnings": resnapshots,
        "rounds": [_round_json(r, began) for r in rounds],
        "config": {"rounds": rounds_each, "quick": args.quick, "kinds": kinds,
                   "lease_s": LEASE_S, "lag_bound_s": LAG_BOUND_S,
                   "policy_stale_s": POLICY_STALE_S, "stale_slack_s": STALE_SLACK_S,
                   "cpus": os.cpu_count(), "wall_s": time.monotonic() - began},
        "samples": _samples_json(chaos, began),
    }
    out = args.out if args.out.suffix == ".json" else args.out / "chaos.json"
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"\nwrote {out} ({time.monotonic() - began:.0f} s; fleet logs in {logs})")
    if broken:
        print("chaos: invariants broken:\n  " + "\n  ".join(broken), file=sys.stderr)
        return 1
    missed = any(row[-1] == "MISSED" for row in rows)
    return 1 if (missed and not args.quick) or lag is None else 0


if __name__ == "__main__":
    sys.exit(main())
