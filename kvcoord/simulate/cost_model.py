"""The simulator's cost model: how long a simulated worker takes. The same for every policy.

A worker is modelled as one prefill server with a FIFO queue, plus decoding batched beside it:

- **Prefill**: a request's prefill starts when it reaches the head of its worker's queue (and
  its pages fit, see ``simworker``); it computes only its *uncached* prompt tokens, plus a
  fixed cost per request (``request_overhead_s``, 0 by default) counted as the prefill tokens
  it takes at the full rate. Its first token comes out when the prefill ends:
  ``TTFT = prefill end - arrival`` (queueing included). A token's attention reads every
  position before it, so a token at position ``p`` costs ``1 + p / attention_tokens`` prefill
  tokens (``prefill_work``): computing positions ``c..n`` costs
  ``(n - c) + (n^2 - c^2) / (2 x attention_tokens)``. The default leaves attention out
  (``attention_tokens`` infinite: every token costs one); ``bench engines`` measures it on its
  own engines (two cold prompt lengths).
- **Decode interferes with prefill** (chunked prefill, as vLLM and SGLang run it): every engine
  step carries :attr:`CostModel.step_prefill_tokens` prefill tokens plus one token for each
  sequence decoding on that worker, and a step takes as long as its tokens' compute. A decode
  token costs ``1 + context / kv_read_tokens`` prefill tokens: its own matmuls (as one prefill
  token) plus reading its whole KV context. So while sequences with contexts ``L_1..L_d``
  decode, a prefill advances at::

      rate = prefill_tokens_per_s * C / (C + sum_i (1 + L_i / kv_read_tokens))

  with ``C = step_prefill_tokens``. The rate changes whenever a decode starts or ends; the
  running prefill's remaining tokens are carried over at the new rate. A decoding sequence's
  context is taken as its prompt plus half its output (its mean while decoding).
- **Host-tier hits** (``simulate --host-capacity-tokens``): a prompt's leading pages found in
  the worker's host tier are copied back to the device before its prefill computes, taking
  :meth:`CostModel.copy_back_s` (``TierCosts.copy_back_s``: KV bytes over the host-to-device
  bandwidth, the very constants the router's ``lower_tier_token`` derives from). The copy is
  added to the request's prefill time on the worker's one prefill server (the next request in
  the queue waits for it too), and decodes do not slow it: it is a DMA, not compute.
- **Decode** itself lasts ``output_length x decode_s_per_token`` (not slowed by prefills: only
  TTFT is measured, and decode time only decides how long pages stay pinned and how long the
  sequence slows prefills beside it).

Constants (documented, never tuned per policy; change them for another model or GPU):

- ``prefill_tokens_per_s = 15_000``: Llama-3-8B in bf16 on one H100/H200-class GPU prefills
  roughly 10-30k tokens/s depending on context length (2 x 8e9 FLOP per token plus attention,
  at 40-60% of ~990 TFLOP/s); 15k is the figure
  ``coordinator.core.routing.choosers.KvAwareWeights`` already
  assumes, so the router's exchange rates and the simulator agree.
- ``decode_s_per_token = 0.02``: 20 ms per output token (50 tokens/s per sequence), a typical
  inter-token latency for an 8B model under continuous batching.
- ``step_prefill_tokens = 8192``: vLLM's default token budget per step
  (``max_num_batched_tokens``) for its OpenAI server on GPUs of 70 GiB or more
  (``vllm/engine/arg_utils.py``).
- ``kv_read_tokens = 1700``: context tokens whose KV is read in the time of one prefill token:
  an H100's ~3.35 TB/s of HBM x (1 / 15,000 s) = 223 MB, over Llama-3-8B's 128 KiB of KV per
  token. A 15k-token context (the Mooncake trace's mean prompt) thus costs ~10 prefill tokens
  per decode token.
- ``tiers = TierCosts()`` (``coordinator.core.tier_costs``): 128 KiB of KV per token over a
  25 GB/s host-to-device link, 5.2 us a token (a 15k-token prefix: 79 ms, against 1 s to
  recompute it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from coordinator.core.tier_costs import TierCosts


@dataclass(frozen=True, slots=True)
class CostModel:
    """Time costs of a simulated worker; all positive (ValueError otherwise)."""

    prefill_tokens_per_s: float = 15_000.0
    decode_s_per_token: float = 0.02
    step_prefill_tokens: int = 8192
    kv_read_tokens: int = 1700
    tiers: TierCosts = field(default_factory=TierCosts)
    request_overhead_s: float = 0.0
    """A fixed cost per prefill, paid even by a prompt with nothing to compute (the engine's
    per-request work). 0 by default: not measured for the GPU figures above; ``bench engines``
    measures it for its own engines (the cached prefill)."""
    attention_tokens: float = math.inf
    """The position at which a token's attention costs as much as the rest of its compute
    (``prefill_work``); infinite by default: not measured for the GPU figures above."""

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.decode_s_per_token > 0
                and self.step_prefill_tokens > 0 and self.kv_read_tokens > 0
                and self.attention_tokens > 0):
            raise ValueError(f"cost model constants must be > 0, got {self!r}")
        if not self.request_overhead_s >= 0:
            raise ValueError(f"request_overhead_s must be >= 0, got {self.request_overhead_s}")

    def prefill_work(self, cached_tokens: int, prompt_tokens: int) -> float:
        """The prefill tokens (at position 0's cost) it takes to compute positions
        ``cached_tokens..prompt_tokens`` of a prompt (the module docstring's rule)."""
        computed = prompt_tokens - cached_tokens
        return computed + (prompt_tokens * prompt_tokens - cached_tokens * cached_tokens) / (
            2 * self.attention_tokens)

    def overhead_tokens(self) -> float:
        """The fixed cost per prefill in prefill tokens (at the rate with nothing decoding)."""
        return self.request_overhead_s * self.prefill_tokens_per_s

    def prefill_rate(self, decoding: int, decoding_context_tokens: int) -> float:
        """Prefill tokens per second while ``decoding`` sequences, whose contexts add up to
        ``decoding_context_tokens``, decode beside it (the rule in the module docstring)."""
        step = self.step_prefill_tokens
        decode_cost = decoding + decoding_context_tokens / self.kv_read_tokens
        return self.prefill_tokens_per_s * step / (step + decode_cost)

    def prefill_s(self, uncached_tokens: int) -> float:
        """Seconds to prefill ``uncached_tokens`` tokens with nothing decoding beside them."""
        return uncached_tokens / self.prefill_tokens_per_s

    def copy_back_s(self, host_tokens: int) -> float:
        """Seconds to copy ``host_tokens`` tokens' KV from the host tier back to the device."""
        return self.tiers.copy_back_s(host_tokens) if host_tokens else 0.0

    def decode_s(self, output_tokens: int) -> float:
        """Seconds to decode ``output_tokens`` tokens after the first."""
        return output_tokens * self.decode_s_per_token

    @staticmethod
    def decode_context(input_length: int, output_length: int) -> int:
        """The context a decoding sequence is charged for: its prompt plus half its output."""
        return input_length + output_length // 2
