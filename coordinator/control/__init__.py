"""The coordinator's stateful services, above the core and the store: the Register/Sync state
machine (``worker_sync``), policy updates, the rollout log and the policy high-water mark.
asyncio, no grpc."""
