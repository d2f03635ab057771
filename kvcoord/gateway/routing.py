"""Where a gateway request goes: ``Route`` (or ``RouteBatch``) under the caller's own token, a
sync drain waited out (bounded), and every refusal of the coordinator as the OpenAI-shaped
answer a client should get.

Routes are asked with ``report_end``: for an engine behind a bridge (which cannot report its
finished requests) the coordinator then counts the route as that engine's load until the
gateway ends it by id. ``RouteLedger`` holds one request's routes and ends each once: a worker
that failed at once, the rest when the request ends however it ends (answered, failed, or the
client gone). Reference workers report their own ends; their routes are not awaited and
nothing is sent for them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import grpc
import structlog

from coordinator.client import AsyncCoordinatorClient, KvcoordError
from coordinator.client.types import Route
from coordinator.wire import Reason
from worker.http_api.openai_requests import OpenAIError
from worker.http_api.serving import retry_after

log = structlog.get_logger(__name__)

_STATUS = {
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
}


def refusal_of(error: KvcoordError) -> OpenAIError:
    """A coordinator refusal as the client's answer: 401/403/400/429 (with ``Retry-After``) as
    the coordinator decided; 503 for no routable worker, a drain, or a coordinator that cannot
    answer; 502 for anything else."""
    headers: dict[str, str] = {}
    if error.retry_after_ms is not None:
        headers.update(retry_after(error.retry_after_ms))
    if error.code in _STATUS:
        status, kind = _STATUS[error.code]
        return OpenAIError(status, error.details, type=kind, code=error.code.name.lower(),
                           headers=headers)
    if error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        code = "no_worker" if error.reason is Reason.NO_WORKER else (
            "draining" if error.reason is Reason.DRAINING else "coordinator_unavailable")
        return OpenAIError(503, error.details, type="server_error", code=code,
                           headers=headers or {"Retry-After": "1"})
    return OpenAIError(502, f"the coordinator refused the route: {error.details}",
                       type="server_error", code="coordinator_error")


END_BATCH_S = 0.005
"""How long an ended route waits for others to end with it in one ``EndRoutes``: at a few
hundred requests a second, one call ends several, where one per request cost the picker and
the gateway a tenth of their CPU. The engine's load is released this much later, far below
any request's own time."""
END_BATCH_MAX = 256
"""Ends sent at once without waiting out ``END_BATCH_S``."""


class RouteEnds:
    """Sends ``EndRoutes`` off the request's path, the ends of ``END_BATCH_S`` gathered into one
    call per caller token; a failure is logged, and the coordinator's ``route_end_ttl_ms``
    releases what was not ended."""

    def __init__(self, client: AsyncCoordinatorClient) -> None:
        self._client = client
        self._sending: set[asyncio.Task[None]] = set()
        self._pending: dict[str | None, set[str]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.sent = 0
        """Route ids sent to be ended, since start."""
        self.calls = 0
        """``EndRoutes`` calls made for them."""

    def end(self, routes: Iterable[Route], token: str | None) -> None:
        """End the awaited ones of ``routes`` under ``token``: gathered, then sent in a task
        of its own (never waited on by the request)."""
        ids = {r.route_id for r in routes if r.end_awaited}
        if not ids:
            return
        pending = self._pending.setdefault(token, set())
        pending.update(ids)
        if sum(len(p) for p in self._pending.values()) >= END_BATCH_MAX:
            self._send_pending()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(END_BATCH_S,
                                                                self._send_pending)

    def _send_pending(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, {}
        for token, ids in pending.items():
            self.sent += len(ids)
            self.calls += 1
            task = asyncio.get_running_loop().create_task(self._send(sorted(ids), token))
            # NOTE: held until done: the loop keeps only a weak reference to a task, and
            # ``flush`` waits for the ones in flight.
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, ids: list[str], token: str | None) -> None:
        try:
            await self._client.as_caller(token).end_routes(ids)
        except KvcoordError as exc:
            log.warning("gateway.end_routes_failed", routes=len(ids), code=exc.code.name,
                        error=exc.details)

    async def flush(self, timeout: float = 2.0) -> None:
        """Send what is gathered and wait (bounded) for the ends in flight: before the
        gateway's client closes."""
        if self._pending:
            self._send_pending()
        if self._sending:
            await asyncio.wait(set(self._sending), timeout=timeout)


class RouteLedger:
    """One request's routes, each ended exactly once (``end`` now, or ``close`` at the
    request's end for all the rest)."""

    def __init__(self, ends: RouteEnds, token: str | None) -> None:
        self._ends = ends
        self._token = token
        self._open: dict[str, Route] = {}

    def issued(self, routes: Iterable[Route]) -> None:
        """Remember the awaited ones of ``routes`` (a route given twice is held once)."""
        for route in routes:
            if route.end_awaited:
                self._open.setdefault(route.route_id, route)

    def end(self, route: Route) -> None:
        """End ``route`` now (a worker that failed it); nothing when it is not held."""
        if self._open.pop(route.route_id, None) is not None:
            self._ends.end([route], self._token)

    def close(self) -> None:
        routes, self._open = list(self._open.values()), {}
        self._ends.end(routes, self._token)


class RequestScope(NamedTuple):
    """What a request names that changes its hash namespace: the LoRA ``adapter`` (its
    ``model``, when that is one of the gateway's ``--adapter``s) and vLLM's ``cache_salt``.
    The engine keys its blocks on both; so does the bridge, so a route must too."""

    adapter: str | None = None
    cache_salt: str | None = None


BASE_SCOPE = RequestScope()
"""The base model, unsalted."""


class RouteFinder:
    """Routes under a caller's token through one shared ``AsyncCoordinatorClient``."""

    def __init__(self, client: AsyncCoordinatorClient, *, model: str,
                 drain_wait_s: float) -> None:
        self._client = client
        self._model = model
        self._drain_wait_s = drain_wait_s
        self.ends = RouteEnds(client)

    def ledger(self, token: str | None) -> RouteLedger:
        return RouteLedger(self.ends, token)

    async def route(self, prompt: Sequence[int], token: str | None,
                    exclude: Sequence[str] = (), scope: RequestScope = BASE_SCOPE) -> Route:
        """The worker for ``prompt``, hashed in the namespace ``scope`` names. A sync drain is
        waited out for up to ``drain_wait_ms`` (the route then runs at
        the new version); OpenAIError for every refusal."""
        # NOTE: the view does not wait out RetryInfo (``as_caller``): only a drain is waited
        # for, here and bounded; NO_WORKER and the rest reach the client at once, with
        # Retry-After (``refusal_of``).
        caller = self._client.as_caller(token)
        deadline = time.monotonic() + self._drain_wait_s
        while True:
            try:
                return await caller.route(prompt, model=self._model, adapter=scope.adapter,
                                          cache_salt=scope.cache_salt, exclude_workers=exclude,
                                          report_end=True)
            except KvcoordError as error:
                if not await self._waited(error, deadline):
                    raise refusal_of(error) from None

    async def route_batch(self, prompts: Sequence[Sequence[int]], token: str | None,
                          scope: RequestScope = BASE_SCOPE) -> list[Route]:
        """``route`` for several prompts in one RouteBatch: ``routes[i]`` is ``prompts[i]``'s."""
        caller = self._client.as_caller(token)
        deadline = time.monotonic() + self._drain_wait_s
        while True:
            try:
                return (await caller.route_batch(prompts, model=self._model,
                                                 adapter=scope.adapter,
                                                 cache_salt=scope.cache_salt,
                                                 report_end=True)).routes
            except KvcoordError as error:
                if not await self._waited(error, deadline):
                    raise refusal_of(error) from None

    @staticmethod
    async def _waited(error: KvcoordError, deadline: float) -> bool:
        """Slept out a drain (True) when one is why, and time is left."""
        if error.reason is not Reason.DRAINING:
            return False
        pause = (error.retry_after_ms or 200) / 1000
        if time.monotonic() + pause >= deadline:
            return False
        await asyncio.sleep(pause)
        return True
