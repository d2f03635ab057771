"""The coordinator's configuration: one typed object built from flags and ``KVCOORD_*`` variables.

Every field ``name`` may be set by the environment variable ``KVCOORD_<NAME>`` (upper case);
command-line flags win over the environment, the environment over the defaults. Validation runs
once, at construction, and names the offending setting. Every timing knob is here so tests can
run with sub-second values.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.core.routing import KvAwareWeights
    from coordinator.core.tier_costs import TierCosts

ENV_PREFIX = "KVCOORD_"
_SHARD_NAME = re.compile(r"[a-z0-9-]{1,32}")


class ConfigError(ValueError):
    """A setting is missing, malformed or out of range; the message names it."""


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """Settings of one coordinator process (defaults suit a production fleet)."""

    listen: str = "127.0.0.1:50051"
    redis: str | None = None
    """Redis URL; unset = the embedded in-memory store (one coordinator process only)."""
    store_namespace: str = "default"
    metrics_port: int | None = None
    metrics_host: str | None = None
    """Where ``/metrics`` listens; unset = the host of ``listen`` (loopback stays loopback)."""
    page_size: int = 16
    hash_key: str | None = None
    """Hex deployment secret for keyed hashing; unset = a fixed development key (warned)."""
    hash_algorithm: str = "blake2b-128"
    default_model: str = "default"
    routing_policy: str = "kv_aware"
    lease_ms: int = 10_000
    """A worker whose heartbeats stop for this long becomes unroutable."""
    heartbeat_ms: int = 2_000
    drop_grace_ms: int = 30_000
    """How long an unroutable (disconnected) worker's entries are kept for a quick reconnect."""
    pending_ttl_ms: int = 2_000
    """Routing decisions count as cached on the chosen worker for this long unless confirmed."""
    max_pending_entries: int = 1_000_000
    max_prompt_tokens: int = 262_144
    max_batch_prompts: int = 4_096
    max_batch_tokens: int = 2_097_152
    """Tokens in all the prompts of one RouteBatch (each prompt is also under
    max_prompt_tokens): bounds the work and memory one call may take."""
    max_events_per_batch: int = 8_192
    max_message_bytes: int = 16 * 1024 * 1024
    hash_cache_pages: int = 262_144
    reaper_interval_ms: int = 500
    max_inflight_per_worker: int = 65_536
    """In-flight routes remembered per worker; beyond it the oldest are assumed finished (a
    worker that never reports completions must not grow the coordinator without bound)."""
    sync_frontends: int = 0
    """Processes that terminate workers' Sync streams for this replica (server.sync_frontend),
    on the ports after ``listen``'s (ephemeral ones when it is 0); 0 = this process reads them.
    Routes then never share a loop with stream reads, and ingest uses more than one core."""
    ingest_max_share: float = 0.7
    """The share of each 100 ms of the event loop that page-event batches may take; past it
    their streams wait (routes never do). 1 = unbounded (control/ingest_governor.py)."""
    route_end_ttl_ms: int = 600_000
    """A route whose caller said it would report the end (``EndRoutes``: gateways, for engines
    behind a bridge) stops counting as load after this long without one (a caller that died)."""
    log_level: str = "info"
    max_staleness: int = 0
    """Async updates: how many versions behind the current one a worker may still serve."""
    barrier_timeout_ms: int = 30_000
    """Default CommitPolicyUpdate deadline when the request gives none."""
    update_timeout_ms: int = 600_000
    """An update neither committed nor aborted within this is aborted (a dead trainer)."""
    route_wait_ms: int = 2_000
    """How long a route waits for a draining (sync) update before UNAVAILABLE."""
    route_retry_ms: int = 200
    """The delay (``google.rpc.RetryInfo``) told to routes refused while an update drains."""
    policy_poll_ms: int = 250
    """How often watchers re-read the store for changes made through other replicas."""
    policy_stale_ms: int | None = None
    """A replica that has not read the policy state from the store for this long refuses
    Route and RouteBatch (UNAVAILABLE, with RetryInfo): it may have missed a commit. Unset =
    one lease (``lease_ms``). The state is re-read every ``policy_poll_ms`` or a quarter of
    this, whichever is shorter."""
    max_rollouts: int = 1_000_000
    """Rollout records kept in the stream (older ones are trimmed)."""
    max_ack_delay_ms: int = 1_000
    """While the ingest budget is cut (the loop fell behind), a stream's event-batch acks may
    wait this long and go out as one cumulative ack (0: ack every batch at once)."""
    replication: bool = True
    """With ``redis``: share the index with the other replicas on it (off: a lone coordinator
    that only keeps its metadata in Redis, and publishes nothing)."""
    share_routes: bool = True
    """With ``replication``: publish every routing decision (its pending entries and in-flight
    load) and every ``EndRoutes``, so the replicas route as one (off: each counts only the
    routes it chose, and a route can be ended only through the replica that issued it)."""
    replica_id: str | None = None
    """This replica's name in the events stream and ``kvcoord status`` (unset: host-pid-rand)."""
    shard: str = ""
    """This replica's shard: with ``redis``, replicas of one shard share an events stream of
    their own (``events:<shard>``) and apply only their shard's workers' batches, while leases,
    incarnations, the policy record, acks and rollouts stay shared by every shard of the
    namespace. Empty = unsharded (the ``events`` stream). 1..32 of ``[a-z0-9-]``."""
    peer_shards: str = ""
    """The other shards' replicas, ``NAME=HOST:PORT[,HOST:PORT...]`` separated by ``;``: a route
    asks every shard for its best candidates and reserves the cheapest (``shard_routing``);
    empty = routes see this shard's workers only."""
    decision_log: bool = False
    """Log each routing decision (``route.decision``: the chosen worker's and the best
    holder's cost, term by term, with their evictions so far) and each awaited route's end
    (``route.ended``), at info: why a route went where it went. Off by default: it prices
    every candidate, O(fleet) a route."""
    routing_seed: int | None = None
    """Seeds the router's tie-breaks (unset: from the OS): two coordinators given the same
    seed, state and requests make the same decisions (the sharded bench compares them)."""
    bootstrap_timeout_ms: int = 5_000
    """A new replica waits this long for the others' snapshots before reporting SERVING."""
    max_replication_events: int = 1_000_000
    """Replication events kept in the store's stream (a replica further behind re-snapshots)."""
    # Security (docs/SECURITY.md): identities, TLS, per-identity limits.
    auth_file: str | None = None
    """TOML identities file (coordinator.rpc.identities): set = every call must authenticate."""
    auth_reload_ms: int = 5_000
    """How often the identities file is checked for changes (re-read when changed, so a
    rotated token needs no restart); 0 = read once at start."""
    tls_cert: str | None = None
    """PEM certificate chain of this server: set (with tls_key) = TLS only."""
    tls_key: str | None = None
    tls_client_ca: str | None = None
    """PEM CA bundle: set = mutual TLS, clients must present a certificate it signed."""
    trust_scheduler_page_keys: bool = False
    """Accept page keys (not token ids) from schedulers too: only where they hold the hash key."""
    rate_limit_per_s: float = 2000.0
    """Calls (and client-stream messages) per second per identity with auth on; 0 = off."""
    rate_limit_burst: int = 4000
    max_streams_per_identity: int = 64
    """Open Sync / WatchPolicy / ReadRollouts streams per identity with auth on."""
    max_pages_per_worker: int = 4_194_304
    """Index entries one worker may hold (an event batch past it is refused)."""
    # kv_aware routing weights (coordinator.core.routing.choosers.KvAwareWeights documents each).
    kv_prefill_token: float = 1.0
    # What a host-tier hit costs to reuse (coordinator.core.tier_costs documents each figure);
    # KvAwareWeights.lower_tier_token is derived from them (kv_weights).
    kv_bytes_per_token: int = 131_072
    host_to_device_bytes_per_s: float = 25e9
    prefill_tokens_per_s: float = 15_000.0
    kv_queued_token: float = 1.0
    kv_running_request: float = 8.0
    kv_memory_pressure: float = 1.0
    kv_duplicate_token: float = 1.0

    def __post_init__(self) -> None:
        positive = (
            "page_size", "lease_ms", "heartbeat_ms", "pending_ttl_ms", "max_pending_entries",
            "max_prompt_tokens", "max_batch_prompts", "max_events_per_batch",
            "max_message_bytes", "reaper_interval_ms", "barrier_timeout_ms", "route_retry_ms",
            "update_timeout_ms", "policy_poll_ms", "max_rollouts", "bootstrap_timeout_ms",
            "max_replication_events", "rate_limit_burst", "max_streams_per_identity",
            "max_pages_per_worker", "max_batch_tokens", "kv_bytes_per_token",
            "host_to_device_bytes_per_s", "prefill_tokens_per_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if min(self.drop_grace_ms, self.hash_cache_pages, self.max_staleness,
               self.route_wait_ms, self.max_ack_delay_ms) < 0:
            raise ConfigError(
                "drop_grace_ms, hash_cache_pages, max_staleness, route_wait_ms and "
                "max_ack_delay_ms must be >= 0"
            )
        if self.policy_stale_ms is not None and self.policy_stale_ms <= 0:
            raise ConfigError(f"policy_stale_ms must be > 0, got {self.policy_stale_ms}")
        if self.heartbeat_ms >= self.lease_ms:
            raise ConfigError(
                f"heartbeat_ms ({self.heartbeat_ms}) must be below lease_ms ({self.lease_ms})"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port out of range: {self.metrics_port}")
        if ":" not in self.listen:
            raise ConfigError(f"listen must be HOST:PORT, got {self.listen!r}")
        self._check_choices()
        check_security_settings(self)
        if self.hash_key is not None:
            try:
                key = bytes.fromhex(self.hash_key)
            except ValueError:
                raise ConfigError("hash_key (KVCOORD_HASH_KEY) must be hex") from None
            if not 16 <= len(key) <= 64:
                raise ConfigError(
                    f"hash_key must be 16..64 bytes (32..128 hex digits), got {len(key)} bytes"
                )
        if self.page_size > 4096:
            raise ConfigError(f"page_size must be <= 4096, got {self.page_size}")
        if self.max_inflight_per_worker <= 0:
            raise ConfigError("max_inflight_per_worker must be > 0")
        if not 0 <= self.sync_frontends <= 64:
            raise ConfigError(f"sync_frontends must be in [0, 64], got {self.sync_frontends}")
        if not 0 < self.ingest_max_share <= 1:
            raise ConfigError(f"ingest_max_share must be in (0, 1], got {self.ingest_max_share}")
        if self.route_end_ttl_ms <= 0:
            raise ConfigError(f"route_end_ttl_ms must be > 0, got {self.route_end_ttl_ms}")
        if not self.store_namespace or any(c in self.store_namespace for c in "{}"):
            raise ConfigError(
                f"store_namespace must be non-empty without braces, got {self.store_namespace!r}"
            )
        self._check_shards()
        if self.replica_id is not None and not (
                self.replica_id.isprintable() and 0 < len(self.replica_id) <= 128):
            raise ConfigError(
                f"replica_id must be 1..128 printable characters, got {self.replica_id!r}"
            )

    def _check_shards(self) -> None:
        if self.shard and not _SHARD_NAME.fullmatch(self.shard):
            raise ConfigError(f"shard must be 1..32 of [a-z0-9-], got {self.shard!r}")
        if self.shard and not self.redis:
            raise ConfigError("shard needs redis: shards share leases, the policy record and "
                              "acks through it")
        peers = self.peer_shard_targets()
        if peers and not self.shard:
            raise ConfigError("peer_shards needs shard: name this replica's own shard")
        if peers and self.tls_cert:
            raise ConfigError("peer_shards does not dial TLS yet: run shards on a trusted "
                              "network without tls_cert, or without peer_shards")
        if self.shard in peers:
            raise ConfigError(f"peer_shards names this replica's own shard {self.shard!r}")

    def peer_shard_targets(self) -> dict[str, tuple[str, ...]]:
        """``peer_shards`` parsed: shard name -> its replicas' HOST:PORT targets, in order
        (ConfigError naming the bad part)."""
        peers: dict[str, tuple[str, ...]] = {}
        for part in filter(None, (p.strip() for p in self.peer_shards.split(";"))):
            name, sep, targets = part.partition("=")
            name = name.strip()
            hosts = tuple(filter(None, (t.strip() for t in targets.split(","))))
            if not sep or not _SHARD_NAME.fullmatch(name) or not hosts or any(
                    ":" not in h for h in hosts):
                raise ConfigError(f"peer_shards: expected NAME=HOST:PORT[,HOST:PORT], got "
                                  f"{part!r}")
            if name in peers:
                raise ConfigError(f"peer_shards names shard {name!r} twice")
            peers[name] = hosts
        return peers

    def _check_choices(self) -> None:
        # Imported here: config is read by every entry point; keep its import light.
        from coordinator.core.hashing import HashAlgorithm
        from coordinator.core.routing.choosers import CHOOSERS

        algorithms = [a.value for a in HashAlgorithm]
        if self.hash_algorithm not in algorithms:
            raise ConfigError(f"hash_algorithm must be one of {algorithms}, "
                              f"got {self.hash_algorithm!r}")
        if self.routing_policy not in CHOOSERS:
            raise ConfigError(f"routing_policy must be one of {sorted(CHOOSERS)}, "
                              f"got {self.routing_policy!r}")
        levels = ("debug", "info", "warning", "error")
        if self.log_level.lower() not in levels:
            raise ConfigError(f"log_level must be one of {levels}, got {self.log_level!r}")
        try:
            self.kv_weights()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def policy_stale_s(self) -> float:
        """``policy_stale_ms`` in seconds, one lease when unset."""
        stale_ms = self.lease_ms if self.policy_stale_ms is None else self.policy_stale_ms
        return stale_ms / 1000

    @property
    def policy_read_s(self) -> float:
        """How often the policy state is re-read: ``policy_poll_ms``, or a quarter of
        ``policy_stale_ms`` when that is shorter (three reads may fail before routes stop)."""
        return min(self.policy_poll_ms / 1000, self.policy_stale_s / 4)

    def tier_costs(self) -> TierCosts:
        """The copy-back constants of this configuration (ValueError for a non-finite one)."""
        from coordinator.core.tier_costs import TierCosts

        return TierCosts(self.kv_bytes_per_token, self.host_to_device_bytes_per_s,
                         self.prefill_tokens_per_s)

    def kv_weights(self) -> KvAwareWeights:
        """The kv_aware routing weights of this configuration; ``lower_tier_token`` is derived
        from the tier constants (``TierCosts.lower_tier_token``), not set on its own."""
        from coordinator.core.routing import KvAwareWeights

        return KvAwareWeights(
            prefill_token=self.kv_prefill_token,
            lower_tier_token=self.tier_costs().lower_tier_token,
            queued_token=self.kv_queued_token, running_request=self.kv_running_request,
            memory_pressure=self.kv_memory_pressure, duplicate_token=self.kv_duplicate_token,
        )

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> CoordinatorConfig:
        """Build from environment then flags (``None`` flag values mean "not given")."""
        return build_config(cls, flags or {}, env or {})


def check_security_settings(config: Any) -> None:
    """The TLS and identity settings every server config shares (``auth_file``, ``tls_cert``,
    ``tls_key``, ``tls_client_ca``, ``rate_limit_per_s``): files readable and well-formed,
    certificate and key together. ConfigError names the setting."""
    from coordinator.rpc.guard import read_pem
    from coordinator.rpc.identities import IdentityFileError, IdentityTable

    if (config.tls_cert is None) != (config.tls_key is None):
        raise ConfigError("tls_cert and tls_key must be given together")
    if config.tls_client_ca is not None and config.tls_cert is None:
        raise ConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
    for setting in ("tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(config, setting)
        if path is not None:
            try:
                read_pem(path, setting)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
    if config.auth_file is not None:
        try:
            IdentityTable.load(config.auth_file)
        except IdentityFileError as exc:
            raise ConfigError(f"auth_file: {exc}") from None
    if config.auth_reload_ms < 0:
        raise ConfigError(f"auth_reload_ms must be >= 0 (0 = never), got {config.auth_reload_ms}")
    if config.rate_limit_per_s < 0:
        raise ConfigError(f"rate_limit_per_s must be >= 0 (0 = off), got {config.rate_limit_per_s}")


def read_token_setting(path: str | None, setting: str = "token_file") -> str | None:
    """The bearer token in the file ``path`` names (None without one), read now; ConfigError
    naming ``setting`` for a file that does not hold exactly one token."""
    from coordinator.client.channels import read_token_file

    if path is None:
        return None
    try:
        return read_token_file(path)
    except ValueError as exc:
        raise ConfigError(f"{setting}: {exc}") from None


T = typing.TypeVar("T")


def build_config(cls: type[T], flags: Mapping[str, Any], env: Mapping[str, str]) -> T:
    """Construct dataclass ``cls`` from ``KVCOORD_*`` env vars overlaid by non-None ``flags``."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = env.get(ENV_PREFIX + field.name.upper())
        if raw is not None and raw != "":
            values[field.name] = parse_value(field.name, raw, hints[field.name])
        flag = flags.get(field.name)
        if flag is not None:
            values[field.name] = flag
    unknown = set(flags) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise ConfigError(f"unknown settings: {sorted(unknown)}")
    return cls(**values)


def parse_value(name: str, raw: str, hint: Any) -> Any:
    """Parse one environment string into the field's type (int, str, bool, optional of those;
    a tuple of strings from a comma-separated list)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
    try:
        if hint is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
        if typing.get_origin(hint) is tuple:  # tuple[str, ...]: a comma-separated list
            return tuple(item.strip() for item in raw.split(",") if item.strip())
    except ValueError:
        raise ConfigError(
            f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {hint.__name__}"
        ) from None
    return raw
