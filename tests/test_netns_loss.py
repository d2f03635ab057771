"""The chaos bench's packet-loss rule (``bench.chaos_faults.packet_loss``) measured: the same
nft ``numgen random mod 100 < N drop`` statements, on a host's input and output hooks, drop a
UDP echo's round trips at the rate the fault claims, (1 - N/100)^2 of them answered.

The fault's rate was chosen from this: a worker's lease (1.5 s, heartbeats every 0.3 s) lapses
only when a TCP segment of its stream is dropped on the way out with its tail-loss probe and
next three retransmissions (RTO 0.2, 0.4, 0.8 s), ~p^5 per heartbeat. No lease lapsed at 20 %
for two leases, nor at 50 % for three (quick chaos run); at 70 % (0.17 per heartbeat) most
rounds of three leases see one, which puts routes at stake for the stale-route check
(``bench.chaos_faults.LOSS_PERCENT``)."""

from __future__ import annotations

import math
import shutil
import sys
from collections.abc import Iterator

import pytest

from bench.chaos_faults import LOSS_PERCENT
from kvcoord import child_process
from tests.netns import Host, Network, unavailable

PORT = 50998
PROBES = 2000
# A packet the output hook drops fails its sendto with EPERM: the echo carries on past it.
ECHO = ("import socket,sys\n"
        "s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "s.bind(('0.0.0.0', int(sys.argv[1])))\n"
        "while True:\n"
        "    data,peer=s.recvfrom(64)\n"
        "    try: s.sendto(data, peer)\n"
        "    except PermissionError: pass\n")
# Sends n numbered probes (one every 0.5 ms, so no queue overflows), reads replies meanwhile
# and for a second after; prints how many distinct probes came back.
PROBE = ("import socket,sys,time\n"
         "dst=(sys.argv[1], int(sys.argv[2])); n=int(sys.argv[3])\n"
         "s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setblocking(False)\n"
         "seen=set()\n"
         "def drain():\n"
         "    while True:\n"
         "        try: seen.add(int(s.recv(64)))\n"
         "        except BlockingIOError: return\n"
         "for i in range(n):\n"
         "    s.sendto(str(i).encode(), dst); drain(); time.sleep(0.0005)\n"
         "end=time.monotonic()+1.0\n"
         "while time.monotonic()<end:\n"
         "    drain(); time.sleep(0.01)\n"
         "print(len(seen))\n")


def answered(src: Host, dst: Host, n: int) -> int:
    """How many of ``n`` UDP probes from ``src`` to ``dst``'s echo came back."""
    done = child_process.run(["ip", "netns", "exec", src.namespace, sys.executable, "-c", PROBE,
                           dst.ip, str(PORT), str(n)], capture_output=True, text=True,
                          timeout=60, check=True)
    return int(done.stdout)


def drop(percent: int) -> str:
    return f"numgen random mod 100 < {percent} drop"


@pytest.fixture
def pair() -> Iterator[tuple[Host, Host]]:
    if shutil.which("nft") is None:
        unavailable("nftables fault tests need `nft` (apt-get install nftables)")
    with Network() as net:
        a, b = net.add_host("a"), net.add_host("b")
        b.run([sys.executable, "-c", ECHO, str(PORT)])
        for _ in range(50):  # the echo listening
            if answered(a, b, 1):
                break
        else:
            raise AssertionError("b's echo never answered")
        yield a, b


@pytest.mark.parametrize("percent", sorted({20, LOSS_PERCENT}))
def test_the_loss_rule_answers_about_the_square_of_what_each_direction_passes(
        pair: tuple[Host, Host], percent: int) -> None:
    a, b = pair
    assert answered(a, b, PROBES) >= PROBES - 5  # without the rule: (nearly) every one
    b.add_rules(inbound=[f'iifname "eth0" {drop(percent)}'],
                outbound=[f'oifname "eth0" {drop(percent)}'])
    got = answered(a, b, PROBES)
    p = (1 - percent / 100) ** 2
    spread = math.sqrt(PROBES * p * (1 - p))  # binomial standard deviation (~20 probes)
    assert abs(got - PROBES * p) <= 5 * spread, (got, PROBES * p, spread)
    b.clear_rules()
    assert answered(a, b, PROBES) >= PROBES - 5  # healed
