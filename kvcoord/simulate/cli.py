"""``kvcoord simulate``: its arguments and its command (wired into ``kvcoord/cli.py``).

Only argparse is imported at module level, so building the CLI parser stays cheap.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcoord.simulate.trace import TraceRequest


def add_simulate_parser(sub: Any) -> None:
    """Add the ``simulate`` subcommand to ``sub`` (an argparse subparsers action)."""
    sim: argparse.ArgumentParser = sub.add_parser(
        "simulate", help="replay a Mooncake-format trace (or a generated workload) through the "
        "real index and router with simulated workers",
    )
    source = sim.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE",
                        help="JSON Lines: timestamp (ms), input_length, output_length, hash_ids")
    source.add_argument("--workload", metavar="NAME",
                        help="generate the requests instead, seeded by --seed: chat, agent, "
                        "grpo, rag (docs/SIMULATOR.md, 'Generated workloads')")
    sim.add_argument("--requests", type=int, metavar="N",
                     help="with --workload: how many requests to generate (default: the "
                     "family's own, sized for 8 workers x 500,000 tokens)")
    sim.add_argument("--write-trace", metavar="FILE",
                     help="with --workload: write the generated requests to FILE as a "
                     "Mooncake trace and stop (no --workers needed); --trace FILE replays them")
    sim.add_argument("--workers", type=int, metavar="N",
                     help="simulated workers (required unless --write-trace)")
    sim.add_argument("--capacity-tokens", type=int, default=500_000, metavar="N",
                     help="KV capacity per worker in tokens (default %(default)s: an 80 GB GPU "
                     "serving Llama-3-8B in bf16)")
    sim.add_argument("--host-capacity-tokens", default="0", metavar="N",
                     help="host-memory KV capacity per worker in tokens (default 0: no host "
                     "tier); a page the device evicts moves there and a hit there is copied "
                     "back")
    sim.add_argument("--policy", action="extend", nargs="+", metavar="NAME",
                     help="round_robin, least_loaded, kv_aware, sglang_like, dynamo_like "
                     "(default: all)")
    sim.add_argument("--json", metavar="FILE", help="write the results as JSON")
    sim.add_argument("--plot", metavar="FILE", help="write a PNG (needs matplotlib)")
    sim.add_argument("--limit", type=int, metavar="N", help="only the first N requests")
    sim.add_argument("--seed", type=int, default=0,
                     help="first seed (default 0); a seed jitters arrivals and breaks ties")
    sim.add_argument("--seeds", type=int, default=3, metavar="N",
                     help="run each policy under N seeds: --seed, --seed+1, ... (default "
                     "%(default)s); the table shows mean and min-max")
    sim.add_argument("--jitter-ms", type=float, default=250.0, metavar="MS",
                     help="each arrival is delayed by a seeded uniform amount in [0, MS) "
                     "(default %(default)s)")
    sim.add_argument("--page-size", type=int, default=512, metavar="N",
                     help="tokens per KV page (default %(default)s: one trace block)")


def run_simulate(args: argparse.Namespace) -> int:
    """Run the simulation, print the table (stdout), write --json/--plot; progress on stderr.
    With ``--write-trace`` only write the generated workload (a line on stdout says where).

    The requests come from ``--trace FILE`` or ``--workload NAME`` (exactly one; argparse
    refuses neither or both); a generated workload is named ``workload:NAME`` in the report.
    Bad input raises ValueError (the CLI prints it and exits 2)."""
    from kvcoord.progress import Progress
    from kvcoord.simulate.engine import ROUTERS, check_policies
    from kvcoord.simulate.report import render, write_json, write_plot
    from kvcoord.simulate.runner import simulate

    if args.write_trace is not None:
        _source(args)
        return 0
    if args.workers is None:
        raise ValueError("--workers N is required (how many workers to simulate)")
    names = check_policies(args.policy or list(ROUTERS))
    host_tokens = _whole_tokens(args.host_capacity_tokens)
    if args.plot:
        _require_matplotlib()  # fail before minutes of simulation, not after
    trace = _source(args)
    bar: list[Progress] = []

    def on_phase(policy: str, requests: int) -> Callable[[int], None]:
        if not bar:
            bar.append(Progress(requests * len(names) * args.seeds))
        bar[0].set_phase(policy)
        return bar[0].advance

    try:
        report = simulate(
            trace, trace_name=f"workload:{args.workload}", workers=args.workers,
            capacity_tokens=args.capacity_tokens, host_capacity_tokens=host_tokens,
            policies=names, page_size=args.page_size, limit=args.limit, seed=args.seed,
            seeds=args.seeds, arrival_jitter_ms=args.jitter_ms, progress=on_phase,
        )
    finally:
        if bar:
            bar[0].close()
    print(render(report))
    if args.json:
        write_json(report, args.json)
    if args.plot:
        write_plot(report, args.plot)
    return 0


def _source(args: argparse.Namespace) -> str | list[TraceRequest]:
    """The trace path, or the generated requests (written out when --write-trace asks).
    ValueError for an unknown workload (naming the known ones) or a flag that needs
    --workload given without it."""
    if args.trace is not None:
        for flag, value in (("--requests", args.requests), ("--write-trace", args.write_trace)):
            if value is not None:
                raise ValueError(f"{flag} applies to --workload only (use --limit with --trace)")
        return str(args.trace)
    from kvcoord.simulate.workloads import generate, jsonl

    requests = generate(args.workload, requests=args.requests, seed=args.seed)
    if args.write_trace is not None:
        jsonl.write(requests, args.write_trace)
        print(f"wrote {len(requests)} requests of workload {args.workload} (seed {args.seed}) "
              f"to {args.write_trace}")
    return requests


def _whole_tokens(text: str) -> int:
    """``--host-capacity-tokens``' value as an int >= 0; ValueError with one line otherwise
    (parsed here, not by argparse, whose refusal is a usage block)."""
    try:
        tokens = int(text, 10)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ValueError(f"--host-capacity-tokens must be a whole number of tokens >= 0 "
                         f"(0: no host tier), got {text!r}")
    return tokens


def _require_matplotlib() -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "--plot needs matplotlib: pip install 'kvcoord[plot]' (or pip install matplotlib)"
        )
