"""Named sizes of the reference model: ``kvcoord worker --model-size`` (``WorkerConfig.model_size``,
``KVCOORD_MODEL_SIZE``).

Every size keeps the shipped tokenizer's 512-id vocabulary and the 4,096-token context, so
prompts, page keys, the HTTP endpoint and the policy-version seeds mean the same whatever the
size; only what a forward pass costs changes. The names are ``worker.config.MODEL_SIZE_NAMES``
(the config validates them without importing torch); this module maps them to shapes.
"""

from __future__ import annotations

from types import MappingProxyType

from worker.runtime.engine import ModelConfig

MODEL_SIZES = MappingProxyType({
    # The default (~0.1M parameters): a 2,048-token prefill is milliseconds, so tests and CI
    # fleets start and answer at once, and a prefix hit saves next to nothing.
    "tiny": ModelConfig(),
    # ~9.8M parameters, `kvcoord up`'s. Why this size: a prefix hit must save time a client
    # sees (one torch thread, 2 shared cores: a 512-token prompt's prefill 225 ms cold, 47 ms
    # with 416 tokens cached, 9 ms all cached; tiny's cold one is 7 ms, under the noise of
    # queueing), and the demo's two passes must still fit in about a minute there.
    "small": ModelConfig(hidden=384, layers=6, heads=6, kv_heads=2, head_dim=64,
                         intermediate=1024),
    # ~23M parameters: the host-tier benchmark's model (bench/bench_host_tier.py BENCH_MODEL),
    # where prefill dominates a KV copy.
    "bench": ModelConfig(hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64,
                         intermediate=1408),
})
"""Size name -> model shape (read-only)."""
