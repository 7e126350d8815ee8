"""MLflow lineage of every stage, however it was launched (``dvc repro``, Prefect, by hand).

Structure, in one MLflow experiment per ``experiment.name``::

    it{t}                      one run per iteration (params: the resolved config)
    ├── {stage}@it{t}          one nested run per stage execution (wall time, stage metrics,
    │                          inputs: the Parquet shards it read, digest = their DVC md5)
    └── it{t}/{agent}          one nested run per agent (its metrics of iteration t)

``update-policies`` registers each agent's checkpoint as a version of the registered model
``{experiment}.{agent}``; the version points at the DVC-tracked directory and carries tags for
the iteration, git commit, DVC hash and Prefect flow-run id; its ``run_id`` is the update run,
whose inputs are the rollout, reward and learner shards it trained on. ``evaluate`` tags its
run with the versions it scored. A user goes eval metric -> model version -> rollout shards ->
config in the UI.

Which MLflow run is "the current run of iteration t" is kept outside the DVC outputs (in
``runs/.tracking/``), so tracking ids never make two otherwise identical artifacts differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from hacrl.config import Config
from hacrl.storage import RunLayout, read_json, write_json

log = logging.getLogger(__name__)

_BAD_METRIC_CHARS = re.compile(r"[^A-Za-z0-9_\-./ ]")
FLOW_RUN_ENV = "HACRL_PREFECT_FLOW_RUN_ID"
"""Set by the Prefect task that launched a stage; tagged on its runs and model versions."""


def sanitize(name: str) -> str:
    """A metric/param name MLflow accepts (alphanumerics and ``_ - . / space``)."""
    return _BAD_METRIC_CHARS.sub("_", name)


def experiment_id(client, cfg: Config, project_dir: Path) -> str:
    """The id of the experiment's MLflow experiment (``experiment.name``), created (its artifacts
    under ``tracking.artifact_dir``) if it does not exist yet."""
    from mlflow.exceptions import MlflowException

    name = cfg.experiment.name
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    art = (Path(project_dir).resolve() / cfg.tracking.artifact_dir / name).as_uri()
    try:
        return client.create_experiment(name, artifact_location=art)
    except MlflowException:  # another stage process created it meanwhile
        return client.get_experiment_by_name(name).experiment_id


def runs_url(ui: str, cfg: Config, project_dir: Path) -> str:
    """The MLflow UI page of the experiment's training runs (MLflow 3 opens on its GenAI traces
    view otherwise, empty here)."""
    from mlflow.tracking import MlflowClient

    eid = experiment_id(MlflowClient(tracking_uri(cfg, Path(project_dir))), cfg, project_dir)
    return f"{ui.rstrip('/')}/#/experiments/{eid}/runs"


def tracking_uri(cfg: Config, project_dir: Path) -> str:
    """``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<project>/mlflow.db``."""
    return cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{(project_dir / 'mlflow.db').resolve()}"


def file_md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dvc_hash(path: str | os.PathLike) -> str:
    """The md5 DVC records for ``path``: a file's md5, or the ``<md5>.dir`` of a directory."""
    p = Path(path)
    if p.is_file():
        return file_md5(p)
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.meta import Meta
    from dvc_data.hashfile.tree import Tree

    tree = Tree()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        tree.add(f.relative_to(p).parts, Meta(size=f.stat().st_size), HashInfo("md5", file_md5(f)))
    tree.digest()
    return tree.hash_info.value


def git_commit(project_dir: Path) -> str:
    """HEAD's commit, with ``-dirty`` when tracked files differ; ``unknown`` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project_dir, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src", "conf", "dvc.yaml"],
                               cwd=project_dir, capture_output=True, timeout=10).returncode != 0
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """Nested mappings/lists as ``a.b.0.c`` -> str(value), the shape of MLflow params."""
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, list) and obj and isinstance(obj[0], dict):
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[sanitize(prefix.rstrip("."))] = str(obj)[:6000]
    return out


def _numbers(d: dict, keys: tuple[str, ...] | None = None) -> dict[str, float]:
    return {k: float(v) for k, v in d.items()
            if (keys is None or k in keys) and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker:
    """Logs one stage execution to MLflow; see the module docstring for the run structure."""

    def __init__(self, cfg: Config, project_dir: str | os.PathLike = ".", commit: str | None = None,
                 flow_run_id: str | None = None, uri: str | None = None) -> None:
        """``commit``, ``flow_run_id``, ``uri``: as they were when the stage ran (a queued record
        is logged later, maybe after a commit or from another shell); default: as they are now."""
        from mlflow.tracking import MlflowClient

        self.cfg = cfg
        self.project = Path(project_dir).resolve()
        self.uri = uri or tracking_uri(cfg, self.project)
        self.client = MlflowClient(self.uri)
        self.layout = RunLayout(self.project / cfg.experiment.runs_dir)
        self.experiment_id = self._experiment()
        self.commit = git_commit(self.project) if commit is None else commit
        self.flow_run_id = os.environ.get(FLOW_RUN_ENV, "") if flow_run_id is None else flow_run_id
        self._agent_runs: dict[tuple[str, str], str] = {}  # one search per agent, not per metric

    # ------------------------------------------------------------------ runs
    def _experiment(self) -> str:
        return experiment_id(self.client, self.cfg, self.project)

    def _base_tags(self, t: int) -> dict[str, str]:
        tags = {"hacrl.experiment": self.cfg.experiment.name, "hacrl.iteration": str(t),
                "hacrl.algorithm": self.cfg.algorithm.name, "hacrl.git_commit": self.commit,
                "hacrl.workspace": str(self.project), "hacrl.launcher": "prefect" if self.flow_run_id else "cli"}
        if self.flow_run_id:
            tags["hacrl.prefect_flow_run_id"] = self.flow_run_id
        return tags

    def _pointer(self, t: int) -> Path:
        return self.layout.runs / ".tracking" / f"it{t}.json"

    def iteration_run(self, t: int, reuse_finished: bool = False, start_ms: int | None = None) -> str:
        """The open MLflow run of iteration t, created (with the config as params) if none is open.

        A finished iteration whose stages run again (a changed param, a forced rerun) gets a new
        run, tagged with the one it supersedes (``reuse_finished``: attach to it instead).
        """
        ptr = self._pointer(t)
        previous = None
        if ptr.exists():
            previous = read_json(ptr).get("run_id")
            try:
                if reuse_finished or self.client.get_run(previous).info.status == "RUNNING":
                    return previous
            except Exception:  # deleted in the UI, or another store: start afresh
                previous = None
        tags = {**self._base_tags(t), "mlflow.runName": f"it{t}", "hacrl.kind": "iteration"}
        if previous:
            tags["hacrl.supersedes"] = previous
        run_id = self.client.create_run(self.experiment_id, start_time=start_ms, tags=tags).info.run_id
        params = flatten(dataclasses.asdict(self.cfg))
        self._log_params(run_id, params)
        write_json(ptr, {"run_id": run_id, "experiment_id": self.experiment_id})
        return run_id

    def _log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i:i + 100])

    def _child(self, parent: str, name: str, t: int, kind: str, extra: dict | None = None,
               start_ms: int | None = None) -> str:
        tags = {**self._base_tags(t), "mlflow.runName": name, "mlflow.parentRunId": parent,
                "hacrl.kind": kind, **(extra or {})}
        return self.client.create_run(self.experiment_id, start_time=start_ms, tags=tags).info.run_id

    def agent_run(self, parent: str, t: int, agent: str) -> str:
        """The nested run of ``agent`` under iteration run ``parent`` (created once)."""
        key = (parent, agent)
        if key not in self._agent_runs:
            self._agent_runs[key] = self._find_or_create_agent_run(parent, t, agent)
        return self._agent_runs[key]

    def _find_or_create_agent_run(self, parent: str, t: int, agent: str) -> str:
        found = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{parent}' and tags.`hacrl.agent` = '{agent}'",
            max_results=1)
        if found:
            return found[0].info.run_id
        return self._child(parent, f"it{t}/{agent}", t, "agent", {"hacrl.agent": agent})

    def _metrics(self, run_id: str, values: dict[str, float], step: int) -> None:
        import math
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        ms = [Metric(sanitize(k), float(v), now, step) for k, v in values.items() if math.isfinite(float(v))]
        for i in range(0, len(ms), 500):
            self.client.log_batch(run_id, metrics=ms[i:i + 500])

    def _inputs(self, run_id: str, paths: list[tuple[str, Path]], context: str) -> None:
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.data.sources import LocalArtifactDatasetSource
        from mlflow.entities import DatasetInput, InputTag

        inputs = []
        for name, path in paths:
            ds = MetaDataset(LocalArtifactDatasetSource(str(path.resolve())), name=name, digest=dvc_hash(path))
            inputs.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]))
        if inputs:
            self.client.log_inputs(run_id, datasets=inputs)

    # ------------------------------------------------------------------ stages
    def log_stage(self, stage: str, t: int, result: Any, wall_s: float, error: str | None = None,
                  start_ms: int | None = None, end_ms: int | None = None) -> str:
        """Record one execution of ``stage`` for iteration ``t`` (``result``: the stage's return;
        ``error``: ``"Type: message"`` of a failed one; ``start_ms``/``end_ms``: the stage's own
        wall-clock times, default now)."""
        if stage == "report":
            t = self.cfg.experiment.iterations
        parent = self.iteration_run(t, reuse_finished=stage == "report", start_ms=start_ms)
        run_id = self._child(parent, f"{stage}@it{t}", t, "stage", {"hacrl.stage": stage}, start_ms=start_ms)
        self._metrics(run_id, {"stage_wall_s": wall_s}, t)
        if error is not None:
            self.client.set_tag(run_id, "hacrl.error", str(error)[:5000])
            self.client.set_terminated(run_id, "FAILED", end_time=end_ms)
            return run_id
        handler = getattr(self, "_on_" + stage.replace("-", "_"), None)
        if handler is not None:
            handler(parent, run_id, t, result if isinstance(result, dict) else {})
        self.client.set_terminated(run_id, "FINISHED", end_time=end_ms)
        if stage == "evaluate":  # the iteration is complete: close it and its agent runs
            for a in self.cfg.agents:
                self.client.set_terminated(self.agent_run(parent, t, a.name), "FINISHED", end_time=end_ms)
            self.client.set_terminated(parent, "FINISHED", end_time=end_ms)
        return run_id

    def _per_agent(self, parent: str, run_id: str, t: int, values: dict[str, dict[str, float]],
                   prefix: str = "") -> None:
        flat = {}
        for agent, vals in values.items():
            self._metrics(self.agent_run(parent, t, agent), {prefix + k: v for k, v in vals.items()}, t)
            flat.update({f"{agent}/{prefix}{k}": v for k, v in vals.items()})
        self._metrics(run_id, flat, t)

    def _agents(self, result: dict) -> dict[str, dict]:
        names = {a.name for a in self.cfg.agents}
        return {k: v for k, v in result.items() if k in names and isinstance(v, dict)}

    def _shards(self, folder: Path, kind: str) -> list[tuple[str, Path]]:
        return [(f"{kind}/it{folder.parent.name[2:]}/{a.name}", folder / f"{a.name}.parquet")
                for a in self.cfg.agents if (folder / f"{a.name}.parquet").exists()]

    def _on_prepare_pool(self, parent, run_id, t, result) -> None:
        self._per_agent(parent, run_id, t, {a: {"params": r.get("params", 0),
                                                "vocab": r.get("vocab", 0),
                                                "round_trip_mismatch": r.get("round_trip_mismatch", 0)}
                                            for a, r in self._agents(result).items()})
        self._register(parent, run_id, t)

    def _on_generate_rollouts(self, parent, run_id, t, result) -> None:
        self._per_agent(parent, run_id, t, {a: _numbers(r) for a, r in self._agents(result).items()}, "rollout_")
        self._inputs(run_id, self._shards(self.layout.rollouts(t), "rollouts"), "rollouts")

    def _on_verify_rewards(self, parent, run_id, t, result) -> None:
        per = {}
        for a, r in self._agents(result).items():
            n = max(1, sum(r.get("verdicts", {}).values()))
            per[a] = {"reward_mean": r["reward_mean"],
                      **{f"verdict_{k}": v / n for k, v in r.get("verdicts", {}).items()}}
        self._per_agent(parent, run_id, t, per)
        self._metrics(run_id, {"killed_verifier_workers": result.get("_killed_workers", 0),
                               "fast_path_verdicts": result.get("_fast_verdicts", 0)}, t)
        self._inputs(run_id, self._shards(self.layout.rollouts(t), "rollouts"), "rollouts")

    def _on_exchange_and_align(self, parent, run_id, t, result) -> None:
        self._per_agent(parent, run_id, t, {a: _numbers(r) for a, r in self._agents(result).items()}, "learner_")
        # THL residuals per (producer, learner) pair, on the stage run
        self._metrics(run_id, {f"thl/{p}/{ln}/{k}": v for p, row in result.get("thl", {}).items()
                               for ln, r in row.items() for k, v in _numbers(r).items()}, t)
        self._inputs(run_id, [(f"exchange/it{t}/published/{a.name}/{k}", self.layout.published(t, a.name, k))
                              for a in self.cfg.agents for k in ("trajectory", "verified_success", "reward_stats")
                              if self.layout.published(t, a.name, k).exists()], "published")

    def _on_compute_capability_stats(self, parent, run_id, t, result) -> None:
        vals = {f"p_hat/{a}": v for a, v in result.get("p_hat", {}).items()}
        for i, row in result.get("omega", {}).items():
            vals.update({f"omega/{i}/{j}": v for j, v in row.items()})
        vals.update({f"pooled/{k}": v for k, v in _numbers(result.get("pooled", {})).items()})
        self._metrics(run_id, vals, t)

    def _on_update_policies(self, parent, run_id, t, result) -> None:
        self._per_agent(parent, run_id, t, {a: _numbers(r) for a, r in self._agents(result).items()},
                        "train_")
        for a, r in self._agents(result).items():  # the loss's own figures per update m of the step
            per = r.get("per_update", {})
            for m in range(max(map(len, per.values()), default=0)):
                self._metrics(self.agent_run(parent, t, a), {f"train_update_{k}": v[m] for k, v in per.items()
                                                             if m < len(v) and v[m] is not None}, m)
        self._inputs(run_id, self._shards(self.layout.rollouts(t), "rollouts")
                     + self._shards(self.layout.rewards(t), "rewards")
                     + [(f"exchange/it{t}/learner-{a.name}", self.layout.learner_input(t, a.name))
                        for a in self.cfg.agents if self.layout.learner_input(t, a.name).exists()], "training")
        self._register(parent, run_id, t)

    def _on_evaluate(self, parent, run_id, t, result) -> None:
        per = {}
        for a, m in result.get("agents", {}).items():
            per[a] = {**_numbers(m), **{f"by_level/{k}": v for k, v in m.get("by_level", {}).items()}}
        self._per_agent(parent, run_id, t, per)
        for a in self.cfg.agents:
            version = self._version_of(a.name, t)
            if version is not None:
                self.client.set_tag(run_id, f"hacrl.model_version.{a.name}", version)
                self.client.set_tag(self.agent_run(parent, t, a.name), "hacrl.model_version", version)

    def _on_report(self, parent, run_id, t, result) -> None:
        reports = self.project / self.cfg.experiment.reports_dir
        for f in sorted(reports.glob("*")):
            if f.is_file() and not f.name.startswith("."):
                self.client.log_artifact(run_id, str(f), "reports")
        if (reports / "plots").is_dir():
            self.client.log_artifacts(run_id, str(reports / "plots"), "reports/plots")

    # ------------------------------------------------------------------ model registry
    def model_name(self, agent: str) -> str:
        return f"{self.cfg.experiment.name}.{agent}"

    def _register(self, parent: str, run_id: str, t: int) -> None:
        from mlflow.exceptions import MlflowException

        if not self.cfg.tracking.register_models:
            return
        for a in self.cfg.agents:
            ckpt = self.layout.checkpoint(t, a.name)
            if not ckpt.is_dir():
                continue
            name = self.model_name(a.name)
            try:
                self.client.create_registered_model(name, tags={"hacrl.agent": a.name})
            except MlflowException:
                pass  # exists already
            tags = {"iteration": str(t), "git_commit": self.commit, "dvc_hash": dvc_hash(ckpt),
                    "dvc_out": f"{self.cfg.experiment.runs_dir}/it{t}/checkpoints",
                    "dvc_out_hash": dvc_hash(ckpt.parent), "prefect_flow_run_id": self.flow_run_id or "none",
                    "agent": a.name, "iteration_run_id": parent}
            mv = self.client.create_model_version(name, source=ckpt.resolve().as_uri(), run_id=run_id, tags=tags,
                                                  description=f"{a.name} after iteration {t}")
            self.client.set_tag(self.agent_run(parent, t, a.name), "hacrl.model_version", f"{name}/{mv.version}")
            self.client.set_tag(run_id, f"hacrl.model_version.{a.name}", f"{name}/{mv.version}")

    def _version_of(self, agent: str, t: int) -> str | None:
        """The newest registered version of ``agent`` whose DVC hash is the checkpoint on disk."""
        ckpt = self.layout.checkpoint(t, agent)
        if not ckpt.is_dir():
            return None
        h = dvc_hash(ckpt)
        name = self.model_name(agent)
        versions = self.client.search_model_versions(
            f"name = '{name}' and tags.dvc_hash = '{h}' and tags.iteration = '{t}'")
        if not versions:
            return None
        return f"{name}/{max(int(v.version) for v in versions)}"


def log_stage(cfg: Config, stage: str, t: int, result: Any, wall_s: float,
              error: BaseException | None = None, project_dir: str | os.PathLike = ".",
              started: float | None = None) -> None:
    """Log a stage execution; a tracking failure is a warning, never a failed stage.

    With ``tracking.asynchronous`` (the default) the record is queued and a background process
    logs it (:mod:`hacrl.track_queue`); otherwise it is logged before this returns.
    """
    if not cfg.tracking.enabled:
        return
    import time

    ended = time.time()
    started = ended - wall_s if started is None else started
    try:
        if cfg.tracking.asynchronous:
            from hacrl import track_queue

            track_queue.enqueue(cfg, Path(project_dir), stage, t, result, wall_s, error, started, ended)
            track_queue.start_flusher(cfg, Path(project_dir))
            return
        Tracker(cfg, project_dir).log_stage(stage, t, result, wall_s,
                                            f"{type(error).__name__}: {error}" if error is not None else None,
                                            start_ms=int(started * 1000), end_ms=int(ended * 1000))
    except Exception as e:  # lineage must not cost a finished stage its result
        log.warning("MLflow tracking failed for %s@it%d: %s: %s", stage, t, type(e).__name__, e)
