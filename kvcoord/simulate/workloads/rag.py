"""``rag``: retrieval-augmented questions over one shared, Zipf-popular document set.

Each request is an application's system prompt, then the k retrieved documents in retrieval
order, then the user's question. Documents are chunks of one block each, identified by their
hash id, so two requests that retrieved the same document hold the same block.

**Order matters.** A KV prefix is shared only as far as two prompts are equal from their
first token: a document's KV is reused only when every document before it matches too. Two
requests that retrieved the same documents in another order share the system prompt and
nothing else (unless their first documents agree); RAGCache's knowledge tree keys its cache
on the ordered document path for this reason. The generator keeps retrieval order; it does
not reorder documents to make prefixes meet.

Where each number comes from (:class:`RagShape`'s defaults):

- Popularity: Zipf with exponent 1.0 over 5,000 documents, which puts ~60% of retrievals on
  the top 3% of documents: RAGCache (Jin et al., arXiv:2404.12457) measures exactly that
  skew ("3% of documents account for 60% of retrieval requests").
- Retrieval order: the k documents are drawn one after another by popularity without
  replacement and kept in draw order, standing in for the retriever's relevance ranking (own
  modelling choice). Every position is then about equally Zipf-skewed (the first slightly
  more), so prefixes meet on the system prompt and a popular first document, rarely beyond:
  in the default run ~90% of document retrievals fetch a document retrieved before, yet the
  infinite-cache bound is ~15% of prompt tokens.
- Documents: 512-token chunks (one block each), the chunk size of CacheBlend's (EuroSys'25)
  RAG datasets, and k = 10 per request, as CacheBlend's multi-hop QA sets carry 10
  passages per query (RAGCache notes retrieved documents add 1,000+ tokens to a ~100-token
  request).
- Question: log-normal, median 90 tokens, sigma 0.5 (mean ~100, RAGCache's ~100-token
  requests), clipped to 1..512; answer: log-normal, median 128, sigma 0.7 (own choice:
  short grounded answers).
- System prompts: 3 applications, 1 block each, Zipf-popular (own choice).
- Arrivals: Poisson, 14 requests a second: own choice, sized for the default fleet (docs/
  SIMULATOR.md, "Generated workloads").
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvcoord.simulate.trace import BLOCK_TOKENS, TraceRequest
from kvcoord.simulate.workloads.base import (
    BlockIds,
    SharedPrompts,
    Workload,
    collect,
    lognormal,
    request,
    starts,
    zipf_weights,
)


@dataclass(frozen=True, slots=True)
class RagShape:
    """The rag family's parameters (sources in the module docstring)."""

    requests_per_s: float = 14.0
    arrival_shape: float = 1.0
    documents: int = 5_000
    zipf: float = 1.0
    retrieved: int = 10
    system_prompts: int = 3
    question: tuple[float, float] = (90, 0.5)  # (median tokens, sigma)
    answer: tuple[float, float] = (128, 0.7)
    max_answer: int = 2_048


def generate(count: int, rng: random.Random, shape: RagShape = RagShape()) -> list[TraceRequest]:
    """The first ``count`` requests of an endless RAG service (module docstring)."""
    return collect(_queries(rng, shape), count)


def retrieve(rng: random.Random, popularity: list[float], k: int) -> list[int]:
    """``k`` distinct document ranks (0 = most popular) drawn by popularity without
    replacement, in draw order. ``popularity`` is cumulative (:func:`zipf_weights`)."""
    chosen: list[int] = []
    while len(chosen) < k:  # rejection: k is far below the corpus size
        rank = rng.choices(range(len(popularity)), cum_weights=popularity)[0]
        if rank not in chosen:
            chosen.append(rank)
    return chosen


def _queries(rng: random.Random, shape: RagShape) -> Iterator[tuple[float, list[TraceRequest]]]:
    if shape.retrieved * 2 > shape.documents:
        raise ValueError("rag: retrieve at most half the documents")
    ids = BlockIds()
    systems = SharedPrompts(rng, ids, shape.system_prompts, (1, 1))
    documents = [ids.take(1) for _ in range(shape.documents)]
    popularity = zipf_weights(shape.documents, shape.zipf)
    for start in starts(rng, shape.requests_per_s, shape.arrival_shape):
        docs = [documents[rank] for rank in retrieve(rng, popularity, shape.retrieved)]
        shared = systems.pick(rng) + tuple(h for doc in docs for h in doc)
        question = lognormal(rng, *shape.question, 1, BLOCK_TOKENS)
        tokens = len(shared) * BLOCK_TOKENS + question
        answer = lognormal(rng, *shape.answer, 1, shape.max_answer)
        yield start, [request(start, tokens, answer, shared + ids.take(1))]


WORKLOAD = Workload(
    "rag", "retrieval-augmented questions: system prompt, 10 of 5,000 Zipf-popular documents in "
    "retrieval order, question (RAGCache's skew, CacheBlend's chunks)", 4_000, generate)
