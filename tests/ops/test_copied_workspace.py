"""A workspace copied with `cp -a` neither logs into the original's MLflow store nor runs the
original's code through its copied virtual environment: each says so in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import SMOKE

from hacrl.pipeline import params
from hacrl.pipeline.result import StageResult

ROOT = Path(__file__).resolve().parents[2]


def test_a_copied_workspace_does_not_log_into_the_original(tmp_path, monkeypatch):
    """`cp -a` keeps mlflow.db, whose experiments hold absolute artifact locations: the copy says
    so in one line and logs nothing (which would write into the original's folder)."""
    import shutil

    from hacrl.ops import track_queue, tracking
    from hacrl.pipeline.params import write_params

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    orig = tmp_path / "orig ws"
    orig.mkdir()
    cfg = params.from_dict(params.compose([*SMOKE, "tracking.enabled=true", "tracking.asynchronous=false"]))
    assert tracking.foreign_store(cfg, orig) is None  # no store yet
    ckpt = orig / "runs" / "it0" / "checkpoints" / "gpt2-a"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_text("weights")
    track_queue.log_stage(cfg, "prepare-pool", 0, StageResult({}, checkpoints={"gpt2-a": "runs/it0/checkpoints/gpt2-a"}),
                       1.0, project_dir=orig)
    assert "MLFLOW_TRACKING_URI" not in os.environ  # registering a model leaves the environment as it was
    track_queue.log_stage(cfg, "verify-rewards", 1, StageResult({}, agents={"gpt2-a": {"reward_mean": 0.5}}), 1.0,
                       project_dir=orig)
    assert tracking.foreign_store(cfg, orig) is None  # its own store
    copy = tmp_path / "copy"
    shutil.copytree(orig, copy, symlinks=True)
    msg = tracking.foreign_store(cfg, copy)
    assert msg.startswith(f"mlflow.db belongs to {orig} (experiment 'smoke' keeps its artifacts in {orig}/mlartifacts")
    before = (orig / "mlflow.db").read_bytes(), (copy / "mlflow.db").read_bytes()
    track_queue.log_stage(cfg, "verify-rewards", 2, StageResult({}, agents={"gpt2-a": {"reward_mean": 0.6}}), 1.0,
                       project_dir=copy)
    assert ((orig / "mlflow.db").read_bytes(), (copy / "mlflow.db").read_bytes()) == before
    # the same under `make serve`, which exports the (copy's) project store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{copy / 'mlflow.db'}")
    assert tracking.foreign_store(cfg, copy) == msg
    track_queue.log_stage(cfg, "verify-rewards", 3, StageResult({}, agents={"gpt2-a": {"reward_mean": 0.7}}), 1.0,
                       project_dir=copy)
    assert ((orig / "mlflow.db").read_bytes(), (copy / "mlflow.db").read_bytes()) == before
    assert len(list((orig / "mlartifacts").rglob("MLmodel"))) == 1  # the original's one model, no more
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    # `hacrl config` there says it in one line
    write_params(params.compose(SMOKE), copy / "params.yaml")
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "config", *SMOKE], cwd=copy, capture_output=True, text=True,
                       env={k: v for k, v in __import__("os").environ.items() if k != "MLFLOW_TRACKING_URI"})
    assert p.returncode == 0 and f"hacrl: warning: mlflow.db belongs to {orig}" in p.stderr
    # an explicitly chosen store is the user's business
    cfg.tracking.uri = f"sqlite:///{orig / 'mlflow.db'}"
    assert tracking.foreign_store(cfg, copy) is None



def test_a_venv_made_for_another_checkout_is_refused_in_one_line(tmp_path):
    def venv_of(owner: Path) -> Path:
        d = tmp_path / "ws" / ".venv" / "lib" / "python3.11" / "site-packages" / "hacrl-0.1.0.dist-info"
        d.mkdir(parents=True, exist_ok=True)
        (d / "direct_url.json").write_text(json.dumps({"dir_info": {"editable": True}, "url": owner.as_uri()}))
        return tmp_path / "ws"

    ws = venv_of(tmp_path / "orig ws")
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_venv.py"), ".venv"], cwd=ws,
                       capture_output=True, text=True)
    assert p.returncode == 1
    assert p.stderr.strip() == (f"hacrl: error: .venv was made for {tmp_path / 'orig ws'} (it imports that "
                                f"checkout's code): this directory was copied; remove .venv (rm -rf .venv) "
                                f"and run make again")
    venv_of(ws)  # made here: fine
    assert subprocess.run([sys.executable, str(ROOT / "scripts" / "check_venv.py")], cwd=ws).returncode == 0
    # this checkout's own venv passes (what `make setup` checks first)
    assert subprocess.run([sys.executable, "scripts/check_venv.py"], cwd=ROOT).returncode == 0
