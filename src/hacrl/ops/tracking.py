"""MLflow lineage of every stage, however it was launched (``dvc repro``, Prefect, by hand).

Structure, in one MLflow experiment per ``experiment.name``::

    {experiment}               the experiment's run, across iterations (params: the config;
    │                          artifacts: the reports; resumed by id, a new one when the config
    │                          changes what the results are)
    ├── it{t}                  one nested run per iteration: each stage's wall time (``wall_s/STAGE``)
    │                          and stage-wide figures at step t (``stage/STAGE/...``); inputs: the files the stages read
    │                          (digest = their DVC md5), the checkpoints it started from; outputs:
    │                          the checkpoints it wrote
    {agent}                    one run per agent, across iterations: every figure of the agent at
                               step t (``eval/accuracy`` first, then reward, entropy, KL, clip
                               fractions... under ``train/``; names: :func:`chart_key`),
                               per-update figures at the learner's update count

Each checkpoint (iteration 0's pool and every update) is an external MLflow logged model
``{agent}-it{t}`` (the weights stay in the DVC workspace; tags: path, DVC hash, iteration, git
commit, Prefect flow run; params: the config). Its held-out figures are logged with its model id
and the held-out dataset, so the experiment's Models tab ranks checkpoints by accuracy; its
source run is the iteration's run, whose inputs are the rollout, reward and learner shards it
was trained on. With ``tracking.register_models`` each is also a version of the registered model
``{experiment}.{agent}`` with alias ``it{t}``.

Which MLflow runs are current is kept outside the DVC outputs (``runs/.tracking/runs.json``),
so tracking ids never make two otherwise identical artifacts differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from hacrl.config.schema import Config
from hacrl.hashes import dvc_hash
from hacrl.pipeline import table
from hacrl.pipeline.result import Input, StageResult
from hacrl.storage import RunLayout, read_json, write_json

log = logging.getLogger(__name__)

_BAD_METRIC_CHARS = re.compile(r"[^A-Za-z0-9_\-./ ]")
FLOW_RUN_ENV = "HACRL_PREFECT_FLOW_RUN_ID"
"""Set by the Prefect task that launched a stage; tagged on its runs and model versions."""


def sanitize(name: str) -> str:
    """A metric/param name MLflow accepts (alphanumerics and ``_ - . / space``)."""
    return _BAD_METRIC_CHARS.sub("_", name)


_RENAMES = (  # (old prefix, new prefix), first match wins: see chart_key
    ("eval_", "eval/"), ("by_level/", "eval/by_level/"),
    ("train_update_", "train/per_update/"), ("train_", "train/"),
    ("rollout_", "rollout/"), ("reward_mean", "rollout/reward_mean"), ("verdict_", "rollout/verdict/"),
    ("learner_", "exchange/learner_"), ("round_trip_mismatch", "exchange/round_trip_mismatch"),
    ("thl_from/", "exchange/thl_from/"), ("p_hat", "sharing/p_hat"), ("omega/", "sharing/omega/"),
    ("params", "pool/params"), ("vocab", "pool/vocab"),
)
_SECTIONS_KEPT = ("stage/", "wall_s/", "warmup/")


def chart_key(key: str) -> str:
    """The name a figure goes to MLflow under (``eval_accuracy`` -> ``eval/accuracy``).

    MLflow's chart view makes a section of every name's part before its last ``/``, lists those
    sections by name before the unprefixed "Model metrics", and sorts charts by name inside a
    section. So the held-out figures go in ``eval`` (``eval/accuracy`` first), the name that sorts
    before every other section here; training figures in ``train`` (per update:
    ``train/per_update``); generation and verdicts in ``rollout``; the exchange's in ``exchange``;
    HACPO's capability in ``sharing``; the pool's size in ``pool``; stage figures in ``stage/STAGE``
    and wall times in ``wall_s``; any other figure under ``other``."""
    for old, new in _RENAMES:
        if key == old or (old.endswith(("_", "/")) and key.startswith(old)):
            return new + key[len(old):]
    return key if key.startswith(_SECTIONS_KEPT) else f"other/{key}"


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


def foreign_store(cfg: Config, project_dir: Path) -> str | None:
    """One line saying so when the project's own MLflow store (``mlflow.db``) was made in another
    directory (a workspace copied with ``cp -a``): its experiments keep their absolute artifact
    locations, so logging here would write into the other directory. ``None`` when the store is
    this directory's, absent, or chosen explicitly (``tracking.uri``, ``$MLFLOW_TRACKING_URI``).
    Reads the sqlite file directly: no MLflow import."""
    import sqlite3
    import urllib.parse

    project = Path(project_dir).resolve()
    db = project / "mlflow.db"
    chosen = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    if chosen and chosen != f"sqlite:///{db}":  # `make serve` exports the project's own store
        return None
    if not db.is_file():
        return None
    try:
        con = sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT name, artifact_location FROM experiments").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return None
    for name, loc in rows:
        u = urllib.parse.urlparse(loc or "")
        if u.scheme != "file":
            continue
        path = Path(urllib.parse.unquote(u.path))
        if not path.is_relative_to(project):
            home = next((p for p in path.parents if (p / "mlflow.db").exists()), path.parent)
            return (f"mlflow.db belongs to {home} (experiment {name!r} keeps its artifacts in {path}): this "
                    f"workspace was copied; MLflow logging is off here until you remove mlflow.db and "
                    f"{cfg.tracking.artifact_dir}/ (a fresh store) or set tracking.uri")
    return None


ML_VIEW = "workflowType=machine_learning"
"""The query that opens MLflow 3's machine-learning view (runs, metrics, the Models tab); without it
the UI may open its GenAI view (traces, no Models tab), which has nothing of this project."""


def ui_link(ui: str, route: str = "") -> str:
    """An MLflow UI URL for ``route`` (``/experiments/1/runs``...) in the machine-learning view."""
    route = route or "/"
    return f"{ui.rstrip('/')}/#{route}{'&' if '?' in route else '?'}{ML_VIEW}"


def _parquet_schema_and_profile(path: Path):
    """(MLflow schema, profile) of the Parquet files at ``path`` (a file or a directory of them),
    from their footers alone; (None, None) for anything else."""
    files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path] if path.suffix == ".parquet" else []
    if not files:
        return None, None
    import pyarrow.parquet as pq
    from mlflow.types.schema import ColSpec, Schema

    kinds = {"int": "long", "uint": "long", "float": "double", "double": "double", "bool": "boolean",
             "string": "string", "large_string": "string", "binary": "binary"}
    try:
        metas = [pq.ParquetFile(f) for f in files]
    except Exception:  # noqa: BLE001 - a schema is a courtesy: an unreadable shard is the input check's to name
        return None, None
    cols = []
    for field in metas[0].schema_arrow:
        t = str(field.type)
        kind = next((v for k, v in kinds.items() if t.startswith(k)), None)
        cols.append(ColSpec(kind or "string", field.name) if kind else ColSpec("string", f"{field.name} ({t})"))
    profile = {"files": len(files), "rows": sum(m.metadata.num_rows for m in metas),
               "bytes": sum(f.stat().st_size for f in files)}
    return Schema(cols), profile


def runs_url(ui: str, cfg: Config, project_dir: Path) -> str:
    """The MLflow UI page of the experiment's training runs, in the machine-learning view."""
    from mlflow.tracking import MlflowClient

    eid = experiment_id(MlflowClient(tracking_uri(cfg, Path(project_dir))), cfg, project_dir)
    return ui_link(ui, f"/experiments/{eid}/runs")


def tracking_uri(cfg: Config, project_dir: Path) -> str:
    """``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<project>/mlflow.db``."""
    return cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{(project_dir / 'mlflow.db').resolve()}"


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


_CREDENTIALS = re.compile(r"(?<=://)[^\s]*@")
"""Everything between ``://`` and the last ``@`` of a URI: its user info, whatever characters
the password holds (a ``@`` in a path after the host is rare; it would be hidden too)."""


def redact(text: str) -> str:
    """``scheme://user:secret@host`` as ``scheme://***@host``: credentials in a URI (a tracking
    server's, a remote's) never reach MLflow's params."""
    return _CREDENTIALS.sub("***@", text)


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
        out[sanitize(prefix.rstrip("."))] = redact(str(obj))[:6000]
    return out


def config_digest(cfg: Config) -> str:
    """A digest of what decides the experiment's results: the config without the iteration
    count (the flow extends an experiment by one iteration at a time), the tracking and
    orchestration settings, and the device inventory (where a job runs does not change its
    result). A changed digest starts a new experiment run."""
    import json

    d = dataclasses.asdict(cfg)
    d["experiment"] = {k: v for k, v in d["experiment"].items() if k != "iterations"}
    for k in ("tracking", "orchestration", "resources"):
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def flow_run_url(flow_run_id: str, ui: str | None = None) -> str:
    """The Prefect UI page of a flow run (``ui``: default ``$PREFECT_UI_URL`` or the API URL
    without ``/api``); empty without a flow run or a Prefect server."""
    if not flow_run_id:
        return ""
    ui = ui or os.environ.get("PREFECT_UI_URL") or os.environ.get("PREFECT_API_URL", "").removesuffix("/api")
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}" if ui else ""


class Tracker:
    """Logs one stage execution to MLflow; see the module docstring for the run structure.

    Every stage is logged the same way, from its :class:`hacrl.pipeline.result.StageResult`.
    """

    def __init__(self, cfg: Config, project_dir: str | os.PathLike = ".", commit: str | None = None,
                 flow_run_id: str | None = None, uri: str | None = None, flow_run_url_: str | None = None) -> None:
        """``commit``, ``flow_run_id``, ``uri``, ``flow_run_url_``: as they were when the stage ran
        (a queued record is logged later, maybe after a commit or from another shell); default:
        as they are now."""
        from mlflow.tracking import MlflowClient

        self.cfg = cfg
        self.project = Path(project_dir).resolve()
        self.uri = uri or tracking_uri(cfg, self.project)
        self.client = MlflowClient(self.uri)
        self.layout = RunLayout(self.project / cfg.experiment.runs_dir)
        self.experiment_id = experiment_id(self.client, cfg, self.project)
        self.commit = git_commit(self.project) if commit is None else commit
        self.flow_run_id = os.environ.get(FLOW_RUN_ENV, "") if flow_run_id is None else flow_run_id
        self.flow_run_url = flow_run_url(self.flow_run_id) if flow_run_url_ is None else flow_run_url_
        self._hashes: dict[str, str] = {}
        self._opened: set[str] = set()

    # ------------------------------------------------------------------ runs
    def _base_tags(self) -> dict[str, str]:
        tags = {"hacrl.experiment": self.cfg.experiment.name, "hacrl.algorithm": self.cfg.algorithm.name,
                "hacrl.git_commit": self.commit, "hacrl.config_digest": config_digest(self.cfg)}
        if self.flow_run_id:
            tags["hacrl.prefect_flow_run_id"] = self.flow_run_id
        if self.flow_run_url:
            tags["hacrl.prefect_flow_run_url"] = self.flow_run_url
        return tags

    def _pointer(self) -> Path:
        return self.layout.runs / ".tracking" / "runs.json"

    def _runs(self) -> dict:
        ptr = self._pointer()
        return read_json(ptr) if ptr.exists() else {}

    def _alive(self, run_id: str | None) -> bool:
        """Whether ``run_id`` is a run of this store not deleted in the UI. Any other failure (a
        locked database) is raised: taking a live run for gone would orphan every run after it."""
        from mlflow.exceptions import MlflowException

        if not run_id:
            return False
        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise

    def _reopen(self, run_id: str | None) -> bool:
        """Whether ``run_id`` is a live run of this store, made RUNNING if it was not. Memoised
        for this tracker until it closes the run: a stage logs to the experiment's and each
        agent's run many times, and each check is two store round trips."""
        if run_id in self._opened:
            return True
        if not self._alive(run_id):
            return False
        if self.client.get_run(run_id).info.status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        self._opened.add(run_id)
        return True

    def experiment_run(self, start_ms: int | None = None) -> str:
        """The experiment's run, across iterations (resumed by id), created with the config as
        params. A config that decides other results (:func:`config_digest`) gets a new run,
        tagged with the one it supersedes; so do its agents' runs."""
        doc = self._runs()
        digest = config_digest(self.cfg)
        if doc.get("digest") == digest and self._reopen(doc.get("experiment_run")):
            return doc["experiment_run"]
        params = flatten(dataclasses.asdict(self.cfg))
        previous = doc.get("experiment_run")
        generation = int(doc.get("generation", 1)) + 1 if previous else 1
        label = self._changed_since(previous, params) if previous else ""
        # a superseding run is told apart from the one it supersedes in every list and legend
        name = self.cfg.experiment.name + (f" #{generation}" if generation > 1 else "") + (f" ({label})" if label else "")
        tags = {**self._base_tags(), "mlflow.runName": name, "hacrl.kind": "experiment",
                "hacrl.workspace": str(self.project)}
        if previous:
            tags["hacrl.supersedes"] = previous
        run_id = self.client.create_run(self.experiment_id, start_time=start_ms, tags=tags).info.run_id
        self._log_params(run_id, params)
        # the logged models stay: a checkpoint is the same model whichever run logged it
        write_json(self._pointer(), {"experiment_id": self.experiment_id, "digest": digest,
                                     "experiment_run": run_id, "agents": {}, "iterations": {},
                                     "generation": generation, "label": label,
                                     "models": doc.get("models", {})})
        return run_id

    def _changed_since(self, run_id: str, params: dict[str, str]) -> str:
        """The settings that differ from ``run_id``'s params, as ``key=value`` (at most two)."""
        from mlflow.exceptions import MlflowException

        try:
            old = self.client.get_run(run_id).data.params
        except MlflowException:
            return ""
        diff = [f"{k}={params[k]}" for k in sorted(params) if k in old and old[k] != params[k]
                and not k.startswith("experiment.iterations")]
        return ", ".join(diff[:2]) + (" ..." if len(diff) > 2 else "")

    def agent_run(self, agent: str, start_ms: int | None = None) -> str:
        """The run of ``agent`` across iterations: its figures at step t, one line per agent on
        a chart of any of them. Top-level (not nested), so every chart shows it."""
        exp = self.experiment_run(start_ms)
        doc = self._runs()
        run_id = doc["agents"].get(agent)
        if self._reopen(run_id):
            return run_id
        ac = self.cfg.agent(agent)
        gen, label = int(doc.get("generation", 1)), doc.get("label", "")
        name = agent + (f" #{gen}" if gen > 1 else "") + (f" · {label}" if label else "")
        tags = {**self._base_tags(), "mlflow.runName": name, "hacrl.kind": "agent", "hacrl.agent": agent,
                "hacrl.experiment_run": exp}
        run_id = self.client.create_run(self.experiment_id, start_time=start_ms, tags=tags).info.run_id
        self._log_params(run_id, flatten(dataclasses.asdict(ac)))
        doc["agents"][agent] = run_id
        write_json(self._pointer(), doc)
        return run_id

    def iteration_run(self, t: int, start_ms: int | None = None) -> str:
        """The run of iteration t, nested in the experiment's run: each stage's wall time, the
        files the stages read (dataset inputs), the checkpoints in and out (logged models).

        A failed iteration resumes in its run (the failures it had stay as tags: their count and
        the last one); one whose stages run again after it finished (a forced rerun) gets a new
        run, tagged with the one it supersedes."""
        exp = self.experiment_run(start_ms)
        doc = self._runs()
        previous = doc["iterations"].get(str(t))
        if self._alive(previous):
            run = self.client.get_run(previous)
            if run.info.status == "RUNNING":
                return previous
            if run.info.status == "FAILED":
                tags = run.data.tags
                self.client.set_tag(previous, "hacrl.failures", str(int(tags.get("hacrl.failures", "0")) + 1))
                self.client.set_tag(previous, "hacrl.last_failure",
                                    f"{tags.get('hacrl.failed_stage', '?')}: {tags.get('hacrl.error', '')}"[:5000])
                for k in ("hacrl.failed_stage", "hacrl.error"):
                    if k in tags:
                        self.client.delete_tag(previous, k)
                self.client.update_run(previous, status="RUNNING")
                return previous
        tags = {**self._base_tags(), "mlflow.runName": f"it{t}", "mlflow.parentRunId": exp,
                "hacrl.kind": "iteration", "hacrl.iteration": str(t)}
        if previous:
            tags["hacrl.supersedes"] = previous
        run_id = self.client.create_run(self.experiment_id, start_time=start_ms, tags=tags).info.run_id
        self._log_params(run_id, flatten(dataclasses.asdict(self.cfg)))  # its Parameters tab: what ran
        doc["iterations"][str(t)] = run_id
        write_json(self._pointer(), doc)
        return run_id

    def _log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i:i + 100])

    def _metrics(self, run_id: str, values: dict[str, float], step: int, when_ms: int | None = None,
                 model_id: str | None = None, dataset: tuple[str, str] | None = None) -> None:
        import math
        import time

        from mlflow.entities import Metric

        now = when_ms or int(time.time() * 1000)
        name, digest = dataset or (None, None)
        ms = [Metric(sanitize(chart_key(k)), float(v), now, step, model_id=model_id, dataset_name=name,
                     dataset_digest=digest)
              for k, v in values.items() if math.isfinite(float(v))]
        for i in range(0, len(ms), 500):
            self.client.log_batch(run_id, metrics=ms[i:i + 500])

    def _hash(self, path: Path) -> str:
        key = str(path.resolve())
        if key not in self._hashes:
            self._hashes[key] = dvc_hash(path)
        return self._hashes[key]

    def _rel(self, path: Path) -> str:
        """``path`` relative to the project (what a user's checkout shows), else as given."""
        path = Path(path)
        return path.relative_to(self.project).as_posix() if path.is_relative_to(self.project) else str(path)

    def _dataset(self, inp: Input):
        """An input as an MLflow dataset: its path relative to the project (not the checkout's
        place on disk), its DVC hash as digest, and for Parquet shards their record schema and a
        profile (rows, files, bytes) read from the files' footers."""
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.data.sources import LocalArtifactDatasetSource

        path = self.project / inp.path
        rel = self._rel(path)
        schema, profile = _parquet_schema_and_profile(path)

        class _Profiled(MetaDataset):  # MetaDataset has a schema but no profile
            @property
            def profile(self):  # noqa: D401 - MLflow's hook
                return profile

            def to_dict(self) -> dict[str, str]:
                return {**super().to_dict(), **({"profile": json.dumps(profile)} if profile else {})}

        return _Profiled(LocalArtifactDatasetSource(rel), name=inp.name, digest=self._hash(path), schema=schema)

    def _inputs(self, run_id: str, inputs: list[Input]) -> None:
        from mlflow.entities import DatasetInput, InputTag

        ds = [DatasetInput(self._dataset(i)._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", i.context)])
              for i in inputs if (self.project / i.path).exists()]
        if ds:
            self.client.log_inputs(run_id, datasets=ds)

    # ------------------------------------------------------------------ stages
    def log_stage(self, stage: str, t: int, result: Any, wall_s: float, error: str | None = None,
                  start_ms: int | None = None, end_ms: int | None = None) -> str:
        """Record one execution of ``stage`` for iteration ``t``; return the iteration's run id.

        ``result``: the stage's :class:`~hacrl.pipeline.result.StageResult` (a plain mapping is
        logged as a result without tracked figures); ``error``: ``"Type: message"`` of a failed
        stage; ``start_ms``/``end_ms``: the stage's own wall-clock times, default now.
        """
        res = result if isinstance(result, StageResult) else StageResult(result if isinstance(result, dict) else {})
        if table.stage(stage).kind == table.REPORT:  # the experiment's own: its curves and tables
            run_id = self.experiment_run(start_ms)
            self._metrics(run_id, {"wall_s/report": wall_s}, self.cfg.experiment.iterations, end_ms)
            self._fail_or_finish(run_id, stage, error, end_ms, close=error is None)
            if error is None:
                for f in res.artifacts:
                    rel = Path(f).parent.relative_to(self.cfg.experiment.reports_dir) \
                        if Path(f).is_relative_to(self.cfg.experiment.reports_dir) else Path()
                    self.client.log_artifact(run_id, str(self.project / f), str(Path("reports") / rel))
            return run_id
        it_run = self.iteration_run(t, start_ms)
        if self.flow_run_id:  # the flow run that ran this stage (a resumed iteration: the latest)
            self.client.set_tag(it_run, "hacrl.prefect_flow_run_id", self.flow_run_id)
            if self.flow_run_url:
                self.client.set_tag(it_run, "hacrl.prefect_flow_run_url", self.flow_run_url)
        self._metrics(it_run, {f"wall_s/{stage}": wall_s}, t, end_ms)
        if error is not None:
            self._fail_or_finish(it_run, stage, error, end_ms)
            return it_run
        self._metrics(it_run, {f"stage/{stage}/{k}": v for k, v in res.metrics.items()}, t, end_ms)
        self._inputs(it_run, res.inputs)
        self._log_checkpoints(it_run, t, res.checkpoints, stage)
        dataset = None
        if res.dataset is not None and res.evaluated:
            self._inputs(it_run, [res.dataset])
            dataset = (res.dataset.name, self._hash(self.project / res.dataset.path))
        # the evaluated checkpoints are this iteration's own outputs (logged as such by the stage
        # that wrote them): their figures link to them, they are not the iteration's inputs
        evaluated = {a: self._model_of(a, t, Path(p)) for a, p in res.evaluated.items()}
        for agent, values in res.agents.items():
            self._metrics(self.agent_run(agent, start_ms), values, t, end_ms, model_id=evaluated.get(agent))
        for agent, values in res.evaluation.items():  # measured on the dataset: linked to it too
            self._metrics(self.agent_run(agent, start_ms), values, t, end_ms, model_id=evaluated.get(agent),
                          dataset=dataset if evaluated.get(agent) else None)
        for agent, ser in res.series.items():
            run = self.agent_run(agent, start_ms)
            for m in range(max(map(len, ser.values.values()), default=0)):
                self._metrics(run, {k: v[m] for k, v in ser.values.items() if m < len(v) and v[m] is not None},
                              ser.first_step + m, end_ms)
        if table.closes_iteration(stage):  # the iteration is complete: its run and the long-lived ones pause
            self._fail_or_finish(it_run, stage, None, end_ms, close=True)
        return it_run

    def _fail_or_finish(self, run_id: str, stage: str, error: str | None, end_ms: int | None,
                        close: bool = False) -> None:
        """A failed stage fails its run (stage and reason as tags); a completed iteration (or
        report) finishes its run, the experiment's and the agents' (they reopen with the next
        stage that logs)."""
        if error is not None:
            self.client.set_tag(run_id, "hacrl.failed_stage", stage)
            self.client.set_tag(run_id, "hacrl.error", str(error)[:5000])
            self.client.set_terminated(run_id, "FAILED", end_time=end_ms)
            self._opened.discard(run_id)
            return
        if close:
            doc = self._runs()
            for rid in {run_id, doc.get("experiment_run"), *doc.get("agents", {}).values()}:
                if self._alive(rid):
                    self.client.set_terminated(rid, "FINISHED", end_time=end_ms)
                self._opened.discard(rid)

    # ------------------------------------------------------------------ logged models
    def model_name(self, agent: str) -> str:
        """The registered model of ``agent``'s checkpoints: ``{experiment}.{agent}``."""
        return f"{self.cfg.experiment.name}.{agent}"

    def _model_of(self, agent: str, t: int, ckpt: Path) -> str | None:
        """The logged model of ``agent``'s checkpoint of iteration t whose DVC hash is on disk."""
        path = self.project / ckpt
        if not path.is_dir():
            return None
        h = self._hash(path)
        found = self.client.search_logged_models(
            [self.experiment_id], filter_string=f"name = '{sanitize(agent)}-it{int(t)}'", max_results=50)
        ids = [m.model_id for m in found if m.tags.get("hacrl.dvc_hash") == h]
        return ids[0] if ids else None

    def _log_checkpoints(self, it_run: str, t: int, checkpoints: dict[str, str], stage: str) -> None:
        """Each checkpoint written as an external MLflow logged model (the weights stay in the
        DVC workspace), an output of the iteration's run; the checkpoints it started from, its
        inputs; registered (``tracking.register_models``) as a version with alias ``itT``."""
        import tempfile

        from mlflow.entities import LoggedModelInput, LoggedModelOutput, LoggedModelStatus
        from mlflow.models.utils import get_external_mlflow_model_spec
        from mlflow.utils.mlflow_tags import MLFLOW_MODEL_IS_EXTERNAL

        if not checkpoints:
            return
        # a stage re-run in a resumed iteration run links the same models again: MLflow refuses a
        # link it holds (a unique key), so only the new ones are logged
        run = self.client.get_run(it_run)
        linked_in = {m.model_id for m in (run.inputs.model_inputs if run.inputs else None) or []}
        linked_out = {m.model_id for m in (run.outputs.model_outputs if run.outputs else None) or []}
        parents = [m for a in checkpoints if t > 0 for m in [self._model_of(a, t - 1, self.layout.checkpoint(t - 1, a))]
                   if m and m not in linked_in]
        if parents:
            self.client.log_inputs(it_run, models=[LoggedModelInput(m) for m in parents])
        params = flatten(dataclasses.asdict(self.cfg))
        outs = []
        for agent, ckpt in checkpoints.items():
            path = self.project / ckpt
            if not path.is_dir():
                continue
            same = self._model_of(agent, t, path)
            if same is not None:  # a rerun wrote the identical checkpoint: the same model
                outs.append(LoggedModelOutput(same, t))
                doc = self._runs()
                doc.setdefault("models", {})[f"{agent}@it{t}"] = same
                write_json(self._pointer(), doc)
                continue
            rel = path.relative_to(self.project).as_posix()
            tags = {MLFLOW_MODEL_IS_EXTERNAL: "true", "hacrl.agent": agent, "hacrl.iteration": str(t),
                    "hacrl.checkpoint": rel, "hacrl.checkpoint_uri": path.as_uri(), "hacrl.dvc_hash": self._hash(path),
                    "hacrl.dvc_out": rel.rsplit("/", 1)[0], "hacrl.stage": f"{stage}@it{t}",
                    **{k: v for k, v in self._base_tags().items() if k != "hacrl.experiment"}}
            tags["mlflow.note.content"] = self._model_description(agent, t, tags)
            model = self.client.create_logged_model(self.experiment_id, name=f"{sanitize(agent)}-it{t}",
                                                    source_run_id=it_run, tags=tags, model_type="hacrl-agent")
            self.client.log_model_params(model.model_id, params)
            with tempfile.TemporaryDirectory() as tmp:  # an MLmodel file saying the weights live elsewhere
                get_external_mlflow_model_spec(model).save(os.path.join(tmp, "MLmodel"))
                self.client.log_model_artifacts(model.model_id, tmp)
            self.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
            outs.append(LoggedModelOutput(model.model_id, t))
            self._register(agent, t, model)
            doc = self._runs()
            doc.setdefault("models", {})[f"{agent}@it{t}"] = model.model_id
            write_json(self._pointer(), doc)
        outs = [o for o in outs if o.model_id not in linked_out]
        if outs:
            self.client.log_outputs(it_run, outs)

    def _model_description(self, agent: str, t: int, tags: dict[str, str]) -> str:
        """The logged model's description (the UI shows it; MLflow 3's model page shows no tags):
        where the weights are, their DVC hash, the rollout shards they were trained on, and the
        Prefect run that made them."""
        lines = [f"**{agent}** after iteration {t} ({self.cfg.algorithm.name}).", "",
                 f"- checkpoint: `{tags['hacrl.checkpoint']}` (DVC output `{tags['hacrl.dvc_out']}`, "
                 f"md5 `{tags['hacrl.dvc_hash']}`); `dvc checkout {tags['hacrl.dvc_out']}` restores it",
                 f"- written by stage `{tags['hacrl.stage']}`, config digest `{tags.get('hacrl.config_digest', '?')}`, "
                 f"commit `{tags.get('hacrl.git_commit', '?')}`"]
        if t > 0:
            lines.append(f"- trained on the rollout shards `{self._rel(self.layout.rollouts(t))}/` and the learner "
                         f"inputs of iteration {t}")
        if self.flow_run_url:
            lines.append(f"- Prefect run: {self.flow_run_url}")
        return "\n".join(lines)

    def _register(self, agent: str, t: int, model) -> None:
        from mlflow.exceptions import MlflowException

        if not self.cfg.tracking.register_models:
            return
        name = self.model_name(agent)
        try:
            self.client.create_registered_model(name, tags={"hacrl.agent": agent},
                                                description=f"{agent}'s checkpoints, one version per iteration "
                                                            f"(alias itT), weights in the DVC workspace")
        except MlflowException:
            pass  # exists already
        from mlflow.tracking._tracking_service import utils as mlflow_uri

        # a ``models:/<id>`` source links the version to the logged model; MLflow resolves it with
        # the global tracking URI, so that is this store's for the call. Setting it also writes
        # $MLFLOW_TRACKING_URI, which is put back as it was afterwards.
        env_before = os.environ.get("MLFLOW_TRACKING_URI")
        try:
            with mlflow_uri._use_tracking_uri(self.uri):
                mv = self.client.create_model_version(
                    name, source=f"models:/{model.model_id}", run_id=model.source_run_id,
                    tags={k.removeprefix("hacrl."): v for k, v in model.tags.items() if k.startswith("hacrl.")},
                    description=f"{agent} after iteration {t}", model_id=model.model_id)
        finally:
            if env_before is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = env_before
        self.client.set_registered_model_alias(name, f"it{t}", mv.version)
        # the UI's "Model versions" of a logged model reads mlflow.modelVersions, which
        # create_model_version does not set (mlflow.register_model does, printing to stderr)
        from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

        known = json.loads(self.client.get_logged_model(model.model_id).tags.get(MLFLOW_MODEL_VERSIONS) or "[]")
        entry = {"name": name, "version": mv.version}
        self.client.set_logged_model_tags(model.model_id, {
            "hacrl.model_version": f"{name}/{mv.version}",
            MLFLOW_MODEL_VERSIONS: json.dumps(known + [entry] if entry not in known else known)})
