"""Shared fixtures: a tiny pool built through the real code path (transformers + tokenizers)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("MKL_DYNAMIC", "FALSE")  # as hacrl.cli sets it: figures independent of the load
os.environ.setdefault("OMP_DYNAMIC", "FALSE")

# a miniature config (tiny pool, tiny budgets): the same code path, in seconds
SMOKE = ["experiment=smoke", "agents=tiny", "rollout.prompts_per_iteration=16", "rollout.group_size=4",
         "rollout.max_new_tokens=12", "data.train_size=1000", "data.heldout_size=100", "data.dev_size=40",
         "trainer.mini_batch_prompts=8", "eval.max_new_tokens=12"]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def tiny_problems():
    from hacrl.task.data import generate_split

    levels = {"add": 0.5, "sub": 0.5}
    return {
        "train": generate_split("train", 800, levels, 99, 0.2, 0),
        "heldout": generate_split("heldout", 100, levels, 99, 0.2, 0),
    }


def make_agent(arch: str, kind: str, tiny_problems, name: str | None = None):
    import torch

    from hacrl.agents.pool import Agent, build_model, train_tokenizer
    from hacrl.config.schema import AgentConfig, TokenizerConfig
    from hacrl.task.data import completion_text

    mc = {
        "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64},
        "llama": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128},
        "qwen2": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "intermediate_size": 64, "max_position_embeddings": 128},
    }[arch]
    ac = AgentConfig(name=name or f"{arch}-{kind}", arch=arch, model_config=mc,
                     tokenizer=TokenizerConfig(kind=kind, vocab_size=120), template="Q: {problem}\nA:")
    corpus = [ac.template.replace("{problem}", p["problem"]) + completion_text(p["answer"])
              for p in tiny_problems["train"]]
    tok = train_tokenizer(ac.tokenizer, corpus)
    torch.manual_seed(0)
    return ac, Agent(ac.name, tok, build_model(ac, tok), ac.template)


def dvc_workspace(dest: Path, items: tuple[str, ...]) -> Path:
    """A copy of the project's ``items`` in ``dest``, made a git + DVC repo (analytics off)."""
    import shutil
    import subprocess

    dest.mkdir(parents=True)
    for item in items:
        src = ROOT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dest / item)
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"],
                [sys.executable, "-m", "dvc", "config", "core.analytics", "false"]):
        subprocess.run(cmd, cwd=dest, check=True, capture_output=True)
    return dest


BOOKKEEPING = {"micro_batches", "seconds", "tokens_per_s", "old_logprobs_recomputed", "gen_vs_train_logprob_maxdiff",
               "world_size"}
"""What a cut (or data-parallel) step legitimately reports otherwise: its forwards, its time, and pi_old passes
(a whole first mini-batch takes pi_old from its first training forward)."""


def assert_same_figures(whole: dict, cut: dict, where: str, tol: float = 1e-6) -> None:
    """Every figure of the cut step equals the whole step's, to ``tol`` (relative above 1): the
    same keys, each per-update series entry by entry, each step figure. A quantile of the
    per-sample ratios is one sample's float32 ratio, whose forward another padding rounds
    otherwise: 2 ``tol`` (seen: 1.0e-6 on a q10 after four updates)."""
    import math

    assert set(whole) - BOOKKEEPING == set(cut) - BOOKKEEPING, f"{where}: keys differ"
    assert set(whole["per_update"]) == set(cut["per_update"]), f"{where}: per-update figures differ"
    for k, series in whole["per_update"].items():
        for i, (x, y) in enumerate(zip(series, cut["per_update"][k], strict=True)):
            assert (x is None) == (y is None), f"{where}: per_update {k}[{i}] {x} against {y}"
            if x is not None:
                assert y == pytest.approx(x, rel=tol, abs=tol), f"{where}: per_update {k}[{i}]"
    for k, x in whole.items():
        if k in BOOKKEEPING or k == "per_update" or not isinstance(x, (int, float)):
            continue
        y = cut[k]
        t = 2 * tol if k.startswith("ratio/") and k.rsplit("/", 1)[1] in ("q10", "q50", "q90", "min", "max") else tol
        if isinstance(x, float) and math.isnan(x):
            assert math.isnan(y), f"{where}: {k}"
        else:
            assert y == pytest.approx(x, rel=t, abs=t), f"{where}: {k} whole {x} cut {y}"


@pytest.fixture(scope="session", autouse=True)
def _stop_stage_server():
    """Stage processes the tests start leave a warm stage server behind (hacrl.ops.stage_server):
    stop it when the session ends rather than after its idle timeout."""
    yield
    import subprocess

    subprocess.run([sys.executable, "-c", "import hacrl.cli; from hacrl.ops import stage_server; stage_server.stop()"],
                   capture_output=True)
