"""``kvcoord bench transport``'s quick form on the cases this host can run without a broker of
its own: gRPC streams and Redis Streams on a real redis-server (the bench starts its own). Each
must deliver every batch its producers published; a transport that drops one fails here."""

from __future__ import annotations

import pytest

from bench.bench_transport import (
    QUICK_SECONDS,
    QUICK_WORKERS,
    run_case,
    transport_invariants,
    transport_steps,
)
from tests.conftest import skip_without_redis

WORKERS, SECONDS = QUICK_WORKERS, QUICK_SECONDS  # the quick form's (smallest) size
BATCHES = WORKERS * 3  # 5 a second each for 0.6 s


def _check_delivered(result: dict[str, object], transport: str) -> None:
    consumer, producer = result["consumer"], result["producer"]
    assert isinstance(consumer, dict) and isinstance(producer, dict)
    assert result["transport"] == transport
    assert result["workers"] == WORKERS
    assert result["rate_target"] == WORKERS * 5.0
    assert producer["sent"] == BATCHES
    assert consumer["expected"] == BATCHES
    assert consumer["batches"] == BATCHES
    assert consumer["keys"] == BATCHES * 128  # 64 stored + 64 removed each
    assert result["delivered"] is True
    assert consumer["cpu_us_per_batch"] > 0
    assert 0 < consumer["latency_p50_ms"] <= consumer["latency_p99_ms"]
    assert consumer["reads"] >= 1


def test_grpc_streams_deliver_and_ack_every_batch() -> None:
    result = run_case("grpc", WORKERS, seconds=SECONDS)

    _check_delivered(result, "grpc")
    assert result["producer"]["acks"] == BATCHES  # one ack per batch, each read back
    assert result["consumer"]["reads"] == BATCHES  # a gRPC read is one message
    assert "broker_cpu_us_per_batch" not in result["consumer"]  # no broker


@pytest.mark.redis
def test_redis_streams_deliver_every_batch_read_in_bulk() -> None:
    skip_without_redis()
    result = run_case("redis", WORKERS, seconds=SECONDS)

    _check_delivered(result, "redis")
    assert result["redis_parser"] == "python"
    assert result["consumer"]["broker_cpu_us_per_batch"] >= 0
    assert result["consumer"]["broker_version"]


def test_a_case_that_lost_batches_breaks_the_invariant() -> None:
    lost = {"transport": "redis", "delivered": False,
            "consumer": {"batches": 319, "expected": 320}, "producer": {"sent": 320}}
    skipped = {"transport": "nats", "skipped": "no NATS server at nats://127.0.0.1:4222"}

    assert transport_invariants({"redis_64": lost, "nats_jetstream_64": skipped,
                                 "comparison": {}}) == [
        "redis_64: 319 of 320 batches arrived (320 sent)"]


def test_the_quick_form_runs_the_cases_at_64_workers_then_compares() -> None:
    names = [name for name, _ in transport_steps(quick=True)]

    assert names == ["grpc_64", "redis_64", "redis_aof_everysec_64",
                     "redis_hiredis_aof_everysec_linger_64", "nats_jetstream_64", "comparison"]
