"""Security flags of the ``kvcoord`` commands (docs/SECURITY.md).

Servers (``coordinator``, ``worker``) take the identities file, their TLS files and the rate
limit; the worker also takes what it presents to the coordinator. Client commands (``route``,
``status``, ``policy``, ...) take a bearer token and TLS files. Every flag has a ``KVCOORD_*``
variable; a token is read from a file (or ``KVCOORD_TOKEN``), never from a flag, so it does not
show in ``ps``. ``kvcoord identity new`` mints a token and prints its identities-file entry.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from typing import Any

from coordinator.client.channels import ClientTls, read_token_file
from coordinator.rpc.identities import IdentityFileError, IdentityTable, Role, token_digest


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


TOKEN_VARIABLE = "KVCOORD_TOKEN"
CLIENT_FILE_VARIABLES = {"token_file": "KVCOORD_TOKEN_FILE", "tls_ca": "KVCOORD_TLS_CA",
                         "tls_cert": "KVCOORD_TLS_CERT", "tls_key": "KVCOORD_TLS_KEY"}
"""The environment variables client commands read (flag destination -> variable)."""


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """How a client command authenticates to the coordinator."""
    env = {dest: os.environ.get(name) for dest, name in CLIENT_FILE_VARIABLES.items()}
    parser.add_argument("--token-file", metavar="FILE", default=env["token_file"],
                        help="file holding a bearer token (env KVCOORD_TOKEN_FILE, or the "
                        "token itself in KVCOORD_TOKEN)")
    parser.add_argument("--tls-ca", metavar="FILE", default=env["tls_ca"],
                        help="CA (PEM) that verifies the coordinator: TLS on (env KVCOORD_TLS_CA)")
    parser.add_argument("--tls-cert", metavar="FILE", default=env["tls_cert"],
                        help="client certificate (PEM) for mutual TLS (env KVCOORD_TLS_CERT)")
    parser.add_argument("--tls-key", metavar="FILE", default=env["tls_key"],
                        help="its private key (PEM) (env KVCOORD_TLS_KEY)")


def client_credentials(args: argparse.Namespace) -> dict[str, Any]:
    """``token`` and ``tls`` keyword arguments for ``CoordinatorClient``; ValueError (naming the
    file) when a file is unusable."""
    token = read_token_file(args.token_file) if args.token_file else None
    if token is None:
        token = os.environ.get(TOKEN_VARIABLE, "").strip() or None
    tls = None
    if args.tls_ca:
        tls = ClientTls.from_files(args.tls_ca, args.tls_cert, args.tls_key)
    elif args.tls_cert or args.tls_key:
        raise ValueError("--tls-cert/--tls-key need --tls-ca (the CA that verifies the server)")
    return {"token": token, "tls": tls}


def add_identity_parser(sub: Any) -> None:
    """``kvcoord identity new``: mint a token and print its identities-file entry."""
    identity = sub.add_parser("identity", help="make credentials for the identities file")
    actions = identity.add_subparsers(dest="identity_command", required=True, metavar="ACTION")
    new = actions.add_parser(
        "new", help="write a fresh random token to --token-file and print the [[identity]] "
        "entry (with the token's SHA-256, not the token) to add to the identities file")
    new.add_argument("--name", required=True, help="unique name (logs, metrics)")
    new.add_argument("--role", required=True, choices=[r.value for r in Role])
    new.add_argument("--tenant", default="", help="tenant salt of this caller (default none)")
    new.add_argument("--worker-id", help="the worker id a worker identity acts as (required "
                     "for --role worker)")
    new.add_argument("--token-file", required=True, metavar="FILE",
                     help="where to write the token (created with mode 0600; must not exist)")


def cmd_identity(args: argparse.Namespace) -> int:
    """Validate the entry as the servers will, then create the token file, then print."""
    token = secrets.token_urlsafe(32)
    entry = {"name": args.name, "role": args.role, "token_sha256": token_digest(token).hex()}
    if args.tenant:
        entry["tenant"] = args.tenant
    if args.worker_id is not None:
        entry["worker_id"] = args.worker_id
    try:
        IdentityTable.from_entries([entry], source="kvcoord identity new")
    except IdentityFileError as exc:
        raise ValueError(str(exc)) from None
    try:
        fd = os.open(args.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ValueError(f"cannot create token file {args.token_file}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    print("[[identity]]")
    for key, value in entry.items():
        print(f"{key} = {json.dumps(value)}")  # a JSON string is a valid TOML basic string
    return 0
