"""Paged KV buffers: one preallocated tensor holding every layer's keys and values.

Layout ``[layers, 2, pages, page_size, kv_heads, head_dim]`` (index 0 of dim 1 is K, 1 is V).
A token's *slot* is ``page * page_size + offset``; :meth:`KVBuffers.flat` exposes one layer's
K and V as ``[pages * page_size, kv_heads, head_dim]`` views so the engine reads and writes
whole requests by indexing with a slot tensor (a gather / an indexed copy), never per token.
"""

from __future__ import annotations

import torch


class KVBuffers:
    """The worker's KV memory, allocated once at start on ``device`` in ``dtype``.

    The buffers hold no bookkeeping: which slots are valid is the allocator's and the
    strategy's business. Contents of freshly allocated pages are undefined (zeros at start,
    stale data after reuse); the engine writes a slot before any query may attend to it.
    """

    def __init__(
        self,
        *,
        layers: int,
        pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        pin_memory: bool = False,
    ) -> None:
        """``pin_memory``: page-locked host memory (a CPU pool beside a CUDA device, so copies
        between them are DMA)."""
        for name, value in (
            ("layers", layers),
            ("pages", pages),
            ("page_size", page_size),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.layers = layers
        self.pages = pages
        self.page_size = page_size
        self.tensor = torch.zeros(
            (layers, 2, pages, page_size, kv_heads, head_dim), device=device, dtype=dtype,
            pin_memory=pin_memory,
        )

    @property
    def slots(self) -> int:
        """Token slots in the pool: ``pages * page_size``."""
        return self.pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes one page takes across every layer, K and V."""
        return self.nbytes // self.pages

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V as ``[pages * page_size, kv_heads, head_dim]`` views.

        Views, not copies: writing into them writes the buffers. ``tensor[layer, i]`` is
        contiguous (the trailing dims are), so the reshape never copies.
        """
        k = self.tensor[layer, 0]
        v = self.tensor[layer, 1]
        return k.view(self.slots, *k.shape[2:]), v.view(self.slots, *v.shape[2:])
