"""``agent``: coding-agent sessions, long contexts that grow by each tool result.

A session starts from one of a few agent harness prompts (system prompt and tool definitions,
whole blocks shared by every session of that harness) and a task. Each step sends the whole
context so far and gets a short answer (a tool call); the tool's output and the answer are
appended, and the next step follows once the answer is decoded and the tool has run (now and
then a human replies instead, after a longer pause). Step k's prompt therefore extends step
k-1's: contexts grow monotonically until the session ends or would pass the context window.

Where each number comes from (:class:`AgentShape`'s defaults):

- Steps per session: log-normal, median 15, sigma 1.7 (mean ~64, p90 ~134). TraceLab
  (arXiv:2606.30560; 4,265 Claude Code and Codex sessions, 357,161 agent steps) reports
  tool-initiated steps per session p50 15, p90 135, mean 73.6.
- Per step, appended tool output: log-normal, median 600, sigma 1.2 (mean ~1,230 tokens);
  answer: median 250, sigma 1.2 (mean ~510). TraceLab: 430.2M genuinely new (user and tool)
  tokens and 186.9M output tokens over its 357,161 steps, i.e. ~1,200 and ~520 per step;
  "long contexts with short outputs".
- Human turns: 10% of steps, after a log-normal pause (median 120 s, sigma 1.2); other steps
  after the tool's latency (median 1 s, sigma 1.0). TraceLab counts 8.9 user-initiated
  against 73.6 tool-initiated steps per session (10.8%). The pause and latency medians are
  own choices; TraceLab's eviction sweep (an idealised cache keeping a session's KV for 1
  minute hits 85.4%, for 5 minutes ~94%, for 1 hour 98.6%) says many human gaps last
  minutes, and those gaps are what evict an idle session's KV.
- The answer's decode time comes first: ``output x 20 ms``, the simulator's own
  ``CostModel.decode_s_per_token``, so a step does not arrive before its context exists.
- Harness prompts: 3, 8-16 blocks (4,096-8,192 tokens) each, Zipf-popular (exponent 1);
  task: log-normal, median 500 tokens, sigma 1.0. Own choices (a coding agent's system prompt
  and tool schemas run to several thousand tokens).
- Window: 131,072 tokens; a session ends at the first step that would pass it (real agents
  compact there; TraceLab's contexts average ~154k tokens a step on 200k-token models).
- Session starts: Poisson, 0.5 a second (~6 requests/s): own choice, sized so the sessions
  alive at once hold more KV than the default fleet (docs/SIMULATOR.md, "Generated
  workloads").
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvcoord.simulate.cost_model import CostModel
from kvcoord.simulate.trace import TraceRequest
from kvcoord.simulate.workloads.base import (
    BlockIds,
    SharedPrompts,
    Stream,
    Workload,
    collect,
    lognormal,
    request,
    starts,
)


@dataclass(frozen=True, slots=True)
class AgentShape:
    """The agent family's parameters (sources in the module docstring)."""

    sessions_per_s: float = 0.5
    arrival_shape: float = 1.0
    harnesses: int = 3
    harness_blocks: tuple[int, int] = (8, 16)
    task: tuple[float, float] = (500, 1.0)  # (median tokens, sigma)
    steps: tuple[float, float] = (15, 1.7)
    max_steps: int = 400
    tool_output: tuple[float, float] = (600, 1.2)
    answer: tuple[float, float] = (250, 1.2)
    max_append: int = 16_384
    human_share: float = 0.1
    human_pause_s: tuple[float, float] = (120.0, 1.2)
    tool_latency_s: tuple[float, float] = (1.0, 1.0)
    decode_s_per_token: float = CostModel().decode_s_per_token
    max_context: int = 131_072


def generate(count: int, rng: random.Random,
             shape: AgentShape = AgentShape()) -> list[TraceRequest]:
    """The first ``count`` requests of an endless stream of agent sessions (module docstring)."""
    return collect(_sessions(rng, shape), count)


def _sessions(rng: random.Random, shape: AgentShape) -> Iterator[tuple[float,
                                                                    list[TraceRequest]]]:
    ids = BlockIds()
    harnesses = SharedPrompts(rng, ids, shape.harnesses, shape.harness_blocks)
    for start in starts(rng, shape.sessions_per_s, shape.arrival_shape):
        yield start, _steps(rng, shape, Stream(harnesses.pick(rng), ids), start)


def _steps(rng: random.Random, shape: AgentShape, context: Stream,
           start_ms: float) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    now = start_ms
    context.append(lognormal(rng, *shape.task, 1, shape.max_append))
    for _ in range(lognormal(rng, *shape.steps, 1, shape.max_steps)):
        answer = lognormal(rng, *shape.answer, 1, shape.max_append)
        out.append(request(now, context.tokens, answer, context.prompt()))
        appended = answer + lognormal(rng, *shape.tool_output, 1, shape.max_append)
        if context.tokens + appended >= shape.max_context:
            break
        context.append(appended)
        pause = shape.human_pause_s if rng.random() < shape.human_share else (
            shape.tool_latency_s)
        wait_s = answer * shape.decode_s_per_token + rng.lognormvariate(
            math.log(pause[0]), pause[1])
        now += 1000.0 * wait_s
    return out


WORKLOAD = Workload(
    "agent", "coding-agent sessions: long contexts growing by each tool result, short "
    "answers (TraceLab step counts and token mix)", 4_000, generate)
