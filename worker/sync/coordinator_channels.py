"""``CoordinatorChannels``: a worker's gRPC channels to its coordinator targets, and to the
sync frontend its registration named.

One channel per target, opened at once; the one in use moves on when it is unreachable
(``next_target``). A replica may terminate Sync streams in frontend processes of its own
(``RegisterResponse.sync_port``, ``coordinator.server.sync_frontend``): the stream then opens on
that port of the host in use, over a channel kept until the port changes or the client stops.
"""

from __future__ import annotations

from typing import Any

import grpc

from coordinator.client.channels import channel_options, open_aio_channel
from coordinator.client.targets import Targets
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from worker.sync.sync_protocol import SyncSettings


def on_port(target: str, port: int) -> str:
    """``target`` (``host:port`` or a gRPC name ending in one) with its port replaced."""
    host, sep, _ = target.rpartition(":")
    if not sep:
        raise ValueError(f"target {target!r} names no port to replace")
    return f"{host}:{port}"


class CoordinatorChannels:
    def __init__(self, targets: Targets, options: list[tuple[str, Any]], tls: Any,
                 token: str | None) -> None:
        self._targets = targets
        self._options = options
        self._tls = tls
        self._token = token
        self._channels: list[grpc.aio.Channel] = []
        self._target = 0  # index of the target in use
        self._sync: tuple[str, grpc.aio.Channel] | None = None  # (target, channel)

    @classmethod
    def from_settings(cls, settings: SyncSettings) -> CoordinatorChannels:
        """Channels to ``settings.targets``, reconnecting with its backoff (not open yet)."""
        options = [
            *channel_options(settings.max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", settings.backoff_initial_ms),
            ("grpc.min_reconnect_backoff_ms", settings.backoff_initial_ms),
            ("grpc.max_reconnect_backoff_ms", settings.backoff_max_ms),
        ]
        # The token goes on through an interceptor: other clients of the worker (the rollout
        # reporter) call through these channels too, with stubs they build themselves.
        return cls(Targets.parse(settings.targets), options, settings.tls, settings.token)

    def open(self) -> None:
        self._channels = [self._open(t) for t in self._targets]

    def _open(self, target: str) -> grpc.aio.Channel:
        return open_aio_channel(target, self._options, self._tls, token=self._token)

    @property
    def is_open(self) -> bool:
        return bool(self._channels)

    def next_target(self) -> None:
        """Use the next target from now on (this one is unreachable)."""
        self._target = (self._target + 1) % len(self._channels)

    def stub(self) -> pb_grpc.CoordinatorStub:
        """A stub on the target in use."""
        return pb_grpc.CoordinatorStub(self._channels[self._target])

    async def sync_stub(self, sync_port: int) -> pb_grpc.CoordinatorStub:
        """A stub for the Sync stream: on the target in use, or with ``sync_port`` set, on
        that port of its host."""
        if not sync_port:
            return self.stub()
        target = on_port(self._targets[self._target], sync_port)
        if self._sync is None or self._sync[0] != target:
            await self._close_sync()
            self._sync = (target, self._open(target))
        return pb_grpc.CoordinatorStub(self._sync[1])

    async def _close_sync(self) -> None:
        if self._sync is not None:
            await self._sync[1].close()
            self._sync = None

    async def close(self) -> None:
        await self._close_sync()
        for channel in self._channels:
            await channel.close()
        self._channels = []
