"""The simulator's cost model: how long a simulated worker takes. The same for every policy.

A worker is modelled as one prefill server with a FIFO queue, plus decoding that overlaps it:

- **Prefill**: a request's prefill starts when it reaches the head of its worker's queue (and
  its pages fit, see ``simworker``); it computes only its *uncached* prompt tokens, at
  :attr:`CostModel.prefill_tokens_per_s`, so it takes ``uncached / rate`` seconds. Its first
  token comes out when the prefill ends: ``TTFT = prefill end - arrival`` (queueing included).
- **Decode**: then ``output_length`` tokens at :attr:`CostModel.decode_s_per_token` each. Decode
  runs batched alongside later prefills (chunked prefill) and does not delay them; it only
  keeps the request's pages pinned (unevictable) until it ends.

Constants (documented, never tuned per policy; change them for another model or GPU):

- ``prefill_tokens_per_s = 15_000``: Llama-3-8B in bf16 on one H100/H200-class GPU prefills
  roughly 10-30k tokens/s depending on context length (2 x 8e9 FLOP per token plus attention,
  at 40-60% of ~990 TFLOP/s); 15k is the figure ``coordinator.routing.KvAwareWeights`` already
  assumes, so the router's exchange rates and the simulator agree.
- ``decode_s_per_token = 0.02``: 20 ms per output token (50 tokens/s per sequence), a typical
  inter-token latency for an 8B model under continuous batching.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    """Time costs of a simulated worker; all positive (ValueError otherwise)."""

    prefill_tokens_per_s: float = 15_000.0
    decode_s_per_token: float = 0.02

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.decode_s_per_token > 0):
            raise ValueError(f"cost model constants must be > 0, got {self!r}")

    def prefill_s(self, uncached_tokens: int) -> float:
        """Seconds to prefill ``uncached_tokens`` tokens (cached ones cost nothing)."""
        return uncached_tokens / self.prefill_tokens_per_s

    def decode_s(self, output_tokens: int) -> float:
        """Seconds to decode ``output_tokens`` tokens after the first."""
        return output_tokens * self.decode_s_per_token
