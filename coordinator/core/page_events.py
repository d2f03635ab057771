"""Page events (a worker stored, removed or cleared pages) and their application to the index.

Pure core: the worker-side bridge and agent name events with ``PageEvent``; the coordinator's
sessions and replicas apply them with ``apply_page_events``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.core.fleet import RegisteredWorker
from coordinator.core.index import PrefixIndex, Tier


@dataclass(frozen=True, slots=True)
class PageEvent:
    kind: str  # "stored" | "removed" | "cleared"
    keys: Sequence[bytes]
    tier: Tier = Tier.GPU


def apply_page_events(index: PrefixIndex, worker_id: str, events: Sequence[PageEvent]) -> None:
    """One batch's page events, in order, to ``worker_id``'s holdings."""
    for event in events:
        if event.kind == "stored":
            index.store(worker_id, event.keys, event.tier)
        elif event.kind == "removed":
            index.remove(worker_id, event.keys)
        else:
            index.drop_worker(worker_id)


def observe_prefill_ends(session: RegisteredWorker, events: Sequence[PageEvent],
                         now: float) -> None:
    """Tell ``session``'s prefill backlog which keys a batch stored (a prefill's last page
    marks its end; ``core.prefill_backlog``)."""
    for event in events:
        if event.kind == "stored":
            session.observe_stored(event.keys, now)
