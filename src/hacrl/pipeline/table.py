"""The stage table: every stage of the pipeline once, and the one place its shape is read from.

A row names the stage (``hacrl stage NAME``, the ``dvc.yaml`` stage of the same name, its
Prefect task), its function as ``"module:function"`` (imported only when the stage runs, so
``hacrl --help`` and the orchestration import no stage code), its kind and the MWRA jobs it
carries out. Every consumer of the stage list reads it here: the CLI, the orchestration of an
iteration (DVC ids, preparation, device tags, GPU routing), the input check, the in-process
runner, the Prefect flow, tracking and the tests (``tests/pipeline/test_stage_table.py`` checks
``dvc.yaml`` against it).

A new stage: its module under ``pipeline/stages/``, one row here, its entry in ``dvc.yaml``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hacrl.errors import ConfigError

PREPARE, ITERATION, REPORT = "prepare", "iteration", "report"


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline."""

    name: str
    """``hacrl stage NAME``; the ``dvc.yaml`` stage (``NAME@itT`` for an iteration stage)."""
    entry: str
    """The stage function as ``module:function``: ``fn(cfg)`` for a prepare or report stage,
    ``fn(cfg, t)`` for an iteration stage."""
    kind: str
    """``prepare`` (once, before iteration 1), ``iteration`` (once per RL iteration, in table
    order) or ``report`` (after the last iteration)."""
    jobs: str | None = None
    """The MWRA jobs it carries out (``rollout``: the generation engines, ``update``: the
    learners' updates), which give its Prefect task its device tags and route it to the GPU pool
    when they are on GPUs; None: no device job."""
    gpu: bool = False
    """Routed to the GPU pool whenever one has workers, wherever MWRA puts its jobs."""
    live_engines: bool = False
    """Takes the rollout engines an in-process run keeps across iterations (``live=``)."""
    at_zero: str | None = None
    """The ``dvc.yaml`` stage that runs this iteration stage at iteration 0, as part of the
    preparation (evaluate's ``evaluate-warmup``); None: it starts at iteration 1."""
    doc: str = ""

    def load(self) -> Callable[..., Any]:
        """The stage function (imported on first use)."""
        module, _, attr = self.entry.partition(":")
        return getattr(importlib.import_module(module), attr)


STAGES: tuple[Stage, ...] = (
    Stage("prepare-data", "hacrl.pipeline.stages.prepare_data:prepare_data", PREPARE,
          doc="train / dev / held-out problem files (procedural or from local files)"),
    Stage("prepare-pool", "hacrl.pipeline.stages.prepare_pool:prepare_pool", PREPARE,
          doc="iteration 0: tokenizers, models and warm-up of every agent, as Hugging Face directories"),
    Stage("generate-rollouts", "hacrl.pipeline.stages.generate_rollouts:generate_rollouts", ITERATION, jobs="rollout",
          live_engines=True, doc="the step's prompts x G samples per agent, with token ids and log-probs"),
    Stage("verify-rewards", "hacrl.pipeline.stages.verify_rewards:verify_rewards", ITERATION,
          doc="math-verify verdicts and rewards in killable worker processes"),
    Stage("exchange-and-align", "hacrl.pipeline.stages.exchange_and_align:exchange_and_align", ITERATION,
          doc="SEE records published; each learner's input from its subscription, THL-aligned"),
    Stage("compute-capability-stats", "hacrl.pipeline.stages.compute_capability_stats:compute_capability_stats",
          ITERATION, doc="step accuracy, windowed capability P_hat, omega, pooled prompt statistics"),
    Stage("update-policies", "hacrl.pipeline.stages.update_policies:update_policies", ITERATION, jobs="update",
          gpu=True, doc="one policy update per learner: new checkpoint and recovery state"),
    Stage("evaluate", "hacrl.pipeline.stages.evaluate:evaluate", ITERATION, jobs="rollout", at_zero="evaluate-warmup",
          doc="greedy pass@1 on the held-out split per agent and level; the run history"),
    Stage("report", "hacrl.pipeline.stages.report:report", REPORT,
          doc="reports/summary.json, curves for dvc plots, PNG plots, reports/README.md"),
)
"""The stages in the order one experiment runs them."""

INPUT_STAGE = "external-input"
"""``dvc.yaml``'s stage that stamps one input from outside the repository (``hacrl input-stamp
KEY``, one per entry of ``external_inputs``); prepare-data and prepare-pool read the stamps."""

_BY_NAME = {s.name: s for s in STAGES}


def names() -> tuple[str, ...]:
    """The names ``hacrl stage`` takes, in running order."""
    return tuple(_BY_NAME)


def stage(name: str) -> Stage:
    """The row of ``name``; an unknown name is a one-line error listing the stages."""
    if name not in _BY_NAME:
        raise ConfigError(f"stage: unknown stage {name!r} (choose from {', '.join(_BY_NAME)})")
    return _BY_NAME[name]


def iteration_stages() -> tuple[str, ...]:
    """The stages of one RL iteration, in order (each ``NAME@itT`` in ``dvc.yaml``)."""
    return tuple(s.name for s in STAGES if s.kind == ITERATION)


def prepare_stages() -> tuple[str, ...]:
    """The ``dvc.yaml`` stages that run before iteration 1: the prepare stages, then the
    iteration stages' runs at iteration 0."""
    return (*(s.name for s in STAGES if s.kind == PREPARE), *(s.at_zero for s in STAGES if s.at_zero))


def stage_id(name: str, t: int) -> str:
    """DVC's name of iteration stage ``name`` in iteration ``t`` (``generate-rollouts@it3``)."""
    return f"{name}@it{t}"


def dvc_stage_id(name: str, t: int) -> str:
    """The ``dvc.yaml`` stage that ``hacrl stage NAME --iteration T`` is."""
    s = stage(name)
    if s.kind != ITERATION:
        return s.name
    return s.at_zero if t == 0 and s.at_zero else stage_id(s.name, t)


def output_identity(cfg: Any, path: Path, stage: str, t: int | None = None) -> dict:
    """What an output directory of stage ``stage`` (iteration ``t``) says it is (its manifest,
    :data:`hacrl.storage.MANIFEST`): its path as ``dvc.yaml`` names it (``runs/it6/rollouts``,
    whatever directory the runs live in) and the ``dvc.yaml`` stage that writes it."""
    lay = cfg.layout
    for root in (lay.runs, lay.data):
        try:
            rel = Path(root.name) / Path(path).relative_to(root)
            break
        except ValueError:
            continue
    else:
        rel = Path(path)
    return {"artifact": rel.as_posix(), "stage": dvc_stage_id(stage, t or 0), "iteration": t}


def of_dvc_stage(dvc_id: str) -> Stage | None:
    """The row a ``dvc.yaml`` stage id belongs to (``evaluate@it3``, ``evaluate-warmup``), or
    None (an ``external-input@KEY`` stage)."""
    base = dvc_id.split("@", 1)[0]
    return _BY_NAME.get(base) or next((s for s in STAGES if s.at_zero == base), None)


def closes_iteration(name: str) -> bool:
    """Whether ``name`` is an iteration's last stage (its results complete the iteration)."""
    return name == iteration_stages()[-1]


def iteration_problem(name: str, t: int, configured: int) -> str | None:
    """Why ``hacrl stage NAME --iteration T`` cannot run with ``configured`` iterations, or None."""
    s = stage(name)
    if s.kind == ITERATION and not s.at_zero and t < 1:
        return f"--iteration: invalid value {t} (RL iterations start at 1)"
    if t < 0 or (s.kind == ITERATION and t > configured):
        return (f"--iteration: invalid value {t} (iterations 0-{configured} are configured; "
                f"more: `hacrl config experiment.iterations=N`)")
    return None


def run(name: str, cfg: Any, t: int = 0, *args: Any, **kwargs: Any) -> Any:
    """Run stage ``name`` on ``cfg`` (iteration ``t`` for an iteration stage; ``args`` and
    ``kwargs`` go to the stage function); returns its result."""
    s = stage(name)
    fn = s.load()
    return fn(cfg, t, *args, **kwargs) if s.kind == ITERATION else fn(cfg, *args, **kwargs)
