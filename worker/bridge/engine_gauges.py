"""What an engine's ``/metrics`` says about its capacity now, exported by the bridge.

vLLM publishes its KV cache's size (``vllm:cache_config_info``'s ``num_gpu_blocks`` and
``block_size`` labels), how full it is (``vllm:kv_cache_usage_perc``: blocks held by running
requests; cached blocks no request holds are free to reuse, so they count as free) and its
requests (``vllm:num_requests_running``, ``vllm:num_requests_waiting``), summed over its
data-parallel ranks. ``EngineGauges`` reads them when the bridge's own ``/metrics`` is scraped
(``read_now``, in the scrape's thread, off the event path), and the bridge exports them
(``kvcoord_bridge_engine_*``). Nothing reads them otherwise: rendering a vLLM 0.32 CPU engine's
``/metrics`` is 58 KB of text on the engine's server, and parsing it is the bridge's CPU, so a
bridge that nobody scrapes costs its engine nothing, and one scraped every 15 s costs one read
per 15 s.

They are not sent in heartbeats yet. A bridge's heartbeat carries no free pages, which
``kv_aware`` prices as memory pressure on every page a prompt needs on every engine: in effect
a stronger preference for the engine that holds the prefix. Sent the engine's real free pages,
the preference fell to the prefill term alone, and on a dense stream (the engines bench's quick
form, load 0.6, shared rig) ``kv_aware`` spread prompts over both engines: 43.2% cached and a
1,018 ms median TTFT, against 51.4% and 542 ms without them (smg: 51.4%). The capacity goes
into the heartbeat once the rule prices free pages without leaning on that accident. The
request counts would not be sent as load either way: the coordinator counts every route it
issued to the engine until the gateway ends it, and the engine's count would count each twice.
An engine without these metrics (SGLang publishes others) exports nothing.
"""

from __future__ import annotations

import contextlib
import re
import urllib.error
import urllib.request
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+(\S+)", re.MULTILINE)
_LABEL = re.compile(r'([a-zA-Z_]+)="([^"]*)"')
SCRAPE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Gauges:
    """The engine's KV cache in blocks of ``block_tokens``, the share in use, its requests."""

    total_blocks: int
    block_tokens: int
    usage: float
    running: int
    waiting: int

    def pages(self, page_size: int) -> tuple[int, int]:
        """(free, total) pages of ``page_size`` tokens: whole free blocks, cut into pages."""
        per_block = max(1, self.block_tokens // page_size)
        free_blocks = int(self.total_blocks * (1.0 - min(max(self.usage, 0.0), 1.0)))
        return free_blocks * per_block, self.total_blocks * per_block


def parse_vllm(text: str) -> Gauges | None:
    """The gauges in vLLM's Prometheus ``text`` (ranks summed; usage averaged over them), or
    None when the cache's size is not in it."""
    blocks = block_tokens = running = waiting = 0
    usages: list[float] = []
    for name, labels, value in _SAMPLE.findall(text):
        if name == "vllm:cache_config_info":
            found = dict(_LABEL.findall(labels))
            with contextlib.suppress(KeyError, ValueError):
                blocks += int(found["num_gpu_blocks"])
                block_tokens = int(found["block_size"])
        elif name == "vllm:kv_cache_usage_perc":
            usages.append(float(value))
        elif name == "vllm:num_requests_running":
            running += int(float(value))
        elif name == "vllm:num_requests_waiting":
            waiting += int(float(value))
    if blocks <= 0 or block_tokens <= 0:
        return None
    usage = sum(usages) / len(usages) if usages else 0.0
    return Gauges(blocks, block_tokens, usage, running, waiting)


class EngineGauges:
    """The ``Gauges`` of the engine at ``metrics_url``, read at each ``read_now`` (None until
    one was read, or while its metrics lack them)."""

    def __init__(self, metrics_url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        self.metrics_url = metrics_url
        self.timeout_s = timeout_s
        self.latest: Gauges | None = None
        self.failures = 0

    def read_now(self) -> Gauges | None:
        """Read the engine's /metrics now (blocking, at most ``timeout_s``): the gauges, also
        kept as ``latest``; None when it cannot be read (logged once per run of failures) or
        names no cache size."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=self.timeout_s) as answer:
                text = answer.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            self.failures += 1
            if self.failures == 1:  # once per run of failures: the engine may be starting
                log.warning("bridge.engine_metrics_unreadable", url=self.metrics_url,
                            error=str(exc) or type(exc).__name__)
            self.latest = None
            return None
        self.failures = 0
        self.latest = parse_vllm(text)
        return self.latest
