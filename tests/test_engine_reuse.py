"""Reusing cached prefix pages gives the same logits as a full recompute, and weights are
namespaced by policy version: versions never share pages."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from coordinator.core.hashing import HashConfig
from coordinator.core.index import Tier
from worker.runtime import InvalidRequest
from worker.runtime.engine import ModelConfig, ReferenceEngine
from worker.runtime.runtime import WorkerRuntime

KEY = bytes(range(32))
MODEL = ModelConfig(max_context=512)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="torch sees no CUDA device"
        ),
    ),
]


class Sink:
    """An EventSink that remembers every key it was told about, in order."""

    def __init__(self) -> None:
        self.stored_keys: list[bytes] = []
        self.removed_keys: list[bytes] = []
        self.moved_keys: list[tuple[Tier, list[bytes]]] = []

    def stored(self, keys: list[bytes]) -> None:
        self.stored_keys += keys

    def removed(self, keys: list[bytes]) -> None:
        self.removed_keys += keys

    def moved(self, keys: list[bytes], tier: Tier) -> None:
        self.moved_keys.append((tier, keys))


def runtime(
    page_size: int = 16, *, device: str = "cpu", pages: int = 256, **kwargs: object
) -> WorkerRuntime:
    return WorkerRuntime(
        model=MODEL,
        pages=pages,
        page_size=page_size,
        hash_config=HashConfig(KEY, page_size=page_size),
        device=device,
        **kwargs,  # type: ignore[arg-type]
    )


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(MODEL.vocab_size) for _ in range(n)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16, 7])
def test_reused_prefix_logits_equal_full_recompute(page_size: int, device: str) -> None:
    rng = random.Random(page_size)
    rt = runtime(page_size, device=device, pages=2048 // page_size)
    system = tokens(rng, 45)  # not a multiple of 7 or 16: the last shared page is partial
    prompts = [system + tokens(rng, rng.randrange(1, 40)) for _ in range(4)]
    prompts.append(prompts[1] + tokens(rng, 30))  # a second turn: reuses prompt 1 whole
    prompts.append(prompts[2][: 2 * page_size])  # ends on a page boundary, fully cached
    reused = []
    for prompt in prompts:
        with_cache = rt.logits_for(prompt, use_cache=True)
        full = rt.logits_for(prompt, use_cache=False)
        assert full.shape == (len(prompt), MODEL.vocab_size)
        rows = with_cache.shape[0]
        reused.append(len(prompt) - rows)
        diff = (with_cache - full[-rows:]).abs().max().item()
        assert diff <= 1e-5, f"page_size {page_size}: max abs diff {diff}"
    shared_pages = len(system) // page_size * page_size
    assert reused[0] == 0
    assert reused[1:4] == [shared_pages] * 3
    assert reused[4] == len(prompts[1]) // page_size * page_size
    assert reused[5] == 2 * page_size - 1  # only the last token is re-run, for its logits
    rt.check_integrity()


def test_second_generate_reuses_every_full_page_and_answers_the_same() -> None:
    sink = Sink()
    rt = runtime(16, events=sink)
    prompt = tokens(random.Random(1), 40)
    first = rt.generate(prompt, 8)
    second = rt.generate(prompt, 8)
    assert (first.cached_tokens, first.computed_tokens) == (0, 40)
    assert (second.cached_tokens, second.computed_tokens) == (32, 8)
    assert second.tokens == first.tokens and len(first.tokens) == 8
    # 40 prompt + 7 fed-back tokens have KV: two full pages were stored, once.
    assert rt.inventory() == {Tier.GPU: sink.stored_keys} and len(sink.stored_keys) == 2
    assert sink.removed_keys == []
    rt.check_integrity()


def test_fully_cached_prompt_reruns_only_its_last_token() -> None:
    rt = runtime(16)
    prompt = tokens(random.Random(2), 48)
    first = rt.generate(prompt, 4)
    second = rt.generate(prompt, 4)
    assert (second.cached_tokens, second.computed_tokens) == (48, 1)
    assert second.tokens == first.tokens
    rt.check_integrity()


def test_policy_versions_have_different_weights() -> None:
    cpu = torch.device("cpu")
    w0 = ReferenceEngine.seeded(MODEL, 0, device=cpu).state_dict()
    w0_again = ReferenceEngine.seeded(MODEL, 0, device=cpu).state_dict()
    w1 = ReferenceEngine.seeded(MODEL, 1, device=cpu).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(w0[name], w0_again[name])
    assert not torch.allclose(w0[name], w1[name])


def test_policy_versions_never_reuse_each_others_pages() -> None:
    sink = Sink()
    rt = runtime(16, events=sink)
    prompt = tokens(random.Random(3), 64)
    v0 = rt.generate(prompt, 6)
    keys_v0 = rt.inventory()[Tier.GPU]
    assert rt.load_weights(1) == len(keys_v0) == 4
    assert sink.removed_keys == keys_v0
    v1 = rt.generate(prompt, 6)
    assert (v1.policy_version, v1.cached_tokens) == (1, 0)
    assert v1.tokens != v0.tokens
    assert set(rt.inventory()[Tier.GPU]).isdisjoint(keys_v0)
    # Back to version 0 (an aborted update): same weights, but nothing of v1 is reused.
    rt.load_weights(0)
    again = rt.generate(prompt, 6)
    assert (again.policy_version, again.cached_tokens, again.tokens) == (0, 0, v0.tokens)
    assert rt.inventory() == {Tier.GPU: keys_v0}  # keys depend on the version only, not on history
    rt.check_integrity()


def test_safetensors_round_trip_gives_the_same_outputs(tmp_path: Path) -> None:
    path = str(tmp_path / "v7.safetensors")
    ReferenceEngine.seeded(MODEL, 7, device=torch.device("cpu")).save(path)
    prompt = tokens(random.Random(4), 30)
    seeded = runtime(16, policy_version=7).generate(prompt, 5)
    loaded = runtime(16, policy_version=7, weights_path=path).generate(prompt, 5)
    assert loaded.tokens == seeded.tokens
    switched = runtime(16)
    switched.load_weights(7, path)
    assert switched.generate(prompt, 5) == seeded


def test_unusable_weights_are_refused_and_change_nothing(tmp_path: Path) -> None:
    rt = runtime(16)
    prompt = tokens(random.Random(5), 20)
    before = rt.generate(prompt, 3)
    with pytest.raises(InvalidRequest, match="not found"):
        rt.load_weights(2, str(tmp_path / "missing.safetensors"))
    other = tmp_path / "other.safetensors"
    ReferenceEngine.seeded(ModelConfig(hidden=32), 2, device=torch.device("cpu")).save(str(other))
    with pytest.raises(InvalidRequest, match="do not match"):
        rt.load_weights(2, str(other))
    assert rt.policy_version == 0
    assert rt.generate(prompt, 3).tokens == before.tokens
