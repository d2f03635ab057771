"""A bridge whose engine takes part in policy updates (the default; ``--no-policy-control``
keeps the old external worker): the engine's controls (``EngineControl``), the proxy the
gateway reaches it through (``EngineProxy``), the stage driver (``PolicyDriver``), the rollout
records of its answers, and the way back from a fence.

**Start.** Every RL endpoint the driver needs must be served (else ``MissingEndpoint``: the
bridge exits 2 naming it and the engine flag). The engine's weights are the bridge's
``--policy-version`` (the operator's word, as before); its weight version is set to it. When the
fleet already serves another version, the engine is brought to it first (below) and only then
registered.

**Fenced, and back.** After a failed stage the bridge leaves the fleet (its pages leave the
index; the coordinator fenced it already) and the engine stays paused. Every
``recover_interval_s`` it tries to bring the engine to the version the fleet serves: load that
version's ``weights_uri`` (or, for the version the engine started with, its own model path),
or, with ``--weights trainer``, find the engine already at it; then reset, set and read back
the version, register anew, resume. Until that succeeds it is never routed, at any version.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import structlog

from coordinator.client import AsyncCoordinatorClient, KvcoordError, PolicyState
from coordinator.client.channels import ClientTls
from coordinator.core.rollout_records import Rollout
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from worker.bridge.engine_control import EngineControl, EngineStepFailed
from worker.bridge.engine_proxy import EngineProxy
from worker.bridge.policy_driver import PolicyDriver
from worker.sync.rollout_reporter import RolloutReporter

log = structlog.get_logger(__name__)


def engine_control(kind: str, url: str) -> EngineControl:
    """The ``EngineControl`` of an engine kind (``vllm`` or ``sglang``)."""
    if kind == "vllm":
        from worker.bridge.engine_vllm import VllmControl

        return VllmControl(url)
    if kind == "sglang":
        from worker.bridge.engine_sglang import SglangControl

        return SglangControl(url)
    raise ValueError(f"no engine control for {kind!r}")


class PolicyMember:
    """The policy side of one bridge (see the module docstring).

    The bridge passes its hooks: ``cleared`` (AllBlocksCleared seen so far), ``confirmed``
    (key new blocks under a version), ``send`` (a SyncRequest on its stream), ``leave`` (stop
    syncing and deregister) and ``rejoin`` (register anew and wait until synced);
    ``stub`` gives the coordinator stub while synced, for rollout records.
    """

    def __init__(
        self, engine: EngineControl, *, worker_id: str, coordinator: str, version: int,
        weights: str, weights_root: Path | None, recover_interval_s: float,
        cleared: Callable[[], int], confirmed: Callable[[int], None],
        send: Callable[[pb.SyncRequest], bool], leave: Callable[[], Awaitable[None]],
        rejoin: Callable[[], Awaitable[None]],
        stub: Callable[[], pb_grpc.CoordinatorStub | None],
        token: str | None = None, tls: ClientTls | None = None,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.proxy = EngineProxy(engine.base_url, worker_id=worker_id, on_answer=self._answered)
        self.driver = PolicyDriver(
            engine, self.proxy, version=version, weights=weights, weights_root=weights_root,
            cleared=cleared, confirmed=confirmed, send=send, on_fenced=self._fenced)
        self.rollouts = RolloutReporter(stub, worker_id=worker_id)
        self.recoveries = 0
        self._coordinator = coordinator
        self._token = token
        self._tls = tls
        self._interval_s = recover_interval_s
        self._leave = leave
        self._rejoin = rejoin
        self._recovery: asyncio.Task[None] | None = None

    @property
    def version(self) -> int:
        return self.driver.version

    # ------------------------------------------------------------------ lifecycle

    async def start(self, host: str, port: int) -> bool:
        """Check the engine, serve the proxy; True when the bridge may register now, False
        when the engine must first catch up with the fleet (recovery runs in the background
        and registers it). Raises ``MissingEndpoint``, ``EngineStepFailed``."""
        await self.engine.check_endpoints()
        start_path = await self.engine.model_path()
        if start_path:
            self.driver.known_paths[self.version] = start_path
        await self.engine.set_weight_version(str(self.version))
        await self.proxy.start(host, port)
        self.rollouts.start()
        serving = await self._fleet_version()
        if serving is None or serving.version == self.version:
            self.proxy.open(self.version)
            return True
        reason = f"the engine serves version {self.version}, the fleet {serving.version}"
        log.warning("bridge.catching_up", worker=self.worker_id, engine=self.version,
                    fleet=serving.version)
        self.driver.counters.fenced = True
        self.proxy.fence(reason)
        self._recovery = asyncio.create_task(self._recover(), name="bridge-recovery")
        return False

    async def stop(self) -> None:
        if self._recovery is not None:
            self._recovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recovery
        await self.driver.stop()
        await self.rollouts.stop(timeout_s=2.0)
        await self.proxy.stop()
        await self.engine.close()

    def command(self, command: pb.PolicyCommand) -> None:
        self.driver.handle(command)

    def _answered(self, rollout: Rollout) -> None:
        self.rollouts.add(rollout)

    # ------------------------------------------------------------------ fenced, and back

    async def _fenced(self, reason: str) -> None:
        """After the FAILED ack: out of the fleet until consistent again."""
        await self._leave()
        self._recovery = asyncio.create_task(self._recover(), name="bridge-recovery")

    async def _recover(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                serving = await self._fleet_version()
                if serving is None or serving.phase != "serving":
                    continue
                await self._catch_up(serving.version, serving.weights_uri)
                await self._rejoin()
            except EngineStepFailed as failed:
                log.warning("bridge.recovery_failed", worker=self.worker_id, step=failed.step,
                            reason=failed.reason)
                continue
            self.driver.unfence(self.version)
            self.recoveries += 1
            self._recovery = None
            log.info("bridge.recovered", worker=self.worker_id, version=self.version)
            return

    async def _catch_up(self, version: int, weights_uri: str) -> None:
        """The engine holds ``version``'s weights, an empty cache, and says so."""
        await self.engine.pause(abort=True)
        if self.driver.weights == "trainer":
            if await self.engine.weight_version() != str(version):
                raise EngineStepFailed("wait_weights", f"the engine is not at version "
                                                       f"{version}: push it again")
        else:
            path = self.driver.resolve(weights_uri) if weights_uri else \
                self.driver.known_paths.get(version)
            if path is None:
                raise EngineStepFailed("load", f"version {version} has no weights_uri and the "
                                               f"engine never loaded it: restart the engine "
                                               f"with its weights")
            await self.engine.load_weights(path)
            self.driver.known_paths[version] = path
        await self.driver.confirm(version)

    async def _fleet_version(self) -> PolicyState | None:
        """The fleet's policy now, or None when the coordinator cannot say."""
        try:
            async with AsyncCoordinatorClient(self._coordinator, self._token,
                                              tls=self._tls) as client:
                return await client.policy()
        except (KvcoordError, grpc.RpcError, OSError) as exc:
            log.warning("bridge.policy_unknown", worker=self.worker_id, error=str(exc)[:200])
            return None

