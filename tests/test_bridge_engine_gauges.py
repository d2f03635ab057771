"""A bridge reads its engine's capacity: vLLM's /metrics text (as vLLM 0.32 writes it) read
into free and total pages and request counts, exported as the bridge's metrics, and read only
when the bridge's own /metrics is scraped."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from worker.bridge.bridge import Bridge, BridgeConfig
from worker.bridge.engine_gauges import Gauges, parse_vllm

# Lines of a real vLLM 0.32 CPU engine's /metrics (the engines bench), cache_config_info cut to
# the labels that matter plus two that look alike.
RANK0 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{_block_size_resolved="True",block_size="32",engine="0",\
num_cpu_blocks="None",num_gpu_blocks="1515",num_gpu_blocks_override="None"} 1.0
"""
RANK1 = """\
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="1515"} 1.0
"""


def test_one_engine_reads_as_its_blocks_usage_and_requests() -> None:
    gauges = parse_vllm(RANK0)
    assert gauges == Gauges(total_blocks=1515, block_tokens=32, usage=0.25, running=3,
                            waiting=2)
    # 16-token pages: two per block; a quarter of the blocks held, whole blocks free.
    assert gauges.pages(16) == (1136 * 2, 1515 * 2)
    assert gauges.pages(32) == (1136, 1515)


def test_data_parallel_ranks_add_up_and_share_their_usage() -> None:
    gauges = parse_vllm(RANK0 + RANK1)
    assert gauges == Gauges(total_blocks=3030, block_tokens=32, usage=0.5, running=4,
                            waiting=2)
    assert gauges.pages(16) == (1515 * 2, 3030 * 2)


def test_metrics_without_the_cache_size_read_as_nothing() -> None:
    assert parse_vllm("vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n") is None
    assert parse_vllm("") is None


def _bridge(engine_url: str, engine: str = "vllm") -> Bridge:
    return Bridge(BridgeConfig(events="tcp://127.0.0.1:1", coordinator="127.0.0.1:1",
                               worker_id="vllm-0", worker_address="127.0.0.1:2",
                               engine_url=engine_url, engine=engine, page_size=16,
                               engine_block_size=32))


@contextmanager
def vllm_metrics(text: str) -> Iterator[tuple[str, list[str]]]:
    """A loopback HTTP server answering ``/metrics`` with ``text``: its base URL, and the
    paths it was asked for (a real engine's /metrics: tests_vllm/test_vllm_engine.py)."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def test_the_gauges_are_read_at_each_scrape_and_the_heartbeat_keeps_the_registrations_capacity(
) -> None:
    from prometheus_client import generate_latest

    from worker.bridge.main import bridge_registry

    with vllm_metrics(RANK0 + RANK1) as (url, asked):
        bridge = _bridge(url)
        assert bridge.gauges is not None and bridge.gauges.metrics_url == f"{url}/metrics"
        registry = bridge_registry(bridge)
        assert asked == []  # nothing is read until someone scrapes the bridge
        text = generate_latest(registry).decode()
        assert asked == ["/metrics"]
        assert "kvcoord_bridge_engine_free_pages 3030.0" in text
        assert "kvcoord_bridge_engine_total_pages 6060.0" in text
        assert 'kvcoord_bridge_engine_requests{state="waiting"} 2.0' in text
        generate_latest(registry)
        assert asked == ["/metrics", "/metrics"]  # one engine read per scrape
    # Not sent as load (engine_gauges says why): the registration's capacity stands.
    beat = bridge.heartbeat()
    assert (beat.free_pages, beat.total_pages, beat.running_requests) == (0, 0, 0)
    # The engine gone: a scrape exports no engine gauges (and says so once in the log).
    text = generate_latest(registry).decode()
    assert "kvcoord_bridge_engine_total_pages" not in text and bridge.gauges.failures == 1


def test_without_an_engine_url_or_for_sglang_nothing_is_read() -> None:
    assert _bridge("").gauges is None
    assert _bridge("http://127.0.0.1:3", engine="sglang").gauges is None
