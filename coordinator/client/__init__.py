"""The coordinator's client SDK, for schedulers, operators and the worker's own clients.

``CoordinatorClient`` (blocking) and ``AsyncCoordinatorClient`` (asyncio) take TARGETS and
credentials; refusals raise ``KvcoordError``. The package's modules:

- ``blocking`` / ``aio``: the two clients;
- ``types``: the values they return; ``messages``: request builders and response parsers;
- ``errors``: ``KvcoordError`` and the retry rules; ``targets``: failover order;
- ``outcomes``: ``outcome_of``, how a failed call ended (code, ``Reason``, ``RetryInfo`` delay);
- ``channels``: channel options, TLS and bearer credentials (the worker uses these too).
"""

from coordinator.client.aio import AsyncCoordinatorClient
from coordinator.client.blocking import DEFAULT_TIMEOUT, CoordinatorClient
from coordinator.client.channels import ClientTls
from coordinator.client.errors import KvcoordError
from coordinator.client.outcomes import Outcome, outcome_of
from coordinator.client.types import (
    EndedRoutes,
    LookupResult,
    PageKeys,
    PolicyState,
    PolicyUpdate,
    RolloutRecord,
    Route,
    RouteBatch,
    Stats,
    WorkerInfo,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "AsyncCoordinatorClient",
    "ClientTls",
    "CoordinatorClient",
    "EndedRoutes",
    "KvcoordError",
    "LookupResult",
    "Outcome",
    "PageKeys",
    "PolicyState",
    "PolicyUpdate",
    "RolloutRecord",
    "Route",
    "RouteBatch",
    "Stats",
    "WorkerInfo",
    "outcome_of",
]
