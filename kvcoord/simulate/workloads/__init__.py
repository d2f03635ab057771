"""Generated workloads for ``kvcoord simulate --workload NAME``: Mooncake-format requests.

Each family is one module whose docstring cites where its numbers come from (published
workload characterizations) and says which are our own choices:

- ``chat``: multi-turn conversations behind a few shared system prompts.
- ``agent``: coding-agent sessions whose contexts grow by each tool result.
- ``grpo``: GRPO rollouts, n samples of one prompt together, one burst a training step.
- ``rag``: retrieval-augmented questions over a Zipf-popular document set (order matters).

``base`` holds what they share (fresh block ids, growing streams, the first-N cut, arrival
processes); ``jsonl`` writes and hashes generated requests as a trace file. A workload is a
pure function of ``(requests, seed)``: the same pair gives the same requests, id for id.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from types import MappingProxyType

from kvcoord.simulate.trace import TraceRequest
from kvcoord.simulate.workloads import agent, chat, grpo, rag
from kvcoord.simulate.workloads.base import Workload

WORKLOADS: Mapping[str, Workload] = MappingProxyType({
    w.name: w for w in (chat.WORKLOAD, agent.WORKLOAD, grpo.WORKLOAD, rag.WORKLOAD)
})


def lookup(name: str) -> Workload:
    """The workload called ``name``; ValueError listing the known names otherwise."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}") from None


def generate(name: str, *, requests: int | None = None, seed: int = 0) -> list[TraceRequest]:
    """The first ``requests`` requests (the family's default when None) of workload ``name``
    under ``seed``, in arrival order and indexed 0... ValueError for an unknown name or
    ``requests < 1``."""
    workload = lookup(name)
    count = workload.default_requests if requests is None else requests
    if count < 1:
        raise ValueError(f"--requests must be >= 1, got {count}")
    return workload.generate(count, random.Random(f"kvcoord.simulate.workloads.{name}:{seed}"))


__all__ = ["WORKLOADS", "Workload", "generate", "lookup"]
