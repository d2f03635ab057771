"""The worker's configuration: one typed object built from flags and ``KVCOORD_*`` variables.

Built with ``coordinator.config.build_config`` (the same rules as the coordinator): every field
``name`` may be set by ``KVCOORD_<NAME>``; flags win over the environment, the environment over
the defaults. Validation runs once, at construction, and names the offending setting. The hash
settings (``KVCOORD_HASH_KEY``, ``KVCOORD_HASH_ALGORITHM``, ``KVCOORD_PAGE_SIZE``) are the very
variables the coordinator reads, so one ConfigMap/Secret serves both.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.client.channels import ClientTls
from coordinator.client.targets import Targets
from coordinator.config import (
    ConfigError,
    build_config,
    check_security_settings,
    read_token_setting,
)
from coordinator.core.hashing import DEV_HASH_KEY, HashAlgorithm, HashConfig
from coordinator.logs import warn_development_key

__all__ = ["ConfigError", "WorkerConfig"]

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
MODEL_SIZE_NAMES = ("tiny", "small", "bench")
"""The reference model's sizes (shapes: ``worker.runtime.model_sizes``, which needs torch)."""
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Settings of one worker process (defaults suit a laptop; the coordinator's lease and
    heartbeat period come from its RegisterResponse, not from here)."""

    coordinator: str = "127.0.0.1:50051"
    """TARGETS: ``host:port``, a comma-separated list, or ``dns:///name:port``."""
    listen: str = "127.0.0.1:50061"
    """HOST:PORT of the Worker gRPC service; port 0 picks a free one."""
    advertise: str | None = None
    """The address schedulers dial; required when ``listen`` is a wildcard (0.0.0.0 / ::)."""
    worker_id: str | None = None
    """Unset = ``<hostname>-<port>`` of the bound port."""
    http_listen: str | None = None
    """HOST:PORT of the OpenAI-compatible HTTP endpoint (``worker.http_api``); unset = none."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer directory for the HTTP endpoint; unset = the shipped reference
    tokenizer (``worker/text/reference_tokenizer``)."""
    pages: int = 1024
    host_pages: int = 0
    """Pages of the host-memory tier (0 = none): device evictions move there and are copied
    back on a hit instead of recomputed. Refused at start beyond the host memory available."""
    page_size: int = 16
    device: str = "auto"
    """``cuda`` when available for ``auto``; ``cuda`` is refused where torch has no GPU."""
    dtype: str = "float32"
    model_size: str = "tiny"
    """The reference model's size, one of ``MODEL_SIZE_NAMES`` (``worker.runtime.model_sizes``):
    ``tiny``
    prefills for next to nothing; ``small`` (what ``kvcoord up`` runs) and ``bench`` make a
    prefill cost what it costs on a real engine. A fleet's workers run one size (a version's
    seeded weights differ between sizes, as a real fleet serves one model)."""
    model_name: str = "default"
    weights: str | None = None
    """A safetensors file; unset = weights generated from a seed chosen by ``policy_version``."""
    policy_version: int = 0
    prefix_caching: bool = True
    max_new_tokens: int = 1024
    """The largest ``max_new_tokens`` a Generate call may ask for."""
    hash_key: str | None = None
    """Hex deployment secret, the coordinator's ``KVCOORD_HASH_KEY``; unset = the dev key."""
    hash_algorithm: str = "blake2b-128"
    metrics_port: int | None = None
    metrics_host: str | None = None
    """Where ``/metrics`` listens; unset = the host of ``listen``."""
    max_message_bytes: int = 16 * 1024 * 1024
    heartbeat_ms: int | None = None
    """Override the heartbeat period the coordinator asks for (unset = the coordinator's)."""
    event_flush_ms: int = 5
    """Page events wait at most this long to be batched with others."""
    max_unacked_batches: int = 1024
    """Event batches kept for resending after a reconnect; beyond it the coordinator resyncs."""
    backoff_initial_ms: int = 100
    backoff_max_ms: int = 5_000
    rpc_timeout_ms: int = 5_000
    """Deadline of Register/Deregister calls (the Sync stream has none)."""
    log_level: str = "info"
    token_file: str | None = None
    """File holding this worker's bearer token for the coordinator."""
    tls_ca: str | None = None
    """CA bundle (PEM) that verifies the coordinator; set = TLS to the coordinator."""
    tls_cert: str | None = None
    """This worker's certificate (PEM): served by its own gRPC server when set, and presented
    as a client certificate to the coordinator when ``tls_ca`` is set. Needs ``tls_key``."""
    tls_key: str | None = None
    """The private key (PEM) of ``tls_cert``."""
    tls_client_ca: str | None = None
    """CA that client certificates must chain to: set = mutual TLS required on the worker's
    server (needs ``tls_cert``)."""
    auth_file: str | None = None
    """TOML identities file: set = callers of the worker's server must authenticate."""
    auth_reload_ms: int = 5_000
    """How often the identities file is checked for changes (re-read when changed, so a
    rotated token needs no restart); 0 = read once at start."""
    rate_limit_per_s: float = 2000.0
    """Calls per second each identity may make to the worker's server (0 = no limit)."""
    rate_limit_burst: int = 4000
    """Calls an identity may make at once above its rate (token bucket size)."""
    max_streams_per_identity: int = 64
    """Streams one identity may hold open on the worker's server at once."""

    def __post_init__(self) -> None:
        positive = (
            "pages", "page_size", "max_new_tokens", "max_message_bytes", "event_flush_ms",
            "max_unacked_batches", "backoff_initial_ms", "backoff_max_ms", "rpc_timeout_ms",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_ms is not None and self.heartbeat_ms <= 0:
            raise ConfigError(f"heartbeat_ms must be > 0, got {self.heartbeat_ms}")
        if self.backoff_max_ms < self.backoff_initial_ms:
            raise ConfigError("backoff_max_ms must be >= backoff_initial_ms")
        if self.page_size > 4096:
            raise ConfigError(f"page_size must be <= 4096, got {self.page_size}")
        if self.policy_version < 0:
            raise ConfigError(f"policy_version must be >= 0, got {self.policy_version}")
        if not 0 <= self.host_pages < 2**32:
            raise ConfigError(f"host_pages must be 0..{2**32 - 1}, got {self.host_pages}")
        if self.host_pages and not self.prefix_caching:
            raise ConfigError("host_pages needs prefix_caching: the host tier keeps cached pages")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port out of range: {self.metrics_port}")
        try:
            Targets.parse(self.coordinator)
        except ValueError as exc:
            raise ConfigError(f"coordinator: {exc}") from None
        host, _port = _split_host_port("listen", self.listen)
        if self.http_listen is not None:
            _split_host_port("http_listen", self.http_listen)
        if self.advertise is not None:
            _split_host_port("advertise", self.advertise)
        elif host in WILDCARD_HOSTS:
            raise ConfigError(
                f"advertise (--advertise HOST:PORT) is required when listening on {self.listen}: "
                "schedulers cannot dial a wildcard address"
            )
        if self.worker_id is not None and not self.worker_id.strip():
            raise ConfigError("worker_id must not be blank")
        self._check_choices()
        self._check_security()
        # Validates the key, algorithm and page size together; warned here, once per process.
        if self.hash_config().uses_development_key:
            warn_development_key()

    def _check_choices(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.model_size not in MODEL_SIZE_NAMES:
            raise ConfigError(f"model_size must be one of {MODEL_SIZE_NAMES}, "
                              f"got {self.model_size!r}")
        if self.device == "cuda" and not _cuda_available():
            raise ConfigError(
                "device cuda was asked for but torch sees no CUDA GPU "
                "(torch.cuda.is_available() is False); use --device cpu"
            )
        levels = ("debug", "info", "warning", "error")
        if self.log_level.lower() not in levels:
            raise ConfigError(f"log_level must be one of {levels}, got {self.log_level!r}")

    def _check_security(self) -> None:
        check_security_settings(self)  # the server side: same rules as the coordinator's
        for name in ("token_file", "tls_ca"):
            path = getattr(self, name)
            if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
                raise ConfigError(f"{name}: {path!r} is not a readable file")
        if self.rate_limit_burst < 1:
            raise ConfigError(f"rate_limit_burst must be >= 1, got {self.rate_limit_burst}")
        if self.max_streams_per_identity < 1:
            raise ConfigError(f"max_streams_per_identity must be >= 1, got "
                              f"{self.max_streams_per_identity}")
        # Read them now: a bad file stops the worker at start, not at its first reconnect.
        self.client_tls()
        self.coordinator_token()

    def client_tls(self) -> ClientTls | None:
        """TLS to the coordinator: None (plaintext) unless ``tls_ca`` is set; then the worker's
        own certificate and key, when set, are its client certificate. Reads the files now."""
        if self.tls_ca is None:
            return None
        try:
            return ClientTls.from_files(self.tls_ca, self.tls_cert, self.tls_key)
        except ValueError as exc:
            raise ConfigError(f"tls_ca/tls_cert/tls_key: {exc}") from None

    def coordinator_token(self) -> str | None:
        """The bearer token the worker presents to the coordinator (read from ``token_file``
        now, so a rotated file is used on the next start), or None without one."""
        return read_token_setting(self.token_file)

    def hash_config(self) -> HashConfig:
        """The deployment hashing parameters (they must equal the coordinator's)."""
        algorithms = [a.value for a in HashAlgorithm]
        if self.hash_algorithm not in algorithms:
            raise ConfigError(
                f"hash_algorithm must be one of {algorithms}, got {self.hash_algorithm!r}"
            )
        try:
            if self.hash_key is None:
                return HashConfig(DEV_HASH_KEY, HashAlgorithm(self.hash_algorithm),
                                  self.page_size)
            return HashConfig.from_hex_key(self.hash_key, self.hash_algorithm, self.page_size)
        except ValueError as exc:
            raise ConfigError(f"hash_key (KVCOORD_HASH_KEY): {exc}") from None

    def resolved_device(self) -> str:
        """``cpu`` or ``cuda`` (``auto`` picks cuda when torch sees a GPU)."""
        if self.device == "auto":
            return "cuda" if _cuda_available() else "cpu"
        return self.device

    def identity(self, bound_port: int) -> tuple[str, str]:
        """(worker id, advertised address) once the service is bound to ``bound_port``."""
        host, _port = _split_host_port("listen", self.listen)
        address = self.advertise or f"{host}:{bound_port}"
        worker_id = self.worker_id or f"{socket.gethostname()}-{bound_port}"
        return worker_id, address

    def http_url(self, bound_port: int) -> str:
        """The OpenAI base URL registered for gateways once ``http_listen`` is bound to
        ``bound_port``: its host, or (listening on a wildcard) the advertised address's host;
        https with a TLS certificate."""
        host, _port = _split_host_port("http_listen", self.http_listen or "")
        if host in WILDCARD_HOSTS:
            host = (self.advertise or self.listen).rpartition(":")[0]
        scheme = "https" if self.tls_cert else "http"
        return f"{scheme}://{host}:{bound_port}"

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> WorkerConfig:
        """Build from environment then flags (``None`` flag values mean "not given")."""
        return build_config(cls, flags or {}, env or {})


def _split_host_port(name: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{name} must be HOST:PORT, got {value!r}")
    return host, int(port)


def _cuda_available() -> bool:
    import torch  # imported here: the config is read before anything heavy is needed

    return bool(torch.cuda.is_available())
