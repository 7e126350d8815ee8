"""What a user is pointed at: the MLflow pages (machine-learning view), telemetry off, the CLI's help."""

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

    env = service_env(Path("/p"), 4200, 5000)
    assert env["MLFLOW_DISABLE_TELEMETRY"] == "true" and env["DO_NOT_TRACK"] == "1"
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    out = subprocess.run([sys.executable, "-c", "import os, hacrl.cli; print(os.environ['MLFLOW_DISABLE_TELEMETRY'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "true"


def test_the_command_line_explains_itself():
    """Bare ``hacrl`` prints what it can do (exit 0); every command's --help has a description and
    every option a help text."""
    import argparse
    import subprocess
    import sys

    from hacrl.cli import build_parser

    bare = subprocess.run([sys.executable, "-m", "hacrl.cli"], capture_output=True, text=True)
    assert bare.returncode == 0 and "COMMAND" in bare.stdout and "``" not in bare.stdout
    parser = build_parser()
    (subs,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = []
    for name, sp in [("hacrl", parser), *subs.choices.items()]:
        if not sp.description:
            missing.append(f"{name}: description")
        for a in sp._actions:
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help:
                missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}")
    assert not missing, missing
