"""RouteBatch's grouping and order: identical prompts routed once, prefixes run back to back.

Pure core: no I/O. ``coordinator.core.routing.choosers`` re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchGroup:
    """Indices into a batch of prompts that are identical for routing, ascending."""

    members: tuple[int, ...]


def group_identical(
    prompt_keys: Sequence[Sequence[bytes]], prompt_tokens: Sequence[Sequence[int] | int]
) -> list[BatchGroup]:
    """Group prompts with the same page keys and the same token count (token ids or a count).

    Such prompts (GRPO siblings) share every cacheable page and cost the same, so the server
    routes each group once. A prompt with no full page is a group of its own: there is nothing
    to share, and lumping every short prompt onto one worker would hot-spot it. Groups come in
    order of their first member. ValueError when the two sequences differ in length.
    """
    if len(prompt_keys) != len(prompt_tokens):
        raise ValueError("prompt_keys and prompt_tokens differ in length")
    groups: dict[object, list[int]] = {}
    for i, (keys, tokens) in enumerate(zip(prompt_keys, prompt_tokens, strict=True)):
        n_tokens = tokens if isinstance(tokens, int) else len(tokens)
        identity: object = (tuple(keys), n_tokens) if keys else i
        groups.setdefault(identity, []).append(i)
    return [BatchGroup(tuple(members)) for members in groups.values()]


def execution_order(prompt_keys: Sequence[Sequence[bytes]], assigned: Sequence[str]) -> list[int]:
    """A permutation of ``range(n)``: prompts by page-key sequence, lexicographically.

    That is a depth-first walk of the batch's prefix trie, so every set of prompts sharing a
    prefix is contiguous, siblings run back to back, and each worker's own subsequence is a
    depth-first walk too (its second prompt with a prefix finds the pages cached). Equal key
    sequences go by ``assigned`` worker (a group split over workers stays together per worker),
    then by input position. ValueError when the two sequences differ in length.
    """
    if len(prompt_keys) != len(assigned):
        raise ValueError("prompt_keys and assigned differ in length")
    # sorted() is stable, so equal (keys, worker) pairs keep their input order.
    return sorted(range(len(prompt_keys)), key=lambda i: (tuple(prompt_keys[i]), assigned[i]))
