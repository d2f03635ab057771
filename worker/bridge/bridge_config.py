"""``kvcoord bridge``'s configuration: one typed value, validated when built (bad values raise
``ValueError`` with the flag's name; the CLI prints it and exits 2)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.core.hashing import DEV_HASH_KEY, HashConfig
from coordinator.logs import warn_development_key
from coordinator.metrics_http import host_of
from worker.bridge.policy_driver import WEIGHT_SOURCES


@dataclass(frozen=True, slots=True)
class BridgeConfig:
    events: str
    coordinator: str
    worker_id: str
    worker_address: str
    model: str = "default"
    page_size: int = 16
    engine_block_size: int | None = None
    replay: str | None = None
    policy_version: int = 0
    hash_key: str | None = None
    heartbeat_ms: int | None = None
    engine: str = "vllm"
    # The engine's OpenAI-compatible base URL ("" = none): what gateways forward to. The
    # worker_address is what schedulers dial for anything else (it may be the same server).
    engine_url: str = ""
    # What Register reports: the coordinator caps what it indexes for one worker at
    # min(max_pages_per_worker, 4x this).
    total_pages: int = 1 << 20
    event_flush_ms: int = 5
    # Policy control: the engine drains, loads, resets and resumes on the coordinator's
    # commands. Needs engine_url (its RL endpoints) and http_listen (where the bridge serves the
    # engine's OpenAI API, registered as the worker's URL).
    policy_control: bool = False
    http_listen: str | None = None
    weights: str = "uri"  # "uri": the engine loads APPLY's weights_uri; "trainer": pushed
    weights_root: str | None = None  # a relative weights_uri is under this directory
    recover_interval_s: float = 5.0
    metrics_port: int | None = None  # serve Prometheus /metrics here (unset: none)
    metrics_host: str | None = None  # where /metrics binds (unset: metrics_bind_host())

    def __post_init__(self) -> None:
        block = self.engine_block_size or self.page_size
        if self.page_size <= 0 or block <= 0:
            raise ValueError("page size and engine block size must be > 0")
        if block % self.page_size:
            raise ValueError(f"engine block size {block} is not a multiple of the page size "
                             f"{self.page_size}")
        if ":" not in self.worker_address:
            raise ValueError(f"--worker-address must be HOST:PORT, got {self.worker_address!r}")
        if not self.worker_id:
            raise ValueError("--worker-id is required")
        if self.engine_url and not self.engine_url.startswith(("http://", "https://")):
            raise ValueError(f"--engine-url must be an http:// or https:// URL, got "
                             f"{self.engine_url!r}")
        if self.policy_control:
            _check_policy_control(self)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        if self.metrics_host == "":
            raise ValueError("--metrics-host must not be empty")
        for name, endpoint in (("--events", self.events), ("--replay", self.replay)):
            if endpoint is not None and "://" not in endpoint:
                raise ValueError(f"{name} must be a ZMQ endpoint such as tcp://HOST:PORT, got "
                                 f"{endpoint!r}")

    def proxy_url(self) -> str:
        """The URL gateways reach the engine through (policy control): ``--http-listen``, with
        the worker address's host when it listens on every interface."""
        assert self.http_listen is not None
        host, _, port = self.http_listen.rpartition(":")
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = self.worker_address.rpartition(":")[0]
        return f"http://{host}:{port}"

    def metrics_bind_host(self) -> str:
        """Where ``/metrics`` listens: ``metrics_host``; else ``http_listen``'s host (the
        bridge's own listen address, under policy control); else loopback, ``127.0.0.1``: a
        bridge without policy control listens nowhere, and its metrics are not published on
        every interface unless ``--metrics-host 0.0.0.0`` asks."""
        if self.metrics_host is not None:
            return self.metrics_host
        return host_of(self.http_listen) if self.http_listen else "127.0.0.1"

    def hash_config(self) -> HashConfig:
        """The deployment hashing; an unset or empty key is the development key, as for the
        coordinator and the worker (an empty KVCOORD_HASH_KEY means "unset" everywhere)."""
        if not self.hash_key:
            warn_development_key()
            return HashConfig(key=DEV_HASH_KEY, page_size=self.page_size)
        return HashConfig.from_hex_key(self.hash_key, page_size=self.page_size)


def _check_policy_control(config: BridgeConfig) -> None:
    if not config.engine_url:
        raise ValueError("policy control needs --engine-url (the engine's RL endpoints), or "
                         "run with --no-policy-control")
    listen = config.http_listen or ""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"policy control needs --http-listen HOST:PORT (where the bridge serves "
                         f"the engine's OpenAI API), got {listen!r}")
    if config.weights not in WEIGHT_SOURCES:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHT_SOURCES)}, got "
                         f"{config.weights!r}")
    if config.recover_interval_s <= 0:
        raise ValueError("--recover-interval-s must be > 0")
