"""A scripted worker for tests and benches: the Sync protocol's messages as
``worker.sync.sync_client``
and ``worker.sync.event_log`` build them (Register, hello, inventory chunks), sent one step at a
time
under the caller's control, holding the pages it is told to hold. It owns no KV memory; tests and
benches use it to drive a real coordinator exactly as a worker would, including the protocol
violations a real worker never commits (forced sequence numbers). Workers that keep themselves in
sync (the agent, the bridge) use ``SyncClient`` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import grpc

from coordinator.client.channels import call_metadata
from coordinator.core.hashing import HashConfig, Namespace, PageHasher
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from worker.sync.coordinator_channels import on_port
from worker.sync.event_log import inventory_chunks
from worker.sync.sync_protocol import WorkerIdentity, hello_request, register_request


class ScriptedWorker:
    """One worker identity with one Sync stream. ``held`` mirrors what it told the coordinator;
    with ``auto_resync`` it answers resync requests with that inventory by itself."""

    def __init__(
        self, target: str, worker_id: str, *, hash_config: HashConfig,
        address: str | None = None, total_pages: int = 4096, model: str = "",
        policy_version: int = 0, auto_resync: bool = True, token: str | None = None,
        external: bool = False, http_url: str = "", host_pages: int = 0,
    ) -> None:
        self.target = target
        self.worker_id = worker_id
        self.address = address or f"{worker_id}.local:7000"
        self.hash_config = hash_config
        self.hasher = PageHasher(hash_config)
        self.total_pages = total_pages
        self.host_pages = host_pages
        self.model = model
        self.policy_version = policy_version
        self.external = external
        self.http_url = http_url
        self.auto_resync = auto_resync
        self.metadata = call_metadata(token)
        self.incarnation = 0
        self.seq = 0
        self.held: set[bytes] = set()
        self.received: asyncio.Queue[pb.SyncResponse | None] = asyncio.Queue()
        self.stream_error: grpc.RpcError | None = None
        self._channel: grpc.aio.Channel | None = None
        self.sync_port = 0  # where Register said to open Sync (0: the same target)
        self._sync_channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None

    def keys(
        self, tokens: Sequence[int], *, version: int | None = None, tenant: str = ""
    ) -> list[bytes]:
        """Page keys as a real worker computes them for a request of ``tenant``."""
        ns = Namespace(
            model=self.model or "default", tenant=tenant,
            policy_version=self.policy_version if version is None else version,
            page_size=self.hash_config.page_size,
        )
        return self.hasher.page_keys(tokens, ns)

    async def register(self) -> pb.RegisterResponse:
        self._channel = self._channel or grpc.aio.insecure_channel(self.target)
        stub = pb_grpc.CoordinatorStub(self._channel)
        identity = WorkerIdentity(worker_id=self.worker_id, address=self.address,
                                  model=self.model, total_pages=self.total_pages,
                                  hash_config=self.hash_config, external=self.external,
                                  http_url=self.http_url, host_pages=self.host_pages)
        response: pb.RegisterResponse = await stub.Register(
            register_request(identity, self.policy_version), metadata=self.metadata)
        self.incarnation = response.incarnation
        self.sync_port = response.sync_port
        self.seq = 0
        self.held.clear()
        return response

    async def connect(self, last_acked_seq: int | None = None) -> pb.SyncResponse:
        """Open the Sync stream with a hello; returns the coordinator's welcome."""
        assert self._channel is not None, "register() first"
        channel = self._channel
        if self.sync_port:  # a sync frontend of the replica
            if self._sync_channel is None:
                self._sync_channel = grpc.aio.insecure_channel(
                    on_port(self.target, self.sync_port))
            channel = self._sync_channel
        self._call = pb_grpc.CoordinatorStub(channel).Sync(metadata=self.metadata)
        self.received = asyncio.Queue()  # nothing from an earlier stream leaks into this one
        self.stream_error = None
        await self._call.write(hello_request(
            self.worker_id, self.incarnation,
            self.seq if last_acked_seq is None else last_acked_seq,
        ))
        self._reader = asyncio.create_task(self._read())
        return await self.next_message()

    async def start(self) -> None:
        await self.register()
        await self.connect()

    async def _read(self) -> None:
        assert self._call is not None
        try:
            async for message in self._call:
                if message.WhichOneof("body") == "resync" and self.auto_resync:
                    await self.send_inventory(message.resync.resync_id)
                    continue
                await self.received.put(message)
        except grpc.RpcError as exc:
            self.stream_error = exc
        except asyncio.CancelledError:
            return
        await self.received.put(None)  # the stream ended

    async def next_message(self, timeout: float = 5.0) -> pb.SyncResponse:
        """The next coordinator message; raises the stream's error once it has ended."""
        message = await asyncio.wait_for(self.received.get(), timeout)
        if message is None:
            await self.received.put(None)  # keep reporting the end to later callers
            if self.stream_error is not None:
                raise self.stream_error
            raise EOFError("the coordinator closed the Sync stream")
        return message

    @property
    def streaming(self) -> bool:
        """The Sync stream is open (connected and not closed by either side)."""
        return self._call is not None and self.stream_error is None

    async def send(self, request: pb.SyncRequest) -> None:
        assert self._call is not None, "connect() first"
        await self._call.write(request)

    async def send_events(
        self, events: Sequence[pb.PageEvent], *, seq: int | None = None
    ) -> int:
        """Send one batch (next sequence number unless ``seq`` forces one); returns its seq."""
        if seq is None:
            self.seq += 1
            seq = self.seq
        await self.send(pb.SyncRequest(events=pb.EventBatch(seq=seq, events=list(events))))
        return seq

    async def store(
        self, keys: Sequence[bytes], tier: pb.Tier = pb.TIER_GPU
    ) -> pb.SyncResponse:
        """Report pages stored and wait for the coordinator's ack."""
        self.held.update(keys)
        event = pb.PageEvent(kind=pb.PageEvent.KIND_STORED, page_keys=b"".join(keys), tier=tier)
        await self.send_events([event])
        return await self.next_message()

    async def remove(self, keys: Sequence[bytes]) -> pb.SyncResponse:
        self.held.difference_update(keys)
        event = pb.PageEvent(kind=pb.PageEvent.KIND_REMOVED, page_keys=b"".join(keys))
        await self.send_events([event])
        return await self.next_message()

    async def heartbeat(self, **load: int) -> None:
        load.setdefault("total_pages", self.total_pages)
        load.setdefault("free_pages", self.total_pages - len(self.held))
        await self.send(pb.SyncRequest(heartbeat=pb.Heartbeat(
            policy_version=self.policy_version, **load
        )))

    async def send_inventory(self, resync_id: int, chunk_pages: int = 4096) -> None:
        """Stream ``held`` as the full inventory in chunks; the last chunk carries ``seq``."""
        for chunk in inventory_chunks({pb.TIER_GPU: sorted(self.held)}, resync_id=resync_id,
                                      seq=self.seq, keys_per_message=chunk_pages):
            await self.send(pb.SyncRequest(inventory=chunk))

    async def disconnect(self) -> None:
        """Close the stream (half-close, then cancel), keeping the channel and registration."""
        if self._call is not None:
            with contextlib.suppress(Exception):
                await self._call.done_writing()
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._call = None

    async def move_to(self, target: str) -> None:
        """Close the stream and channel and dial ``target`` (another coordinator replica),
        keeping the registration and sequence numbers: ``connect()`` next to resume there."""
        await self.close()
        self.target = target
        self.sync_port = 0  # what this replica's Register said; the new one said nothing
        self._channel = grpc.aio.insecure_channel(target)

    async def close(self) -> None:
        await self.disconnect()
        if self._sync_channel is not None:
            await self._sync_channel.close()
            self._sync_channel = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
