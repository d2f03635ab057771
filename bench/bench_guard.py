"""What the guard costs per call, in process: ``Guard.admit`` with auth off (every caller is the
anonymous admin: the baseline, measured in the same run) against auth on (bearer token digest,
role check, rate bucket) for Route, and for a token that names no identity. End-to-end RPC
numbers (``bench_rpc``'s auth rows) move by more than this between runs on a shared machine;
this isolates the guard's own work."""

from __future__ import annotations

import contextlib
import timeit
from typing import Any

from coordinator.rpc.guard import Guard, ServerSecurity
from coordinator.rpc.identities import COORDINATOR_PERMISSIONS, IdentityTable, Unauthenticated

TOKEN = "bench-scheduler-token-0123456789"


class _Call:
    """What the guard reads of a grpc ServicerContext: the call's metadata and auth context."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}


def _us_per_call(fn: Any, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def bench_guard(quick: bool = False) -> dict[str, Any]:
    number = 2_000 if quick else 200_000
    identities = IdentityTable.from_entries(
        [{"name": f"id-{i}", "role": "scheduler", "token": f"{TOKEN}-{i}"} for i in range(999)]
        + [{"name": "bench", "role": "scheduler", "token": TOKEN}])
    off = Guard(ServerSecurity())
    on = Guard(ServerSecurity(identities=identities, rate_limit_per_s=1e12,
                              rate_limit_burst=1 << 62))
    call = _Call((("authorization", f"Bearer {TOKEN}"),))
    stranger = _Call((("authorization", "Bearer not-a-known-token-0123"),))

    def refused() -> None:
        with contextlib.suppress(Unauthenticated):
            on.admit("Route", stranger, COORDINATOR_PERMISSIONS)

    results = {
        "auth_off_us": _us_per_call(lambda: off.admit("Route", call, COORDINATOR_PERMISSIONS),
                                    number),
        "auth_on_us": _us_per_call(lambda: on.admit("Route", call, COORDINATOR_PERMISSIONS),
                                   number),
        "unknown_token_us": _us_per_call(refused, number),
        "identities": len(identities),
    }
    results["added_us"] = results["auth_on_us"] - results["auth_off_us"]
    return results
