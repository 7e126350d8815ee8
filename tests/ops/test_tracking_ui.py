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


def test_every_mlflow_url_the_project_prints_opens_the_machine_learning_view(tmp_path, monkeypatch):
    """Issue 28 (1): the flow run's report (its links to the runs, the iteration run, each model,
    the Models tab), hacrl iterate's closing lines and `make serve`'s URL all end in the
    machine-learning view's query; every MLflow route in the sources goes through ui_link."""
    import re

    from hacrl.ops.launch import result_lines
    from hacrl.ops.orchestration import iteration_markdown
    from hacrl.ops.tracking import ML_VIEW
    from hacrl.storage import RunLayout, write_json

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = params.compose(["experiment=smoke"])
    params.write_params(data, tmp_path / "params.yaml")
    cfg = params.from_dict(data)
    lay = RunLayout(tmp_path / cfg.experiment.runs_dir)
    names = [a.name for a in cfg.agents]
    write_json(lay.runs / ".tracking" / "runs.json", {"experiment_id": "7", "iterations": {"1": "r1"},
                                                       "models": {f"{n}@it1": f"m-{n}" for n in names}})
    for t in (0, 1):
        write_json(lay.eval_metrics(t), {"agents": {n: {"eval_accuracy": 0.2 + t / 10, "eval_stderr": 0.01}
                                                    for n in names}})
    md = iteration_markdown(tmp_path, cfg, 1, {"evaluate": "ran"}, "http://127.0.0.1:5000")
    urls = re.findall(r"\]\((http[^)]+)\)", md)
    assert len(urls) == len(names) + 3, md  # a model each, the runs, the iteration run, the Models tab
    assert all(u.startswith("http://127.0.0.1:5000/#/experiments/7/") and u.endswith("?" + ML_VIEW) for u in urls), urls
    monkeypatch.setenv("HACRL_MLFLOW_UI", "http://127.0.0.1:5000")
    lines = result_lines(tmp_path, 1)
    printed = [u for ln in lines for u in re.findall(r"http\S+", ln)]
    assert printed and all(u.endswith("?" + ML_VIEW) for u in printed), lines
    # no MLflow page is linked any other way: every route string is built by ui_link
    root = Path(__file__).resolve().parents[2]
    for f in [*root.glob("src/hacrl/**/*.py"), *root.glob("flows/*.py")]:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"#/|/experiments/|/models/", line) and "ui_link" not in line and "link(" not in line \
                    and not line.lstrip().startswith(("#", '"', "'")):
                raise AssertionError(f"{f.relative_to(root)}:{n}: an MLflow route outside ui_link: {line.strip()}")
