"""The engine host, for real: ``dvc repro`` of generate-rollouts with ``rollout=vllm`` on the
SmolLM2 pool (SmolLM2-135M-Instruct, tied embeddings, beside an embedded qwen2), in a scratch
git + DVC workspace.

- the first stage starts one vLLM worker per agent in the workspace's host; a rerun reuses
  them and writes the same rollouts, byte for byte;
- a checkpoint edited under DVC (new weights, same path, committed) is reloaded by the host
  before the stage generates: the log-probs vLLM recorded match the trainer's forward on the
  edited checkpoint within the engine tolerance, and the rollouts change;
- ``kill -9`` of the host mid-stage: the stage starts a new host (or fails in one line), and
  the rerun's rollouts are identical to the ones before the kill; the killed host's workers
  exit (their stdin closed).

Skipped without the vLLM environment unless ``HACRL_REQUIRE_VLLM=1`` (CI), where that fails.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import dvc_workspace

from hacrl.rollout import engine_host
from hacrl.rollout.vllm_engine import vllm_python

pytestmark = pytest.mark.slow

PROJECT = Path(__file__).resolve().parents[2]
ITEMS = ("dvc.yaml", "conf", "src", "flows", "tasks", "prefect.yaml", ".gitignore", ".dvcignore", "pyproject.toml")
TINY = ["agents=smollm2_mix", "experiment=smollm2", "rollout=vllm", "tracking.enabled=false",
        "experiment.iterations=1", "data.train_size=400", "data.heldout_size=8", "data.dev_size=8",
        "rollout.prompts_per_iteration=4", "rollout.group_size=2", "rollout.max_new_tokens=24",
        "trainer.mini_batch_prompts=4", "eval.max_new_tokens=24", "agents.pool.1.warmup.max_steps=20",
        "agents.pool.1.warmup.eval_every=10"]
STAGE = "generate-rollouts@it1"
TOL = 1e-3  # the trainer's fp32 forward against vLLM's sampled log-probs (tests/agents/test_smollm2_pool.py)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HACRL_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def _run(ws: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), cwd=ws, env=_env(), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    return p


def _dvc(ws: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(ws, sys.executable, "-m", "dvc", *args, check=check)


def _rollouts_md5(ws: Path) -> str:
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"][STAGE]
    return next(o["md5"] for o in lock["outs"] if o["path"].endswith("rollouts"))


def _host_log(ws: Path) -> str:
    try:
        return engine_host.socket_path(ws).with_suffix(".log").read_text()
    except OSError:
        return ""


def _sessions(log_text: str) -> list[tuple[str, str]]:
    """(agent, mode) of every session the host opened, in order."""
    return re.findall(r"engine-host: (\S+) at \S+ \(.*?\): (start|reuse|in_place) in", log_text)


def _workers() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "vllm_worker.py"], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _gap(ws: Path, agent: str) -> float:
    """Largest |vLLM's recorded log-prob - the trainer's forward| over the agent's rollouts, the
    forward on the checkpoint the stage read."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hacrl.agents.scoring import pack, response_span, token_logprobs
    from hacrl.exchange.experience import read_records

    d = ws / "runs" / "it0" / "checkpoints" / agent
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    pad = AutoTokenizer.from_pretrained(d).pad_token_id
    df = read_records(ws / "runs" / "it1" / "rollouts" / f"{agent}.parquet", "rollout")
    rows = [r for r in df.itertuples() if len(r.response_token_ids)]
    ids, attn, resp = pack([list(r.prompt_token_ids) for r in rows], [list(r.response_token_ids) for r in rows], pad)
    with torch.no_grad():
        lp = token_logprobs(model, ids, attn, 1.0, span=response_span(resp))
    gaps = [(lp[i][resp[i].bool()] - torch.tensor(list(r.response_logprobs), dtype=torch.float32)).abs().max()
            for i, r in enumerate(rows)]
    return float(max(gaps))


def _difference(before: Path, after: Path) -> str:
    """Which agent's rollouts differ, and how: token sequences, largest log-prob difference."""
    from hacrl.exchange.experience import read_records

    lines = []
    for f in sorted(before.glob("*.parquet")):
        a, b = read_records(f, "rollout"), read_records(after / f.name, "rollout")
        if len(a) != len(b):
            lines.append(f"{f.stem}: {len(a)} vs {len(b)} rollouts")
            continue
        other = sum(list(x) != list(y) for x, y in zip(a["response_token_ids"], b["response_token_ids"]))
        gaps = [max((abs(u - v) for u, v in zip(x, y)), default=0.0)
                for x, y, tx, ty in zip(a["response_logprobs"], b["response_logprobs"], a["response_token_ids"],
                                        b["response_token_ids"]) if list(tx) == list(ty)]
        lines.append(f"{f.stem}: {other} of {len(a)} responses with other tokens, largest log-prob difference on "
                     f"the same tokens {max(gaps, default=0.0):.3g}")
    return "rollouts after the kill differ from those before it: " + "; ".join(lines)


@pytest.fixture
def ws(tmp_path):
    if not vllm_python(".venv-vllm/bin/python").exists():
        if os.environ.get("HACRL_REQUIRE_VLLM") == "1":
            pytest.fail("HACRL_REQUIRE_VLLM=1 but there is no vLLM environment (make setup-vllm)")
        pytest.skip("no vLLM environment (make setup-vllm)")
    ws = dvc_workspace(tmp_path / "ws", ITEMS)
    engine_host.stop(ws)  # a host left by an earlier test at this path (same path, same socket)
    engine_host.socket_path(ws).with_suffix(".log").unlink(missing_ok=True)
    os.symlink(PROJECT / ".venv-vllm", ws / ".venv-vllm")
    shutil.copy(PROJECT / ".dvc" / "config", ws / ".dvc" / "config")  # the project's cache links
    _run(ws, sys.executable, "-m", "hacrl.cli", "config", *TINY)
    yield ws
    engine_host.stop(ws)


def test_engines_outlive_stages_follow_the_checkpoint_and_survive_a_killed_host(ws):
    # 1. the first stage starts both workers; a rerun reuses them, same bytes
    _dvc(ws, "repro", STAGE)
    assert sorted(_sessions(_host_log(ws))) == [("qwen2-embedded", "start"), ("smollm2-135m", "start")]
    first = _rollouts_md5(ws)
    # the project's cache links (.dvc/config): outputs are linked into the cache, not copied
    for f in [*(ws / "runs" / "it1" / "rollouts").iterdir(), *(ws / "runs" / "it0" / "checkpoints").rglob("*.safetensors")]:
        assert f.stat().st_nlink == 2, f
    _dvc(ws, "repro", "--force", "--single-item", STAGE)
    assert sorted(_sessions(_host_log(ws))[2:]) == [("qwen2-embedded", "reuse"), ("smollm2-135m", "reuse")]
    assert _rollouts_md5(ws) == first
    for agent in ("qwen2-embedded", "smollm2-135m"):
        assert _gap(ws, agent) < TOL

    # 2. a checkpoint edited under DVC: same path, new weights (written beside it, then renamed
    # over it: DVC's cache is linked, never written through), committed
    import torch
    from transformers import AutoModelForCausalLM

    ck = ws / "runs" / "it0" / "checkpoints" / "qwen2-embedded"
    model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std().clamp_min(1e-3))
    tmp = ws / "edited"
    model.save_pretrained(tmp)
    os.replace(tmp / "model.safetensors", ck / "model.safetensors")
    _dvc(ws, "commit", "-f", "-q", "prepare-pool")
    _dvc(ws, "repro", "--force", "--single-item", STAGE)
    modes = dict(_sessions(_host_log(ws))[4:])
    assert modes == {"qwen2-embedded": "in_place", "smollm2-135m": "reuse"}
    assert _gap(ws, "qwen2-embedded") < TOL, "the host served other weights than the stage's checkpoint"
    edited = _rollouts_md5(ws)
    assert edited != first

    # 3. kill -9 of the host mid-stage, then the rerun: identical outputs
    kept = ws.parent / "edited_rollouts"  # for the message below, should they differ
    shutil.copytree(ws / "runs" / "it1" / "rollouts", kept)
    host_pid = engine_host.status(ws)["pid"]
    old_workers = set(_workers())
    n = len(_sessions(_host_log(ws)))
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "--force", "--single-item", STAGE], cwd=ws,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while len(_sessions(_host_log(ws))) == n and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(host_pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=900)
    if proc.returncode != 0:  # it may fail; if so, in words, and a rerun runs it
        assert "engine host" in out or "vLLM" in out, out[-3000:]
        _dvc(ws, "repro", "--single-item", STAGE)
    assert _rollouts_md5(ws) == edited, _difference(kept, ws / "runs" / "it1" / "rollouts") + "\n" + out[-2000:]
    assert engine_host.status(ws)["pid"] != host_pid
    deadline = time.time() + 60
    while old_workers & set(_workers()) and time.time() < deadline:
        time.sleep(0.5)
    assert not old_workers & set(_workers()), "the killed host's vLLM workers outlived it"
    # nothing wrote through a link into DVC's cache: the cached copies still have their hashes
    from hacrl.hashes import dvc_hash

    _dvc(ws, "checkout", "--force", "runs/it1/rollouts", "runs/it0/checkpoints")
    assert dvc_hash(ws / "runs" / "it1" / "rollouts") == edited
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]["prepare-pool"]["outs"]
    ckpts = next(o["md5"] for o in lock if o["path"].endswith("checkpoints"))
    assert dvc_hash(ws / "runs" / "it0" / "checkpoints") == ckpts
