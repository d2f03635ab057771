"""A bridged engine through the policy barrier: the coordinator's DRAIN / APPLY / RESUME, carried
out on the engine (``EngineControl``) and its proxy (``EngineProxy``), in arrival order, each
acknowledged only once the engine has done it (docs/BRIDGE.md "RL with vLLM / SGLang").

- **DRAIN(v, abort_running)**: close the proxy's gate (new requests wait in the bridge); with
  ``abort_running`` pause the engine in ``abort`` mode first; wait until every forwarded request
  is answered; pause in ``wait`` mode; ack DRAINED only when the engine reports no request
  running or waiting. ``keep`` is never used: it would resume KV made under the old weights.
- **APPLY(v, uri)**: (async mode: drain first, as above, never aborting) the weights change:
  ``weights="uri"`` asks the engine to load ``uri`` in place (relative to ``weights_root`` when
  relative), ``weights="trainer"`` waits for the trainer's signal, the engine's own weight
  version reaching ``v`` (vLLM: ``/finish_weight_update {"weight_version": "v"}`` after the
  trainer's transfer); a load from ``uri`` is checked where the engine checksums its weights
  (vLLM's ``/weight_checker``): taken before and after, equal checksums (the load left every
  weight as it was) fail step ``verify``; the prefix cache is reset (vLLM's offload tiers
  too); the version is set to ``v`` and read back; the engine resumes and the bridge waits to
  see AllBlocksCleared on the event stream; only then does the proxy forward again and
  APPLIED(v) go out. An APPLY of the version already confirmed (an aborted update) only
  resumes.
- **RESUME**: resume and reopen (an update aborted after DRAIN).
- **Any failure** (``EngineStepFailed``, or a version read back other than asked) fences the
  engine: the proxy answers 503, the engine is left paused, FAILED(v, reason) is acked (the
  coordinator fences the worker at once), ``on_fenced`` runs (the bridge leaves the fleet and
  recovers), ``kvcoord_bridge_policy_failures_total{step}`` counts it and ``bridge.fenced`` logs it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from coordinator.v1 import coordinator_pb2 as pb
from worker.bridge.engine_control import EngineControl, EngineStepFailed
from worker.bridge.engine_proxy import EngineProxy
from worker.serving.in_order import InOrder

log = structlog.get_logger(__name__)

WEIGHT_SOURCES = ("uri", "trainer")
# What the check of a load from a URI found: the weights changed, or not (fenced), or the
# engine gives no checksums.
WEIGHT_CHECKS = ("checked", "failed", "unchecked")
_POLL_S = 0.1


@dataclass(slots=True)
class PolicyCounters:
    """What ``/metrics`` shows of the driver: stages done, failures by step, weight checks by
    outcome (``WEIGHT_CHECKS``), pause seconds."""

    stages: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    weight_checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WEIGHT_CHECKS, 0))
    fenced: bool = False
    last_pause_s: float = 0.0


class PolicyDriver:
    """Runs policy commands against the engine (see the module docstring).

    ``cleared``: how many AllBlocksCleared the bridge has seen on the event stream (read before
    and after a reset); ``confirmed``: called with each version the engine confirmed, before the
    engine resumes (the bridge keys new blocks under it); ``send``: queues a SyncRequest on the
    current stream (False when there is none); ``on_fenced(reason)``: after a failure was acked.
    """

    def __init__(
        self, engine: EngineControl, proxy: EngineProxy, *, version: int, weights: str,
        weights_root: Path | None, cleared: Callable[[], int],
        confirmed: Callable[[int], None], send: Callable[[pb.SyncRequest], bool],
        on_fenced: Callable[[str], Awaitable[None]], clear_timeout_s: float = 30.0,
        trainer_timeout_s: float = 600.0,
    ) -> None:
        if weights not in WEIGHT_SOURCES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_SOURCES)}, got {weights!r}")
        self.engine = engine
        self.proxy = proxy
        self.version = version
        self.weights = weights
        self.weights_root = weights_root
        self.counters = PolicyCounters()
        # version -> the checkpoint path it was loaded from (the start's, and each APPLY's):
        # what a fenced engine reloads to catch up with the fleet.
        self.known_paths: dict[int, str] = {}
        self._cleared = cleared
        self._confirmed = confirmed
        self._send = send
        self._on_fenced = on_fenced
        self._clear_timeout_s = clear_timeout_s
        self._trainer_timeout_s = trainer_timeout_s
        self._commands = InOrder(self._run, "bridge-policy")
        self._paused_at: float | None = None

    def handle(self, command: pb.PolicyCommand) -> None:
        """Queue ``command``; it runs after every command received before it."""
        self._commands.handle(command)

    async def idle(self) -> None:
        await self._commands.idle()

    async def stop(self) -> None:
        await self._commands.stop()

    async def _run(self, command: pb.PolicyCommand) -> None:
        try:
            if self.counters.fenced:
                log.warning("bridge.command_while_fenced", kind=int(command.kind),
                            version=command.version)
            else:
                await self._execute(command)
        except EngineStepFailed as failed:
            await self._fail(command.version, failed)
        except Exception as exc:  # a bug must fence, never leave old weights serving
            log.exception("bridge.policy_bug", version=command.version)
            await self._fail(command.version, EngineStepFailed("bridge", repr(exc)))

    async def _execute(self, command: pb.PolicyCommand) -> None:
        if command.kind == pb.PolicyCommand.KIND_DRAIN:
            await self.drain(abort=command.abort_running)
            self._ack(pb.PolicyAck.STAGE_DRAINED, command.version)
        elif command.kind == pb.PolicyCommand.KIND_APPLY:
            await self.apply(command.version, command.weights_uri)
            self._ack(pb.PolicyAck.STAGE_APPLIED, command.version)
        elif command.kind == pb.PolicyCommand.KIND_RESUME:
            if not self.proxy.is_open:
                await self.engine.resume()
                self._reopen()
        else:
            log.warning("bridge.unknown_command", kind=int(command.kind))

    # ------------------------------------------------------------------ the stages

    async def drain(self, *, abort: bool) -> None:
        """Nothing generates any more, and nothing waits in the engine."""
        self.proxy.close()
        self._paused_at = self._paused_at or time.monotonic()
        if abort:
            await self.engine.pause(abort=True)
        await self.proxy.wait_idle()
        await self.engine.pause(abort=False)
        running = await self.engine.running_requests()
        if running:
            raise EngineStepFailed("pause", f"the engine reports {running} request(s) running "
                                            f"or waiting after the pause")
        self._count("drained")

    async def apply(self, version: int, weights_uri: str) -> None:
        """The engine serves ``version``'s weights with an empty cache, and says so."""
        if version == self.version and await self.engine.weight_version() == str(version):
            await self.engine.resume()  # an aborted update: the weights never changed
            self._reopen()
            return
        if self.proxy.is_open:  # async mode: no DRAIN came first
            await self.drain(abort=False)
        await self.load(version, weights_uri)
        await self.confirm(version)
        self._reopen()
        self._count("applied")

    async def load(self, version: int, weights_uri: str) -> None:
        """Step 1: the weights of ``version`` are in the engine."""
        if self.weights == "trainer":
            await self._trainer_pushed(version)
            return
        if not weights_uri:
            raise EngineStepFailed("load", f"the update to version {version} names no "
                                           f"weights_uri, and this bridge loads weights from one "
                                           f"(--weights uri); begin it with weights_uri, or run "
                                           f"the bridge with --weights trainer")
        path = self.resolve(weights_uri)
        before = await self.engine.weight_checksums()
        await self.engine.load_weights(path)
        await self._check_changed(version, path, before)
        self.known_paths[version] = path

    async def _check_changed(self, version: int, path: str, before: dict[str, str] | None
                             ) -> None:
        """Fail step ``verify`` when the load left every weight's checksum as ``before`` (a
        checkpoint of the old weights, a loader that did nothing): the engine would serve
        ``version``'s tag on the old weights. Unchecked when the engine gave no checksums."""
        if before is None:
            if not self.counters.weight_checks["unchecked"]:  # once: it cannot change
                log.warning("bridge.weights_unchecked", engine=self.engine.kind,
                            reason="the engine gives no weight checksums")
            self.counters.weight_checks["unchecked"] += 1
            return
        if await self.engine.weight_checksums() == before:
            self.counters.weight_checks["failed"] += 1
            raise EngineStepFailed("verify", f"every weight is unchanged after loading {path} "
                                             f"for version {version} ({len(before)} checksums "
                                             f"equal to those before)")
        self.counters.weight_checks["checked"] += 1

    async def confirm(self, version: int) -> None:
        """Steps 2 to 4: the cache dropped, the version set and read back, the engine resumed
        and the clear seen on the event stream (vLLM publishes it only with a later step:
        ``publish_events``); from here the bridge keys blocks under ``version``. The proxy's
        gate stays closed throughout: nothing of the gateway's runs before the clear is seen."""
        before = self._cleared()
        await self.engine.reset_prefix_cache()
        await self.engine.set_weight_version(str(version))
        reported = await self.engine.weight_version()
        if reported != str(version):
            raise EngineStepFailed("version", f"the engine reports weight version {reported!r} "
                                              f"after it was set to {version}")
        await self.engine.resume()
        await self.engine.publish_events()
        deadline = time.monotonic() + self._clear_timeout_s
        while self._cleared() == before:
            if time.monotonic() > deadline:
                raise EngineStepFailed("reset", f"no AllBlocksCleared on the event stream "
                                                f"{self._clear_timeout_s:.0f} s after the reset")
            await asyncio.sleep(_POLL_S)
        self.version = version
        self._confirmed(version)

    def resolve(self, weights_uri: str) -> str:
        """A ``file://`` URI or a path; a relative one is under ``weights_root``."""
        path = weights_uri.removeprefix("file://")
        if self.weights_root is not None and not Path(path).is_absolute():
            return str(self.weights_root / path)
        return path

    async def _trainer_pushed(self, version: int) -> None:
        deadline = time.monotonic() + self._trainer_timeout_s
        while await self.engine.weight_version() != str(version):
            if time.monotonic() > deadline:
                raise EngineStepFailed("wait_weights", f"the trainer did not finish pushing "
                                                       f"version {version} within "
                                                       f"{self._trainer_timeout_s:.0f} s")
            await asyncio.sleep(_POLL_S)

    # ------------------------------------------------------------------ acks and failures

    def _reopen(self) -> None:
        self.proxy.open(self.version)
        if self._paused_at is not None:
            self.counters.last_pause_s = time.monotonic() - self._paused_at
            self._paused_at = None

    def _count(self, stage: str) -> None:
        self.counters.stages[stage] = self.counters.stages.get(stage, 0) + 1

    def _ack(self, stage: pb.PolicyAck.Stage, version: int, reason: str = "") -> None:
        ack = pb.PolicyAck(stage=stage, version=version, reason=reason)
        if not self._send(pb.SyncRequest(policy_ack=ack)):
            log.warning("bridge.ack_not_sent", stage=pb.PolicyAck.Stage.Name(stage),
                        version=version, reason="no Sync stream")
        else:
            log.info("bridge.acked", stage=pb.PolicyAck.Stage.Name(stage), version=version)

    async def _fail(self, version: int, failed: EngineStepFailed) -> None:
        reason = str(failed)
        self.counters.failures[failed.step] = self.counters.failures.get(failed.step, 0) + 1
        self.counters.fenced = True
        self.proxy.fence(reason)
        log.error("bridge.fenced", version=version, step=failed.step, reason=failed.reason,
                  serving=self.version)
        self._ack(pb.PolicyAck.STAGE_FAILED, version, reason)
        await self._on_fenced(reason)

    def unfence(self, version: int) -> None:
        """The bridge brought the engine back to ``version`` (``recovery``): serve again."""
        self.version = version
        self.counters.fenced = False
        self._reopen()
