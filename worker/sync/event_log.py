"""The worker side of the Sync sequence rules: pending page events, numbered batches, acks, what
to resend after a reconnect, and inventories cut under the message limit (docs/PROTOCOL.md §4).
No I/O and no clock: ``worker.sync.sync_client`` decides when to cut a batch and where to send it.

Every page event sets a key's state (held / not held), so replaying events that an inventory
snapshot already reflects is harmless: the last event for a key wins, and it matches the snapshot.
That is what lets ``restart`` and ``rebase`` drop pending events taken before a snapshot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from coordinator.core.hashing import PAGE_KEY_BYTES
from coordinator.v1 import coordinator_pb2 as pb

Holdings = Mapping["pb.Tier", Sequence[bytes]]
"""What a worker holds: page keys by tier (``pb.TIER_GPU``, ...)."""

EVENT_OVERHEAD = 16  # bytes of protobuf framing per PageEvent, rounded up
BATCH_OVERHEAD = 1024  # SyncRequest + EventBatch framing, with room to spare


@dataclass(slots=True)
class _Pending:
    kind: pb.PageEvent.Kind
    tier: pb.Tier
    keys: list[bytes]


@dataclass(frozen=True, slots=True)
class Resume:
    """What to do after ``welcome{next_seq}``: resend ``batches`` in order, or, when batches the
    coordinator never applied are gone (``gap_seq`` set), send an empty batch at ``gap_seq``: the
    sequence gap makes the coordinator ask for a full inventory."""

    batches: list[pb.EventBatch]
    gap_seq: int | None = None


class EventLog:
    """Pending events and unacknowledged batches of one incarnation.

    ``add`` queues an event (consecutive events of one kind and tier merge; a CLEARED event
    supersedes everything pending before it); ``cut`` numbers the next batch
    (seq + 1), within ``max_events`` events and ``max_message_bytes``, and keeps it until ``ack``.
    At most ``max_unacked`` batches are kept: older ones are dropped and the loss is repaired by a
    resync at the next ``resume``. At most ``max_pending_keys`` keys wait unbatched; beyond that
    they are dropped the same way (a long outage under heavy load).
    """

    def __init__(
        self, *, max_unacked: int, max_events: int = 8192,
        max_message_bytes: int = 16 * 1024 * 1024, max_pending_keys: int = 1 << 20,
    ) -> None:
        self.seq = 0
        self.last_acked = 0
        self.lost = False
        self.max_events = max_events
        self.max_message_bytes = max_message_bytes
        self._max_pending_keys = max_pending_keys
        self._pending: deque[_Pending] = deque()
        self._pending_keys = 0
        self._unacked: deque[pb.EventBatch] = deque()
        self._max_unacked = max_unacked

    @property
    def pending_keys(self) -> int:
        return self._pending_keys

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def add(
        self, kind: pb.PageEvent.Kind, keys: Sequence[bytes], tier: pb.Tier = pb.TIER_GPU
    ) -> bool:
        """Queue one event; returns True when a batch should be cut now (a full one is waiting,
        or a CLEARED event: the coordinator should drop the worker's entries without delay)."""
        if kind == pb.PageEvent.KIND_CLEARED:
            self._drop_pending()  # what it would have stored or removed is cleared anyway
            self._pending.append(_Pending(kind, tier, []))
            return True
        if not keys:
            return False
        last = self._pending[-1] if self._pending else None
        if last is not None and last.kind == kind and last.tier == tier:
            last.keys.extend(keys)
        else:
            self._pending.append(_Pending(kind, tier, list(keys)))
        self._pending_keys += len(keys)
        if self._pending_keys > self._max_pending_keys:
            self._drop_pending()
            self.lost = True
            return False
        return (
            len(self._pending) >= self.max_events
            or self._pending_bytes() >= self._batch_budget()
        )

    def cut(self) -> pb.EventBatch | None:
        """Number and keep the next batch from pending events (None when nothing is pending).
        A very large event is split across batches; order is preserved."""
        if not self._pending:
            return None
        budget = self._batch_budget()
        events: list[pb.PageEvent] = []
        while self._pending and len(events) < self.max_events:
            head = self._pending[0]
            room = (budget - EVENT_OVERHEAD) // PAGE_KEY_BYTES
            if room <= 0:
                break
            take, rest = head.keys[:room], head.keys[room:]
            events.append(pb.PageEvent(kind=head.kind, page_keys=b"".join(take), tier=head.tier))
            budget -= EVENT_OVERHEAD + PAGE_KEY_BYTES * len(take)
            self._pending_keys -= len(take)
            if rest:
                head.keys = rest
                break
            self._pending.popleft()
        self.seq += 1
        batch = pb.EventBatch(seq=self.seq, events=events)
        self._unacked.append(batch)
        if len(self._unacked) > self._max_unacked:
            self._unacked.popleft()
            self.lost = True
        return batch

    def ack(self, seq: int) -> None:
        """The coordinator applied every batch up to ``seq``."""
        self.last_acked = max(self.last_acked, seq)
        while self._unacked and self._unacked[0].seq <= seq:
            self._unacked.popleft()

    def resume(self, next_seq: int) -> Resume:
        """After ``welcome{next_seq}`` on a new stream of the same incarnation."""
        while self._unacked and self._unacked[0].seq < next_seq:
            self._unacked.popleft()
        first = self._unacked[0].seq if self._unacked else self.seq + 1
        if self.lost or first != next_seq:
            # Lost batches (or a coordinator that claims more than we sent): ask for a resync
            # through a gap rather than resend a history with holes.
            self._unacked.clear()
            self.lost = False
            self.seq = max(self.seq, next_seq) + 1
            return Resume([], gap_seq=self.seq)
        return Resume(list(self._unacked))

    def restart(self) -> None:
        """A new incarnation: sequence numbers start again at 1, nothing is pending or kept."""
        self.seq = 0
        self.last_acked = 0
        self.rebase()

    def rebase(self) -> int:
        """An inventory snapshot is about to be taken: drop what it will reflect (pending and
        unacked batches). Returns the seq the inventory carries; batches continue after it."""
        self._drop_pending()
        self._unacked.clear()
        self.lost = False
        return self.seq

    def inventory_batches(self, holdings: Holdings) -> list[pb.EventBatch]:
        """Number and keep the full holdings as STORED batches (a new incarnation announcing
        what it holds), one message's worth of keys of one tier per batch."""
        batches = []
        for tier, keys in _chunks(holdings, self.keys_per_message()):
            self.seq += 1
            event = pb.PageEvent(kind=pb.PageEvent.KIND_STORED, page_keys=keys, tier=tier)
            batches.append(pb.EventBatch(seq=self.seq, events=[event]))
        self._unacked.extend(batches)
        while len(self._unacked) > self._max_unacked:
            self._unacked.popleft()
            self.lost = True
        return batches

    def inventory_chunks(self, holdings: Holdings, resync_id: int) -> list[pb.InventoryChunk]:
        """The answer to resync ``resync_id``: the full holdings in chunks of one tier, each
        under the message limit; the last is marked and every chunk carries the current seq
        (the coordinator resumes the sequence after it). An empty holding is one empty chunk."""
        return inventory_chunks(holdings, resync_id=resync_id, seq=self.seq,
                                keys_per_message=self.keys_per_message())

    def keys_per_message(self) -> int:
        """Page keys that fit one message (an event batch or an inventory chunk)."""
        return max(1, (self._batch_budget() - EVENT_OVERHEAD) // PAGE_KEY_BYTES)

    def _batch_budget(self) -> int:
        return max(self.max_message_bytes - BATCH_OVERHEAD, EVENT_OVERHEAD + PAGE_KEY_BYTES)

    def _pending_bytes(self) -> int:
        return self._pending_keys * PAGE_KEY_BYTES + len(self._pending) * EVENT_OVERHEAD

    def _drop_pending(self) -> None:
        self._pending.clear()
        self._pending_keys = 0


def inventory_chunks(
    holdings: Holdings, *, resync_id: int, seq: int, keys_per_message: int
) -> list[pb.InventoryChunk]:
    """``holdings`` as the chunks of one resync answer: one tier per chunk, at most
    ``keys_per_message`` keys each, the last marked; every chunk carries ``seq``."""
    chunks = [pb.InventoryChunk(resync_id=resync_id, page_keys=keys, tier=tier, seq=seq)
              for tier, keys in _chunks(holdings, keys_per_message)]
    if not chunks:
        chunks = [pb.InventoryChunk(resync_id=resync_id, tier=pb.TIER_GPU, seq=seq)]
    chunks[-1].last = True
    return chunks


def _chunks(holdings: Holdings, per: int) -> Iterator[tuple[pb.Tier, bytes]]:
    """(tier, up to ``per`` concatenated keys), tier by tier, in the holdings' order."""
    for tier, keys in holdings.items():
        for start in range(0, len(keys), per):
            yield tier, b"".join(keys[start:start + per])
