"""A stage's rollout engines: opened for an agent's MWRA job, kept or released as the plan says.

The engine itself comes from the engine table (:mod:`hacrl.rollout.table`, ``rollout.engine``);
this module turns a job's placement (:func:`hacrl.resources.placement`) into an
:class:`~hacrl.rollout.engine.EngineRequest`, reuses an engine an in-process run keeps across
iterations (loading the checkpoint the stage reads), and keeps the stage's sessions until the plan
releases them (:class:`StageEngines`). What an engine can do is read from its row
(``in_process``, ``keeps_alive``, ``hostable``, ``can_sleep``) and whether a session is the
engine host's from the session (``hosted``), never from a name or a probed method.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from hacrl.config.schema import AgentConfig, Config
from hacrl.hashes import cached_dvc_hash
from hacrl.resources import Placement, Release
from hacrl.rollout import engine_host
from hacrl.rollout.engine import EngineRequest, RolloutEngine
from hacrl.rollout.table import engine_spec

log = logging.getLogger(__name__)

SERIAL = threading.Lock()
"""Held by in-process jobs that must not overlap (transformers' generate seeds torch's global
generator per batch, so two at once would interleave their random streams)."""

LOADING = threading.Lock()
"""Agents of one wave load one at a time: transformers' lazy imports are not thread-safe (seen
here: "cannot import name 'AutoModelForCausalLM'" when two rollout jobs started at once)."""


_HOST = {"on": False}


def serve_from_host(on: bool = True) -> None:
    """Whether this process's stages take engine processes and verifier workers from the
    workspace's engine host (:mod:`hacrl.rollout.engine_host`): ``hacrl stage`` turns it on (a
    stage process under ``dvc repro`` or Prefect); ``hacrl run`` keeps its own, in its process."""
    _HOST["on"] = on


def hosted(cfg: Config) -> bool:
    """Stages of this process use the engine host (``engines.host``, ``HACRL_ENGINE_HOST``)."""
    return _HOST["on"] and cfg.engines.host and engine_host.enabled()


def verifier_lease(cfg: Config):
    """Ready-made verifier workers from the engine host for a ``VerifierPool`` (None: it starts
    its own)."""
    return engine_host.VerifierLease(Path.cwd(), cfg.engines.host_idle_s) if hosted(cfg) else None


def open_engine(cfg: Config, ac: AgentConfig, agent, model_dir: Path, where: Placement | None = None,
                live: dict | None = None, desc: str = "rollouts") -> RolloutEngine:
    """A session of the agent's rollout engine (``rollout.engine``) over the checkpoint in
    ``model_dir``; what opening it cost is its ``cost``.

    An in-process engine wraps the loaded ``agent``; given ``live`` (the engines an in-process
    run keeps across iterations), the agent's running engine loads ``model_dir`` (its cost: the
    sync). Otherwise an engine whose worker the host can keep (``hostable``) takes, in a stage
    process, the workspace's engine host's worker (:mod:`hacrl.rollout.engine_host`,
    ``engines.host``), named by the checkpoint's content hash: the host serves exactly those
    weights. ``where``: the job's placement (its GPUs become the worker's devices and its
    tensor-parallel size, its cores and threads the worker's, its token budget the batch budget).
    """
    spec = engine_spec(cfg.rollout.engine)
    if live is not None and ac.name in live:
        sync = live[ac.name].load_weights(model_dir)
        live[ac.name].cost = {"engine_sync_s": round(sync["seconds"], 2),
                              "engine_sync_restart": int(sync["mode"] == "restart")}
        return live[ac.name]
    e = cfg.engines
    use_host = live is None and spec.hostable and hosted(cfg)
    gpus = where is not None and where.gpus > 0
    request = EngineRequest(
        model_dir, agent.tokenizer, model=agent.model, batch_size=cfg.rollout.batch_size, desc=f"{desc} {ac.name}",
        dtype="bfloat16" if cfg.trainer.dtype == "bf16" else "float32", seed=cfg.experiment.seed,
        threads=where.threads if where is not None else cfg.experiment.threads,
        cores=where.cores if where is not None else None, env=where.env if where is not None else None,
        tensor_parallel_size=where.gpus if gpus else 1,
        max_batch_tokens=where.max_batch_tokens if where is not None else 0,
        sleep_mode=gpus and spec.can_sleep and cfg.resources.engine_release == "sleep",
        settings=spec.settings(e), engine=spec.name,
        # a stage process asks the workspace's engine host for the agent at this checkpoint's
        # content (hashed through the memo the input check just filled: a stat per file)
        host=Path.cwd() if use_host else None, agent=ac.name, host_idle_s=e.host_idle_s,
        weights_id=cached_dvc_hash(Path.cwd(), model_dir) if use_host else "")
    engine = spec.load().open(request)
    if live is not None and spec.keeps_alive:
        live[ac.name] = engine
    return engine


def place(agent, where: Placement):
    """Move an in-process agent's model to its job's first GPU (no-op on the CPU)."""
    if where.device is not None:
        agent.model.to(where.device)
    return agent


def release_engine(live: dict | None, rel: Release) -> None:
    """Carry out a plan's release on a kept engine (sleep where it can, else a stop); a stopped
    engine leaves ``live``."""
    if not live or rel.agent not in live:
        return
    engine = live[rel.agent] if rel.action == "sleep" else live.pop(rel.agent)
    engine.release(rel.action)
    log.info("engine of %s: %s (frees %s)", rel.agent, rel.action, ", ".join(rel.devices))


class StageEngines:
    """The rollout engines of one stage's jobs: each job's session is closed when its job is
    done, unless it is worth keeping for the plan's releases (a hosted session, until the
    stage's end) or for the next iterations (``live``: an in-process run's kept engines)."""

    def __init__(self, cfg: Config, live: dict | None = None):
        self.cfg, self.live = cfg, live
        self.held: dict[str, RolloutEngine] = {}

    def __enter__(self) -> StageEngines:
        return self

    def __exit__(self, *exc) -> None:
        for engine in self.held.values():
            engine.close()  # the session ends; the host keeps the worker (asleep if released)
        self.held.clear()

    def open(self, ac: AgentConfig, agent, model_dir: Path, where: Placement | None = None) -> RolloutEngine:
        """The agent's session (see :func:`open_engine`)."""
        return open_engine(self.cfg, ac, agent, model_dir, where, self.live)

    def done(self, name: str, engine: RolloutEngine) -> None:
        """The job is done with its engine: a hosted session is held for the plan's releases, an
        in-process run's kept engine stays, any other one closes."""
        if engine.hosted:
            self.held[name] = engine
        elif self.live is None or self.live.get(name) is not engine:
            engine.close()

    def release(self, rel: Release) -> None:
        """A plan's release, on the session this stage holds or the run's kept engine."""
        release_engine(self.held if rel.agent in self.held else self.live, rel)
