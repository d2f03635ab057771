"""Hostile protobuf requests, walked from a message's descriptor: a ``Profile`` says how each
kind of field is filled (boundary ints, hostile strings, wrong-length and random bytes, huge or
empty repeated fields, unknown enum numbers), so one generator covers every method of every
service. Large values (tens of KiB of bytes, 100k-element repeated fields) are expanded from a
few drawn values and a seed, never drawn element by element: hypothesis's choice buffer stays
small, and even a 14 MiB case is drawn in tens of milliseconds. The hostile classes built on
these, and on the wire level, are in ``tests.fuzz_wire``."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from coordinator.wire import PROTOCOL_VERSION

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
    pinned={"protocol_version": st.sampled_from((0, PROTOCOL_VERSION))},
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


def nested(f: FieldDescriptor) -> Descriptor:
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
        getattr(message, f.name).CopyFrom(draw(_message(nested(f), profile, depth + 1)))


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
    if f.type == F.TYPE_MESSAGE and nested(f).GetOptions().map_entry:
        raise NotImplementedError(f"{f.full_name}: map fields")
    element = (_message(nested(f), profile, depth + 1) if f.type == F.TYPE_MESSAGE
               else _scalar(f, profile))
    distinct = [draw(element) for _ in range(min(n, DISTINCT))]
    n = min(n, MAX_FIELD_BYTES // (2 + max(_encoded_size(v) for v in distinct)))
    values = distinct if n <= DISTINCT else random.Random(draw(SEEDS)).choices(distinct, k=n)
    getattr(message, f.name).extend(values)
