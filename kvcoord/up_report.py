"""The report ``kvcoord up`` prints: one pass per routing policy, side by side.

Definitions (the same as ``kvcoord simulate``'s where the names match): prompt tokens = every
prompt token sent; ``prefill computed`` = prompt tokens the workers ran through the model;
``prefill from cache`` = prompt tokens served from cached KV pages (both as each worker's
Generate answer reported them; a fully cached prompt still computes its last token, so
computed + from cache may exceed prompt tokens by one per such request); hit ratio = from cache
/ prompt tokens; load imbalance = the
busiest worker's computed prefill tokens / the mean over all workers; TTFT (time to first token)
and latency = per request, at the client, from its route call to the first streamed token / to
the end of its answer (``kvcoord.demo_workload`` says where a GRPO sample's clock starts),
nearest-rank percentiles; GRPO rounds = the GRPO rounds' time, each from its RouteBatch call to
its last answer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvcoord.demo_workload import PassResult, WorkloadSpec
from kvcoord.tables import render_table

Cell = Callable[[PassResult], str]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil without floats drifting
    return ordered[int(rank) - 1]


def hit_ratio(result: PassResult) -> float:
    prompt = sum(r.prompt_tokens for r in result.records)
    return sum(r.cached_tokens for r in result.records) / prompt if prompt else 0.0


def load_imbalance(result: PassResult, worker_ids: Sequence[str]) -> float:
    """Busiest worker's computed prefill tokens / the mean over ``worker_ids`` (1.0 = even)."""
    computed = {w: 0 for w in worker_ids}
    for r in result.records:
        computed[r.worker_id] = computed.get(r.worker_id, 0) + r.computed_tokens
    mean = sum(computed.values()) / len(computed) if computed else 0.0
    return max(computed.values()) / mean if mean else 0.0


def ttft_ms(result: PassResult, q: float, kind: str | None = None) -> float:
    """TTFT percentile ``q`` in ms over the requests of ``kind`` (None: all of them)."""
    return 1000 * percentile([r.ttft_s for r in result.records
                              if kind is None or r.kind == kind], q)


def versions_seen(result: PassResult) -> list[int]:
    return sorted({r.policy_version for r in result.records})


def _summary_rows(passes: Sequence[PassResult], worker_ids: Sequence[str]) -> list[list[str]]:
    def row(label: str, cell: Cell) -> list[str]:
        return [label, *(cell(p) for p in passes)]

    def ms(q: float) -> Cell:
        return lambda p: f"{1000 * percentile([r.latency_s for r in p.records], q):.1f}"

    def ttft(q: float) -> Cell:
        return lambda p: f"{ttft_ms(p, q):.1f}"

    def ttft_of(kind: str) -> Cell:
        return lambda p: f"{ttft_ms(p, 50, kind):.0f} / {ttft_ms(p, 99, kind):.0f}"

    def count(kind: str) -> Cell:
        return lambda p: str(sum(r.kind == kind for r in p.records))

    return [
        row("requests", lambda p: str(len(p.records))),
        row("  chat turns", count("chat")),
        row("  GRPO samples", count("grpo")),
        row("prompt tokens", lambda p: str(sum(r.prompt_tokens for r in p.records))),
        row("prefill computed", lambda p: str(sum(r.computed_tokens for r in p.records))),
        row("prefill from cache", lambda p: str(sum(r.cached_tokens for r in p.records))),
        row("hit ratio", lambda p: f"{hit_ratio(p):.1%}"),
        row("load imbalance", lambda p: f"{load_imbalance(p, worker_ids):.2f}x"),
        row("TTFT p50 (ms)", ttft(50)),
        row("TTFT p99 (ms)", ttft(99)),
        row("  chat turns p50 / p99", ttft_of("chat")),
        row("  GRPO samples p50 / p99", ttft_of("grpo")),
        row("latency p50 (ms)", ms(50)),
        row("latency p99 (ms)", ms(99)),
        row("GRPO rounds (s)", lambda p: f"{p.grpo_s:.1f}"),
        row("policy versions seen", lambda p: ", ".join(f"v{v}" for v in versions_seen(p))),
        row("wall time (s)", lambda p: f"{p.wall_s:.1f}"),
    ]


def _worker_rows(passes: Sequence[PassResult], worker_ids: Sequence[str]) -> list[list[str]]:
    rows = []
    for worker_id in worker_ids:
        cells = [worker_id]
        for p in passes:
            mine = [r for r in p.records if r.worker_id == worker_id]
            cells += [str(len(mine)), str(sum(r.prompt_tokens for r in mine)),
                      str(sum(r.computed_tokens for r in mine))]
        rows.append(cells)
    return rows


def render_report(spec: WorkloadSpec, worker_ids: Sequence[str],
                  passes: Sequence[PassResult], how: str) -> str:
    """The whole report; ``passes[0]`` is the headline policy, the others its contrast.
    ``how`` says in one line how the passes were kept comparable."""
    names = [p.routing_policy for p in passes]
    lines = [
        f"workload: {spec.chats} chats x {spec.turns} turns sharing {spec.system_prompts} "
        f"system prompt{'s' if spec.system_prompts != 1 else ''} "
        f"({min(spec.concurrency, spec.chats)} at a time, ~{spec.think_s:g} s between turns), then "
        f"GRPO {spec.grpo_prompts} prompts x {spec.samples} samples with a policy update "
        f"halfway; {how}",
        "",
        render_table(["", *names], _summary_rows(passes, worker_ids)),
        "",
        "per-worker load (requests / prompt tokens / prefill computed)",
        render_table(["worker", *(f"{n} {c}" for n in names
                                  for c in ("req", "prompt", "computed"))],
                     _worker_rows(passes, worker_ids)),
    ]
    if len(passes) > 1:
        lines += ["", verdict(passes[0], passes[1])]
    return "\n".join(lines)


def verdict(head: PassResult, other: PassResult) -> str:
    """Prefill saved and TTFT of ``head`` against ``other``, in one sentence that says which
    way each went (a policy that saves tokens may still answer later)."""
    base = sum(r.computed_tokens for r in other.records)
    saved = base - sum(r.computed_tokens for r in head.records)
    if base:
        fewer = "fewer" if saved >= 0 else "more"
        tokens = (f"{head.routing_policy} computed {abs(saved)} {fewer} prefill tokens than "
                  f"{other.routing_policy} ({abs(saved) / base:.0%} "
                  f"{'less' if saved >= 0 else 'more'})")
    else:
        tokens = f"{head.routing_policy} and {other.routing_policy} computed no prefill"
    quantiles = [f"p{q} {ttft_ms(head, q):.0f} against {ttft_ms(other, q):.0f} ms"
                 for q in (50, 99)]
    differ = different_prompts(head, other)
    same = ("on the same requests" if not differ else
            f"on requests of which {differ} differed (a greedy reply came out otherwise)")
    return f"{tokens} {same}; its TTFT was {', '.join(quantiles)}."


def different_prompts(head: PassResult, other: PassResult) -> int:
    """Requests of ``head`` whose prompt ``other`` did not send (as multisets: 0 = the two
    passes sent the very same prompts, in whatever order)."""
    return sum((Counter(r.prompt_key for r in head.records)
                - Counter(r.prompt_key for r in other.records)).values())
