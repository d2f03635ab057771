"""``DelayedAcks``: one Sync stream's acknowledgements, merged while its replica is busy.

Acks are cumulative (``ack{seq}`` covers every batch up to ``seq``). Writing one costs a busy
replica about a quarter of an event batch's CPU (``kvcoord bench fleet``), so while the ingest
budget is cut (the loop fell behind: ``IngestGovernor.ack_delay_s``) a batch's ack waits up to
that long and goes out as one ack for every batch applied meanwhile. Any other reply (a resync,
a command) first sends the ack it would overtake, so the stream's order never changes; an idle
replica acks every batch at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from coordinator.control.sessions.sync_messages import Ack, Outbound
from coordinator.control.sessions.worker_sync import SyncCounters


class DelayedAcks:
    def __init__(self, send: Callable[[list[Outbound]], None],
                 delay_s: Callable[[], float], counters: SyncCounters) -> None:
        """``send`` writes replies to the stream in order; ``delay_s()`` is how long an ack
        may wait now (0: not at all); ``counters.acks_merged`` counts acks a later one
        covered."""
        self._send = send
        self._delay_s = delay_s
        self._counters = counters
        self._seq: int | None = None  # the highest applied batch not acked yet
        self._timer: asyncio.TimerHandle | None = None

    def reply(self, replies: list[Outbound]) -> None:
        """Send ``replies``, letting a lone ack wait while the replica is busy."""
        if len(replies) == 1 and isinstance(replies[0], Ack):
            delay = self._delay_s()
            if delay > 0 or self._seq is not None:
                if self._seq is not None:
                    self._counters.acks_merged += 1
                self._seq = replies[0].seq
                if self._timer is None:
                    self._timer = asyncio.get_running_loop().call_later(delay, self.flush)
                return
        self.flush()
        self._send(replies)

    def flush(self) -> None:
        """Send the waiting ack now, if any (also when the stream ends)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._seq is not None:
            seq, self._seq = self._seq, None
            self._send([Ack(seq)])

    def discard(self) -> None:
        """The stream is gone: drop the waiting ack (its batches are applied; the worker's
        next hello learns ``next_seq``)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._seq = None
