"""Two checks the engines bench runs beside its measurements.

**The index agrees with the engines** (``check_index``). While the kvcoord router is up and the
fleet is quiet (no request running, the bridges' streams still), take prompts of the stream
and, one at a time, for each engine: ask the coordinator's ``Lookup`` how many of the prompt's
tokens the engine holds (M), send the prompt to that engine directly, and read the tokens it
reports cached (C). vLLM reuses whole 32-token blocks and always computes the prompt's last
token, so it must report exactly ``min(M // 32 * 32, (n - 1) // 32 * 32)`` for an n-token
prompt: more means the index missed blocks, less means it claims blocks the engine does not
have. The probe itself stores the prompt on that engine; the next probe waits until the index
shows it (which also proves the events reach the index), so each comparison starts from an
index that is up to date; one the index does not show within ``FOLLOW_S`` is a disagreement
too (``index_after_probe``: what it showed), and the check goes on. Quiet fleet + one request
at a time = no race in the comparison.

**``sglang_like`` decides as ``smg`` does** (``compare_sglang_like``). The same short sequence
goes, one request at a time, through a fresh ``smg --policy cache_aware``; after each, smg's own
metrics name the worker it chose (``smg_worker_cb_outcomes_total{worker=URL}`` counts each
worker's completed requests). The simulator's ``SglangLikeRouter`` is then driven with the
same prompts (their page keys, their token counts) and must pick the same worker. Where the
simulator faces a tie it draws from its seeded rng; smg breaks ties by its hash-map order, which
the simulator does not model, so a tie is resolved to smg's pick (and counted), and only
decisions the simulator's rule forces are compared.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TypeVar

from bench.engines_fleet import ENGINE_BLOCK, MODEL, PAGE_SIZE, Engine
from bench.engines_load import send_one
from bench.engines_procs import EnginesError, http_get, metric_samples
from bench.engines_routers import RouterRun
from bench.engines_stream import StreamRequest
from coordinator.client import CoordinatorClient
from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from coordinator.core.index import PrefixIndex
from coordinator.core.routing import KvAwareWeights
from kvcoord.simulate.peers import SglangConfig, SglangLikeRouter
from kvcoord.simulate.routers import RouterContext
from kvcoord.simulate.simworker import Job
from kvcoord.simulate.trace import TraceRequest
from kvcoord.simulate.views import CoordinatorLoads
from worker.text.tokenizer import TextTokenizer

SETTLE_S = 1.0  # the bridges' streams must be still this long before the first probe
FOLLOW_S = 30.0  # bound on the wait for a probe's blocks to reach the index
T = TypeVar("T")


def expected_cached(matched: int, prompt_tokens: int, block: int = ENGINE_BLOCK) -> int:
    """What vLLM reports cached for a prompt whose first ``matched`` tokens it holds."""
    return min(matched // block * block, (prompt_tokens - 1) // block * block)


def spread(items: Sequence[T], count: int) -> list[T]:
    """``count`` items spread evenly over ``items`` (all of them when there are fewer)."""
    if count >= len(items):
        return list(items)
    step = len(items) / count
    return [items[int(i * step)] for i in range(count)]


def _bridge_seqs(router: RouterRun) -> list[float]:
    seqs = []
    for url in router.bridge_metrics:
        body = http_get(url)
        seqs.append(-1.0 if body is None else
                    sum(metric_samples(body.decode(), "kvcoord_bridge_last_seq").values()))
    return seqs


def _settle(router: RouterRun, deadline_s: float = 30.0) -> None:
    """Wait until no bridge applied an engine batch for SETTLE_S."""
    end = time.monotonic() + deadline_s
    last, since = _bridge_seqs(router), time.monotonic()
    while time.monotonic() - since < SETTLE_S:
        if time.monotonic() > end:
            raise EnginesError("the bridges' event streams did not settle")
        time.sleep(0.2)
        now = _bridge_seqs(router)
        if now != last:
            last, since = now, time.monotonic()


def check_index(router: RouterRun, engines: Sequence[Engine], tokenizer: TextTokenizer,
                requests: Sequence[StreamRequest], probes: int) -> dict[str, Any]:
    """Probe ``probes`` prompts of ``requests`` on every engine (module docstring). Returns the
    counts and every disagreement."""
    assert router.coordinator is not None, "the kvcoord router has a coordinator"
    _settle(router)
    rows: list[dict[str, Any]] = []
    with CoordinatorClient(router.coordinator, timeout=10.0) as client:
        for request in spread(requests, probes):
            ids = tokenizer.encode_chat(request.messages)
            for engine in engines:
                matched = client.lookup(ids, model=MODEL).matches.get(engine.worker_id, 0)
                outcome = send_one(f"{engine.url}/v1", MODEL, replace(request, max_tokens=1))
                if outcome.error is not None or outcome.cached_tokens is None:
                    raise EnginesError(f"probe of request {request.index} on "
                                       f"{engine.worker_id} failed: {outcome.error}")
                row = {"request": request.index, "engine": engine.worker_id,
                       "prompt_tokens": len(ids), "index_tokens": matched,
                       "expected": expected_cached(matched, len(ids)),
                       "engine_cached": outcome.cached_tokens}
                shown = _follow(client, ids, engine.worker_id)
                if shown is not None:  # a disagreement too: recorded, and the check goes on
                    row["index_after_probe"] = shown
                rows.append(row)
    wrong = {f"request {r['request']} on {r['engine']}": r for r in rows
             if r["engine_cached"] != r["expected"] or "index_after_probe" in r}
    return {"probes": len(rows), "agreed": len(rows) - len(wrong), "disagreements": wrong,
            "index_tokens": sum(r["index_tokens"] for r in rows),
            "engine_cached_tokens": sum(r["engine_cached"] for r in rows)}


def _follow(client: CoordinatorClient, ids: list[int], worker_id: str) -> int | None:
    """Wait until the index holds ``ids``' full engine blocks on ``worker_id``: None once it
    does, or, after ``FOLLOW_S``, the tokens it shows (the engine holds the prompt it just
    served; an index that does not show it has lost blocks the engine still serves)."""
    want = len(ids) // ENGINE_BLOCK * ENGINE_BLOCK
    end = time.monotonic() + FOLLOW_S
    while (shown := client.lookup(ids, model=MODEL).matches.get(worker_id, 0)) < want:
        if time.monotonic() > end:
            return shown
        time.sleep(0.05)
    return None


_WORKER = re.compile(r'worker="([^"]*)"')


def _smg_completions(metrics_url: str) -> dict[str, float]:
    body = http_get(metrics_url)
    if body is None:
        raise EnginesError(f"GET {metrics_url} failed")
    counts: dict[str, float] = {}
    for labels, value in metric_samples(body.decode(), "smg_worker_cb_outcomes_total").items():
        found = _WORKER.search(labels)
        if found and 'outcome="success"' in labels:
            counts[found.group(1)] = counts.get(found.group(1), 0.0) + value
    return counts


def smg_choices(router: RouterRun, engines: Sequence[Engine],
                requests: Sequence[StreamRequest]) -> list[int]:
    """The engine (position in ``engines``) smg sent each request to, one request at a time."""
    assert router.metrics_url is not None, "an smg router has a metrics URL"
    urls = [e.url for e in engines]
    choices = []
    for request in requests:
        before = _smg_completions(router.metrics_url)
        outcome = send_one(router.url, MODEL, replace(request, max_tokens=1))
        if outcome.error is not None:
            raise EnginesError(f"smg failed request {request.index}: {outcome.error}")
        end = time.monotonic() + 5.0
        while True:
            after = _smg_completions(router.metrics_url)
            grew = [i for i, u in enumerate(urls) if after.get(u, 0.0) > before.get(u, 0.0)]
            if len(grew) == 1:
                break
            if time.monotonic() > end:
                raise EnginesError(f"smg's metrics do not name one worker for request "
                                   f"{request.index}: {before} -> {after}")
            time.sleep(0.05)
        choices.append(grew[0])
    return choices


class _TieToPeer(random.Random):
    """The simulator's rng, asked only on ties: answers the peer's pick when it is among the
    tied workers (else the first), and remembers that it was asked."""

    def __init__(self) -> None:
        super().__init__(0)
        self.peer_pick = 0
        self.tied: list[int] | None = None

    def choice(self, seq: Sequence[Any]) -> Any:  # seq: the tied workers' positions
        self.tied = list(seq)
        return self.peer_pick if self.peer_pick in seq else seq[0]


def compare_sglang_like(engines: Sequence[Engine], tokenizer: TextTokenizer,
                        requests: Sequence[StreamRequest], smg_picks: Sequence[int],
                        smg_order: Sequence[int],
                        cache_threshold: float = SglangConfig().cache_threshold,
                        ) -> dict[str, Any]:
    """Drive the simulator's ``SglangLikeRouter`` with ``requests`` (each finished before the
    next, as smg saw them) and compare its picks with ``smg_picks``, apart for prompts that
    match an earlier one by more than ``cache_threshold`` of their tokens (both rules then
    follow the match) and for the rest (the rules' fallback). The simulator gets the workers
    in ``smg_order`` (smg's registry order, by which both break ties of load)."""
    if sorted(smg_order) != list(range(len(engines))):
        raise EnginesError(f"smg lists the engines as {smg_order}")
    worker_ids = [engines[i].url for i in smg_order]
    rng = _TieToPeer()
    ctx = RouterContext(worker_ids=worker_ids, index=PrefixIndex(clock=lambda: 0.0),
                        page_size=PAGE_SIZE, rng=rng, weights=KvAwareWeights(),
                        coordinator=CoordinatorLoads(worker_ids, 1))
    router = SglangLikeRouter(ctx)
    hasher = PageHasher(HashConfig(b"kvcoord.bench.engines.compare.v1", page_size=PAGE_SIZE))
    namespace = Namespace(model=MODEL, page_size=PAGE_SIZE)
    ties = 0
    tally = {"high_match": [0, 0], "low_match": [0, 0]}  # [agreed, compared]
    differing: dict[str, str] = {}
    earlier: list[list[int]] = []
    for position, (request, smg_pick) in enumerate(zip(requests, smg_picks, strict=True)):
        ids = tokenizer.encode_chat(request.messages)
        shared = max((_common(ids, other) for other in earlier), default=0)
        earlier.append(ids)
        path = "high_match" if shared // PAGE_SIZE * PAGE_SIZE / len(ids) > cache_threshold \
            else "low_match"
        job = Job(TraceRequest(position, 0.0, len(ids), 1, request.hash_ids),
                  hasher.page_keys(ids, namespace), 0.0)
        rng.peer_pick, rng.tied = smg_order.index(smg_pick), None
        position = router.route(job, {}, 0.0)
        router.on_prefill_done(position, job)
        router.on_finished(position, job)
        chosen = smg_order[position]
        ties += rng.tied is not None
        tally[path][1] += 1
        if chosen == smg_pick:
            tally[path][0] += 1
        else:
            differing[f"request {request.index}"] = (
                f"sglang_like {engines[chosen].worker_id}, smg {engines[smg_pick].worker_id} "
                f"({len(ids)} tokens, {path.replace('_', ' ')}: {shared} shared)")
    agreed = sum(t[0] for t in tally.values())
    # From the first difference on, the two trees hold different prompts: later picks compare
    # diverged states, not the rules alone.
    first = next(iter(differing), None)
    return {"requests": len(requests), "agreed": agreed, "differed": len(requests) - agreed,
            "first_difference": first, "ties_resolved_to_smg": ties,
            **{f"{path}.{what}": t[i] for path, t in tally.items()
               for i, what in enumerate(("agreed", "compared"))},
            "smg_picks": "".join(str(i) for i in smg_picks),
            "smg_worker_order": [engines[i].worker_id for i in smg_order],
            "differences": differing}


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
