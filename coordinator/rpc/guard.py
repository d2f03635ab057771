"""gRPC face of ``coordinator.rpc.identities``: credentials from a call, server TLS, the
per-call guard.

``Guard.admit`` runs before every handler (``coordinator.rpc.interceptor`` calls it): it finds the
caller's identity (bearer token, else the mTLS certificate's common name), checks the method
against the role table, and takes one token from the identity's rate bucket. The identity is
then readable in the handler as ``caller()`` (a context variable: each call runs in its own
task, and tasks a handler starts inherit it). With auth off every caller is
``auth.ANONYMOUS`` and the per-identity limits are off: there is nobody to be fair between.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from coordinator.rpc.identities import (
    ANONYMOUS,
    Identity,
    IdentityFileError,
    IdentityTable,
    RateLimiter,
    Role,
    StreamSlots,
    Unauthenticated,
    authorize,
)

log = structlog.get_logger(__name__)

_CALLER: contextvars.ContextVar[Identity] = contextvars.ContextVar("kvcoord_caller")

REFLECTION_PERMISSIONS: Mapping[str, frozenset[Role]] = {
    "ServerReflectionInfo": frozenset({Role.ADMIN}),
}
"""Reflection lists every method and message: admin-only when auth is on."""


def caller() -> Identity:
    """The identity of the call being handled; Unauthenticated outside a guarded call (so a
    handler reached some other way fails closed)."""
    try:
        return _CALLER.get()
    except LookupError:
        raise Unauthenticated("no caller identity for this call") from None


def acting_as(identity: Identity) -> contextvars.Token[Identity]:
    """Make ``identity`` the caller of the current context (the guard does this per call)."""
    return _CALLER.set(identity)


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """What one gRPC server enforces: who may call (``identities``; None = auth off), its TLS
    (``cert``/``key`` PEM; ``client_ca`` set = clients must present a certificate from it) and
    the per-identity limits."""

    identities: IdentityTable | None = None
    auth_file: str | None = None
    """Where ``identities`` came from: re-read when it changes (``IdentitySource``)."""
    auth_reload_ms: int = 5_000
    cert: bytes | None = None
    key: bytes | None = None
    client_ca: bytes | None = None
    rate_limit_per_s: float = 2000.0
    rate_limit_burst: int = 4000
    max_streams_per_identity: int = 64

    @classmethod
    def from_settings(
        cls, *, auth_file: str | None, tls_cert: str | None, tls_key: str | None,
        tls_client_ca: str | None, rate_limit_per_s: float, rate_limit_burst: int,
        max_streams_per_identity: int, auth_reload_ms: int = 5_000,
    ) -> ServerSecurity:
        """Read the files named by a config (ValueError naming the file when one is bad)."""
        return cls(
            identities=IdentityTable.load(auth_file) if auth_file else None,
            auth_file=auth_file, auth_reload_ms=auth_reload_ms,
            cert=read_pem(tls_cert, "tls_cert") if tls_cert else None,
            key=read_pem(tls_key, "tls_key") if tls_key else None,
            client_ca=read_pem(tls_client_ca, "tls_client_ca") if tls_client_ca else None,
            rate_limit_per_s=rate_limit_per_s, rate_limit_burst=rate_limit_burst,
            max_streams_per_identity=max_streams_per_identity,
        )

    @classmethod
    def from_config(cls, config: Any) -> ServerSecurity:
        """From a server config with the security settings (coordinator or worker)."""
        return cls.from_settings(
            auth_file=config.auth_file, tls_cert=config.tls_cert, tls_key=config.tls_key,
            tls_client_ca=config.tls_client_ca, rate_limit_per_s=config.rate_limit_per_s,
            rate_limit_burst=config.rate_limit_burst,
            max_streams_per_identity=config.max_streams_per_identity,
            auth_reload_ms=config.auth_reload_ms,
        )

    @property
    def auth_on(self) -> bool:
        return self.identities is not None

    @property
    def tls_on(self) -> bool:
        return self.cert is not None

    def bind(self, server: grpc.aio.Server, listen: str) -> int:
        """Add ``listen`` to ``server`` (TLS when configured); the bound port (0 = failed)."""
        if self.cert is None or self.key is None:
            return int(server.add_insecure_port(listen))
        credentials = grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )
        return int(server.add_secure_port(listen, credentials))

    def describe(self) -> dict[str, Any]:
        """For the start-up log line: what is on, never a credential."""
        return {
            "auth": self.auth_on, "identities": len(self.identities or ()),
            "tls": self.tls_on, "mtls": self.client_ca is not None,
            "rate_limit_per_s": self.rate_limit_per_s if self.auth_on else 0,
        }


def read_pem(path: str, setting: str) -> bytes:
    """The PEM file ``path``; ValueError naming ``setting`` when unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{setting}: {path} is not a PEM file")
    return data


class IdentitySource:
    """The identities in force, re-read from ``path`` when the file changes, so a rotated token
    (a Kubernetes Secret updated in place) takes effect without a restart. The file is checked
    (one ``stat``) at most every ``interval`` seconds, on the call path; ``interval <= 0`` never
    checks. A changed file that does not load leaves the identities in force, and says why in
    the log (never a credential: the loader's messages name entries and fields only)."""

    def __init__(self, table: IdentityTable, path: str | None, *, interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._table = table
        self._path = path
        self._interval = interval if path else 0.0
        self._clock = clock
        self._next_check = clock() + self._interval
        self._stamp = self._file_stamp()

    @property
    def table(self) -> IdentityTable:
        """The identities in force, after a reload when the file is due a check and changed."""
        if self._interval > 0:
            now = self._clock()
            if now >= self._next_check:
                self._next_check = now + self._interval
                self._reload_if_changed()
        return self._table

    def _file_stamp(self) -> tuple[int, int, int] | None:
        if self._path is None:
            return None
        try:
            st = os.stat(self._path)  # follows the symlink a Secret volume swaps atomically
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _reload_if_changed(self) -> None:
        if self._path is None:
            return
        stamp = self._file_stamp()
        if stamp is None:
            log.error("auth.reload_failed", file=self._path, error="cannot stat the file",
                      kept=len(self._table))
            return
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            table = IdentityTable.load(self._path)
        except IdentityFileError as exc:
            log.error("auth.reload_failed", file=self._path, error=str(exc),
                      kept=len(self._table))
            return
        self._table = table
        log.info("auth.reloaded", file=self._path, identities=len(table))


class Guard:
    """Authenticate, authorize and rate-limit calls of one server (see the module doc)."""

    def __init__(self, security: ServerSecurity, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._identities = None if security.identities is None else IdentitySource(
            security.identities, security.auth_file,
            interval=security.auth_reload_ms / 1000, clock=clock,
        )
        on = security.auth_on
        self._limiter = RateLimiter(security.rate_limit_per_s if on else 0.0,
                                    max(1, security.rate_limit_burst), clock)
        self._streams = StreamSlots(security.max_streams_per_identity if on else 0)

    def admit(self, method: str, context: Any,
              permissions: Mapping[str, frozenset[Role]]) -> Identity:
        """The caller's identity, once it may call ``method`` now; set as ``caller()``.
        Unauthenticated / PermissionDenied / RateLimited otherwise."""
        identity = self.identify(context)
        # The rate first: refused calls count too, so a flood of them is throttled (and its
        # log lines with it) like any other.
        self._limiter.take(identity.name, method)
        try:
            authorize(identity, method, permissions)
        except Exception:
            log.warning("auth.denied", identity=identity.name, role=identity.role, method=method)
            raise
        acting_as(identity)
        return identity

    def identify(self, context: Any) -> Identity:
        """Who is calling: ``ANONYMOUS`` with auth off, else the identity of the bearer token
        or, without one, of the verified client certificate. Unauthenticated when neither
        names one. A token wins: a call with both is whoever the token names."""
        if self._identities is None:
            return ANONYMOUS
        identities = self._identities.table
        token = bearer_token(context.invocation_metadata() or ())
        if token is not None:
            identity = identities.by_token(token)
            if identity is None:
                raise Unauthenticated("unknown bearer token")
            return identity
        subject = certificate_name(context.auth_context())
        if subject is not None:
            identity = identities.by_subject(subject)
            if identity is None:
                raise Unauthenticated(f"client certificate {subject!r} names no identity")
            return identity
        raise Unauthenticated(
            "no credentials: send 'authorization: Bearer <token>' or a client certificate"
        )

    def open_stream(self, identity: Identity, method: str) -> None:
        """Count a long-lived stream against ``identity``; release with ``close_stream``."""
        self._streams.acquire(identity.name, method)

    def close_stream(self, identity: Identity) -> None:
        self._streams.release(identity.name)

    @property
    def paces(self) -> bool:
        """Whether client streams are paced (a rate limit is on): when not, ``paced`` would
        only add a generator hop to every message."""
        return self._limiter.enabled

    async def paced(self, identity: Identity, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``messages`` (a client stream), each taking a token from ``identity``'s bucket. Over
        the rate, reading waits for the bucket instead of failing: the stream is throttled
        (gRPC flow control pushes back on the sender), never torn down and resynced."""
        limiter = self._limiter
        async for message in messages:
            while wait := limiter.wait_for(identity.name):
                await asyncio.sleep(wait)
            yield message


def bearer_token(metadata: Any) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry, if any; Unauthenticated for
    an ``authorization`` entry of another form (never read as "no credentials")."""
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
    return None


def certificate_name(auth_context: Mapping[str, Any]) -> str | None:
    """The verified client certificate's common name (grpc sets it only after verifying the
    certificate against the server's client CA)."""
    names = auth_context.get("x509_common_name")
    if not names:
        return None
    name = names[0]
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)
