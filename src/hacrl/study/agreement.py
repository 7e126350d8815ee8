"""How far a pool's agents agree on each other's text, measured before anything trains on it.

HACPO gives a peer's sample a gradient only while its cross ratio, the learner's probability of
the peer's response over the producer's (per token, as a geometric mean), lies in a window just
below 1 (``[lower_m, 1]``, ``lower_m`` = 0.8 at the step's first update; docs/ALGORITHMS.md,
"HACPO"). A pool whose models give each other's answers a small fraction of the producer's
probability shares nothing however long it trains: every cross sample is clipped. That takes
minutes to see and hours of suite to find out otherwise.

:func:`measure` loads the pool at an iteration's checkpoints, lets every agent sample G responses
on N dev prompts (never held-out), publishes them as the pipeline does (verified, SEE records) and
has every other agent score them through its own subscription (THL-aligned onto its tokens) with
forward passes only. Per edge (producer -> learner) it reports:

- the cross ratio's distribution in both units: ``source_tokens`` (the learner's mean log-prob over
  its tokens against the producer's mean over its own, the reference trainer's) and
  ``learner_tokens`` (both over the learner's tokens, the producer's trace aligned by THL);
- the per-token log-prob gap (nats per learner token; the log of the ``learner_tokens`` ratio);
- the share of samples inside each sharing algorithm's window: HACPO's at the first and at the
  last update that holds cross samples (the stepwise bound for the configured layout and sizes),
  and PRP's token window on the THL-aligned peer trace (the share of peer tokens inside);
- the mean effective weight a sample would get against an own sample's (``c sg[c]^alpha omega``
  inside the window, 0 outside, where its gradient is 0).

:func:`gate` turns that into a suite's go / no-go; ``hacrl agreement`` prints a table and writes
``agreement.json``, a histogram per edge with the windows drawn, and an MLflow run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import numpy as np

from hacrl.config.schema import Config, StreamConfig
from hacrl.errors import ConfigError
from hacrl.seeds import hash_seed
from hacrl.storage import atomic_write_text, read_json, write_json

log = logging.getLogger(__name__)

UNITS = ("source_tokens", "learner_tokens")
WINDOWS = ("hacpo_first", "hacpo_last")


def _hacpo_options(cfg: Config):
    """HACPO's loss options of this config (its defaults where another algorithm is configured:
    the windows say what HACPO would meet on this pool)."""
    from hacrl.rl.algorithms import LOSSES, HacpoLossOptions, build_options

    opts = build_options(LOSSES, cfg.algorithm.loss, "algorithm.loss")
    return opts if isinstance(opts, HacpoLossOptions) else HacpoLossOptions()


def cross_updates(cfg: Config, learner: str) -> list[int]:
    """The step's update indices m (0-based, all epochs) whose mini-batch holds cross samples,
    for ``learner`` under the configured layout, sizes and pool (HACPO's subscription: every
    agent's samples of every prompt)."""
    import pandas as pd

    from hacrl.rl.layout import layout, update_order

    from hacrl.rl.algorithms import LOSSES, HacpoLossOptions, build_options

    names = [a.name for a in cfg.agents]
    hacpo = isinstance(build_options(LOSSES, cfg.algorithm.loss, "algorithm.loss"), HacpoLossOptions)
    hacpo_layout = cfg.algorithm.minibatch_order if hacpo else "source_blocks"
    c = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, minibatch_order=hacpo_layout))
    prompts = [f"p{i}" for i in range(cfg.rollout.prompts_per_iteration)]
    rows = [(p, src) for src in [learner] + [n for n in names if n != learner] for p in prompts
            for _ in range(cfg.samples_per_prompt)]
    batch = pd.DataFrame({"prompt_id": [p for p, _ in rows], "producer": [s for _, s in rows]})
    batch["is_self"] = batch["producer"] == learner
    mbs = layout(batch, c, learner, seed=0)
    order = update_order(len(mbs), c, seed=0)
    return [m for m, b in enumerate(order) if (~batch["is_self"].iloc[mbs[b]]).any()]


def windows(cfg: Config, learner: str) -> dict[str, tuple[float, float]]:
    """HACPO's cross window ``[lower_m, 1]`` at the first and at the last update that holds cross
    samples (``hacpo_first``, ``hacpo_last``)."""
    from hacrl.rl.algorithms import stepwise_lower_bound

    opts = _hacpo_options(cfg)
    ms = cross_updates(cfg, learner) or [0]
    lo = {w: stepwise_lower_bound(m, opts.cross_clip_delta, opts.cross_clip_delta_step)
          for w, m in (("hacpo_first", ms[0]), ("hacpo_last", ms[-1]))}
    if not opts.cross_clip:
        return {w: (0.0, math.inf) for w in lo}
    return {w: (v, 1.0) for w, v in lo.items()}


def prp_window(cfg: Config) -> tuple[float, float]:
    """PRP's token clip ``[1 - eps_l, 1 + eps_h]`` (its options where PRP is configured, else its defaults)."""
    from hacrl.rl.algorithms import LOSSES, PrpOptions, build_options

    opts = build_options(LOSSES, cfg.algorithm.loss, "algorithm.loss")
    opts = opts if isinstance(opts, PrpOptions) else PrpOptions()
    return 1 - opts.clip_low, 1 + opts.clip_high


# ----------------------------------------------------------------------------- sampling

def dev_prompts(cfg: Config, n: int) -> list[dict]:
    """``n`` dev problems (every one when the split holds fewer), in a seeded order."""
    import random

    from hacrl.task.data import read_split

    dev = read_split(cfg.layout.tasks, "dev")
    if not dev:
        raise ConfigError("agreement: the dev split is empty (data.dev_size)")
    random.Random(hash_seed(cfg.experiment.seed, "agreement")).shuffle(dev)
    return dev[:n]


def sample_pool(cfg: Config, t: int, prompts: list[dict], samples: int) -> tuple[dict, dict, dict]:
    """Every agent's G samples on ``prompts`` from its iteration-``t`` checkpoint, verified and
    published as the pipeline publishes them. Returns (published records per producer, tokenizers,
    accuracy of the samples per agent)."""
    import pandas as pd

    from hacrl.agents.pool import load_agent
    from hacrl.exchange.experience import publish, rollout_records
    from hacrl.rollout.engine import SamplingParams, cut_at_stop
    from hacrl.rollout.hf import HFEngine
    from hacrl.task.rewards import VerifierPool, reward_of

    lay, r = cfg.layout, cfg.rollout
    rollouts, tokenizers = {}, {}
    for ac in cfg.agents:
        agent = load_agent(ac, lay.checkpoint(t, ac.name), cfg.trainer.dtype)
        rendered = [agent.render(p["problem"]) for p in prompts]
        params = SamplingParams(n=samples, temperature=r.temperature, top_p=r.top_p, sampler=r.sampler,
                                max_new_tokens=r.max_new_tokens, stop=agent.stop,
                                seed=hash_seed(cfg.experiment.seed, "agreement", t, ac.name))
        comps = cut_at_stop(HFEngine(agent.model, agent.tokenizer, r.batch_size, desc=f"agreement {ac.name}")
                            .generate(rendered, params), agent.tokenizer, agent.stop)
        rollouts[ac.name] = rollout_records(t, ac.name, ac.tokenizer_id, prompts, rendered, comps)
        tokenizers[ac.name] = agent.tokenizer
    published, accuracy = {}, {}
    with VerifierPool.of(cfg.reward) as pool:
        for name, ro in rollouts.items():
            verdicts = pool.verify(list(zip(ro["gold"], ro["response_text"])), desc=f"verify {name}")
            df = pd.DataFrame({"record_id": ro["record_id"], "producer": name, "prompt_id": ro["prompt_id"],
                               "verdict": verdicts, "reward": [reward_of(v) for v in verdicts]})
            published[name] = publish(ro, df)
            accuracy[name] = float(np.mean([v == "correct" for v in verdicts]))
    return published, tokenizers, accuracy


# ----------------------------------------------------------------------------- scoring

def _learner_logprobs(cfg: Config, model, rows, pad: int, batch: int = 16) -> list[np.ndarray]:
    """The learner's per-token log-probs of each row's response (its tokens), forward only."""
    import torch

    from hacrl.agents.scoring import pack, response_span, token_logprobs

    out = []
    with torch.no_grad():
        for b0 in range(0, len(rows), batch):
            part = rows.iloc[b0:b0 + batch]
            ids, attn, resp = pack([list(x) for x in part["input_prompt_ids"]],
                                   [list(x) for x in part["input_response_ids"]], pad)
            lp = token_logprobs(model, ids, attn, cfg.rollout.temperature, span=response_span(resp),
                                chunk=cfg.trainer.logprob_chunk)
            out += [lp[i][resp[i].bool()].numpy() for i in range(len(part))]
    return out


def score_edges(cfg: Config, t: int, published: dict, tokenizers: dict) -> dict[str, dict]:
    """Per edge ``producer->learner``: each cross sample's log-ratio in both units and the
    per-token log-ratios of the peer's aligned trace (PRP's token ratios)."""
    from hacrl.agents.pool import load_agent, prompt_template
    from hacrl.exchange.experience import LearnerView, subscribe

    stream = [StreamConfig(record_type="trajectory", producers="all")]
    edges: dict[str, dict] = {}
    for ac in cfg.agents:
        tok = tokenizers[ac.name]
        view = LearnerView(ac.name, tok, prompt_template(ac, tok))
        rows = subscribe(published, view, stream, tokenizers, cfg.algorithm.thl).rows
        cross = rows[~rows["is_self"].astype(bool)].reset_index(drop=True)
        if not len(cross):
            continue
        model = load_agent(ac, cfg.layout.checkpoint(t, ac.name), cfg.trainer.dtype).model
        lps = _learner_logprobs(cfg, model, cross, tok.pad_token_id)
        for producer in dict.fromkeys(cross["producer"]):
            sel = np.flatnonzero((cross["producer"] == producer).to_numpy())
            src, lt, tokens = [], [], []
            for i in sel:
                lp = lps[i]
                aligned = np.asarray(cross["behavior_logprobs_aligned"].iloc[i], dtype=np.float64)
                src.append(float(lp.mean()) - float(cross["behavior_logprob_mean"].iloc[i]))
                lt.append(float((lp - aligned).mean()))
                tokens.append(lp - aligned)
            edges[f"{producer}->{ac.name}"] = {"producer": producer, "learner": ac.name,
                                               "log_ratio": {"source_tokens": np.array(src),
                                                             "learner_tokens": np.array(lt)},
                                               "token_log_ratios": np.concatenate(tokens) if tokens else np.zeros(0)}
    return edges


def _inside(log_r: np.ndarray, lo: float, hi: float) -> float:
    r = np.exp(log_r)
    return float(((r >= lo) & (r <= hi)).mean()) if len(r) else float("nan")


def _effective_weight(log_r: np.ndarray, lo: float, hi: float, alpha: float, omega: float) -> float:
    """Mean over samples of ``c sg[c]^alpha omega`` where the sample passes a gradient, 0 elsewhere."""
    r = np.exp(log_r)
    inside = (r >= lo) & (r <= hi)
    return float(np.where(inside, r ** (1 + alpha) * omega, 0.0).mean()) if len(r) else float("nan")


def summarize(cfg: Config, edges: dict[str, dict], omega: dict | None) -> dict[str, dict]:
    """The figures of every edge (see the module's docstring)."""
    opts = _hacpo_options(cfg)
    prp_lo, prp_hi = prp_window(cfg)
    out = {}
    for key, e in edges.items():
        win = windows(cfg, e["learner"])
        om = float(omega[e["producer"]][e["learner"]]) if omega else 1.0
        fig: dict = {"producer": e["producer"], "learner": e["learner"], "n": int(len(e["log_ratio"]["source_tokens"])),
                     "omega": om, "windows": {w: list(v) for w, v in win.items()}}
        for unit in UNITS:
            lr = e["log_ratio"][unit]
            q = np.quantile(np.exp(lr), [0.1, 0.5, 0.9]) if len(lr) else [float("nan")] * 3
            fig[unit] = {"q10": float(q[0]), "q50": float(q[1]), "q90": float(q[2]),
                         "mean_log": float(lr.mean()) if len(lr) else float("nan"),
                         **{f"inside_{w}": _inside(lr, *win[w]) for w in WINDOWS},
                         **{f"weight_{w}": _effective_weight(lr, *win[w], opts.alpha, om) for w in WINDOWS}}
        tl = e["token_log_ratios"]
        fig["gap_nats_per_token"] = float(tl.mean()) if len(tl) else float("nan")
        fig["prp_tokens_inside"] = _inside(tl, prp_lo, prp_hi)
        out[key] = fig
    return out


# ----------------------------------------------------------------------------- the command

def measure(cfg: Config, t: int = 0, prompts: int = 32, samples: int | None = None) -> dict:
    """The agreement of ``cfg``'s pool at iteration ``t`` (its checkpoints under the config's runs
    directory; the task data under ``data/`` of the working directory)."""
    if len(cfg.agents) < 2:
        raise ConfigError(f"agents: a pool of {len(cfg.agents)} agent ({', '.join(a.name for a in cfg.agents)}) "
                          "has no edge to measure agreement on (at least two)")
    missing = [a.name for a in cfg.agents if not cfg.layout.checkpoint(t, a.name).is_dir()]
    if missing:
        raise ConfigError(f"--iteration: no checkpoint of {missing[0]} at iteration {t} "
                          f"({cfg.layout.checkpoint(t, missing[0])}); prepare the pool first")
    from hacrl.runtime import set_threads

    set_threads(cfg.experiment.threads)
    g = samples or cfg.samples_per_prompt
    ps = dev_prompts(cfg, prompts)
    published, tokenizers, accuracy = sample_pool(cfg, t, ps, g)
    cap = cfg.layout.capability(t)
    omega = read_json(cap).get("omega") if cap.exists() else None  # iteration 0: none yet (ones)
    edges = score_edges(cfg, t, published, tokenizers)
    return {"iteration": t, "prompts": len(ps), "samples": g, "temperature": cfg.rollout.temperature,
            "algorithm": cfg.algorithm.name, "unit": _hacpo_options(cfg).cross_ratio_unit,
            "prp_window": list(prp_window(cfg)), "accuracy": accuracy,
            "edges": summarize(cfg, edges, omega),
            "_log_ratios": {k: {u: e["log_ratio"][u].tolist() for u in UNITS} for k, e in edges.items()}}


def gate(result: dict, window: str = "hacpo_first", min_share: float = 0.3, edges: list[str] | None = None,
         unit: str | None = None) -> list[str]:
    """Each edge (of ``edges``; None: all) whose share of cross samples inside ``window`` is below
    ``min_share``, as ``edge: share`` lines; empty when the pool passes. ``unit``: the ratio's unit
    (default: the configured HACPO unit)."""
    unit = unit or result["unit"]
    chosen = result["edges"] if edges is None else {k: result["edges"][k] for k in edges}
    if not chosen:
        raise ConfigError("gate: it names no edge of the pool (edges: " + ", ".join(result["edges"]) + ")")
    return [f"{k} {100 * e[unit][f'inside_{window}']:.0f} %" for k, e in chosen.items()
            if not e[unit][f"inside_{window}"] >= min_share]


def table(result: dict) -> str:
    """The terminal table: one row per edge."""
    unit = result["unit"]
    head = (f"agreement at iteration {result['iteration']}: {result['prompts']} dev prompts x {result['samples']} "
            f"samples per agent, T={result['temperature']}; HACPO's ratio unit: {unit}")
    lines = [head, "", "| producer -> learner | n | ratio q10 / q50 / q90 (source tokens) | ratio q10 / q50 / q90 "
             "(learner tokens) | gap (nats/token) | inside first window | inside last window | PRP tokens inside "
             "| mean weight (first) |", "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for k, e in result["edges"].items():
        s, lt, u = e["source_tokens"], e["learner_tokens"], e[unit]
        lo_f, lo_l = e["windows"]["hacpo_first"][0], e["windows"]["hacpo_last"][0]
        lines.append(f"| {k} | {e['n']} | {s['q10']:.2f} / {s['q50']:.2f} / {s['q90']:.2f} | "
                     f"{lt['q10']:.2f} / {lt['q50']:.2f} / {lt['q90']:.2f} | {e['gap_nats_per_token']:+.3f} | "
                     f"{100 * u['inside_hacpo_first']:.0f} % [{lo_f:.3f}, 1] | "
                     f"{100 * u['inside_hacpo_last']:.0f} % [{lo_l:.3f}, 1] | {100 * e['prp_tokens_inside']:.0f} % | "
                     f"{u['weight_hacpo_first']:.3f} |")
    return "\n".join(lines)


def plot(result: dict, out_dir: Path) -> list[Path]:
    """One histogram per edge: log10 of the cross ratio in both units, HACPO's first and last
    windows shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for k, e in result["edges"].items():
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        both = {u: np.array(result["_log_ratios"][k][u]) / math.log(10) for u in UNITS}
        edges_ = np.histogram_bin_edges(np.concatenate([*both.values(), [math.log10(0.8), 0.0]]), bins=40)
        for unit, color in zip(UNITS, ("tab:blue", "tab:orange")):
            ax.hist(both[unit], bins=edges_, alpha=0.55, color=color, label=unit.replace("_", " "))
        for w, shade in (("hacpo_first", 0.18), ("hacpo_last", 0.10)):
            lo, hi = e["windows"][w]
            if lo > 0 and math.isfinite(hi):
                ax.axvspan(math.log10(lo), math.log10(hi), color="green", alpha=shade,
                           label=f"HACPO window, {w.split('_')[1]} cross update [{lo:.3f}, 1]")
        ax.set_xlabel("log10 cross ratio (learner's probability of the peer's response / producer's)")
        ax.set_ylabel("samples")
        ax.set_title(f"{k}: {e['n']} samples, iteration {result['iteration']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"agreement_{k.replace('->', '_to_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write(result: dict, out_dir: Path) -> list[Path]:
    """``agreement.json`` (the figures and every sample's log-ratios), ``agreement.md`` (the
    table) and the histograms, into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "agreement.json", result)
    atomic_write_text(out_dir / "agreement.md", table(result) + "\n")
    return [out_dir / "agreement.json", out_dir / "agreement.md", *plot(result, out_dir)]


def log_to_mlflow(cfg: Config, result: dict, files: list[Path], project_dir: Path) -> str | None:
    """An MLflow run ``agreement-itT`` in the experiment's store: the figures per edge as metrics,
    the files as artifacts; its id (None when tracking is off)."""
    if not cfg.tracking.enabled:
        return None
    from mlflow.tracking import MlflowClient

    from hacrl.ops.tracking import experiment_id, tracking_uri

    client = MlflowClient(tracking_uri(cfg, project_dir))
    run = client.create_run(experiment_id(client, cfg, project_dir), run_name=f"agreement-it{result['iteration']}",
                            tags={"hacrl.kind": "agreement"})
    rid = run.info.run_id
    for k in ("iteration", "prompts", "samples", "temperature", "unit", "algorithm"):
        client.log_param(rid, k, str(result[k]))
    for k, e in result["edges"].items():
        edge = k.replace("->", "_to_")
        for unit in UNITS:
            for f, v in e[unit].items():
                if isinstance(v, float) and math.isfinite(v):
                    client.log_metric(rid, f"agreement/{edge}/{unit}/{f}", v)
        client.log_metric(rid, f"agreement/{edge}/gap_nats_per_token", e["gap_nats_per_token"])
    for f in files:
        client.log_artifact(rid, str(f))
    client.set_terminated(rid)
    return rid
