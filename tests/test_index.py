"""PrefixIndex: exact depths, tiers, worker lifecycle, pending entries with a fake clock."""

from __future__ import annotations

import pytest

from coordinator.core.index import IndexIntegrityError, IndexStats, MatchDetail, PrefixIndex, Tier
from tests.conftest import INDEX_PATHS


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chain(name: str, n: int) -> list[bytes]:
    """n distinct 16-byte keys standing for one prompt's pages."""
    return [f"{name}{i:03d}".encode().ljust(16, b".") for i in range(n)]


A = chain("a", 8)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=INDEX_PATHS)
def accelerated(request: pytest.FixtureRequest) -> bool:
    """Each test runs on both holdings (pure Python; compiled, where built)."""
    return bool(request.param)


@pytest.fixture
def idx(clock: FakeClock, accelerated: bool) -> PrefixIndex:
    return PrefixIndex(clock=clock, pending_ttl=2.0, accelerated=accelerated)


def test_match_reports_each_holder_of_the_first_key_with_its_depth(idx: PrefixIndex) -> None:
    assert idx.store("w1", A) == 8
    assert idx.store("w2", A[:3]) == 3
    idx.store("w3", A[1:])  # holds everything but the first page: not a match
    assert idx.match(A) == {"w1": 8, "w2": 3}
    assert idx.match(A[:2]) == {"w1": 2, "w2": 2}
    assert idx.match(chain("b", 4)) == {}
    assert idx.match([]) == {}
    idx.check_integrity()


def test_a_middle_page_evicted_ends_the_match_there(idx: PrefixIndex) -> None:
    idx.store("w1", A)
    idx.store("w2", A)
    assert idx.remove("w1", [A[4]]) == 1
    assert idx.match(A) == {"w1": 4, "w2": 8}
    assert idx.match_detail(A) == {"w1": MatchDetail(4, 0, 0, 4), "w2": MatchDetail(8, 0, 0, 8)}
    idx.check_integrity()


def test_store_counts_only_new_holdings_and_remove_ignores_unknown_keys(
    idx: PrefixIndex,
) -> None:
    assert idx.store("w1", A[:4]) == 4
    assert idx.store("w1", A[2:6] + A[2:3]) == 2
    assert idx.remove("w1", [*chain("zz", 3), A[0]]) == 1
    assert idx.remove("nobody", A) == 0
    assert idx.worker_keys("w1") == frozenset(A[1:6])
    assert idx.stats() == IndexStats(keys=5, holdings=5, pending=0, workers=1)
    idx.check_integrity()


def test_drop_worker_forgets_it_and_slot_reuse_does_not_resurrect(idx: PrefixIndex) -> None:
    idx.store("w1", A)
    idx.store("w2", A[:2])
    idx.store("w2", A[2:5], "cpu")
    idx.add_pending("w2", A[5:])
    assert idx.drop_worker("w2") == 5
    assert idx.drop_worker("w2") == 0
    assert idx.workers() == ["w1"]
    idx.store("w9", A[7:])  # takes w2's freed slot
    assert idx.workers() == ["w1", "w9"]
    assert idx.match(A) == {"w1": 8}
    assert idx.match_detail(A, include_pending=True) == {"w1": MatchDetail(8, 0, 0, 8)}
    assert idx.worker_keys("w9") == frozenset(A[7:])
    assert idx.tier_of("w9", A[3]) is None
    assert idx.stats() == IndexStats(keys=8, holdings=9, pending=0, workers=2)
    idx.check_integrity()


def test_tiers_are_kept_per_holder_and_restoring_moves_them(idx: PrefixIndex) -> None:
    idx.store("w1", A[:4])
    idx.store("w1", A[4:6], Tier.CPU)
    idx.store("w1", A[6:], "disk")
    idx.store("w2", A, "cpu")
    assert [idx.tier_of("w1", k) for k in A] == ["gpu"] * 4 + ["cpu"] * 2 + ["disk"] * 2
    assert idx.match_detail(A) == {"w1": MatchDetail(8, 4, 0, 8), "w2": MatchDetail(8, 8, 0, 8)}
    assert idx.store("w1", A[5:7], "gpu") == 0  # a tier change is not a new holding
    assert idx.store("w2", A[:1], "disk") == 0
    assert idx.tier_of("w1", A[6]) is Tier.GPU and idx.tier_of("w2", A[0]) is Tier.DISK
    assert idx.match_detail(A) == {"w1": MatchDetail(8, 2, 0, 8), "w2": MatchDetail(8, 8, 0, 8)}
    idx.check_integrity()


def test_replace_worker_makes_holdings_exactly_the_inventory(idx: PrefixIndex) -> None:
    idx.store("w1", A[:6])
    idx.replace_worker("w1", {"gpu": A[:2], "cpu": A[2:4] + A[7:], "disk": A[:1]})
    assert idx.worker_keys("w1") == frozenset(A[:4] + A[7:])
    assert idx.tier_of("w1", A[0]) is Tier.GPU  # listed twice: the faster tier wins
    assert idx.tier_of("w1", A[3]) is Tier.CPU
    assert idx.match_detail(A) == {"w1": MatchDetail(4, 2, 0, 4)}
    idx.replace_worker("w1", {})
    assert idx.worker_keys("w1") == frozenset() and idx.match(A) == {}
    idx.check_integrity()


def test_pending_entries_are_seen_by_match_detail_only_and_expire(
    idx: PrefixIndex, clock: FakeClock
) -> None:
    idx.store("w1", A[:2])
    assert idx.add_pending("w1", A) == 6  # the two confirmed keys are never made pending
    assert idx.add_pending("w2", A[:3]) == 3
    assert idx.match(A) == {"w1": 2}
    assert idx.match_detail(A) == {"w1": MatchDetail(2, 0, 0, 2)}
    assert idx.match_detail(A, include_pending=True) == {
        "w1": MatchDetail(8, 0, 6, 2),
        "w2": MatchDetail(3, 0, 3, 0),
    }
    assert idx.stats().pending == 9
    clock.now += 1.999
    assert idx.expire_pending() == 0
    clock.now += 0.001  # deadline reached: gone
    assert idx.match_detail(A, include_pending=True) == {"w1": MatchDetail(2, 0, 0, 2)}
    assert idx.stats().pending == 0
    idx.check_integrity()


def test_store_confirms_pending_and_a_refresh_restarts_the_ttl(
    idx: PrefixIndex, clock: FakeClock
) -> None:
    idx.add_pending("w1", A[:4])
    clock.now += 1.5
    assert idx.add_pending("w1", A[2:6]) == 2  # A[2:4] refreshed, A[4:6] new
    idx.store("w1", A[:1], "cpu")
    assert idx.pending_keys("w1") == frozenset(A[1:6])
    clock.now += 1.0  # the first record expires; only A[1] still carries its deadline
    assert idx.expire_pending() == 1
    assert idx.match_detail(A, include_pending=True) == {"w1": MatchDetail(1, 1, 0, 1)}
    assert idx.match_detail(A[2:], include_pending=True) == {"w1": MatchDetail(4, 0, 4, 0)}
    idx.check_integrity()
    clock.now += 1.0
    assert idx.expire_pending() == 4
    idx.check_integrity()


def test_remove_also_drops_pending_entries(idx: PrefixIndex) -> None:
    idx.add_pending("w1", A[:3])
    idx.remove("w1", A[1:2])
    assert idx.pending_keys("w1") == frozenset([A[0], A[2]])
    idx.check_integrity()


def test_max_pending_evicts_the_oldest_records_first(idx: PrefixIndex, clock: FakeClock,
                                                     accelerated: bool) -> None:
    small = PrefixIndex(clock=clock, pending_ttl=2.0, max_pending=5, accelerated=accelerated)
    small.add_pending("w1", A[:3])
    small.add_pending("w2", A[:2])
    small.add_pending("w3", A[:2])  # 7 > 5: w1's record (oldest) goes
    assert (small.pending_keys("w1"), small.stats().pending) == (frozenset(), 4)
    assert small.add_pending("w4", A) == 5  # longer than the bound: keeps its first 5 keys
    assert small.pending_keys("w4") == frozenset(A[:5])
    assert small.stats().pending == 5
    small.check_integrity()


def test_bad_input_is_refused_without_mutation(idx: PrefixIndex) -> None:
    idx.store("w1", A)
    for bad in ([b"short"], [A[0], "x" * 16], [bytearray(16)], [A[0] + b"!"], b"\x00" * 16):
        with pytest.raises(ValueError):
            idx.store("w2", bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            idx.match(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            idx.add_pending("w2", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="worker id"):
        idx.store("", A)
    with pytest.raises(ValueError):
        idx.store("w1", A, "tape")
    with pytest.raises(ValueError):
        idx.replace_worker("w1", {"gpu": A[:1], "tape": A})
    assert idx.workers() == ["w1"] and idx.match(A) == {"w1": 8}
    idx.check_integrity()


def test_check_integrity_detects_corruption(idx: PrefixIndex) -> None:
    idx.store("w1", A)
    idx._holdings.add([A[3]], 1)  # a holding for a slot nobody has
    with pytest.raises(IndexIntegrityError, match="free slot"):
        idx.check_integrity()


def test_many_workers_get_exact_depths(idx: PrefixIndex) -> None:
    keys = chain("p", 64)
    for w in range(300):
        idx.store(f"w{w}", keys[: 1 + w % 64])
    expected = {f"w{w}": 1 + w % 64 for w in range(300)}
    assert idx.match(keys) == expected
    assert {w: d.pages for w, d in idx.match_detail(keys).items()} == expected
    idx.check_integrity()


def test_confirmed_pages_is_the_confirmed_run_inside_the_pending_inclusive_one(
    idx: PrefixIndex,
) -> None:
    idx.store("w1", A[:3])
    idx.store("w1", A[4:6], "cpu")  # a hole at A[3], filled below by a pending entry
    idx.add_pending("w1", A[3:4] + A[6:])
    idx.store("w2", A[:2], "disk")
    idx.add_pending("w2", A[2:5])
    idx.store("w2", A[5:7])  # after the pending run: confirmed depth stays 2
    assert idx.match(A) == {"w1": 3, "w2": 2}
    assert idx.match_detail(A, include_pending=True) == {
        "w1": MatchDetail(8, 2, 3, 3),
        "w2": MatchDetail(7, 2, 3, 2),
    }
    assert idx.match_detail(A) == {"w1": MatchDetail(3, 0, 0, 3), "w2": MatchDetail(2, 2, 0, 2)}
    idx.check_integrity()


def test_worker_names_follow_slot_reuse_between_lookups(idx: PrefixIndex) -> None:
    idx.store("w1", A)
    assert idx.match(A) == {"w1": 8}  # memoises slot 0's name
    idx.drop_worker("w1")
    idx.store("w2", A[:5])  # reuses slot 0: the same mask now names w2
    assert idx.match(A) == {"w2": 5}
    assert idx.match_detail(A) == {"w2": MatchDetail(5, 0, 0, 5)}


def test_digest_is_order_independent_and_covers_worker_key_and_tier(
        clock: FakeClock, accelerated: bool) -> None:
    def built(steps: list[tuple[str, list[bytes], Tier]]) -> PrefixIndex:
        idx = PrefixIndex(clock=clock, accelerated=accelerated)
        for worker, keys, tier in steps:
            idx.store(worker, keys, tier)
        return idx

    b = chain("b", 3)
    one = built([("w1", A[:4], Tier.GPU), ("w2", b, Tier.CPU)])
    assert one.digest() == built([("w2", b[::-1], Tier.CPU), ("w1", A[3::-1], Tier.GPU)]).digest()
    assert len(one.digest()) == 16
    assert one.digest() != built([("w1", A[:4], Tier.GPU), ("w2", b, Tier.GPU)]).digest()  # tier
    assert one.digest() != built([("w1", A[:4], Tier.GPU), ("w3", b, Tier.CPU)]).digest()  # worker
    assert one.digest() != built([("w1", A[:3], Tier.GPU), ("w2", b, Tier.CPU)]).digest()  # key
    pending = built([("w1", A[:4], Tier.GPU), ("w2", b, Tier.CPU)])
    pending.add_pending("w3", chain("c", 2))  # unconfirmed: not part of the index's agreement
    assert pending.digest() == one.digest()
    one.remove("w2", b)
    one.drop_worker("w1")
    assert one.digest() == PrefixIndex(clock=clock, accelerated=accelerated).digest() == bytes(16)


def test_match_tiers_counts_each_holders_run_per_tier(idx: PrefixIndex) -> None:
    idx.store("w", A)
    idx.store("v", A[:5])
    idx.store("u", A[:3])
    # Nothing below GPU anywhere: depths as match gives them, no tier named.
    assert idx.match_tiers(A) == ({"w": 8, "v": 5, "u": 3}, {})
    # w's pages 4..7 spill: 4 and 5 to CPU, 6 and 7 to disk; v's page 4 to CPU (a Stored
    # event for a key already held moves it: one tier per (worker, key)).
    idx.store("w", A[4:6], Tier.CPU)
    idx.store("w", A[6:], Tier.DISK)
    idx.store("v", A[4:5], Tier.CPU)
    # u spills a page beyond the prompt's run: it is named only where its run holds some.
    idx.store("u", chain("z", 1), Tier.CPU)
    depths, lower = idx.match_tiers(A)
    assert depths == idx.match(A) == {"w": 8, "v": 5, "u": 3}
    assert lower == {"w": {Tier.CPU: 2, Tier.DISK: 2}, "v": {Tier.CPU: 1}}
    # A shorter prompt counts only the pages it matched.
    assert idx.match_tiers(A[:5]).lower_tiers == {"w": {Tier.CPU: 1}, "v": {Tier.CPU: 1}}
    # Copied back up: the tier follows the last event.
    idx.store("w", A[4:], Tier.GPU)
    assert idx.match_tiers(A).lower_tiers == {"v": {Tier.CPU: 1}}
    idx.check_integrity()


def test_held_by_tier_splits_a_workers_holdings(idx: PrefixIndex) -> None:
    assert idx.held_by_tier("nobody") == {Tier.GPU: 0, Tier.CPU: 0, Tier.DISK: 0}
    idx.store("w", A)
    idx.store("w", A[2:5], Tier.CPU)
    idx.store("w", A[7:], Tier.DISK)
    assert idx.held_by_tier("w") == {Tier.GPU: 4, Tier.CPU: 3, Tier.DISK: 1}
    idx.remove("w", A[2:3])
    assert idx.held_by_tier("w") == {Tier.GPU: 4, Tier.CPU: 2, Tier.DISK: 1}
    assert sum(idx.held_by_tier("w").values()) == idx.held_count("w")
