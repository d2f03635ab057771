"""The command line with auth on: servers take --auth-file, clients a token file (or
KVCOORD_TOKEN), and every credential problem is one clear line with its exit status."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcoord import child_process
from kvcoord.demo import free_port, start_coordinator_process, stop_process, wait_healthy
from tests.auth_fixtures import IdentityFile, write_identities
from tests.test_cli import KVCOORD, run_cli


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[str, IdentityFile, Path]]:
    identities = write_identities(tmp_path)
    port = free_port()
    process = start_coordinator_process(port, "--auth-file", str(identities.path))
    target = f"127.0.0.1:{port}"
    try:
        wait_healthy(target, process)  # health stays open: probes carry no credentials
        yield target, identities, tmp_path
    finally:
        stop_process(process)


def test_clients_authenticate_with_a_token_file_or_the_environment(
    secured: tuple[str, IdentityFile, Path],
) -> None:
    target, identities, tmp = secured
    anonymous = run_cli("policy", "show", "--coordinator", target)
    assert anonymous.returncode == 1
    assert "UNAUTHENTICATED" in anonymous.stderr and "no credentials" in anonymous.stderr
    token_file = tmp / "admin.token"
    token_file.write_text(identities.tokens["admin"] + "\n")
    status = run_cli("status", "--coordinator", target, "--json", "--token-file", str(token_file))
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["workers"] == []
    by_env = child_process.run(
        [*KVCOORD, "route", "--coordinator", target, "--random", "32", "--lookup", "--json"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        env={**os.environ, "KVCOORD_TOKEN": identities.tokens["sched-a"]},
    )
    assert by_env.returncode == 0, by_env.stderr
    assert json.loads(by_env.stdout)["matches"] == {}
    scheduler_file = tmp / "sched.token"
    scheduler_file.write_text(identities.tokens["sched-a"])
    denied = run_cli("policy", "begin", "--coordinator", target, "--expected-version", "0",
                     "--token-file", str(scheduler_file))
    assert denied.returncode == 1
    assert "PERMISSION_DENIED" in denied.stderr
    assert identities.tokens["sched-a"] not in denied.stderr + denied.stdout


def test_credential_files_that_cannot_be_used_exit_2_naming_the_file(tmp_path: Path) -> None:
    missing = run_cli("status", "--token-file", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "nope" in missing.stderr
    spaced = tmp_path / "spaced.token"
    spaced.write_text("two words")
    inner = run_cli("status", "--token-file", str(spaced))
    assert inner.returncode == 2 and "spaced.token" in inner.stderr
    assert "two words" not in inner.stderr  # the token's content is never echoed
    bad = tmp_path / "ids.toml"
    bad.write_text('[[identity]]\nname = "x"\nrole = "root"\ntoken = "0123456789abcdef"\n')
    for command in ("coordinator", "worker"):
        refused = run_cli(command, "--listen", "127.0.0.1:0", "--auth-file", str(bad))
        assert refused.returncode == 2, refused.stderr
        assert "auth_file" in refused.stderr and "role must be one of" in refused.stderr
    half = run_cli("coordinator", "--tls-cert", str(bad))
    assert half.returncode == 2 and "tls_cert and tls_key must be given together" in half.stderr
    negative = run_cli("coordinator", "--listen", "127.0.0.1:0", "--rate-limit-per-s", "-5")
    assert negative.returncode == 2 and "rate_limit_per_s must be >= 0" in negative.stderr
    no_ca = run_cli("status", "--tls-cert", str(bad), "--tls-key", str(bad))
    assert no_ca.returncode == 2 and "need --tls-ca" in no_ca.stderr


def test_identity_new_mints_a_token_whose_printed_entry_authenticates_it(tmp_path: Path) -> None:
    from coordinator.rpc.identities import Identity, IdentityTable, Role

    token_file = tmp_path / "w0.token"
    made = run_cli("identity", "new", "--name", "w0", "--role", "worker", "--worker-id",
                   "kvcoord-worker-0", "--token-file", str(token_file))
    assert made.returncode == 0, made.stderr
    token = token_file.read_text().strip()
    assert token not in made.stdout  # the entry carries the digest only
    assert token_file.stat().st_mode & 0o777 == 0o600
    identities = tmp_path / "identities.toml"
    identities.write_text(made.stdout)
    table = IdentityTable.load(identities)
    assert table.by_token(token) == Identity("w0", Role.WORKER, "", "kvcoord-worker-0")
    again = run_cli("identity", "new", "--name", "w1", "--role", "admin", "--token-file",
                    str(token_file))
    assert again.returncode == 2 and "File exists" in again.stderr
    assert token_file.read_text().strip() == token  # never overwritten
    no_worker_id = run_cli("identity", "new", "--name", "w1", "--role", "worker",
                           "--token-file", str(tmp_path / "x"))
    assert no_worker_id.returncode == 2 and "needs a worker_id" in no_worker_id.stderr
    assert not (tmp_path / "x").exists()  # refused before anything was written
