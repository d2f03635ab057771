"""Generated workloads (`kvcoord simulate --workload NAME`): seeded, shaped as their docstrings
say, valid as trace requests, and runnable end to end through the simulator."""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvcoord import child_process
from kvcoord.simulate.runner import simulate
from kvcoord.simulate.trace import BLOCK_TOKENS, TraceRequest, load_trace
from kvcoord.simulate.workloads import WORKLOADS, agent, chat, generate, grpo, jsonl, rag

FAMILIES = ("chat", "agent", "grpo", "rag")


def test_the_registry_holds_the_four_families() -> None:
    assert set(WORKLOADS) == set(FAMILIES)
    for name, workload in WORKLOADS.items():
        assert workload.name == name and workload.default_requests > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_a_seed_gives_the_same_requests_and_another_seed_others(name: str) -> None:
    first = generate(name, requests=300, seed=0)
    assert generate(name, requests=300, seed=0) == first
    assert generate(name, requests=300, seed=1) != first
    assert len(first) == 300


@pytest.mark.parametrize("name", FAMILIES)
def test_requests_are_valid_trace_requests_and_survive_a_trace_file(
    name: str, tmp_path: Path
) -> None:
    requests = generate(name, seed=3)
    assert len(requests) == WORKLOADS[name].default_requests
    assert [r.index for r in requests] == list(range(len(requests)))
    for r in requests:  # the loader's rule: input_length fits its blocks
        assert (len(r.hash_ids) - 1) * BLOCK_TOKENS < r.input_length <= (
            len(r.hash_ids) * BLOCK_TOKENS)
        assert r.output_length >= 1 and r.timestamp_ms.is_integer()
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(requests))
    path = tmp_path / f"{name}.jsonl"
    jsonl.write(requests, path)
    assert load_trace(path) == requests
    assert jsonl.sha256(requests) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_unknown_names_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown workload 'nope'; known: agent, chat, grpo, rag"):
        generate("nope")
    with pytest.raises(ValueError, match="--requests must be >= 1"):
        generate("chat", requests=0)


def by_stream(requests: list[TraceRequest]) -> dict[int, list[TraceRequest]]:
    """Requests grouped by their first block after a one-block shared prompt (id 0)."""
    groups: dict[int, list[TraceRequest]] = collections.defaultdict(list)
    for r in requests:
        assert r.hash_ids[0] == 0
        groups[r.hash_ids[1]].append(r)
    return groups


def test_chat_turns_extend_the_previous_turn_after_a_think_time() -> None:
    shape = chat.ChatShape(system_prompts=1, system_prompt_blocks=(1, 1))
    conversations = by_stream(chat.generate(3000, random.Random(5), shape))
    multi = [turns for turns in conversations.values() if len(turns) > 1]
    assert len(multi) > 100
    for turns in multi:
        for before, after in itertools.pairwise(turns):
            # prompt k = prompt k-1 + its answer + a new message: ids extend, the partial
            # last block keeps its id as it fills
            assert after.hash_ids[: len(before.hash_ids)] == before.hash_ids
            assert after.input_length >= before.input_length + before.output_length + 1
            assert after.timestamp_ms > before.timestamp_ms
    turn_counts = [len(t) for t in conversations.values() if t[0].index < 500]
    assert 2.0 < sum(turn_counts) / len(turn_counts) < 5.0  # geometric, mean 3.5


def test_chat_conversations_share_a_few_system_prompts() -> None:
    requests = generate("chat", seed=0)
    leading = collections.Counter(r.hash_ids[0] for r in requests)
    assert len(leading) <= chat.ChatShape().system_prompts
    assert leading.most_common(1)[0][1] > len(requests) / 4  # Zipf: one prompt dominates


def test_agent_contexts_grow_step_by_step_with_short_answers() -> None:
    shape = agent.AgentShape(harnesses=1, harness_blocks=(1, 1))
    sessions = by_stream(agent.generate(3000, random.Random(2), shape))
    long_sessions = [steps for steps in sessions.values() if len(steps) >= 10]
    assert long_sessions
    for steps in sessions.values():
        for before, after in itertools.pairwise(steps):
            assert after.hash_ids[: len(before.hash_ids)] == before.hash_ids
            assert after.input_length > before.input_length + before.output_length
            # the next step waits at least for the answer's decode
            assert after.timestamp_ms - before.timestamp_ms >= before.output_length * 20 - 1
        assert steps[-1].input_length < shape.max_context
    requests = [r for steps in sessions.values() for r in steps]
    mean_in = sum(r.input_length for r in requests) / len(requests)
    mean_out = sum(r.output_length for r in requests) / len(requests)
    assert mean_in > 20 * mean_out


def test_grpo_groups_of_16_identical_prompts_arrive_in_step_bursts() -> None:
    shape = grpo.GrpoShape()
    per_step = shape.group_size * shape.prompts_per_step
    requests = generate("grpo", requests=2 * per_step, seed=4)
    groups: dict[tuple[int, ...], list[TraceRequest]] = collections.defaultdict(list)
    for r in requests:
        groups[r.hash_ids].append(r)
    assert len(groups) == 2 * shape.prompts_per_step
    for group in groups.values():
        assert len(group) == shape.group_size
        assert len({(r.timestamp_ms, r.input_length) for r in group}) == 1
    blocks = [h for ids in groups for h in ids]
    assert len(blocks) == len(set(blocks))  # no block shared across prompts or steps
    first, second = requests[:per_step], requests[per_step:]
    for step in (first, second):
        assert step[-1].timestamp_ms - step[0].timestamp_ms <= 1000 * shape.dispatch_s
    assert second[0].timestamp_ms - first[-1].timestamp_ms >= 1000 * shape.update_s


def test_rag_documents_are_zipf_popular_and_popular_ones_come_first() -> None:
    shape = rag.RagShape()
    requests = generate("rag", seed=0)
    docs = [r.hash_ids[1:-1] for r in requests]
    assert all(len(d) == shape.retrieved == len(set(d)) for d in docs)
    retrievals = collections.Counter(h for d in docs for h in d)
    top = sum(n for _, n in retrievals.most_common(int(0.03 * shape.documents)))
    assert 0.5 < top / sum(retrievals.values()) < 0.7  # RAGCache: 3% of documents, 60%
    # Retrieval order is kept, never sorted to make prefixes meet: some requests retrieved
    # the same two leading documents in the other order (so they share only the system
    # prompt), and the first position is a little more concentrated than the last.
    assert len({d[:2] for d in docs}) > len({frozenset(d[:2]) for d in docs})
    assert len({d[0] for d in docs}) < len({d[-1] for d in docs})
    assert len({r.hash_ids[-1] for r in requests}) == len(requests)  # each question its own


def test_retrieve_draws_distinct_documents() -> None:
    ranks = rag.retrieve(random.Random(0), [1.0, 1.5, 1.8, 2.0], 3)
    assert len(set(ranks)) == 3 and all(0 <= r < 4 for r in ranks)


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_runs_through_the_simulator(name: str) -> None:
    requests = generate(name, requests=120, seed=0)
    report = simulate(requests, workers=2, capacity_tokens=64 * BLOCK_TOKENS,
                      policies=["kv_aware", "round_robin"], seeds=1,
                      trace_name=f"workload:{name}")
    assert report.trace == f"workload:{name}" and report.requests == 120
    assert report.trace_sha256 == jsonl.sha256(requests)
    assert 0.0 <= report.pooled <= report.infinite <= 1.0
    for runs in report.runs.values():
        assert len(runs[0].ttft_s) == 120


def test_simulate_refuses_requests_out_of_order_or_invalid() -> None:
    requests = generate("rag", requests=5)
    with pytest.raises(ValueError, match="arrival order"):
        simulate(requests[::-1], workers=1)
    bad = TraceRequest(0, 0.0, BLOCK_TOKENS + 1, 1, (1,))  # 513 tokens in one block
    with pytest.raises(ValueError, match="not a valid trace request"):
        simulate([bad], workers=1)
    with pytest.raises(ValueError, match="no requests"):
        simulate([], workers=1)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return child_process.run(
        [sys.executable, "-m", "kvcoord.cli", "simulate", *args], capture_output=True,
        text=True, timeout=120, stdin=subprocess.DEVNULL,
    )


def test_cli_names_the_known_workloads_on_an_unknown_one() -> None:
    result = run_cli("--workload", "nope", "--workers", "2")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "kvcoord simulate: unknown workload 'nope'; known: agent, chat, grpo, rag")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "2"], "one of the arguments --trace --workload is required"),
        (["--workload", "chat", "--trace", "t.jsonl", "--workers", "2"], "not allowed with"),
        (["--trace", "t.jsonl", "--requests", "5", "--workers", "2"],
         "--requests applies to --workload only"),
        (["--workload", "chat", "--requests", "0", "--workers", "2"], "--requests must be >= 1"),
        (["--workload", "chat"], "--workers N is required"),
    ],
)
def test_cli_refuses_a_bad_source(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_simulates_a_workload_and_writes_the_same_requests_as_a_trace(
    tmp_path: Path,
) -> None:
    trace, out = tmp_path / "grpo.jsonl", tmp_path / "out.json"
    written = run_cli("--workload", "grpo", "--requests", "48", "--seed", "7",
                      "--write-trace", str(trace))
    assert written.returncode == 0, written.stderr
    assert f"wrote 48 requests of workload grpo (seed 7) to {trace}" in written.stdout
    assert load_trace(trace) == generate("grpo", requests=48, seed=7)
    result = run_cli("--workload", "grpo", "--requests", "48", "--seed", "7", "--workers", "2",
                     "--seeds", "1", "--policy", "kv_aware", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "trace workload:grpo: 48 requests" in result.stdout
    report = json.loads(out.read_text())
    assert report["trace"] == "workload:grpo" and report["seeds"] == [7]
    assert report["trace_sha256"] == hashlib.sha256(trace.read_bytes()).hexdigest()
