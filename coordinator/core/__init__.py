"""The pure core: hashing, the prefix index, page events, routing and the router, the fleet
view, the policy state machine, rollout records and the domain errors.

No grpc, redis, asyncio, socket, zmq, prometheus_client or structlog here (import-linter checks
it): the core takes time and randomness from its caller and returns facts rather than logging
them.
"""
