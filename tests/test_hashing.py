"""Page hashing: exact values, the spec re-derived with hashlib, namespaces, cache, config."""

from __future__ import annotations

import hashlib
from array import array

import pytest
import structlog.testing

from coordinator.core.hashing import (
    DEV_HASH_KEY,
    HashAlgorithm,
    HashConfig,
    Namespace,
    PageHasher,
    PageKeys,
    encode_root,
    load_hash_config,
    split_page_keys,
)
from coordinator.core.hashing import page_hasher as hashing
from coordinator.core.hashing.page_hasher import tokens_to_bytes

KEY = bytes(range(32))
NS = Namespace(model="llama-3-8b", tenant="acme", policy_version=7, page_size=4)
TOKENS = list(range(10))  # two full pages of 4, then a partial page of 2


def spec_keys(key: bytes, tokens: list[int], ns: Namespace) -> list[bytes]:
    """The hashing contract (docs/PROTOCOL.md §3) written out independently with hashlib."""

    def lp(data: bytes) -> bytes:
        return len(data).to_bytes(4, "little") + data

    root = (
        lp(b"kvcoord.root.v1")
        + lp(b"blake2b-128")
        + lp(ns.model.encode())
        + lp(ns.adapter.encode())
        + lp(ns.tenant.encode())
        + ns.policy_version.to_bytes(8, "little")
        + ns.page_size.to_bytes(4, "little")
    )
    parent = hashlib.blake2b(root, key=key, digest_size=16).digest()
    keys = []
    for start in range(0, len(tokens) - ns.page_size + 1, ns.page_size):
        page = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + ns.page_size])
        parent = hashlib.blake2b(parent + page, key=key, digest_size=16).digest()
        keys.append(parent)
    return keys


def test_blake2b_keys_are_pinned_and_follow_the_spec() -> None:
    hasher = PageHasher(HashConfig(KEY))
    keys = hasher.page_keys(TOKENS, NS)
    assert [k.hex() for k in keys] == [
        "9e94992ea0be7b9a33c52737b46820e4",
        "a8f9687604155a0e62e683318e482d7b",
    ]
    assert keys == spec_keys(KEY, TOKENS, NS)
    assert hasher.root(NS).hex() == "e5daeb02eaf0ebefcd014df55cf78d40"


def test_xxh3_mode_is_pinned_keyed_and_differs_from_blake2b() -> None:
    fast = PageHasher(HashConfig(KEY, HashAlgorithm.XXH3, 4)).page_keys(TOKENS, NS)
    assert [k.hex() for k in fast] == [
        "3e2cfc833ce6235a5680ea7cb2cbf23c",
        "1b2f0352b49a513476cdacdacd733315",
    ]
    other_key = PageHasher(HashConfig(bytes(32), HashAlgorithm.XXH3, 4)).page_keys(TOKENS, NS)
    assert other_key[0] != fast[0]
    assert fast != PageHasher(HashConfig(KEY)).page_keys(TOKENS, NS)


def test_keys_chain_so_a_prefix_has_the_same_keys() -> None:
    hasher = PageHasher(HashConfig(KEY), cache_pages=0)
    long = hasher.page_keys(list(range(64)), Namespace())
    short = hasher.page_keys(list(range(40)), Namespace())
    assert len(long) == 4 and len(short) == 2
    assert long[:2] == short
    changed = hasher.page_keys([99, *range(1, 64)], Namespace())
    assert all(a != b for a, b in zip(changed, long, strict=True))  # a change poisons the rest


@pytest.mark.parametrize(
    "other",
    [
        Namespace(model="llama-3-70b", tenant="acme", policy_version=7, page_size=4),
        Namespace(
            model="llama-3-8b", adapter="lora-1", tenant="acme", policy_version=7, page_size=4
        ),
        Namespace(model="llama-3-8b", tenant="other", policy_version=7, page_size=4),
        Namespace(model="llama-3-8b", tenant="acme", policy_version=8, page_size=4),
        Namespace(model="llama-3-8b", tenant="acme", policy_version=7, page_size=2),
        Namespace(model="llama-3-8b", tenant="acme", policy_version=7, page_size=4,
                  cache_salt="s"),
    ],
)
def test_any_namespace_field_changes_every_key(other: Namespace) -> None:
    hasher = PageHasher(HashConfig(KEY))
    tokens = list(range(16))
    assert set(hasher.page_keys(tokens, NS)).isdisjoint(hasher.page_keys(tokens, other))


def test_a_cache_salt_binds_the_root_and_is_pinned() -> None:
    # docs/PROTOCOL.md §3: h[-1] = bind(H(root), salt) for a salted scope.
    hasher = PageHasher(HashConfig(DEV_HASH_KEY, page_size=16))
    salted = Namespace(cache_salt="tenant-a")
    assert hasher.root(salted).hex() == "5e1db033280b8a660b84b43e3e8b5197"
    assert [k.hex() for k in hasher.page_keys(list(range(40)), salted)] == [
        "9ee3998b49a0ef6df667f7f21f0fe940", "8c0b0a667743326306db4a508a55aead"]
    assert hasher.bind(hasher.root(Namespace()), b"img").hex() == (
        "724ec4f66f6c7725c4304a0d38b7a4bf")
    assert hasher.root(Namespace(cache_salt="")) == hasher.root(Namespace())


def test_root_encoding_is_unambiguous_across_field_boundaries() -> None:
    a = encode_root(Namespace(model="ab", adapter="c"), HashAlgorithm.BLAKE2B)
    b = encode_root(Namespace(model="a", adapter="bc"), HashAlgorithm.BLAKE2B)
    assert a != b


def test_partial_last_page_gets_no_key() -> None:
    hasher = PageHasher(HashConfig(KEY))
    ns = Namespace(page_size=4)
    assert hasher.page_keys([1, 2, 3], ns) == []
    assert hasher.page_keys([1, 2, 3, 4, 5, 6, 7], ns) == hasher.page_keys([1, 2, 3, 4], ns)


def test_namespace_page_size_decides_the_cut() -> None:
    hasher = PageHasher(HashConfig(KEY, page_size=16))
    assert len(hasher.page_keys(list(range(32)), Namespace(page_size=8))) == 4


def test_warm_cache_counts_hits_and_gives_identical_keys() -> None:
    hasher = PageHasher(HashConfig(KEY))
    cold = PageHasher(HashConfig(KEY), cache_pages=0)
    turn1 = list(range(40))  # 2 full pages of 16
    first = hasher.page_keys(turn1, Namespace())
    assert (hasher.hits, hasher.misses) == (0, 2)
    turn2 = turn1 + list(range(1000, 1030))  # 70 tokens: 4 pages, 2 of them new
    second = hasher.page_keys(turn2, Namespace())
    assert (hasher.hits, hasher.misses) == (2, 4)
    assert second[:2] == first
    assert second == cold.page_keys(turn2, Namespace())
    other_ns = hasher.page_keys(turn1, Namespace(tenant="t"))  # the root keeps caches apart
    assert (hasher.hits, hasher.misses) == (2, 6)
    assert set(other_ns).isdisjoint(first)


def test_run_entries_find_a_long_cached_prefix_and_stop_exactly_where_it_ends() -> None:
    hasher = PageHasher(HashConfig(KEY))
    cold = PageHasher(HashConfig(KEY), cache_pages=0)
    first = list(range(40 * 16 + 5))  # 40 pages: runs of 16 at pages 0 and 16, then 8 more
    assert hasher.page_keys(first, Namespace()) == cold.page_keys(first, Namespace())
    assert (hasher.hits, hasher.misses) == (0, 40)
    diverged = first[: 37 * 16 + 3] + [7] * 200  # shares 37 pages, then 12 new pages
    keys = hasher.page_keys(diverged, Namespace())
    assert keys == cold.page_keys(diverged, Namespace())
    assert (hasher.hits, hasher.misses) == (37, 52)
    again = hasher.page_keys(tokens_to_bytes(diverged), Namespace())  # runs now cover 48 pages
    assert again == keys and (hasher.hits, hasher.misses) == (37 + 49, 52)
    mid_run = first[: 16 * 16] + [9] * 16 + first[17 * 16 :]  # page 16 differs: all new after
    assert hasher.page_keys(mid_run, Namespace()) == cold.page_keys(mid_run, Namespace())
    assert (hasher.hits, hasher.misses) == (37 + 49 + 16, 52 + 24)


def test_chain_cache_is_bounded() -> None:
    hasher = PageHasher(HashConfig(KEY), cache_pages=8)
    for prompt in range(20):
        hasher.page_keys([prompt] * 64, Namespace())  # 4 new pages each
        assert hasher.cache_len() <= 8 + 4
    assert hasher.page_keys([19] * 64, Namespace()) == PageHasher(
        HashConfig(KEY), cache_pages=0
    ).page_keys([19] * 64, Namespace())
    assert hasher.hits == 4  # the newest prompt survived the rotations
    runs = PageHasher(HashConfig(KEY), cache_pages=40)
    for prompt in range(10):
        runs.page_keys([prompt] * 512, Namespace())  # 32 pages and 2 run entries each
        assert runs.cache_len() <= 40 + 32 + 2


def test_bytes_input_is_taken_as_encoded_tokens() -> None:
    hasher = PageHasher(HashConfig(KEY))
    tokens = list(range(100, 132))
    encoded = tokens_to_bytes(tokens)
    assert encoded == array("I", tokens).tobytes() and len(encoded) == 128
    assert hasher.page_keys(encoded, Namespace()) == hasher.page_keys(tokens, Namespace())
    assert hasher.page_keys(memoryview(encoded), Namespace()) == hasher.page_keys(
        tokens, Namespace()
    )
    with pytest.raises(ValueError, match="multiple of 4"):
        tokens_to_bytes(b"\x00" * 6)


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_token_outside_uint32_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match=f"token id {bad} outside uint32"):
        tokens_to_bytes([1, bad, 3])
    tokens_to_bytes([0, 2**32 - 1])


def test_non_integer_token_is_refused() -> None:
    with pytest.raises(ValueError, match="integers"):
        tokens_to_bytes([1.5])  # type: ignore[list-item]


def test_split_page_keys() -> None:
    keys = [bytes([i]) * 16 for i in range(3)]
    assert split_page_keys(b"".join(keys)) == tuple(keys)
    assert type(split_page_keys(b"".join(keys))) is PageKeys  # the index trusts this type
    assert split_page_keys(b"") == ()
    with pytest.raises(ValueError, match="multiple of 16"):
        split_page_keys(b"\x00" * 17)


def test_fingerprint_differs_per_key_algorithm_and_page_size_and_hides_the_key() -> None:
    base = HashConfig(KEY)
    fp = base.fingerprint()
    assert len(fp) == 16 and fp.hex() == "5e9a9cd1e3745b71ce71357ba03e9b00"
    assert HashConfig(bytes(KEY)).fingerprint() == fp
    others = [
        HashConfig(bytes(32)),
        HashConfig(KEY + b"\x00"),
        HashConfig(KEY, HashAlgorithm.XXH3),
        HashConfig(KEY, page_size=32),
    ]
    assert len({fp, *(c.fingerprint() for c in others)}) == 5
    for chunk in (KEY[i : i + 4] for i in range(0, 32, 4)):
        assert chunk not in fp


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"key": b"short"}, "16..64 bytes"),
        ({"key": b"k" * 65}, "16..64 bytes"),
        ({"key": KEY, "page_size": 0}, "page_size must be 1..4096"),
        ({"key": KEY, "page_size": 4097}, "page_size must be 1..4096"),
        ({"key": KEY, "algorithm": "md5"}, "must be one of blake2b-128, xxh3-128"),
    ],
)
def test_hash_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HashConfig(**kwargs)  # type: ignore[arg-type]


def test_namespace_validation() -> None:
    with pytest.raises(ValueError, match="page_size"):
        Namespace(page_size=0)
    with pytest.raises(ValueError, match="uint64"):
        Namespace(policy_version=-1)


def test_from_hex_key_and_bad_hex() -> None:
    assert HashConfig.from_hex_key(KEY.hex(), "xxh3-128", 8) == HashConfig(
        KEY, HashAlgorithm.XXH3, 8
    )
    with pytest.raises(ValueError, match="not valid hex"):
        HashConfig.from_hex_key("zz" * 16)


def test_load_hash_config_from_env() -> None:
    cfg = load_hash_config(
        {
            "KVCOORD_HASH_KEY": KEY.hex(),
            "KVCOORD_HASH_ALGORITHM": "xxh3-128",
            "KVCOORD_PAGE_SIZE": "32",
        }
    )
    assert cfg == HashConfig(KEY, HashAlgorithm.XXH3, 32)
    with pytest.raises(ValueError, match=r"KVCOORD_PAGE_SIZE.*'big'"):
        load_hash_config({"KVCOORD_PAGE_SIZE": "big"})
    with pytest.raises(ValueError, match=r"KVCOORD_HASH_KEY.*16\.\.64 bytes"):
        load_hash_config({"KVCOORD_HASH_KEY": "00"})
    with pytest.raises(ValueError, match=r"KVCOORD_HASH_ALGORITHM.*'sha1'"):
        load_hash_config({"KVCOORD_HASH_ALGORITHM": "sha1"})


def test_missing_key_uses_the_dev_key_and_says_so_without_logging() -> None:
    with structlog.testing.capture_logs() as logs:
        cfg = load_hash_config({})
    assert cfg.key == DEV_HASH_KEY and cfg.uses_development_key
    assert not HashConfig(KEY).uses_development_key
    assert cfg.algorithm is HashAlgorithm.BLAKE2B and cfg.page_size == 16
    assert logs == []  # the core returns the fact; the servers log it
    assert DEV_HASH_KEY.hex() not in repr(cfg)  # the key is kept out of reprs and logs


def test_every_server_falling_back_to_the_dev_key_warns_once() -> None:
    from coordinator.config import CoordinatorConfig
    from coordinator.replica import hash_config_from
    from worker.bridge.bridge import BridgeConfig
    from worker.config import WorkerConfig

    builders = {
        "coordinator": lambda key: hash_config_from(CoordinatorConfig(hash_key=key)),
        "worker": lambda key: WorkerConfig(coordinator="127.0.0.1:1", hash_key=key).hash_config(),
        "bridge": lambda key: BridgeConfig(events="tcp://127.0.0.1:1", coordinator="127.0.0.1:1",
                                           worker_id="b", worker_address="e:1",
                                           hash_key=key).hash_config(),
    }
    for name, build in builders.items():
        with structlog.testing.capture_logs() as logs:
            assert build(None).uses_development_key, name
        assert [entry["event"] for entry in logs] == ["hashing.dev_key"], name
        with structlog.testing.capture_logs() as logs:
            assert not build(KEY.hex()).uses_development_key, name
        assert logs == [], name


def test_module_page_keys_uses_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCOORD_HASH_KEY", KEY.hex())
    monkeypatch.setenv("KVCOORD_PAGE_SIZE", "4")
    monkeypatch.delenv("KVCOORD_HASH_ALGORITHM", raising=False)
    hashing._default_hasher.cache_clear()
    try:
        assert hashing.page_keys(TOKENS, NS) == spec_keys(KEY, TOKENS, NS)
        default_ns = Namespace(page_size=4)  # None: model "default", version 0, page size 4
        assert hashing.page_keys(TOKENS) == spec_keys(KEY, TOKENS, default_ns)
    finally:
        hashing._default_hasher.cache_clear()
