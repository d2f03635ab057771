"""The engines bench's cases: a **rig** (where the engines, the routers and the client run) and a
**regime** (how much of the stream each engine's KV cache holds).

Rigs, on a machine's first two cores:

- ``production``: every engine on core 0; the routers and the client on core 1. As in a GPU
  fleet, the router's CPU then takes nothing from prefill: what is left of a TTFT gap is added
  latency and where requests queue.
- ``shared``: one engine per core, round robin; the routers and the client float over both
  (the bench as it first ran). Router CPU competes with prefill here.
- ``quota``: one engine per core, round robin, the engines sharing ``QUOTA_CORES`` cores
  evenly, each capped at its share by a cgroup CPU quota (``engines_quota``: 0.45 core each
  for 4 engines, 0.9 for 2); the routers and the client float over what is left. Engines are
  then independent servers, as GPUs are: on a shared core a queue-aware rule reads their
  common slowness as each one's backlog. Every regime gets the same compute, so a case's
  stream takes as long whatever its engine count. Needs a writable cgroup v1 ``cpu``
  controller (root): asked for where there is none, the command exits 2 saying so.

Workloads (``WORKLOADS``): the synthetic trace, and the simulator's ``chat`` and ``agent``
families.

Regimes:

- ``roomy``: each engine's KV cache holds half the stream's distinct tokens, so the engines
  together hold every prefix only if no prefix is held twice;
- ``pressure``: a quarter. The engines evict, and a router's tree of what it sent goes stale
  (the case llm-d's precise scorer was built for).

``--coordinator`` says where our coordinator runs (``COORDINATORS``).

``parse_choice`` turns ``--rig``/``--regime``/``--workload``/``--coordinator`` values into
names, refusing unknown ones with the known ones listed (the CLI exits 2 with that line).
"""

from __future__ import annotations

from dataclasses import dataclass

QUOTA_CORES = 1.8
"""The quota rig's engines share 1.8 of the two cores evenly (0.45 each for four, 0.9 for
two), leaving the routers and the client 0.2."""


@dataclass(frozen=True, slots=True)
class Rig:
    """Cores: ``engine_cores(n)`` for n engines; the routers' and the client's core (None:
    unpinned); ``engines_quota``: the cores the engines share evenly, each capped at its share
    (None: uncapped)."""

    name: str
    spread: tuple[int, ...]
    router_core: int | None
    client_core: int | None
    about: str
    engines_quota: float | None = None

    def engine_quota(self, engines: int) -> float | None:
        """Each of ``engines`` engines' cap in cores (None: uncapped)."""
        return None if self.engines_quota is None else self.engines_quota / engines

    def engine_cores(self, engines: int) -> tuple[int, ...]:
        return tuple(self.spread[i % len(self.spread)] for i in range(engines))

    def parallel_engines(self, engines: int) -> int:
        """How many of ``engines`` prefill at once, each at the speed one engine measured
        alone: all of them where capped (each was measured under its own cap), else one per
        distinct core they compute on (engines sharing a core share its speed)."""
        if self.engines_quota is not None:
            return engines
        return len(set(self.engine_cores(engines)))

    def independent(self, engines: int) -> bool:
        """Whether no engine's work slows another's (capped, or a core each)."""
        return (self.engines_quota is not None
                or len(set(self.engine_cores(engines))) == engines)


@dataclass(frozen=True, slots=True)
class Regime:
    """``kv_share``: each engine's KV cache as a share of the stream's distinct tokens;
    ``engines``: how many engines its cases run."""

    name: str
    kv_share: float
    about: str
    engines: int


RIGS = {r.name: r for r in (
    Rig("production", (0,), router_core=1, client_core=1,
        about="engines on core 0; routers and client on core 1"),
    Rig("shared", (0, 1), router_core=None, client_core=None,
        about="an engine per core; routers and client unpinned"),
    Rig("quota", (0, 1), router_core=None, client_core=None, engines_quota=QUOTA_CORES,
        about=f"an engine per core, the engines sharing {QUOTA_CORES} cores evenly, each "
              "capped at its share by a cgroup; routers and client on what is left"),
)}
NEEDS_CGROUP = frozenset(name for name, rig in RIGS.items() if rig.engines_quota is not None)
REGIMES = {r.name: r for r in (
    Regime("roomy", 0.5, about="2 engines, each holding half the stream's distinct tokens",
           engines=2),
    # Four engines: together they hold the stream once over, so a router that keeps each
    # prefix on one engine fits it, and one that spreads prefixes evicts.
    Regime("pressure", 0.25, about="4 engines, each holding a quarter: engines evict",
           engines=4),
)}
WORKLOADS = ("trace", "chat", "agent")
"""``trace``: the Mooncake synthetic trace; ``chat`` and ``agent``: the simulator's generated
families (kvcoord/simulate/workloads), written as a trace of their own and sampled alike."""
COORDINATORS = ("embedded", "process")
"""Where our routers' coordinator runs: in the gateway's process (``kvcoord gateway
--embed-coordinator``: routes with no RPC, one process fewer), or as a ``kvcoord coordinator``
process of its own that the gateway calls over gRPC."""
CASES = tuple(f"{workload}/{rig}/{regime}" for workload in WORKLOADS for rig in RIGS
              for regime in REGIMES)
"""``--case`` names: ``workload/rig/regime`` (the regime sets the engines: 4 under pressure,
2 roomy)."""
CHOICES = {"rig": tuple(RIGS), "regime": tuple(REGIMES), "workload": WORKLOADS,
           "coordinator": COORDINATORS, "case": CASES}
"""The options ``kvcoord bench engines`` takes, and their known values in default order."""


def case_parts(case: str) -> dict[str, tuple[str, ...]]:
    """A ``--case`` name as the choices it stands for (workload, rig, regime)."""
    workload, rig, regime = case.split("/")
    return {"workload": (workload,), "rig": (rig,), "regime": (regime,)}


def case_file(case: str) -> str:
    """Where a case's results go, under the results folder: ``engines/<workload>-<rig>-
    <regime>`` (``.json`` added by the runner)."""
    return "engines/" + case.replace("/", "-")


class UnknownChoice(ValueError):
    """A ``--rig``, ``--regime`` or ``--workload`` value that is not known; the message lists
    the known ones."""


def parse_choice(option: str, value: str) -> tuple[str, ...]:
    """``value`` (comma-separated names) as names in the order given, each once;
    UnknownChoice naming the first unknown one and the known ones (or an unknown option), or
    saying why a rig that needs a cgroup cannot have one here."""
    if option not in CHOICES:
        raise UnknownChoice(f"unknown option --{option}; known: "
                            + ", ".join(f"--{o}" for o in CHOICES))
    known = CHOICES[option]
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise UnknownChoice(f"--{option} names nothing; known: {', '.join(known)}")
    for name in names:
        if name not in known:
            raise UnknownChoice(f"unknown {option} {name!r}; known: {', '.join(known)}")
    if option == "case" and len(names) > 1:
        raise UnknownChoice(f"--case runs one case, got {len(names)}: {', '.join(names)}")
    rigs = [case_parts(n)["rig"][0] for n in names] if option == "case" else names
    if option in ("rig", "case") and NEEDS_CGROUP.intersection(rigs):
        from bench.engines_quota import quota_problem

        if (problem := quota_problem()) is not None:
            raise UnknownChoice(f"rig {sorted(NEEDS_CGROUP.intersection(rigs))[0]!r} caps "
                                f"each engine with a cgroup CPU quota: {problem}")
    return tuple(dict.fromkeys(names))


def case_name(workload: str, rig: str, regime: str, coordinator: str = "embedded") -> str:
    """``workload/rig/regime``, then ``/process`` when our coordinator ran as its own
    process."""
    base = f"{workload}/{rig}/{regime}"
    return base if coordinator == "embedded" else f"{base}/{coordinator}"
