"""The compiled page-key chain (coordinator/core/_chain_accel.pyx) against hashlib's keyed
BLAKE2b, and PageHasher's keys with it against the pure-Python chain: equal for every page
size, key length and message length, cached or cold."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core import accel
from coordinator.core.hashing import HashConfig, Namespace, PageHasher

chain_module = accel.built("_chain_accel")
pytestmark = pytest.mark.skipif(chain_module is None, reason=accel.status())


@settings(max_examples=300, deadline=None)
@given(key=st.binary(min_size=1, max_size=64), message=st.binary(min_size=1, max_size=600))
def test_every_digest_is_hashlibs_keyed_blake2b_128(key: bytes, message: bytes) -> None:
    assert chain_module is not None
    expected = hashlib.blake2b(message, key=key, digest_size=16).digest()
    assert chain_module.KeyedChain(key).digest(message) == expected


@pytest.mark.parametrize("page_size", [1, 16, 28, 29, 64])
def test_page_hasher_keys_are_the_pure_pythons_cold_and_cached(page_size: int) -> None:
    config = HashConfig(key=bytes(range(32)))
    compiled, pure = PageHasher(config), PageHasher(config)
    pure._chain = None  # the pure-Python path of the same hasher
    assert compiled._chain is not None or accel.DISABLED
    rng = random.Random(page_size)
    ns = Namespace(page_size=page_size)
    shared = [rng.randrange(2**17) for _ in range(page_size * 40)]
    for n in range(12):
        prompt = shared[: page_size * rng.randrange(41)] + [rng.randrange(2**17)
                                                          for _ in range(rng.randrange(300))]
        assert compiled.page_keys(prompt, ns) == pure.page_keys(prompt, ns), n
    parent = pure.root(ns)
    assert compiled.extend(parent, shared, page_size) == pure.extend(parent, shared, page_size)


def test_bad_arguments_are_refused() -> None:
    assert chain_module is not None
    chain = chain_module.KeyedChain(b"k" * 32)
    with pytest.raises(ValueError):
        chain_module.KeyedChain(b"")
    with pytest.raises(ValueError):
        chain.digest(b"")
    with pytest.raises(ValueError):
        chain.chain(b"short", b"x" * 64, 0, 64, 64)
    with pytest.raises(ValueError):
        chain.chain(b"p" * 16, b"x" * 64, 0, 65, 64)
