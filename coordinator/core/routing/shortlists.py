"""Shortlists: a routing rule's choice split in two, so that shards can choose as one.

A chooser ranks each candidate by a key that depends on that candidate alone (``rank``) and
returns the candidates tied at its lowest rank (``Shortlist``). ``decide`` takes the lowest
rank of one or more shortlists and picks among the candidates tied at it, so a decision over
the shortlists of several shards is the decision one chooser would make over all their
candidates: same rank order, same tie set, the same ``rng`` draw. A single coordinator's
``choose`` is ``decide`` over its one shortlist, so both paths run the same code.

``kv_aware``'s cost has one term that is not the candidate's own: the copy of the best
holder's prefix (``duplicate_token`` x the pages the best holder caches beyond this worker).
The best holder is the same for every candidate of a route, so that term shifts every cost by
the same amount and the order does not depend on it: the rank leaves it out, each entry keeps
its ``own_cost`` (every other term), and ``decide`` adds the term with the longest prefix any
shortlist reports (``best_cached``).

Pure core: no I/O; randomness comes in as a ``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.core.errors import Unavailable
from coordinator.core.routing.routing_values import Decision, KvAwareWeights, RoutingRequest


class NoEligibleWorker(Unavailable):
    """No candidate to choose from; the interceptor answers UNAVAILABLE."""


@dataclass(frozen=True, slots=True, order=True)
class ShortlistEntry:
    """A candidate tied at its shortlist's rank: its id, the leading pages of the prompt it
    caches (pending included) and its ``kv_aware`` cost without the duplicate term. Ordered by
    worker id first (``decide`` draws from the tie set in that order)."""

    worker_id: str
    cached_pages: int
    own_cost: float


@dataclass(frozen=True, slots=True)
class Shortlist:
    """One chooser's answer over some candidates: the lowest ``rank`` among them and every
    candidate at it (``tied``; empty with no candidate), and the longest prefix (pages) any of
    them caches (``best_cached``). ``lowest_id_wins``: a tie goes to the smallest worker id
    (round robin's cursor order), else it is drawn at random."""

    rank: tuple[float, ...]
    tied: tuple[ShortlistEntry, ...]
    best_cached: int
    lowest_id_wins: bool = False


def duplicate_cost(weights: KvAwareWeights, page_size: int, best_cached: int,
                   cached: int) -> float:
    """The ``kv_aware`` term for the pages the best holder caches beyond this worker's."""
    return weights.duplicate_token * max(0, best_cached - cached) * page_size


def decide(shortlists: Sequence[Shortlist], request: RoutingRequest, weights: KvAwareWeights,
           rng: random.Random) -> Decision:
    """The decision over every candidate of ``shortlists``: the lowest rank; among the
    entries tied at it (sorted by worker id), the smallest id where the rule says so, else one
    drawn with ``rng`` (only when there is a tie). The cost is the ``kv_aware`` cost with the
    longest prefix any shortlist reports. NoEligibleWorker when no shortlist has an entry."""
    ranked = [s for s in shortlists if s.tied]
    if not ranked:
        raise NoEligibleWorker("no eligible worker for this request")
    rank = min(s.rank for s in ranked)
    tied = sorted(e for s in ranked if s.rank == rank for e in s.tied)
    chosen = tied[0] if len(tied) == 1 or ranked[0].lowest_id_wins else rng.choice(tied)
    best_cached = max(s.best_cached for s in shortlists)
    cost = chosen.own_cost + duplicate_cost(weights, request.page_size, best_cached,
                                            chosen.cached_pages)
    return Decision(chosen.worker_id, cost, chosen.cached_pages)
