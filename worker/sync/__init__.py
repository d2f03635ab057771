"""The worker side of the ``Sync`` protocol, shared by the reference worker and the bridge.

- ``sync_client``: ``SyncClient``, one stream to the coordinator: register, page events in
  numbered batches, heartbeats, acks, resync, reconnection.
- ``sync_protocol``: its vocabulary (``WorkerIdentity``, ``SyncSettings``, counters, refusals).
- ``event_log``: pending page events, numbered batches and what a reconnect resends.
- ``relay``: page events handed from the runtime's thread to the event loop.
- ``rollout_reporter``: what the worker generated, reported as rollout records.
- ``sync_metrics``: the client's counts as Prometheus counters.

NOTE: this face imports nothing. The vocabulary (``sync_protocol``, ``event_log``) is read by
tools and benchmarks that must not pay for the client's import (grpc aio, structlog, the SDK):
importing ``SyncClient`` here made every ``bench.scripted_worker`` start 0.1 s slower, which
the fleet benchmark's windows measured.
"""
