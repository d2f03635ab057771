"""A contract double of SGLang 0.5.23's HTTP server (PyPI ``sglang==0.5.23``, tag v0.5.23) for
the endpoints ``SglangControl`` drives, written from its source; paths are under python/sglang/srt/:

- ``POST /pause_generation`` (entrypoints/http_server.py:1831-1841; the modes,
  managers/io_struct.py:1927-1947): ``abort`` aborts every running and waiting request
  (managers/tokenizer_manager.py:2267-2280); ``retract`` moves running requests back to the
  waiting queue and ``in_place`` leaves them, both also stopping the scheduler
  (managers/scheduler.py:5817-5932). Either way later requests are held: ``GET /ready`` 503.
- ``POST /continue_generation`` (http_server.py:1844-1854); ``GET /ready`` (http_server.py:714-718).
- ``POST /update_weights_from_disk`` (http_server.py:1300-1326, io_struct.py:1970-2000,
  tokenizer_manager.py:2288-2390): aborts first when asked, waits for in-flight requests unless
  paused (the model-update writer lock), loads, drops the cache when ``flush_cache`` (and fails if
  requests still run, scheduler_components/weight_updater.py:120-162), moves ``model_path``.
  Loader messages from model_executor/model_runner_components/weight_updater.py:174-258 and
  model_loader/loader.py:480-581; for a directory that does not exist the text after "Failed to
  get weights iterator:" is huggingface_hub's (2.4.0's, as an engine with HF_HUB_OFFLINE=1 says).
- ``GET|POST /flush_cache[?timeout=S]`` (http_server.py:1025-1040): 400 while a request runs, or
  waits with the scheduler running (scheduler.py:5518-5548, 5337-5360); ``timeout`` waits for idle
  (scheduler_components/flush_wrapper.py).
- ``POST /update_weight_version`` (http_server.py:1527-1556; ``abort_all_requests`` defaults to
  true, io_struct.py:2155-2160); ``GET /model_info`` and its deprecated alias ``/get_model_info``
  (http_server.py:802-850); ``weight_version`` is ``"default"`` until set.
- ``GET /v1/loads`` (entrypoints/v1_loads.py:96-150; managers/load_snapshot.py:196-230).
- A body FastAPI cannot validate: 400 with ``ErrorResponse`` (http_server.py:635-693); an unknown
  route 404 ``{"detail": "Not Found"}``, a known one with another method 405.

Requests are counts (``admit``/``finish``), the cache a count of blocks. Injected faults:
``fail_load`` (the loader raises it, SGLang rolls back), ``lie_version`` (``/model_info`` reports
it whatever was set), ``broken`` (paths answering 500), ``without`` (paths an older release lacks).
"""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path

from aiohttp import web

from tests.fastapi_double import Handler, json_body, serve

MODES = ("abort", "retract", "in_place")
LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
           "or waiting requests, the operation will not be performed.)\n")
NOT_FLUSHED_AFTER_LOAD = ("Weights were updated, but the cache was not flushed because requests "
                          "are still running or queued. Retract or finish them, then call "
                          "/flush_cache.")


def missing_weights_message(path: str) -> str:
    """What SGLang answers for a model path with no weights behind it."""
    if Path(path).is_dir():
        reason = f"Cannot find any model weights with `{path}`"
    elif path.startswith("/"):
        reason = (f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. "
                  f"Use `repo_type` argument if needed.")
    else:
        reason = ("Cannot find an appropriate cached snapshot folder for the specified revision "
                  "on the local disk and outgoing traffic has been disabled. To enable repo "
                  "look-ups and downloads online, pass 'local_files_only=False' as input.")
    return f"Failed to get weights iterator: {reason}."


def _has_weights(path: str) -> bool:
    folder = Path(path)
    return folder.is_dir() and any(any(folder.glob(pattern)) for pattern in ("*.safetensors",
                                                                            "*.bin"))


def _validation_error(message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": "Bad Request",
                              "param": None, "code": 400}, status=400)


class SglangDouble:
    """SGLang's HTTP server on 127.0.0.1 (a free port); ``url`` once started."""

    def __init__(self, model_path: str, *, without: frozenset[str] = frozenset()) -> None:
        self.model_path = model_path  # what /model_info reports: the weights loaded last
        self.loaded = model_path  # whose weights the model holds (a failed flush still loads)
        self.weight_version = "default"
        self.without = without
        self.fail_load: str | None = None
        self.lie_version: str | None = None
        self.broken: set[str] = set()
        self.paused = False  # the tokenizer manager holds new requests
        self.scheduler_paused = False  # only retract and in_place stop the scheduler
        self.running = 0
        self.waiting = 0
        self.cache_blocks = 0
        self.aborted = 0
        self.pause_modes: list[str] = []
        self.flush_statuses: list[int] = []
        self.loads_polled = asyncio.Event()
        self.flush_refused = asyncio.Event()
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ------------------------------------------------------------------ what the test drives

    async def admit(self, running: int, waiting: int = 0) -> None:
        """Requests arrive; each running one has stored a block."""
        async with self._changed:
            self.running += running
            self.waiting += waiting
            self.cache_blocks += running
            self._changed.notify_all()

    async def finish(self) -> None:
        """Every running and waiting request ends."""
        async with self._changed:
            self.running = self.waiting = 0
            self._changed.notify_all()

    def idle(self) -> bool:
        """Scheduler.is_fully_idle(ignore_waiting=paused) (scheduler.py:5337-5360)."""
        return self.running == 0 and (self.waiting == 0 or self.scheduler_paused)

    async def __aenter__(self) -> SglangDouble:
        routes: list[tuple[str, str, Handler]] = [
            ("POST", "/pause_generation", self._pause),
            ("POST", "/continue_generation", self._continue),
            ("GET", "/ready", self._ready),
            ("GET", "/model_info", self._model_info),
            ("GET", "/get_model_info", self._model_info),
            ("GET", "/v1/loads", self._loads),
            ("POST", "/update_weights_from_disk", self._update_weights_from_disk),
            ("POST", "/update_weight_version", self._update_weight_version),
            ("GET", "/flush_cache", self._flush_cache),
            ("POST", "/flush_cache", self._flush_cache),
        ]
        self._runner, self.url = await serve(routes, without=self.without,
                                             middlewares=[self._faults])
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------------ SGLang's handlers

    @web.middleware
    async def _faults(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in self.broken:
            return web.Response(status=500, text="Internal Server Error")
        return await handler(request)

    async def _pause(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if body is None:
            return _validation_error("body: Field required")
        mode = body.get("mode", "abort")
        if mode not in MODES:
            return _validation_error(f"body.mode: Input should be 'abort', 'retract' or "
                                     f"'in_place', got {mode!r}")
        async with self._changed:
            self.pause_modes.append(mode)
            self.paused = True
            if mode == "abort":
                self._abort_all()
            else:
                self.scheduler_paused = True
                if mode == "retract":
                    self.running, self.waiting = 0, self.waiting + self.running
            self._changed.notify_all()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        if await json_body(request) is None:
            return _validation_error("body: Field required")
        self.paused = self.scheduler_paused = False
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.paused else 200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "served_model_name": self.model_path,
            "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.lie_version or self.weight_version,
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
            "disaggregation_mode": "null", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "llama",
            "architectures": ["LlamaForCausalLM"]})

    async def _loads(self, request: web.Request) -> web.Response:
        self.loads_polled.set()
        include = {s.strip() for s in request.query.get("include", "all").split(",")}
        if not include <= LOAD_SECTIONS:
            detail = (f"Invalid include sections: {include - LOAD_SECTIONS}. "
                      f"Valid options: {sorted(LOAD_SECTIONS)}")
            return web.json_response({"object": "error", "message": detail, "type": "400",
                                      "param": None, "code": 400}, status=400)
        load = {"timestamp": 0.0, "dp_rank": 0, "num_running_reqs": self.running,
                "num_waiting_reqs": self.waiting, "num_used_tokens": 16 * self.cache_blocks,
                "token_usage": 0.0, "gen_throughput": 0.0, "cache_hit_rate": 0.0}
        return web.json_response({
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat(), "version": "0.5.23",
            "accelerator": None, "num_accelerators": 1, "loads": [load]})

    async def _update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await json_body(request) or {}
        path = body.get("model_path")
        if not isinstance(path, str):
            return _validation_error("body.model_path: Field required")
        async with self._changed:
            if body.get("abort_all_requests", False):
                self._abort_all()
            if not self.paused:  # the writer lock waits for every request in flight
                await self._changed.wait_for(lambda: self.running + self.waiting == 0)
            success, message = self._load(path, flush=body.get("flush_cache", True) is not False)
            version = body.get("weight_version")
            if success and version is not None:
                self.weight_version = str(version)
                message += f" Weight version updated to {version}."
        answer = {"success": success, "message": message, "num_paused_requests": 0}
        return web.json_response(answer, status=200 if success else 400)

    def _load(self, path: str, *, flush: bool) -> tuple[bool, str]:
        if self.fail_load is not None:
            return False, f"Failed to update weights: {self.fail_load}.\nRolling back to " \
                          f"original weights."
        if not _has_weights(path):
            return False, missing_weights_message(path)
        self.loaded = path
        if flush and not self.idle():
            return False, NOT_FLUSHED_AFTER_LOAD
        if flush:
            self.cache_blocks = 0
        self.model_path = path
        return True, "Succeeded to update model weights."

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = await json_body(request) or {}
        version = body.get("new_version")
        if not isinstance(version, str):
            return _validation_error("body.new_version: Field required")
        if body.get("abort_all_requests", True):
            async with self._changed:
                self._abort_all()
        self.weight_version = version
        return web.json_response({"success": True, "message": f"Weight version updated to "
                                                              f"{version}", "new_version": version})

    async def _flush_cache(self, request: web.Request) -> web.Response:
        try:
            timeout = float(request.query.get("timeout", "0"))
        except ValueError:
            timeout = -1.0
        if timeout < 0:
            return _validation_error("query.timeout: Input should be greater than or equal to 0")
        message = "Flush cache failed.\n"
        async with self._changed:
            if timeout > 0 and not self.idle():
                try:
                    await asyncio.wait_for(self._changed.wait_for(self.idle), timeout)
                except TimeoutError:
                    message = "Timed out waiting for idle state."
            flushed = self.idle()
            if flushed:
                self.cache_blocks = 0
        status = 200 if flushed else 400
        self.flush_statuses.append(status)
        if not flushed:
            self.flush_refused.set()
        return web.Response(status=status, text=FLUSHED if flushed else message)

    def _abort_all(self) -> None:
        self.aborted += self.running + self.waiting
        self.running = self.waiting = 0
