"""Stage records reach MLflow through the queue: the stage process never imports MLflow, a
background flusher logs the record with the stage's own times, `hacrl track` waits for it, and
a record MLflow refuses is set aside without blocking the others."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import SMOKE

from hacrl.ops import track_queue
from hacrl.pipeline import params


def _cfg(tmp_path: Path):
    cfg = params.from_dict(params.compose([*SMOKE, "tracking.enabled=true"]))
    cfg.tracking.uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return cfg


def test_a_stage_queues_its_record_without_importing_mlflow_and_track_logs_it(tmp_path):
    code = f"""
import sys, time
from hacrl.pipeline import params
from hacrl.ops import track_queue
from conftest import SMOKE
cfg = params.from_dict(params.compose([*SMOKE, "tracking.enabled=true"]))
cfg.tracking.uri = "sqlite:///{tmp_path / 'mlflow.db'}"
from hacrl.pipeline.result import StageResult
res = StageResult({{"p_hat": {{"gpt2-a": 0.25}}}}, agents={{"gpt2-a": {{"p_hat": 0.25}}}}, metrics={{"pooled/n": 3}})
track_queue.log_stage(cfg, "compute-capability-stats", 1, res, 1.5, project_dir="{tmp_path}", started=1000.0)
assert "mlflow" not in sys.modules, "the stage process imported mlflow"
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=f"{Path(__file__).parents[1]}:{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr
    cfg = _cfg(tmp_path)
    # the detached flusher may have logged it already; flush waits for it and logs any leftovers
    track_queue.flush(tmp_path, cfg.experiment.runs_dir, timeout_s=120)
    assert track_queue.pending(tmp_path, cfg.experiment.runs_dir) == []
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.tracking.uri)
    exp = client.get_experiment_by_name(cfg.experiment.name)
    (r,) = client.search_runs([exp.experiment_id], "tags.`hacrl.kind` = 'iteration'")
    assert r.data.metrics["wall_s/compute-capability-stats"] == 1.5
    assert r.data.metrics["stage/compute-capability-stats/pooled/n"] == 3
    # the stage's own times, not the flusher's; the iteration goes on after this stage
    assert r.info.start_time == 1000_000 and r.info.status == "RUNNING"
    (a,) = client.search_runs([exp.experiment_id], "tags.`hacrl.kind` = 'agent'")
    assert a.info.run_name == "gpt2-a" and a.data.metrics["sharing/p_hat"] == 0.25


def test_a_refused_record_is_set_aside_and_the_rest_are_logged(tmp_path):
    cfg = _cfg(tmp_path)
    now = time.time()
    bad = track_queue.enqueue(cfg, tmp_path, "evaluate", 1, {}, 1.0, None, now, now)
    rec = json.loads(bad.read_text())
    rec["config"]["trainer"]["lr"] = -1.0  # a config that no longer validates
    bad.write_text(json.dumps(rec))
    track_queue.enqueue(cfg, tmp_path, "verify-rewards", 1, {"gpt2-a": {"reward_mean": 0.5, "verdicts": {"correct": 1}}},
                        2.0, RuntimeError("boom"), now, now + 2)
    assert track_queue.flush(tmp_path, cfg.experiment.runs_dir, timeout_s=60) == 1
    q = tmp_path / cfg.experiment.runs_dir / ".tracking" / "queue"
    assert [p.name for p in (q / "failed").glob("*.json")] == [bad.name]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.tracking.uri)
    exp = client.get_experiment_by_name(cfg.experiment.name)
    (run,) = client.search_runs([exp.experiment_id], "tags.`hacrl.kind` = 'iteration'")
    assert run.info.status == "FAILED" and run.data.tags["hacrl.error"] == "RuntimeError: boom"
    assert run.data.tags["hacrl.failed_stage"] == "verify-rewards"
    assert run.info.end_time - run.info.start_time == 2000


def test_a_corrupted_store_is_said_with_its_reason_and_retry_logs_after_repair(tmp_path):
    """A record MLflow refuses (here: mlflow.db is not a database) makes `hacrl track` fail with
    the reason in the line; after the store is repaired, `hacrl track --retry` logs it."""
    cfg = _cfg(tmp_path)
    params.write_params(params.compose([*SMOKE, "tracking.enabled=true", f"tracking.uri={cfg.tracking.uri}"]),
                        tmp_path / "params.yaml")
    now = time.time()
    track_queue.enqueue(cfg, tmp_path, "verify-rewards", 1, {"gpt2-a": {"reward_mean": 0.5}}, 2.0, None, now, now + 2)
    (tmp_path / "mlflow.db").write_bytes(b"this is not an sqlite database" * 100)
    env = {**os.environ, "HACRL_STAGE_SERVER": "0"}

    def track(*extra):
        return subprocess.run([sys.executable, "-m", "hacrl.cli", "track", *extra], cwd=tmp_path, env=env,
                              capture_output=True, text=True)

    p = track()
    assert p.returncode == 1 and "1 refused" in p.stdout, (p.stdout, p.stderr)
    assert "MLflow refused 1 record(s): " in p.stderr and "not a database" in p.stderr, p.stderr
    assert "hacrl track --retry" in p.stderr
    (tmp_path / "mlflow.db").unlink()  # repaired: a fresh store
    p = track("--retry")
    assert p.returncode == 0 and "1 refused records queued again" in p.stdout and "every stage record is logged (1 by" in p.stdout, \
        (p.stdout, p.stderr)
    assert track_queue.refused(tmp_path, cfg.experiment.runs_dir) == []
