"""The agent's pieces that need no network: the Sync sequence bookkeeping (EventLog), policy
commands against a real runtime, and WorkerConfig validation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.config import ConfigError
from coordinator.v1 import coordinator_pb2 as pb
from tests.coordinator_fixtures import DEV_HASH
from tests.tls_certs import make_pki
from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics
from worker.runtime.engine import ModelConfig
from worker.runtime.runtime import WorkerRuntime
from worker.serving.gate import Draining, GenerationGate
from worker.serving.policy_commands import PolicyCommandHandler
from worker.sync.event_log import EventLog

STORED, REMOVED = pb.PageEvent.KIND_STORED, pb.PageEvent.KIND_REMOVED


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_events_of_one_kind_merge_and_batches_are_numbered_from_one() -> None:
    log = EventLog(max_unacked=8)
    log.add(STORED, [key(1)])
    log.add(STORED, [key(2)])
    log.add(REMOVED, [key(1)])
    batch = log.cut()
    assert batch is not None and batch.seq == 1
    assert [(e.kind, e.page_keys) for e in batch.events] == [
        (STORED, key(1) + key(2)), (REMOVED, key(1)),
    ]
    assert log.cut() is None and log.unacked == 1
    log.ack(1)
    assert log.unacked == 0 and log.last_acked == 1


def test_a_batch_stays_under_the_message_limit_and_splits_large_events_in_order() -> None:
    log = EventLog(max_unacked=8, max_message_bytes=1024 + 16 + 16 * 10)  # 10 keys a batch
    full = log.add(STORED, [key(i) for i in range(25)])
    assert full
    batches = [log.cut() for _ in range(3)]
    assert [len(b.events[0].page_keys) // 16 for b in batches if b] == [10, 10, 5]
    assert b"".join(b.events[0].page_keys for b in batches if b) == b"".join(
        key(i) for i in range(25))
    assert [b.seq for b in batches if b] == [1, 2, 3]


def test_resume_resends_unacked_batches_from_next_seq() -> None:
    log = EventLog(max_unacked=8)
    for i in range(3):
        log.add(STORED, [key(i)])
        log.cut()
    log.ack(1)
    resume = log.resume(next_seq=3)  # the coordinator applied 2 but the ack was lost
    assert [b.seq for b in resume.batches] == [3] and resume.gap_seq is None


def test_lost_batches_make_resume_ask_for_a_resync_through_a_gap() -> None:
    log = EventLog(max_unacked=2)
    for i in range(4):
        log.add(STORED, [key(i)])
        log.cut()
    resume = log.resume(next_seq=1)  # batches 1 and 2 were dropped unsent
    assert resume.batches == [] and resume.gap_seq == 5
    assert log.rebase() == 5  # the inventory answering the resync carries seq 5
    log.add(REMOVED, [key(0)])
    after = log.cut()
    assert after is not None and after.seq == 6


def test_a_new_incarnation_announces_its_inventory_from_seq_one() -> None:
    log = EventLog(max_unacked=8, max_message_bytes=1024 + 16 + 16 * 2)
    log.add(STORED, [key(9)])
    log.cut()
    log.restart()
    batches = log.inventory_batches({pb.TIER_GPU: [key(i) for i in range(5)]})
    assert [b.seq for b in batches] == [1, 2, 3]
    assert all(e.kind == STORED and e.tier == pb.TIER_GPU for b in batches for e in b.events)


def test_an_announcement_cuts_one_tier_per_batch_under_the_message_limit() -> None:
    log = EventLog(max_unacked=8, max_message_bytes=1024 + 16 + 16 * 2)  # 2 keys a message
    batches = log.inventory_batches({pb.TIER_GPU: [key(i) for i in range(3)],
                                     pb.TIER_CPU: [key(7)]})
    assert [(b.seq, b.events[0].tier, len(b.events[0].page_keys) // 16) for b in batches] == [
        (1, pb.TIER_GPU, 2), (2, pb.TIER_GPU, 1), (3, pb.TIER_CPU, 1)]


def test_a_resync_answer_is_chunked_by_tier_with_the_last_chunk_marked() -> None:
    log = EventLog(max_unacked=8, max_message_bytes=1024 + 16 + 16 * 2)
    log.add(STORED, [key(1)])
    log.cut()
    seq = log.rebase()
    chunks = log.inventory_chunks({pb.TIER_GPU: [key(i) for i in range(3)],
                                   pb.TIER_CPU: [key(9)]}, resync_id=4)
    assert [(c.resync_id, c.tier, len(c.page_keys) // 16, c.last, c.seq) for c in chunks] == [
        (4, pb.TIER_GPU, 2, False, seq), (4, pb.TIER_GPU, 1, False, seq),
        (4, pb.TIER_CPU, 1, True, seq)]
    [empty] = log.inventory_chunks({}, resync_id=5)
    assert (empty.resync_id, empty.page_keys, empty.last) == (5, b"", True)


def test_events_merge_only_within_one_tier_and_a_clear_supersedes_what_is_pending() -> None:
    log = EventLog(max_unacked=8)
    log.add(STORED, [key(1)], pb.TIER_GPU)
    log.add(STORED, [key(2)], pb.TIER_CPU)
    log.add(STORED, [key(3)], pb.TIER_CPU)
    batch = log.cut()
    assert [(e.tier, len(e.page_keys) // 16) for e in batch.events] == [
        (pb.TIER_GPU, 1), (pb.TIER_CPU, 2)]
    log.add(STORED, [key(4)])
    assert log.add(pb.PageEvent.KIND_CLEARED, []) is True  # cut at once
    log.add(STORED, [key(5)])
    batch = log.cut()
    assert [(e.kind, e.page_keys) for e in batch.events] == [
        (pb.PageEvent.KIND_CLEARED, b""), (STORED, key(5))]


@pytest.fixture
def runtime() -> WorkerRuntime:
    return WorkerRuntime(model=ModelConfig(), pages=16, page_size=16, hash_config=DEV_HASH)


async def test_drain_waits_for_running_generation_then_acks_and_resume_reopens(
    runtime: WorkerRuntime,
) -> None:
    gate, sent = GenerationGate(), []
    handler = PolicyCommandHandler(runtime, gate, WorkerMetrics(), lambda r: sent.append(r) or True)
    gate.enter()  # one generation in flight
    handler.handle(pb.PolicyCommand(kind=pb.PolicyCommand.KIND_DRAIN, version=3))
    await asyncio.sleep(0.05)
    assert sent == [] and gate.closed
    with pytest.raises(Draining):
        gate.enter()
    gate.leave()
    await handler.idle()
    assert [(r.policy_ack.stage, r.policy_ack.version) for r in sent] == [
        (pb.PolicyAck.STAGE_DRAINED, 3)]
    handler.handle(pb.PolicyCommand(kind=pb.PolicyCommand.KIND_APPLY, version=3))
    handler.handle(pb.PolicyCommand(kind=pb.PolicyCommand.KIND_RESUME, version=3))
    await handler.idle()
    assert sent[-1].policy_ack.stage == pb.PolicyAck.STAGE_APPLIED
    assert runtime.policy_version == 3 and not gate.closed
    assert gate.take_completed() == 1 and gate.take_completed() == 0
    await handler.stop()


@pytest.mark.parametrize(("settings", "message"), [
    ({"listen": "0.0.0.0:7000"}, "advertise"),
    ({"listen": "nope"}, "listen must be HOST:PORT"),
    ({"coordinator": ""}, "coordinator"),
    ({"pages": 0}, "pages must be > 0"),
    ({"device": "tpu"}, "device must be one of"),
    ({"hash_key": "zz"}, "hash_key"),
    ({"backoff_initial_ms": 10, "backoff_max_ms": 5}, "backoff_max_ms"),
])
def test_bad_worker_settings_are_refused_naming_the_setting(
    settings: dict[str, object], message: str,
) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerConfig(**settings)  # type: ignore[arg-type]


def test_worker_config_reads_kvcoord_env_and_flags_win() -> None:
    env = {"KVCOORD_PAGES": "32", "KVCOORD_PAGE_SIZE": "8", "KVCOORD_LISTEN": "0.0.0.0:1"}
    config = WorkerConfig.from_sources({"advertise": "w.local:1", "pages": 64}, env)
    assert (config.pages, config.page_size, config.advertise) == (64, 8, "w.local:1")
    worker_id, address = config.identity(1)
    assert worker_id.endswith("-1") and address == "w.local:1"
    assert config.hash_config().page_size == 8


@pytest.mark.parametrize(("settings", "message"), [
    ({"rate_limit_per_s": -1.0}, "rate_limit_per_s must be >= 0"),
    ({"rate_limit_burst": 0}, "rate_limit_burst must be >= 1"),
    ({"max_streams_per_identity": 0}, "max_streams_per_identity must be >= 1"),
    ({"token_file": "/nonexistent/token"}, "token_file"),
    ({"tls_ca": "/nonexistent/ca.pem"}, "tls_ca"),
    ({"tls_client_ca": "/nonexistent/ca.pem"}, "tls_client_ca"),
    ({"auth_file": "/nonexistent/auth.toml"}, "auth_file"),
])
def test_bad_security_settings_are_refused_naming_the_setting(
    settings: dict[str, object], message: str,
) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerConfig(**settings)  # type: ignore[arg-type]


def test_tls_files_are_read_and_checked_when_the_config_is_built(tmp_path: Path) -> None:
    pki = make_pki(tmp_path, ("worker-0",))
    cert, key = pki.clients["worker-0"].cert, pki.clients["worker-0"].key
    with pytest.raises(ConfigError, match="tls_cert and tls_key"):
        WorkerConfig(tls_cert=cert)
    with pytest.raises(ConfigError, match="tls_cert and tls_key"):
        WorkerConfig(tls_key=key)
    with pytest.raises(ConfigError, match="tls_client_ca"):
        WorkerConfig(tls_client_ca=pki.ca)  # mutual TLS on a plaintext server
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello")
    with pytest.raises(ConfigError, match=f"tls_ca.*{not_pem}.*not PEM"):
        WorkerConfig(tls_ca=str(not_pem))
    assert WorkerConfig(tls_cert=cert, tls_key=key).client_tls() is None  # serves TLS only
    tls = WorkerConfig(tls_ca=pki.ca, tls_cert=cert, tls_key=key).client_tls()
    assert tls is not None
    assert (tls.ca_pem, tls.cert_pem, tls.key_pem) == (
        Path(pki.ca).read_bytes(), Path(cert).read_bytes(), Path(key).read_bytes())
    only_ca = WorkerConfig(tls_ca=pki.ca).client_tls()
    assert only_ca is not None and only_ca.cert_pem is None


def test_the_coordinator_token_comes_from_token_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    env = {"KVCOORD_TOKEN_FILE": str(token_file), "KVCOORD_RATE_LIMIT_PER_S": "0"}
    config = WorkerConfig.from_sources({}, env)
    assert config.coordinator_token() == "s3cret-token"
    assert config.rate_limit_per_s == 0.0  # 0 = off
    assert WorkerConfig().coordinator_token() is None
    token_file.write_text("two\ntokens\n")
    with pytest.raises(ConfigError, match=r"token_file.*more than one token"):
        WorkerConfig(token_file=str(token_file))
    token_file.write_text("")
    with pytest.raises(ConfigError, match=r"token_file.*empty"):
        WorkerConfig(token_file=str(token_file))
