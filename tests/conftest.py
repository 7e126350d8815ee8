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


def plain(df) -> list[dict]:
    """Rows as plain Python values (Parquet gives list columns back as numpy arrays)."""
    return [{k: (list(v) if hasattr(v, "__len__") and not isinstance(v, str) else v) for k, v in r.items()}
            for r in df.to_dict("records")]


def fixed_rewards(df):
    """A fixed 0/1 reward per record (a third of them 1, spread within prompt groups): the barely
    warmed-up tiny pool scores about 0, which trains nothing."""
    n = df["record_id"].map(lambda r: sum(map(ord, r)))
    return ((n % 3) == 0).astype(float)


class Workspaces:
    """Scratch workspaces of the tiny pool (:data:`SMOKE`), all under one directory that holds
    the task data (stages read ``data/`` from the working directory, as under DVC). The pool is
    prepared once, by the stage table's prepare stages; each variant copies its iteration 0 and
    runs the table's iteration stages in order."""

    def __init__(self, root: Path):
        self.root = root
        self._done: dict = {}

    def config(self, name: str, *overrides: str):
        """SMOKE + ``overrides``, its runs and reports under ``root/name``."""
        from hacrl.pipeline import params

        d = params.compose([*SMOKE, *overrides])
        d["experiment"]["runs_dir"] = str(self.root / name / "runs")
        d["experiment"]["reports_dir"] = str(self.root / name / "reports")
        return params.from_dict(d)

    def inside(self):
        """A context in the workspaces' directory (where ``data/`` is)."""
        import contextlib

        @contextlib.contextmanager
        def cd():
            cwd = os.getcwd()
            os.chdir(self.root)
            try:
                yield self.root
            finally:
                os.chdir(cwd)
        return cd()

    def prepared(self) -> Path:
        """Iteration 0 of the pool (data, checkpoints, train state, capability), once."""
        from hacrl.pipeline import table

        base = self.root / "base" / "runs" / "it0"
        if not base.exists():
            cfg = self.config("base")
            with self.inside():
                for s in table.STAGES:
                    if s.kind == table.PREPARE:
                        table.run(s.name, cfg)
        return base

    def iteration(self, name: str, *overrides: str, until: str = "update-policies", rewards=None):
        """Workspace ``name`` (a config of ``overrides``) with iteration 1 run up to, not
        including, stage ``until``; ``rewards`` (verdict rows -> 0/1) replaces the verifier's
        rewards after verify-rewards. Made once per name; returns its config."""
        import shutil

        from hacrl.exchange.experience import read_records, write_records
        from hacrl.pipeline import table
        from hacrl.storage import RunLayout

        if name in self._done:
            return self._done[name]
        cfg = self.config(name, *overrides)
        lay = RunLayout(cfg.experiment.runs_dir)
        shutil.copytree(self.prepared(), lay.it(0))
        with self.inside():
            for stage in table.iteration_stages():
                if stage == until:
                    break
                table.run(stage, cfg, 1)
                if stage == "verify-rewards" and rewards is not None:
                    for a in cfg.agents:
                        f = lay.rewards(1) / f"{a.name}.parquet"
                        df = read_records(f, "verdict")
                        df["reward"] = rewards(df)
                        df["verdict"] = df["reward"].map({1.0: "correct", 0.0: "wrong"})
                        write_records(f, df, "verdict")
        self._done[name] = cfg
        return cfg


@pytest.fixture(scope="session")
def workspaces(tmp_path_factory) -> Workspaces:
    """The tiny pool's scratch workspaces, prepared once per test session (see :class:`Workspaces`)."""
    return Workspaces(tmp_path_factory.mktemp("workspaces"))


@pytest.fixture(scope="session", autouse=True)
def _stop_stage_server():
    """Stage processes the tests start leave a warm stage server behind (hacrl.ops.stage_server):
    stop it when the session ends rather than after its idle timeout."""
    yield
    import subprocess

    subprocess.run([sys.executable, "-c", "import hacrl.cli; from hacrl.ops import stage_server; stage_server.stop()"],
                   capture_output=True)
