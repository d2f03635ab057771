"""The ``kvcoord gateway`` command: its flags (each also a ``KVCOORD_*`` variable) and its
runner. argparse only at import: the gateway's stack is imported when the command runs."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable


def add_routing_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every front door that routes through the coordinator takes (``kvcoord
    gateway`` and ``kvcoord epp``: both read a ``GatewayConfig``)."""
    parser.add_argument("--coordinator", metavar="TARGETS", help="coordinator host:port, a "
                        "comma-separated list, or dns:///name:port (env KVCOORD_COORDINATOR)")
    parser.add_argument("--embed-coordinator", metavar="HOST:PORT", help="run a coordinator "
                        "in this process, listening here for workers and bridges (its other "
                        "settings from KVCOORD_* variables), and route to it without an RPC; "
                        "instead of --coordinator (env KVCOORD_EMBED_COORDINATOR)")
    parser.add_argument("--tokenizer", metavar="DIR", help="the engines' Hugging Face "
                        "tokenizer directory (default: the shipped reference tokenizer)")
    parser.add_argument("--model", help="the model name clients ask for (default 'default')")
    parser.add_argument("--adapter", dest="adapters", action="append", metavar="NAME",
                        help="a LoRA adapter the engines serve (vLLM --lora-modules "
                        "NAME=...): requests naming it as their model are routed in its "
                        "namespace; repeatable (env KVCOORD_ADAPTERS, comma-separated)")
    parser.add_argument("--max-context", type=int, metavar="TOKENS",
                        help="context length (default: the tokenizer's model_max_length)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here")
    parser.add_argument("--metrics-host", metavar="HOST", help="the host /metrics binds "
                        "(default: --listen's host; 0.0.0.0 for every interface)")
    parser.add_argument("--drain-wait-ms", type=int,
                        help="how long a request waits out a policy drain (default 30000)")
    parser.add_argument("--token-file", metavar="FILE", help="this process's own bearer "
                        "token, only for readiness (requests carry their client's token)")
    parser.add_argument("--tls-ca", metavar="FILE", help="CA (PEM) verifying the coordinator")
    parser.add_argument("--log-level", help="debug, info (default), warning, error")


ROUTING_FLAGS = ("coordinator", "embed_coordinator", "tokenizer", "model", "max_context",
                 "metrics_port", "metrics_host", "drain_wait_ms", "token_file", "tls_ca",
                 "log_level")
"""``add_routing_flags``' destinations, as ``GatewayConfig`` fields (``adapters`` aside: a
list on the command line, a tuple in the config)."""


def routing_flag_values(args: argparse.Namespace) -> dict[str, object]:
    """``add_routing_flags``' values by config field (None: not given)."""
    flags: dict[str, object] = {name: getattr(args, name) for name in ROUTING_FLAGS}
    flags["adapters"] = tuple(args.adapters) if args.adapters else None
    return flags


def add_gateway_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gateway = sub.add_parser("gateway", help="an OpenAI-compatible endpoint that routes each "
                             "request by the global prefix cache")
    add_routing_flags(gateway)
    gateway.add_argument("--listen", metavar="HOST:PORT",
                         help="where clients connect (default 127.0.0.1:8080)")
    gateway.add_argument("--route-retries", type=int,
                         help="re-routes when a worker fails before its first byte (default 2)")


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (the ``gateway`` extra has it): the proxy's per-chunk
    and per-connection work costs less CPU there; None, asyncio's own, otherwise."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def cmd_gateway(args: argparse.Namespace) -> int:
    from coordinator.logs import configure_logging
    from coordinator.store.protocol import StoreUnavailable
    from kvcoord.gateway.config import ConfigError, GatewayConfig
    from kvcoord.gateway.main import embedded_coordinator_config, load_tokenizer, serve_forever

    flags = {**routing_flag_values(args), "listen": args.listen,
             "route_retries": args.route_retries}
    try:
        config = GatewayConfig.from_sources(flags, os.environ)
        load_tokenizer(config)  # a bad directory is refused before anything starts
        config.own_token()  # and so is a token file that holds no token
        embedded = embedded_coordinator_config(config, os.environ, coordinator_given=bool(
            args.coordinator or os.environ.get("KVCOORD_COORDINATOR")))
    except ConfigError as exc:
        print(f"kvcoord gateway: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(serve_forever(config, embedded))
    except ConfigError as exc:
        print(f"kvcoord gateway: {exc}", file=sys.stderr)
        return 2
    except StoreUnavailable as exc:  # the embedded coordinator's Redis is not up (yet)
        print(f"kvcoord gateway: {exc}", file=sys.stderr)
        return 1
