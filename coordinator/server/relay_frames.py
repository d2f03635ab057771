"""The framing between a replica and its sync frontend processes (``server.sync_relay``,
``server.sync_frontend``): one Unix socket each, carrying frames of relay messages.

A frame is a 4-byte little-endian length, then a pickled list of messages (tuples whose first
item names the kind). Both sides write through a ``FrameWriter``, which gathers every message
queued in one turn of the event loop into one frame: at a thousand streams a frame carries
dozens of messages, and each costs one pickle item instead of a system call and a wakeup.
Pickle is safe here only because both ends are the same program, started by the replica, on a
socket pair no one else holds.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import AsyncIterator
from typing import Any

_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30
"""A length past this is a broken peer, not a frame."""

# Message kinds, frontend -> replica.
OPEN = "open"          # (OPEN, stream, identity): a worker opened a Sync stream
REQUEST = "req"        # (REQUEST, stream, raw SyncRequest bytes)
HALF_CLOSE = "eof"     # (HALF_CLOSE, stream): the worker finished sending
GONE = "gone"          # (GONE, stream): the call ended on the worker's side (cancelled)
READY = "ready"        # (READY, port): the frontend serves on this port
# Message kinds, replica -> frontend.
RESPONSE = "resp"      # (RESPONSE, stream, raw SyncResponse bytes)
DONE = "done"          # (DONE, stream): end the call with OK
FAILED = "fail"        # (FAILED, stream, status name, details, rich status bytes or None)
CREDIT = "credit"      # (CREDIT, stream, n): the replica consumed n more requests


LINGER_S = 0.005
"""Frames go at most once per this interval; a message after a quieter spell goes at once. A
frame's fixed cost (a system call and a wakeup on each side, a pickle) is most of a small
one's: sent at once, frames carried one or two messages each, and the replica spent twice the
CPU per event batch that it does on frames gathered over 5 ms (``kvcoord bench fleet``, 1,024
workers). An idle stream pays nothing: a hello waiting 5 ms each way made 1,024 workers
starting one after another take longer than a lease."""


class FrameWriter:
    """Queue messages; one frame carries every message queued since the last, and frames go
    at most once per ``linger_s`` (0: once per turn of the event loop)."""

    def __init__(self, writer: asyncio.StreamWriter, linger_s: float = LINGER_S) -> None:
        self._writer = writer
        self._pending: list[tuple[Any, ...]] = []
        self._scheduled = False
        self._linger_s = linger_s
        self._last_flush = 0.0

    def send(self, message: tuple[Any, ...]) -> None:
        self._pending.append(message)
        if not self._scheduled:
            self._scheduled = True
            loop = asyncio.get_running_loop()
            wait = self._last_flush + self._linger_s - loop.time()
            if wait > 0:
                loop.call_later(wait, self._flush)
            else:
                loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        self._last_flush = asyncio.get_running_loop().time()
        if not self._pending or self._writer.is_closing():
            self._pending.clear()
            return
        body = pickle.dumps(self._pending, protocol=pickle.HIGHEST_PROTOCOL)
        self._pending = []
        self._writer.write(_LENGTH.pack(len(body)) + body)

    def close(self) -> None:
        self._writer.close()


async def read_frames(reader: asyncio.StreamReader) -> AsyncIterator[list[tuple[Any, ...]]]:
    """Each frame's messages until the peer closes the socket."""
    while True:
        try:
            header = await reader.readexactly(_LENGTH.size)
        except asyncio.IncompleteReadError:
            return
        (length,) = _LENGTH.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"relay frame of {length} bytes: the peer is broken")
        try:
            body = await reader.readexactly(length)
        except asyncio.IncompleteReadError:
            return
        messages: list[tuple[Any, ...]] = pickle.loads(body)
        yield messages
