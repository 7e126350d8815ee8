"""What the stages share: the run layout, torch threads, the task splits, seeds, the resource plan."""

from __future__ import annotations

import random
from pathlib import Path

from hacrl.config.schema import Config
from hacrl.resources import ResourcePlan, plan_for
from hacrl.storage import RunLayout
from hacrl.task import data as task_data


def layout(cfg: Config) -> RunLayout:
    """Where the experiment's artifacts live (``experiment.runs_dir``)."""
    return RunLayout(cfg.experiment.runs_dir)


def artifact(cfg: Config, path: Path, stage: str, t: int | None = None) -> dict:
    """What an output directory of stage ``stage`` (iteration ``t``) says it is (its manifest,
    :data:`hacrl.storage.MANIFEST`): its path as ``dvc.yaml`` names it (``runs/it6/rollouts``,
    whatever directory the runs live in) and the ``dvc.yaml`` stage that writes it."""
    from hacrl.pipeline.table import dvc_stage_id

    lay = layout(cfg)
    for root in (lay.runs, lay.data):
        try:
            rel = Path(root.name) / Path(path).relative_to(root)
            break
        except ValueError:
            continue
    else:
        rel = Path(path)
    return {"artifact": rel.as_posix(), "stage": dvc_stage_id(stage, t or 0), "iteration": t}


def set_threads(cfg: Config) -> None:
    """torch's intra-op threads for this stage process (``experiment.threads``)."""
    import torch

    torch.set_num_threads(max(1, cfg.experiment.threads))


def split(cfg: Config, name: str) -> list[dict]:
    """One split of the prepared task data (train, dev or heldout)."""
    return task_data.read_jsonl(layout(cfg).tasks / f"{name}.jsonl")


def hash_seed(*parts) -> int:
    """A stable seed from the master seed and names (stage, iteration, agent)."""
    return random.Random("/".join(map(str, parts))).randrange(2**31 - 1)


def resource_plan(cfg: Config) -> ResourcePlan:
    """The MWRA plan of the pool on the declared inventory (``resources``; docs/SCALING.md)."""
    return plan_for(cfg)


def compact(stats: dict, keys: tuple[str, ...] | None = None) -> str:
    """A stage's figures as one short terminal line: ``key value`` pairs, numbers to 4 significant
    digits, nested mappings as ``key{a: 1, b: 2}``; ``keys``: only these, in this order (the
    full mapping goes to the artifact and to DEBUG logs)."""
    def fmt(v) -> str:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return str(v) if not isinstance(v, dict) else "{" + ", ".join(f"{k}: {fmt(x)}" for k, x in v.items()) + "}"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    items = [(k, stats[k]) for k in (keys or tuple(stats)) if k in stats and stats[k] is not None]
    return " · ".join(f"{k} {fmt(v)}" for k, v in items)
