"""CoordinatorConfig: environment, flags, validation at start with the setting named."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.core.routing import KvAwareWeights
from coordinator.core.tier_costs import TierCosts


def test_flags_win_over_environment_which_wins_over_defaults() -> None:
    env = {"KVCOORD_LEASE_MS": "3000", "KVCOORD_PAGE_SIZE": "32", "KVCOORD_REDIS": ""}
    config = CoordinatorConfig.from_sources({"page_size": 64, "redis": None}, env)
    assert (config.lease_ms, config.page_size, config.redis) == (3000, 64, None)
    assert config.heartbeat_ms == 2_000


def test_routing_weights_come_from_config() -> None:
    config = CoordinatorConfig.from_sources({}, {"KVCOORD_KV_QUEUED_TOKEN": "0.5"})
    assert config.kv_weights().queued_token == 0.5


def test_lower_tier_weight_is_derived_from_the_tier_constants() -> None:
    # Defaults: 131,072 B a token over 25e9 B/s is 5.24 us; at 15,000 prefill tokens/s that is
    # 0.0786 of a prefill token; the core's own default is the same derived figure.
    assert CoordinatorConfig().kv_weights().lower_tier_token == pytest.approx(0.0786432)
    assert KvAwareWeights().lower_tier_token == TierCosts().lower_tier_token
    # A slower link doubles it; a faster prefill (fewer us a token) makes a copy dearer too.
    env = {"KVCOORD_HOST_TO_DEVICE_BYTES_PER_S": "12.5e9", "KVCOORD_KV_BYTES_PER_TOKEN": "131072",
           "KVCOORD_PREFILL_TOKENS_PER_S": "30000"}
    config = CoordinatorConfig.from_sources({}, env)
    assert config.kv_weights().lower_tier_token == pytest.approx(0.0786432 * 4)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lease_ms": 0}, "lease_ms must be > 0"),
        ({"heartbeat_ms": 5000, "lease_ms": 4000}, "heartbeat_ms (5000) must be below lease_ms"),
        ({"listen": "nohost"}, "listen must be HOST:PORT"),
        ({"hash_algorithm": "md5"}, "hash_algorithm must be one of"),
        ({"routing_policy": "fastest"}, "routing_policy must be one of"),
        ({"hash_key": "xyz"}, "must be hex"),
        ({"hash_key": "ab" * 8 + "c"}, "must be hex"),
        ({"hash_key": "ab" * 4}, "16..64 bytes"),
        ({"page_size": 8192}, "page_size must be <= 4096"),
        ({"log_level": "loud"}, "log_level must be one of"),
        ({"kv_running_request": -1.0}, "KvAwareWeights.running_request must be >= 0"),
        ({"store_namespace": "a{b}"}, "store_namespace"),
        ({"replica_id": ""}, "replica_id must be 1..128 printable characters"),
        ({"replica_id": "c\n1"}, "replica_id must be 1..128 printable characters"),
        ({"max_ack_delay_ms": -1}, "max_ack_delay_ms must be >= 0"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token must be > 0, got 0"),
        ({"host_to_device_bytes_per_s": -1.0}, "host_to_device_bytes_per_s must be > 0"),
        ({"prefill_tokens_per_s": 0.0}, "prefill_tokens_per_s must be > 0"),
        ({"prefill_tokens_per_s": float("nan")}, "prefill_tokens_per_s must be finite and > 0"),
        ({"host_to_device_bytes_per_s": float("inf")},
         "host_to_device_bytes_per_s must be finite and > 0"),
        ({"shard": "Shard A", "redis": "redis://r"}, "shard must be 1..32 of"),
        ({"shard": "a"}, "shard needs redis"),
        ({"peer_shards": "b=h:1"}, "peer_shards needs shard"),
        ({"shard": "a", "redis": "redis://r", "peer_shards": "b"},
         "peer_shards: expected NAME=HOST:PORT.* got 'b'"),
        ({"shard": "a", "redis": "redis://r", "peer_shards": "b=nohost"},
         "peer_shards: expected NAME=HOST:PORT.* got 'b=nohost'"),
        ({"shard": "a", "redis": "redis://r", "peer_shards": "b=h:1;b=h:2"},
         "peer_shards names shard 'b' twice"),
        ({"shard": "a", "redis": "redis://r", "peer_shards": "a=h:1"},
         "peer_shards names this replica's own shard 'a'"),
    ],
)
def test_bad_settings_are_refused_at_start_naming_the_setting(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CoordinatorConfig(**settings)  # type: ignore[arg-type]


def test_malformed_environment_values_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="KVCOORD_METRICS_PORT='x' is not a valid int"):
        CoordinatorConfig.from_sources({}, {"KVCOORD_METRICS_PORT": "x"})
    with pytest.raises(ConfigError, match="unknown settings"):
        CoordinatorConfig.from_sources({"lease": 5}, {})


def test_peer_shards_parse_into_each_shards_targets_in_order() -> None:
    config = CoordinatorConfig(redis="redis://r", shard="a",
                               peer_shards=" b=h1:1,h2:2 ; c=h3:3 ;")
    assert config.peer_shard_targets() == {"b": ("h1:1", "h2:2"), "c": ("h3:3",)}


def test_peer_shards_beside_tls_are_refused(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n...\n")
    with pytest.raises(ConfigError, match="peer_shards does not dial TLS yet"):
        CoordinatorConfig(redis="redis://r", shard="a", peer_shards="b=h:1",
                          tls_cert=str(pem), tls_key=str(pem))
