"""Hosts as Linux network namespaces on a private bridge, for multi-host fault tests.

    with Network() as net:                    # skips the test unless root with ``ip netns``
        db, c1 = net.add_host("db"), net.add_host("c1")
        proc = c1.run(["python", "-m", "kvcoord.cli", "coordinator", ...], env=...)
        c1.link_down()                         # cut c1 off the bridge; ``link_up`` heals it

Layout: one bridge ``kvcbr-<uid>`` in the root namespace holding ``10.251.<n>.1/24``; per host
a namespace ``kvc-<uid>-<name>`` whose ``eth0`` (``10.251.<n>.<10+i>/24``) is one end of a veth
pair, the other end (``kv<uid>h<i>``) enslaved to the bridge. The test process stays in the
root namespace and reaches every host through the bridge. ``<uid>`` is fresh per ``Network``,
so parallel or leftover runs never collide, and ``<n>`` is a /24 no interface uses yet.

Teardown (``close``, also on failure half-way through ``add_host``) stops every process group
``run`` started, host by host in the reverse order of ``add_host`` (SIGTERM, SIGKILL after a
grace period), SIGKILLs anything else still inside this network's namespaces, then deletes the
namespaces (which deletes their veth ends, and so the pairs) and the bridge. It touches only
names carrying this run's uid.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, NoReturn

import pytest

from kvcoord import child_process

SKIP_REASON = "network namespace tests need root and iproute2 (ip netns)"
PREFIX = "10.251"
STOP_GRACE_S = 5.0
FAULT_TABLE = "kvcoord_faults"  # the nftables table ``Host.add_rules`` writes in a namespace


def in_ci() -> bool:
    """True under CI (``CI=true``, as CI services and ``.ci/run``'s callers set it)."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1"}


def unavailable(reason: str) -> NoReturn:
    """A capability the namespace tests need is missing: skip the test, except under CI, where
    they must run, so the missing capability fails it instead of hiding it."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: the namespace tests must run, not skip)")
    pytest.skip(reason)


class NetnsError(RuntimeError):
    """An ``ip`` command failed (message: the command and its stderr)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` in the root namespace; NetnsError with its stderr when it fails."""
    done = child_process.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _used_subnets() -> set[int]:
    """Third octets of the 10.251.x.0/24 networks some interface or route already uses."""
    used = set()
    for line in (ip("-o", "-4", "addr", "show").stdout + ip("-4", "route").stdout).splitlines():
        for word in line.split():
            if word.startswith(f"{PREFIX}."):
                used.add(int(word.split(".")[2].split("/")[0]))
    return used


@dataclass
class Host:
    """One namespace on the bridge. ``ip`` is its address; ``run`` starts a process in it."""

    name: str
    namespace: str
    ip: str
    bridge_port: str
    """The veth end on the bridge (root namespace): setting it down cuts this host off."""
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None, *,
            stdout: IO[bytes] | int | None = subprocess.DEVNULL,
            stderr: IO[bytes] | int | None = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
        """``argv`` inside this host (``ip netns exec``, which execs it: same pid), in its own
        session (process group = pid), with ``env`` (default: the test's environment). Call it
        from the main thread: the parent-death signal follows the thread that started it."""
        process = child_process.start(
            ["ip", "netns", "exec", self.namespace, *argv], death_signal=signal.SIGKILL,
            env=dict(env or os.environ), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
        )
        self.processes.append(process)
        return process

    def kill(self, process: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGKILL,
             grace: float = STOP_GRACE_S) -> None:
        """Signal ``process``'s group and reap it (SIGKILL if it outlives ``grace``)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def link_down(self) -> None:
        """Cut the host's link (its bridge port): nothing reaches it or leaves it. Sockets stay
        open on both sides, as with a pulled cable."""
        ip("link", "set", self.bridge_port, "down")

    def link_up(self) -> None:
        ip("link", "set", self.bridge_port, "up")

    def add_rules(self, *, inbound: Sequence[str] = (), outbound: Sequence[str] = ()) -> None:
        """nftables rules inside this host (``inet`` table ``FAULT_TABLE``, created on first
        use): ``inbound`` on its input hook, ``outbound`` on its output hook, each an nft rule
        statement such as ``ip daddr 10.251.7.11 drop``. NetnsError (with nft's stderr) when
        ``nft`` refuses them or is missing."""
        table = f"inet {FAULT_TABLE}"
        script = [f"add table {table}",
                  f"add chain {table} input {{ type filter hook input priority 0; }}",
                  f"add chain {table} output {{ type filter hook output priority 0; }}"]
        script += [f"add rule {table} input {rule}" for rule in inbound]
        script += [f"add rule {table} output {rule}" for rule in outbound]
        self._nft("\n".join(script) + "\n")

    def clear_rules(self) -> None:
        """Remove every rule ``add_rules`` made here (the whole table); a no-op without one."""
        self._nft(f"add table inet {FAULT_TABLE}\ndelete table inet {FAULT_TABLE}\n")

    def _nft(self, script: str) -> None:
        if shutil.which("nft") is None:
            raise NetnsError("no `nft` command (apt-get install nftables)")
        done = child_process.run(["ip", "netns", "exec", self.namespace, "nft", "-f", "-"],
                              input=script, capture_output=True, text=True)
        if done.returncode != 0:
            raise NetnsError(f"nft in {self.name}: {done.stderr.strip()}\n{script}")

    def stop_all(self) -> None:
        """SIGTERM every process group ``run`` started, SIGKILL what outlives the grace, then
        SIGKILL whatever else still runs in the namespace."""
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGCONT)  # a stopped process ignores TERM
                    os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            self.kill(process, signal.SIGTERM)
        for pid in ip("netns", "pids", self.namespace, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.kill(int(pid), signal.SIGKILL)


class Network:
    """A bridge plus hosts; a context manager that skips the test where namespaces cannot be
    made (not root, no ``ip``, no CAP_SYS_ADMIN in a container) and always tears down."""

    def __init__(self) -> None:
        self.uid = secrets.token_hex(3)
        self.bridge = f"kvcbr-{self.uid}"
        self.subnet = 0
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._bridge_made = False

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (where the test process connects from)."""
        return f"{PREFIX}.{self.subnet}.1"

    def __enter__(self) -> Network:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def open(self) -> None:
        if not sys.platform.startswith("linux") or shutil.which("ip") is None:
            unavailable(f"{SKIP_REASON}: no `ip` command (apt-get install iproute2)")
        if os.geteuid() != 0:
            unavailable(f"{SKIP_REASON}: not running as root")
        probe = f"kvc-{self.uid}-probe"
        done = ip("netns", "add", probe, check=False)
        if done.returncode != 0:
            unavailable(f"{SKIP_REASON}: `ip netns add` failed: {done.stderr.strip()}")
        ip("netns", "del", probe, check=False)
        free = sorted(set(range(100, 250)) - _used_subnets())
        if not free:
            raise NetnsError(f"no free {PREFIX}.x.0/24 subnet")
        self.subnet = free[secrets.randbelow(len(free))]
        # Why nf_call_*tables 0: with br_netfilter loaded, the host's iptables FORWARD rules
        # (Docker's DROP policy, say) would otherwise filter traffic between our hosts.
        quiet = ("nf_call_iptables", "0", "nf_call_ip6tables", "0", "nf_call_arptables", "0")
        if ip("link", "add", self.bridge, "type", "bridge", *quiet, check=False).returncode:
            ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def add_host(self, name: str) -> Host:
        """A new namespace with ``lo`` up and ``eth0`` on the bridge at the next address."""
        index = len(self.hosts)
        namespace, port = f"kvc-{self.uid}-{name}", f"kv{self.uid}h{index}"
        address = f"{PREFIX}.{self.subnet}.{10 + index}"
        ip("netns", "add", namespace)
        self._namespaces.append(namespace)
        ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        ip("link", "set", port, "master", self.bridge)
        ip("link", "set", port, "up")
        inside = ("netns", "exec", namespace, "ip")
        ip(*inside, "link", "set", "lo", "up")
        ip(*inside, "addr", "add", f"{address}/24", "dev", "eth0")
        ip(*inside, "link", "set", "eth0", "up")
        host = Host(name, namespace, address, port)
        self.hosts[name] = host
        return host

    def close(self) -> None:
        """Idempotent; errors while deleting are ignored (the next name is fresh anyway)."""
        for host in reversed(self.hosts.values()):  # clients before the servers they need
            host.stop_all()
        for namespace in self._namespaces:
            ip("netns", "del", namespace, check=False)
        self._namespaces.clear()
        for host in self.hosts.values():  # gone with their namespaces unless that failed
            ip("link", "del", host.bridge_port, check=False)
        if self._bridge_made:
            ip("link", "del", self.bridge, check=False)
            self._bridge_made = False
        self.hosts.clear()
