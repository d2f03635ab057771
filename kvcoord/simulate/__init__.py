"""``kvcoord simulate``: replay a Mooncake-format trace through the production index and router.

Modules, in data-flow order:

- ``trace``: load and validate the JSONL trace; expand hash ids into tokens and page keys.
- ``bounds``: the infinite / pooled hit-ratio bounds.
- ``arrivals``: a seed's arrival times (trace times plus a seeded jitter).
- ``cost_model``: the documented time constants and the decode-interference rule (the same
  for every policy).
- ``simworker``: a simulated worker (production allocator and prefix cache, FIFO prefill,
  decodes batched beside it).
- ``views``: what each router knows of the workers and how late (Sync delay, heartbeats, the
  production coordinator's in-flight books).
- ``routers``: the router protocol and the adapter for the production policies.
- ``peers``: ``sglang_like`` and ``dynamo_like``, re-stated from the peers' sources.
- ``engine``: the event loop of one (policy, seed) run.
- ``summary``: per-seed numbers, mean and min-max over seeds, when a difference counts.
- ``report``: the table, the JSON contract (ARCHITECTURE §0), the optional PNG.
- ``runner`` / ``cli``: ``simulate()`` and the ``kvcoord simulate`` subcommand.
"""
