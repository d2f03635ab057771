"""``WorkerStreams``: which Sync stream of this replica carries each worker.

The one table both the Register/Sync state machine (``worker_sync``) and policy updates
(``policy_updates``) use to reach a worker: attach a stream, push a command onto it, end it with
a reason. A stream ended here learns why at once (its closer), not on its next send.
"""

from __future__ import annotations

import itertools

from coordinator.control.sessions.sync_messages import Outbound, StreamCloser, StreamSender
from coordinator.core.errors import FailedPrecondition
from coordinator.wire import Reason


class WorkerStreams:
    """Worker id -> (stream id, closer, sender) of the stream attached on this replica."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._streams: dict[str, tuple[int, StreamCloser, StreamSender]] = {}

    def attach(self, worker_id: str, close: StreamCloser, send: StreamSender) -> int:
        """Make this the worker's stream (an older one is ended first, reason SUPERSEDED:
        the worker reconnected before we noticed the old one die). Returns its id."""
        self.close(worker_id, "superseded by a newer stream of the same worker",
                   Reason.SUPERSEDED)
        stream_id = next(self._ids)
        self._streams[worker_id] = (stream_id, close, send)
        return stream_id

    def is_current(self, worker_id: str, stream_id: int) -> bool:
        """Whether ``stream_id`` is still the stream attached for ``worker_id``."""
        owner = self._streams.get(worker_id)
        return owner is not None and owner[0] == stream_id

    def release(self, worker_id: str, stream_id: int) -> bool:
        """The stream ended by itself: forget it (False when it was no longer current)."""
        if not self.is_current(worker_id, stream_id):
            return False
        del self._streams[worker_id]
        return True

    def send(self, worker_id: str, message: Outbound) -> bool:
        """Push ``message`` onto the worker's current stream; False when it has none."""
        owner = self._streams.get(worker_id)
        if owner is None:
            return False
        owner[2](message)
        return True

    def has_stream(self, worker_id: str) -> bool:
        """Whether the worker's Sync stream is attached to this replica."""
        return worker_id in self._streams

    def close(self, worker_id: str, message: str, reason: Reason) -> None:
        """Forget the worker's stream, if any, and end it with FAILED_PRECONDITION naming
        ``reason`` (``message`` is for people and logs)."""
        owner = self._streams.pop(worker_id, None)
        if owner is not None:
            owner[1](FailedPrecondition(f"{message}: reconnect", reason=reason))
