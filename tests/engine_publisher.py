"""A stand-in for an engine's KV-event publisher, writing the wire bytes by hand.

vLLM and SGLang publish KV-cache events on a ZMQ PUB socket as ``[topic, seq, payload]`` and
answer replay requests on a ROUTER socket (docs/PROTOCOL.md §8). ``EnginePublisher`` plays that
part in the bridge tests. Nothing here imports an engine: each payload is
``msgspec.msgpack.encode`` of plain lists, maps, ints, bytes and strings laid out as the format
says, so the tests pin the format itself rather than whatever an engine class happens to emit.

What it can send:

- batches ``[ts, [event, ...], dp_rank]`` (or ``[ts, [event, ...]]``, vLLM before the rank was
  added) with events in one of three ``Encoding``s: tagged arrays as older vLLM sends them,
  tagged arrays as SGLang sends them, tagged maps as current vLLM sends them;
- events with fields left out (``omit=True``: the shortest form a consumer must accept) or with
  fields a newer release added (``extra``), int or bytes hashes, LoRA, any medium;
- raw frames and raw payloads (garbage);
- a batch that is recorded for replay but never delivered (``deliver=False``): the live stream
  then shows a gap, exactly as when the PUB socket drops a message.

The PUB side is an XPUB socket (the same wire for subscribers), so ``wait_subscribed`` can await
the subscriber's SUBSCRIBE message instead of sleeping through ZMQ's slow-joiner window. Replay
requests are served on a background thread in either ``ReplayStyle``; every request is recorded.
"""

from __future__ import annotations

import asyncio
import enum
import struct
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

SEQ = struct.Struct(">q")  # 8 bytes, big endian, signed: the end marker is -1
END = SEQ.pack(-1)
TOPIC = b"kv-events"
BASE_TS = 1_767_225_600.0  # batch timestamps: BASE_TS + seq (any float will do)

EngineHash = int | bytes


class Encoding(enum.Enum):
    """How one event is laid out inside a batch."""

    VLLM_ARRAY = "vllm-array"  # vLLM before PR #42892: a positional array tagged by class name
    SGLANG_ARRAY = "sglang-array"  # SGLang before PR #37482: the same, SGLang's field list
    VLLM_MAP = "vllm-map"  # vLLM after PR #42892: a map with "type" and named fields


class ReplayStyle(enum.Enum):
    """How the ROUTER answers ``[identity, b"", start_seq]`` (the DEALER drops the identity)."""

    CURRENT = "current"  # vLLM with PR #45177: [b"", topic, seq, payload], end [b"", b"", END, b""]
    LEGACY = "legacy"  # older vLLM and SGLang: [b"", seq, payload], end [b"", END, b""]


@dataclass(frozen=True, slots=True)
class Stored:
    """A BlockStored event: ``tokens`` are the tokens of all ``hashes``' blocks, in order."""

    hashes: Sequence[EngineHash]
    parent: EngineHash | None
    tokens: Sequence[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = "GPU"
    extra: Mapping[str, Any] = field(default_factory=dict)  # fields of newer releases
    omit: bool = False  # the shortest form: every field that may be missing is missing


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: Sequence[EngineHash]
    medium: str | None = "GPU"
    extra: Mapping[str, Any] = field(default_factory=dict)
    omit: bool = False


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def encode_event(event: Event, encoding: Encoding) -> list[Any] | dict[str, Any]:
    """One event as the plain value msgpack encodes (docs/PROTOCOL.md §8 gives the layouts)."""
    if isinstance(event, Cleared):
        return {"type": "AllBlocksCleared"} if encoding is Encoding.VLLM_MAP else [
            "AllBlocksCleared"]
    hashes = list(event.hashes)
    if isinstance(event, Removed):
        if encoding is Encoding.VLLM_MAP:
            removed: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes}
            return removed if event.omit else {**removed, "medium": event.medium, **event.extra}
        short = ["BlockRemoved", hashes]
        return short if event.omit else [*short, event.medium, *event.extra.values()]
    tokens = list(event.tokens)
    if encoding is Encoding.VLLM_MAP:
        stored: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes,
                                  "token_ids": tokens, "block_size": event.block_size}
        if event.omit:  # a missing key reads as its default (None)
            return stored if event.parent is None else {**stored,
                                                        "parent_block_hash": event.parent}
        # Field order as vLLM declares them; a consumer must not depend on it.
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": event.parent,
                "token_ids": tokens, "block_size": event.block_size, "lora_id": event.lora_id,
                "medium": event.medium, "lora_name": event.lora_name, **event.extra}
    head = ["BlockStored", hashes, event.parent, tokens, event.block_size]
    if event.omit:
        return head
    if encoding is Encoding.SGLANG_ARRAY:
        if event.lora_name is not None:
            raise ValueError("SGLang's array encoding has no lora_name field")
        return [*head, event.lora_id, event.medium, *event.extra.values()]
    return [*head, event.lora_id, event.medium, event.lora_name, *event.extra.values()]


def encode_batch(events: Sequence[Event], encoding: Encoding, *, ts: float = BASE_TS,
                 dp_rank: int | None = 0) -> bytes:
    """``[ts, [events...], dp_rank]``; with ``dp_rank=None`` the rank is left out."""
    body = [encode_event(event, encoding) for event in events]
    return msgspec.msgpack.encode([ts, body] if dp_rank is None else [ts, body, dp_rank])


class EnginePublisher:
    """An engine's PUB socket (and ROUTER socket unless ``replay`` is None) on 127.0.0.1.

    Every batch gets the next sequence number, from 0, and is kept (the last ``buffer_steps``)
    for replay. ``replay_requests`` lists the start sequence numbers asked for, in order;
    ``bad_replay_requests`` the requests that were not ``[identity, b"", 8-byte seq]`` (they get
    no answer, as in vLLM). ``close()`` (or ``restart()``) must be called by the test.
    """

    def __init__(self, *, encoding: Encoding = Encoding.VLLM_MAP,
                 replay: ReplayStyle | None = ReplayStyle.CURRENT, topic: bytes = TOPIC,
                 buffer_steps: int = 10_000) -> None:
        self.encoding = encoding
        self.replay_style = replay
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.replay_requests: list[int] = []
        self.bad_replay_requests: list[list[bytes]] = []
        self._pub_port = 0
        self._router_port = 0
        self._open()

    # ------------------------------------------------------------------ sockets

    def _open(self) -> None:
        self.next_seq = 0
        self._history: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub_port = _bind(self._pub, self._pub_port)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.replay_style is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self._router_port = _bind(router, self._router_port)
            self._thread = threading.Thread(target=self._serve_replay, args=(router,),
                                            name="engine-replay", daemon=True)
            self._thread.start()

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self._pub_port}"

    @property
    def replay(self) -> str | None:
        return f"tcp://127.0.0.1:{self._router_port}" if self.replay_style is not None else None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pub.close(linger=0)
        self._ctx.term()  # returns once every socket is closed: the ports are free again

    def restart(self) -> None:
        """The engine process restarted: same ports, sequence numbers from 0, empty buffer."""
        self.close()
        self._open()

    async def wait_subscribed(self, timeout: float = 5.0) -> None:
        """Until a subscriber's SUBSCRIBE reaches this socket (after ``connect``, the subscriber
        receives nothing published before this)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise AssertionError(f"no subscriber on {self.events} after {timeout}s")
            ready = await asyncio.to_thread(self._pub.poll, int(min(left, 0.2) * 1000))
            if ready and self._pub.recv().startswith(b"\x01"):  # \x00 would be UNSUBSCRIBE
                return

    # ------------------------------------------------------------------ publishing

    def publish(self, *events: Event, encoding: Encoding | None = None,
                dp_rank: int | None = 0, deliver: bool = True) -> int:
        """One batch of ``events``; returns its sequence number."""
        seq = self.next_seq
        payload = encode_batch(events, encoding or self.encoding, ts=BASE_TS + seq,
                               dp_rank=dp_rank)
        return self.publish_payload(payload, deliver=deliver)

    def publish_payload(self, payload: bytes, *, deliver: bool = True) -> int:
        """Any payload bytes under the next sequence number, kept for replay; sent unless
        ``deliver`` is False (then the live stream shows a gap there)."""
        seq = self.next_seq
        self.next_seq += 1
        with self._lock:
            self._history.append((seq, payload))
        if deliver:
            self._pub.send_multipart([self.topic, SEQ.pack(seq), payload])
        return seq

    def send_frames(self, frames: Sequence[bytes]) -> None:
        """Raw frames, sent as they are: no sequence number is used, nothing is kept."""
        self._pub.send_multipart(list(frames))

    # ------------------------------------------------------------------ replay

    def _serve_replay(self, router: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if router.poll(50):
                    self._answer(router, router.recv_multipart())
        finally:
            router.close(linger=0)

    def _answer(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.bad_replay_requests.append(frames)
            return
        identity, start = frames[0], SEQ.unpack(frames[2])[0]
        self.replay_requests.append(start)
        with self._lock:
            wanted = [(seq, payload) for seq, payload in self._history if seq >= start]
        for seq, payload in wanted:
            if self.replay_style is ReplayStyle.CURRENT:
                router.send_multipart([identity, b"", self.topic, SEQ.pack(seq), payload])
            else:
                router.send_multipart([identity, b"", SEQ.pack(seq), payload])
        if self.replay_style is ReplayStyle.CURRENT:
            router.send_multipart([identity, b"", b"", END, b""])
        else:
            router.send_multipart([identity, b"", END, b""])


def _bind(socket: zmq.Socket[bytes], port: int) -> int:
    """Bind on 127.0.0.1 (``port`` 0: any free one); the bound port."""
    if port:
        socket.bind(f"tcp://127.0.0.1:{port}")
        return port
    socket.bind("tcp://127.0.0.1:*")
    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return int(endpoint.rsplit(b":", 1)[1])
