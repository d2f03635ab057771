"""How well the simulator predicts the engines bench: the simulator's engine model, calibrated on
what the run measured of its own engines, replays the case's stream (the same requests at the
same paced arrivals), and its TTFT p50 and p99 per router are set beside the measured ones.

Calibration: every constant comes from the run being predicted, none is fitted to its TTFTs.

- **Units.** The simulator keys a request's pages from trace blocks of 512 tokens; the bench
  makes each block 64 engine tokens (``StreamShape.block_tokens``). One engine token is
  therefore ``SCALE`` = 512 / 64 simulated tokens, and every length, rate and capacity below is
  scaled by it, so the simulated pages share exactly what the engine's blocks share.
- **Page:** the engine's block (32 tokens).
- **Prefill rate, attention and fixed cost** (``prefill_costs``): from the run's prefill
  sizing, a 2,048-token prompt cold, then with all but its last block cached, and a 512-token
  prompt cold. A token's attention grows with its position (``CostModel.prefill_work``), so a
  2,048-token prompt costs more per token than the stream's shorter ones: the two cold
  lengths measure how much. Where a run lacks the short measure (results from before it), the
  rate is ``(2048 - 32) / (cold - cached)`` and the fixed cost the cached measure.
- **Step budget:** the engines' ``--max-num-batched-tokens``.
- **Decode:** per output token, the median over the routers' turns of (latency p50 - TTFT p50)
  / (answer tokens - 1).
- **KV reads while decoding:** none (a CPU engine's decode token costs one prefill token; the
  GPU figure of ``CostModel.kv_read_tokens`` does not apply).
- **KV capacity:** the case's KV cache tokens per engine.

Router pairs: the simulator's ``kv_aware`` (the production rule) for (a), ``sglang_like`` (a
re-statement of smg's ``cache_aware``) for (b), ``round_robin`` for (c).

What the model still lacks, and so where its error comes from: vLLM batches several prefills
into one chunked step (the simulator runs one prefill at a time per engine, first come first
served), the router's CPU competing with prefill (the shared rig), and engines sharing one
core (the production rig, which is therefore not predicted).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.engines_model import ModelShape, write_model
from bench.engines_stream import TRACE_BLOCK, Stream, StreamShape, build_stream
from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from kvcoord.provenance import git_state
from kvcoord.simulate.cost_model import CostModel
from kvcoord.simulate.engine import SimConfig, run_policy
from kvcoord.simulate.trace import TraceRequest, trace_page_keys
from kvcoord.tables import render_table
from kvcoord.up_report import percentile

PAIRS = {"kv_aware": "kv_aware", "smg_cache_aware": "sglang_like",
         "smg_round_robin": "round_robin"}
"""Measured router -> the simulator's policy that stands for it."""
NO_KV_READS = 10**12
_HASH_KEY = b"kvcoord.bench.engines-predict.v1"


def prefill_costs(prefill: Mapping[str, Any], engine_block: int) -> tuple[float, float, float]:
    """(rate at position 0 in tokens/s, the attention position ``CostModel.attention_tokens``,
    the fixed cost per request in s) from a case's prefill sizing: an ``L``-token prompt cold
    and cached (its last block of ``B`` tokens recomputed), and, where measured, an
    ``S``-token prompt cold. With ``W(c, n) = (n - c) + (n^2 - c^2) x`` the work of positions
    ``c..n`` (``x = 1 / (2 attention_tokens)``):
    ``cold(L) - cached(L) = W(0, L - B) / rate`` and ``cold(L) - cold(S) = W(S, L) / rate``;
    their ratio gives ``x``, then the rate, then the fixed cost ``cached(L) - W(L - B, L) /
    rate``. Without the short measure, or where noise makes ``x`` negative, attention is left
    out (``x = 0``) and the fixed cost is the cached time (the measure as first made)."""
    long, block = prefill["prompt_tokens"], engine_block
    cold_s, cached_s = prefill["cold_ms"] / 1000, prefill["cached_ms"] / 1000
    d1 = max(1e-6, cold_s - cached_s)
    x = 0.0
    if "short_cold_ms" in prefill:
        short = prefill["short_prompt_tokens"]
        d2 = cold_s - prefill["short_cold_ms"] / 1000
        if d2 > 0:
            ratio = d1 / d2
            denominator = (long - block) ** 2 - ratio * (long * long - short * short)
            if denominator != 0:  # the ratio falls from (L-B)/(L-S) as x grows from 0
                x = max(0.0, (ratio * (long - short) - (long - block)) / denominator)
    rate = ((long - block) + (long - block) ** 2 * x) / d1
    if x == 0.0:
        return rate, math.inf, cached_s
    last_block = block + (long * long - (long - block) ** 2) * x
    return rate, 1 / (2 * x), max(0.0, cached_s - last_block / rate)


def calibrated_cost(prefill: Mapping[str, Any], routers: Mapping[str, Any], *, scale: int,
                    engine_block: int, step_tokens: int, answer_tokens: int) -> CostModel:
    """The simulator's cost model from a case's own measures (the module docstring's rules)."""
    rate, attention_tokens, fixed_s = prefill_costs(prefill, engine_block)
    gaps = [(r["latency_p50_ms"]["mean"] - r["ttft_p50_ms"]["mean"]) / 1000
            for r in routers.values()]
    per_token = max(1e-4, statistics.median(gaps) / max(1, answer_tokens - 1))
    return CostModel(prefill_tokens_per_s=rate * scale, decode_s_per_token=per_token,
                     step_prefill_tokens=step_tokens * scale, kv_read_tokens=NO_KV_READS,
                     request_overhead_s=fixed_s, attention_tokens=attention_tokens * scale)


def sim_requests(stream: Stream, block_tokens: int) -> tuple[list[TraceRequest], int]:
    """The stream as simulator requests (its words only: the template is one shared prefix),
    and the scale: simulated tokens per engine token."""
    scale = TRACE_BLOCK // block_tokens
    out = []
    for r in stream.requests:
        words = len(r.text.split())
        blocks = -(-words // block_tokens)
        out.append(TraceRequest(r.index, r.arrival_s * 1000, words * scale, r.max_tokens,
                                tuple(r.hash_ids[:blocks])))
    return out, scale


def predict(stream: Stream, *, engines: int, kv_tokens: int, engine_block: int,
            block_tokens: int, prefill: Mapping[str, Any], routers: Mapping[str, Any],
            step_tokens: int, answer_tokens: int) -> dict[str, Any]:
    """Per measured router: the simulator's TTFT p50/p99 (ms) and cached share beside the
    measured means, and the relative errors (predicted / measured - 1)."""
    requests, scale = sim_requests(stream, block_tokens)
    cost = calibrated_cost(prefill, routers, scale=scale, engine_block=engine_block,
                           step_tokens=step_tokens, answer_tokens=answer_tokens)
    page = engine_block * scale
    hasher = PageHasher(HashConfig(_HASH_KEY, page_size=page))
    namespace = Namespace(model="engines-predict", page_size=page)
    config = SimConfig(engines, kv_tokens * scale, hasher, namespace, cost=cost,
                       arrival_jitter_ms=0.0)
    keys = trace_page_keys(requests, hasher, namespace)
    out: dict[str, Any] = {"cost_model": {
        "prefill_tokens_per_s": cost.prefill_tokens_per_s / scale,
        "attention_tokens": (None if math.isinf(cost.attention_tokens)
                             else cost.attention_tokens / scale),
        "request_overhead_ms": cost.request_overhead_s * 1000,
        "decode_ms_per_token": cost.decode_s_per_token * 1000,
        "step_prefill_tokens": step_tokens, "page_tokens": engine_block}, "routers": {}}
    for measured, policy in PAIRS.items():
        if measured not in routers:
            continue
        run = run_policy(policy, requests, keys, config, 0, None)
        ttfts = [t * 1000 for t in run.ttft_s]
        predicted = {"ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
                     "cached_share": sum(run.cached_tokens) / max(1, sum(run.prompt_tokens))}
        real = {k: routers[measured][k]["mean"] for k in predicted}
        out["routers"][measured] = {
            "policy": policy, "predicted": predicted, "measured": real,
            "error": {k: predicted[k] / real[k] - 1 if real[k] else None for k in predicted}}
    return out


def prediction_text(prediction: Mapping[str, Any]) -> str:
    """The calibrated constants, then the table of ``prediction_table``."""
    model = prediction["cost_model"]
    return (f"the simulator calibrated on these engines (rate "
            f"{model['prefill_tokens_per_s']:,.0f} tokens/s, fixed "
            f"{model['request_overhead_ms']:.1f} ms a request, decode "
            f"{model['decode_ms_per_token']:.1f} ms a token), TTFT ms\n" + render_table(
                ["router", "simulated as", "p50 predicted", "p50 measured", "p50 error",
                 "p99 predicted", "p99 measured", "p99 error"], prediction_table(prediction)))


def prediction_table(prediction: Mapping[str, Any]) -> list[list[str]]:
    """Rows: router, simulator policy, then predicted / measured / error for p50 and p99."""
    rows = []
    for name, r in prediction["routers"].items():
        row = [name, r["policy"]]
        for key in ("ttft_p50_ms", "ttft_p99_ms"):
            error = r["error"][key]
            row += [f"{r['predicted'][key]:,.0f}", f"{r['measured'][key]:,.0f}",
                    "-" if error is None else f"{error:+.0%}"]
        rows.append(row)
    return rows


def predict_results(results: Mapping[str, Any], trace: Path, work: Path) -> dict[str, Any]:
    """Every case of an engines run (``results``: the ``engines`` object of its JSON) whose
    engines each have a core of their own and whose workload is the trace, predicted: case ->
    ``predict``'s answer. The stream is rebuilt from ``trace`` as the run built it."""
    setup = results["setup"]
    shape = StreamShape(**{k: setup["streams"]["trace"][k] for k in (
        "requests", "block_tokens", "max_output_tokens", "seed")})
    tokenizer = write_model(work / "model", ModelShape())
    stream = build_stream(trace, shape, tokenizer, setup["model"]["max_model_len"])
    out = {}
    for name, case in results["cases"].items():
        engines = case["engines"]
        if case.get("workload", "trace") != "trace" or len(set(engines["cores"])) < len(
                engines["cores"]):
            continue
        out[name] = predict(stream.scaled(case["time_scale"]), engines=engines["count"],
                            kv_tokens=engines["kv_cache_tokens"],
                            engine_block=engines["block_tokens"],
                            block_tokens=shape.block_tokens, prefill=case["prefill"],
                            routers=case["routers"],
                            step_tokens=engines["max_num_batched_tokens"],
                            answer_tokens=shape.max_output_tokens)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.engines_predict RESULT.json [--trace PATH]``: print each case's
    prediction table; with ``--out``, write the predictions as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.engines_predict")
    parser.add_argument("result", type=Path, help="a `kvcoord bench engines` JSON")
    parser.add_argument("--trace", type=Path, help="the trace it sampled (default: "
                        "../shared/traces/<its trace's name> beside the checkout)")
    parser.add_argument("--out", type=Path, help="write the predictions here (JSON)")
    args = parser.parse_args(argv)
    document = json.loads(args.result.read_text())
    results = document.get("results", document).get("engines", document)
    trace = args.trace or (Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
                           / results["setup"]["trace"]["name"])
    if not trace.is_file():
        print(f"engines_predict: no trace at {trace} (--trace PATH)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as work:
        predictions = predict_results(results, trace, Path(work))
    for name, prediction in predictions.items():
        print(f"\n{name}: {prediction_text(prediction)}")
    if args.out is not None:  # this code's commit, and the run's
        commit, dirty = git_state()
        args.out.write_text(json.dumps({
            "commit": commit, "dirty": dirty, "result": str(args.result),
            "result_commit": document.get("commit"), "predictions": predictions},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
