"""``Host.add_rules`` / ``clear_rules`` (tests/netns.py): real nftables rules inside a namespace,
as the chaos bench's asymmetric-partition and packet-loss faults use them. A rule drops only the
packets it names (one direction: b's connections to a's server, while a still reaches b), and
clearing the rules heals the pair."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator

import pytest

from kvcoord import child_process
from tests.netns import Host, NetnsError, Network, unavailable

PORT = 50999
SERVE = ("import socket,sys\n"
         "s=socket.create_server(('0.0.0.0', int(sys.argv[1])))\n"
         "while True:\n"
         "    c,_=s.accept(); c.sendall(b'ok'); c.close()\n")
CONNECT = ("import socket,sys\n"
           "try:\n"
           "    c=socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5)\n"
           "    print(c.recv(2).decode())\n"
           "except OSError:\n"
           "    print('dropped')\n")


def reaches(src: Host, dst: Host) -> bool:
    """Whether a TCP connection from ``src`` to ``dst``'s server is answered."""
    done = child_process.run(["ip", "netns", "exec", src.namespace, sys.executable, "-c", CONNECT,
                           dst.ip, str(PORT)], capture_output=True, text=True, timeout=10)
    return done.stdout.strip() == "ok"


@pytest.fixture
def pair() -> Iterator[tuple[Host, Host]]:
    if shutil.which("nft") is None:
        unavailable("nftables fault tests need `nft` (apt-get install nftables)")
    with Network() as net:
        a, b = net.add_host("a"), net.add_host("b")
        for host in (a, b):
            host.run([sys.executable, "-c", SERVE, str(PORT)])
        for src, dst in ((a, b), (b, a)):  # both servers listening
            for _ in range(50):
                if reaches(src, dst):
                    break
            else:
                raise AssertionError(f"{dst.name}'s server never answered")
        yield a, b


def test_rules_drop_only_what_they_name_and_clearing_heals(pair: tuple[Host, Host]) -> None:
    a, b = pair
    a.add_rules(outbound=[f"ip daddr {b.ip} drop"])
    assert not reaches(a, b)  # a's SYN to b is dropped
    assert reaches(b, a) is False  # a's SYN-ACK to b is dropped too: TCP needs both ways
    a.clear_rules()
    a.add_rules(inbound=[f"ip saddr {b.ip} tcp dport {PORT} drop"])  # b -> a's server only
    assert reaches(a, b) and not reaches(b, a)
    a.clear_rules()
    a.clear_rules()  # a no-op without the table
    assert reaches(a, b) and reaches(b, a)


def test_a_bad_rule_is_refused_with_nfts_message(pair: tuple[Host, Host]) -> None:
    a, _ = pair
    with pytest.raises(NetnsError, match="nft in a"):
        a.add_rules(outbound=["no such statement"])
