"""What a bridge asks of its engine during a policy update, over the engine's own HTTP API.

One ``EngineControl`` per engine kind (``engine_vllm.VllmControl``, ``engine_sglang.SglangControl``)
gives the stages of docs/BRIDGE.md "RL with vLLM / SGLang" one call each. The bridge's policy
driver (``worker.bridge.policy_driver``) calls them in order and acks a stage only after the
engine answered every call of it.

Contract of every call: it returns once the engine has done the thing (not merely accepted it),
and raises ``EngineStepFailed(step, reason)`` when the engine refuses, answers something
unexpected, times out or cannot be reached. ``reason`` is one line fit for a log, a metric label
is ``step``. ``check_endpoints`` raises ``MissingEndpoint`` naming the endpoint and the engine
flag that serves it.
"""

from __future__ import annotations

import abc
import json
from typing import Any

import aiohttp

# An in-place reload reads a whole checkpoint: give it minutes. Everything else is a flag flip.
DEFAULT_STEP_TIMEOUT_S = 30.0
DEFAULT_LOAD_TIMEOUT_S = 600.0
_REASON_CHARS = 300


class EngineStepFailed(Exception):
    """The engine failed ``step`` (``pause``, ``load``, ``verify``, ``reset``, ``version``,
    ``resume``, ``idle``, ``wait_weights``); ``reason`` says how, in one line."""

    def __init__(self, step: str, reason: str) -> None:
        super().__init__(f"{step}: {reason}")
        self.step = step
        self.reason = reason


class MissingEndpoint(Exception):
    """The engine does not serve ``endpoint``; ``flag`` is what makes it serve it."""

    def __init__(self, engine: str, endpoint: str, flag: str) -> None:
        super().__init__(f"the {engine} engine does not serve {endpoint}: start it with {flag}, "
                         f"or run the bridge with --no-policy-control")
        self.endpoint = endpoint
        self.flag = flag


class EngineControl(abc.ABC):
    """The engine's RL hooks, one awaitable per stage (see the module docstring).

    ``base_url``: the engine's HTTP server (``http://HOST:PORT``). The session is opened on first
    use, on the running loop, and closed by ``close``.
    """

    kind = "engine"

    def __init__(self, base_url: str, *, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
                 load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.step_timeout_s = step_timeout_s
        self.load_timeout_s = load_timeout_s
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ the stages

    @abc.abstractmethod
    async def check_endpoints(self) -> None:
        """Raise ``MissingEndpoint`` for the first RL endpoint the engine does not serve."""

    @abc.abstractmethod
    async def pause(self, *, abort: bool) -> None:
        """Stop generating: running requests finish (``abort`` False) or are aborted; requests
        that arrive later wait in the engine until ``resume``. Never keeps a running request's
        KV across the pause (vLLM's ``mode=keep``)."""

    @abc.abstractmethod
    async def running_requests(self) -> int:
        """Requests the engine reports running or waiting now."""

    @abc.abstractmethod
    async def load_weights(self, path: str) -> None:
        """Load the checkpoint at ``path`` (as the engine's host sees it) in place."""

    async def weight_checksums(self) -> dict[str, str] | None:
        """A digest of every loaded weight, by name, or None where the engine gives none (the
        default). An engine that gave digests once gives them on every later call."""
        return None

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> None:
        """Drop every cached KV block the engine can be asked to drop: its own cache and the
        offload tiers it loads prefixes back from (vLLM's connector-managed ones). The engine
        publishes AllBlocksCleared."""

    @abc.abstractmethod
    async def set_weight_version(self, version: str) -> None:
        """Tag the loaded weights with ``version``."""

    @abc.abstractmethod
    async def weight_version(self) -> str | None:
        """The engine's weight version tag now (None when it has none)."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Generate again (requests that waited start now)."""

    async def publish_events(self) -> None:  # noqa: B027 - an engine may hold none back
        """Make the engine publish the KV events it holds back (the default: it holds none)."""

    async def model_path(self) -> str | None:
        """Where the engine loaded its weights from at start, when it says (else None)."""
        return None

    # ------------------------------------------------------------------ HTTP

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _call(self, step: str, method: str, path: str, *, body: Any = None,
                    params: dict[str, str] | None = None,
                    timeout_s: float | None = None) -> Any:
        """``method path`` -> the decoded JSON answer (None for an empty 200). Raises
        ``EngineStepFailed(step, ...)`` for a status other than 200, an answer that is not JSON
        or no answer within ``timeout_s`` (the step timeout by default)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.step_timeout_s)
        url = f"{self.base_url}{path}"
        try:
            async with self._http().request(method, url, json=body, params=params,
                                            timeout=timeout) as answer:
                text = await answer.text()
                if answer.status != 200:
                    raise EngineStepFailed(step, f"{method} {path} answered {answer.status}: "
                                                 f"{_one_line(text)}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineStepFailed(step, f"{method} {path}: {type(exc).__name__} "
                                         f"{_one_line(str(exc))}") from exc
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except ValueError as exc:
            raise EngineStepFailed(step, f"{method} {path} answered non-JSON: "
                                         f"{_one_line(text)}") from exc

    async def _text(self, step: str, path: str) -> str:
        """``GET path`` -> the answer's text; ``EngineStepFailed(step, ...)`` as ``_call``."""
        timeout = aiohttp.ClientTimeout(total=self.step_timeout_s)
        try:
            async with self._http().get(f"{self.base_url}{path}", timeout=timeout) as answer:
                text = await answer.text()
                if answer.status != 200:
                    raise EngineStepFailed(step, f"GET {path} answered {answer.status}: "
                                                 f"{_one_line(text)}")
                return text
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineStepFailed(step, f"GET {path}: {type(exc).__name__} "
                                         f"{_one_line(str(exc))}") from exc

    async def _serves(self, path: str, step: str = "check") -> bool:
        """Whether the engine routes ``path``: probed with a GET, which a POST-only route answers
        with 405 and an unknown one with 404 (nothing is changed)."""
        timeout = aiohttp.ClientTimeout(total=self.step_timeout_s)
        try:
            async with self._http().get(f"{self.base_url}{path}", timeout=timeout) as answer:
                return answer.status not in (404,)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineStepFailed(step, f"GET {path}: {type(exc).__name__} "
                                         f"{_one_line(str(exc))}") from exc


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _REASON_CHARS else line[:_REASON_CHARS] + "..."
