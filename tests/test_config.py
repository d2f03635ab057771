"""CoordinatorConfig: environment, flags, validation at start with the setting named."""

from __future__ import annotations

import pytest

from coordinator.config import ConfigError, CoordinatorConfig


def test_flags_win_over_environment_which_wins_over_defaults() -> None:
    env = {"KVCOORD_LEASE_MS": "3000", "KVCOORD_PAGE_SIZE": "32", "KVCOORD_REDIS": ""}
    config = CoordinatorConfig.from_sources({"page_size": 64, "redis": None}, env)
    assert (config.lease_ms, config.page_size, config.redis) == (3000, 64, None)
    assert config.heartbeat_ms == 2_000


def test_routing_weights_come_from_config() -> None:
    config = CoordinatorConfig.from_sources({}, {"KVCOORD_KV_QUEUED_TOKEN": "0.5"})
    assert config.kv_weights().queued_token == 0.5


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
