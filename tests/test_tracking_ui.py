"""What a user is pointed at in MLflow: the experiment's training runs, telemetry off."""

from pathlib import Path

from hacrl.ops.services import service_env
from hacrl.ops.tracking import runs_url
from hacrl.pipeline import params


def test_serve_links_the_experiments_training_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = params.from_dict(params.compose(["experiment=smoke"]))
    url = runs_url("http://127.0.0.1:5000/", cfg, tmp_path)
    # the machine-learning view: MLflow 3 may open its GenAI view (no Models tab) otherwise
    assert url.startswith("http://127.0.0.1:5000/#/experiments/") and url.endswith("/runs?workflowType=machine_learning")
    assert runs_url("http://127.0.0.1:5000", cfg, tmp_path) == url  # created once, then found
    from mlflow.tracking import MlflowClient

    exp = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_experiment_by_name(cfg.experiment.name)
    assert url == f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
    assert exp.artifact_location == (tmp_path / cfg.tracking.artifact_dir / cfg.experiment.name).as_uri()


def test_services_and_stages_run_with_mlflow_telemetry_off():
    import subprocess
    import sys

    assert service_env(Path("/p"), 4200, 5000)["MLFLOW_DISABLE_TELEMETRY"] == "true"
    out = subprocess.run([sys.executable, "-c", "import os, hacrl.cli; print(os.environ['MLFLOW_DISABLE_TELEMETRY'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "true"
