"""One worker's generation runtime: engine + KV buffers + paged strategy + prefix cache.

A request: validate -> look up the cached prefix (its tenant's only, in either tier) -> allocate
the rest (all or nothing; host-tier hits copied back) -> prefill only the uncached tokens ->
greedy decode -> record the full pages whose KV was computed -> release every page (recorded
ones stay cached for reuse; evicted ones move to the host tier when there is one). Requests run
one at a time under a lock; callers beyond the first wait their turn, so more concurrent
requests than the pool can hold at once queue instead of corrupting anything.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from coordinator.core.index import Tier
from worker.kv import AllocatorIntegrityError, OutOfPages, PageAllocator, PrefixCache
from worker.runtime.engine import ModelConfig, ReferenceEngine
from worker.runtime.kv_tier_copy import TierCopier, available_host_bytes, check_host_pool
from worker.runtime.runtime_types import (
    EventSink,
    Generation,
    GenerationAborted,
    GenerationCancelled,
    InvalidRequest,
    PoolExhausted,
    RuntimeStats,
)
from worker.runtime.strategy import PagedStrategy, ReqToTokenPool, TaskCacheState


class WorkerRuntime:
    """One worker's generation runtime: engine + KV buffers + paged strategy + prefix cache.
    Thread-safe: generate() calls are serialized by an internal lock (more concurrent requests
    than pages queue, never corrupt).

    ``host_pages`` > 0 adds a host tier: a pool of that many pages in host memory (pinned
    beside CUDA) where pages the device pool evicts are kept and from which a prompt's prefix
    is copied back instead of recomputed (``worker.kv.host_tier``).

    ValueError at construction for an unusable configuration (a device that is not present, a
    page size other than ``hash_config.page_size`` with prefix caching on, bad weights, a host
    tier without prefix caching or larger than the host memory available:
    ``kv_tier_copy.HostMemoryShort``).
    """

    def __init__(
        self,
        *,
        model: ModelConfig,
        pages: int,
        page_size: int,
        hash_config: HashConfig,
        model_name: str = "default",
        policy_version: int = 0,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        weights_path: str | None = None,
        prefix_caching: bool = True,
        events: EventSink | None = None,
        max_new_tokens_limit: int = 1024,
        host_pages: int = 0,
    ) -> None:
        if max_new_tokens_limit < 1:
            raise ValueError(f"max_new_tokens_limit must be >= 1, got {max_new_tokens_limit}")
        if host_pages < 0 or (host_pages and not prefix_caching):
            raise ValueError(f"host_pages must be >= 0 and needs prefix caching, got {host_pages}")
        if prefix_caching and page_size != hash_config.page_size:
            # Keys cut at another page size would never match the coordinator's.
            raise ValueError(f"page_size {page_size} != hash config page_size "
                             f"{hash_config.page_size}")
        self.model = model
        self.page_size = page_size
        self.policy_version = policy_version
        self.max_new_tokens_limit = max_new_tokens_limit
        self._device = _resolve_device(device)
        self._dtype = dtype
        try:
            self._engine = self._load_engine(policy_version, weights_path)
        except InvalidRequest as exc:
            raise ValueError(str(exc)) from None
        self._buffers = self._engine.new_buffers(pages, page_size)
        self._allocator = PageAllocator(pages)
        self._copier: TierCopier | None = None
        host: PageAllocator | None = None
        if host_pages:
            check_host_pool(host_pages, self._engine.page_bytes(page_size), available_host_bytes())
            host_buffers = self._engine.new_buffers(host_pages, page_size, host=True)
            self._copier = TierCopier(self._buffers, host_buffers)
            host = PageAllocator(host_pages)
        # One row: requests run one at a time, so only one row is ever in use.
        self._req_pool = ReqToTokenPool(1, model.max_context, self._device)
        self._prefix: PrefixCache | None = None
        if prefix_caching:
            namespace = Namespace(model=model_name, policy_version=policy_version,
                                  page_size=page_size)
            self._prefix = PrefixCache(
                self._allocator, PageHasher(hash_config), namespace,
                on_stored=events.stored if events else None,
                on_removed=events.removed if events else None,
                host=host, mover=self._copier,
                on_moved=events.moved if events else None,
            )
        self._strategy = PagedStrategy(self._allocator, self._prefix, page_size, self._req_pool)
        # Full recompute for logits_for(use_cache=False): same pool, never looks up or records.
        self._uncached = PagedStrategy(self._allocator, None, page_size, self._req_pool)
        self._lock = threading.Lock()  # serializes requests and weight loads
        # Set while a drain aborts running generation: decode stops at its next step and queued
        # requests stop before they start, until set_aborting(False).
        self._aborting = threading.Event()
        self._stats_lock = threading.Lock()  # guards the two counters below only
        self._running = 0
        self._queued_tokens = 0

    # ---- requests ----

    def generate(
        self, tokens: Sequence[int], max_new_tokens: int, *, tenant: str = "",
        on_token: Callable[[int], None] | None = None, cancel: threading.Event | None = None,
    ) -> Generation:
        """Greedy-decode ``max_new_tokens`` tokens after ``tokens``.

        Reuses cached prefix pages of ``tenant`` (the caller's authenticated tenant; never
        another tenant's: cached_tokens and the time to first token would reveal its prompts);
        records the full pages of prompt + completion whose KV was computed, under ``tenant``'s
        keys; events.stored/removed fire for the changes. InvalidRequest for bad input
        (checked before queueing), PoolExhausted when the request cannot fit the pool.

        ``on_token`` (streaming) is called with each completion token as it is decoded, on this
        thread (each call reads the token back from the device: without it, tokens are read
        once at the end). ``cancel`` set (the caller went away) stops the request at its next
        decode step, or before it starts, with GenerationCancelled; its pages are released and
        nothing is recorded.
        """
        prompt = self._validate(tokens, max_new_tokens)
        n = len(prompt)
        # The last completion token is never fed back, so it needs no KV slot.
        with self._turn(n + max_new_tokens), self._request(self._strategy, prompt,
                                                           n + max_new_tokens - 1,
                                                           tenant=tenant) as req:
            self._check_running(cancel)
            token = req.logits[-1].argmax()
            out = [token]
            if on_token is not None:
                on_token(int(token))
            # Decode: one forward per token (inherent); tokens stay on the device and are
            # read back once at the end, so a GPU never waits on the host between steps.
            for pos in range(n, n + max_new_tokens - 1):
                self._check_running(cancel)
                slots = self._req_pool.slots(req.task.req_idx, pos + 1)
                token = self._engine.forward(self._buffers, token.view(1), pos, slots)[-1].argmax()
                out.append(token)
                if on_token is not None:
                    on_token(int(token))
            completion: list[int] = torch.stack(out).tolist()
            self._strategy.record(req.task, prompt + completion[:-1])
            return Generation(completion, self.policy_version, req.task.cached, req.computed,
                              req.task.host_cached)

    def _check_running(self, cancel: threading.Event | None) -> None:
        if self._aborting.is_set():
            raise GenerationAborted("generation aborted by a policy drain: retry")
        if cancel is not None and cancel.is_set():
            raise GenerationCancelled("the caller went away")

    def logits_for(
        self, tokens: Sequence[int], *, use_cache: bool, tenant: str = ""
    ) -> torch.Tensor:
        """Prefill logits of the positions actually computed: ``[computed_tokens, vocab]``,
        i.e. the last rows of a full recompute (all ``len(tokens)`` rows when nothing was
        reused). ``use_cache=True`` reuses and then records the prompt's full pages (``tenant``'s,
        as ``generate``); ``use_cache=False`` recomputes everything and leaves the prefix cache
        untouched."""
        prompt = self._validate(tokens, 1)
        strategy = self._strategy if use_cache else self._uncached
        with self._turn(len(prompt)), self._request(strategy, prompt, len(prompt),
                                                    all_logits=True, tenant=tenant) as req:
            strategy.record(req.task, prompt)
            return req.logits

    # ---- weights, inventory, stats ----

    def set_aborting(self, aborting: bool) -> None:
        """While True, the running generation stops at its next decode step and queued ones
        before they start (``GenerationAborted``; their pages are released). Thread-safe."""
        if aborting:
            self._aborting.set()
        else:
            self._aborting.clear()

    def load_weights(self, version: int, path: str | None = None) -> int:
        """Switch to ``version``'s weights (from ``path``, else seeded by the version).

        Waits for the running request; then every reusable page is freed and the prefix cache
        moves into ``version``'s namespace (keys carry the version anyway, so nothing of
        another version could hit). Returns the pages freed. Any version is accepted, lower
        ones too: an aborted policy update moves workers back. InvalidRequest for a negative
        version or unusable weights, and then nothing changed.
        """
        if version < 0:
            raise InvalidRequest(f"policy version must be >= 0, got {version}")
        with self._lock:
            engine = self._load_engine(version, path)
            freed = 0
            if self._prefix is not None:
                freed = self._prefix.invalidate(replace(self._prefix.namespace,
                                                        policy_version=version))
            self._engine = engine
            self.policy_version = version
            return freed

    def inventory(self) -> dict[Tier, list[bytes]]:
        """Every cached page key by the tier holding it (for a resync); tiers holding none are
        left out. Waits for the running request."""
        with self._lock:
            return {} if self._prefix is None else self._prefix.inventory_by_tier()

    def stats(self) -> RuntimeStats:
        """Load snapshot; does not wait for the running request."""
        with self._stats_lock:
            running, queued = self._running, self._queued_tokens
        a = self._allocator
        host = self._prefix.host_allocator if self._prefix is not None else None
        if host is None or self._copier is None:
            return RuntimeStats(a.n_pages, a.free_count, a.cached_count, running, queued,
                                self.policy_version)
        return RuntimeStats(a.n_pages, a.free_count, a.cached_count, running, queued,
                            self.policy_version, host.n_pages, host.free_count,
                            host.cached_count, replace(self._copier.stats))

    def check_integrity(self) -> None:
        """Allocator and prefix cache invariants, and no page referenced while idle (a leak).
        Raises AllocatorIntegrityError. Waits for the running request."""
        with self._lock:
            self._allocator.check_integrity()
            if self._prefix is not None:
                self._prefix.check_integrity()
            host = self._prefix.host_allocator if self._prefix is not None else None
            for pool, allocator in (("device", self._allocator), ("host", host)):
                if allocator is not None and allocator.referenced_count:
                    raise AllocatorIntegrityError(f"{allocator.referenced_count} {pool} pages "
                                                  "referenced with no request running")

    # ---- internals ----

    @contextlib.contextmanager
    def _turn(self, tokens: int) -> Iterator[None]:
        """Queue for the lock (counted in ``queued_tokens``), then run (``running_requests``)."""
        with self._stats_lock:
            self._queued_tokens += tokens
        acquired = False
        try:
            acquired = self._lock.acquire()
        finally:  # also when interrupted while waiting: the counters must stay true
            with self._stats_lock:
                self._queued_tokens -= tokens
                self._running += acquired
        try:
            yield
        finally:
            with self._stats_lock:
                self._running -= 1
            self._lock.release()

    @contextlib.contextmanager
    def _request(
        self, strategy: PagedStrategy, prompt: list[int], capacity: int, *,
        all_logits: bool = False, tenant: str = "",
    ) -> Iterator[_Prefilled]:
        """Slots for ``capacity`` positions, the uncached prompt tokens prefilled (reusing
        ``tenant``'s cached pages); on exit (normal or not) the pages and the request row are
        released. Hold the lock."""
        task = TaskCacheState(self._req_pool.alloc(), tenant=tenant)
        try:
            try:
                strategy.alloc(task, prompt, capacity)
            except OutOfPages as exc:
                raise PoolExhausted(
                    f"request needs {-(-capacity // self.page_size)} pages of {self.page_size} "
                    f"tokens ({len(prompt)} prompt + {capacity - len(prompt)} decode slots); "
                    f"the pool has {self._allocator.n_pages} ({exc})"
                ) from None
            strategy.write_indices(task)
            n = len(prompt)
            # A fully cached prompt still needs its last token's logits: re-run that token
            # over the cache without rewriting its (shared, cached) KV.
            start = min(task.cached, n - 1)
            ids = torch.tensor(prompt[start:], dtype=torch.long, device=self._device)
            logits = self._engine.forward(
                self._buffers, ids, start, self._req_pool.slots(task.req_idx, n),
                write_kv=task.cached < n, all_logits=all_logits,
            )
            yield _Prefilled(task, logits, n - start)
        finally:
            strategy.free(task)
            self._req_pool.free(task.req_idx)

    def _validate(self, tokens: Sequence[int], max_new_tokens: int) -> list[int]:
        prompt = list(tokens)
        vocab, context = self.model.vocab_size, self.model.max_context
        if not prompt:
            raise InvalidRequest("prompt is empty")
        if not 1 <= max_new_tokens <= self.max_new_tokens_limit:
            raise InvalidRequest(
                f"max_new_tokens must be 1..{self.max_new_tokens_limit}, got {max_new_tokens}"
            )
        if len(prompt) + max_new_tokens > context:
            raise InvalidRequest(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) "
                                 f"exceeds the model context of {context} tokens")
        if min(prompt) < 0 or max(prompt) >= vocab:
            pos, bad = next((i, t) for i, t in enumerate(prompt) if not 0 <= t < vocab)
            raise InvalidRequest(f"token id {bad} at position {pos} is outside the vocabulary "
                                 f"0..{vocab - 1}")
        return prompt

    def _load_engine(self, version: int, path: str | None) -> ReferenceEngine:
        if path is None:
            return ReferenceEngine.seeded(self.model, version, device=self._device,
                                          dtype=self._dtype)
        try:
            return ReferenceEngine.from_safetensors(self.model, path, device=self._device,
                                                   dtype=self._dtype)
        except FileNotFoundError:
            raise InvalidRequest(f"weights file not found: {path}") from None
        except Exception as exc:  # safetensors raises its own error types for a bad file
            raise InvalidRequest(f"cannot load weights from {path}: {exc}") from None


@dataclass(frozen=True, slots=True)
class _Prefilled:
    task: TaskCacheState
    logits: torch.Tensor  # of the prefilled positions (the last one only unless all_logits)
    computed: int  # prompt tokens run through the model


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch sees no CUDA device")
    return resolved
