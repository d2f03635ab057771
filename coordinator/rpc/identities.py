"""Who is calling and what they may do: identities, roles, permissions, per-identity limits.

Pure core: no grpc, no I/O beyond reading the identities file at start, time injected.

An identities file (TOML; a Kubernetes Secret mounted as a file) lists who may call::

    [[identity]]
    name = "scheduler-a"        # unique; what logs and metrics name
    role = "scheduler"          # scheduler | worker | trainer | admin
    tenant = "acme"             # tenant salt of this caller's prefix cache (default "")
    token_sha256 = "9f86d0..."  # or token = "..." (a bearer token), and/or subject = "CN"
    [[identity]]
    name = "worker-0"
    role = "worker"
    worker_id = "worker-0"      # required for the worker role: the only worker it may act as
    subject = "worker-0"        # mTLS: the client certificate's common name

A caller presents a bearer token (``authorization: Bearer <token>`` call metadata) or, under
mutual TLS, a certificate whose common name is an identity's ``subject``. Tokens are kept only
as SHA-256 digests and found by digest, then compared with ``hmac.compare_digest``: the time a
lookup takes depends on the digest of what was sent, never on how much of a real token it
matched. Tokens are never logged; ``Identity`` holds none.
"""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from coordinator.core.errors import DomainError, ResourceExhausted
from coordinator.wire import Reason


class Unauthenticated(DomainError):
    """No credential, or one that names no identity. Takes a message only (no reason or retry
    delay: there is nothing to retry): raised for every stranger's call, it is built as a plain
    exception, so refusing one costs what it did before errors carried reasons."""

    status_name = "UNAUTHENTICATED"
    __init__ = Exception.__init__


class PermissionDenied(DomainError):
    """The caller is known but its role (or worker id) does not allow this call."""

    status_name = "PERMISSION_DENIED"


class IdentityFileError(ValueError):
    """The identities file is missing or malformed; the message names the entry and field."""


class Role(StrEnum):
    SCHEDULER = "scheduler"
    WORKER = "worker"
    TRAINER = "trainer"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated caller. ``worker_id`` is set for (and only for) the worker role."""

    name: str
    role: Role
    tenant: str = ""
    worker_id: str | None = None


ANONYMOUS = Identity("anonymous", Role.ADMIN)
"""Every caller when auth is off: an admin of the default tenant (a trusted network)."""

ALL_ROLES = frozenset(Role)

COORDINATOR_PERMISSIONS: Mapping[str, frozenset[Role]] = {
    "Lookup": frozenset({Role.SCHEDULER, Role.ADMIN}),
    "Route": frozenset({Role.SCHEDULER, Role.ADMIN}),
    "RouteBatch": frozenset({Role.SCHEDULER, Role.ADMIN}),
    "EndRoutes": frozenset({Role.SCHEDULER, Role.ADMIN}),
    # Another shard deciding a route, with its caller's credentials.
    "ShardShortlist": frozenset({Role.SCHEDULER, Role.ADMIN}),
    "ShardReserve": frozenset({Role.SCHEDULER, Role.ADMIN}),
    "Register": frozenset({Role.WORKER, Role.ADMIN}),
    "Sync": frozenset({Role.WORKER, Role.ADMIN}),
    "Deregister": frozenset({Role.WORKER, Role.ADMIN}),
    "ReportRollouts": frozenset({Role.WORKER, Role.ADMIN}),
    # Reading the live version is harmless and every role needs it.
    "GetPolicy": ALL_ROLES,
    "WatchPolicy": ALL_ROLES,
    "BeginPolicyUpdate": frozenset({Role.TRAINER, Role.ADMIN}),
    "CommitPolicyUpdate": frozenset({Role.TRAINER, Role.ADMIN}),
    "AbortPolicyUpdate": frozenset({Role.TRAINER, Role.ADMIN}),
    "ReadRollouts": frozenset({Role.TRAINER, Role.ADMIN}),
    # A worker sees only its own entry (visible_workers): its preStop hook reads its
    # incarnation there before deregistering.
    "ListWorkers": ALL_ROLES,
    # Index-wide counts move with every tenant's traffic: not for tenants' schedulers.
    "GetStats": frozenset({Role.TRAINER, Role.ADMIN}),
    # A worker cordons itself at the start of a graceful stop (check_cordon).
    "Cordon": frozenset({Role.WORKER, Role.ADMIN}),
}
"""Which roles may call each ``coordinator.v1.Coordinator`` method (admin: all)."""

WORKER_PERMISSIONS: Mapping[str, frozenset[Role]] = {
    "Generate": frozenset({Role.SCHEDULER, Role.TRAINER, Role.ADMIN}),
    "LoadWeights": frozenset({Role.TRAINER, Role.ADMIN}),
    "GetStats": frozenset({Role.SCHEDULER, Role.TRAINER, Role.ADMIN}),
}
"""Which roles may call each ``worker.v1.Worker`` method."""


def authorize(identity: Identity, method: str, permissions: Mapping[str, frozenset[Role]]) -> None:
    """PermissionDenied unless ``identity``'s role may call ``method`` (unknown methods: admin)."""
    allowed = permissions.get(method, frozenset({Role.ADMIN}))
    if identity.role not in allowed:
        raise PermissionDenied(f"{identity.role} {identity.name!r} may not call {method}")


def check_worker(identity: Identity, worker_id: str) -> None:
    """A worker identity acts only as its own worker id; other roles allowed to reach a worker
    RPC (admin) may act as any."""
    if identity.role is Role.WORKER and identity.worker_id != worker_id:
        raise PermissionDenied(
            f"worker identity {identity.name!r} is worker {identity.worker_id!r}, "
            f"not {worker_id!r}"
        )


def check_cordon(identity: Identity, worker_id: str, cordoned: bool) -> None:
    """A worker may take itself out of routing, never another worker, and never put itself
    back (an operator's cordon must not be undone by the worker it was meant for)."""
    check_worker(identity, worker_id)
    if identity.role is Role.WORKER and not cordoned:
        raise PermissionDenied(
            f"worker identity {identity.name!r} may cordon itself but not uncordon"
        )


def visible_workers(identity: Identity, worker_ids: Iterable[str]) -> set[str]:
    """Which of ``worker_ids`` ``identity`` may see in ListWorkers: a worker only itself."""
    if identity.role is Role.WORKER:
        return {w for w in worker_ids if w == identity.worker_id}
    return set(worker_ids)


def may_send_page_keys(identity: Identity, trust_schedulers: bool) -> bool:
    """Page keys bypass the tenant salt (they are already hashed): only callers that hold the
    hash key may send them (ARCHITECTURE §0, "Who holds the key")."""
    if identity.role in (Role.WORKER, Role.ADMIN):
        return True
    return trust_schedulers and identity.role is Role.SCHEDULER


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class IdentityTable:
    """Credentials -> identities, as loaded from an identities file."""

    def __init__(self, by_digest: Mapping[bytes, Identity], by_subject: Mapping[str, Identity]):
        self._by_digest = {digest: (digest, who) for digest, who in by_digest.items()}
        self._by_subject = dict(by_subject)

    def __len__(self) -> int:
        return len({*(who for _, who in self._by_digest.values()), *self._by_subject.values()})

    @classmethod
    def load(cls, path: str | Path) -> IdentityTable:
        """Read and validate ``path``; IdentityFileError names what is wrong."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise IdentityFileError(f"cannot read identities file {path}: {exc.strerror}") from None
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise IdentityFileError(f"identities file {path} is not TOML: {exc}") from None
        entries = document.get("identity")
        if not isinstance(entries, list) or not entries:
            raise IdentityFileError(f"identities file {path} has no [[identity]] entries")
        return cls.from_entries(entries, source=str(path))

    @classmethod
    def from_entries(cls, entries: Iterable[Any], *, source: str = "identities") -> IdentityTable:
        """A table of parsed ``[[identity]]`` entries; IdentityFileError (naming ``source``,
        the entry and the field) for a bad entry, or a name, token or subject used twice."""
        by_digest: dict[bytes, Identity] = {}
        by_subject: dict[str, Identity] = {}
        names: set[str] = set()
        for i, entry in enumerate(entries):
            where = f"{source}: identity[{i}]"
            identity, digest, subject = _parse_entry(entry, where)
            if identity.name in names:
                raise IdentityFileError(f"{where}: name {identity.name!r} is used twice")
            names.add(identity.name)
            if digest is not None:
                if digest in by_digest:
                    raise IdentityFileError(f"{where}: its token is also another identity's")
                by_digest[digest] = identity
            if subject is not None:
                if subject in by_subject:
                    raise IdentityFileError(f"{where}: subject {subject!r} is used twice")
                by_subject[subject] = identity
        return cls(by_digest, by_subject)

    def by_token(self, token: str) -> Identity | None:
        """The identity whose token is ``token``, or None.

        Found by the SHA-256 of what was sent: how long the lookup takes says something about
        that digest, which tells a guesser nothing about how close the guess was to a real
        token (that would need a preimage). The final comparison is constant-time anyway.
        """
        digest = token_digest(token)
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found[0], digest):
            return None
        return found[1]

    def by_subject(self, subject: str) -> Identity | None:
        """The identity of an mTLS certificate whose common name is ``subject``, or None."""
        return self._by_subject.get(subject)


_FIELDS = {"name", "role", "tenant", "worker_id", "token", "token_sha256", "subject"}


def _parse_entry(entry: Any, where: str) -> tuple[Identity, bytes | None, str | None]:
    if not isinstance(entry, dict):
        raise IdentityFileError(f"{where}: expected a table")
    unknown = set(entry) - _FIELDS
    if unknown:
        raise IdentityFileError(f"{where}: unknown fields {sorted(unknown)}")
    for key, value in entry.items():
        if not isinstance(value, str):
            raise IdentityFileError(f"{where}: {key} must be a string")
    name = entry.get("name", "")
    if not name or not name.isprintable() or len(name) > 128:
        raise IdentityFileError(f"{where}: name must be 1..128 printable characters")
    try:
        role = Role(entry.get("role", ""))
    except ValueError:
        raise IdentityFileError(
            f"{where} ({name}): role must be one of {[r.value for r in Role]}"
        ) from None
    worker_id = entry.get("worker_id")
    if role is Role.WORKER and not worker_id:
        raise IdentityFileError(f"{where} ({name}): the worker role needs a worker_id")
    if role is not Role.WORKER and worker_id is not None:
        raise IdentityFileError(f"{where} ({name}): worker_id is for the worker role only")
    digest = _entry_digest(entry, where, name)
    subject = entry.get("subject")
    if digest is None and not subject:
        raise IdentityFileError(f"{where} ({name}): give a token, token_sha256 or subject")
    identity = Identity(name, role, entry.get("tenant", ""), worker_id)
    return identity, digest, subject or None


def _entry_digest(entry: Mapping[str, str], where: str, name: str) -> bytes | None:
    if "token" in entry and "token_sha256" in entry:
        raise IdentityFileError(f"{where} ({name}): give token or token_sha256, not both")
    if "token" in entry:
        token = entry["token"]
        if len(token) < 16 or any(c.isspace() for c in token):
            raise IdentityFileError(
                f"{where} ({name}): a token must be at least 16 characters without spaces"
            )
        return token_digest(token)
    if "token_sha256" in entry:
        try:
            digest = bytes.fromhex(entry["token_sha256"])
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise IdentityFileError(f"{where} ({name}): token_sha256 must be 64 hex digits")
        return digest
    return None


class RateLimiter:
    """A token bucket per key: ``rate`` per second, up to ``burst`` saved.

    At most ``max_keys`` buckets are kept (least recently used dropped first; a dropped bucket
    comes back full, which only ever favours the caller). ``rate <= 0`` turns it off.
    """

    def __init__(self, rate: float, burst: int, clock: Callable[[], float], *,
                 max_keys: int = 65_536) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._clock = clock
        self._max_keys = max_keys
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # key -> [tokens, at]

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def wait_for(self, key: str, cost: float = 1.0) -> float:
        """Take ``cost`` from ``key``'s bucket and return 0.0, or take nothing and return the
        seconds until it could be taken."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = [self.burst, now]
            if len(self._buckets) >= self._max_keys:
                self._buckets.popitem(last=False)
            self._buckets[key] = bucket
        else:
            self._buckets.move_to_end(key)
            bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
            bucket[1] = now
        if bucket[0] >= cost:
            bucket[0] -= cost
            return 0.0
        return (cost - bucket[0]) / self.rate

    def take(self, key: str, what: str) -> None:
        """ResourceExhausted (with a retry hint) when ``key`` is over its rate."""
        wait = self.wait_for(key)
        if wait:
            raise RateLimited(
                f"{what}: over the rate limit of {self.rate:g} requests/s "
                f"(burst {self.burst:g}); retry in {wait * 1000:.0f} ms",
                retry_after_ms=max(1, round(wait * 1000)),
            )


class RateLimited(ResourceExhausted):
    """Over the per-identity request rate (reason RATE_LIMITED); ``retry_after_ms`` says when
    a token is back."""

    def __init__(self, message: str, *, retry_after_ms: int) -> None:
        super().__init__(message, reason=Reason.RATE_LIMITED, retry_after_ms=retry_after_ms)


class StreamSlots:
    """Open long-lived streams per key, at most ``limit`` each (``limit <= 0``: unbounded)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}

    def acquire(self, key: str, what: str) -> None:
        """Count one more open stream for ``key``; ResourceExhausted at the limit."""
        n = self._open.get(key, 0)
        if 0 < self.limit <= n:
            raise ResourceExhausted(
                f"{what}: {n} streams already open, the limit per identity is {self.limit}",
                reason=Reason.STREAM_LIMIT,
            )
        self._open[key] = n + 1

    def release(self, key: str) -> None:
        n = self._open.get(key, 0) - 1
        if n > 0:
            self._open[key] = n
        else:
            self._open.pop(key, None)

    def open_count(self, key: str) -> int:
        return self._open.get(key, 0)
