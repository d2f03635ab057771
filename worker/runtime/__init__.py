"""The reference worker's generation runtime (torch): the model, its KV buffers, the slots.

- ``runtime``: ``WorkerRuntime``, engine + KV buffers + paged strategy + prefix cache; what a
  generation and a policy command run on.
- ``engine``: ``ReferenceEngine``, a small Llama-style decoder over paged KV buffers;
  ``model_sizes`` names its sizes.
- ``kv_buffers``: one preallocated tensor per worker; ``kv_tier_copy``: the host tier's bytes
  and the copies between tiers.
- ``strategy``: which KV slot each position of a request lives in.
- ``runtime_types``: what the runtime takes and gives, and its refusals (no torch).

NOTE: this face re-exports only ``runtime_types``: the SDK (``worker.client``) imports those
types and must run without torch, so the torch modules are imported by name.
"""

# The face re-exports runtime_types' public names, as its __all__ lists them.
from worker.runtime.runtime_types import *  # noqa: F403
from worker.runtime.runtime_types import __all__ as __all__
