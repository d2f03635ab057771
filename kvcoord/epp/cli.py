"""The ``kvcoord epp`` command: its flags (each also a ``KVCOORD_*`` variable, as the
gateway's) and its runner. argparse only at import."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from kvcoord.gateway.cli import add_routing_flags, routing_flag_values

DEFAULT_LISTEN = "127.0.0.1:9002"  # the Gateway API Inference Extension's usual picker port


def add_epp_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    epp = sub.add_parser("epp", help="a Gateway API Inference Extension endpoint picker: "
                         "Envoy's ext_proc service, routing by the global prefix cache")
    add_routing_flags(epp)
    epp.add_argument("--listen", metavar="HOST:PORT", help="where Envoy's ext_proc streams "
                     f"and gRPC health checks connect (default {DEFAULT_LISTEN})")
    epp.add_argument("--max-body-bytes", type=int, metavar="BYTES",
                     help="a larger request body is answered 413 (default 8 MiB)")


def cmd_epp(args: argparse.Namespace) -> int:
    from coordinator.logs import configure_logging
    from coordinator.store.protocol import StoreUnavailable
    from kvcoord.epp.main import serve_forever
    from kvcoord.gateway.config import ConfigError, GatewayConfig
    from kvcoord.gateway.main import embedded_coordinator_config, load_tokenizer

    flags = {**routing_flag_values(args), "listen": args.listen,
             "max_body_bytes": args.max_body_bytes}
    if flags["listen"] is None and "KVCOORD_LISTEN" not in os.environ:
        flags["listen"] = DEFAULT_LISTEN
    try:
        config = GatewayConfig.from_sources(flags, os.environ)
        load_tokenizer(config)  # a bad directory is refused before anything starts
        config.own_token()
        embedded = embedded_coordinator_config(config, os.environ, coordinator_given=bool(
            args.coordinator or os.environ.get("KVCOORD_COORDINATOR")))
    except ConfigError as exc:
        print(f"kvcoord epp: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    try:
        with asyncio.Runner() as runner:
            return runner.run(serve_forever(config, embedded))
    except ConfigError as exc:
        print(f"kvcoord epp: {exc}", file=sys.stderr)
        return 2
    except StoreUnavailable as exc:  # the embedded coordinator's Redis is not up (yet)
        print(f"kvcoord epp: {exc}", file=sys.stderr)
        return 1
