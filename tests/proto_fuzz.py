"""Hostile protobuf requests for any gRPC service, a campaign that sends them to running servers
over real gRPC, and the kvcoord fleet (a coordinator and a worker process) it is aimed at.

Strategies: ``payloads(descriptor, kind)`` draws the serialized bytes of one request of hostile
class ``kind`` (a key of ``HOSTILE_CLASSES``). A class is either a ``Profile`` (how each kind of
field is filled while the message is walked from its descriptor) or a wire-level construction
(out-of-range varints, invalid UTF-8, unknown fields, another message's bytes, mutations of a
valid encoding, random bytes), so one generator covers every method of every service. Large
values (tens of KiB of bytes, 100k-element repeated fields) are expanded from a few drawn values
and a seed, never drawn element by element: hypothesis's choice buffer stays small, and even a
14 MiB case is drawn in tens of milliseconds.

Campaign: ``Campaign.run`` sends ``examples`` cases per (class, method) with raw byte
(de)serializers, so the bytes on the wire are exactly the drawn ones, and tallies per class the
status codes returned. Whether a payload is a request at all is decided here, by parsing it as
the request message (``Msg.FromString``). A unary request that does not parse is answered by
grpcio before any of our code runs (1.85's aio server: UNKNOWN "Unexpected <class
'DecodeError'>"): counted apart (``decode_failures``), not as a bug. A client-stream message
that does not parse raises inside our handler, which answers INVALID_ARGUMENT. Any other
INTERNAL or UNKNOWN is a bug. Every server
process must be alive after every case and answer a normal request after every block. RSS is
read before and after each class of the measured pass (the second of two over the same cases:
see ``Campaign``).
"""

from __future__ import annotations

import math
import random
import secrets
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from coordinator.hashing import HashConfig
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from kvcoord.fleet_procs import free_port, spawn, stop_processes, wait_healthy
from worker.v1 import worker_pb2 as wpb

F = FieldDescriptor
Strategy = st.SearchStrategy

# ---------------------------------------------------------------------------------- values

# Edges of each wire type's range, of the narrower ranges a server might cast to (u8, u16, i32),
# and small page/word multiples and their neighbours.
_U32 = (0, 1, 2, 3, 4, 15, 16, 17, 127, 128, 255, 256, 1023, 1024, 1025, 4096, 65535, 65536,
        2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1)
_U64 = (*_U32, 2**32, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1)
_I32 = (-(2**31), -(2**31) + 1, -65536, -1, 0, 1, 16, 2**31 - 2, 2**31 - 1)
_I64 = (*_I32, -(2**63), -(2**63) + 1, -(2**53), 2**53, 2**63 - 1)
INT_BOUNDARIES: dict[int, tuple[int, ...]] = {
    F.TYPE_UINT32: _U32, F.TYPE_FIXED32: _U32, F.TYPE_UINT64: _U64, F.TYPE_FIXED64: _U64,
    F.TYPE_INT32: _I32, F.TYPE_SINT32: _I32, F.TYPE_SFIXED32: _I32,
    F.TYPE_INT64: _I64, F.TYPE_SINT64: _I64, F.TYPE_SFIXED64: _I64,
}
VARINT_TYPES = {*INT_BOUNDARIES} - {F.TYPE_FIXED32, F.TYPE_FIXED64, F.TYPE_SFIXED32,
                                    F.TYPE_SFIXED64} | {F.TYPE_BOOL, F.TYPE_ENUM}
FLOATS = st.one_of(st.sampled_from((0.0, -0.0, math.nan, math.inf, -math.inf, 1e308, 5e-324,
                                    3.5e38)), st.floats())
HOSTILE_STRINGS = (
    "", " ", "\x00", "\x00" * 64, "\r\n\x1b[31m\x07\x7f", "\u202e\u200b\ufeff", "\U0010ffff" * 64,
    "../../../../etc/passwd", "%s%n{0}${x}", "w0", "w0:1", ":", "127.0.0.1:0", "é" * 4096,
    "a" * 70_000,
)
ALIGNED_LENGTHS = (0, 4, 8, 16, 32, 48, 64, 256, 4096, 16_384, 49_152, 65_536)  # x16 (and x4)
OFF_BY_ONE_LENGTHS = (1, 3, 5, 7, 15, 17, 31, 33, 63, 65, 4095, 4097, 65_535, 65_537)
HUGE_COUNTS = (0, 1, 1_000, 10_000, 100_000)
DISTINCT = 4
"""Elements of a repeated field drawn one by one; longer fields repeat them (seeded order)."""
MAX_FIELD_BYTES = 20 * 1024 * 1024
"""Cap on one repeated field's encoding: past a 16 MiB server limit, short of a client OOM."""
SEEDS = st.integers(0, 2**32 - 1)


def _random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def blobs(lengths: Sequence[int]) -> Strategy[bytes]:
    """Random bytes at ``lengths`` (or any small length), content from a drawn seed."""
    return st.builds(_random_bytes, st.sampled_from(lengths) | st.integers(0, 64), SEEDS)


@dataclass(frozen=True, slots=True)
class Profile:
    """How one hostile class fills a message, by kind of field."""

    ints: Callable[[FieldDescriptor], Strategy[int]]
    strings: Strategy[str]
    blobs: Strategy[bytes]
    enums: Callable[[FieldDescriptor], Strategy[int]]
    counts: Strategy[int]
    """Elements in a repeated field."""
    present: Strategy[bool] = field(default_factory=st.booleans)
    """Whether a singular (non-oneof) field is set."""
    floats: Strategy[float] = FLOATS
    max_depth: int = 3
    pinned: Mapping[str, Strategy[Any]] = field(default_factory=dict)
    """Singular scalar fields, by name, drawn from these instead (and always set)."""


def _any_int(f: FieldDescriptor) -> Strategy[int]:
    bounds = INT_BOUNDARIES[f.type]
    return st.sampled_from(bounds) | st.integers(min(bounds), max(bounds))


def _boundary_int(f: FieldDescriptor) -> Strategy[int]:
    return st.sampled_from(INT_BOUNDARIES[f.type])


def _plain_int(f: FieldDescriptor) -> Strategy[int]:
    # Small and ordinary, so that the class under test, not these, decides how far a
    # request gets.
    return st.sampled_from((0, 1, 2, 16))


def _enum_numbers(f: FieldDescriptor) -> list[int]:
    if f.enum_type is None:
        raise TypeError(f"{f.full_name} is not an enum field")
    return [v.number for v in f.enum_type.values]


def _known_enum(f: FieldDescriptor) -> Strategy[int]:
    return st.sampled_from(_enum_numbers(f))


def _unknown_enum(f: FieldDescriptor) -> Strategy[int]:
    top = max(_enum_numbers(f))
    return st.sampled_from((-1, top + 1, 1000, 2**31 - 1, -(2**31))) | _known_enum(f)


PLAIN = Profile(
    ints=_plain_int, strings=st.sampled_from(("", "w0", "default", "fuzz")),
    blobs=blobs((0, 16, 32)), enums=_known_enum, counts=st.integers(0, 3),
    # A version this peer speaks, so the class under test reaches past the version check
    # (random_fields and wire_varints still send every other version).
    pinned={"protocol_version": st.sampled_from((0, 1))},
)
PROFILES: dict[str, Profile] = {
    "random_fields": Profile(
        ints=_any_int, strings=st.sampled_from(HOSTILE_STRINGS) | st.text(max_size=40),
        blobs=blobs((*ALIGNED_LENGTHS, *OFF_BY_ONE_LENGTHS)), enums=_unknown_enum,
        counts=st.integers(0, 6)),
    "empty_fields": Profile(
        ints=lambda f: st.just(0), strings=st.just(""), blobs=st.just(b""),
        enums=lambda f: st.just(0), counts=st.just(0)),
    "boundary_ints": replace(PLAIN, ints=_boundary_int),
    "hostile_strings": replace(PLAIN, strings=st.sampled_from(HOSTILE_STRINGS) | st.text()),
    "wrong_lengths": replace(PLAIN, blobs=blobs(OFF_BY_ONE_LENGTHS)),
    "random_bytes": replace(PLAIN, blobs=blobs(ALIGNED_LENGTHS)),
    "huge_repeated": replace(PLAIN, counts=st.sampled_from(HUGE_COUNTS),
                             blobs=blobs((0, 16, 4096, 65_536)), max_depth=2),
    "unknown_enums": replace(PLAIN, enums=_unknown_enum),
}


# ---------------------------------------------------------------------------------- messages

def messages(descriptor: Descriptor, profile: Profile) -> Strategy[Message]:
    """Instances of ``descriptor``'s message class filled by ``profile``: at most one field per
    oneof, nested messages to ``profile.max_depth``. Map fields are not supported (none here)."""
    return _message(descriptor, profile, 0)


@st.composite
def _message(draw: st.DrawFn, descriptor: Descriptor, profile: Profile, depth: int) -> Message:
    message: Message = GetMessageClass(descriptor)()
    chosen = {draw(st.sampled_from([None, *(f.name for f in o.fields)]))
              for o in descriptor.oneofs}
    for f in descriptor.fields:
        if f.name in profile.pinned and not f.is_repeated:
            setattr(message, f.name, draw(profile.pinned[f.name]))
        elif f.containing_oneof is not None:
            if f.name in chosen:
                _set_singular(draw, message, f, profile, depth)
        elif f.is_repeated:
            _fill_repeated(draw, message, f, profile, depth)
        elif draw(profile.present):
            _set_singular(draw, message, f, profile, depth)
    return message


def _nested(f: FieldDescriptor) -> Descriptor:
    if f.message_type is None:
        raise TypeError(f"{f.full_name} is not a message field")
    return f.message_type


def _scalar(f: FieldDescriptor, profile: Profile) -> Strategy[Any]:
    if f.type in INT_BOUNDARIES:
        return profile.ints(f)
    if f.type == F.TYPE_ENUM:
        return profile.enums(f)
    if f.type == F.TYPE_STRING:
        return profile.strings
    if f.type == F.TYPE_BYTES:
        return profile.blobs
    if f.type == F.TYPE_BOOL:
        return st.booleans()
    if f.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return profile.floats
    raise NotImplementedError(f"{f.full_name}: field type {f.type}")


def _set_singular(draw: st.DrawFn, message: Message, f: FieldDescriptor, profile: Profile,
                  depth: int) -> None:
    if f.type != F.TYPE_MESSAGE:
        setattr(message, f.name, draw(_scalar(f, profile)))
    elif depth >= profile.max_depth:
        getattr(message, f.name).SetInParent()
    else:
        getattr(message, f.name).CopyFrom(draw(_message(_nested(f), profile, depth + 1)))


def _encoded_size(value: Any) -> int:
    if isinstance(value, Message):
        return value.ByteSize()
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, str):
        return len(value.encode())
    return 10  # the longest varint


def _fill_repeated(draw: st.DrawFn, message: Message, f: FieldDescriptor, profile: Profile,
                   depth: int) -> None:
    n = draw(profile.counts)
    if n == 0 or (f.type == F.TYPE_MESSAGE and depth >= profile.max_depth):
        return
    if f.type == F.TYPE_MESSAGE and _nested(f).GetOptions().map_entry:
        raise NotImplementedError(f"{f.full_name}: map fields")
    element = (_message(_nested(f), profile, depth + 1) if f.type == F.TYPE_MESSAGE
               else _scalar(f, profile))
    distinct = [draw(element) for _ in range(min(n, DISTINCT))]
    n = min(n, MAX_FIELD_BYTES // (2 + max(_encoded_size(v) for v in distinct)))
    values = distinct if n <= DISTINCT else random.Random(draw(SEEDS)).choices(distinct, k=n)
    getattr(message, f.name).extend(values)


# ---------------------------------------------------------------------------------- wire level

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _tag(number, 2) + _varint(len(payload)) + payload


# Varints a field of 32 bits (or any field) was not meant to hold: too wide, overlong encodings
# of small values, 11 bytes (past the 10-byte maximum), a truncated one.
ODD_VARINTS = (_varint(2**32), _varint(2**63), _varint(2**64 - 1), b"\x80" * 9 + b"\x00",
               b"\xff" * 9 + b"\x7f", b"\xff" * 10 + b"\x01", b"\x80")
INVALID_UTF8 = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"ok\x80")


@st.composite
def _wire_varints(draw: st.DrawFn, descriptor: Descriptor) -> bytes:
    """A plain message followed by one odd varint for a varint field (packed when repeated)."""
    base = draw(messages(descriptor, PLAIN)).SerializeToString()
    fields = [f for f in descriptor.fields if f.type in VARINT_TYPES]
    f = draw(st.sampled_from(fields)) if fields else None
    number = f.number if f is not None else draw(st.integers(1, 2**29 - 1))
    value = draw(st.sampled_from(ODD_VARINTS))
    if f is not None and f.is_repeated and draw(st.booleans()):
        return base + _length_delimited(number, value)
    return base + _tag(number, 0) + value


def _string_paths(descriptor: Descriptor, depth: int = 3) -> list[tuple[int, ...]]:
    """Field-number paths from ``descriptor`` to each string field, through nested messages."""
    paths: list[tuple[int, ...]] = []
    for f in descriptor.fields:
        if f.type == F.TYPE_STRING:
            paths.append((f.number,))
        elif f.type == F.TYPE_MESSAGE and depth > 1:
            paths += [(f.number, *p) for p in _string_paths(_nested(f), depth - 1)]
    return paths


@st.composite
def _invalid_utf8(draw: st.DrawFn, descriptor: Descriptor) -> bytes:
    """A plain message plus invalid UTF-8 in a string field (nested or not); a message without
    one gets it in an unknown field, which parsers do not validate (it stays decodable)."""
    paths = _string_paths(descriptor)
    path = draw(st.sampled_from(paths)) if paths else (draw(st.integers(1000, 2**29 - 1)),)
    payload = draw(st.sampled_from(INVALID_UTF8))
    for number in reversed(path):
        payload = _length_delimited(number, payload)
    return draw(messages(descriptor, PLAIN)).SerializeToString() + payload


@st.composite
def _unknown_fields(draw: st.DrawFn, descriptor: Descriptor) -> bytes:
    """A plain message plus fields of any number (known ones too) in any wire type: skipped
    unknowns, wrong wire types, groups (balanced or a lone end: undecodable), wire types 6/7."""
    out = draw(messages(descriptor, PLAIN)).SerializeToString()
    known = [f.number for f in descriptor.fields]
    for _ in range(draw(st.integers(1, 3))):
        number = draw(st.sampled_from(known) | st.integers(1, 2**29 - 1))
        wire = draw(st.integers(0, 7))
        body = {0: _varint(draw(st.integers(0, 2**64 - 1))), 1: b"\x01" * 8,
                2: _varint(4) + b"junk", 3: _tag(number, 4), 5: b"\x01" * 4}.get(wire, b"")
        out += _tag(number, wire) + body
    return out


def _truncate(data: bytearray, rng: random.Random) -> None:
    del data[rng.randrange(len(data) + 1):]


def _flip(data: bytearray, rng: random.Random) -> None:
    if data:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)


def _insert(data: bytearray, rng: random.Random) -> None:
    at = rng.randrange(len(data) + 1)
    data[at:at] = rng.randbytes(rng.choice((1, 2, 5, 11)))


def _overlong_length(data: bytearray, rng: random.Random) -> None:
    data += _tag(rng.randrange(1, 16), 2) + _varint(rng.choice((2**31, 2**32 + 5, 2**63)))


MUTATIONS = (_truncate, _flip, _insert, _overlong_length, lambda data, rng: data.extend(data))


@st.composite
def _mutated_wire(draw: st.DrawFn, descriptor: Descriptor) -> bytes:
    """A valid encoding with 1-3 mutations (truncated, bit flips, inserted bytes, a length past
    the end, itself appended: a merge), each at seeded positions."""
    data = bytearray(draw(messages(descriptor, PLAIN)).SerializeToString())
    rng = random.Random(draw(SEEDS))
    for _ in range(draw(st.integers(1, 3))):
        draw(st.sampled_from(MUTATIONS))(data, rng)
    return bytes(data)


def _type_confusion(descriptor: Descriptor) -> Strategy[bytes]:
    """Another message of the same proto file, filled at random, sent as this one."""
    others = [d for d in descriptor.file.message_types_by_name.values() if d is not descriptor]
    return st.sampled_from(others).flatmap(
        lambda d: messages(d, PROFILES["random_fields"])).map(lambda m: m.SerializeToString())


RAW_LENGTHS = (0, 1, 5, 16, 17, 4096, 65_536, 1_048_576)


def _profiled(profile: Profile) -> Callable[[Descriptor], Strategy[bytes]]:
    return lambda d: messages(d, profile).map(lambda m: m.SerializeToString())


HOSTILE_CLASSES: dict[str, Callable[[Descriptor], Strategy[bytes]]] = {
    **{name: _profiled(profile) for name, profile in PROFILES.items()},
    "wire_varints": _wire_varints,
    "invalid_utf8": _invalid_utf8,
    "unknown_fields": _unknown_fields,
    "type_confusion": _type_confusion,
    "mutated_wire": _mutated_wire,
    "raw_bytes": lambda d: st.binary(max_size=64) | blobs(RAW_LENGTHS),
}


def payloads(descriptor: Descriptor, kind: str) -> Strategy[bytes]:
    """Serialized requests for ``descriptor`` of hostile class ``kind``."""
    return HOSTILE_CLASSES[kind](descriptor)


def decodes(descriptor: Descriptor, payload: bytes) -> bool:
    """Whether ``payload`` parses as ``descriptor``'s message (what grpcio's server does first)."""
    try:
        GetMessageClass(descriptor).FromString(payload)
    except DecodeError:
        return False
    return True


# ---------------------------------------------------------------------------------- campaign

Metadata = tuple[tuple[str, str], ...]
SERVER_STREAM_MESSAGES = 1
"""Messages read from a server stream before the client cancels it: the first one shows the
handler ran; a watch never ends by itself."""
BIDI_MESSAGES = 3
"""Most messages sent on one client stream (after the optional well-formed first message)."""
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.max_send_message_length", 64 * 1024 * 1024)]
GRPCIO_DECODE_FAILURE = "Unexpected <class 'google.protobuf.message.DecodeError'>"
"""How grpcio's aio server details a unary request it could not parse (status UNKNOWN)."""
OVERSIZED_DETAILS = "received metadata size exceeds hard limit"


class ServerDied(RuntimeError):
    """A server process exited during the campaign (the message names the case)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One running server under fuzz.

    ``probe`` is a normal request (method name, payload) that must answer OK after every
    block, sent with ``probe_metadata`` (the campaign's credentials may be none or too weak).
    ``first_message`` gives, per bidi-streaming method, a well-formed opening message (e.g. a
    hello); a drawn flag decides whether a case starts with it, so later messages reach the
    code behind the handshake. ``before_block(method)`` restores state between blocks.
    """

    name: str
    target: str
    pid: int
    alive: Callable[[], bool]
    service: ServiceDescriptor
    probe: tuple[str, bytes]
    probe_metadata: Metadata = ()
    first_message: Mapping[str, Callable[[], bytes]] = field(default_factory=dict)
    before_block: Callable[[str], None] = lambda method: None


@dataclass(slots=True)
class Tally:
    """What one hostile class got back, over both passes (RSS: the measured pass)."""

    tried: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    decode_failures: int = 0
    """Bytes that are not a unary request, answered UNKNOWN with grpcio's parse-failure
    details: counted apart from bugs."""
    internal: int = 0
    """Answered INTERNAL: our handler failed (a bug)."""
    unknown: int = 0
    """UNKNOWN not explained by a parse failure: something escaped the error mapping (a bug)."""
    oversized_details: int = 0
    """Refusals whose details (echoing the request) passed the client's 16 KiB metadata
    limit, so the client saw RESOURCE_EXHAUSTED "Stream removed" instead of the status."""
    crashes: int = 0
    rss_growth_mib: dict[str, float] = field(default_factory=dict)
    peak_mib: dict[str, float] = field(default_factory=dict)
    """Peak RSS during the class (VmHWM, reset at its start) minus RSS at its start."""
    failures: list[str] = field(default_factory=list)
    """The first few bug cases: method, status, details and the payload's head."""


@dataclass(slots=True)
class Report:
    """A campaign's result: tallies by class, statuses and seconds by method, RSS by server."""

    classes: dict[str, Tally] = field(default_factory=dict)
    methods: dict[str, Counter[str]] = field(default_factory=dict)
    method_seconds: dict[str, float] = field(default_factory=dict)
    rss_start_mib: dict[str, float] = field(default_factory=dict)
    rss_baseline_mib: dict[str, float] = field(default_factory=dict)
    """After the warm-up pass."""
    rss_after_mib: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def cases(self) -> int:
        return sum(t.tried for t in self.classes.values())

    def total(self, what: str) -> int:
        """The sum of one ``Tally`` counter (``internal``, ``unknown``, ...) over classes."""
        return int(sum(getattr(t, what) for t in self.classes.values()))

    def rss_growth_mib(self) -> dict[str, float]:
        return {name: self.rss_after_mib[name] - self.rss_baseline_mib[name]
                for name in self.rss_after_mib}

    def failures(self) -> list[str]:
        return [f for t in self.classes.values() for f in t.failures]


def _proc_status_mib(pid: int, field_name: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field_name} for pid {pid}")


def rss_mib(pid: int) -> float:
    """Resident set size of process ``pid`` now (VmRSS), MiB."""
    return _proc_status_mib(pid, "VmRSS")


def reset_peak(pid: int) -> bool:
    """Reset ``pid``'s peak RSS (VmHWM) to its current RSS; False where Linux refuses."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@dataclass
class Campaign:
    """Sends hostile cases to ``endpoints``: for each class in ``classes``, ``examples`` cases
    per method of every endpoint's service (fewer where a class's space is smaller).

    The campaign runs twice, on the same derandomized cases: the first pass is the warm-up.
    It reaches every high-water mark those inputs reach (allocator arenas, grpc buffers,
    caches), so RSS growth over the second pass is what the inputs leave behind. Both passes
    count in the tallies; RSS growth and peaks are the second pass's.
    """

    endpoints: Sequence[Endpoint]
    examples: int
    classes: Sequence[str] = tuple(HOSTILE_CLASSES)
    metadata: Metadata = ()
    deadline_s: float = 2.0
    stream_deadline_s: float = 0.25
    warmup: bool = True
    report: Report = field(default_factory=Report)
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def run(self) -> Report:
        started = time.perf_counter()
        self._channels = {e.name: grpc.insecure_channel(e.target, options=CHANNEL_OPTIONS)
                          for e in self.endpoints}
        try:
            self.report.rss_start_mib = self._rss()
            if self.warmup:
                for kind in self.classes:
                    self._pass(kind)
            self.report.rss_baseline_mib = self._rss()
            for kind in self.classes:
                before = self._rss()
                peaks = all([reset_peak(e.pid) for e in self.endpoints])  # a list: reset all
                self._pass(kind)
                tally = self.report.classes[kind]
                tally.rss_growth_mib = {n: v - before[n] for n, v in self._rss().items()}
                if peaks:
                    tally.peak_mib = {e.name: _proc_status_mib(e.pid, "VmHWM") - before[e.name]
                                      for e in self.endpoints}
            self.report.rss_after_mib = self._rss()
        finally:
            for channel in self._channels.values():
                channel.close()
        self.report.wall_s = time.perf_counter() - started
        return self.report

    def _rss(self) -> dict[str, float]:
        return {e.name: rss_mib(e.pid) for e in self.endpoints}

    def _pass(self, kind: str) -> None:
        tally = self.report.classes.setdefault(kind, Tally())
        for endpoint in self.endpoints:
            for method in endpoint.service.methods:
                endpoint.before_block(method.name)
                self._block(endpoint, method.name, kind, tally)
                self._probe(endpoint)

    def _cases(self, endpoint: Endpoint, method: str, kind: str) -> Strategy[tuple[bytes, ...]]:
        descriptor = endpoint.service.methods_by_name[method]
        body = payloads(descriptor.input_type, kind)
        if not descriptor.client_streaming:
            return body.map(lambda payload: (payload,))
        stream = st.lists(body, max_size=BIDI_MESSAGES).map(tuple)
        opening = endpoint.first_message.get(method)
        if opening is None:
            return stream
        return st.tuples(st.booleans(), stream).map(
            lambda case: (opening(), *case[1]) if case[0] else case[1])

    def _block(self, endpoint: Endpoint, method: str, kind: str, tally: Tally) -> None:
        # derandomize: CI sees the same cases every run, and both passes the same cases. Only
        # the generate phase: a bug case is recorded and the campaign goes on (shrinking would
        # replay it many times). too_slow suppressed because huge_repeated builds messages of
        # up to 14 MiB on purpose: 8 RouteBatch cases take ~0.5 s to draw here, and a slower
        # runner would cross hypothesis's 1 s limit.
        @settings(max_examples=self.examples, derandomize=True, database=None, deadline=None,
                  phases=(Phase.generate,), suppress_health_check=(HealthCheck.too_slow,))
        @given(self._cases(endpoint, method, kind))
        def send(case: tuple[bytes, ...]) -> None:
            self._send(endpoint, method, kind, case, tally)

        send()

    def _send(self, endpoint: Endpoint, method: str, kind: str, case: tuple[bytes, ...],
              tally: Tally) -> None:
        started = time.perf_counter()
        code, details = self._call(endpoint, method, case)
        name = f"{endpoint.service.full_name}/{method}"
        seconds = self.report.method_seconds
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - started
        self.report.methods.setdefault(name, Counter())[code] += 1
        tally.tried += 1
        tally.statuses[code] += 1
        request = endpoint.service.methods_by_name[method].input_type
        decodable = all(decodes(request, payload) for payload in case)
        if code == "UNKNOWN" and not decodable and details.startswith(GRPCIO_DECODE_FAILURE):
            tally.decode_failures += 1
        elif code in ("INTERNAL", "UNKNOWN"):
            if code == "INTERNAL":
                tally.internal += 1
            else:
                tally.unknown += 1
            if len(tally.failures) < 5:
                tally.failures.append(_describe(endpoint, method, kind, code, details, case))
        if code == "RESOURCE_EXHAUSTED" and OVERSIZED_DETAILS in details:
            tally.oversized_details += 1
        dead = [e.name for e in self.endpoints if not e.alive()]
        if dead:
            tally.crashes += 1
            raise ServerDied(f"{', '.join(dead)} exited after "
                             f"{_describe(endpoint, method, kind, code, details, case)}")

    def _call(self, endpoint: Endpoint, method: str,
              case: tuple[bytes, ...]) -> tuple[str, str]:
        """(status code name, details) of one call with raw bytes. A server stream read up to
        ``SERVER_STREAM_MESSAGES`` and then cancelled by us counts as OK."""
        channel = self._channels[endpoint.name]
        path = f"/{endpoint.service.full_name}/{method}"
        descriptor = endpoint.service.methods_by_name[method]
        try:
            if not descriptor.server_streaming:
                channel.unary_unary(path)(case[0], timeout=self.deadline_s,
                                          metadata=self.metadata)
                return "OK", ""
            if descriptor.client_streaming:
                call = channel.stream_stream(path)(iter(case), timeout=self.deadline_s,
                                                   metadata=self.metadata)
            else:
                call = channel.unary_stream(path)(case[0], timeout=self.stream_deadline_s,
                                                  metadata=self.metadata)
            for i, _ in enumerate(call):
                if i + 1 >= SERVER_STREAM_MESSAGES:
                    call.cancel()
                    break
            return "OK", ""
        except grpc.RpcError as err:
            return err.code().name, err.details() or ""

    def _probe(self, endpoint: Endpoint) -> None:
        method, payload = endpoint.probe
        path = f"/{endpoint.service.full_name}/{method}"
        self._channels[endpoint.name].unary_unary(path)(payload, timeout=10.0,
                                                        metadata=endpoint.probe_metadata)


def _describe(endpoint: Endpoint, method: str, kind: str, code: str, details: str,
              case: tuple[bytes, ...]) -> str:
    heads = ", ".join(f"{len(p)}B {p[:24].hex()}" for p in case)
    return f"{endpoint.name} {method} [{kind}] -> {code} {details!r}; payload: {heads}"


# ---------------------------------------------------------------------------------- the fleet

FAKE_WORKER = "w0"
"""The worker identity the fuzz itself registers (again before every block, so its hello always
opens a stream). ``PLAIN`` strings name it: fuzzed Deregister, Cordon, Sync and ReportRollouts
calls find a worker, and whatever they do to it is undone for the next block."""
REAL_WORKER = "worker-1"
ROLES = ("admin", "scheduler", "trainer")


@dataclass
class FuzzFleet:
    """A ``kvcoord coordinator`` and one ``kvcoord worker`` subprocess (CPU, one torch thread)
    on free 127.0.0.1 ports, stderr logged under ``log_dir``. With ``auth``, both serve with an
    identities file (one identity per role in ``ROLES``, plus the worker's own) and a rate limit
    far above the campaign's pace. ``KVCOORD_ROUTE_WAIT_MS`` is 100: a fuzzed BeginPolicyUpdate
    may start a drain, and each route then waits at most that long, not 2 s."""

    log_dir: Path
    auth: bool = True
    tokens: dict[str, str] = field(default_factory=dict)
    coordinator_target: str = ""
    worker_target: str = ""
    _processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _hash: HashConfig | None = None
    _incarnation: int = 0
    _channel: grpc.Channel | None = None

    def __enter__(self) -> FuzzFleet:
        key = secrets.token_hex(32)
        self._hash = HashConfig.from_hex_key(key, "blake2b-128", 16)
        env = {"KVCOORD_HASH_KEY": key, "KVCOORD_ROUTE_WAIT_MS": "100", "OMP_NUM_THREADS": "1"}
        security = self._write_identities() if self.auth else []
        self.coordinator_target = f"127.0.0.1:{free_port()}"
        self.worker_target = f"127.0.0.1:{free_port()}"
        token = ["--token-file", str(self.log_dir / "worker.token")] if self.auth else []
        commands = {
            self.coordinator_target: ["coordinator", "--listen", self.coordinator_target],
            self.worker_target: ["worker", "--coordinator", self.coordinator_target,
                                 "--listen", self.worker_target, "--worker-id", REAL_WORKER,
                                 "--pages", "256", "--device", "cpu", *token],
        }
        try:
            for (target, args), name in zip(commands.items(), ("coordinator", "worker"),
                                            strict=True):
                with (self.log_dir / f"{name}.log").open("ab") as log:
                    self._processes[name] = spawn(
                        [*args, *security, "--log-level", "warning"], env=env, stderr=log)
                wait_healthy(target, self._processes[name], timeout=60.0)
            self._channel = grpc.insecure_channel(self.coordinator_target)
            self._wait_worker_ready()
            self.register_fake_worker()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._channel is not None:
            self._channel.close()
        stop_processes([self._processes[n] for n in ("worker", "coordinator")
                        if n in self._processes])

    def _write_identities(self) -> list[str]:
        """Write the identities file and the worker's token file; the servers' flags."""
        self.tokens = {role: secrets.token_hex(24) for role in (*ROLES, REAL_WORKER)}
        entries = [(role, role, "") for role in ROLES]
        entries.append((REAL_WORKER, "worker", f'worker_id = "{REAL_WORKER}"\n'))
        (self.log_dir / "identities.toml").write_text("".join(
            f'[[identity]]\nname = "{name}"\nrole = "{role}"\n{extra}'
            f'token = "{self.tokens[name]}"\n' for name, role, extra in entries))
        (self.log_dir / "worker.token").write_text(self.tokens[REAL_WORKER] + "\n")
        # Far above the campaign's pace: the limiter runs, but does not answer the fuzz
        # RESOURCE_EXHAUSTED before it reaches the handlers.
        return ["--auth-file", str(self.log_dir / "identities.toml"),
                "--rate-limit-per-s", "1000000"]

    def metadata(self, role: str | None = "admin") -> Metadata:
        """Call metadata of ``role`` (none without auth, or for ``role=None``)."""
        if not self.auth or role is None:
            return ()
        return (("authorization", f"Bearer {self.tokens[role]}"),)

    def _coordinator(self, call: Callable[[pb_grpc.CoordinatorStub], Any]) -> Any:
        assert self._channel is not None, "start the fleet first"
        return call(pb_grpc.CoordinatorStub(self._channel))

    def _wait_worker_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listed = self._coordinator(lambda stub: stub.ListWorkers(
                pb.ListWorkersRequest(), timeout=5.0, metadata=self.metadata()))
            if any(w.worker_id == REAL_WORKER and w.state == pb.WORKER_STATE_READY
                   for w in listed.workers):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{REAL_WORKER} not ready at the coordinator in {timeout}s")

    def register_fake_worker(self) -> None:
        """(Re-)register ``FAKE_WORKER``: a new incarnation, its old entries dropped."""
        assert self._hash is not None, "start the fleet first"
        request = pb.RegisterRequest(
            worker_id=FAKE_WORKER, address=f"{FAKE_WORKER}.invalid:1", total_pages=1024,
            hash_config=pb.HashConfig(algorithm=self._hash.algorithm.value,
                                      page_size=self._hash.page_size,
                                      fingerprint=self._hash.fingerprint()))
        self._incarnation = self._coordinator(lambda stub: stub.Register(
            request, timeout=5.0, metadata=self.metadata())).incarnation

    def hello(self) -> bytes:
        """A well-formed first Sync message of ``FAKE_WORKER``'s current incarnation."""
        return pb.SyncRequest(hello=pb.SyncHello(
            worker_id=FAKE_WORKER, incarnation=self._incarnation)).SerializeToString()

    def before_block(self, method: str) -> None:
        """Undo what the last block may have changed: abort a policy update it began (or every
        route would wait on its drain) and register the fake worker again."""
        def abort_update(stub: pb_grpc.CoordinatorStub) -> None:
            state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=5.0, metadata=self.metadata())
            if state.HasField("target_version"):
                stub.AbortPolicyUpdate(pb.AbortPolicyUpdateRequest(version=state.target_version),
                                       timeout=5.0, metadata=self.metadata())

        self._coordinator(abort_update)
        self.register_fake_worker()

    def alive(self, name: str) -> bool:
        return self._processes[name].poll() is None

    def pid(self, name: str) -> int:
        return self._processes[name].pid

    def log_tail(self, name: str, chars: int = 4000) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-chars:]

    def endpoints(self) -> list[Endpoint]:
        """The coordinator and the worker as campaign endpoints. Probes and resets run as admin,
        so a campaign without credentials can still check that the servers answer."""
        admin = self.metadata()
        return [
            Endpoint("coordinator", self.coordinator_target, self.pid("coordinator"),
                     lambda: self.alive("coordinator"), pb.DESCRIPTOR.services_by_name[
                         "Coordinator"], probe=("GetStats", b""),
                     first_message={"Sync": self.hello}, before_block=self.before_block,
                     probe_metadata=admin),
            Endpoint("worker", self.worker_target, self.pid("worker"),
                     lambda: self.alive("worker"), wpb.DESCRIPTOR.services_by_name["Worker"],
                     probe=("GetStats", b""), probe_metadata=admin),
        ]
