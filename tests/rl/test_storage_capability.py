import pandas as pd
import pytest

from hacrl.rl.capability import omega_matrix, update_history, windowed_capability
from hacrl.storage import atomic_path, clean_tmp, write_json


def test_atomic_dir_is_invisible_until_complete_and_removed_on_error(tmp_path):
    final = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with atomic_path(final, is_dir=True) as tmp:
            (tmp / "half.bin").write_bytes(b"x" * 10)
            assert not final.exists()
            raise RuntimeError("killed")
    assert not final.exists() and list(tmp_path.iterdir()) == []
    with atomic_path(final, is_dir=True) as tmp:
        (tmp / "w.bin").write_bytes(b"ok")
    assert (final / "w.bin").read_bytes() == b"ok"


def test_clean_tmp_removes_debris_of_a_killed_writer(tmp_path):
    (tmp_path / "runs" / "it1").mkdir(parents=True)
    (tmp_path / "runs" / "it1" / ".tmp-rollouts-abc").mkdir()
    (tmp_path / "runs" / "it1" / ".tmp-x.json-1").write_text("{")
    write_json(tmp_path / "runs" / "it1" / "done.json", {"a": 1})
    assert clean_tmp(tmp_path / "runs") == 2
    assert [p.name for p in (tmp_path / "runs" / "it1").iterdir()] == ["done.json"]


def test_a_stage_start_cleans_every_place_stages_write_reports_included(tmp_path, monkeypatch):
    """kill -9 in the report stage left reports/.tmp-accuracy.png-* behind (the kill benchmark, seed 2):
    a stage start cleaned runs/ and data/ only."""
    from types import SimpleNamespace

    from hacrl.cli import clean_debris

    monkeypatch.chdir(tmp_path)
    for d in ("runs/it1", "data/tasks", "out/plots"):
        (tmp_path / d).mkdir(parents=True)
    for f in ("runs/it1/.tmp-x.json-1", "data/tasks/.tmp-train.jsonl-2", "out/.tmp-accuracy.png-3",
              "out/plots/.tmp-eval_accuracy.csv-4", "out/summary.json"):
        (tmp_path / f).write_text("x")
    # the MLflow flusher writes beside the stages: its temporary file of the moment is not debris
    (tmp_path / "runs/.tracking").mkdir()
    (tmp_path / "runs/.tracking/.tmp-runs.json-5").write_text("{")
    cfg = SimpleNamespace(experiment=SimpleNamespace(runs_dir="runs", reports_dir="out"))
    assert clean_debris(cfg) == 4 and [p.name for p in (tmp_path / "out").rglob("*") if p.is_file()] == ["summary.json"]
    assert (tmp_path / "runs/.tracking/.tmp-runs.json-5").exists()


def test_a_writer_killed_before_the_rename_leaves_only_debris(tmp_path):
    import os
    import subprocess
    import sys

    code = ("from hacrl.storage import atomic_path\n"
            f"with atomic_path({str(tmp_path / 'ckpt')!r}, is_dir=True) as tmp:\n"
            "    (tmp / 'weights.bin').write_bytes(b'0' * 4096)\n")
    env = {**os.environ, "HACRL_FAULT": "kill-before-rename:ckpt"}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == -9
    assert not (tmp_path / "ckpt").exists()
    assert len(list(tmp_path.glob(".tmp-ckpt-*/weights.bin"))) == 1  # complete, but not under its name
    assert clean_tmp(tmp_path) == 1 and not list(tmp_path.iterdir())


def test_windowed_capability_and_omega_clamp():
    hist = [{"a": 0.1, "b": 0.5}, {"a": 0.3, "b": 0.5}, {"a": 0.5, "b": 0.5}]
    p = windowed_capability(hist, ["a", "b"], window=2)
    assert p == pytest.approx({"a": 0.4, "b": 0.5})
    om = omega_matrix({"a": 0.01, "b": 0.5, "c": 0.25})
    assert om["a"]["b"] == 0.1 and om["b"]["a"] == 10.0 and om["b"]["c"] == pytest.approx(2.0)
    assert omega_matrix({"a": 0.01, "b": 0.5}, warmup=True)["a"]["b"] == 1.0


def test_history_extends_the_previous_iteration():
    def rewards(vals):
        return pd.DataFrame({"prompt_id": [f"p{i // 2}" for i in range(len(vals))], "reward": vals})

    d1 = update_history({"steps": []}, 1, {"a": rewards([1, 0, 0, 0]), "b": rewards([1, 1, 1, 0])}, 5, 0.1, 10, 0)
    d2 = update_history(d1, 2, {"a": rewards([1, 1, 0, 0]), "b": rewards([1, 1, 1, 1])}, 5, 0.1, 10, 0)
    assert [s["iteration"] for s in d2["steps"]] == [1, 2]
    assert d2["p_hat"]["a"] == pytest.approx((0.25 + 0.5) / 2)
    assert d2["omega"]["b"]["a"] == pytest.approx(((0.75 + 1) / 2) / 0.375)
    assert d2["pooled"]["prompts"] == 2
