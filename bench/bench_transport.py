"""``kvcoord bench transport``: the coordinator's CPU per event batch on each event transport,
gRPC streams (today's, the same-run baseline) against a broker read in bulk (issue 29).

Per case and fleet size, three processes: the consumer (bench/transport_consumer.py: the
coordinator's side, parsing and acking every batch, without the index) pinned to core 0, the
producers (bench/transport_producer.py: ``workers`` emulated workers, each publishing a
serialized ``SyncRequest`` of 64 keys stored and 64 removed 5 times a second) pinned to core 1,
and the broker where there is one (a redis-server this bench starts, pinned to core 1 beside
the producers; the NATS server already running at 127.0.0.1:4222, left where it runs). CPU is
read per process (``getrusage`` in the consumer, /proc for the broker), so the producers' work
never enters the consumer's figures.

Cases: ``grpc`` (one stream and connection per worker, an ack per batch; ``grpc_one_connection``:
every stream on one connection, as bench fleet's generator has them); ``redis*`` (one
stream, an ``XADD`` per batch; ``XREADGROUP COUNT 512`` and one ``XACK`` per read), with
persistence off or AOF fsync every second, redis-py's pure-Python reply parser or hiredis's
(skipped where hiredis is not installed: it is no dependency of the project); and
``nats_jetstream*`` (file storage, ``fetch(512)``, ack-all per fetch; skipped with its reason
where no JetStream server answers). A ``_linger`` case's consumer pauses ``LINGER_MS`` after a
read that was not full, so reads grow with the pause instead of with the load.

Each reports the consumer's CPU per batch and per read (a gRPC message, an ``XREADGROUP``
reply, a ``fetch``), its CPU share at the rate reached, the latency from publish to parse
(p50/p99), the broker's CPU per batch, whether every batch published arrived (``delivered``)
and ``host_other_cpu_share``: cores kept busy meanwhile by processes not of the case (another
job on the host inflates CPU per operation and latency; such a run is suspect). At 1,024
workers the rate is the fleet's: 5,120 batches a second.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench.transport_consumer import cpu_seconds
from kvcoord import child_process
from kvcoord.tables import render_table
from tests.redis_server import RedisServer, redis_server_available

CONSUMER_CORE, PRODUCER_CORE = "0", "1"
NATS_URL = "nats://127.0.0.1:4222"
RATE = 5.0
"""Batches a second per worker (an engine's cadence, as in bench fleet)."""
BASELINE = "grpc"
SETUP_ALLOWANCE_S = 60.0
"""How long the producers may take to connect before the consumer gives up waiting."""


@dataclass(frozen=True, slots=True)
class Case:
    transport: str
    """The consumer's and the producers' key (CONSUMERS, SENDERS)."""
    durability: str
    """What a crash loses once the consumer or broker has acknowledged a batch."""
    appendfsync: str | None = None
    """Redis only: the AOF's fsync policy; None: no persistence."""
    parser: str = "python"
    """Redis only: the consumer's reply parser, ``python`` (redis-py's) or ``hiredis``."""
    linger_ms: float = 0.0
    """Brokers: the consumer's pause after a bulk read that was not full."""
    one_connection: bool = False
    """gRPC only: every worker's stream on one connection (bench fleet's way)."""


GRPC = "consumer memory only (acked once parsed)"
MEMORY_ONLY = "broker memory only (persistence off)"
EVERYSEC = "AOF, fsync every 1 s (a host crash loses ~1 s)"
JETSTREAM = "file store; PubAck before fsync (server default: fsync every 2 min)"
LINGER_MS = 10.0
CASES: dict[str, Case] = {
    "grpc": Case("grpc", GRPC),
    "grpc_one_connection": Case("grpc", GRPC, one_connection=True),
    "redis": Case("redis", MEMORY_ONLY),
    "redis_aof_everysec": Case("redis", EVERYSEC, "everysec"),
    "redis_hiredis": Case("redis", MEMORY_ONLY, parser="hiredis"),
    "redis_hiredis_aof_everysec": Case("redis", EVERYSEC, "everysec", parser="hiredis"),
    "redis_hiredis_aof_everysec_linger": Case("redis", EVERYSEC, "everysec", parser="hiredis",
                                              linger_ms=LINGER_MS),
    "nats_jetstream": Case("nats", JETSTREAM),
    "nats_jetstream_linger": Case("nats", JETSTREAM, linger_ms=LINGER_MS),
}

FULL_ONLY = {"grpc_one_connection", "redis_hiredis", "redis_hiredis_aof_everysec",
             "nats_jetstream_linger"}
"""Cases the quick form leaves out."""
QUICK_WORKERS, QUICK_SECONDS = 64, 0.6  # 3 batches each


def _pinning() -> bool:
    return shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2


def _pinned(core: str, argv: list[str]) -> list[str]:
    return ["taskset", "-c", core, *argv] if _pinning() else argv


def _nats_server_pid() -> int | None:
    """The pid of the one nats-server process of this host, if exactly one is visible."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "nats-server":
                found.append(int(entry.name))
        except OSError:
            continue
    return found[0] if len(found) == 1 else None


def _lacking(case: Case) -> str | None:
    """What this host lacks for ``case`` (a NATS server not answering is found later, by the
    consumer), or None."""
    if case.transport == "redis" and not redis_server_available():
        return "redis-server is not installed"
    if case.parser == "hiredis" and importlib.util.find_spec("hiredis") is None:
        return "hiredis is not installed (pip install hiredis): redis-py's C reply parser"
    return None


@contextmanager
def _broker(case: Case) -> Iterator[tuple[str, int | None]]:
    """(address, the broker's pid or None); a redis-server of its own, pinned."""
    if case.transport == "grpc":
        yield "", None
    elif case.transport == "nats":
        yield NATS_URL, _nats_server_pid()
    else:
        with RedisServer(appendonly=case.appendfsync is not None,
                         appendfsync=case.appendfsync or "everysec") as server:
            with redis.Redis.from_url(server.url) as client:
                pid = int(client.info("server")["process_id"])
            if _pinning():
                child_process.run(["taskset", "-a", "-p", "-c", PRODUCER_CORE, str(pid)],
                               check=True, stdout=subprocess.DEVNULL)
            yield server.url, pid


def _host_busy_s() -> float:
    """CPU seconds the host's cores have spent busy (not idle, not waiting on I/O)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _, _, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _ours_s(case: Case) -> float:
    """CPU seconds of this process, its children once reaped (consumer, producers,
    redis-server) and, for NATS, the server's."""
    own, children = (resource.getrusage(who)
                     for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    pid = _nats_server_pid() if case.transport == "nats" else None
    return total + (cpu_seconds(pid) if pid else 0.0)


def _last_json(text: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(text.strip().splitlines()[-1])
    return result


def run_case(name: str, workers: int, *, seconds: float = 10.0) -> dict[str, Any]:
    """One case at ``workers`` workers for ``seconds``: the consumer ready, the producers run
    to the end, the consumer's figures once every batch arrived (or its wait ran out)."""
    case = CASES[name]
    batches = max(1, round(seconds * RATE))
    expected = workers * batches
    out: dict[str, Any] = {
        "transport": case.transport, "durability": case.durability, "workers": workers,
        "rate_target": workers * RATE, "pinned": _pinning(),
        "broker_pinned": case.transport == "redis" and _pinning(),
        "redis_parser": case.parser if case.transport == "redis" else None}
    lacking = _lacking(case)
    if lacking is not None:
        return out | {"skipped": lacking}
    if case.parser == "hiredis":
        out["hiredis_version"] = importlib.metadata.version("hiredis")
    began, busy_before, ours_before = time.monotonic(), _host_busy_s(), _ours_s(case)
    with _broker(case) as (address, broker_pid):
        stream = f"kvbench{os.getpid()}{name.replace('_', '')}{workers}"
        wait_s = SETUP_ALLOWANCE_S + seconds + 15.0
        consumer_config = {"transport": case.transport, "address": address, "name": stream,
                           "workers": workers, "expected": expected, "wait_s": wait_s,
                           "broker_pid": broker_pid, "parser": case.parser,
                           "linger_ms": case.linger_ms}
        consumer = child_process.start(
            _pinned(CONSUMER_CORE, [sys.executable, "-m", "bench.transport_consumer",
                                    json.dumps(consumer_config)]),
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        try:
            line = consumer.stdout.readline() if consumer.stdout is not None else ""
            first = json.loads(line or '{"skipped": "the consumer exited before ready"}')
            if "skipped" in first:
                consumer.wait(timeout=30)
                return out | first
            producer_config = {"transport": case.transport, "address": first["ready"],
                               "name": stream, "workers": workers, "batches": batches,
                               "rate": RATE, "one_connection": case.one_connection}
            produced = child_process.run(
                _pinned(PRODUCER_CORE, [sys.executable, "-m", "bench.transport_producer",
                                        json.dumps(producer_config)]),
                capture_output=True, text=True, timeout=wait_s, stdin=subprocess.DEVNULL)
            if produced.returncode != 0:
                state = consumer.poll()
                raise RuntimeError(
                    f"the {name} producers failed (the consumer "
                    f"{'is running' if state is None else f'exited {state}'}): "
                    f"{produced.stderr[-3000:]}")
            remaining, _ = consumer.communicate(timeout=wait_s)
        finally:
            if consumer.poll() is None:
                consumer.kill()
                consumer.wait()
        if consumer.returncode != 0:
            raise RuntimeError(f"the {name} consumer exited {consumer.returncode}")
    producer = _last_json(produced.stdout)
    measured = _last_json(remaining)
    acked = producer.get("acks", measured["batches"])
    delivered = producer["sent"] == expected == measured["batches"] == acked
    # Other work on the host (cores busy with processes not of this case) inflates CPU per
    # operation and latency: a case run beside it is suspect.
    others = (_host_busy_s() - busy_before) - (_ours_s(case) - ours_before)
    return out | {"consumer": measured, "producer": producer, "delivered": delivered,
                  "host_other_cpu_share": max(0.0, others) / (time.monotonic() - began)}


def summarize(measured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Print the comparison table; per case, the consumer's CPU per batch against gRPC's at
    the same fleet size (same run)."""
    rows, ratios = [], {}
    for name, result in measured.items():
        if "skipped" in result:
            rows.append([name, str(result["workers"]), "skipped: " + result["skipped"]])
            continue
        got = result["consumer"]
        base = measured.get(f"{BASELINE}_{result['workers']}", {}).get("consumer")
        ratio = base["cpu_us_per_batch"] / got["cpu_us_per_batch"] if base else None
        ratios[name] = ratio
        broker = got.get("broker_cpu_us_per_batch")
        rows.append([
            name, str(result["workers"]), f"{result['rate_target']:,.0f} / {got['rate']:,.0f}",
            f"{got['cpu_us_per_batch']:.1f}", f"{got['batches_per_read']:.1f}",
            f"{got['cpu_share']:.3f}", f"{ratio:.2f}x" if ratio else "-",
            f"{got['latency_p50_ms']:.2f} / {got['latency_p99_ms']:.2f}",
            "-" if broker is None else f"{broker:.1f}", str(result["delivered"]),
            f"{result['host_other_cpu_share']:.2f}", result["durability"]])
    print("\ntransport: the consumer's CPU per event batch (the coordinator's side)")
    print(render_table(
        ["case", "workers", "batches/s target / reached", "consumer CPU us/batch",
         "batches/read", "consumer CPU share", "gRPC us / this", "latency p50 / p99 ms",
         "broker CPU us/batch", "delivered", "other load (cores)", "durability"], rows))
    return {"grpc_cpu_per_batch_over_this": ratios}


def transport_steps(quick: bool) -> list[tuple[str, Callable[[], Any]]]:
    """Every case at each size, then the comparison table. Quick (``make smoke``, < 20 s):
    ``QUICK_WORKERS`` for ``QUICK_SECONDS``, less the ``FULL_ONLY`` cases (each runs code
    another quick case runs)."""
    sizes = [QUICK_WORKERS] if quick else [256, 1024]
    seconds = QUICK_SECONDS if quick else 10.0
    names = [n for n in CASES if not (quick and n in FULL_ONLY)]
    measured: dict[str, dict[str, Any]] = {}

    def step(name: str, workers: int) -> Callable[[], Any]:
        def measure() -> dict[str, Any]:
            measured[f"{name}_{workers}"] = run_case(name, workers, seconds=seconds)
            return measured[f"{name}_{workers}"]
        return measure

    steps = [(f"{name}_{n}", step(name, n)) for n in sizes for name in names]
    return [*steps, ("comparison", lambda: summarize(measured))]


def _cases(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in results.items() if k != "comparison"}


def transport_targets(results: dict[str, Any]) -> list[list[str]]:
    """Per case that ran: the rate reached (>= 95% of the target) and, beside gRPC, a lower
    consumer CPU per batch at the same fleet size."""
    rows = []
    for name, result in _cases(results).items():
        if "skipped" in result:
            continue
        got = result["consumer"]
        reached = got["rate"] / result["rate_target"]
        rows.append([f"rate reached ({name})", ">= 95% of target", f"{reached:.0%}",
                     "met" if reached >= 0.95 else "MISSED"])
        ratio = results.get("comparison", {}).get("grpc_cpu_per_batch_over_this", {}).get(name)
        if ratio is not None and result["transport"] != BASELINE:
            rows.append([f"consumer CPU per batch below gRPC's ({name})", "gRPC / this > 1",
                         f"{ratio:.2f}x", "met" if ratio > 1 else "MISSED"])
    return rows


def transport_invariants(results: dict[str, Any]) -> list[str]:
    """Every case that ran delivered every batch published (and gRPC acked each)."""
    broken = []
    for name, result in _cases(results).items():
        if "skipped" not in result and not result["delivered"]:
            broken.append(f"{name}: {result['consumer']['batches']} of "
                          f"{result['consumer']['expected']} batches arrived "
                          f"({result['producer']['sent']} sent)")
    return broken
