"""Every command the README shows is run: here (configs composed, comparison plans validated,
the MLflow CLI on a store), or by the test or CI script that carries a ``# README: COMMAND``
marker. A command added to the README without either fails this test."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    """The commands of the README's bash blocks and of its command table (first column)."""
    text = (ROOT / "README.md").read_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        cmds += [ln.split("  #")[0].split(" # ")[0].strip() for ln in block.splitlines()]
    table = text.split("| command | what it does |", 1)[1].split("\n\n", 1)[0]
    for row in re.findall(r"^\| `([^`|]+)`(?: / `([^`|]+)`)? \|", table, re.M):
        cmds += [c for c in row if c]
    return [c for c in dict.fromkeys(cmds) if c]


def markers() -> set[str]:
    """Commands that a test or the CI script says it runs (``# README: COMMAND``)."""
    found = set()
    for f in [*ROOT.glob("tests/**/*.py"), ROOT / ".ci" / "run"]:
        found |= {m.strip() for m in re.findall(r"# README: (.+)$", f.read_text(), re.M)}
    return found


def _hacrl(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hacrl.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "HACRL_STAGE_SERVER": "0", **(env or {})})


def _make_run_overrides(cmd: str) -> list[str] | None:
    m = re.fullmatch(r'make run OVERRIDES="([^"]*)"', cmd)
    return shlex.split(m.group(1)) if m else None


def test_every_readme_command_is_run_here_or_by_a_marked_test():
    cmds = readme_commands()
    assert "make run" in cmds and "make test" in cmds and any(c.startswith("hacrl compare") for c in cmds)
    here = {c for c in cmds if _make_run_overrides(c) is not None or c.startswith("hacrl compare")
            or c.startswith("mlflow ")}
    missing = [c for c in cmds if c not in here and c not in markers()]
    assert not missing, f"README commands no test runs (add a '# README: ...' marker where one does): {missing}"


def test_the_readme_overrides_compose_into_valid_configs(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = '{"problem": "What is 2+3?", "answer": "5"}\n' * 50
    for name in ("gsm8k_train.jsonl", "gsm8k_test.jsonl"):
        (data / name).write_text(rows)
    cmds = [c for c in readme_commands() if _make_run_overrides(c) is not None]
    assert len(cmds) >= 6
    for path in {m for c in cmds for m in re.findall(r'=/data/([^\s"]+)', c)}:  # every other task file named
        f = data / path
        if f.suffix:
            f.parent.mkdir(parents=True, exist_ok=True)
            if not f.exists():
                f.write_text(rows)
        else:  # a saved dataset's directory (what save_to_disk leaves: its state file)
            f.mkdir(parents=True, exist_ok=True)
            (f / "state.json").write_text("{}")
    for cmd in cmds:
        # the README's /data/ paths point at files made here
        overrides = [o.replace("=/data/", f"={data}/") for o in _make_run_overrides(cmd)]
        p = _hacrl(["config", *overrides, "--out", str(tmp_path / "params.yaml")], ROOT)
        assert p.returncode == 0, (cmd, p.stderr)


def test_the_readme_comparisons_are_valid_plans(tmp_path):
    cmds = [c for c in readme_commands() if c.startswith("hacrl compare")]
    # both suites, the protocol's dev sweep, resuming and adding probes are shown
    assert {"--suite hacpo", "--suite mutual", "--tune", "--resume", "--contenders"} <= {
        f for c in cmds for f in ("--suite hacpo", "--suite mutual", "--tune", "--resume", "--contenders") if f in c}
    for cmd in [c for c in cmds if "--report-only" not in c]:
        # the configs only: a plan with --no-gate prepares no pool and measures no gate
        p = _hacrl([*shlex.split(cmd)[1:], "--dry-run", "--no-gate", "--work-dir", str(tmp_path)], ROOT)
        assert p.returncode == 0 and "every config valid" in p.stdout, (cmd, p.stderr)
    assert not any(tmp_path.iterdir())  # a plan runs nothing
    # rewriting a report runs nothing either: done for real on a copy of the committed results
    for cmd in [c for c in cmds if "--report-only" in c]:
        args = shlex.split(cmd)[1:]
        suite, setting = args[args.index("--suite") + 1], args[args.index("--setting") + 1]
        copy = tmp_path / "reports" / suite / setting
        copy.mkdir(parents=True)
        shutil.copy(ROOT / "reports" / suite / setting / "results.json", copy)
        if (ROOT / "reports" / suite / setting / "runs").exists():  # the runs results.json lists
            shutil.copytree(ROOT / "reports" / suite / setting / "runs", copy / "runs")
        p = _hacrl([*args, "--reports-dir", str(tmp_path / "reports")], ROOT)
        assert p.returncode == 0 and (copy / "README.md").read_text().startswith("**Primary contrast**"), (cmd, p.stderr)


def test_the_readme_mlflow_commands_list_the_experiment_and_its_runs(tmp_path):
    from conftest import SMOKE

    from hacrl.ops.tracking import Tracker
    from hacrl.pipeline import params
    from hacrl.pipeline.result import StageResult

    cfg = params.from_dict(params.compose([*SMOKE, "tracking.enabled=true"]))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg.tracking.uri = uri
    Tracker(cfg, tmp_path).log_stage("verify-rewards", 1, StageResult({}, agents={"gpt2-a": {"reward_mean": 0.5}}), 1.0)
    for cmd in [c for c in readme_commands() if c.startswith("mlflow ")]:
        p = subprocess.run([str(Path(sys.executable).parent / "mlflow"), *shlex.split(cmd)[1:]], cwd=tmp_path,
                           capture_output=True, text=True,
                           env={**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true"})
        assert p.returncode == 0, (cmd, p.stderr[-2000:])
        if "experiments search" in cmd:
            assert "smoke" in p.stdout
        else:  # the experiment's first id is 1: its runs, the agent's among them
            assert "gpt2-a" in p.stdout and "it1" in p.stdout


@pytest.mark.parametrize("cmd", ["hacrl --version", "hacrl stage --help"])
def test_small_cli_commands(cmd):
    p = _hacrl(shlex.split(cmd)[1:], ROOT)
    assert p.returncode == 0 and p.stdout
