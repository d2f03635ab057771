"""What the engines and the gateway say about a turn, from their Prometheus ``/metrics``:
histograms read before and after the turn, their difference taken, and a TTFT gap taken apart.

- The engines' own TTFT (``vllm:time_to_first_token_seconds``: from the request reaching the
  engine's server to its first token), queue time (``vllm:request_queue_time_seconds``: waiting
  for the scheduler) and prefill time (``vllm:request_prefill_time_seconds``: scheduled to first
  token), summed over the engines.
- The gateway's added latency (``kvcoord_gateway_added_seconds``: arrival to the upstream send).

``decompose`` splits the client's mean TTFT into the router's **added** latency (client TTFT
less the engines' TTFT: the hop, routing and relaying the first byte), **queueing** at the
engine, **compute** (prefill, which cached share and CPU taken from the engine both move) and
the engine's **other** time (its own front end: tokenizing, detokenizing). Means, because the
engines' histograms give per-request times only in buckets; their difference between two
routers says which part a gap is made of.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engines_procs import EnginesError, http_get, metric_samples
from kvcoord.up_report import percentile

ENGINE_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
GATEWAY_ADDED = "kvcoord_gateway_added_seconds"
_LE = re.compile(r'le="([^"]+)"')


@dataclass(frozen=True, slots=True)
class Histogram:
    """A Prometheus histogram summed over its series: total, count, cumulative buckets."""

    total: float
    count: float
    buckets: tuple[tuple[float, float], ...]

    def minus(self, before: Histogram) -> Histogram:
        earlier = dict(before.buckets)
        return Histogram(self.total - before.total, self.count - before.count,
                         tuple((le, n - earlier.get(le, 0.0)) for le, n in self.buckets))

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """``q``'s value, linear within its bucket (as PromQL's histogram_quantile)."""
        if self.count <= 0:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if le == float("inf"):
                    return lower
                inside = cumulative - below
                return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = le, cumulative
        return lower


def histogram(text: str, name: str) -> Histogram:
    """``name``'s series in Prometheus ``text``, summed (an absent histogram is empty)."""
    buckets: dict[float, float] = {}
    for labels, value in metric_samples(text, f"{name}_bucket").items():
        found = _LE.search(labels)
        if found:
            le = float(found.group(1))
            buckets[le] = buckets.get(le, 0.0) + value
    return Histogram(sum(metric_samples(text, f"{name}_sum").values()),
                     sum(metric_samples(text, f"{name}_count").values()),
                     tuple(sorted(buckets.items())))


def scrape(urls: Iterable[str], names: Mapping[str, str]) -> dict[str, Histogram]:
    """Each of ``names`` (key -> metric) summed over every ``/metrics`` at ``urls``;
    EnginesError when a scrape fails."""
    texts = []
    for url in urls:
        body = http_get(url)
        if body is None:
            raise EnginesError(f"GET {url} failed")
        texts.append(body.decode())
    out: dict[str, Histogram] = {}
    for key, name in names.items():
        parts = [histogram(text, name) for text in texts]
        merged: dict[float, float] = {}
        for part in parts:
            for le, n in part.buckets:
                merged[le] = merged.get(le, 0.0) + n
        out[key] = Histogram(sum(p.total for p in parts), sum(p.count for p in parts),
                             tuple(sorted(merged.items())))
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def turn_signals(before: Mapping[str, Histogram], after: Mapping[str, Histogram],
                 client_ttft_mean_ms: float) -> dict[str, Any]:
    """One turn's engine-side means (ms) and the split of the client's mean TTFT."""
    delta = {key: after[key].minus(before[key]) for key in after}
    engine_ttft = _ms(delta["ttft"].mean())
    queue, prefill = _ms(delta["queue"].mean()), _ms(delta["prefill"].mean())
    out: dict[str, Any] = {
        "engine_requests": delta["ttft"].count, "engine_ttft_mean_ms": engine_ttft,
        "engine_ttft_p50_ms": _ms(delta["ttft"].quantile(0.5)),
        "engine_ttft_p99_ms": _ms(delta["ttft"].quantile(0.99)),
        "queue_mean_ms": queue, "prefill_mean_ms": prefill, "client_ttft_mean_ms":
        client_ttft_mean_ms}
    if engine_ttft is not None and queue is not None and prefill is not None:
        out.update({"added_mean_ms": client_ttft_mean_ms - engine_ttft,
                    "other_mean_ms": engine_ttft - queue - prefill})
    if "added" in delta:  # the gateway's own measure
        out["gateway_added_p50_ms"] = _ms(delta["added"].quantile(0.5))
        out["gateway_added_p99_ms"] = _ms(delta["added"].quantile(0.99))
        out["gateway_added_mean_ms"] = _ms(delta["added"].mean())
    return out


PARTS = ("added", "queue", "compute", "other")
"""The parts of a TTFT gap, in the order the table shows them."""


def _parts(signals: Mapping[str, Any]) -> dict[str, float] | None:
    names = ("added_mean_ms", "queue_mean_ms", "prefill_mean_ms", "other_mean_ms")
    if any(signals.get(n) is None for n in names):
        return None
    return {"added": signals["added_mean_ms"], "queue": signals["queue_mean_ms"],
            "compute": signals["prefill_mean_ms"], "other": signals["other_mean_ms"]}


def decompose(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, float] | None:
    """Our mean TTFT less theirs (ms), and that gap's parts: ``added``, ``queue``, ``compute``,
    ``other`` (they sum to ``gap``); None when a side lacks the engines' figures."""
    mine, other = _parts(ours), _parts(theirs)
    if mine is None or other is None:
        return None
    split = {part: mine[part] - other[part] for part in PARTS}
    return {"gap": ours["client_ttft_mean_ms"] - theirs["client_ttft_mean_ms"], **split}


ACCESS_LOG_WAIT_S = 3.0
"""How long a turn waits for Envoy to write its requests' access log lines (every 0.25 s)."""


def access_log_size(path: Path | None) -> int:
    """Where a turn's lines will start in Envoy's access log (0 before its first line)."""
    return path.stat().st_size if path is not None and path.exists() else 0


def access_log_lines(path: Path, offset: int, requests: int) -> list[dict[str, Any]]:
    """The access log's JSON lines after ``offset``, once ``requests`` of them are there or
    ``ACCESS_LOG_WAIT_S`` has passed (then fewer)."""
    deadline = time.monotonic() + ACCESS_LOG_WAIT_S
    while True:
        with path.open("rb") as log:
            log.seek(offset)
            lines = [json.loads(line) for line in log.read().splitlines() if line.strip()]
        if len(lines) >= requests or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def envoy_added(path: Path, offset: int, requests: int) -> dict[str, float]:
    """The latency Envoy and the picker added to the ``requests`` answered after ``offset`` of
    the access log (``added_us``: the request's first byte to the engine's first byte sent;
    ms), as the gateway's ``gateway_added_*`` signals. EnginesError when fewer lines arrive
    within ``ACCESS_LOG_WAIT_S``."""
    lines = access_log_lines(path, offset, requests)
    added = [float(line["added_us"]) / 1000 for line in lines if line["added_us"] != "-"]
    if len(added) < requests:
        raise EnginesError(f"{path}: {len(added)} requests reached an engine, of {requests}")
    return {"gateway_added_p50_ms": percentile(added, 50),
            "gateway_added_p99_ms": percentile(added, 99),
            "gateway_added_mean_ms": statistics.fmean(added)}
