"""``kvcoord simulate``: replay a Mooncake-format trace through the production index and router.

Modules, in data-flow order:

- ``trace``: load and validate the JSONL trace; expand hash ids into tokens and page keys.
- ``cost_model``: the documented time constants (the same for every policy).
- ``simworker``: a simulated worker (production allocator and prefix cache, FIFO prefill).
- ``routers``: the router protocol and the adapter for the production policies.
- ``peers``: ``sglang_like`` and ``dynamo_like``, re-stated from the peers' sources.
- ``engine``: the event loop per policy, and the infinite / pooled hit-ratio bounds.
- ``report``: the table, the JSON contract (DESIGN.md), the optional PNG.
- ``runner`` / ``cli``: ``simulate()`` and the ``kvcoord simulate`` subcommand.
"""
