"""``RouteViews``: what a route reads before any rule chooses: the prompt's keys under each
servable version, each version's eligible workers and index depths (``VersionView``), and the
candidates a chooser takes from them. Reads the index and the fleet, mutates nothing.

Pure core: no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from coordinator.core.fleet import Candidate, Fleet
from coordinator.core.hashing import Namespace, PageHasher
from coordinator.core.index import PrefixIndex
from coordinator.core.routing.batch_order import BatchGroup, group_identical
from coordinator.core.routing.route_types import PromptInput, Scope
from coordinator.core.routing.routing_values import RoutingRequest
from coordinator.core.routing.version_view import VersionView


class RouteViews:
    """The read side of a route, for ``Router`` (and a shard's shortlist). A request is read
    under one policy version (the one it asks for, else the current serving version), or
    under every servable version when it asks for none (an async update's ``max_staleness``)."""

    def __init__(
        self,
        *,
        hasher: PageHasher,
        index: PrefixIndex,
        fleet: Fleet,
        page_size: int,
        default_model: str,
        serving_version: Callable[[], int],
        servable_versions: Callable[[], Sequence[int]] | None = None,
    ) -> None:
        self._hasher = hasher
        self._index = index
        self._fleet = fleet
        self._page_size = page_size
        self._default_model = default_model
        self._serving_version = serving_version
        # Versions a route without an explicit one may be served at (async updates with bounded
        # staleness allow several); default: only the serving version.
        self._servable_versions = servable_versions or (lambda: (serving_version(),))

    def namespace(self, scope: Scope) -> Namespace:
        """The cache namespace of ``scope`` (its version, else the serving one)."""
        version = self._serving_version() if scope.policy_version is None else scope.policy_version
        return Namespace(
            model=scope.model or self._default_model,
            adapter=scope.adapter,
            tenant=scope.tenant,
            policy_version=version,
            page_size=self._page_size,
            cache_salt=scope.cache_salt,
        )

    def keys(self, prompt: PromptInput, namespace: Namespace) -> list[bytes]:
        """The prompt's page keys: hashed here from tokens, or as sent by a trusted caller."""
        if prompt.page_keys is not None:
            return list(prompt.page_keys)
        assert prompt.token_bytes is not None  # PromptInput always carries one body
        return self._hasher.page_keys(prompt.token_bytes, namespace)

    def versions(self, scope: Scope) -> Sequence[int]:
        """The versions a route in ``scope`` may be served at: its pinned one, else every
        servable one."""
        if scope.policy_version is not None:
            return (scope.policy_version,)
        return self._servable_versions()

    def view(self, scope: Scope, version: int, keys: list[bytes], now: float,
             min_policy_version: int | None, only: str | None = None) -> VersionView:
        """``version``'s side of a route of ``keys``: its eligible workers and their depths
        (``only``: of that one worker alone, without sorting the fleet)."""
        ns = self.namespace(replace(scope, policy_version=version))
        if only is None:
            eligible = self._fleet.routable(
                now, version=version, min_version=min_policy_version, model=ns.model)
        else:
            found = self._fleet.routable_worker(
                only, now, version=version, min_version=min_policy_version, model=ns.model)
            eligible = [found] if found is not None else []
        details = self._index.match_detail(keys, include_pending=True) if keys and eligible else {}
        if only is not None:
            details = {only: details[only]} if only in details else {}
        return VersionView(ns, keys, eligible, details)

    def views(self, prompt: PromptInput, scope: Scope, now: float,
              min_policy_version: int | None, exclude: frozenset[str],
              first_keys: list[bytes] | None = None, only: str | None = None,
              ) -> list[VersionView]:
        """Every servable version's view of ``prompt``, without the workers in ``exclude``
        (``only``: with that worker alone). ``first_keys``: the prompt's keys under the first
        version, already hashed."""
        views = []
        for i, version in enumerate(self.versions(scope)):
            ns = self.namespace(replace(scope, policy_version=version))
            keys = first_keys if i == 0 and first_keys is not None else self.keys(prompt, ns)
            view = self.view(scope, version, keys, now, min_policy_version, only)
            views.append(view if not exclude else view.without(exclude))
        return views

    def group_batch(self, prompts: Sequence[PromptInput], scope: Scope,
                    ) -> tuple[list[list[bytes]], list[BatchGroup]]:
        """A batch's prompts' keys under its first servable version and its groups of
        identical prompts, in the order ``Router.route_batch`` routes them."""
        version = self.versions(scope)[0]
        ns = self.namespace(replace(scope, policy_version=version))
        memo: dict[bytes | tuple[bytes, ...], list[bytes]] = {}
        first_keys = []
        for p in prompts:
            body = p.token_bytes if p.token_bytes is not None else p.page_keys
            assert body is not None  # PromptInput always carries one body
            found = memo.get(body)
            if found is None:
                found = memo[body] = self.keys(p, ns)
            first_keys.append(found)
        return first_keys, group_identical(first_keys, [p.token_count for p in prompts])

    def request(self, views: list[VersionView], token_count: int,
                copies: int) -> RoutingRequest:
        """What the chooser prices: ``copies`` prompts of ``token_count`` tokens."""
        return RoutingRequest(prompt_pages=len(views[0].keys), prompt_tokens=token_count,
                              page_size=self._page_size, copies=copies)

    def candidates(self, views: list[VersionView], min_policy_version: int | None,
                   now: float) -> tuple[list[Candidate], Iterator[Candidate]]:
        """Every version's holders of the prompt (pending entries included), and then its idle
        eligible workers, cheapest load floor first (lazily: a chooser may stop early)."""
        holders = [c for view in views
                   for c in view.holders(self._fleet, now, min_policy_version)]
        # Each version's eligible list is in load-floor order; merged, idle workers still reach
        # the chooser cheapest first.
        idle_sessions = heapq.merge(
            *[(s for s in view.eligible if s.worker_id not in view.details) for view in views],
            key=lambda s: s.floor_at(now),
        )
        return holders, (s.idle_candidate(now) for s in idle_sessions)
