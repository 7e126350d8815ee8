"""Multi-workload resource allocation (MWRA): which devices each agent's rollouts and updates
use, and what runs at the same time.

The pool's agents differ in size, so one device layout does not suit all of them. The user
declares the device inventory and, per agent and stage, what a job needs (``resources`` in the
config, docs/SCALING.md). :func:`plan` turns that into waves: the jobs of one wave run at the
same time on disjoint devices; jobs that would share a device run in turn, and a rollout engine
whose devices an update needs is put to sleep (or stopped) first. A demand that no device can
meet fails here, naming the agent, the stage and the resource, before any work starts.

:func:`run_stage` carries a plan out: the stages hand it one function per job, and it runs a
wave's jobs at the same time and the waves in turn, releasing engines where the plan says.

Pure Python: no torch, no Prefect; the orchestrator and the stages read the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from hacrl.config.schema import ResourcesConfig, StageResources
from hacrl.errors import ConfigError

STAGES = ("rollout", "update")
"""The two device-hungry jobs of an agent in an iteration (evaluation reuses the rollout's)."""


class PlanError(ConfigError):
    """The declared resources cannot run the pool; the message names the agent and the resource."""


@dataclass(frozen=True)
class Job:
    """One agent's rollout or update, placed on devices."""

    agent: str
    stage: str
    devices: tuple[str, ...]
    memory_gib: float
    max_batch_tokens: int


@dataclass
class Wave:
    """Jobs of one stage that run at the same time (their devices are disjoint)."""

    stage: str
    jobs: list[Job] = field(default_factory=list)

    @property
    def busy(self) -> set[str]:
        return {d for j in self.jobs for d in j.devices}


@dataclass
class Release:
    """Before wave ``before`` starts, ``agent``'s rollout engine frees its devices."""

    before: int
    agent: str
    action: str  # "sleep" or "stop"
    devices: tuple[str, ...]


@dataclass
class ResourcePlan:
    waves: list[Wave]
    releases: list[Release]
    kept_alive: list[str]
    """Agents whose engine shares no device with any update: it stays up through the updates."""

    def jobs(self, stage: str) -> list[Job]:
        return [j for w in self.waves if w.stage == stage for j in w.jobs]

    def job(self, agent: str, stage: str) -> Job:
        return next(j for j in self.jobs(stage) if j.agent == agent)

    def to_dict(self) -> dict:
        return {"waves": [{"stage": w.stage, "jobs": [dataclasses.asdict(j) for j in w.jobs]} for w in self.waves],
                "releases": [dataclasses.asdict(r) for r in self.releases], "kept_alive": self.kept_alive}

    def describe(self) -> str:
        """The plan as lines a person reads (``hacrl resources``)."""
        lines = []
        for i, w in enumerate(self.waves):
            for r in self.releases:
                if r.before == i:
                    lines.append(f"  {r.action} {r.agent}'s engine (frees {', '.join(r.devices)})")
            jobs = "; ".join(f"{j.agent} on {', '.join(j.devices)}" for j in w.jobs)
            together = " (at the same time)" if len(w.jobs) > 1 else ""
            lines.append(f"wave {i}: {w.stage} {jobs}{together}")
        if self.kept_alive:
            lines.append(f"engines kept alive through the updates: {', '.join(self.kept_alive)}")
        return "\n".join(lines)


def demand(res: ResourcesConfig, agent: str, stage: str) -> StageResources:
    """The agent's declared needs for ``stage`` (``resources.agents[agent]``, else ``resources.default``)."""
    per = res.agents.get(agent)
    return getattr(per if per is not None else res.default, stage)


def _capacity(res: ResourcesConfig) -> dict[str, float]:
    return {d.id: d.memory_gib for d in res.devices}


def _fits(mem: float, need: float) -> bool:
    return mem <= 0 or need <= mem  # 0: memory not declared (a CPU host)


def refuse_impossible(res: ResourcesConfig, agents: list[str]) -> None:
    """Fail, naming the agent, stage and resource, when a job cannot run even on an idle inventory."""
    cap = _capacity(res)
    unknown = sorted(set(res.agents) - set(agents))
    if unknown:
        raise PlanError(f"resources.agents.{unknown[0]}: no such agent in the pool ({', '.join(agents)})")
    for a in agents:
        for st in STAGES:
            d = demand(res, a, st)
            key = f"resources.agents.{a}.{st}" if a in res.agents else f"resources.default.{st}"
            if d.pin:
                missing = [x for x in d.pin if x not in cap]
                if missing:
                    raise PlanError(f"{key}.pin: device {missing[0]!r} is not in resources.devices "
                                    f"({', '.join(cap)}) (agent {a})")
                if d.devices not in (0, 1, len(d.pin)):  # 1 is the default: the pin decides
                    raise PlanError(f"{key}.devices: {d.devices} but pin names {len(d.pin)} devices (agent {a})")
                small = [x for x in d.pin if not _fits(cap[x], d.memory_gib)]
                if small:
                    raise PlanError(f"{key}.memory_gib: agent {a}'s {st} needs {d.memory_gib:g} GiB per device; "
                                    f"{small[0]} has {cap[small[0]]:g} GiB")
                continue
            n = d.devices or 1
            if n > len(cap):
                raise PlanError(f"{key}.devices: agent {a}'s {st} needs {n} devices; the inventory has "
                                f"{len(cap)} ({', '.join(cap)})")
            big = [x for x, m in cap.items() if _fits(m, d.memory_gib)]
            if len(big) < n:
                best = max(cap.values())
                raise PlanError(f"{key}.memory_gib: agent {a}'s {st} needs {n} device(s) with "
                                f"{d.memory_gib:g} GiB each; {len(big)} of the inventory have that "
                                f"(the largest has {best:g} GiB)")


def _place(d: StageResources, cap: dict[str, float], busy: set[str], load: dict[str, int],
           home: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """Devices for a job in a wave whose devices ``busy`` are taken, or None if it does not fit.
    ``home``: the devices of the agent's own engine, preferred for its update."""
    if d.pin:
        return tuple(d.pin) if not busy & set(d.pin) else None
    free = [x for x in cap if x not in busy and _fits(cap[x], d.memory_gib)]
    n = d.devices or 1
    if len(free) < n:
        return None
    # the agent's own engine's devices first (the update then displaces no other agent's
    # engine, and the new weights are already where the engine reloads them: colocation as in
    # verl's hybrid engine), then the least used (spreads the agents), inventory order on ties
    free.sort(key=lambda x: (x not in home, load[x], list(cap).index(x)))
    return tuple(sorted(free[:n], key=list(cap).index))


def plan_for(cfg) -> ResourcePlan:
    """The plan of a whole config: its pool on its declared inventory."""
    return plan(cfg.resources, [a.name for a in cfg.agents])


def plan(res: ResourcesConfig, agents: list[str]) -> ResourcePlan:
    """Place every agent's rollout and update on the inventory, in as few waves as fit.

    Rollouts come first (all agents sample from the same policies of the iteration), then the
    updates. Within a stage, jobs go largest first (devices, then memory) into the first wave
    where their devices are free (first-fit decreasing); an update prefers the devices of the
    agent's own engine; ``engines_alive`` caps the engines up at once. An engine is released before the first wave that needs one of its devices:
    put to sleep (``engine_release: sleep``, the weights and cache leave the device, the
    process stays) or stopped. Deterministic for a given config.
    """
    refuse_impossible(res, agents)
    cap = _capacity(res)
    load = {x: 0 for x in cap}
    waves: list[Wave] = []
    for st in STAGES:
        order = sorted(agents, key=lambda a: (-(len(demand(res, a, st).pin or []) or demand(res, a, st).devices or 1),
                                              -demand(res, a, st).memory_gib, agents.index(a)))
        stage_waves: list[Wave] = []
        homes = {j.agent: j.devices for w in waves for j in w.jobs if j.stage == "rollout"}
        for a in order:
            d = demand(res, a, st)
            for w in stage_waves:
                if st == "rollout" and res.engines_alive and len(w.jobs) >= res.engines_alive:
                    continue
                devs = _place(d, cap, w.busy, load, homes.get(a, ()))
                if devs is not None:
                    break
            else:
                w = Wave(st)
                stage_waves.append(w)
                devs = _place(d, cap, set(), load, homes.get(a, ()))
                assert devs is not None  # check() guarantees an idle inventory fits every job
            for x in devs:
                load[x] += 1
            w.jobs.append(Job(a, st, devs, d.memory_gib, d.max_batch_tokens))
        for w in stage_waves:  # pool order within a wave: logs and tests read the same way each run
            w.jobs.sort(key=lambda j: agents.index(j.agent))
        waves += stage_waves
    def release(before: int, agent: str, devs: tuple[str, ...]) -> Release:
        # sleep mode keeps a GPU engine's process and frees its memory; a CPU engine has no
        # device memory to free, so it stops
        return Release(before, agent, "stop" if "cpu" in devs else res.engine_release, devs)

    def contended(devs: tuple[str, ...]) -> bool:
        # a GPU's memory is what engines and updates fight over; a CPU host's memory only when
        # declared: an idle CPU engine costs no cores, and keeping it saves a start-up
        return any(x.startswith("cuda:") or cap[x] > 0 for x in devs)

    releases, alive = [], {}
    for i, w in enumerate(waves):
        need = w.busy
        for a, devs in list(alive.items()):
            if need & set(devs) and contended(devs):
                releases.append(release(i, a, devs))
                del alive[a]
        if w.stage == "rollout" and res.engines_alive:
            # engines on other devices may stay up, but never more than engines_alive at once
            for a in list(alive)[:max(0, len(alive) + len(w.jobs) - res.engines_alive)]:
                releases.append(release(i, a, alive.pop(a)))
        if w.stage == "rollout":
            alive.update({j.agent: j.devices for j in w.jobs})
    return ResourcePlan(waves, releases, [a for a in agents if a in alive])


T = TypeVar("T")


def device_env(devices: tuple[str, ...]) -> dict[str, str]:
    """What a job's processes are given: its GPUs as ``CUDA_VISIBLE_DEVICES`` (ranks and vLLM's
    tensor-parallel workers then count from 0 within it), none for a CPU job. ``cuda:N`` is the
    N-th GPU this process sees, as in torch: under a ``CUDA_VISIBLE_DEVICES`` of its own (a
    Prefect GPU worker, a batch scheduler) it is translated to the physical id."""
    import os

    seen = [x for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    gpus = [int(x.split(":", 1)[1]) for x in devices if x.startswith("cuda:")]
    if not gpus:
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {"CUDA_VISIBLE_DEVICES": ",".join(seen[g] if seen and g < len(seen) else str(g) for g in gpus)}


def on_gpus(devices: tuple[str, ...]) -> bool:
    return any(x.startswith("cuda:") for x in devices)


def job_threads(res: ResourcesConfig, job: Job, host_threads: int) -> int:
    """CPU threads for a job: the host's on ``cpu``, an equal share per ``cpu:N`` device it holds."""
    shares = [x.id for x in res.devices if x.id.startswith("cpu:")]
    if not shares:
        return host_threads
    mine = sum(x.startswith("cpu:") for x in job.devices) or 1
    return max(1, host_threads * mine // len(shares))


def job_cores(res: ResourcesConfig, job: Job, host_threads: int) -> tuple[int, int] | None:
    """(first core, count) of a job on ``cpu:N`` shares, so that concurrent jobs bind disjoint
    cores; None on the whole host or on GPUs."""
    shares = [x.id for x in res.devices if x.id.startswith("cpu:")]
    mine = [shares.index(x) for x in job.devices if x in shares]
    if not mine:
        return None
    per = max(1, host_threads // len(shares))
    return min(mine) * per, job_threads(res, job, host_threads)


@dataclass(frozen=True)
class Placement:
    """A job in the terms its processes take, from one call (:func:`placement`): its threads,
    its cores, its environment, its GPUs, where an in-process model goes and its token budget."""

    job: Job
    threads: int
    """CPU threads: the host's on ``cpu`` (and next to GPUs), an equal share per ``cpu:N`` device."""
    cores: tuple[int, int] | None
    """(first core, count) to bind on ``cpu:N`` shares, so concurrent jobs take disjoint cores;
    None on the whole host or on GPUs."""
    env: dict[str, str]
    """Added to the environment of the job's processes: ``CUDA_VISIBLE_DEVICES`` (empty on the CPU)."""
    gpus: int
    """Its GPUs (0 on the CPU): an update's ranks, an engine's tensor-parallel size."""
    device: str | None
    """Where an in-process model goes: the job's first GPU (``cuda:N``), None on the CPU."""

    @property
    def max_batch_tokens(self) -> int:
        """Token budget per forward batch (0: the engine's default)."""
        return self.job.max_batch_tokens


def placement(res: ResourcesConfig, job: Job, host_threads: int) -> Placement:
    """Everything a stage needs to run ``job`` where the plan put it."""
    gpus = [x for x in job.devices if x.startswith("cuda:")]
    return Placement(job, job_threads(res, job, host_threads), job_cores(res, job, host_threads),
                     device_env(job.devices), len(gpus), gpus[0] if gpus else None)


def run_stage(p: ResourcePlan, stage: str, run_job: Callable[[Job], T],
              release: Callable[[Release], None] | None = None) -> dict[str, T]:
    """Carry out ``stage``'s waves: in turn, and a wave's jobs at the same time (threads: a job's
    heavy work runs in its own processes, or in torch, which releases the interpreter). Before a
    wave, ``release`` gets each engine the plan releases there. A failed job fails the stage,
    naming the agent, once the wave's other jobs have finished (no output of theirs is lost
    half-written). Returns each agent's result."""
    results: dict[str, T] = {}
    for i, w in enumerate(p.waves):
        if w.stage != stage:
            continue
        for r in p.releases:
            if r.before == i and release is not None:
                release(r)
        if len(w.jobs) == 1:
            results[w.jobs[0].agent] = run_job(w.jobs[0])
            continue
        with ThreadPoolExecutor(max_workers=len(w.jobs), thread_name_prefix=f"{stage}-wave{i}") as ex:
            futures = {j.agent: ex.submit(run_job, j) for j in w.jobs}
        for agent, f in futures.items():
            exc = f.exception()
            if exc is not None:
                # the job's own exception (its type decides the exit code and whether a retry
                # can help), told where it ran
                exc.add_note(f"{stage} of {agent} (wave {i}, on {', '.join(p.job(agent, stage).devices)})")
                raise exc
            results[agent] = f.result()
    return results

