"""``kvcoord bridge vllm|sglang``: an unmodified engine's KV-cache events, as a coordinator worker.

The bridge subscribes to the engine's ZMQ publisher (frames ``[topic, seq, payload]``), turns
each batch into page events (``BlockMap``) and sends them through a ``SyncClient``
(``worker.sync.sync_client``: acks, resends, chunked inventories, heartbeats, failover), registered
as a worker. With ``policy_control`` (the CLI's default) it takes part in policy updates through
the engine's own RL endpoints (``worker.bridge.policy_member``) and serves the engine's OpenAI
API through a proxy that tags each answer with the version that made it; without, it is an
*external* worker that stays out of policy barriers and serves the ``policy_version`` it is
given. Engine sequence numbers are checked: a gap, or a first number above 0, is filled by the
engine's replay socket (``[b"", start_seq]`` to a DEALER; replies in either the current vLLM or
the older vLLM/SGLang form, up to the end marker seq -1). Without replay, or when it fails, the
bridge asks the coordinator to drop everything the worker holds and rebuilds from the events
that follow. Bad input is counted by kind (``malformed``), logged at most once a minute per
kind and skipped: the bridge never stops on it. Its calls to the coordinator carry a bearer
``token`` and use ``tls`` when given.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog
import zmq
import zmq.asyncio

from coordinator.client.channels import ClientTls
from coordinator.core.hashing import PageHasher
from coordinator.core.index import PageEvent, WorkerCleared
from coordinator.sync_codec import TIER_TO_PB
from coordinator.v1 import coordinator_pb2 as pb
from worker.bridge.block_map import BlockMap
from worker.bridge.bridge_config import BridgeConfig
from worker.bridge.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedInput,
    decode_payload,
)
from worker.bridge.engine_gauges import EngineGauges
from worker.bridge.policy_member import PolicyMember, engine_control
from worker.sync.event_log import Holdings
from worker.sync.sync_client import SyncClient
from worker.sync.sync_protocol import SyncSettings, WorkerIdentity

__all__ = ["END_SEQ", "Bridge", "BridgeConfig"]

log = structlog.get_logger(__name__)

_SEQ = struct.Struct(">q")
END_SEQ = -1
# Routes issued to the engine are never reported finished (it cannot tell us): each heartbeat
# settles them all, so the coordinator's in-flight count covers one heartbeat period.
_SETTLE_ALL = 1 << 30
_REPLAY_TIMEOUT_S = 2.0
SKIP_LOG_INTERVAL_S = 60.0
"""A kind of skipped input is logged at most once per this interval (a flood of bad events
must not flood the logs); every one is counted."""


class Bridge:
    """One engine's events -> one external worker of the coordinator, through a ``SyncClient``
    (``worker.sync.sync_client``: acks, resends, chunked inventories, heartbeats, failover).
    ``token``: bearer token sent on every call to the coordinator; ``tls``: TLS to it."""

    def __init__(
        self, config: BridgeConfig, *, token: str | None = None, tls: ClientTls | None = None
    ) -> None:
        self.config = config
        hash_config = config.hash_config()
        self.blocks = BlockMap(PageHasher(hash_config), model=config.model,
                               policy_version=config.policy_version, page_size=config.page_size)
        self.malformed: dict[str, int] = {}
        self.clock: Callable[[], float] = time.monotonic  # for the skip log's interval
        self._skip_logged: dict[str, tuple[float, int]] = {}  # kind -> (when, count then)
        self.applied: dict[str, int] = {"stored": 0, "removed": 0, "cleared": 0}
        self.last_seq = -1
        self.replays = 0
        self.rebuilds = 0
        self.engine_clears = 0  # AllBlocksCleared seen on the engine's stream
        self._identity = WorkerIdentity(
            worker_id=config.worker_id, address=config.worker_address, model=config.model,
            total_pages=config.total_pages, hash_config=hash_config,
            external=not config.policy_control,
            http_url=config.proxy_url() if config.policy_control else config.engine_url,
        )
        self._settings = SyncSettings(targets=config.coordinator, heartbeat_ms=config.heartbeat_ms,
                                      event_flush_ms=config.event_flush_ms, token=token, tls=tls)
        self.sync = SyncClient(self._identity, self._settings, self)
        self.member = _policy_member(self, token, tls) if config.policy_control else None
        # Sockets are opened by start(): a Bridge built and never started (its metrics
        # collector, a test) holds nothing that needs a loop or a clean-up.
        self._zmq: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._engine: asyncio.Task[None] | None = None
        # The engine's capacity and requests, read from its /metrics (vLLM's) when the
        # bridge's own /metrics is scraped.
        self.gauges = EngineGauges(f"{config.engine_url}/metrics") \
            if config.engine_url and config.engine == "vllm" else None

    @property
    def incarnation(self) -> int:
        return self.sync.incarnation

    @property
    def synced(self) -> asyncio.Event:
        return self.sync.synced

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Subscribe, register and open the Sync stream (waiting until it is welcomed); then
        follow the engine in the background. Raises ``RegistrationRefused`` when the
        coordinator refuses the registration for good (a hash key or protocol mismatch)."""
        self._zmq = zmq.asyncio.Context()
        self._sub = self._zmq.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(self.config.events)
        self._engine = asyncio.create_task(self._follow_engine(), name="bridge-engine")
        register = True
        if self.member is not None:
            assert self.config.http_listen is not None
            host, _, port = self.config.http_listen.rpartition(":")
            register = await self.member.start(host, int(port))
        else:
            log.warning("bridge.external", worker=self.config.worker_id,
                        detail="--no-policy-control: this engine stays out of policy updates "
                               "and serves only --policy-version")
        if register:
            await self.join_fleet()
        log.info("bridge.started", worker=self.config.worker_id, engine=self.config.engine,
                 events=self.config.events, replay=self.config.replay,
                 incarnation=self.incarnation, policy_control=self.member is not None,
                 version=self.policy_version())

    async def join_fleet(self) -> None:
        """Start the Sync client and wait until it is welcomed; raises ``RegistrationRefused``."""
        self.sync.start()
        synced = asyncio.create_task(self.sync.synced.wait())
        failed = asyncio.create_task(self.sync.failed.wait())
        await asyncio.wait([synced, failed], return_when=asyncio.FIRST_COMPLETED)
        synced.cancel()
        failed.cancel()
        if self.sync.error is not None:
            raise self.sync.error

    async def leave_fleet(self) -> None:
        """Out of the fleet (a fenced engine): the last ack sent, deregistered."""
        await self.sync.sent(2.0)
        await self.sync.stop(deregister=True)
        self.sync = SyncClient(self._identity, self._settings, self, counters=self.sync.counters)

    async def stop(self) -> None:
        if self.member is not None:
            await self.member.stop()
        if self._engine is not None:
            self._engine.cancel()
            await asyncio.wait([self._engine], timeout=2.0)
            self._engine = None
        await self.sync.stop(deregister=True)
        if self._sub is not None:
            self._sub.close(linger=0)
        if self._zmq is not None:
            self._zmq.term()
        self._sub = self._zmq = None

    # ------------------------------------------------------------------ SyncOwner

    def policy_version(self) -> int:
        return self.config.policy_version if self.member is None else self.member.version

    async def holdings(self) -> Holdings:
        """What the engine holds now, by tier (taken on the loop, where the map changes)."""
        return {TIER_TO_PB[tier]: keys for tier, keys in self.blocks.inventory().items()}

    def heartbeat(self) -> pb.Heartbeat:
        running = 0 if self.member is None else self.member.proxy.in_flight
        # NOTE: the engine's free and total pages (self.gauges) are not sent: with them,
        # kv_aware spread a dense stream over both engines and lost 8 points of cached share
        # (engine_gauges says more); they are exported for operators until the rule prices them.
        return pb.Heartbeat(completed_routes=_SETTLE_ALL, running_requests=running)

    async def registered(self, response: pb.RegisterResponse) -> None:
        """Nothing to load here: an external worker serves the version it is given, and a
        policy-controlled one registers only once its engine serves the fleet's version."""

    def command(self, command: pb.PolicyCommand) -> None:
        if self.member is not None:
            self.member.command(command)
            return
        log.warning("bridge.unexpected_command", worker=self.config.worker_id,
                    kind=command.kind, version=command.version)

    def confirm_version(self, version: int) -> None:
        self.blocks.policy_version = version

    def _send(self, events: Sequence[PageEvent]) -> None:
        for event in events:
            self.sync.page_event(event)

    # ------------------------------------------------------------------ the engine side

    async def _follow_engine(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            try:
                seq, payload = _published(frames)
            except MalformedInput as exc:
                self._skip(exc.kind, str(exc))
                continue
            if seq == 0 and self.last_seq >= 0:
                await self._engine_restarted()
            elif seq <= self.last_seq:
                continue  # already applied (a replay overlapped the live stream)
            if seq > self.last_seq + 1:
                await self._fill_gap(seq)
            if seq > self.last_seq:
                await self._apply(seq, payload)

    async def _engine_restarted(self) -> None:
        """Sequence 0 again: a new engine process with an empty cache. What the old one held
        is gone; follow the new stream from here."""
        log.warning("bridge.engine_restarted", worker=self.config.worker_id,
                    last_seq=self.last_seq)
        await self._drop_everything()
        self.last_seq = -1

    async def _drop_everything(self) -> None:
        """Forget every block and have the coordinator drop the worker's entries."""
        self.blocks.clear()
        self._send([WorkerCleared()])
        self.applied["cleared"] += 1

    async def _fill_gap(self, seen: int) -> None:
        """Batches ``last_seq + 1 .. seen - 1`` never arrived: replay them, or rebuild."""
        start = self.last_seq + 1
        log.warning("bridge.gap", expected=start, got=seen)
        if self.config.replay is not None and await self._replay(start, seen):
            self.replays += 1
            return
        self.rebuilds += 1
        await self._drop_everything()
        self.last_seq = seen - 1
        log.warning("bridge.rebuild", worker=self.config.worker_id, from_seq=seen)

    async def _replay(self, start: int, seen: int) -> bool:
        """Ask the engine for ``start`` onwards; True when everything up to ``seen - 1`` came."""
        assert self.config.replay is not None and self._zmq is not None
        dealer = self._zmq.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.config.replay)
            await dealer.send_multipart([b"", _SEQ.pack(start)])
            while True:
                if not await dealer.poll(int(_REPLAY_TIMEOUT_S * 1000)):
                    log.warning("bridge.replay_timeout", start=start)
                    return False
                frames = await dealer.recv_multipart()
                try:
                    seq, payload = _replayed(frames)
                except MalformedInput as exc:
                    self._skip(exc.kind, str(exc))
                    continue
                if seq == END_SEQ:
                    break
                if seq > self.last_seq and (seq == self.last_seq + 1 or self.last_seq < 0):
                    await self._apply(seq, payload)
            return self.last_seq >= seen - 1
        finally:
            dealer.close(linger=0)

    async def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            batch = decode_payload(payload)
        except MalformedInput as exc:
            self._skip(exc.kind, str(exc))
            return
        for kind, message in batch.skipped:
            self._skip(kind, message)
        out: list[PageEvent] = []
        for event in batch.events:
            try:
                if isinstance(event, BlockStored):
                    events, skipped = self.blocks.stored(event)
                    out += events
                    self.applied["stored"] += 1
                    for refused in skipped:
                        self._skip(refused.kind, str(refused))
                elif isinstance(event, BlockRemoved):
                    events, unknown = self.blocks.removed(event)
                    out += events
                    self.applied["removed"] += 1
                    if unknown:
                        self._skip("unknown_block", f"{unknown} removed block(s) never stored")
                elif isinstance(event, AllBlocksCleared):
                    self.engine_clears += 1
                    self.blocks.clear()
                    out = [WorkerCleared()]
                    self.applied["cleared"] += 1
            except MalformedInput as exc:
                self._skip(exc.kind, str(exc))
        self._send(out)

    def _skip(self, kind: str, message: str) -> None:
        """Count one skipped input of ``kind``; log it unless that kind was logged less than
        ``SKIP_LOG_INTERVAL_S`` ago (the line then says how many were skipped since)."""
        count = self.malformed[kind] = self.malformed.get(kind, 0) + 1
        now = self.clock()
        last = self._skip_logged.get(kind)
        if last is None or now - last[0] >= SKIP_LOG_INTERVAL_S:
            self._skip_logged[kind] = (now, count)
            log.warning("bridge.malformed", kind=kind, detail=message[:300], total=count,
                        since_last_line=count - (last[1] if last else 0))


def _policy_member(bridge: Bridge, token: str | None, tls: ClientTls | None) -> PolicyMember:
    config = bridge.config
    return PolicyMember(
        engine_control(config.engine, config.engine_url), worker_id=config.worker_id,
        coordinator=config.coordinator, version=config.policy_version, weights=config.weights,
        weights_root=Path(config.weights_root) if config.weights_root else None,
        recover_interval_s=config.recover_interval_s,
        cleared=lambda: bridge.engine_clears, confirmed=bridge.confirm_version,
        send=lambda request: bridge.sync.send(request), leave=bridge.leave_fleet,
        rejoin=bridge.join_fleet,
        stub=lambda: bridge.sync.stub() if bridge.sync.synced.is_set() else None,
        token=token, tls=tls)


def _published(frames: list[bytes]) -> tuple[int, bytes]:
    """``[topic, seq, payload]`` -> (seq, payload)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise MalformedInput("frame", f"a published message is [topic, seq (8 bytes), payload];"
                                      f" got {len(frames)} frames")
    return _SEQ.unpack(frames[1])[0], frames[2]


def _replayed(frames: list[bytes]) -> tuple[int, bytes]:
    """A replay reply in either form -> (seq, payload); seq END_SEQ ends the replay.

    Current vLLM: ``[b"", topic, seq, payload]``, end ``[b"", b"", END, b""]``; older vLLM
    and SGLang: ``[b"", seq, payload]``, end ``[b"", END, b""]``."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3 and len(frames[1]) == 8:
        return _SEQ.unpack(frames[1])[0], frames[2]
    if len(frames) == 2 and len(frames[0]) == 8:
        return _SEQ.unpack(frames[0])[0], frames[1]
    raise MalformedInput("frame", f"a replay reply is [topic, seq, payload] or [seq, payload];"
                                  f" got {len(frames)} frames")
