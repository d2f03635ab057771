"""Security flags of the ``kvcoord`` commands (docs/SECURITY.md).

Servers (``coordinator``, ``worker``) take the identities file, their TLS files and the rate
limit; the worker also takes what it presents to the coordinator. Client commands (``route``,
``status``, ``policy``, ...) take a bearer token and TLS files. Every flag has a ``KVCOORD_*``
variable; a token is read from a file (or ``KVCOORD_TOKEN``), never from a flag, so it does not
show in ``ps``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from coordinator.sdk_types import ClientTls, read_token_file


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of a serving process; each maps to the config field of the same name."""
    parser.add_argument("--auth-file", metavar="FILE",
                        help="TOML identities file: callers must authenticate (docs/SECURITY.md)")
    parser.add_argument("--tls-cert", metavar="FILE", help="this server's certificate (PEM)")
    parser.add_argument("--tls-key", metavar="FILE", help="this server's private key (PEM)")
    parser.add_argument("--tls-client-ca", metavar="FILE",
                        help="CA (PEM) client certificates must chain to: mutual TLS")
    parser.add_argument("--rate-limit-per-s", type=float, metavar="N",
                        help="calls per second per identity with auth on (default 2000; 0 off)")


def server_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in
            ("auth_file", "tls_cert", "tls_key", "tls_client_ca", "rate_limit_per_s")}


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """How a client command authenticates to the coordinator."""
    env = os.environ.get
    parser.add_argument("--token-file", metavar="FILE", default=env("KVCOORD_TOKEN_FILE"),
                        help="file holding a bearer token (env KVCOORD_TOKEN_FILE, or the "
                        "token itself in KVCOORD_TOKEN)")
    parser.add_argument("--tls-ca", metavar="FILE", default=env("KVCOORD_TLS_CA"),
                        help="CA (PEM) that verifies the coordinator: TLS on (env KVCOORD_TLS_CA)")
    parser.add_argument("--tls-cert", metavar="FILE", default=env("KVCOORD_TLS_CERT"),
                        help="client certificate (PEM) for mutual TLS (env KVCOORD_TLS_CERT)")
    parser.add_argument("--tls-key", metavar="FILE", default=env("KVCOORD_TLS_KEY"),
                        help="its private key (PEM) (env KVCOORD_TLS_KEY)")


def client_credentials(args: argparse.Namespace) -> dict[str, Any]:
    """``token`` and ``tls`` keyword arguments for ``CoordinatorClient``; ValueError (naming the
    file) when a file is unusable."""
    token = read_token_file(args.token_file) if args.token_file else None
    if token is None:
        token = os.environ.get("KVCOORD_TOKEN", "").strip() or None
    tls = None
    if args.tls_ca:
        tls = ClientTls.from_files(args.tls_ca, args.tls_cert, args.tls_key)
    elif args.tls_cert or args.tls_key:
        raise ValueError("--tls-cert/--tls-key need --tls-ca (the CA that verifies the server)")
    return {"token": token, "tls": tls}
