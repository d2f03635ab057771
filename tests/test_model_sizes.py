"""The reference model's named sizes: every name the config accepts has a shape, every shape
fits the shipped tokenizer and context, and the setting is read like any other."""

from __future__ import annotations

import math

import pytest

from bench.bench_host_tier import BENCH_MODEL
from worker.config import MODEL_SIZE_NAMES, ConfigError, WorkerConfig
from worker.runtime.engine import ModelConfig
from worker.runtime.model_sizes import MODEL_SIZES
from worker.text.tokenizer import reference_tokenizer


def params(model: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in model.weight_shapes().values())


def test_every_size_the_config_accepts_has_a_shape_and_tiny_is_the_old_default() -> None:
    assert tuple(MODEL_SIZES) == MODEL_SIZE_NAMES
    assert WorkerConfig().model_size == "tiny"
    assert MODEL_SIZES["tiny"] == ModelConfig()


def test_every_size_keeps_the_shipped_vocabulary_and_context() -> None:
    for model in MODEL_SIZES.values():
        assert model.vocab_size == reference_tokenizer().vocab_size == 512
        assert model.max_context == ModelConfig().max_context == 4096


def test_sizes_grow_and_bench_is_the_host_tier_benchmark_model() -> None:
    assert MODEL_SIZES["bench"] == BENCH_MODEL
    counts = [params(MODEL_SIZES[name]) for name in ("tiny", "small", "bench")]
    assert counts == sorted(counts)
    assert [round(n / 1e6, 1) for n in counts] == [0.1, 9.8, 23.1]


def test_model_size_comes_from_the_environment_and_an_unknown_one_is_refused() -> None:
    config = WorkerConfig.from_sources({}, {"KVCOORD_MODEL_SIZE": "small"})
    assert config.model_size == "small"
    with pytest.raises(ConfigError, match=r"model_size must be one of \('tiny', 'small'"):
        WorkerConfig(model_size="huge")
