"""The ``kvcoord`` command line: its parser and ``main``, the console entry point. Its commands
and flags are a contract (ARCHITECTURE §0); what each command does is in
:mod:`kvcoord.cli_commands`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from coordinator.client.errors import KvcoordError
from kvcoord.cli_commands import COMMANDS
from kvcoord.cli_security import add_client_flags, add_identity_parser, add_server_flags
from worker.config import MODEL_SIZE_NAMES

DEFAULT_TARGET = "127.0.0.1:50051"


def _add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--coordinator", default=os.environ.get("KVCOORD_COORDINATOR", DEFAULT_TARGET),
        metavar="TARGETS", help="host:port, a comma-separated list, or dns:///name:port "
        "(env KVCOORD_COORDINATOR; default %(default)s)",
    )
    add_client_flags(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcoord", description="Distributed KV-cache coordinator for LLM inference fleets."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    coord = sub.add_parser("coordinator", help="run a coordinator (gRPC service)")
    coord.add_argument("--listen", help="HOST:PORT to serve on (default 127.0.0.1:50051)")
    coord.add_argument("--redis", metavar="URL", help="Redis URL; omit for the embedded store")
    coord.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    coord.add_argument("--metrics-host", help="the host /metrics binds (default: --listen's)")
    coord.add_argument("--page-size", type=int, help="tokens per KV page (default 16)")
    coord.add_argument("--routing-policy", help="kv_aware (default), round_robin, least_loaded")
    coord.add_argument("--replica-id", help="this replica's name among the replicas sharing "
                       "--redis (default <hostname>-<pid>-<random>)")
    coord.add_argument("--sync-frontends", type=int, metavar="N",
                       help="processes that read workers' Sync streams, on the ports after "
                       "--listen's (default 0: this process reads them)")
    coord.add_argument("--shard", help="this replica's shard (needs --redis): it applies only "
                       "its own workers' batches; leases and the policy are shared")
    coord.add_argument("--peer-shards", metavar="NAME=HOST:PORT[,...][;...]",
                       help="the other shards' replicas: routes take the cheapest worker of all")
    coord.add_argument("--log-level", help="debug, info (default), warning, error")
    add_server_flags(coord)

    work = sub.add_parser("worker", help="run a worker (reference engine, gRPC service, "
                          "coordinator agent)")
    work.add_argument("--coordinator", metavar="TARGETS", help="coordinator host:port, a "
                      "comma-separated list, or dns:///name:port (env KVCOORD_COORDINATOR)")
    work.add_argument("--listen", help="HOST:PORT of the Worker service (default 127.0.0.1:50061)")
    work.add_argument("--advertise", metavar="HOST:PORT",
                      help="address schedulers dial (required when listening on 0.0.0.0)")
    work.add_argument("--pages", type=int, help="KV pages in the pool (default 1024)")
    work.add_argument("--host-pages", type=int, metavar="N",
                      help="KV pages of a host-memory tier: evicted pages are kept there and "
                      "copied back on a hit (default 0: none; refused beyond the RAM available)")
    work.add_argument("--device", help="cpu, cuda or auto (default: cuda when present)")
    work.add_argument("--worker-id", help="default <hostname>-<port>")
    work.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    work.add_argument("--metrics-host", help="the host /metrics binds (default: --listen's)")
    work.add_argument("--http-listen", metavar="HOST:PORT",
                      help="serve the OpenAI-compatible /v1 endpoint here (default: none)")
    work.add_argument("--tokenizer", metavar="DIR", help="Hugging Face tokenizer directory for "
                      "the HTTP endpoint (default: the shipped reference tokenizer)")
    work.add_argument("--page-size", type=int, help="tokens per KV page (default 16)")
    work.add_argument("--model", help="model name (hash namespace; default 'default')")
    work.add_argument("--model-size", choices=MODEL_SIZE_NAMES,
                      help="the reference model's size (default tiny: prefill costs next to "
                      "nothing; small ~10M and bench ~23M parameters make it cost)")
    work.add_argument("--weights", metavar="FILE", help="safetensors weights (default: seeded)")
    work.add_argument("--log-level", help="debug, info (default), warning, error")
    add_server_flags(work)
    work.add_argument("--token-file", metavar="FILE",
                      help="file holding this worker's bearer token for the coordinator")
    work.add_argument("--tls-ca", metavar="FILE",
                      help="CA (PEM) that verifies the coordinator: TLS to it (with --tls-cert/"
                      "--tls-key also presented as this worker's client certificate)")

    route = sub.add_parser("route", help="ask where a prompt should go")
    _add_target(route)
    body = route.add_mutually_exclusive_group(required=True)
    body.add_argument("--tokens", help="comma-separated token ids")
    body.add_argument("--random", type=int, metavar="N", help="N pseudo-random token ids")
    route.add_argument("--seed", type=int, default=0, help="seed for --random")
    route.add_argument("--model")
    route.add_argument("--lookup", action="store_true", help="only look up, do not route")
    route.add_argument("--json", action="store_true", help="print JSON")
    route.add_argument("--timeout", type=float, default=10.0,
                       help="seconds to keep retrying while no worker can take it (default 10)")

    bridge = sub.add_parser("bridge", help="feed the coordinator from an unmodified vLLM or "
                            "SGLang engine's KV-cache events")
    bridge.add_argument("engine", choices=("vllm", "sglang"))
    _add_target(bridge)
    bridge.add_argument("--events", required=True, metavar="tcp://HOST:PORT",
                        help="the engine's KV-events publisher (ZMQ PUB)")
    bridge.add_argument("--replay", metavar="tcp://HOST:PORT",
                        help="the engine's replay socket (ZMQ ROUTER); without it a gap rebuilds")
    bridge.add_argument("--worker-id", required=True, help="this engine's worker id")
    bridge.add_argument("--worker-address", required=True, metavar="HOST:PORT",
                        help="where schedulers send this engine's requests")
    bridge.add_argument("--engine-url", metavar="URL", help="the engine's OpenAI-compatible "
                        "base URL (http://HOST:PORT), registered for gateways")
    bridge.add_argument("--model", default="default", help="model name (hash namespace)")
    bridge.add_argument("--page-size", type=int, help="tokens per page (default "
                        "KVCOORD_PAGE_SIZE or 16)")
    bridge.add_argument("--engine-block-size", type=int,
                        help="the engine's KV block size (default: the page size)")
    bridge.add_argument("--policy-version", type=int, default=0,
                        help="the weights version the engine serves at start (default 0)")
    bridge.add_argument("--no-policy-control", dest="policy_control", action="store_false",
                        help="keep the engine out of policy updates (an external worker that "
                        "serves only --policy-version)")
    bridge.add_argument("--http-listen", metavar="HOST:PORT",
                        help="policy control: serve the engine's OpenAI API here, each answer "
                        "tagged with its weight version (registered as the worker's URL)")
    bridge.add_argument("--weights", choices=("uri", "trainer"), default="uri",
                        help="policy control: the engine loads each update's weights_uri "
                        "(uri, default), or the trainer pushes them through the engine's "
                        "weight-transfer API and finishes with the version (trainer)")
    bridge.add_argument("--weights-root", metavar="DIR",
                        help="a relative weights_uri is a path under this directory")
    bridge.add_argument("--recover-interval-s", type=float, default=5.0,
                        help="a fenced engine tries to catch up with the fleet this often "
                        "(default 5)")
    bridge.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    bridge.add_argument("--metrics-host", metavar="HOST", help="the host /metrics binds "
                        "(default: --http-listen's host, else 127.0.0.1; 0.0.0.0 for every "
                        "interface)")
    bridge.add_argument("--log-level", help="debug, info (default), warning, error")

    dereg = sub.add_parser("deregister", help="take a worker out of the index now (a worker "
                           "pod's preStop hook)")
    _add_target(dereg)
    dereg.add_argument("--worker-id", required=True)

    status = sub.add_parser("status", help="workers, pages, load and hit rate")
    _add_target(status)
    status.add_argument("--json", action="store_true", help="print JSON")

    rollouts = sub.add_parser("rollouts", help="rollout attribution records (trainers)")
    rollouts_sub = rollouts.add_subparsers(dest="rollouts_command", required=True,
                                           metavar="SUBCOMMAND")
    tail = rollouts_sub.add_parser("tail", help="print rollout records from a cursor")
    _add_target(tail)
    tail.add_argument("--since", metavar="CURSOR", help="records strictly after this cursor "
                      "(default: from the oldest kept)")
    tail.add_argument("--follow", action="store_true", help="keep printing new records")
    tail.add_argument("--json", action="store_true", help="one JSON object per line")

    pol = sub.add_parser("policy", help="show or change the policy version (trainers)")
    pol_sub = pol.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    show = pol_sub.add_parser("show", help="the current version and phase")
    _add_target(show)
    show.add_argument("--json", action="store_true", help="print JSON")
    begin = pol_sub.add_parser("begin", help="start moving the fleet to the next version")
    _add_target(begin)
    begin.add_argument("--expected-version", type=int, required=True,
                       help="the version you believe is current (ABORTED when stale)")
    begin.add_argument("--mode", choices=("sync", "async"), default="sync")
    begin.add_argument("--weights", default="", metavar="URI",
                       help="weights the workers load (default: seeded by the version)")
    begin.add_argument("--abort-running", action="store_true",
                       help="sync mode: stop running generation instead of letting it finish")
    commit = pol_sub.add_parser("commit", help="wait for the barrier, then serve the version")
    _add_target(commit)
    commit.add_argument("--version", type=int, required=True)
    commit.add_argument("--timeout", type=float, default=30.0, help="barrier deadline (s)")
    abort = pol_sub.add_parser("abort", help="abandon an update, back to the current version")
    _add_target(abort)
    abort.add_argument("--version", type=int, required=True)

    bench = sub.add_parser("bench", help="run benchmarks (what `make bench` runs)")
    bench.add_argument("suite", nargs="?", default="all",
                       help="coordinator, worker, policy, replication, bridge, security or all "
                       "(default)")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    bench.add_argument("--out", type=Path, metavar="DIR",
                       help="write <suite>.json here (default: bench/results/ in the checkout)")
    bench.add_argument("--rig", metavar="NAMES", help="engines suite: production (engines on "
                       "core 0, routers and client on core 1), shared (an engine per core), "
                       "quota (an engine per core, each capped by a cgroup CPU quota: needs "
                       "root); comma-separated (default: production,shared; --quick: shared)")
    bench.add_argument("--regime", metavar="NAMES", help="engines suite: roomy (each engine "
                       "holds half the stream's distinct tokens), pressure (a quarter); "
                       "comma-separated (default: both; --quick: roomy)")
    bench.add_argument("--workload", metavar="NAMES", help="engines suite: trace (the Mooncake "
                       "synthetic trace), chat, agent (generated families); comma-separated "
                       "(default: trace)")
    bench.add_argument("--case", metavar="NAME", help="engines suite: one case, "
                       "WORKLOAD/RIG/REGIME (e.g. trace/quota/pressure: 4 engines; roomy: 2), "
                       "its JSON in bench/results/engines/WORKLOAD-RIG-REGIME.json")
    bench.add_argument("--allow-busy", action="store_true",
                       help="measure even when other processes use more than half a core at "
                       "the start (by default the run refuses, exit 2, naming them)")
    bench.add_argument("--coordinator", metavar="NAMES", help="engines suite: where our "
                       "routers' coordinator runs: embedded (in the gateway's process), "
                       "process (its own); comma-separated (default: embedded)")

    up = sub.add_parser("up", help="a local fleet (coordinator + workers), a demo workload "
                        "under kv_aware and round_robin, and a report")
    up.add_argument("--workers", type=int, default=3, help="reference workers (default 3)")
    up.add_argument("--redis", metavar="URL", help="Redis URL; omit for the embedded store")
    up.add_argument("--keep-running", action="store_true",
                    help="after the report, keep the fleet serving until Ctrl-C")
    up.add_argument("--serve", action="store_true",
                    help="after the report, keep the fleet running behind an OpenAI-compatible "
                    "gateway and print its URL (Ctrl-C stops everything)")
    up.add_argument("--scale", choices=("small", "default"), default="default",
                    help="workload size: small (CI, 36 requests) or default (160)")
    up.add_argument("--requests", type=int, metavar="N",
                    help="about N requests per routing policy (overrides --scale)")
    up.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                    help="the workers' device (default cpu: the reference model is small)")
    up.add_argument("--model-size", choices=MODEL_SIZE_NAMES,
                    help="the workers' reference model (default small, ~10M parameters: "
                    "prefill costs, so the report's TTFT shows what the cache saves)")
    up.add_argument("--pages", type=int,
                    help="KV pages per worker (default 256: less than the workload's working "
                    "set, as in production)")
    up.add_argument("--pidfile", metavar="FILE",
                    help="write the pid of every process started, one per line")

    sub.add_parser("demo", help="same as `kvcoord up` with its defaults (what `make demo` runs)")

    from kvcoord.epp.cli import add_epp_parser  # argparse only: cheap
    from kvcoord.gateway.cli import add_gateway_parser
    from kvcoord.simulate.cli import add_simulate_parser

    add_simulate_parser(sub)
    add_gateway_parser(sub)
    add_epp_parser(sub)
    add_identity_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KvcoordError as exc:
        print(f"kvcoord {args.command}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"kvcoord {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
