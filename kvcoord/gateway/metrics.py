"""Prometheus metrics of the gateway (``kvcoord_gateway_*``), on a registry of its own, and
``Observation``: what one forwarded request measures as its answer passes through.

Latencies are histograms by worker; the serving policy version is a gauge (never a label: it
grows every RL step). Gateway CPU per request is
``rate(process_cpu_seconds_total) / rate(kvcoord_gateway_requests_total)`` (the process
collector is on the same registry). The cached-token ratio is
``kvcoord_gateway_cached_tokens_total / kvcoord_gateway_prompt_tokens_total``, from the usage
the engines report.
"""

from __future__ import annotations

import json
import time
from typing import Any

from prometheus_client import (
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

_LATENCY = (5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
# Fine at the low end: the hop's own cost is judged against a 2 ms budget (llm-d's 2.05 ms).
_ADDED = (2.5e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 1e-2, 2.5e-2, 5e-2,
          0.1, 0.25, 1.0)
_TOKEN_GAP = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
_USAGE_SCAN_BYTES = 1 << 20  # a non-streamed answer larger than this is not parsed for usage


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        r.register(PROCESS_COLLECTOR)
        self.requests = Counter(
            "kvcoord_gateway_requests_total", "Requests answered, by endpoint and HTTP status",
            ["endpoint", "status"], registry=r)
        self.ttft = Histogram(
            "kvcoord_gateway_time_to_first_byte_seconds", "From the request's arrival to the "
            "first byte of the worker's answer (the first token, when streamed)", ["worker"],
            buckets=_LATENCY, registry=r)
        self.added = Histogram(
            "kvcoord_gateway_added_seconds", "The gateway's own latency before the engine sees "
            "a request: from its arrival (body read, tokenized, routed) to the upstream request "
            "being sent; a drain waited out is counted in it", buckets=_ADDED, registry=r)
        self.inter_token = Histogram(
            "kvcoord_gateway_inter_token_seconds", "Between consecutive chunks of a stream",
            ["worker"], buckets=_TOKEN_GAP, registry=r)
        self.latency = Histogram(
            "kvcoord_gateway_request_duration_seconds", "From the request's arrival to the end "
            "of its answer", ["worker"], buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter(
            "kvcoord_gateway_prompt_tokens_total", "Prompt tokens the engines reported",
            registry=r)
        self.cached_tokens = Counter(
            "kvcoord_gateway_cached_tokens_total", "Of those, the ones served from cached KV "
            "(usage.prompt_tokens_details.cached_tokens)", registry=r)
        self.tokenizer_drift = Counter(
            "kvcoord_gateway_tokenizer_drift_total", "Answers whose usage.prompt_tokens differs "
            "from the gateway's own count (its tokenizer or template is not the engine's)",
            registry=r)
        self.retries = Counter(
            "kvcoord_gateway_reroutes_total", "Workers routed around after failing before "
            "their first byte", registry=r)
        self.policy_version = Gauge(
            "kvcoord_gateway_policy_version", "The policy version that served the latest "
            "request", registry=r)


class Observation:
    """One forwarded answer as it passes: the first byte, the gaps between chunks, the end,
    and the usage the engine reported (the last ``usage`` of a stream, or of the JSON body)."""

    def __init__(self, metrics: GatewayMetrics, worker: str, started: float,
                 prompt_tokens: int, *, streamed: bool) -> None:
        self._metrics = metrics
        self._worker = worker
        self._started = started
        self._counted = prompt_tokens
        self._streamed = streamed
        self._last: float | None = None
        self._body = bytearray()
        self.usage: dict[str, Any] | None = None

    def chunk(self, data: bytes) -> None:
        """One piece of the answer, as it passes: the first times the first byte; a stream's
        ``data:`` lines holding a usage are read now; a JSON body is kept for ``end``, up to
        1 MiB (a larger one's usage is not counted)."""
        now = time.perf_counter()
        if self._last is None:
            self._metrics.ttft.labels(self._worker).observe(now - self._started)
        elif self._streamed:
            self._metrics.inter_token.labels(self._worker).observe(now - self._last)
        self._last = now
        if self._streamed:
            for line in data.splitlines():
                if line.startswith(b"data:") and b'"usage"' in line:
                    self._take_usage(line[5:])
        elif len(self._body) + len(data) <= _USAGE_SCAN_BYTES:
            self._body += data

    def end(self, status: int) -> None:
        """The answer is done: its latency, and the token counters from its usage (a JSON body
        is read only when ``status`` is 200; no usage, no count)."""
        self._metrics.latency.labels(self._worker).observe(time.perf_counter() - self._started)
        if not self._streamed and self._body and status == 200:
            self._take_usage(bytes(self._body))
        usage = self.usage
        if usage is None:
            return
        prompt = int(usage.get("prompt_tokens") or 0)
        self._metrics.prompt_tokens.inc(prompt)
        self._metrics.cached_tokens.inc(self.cached_tokens or 0)
        if prompt != self._counted:
            self._metrics.tokenizer_drift.inc()

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens the engine served from its cache, as its usage says (None: it
        reported no usage, or not yet)."""
        if self.usage is None:
            return None
        details = self.usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0

    def _take_usage(self, payload: bytes) -> None:
        try:
            usage = json.loads(payload).get("usage")
        except (ValueError, AttributeError):
            return  # not JSON, or not ours to read: the client gets it as it is
        if isinstance(usage, dict):
            self.usage = usage
