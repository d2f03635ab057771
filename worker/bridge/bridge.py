"""``kvcoord bridge vllm|sglang``: an unmodified engine's KV-cache events, as a coordinator worker.

The bridge subscribes to the engine's ZMQ publisher (frames ``[topic, seq, payload]``), turns
each batch into page events (``BlockMap``) and sends them on its own Sync stream, registered as
an *external* worker: it stays out of policy barriers and serves the ``policy_version`` it is
given. Engine sequence numbers are checked: a gap, or a first number above 0, is filled by the
engine's replay socket (``[b"", start_seq]`` to a DEALER; replies in either the current vLLM or
the older vLLM/SGLang form, up to the end marker seq -1). Without replay, or when it fails, the
bridge asks the coordinator to drop everything the worker holds and rebuilds from the events
that follow. Bad input is counted by kind (``malformed``), logged once per kind and skipped: the
bridge never stops on it. Its calls to the coordinator carry a bearer ``token`` and use ``tls``
when given.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
import zmq
import zmq.asyncio

from coordinator.client.channels import ClientTls, client_channel_options, open_aio_channel
from coordinator.client.targets import Targets
from coordinator.core.hashing import DEV_HASH_KEY, HashConfig, PageHasher
from coordinator.core.index import Tier
from coordinator.core.page_events import PageEvent
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.wire import PROTOCOL_VERSION
from worker.bridge.block_map import BlockMap
from worker.bridge.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedInput,
    decode_payload,
)

log = structlog.get_logger(__name__)

_SEQ = struct.Struct(">q")
END_SEQ = -1
_KIND_PB = {"stored": pb.PageEvent.KIND_STORED, "removed": pb.PageEvent.KIND_REMOVED,
            "cleared": pb.PageEvent.KIND_CLEARED}
_TIER_PB = {Tier.GPU: pb.TIER_GPU, Tier.CPU: pb.TIER_CPU, Tier.DISK: pb.TIER_DISK}
# Routes issued to the engine are never reported finished (it cannot tell us): each heartbeat
# settles them all, so the coordinator's in-flight count covers one heartbeat period.
_SETTLE_ALL = 1 << 30
_REPLAY_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class BridgeConfig:
    events: str
    coordinator: str
    worker_id: str
    worker_address: str
    model: str = "default"
    page_size: int = 16
    engine_block_size: int | None = None
    replay: str | None = None
    policy_version: int = 0
    hash_key: str | None = None
    heartbeat_ms: int | None = None
    engine: str = "vllm"

    def __post_init__(self) -> None:
        block = self.engine_block_size or self.page_size
        if self.page_size <= 0 or block <= 0:
            raise ValueError("page size and engine block size must be > 0")
        if block % self.page_size:
            raise ValueError(f"engine block size {block} is not a multiple of the page size "
                             f"{self.page_size}")
        if ":" not in self.worker_address:
            raise ValueError(f"--worker-address must be HOST:PORT, got {self.worker_address!r}")
        if not self.worker_id:
            raise ValueError("--worker-id is required")
        for name, endpoint in (("--events", self.events), ("--replay", self.replay)):
            if endpoint is not None and "://" not in endpoint:
                raise ValueError(f"{name} must be a ZMQ endpoint such as tcp://HOST:PORT, got "
                                 f"{endpoint!r}")

    def hash_config(self) -> HashConfig:
        if self.hash_key is None:
            return HashConfig(key=DEV_HASH_KEY, page_size=self.page_size)
        return HashConfig.from_hex_key(self.hash_key, page_size=self.page_size)


class Bridge:
    """One engine's events -> one external worker of the coordinator. ``token``: bearer token
    sent on every call to the coordinator; ``tls``: TLS to it (plaintext when None)."""

    def __init__(
        self, config: BridgeConfig, *, token: str | None = None, tls: ClientTls | None = None
    ) -> None:
        self.config = config
        self._token = token
        self._tls = tls
        self._hash = config.hash_config()
        self.blocks = BlockMap(PageHasher(self._hash), model=config.model,
                               policy_version=config.policy_version, page_size=config.page_size)
        self.malformed: dict[str, int] = {}
        self.applied: dict[str, int] = {"stored": 0, "removed": 0, "cleared": 0}
        self.last_seq = -1
        self.replays = 0
        self.rebuilds = 0
        self.incarnation = 0
        self.synced = asyncio.Event()
        self._targets = Targets.parse(config.coordinator)
        # Sockets and channels are opened by start(): a Bridge built and never started (its
        # metrics collector, a test) holds nothing that needs a loop or a clean-up.
        self._zmq: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._channels: list[grpc.aio.Channel] = []
        self._target = 0
        self._call: grpc.aio.StreamStreamCall | None = None
        self._seq = 0  # our sequence numbers on the Sync stream
        self._heartbeat_s = (config.heartbeat_ms or 1000) / 1000
        self._tasks: list[asyncio.Task[None]] = []
        self._reader: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Subscribe, register, open the Sync stream; then follow the engine in the background."""
        self._zmq = zmq.asyncio.Context()
        self._sub = self._zmq.socket(zmq.SUB)
        options = client_channel_options(16 << 20)
        self._channels = [open_aio_channel(t, options, self._tls, token=self._token)
                          for t in self._targets]
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(self.config.events)
        await self._connect()
        self._tasks = [asyncio.create_task(self._follow_engine(), name="bridge-engine"),
                       asyncio.create_task(self._heartbeats(), name="bridge-heartbeat")]
        log.info("bridge.started", worker=self.config.worker_id, engine=self.config.engine,
                 events=self.config.events, replay=self.config.replay)

    async def stop(self) -> None:
        tasks = [*self._tasks, *([self._reader] if self._reader is not None else [])]
        self._call, call = None, self._call  # the reader must not reconnect
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        self._tasks, self._reader = [], None
        if call is not None:
            call.cancel()
        with contextlib.suppress(grpc.RpcError):
            if self.incarnation:
                await self._stub().Deregister(pb.DeregisterRequest(
                    protocol_version=PROTOCOL_VERSION, worker_id=self.config.worker_id,
                    incarnation=self.incarnation), timeout=2.0)
        for channel in self._channels:
            await channel.close()
        self._channels = []
        if self._sub is not None:
            self._sub.close(linger=0)
        if self._zmq is not None:
            self._zmq.term()
        self._sub = self._zmq = None

    # ------------------------------------------------------------------ the coordinator side

    def _stub(self) -> pb_grpc.CoordinatorStub:
        return pb_grpc.CoordinatorStub(self._channels[self._target])

    async def _connect(self) -> None:
        """Register (a new incarnation: the coordinator starts from nothing) and send what we
        hold; on failure try the next target, with backoff."""
        cfg, attempt = self.config, 0
        while True:
            try:
                response = await self._stub().Register(pb.RegisterRequest(
                    protocol_version=PROTOCOL_VERSION, worker_id=cfg.worker_id,
                    address=cfg.worker_address, total_pages=1 << 20,
                    policy_version=cfg.policy_version, external=True, model=cfg.model,
                    hash_config=pb.HashConfig(algorithm=self._hash.algorithm.value,
                                              page_size=self._hash.page_size,
                                              fingerprint=self._hash.fingerprint()),
                ), timeout=5.0)
                self.incarnation = response.incarnation
                if cfg.heartbeat_ms is None and response.heartbeat_ms:
                    self._heartbeat_s = response.heartbeat_ms / 1000
                call = self._stub().Sync()
                hello = pb.SyncHello(worker_id=cfg.worker_id, incarnation=self.incarnation,
                                     last_acked_seq=0)
                await call.write(pb.SyncRequest(protocol_version=PROTOCOL_VERSION, hello=hello))
                welcome = await call.read()
                if welcome is grpc.aio.EOF or welcome.WhichOneof("body") != "welcome":
                    raise ConnectionError("no welcome on the Sync stream")
                self._call, self._seq = call, welcome.welcome.next_seq - 1
                self._reader = asyncio.create_task(self._read_coordinator(call))
                inventory = self.blocks.inventory()
                if inventory:
                    await self._send([PageEvent("stored", tuple(keys), tier)
                                      for tier, keys in inventory.items()])
                self.synced.set()
                log.info("bridge.registered", worker=cfg.worker_id,
                         incarnation=self.incarnation, blocks=len(self.blocks))
                return
            except (grpc.RpcError, ConnectionError) as exc:
                attempt += 1
                self._target = (self._target + 1) % len(self._channels)
                log.warning("bridge.register_failed", worker=cfg.worker_id, error=str(exc)[:200])
                await asyncio.sleep(min(5.0, 0.1 * 2 ** min(attempt, 6)))

    async def _read_coordinator(self, call: grpc.aio.StreamStreamCall) -> None:
        """Answer resync requests with our inventory; reconnect when the stream ends."""
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    break
                if message.WhichOneof("body") == "resync":
                    await self._send_inventory(message.resync.resync_id)
        except grpc.RpcError as exc:
            log.warning("bridge.stream_ended", code=exc.code().name, details=exc.details())
        if call is self._call:  # not stopping: come back under a new incarnation
            self.synced.clear()
            self._call = None
            await self._connect()

    async def _send_inventory(self, resync_id: int) -> None:
        assert self._call is not None
        inventory = list(self.blocks.inventory().items()) or [(Tier.GPU, [])]
        for i, (tier, keys) in enumerate(inventory):
            await self._call.write(pb.SyncRequest(protocol_version=PROTOCOL_VERSION,
                                                  inventory=pb.InventoryChunk(
                resync_id=resync_id, page_keys=b"".join(keys), tier=_TIER_PB[tier],
                last=i == len(inventory) - 1, seq=self._seq)))

    async def _send(self, events: Sequence[PageEvent]) -> None:
        if not events:
            return
        if self._call is None:
            return  # the inventory sent at the next registration carries it
        self._seq += 1
        batch = pb.EventBatch(seq=self._seq, events=[
            pb.PageEvent(kind=_KIND_PB[e.kind], page_keys=b"".join(e.keys), tier=_TIER_PB[e.tier])
            for e in events])
        try:
            await self._call.write(pb.SyncRequest(protocol_version=PROTOCOL_VERSION,
                                                  events=batch))
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            log.warning("bridge.send_failed", error=str(exc)[:200])

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            call = self._call
            if call is None:
                continue
            with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
                await call.write(pb.SyncRequest(protocol_version=PROTOCOL_VERSION,
                                                heartbeat=pb.Heartbeat(
                    completed_routes=_SETTLE_ALL, policy_version=self.config.policy_version)))

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
        await self._send([PageEvent("cleared", ())])
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
                    self.blocks.clear()
                    out = [PageEvent("cleared", ())]
                    self.applied["cleared"] += 1
            except MalformedInput as exc:
                self._skip(exc.kind, str(exc))
        await self._send(out)

    def _skip(self, kind: str, message: str) -> None:
        count = self.malformed[kind] = self.malformed.get(kind, 0) + 1
        if count == 1:  # once per kind: a flood of bad frames must not flood the logs
            log.warning("bridge.malformed", kind=kind, detail=message[:300])


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
