"""Tenant isolation in the worker's prefix cache: a prompt reuses only its own tenant's pages
(another tenant's hit would reveal its prompts through cached_tokens and the time to first
token), and the keys the runtime reports are the coordinator's keys for that tenant."""

from __future__ import annotations

import random

from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from coordinator.core.index import Tier
from worker.runtime.engine import ModelConfig
from worker.runtime.runtime import WorkerRuntime

KEY = bytes(range(32))
MODEL = ModelConfig(max_context=512)
PAGE = 16


class Sink:
    """An EventSink that keeps every Stored batch and every removed key, in order."""

    def __init__(self) -> None:
        self.stored_batches: list[list[bytes]] = []
        self.removed_keys: list[bytes] = []

    def stored(self, keys: list[bytes]) -> None:
        self.stored_batches.append(keys)

    def removed(self, keys: list[bytes]) -> None:
        self.removed_keys += keys

    def moved(self, keys: list[bytes], tier: Tier) -> None:
        raise AssertionError(f"no host tier here, yet {len(keys)} keys moved to {tier}")


def runtime(sink: Sink, policy_version: int = 0) -> WorkerRuntime:
    return WorkerRuntime(model=MODEL, pages=64, page_size=PAGE,
                         hash_config=HashConfig(KEY, page_size=PAGE), model_name="m",
                         policy_version=policy_version, events=sink)


def coordinator_keys(tokens: list[int], tenant: str, policy_version: int = 0) -> list[bytes]:
    namespace = Namespace(model="m", tenant=tenant, policy_version=policy_version,
                          page_size=PAGE)
    return PageHasher(HashConfig(KEY, page_size=PAGE)).page_keys(tokens, namespace)


PROMPT = [random.Random(9).randrange(MODEL.vocab_size) for _ in range(40)]  # 2 full pages


def test_the_same_prompt_from_another_tenant_reuses_nothing_and_stores_other_keys() -> None:
    sink = Sink()
    rt = runtime(sink)
    a = rt.generate(PROMPT, 4, tenant="a")
    b = rt.generate(PROMPT, 4, tenant="b")
    assert (a.cached_tokens, a.computed_tokens) == (0, 40)
    assert (b.cached_tokens, b.computed_tokens) == (0, 40)
    assert b.tokens == a.tokens  # same weights, same answer: only the cache is separate
    # 40 prompt + 3 fed-back tokens have KV: two full pages per tenant.
    assert sink.stored_batches == [coordinator_keys(PROMPT, "a"), coordinator_keys(PROMPT, "b")]
    assert set(sink.stored_batches[0]).isdisjoint(sink.stored_batches[1])
    assert rt.inventory() == {Tier.GPU: [*sink.stored_batches[0], *sink.stored_batches[1]]}
    rt.check_integrity()


def test_the_same_tenant_twice_hits_its_own_pages() -> None:
    sink = Sink()
    rt = runtime(sink)
    first = rt.generate(PROMPT, 4, tenant="a")
    second = rt.generate(PROMPT, 4, tenant="a")
    assert (second.cached_tokens, second.computed_tokens) == (32, 8)
    assert second.tokens == first.tokens
    assert sink.stored_batches == [coordinator_keys(PROMPT, "a")]  # stored once
    assert rt.generate(PROMPT, 4).cached_tokens == 0  # the default tenant is a tenant too
    rt.check_integrity()


def test_the_default_tenant_keeps_the_untenanted_keys() -> None:
    sink = Sink()
    rt = runtime(sink, policy_version=2)
    rt.generate(PROMPT, 4)
    again = rt.generate(PROMPT, 4, tenant="")
    assert again.cached_tokens == 32
    assert sink.stored_batches == [coordinator_keys(PROMPT, "", policy_version=2)]
    rt.check_integrity()


def test_logits_for_reuses_only_the_tenants_pages() -> None:
    rt = runtime(Sink())
    rt.logits_for(PROMPT, use_cache=True, tenant="a")
    assert rt.logits_for(PROMPT, use_cache=True, tenant="b").shape[0] == len(PROMPT)
    assert rt.logits_for(PROMPT, use_cache=True, tenant="a").shape[0] == len(PROMPT) - 32
    rt.check_integrity()


def test_a_weight_update_drops_every_tenants_pages_and_rehashes_under_the_new_version() -> None:
    sink = Sink()
    rt = runtime(sink)
    rt.generate(PROMPT, 4, tenant="a")
    rt.generate(PROMPT, 4, tenant="b")
    held = rt.inventory()[Tier.GPU]
    assert rt.load_weights(1) == 4
    assert sink.removed_keys == held and rt.inventory() == {}
    after = rt.generate(PROMPT, 4, tenant="a")
    assert (after.policy_version, after.cached_tokens) == (1, 0)
    assert sink.stored_batches[-1] == coordinator_keys(PROMPT, "a", policy_version=1)
    rt.check_integrity()
