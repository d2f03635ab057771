"""Hashing: a prompt's token ids -> its chained, keyed page keys (PROTOCOL.md §3).

- ``hash_config``: the hash key, the namespace (model, adapter, tenant, policy version, page
  size) that roots every chain, and their limits.
- ``page_hasher``: ``PageHasher`` and ``page_keys``, the chain itself (compiled where built:
  ``coordinator.core.accel``).

Pure core: no I/O. ``coordinator.hashing`` re-exports ``page_keys`` as the documented contract.
"""

# The face re-exports each module's public names, as its __all__ lists them.
from coordinator.core.hashing import hash_config, page_hasher
from coordinator.core.hashing.hash_config import *  # noqa: F403
from coordinator.core.hashing.page_hasher import *  # noqa: F403

__all__: list[str] = []
__all__ += hash_config.__all__
__all__ += page_hasher.__all__
