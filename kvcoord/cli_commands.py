"""What each ``kvcoord`` command does: ``cmd_<command>(args) -> exit status``, and
:data:`COMMANDS`, the table :func:`kvcoord.cli.main` dispatches on.

``args`` is what :func:`kvcoord.cli.build_parser` parsed. A command returns the process's exit
status (2 for a configuration it refuses); ``main`` turns a ``KvcoordError`` escaping one into
1, a ``ValueError`` into 2 and Ctrl-C into 130. Servers, clients and engines are imported
inside each command, so parsing (``kvcoord --help``) stays light.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from dataclasses import asdict

from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.store.protocol import StoreUnavailable
from kvcoord.cli_security import client_credentials, cmd_identity, server_flags
from kvcoord.epp.cli import cmd_epp
from kvcoord.gateway.cli import cmd_gateway


def _tokens(args: argparse.Namespace) -> list[int]:
    if args.tokens is not None:
        try:
            return [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise SystemExit(
                f"kvcoord: --tokens must be comma-separated integers: {args.tokens}"
            ) from None
    rng = random.Random(args.seed)
    return [rng.randrange(32_000) for _ in range(args.random)]


def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator.logs import configure_logging
    from coordinator.server.main import serve_forever

    flags = {
        "listen": args.listen, "redis": args.redis, "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "page_size": args.page_size, "routing_policy": args.routing_policy,
        "replica_id": args.replica_id, "sync_frontends": args.sync_frontends,
        "shard": args.shard, "peer_shards": args.peer_shards,
        "log_level": args.log_level, **server_flags(args),
    }
    try:
        config = CoordinatorConfig.from_sources(flags, os.environ)
    except ConfigError as exc:
        print(f"kvcoord coordinator: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    try:
        asyncio.run(serve_forever(config))
    except StoreUnavailable as exc:  # Redis not up (yet): one line, and a restart will retry
        print(f"kvcoord coordinator: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # found at start: a --metrics-host that cannot be bound
        print(f"kvcoord coordinator: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from coordinator.logs import configure_logging
    from worker.config import WorkerConfig
    from worker.main import serve_forever

    flags = {
        "coordinator": args.coordinator, "listen": args.listen, "advertise": args.advertise,
        "pages": args.pages, "host_pages": args.host_pages, "device": args.device,
        "worker_id": args.worker_id,
        "metrics_port": args.metrics_port, "metrics_host": args.metrics_host,
        "page_size": args.page_size, "http_listen": args.http_listen, "tokenizer": args.tokenizer,
        "model_name": args.model, "model_size": args.model_size, "weights": args.weights,
        "log_level": args.log_level,
        "token_file": args.token_file, "tls_ca": args.tls_ca, **server_flags(args),
    }
    try:
        config = WorkerConfig.from_sources(flags, os.environ)
    except ConfigError as exc:
        print(f"kvcoord worker: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    try:
        return asyncio.run(serve_forever(config))
    except ConfigError as exc:  # found at start: the tokenizer of --http-listen, --metrics-host
        print(f"kvcoord worker: {exc}", file=sys.stderr)
        return 2


def cmd_route(args: argparse.Namespace) -> int:
    from coordinator.client import CoordinatorClient

    tokens = _tokens(args)
    credentials = client_credentials(args)
    with CoordinatorClient(args.coordinator, timeout=args.timeout, **credentials) as client:
        if args.lookup:
            result = client.lookup(tokens, model=args.model)
            out = {"matches": result.matches, "policy_version": result.policy_version,
                   "prompt_pages": result.prompt_pages}
        else:
            out = asdict(client.route(tokens, model=args.model))
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>16}: {value}")
    return 0


def cmd_bridge(args: argparse.Namespace) -> int:
    from coordinator.logs import configure_logging
    from worker.bridge.main import serve_bridge

    try:
        from worker.bridge.bridge import BridgeConfig
    except ImportError as exc:  # the optional group is not installed
        print(f"kvcoord bridge: {exc}: pip install 'kvcoord[bridge]'", file=sys.stderr)
        return 2
    page_size = args.page_size or int(os.environ.get("KVCOORD_PAGE_SIZE", "16"))
    try:
        config = BridgeConfig(
            events=args.events, coordinator=args.coordinator, worker_id=args.worker_id,
            worker_address=args.worker_address, model=args.model, page_size=page_size,
            engine_block_size=args.engine_block_size, replay=args.replay,
            policy_version=args.policy_version, hash_key=os.environ.get("KVCOORD_HASH_KEY"),
            engine=args.engine, engine_url=args.engine_url or "",
            policy_control=args.policy_control, http_listen=args.http_listen,
            weights=args.weights, weights_root=args.weights_root,
            recover_interval_s=args.recover_interval_s,
            metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        )
    except ValueError as exc:
        print(f"kvcoord bridge: {exc}", file=sys.stderr)
        return 2
    credentials = client_credentials(args)
    configure_logging(args.log_level or os.environ.get("KVCOORD_LOG_LEVEL", "info"))
    return asyncio.run(serve_bridge(config, **credentials))


def cmd_deregister(args: argparse.Namespace) -> int:
    from coordinator.client import CoordinatorClient

    with CoordinatorClient(args.coordinator, **client_credentials(args)) as client:
        removed = client.deregister(args.worker_id)
    print(f"worker {args.worker_id}: " + ("deregistered" if removed else "not registered"))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from coordinator.client import CoordinatorClient
    from kvcoord.tables import render_table

    with CoordinatorClient(args.coordinator, **client_credentials(args)) as client:
        workers = client.workers()
        stats = client.stats()
    if args.json:
        print(json.dumps({"stats": asdict(stats), "workers": [asdict(w) for w in workers]}))
        return 0
    print(
        f"coordinator {args.coordinator}  store={stats.store}  policy v{stats.policy_version} "
        f"({stats.policy_phase})  index: {stats.index_keys} keys, {stats.index_entries} entries, "
        f"{stats.pending_entries} pending  routes={stats.routes}  hit={stats.hit_ratio:.1%}"
    )
    if stats.replica_id:
        print(
            f"replica {stats.replica_id}  live replicas: {', '.join(stats.replicas)}  "
            f"replication lag p50/p99: {stats.replication_lag_p50_ms:.1f}/"
            f"{stats.replication_lag_p99_ms:.1f} ms"
        )
    # Pages per tier: the index's holdings / the pool registered (disk: holdings only).
    rows = [
        [w.worker_id, w.address, w.state, f"v{w.policy_version}", str(w.incarnation),
         f"{w.cached_gpu_pages}/{w.total_pages}", f"{w.cached_cpu_pages}/{w.host_pages}",
         str(w.cached_disk_pages), str(w.free_pages), str(w.running_requests),
         str(w.queued_tokens), str(w.inflight_routes), f"{w.prefill_backlog_tokens:.0f}",
         f"{w.prefill_tokens_per_s:.0f}", f"{w.prefill_route_seconds * 1000:.0f}",
         f"{w.prefill_attention_tokens:.0f}" if w.prefill_attention_tokens else "-",
         str(w.routed_requests),
         f"{w.hit_ratio:.1%}", w.owner_replica or "-"]
        for w in workers
    ]
    print(render_table(
        ["worker", "address", "state", "policy", "inc", "gpu pages", "host pages", "disk",
         "free", "running", "queued", "inflight", "backlog", "prefill/s", "ms/route",
         "attention", "routed",
         "hit",
         "replica"], rows,
    ))
    return 0


_ROLLOUT_FIELDS = ("cursor", "rollout_id", "policy_version", "worker_id", "prompt_tokens",
                   "cached_tokens", "completion_tokens")


def cmd_rollouts(args: argparse.Namespace) -> int:
    """``rollouts tail``: one line per record, oldest first, flushed as it arrives."""
    from coordinator.client import CoordinatorClient

    with CoordinatorClient(args.coordinator, **client_credentials(args)) as client:
        for record in client.rollouts(since=args.since, follow=args.follow):
            values = {name: getattr(record, name) for name in _ROLLOUT_FIELDS}
            if args.json:
                line = json.dumps(values)
            else:
                line = (f"{record.cursor}  {record.rollout_id}  v{record.policy_version}  "
                        f"{record.worker_id}  prompt={record.prompt_tokens} "
                        f"cached={record.cached_tokens} completion={record.completion_tokens}")
            print(line, flush=True)
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    from coordinator.client import CoordinatorClient

    with CoordinatorClient(args.coordinator, timeout=getattr(args, "timeout", 10.0) + 5,
                           **client_credentials(args)) as c:
        action = args.policy_command
        if action == "show":
            state = c.policy()
        elif action == "begin":
            state = c.begin_policy_update(args.expected_version, args.mode, args.weights,
                                          args.abort_running)
        elif action == "commit":
            state = c.commit_policy_update(args.version, timeout=args.timeout)
        else:
            state = c.abort_policy_update(args.version)
    if getattr(args, "json", False):
        print(json.dumps(asdict(state)))
        return 0
    target = f" -> v{state.target_version}" if state.target_version is not None else ""
    print(f"policy v{state.version}{target} ({state.phase}, {state.mode})")
    if state.acked_workers or state.fenced_workers:
        print(f"acked: {', '.join(state.acked_workers) or '-'}")
        print(f"fenced: {', '.join(state.fenced_workers) or '-'}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from kvcoord.bench_runner import run

    options = {name: value for name in ("rig", "regime", "workload", "coordinator", "case")
               if (value := getattr(args, name)) is not None}
    return run(args.suite, quick=args.quick, out=args.out, options=options,
               allow_busy=args.allow_busy)


def cmd_up(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvcoord.demo_workload import SCALES, WorkloadSpec
    from kvcoord.up import UpOptions, run_up

    spec = WorkloadSpec.for_requests(args.requests or SCALES[args.scale])
    return run_up(UpOptions(
        workers=args.workers, redis=args.redis, keep_running=args.keep_running,
        serve=args.serve, spec=spec,
        device=args.device, pidfile=Path(args.pidfile) if args.pidfile else None,
        **({} if args.pages is None else {"pages": args.pages}),
        **({} if args.model_size is None else {"model_size": args.model_size}),
    ))


def cmd_simulate(args: argparse.Namespace) -> int:
    from kvcoord.simulate.cli import run_simulate

    return run_simulate(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvcoord.demo import run_demo

    return run_demo()


COMMANDS = {
    "policy": cmd_policy,
    "coordinator": cmd_coordinator, "worker": cmd_worker, "route": cmd_route, "status": cmd_status,
    "rollouts": cmd_rollouts, "bench": cmd_bench, "demo": cmd_demo, "up": cmd_up,
    "simulate": cmd_simulate, "deregister": cmd_deregister, "bridge": cmd_bridge,
    "identity": cmd_identity, "gateway": cmd_gateway, "epp": cmd_epp,
}
