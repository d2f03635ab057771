"""``EngineControl`` for SGLang 0.5.23 (PyPI ``sglang==0.5.23``, tag v0.5.23), through the native
endpoints its HTTP server serves by default (python/sglang/srt/entrypoints/http_server.py; the
request bodies are python/sglang/srt/managers/io_struct.py's):

- ``POST /pause_generation {"mode": "abort"}`` (http_server.py:1831-1841, io_struct.py:1927-1947):
  the tokenizer manager holds every request that arrives later until resume, aborts all running
  and waiting requests, and answers once none is left in flight (tokenizer_manager.py:2267-2280).
  The other modes are never used: ``in_place`` freezes running requests with their KV and
  ``retract`` recomputes their prompt KV but keeps the tokens they sampled, so either would finish
  a sample under two weight versions. SGLang has no mode in which running requests finish, so
  ``pause(abort=False)`` first waits until ``/v1/loads`` reports no request running or waiting,
  and then pauses in ``abort`` mode, which then aborts only what slipped in meanwhile.
- ``GET /ready`` (http_server.py:714-718, tokenizer_manager.py:732-734): 503 while paused (or
  unhealthy), 200 when generating; read back after pause and resume as vLLM's ``/is_paused``.
- ``GET /v1/loads?include=core`` (entrypoints/v1_loads.py:96-150): one entry per DP rank with
  ``num_running_reqs`` and ``num_waiting_reqs`` (managers/load_snapshot.py:196-230), from a
  snapshot each scheduler publishes after batches and on every idle pass (scheduler.py:871-889,
  5082, 5322); a zero may lag a request just admitted, which the ``abort`` pause then ends.
- ``POST /update_weights_from_disk {"model_path": P, "abort_all_requests": false,
  "flush_cache": true}`` (http_server.py:1300-1326, io_struct.py:1970-2000): 200
  ``{"success": true, ...}``, or 400 ``{"success": false, "message": M, ...}`` when the
  checkpoint cannot be read (model_runner_components/weight_updater.py:174-258 rolls back).
  SGLang drops its cache in the same scheduler step as the load (scheduler_components/
  weight_updater.py:120-162), so no request ever meets new weights and old KV; the reset that
  follows flushes again, for the AllBlocksCleared the bridge waits for.
- ``POST /flush_cache`` (http_server.py:1025-1040): 400 ``Flush cache failed.`` while a request
  runs, or waits with the scheduler running (scheduler.py:5518-5548); retried. Not probed by
  ``check_endpoints``: it also answers GET, and a GET would flush.
- ``POST /update_weight_version {"new_version": V, "abort_all_requests": false}``
  (http_server.py:1527-1556; the flag defaults to true, io_struct.py:2155-2160), read back as
  ``weight_version`` of ``GET /model_info`` (http_server.py:812-850), which also names the
  ``model_path`` of the weights loaded last. There is no ``/get_weight_version`` in 0.5.23, and
  ``/get_model_info`` is a deprecated alias that logs a warning per call.
- ``POST /continue_generation {}`` (http_server.py:1844-1854).

The pause and the flush leave SGLang's scheduler running (only ``in_place`` and ``retract`` stop
it), so it publishes the flush's AllBlocksCleared on its next idle pass (scheduler.py:5315):
``publish_events`` has nothing to do.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from worker.bridge.engine_control import (
    EngineControl,
    EngineStepFailed,
    MissingEndpoint,
    _one_line,
)

RELEASE_HINT = "sglang 0.5.23, the release this bridge is written against"
_ENDPOINTS = ("/pause_generation", "/continue_generation", "/ready", "/v1/loads",
              "/update_weights_from_disk", "/update_weight_version", "/model_info")
_RESET_ATTEMPTS = 50
_RETRY_S = 0.1
_PAUSED, _GENERATING = 503, 200  # what GET /ready answers


class SglangControl(EngineControl):
    kind = "sglang"

    async def check_endpoints(self) -> None:
        for path in _ENDPOINTS:
            if not await self._serves(path):
                raise MissingEndpoint("SGLang", path, RELEASE_HINT)

    async def pause(self, *, abort: bool) -> None:
        if not abort:
            await self._wait_idle()
        await self._call("pause", "POST", "/pause_generation", body={"mode": "abort"})
        await self._expect_ready("pause", _PAUSED, after="/pause_generation")

    async def running_requests(self) -> int:
        answer = await self._call("idle", "GET", "/v1/loads", params={"include": "core"})
        count = count_requests(answer)
        if count is None:
            raise EngineStepFailed("idle", f"/v1/loads answered {_one_line(repr(answer))}")
        return count

    async def load_weights(self, path: str) -> None:
        body = {"model_path": path, "abort_all_requests": False, "flush_cache": True}
        status, text = await self._request("load", "POST", "/update_weights_from_disk",
                                           body=body, timeout_s=self.load_timeout_s)
        answer = _json(text)
        if status not in (200, 400) or not isinstance(answer, dict) or "success" not in answer:
            raise EngineStepFailed("load", f"POST /update_weights_from_disk answered {status}: "
                                           f"{_one_line(text)}")
        if answer["success"] is not True:
            raise EngineStepFailed("load", _one_line(str(answer.get("message"))))

    async def reset_prefix_cache(self) -> None:
        refusal = ""
        for _ in range(_RESET_ATTEMPTS):
            status, text = await self._request("reset", "POST", "/flush_cache")
            if status == 200:
                return
            if status != 400:
                raise EngineStepFailed("reset", f"POST /flush_cache answered {status}: "
                                                f"{_one_line(text)}")
            refusal = _one_line(text)
            await asyncio.sleep(_RETRY_S)  # a request is still running or waiting
        raise EngineStepFailed("reset", f"/flush_cache kept answering 400 ({_RESET_ATTEMPTS} "
                                        f"tries): {refusal}")

    async def set_weight_version(self, version: str) -> None:
        # abort_all_requests defaults to true: the bridge also tags an engine that is serving.
        body = {"new_version": version, "abort_all_requests": False}
        answer = await self._call("version", "POST", "/update_weight_version", body=body)
        if not (isinstance(answer, dict) and answer.get("success") is True):
            raise EngineStepFailed("version", f"/update_weight_version answered "
                                              f"{_one_line(repr(answer))}")

    async def weight_version(self) -> str | None:
        """SGLang's tag, ``"default"`` until one is set (``--weight-version``'s default)."""
        version = (await self._model_info("version")).get("weight_version")
        return None if version is None else str(version)

    async def resume(self) -> None:
        await self._call("resume", "POST", "/continue_generation", body={})
        await self._expect_ready("resume", _GENERATING, after="/continue_generation")

    async def model_path(self) -> str | None:
        """The path of the weights SGLang loaded last: the start path until the first
        ``load_weights`` (a load moves it, tokenizer_manager.py:2365-2370)."""
        path = (await self._model_info("check")).get("model_path")
        return path if isinstance(path, str) and path else None

    # ------------------------------------------------------------------ helpers

    async def _wait_idle(self) -> None:
        """Return once nothing runs or waits; running requests finish on the weights they
        started on. SGLang announces no such moment, so it is polled."""
        deadline = asyncio.get_running_loop().time() + self.load_timeout_s
        while (running := await self.running_requests()) > 0:
            if asyncio.get_running_loop().time() > deadline:
                raise EngineStepFailed("pause", f"{running} request(s) still running or "
                                                f"waiting after {self.load_timeout_s:g} s")
            await asyncio.sleep(_RETRY_S)

    async def _expect_ready(self, step: str, status: int, *, after: str) -> None:
        answered, _ = await self._request(step, "GET", "/ready")
        if answered != status:
            raise EngineStepFailed(step, f"/ready answered {answered}, not {status}, after {after}")

    async def _model_info(self, step: str) -> dict[str, Any]:
        answer = await self._call(step, "GET", "/model_info")
        if not isinstance(answer, dict):
            raise EngineStepFailed(step, f"/model_info answered {_one_line(repr(answer))}")
        return answer

    async def _request(self, step: str, method: str, path: str, *, body: Any = None,
                       timeout_s: float | None = None) -> tuple[int, str]:
        """``method path`` -> (status, text) whatever the status (SGLang refuses with 400 and
        says why in the body); ``EngineStepFailed(step, ...)`` only when there is no answer."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.step_timeout_s)
        try:
            async with self._http().request(method, f"{self.base_url}{path}", json=body,
                                            timeout=timeout) as answer:
                return answer.status, await answer.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineStepFailed(step, f"{method} {path}: {type(exc).__name__} "
                                         f"{_one_line(str(exc))}") from exc


def count_requests(loads: Any) -> int | None:
    """Running plus waiting requests in a ``/v1/loads`` answer, summed over DP ranks (None for
    an answer of another shape)."""
    ranks = loads.get("loads") if isinstance(loads, dict) else None
    if not isinstance(ranks, list):
        return None
    total = 0
    for rank in ranks:
        for key in ("num_running_reqs", "num_waiting_reqs"):
            count = rank.get(key) if isinstance(rank, dict) else None
            if not isinstance(count, int):
                return None
            total += count
    return total


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
