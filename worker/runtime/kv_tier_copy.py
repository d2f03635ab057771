"""The bytes of the host tier: host KV buffers, the batched copies between them and the device
buffers, and the check that a host pool fits in memory.

:class:`TierCopier` is the worker's :class:`worker.kv.host_tier.TierMover`. Each call moves many
pages with one gather, one transfer and one scatter per layer (``index_select`` on the source,
``index_copy_`` into the destination), never a loop per page. On CUDA the host buffers are
pinned and a copy back goes through a pinned staging buffer, so the transfer is a DMA that
does not block the host; the call waits for it before returning (the next forward pass reads
those pages, and the copy time is measured).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from worker.runtime.kv_buffers import KVBuffers
from worker.runtime.runtime_types import TierCopyStats


class TierCopier:
    """Copies pages between ``device`` and ``host`` buffers of the same shape but the page
    count (ValueError otherwise). Not thread-safe: the runtime serialises calls."""

    def __init__(self, device: KVBuffers, host: KVBuffers) -> None:
        d, h = device.tensor, host.tensor
        if d.shape[:2] != h.shape[:2] or d.shape[3:] != h.shape[3:] or d.dtype != h.dtype:
            raise ValueError(f"host buffers {tuple(h.shape)} {h.dtype} do not match the "
                             f"device buffers {tuple(d.shape)} {d.dtype}")
        self.device = device
        self.host = host
        self.stats = TierCopyStats()
        self._page_bytes = device.page_bytes
        self._cuda = d.device.type == "cuda"

    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        if not device_pages:
            return
        started = time.perf_counter()
        src = torch.tensor(device_pages, dtype=torch.long, device=self.device.tensor.device)
        dst = torch.tensor(host_pages, dtype=torch.long)
        for layer in range(self.device.layers):
            # [2, n, page_size, kv_heads, head_dim]: K and V of every page in one gather.
            pages = self.device.tensor[layer].index_select(1, src)
            self.host.tensor[layer].index_copy_(1, dst, pages.to("cpu"))
        self._count(len(device_pages), started, to_host=True)

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        if not host_pages:
            return
        started = time.perf_counter()
        src = torch.tensor(host_pages, dtype=torch.long)
        dst = torch.tensor(device_pages, dtype=torch.long, device=self.device.tensor.device)
        staging = None
        if self._cuda:
            # Gathered into pinned memory, so each layer's transfer is an asynchronous DMA;
            # each layer has its own contiguous slice (nothing is reused before the sync in
            # _count). Pinned tensors come from torch's caching host allocator: cheap to ask.
            shape = list(self.host.tensor.shape)
            shape[2] = len(host_pages)
            staging = torch.empty(shape, dtype=self.host.tensor.dtype, pin_memory=True)
        for layer in range(self.device.layers):
            if staging is None:
                pages = self.host.tensor[layer].index_select(1, src)
            else:
                pages = torch.index_select(self.host.tensor[layer], 1, src, out=staging[layer])
            moved = pages.to(self.device.tensor.device, non_blocking=staging is not None)
            self.device.tensor[layer].index_copy_(1, dst, moved)
        self._count(len(host_pages), started, to_host=False)

    def _count(self, pages: int, started: float, *, to_host: bool) -> None:
        if self._cuda:
            torch.cuda.current_stream(self.device.tensor.device).synchronize()
        elapsed = time.perf_counter() - started
        s = self.stats
        if to_host:
            s.pages_to_host += pages
            s.bytes_to_host += pages * self._page_bytes
            s.seconds_to_host += elapsed
        else:
            s.pages_to_device += pages
            s.bytes_to_device += pages * self._page_bytes
            s.seconds_to_device += elapsed


class HostMemoryShort(ValueError):
    """A host pool larger than the memory available (refused at start)."""


def available_host_bytes() -> int | None:
    """The memory the kernel says can be taken without swapping (``MemAvailable``), or None
    where it does not say (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_host_pool(host_pages: int, page_bytes: int, available: int | None) -> None:
    """HostMemoryShort unless ``host_pages`` pages of ``page_bytes`` fit in ``available``
    bytes (None: unknown, not checked). The message says what was asked and what there is."""
    wanted = host_pages * page_bytes
    if available is not None and wanted > available:
        raise HostMemoryShort(
            f"--host-pages {host_pages} needs {wanted / 2**30:.2f} GiB of host memory "
            f"({page_bytes} bytes a page), only {available / 2**30:.2f} GiB is available; "
            f"at most {available // page_bytes} pages fit"
        )
