"""Worker sessions: Register and the Sync stream of each worker, kept true in the index.

- ``worker_sync``: ``WorkerSync``, the state machine (register, batches, heartbeats, resync,
  leases, departure).
- ``worker_streams``: the open streams, and what is sent down them.
- ``sync_messages``: the domain form of the Sync messages (``server.convert`` maps protobuf).
- ``resync_staging``: a resync's inventory, staged until complete.
- ``registration_checks``: what a registration is refused for.
- ``ingest_governor``: how many batches the event loop applies before routes get a turn.
- ``delayed_acks``: acks held until their batch is applied.
"""

from coordinator.control.sessions.worker_streams import WorkerStreams
from coordinator.control.sessions.worker_sync import SyncCounters, WorkerSync

__all__ = ["SyncCounters", "WorkerStreams", "WorkerSync"]
