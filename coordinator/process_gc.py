"""A serving process's garbage collector, settled once it has started.

CPython collects its youngest generation every 700 net allocations, and each collection of an
older generation walks every object it holds. A server that has just started holds a few
hundred thousand objects it will keep for its whole life (modules, classes, a tokenizer, a
prometheus registry), and each request allocates thousands of short-lived ones (protobuf
messages, dicts, bytes): with the defaults it runs several young collections per request and,
every hundred or so, walks everything it started with again. Measured on the engines bench
(perf, the gateway with its coordinator embedded): 18% of its CPU was the collector.

``settle_after_start`` collects what starting left behind, freezes the rest (``gc.freeze``:
never walked again; it is kept, not leaked: it was going to live as long as the process), and
raises the young generation's threshold to ``YOUNG_THRESHOLD``: about one young collection per
few dozen requests instead of several per request, each still bounded by that many objects.
Cycles are still collected, just later; nothing else changes.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000


def settle_after_start() -> None:
    """Collect, freeze what is left, and raise the young generation's threshold."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
