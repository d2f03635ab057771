"""``EngineControl`` for vLLM 0.32 (its CPU build included), through the endpoints its OpenAI
server adds with ``VLLM_SERVER_DEV_MODE=1`` (vllm/entrypoints/launchers/api_server/routers.py
registers the RL routes, vllm/entrypoints/rl/online/api_router.py, and the dev routes,
vllm/entrypoints/serve/dev/, only then):

- ``POST /pause?mode=wait|abort&clear_cache=false``: the scheduler stops; ``wait`` returns once
  running requests finished, ``abort`` aborts them. Requests added later are held until resume.
  ``clear_cache`` defaults to true; the bridge drops the cache itself after the weights change,
  where it can watch the clear arrive on the event stream. ``mode=keep`` is never used.
- ``GET /metrics``: ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``.
- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": P}}``: every
  model worker reloads the checkpoint in place (refused for an engine started with
  ``--load-format dummy``).
- ``POST /weight_checker {"action": "checksum"}`` (api_router.py): ``{"checksums": {NAME:
  SHA256}}``, one per weight of every model worker (names prefixed ``dp0:pp0:pcp0:tp0:``).
  Probed once, at the first call: an engine without it (404) gives no checksums.
- ``POST /reset_prefix_cache?reset_external=true`` (serve/dev/cache/api_router.py):
  ``{"success": false}`` while blocks are held, or while an offload transfer is in flight;
  retried. ``reset_external`` also clears the connector-managed tiers (CPU or disk offload
  through the OffloadingConnector, LMCache), whose blocks vLLM keys without the weights: a
  bare reset leaves KV of the old weights there, loaded back for the next request of its prefix.
  Without a connector it is a no-op that succeeds (v1/core/sched/scheduler.py
  ``reset_connector_cache``).
- ``POST /update_weight_version {"new_version": V}``, ``GET /weight_info``.
- ``POST /resume``.
- ``GET /v1/models``: the first model's ``root``, the path the engine loaded at start.

NOTE: vLLM queues a reset's AllBlocksCleared until its next engine step with outputs, so after
the reset the bridge resumes the engine and sends it one request of a single token for one
token (``publish_events``): that step publishes the event and, shorter than a block, stores
nothing. Requests of the gateway are still held by the bridge's proxy meanwhile.
"""

from __future__ import annotations

import asyncio

from worker.bridge.engine_control import (
    EngineControl,
    EngineStepFailed,
    MissingEndpoint,
    _one_line,
)

DEV_MODE_FLAG = "VLLM_SERVER_DEV_MODE=1 in the engine's environment"
_RESET_ATTEMPTS = 50
_RESET_RETRY_S = 0.1
_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


class VllmControl(EngineControl):
    kind = "vllm"

    def __init__(self, base_url: str, **timeouts: float) -> None:
        super().__init__(base_url, **timeouts)
        self._checks_weights: bool | None = None  # /weight_checker served; None: not probed

    async def check_endpoints(self) -> None:
        for path in ("/is_paused", "/weight_info", "/reset_prefix_cache", "/collective_rpc",
                     "/update_weight_version", "/pause", "/resume"):
            if not await self._serves(path):
                raise MissingEndpoint("vLLM", path, DEV_MODE_FLAG)

    async def pause(self, *, abort: bool) -> None:
        mode = "abort" if abort else "wait"
        timeout = self.load_timeout_s  # "wait" lasts as long as the longest running request
        await self._call("pause", "POST", "/pause",
                         params={"mode": mode, "clear_cache": "false"}, timeout_s=timeout)
        answer = await self._call("pause", "GET", "/is_paused")
        if not (isinstance(answer, dict) and answer.get("is_paused") is True):
            raise EngineStepFailed("pause", f"/is_paused answered {answer!r} after /pause")

    async def running_requests(self) -> int:
        return count_requests(await self._text("idle", "/metrics"))

    async def load_weights(self, path: str) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        await self._call("load", "POST", "/collective_rpc", body=body,
                         timeout_s=self.load_timeout_s)

    async def weight_checksums(self) -> dict[str, str] | None:
        if self._checks_weights is None:
            self._checks_weights = await self._serves("/weight_checker", step="verify")
        if not self._checks_weights:
            return None
        # Every worker hashes every byte of its weights: as long as a reload, not a flag flip.
        answer = await self._call("verify", "POST", "/weight_checker",
                                  body={"action": "checksum"}, timeout_s=self.load_timeout_s)
        checksums = answer.get("checksums") if isinstance(answer, dict) else None
        if not (isinstance(checksums, dict) and checksums
                and all(isinstance(digest, str) for digest in checksums.values())):
            raise EngineStepFailed("verify", f"/weight_checker answered "
                                             f"{_one_line(repr(answer))}")
        return checksums

    async def reset_prefix_cache(self) -> None:
        for _ in range(_RESET_ATTEMPTS):
            answer = await self._call("reset", "POST", "/reset_prefix_cache",
                                      params={"reset_external": "true"})
            if isinstance(answer, dict) and answer.get("success") is True:
                return
            await asyncio.sleep(_RESET_RETRY_S)  # blocks still held by a finishing request
        raise EngineStepFailed("reset", f"/reset_prefix_cache kept answering success=false "
                                        f"({_RESET_ATTEMPTS} tries)")

    async def set_weight_version(self, version: str) -> None:
        await self._call("version", "POST", "/update_weight_version",
                         body={"new_version": version})

    async def weight_version(self) -> str | None:
        answer = await self._call("version", "GET", "/weight_info")
        if not isinstance(answer, dict):
            raise EngineStepFailed("version", f"/weight_info answered {answer!r}")
        version = answer.get("weight_version")
        return None if version is None else str(version)

    async def resume(self) -> None:
        await self._call("resume", "POST", "/resume")
        answer = await self._call("resume", "GET", "/is_paused")
        if not (isinstance(answer, dict) and answer.get("is_paused") is False):
            raise EngineStepFailed("resume", f"/is_paused answered {answer!r} after /resume")

    async def publish_events(self) -> None:
        models = await self._call("publish", "GET", "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not (isinstance(data, list) and data and isinstance(data[0], dict)):
            raise EngineStepFailed("publish", f"/v1/models answered {models!r}")
        body = {"model": data[0].get("id"), "prompt": [0], "max_tokens": 1, "temperature": 0}
        await self._call("publish", "POST", "/v1/completions", body=body)

    async def model_path(self) -> str | None:
        answer = await self._call("check", "GET", "/v1/models")
        models = answer.get("data") if isinstance(answer, dict) else None
        if isinstance(models, list) and models and isinstance(models[0], dict):
            root = models[0].get("root")
            return root if isinstance(root, str) and root else None
        return None


def count_requests(metrics_text: str) -> int:
    """Running plus waiting requests in vLLM's Prometheus text (summed over label sets)."""
    total = 0.0
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _METRICS:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)

