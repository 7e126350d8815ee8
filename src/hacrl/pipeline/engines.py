"""A stage's rollout engines: opened for an agent's MWRA job, kept or released as the plan says.

The engine itself comes from the engine table (:mod:`hacrl.rollout.table`, ``rollout.engine``);
this module turns a job of the resource plan (its devices, cores and token budget) into an
:class:`~hacrl.rollout.engine.EngineRequest`, reuses an engine an in-process run keeps across
iterations (syncing it to the checkpoint the stage reads), and carries out the plan's releases.
What an engine can do is read from its row (``in_process``, ``keeps_alive``, ``can_sleep``),
never from its name.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

from hacrl.config.schema import AgentConfig, Config
from hacrl.hashes import cached_dvc_hash
from hacrl.pipeline.params import CONF_DIR
from hacrl.resources import Job, Release, device_env, job_cores, on_gpus
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


def vllm_python(path: str) -> Path:
    """The vLLM interpreter: an absolute path as is; a relative one from the working directory if
    it exists there, else from the project root (where ``make setup-vllm`` builds it)."""
    p = Path(path)
    if p.is_absolute() or (Path.cwd() / p).exists():
        return p.absolute()
    return CONF_DIR.parent / p


def open_engine(cfg: Config, ac: AgentConfig, agent, model_dir: Path, live: dict | None = None,
                desc: str = "rollouts", job: Job | None = None,
                threads: int | None = None) -> tuple[RolloutEngine, dict]:
    """The agent's rollout engine over the checkpoint in ``model_dir`` (``rollout.engine``).

    An in-process engine wraps the loaded ``agent``; one with a process of its own starts, or,
    given ``live`` (the engines an in-process run keeps across iterations), the agent's running
    engine is made to serve ``model_dir`` (in place). Otherwise, for an engine with a process
    worth keeping (``keeps_alive``), a stage process's engine comes from the workspace's engine
    host (:mod:`hacrl.rollout.engine_host`, ``engines.host``), named by the checkpoint's content
    hash: the host serves exactly those weights. Returns the engine and what starting or syncing
    it cost. ``job``: the MWRA placement (its
    GPUs become the engine process's ``CUDA_VISIBLE_DEVICES`` and its tensor-parallel size, its
    token budget the engine's batch budget); ``threads``: its share of the host's cores.
    """
    spec = engine_spec(cfg.rollout.engine)
    if live is not None and ac.name in live:
        sync = live[ac.name].reload(model_dir)
        return live[ac.name], {"engine_sync_s": round(sync["seconds"], 2),
                               "engine_sync_restart": int(sync["mode"] == "restart")}
    e = cfg.engines
    gpus = job is not None and on_gpus(job.devices)
    use_host = live is None and spec.keeps_alive and hosted(cfg)
    request = EngineRequest(
        model_dir, agent.tokenizer, model=agent.model, batch_size=cfg.rollout.batch_size, desc=f"{desc} {ac.name}",
        dtype="bfloat16" if cfg.trainer.dtype == "bf16" else "float32", seed=cfg.experiment.seed,
        threads=e.vllm_threads or threads or cfg.experiment.threads, env=_worker_env(cfg, job),
        tensor_parallel_size=len(job.devices) if gpus else 1,
        max_batch_tokens=job.max_batch_tokens if job is not None else 0,
        max_model_len=0 if spec.in_process else _max_model_len(cfg, agent),
        sleep_mode=gpus and spec.can_sleep and cfg.resources.engine_release == "sleep",
        settings=dataclasses.replace(e, vllm_python=str(vllm_python(e.vllm_python))),
        # a stage process asks the workspace's engine host for the agent at this checkpoint's
        # content (hashed through the memo the input check just filled: a stat per file)
        host=Path.cwd() if use_host else None, agent=ac.name, host_idle_s=e.host_idle_s,
        weights_id=cached_dvc_hash(Path.cwd(), model_dir) if use_host else "")
    engine = spec.load().open(request)
    if live is not None and spec.keeps_alive:
        live[ac.name] = engine
    cost = {} if engine.startup_s is None else {"engine_startup_s": round(engine.startup_s, 2)}
    sync = getattr(engine, "sync", None)
    if sync:  # the engine host's: started, reused, or reloaded in place
        cost.update({"engine_sync_s": round(sync["seconds"], 2), "engine_hosted": 1,
                     "engine_reused": int(sync["mode"] == "reuse"), "engine_started": int(sync["mode"] == "start")})
    return engine, cost


def _max_model_len(cfg: Config, agent) -> int:
    """Prompt + response tokens an engine process serves: ``engines.vllm_max_model_len``, else the
    model's ``max_position_embeddings`` (at most 4096)."""
    return cfg.engines.vllm_max_model_len or min(4096, int(getattr(agent.model.config, "max_position_embeddings",
                                                                   None) or 4096))


def _worker_env(cfg: Config, job: Job | None) -> dict | None:
    """An engine process's share of the machine: its GPUs, or on ``cpu:N`` shares its own cores."""
    if job is None:
        return None
    env = device_env(job.devices)
    cores = job_cores(cfg.resources, job, cfg.experiment.threads)
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}-{cores[0] + cores[1] - 1}"
    return env


def place(agent, job: Job):
    """Move an in-process agent's model to the first GPU of its MWRA job (no-op on the CPU)."""
    if on_gpus(job.devices):
        agent.model.to(next(x for x in job.devices if x.startswith("cuda:")))
    return agent


def release_engine(cfg: Config, live: dict | None, rel: Release) -> None:
    """Carry out a plan's release on a kept engine: sleep where the engine can, else a stop."""
    if not live or rel.agent not in live:
        return
    if rel.action == "sleep" and engine_spec(cfg.rollout.engine).can_sleep:
        live[rel.agent].sleep()
    else:
        engine = live.pop(rel.agent)
        getattr(engine, "stop", engine.close)()  # a hosted engine's worker stops too, not only its session
    log.info("engine of %s: %s (frees %s)", rel.agent, rel.action, ", ".join(rel.devices))
