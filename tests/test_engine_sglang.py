"""``SglangControl`` (``worker.bridge.engine_sglang``) against a contract double of SGLang 0.5.23's
HTTP server (``tests.sglang_double``): each stage of a policy update, SGLang's own message when a
checkpoint cannot be loaded, a missing endpoint named, the flush retried while a request runs, the
version read back (and a lying engine caught); and ``count_requests`` of ``engine_vllm`` on
Prometheus text as vLLM writes it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvcoord.fleet_procs import free_port
from tests.sglang_double import SglangDouble
from worker.bridge import engine_sglang
from worker.bridge.engine_control import EngineStepFailed, MissingEndpoint
from worker.bridge.engine_sglang import RELEASE_HINT, SglangControl
from worker.bridge.engine_vllm import count_requests


def checkpoint(root: Path, name: str) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[tuple[SglangDouble, SglangControl]]:
    async with SglangDouble(checkpoint(tmp_path, "v0")) as double:
        control = SglangControl(double.url, load_timeout_s=5.0)
        try:
            yield double, control
        finally:
            await control.close()


async def test_check_endpoints_accepts_sglang_0_5_23_and_never_flushes(
    engine: tuple[SglangDouble, SglangControl],
) -> None:
    double, control = engine
    await control.check_endpoints()
    assert double.flush_statuses == []


@pytest.mark.parametrize("endpoint", ["/pause_generation", "/continue_generation", "/ready",
                                      "/v1/loads", "/update_weights_from_disk",
                                      "/update_weight_version", "/model_info"])
async def test_a_missing_endpoint_is_named_with_the_release_that_serves_it(
    tmp_path: Path, endpoint: str,
) -> None:
    async with SglangDouble(str(tmp_path), without=frozenset({endpoint})) as double:
        control = SglangControl(double.url)
        with pytest.raises(MissingEndpoint) as missing:
            await control.check_endpoints()
        await control.close()
    assert (missing.value.endpoint, missing.value.flag) == (endpoint, RELEASE_HINT)
    assert str(missing.value) == (f"the SGLang engine does not serve {endpoint}: start it with "
                                  f"{RELEASE_HINT}, or run the bridge with --no-policy-control")


async def test_pause_with_abort_ends_running_and_waiting_requests_at_once(
    engine: tuple[SglangDouble, SglangControl],
) -> None:
    double, control = engine
    await double.admit(running=2, waiting=1)
    await control.pause(abort=True)
    assert (double.paused, double.aborted, double.pause_modes) == (True, 3, ["abort"])
    assert await control.running_requests() == 0


async def test_pause_without_abort_lets_running_requests_finish_first(
    engine: tuple[SglangDouble, SglangControl],
) -> None:
    double, control = engine
    await double.admit(running=2)
    pausing = asyncio.create_task(control.pause(abort=False))
    await double.loads_polled.wait()
    assert (pausing.done(), double.pause_modes) == (False, [])
    await double.finish()
    await pausing
    assert (double.paused, double.aborted, double.pause_modes) == (True, 0, ["abort"])


async def test_pause_without_abort_gives_up_unpaused_when_requests_never_finish(
    engine: tuple[SglangDouble, SglangControl],
) -> None:
    double, control = engine
    control.load_timeout_s = 0.3
    await double.admit(running=1)
    with pytest.raises(EngineStepFailed) as failed:
        await control.pause(abort=False)
    assert (failed.value.step, failed.value.reason) == (
        "pause", "1 request(s) still running or waiting after 0.3 s")
    assert (double.paused, double.aborted, double.pause_modes) == (False, 0, [])


async def test_a_pause_not_read_back_fails_the_pause(
    engine: tuple[SglangDouble, SglangControl],
) -> None:
    double, control = engine
    double.broken.add("/ready")
    with pytest.raises(EngineStepFailed) as failed:
        await control.pause(abort=True)
    assert (failed.value.step, failed.value.reason) == (
        "pause", "/ready answered 500, not 503, after /pause_generation")


async def test_running_requests_counts_running_and_waiting(
    engine: tuple[SglangDouble, SglangControl],
) -> None:
    double, control = engine
    await double.admit(running=2, waiting=3)
    assert await control.running_requests() == 5


async def test_load_weights_loads_in_place_drops_the_cache_and_moves_model_path(
    engine: tuple[SglangDouble, SglangControl], tmp_path: Path,
) -> None:
    double, control = engine
    await double.admit(running=1)
    await control.pause(abort=True)
    v1 = checkpoint(tmp_path, "v1")
    await control.load_weights(v1)
    assert (double.loaded, double.cache_blocks) == (v1, 0)
    assert await control.model_path() == v1


async def test_a_path_without_a_checkpoint_fails_the_load_with_sglangs_message(
    engine: tuple[SglangDouble, SglangControl], tmp_path: Path,
) -> None:
    double, control = engine
    start = double.model_path
    await control.pause(abort=True)
    with pytest.raises(EngineStepFailed) as failed:
        await control.load_weights("/ckpt/missing")
    assert (failed.value.step, failed.value.reason) == (
        "load", "Failed to get weights iterator: Repo id must be in the form 'repo_name' or "
                "'namespace/repo_name': '/ckpt/missing'. Use `repo_type` argument if needed..")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineStepFailed) as failed:
        await control.load_weights(str(tmp_path / "empty"))
    assert failed.value.reason == (f"Failed to get weights iterator: Cannot find any model "
                                   f"weights with `{tmp_path / 'empty'}`.")
    assert (double.loaded, await control.model_path()) == (start, start)


async def test_weights_the_engine_cannot_take_fail_the_load_and_are_rolled_back(
    engine: tuple[SglangDouble, SglangControl], tmp_path: Path,
) -> None:
    double, control = engine
    double.fail_load = "size mismatch for lm_head.weight"
    await control.pause(abort=True)
    with pytest.raises(EngineStepFailed) as failed:
        await control.load_weights(checkpoint(tmp_path, "v1"))
    assert (failed.value.step, failed.value.reason) == (
        "load", "Failed to update weights: size mismatch for lm_head.weight. Rolling back to "
                "original weights.")
    assert double.loaded == str(tmp_path / "v0")


async def test_the_flush_is_retried_while_a_request_still_runs(
    engine: tuple[SglangDouble, SglangControl],
) -> None:
    double, control = engine
    await control.pause(abort=True)
    await double.admit(running=1)  # one the engine had not yet let go of
    resetting = asyncio.create_task(control.reset_prefix_cache())
    await double.flush_refused.wait()
    await double.finish()
    await resetting
    *refused, flushed = double.flush_statuses
    assert (set(refused), flushed, double.cache_blocks) == ({400}, 200, 0)


async def test_a_flush_refused_every_time_fails_the_reset(
    engine: tuple[SglangDouble, SglangControl], monkeypatch: pytest.MonkeyPatch,
) -> None:
    double, control = engine
    monkeypatch.setattr(engine_sglang, "_RESET_ATTEMPTS", 3)
    await double.admit(running=1)
    with pytest.raises(EngineStepFailed) as failed:
        await control.reset_prefix_cache()
    assert (failed.value.step, failed.value.reason) == (
        "reset", "/flush_cache kept answering 400 (3 tries): Flush cache failed.")
    assert double.flush_statuses == [400, 400, 400]


async def test_the_weight_version_is_set_without_aborting_and_read_back(
    engine: tuple[SglangDouble, SglangControl],
) -> None:
    double, control = engine
    assert await control.weight_version() == "default"
    await double.admit(running=1)  # the bridge tags a serving engine at start
    await control.set_weight_version("7")
    assert (await control.weight_version(), double.aborted, double.running) == ("7", 0, 1)


async def test_a_lying_engine_reports_its_own_version(
    engine: tuple[SglangDouble, SglangControl],
) -> None:
    double, control = engine
    double.lie_version = "6"
    await control.set_weight_version("7")
    assert await control.weight_version() == "6"


async def test_an_update_runs_every_stage_in_order(
    engine: tuple[SglangDouble, SglangControl], tmp_path: Path,
) -> None:
    double, control = engine
    await double.admit(running=2)
    pausing = asyncio.create_task(control.pause(abort=False))
    await double.loads_polled.wait()
    await double.finish()
    await pausing
    assert await control.running_requests() == 0
    await control.load_weights(checkpoint(tmp_path, "v1"))
    await control.reset_prefix_cache()
    await control.set_weight_version("1")
    assert await control.weight_version() == "1"
    await control.resume()
    await control.publish_events()
    assert (double.paused, double.aborted, double.pause_modes) == (False, 0, ["abort"])
    assert (double.model_path, double.weight_version, double.cache_blocks) == (
        str(tmp_path / "v1"), "1", 0)


async def test_an_engine_that_does_not_answer_fails_the_step() -> None:
    control = SglangControl(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(EngineStepFailed) as failed:
        await control.resume()
    await control.close()
    assert failed.value.step == "resume"
    assert failed.value.reason.startswith("POST /continue_generation: ClientConnectorError")


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
python_gc_objects_collected_total{generation="0"} 512.0
"""


def test_vllm_count_requests_sums_running_and_waiting_over_engines_only() -> None:
    assert count_requests(VLLM_METRICS) == 6


def test_vllm_count_requests_of_an_idle_engine_is_zero() -> None:
    idle = ('vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n')
    assert count_requests(idle) == 0
    assert count_requests("") == 0
