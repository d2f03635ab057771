"""The workload ``kvcoord up`` drives through the SDK and the workers' OpenAI endpoints:
multi-turn chats and a GRPO-style round.

One pass, against one fleet, under one routing policy (``routing_policy`` on every Route and
RouteBatch call):

1. **Chats**: ``chats`` conversations of ``turns`` turns; conversation c opens with system
   prompt ``c % system_prompts`` (so several chats share each one). Each turn's prompt is the
   whole history (system prompt, earlier user turns and replies, the new user turn): it is
   routed with ``client.route`` and streamed from the chosen worker's OpenAI endpoint
   (``kvcoord.completion_stream``), as a scheduler in front of real engines would. The reply
   goes into the history as its text encoded again (what a chat client sends back), with the
   reference tokenizer the workers use. Up to ``concurrency`` conversations run at once.
2. **GRPO round**: ``grpo_prompts`` prompts (a shared instruction template + a problem), each
   sampled ``samples`` times. The first half of the prompts is routed with one
   ``client.route_batch`` call and generated in the returned ``order`` (each worker's share in
   that order, one request at a time, workers in parallel); then ``client.policy_update``
   moves the fleet to v+1; then the second half likewise. Every generation before the update
   must report v, every one after it v+1; anything else raises ``WorkloadError``.

Prompts depend only on ``seed`` and the replies (greedy decoding under the same weights), so two
passes on fresh fleets see the very same requests: that is what makes the policies comparable.
Both clocks run at the client from the request's route call: time to first token (TTFT) stops
at the stream's first event, latency at its end. A batch-routed sample's clock starts when the
client sends it (its worker has finished the sample before it), plus an equal share of the
RouteBatch call; how long each GRPO round took in all is ``PassResult.grpo_s``.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from coordinator.client import CoordinatorClient, Route
from kvcoord.completion_stream import CompletionStreamer, StreamError
from kvcoord.progress import Progress
from worker.text.tokenizer import TextTokenizer, reference_tokenizer

VOCAB = 512  # the reference model's vocabulary: token ids must stay below it
SCALES = {"small": 40, "default": 160}


class WorkloadError(RuntimeError):
    """The fleet answered something the workload's invariants forbid (e.g. a wrong version)."""


class Cancelled(Exception):
    """The pass was stopped (Ctrl-C): raised by workload threads at their next request."""


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The shape of one pass. ``requests`` = chats * turns + grpo_prompts * samples."""

    chats: int = 16
    turns: int = 5
    system_prompts: int = 4
    system_tokens: int = 128
    user_tokens: int = 96
    reply_tokens: int = 8
    think_s: float = 0.3
    """Mean pause between a reply and the next turn (a user reads before typing; uniform in
    [0.5, 1.5] x ``think_s``, seeded per chat). Why it matters
    here: the coordinator learns that a route finished from the worker's next heartbeat (250 ms
    in ``kvcoord up``'s fleet), and until then counts it as queued work on that worker."""
    grpo_prompts: int = 10
    samples: int = 8
    template_tokens: int = 64
    problem_tokens: int = 160
    completion_tokens: int = 8
    concurrency: int = 8
    seed: int = 7

    @property
    def requests(self) -> int:
        return self.chats * self.turns + self.grpo_prompts * self.samples

    @classmethod
    def for_requests(cls, requests: int) -> WorkloadSpec:
        """About ``requests`` requests (at least 26), half chat turns and half GRPO samples, in
        the default shapes; ValueError below 1."""
        if requests < 1:
            raise ValueError(f"--requests must be >= 1, got {requests}")
        base = cls()
        chats = max(2, round(requests / 2 / base.turns))
        grpo_prompts = max(2, 2 * round(requests / 4 / base.samples))  # even: two halves
        return cls(chats=chats, system_prompts=max(1, chats // 4), grpo_prompts=grpo_prompts)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One served request as the scheduler saw it (token counts are the worker's ``usage``;
    ``computed_tokens`` follows from them: a fully cached prompt still computes its last token).
    ``ttft_s`` and ``latency_s``: the module docstring's clocks."""

    kind: str  # "chat" | "grpo"
    worker_id: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    ttft_s: float
    latency_s: float
    policy_version: int
    prompt_key: int
    """``hash(tuple(prompt))``: deterministic for ints, so passes compare their prompts."""


@dataclass(slots=True)
class PassResult:
    """Everything one pass recorded; ``routing_policy`` names the policy every route asked.
    ``grpo_s``: the GRPO rounds' time, each from its RouteBatch call to its last answer."""

    routing_policy: str
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    grpo_s: float = 0.0


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


class _Pass:
    """One pass's state: the clients, the records (under a lock), the stop flag."""

    def __init__(self, client: CoordinatorClient, routing_policy: str, progress: Progress,
                 stop: threading.Event, tokenizer: TextTokenizer) -> None:
        self.client = client
        self.result = PassResult(routing_policy)
        self.progress = progress
        self.stop = stop
        self.streamer = CompletionStreamer()
        self._tokenizer = tokenizer
        self._lock = threading.Lock()

    def close(self) -> None:
        self.streamer.close()

    def serve(self, kind: str, prompt: list[int], max_new: int, version: int,
              route: Route | None = None, route_s: float = 0.0) -> list[int]:
        """Route (unless already routed), stream the completion from the routed worker,
        record; returns the reply's text encoded again. WorkloadError when the worker serves
        another version than ``version`` or its endpoint fails."""
        if self.stop.is_set():
            raise Cancelled
        if route is None:
            start = time.perf_counter()
            route = self.client.route(prompt, routing_policy=self.result.routing_policy)
            route_s = time.perf_counter() - start
        if not route.http_url:
            raise WorkloadError(f"{route.worker_id} registered no OpenAI endpoint")
        try:
            answer = self.streamer.complete(route.http_url, prompt, max_new)
        except StreamError as exc:
            raise WorkloadError(f"{kind} request on {route.worker_id}: {exc}") from None
        if answer.policy_version != version:
            raise WorkloadError(f"{kind} request on {route.worker_id} served under policy "
                                f"v{answer.policy_version}, expected v{version}")
        cached = answer.cached_tokens
        computed = len(prompt) - cached if cached < len(prompt) else 1
        record = RequestRecord(kind, route.worker_id, len(prompt), cached, computed,
                               route_s + answer.ttft_s, route_s + answer.total_s,
                               answer.policy_version, hash(tuple(prompt)))
        with self._lock:
            self.result.records.append(record)
        self.progress.advance()
        return self._tokenizer.encode(answer.text, add_special_tokens=False)

    def run_all(self, tasks: Sequence[Callable[[], None]], concurrency: int) -> None:
        """Run ``tasks`` on ``concurrency`` threads; the first error (or Ctrl-C here) sets the
        stop flag so the others end at their next request, then propagates."""
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            futures = [pool.submit(task) for task in tasks]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                self.stop.set()
                pool.shutdown(wait=True, cancel_futures=True)
                raise


def run_pass(target: str, routing_policy: str, spec: WorkloadSpec, progress: Progress,
             stop: threading.Event) -> PassResult:
    """Drive ``spec`` through the coordinator at ``target`` (module docstring: what, in which
    order). Raises WorkloadError, KvcoordError from the fleet, or Cancelled once ``stop`` is
    set; leaves the fleet one policy version further than it found it."""
    rng = random.Random(spec.seed)
    systems = [_tokens(rng, spec.system_tokens) for _ in range(spec.system_prompts)]
    template = _tokens(rng, spec.template_tokens)
    problems = [template + _tokens(rng, spec.problem_tokens) for _ in range(spec.grpo_prompts)]
    started = time.monotonic()
    with CoordinatorClient(target, timeout=30.0) as client:
        run = _Pass(client, routing_policy, progress, stop, reference_tokenizer())
        try:
            version = client.policy().version

            def chat(index: int) -> None:
                turn_rng = random.Random(spec.seed * 100_003 + index)
                history = list(systems[index % len(systems)])
                for turn in range(spec.turns):
                    # Jittered: users do not type in lockstep (and lockstep turns would let
                    # round_robin keep each chat on one worker by accident).
                    if turn and run.stop.wait(spec.think_s * (0.5 + turn_rng.random())):
                        raise Cancelled
                    history += _tokens(turn_rng, spec.user_tokens)
                    history += run.serve("chat", history, spec.reply_tokens, version)

            progress.set_phase(f"{routing_policy}: {spec.chats} chats x {spec.turns} turns")
            run.run_all([functools.partial(chat, i) for i in range(spec.chats)], spec.concurrency)
            half = len(problems) // 2
            progress.set_phase(f"{routing_policy}: GRPO {half}x{spec.samples} samples @ v{version}")
            run.result.grpo_s += _grpo_batch(run, problems[:half], spec, version)
            progress.set_phase(f"{routing_policy}: policy update v{version} -> v{version + 1}")
            with client.policy_update(version) as update:
                pass  # reference workers derive the new weights from the version itself
            progress.set_phase(f"{routing_policy}: GRPO {len(problems) - half}x{spec.samples} "
                               f"samples @ v{update.version}")
            run.result.grpo_s += _grpo_batch(run, problems[half:], spec, update.version)
        finally:
            run.close()
    run.result.wall_s = time.monotonic() - started
    return run.result


def _grpo_batch(run: _Pass, prompts: list[list[int]], spec: WorkloadSpec, version: int
                ) -> float:
    """``samples`` copies of each prompt through one RouteBatch; each worker runs its share in
    the returned order (siblings back to back), the workers in parallel. Returns the seconds
    from the RouteBatch call to the last answer."""
    batch = [prompt for prompt in prompts for _ in range(spec.samples)]
    if not batch:
        return 0.0
    start = time.perf_counter()
    routed = run.client.route_batch(batch, routing_policy=run.result.routing_policy)
    route_s = (time.perf_counter() - start) / len(batch)
    queues: dict[str, list[int]] = {}
    for i in routed.order:
        queues.setdefault(routed.routes[i].worker_id, []).append(i)

    def drain(indices: list[int]) -> None:
        for i in indices:
            run.serve("grpo", batch[i], spec.completion_tokens, version, routed.routes[i], route_s)

    run.run_all([functools.partial(drain, q) for q in queues.values()], len(queues))
    return time.perf_counter() - start
