"""``GatewayConfig``: one frozen object from ``kvcoord gateway`` flags over ``KVCOORD_*``
variables (``coordinator.config.build_config``), checked at start."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.client.targets import Targets
from coordinator.config import ConfigError, build_config, read_token_setting
from coordinator.metrics_http import host_of

__all__ = ["ConfigError", "GatewayConfig"]


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    coordinator: str = "127.0.0.1:50051"
    """TARGETS of the coordinator: ``host:port``, a comma-separated list, or ``dns:///name``."""
    embed_coordinator: str | None = None
    """HOST:PORT: run a coordinator replica in the gateway's own process, listening there for
    workers, bridges and SDK clients (its other settings from the ``KVCOORD_*`` variables
    ``kvcoord coordinator`` reads), and route this gateway's requests to it in process, with no
    RPC; ``coordinator`` is then not used. Unset: route through ``coordinator``."""
    listen: str = "127.0.0.1:8080"
    """HOST:PORT the OpenAI-compatible endpoint listens on; port 0 picks a free one."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer directory; unset = the shipped reference tokenizer."""
    model: str = "default"
    """The model name clients ask for (and the coordinator's hash namespace)."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters the engines serve (vLLM ``--lora-modules NAME=PATH``): a request whose
    ``model`` names one is routed in that adapter's hash namespace, where the bridge keys the
    engine's blocks of that adapter; it goes to the engine unchanged. Env: comma-separated."""
    max_context: int | None = None
    """Tokens of context; unset = the tokenizer config's ``model_max_length``."""
    metrics_port: int | None = None
    """Serve Prometheus ``/metrics`` (``kvcoord_gateway_*``) on this port; unset = none."""
    metrics_host: str | None = None
    """The host ``/metrics`` binds; unset = ``listen``'s host, so a gateway on loopback keeps
    its metrics there too (``0.0.0.0`` for every interface)."""
    max_body_bytes: int = 8 * 1024 * 1024
    """A request body over this is refused with 413."""
    route_retries: int = 2
    """Routes tried again, excluding the worker, when one fails before its first byte."""
    drain_wait_ms: int = 30_000
    """How long a request waits out a sync policy drain before 503."""
    connect_timeout_ms: int = 2_000
    """Connecting to a worker; past it the worker counts as failed and the request re-routes."""
    upstream_timeout_ms: int = 600_000
    """A whole forwarded request at most (a long generation)."""
    shutdown_grace_ms: int = 30_000
    """On SIGTERM: stop accepting, then let requests in flight finish for this long."""
    token_file: str | None = None
    """The gateway's own bearer token, used only to ask the coordinator whether it is ready
    (``/readyz``); requests always go on under their client's token."""
    tls_ca: str | None = None
    """CA (PEM) that verifies the coordinator: TLS to it."""
    log_level: str = "info"

    def __post_init__(self) -> None:
        try:
            Targets.parse(self.coordinator)
        except ValueError as exc:
            raise ConfigError(f"coordinator: {exc}") from None
        for name in ("listen", "embed_coordinator"):
            value = getattr(self, name)
            _host, sep, port = (value or "").rpartition(":")
            if value is not None and (not sep or not port.isdigit()
                                      or not 0 <= int(port) <= 65535):
                raise ConfigError(f"{name} must be HOST:PORT, got {value!r}")
        positive = ("max_body_bytes", "drain_wait_ms", "connect_timeout_ms",
                    "upstream_timeout_ms", "shutdown_grace_ms")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.route_retries < 0:
            raise ConfigError(f"route_retries must be >= 0, got {self.route_retries}")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError(f"max_context must be >= 1, got {self.max_context}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port out of range: {self.metrics_port}")
        if not self.model:
            raise ConfigError("model must not be empty")
        for adapter in self.adapters:
            if not adapter or adapter == self.model or not adapter.isprintable():
                raise ConfigError(f"adapters: {adapter!r} is not an adapter name (empty, the "
                                  "base model's, or unprintable)")
        if len(set(self.adapters)) != len(self.adapters):
            raise ConfigError(f"adapters: a name is given twice in {list(self.adapters)}")
        if self.metrics_host == "":
            raise ConfigError("metrics_host must not be empty (leave it unset for listen's host)")

    def metrics_bind_host(self) -> str:
        """Where ``/metrics`` listens: ``metrics_host``, or else ``listen``'s host."""
        return self.metrics_host if self.metrics_host is not None else host_of(self.listen)

    def own_token(self) -> str | None:
        """The gateway's own bearer token, read from ``token_file`` now (None without one).
        Raises ConfigError for a file that holds no single token."""
        return read_token_setting(self.token_file)

    @classmethod
    def from_sources(cls, flags: Mapping[str, Any] | None = None,
                     env: Mapping[str, str] | None = None) -> GatewayConfig:
        """Environment, then flags (``None`` flag values mean "not given")."""
        return build_config(cls, flags or {}, env or {})
