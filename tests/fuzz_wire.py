"""Hostile classes at the wire level (out-of-range varints, invalid UTF-8, unknown fields,
another message's bytes, mutations of a valid encoding, random bytes), and ``HOSTILE_CLASSES``:
every class by name, ``payloads(descriptor, kind)`` the serialized requests of one, and
``decodes`` (whether bytes parse as the request at all)."""

from __future__ import annotations

import random
from collections.abc import Callable

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from tests.fuzz_messages import (
    PLAIN,
    PROFILES,
    SEEDS,
    VARINT_TYPES,
    F,
    Profile,
    Strategy,
    blobs,
    messages,
    nested,
)

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
            paths += [(f.number, *p) for p in _string_paths(nested(f), depth - 1)]
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
