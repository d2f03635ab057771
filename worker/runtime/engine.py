"""The reference engine: a small Llama-style decoder over paged KV buffers.

RMSNorm, rotary position embeddings (the rotate-half convention of Hugging Face Llama),
grouped-query attention and a SwiGLU MLP. Weights use Hugging Face Llama tensor names, come
from a safetensors file or are generated from a seed that the policy version selects (so the
reference fleet can "train": version v always means the same weights on every worker).

Attention reads the cache by gather: a request's slot tensor indexes the flattened
``[pages * page_size, kv_heads, head_dim]`` K/V of each layer. One :meth:`forward` serves
prefill (many new tokens, causal over cached + new) and decode (one token).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from worker.runtime.kv_buffers import KVBuffers

_SEED_TAG = b"kvcoord.reference-weights.v1"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the reference model. The defaults are tiny: a 2,048-token prefill is
    milliseconds on a CPU. ValueError for inconsistent shapes."""

    vocab_size: int = 512
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    rope_theta: float = 10000.0
    max_context: int = 4096
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        sizes = (self.vocab_size, self.hidden, self.layers, self.heads, self.kv_heads,
                 self.head_dim, self.intermediate, self.max_context)
        if min(sizes) < 1:
            raise ValueError(f"model sizes must be >= 1: {self}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model needs, by Hugging Face Llama name."""
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, self.hidden),
            "model.norm.weight": (self.hidden,),
            "lm_head.weight": (self.vocab_size, self.hidden),
        }
        for i in range(self.layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (self.hidden,),
                p + "self_attn.q_proj.weight": (self.heads * self.head_dim, self.hidden),
                p + "self_attn.k_proj.weight": (self.kv_heads * self.head_dim, self.hidden),
                p + "self_attn.v_proj.weight": (self.kv_heads * self.head_dim, self.hidden),
                p + "self_attn.o_proj.weight": (self.hidden, self.heads * self.head_dim),
                p + "post_attention_layernorm.weight": (self.hidden,),
                p + "mlp.gate_proj.weight": (self.intermediate, self.hidden),
                p + "mlp.up_proj.weight": (self.intermediate, self.hidden),
                p + "mlp.down_proj.weight": (self.hidden, self.intermediate),
            }
        return shapes


def seed_for_version(version: int) -> int:
    """The weight seed of a policy version: a hash, so nearby versions are unrelated."""
    digest = hashlib.blake2b(_SEED_TAG + version.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seeded_weights(config: ModelConfig, version: int) -> dict[str, torch.Tensor]:
    """Deterministic fp32 CPU weights for ``version`` (same on every machine and device).

    Linear weights ~ N(0, 1/fan_in) keep activations O(1) through the layers; norms are ones.
    """
    gen = torch.Generator().manual_seed(seed_for_version(version))
    weights = {}
    for name, shape in config.weight_shapes().items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5
    return weights


class ReferenceEngine:
    """Weights on one device plus the forward pass; holds no per-request state.

    Not thread-safe: the runtime serializes calls.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        expected = config.weight_shapes()
        missing = sorted(expected.keys() - weights.keys())
        extra = sorted(weights.keys() - expected.keys())
        wrong = [n for n in expected.keys() & weights.keys()
                 if tuple(weights[n].shape) != expected[n]]
        if missing or extra or wrong:
            raise ValueError(
                f"weights do not match the model config: missing {missing[:3]}, "
                f"unexpected {extra[:3]}, wrong shape {sorted(wrong)[:3]}"
            )
        self.config = config
        self.device = device
        self.dtype = dtype
        self._w = {n: t.to(device=device, dtype=dtype).contiguous() for n, t in weights.items()}
        # RoPE tables for every position, computed in fp32 (then cast) so that prefill and
        # decode see bit-identical angles for the same position.
        inv = 1.0 / config.rope_theta ** (
            torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
        )
        angles = torch.outer(torch.arange(config.max_context, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self._cos = angles.cos().to(device=device, dtype=dtype)
        self._sin = angles.sin().to(device=device, dtype=dtype)

    @classmethod
    def seeded(
        cls, config: ModelConfig, version: int, *, device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> ReferenceEngine:
        """Weights generated from ``version``'s seed: different versions, different weights."""
        return cls(config, seeded_weights(config, version), device=device, dtype=dtype)

    @classmethod
    def from_safetensors(
        cls, config: ModelConfig, path: str, *, device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> ReferenceEngine:
        """Load ``path``; ValueError when its tensors do not match ``config``."""
        return cls(config, load_file(path, device="cpu"), device=device, dtype=dtype)

    def save(self, path: str) -> None:
        """Write the weights as safetensors (CPU tensors, this engine's dtype)."""
        save_file({n: t.detach().cpu().contiguous() for n, t in self._w.items()}, path)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights by name (the engine's own tensors: do not mutate)."""
        return dict(self._w)

    def new_buffers(self, pages: int, page_size: int, *, host: bool = False) -> KVBuffers:
        """KV buffers shaped for this model in its dtype, on its device (``host``: in host
        memory, pinned when the device is CUDA: the host tier's pool)."""
        c = self.config
        device = torch.device("cpu") if host else self.device
        return KVBuffers(layers=c.layers, pages=pages, page_size=page_size,
                         kv_heads=c.kv_heads, head_dim=c.head_dim, device=device,
                         dtype=self.dtype, pin_memory=host and self.device.type == "cuda")

    def page_bytes(self, page_size: int) -> int:
        """Bytes of KV one page of ``page_size`` tokens takes (every layer, K and V)."""
        c = self.config
        element = torch.empty((), dtype=self.dtype).element_size()
        return c.layers * 2 * page_size * c.kv_heads * c.head_dim * element

    @torch.no_grad()
    def forward(
        self,
        buffers: KVBuffers,
        token_ids: torch.Tensor,
        start: int,
        slots: torch.Tensor,
        *,
        write_kv: bool = True,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run ``token_ids`` (positions ``[start, start + n)``) over the cache; return logits.

        ``slots`` holds the slot of every position ``[0, start + n)``; K/V of positions before
        ``start`` must already be in the buffers. With ``write_kv`` the new tokens' K/V are
        written to ``slots[start:]`` first (``write_kv=False`` recomputes tokens whose K/V is
        already cached, only for their logits). Attention is causal over cached + new.
        Returns ``[n, vocab]`` logits with ``all_logits``, else ``[1, vocab]`` for the last.
        """
        c, w = self.config, self._w
        n = token_ids.shape[0]
        end = start + n
        if n < 1 or slots.shape[0] != end or end > c.max_context:
            raise ValueError(f"bad forward shape: {n} tokens from {start}, {slots.shape[0]} slots")
        cos, sin = self._cos[start:end, None, :], self._sin[start:end, None, :]
        # One query at the last position sees every key; a prefill from position 0 is plain
        # causal (the fused kernel skips masked blocks); otherwise query i sees keys <= start+i.
        mask = None
        causal = start == 0 and n > 1
        if start > 0 and n > 1:
            q_pos = torch.arange(start, end, device=self.device)
            mask = torch.arange(end, device=self.device)[None, :] <= q_pos[:, None]
        new_slots = slots[start:].long()  # index_copy_ wants int64 indices (on every device)
        x = w["model.embed_tokens.weight"][token_ids]
        for i in range(c.layers):
            p = f"model.layers.{i}."
            h = self._rms_norm(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, c.heads, c.head_dim)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, c.kv_heads, c.head_dim)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, c.kv_heads, c.head_dim)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            cache_k, cache_v = buffers.flat(i)
            if write_kv:
                cache_k.index_copy_(0, new_slots, k)
                cache_v.index_copy_(0, new_slots, v)
            # The gather: every position's K/V, wherever its page lives. [1, kv_heads, end, dim]
            # (4-D with a batch of one: 3-D inputs miss the fused CPU kernel, ~10x slower).
            # index_select, not cache_k[slots]: the same gather, measured ~6x faster on CPU.
            keys = cache_k.index_select(0, slots).transpose(0, 1)[None]
            values = cache_v.index_select(0, slots).transpose(0, 1)[None]
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys, values, attn_mask=mask, is_causal=causal,
                enable_gqa=True,
            )[0]
            x = x + attn.transpose(0, 1).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = self._rms_norm(x, w[p + "post_attention_layernorm.weight"])
            gate = F.silu(h @ w[p + "mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        if not all_logits:
            x = x[-1:]
        x = self._rms_norm(x, w["model.norm.weight"])
        return x @ w["lm_head.weight"].T

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.norm_eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

