"""What a KV page in host memory costs to reuse: the copy back to the device, in prefill time.

A page a worker holds in a lower tier (host memory) is reusable, but only after it is copied
back over the host link. The router credits such a hit at that copy's cost, and the simulator
charges the same time, so both come from these constants (config: ``kv_bytes_per_token``,
``host_to_device_bytes_per_s``, ``prefill_tokens_per_s``; docs/ARCHITECTURE.md §6):

- ``kv_bytes_per_token = 131_072`` (128 KiB): Llama-3-8B in bf16, 32 layers x 8 KV heads x
  128 dims x 2 (K and V) x 2 bytes. The simulator's default capacity assumes the same model.
- ``host_to_device_bytes_per_s = 25e9``: a pinned host-to-device copy over PCIe. A Gen5 x16
  link carries 64 GB/s per direction raw and measures ~50 GB/s; a Gen4 x16 link (A100 hosts)
  ~25 GB/s, which is also what a Gen5 link shared by two GPUs behind one switch leaves each.
  The lower figure is the cautious one: it never over-credits a host hit.
- ``prefill_tokens_per_s = 15_000``: Llama-3-8B prefill on one H100/H200-class GPU (the
  figure ``KvAwareWeights`` and the simulator's cost model already assume).

With these, copying one token's KV back takes 131,072 / 25e9 = 5.2 us against 67 us to
recompute it: a host hit costs 0.079 prefill tokens (``lower_tier_token``), i.e. it is credited
0.92 of a device hit (Dynamo's router credits a host hit 0.75 by a fixed weight, llm-d 0.8).

Pure core: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierCosts:
    """The constants above; ValueError unless each is finite and > 0."""

    kv_bytes_per_token: int = 131_072
    host_to_device_bytes_per_s: float = 25e9
    prefill_tokens_per_s: float = 15_000.0

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "host_to_device_bytes_per_s", "prefill_tokens_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"TierCosts.{name} must be finite and > 0, got {value!r}")

    def copy_back_s(self, tokens: int) -> float:
        """Seconds to copy ``tokens`` tokens' KV from host memory to the device."""
        return tokens * self.kv_bytes_per_token / self.host_to_device_bytes_per_s

    @property
    def lower_tier_token(self) -> float:
        """A host-tier token's copy-back time in prefill-token equivalents (the routing cost's
        unit): ``prefill_tokens_per_s * kv_bytes_per_token / host_to_device_bytes_per_s``."""
        return self.copy_back_s(1) * self.prefill_tokens_per_s
