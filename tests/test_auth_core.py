"""The pure auth core: identities file parsing, token lookup, role table, buckets, stream slots."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.core.errors import ResourceExhausted
from coordinator.rpc.guard import bearer_token, certificate_name
from coordinator.rpc.identities import (
    ANONYMOUS,
    Identity,
    IdentityFileError,
    IdentityTable,
    PermissionDenied,
    RateLimited,
    RateLimiter,
    Role,
    StreamSlots,
    Unauthenticated,
    authorize,
    check_cordon,
    check_worker,
    may_send_page_keys,
)

TOKEN = "s3cret-token-0123456789"


def _table(*entries: dict[str, str]) -> IdentityTable:
    return IdentityTable.from_entries(entries)


def test_a_token_or_its_digest_names_the_identity_and_nothing_else_does() -> None:
    table = _table(
        {"name": "a", "role": "scheduler", "tenant": "t", "token": TOKEN},
        {"name": "b", "role": "trainer",
         "token_sha256": hashlib.sha256(b"other-token-0123456789").hexdigest()},
        {"name": "w", "role": "worker", "worker_id": "w-0", "subject": "w-0.cert"},
    )
    assert table.by_token(TOKEN) == Identity("a", Role.SCHEDULER, "t")
    assert table.by_token("other-token-0123456789") == Identity("b", Role.TRAINER)
    assert table.by_token(TOKEN[:-1]) is None
    assert table.by_token(TOKEN + "x") is None
    assert table.by_token("") is None
    assert table.by_subject("w-0.cert") == Identity("w", Role.WORKER, "", "w-0")
    assert table.by_subject("w-0") is None
    assert len(table) == 3


@pytest.mark.parametrize(("entry", "message"), [
    ({"role": "admin", "token": TOKEN}, "name must be"),
    ({"name": "x", "role": "root", "token": TOKEN}, "role must be one of"),
    ({"name": "x", "role": "worker", "token": TOKEN}, "needs a worker_id"),
    ({"name": "x", "role": "admin", "worker_id": "w", "token": TOKEN}, "worker role only"),
    ({"name": "x", "role": "admin"}, "give a token"),
    ({"name": "x", "role": "admin", "token": "short"}, "at least 16 characters"),
    ({"name": "x", "role": "admin", "token": "has a space in it 12345"}, "without spaces"),
    ({"name": "x", "role": "admin", "token_sha256": "abcd"}, "64 hex digits"),
    ({"name": "x", "role": "admin", "token": TOKEN, "token_sha256": "00" * 32}, "not both"),
    ({"name": "x", "role": "admin", "token": TOKEN, "colour": "red"}, "unknown fields"),
    ({"name": "x", "role": "admin", "token": 5}, "must be a string"),
])
def test_a_bad_identity_entry_is_refused_naming_what_is_wrong(
    entry: dict[str, object], message: str
) -> None:
    with pytest.raises(IdentityFileError, match=message) as refused:
        IdentityTable.from_entries([entry])
    assert "identity[0]" in str(refused.value)
    assert TOKEN not in str(refused.value)  # credentials never end up in a message


def test_duplicate_names_tokens_and_subjects_are_refused() -> None:
    a = {"name": "a", "role": "admin", "token": TOKEN}
    with pytest.raises(IdentityFileError, match="used twice"):
        IdentityTable.from_entries([a, dict(a)])
    with pytest.raises(IdentityFileError, match="also another identity's"):
        IdentityTable.from_entries([a, {**a, "name": "b"}])
    s = {"name": "s", "role": "admin", "subject": "cn"}
    with pytest.raises(IdentityFileError, match="subject 'cn' is used twice"):
        IdentityTable.from_entries([s, {**s, "name": "t"}])


def test_an_identities_file_is_read_and_a_bad_one_fails_config(tmp_path: Path) -> None:
    good = tmp_path / "ids.toml"
    good.write_text(f'[[identity]]\nname = "a"\nrole = "admin"\ntoken = "{TOKEN}"\n')
    assert IdentityTable.load(good).by_token(TOKEN) == Identity("a", Role.ADMIN)
    for text, message in (("not toml [", "is not TOML"), ("x = 1", "no \\[\\[identity\\]\\]")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=f"auth_file: .*{message}"):
            CoordinatorConfig(auth_file=str(bad))
    with pytest.raises(ConfigError, match="cannot read identities file"):
        CoordinatorConfig(auth_file=str(tmp_path / "missing.toml"))


def test_tls_settings_are_checked_at_start(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n...\n")
    with pytest.raises(ConfigError, match="tls_cert and tls_key must be given together"):
        CoordinatorConfig(tls_cert=str(pem))
    with pytest.raises(ConfigError, match=r"tls_client_ca .* needs tls_cert"):
        CoordinatorConfig(tls_client_ca=str(pem))
    not_pem = tmp_path / "key.txt"
    not_pem.write_text("hello")
    with pytest.raises(ConfigError, match=r"tls_key: .* is not a PEM file"):
        CoordinatorConfig(tls_cert=str(pem), tls_key=str(not_pem))
    with pytest.raises(ConfigError, match="rate_limit_per_s must be >= 0"):
        CoordinatorConfig(rate_limit_per_s=-1)
    with pytest.raises(ConfigError, match="max_streams_per_identity must be > 0"):
        CoordinatorConfig(max_streams_per_identity=0)
    with pytest.raises(ConfigError, match="auth_reload_ms must be >= 0"):
        CoordinatorConfig(auth_reload_ms=-1)
    with pytest.raises(ConfigError, match="max_batch_tokens must be > 0"):
        CoordinatorConfig(max_batch_tokens=0)
    with pytest.raises(ConfigError, match="max_pages_per_worker must be > 0"):
        CoordinatorConfig(max_pages_per_worker=0)
    from worker.config import WorkerConfig

    with pytest.raises(ConfigError, match="auth_reload_ms must be >= 0"):
        WorkerConfig(auth_reload_ms=-1, device="cpu")
    with pytest.raises(ConfigError, match="tls_cert and tls_key must be given together"):
        WorkerConfig(tls_cert=str(pem), device="cpu")


def test_roles_and_worker_ids() -> None:
    table = {"Route": frozenset({Role.SCHEDULER, Role.ADMIN})}
    authorize(Identity("s", Role.SCHEDULER), "Route", table)
    authorize(ANONYMOUS, "Route", table)
    with pytest.raises(PermissionDenied, match="trainer 't' may not call Route"):
        authorize(Identity("t", Role.TRAINER), "Route", table)
    with pytest.raises(PermissionDenied):  # a method missing from the table: admin only
        authorize(Identity("s", Role.SCHEDULER), "Unlisted", table)
    worker = Identity("w", Role.WORKER, worker_id="w-1")
    check_worker(worker, "w-1")
    check_worker(ANONYMOUS, "anything")
    with pytest.raises(PermissionDenied, match="is worker 'w-1', not 'w-2'"):
        check_worker(worker, "w-2")
    check_cordon(worker, "w-1", True)
    check_cordon(ANONYMOUS, "w-2", False)
    with pytest.raises(PermissionDenied, match="may cordon itself but not uncordon"):
        check_cordon(worker, "w-1", False)
    with pytest.raises(PermissionDenied, match="not 'w-2'"):
        check_cordon(worker, "w-2", True)
    assert may_send_page_keys(worker, False) and may_send_page_keys(ANONYMOUS, False)
    scheduler = Identity("s", Role.SCHEDULER)
    assert not may_send_page_keys(scheduler, False) and may_send_page_keys(scheduler, True)
    assert not may_send_page_keys(Identity("t", Role.TRAINER), True)


def test_a_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    now = [0.0]
    limiter = RateLimiter(10.0, 3, lambda: now[0])
    assert [limiter.wait_for("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.wait_for("a") == pytest.approx(0.1)
    assert limiter.wait_for("b") == 0.0  # buckets are per key
    now[0] = 0.05
    assert limiter.wait_for("a") == pytest.approx(0.05)
    now[0] = 0.1
    assert limiter.wait_for("a") == 0.0
    now[0] = 100.0  # a long pause saves at most the burst
    assert [limiter.wait_for("a") for _ in range(4)][-1] == pytest.approx(0.1)
    with pytest.raises(RateLimited, match="over the rate limit of 10 requests/s") as refused:
        limiter.take("a", "Route")
    assert refused.value.retry_after_ms == 100
    assert isinstance(refused.value, ResourceExhausted)
    off = RateLimiter(0.0, 1, lambda: 0.0)
    assert not off.enabled and all(off.wait_for("a") == 0.0 for _ in range(100))


def test_buckets_are_bounded_by_dropping_the_least_recently_used() -> None:
    limiter = RateLimiter(1.0, 1, lambda: 0.0, max_keys=2)
    limiter.wait_for("a")
    limiter.wait_for("b")
    assert limiter.wait_for("a") > 0  # a is now the most recent
    limiter.wait_for("c")  # drops b
    assert limiter.wait_for("a") > 0
    assert limiter.wait_for("b") == 0.0  # b came back full


def test_stream_slots() -> None:
    slots = StreamSlots(2)
    slots.acquire("a", "Sync")
    slots.acquire("a", "Sync")
    with pytest.raises(ResourceExhausted, match="2 streams already open"):
        slots.acquire("a", "WatchPolicy")
    slots.acquire("b", "Sync")
    slots.release("a")
    slots.acquire("a", "Sync")
    assert slots.open_count("a") == 2
    for _ in range(3):
        slots.release("a")
    assert slots.open_count("a") == 0
    unbounded = StreamSlots(0)
    for _ in range(1000):
        unbounded.acquire("a", "Sync")


def test_credentials_are_read_from_metadata_and_certificates() -> None:
    assert bearer_token((("authorization", f"Bearer {TOKEN}"),)) == TOKEN
    assert bearer_token((("authorization", f"bearer  {TOKEN} "),)) == TOKEN
    assert bearer_token((("x-other", "1"),)) is None
    for bad in ("Basic abc", "Bearer", "Bearer   ", TOKEN):
        with pytest.raises(Unauthenticated, match="must be 'Bearer <token>'"):
            bearer_token((("authorization", bad),))
    assert certificate_name({"x509_common_name": [b"w-0"]}) == "w-0"
    assert certificate_name({"transport_security_type": [b"ssl"]}) is None


def test_a_changed_identities_file_is_read_again_and_a_broken_one_ignored(
    tmp_path: Path,
) -> None:
    from coordinator.rpc.guard import IdentitySource

    path = tmp_path / "ids.toml"

    def write(name: str, token: str) -> None:
        path.write_text(f'[[identity]]\nname = "{name}"\nrole = "admin"\ntoken = "{token}"\n')

    old, new = "old-token-0123456789", "new-token-0123456789"
    write("a", old)
    now = [0.0]
    source = IdentitySource(IdentityTable.load(path), str(path), interval=5.0,
                            clock=lambda: now[0])
    write("b", new)
    assert source.table.by_token(new) is None  # not checked before the interval
    now[0] = 5.0
    assert source.table.by_token(new) == Identity("b", Role.ADMIN)
    assert source.table.by_token(old) is None  # rotated out
    path.write_text("not toml [")
    now[0] = 10.0
    assert source.table.by_token(new) == Identity("b", Role.ADMIN)  # kept
    path.unlink()
    now[0] = 15.0
    assert source.table.by_token(new) == Identity("b", Role.ADMIN)  # kept
    never = IdentitySource(source.table, str(path), interval=0.0, clock=lambda: now[0])
    write("c", old)
    now[0] = 100.0
    assert never.table.by_token(old) is None  # interval 0: read once, at start
