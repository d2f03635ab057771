"""Samples of an RL run on real engines, and the check that each was made by the weights it is
attributed to.

A ``Sample`` is one greedy completion: its prompt, its completion's token ids (vLLM's
``return_token_ids``), the version its answer named and the worker that made it. ``regenerate``
starts one fresh engine per version, loaded from that version's checkpoint, sends it every
sample's prompt with the same request, and returns the samples whose token ids differ: a sample
generated (even partly) under other weights than its version's, or attributed to the wrong one.
Greedy decoding on float32 weights makes the comparison exact (tests_vllm/tiny_model.py says
how the checkpoints keep the top two logits apart).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.engines_procs import Proc, stop

VERSION_HEADER = "x-kvcoord-policy-version"
WORKER_HEADER = "x-kvcoord-worker"
REQUEST_S = 120.0


@dataclass(frozen=True, slots=True)
class Sample:
    prompt: tuple[int, ...]
    max_tokens: int
    tokens: tuple[int, ...]
    version: int
    worker: str
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Answer:
    """One completion request's outcome: ``status`` 200 with a sample, or another status."""

    status: int
    sample: Sample | None
    body: str = ""


def complete(url: str, model: str, prompt: Sequence[int], max_tokens: int, *,
             version: int | None = None, headers: Mapping[str, str] | None = None) -> Answer:
    """A greedy ``/v1/completions`` of ``prompt`` at ``url`` (a gateway, a bridge's proxy or an
    engine). The sample's version is the answer's ``x-kvcoord-policy-version``, else
    ``version`` (what a caller without our headers believes), else -1."""
    body = json.dumps({"model": model, "prompt": list(prompt), "max_tokens": max_tokens,
                       "temperature": 0, "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_S) as answer:
            text = answer.read().decode()
            named = answer.headers.get(VERSION_HEADER, "")
            worker = answer.headers.get(WORKER_HEADER, "")
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, None, exc.read().decode(errors="replace")[:500])
    parsed = json.loads(text)
    choice = parsed["choices"][0]
    usage = parsed.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    seen = int(named) if named.isdigit() else (-1 if version is None else version)
    return Answer(200, Sample(tuple(prompt), max_tokens, tuple(choice["token_ids"]), seen,
                              worker, int(cached)))


def mismatches(urls: Mapping[int, str], samples: Iterable[Sample], model: str) -> list[Sample]:
    """The samples that the engine at ``urls[sample.version]`` (a fresh engine loaded with that
    version's checkpoint) does not reproduce exactly. ValueError when a version has no URL."""
    by_version: dict[int, list[Sample]] = {}
    for sample in samples:
        by_version.setdefault(sample.version, []).append(sample)
    missing = set(by_version) - set(urls)
    if missing:
        raise ValueError(f"no reference engine for version(s) {sorted(missing)}")
    wrong: list[Sample] = []
    with ThreadPoolExecutor(max_workers=8) as pool:
        for version, group in by_version.items():
            again = pool.map(lambda s, u=urls[version]: complete(u, model, s.prompt,
                                                                 s.max_tokens), group)
            wrong += [s for s, a in zip(group, again, strict=True)
                      if a.sample is None or a.sample.tokens != s.tokens]
    return wrong


@contextmanager
def reference_engines(python: Path, checkpoints: Mapping[int, Path], log_dir: Path, *,
                      wait: bool = True) -> Iterator[tuple[dict[int, str], Callable[[], None]]]:
    """Fresh engines, one per version of ``checkpoints``, launched at once: yields ``(urls by
    version, ready)``, where ``ready()`` waits until they answer (called already when
    ``wait``); stops them. Launch them early and call ``ready`` late to overlap their start
    with other work."""
    from bench.rl_fleet import await_engines, launch_engines

    scratch = Path(tempfile.mkdtemp(prefix="kvcoord-fresh-"))
    versions = sorted(checkpoints)
    started: list[tuple[str, Proc, str, str]] = []
    try:
        started = launch_engines(python, [checkpoints[v] for v in versions], scratch, log_dir,
                                 tag="fresh")
        urls = {v: url for v, (url, _, _, _) in zip(versions, started, strict=True)}
        if wait:
            await_engines(started)
        yield urls, lambda: await_engines(started)
    finally:
        stop([proc for _, proc, _, _ in started])
        shutil.rmtree(scratch, ignore_errors=True)


def regenerate(python: Path, checkpoints: Mapping[int, Path], samples: Iterable[Sample],
               log_dir: Path, model: str) -> list[Sample]:
    """``mismatches`` on fresh engines of the samples' versions, started for it and stopped."""
    samples = list(samples)
    wanted = {v: checkpoints[v] for v in {s.version for s in samples} if v in checkpoints}
    with reference_engines(python, wanted, log_dir) as (urls, _):
        return mismatches(urls, samples, model)
