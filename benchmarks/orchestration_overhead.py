"""What Prefect + DVC + MLflow add to one RL iteration, against the six stage functions called
directly in one process. Same workspace, same iteration, same inputs, in one run:

1. direct       the six functions of ``hacrl.pipeline.stages`` for iteration N+1, in this process, on a
                copy of iteration N's state (no DVC, no MLflow, no Prefect);
2. prefect      ``prefect deployment run hacrl/iterate --watch`` (runs iteration N+1 in the
                workspace: Prefect -> DVC -> one process per stage -> MLflow);
3. dvc+mlflow   the same six stages again with ``dvc repro --force --single-item`` (no Prefect);
4. dvc          the same without MLflow (``tracking.enabled=false``).

Run it in a workspace whose experiment has run (``make run``); it starts the services itself
(free ports) unless ``.services.env`` exists. Prints a table and writes
``reports/orchestration_overhead.json``. The forced reruns reproduce byte-identical artifacts,
so the workspace ends as the Prefect run left it (one iteration longer).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hacrl.config.schema import Config
from hacrl.ops.orchestration import stale_stages
from hacrl.pipeline import params, table
from hacrl.pipeline.table import iteration_stages, stage_id
from hacrl.storage import RunLayout

PROJECT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    from hacrl.ops.services import client_env

    return client_env(PROJECT)


def direct(cfg: Config, t: int) -> dict[str, float]:
    """The six stage functions for iteration t on a temporary copy of iteration t-1's state."""
    lay = RunLayout(cfg.experiment.runs_dir)
    tmp = Path(tempfile.mkdtemp(prefix="hacrl-direct-"))
    try:
        shutil.copytree(lay.it(t - 1), tmp / "runs" / f"it{t - 1}")
        cfg.experiment.runs_dir = str(tmp / "runs")
        times = {}
        for s in iteration_stages():
            t0 = time.time()
            table.run(s, cfg, t)
            times[s] = time.time() - t0
        return times
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def dvc_stages(t: int) -> float:
    t0 = time.time()
    for s in iteration_stages():
        p = subprocess.run([sys.executable, "-m", "dvc", "repro", "--force", "--single-item", stage_id(s, t)],
                           cwd=PROJECT, env=_env(), capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{stage_id(s, t)} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return time.time() - t0


def set_tracking(enabled: bool) -> None:
    import yaml

    p = PROJECT / "params.yaml"
    data = yaml.safe_load(p.read_text())
    data["tracking"]["enabled"] = enabled
    params.write_params(data, p)


def main() -> int:
    os.chdir(PROJECT)
    cfg = params.load(PROJECT / "params.yaml")
    stale = stale_stages(PROJECT)
    if stale:
        print(f"the experiment is not complete ({sorted(stale)[:3]}...): run `make run` first", file=sys.stderr)
        return 1
    n = cfg.experiment.iterations
    t = n + 1
    started = False
    if not (PROJECT / ".services.env").exists():
        from hacrl.ops.services import serve

        serve(PROJECT, 0, 0)
        started = True
    try:
        d = direct(params.load(PROJECT / "params.yaml"), t)
        # force: DVC would otherwise restore iteration t's outputs from an identical earlier run
        # (its run cache, or dvc.lock entries of a longer experiment) instead of running the stages
        t0 = time.time()
        p = subprocess.run(["prefect", "deployment", "run", "hacrl/iterate", "--watch", "--watch-interval", "1",
                            "--param", f"iteration={t}", "--param", "force=true"],
                           cwd=PROJECT, env=_env(), capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"the iterate flow run failed:\n{(p.stdout + p.stderr)[-3000:]}")
        prefect_wall = time.time() - t0
        report_s = _mlflow_stage_seconds(cfg, t)
        dvc_mlflow = dvc_stages(t)
        set_tracking(False)
        try:
            dvc_only = dvc_stages(t)
        finally:
            set_tracking(True)
    finally:
        if started:
            from hacrl.ops.services import stop

            stop(PROJECT)
    direct_total = sum(d.values())
    rows = {
        "direct (six functions, one process)": direct_total,
        "dvc repro, one process per stage": dvc_only,
        "dvc repro + MLflow": dvc_mlflow,
        "prefect deployment run (+ DVC + MLflow)": prefect_wall,
    }
    print(f"\none embedded iteration (it{t}), {len(cfg.agents)} agents, "
          f"{cfg.rollout.prompts_per_iteration} prompts x {cfg.samples_per_prompt} samples\n")
    print(f"{'path':44s} {'seconds':>8s} {'overhead':>9s}")
    for k, v in rows.items():
        print(f"{k:44s} {v:8.1f} {v - direct_total:+9.1f}")
    print("\nper stage, direct vs inside the stage process under Prefect (MLflow stage_wall_s):")
    for s in iteration_stages():
        print(f"  {s:26s} {d[s]:6.1f} {report_s.get(s, float('nan')):6.1f}")
    out = PROJECT / cfg.experiment.reports_dir / "orchestration_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"iteration": t, "seconds": rows, "direct_per_stage": d,
                               "prefect_in_stage_per_stage": report_s}, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


def _mlflow_stage_seconds(cfg: Config, t: int) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    from hacrl.ops.tracking import tracking_uri

    client = MlflowClient(tracking_uri(cfg, PROJECT))
    exp = client.get_experiment_by_name(cfg.experiment.name)
    runs = client.search_runs([exp.experiment_id], f"tags.`hacrl.iteration` = '{t}' and tags.`hacrl.kind` = 'stage' "
                              "and tags.`hacrl.launcher` = 'prefect'")
    return {r.data.tags["hacrl.stage"]: r.data.metrics.get("stage_wall_s", float("nan")) for r in runs}


if __name__ == "__main__":
    sys.exit(main())
