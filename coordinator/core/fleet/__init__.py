"""The fleet: the registered workers, their sessions, load and serving version.

- ``fleet``: ``Fleet`` (every worker by id, eligibility, expiry).
- ``registered_worker``: ``RegisteredWorker`` (one worker's session: lease, sequence numbers,
  version, routes in flight), ``WorkerStatus`` and ``BatchVerdict``.
- ``worker_load``: what the fleet tells a router of a worker (``WorkerLoad``, ``Candidate``).
- ``prefill_backlog``: the prefill work the coordinator booked at a worker, drained at its
  learned rate (``attention_positions``: what a prefill's tokens attend over).

Pure core: no I/O, no clock of its own (callers pass ``now``).
"""

from coordinator.core.fleet.fleet import Fleet
from coordinator.core.fleet.prefill_backlog import PrefillBacklog, attention_positions
from coordinator.core.fleet.registered_worker import BatchVerdict, RegisteredWorker, WorkerStatus
from coordinator.core.fleet.worker_load import Candidate, WorkerLoad

__all__ = ["BatchVerdict", "Candidate", "Fleet", "PrefillBacklog", "RegisteredWorker",
           "WorkerLoad", "WorkerStatus", "attention_positions"]
