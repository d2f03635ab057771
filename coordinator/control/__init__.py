"""The coordinator's stateful services, above the core and the store (asyncio, no grpc):

- ``sessions/``: the Register/Sync state machine of each worker (``WorkerSync``), its streams,
  resync staging, registration checks, the ingest governor and delayed acks.
- ``policy/``: the weights version as this replica sees it (``PolicyView``), its high-water
  mark, and the acks an update waits for.
- ``policy_updates``: Begin/Commit/Abort of a policy update across the fleet.
- ``routing_gate``: what a Route passes before the router (a sync drain waited out, a fresh
  policy state).
- ``rollouts``: the rollout log; ``replication_sink``: what the services tell other replicas.
"""
