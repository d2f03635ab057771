"""The weights version ("policy version") as one replica sees it.

- ``policy_view``: ``PolicyView``, the version and phase read from the store (compare-and-set
  only), cached and refreshed.
- ``high_water``: ``HighWater``, the highest version ever seen, so the store is restored, never
  answered lower.
- ``policy_acks``: the workers' acknowledgements an update waits for, and its outcome.
"""

from coordinator.control.policy.high_water import HighWater
from coordinator.control.policy.policy_acks import (
    CommitResult,
    await_barrier,
    failures_of,
    latest_stages,
)
from coordinator.control.policy.policy_view import READ_ATTEMPTS, PolicyView

__all__ = ["READ_ATTEMPTS", "CommitResult", "HighWater", "PolicyView", "await_barrier",
           "failures_of", "latest_stages"]
