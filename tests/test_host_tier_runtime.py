"""The worker's host tier with real torch forward passes: pages the device pool evicts move to
host memory and come back bit-exact, events say where each page is, a policy update drops both
tiers (and a cross-version hit is impossible even with invalidation switched off), and a host
pool larger than the machine's memory is refused at start."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from coordinator.core.hashing import HashConfig
from coordinator.core.index import Tier
from kvcoord import child_process
from worker.config import ConfigError, WorkerConfig
from worker.runtime.engine import ModelConfig
from worker.runtime.kv_buffers import KVBuffers
from worker.runtime.kv_tier_copy import HostMemoryShort, TierCopier, check_host_pool
from worker.runtime.runtime import WorkerRuntime

PAGE = 16
KEY = bytes(range(32))


class Sink:
    """An EventSink that keeps every event in order: ("stored" | "removed" | tier, keys)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, list[bytes]]] = []

    def stored(self, keys: list[bytes]) -> None:
        self.events.append(("stored", keys))

    def removed(self, keys: list[bytes]) -> None:
        self.events.append(("removed", keys))

    def moved(self, keys: list[bytes], tier: Tier) -> None:
        self.events.append((tier.value, keys))

    def keys(self, what: str) -> list[bytes]:
        return [k for kind, keys in self.events if kind == what for k in keys]


def runtime(*, pages: int = 8, host_pages: int = 16, sink: Sink | None = None,
            policy_version: int = 0, device: str = "cpu") -> WorkerRuntime:
    return WorkerRuntime(model=ModelConfig(), pages=pages, page_size=PAGE,
                         hash_config=HashConfig(KEY, page_size=PAGE), events=sink,
                         host_pages=host_pages, policy_version=policy_version, device=device)


# On a GPU (when one is lent) the host pool is pinned and the copies are DMA.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="torch sees no CUDA device"))]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefix_evicted_to_host_comes_back_bit_exact_instead_of_recomputed(device: str) -> None:
    sink = Sink()
    rt = runtime(sink=sink, device=device)
    a, b = prompt(1, 72), prompt(2, 96)
    first = rt.generate(a, 4)  # 4 full pages of a cached on the device, 4 pages free
    rt.generate(b, 4)  # needs 7 pages of 8: 3 of a's pages (tails first) move to the host
    assert len(sink.keys("cpu")) == 3 and rt.inventory()[Tier.CPU] == sink.keys("cpu")
    assert sink.keys("removed") == []  # the host tier kept every evicted page
    again = rt.generate(a, 4)
    # Page 0 still on the device, pages 1-3 copied back, the 8-token tail computed.
    assert (again.cached_tokens, again.host_cached_tokens, again.computed_tokens) == (64, 48, 8)
    assert again.tokens == first.tokens
    # Copied-back pages give exactly the logits a full recompute gives: bit-exact on the CPU,
    # within the engine tests' tolerance on CUDA (test_engine_reuse.py).
    fresh = runtime(device=device)
    fresh.generate(a, 4)
    fresh.generate(b, 4)
    before = fresh.stats().copies
    reused = fresh.logits_for(a, use_cache=True)
    after = fresh.stats().copies
    assert before is not None and after is not None
    assert after.pages_to_device - before.pages_to_device == 3
    full = fresh.logits_for(a, use_cache=False)
    assert reused.shape[0] == 8
    if device == "cpu":
        assert torch.equal(reused, full[-8:])
    else:
        assert (reused - full[-8:]).abs().max().item() <= 1e-5
    rt.check_integrity()
    fresh.check_integrity()


def test_events_follow_each_page_down_and_back_up_and_a_full_host_pool_drops() -> None:
    sink = Sink()
    rt = runtime(pages=8, host_pages=2, sink=sink)
    a, b = prompt(3, 64), prompt(4, 96)
    rt.generate(a, 4)
    stored_a = sink.keys("stored")
    assert len(stored_a) == 4
    rt.generate(b, 4)
    # b took a's last 3 pages (tails first) and only 2 fit the host pool: the hottest two moved
    # down, the coldest (a's last page, evicted first) was dropped.
    assert sink.keys("cpu") == [stored_a[2], stored_a[1]]
    assert sink.keys("removed") == [stored_a[3]]
    assert rt.inventory()[Tier.CPU] == [stored_a[2], stored_a[1]]
    sink.events.clear()
    again = rt.generate(a, 4)
    assert (again.cached_tokens, again.host_cached_tokens) == (48, 32)
    # The allocation came first: it evicted 3 of b's pages, which dropped (the host pool's
    # two pages were pinned for the copy back); then a's pages came back up, in prompt order.
    assert [kind for kind, _ in sink.events[:3]] == ["removed", "gpu", "stored"]
    assert len(sink.events[0][1]) == 3 and sink.events[1][1] == stored_a[1:3]
    held = rt.inventory()
    assert set(held[Tier.GPU]) >= set(stored_a)
    assert not set(held.get(Tier.CPU, [])) & set(stored_a)  # one tier per key
    stats = rt.stats()
    assert stats.host_total_pages == 2 and stats.copies is not None
    assert stats.copies.pages_to_device == 2
    page_bytes = 2 * 2 * PAGE * 2 * 16 * 4  # layers x K,V x tokens x kv heads x dim x fp32
    assert stats.copies.bytes_to_device == 2 * page_bytes
    rt.check_integrity()


def test_a_policy_update_drops_both_tiers() -> None:
    sink = Sink()
    rt = runtime(sink=sink)
    rt.generate(prompt(5, 64), 4)
    rt.generate(prompt(6, 96), 4)
    held = rt.inventory()
    assert held[Tier.CPU] and held[Tier.GPU]
    sink.events.clear()
    rt.load_weights(1)
    assert rt.inventory() == {}
    assert sorted(sink.keys("removed")) == sorted(held[Tier.GPU] + held[Tier.CPU])
    assert rt.stats().host_free_pages == 16
    rt.check_integrity()


def test_no_cross_version_hit_from_the_host_tier_even_with_invalidation_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rt = runtime()
    a = prompt(7, 64)
    rt.generate(a, 4)
    rt.generate(prompt(8, 96), 4)  # a's pages now in the host tier
    assert rt.inventory()[Tier.CPU]
    prefix = rt._prefix
    assert prefix is not None

    def switch_namespace_only(namespace: object = None) -> int:
        prefix.namespace = namespace  # type: ignore[assignment]
        return 0  # nothing dropped: invalidation is off

    monkeypatch.setattr(prefix, "invalidate", switch_namespace_only)
    rt.load_weights(1)
    assert rt.inventory()[Tier.CPU]  # the v0 pages are still there...
    v1 = rt.generate(a, 4)
    # ...and the version in the hash root keeps them from hitting under v1.
    assert (v1.policy_version, v1.cached_tokens, v1.host_cached_tokens) == (1, 0, 0)
    # Back under v0's namespace the same pages hit: the check above could have failed.
    rt.load_weights(0)
    v0 = rt.generate(a, 4)
    assert v0.cached_tokens > 0


def test_copier_round_trip_moves_exactly_the_named_pages() -> None:
    cpu = torch.device("cpu")
    shape = {"layers": 3, "page_size": 4, "kv_heads": 2, "head_dim": 8, "dtype": torch.float32}
    device, host = KVBuffers(pages=6, device=cpu, **shape), KVBuffers(pages=5, device=cpu, **shape)
    device.tensor.copy_(torch.randn(device.tensor.shape))
    original = device.tensor.clone()
    copier = TierCopier(device, host)
    copier.to_host([4, 1], [0, 3])
    assert torch.equal(host.tensor[:, :, 0], original[:, :, 4])
    assert torch.equal(host.tensor[:, :, 3], original[:, :, 1])
    copier.to_device([3, 0], [5, 2])
    assert torch.equal(device.tensor[:, :, 5], original[:, :, 1])
    assert torch.equal(device.tensor[:, :, 2], original[:, :, 4])
    untouched = [0, 1, 3, 4]
    assert torch.equal(device.tensor[:, :, untouched], original[:, :, untouched])
    assert copier.stats.bytes_to_host == copier.stats.bytes_to_device == 2 * device.page_bytes
    with pytest.raises(ValueError, match="do not match"):
        TierCopier(device, KVBuffers(pages=5, device=cpu, **{**shape, "layers": 2}))


def test_a_host_pool_beyond_the_memory_available_is_refused_with_what_fits() -> None:
    check_host_pool(10, 1000, 10_000)
    check_host_pool(10**12, 1000, None)  # unknown memory: not checked
    with pytest.raises(HostMemoryShort, match=r"--host-pages 11 needs .* at most 10 pages fit"):
        check_host_pool(11, 1000, 10_000)
    with pytest.raises(ValueError, match="host_pages must be >= 0"):
        runtime(host_pages=-1)


def test_kvcoord_worker_refuses_more_host_pages_than_ram_at_start() -> None:
    # 4e9 pages x 8 KiB (the reference model's page) is 32 TB: no machine here has it.
    proc = child_process.run(
        [sys.executable, "-m", "kvcoord.cli", "worker", "--coordinator", "127.0.0.1:1",
         "--listen", "127.0.0.1:0", "--device", "cpu", "--host-pages", "4000000000"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--host-pages 4000000000 needs" in proc.stderr and "pages fit" in proc.stderr


def test_host_pages_out_of_range_or_without_prefix_caching_are_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match=r"host_pages must be 0\.\.4294967295, got -3"):
        WorkerConfig(host_pages=-3)
    with pytest.raises(ConfigError, match="host_pages needs prefix_caching"):
        WorkerConfig(host_pages=8, prefix_caching=False)
    assert WorkerConfig(host_pages=8).host_pages == 8
