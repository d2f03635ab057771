"""``worker.allocator.PageAllocator``: the documented contract path (ARCHITECTURE §0) of the
worker's page allocator, which lives in ``worker.kv.allocator``."""

from worker.kv import AllocatorIntegrityError, OutOfPages, PageAllocator

__all__ = ["AllocatorIntegrityError", "OutOfPages", "PageAllocator"]
