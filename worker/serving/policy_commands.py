"""Policy commands from the coordinator (``SyncResponse.command``), handled one at a time in
arrival order and acknowledged on the Sync stream:

- DRAIN: close the generation gate (new Generate calls get UNAVAILABLE), wait until no call is in
  flight, then ``PolicyAck{DRAINED, version}``.
- APPLY: ``runtime.load_weights(version, weights_uri or None)`` in a thread (it drops every
  cached page of the old weights; their REMOVED events flow as usual), then
  ``PolicyAck{APPLIED, version}``.
- RESUME: open the gate again (no ack). APPLY already reopened it once the new weights were in;
  RESUME covers an aborted update whose APPLY never came.

DRAIN with ``abort_running`` also stops running generation at its next decode step (and queued
requests before they start): their callers get ABORTED and route again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from coordinator.v1 import coordinator_pb2 as pb
from worker.metrics import WorkerMetrics
from worker.runtime.runtime import WorkerRuntime
from worker.serving.gate import GenerationGate
from worker.serving.in_order import InOrder

log = structlog.get_logger(__name__)

KIND_NAMES = {
    pb.PolicyCommand.KIND_DRAIN: "drain", pb.PolicyCommand.KIND_APPLY: "apply",
    pb.PolicyCommand.KIND_RESUME: "resume",
}


class PolicyCommandHandler:
    """Runs policy commands in order on the event loop. ``send`` queues a ``SyncRequest`` on the
    current stream and returns False when there is none (the ack is then lost; the coordinator
    resends the command for the worker's stage when its stream comes back, and the worker skips
    work already done)."""

    def __init__(
        self, runtime: WorkerRuntime, gate: GenerationGate, metrics: WorkerMetrics,
        send: Callable[[pb.SyncRequest], bool],
    ) -> None:
        self.gate = gate
        self._runtime = runtime
        self._metrics = metrics
        self._send = send
        self._commands = InOrder(self._run, "policy-commands")

    def handle(self, command: pb.PolicyCommand) -> None:
        """Queue ``command``; it runs after every command received before it."""
        self._commands.handle(command)

    async def idle(self) -> None:
        """Return once every queued command has run (for tests and shutdown)."""
        await self._commands.idle()

    async def stop(self) -> None:
        await self._commands.stop()

    async def _run(self, command: pb.PolicyCommand) -> None:
        try:
            await self._execute(command)
        except Exception:
            # A failed APPLY leaves the old weights serving and sends no ack: the
            # coordinator's barrier times out and fences this worker, which is the point.
            log.exception("policy.command_failed", kind=KIND_NAMES.get(command.kind),
                          version=command.version)

    async def _execute(self, command: pb.PolicyCommand) -> None:
        kind = KIND_NAMES.get(command.kind)
        if kind is None:
            log.warning("policy.unknown_command", kind=int(command.kind))
            return
        self._metrics.sync_policy_commands.labels(kind).inc()
        log.info("policy.command", kind=kind, version=command.version)
        if kind == "drain":
            self.gate.close()
            if command.abort_running:
                self._runtime.set_aborting(True)
            await self.gate.wait_idle()
            self._ack(pb.PolicyAck.STAGE_DRAINED, command.version)
        elif kind == "apply":
            if self._runtime.policy_version == command.version and not command.weights_uri:
                # Already serving it (an abort re-applying the current version, a trainer that
                # pushed the weights through LoadWeights first): nothing to reload.
                log.info("policy.already_applied", version=command.version)
            else:
                freed = await asyncio.to_thread(
                    self._runtime.load_weights, command.version, command.weights_uri or None
                )
                log.info("policy.applied", version=command.version, freed_pages=freed)
            # Generation may run again: the weights it would use are the ones just applied (the
            # invariant forbids generating between DRAINED and APPLIED, not after). The
            # coordinator keeps routes away until it commits.
            self._reopen()
            self._ack(pb.PolicyAck.STAGE_APPLIED, command.version)
        else:
            self._reopen()

    def _reopen(self) -> None:
        self._runtime.set_aborting(False)
        self.gate.open()

    def _ack(self, stage: pb.PolicyAck.Stage, version: int) -> None:
        log.info("policy.acked", stage=pb.PolicyAck.Stage.Name(stage), version=version)
        ack = pb.PolicyAck(stage=stage, version=version)
        if not self._send(pb.SyncRequest(policy_ack=ack)):
            log.warning("policy.ack_not_sent", stage=int(stage), version=version,
                        reason="no Sync stream")
