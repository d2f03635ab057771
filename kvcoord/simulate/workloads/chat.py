"""``chat``: multi-turn conversations behind a few shared system prompts.

A conversation picks one of a few system prompts (whole blocks, shared by every conversation
that picks it), then runs its turns: turn k's prompt is turn k-1's prompt, its answer and a
new user message, so turn k's hash ids start with turn k-1's full blocks. The user thinks
between turns; conversations start in bursts.

Where each number comes from (:class:`ChatShape`'s defaults):

- Turns per conversation: geometric with mean 3.5: ShareGPT averages 3.51 turns per
  conversation (94,145 conversations, 330,239 turns; the dataset table of "ShareChat",
  arXiv:2512.17843). LMSYS-Chat-1M averages 2.0 (Zheng et al., ICLR 2024).
- First message: log-normal, median 5,900 tokens, sigma 1.16; later user messages: median
  150, sigma 2.0; answers: median 350, sigma 0.5 (clipped to 1..2,000). Fitted here to the
  Mooncake FAST'25 *conversation* trace (kvcache-ai/Mooncake ``FAST25-release/traces/
  conversation_trace.jsonl``, 12,031 requests from one hour of Kimi): its first turns measure
  median 5,933 / mean 11,257 / p90 26,276 input tokens; the growth from one turn to the next
  (answer plus new message) median 502 / mean 1,683 / p90 4,707; outputs median 350, p25 156,
  p75 472, max 2,000. These long prompts are a long-context service's (documents pasted into
  chat); ShareGPT-era user messages average ~70 tokens (LMSYS-Chat-1M).
- Think time between turns: log-normal, median 126 s, sigma 1.12: measured in the same trace
  (a turn follows the request it extends after p25 66 s, p50 126 s, p80 324 s); Alibaba's
  "KVCache Cache in the Wild" (USENIX ATC'25) likewise finds 80% of its to-C reuses within
  10 minutes.
- Bursty starts: Gamma gaps with shape 0.4 (coefficient of variation 1.6). BurstGPT
  (arXiv:2401.17644) fits LLM request arrivals with a Gamma distribution; the shape is
  derived from the Mooncake conversation trace, whose per-10 s and per-minute request counts
  have a variance 2.1x and 2.8x their mean (a Gamma renewal process with shape k has index of
  dispersion 1/k).
- System prompts: 4, Zipf-popular (exponent 1), 1-2 blocks each. Own choice for "a few"; in
  the Mooncake conversation trace every request shares exactly one leading block.
- Rate: 1.5 conversations a second, ~3.3 requests/s (the trace's hour: 3.4/s), sized so
  the default fleet (8 x 500,000 tokens, 15,000 prefill tokens/s each) is loaded, not
  overloaded, and the conversations alive at once hold more KV than the fleet (docs/
  SIMULATOR.md, "Generated workloads").
- A conversation ends early when its context would pass 131,072 tokens (a 128k window).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvcoord.simulate.trace import BLOCK_TOKENS, TraceRequest
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
class ChatShape:
    """The chat family's parameters (sources in the module docstring)."""

    conversations_per_s: float = 1.5
    arrival_shape: float = 0.4
    system_prompts: int = 4
    system_prompt_zipf: float = 1.0
    system_prompt_blocks: tuple[int, int] = (1, 2)
    mean_turns: float = 3.5
    first_message: tuple[float, float] = (5_900, 1.16)  # (median tokens, sigma)
    message: tuple[float, float] = (150, 2.0)
    answer: tuple[float, float] = (350, 0.5)
    max_answer: int = 2_000
    think_s: tuple[float, float] = (126.0, 1.12)
    max_context: int = 131_072


def generate(count: int, rng: random.Random, shape: ChatShape = ChatShape()) -> list[TraceRequest]:
    """The first ``count`` requests of an endless chat service (module docstring)."""
    return collect(_conversations(rng, shape), count)


def _conversations(rng: random.Random, shape: ChatShape) -> Iterator[tuple[float,
                                                                        list[TraceRequest]]]:
    ids = BlockIds()
    systems = SharedPrompts(rng, ids, shape.system_prompts, shape.system_prompt_blocks,
                            shape.system_prompt_zipf)
    for start in starts(rng, shape.conversations_per_s, shape.arrival_shape):
        yield start, _turns(rng, shape, Stream(systems.pick(rng), ids), start)


def _turns(rng: random.Random, shape: ChatShape, stream: Stream,
           start_ms: float) -> list[TraceRequest]:
    # Geometric number of turns with the given mean: stop after each turn with p = 1/mean.
    out: list[TraceRequest] = []
    now = start_ms
    message = lognormal(rng, *shape.first_message, 1, shape.max_context // 2)
    while stream.tokens + message < shape.max_context:
        stream.append(message)
        answer = lognormal(rng, *shape.answer, 1, shape.max_answer)
        out.append(request(now, stream.tokens, answer, stream.prompt()))
        if rng.random() < 1.0 / shape.mean_turns:
            break
        stream.append(answer)
        now += 1000.0 * rng.lognormvariate(math.log(shape.think_s[0]), shape.think_s[1])
        message = lognormal(rng, *shape.message, 1, 32 * BLOCK_TOKENS)
    return out


WORKLOAD = Workload(
    "chat", "multi-turn conversations behind a few shared system prompts (ShareGPT turns, "
    "Mooncake conversation lengths and think times, bursty starts)", 4_000, generate)
