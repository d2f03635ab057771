"""``grpo``: GRPO rollouts, n samples of each prompt arriving together, one burst a step.

A synchronous GRPO trainer hands the rollout engines a batch of prompts each training step
and samples every prompt n times; the n siblings carry identical prompts (identical hash
ids), so a router that keeps a group together computes its prompt once. The next step's
batch comes only after the whole batch has finished and the policy has been updated, so the
arrivals are bursts separated by quiet. Every batch holds new prompts: nothing is reused
across steps (and the new weights would void it anyway).

Where each number comes from (:class:`GrpoShape`'s defaults):

- Group size 16 and responses up to 20,480 tokens: DAPO's recipe in verl
  (``recipe/dapo/run_dapo_qwen2.5_32b.sh``: ``n_resp_per_prompt=16``,
  ``max_response_length=20480``, ``max_prompt_length=2048``, ``train_prompt_bsz=512``).
  DeepSeekMath's original GRPO sampled 64 outputs per question.
- Prompts per step: 80 (1,280 rollouts). DAPO runs 512 prompts x 16 on 16 nodes x 8 GPUs
  with tensor parallelism 4, i.e. 256 rollouts per rollout engine per step; we give each of
  the default fleet's 8 workers 160 (own choice), so one step's KV (prompts plus outputs,
  ~4.3M tokens) just overflows the fleet's 4M instead of overflowing it twice over.
- Prompt length: uniform over 600..2,048 tokens (DAPO's ``max_prompt_length``). Own choice of
  the low end: a prompt shorter than one 512-token block holds no full block, so its siblings
  could share nothing at block granularity; math prompts alone are often that short, and a
  chat template or few-shot preamble pushes them past it.
- Response length: log-normal, median 1,500 tokens, sigma 0.8, clipped to 1..20,480. Own
  choice (reasoning rollouts run to thousands of tokens and grow during training).
- Within a step, the 64 groups arrive spread uniformly over 1 s (own choice: the trainer
  dispatches its batch in a loop); the siblings of one group arrive at the same millisecond.
- The next step starts twice the step's longest decode (``output x 20 ms``, the simulator's
  ``CostModel``) after it, plus 60 s of policy update: an open-loop trace cannot know when
  the last rollout ends, and rollouts that waited for memory run in a second wave. The 60 s
  is an own choice.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvcoord.simulate.cost_model import CostModel
from kvcoord.simulate.trace import BLOCK_TOKENS, TraceRequest
from kvcoord.simulate.workloads.base import BlockIds, Workload, collect, lognormal, request


@dataclass(frozen=True, slots=True)
class GrpoShape:
    """The grpo family's parameters (sources in the module docstring)."""

    group_size: int = 16
    prompts_per_step: int = 80
    prompt_tokens: tuple[int, int] = (600, 2_048)
    response: tuple[float, float] = (1_500, 0.8)  # (median tokens, sigma)
    max_response: int = 20_480
    dispatch_s: float = 1.0
    update_s: float = 60.0
    decode_s_per_token: float = CostModel().decode_s_per_token


def generate(count: int, rng: random.Random, shape: GrpoShape = GrpoShape()) -> list[TraceRequest]:
    """The first ``count`` rollouts of an endless GRPO run (module docstring)."""
    return collect(_groups(rng, shape), count)


def _groups(rng: random.Random, shape: GrpoShape) -> Iterator[tuple[float, list[TraceRequest]]]:
    ids = BlockIds()
    step_ms = 0.0
    while True:
        offsets = sorted(rng.uniform(0.0, 1000.0 * shape.dispatch_s)
                         for _ in range(shape.prompts_per_step))
        longest = 0
        for offset in offsets:
            tokens = rng.randint(*shape.prompt_tokens)
            prompt = ids.take(-(-tokens // BLOCK_TOKENS))
            at = step_ms + offset
            group = []
            for _ in range(shape.group_size):
                output = lognormal(rng, *shape.response, 1, shape.max_response)
                longest = max(longest, output)
                group.append(request(at, tokens, output, prompt))
            yield at, group
        step_ms += 1000.0 * (2 * longest * shape.decode_s_per_token + shape.update_s)


WORKLOAD = Workload(
    "grpo", "GRPO rollouts: 16 samples of each prompt together, one batch a training step "
    "(DAPO's group size and lengths)", 5_120, generate)
