"""A contract double of vLLM 0.32's OpenAI server with ``VLLM_SERVER_DEV_MODE=1``, for the
endpoints ``VllmControl`` drives, written from its source (paths under vllm/):

- ``POST /pause?mode=abort|wait|keep&clear_cache=BOOL``, ``POST /resume``, ``GET /is_paused``
  (entrypoints/rl/online/api_router.py). Requests that arrive while paused wait for the resume.
  ``clear_cache`` (default true; not with ``keep``) resets every cache, connector tiers
  included (v1/engine/core.py ``_reset_caches``).
- ``POST /reset_prefix_cache?reset_running_requests=BOOL&reset_external=BOOL``
  (entrypoints/serve/dev/cache/api_router.py; v1/core/sched/scheduler.py
  ``reset_prefix_cache``): ``{"success": true}``; the device cache is dropped, the offload
  tier only with ``reset_external=true`` (the OffloadingConnector's ``reset_cache``,
  distributed/kv_transfer/kv_connector/v1/offloading_connector.py). vLLM queues the reset's
  AllBlocksCleared until its next step with outputs: here, the next completion.
- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": P}}``
  (entrypoints/serve/dev/rpc/api_router.py; v1/worker/gpu_worker.py): ``{"results": [null]}``;
  a path without weights, or an engine started with ``--load-format dummy``: 500.
- ``POST /weight_checker {"action": "checksum"|"compare"|"reset", "baseline": {...}}``
  (rl/online/api_router.py; model_executor/model_loader/weight_checksum.py): a SHA-256 per
  weight, named ``dp0:pp0:pcp0:tp0:<name>``; ``compare`` without a baseline: 400.
- ``POST /update_weight_version {"new_version": V}``, ``GET /weight_info`` (``"default"`` until
  set, v1/engine/core.py).
- ``GET /metrics`` (``vllm:num_requests_running`` / ``_waiting``), ``GET /v1/models`` (``root``:
  the path loaded at start), ``POST /v1/completions`` with token ids, answering
  ``usage.prompt_tokens_details.cached_tokens`` (vLLM's with
  ``--enable-prompt-tokens-details``).
- A body FastAPI cannot validate: 422 ``{"detail": [...]}``; an unknown route 404
  ``{"detail": "Not Found"}``, a known one with another method 405.

The model: a checkpoint is a folder whose ``*.safetensors`` files each stand for one weight
(its bytes the values). The KV cache is a set of 16-token blocks, keyed as vLLM keys them:
chained over the tokens, never over the weights. Each block remembers which weights computed it,
so a hit on a block the loaded weights did not compute is counted in ``stale_tokens``. A
request stores its full blocks on the device and in the offload tier (as the OffloadingConnector
stores what it computes); ``evict_device`` drops the device's, as memory pressure does, and a
later hit loads them back from the offload tier. Requests are answered at once: nothing is ever
running. ``without``: paths an engine lacks (an older release, or no dev mode).
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from aiohttp import web

from tests.fastapi_double import Handler, json_body, serve

BLOCK_TOKENS = 16
PAUSE_MODES = ("abort", "wait", "keep")
CHECKER_ACTIONS = ("checksum", "reset", "compare")
WORKER_PREFIX = "dp0:pp0:pcp0:tp0:"  # gpu_worker.py _weight_checksum_prefix, one worker


def read_weights(path: str) -> dict[str, bytes]:
    """A checkpoint folder's weights: each ``*.safetensors`` file's bytes, by file name."""
    return {f.name: f.read_bytes() for f in sorted(Path(path).glob("*.safetensors"))}


class VllmDouble:
    """vLLM's server on 127.0.0.1 (a free port); ``url`` once started."""

    def __init__(self, model_path: str, *, without: frozenset[str] = frozenset(),
                 load_format: str = "auto") -> None:
        self.model_path = model_path
        self.weights = read_weights(model_path)
        self.without = without
        self.load_format = load_format
        self.weight_version = "default"
        self.paused = False
        self.device: dict[bytes, str] = {}  # block hash -> the weights that computed it
        self.offload: dict[bytes, str] = {}
        self.pending_clear = False
        self.clears_published = 0
        self.stale_tokens = 0
        self.reset_queries: list[dict[str, str]] = []
        self.checksums_taken = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ------------------------------------------------------------------ what the test drives

    def evict_device(self) -> None:
        """GPU memory pressure: every block leaves the device; the offload tier keeps its."""
        self.device.clear()

    def checksums(self) -> dict[str, str]:
        return {WORKER_PREFIX + name: hashlib.sha256(value).hexdigest()
                for name, value in self.weights.items()}

    async def __aenter__(self) -> VllmDouble:
        routes: list[tuple[str, str, Handler]] = [
            ("POST", "/pause", self._pause),
            ("POST", "/resume", self._resume),
            ("GET", "/is_paused", self._is_paused),
            ("POST", "/reset_prefix_cache", self._reset_prefix_cache),
            ("POST", "/collective_rpc", self._collective_rpc),
            ("POST", "/weight_checker", self._weight_checker),
            ("POST", "/update_weight_version", self._update_weight_version),
            ("GET", "/weight_info", self._weight_info),
            ("GET", "/metrics", self._metrics),
            ("GET", "/v1/models", self._models),
            ("POST", "/v1/completions", self._completions),
        ]
        self._runner, self.url = await serve(routes, without=self.without)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------------ vLLM's handlers

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _unprocessable("query", "mode", "Input should be 'abort', 'wait' or 'keep'")
        self.paused = True
        self._resumed.clear()
        if mode != "keep" and _flag(request, "clear_cache", default=True):
            self._reset(external=True)
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.paused = False
        self._resumed.set()
        return web.json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.reset_queries.append(dict(request.query))
        self._reset(external=_flag(request, "reset_external", default=False))
        return web.json_response({"success": True})

    def _reset(self, *, external: bool) -> None:
        self.device.clear()
        if external:
            self.offload.clear()
        self.pending_clear = True

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if body is None or "method" not in body:
            return web.json_response({"detail": "Missing 'method' in request body"}, status=400)
        path = (body.get("kwargs") or {}).get("weights_path")
        if body["method"] != "reload_weights" or self.load_format == "dummy" \
                or not isinstance(path, str) or not read_weights(path):
            return web.Response(status=500, text="Internal Server Error")
        self.weights = read_weights(path)
        return web.json_response({"results": [None]})

    async def _weight_checker(self, request: web.Request) -> web.Response:
        body = await json_body(request) or {}
        action = body.get("action")
        if action not in CHECKER_ACTIONS:
            return _unprocessable("body", "action",
                                  "Input should be 'checksum', 'reset' or 'compare'")
        if action == "reset":
            self.weights = {name: bytes(len(value)) for name, value in self.weights.items()}
            return web.json_response({"status": "reset"})
        if action == "checksum":
            self.checksums_taken += 1
            return web.json_response({"checksums": self.checksums()})
        baseline = body.get("baseline")
        if not isinstance(baseline, dict):
            return web.json_response(
                {"detail": "action='compare' requires a 'baseline' object"}, status=400)
        checksums = self.checksums()
        mismatches = sorted(key for key in checksums.keys() | baseline.keys()
                            if checksums.get(key) != baseline.get(key))
        return web.json_response({"match": not mismatches, "mismatches": mismatches})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        version = (await json_body(request) or {}).get("new_version")
        if not isinstance(version, str):
            return _unprocessable("body", "new_version", "Field required")
        self.weight_version = version
        return web.json_response({"success": True, "new_version": version})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
                                 'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n')

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_path, "object": "model", "root": self.model_path}]})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await json_body(request) or {}
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return _unprocessable("body", "prompt", "token ids expected by this double")
        await self._resumed.wait()
        if self.pending_clear:  # this step publishes the reset's AllBlocksCleared
            self.pending_clear = False
            self.clears_published += 1
        cached = self._serve(prompt)
        return web.json_response({
            "object": "text_completion", "model": self.model_path,
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1,
                      "total_tokens": len(prompt) + 1,
                      "prompt_tokens_details": {"cached_tokens": cached}}})

    def _serve(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` read from cache (the last token is always computed); then
        every full block is stored on the device and offloaded."""
        computed_by = hashlib.sha256(repr(sorted(self.checksums().items())).encode()).hexdigest()
        hits, hitting = 0, True
        for key, within in _blocks(prompt):
            made_by = self.device.get(key, self.offload.get(key))
            if hitting and within and made_by is not None:
                hits += 1
                self.stale_tokens += BLOCK_TOKENS if made_by != computed_by else 0
            else:
                hitting = False
                made_by = computed_by
            self.device[key] = self.offload[key] = made_by
        return hits * BLOCK_TOKENS


def _blocks(prompt: list[int]) -> list[tuple[bytes, bool]]:
    """Each full block's chained hash, and whether it lies before the prompt's last token."""
    blocks, parent = [], b""
    for start in range(0, len(prompt) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        parent = hashlib.sha256(parent + repr(prompt[start:start + BLOCK_TOKENS]).encode()
                                ).digest()
        blocks.append((parent, start + BLOCK_TOKENS < len(prompt)))
    return blocks


def _flag(request: web.Request, name: str, *, default: bool) -> bool:
    value = request.query.get(name)
    return default if value is None else value.lower() in ("true", "1", "yes", "on")


def _unprocessable(where: str, field: str, message: str) -> web.Response:
    return web.json_response({"detail": [{"type": "value_error", "loc": [where, field],
                                          "msg": message}]}, status=422)
