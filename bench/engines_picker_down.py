"""The picker down, measured once per run (the first case): Envoy in front of the engines with
``kvcoord epp`` deciding ``kv_aware``, the picker killed (SIGKILL, as a crash) halfway through
a short run of requests, once failing open and once failing closed (``envoy_config``: Envoy's
``failure_mode_allow``).

Each half sends ``REQUESTS_PER_HALF`` of the stream's requests at once. Before the kill every
request must be served through the picker; after it, failing open, every request is served by
the fallback engine (the first; Envoy's access log names the engine that served), and failing
closed, every request is refused with 503 at once, not after Envoy's wait for the picker. What
each half got: requests served, refusals by status, time to the answer's first byte (served:
TTFT; refused: the refusal's latency), the engines that served.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.engines_fleet import MODEL, Engine
from bench.engines_load import Outcome, replay
from bench.engines_routers import RouterRun, kvcoord_router
from bench.engines_signals import access_log_lines, access_log_size
from bench.engines_stream import StreamRequest
from kvcoord.up_report import percentile

MODES = ("fail_open", "fail_close")
REQUESTS_PER_HALF = 6
REFUSAL_STATUS = 503  # envoy_config's status_on_error
REFUSAL_FAST_MS = 1000.0
"""A refusal slower than this waited on the picker instead of failing at once."""


def picker_down(engines: Sequence[Engine], requests: Sequence[StreamRequest], model_dir: Path,
                log_dir: Path, max_model_len: int, *, core: int | None = None,
                embedded: bool = True) -> dict[str, Any]:
    """For each of ``MODES``: a fresh Envoy + picker router, ``REQUESTS_PER_HALF`` of
    ``requests`` sent at once, the picker killed, the next ``REQUESTS_PER_HALF`` sent at once;
    each half's ``half_summary``. The fallback (failing open) is ``engines[0]``; ``core`` and
    ``embedded`` as ``engines_routers.kvcoord_router`` takes them. ValueError
    when ``requests`` holds fewer than two halves."""
    if len(requests) < 2 * REQUESTS_PER_HALF:
        raise ValueError(f"the picker-down measure needs {2 * REQUESTS_PER_HALF} requests, "
                         f"got {len(requests)}")
    at_once = [replace(r, arrival_s=0.0) for r in requests[:2 * REQUESTS_PER_HALF]]
    fallback = engines[0].url.removeprefix("http://")
    names = {e.url.removeprefix("http://"): e.worker_id for e in engines}
    out: dict[str, Any] = {"requests_per_half": REQUESTS_PER_HALF,
                           "fallback": engines[0].worker_id}
    for mode in MODES:
        fail_open = mode == "fail_open"
        with kvcoord_router(engines, model_dir, log_dir, max_model_len, f"down-{mode}",
                            core=core, embedded=embedded, front="envoy", fail_open=fail_open,
                            fallback=fallback if fail_open else None) as router:
            halves = {}
            for half, sent in (("before", at_once[:REQUESTS_PER_HALF]),
                               ("after", at_once[REQUESTS_PER_HALF:])):
                if half == "after":
                    _kill_picker(router)
                logged = access_log_size(router.access_log)
                outcomes = replay(router.url, MODEL, sent)
                halves[half] = half_summary(outcomes, _served_by(router, logged, len(sent),
                                                                 names))
        out[mode] = halves
    return out


def _kill_picker(router: RouterRun) -> None:
    """SIGKILL the picker's process group (a crash: no drain, no goodbye) and reap it."""
    picker = next(p for p in router.procs if router.role(p) == "epp")
    os.killpg(picker.process.pid, signal.SIGKILL)
    picker.process.wait()


def _served_by(router: RouterRun, offset: int, requests: int,
               names: dict[str, str]) -> list[str]:
    """The engines (worker ids) that served the ``requests`` logged after ``offset`` of
    Envoy's access log (refused requests have none)."""
    assert router.access_log is not None, "an Envoy front has an access log"
    lines = access_log_lines(router.access_log, offset, requests)
    return [names.get(line["upstream"], line["upstream"]) for line in lines
            if line["upstream"] not in ("-", None)]


def half_summary(outcomes: Sequence[Outcome], served_by: Sequence[str]) -> dict[str, Any]:
    """Requests sent, served (with usage), refused by status (``"none"``: failed without a
    status), TTFT p50 of the served and latency p50 and max of the refused (ms), and how
    many each engine served (Envoy's access log)."""
    served = [o for o in outcomes if o.error is None]
    refused = [o for o in outcomes if o.error is not None]
    refusal_ms = [o.latency_s * 1000 for o in refused if o.latency_s is not None]
    return {
        "requests": len(outcomes), "served": len(served),
        "refused": dict(Counter(str(o.status or "none") for o in refused)),
        "served_ttft_p50_ms": percentile([o.ttft_s * 1000 for o in served
                                          if o.ttft_s is not None], 50) if served else None,
        "refused_p50_ms": percentile(refusal_ms, 50) if refusal_ms else None,
        "refused_max_ms": max(refusal_ms) if refusal_ms else None,
        "served_by": dict(Counter(served_by)),
        "first_errors": [o.error for o in refused[:2]],
    }


def picker_down_targets(name: str, measured: dict[str, Any]) -> list[list[str]]:
    """The picker-down goals: every request served through the picker before the kill;
    after it, failing open every request served by the fallback, failing closed every request
    refused with 503 within ``REFUSAL_FAST_MS``."""
    rows = []
    for mode in MODES:
        before = measured[mode]["before"]
        rows.append([f"{name}: picker up ({mode}): requests served", "all",
                     f"{before['served']} of {before['requests']}",
                     "met" if before["served"] == before["requests"] else "MISSED"])
    opened = measured["fail_open"]["after"]
    fallback = opened["served_by"].get(measured["fallback"], 0)
    rows.append([f"{name}: picker down, fail open: served by the fallback", "all",
                 f"{fallback} of {opened['requests']}",
                 "met" if fallback == opened["served"] == opened["requests"] else "MISSED"])
    closed = measured["fail_close"]["after"]
    refused = closed["refused"].get(str(REFUSAL_STATUS), 0)
    slowest = closed["refused_max_ms"]
    fast = slowest is not None and slowest <= REFUSAL_FAST_MS
    rows.append([f"{name}: picker down, fail close: refused {REFUSAL_STATUS} at once",
                 f"all, <= {REFUSAL_FAST_MS:.0f} ms",
                 f"{refused} of {closed['requests']}, slowest "
                 + ("-" if slowest is None else f"{slowest:.0f} ms"),
                 "met" if refused == closed["requests"] and fast else "MISSED"])
    return rows


def picker_down_text(measured: dict[str, Any]) -> str:
    """The measure as a table: per mode and half, served, refused, the times, who served."""
    lines = [f"the picker down (Envoy + kvcoord epp; killed between the halves, "
             f"{measured['requests_per_half']} requests each, sent at once; fallback "
             f"{measured['fallback']}):",
             f"  {'mode':<11} {'half':<7} {'served':>6} {'refused':<12} {'TTFT p50':>9} "
             f"{'refusal p50/max':>16}  served by"]
    for mode in MODES:
        for half in ("before", "after"):
            got = measured[mode][half]
            refused = ", ".join(f"{n}x {s}" for s, n in got["refused"].items()) or "-"
            ttft = got["served_ttft_p50_ms"]
            refusal = ("-" if got["refused_p50_ms"] is None else
                       f"{got['refused_p50_ms']:.0f}/{got['refused_max_ms']:.0f} ms")
            by = ", ".join(f"{w} {n}" for w, n in sorted(got["served_by"].items())) or "-"
            lines.append(f"  {mode:<11} {half:<7} {got['served']:>6} {refused:<12} "
                         f"{'-' if ttft is None else f'{ttft:.0f} ms':>9} {refusal:>16}  {by}")
    return "\n".join(lines)
