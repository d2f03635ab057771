"""``kvcoord epp`` spoken to as Envoy speaks to it (ext_proc over gRPC, the ``xds-protos``
stubs), against a real coordinator and two reference workers: the pick is in the
``x-gateway-destination-endpoint`` header and in ``envoy.lb`` metadata; the subset hint is
honoured; a stream that ends before its body is counted and leaves the picker serving; gRPC
health answers for liveness, readiness and the ext_proc service."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcoord import child_process
from kvcoord.epp.picker import endpoint_of
from kvcoord.epp.protocol import DESTINATION_HEADER, SUBSET_HEADER, SUBSET_NAMESPACE
from kvcoord.fleet_procs import free_port
from tests.cli_refusals import assert_refused_in_one_line
from tests.coordinator_fixtures import eventually
from tests.test_epp_envoy import picker_for
from tests.test_gateway import FIRST, MODEL, running_fleet


def headers(path: str, *, end: bool = False) -> ProcessingRequest:
    pairs = {":method": "POST", ":path": path, "content-type": "application/json"}
    return ProcessingRequest(request_headers=HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode())
                                   for k, v in pairs.items()]), end_of_stream=end))


def with_subset(message: ProcessingRequest, endpoints: list[str]) -> ProcessingRequest:
    hint = Struct()
    hint.update({SUBSET_HEADER: endpoints})
    message.metadata_context.CopyFrom(Metadata(filter_metadata={SUBSET_NAMESPACE: hint}))
    return message


def body(payload: object) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=json.dumps(payload).encode(),
                                                   end_of_stream=True))


async def exchange(port: int, messages: list[ProcessingRequest]) -> list[ProcessingResponse]:
    """Send ``messages`` on one stream, then close it; every answer."""
    async def sent() -> AsyncIterator[ProcessingRequest]:
        for message in messages:
            yield message

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return [r async for r in ExternalProcessorStub(channel).Process(sent())]


def destination(response: ProcessingResponse) -> tuple[str, str]:
    """(the header's value, the ``envoy.lb`` metadata's value)."""
    mutation = response.request_body.response.header_mutation.set_headers
    header = {h.header.key: h.header.raw_value.decode() for h in mutation}[DESTINATION_HEADER]
    meta = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    return header, meta[DESTINATION_HEADER].string_value


async def test_the_pick_is_in_the_header_and_the_metadata_and_the_subset_is_honoured() -> None:
    async with running_fleet() as fleet, picker_for(fleet) as picker:
        endpoints = {w.worker_id: endpoint_of(f"http://127.0.0.1:{w.http_port}")
                     for w in fleet.workers}
        request = {"model": MODEL, "messages": FIRST, "max_tokens": 2}
        answers = await exchange(picker.port, [headers("/v1/chat/completions"), body(request)])
        assert answers[0].HasField("request_headers")  # buffered: headers answered at once
        header, meta = destination(answers[1])
        assert header == meta and header in endpoints.values()
        # Only w1 is in the gateway's subset: every pick is w1, whatever is cached where.
        for i in range(4):
            prompt = {**request, "messages": [{"role": "user", "content": f"subset {i}"}]}
            answers = await exchange(picker.port, [
                with_subset(headers("/v1/chat/completions"), [endpoints["w1"]]), body(prompt)])
            assert destination(answers[1]) == (endpoints["w1"], endpoints["w1"])
        # A subset naming no engine the picker knows: 503, not a pick outside it.
        answers = await exchange(picker.port, [
            with_subset(headers("/v1/chat/completions"), ["10.9.9.9:80"]), body(request)])
        assert answers[-1].immediate_response.status.code == 503


async def test_a_stream_ended_before_its_body_is_counted_and_the_picker_serves_on() -> None:
    async with running_fleet() as fleet, picker_for(fleet) as picker:
        answers = await exchange(picker.port, [headers("/v1/chat/completions")])
        assert len(answers) == 1 and answers[0].HasField("request_headers")
        metrics = picker.picker.metrics
        await eventually(lambda: _async(metrics.picks.labels("ended_before_body")._value.get()
                                        == 1), what="the early end counted")
        request = {"model": MODEL, "messages": FIRST, "max_tokens": 2}
        answers = await exchange(picker.port, [headers("/v1/chat/completions"), body(request)])
        assert destination(answers[1])[0]
        # An unknown path is refused at once, as JSON.
        answers = await exchange(picker.port, [headers("/v1/embeddings"), body(request)])
        refusal = answers[-1].immediate_response
        assert refusal.status.code == 404
        assert json.loads(refusal.body)["error"]["code"] == "not_found"


async def test_grpc_health_answers_for_liveness_readiness_and_the_service() -> None:
    async with running_fleet() as fleet, picker_for(fleet) as picker, \
            grpc.aio.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)

        async def status(service: str) -> int:
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            return int(answer.status)

        serving = health_pb2.HealthCheckResponse.SERVING
        await eventually(lambda: _is(status("readiness"), serving), what="ready")
        assert await status("liveness") == serving
        assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == serving


async def _async(value: bool) -> bool:
    return value


async def _is(answer: object, expected: int) -> bool:
    return await answer == expected  # type: ignore[misc]


@pytest.mark.parametrize(("flags", "says"), [
    (["--tokenizer", "/nonexistent"], "tokenizer: tokenizer directory '/nonexistent'"),
    (["--listen", "nowhere"], "listen must be HOST:PORT"),
    (["--max-body-bytes", "0"], "max_body_bytes must be > 0"),
    (["--drain-wait-ms", "0"], "drain_wait_ms must be > 0"),
    (["--model", ""], "model must not be empty"),
    (["--coordinator", "127.0.0.1:1", "--embed-coordinator", "127.0.0.1:0"],
     "give --coordinator (route through a coordinator elsewhere) or --embed-coordinator"),
])
def test_kvcoord_epp_refuses_bad_settings_in_one_line(flags: list[str], says: str) -> None:
    assert_refused_in_one_line("epp", flags, says)


def test_kvcoord_epp_logs_json_lines_at_its_log_level(tmp_path: Path) -> None:
    """As every other kvcoord server: JSON lines on stderr (not a terminal here), and nothing
    below ``KVCOORD_LOG_LEVEL``."""
    log = tmp_path / "epp.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCOORD_")}
    with log.open("wb") as sink:
        process = child_process.start(
            [str(Path(sys.executable).parent / "kvcoord"), "epp", "--listen",
             f"127.0.0.1:{free_port()}", "--embed-coordinator", f"127.0.0.1:{free_port()}"],
            env={**env, "KVCOORD_LOG_LEVEL": "warning"}, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while b"hashing.dev_key" not in log.read_bytes():  # a warning: logged at that level
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        child_process.stop_process(process)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert lines and all(line["level"] in ("warning", "error") for line in lines), lines
    assert "hashing.dev_key" in {line["event"] for line in lines}
