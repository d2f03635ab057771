"""``RoutingGate``: what a Route or RouteBatch passes on its way to the router.

One order for both: wait while a sync update drains, refuse on a stale policy state, then
route. The servicer converts the request and calls this; the decision itself is the router's
(``coordinator.core.routing``). Asyncio (it waits), no grpc.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coordinator.control.policy import PolicyView
from coordinator.control.shard_routing import ShardRouting
from coordinator.core.routing import BatchResult, PromptInput, Router, RouteResult, Scope


class RoutingGate:
    """The way in to ``Router.route`` / ``route_batch`` (or ``ShardRouting``'s, with shards)
    for a caller that may wait: a route
    never starts between a sync update's DRAIN and RESUME, nor on a policy state this replica
    has not read within ``policy_stale_ms``. Holds no state of its own."""

    def __init__(self, *, policy_view: PolicyView, router: Router) -> None:
        self._policy_view = policy_view
        self._router = router
        self._shards: ShardRouting | None = None

    def span(self, shards: ShardRouting) -> None:
        """From now on, routes are decided over every shard (``control.shard_routing``), once
        admitted here as before. Set once, before the server serves."""
        self._shards = shards

    async def admit(self, scope: Scope, time_left: Callable[[], float | None]) -> None:
        """Return once a route in ``scope`` may be decided. A scope without a pinned policy
        version waits while a sync update drains (``PolicyView.await_routable``: up to
        ``route_wait_ms`` and short of ``time_left()``, the caller's deadline in seconds, None
        for none).

        Raises:
            Unavailable: reason DRAINING (RetryInfo ``route_retry_ms``) when the drain outlasts
                the wait; reason POLICY_STALE (RetryInfo ``route_retry_ms``) when this replica
                has not read the policy state within ``policy_stale_ms``
                (``PolicyView.check_fresh``), checked after the wait.
        """
        await self._policy_view.await_routable(
            pinned_version=scope.policy_version is not None, time_left=time_left
        )
        self._policy_view.check_fresh()

    async def route(
        self,
        prompt: PromptInput,
        scope: Scope,
        *,
        time_left: Callable[[], float | None],
        min_policy_version: int | None = None,
        routing: str = "",
        exclude: frozenset[str] = frozenset(),
        report_end: bool = False,
    ) -> RouteResult:
        """``Router.route`` once admitted (``admit``: a drain waited out, a fresh policy
        state); its refusals and the router's pass through unchanged."""
        await self.admit(scope, time_left)
        if self._shards is not None:
            return await self._shards.route(
                prompt, scope, min_policy_version=min_policy_version, routing=routing,
                exclude=exclude, report_end=report_end,
            )
        return self._router.route(
            prompt, scope, min_policy_version=min_policy_version, routing=routing,
            exclude=exclude, report_end=report_end,
        )

    async def route_batch(
        self,
        prompts: Sequence[PromptInput],
        scope: Scope,
        *,
        time_left: Callable[[], float | None],
        min_policy_version: int | None = None,
        routing: str = "",
        report_end: bool = False,
    ) -> BatchResult:
        """``Router.route_batch`` once admitted, as ``route``: the whole batch waits (or is
        refused) once, before any of its prompts is routed."""
        await self.admit(scope, time_left)
        if self._shards is not None:
            return await self._shards.route_batch(
                prompts, scope, min_policy_version=min_policy_version, routing=routing,
                report_end=report_end,
            )
        return self._router.route_batch(
            prompts, scope, min_policy_version=min_policy_version, routing=routing,
            report_end=report_end,
        )
