"""What a stage reports: one typed shape for every stage, which tracking logs the same way.

A stage function returns a :class:`StageResult`. As a mapping it is the stage's detailed
figures, as before (``hacrl stage NAME --print-result`` prints them; code that reads
``result[agent]["reward_mean"]`` keeps working). Its fields are what MLflow records, whatever
the stage: per-agent figures of the iteration, the stage's own figures, per-update series, the
files it read (hashed as DVC hashes them, by the tracker), the checkpoints it wrote and the
checkpoints whose quality it measured. A new figure in a stage is a new key in one of these
fields; :mod:`hacrl.ops.tracking` needs no edit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Input:
    """A file or directory a stage read: ``name`` as MLflow shows it, ``path`` relative to the
    project, ``context`` the role it played (``training``, ``evaluation``, ``warm-up``)."""

    name: str
    path: str
    context: str


@dataclasses.dataclass(frozen=True)
class Series:
    """Figures of one agent at consecutive global steps ``first_step, first_step + 1, ...``
    (a policy update's per-mini-batch figures: step = the learner's update count). ``None``
    where a figure is undefined at that step."""

    first_step: int
    values: dict[str, list[float | None]]


class StageResult(dict):
    """A stage's figures (the mapping) plus what tracking logs for every stage alike.

    Attributes:
        agents: agent -> figures of this iteration (finite numbers), on the agent's run at step t.
        metrics: the stage's own figures (not per agent), on the iteration's run at step t.
        series: agent -> :class:`Series` (per-update figures at the learner's global update steps).
        inputs: the files it read, logged as MLflow dataset inputs of the iteration's run.
        checkpoints: agent -> checkpoint directory it wrote (each becomes an MLflow logged model).
        evaluated: agent -> checkpoint directory the stage measured.
        evaluation: agent -> figures of that checkpoint on ``dataset`` (held-out accuracy...), on
            the agent's run at step t and linked to the checkpoint's logged model and to ``dataset``.
        dataset: the dataset ``evaluation``'s figures were measured on.
        artifacts: files to attach to the experiment's run (reports).
    """

    def __init__(self, details: Mapping | None = None, *, agents: dict[str, dict[str, float]] | None = None,
                 metrics: dict[str, float] | None = None, series: dict[str, Series] | None = None,
                 inputs: list[Input] | None = None, checkpoints: dict[str, str] | None = None,
                 evaluated: dict[str, str] | None = None, evaluation: dict[str, dict[str, float]] | None = None,
                 dataset: Input | None = None, artifacts: list[str] | None = None) -> None:
        super().__init__(details or {})
        self.agents = {a: numbers(v) for a, v in (agents or {}).items()}
        self.metrics = numbers(metrics or {})
        self.series = dict(series or {})
        self.inputs = list(inputs or [])
        self.checkpoints = {a: str(p) for a, p in (checkpoints or {}).items()}
        self.evaluated = {a: str(p) for a, p in (evaluated or {}).items()}
        self.evaluation = {a: numbers(v) for a, v in (evaluation or {}).items()}
        self.dataset = dataset
        self.artifacts = [str(p) for p in (artifacts or [])]

    def tracked(self) -> dict:
        """The tracked fields as plain JSON (a queued record carries them to the flusher)."""
        return {"agents": self.agents, "metrics": self.metrics,
                "series": {a: dataclasses.asdict(s) for a, s in self.series.items()},
                "inputs": [dataclasses.asdict(i) for i in self.inputs], "checkpoints": self.checkpoints,
                "evaluated": self.evaluated, "evaluation": self.evaluation,
                "dataset": dataclasses.asdict(self.dataset) if self.dataset else None,
                "artifacts": self.artifacts}

    @classmethod
    def from_record(cls, details: Mapping | None, tracked: Mapping | None) -> StageResult:
        """Rebuild a result from :meth:`tracked`'s JSON (``None``: a result with figures only)."""
        tr = dict(tracked or {})
        ds = tr.get("dataset")
        return cls(details, agents=tr.get("agents"), metrics=tr.get("metrics"),
                   series={a: Series(int(s["first_step"]), s["values"]) for a, s in (tr.get("series") or {}).items()},
                   inputs=[Input(**i) for i in tr.get("inputs") or []], checkpoints=tr.get("checkpoints"),
                   evaluated=tr.get("evaluated"), evaluation=tr.get("evaluation"), dataset=Input(**ds) if ds else None,
                   artifacts=tr.get("artifacts"))


def numbers(d: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numeric entries of ``d`` (nested mappings flattened as ``a/b``), keys prefixed.

    Booleans, strings, lists and non-finite values are left out: a figure that was not computed
    is absent, never logged as 0.
    """
    out: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
            out[f"{prefix}{k}"] = float(v)
    return out


def shard_inputs(folder: Path, agents: list[str], kind: str, t: int, context: str) -> list[Input]:
    """The per-agent Parquet shards of ``folder`` (``NAME.parquet``) as inputs ``kind/itT/NAME``."""
    return [Input(f"{kind}/it{t}/{a}", str(folder / f"{a}.parquet"), context) for a in agents]


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
