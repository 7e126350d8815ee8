"""scripts/gpu_check.sh is meant for a GPU host; here it runs on the CPU (HACRL_GPU_CHECK_ON_CPU=1,
the tiny pool, transformers rollouts) so that the script itself cannot rot where CI runs. Its
figures mean nothing here; on a host without GPUs and without that switch it refuses clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(args, env_extra, tmp_path):
    env = dict(os.environ, PY=sys.executable, **env_extra)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=900)


def test_gpu_check_refuses_a_host_without_gpus(tmp_path):
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("this host has nvidia-smi")
    p = _run([], {}, tmp_path)
    assert p.returncode == 2 and "not a GPU host" in p.stderr


@pytest.mark.slow
def test_gpu_check_runs_one_iteration_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    p = _run(["--agents", "tiny", "--engine", "hf", "--dtype", "fp32", "--prompts", "8", "--group", "2",
              "--tokens", "8", "--update-samples", "16", "--update-tokens", "96", "--micro-batch-tokens", "640",
              "--out", str(out)], {"HACRL_GPU_CHECK_ON_CPU": "1"}, tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rep = json.loads(Path(out).read_text())
    assert [r["stage"] for r in rep["stages"]] == [
        "prepare-data", "prepare-pool", "evaluate-warmup", "generate-rollouts", "verify-rewards", "exchange-and-align",
        "compute-capability-stats", "update-policies", "evaluate"]
    assert all(r["seconds"] >= 0 for r in rep["stages"]) and rep["gpus"] == 0
    assert set(rep["rollouts"]) == {"gpt2-a", "llama-b"}
    assert "generate-rollouts" in p.stdout and "total" in p.stdout
    # the update at realistic lengths (here: 16 x (64 + 96) tokens, micro-batched) and its prediction
    check = rep["update_check"]
    assert check["micro_batches"] > 1 and check["predicted_mib"] > 0 and "update at realistic lengths" in p.stdout
