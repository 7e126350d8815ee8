"""``hacrl compare``: run contenders on the same pool, prompts and seeds; write a comparison report.

The pool and the task data are prepared once (``<out>/base``); every contender x seed starts
from that iteration-0 state and runs its iterations through the same stage functions as
``dvc repro`` (:func:`hacrl.pipeline.in_process.run_in_process`), in this process (the DVC path costs a
process per stage). Results: ``reports/<suite>/`` with ``results.json`` (every curve), a table
per agent (final held-out accuracy mean +- std over seeds; area under the accuracy curve
against rollouts generated, up to the budget every contender reached, so equal-cost
comparisons are explicit), plots against iterations and against rollouts, and a README that
says which of the paper's findings reproduce here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np

from hacrl.config.schema import Config
from hacrl.errors import ConfigError
from hacrl.pipeline import params
from hacrl.pipeline.in_process import prepare_experiment, run_in_process
from hacrl.storage import RunLayout, read_json, write_json

log = logging.getLogger(__name__)

HACPO_ABLATIONS = {
    "hacpo-adv": ["algorithm.advantage.capability_aware=false"],
    "hacpo-omega": ["algorithm.loss.discrepancy_coef=false"],
    "hacpo-expIS": ["algorithm.loss.alpha=0"],
    "hacpo-clip": ["algorithm.loss.cross_clip=false"],
    "hacpo-stepwise": ["algorithm.loss.cross_clip_delta_step=0"],
}

HACPO_CONTENDERS = {
    "grpo": ["algorithm=grpo"],
    "gspo": ["algorithm=gspo"],
    "gspo_x2": ["algorithm=gspo_x2"],
    "naive_share": ["algorithm=naive_share"],
    "hacpo": ["algorithm=hacpo"],  # the reference trainer's layout, EOS and ratio
    "hacpo_learner_tokens": ["algorithm=hacpo", "algorithm.loss.cross_ratio_unit=learner_tokens"],
    # one change of the reference set-up each: what moved the result
    "hacpo_self_first": ["algorithm=hacpo", "algorithm.minibatch_order=self_first"],
    "hacpo_keep_eos": ["algorithm=hacpo", "algorithm.thl.peer_eos=keep_if_stopped"],
    **{k: ["algorithm=hacpo", *v] for k, v in HACPO_ABLATIONS.items()},
    # step-size probes (run on demand with --contenders, added to a setting's report): HACPO takes
    # n times GSPO's optimizer updates per step; do more updates alone, on the learner's own
    # samples, cost GSPO what HACPO loses, and does a smaller step close the gap?
    "gspo_3passes": ["algorithm=gspo", "trainer.epochs=3"],
    "gspo_lr3e4": ["algorithm=gspo", "trainer.lr=3e-4"],
    "hacpo_lr3e4": ["algorithm=hacpo", "trainer.lr=3e-4"],
    "gspo_lr1e4": ["algorithm=gspo", "trainer.lr=1e-4"],
    "hacpo_lr1e4": ["algorithm=hacpo", "trainer.lr=1e-4"],
    "gspo_x2_lr1e4": ["algorithm=gspo_x2", "trainer.lr=1e-4"],
    "gspo_3passes_lr1e4": ["algorithm=gspo", "trainer.epochs=3", "trainer.lr=1e-4"],
}
CORE = ["gspo", "gspo_x2", "naive_share", "hacpo", "hacpo_learner_tokens"]

# the paper's step shape (128 prompts, 8 samples per agent, mini-batches of 64 prompts) and the
# reference runs' KL (0.001, k3, on self samples) for every contender alike
HACPO_STEP = ["rollout.prompts_per_iteration=128", "trainer.mini_batch_prompts=64", "algorithm.kl_coef=0.001"]


# the claims checked per agent: (text, better contender, worse contender); a 4th element names the
# kind (see :func:`findings`), default ``final``
HACPO_CLAIMS = [
    ("HACPO above GSPO x2", "hacpo", "gspo_x2"),
    ("GSPO x2 above GSPO", "gspo_x2", "gspo"),
    ("HACPO above GSPO", "hacpo", "gspo"),
    ("naive sharing below GSPO", "gspo", "naive_share"),
    ("HACPO above naive sharing", "hacpo", "naive_share"),
    ("HACPO above GRPO", "hacpo", "grpo"),
    ("ratio over learner tokens above the reference ratio", "hacpo_learner_tokens", "hacpo"),
    ("reference layout above the mixed self_first layout", "hacpo", "hacpo_self_first"),
    ("dropping the peer's terminal EOS above keeping it", "hacpo", "hacpo_keep_eos"),
    *[(f"ablation {k.replace('hacpo', '')} costs accuracy", "hacpo", k) for k in HACPO_ABLATIONS],
    ("GSPO with three passes (HACPO's update count, own samples only) above one pass", "gspo_3passes", "gspo"),
    ("HACPO above GSPO, both at lr 3e-4", "hacpo_lr3e4", "gspo_lr3e4"),
    ("GSPO at lr 3e-4 above lr 5e-4", "gspo_lr3e4", "gspo"),
    ("HACPO at lr 3e-4 above lr 5e-4", "hacpo_lr3e4", "hacpo"),
    ("HACPO above GSPO, both at lr 1e-4", "hacpo_lr1e4", "gspo_lr1e4"),
    ("HACPO above GSPO x2, both at lr 1e-4", "hacpo_lr1e4", "gspo_x2_lr1e4"),
    ("GSPO x2 above GSPO, both at lr 1e-4", "gspo_x2_lr1e4", "gspo_lr1e4"),
    ("HACPO above GSPO with three passes (the same update count), both at lr 1e-4", "hacpo_lr1e4",
     "gspo_3passes_lr1e4"),
]

MUTUAL_CONTENDERS = {
    "grpo": ["algorithm=grpo"],
    "prp": ["algorithm=prp"],  # the learner's snapshot as the peer samples' denominator
    "prp_thl": ["algorithm=prp", "algorithm.loss.peer_denominator=thl_aligned_peer"],
    "xgrpo": ["algorithm=xgrpo"],
    "sgt": ["algorithm=sgt"],
    # SGT's control: the same row filter and layout with the NLL weight 0, so GRPO plus nothing --
    # is SGT's gain the injected answers?
    "sgt_nll0": ["algorithm=sgt", "algorithm.loss.nll_weight=0"],
    # step-size probes (run on demand with --contenders): HACPO's ordering appeared only at lr 1e-4
    "grpo_lr1e4": ["algorithm=grpo", "trainer.lr=1e-4"],
    "prp_lr1e4": ["algorithm=prp", "trainer.lr=1e-4"],
    "prp_thl_lr1e4": ["algorithm=prp", "algorithm.loss.peer_denominator=thl_aligned_peer", "trainer.lr=1e-4"],
    "sgt_lr1e4": ["algorithm=sgt", "trainer.lr=1e-4"],
}
MUTUAL_CORE = ["grpo", "prp", "prp_thl", "xgrpo", "sgt", "sgt_nll0"]

MUTUAL_CLAIMS = [
    ("SGT above GRPO on the mean over agents", "sgt", "grpo", "average"),
    ("SGT above XGRPO on the mean over agents", "sgt", "xgrpo", "average"),
    ("SGT above PRP on the mean over agents", "sgt", "prp", "average"),
    ("SGT above PRP (THL-aligned) on the mean over agents", "sgt", "prp_thl", "average"),
    ("SGT at or above GRPO at every checkpoint", "sgt", "grpo", "every_checkpoint"),
    ("SGT above GRPO", "sgt", "grpo"),
    ("XGRPO indistinguishable from GRPO", "xgrpo", "grpo", "equal"),
    ("PRP below GRPO (the weaker agent hurt)", "grpo", "prp"),
    ("PRP lowers the policy entropy (GRPO above PRP)", "grpo", "prp", "entropy"),
    ("PRP raises the KL to the initial model", "prp", "grpo", "kl"),
    ("PRP (THL-aligned) below GRPO", "grpo", "prp_thl"),
    ("PRP (THL-aligned) lowers the entropy (GRPO above it)", "grpo", "prp_thl", "entropy"),
    ("PRP (THL-aligned) raises the KL to the initial model", "prp_thl", "grpo", "kl"),
    ("THL-aligned PRP above snapshot PRP", "prp_thl", "prp"),
    ("THL-aligned PRP keeps more entropy than snapshot PRP", "prp_thl", "prp", "entropy"),
    ("THL-aligned PRP drifts less (KL) than snapshot PRP", "prp", "prp_thl", "kl"),
    ("SGT above its control with lambda 0 (the injected answers carry the gain)", "sgt", "sgt_nll0"),
    ("SGT with lambda 0 indistinguishable from GRPO", "sgt_nll0", "grpo", "equal"),
    ("SGT above GRPO on the mean over agents, both at lr 1e-4", "sgt_lr1e4", "grpo_lr1e4", "average"),
    ("SGT above GRPO, both at lr 1e-4", "sgt_lr1e4", "grpo_lr1e4"),
    ("PRP below GRPO, both at lr 1e-4", "grpo_lr1e4", "prp_lr1e4"),
    ("PRP (THL-aligned) below GRPO, both at lr 1e-4", "grpo_lr1e4", "prp_thl_lr1e4"),
    ("PRP raises the KL to the initial model, both at lr 1e-4", "prp_lr1e4", "grpo_lr1e4", "kl"),
    ("PRP at lr 1e-4 above PRP at lr 5e-4", "prp_lr1e4", "prp"),
]

# Mutual RL's step: GRPO's embedded settings at the HACPO suite's step size (128 prompts, 8 samples
# per agent, mini-batches of 64 prompts), no KL term, the KL to the initial model measured
MUTUAL_STEP = ["rollout.prompts_per_iteration=128", "trainer.mini_batch_prompts=64",
               "trainer.measure_kl_to_init=true"]

SUITES: dict[str, dict] = {
    "hacpo": {
        "settings": {
            "default": {"about": "the embedded pool (three tokenizers), boxed answers",
                        "base": [*HACPO_STEP, "experiment.iterations=6"],
                        "contenders": list(HACPO_CONTENDERS)},
            "shared_tok": {"about": "two agents sharing one tokenizer at two sizes (agents=embedded_shared_tok)",
                           "base": [*HACPO_STEP, "experiment.iterations=6", "agents=embedded_shared_tok"],
                           "contenders": CORE},
            "worked": {"about": "the embedded pool writing worked solutions of tens of tokens (data=arith_worked)",
                       "base": [*HACPO_STEP, "experiment.iterations=5", "data=arith_worked",
                                "rollout.max_new_tokens=40", "eval.max_new_tokens=40"],
                       "contenders": CORE},
        },
        "all": HACPO_CONTENDERS,
        "claims": HACPO_CLAIMS,
    },
    "mutual": {
        "settings": {
            "default": {"about": "the embedded pool (three tokenizers), boxed answers",
                        "base": [*MUTUAL_STEP, "experiment.iterations=6"],
                        "contenders": MUTUAL_CORE},
            "worked": {"about": "the embedded pool writing worked solutions of tens of tokens (data=arith_worked)",
                       "base": [*MUTUAL_STEP, "experiment.iterations=5", "data=arith_worked",
                                "rollout.max_new_tokens=40", "eval.max_new_tokens=40"],
                       "contenders": MUTUAL_CORE},
        },
        "all": MUTUAL_CONTENDERS,
        "claims": MUTUAL_CLAIMS,
    },
}

# the per-update figures kept from each run (the rest of update_stats stays in the run's MLflow)
TRAIN_KEYS = ("cross_objective_share", "cross_gradient_share", "cross_ratio_mean", "cross_clipped_below", "cross_clipped_above",
              "kl_to_init", "kl_init_before_step", "entropy", "updates", "reward_mean", "peer_ratio_mean",
              "peer_clip_frac", "rescues", "trigger_rate", "own_all_wrong_prompts")
# per-iteration figures of the evaluation kept from each run (SGT: did the rescues stick)
EVAL_KEYS = ("rescued_now_accuracy", "rescued_now_n", "rescued_before_accuracy", "rescued_before_n")


def _cfg(overrides: list[str], runs_dir: Path, reports_dir: Path) -> Config:
    data = params.compose(overrides)
    data["experiment"]["runs_dir"] = str(runs_dir)
    data["experiment"]["reports_dir"] = str(reports_dir)
    return params.from_dict(data)


def prepare_base(base_overrides: list[str], out: Path) -> Config:
    """Task data, pool and the iteration-0 evaluation, once; reused while the config is the same."""
    base = out / "base"
    cfg = _cfg(base_overrides, base / "runs", base / "reports")
    key = json.dumps({"data": dataclasses.asdict(cfg.data), "agents": [dataclasses.asdict(a) for a in cfg.agents],
                      "seed": cfg.experiment.seed, "eval": dataclasses.asdict(cfg.eval)}, sort_keys=True)
    stamp = base / "prepared.json"
    if stamp.exists() and read_json(stamp).get("key") == key:
        log.info("reusing the prepared pool in %s", base)
        return cfg
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    with contextlib.chdir(base):
        t0 = time.time()
        prepare_experiment(cfg)
    write_json(stamp, {"key": key, "seconds": round(time.time() - t0, 1)})
    return cfg


RESULT_FILE = "result.json"
"""A finished run's curves, next to its scratch state (``<work>/<suite>/<setting>/<contender>/seed<k>/``)."""


def finished_run(name: str, overrides: list[str], seed: int, out: Path) -> dict | None:
    """The curves an earlier (interrupted) suite wrote for this contender and seed, if its
    overrides were the same; None otherwise."""
    f = out / name / f"seed{seed}" / RESULT_FILE
    if not f.exists():
        return None
    res = read_json(f)
    if res.pop("overrides", None) != overrides + [f"experiment.seed={seed}"]:
        return None
    return res


def run_contender(name: str, overrides: list[str], seed: int, out: Path) -> dict:
    """One contender with one seed from the prepared iteration 0; returns its curves."""
    base = out / "base"
    run_dir = out / name / f"seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = _cfg(overrides + [f"experiment.seed={seed}"], run_dir / "runs", run_dir / "reports")
    shutil.copytree(base / "runs" / "it0", run_dir / "runs" / "it0")
    t0 = time.time()
    with contextlib.chdir(base):  # data/tasks of the base
        timings = run_in_process(cfg, prepare=False)
    lay = RunLayout(cfg.experiment.runs_dir)
    history = read_json(lay.history(cfg.experiment.iterations))
    agents = [a.name for a in cfg.agents]
    per_iter = cfg.rollout.prompts_per_iteration * cfg.samples_per_prompt  # rollouts per agent
    res = {"contender": name, "seed": seed, "algorithm": cfg.algorithm.name, "seconds": round(time.time() - t0, 1),
           "stage_seconds": {k: round(v, 1) for k, v in timings.items()},
           "rollouts_per_agent_per_iteration": per_iter, "agents": {}}
    updates = [read_json(lay.update_stats(t)) for t in range(1, cfg.experiment.iterations + 1)]
    for a in agents:
        acc = [h["agents"][a]["eval_accuracy"] for h in history["iterations"]]
        train = [{k: v for k, v in u.get(a, {}).items()
                  if (k in TRAIN_KEYS or k.startswith("ratio/")) and isinstance(v, (int, float))} for u in updates]
        its = history["iterations"]
        res["agents"][a] = {"eval_accuracy": acc, "rollouts": [per_iter * t for t in range(len(acc))],
                            "train": train,
                            # the optimisation signatures per iteration (None at iteration 0): the
                            # policy's entropy on its own samples during the update, and the KL of
                            # the policy that generated the step's rollouts to the initial model
                            "entropy": [h["agents"][a].get("entropy") for h in its],
                            "kl": [h["agents"][a].get("kl_init_before_step", h["agents"][a].get("kl_to_init"))
                                   for h in its],
                            "eval": [{k: h["agents"][a][k] for k in EVAL_KEYS if k in h["agents"][a]} for h in its]}
    shutil.rmtree(run_dir / "runs", ignore_errors=True)  # checkpoints are not kept: only the curves
    write_json(run_dir / RESULT_FILE, {**res, "overrides": overrides + [f"experiment.seed={seed}"]})
    return res


def auc(x: list[float], y: list[float], budget: float) -> float:
    """Mean accuracy over rollouts generated in [0, budget] (trapezoid area / budget)."""
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    if budget <= 0:
        return float(ys[0])
    grid_y = np.interp(np.append(xs[xs < budget], budget), xs, ys)
    grid_x = np.append(xs[xs < budget], budget)
    return float(np.trapezoid(grid_y, grid_x) / budget)


def paired_difference(results: list[dict], agent: str, hi: str, lo: str) -> dict | None:
    """Final accuracy of ``hi`` minus ``lo`` for ``agent``, paired by seed (the same pool, prompts
    and sampling seed): mean, standard error of the mean difference, seeds; None if not both ran."""
    return paired(results, hi, lo, lambda r: r["agents"][agent]["eval_accuracy"][-1])


def verdict(diff: dict) -> str:
    """``holds`` / ``reversed`` when the paired mean difference is beyond 2 standard errors in the
    claimed / opposite direction, else ``within noise``."""
    if not np.isfinite(diff["se"]):
        return "holds" if diff["mean"] > 0 else "reversed"
    if diff["mean"] > 2 * diff["se"]:
        return "holds"
    if diff["mean"] < -2 * diff["se"]:
        return "reversed"
    return "within noise"


def summarize(results: list[dict]) -> dict:
    """Per agent and contender: final accuracy and equal-budget AUC, mean and std over seeds; the
    training diagnostics (cross ratios, cross share of the objective, KL) averaged over iterations
    and seeds."""
    agents = list(results[0]["agents"])
    contenders = list(dict.fromkeys(r["contender"] for r in results))
    budget = min(r["agents"][a]["rollouts"][-1] for r in results for a in agents)
    table: dict = {"budget_rollouts_per_agent": budget, "agents": {}}
    for a in agents:
        rows = {}
        for c in contenders:
            rs = [r for r in results if r["contender"] == c]
            final = [r["agents"][a]["eval_accuracy"][-1] for r in rs]
            areas = [auc(r["agents"][a]["rollouts"], r["agents"][a]["eval_accuracy"], budget) for r in rs]
            curve = np.mean([r["agents"][a]["eval_accuracy"] for r in rs], axis=0).tolist()
            train = [x for r in rs for x in r["agents"][a].get("train", [])]
            keys = dict.fromkeys(k for x in train for k in x)
            rows[c] = {"final_mean": float(np.mean(final)), "final_std": float(np.std(final, ddof=1)) if len(final) > 1 else 0.0,
                       "auc_mean": float(np.mean(areas)), "auc_std": float(np.std(areas, ddof=1)) if len(areas) > 1 else 0.0,
                       "seeds": len(rs), "mean_curve": curve,
                       "rollouts": rs[0]["agents"][a]["rollouts"],
                       "train": {k: float(np.mean([x[k] for x in train if k in x])) for k in keys}}
        table["agents"][a] = rows
    return table


def _signature(run: dict, agent: str, key: str) -> float:
    """A run's mean over iterations of ``entropy`` or ``kl`` (the optimisation signatures)."""
    vals = [v for v in run["agents"][agent].get(key, []) if v is not None]
    return float(np.mean(vals)) if vals else float("nan")


def paired(results: list[dict], hi: str, lo: str, value) -> dict | None:
    """``value(run)`` of ``hi`` minus that of ``lo``, paired by seed: mean, s.e., seeds (None if
    no seed has both or the value is undefined)."""
    runs = {(r["contender"], r["seed"]): r for r in results}
    seeds = sorted({s for c, s in runs if c == hi} & {s for c, s in runs if c == lo})
    d = np.array([value(runs[(hi, s)]) - value(runs[(lo, s)]) for s in seeds], dtype=float)
    if not len(d) or not np.all(np.isfinite(d)):
        return None
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return {"mean": float(d.mean()), "se": se, "seeds": len(d)}


def _cell(d: dict, scale: float, kind: str) -> dict:
    v = verdict(d)
    if kind == "equal":  # the claim is "no difference": within noise is what holds
        v = "holds" if v == "within noise" else "differs"
    return {"points": round(scale * d["mean"], 4 if scale == 1 else 2), "stderr_points": round(scale * d["se"], 4 if scale == 1 else 2),
            "seeds": d["seeds"], "verdict": v}


def findings(results: list[dict], claims: list[tuple] | None = None) -> list[dict]:
    """The suite's claims (:data:`HACPO_CLAIMS`, :data:`MUTUAL_CLAIMS`) per agent, as paired
    differences over seeds (mean +- s.e.) with a verdict. Kinds: ``final`` held-out accuracy
    (points); ``average``: the final accuracy averaged over the agents (one cell, ``all agents``);
    ``every_checkpoint``: the accuracy difference at every evaluated iteration after 0 -- holds
    when no checkpoint is reversed, the cell shows the smallest difference; ``equal``: holds when
    the final difference is within noise; ``entropy`` / ``kl``: the signature's mean over
    iterations (raw units)."""
    out = []
    agents = list(results[0]["agents"])
    for claim in claims if claims is not None else HACPO_CLAIMS:
        text, hi, lo, kind = (*claim, "final")[:4]
        diffs: dict = {}
        if kind == "average":
            d = paired(results, hi, lo, lambda r: float(np.mean([r["agents"][a]["eval_accuracy"][-1] for a in agents])))
            if d is not None:
                diffs["all agents"] = _cell(d, 100, kind)
        for a in agents if kind != "average" else []:
            if kind in ("entropy", "kl"):
                d = paired(results, hi, lo, lambda r, a=a: _signature(r, a, kind))
                if d is not None:
                    diffs[a] = _cell(d, 1, kind)
            elif kind == "every_checkpoint":
                n = min(len(r["agents"][a]["eval_accuracy"]) for r in results)
                per = [paired(results, hi, lo, lambda r, t=t, a=a: r["agents"][a]["eval_accuracy"][t]) for t in range(1, n)]
                per = [x for x in per if x is not None]
                if per:
                    worst = min(per, key=lambda x: x["mean"] + 2 * (x["se"] if np.isfinite(x["se"]) else 0))
                    cell = _cell(worst, 100, kind)
                    cell["verdict"] = "reversed" if any(verdict(x) == "reversed" for x in per) else "holds"
                    cell["checkpoints"] = len(per)
                    diffs[a] = cell
            else:
                d = paired(results, hi, lo, lambda r, a=a: r["agents"][a]["eval_accuracy"][-1])
                if d is not None:
                    diffs[a] = _cell(d, 100, kind)
        if diffs:
            out.append({"claim": text, "better": hi, "worse": lo, "kind": kind, "differences": diffs,
                        "reproduces": all(x["verdict"] == "holds" for x in diffs.values())})
    return out


def _train_figures(row: dict, agent: str) -> str:
    """One table cell: the cross ratio's median and share clipped below per peer, the cross
    share of the objective and the KL, as the learner saw them (means over iterations and seeds)."""
    t = row.get("train", {})
    parts = []
    for k, v in t.items():
        if k.startswith("ratio/") and k.endswith("/q50") and k.split("/")[1] != agent:
            peer = k.split("/")[1]
            below = t.get(f"ratio/{peer}/clipped_below")
            parts.append(f"{peer}: {v:.3f}" + (f" ({100 * below:.0f}% below)" if below is not None else ""))
    if "cross_gradient_share" in t:
        parts.append(f"cross share of the gradient-carrying objective {100 * t['cross_gradient_share']:.0f}%")
    elif "cross_objective_share" in t:
        parts.append(f"cross share of the objective {100 * t['cross_objective_share']:.0f}%")
    if "kl_to_init" in t:
        parts.append(f"KL {t['kl_to_init']:.4f}")
    elif "kl_init_before_step" in t:
        parts.append(f"KL to init {t['kl_init_before_step']:.4f}")
    if "entropy" in t:
        parts.append(f"entropy {t['entropy']:.3f}")
    return "; ".join(parts) or "-"


def write_report(results: list[dict], suite: str, out_dir: Path, wall_s: float, overrides: list[str],
                 setting: str = "", about: str = "") -> Path:
    """``reports/<suite>/<setting>/``: results.json, README.md (tables, paired differences,
    findings), accuracy plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    table = summarize(results)
    found = findings(results, SUITES[suite]["claims"] if suite in SUITES else None)
    seeds = sorted({r["seed"] for r in results})
    write_json(out_dir / "results.json", {"suite": suite, "setting": setting, "about": about, "seeds": seeds,
                                          "overrides": overrides, "wall_seconds": round(wall_s, 1), "runs": results,
                                          "table": table, "findings": found})
    agents = list(table["agents"])
    for xkey, fname, xlabel in (("iterations", "accuracy_vs_iterations.png", "iteration"),
                                ("rollouts", "accuracy_vs_rollouts.png", "rollouts generated per agent")):
        fig, axes = plt.subplots(1, len(agents), figsize=(5 * len(agents), 4), squeeze=False)
        for ax, a in zip(axes[0], agents):
            for c, row in table["agents"][a].items():
                x = row["rollouts"] if xkey == "rollouts" else list(range(len(row["mean_curve"])))
                ax.plot(x, row["mean_curve"], marker=".", label=c,
                        linestyle="-" if "-" not in c else ":")
            ax.set_title(a)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out accuracy (mean over seeds)")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
    plots = ["accuracy_vs_iterations.png", "accuracy_vs_rollouts.png"]
    for key, fname, ylabel in (("entropy", "entropy_vs_iterations.png", "policy entropy on own samples (nats/token)"),
                               ("kl", "kl_vs_iterations.png", "KL(policy before the step || initial)")):
        if not any(v is not None for r in results for a in agents for v in r["agents"][a].get(key, [])):
            continue
        fig, axes = plt.subplots(1, len(agents), figsize=(5 * len(agents), 4), squeeze=False)
        for ax, a in zip(axes[0], agents):
            for c in table["agents"][a]:
                curves = [r["agents"][a][key] for r in results if r["contender"] == c]
                its = [t for t in range(len(curves[0])) if all(cv[t] is not None for cv in curves)]
                ax.plot(its, [float(np.mean([cv[t] for cv in curves])) for t in its], marker=".", label=c)
            ax.set_title(a)
            ax.set_xlabel("iteration")
            ax.set_ylabel(ylabel + " (mean over seeds)", fontsize=8)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        plots.append(fname)
    title = f"# Comparison suite `{suite}`" + (f", setting `{setting}`" if setting else "")
    kl = next((o.split("=", 1)[1] for o in overrides if o.startswith("algorithm.kl_coef=")), None)
    lines = [title, "", *([about, ""] if about else []),
             f"Seeds {seeds}; overrides {' '.join(overrides) or '(none)'}; wall time {wall_s / 60:.1f} min "
             "(pool prepared once). "
             + (f"KL: coefficient {kl} (k3 to the initial model, on the learner's own samples) for every "
                "contender alike. " if kl else "KL: off. ")
             + "Final = held-out greedy accuracy after the last iteration, mean +- std over seeds; AUC = mean "
             f"accuracy over the first {table['budget_rollouts_per_agent']} rollouts each agent generated (the "
             "budget every contender reached: the equal-cost view). Training figures: the cross ratio's median per "
             "peer and the share of cross samples below the clip window, the share of the |objective| carried by "
             "cross samples, the KL (means over iterations and seeds).", ""]
    for a in agents:
        lines += [f"## {a}", "", "| contender | final (%) | AUC at equal rollouts (%) | training |", "|---|---|---|---|"]
        for c, row in table["agents"][a].items():
            lines.append(f"| {c} | {100 * row['final_mean']:.1f} +- {100 * row['final_std']:.1f} | "
                         f"{100 * row['auc_mean']:.1f} +- {100 * row['auc_std']:.1f} | {_train_figures(row, a)} |")
        lines.append("")
    lines += rescue_lines(results, agents)
    lines += ["## Claims, paired by seed", "",
              "Difference (better - worse) of the final held-out accuracy in points, mean +- standard error over "
              "seeds (same pool, prompts and sampling seed per pair); *holds* / *reversed*: beyond 2 s.e. either "
              "way. *all agents*: the accuracy averaged over the agents. *Every checkpoint*: the smallest "
              "difference over the iterations, *holds* when none is reversed. *Indistinguishable*: holds when "
              "within noise. Entropy / KL claims: the mean over iterations, in nats.", "",
              *claim_table(found, agents)]
    lines += ["", "Plots: " + ", ".join(f"`{x}`" for x in plots) + ". Raw curves and per-iteration "
              "training figures: `results.json`.", ""]
    (out_dir / "README.md").write_text("\n".join(lines))
    return out_dir


def claim_table(found: list[dict], agents: list[str]) -> list[str]:
    """The markdown table of :func:`findings`: one row per claim, one column per agent (and
    ``all agents`` when a claim is on the mean over agents)."""
    cols = agents + (["all agents"] if any("all agents" in f["differences"] for f in found) else [])
    lines = ["| claim | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for f in found:
        cells = []
        for a in cols:
            d = f["differences"].get(a)
            digits = 4 if f.get("kind") in ("entropy", "kl") else 1
            cells.append(f"{d['points']:+.{digits}f} +- {d['stderr_points']:.{digits}f} {d['verdict']}" if d else "-")
        lines.append(f"| {f['claim']} | " + " | ".join(cells) + " |")
    return lines


def rescue_lines(results: list[dict], agents: list[str]) -> list[str]:
    """A README section on SGT's rescues per agent and contender that made any: the trigger rate and
    rescues per iteration, and the greedy accuracy on the rescued prompts right after the update
    and at later iterations (means over iterations and seeds), empty when no run rescued."""
    rows = []
    for c in dict.fromkeys(r["contender"] for r in results):
        for a in agents:
            rs = [r for r in results if r["contender"] == c]
            train = [x for r in rs for x in r["agents"][a].get("train", []) if "trigger_rate" in x]
            if not train:
                continue
            ev = [x for r in rs for x in r["agents"][a].get("eval", [])]

            def mean(key: str, src: list) -> str:
                vals = [x[key] for x in src if key in x]
                return f"{np.mean(vals):.3g}" if vals else "-"

            def pct(key: str) -> str:
                vals = [x[key] for x in ev if key in x]
                return f"{100 * np.mean(vals):.1f}" if vals else "-"

            rows.append(f"| {c} | {a} | {100 * float(np.mean([x['trigger_rate'] for x in train])):.1f} | "
                        f"{mean('rescues', train)} | {mean('own_all_wrong_prompts', train)} | {pct('rescued_now_accuracy')} | "
                        f"{pct('rescued_before_accuracy')} |")
    if not rows:
        return []
    return ["## Success-gated rescues", "",
            "Per iteration (means over iterations and seeds): the share of the learner's prompts where the gate "
            "fired (all own samples wrong, a peer's verified success injected), responses injected, prompts "
            "with all own samples wrong; then the learner's greedy accuracy on the prompts rescued at that "
            "iteration, right after the update, and on those rescued at earlier iterations (did it stick?). "
            "Before its rescue the learner had 0 of G samples right on each.", "",
            "| contender | agent | trigger rate (%) | injected | all-wrong prompts | acc. on prompts rescued now (%) "
            "| acc. on prompts rescued earlier (%) |", "|---|---|---|---|---|---|---|", *rows, ""]


def write_index(suite_dir: Path, suite: str) -> Path:
    """``reports/<suite>/README.md``: each setting's headline claims side by side."""
    lines = [f"# Comparison suite `{suite}`", "", "One directory per setting, each with its own README, plots "
             "and results.json. Headline: paired differences of final held-out accuracy in points "
             "(mean +- s.e. over seeds) and their verdict.", ""]
    if (suite_dir / "ANALYSIS.md").exists():  # written by hand from these reports
        lines += ["What the settings and probes say about the causes: [ANALYSIS.md](ANALYSIS.md).", ""]
    for res_file in sorted(suite_dir.glob("*/results.json")):
        res = read_json(res_file)
        setting = res.get("setting") or res_file.parent.name
        agents = list(res["table"]["agents"])
        lines += [f"## `{setting}`: {res.get('about', '')}", "",
                  f"{len(res['seeds'])} seeds, {len(res['runs'])} runs, {res['wall_seconds'] / 60:.0f} min. "
                  f"[details]({res_file.parent.name}/README.md)", "",
                  *claim_table(res["findings"], agents), ""]
    (suite_dir / "README.md").write_text("\n".join(lines))
    return suite_dir / "README.md"


def run_suite(suite: str, seeds: int, overrides: list[str] | None = None, work_dir: str | os.PathLike = "compare",
              reports_dir: str | os.PathLike = "reports", contenders: list[str] | None = None,
              setting: str = "default", resume: bool = False, dry_run: bool = False) -> Path | str:
    """Run ``suite`` in ``setting`` for ``seeds`` seeds (0..seeds-1) and write
    ``reports/<suite>/<setting>/`` and the suite's index. With ``contenders`` given, the runs of
    other contenders already in that setting's report (same overrides: the same prepared pool)
    are kept, so a probe can be added to a finished suite. With ``resume``, runs an interrupted
    suite finished with the same overrides are reused rather than run again. With ``dry_run``,
    every contender's config is composed and validated and the plan returned as text; nothing
    runs."""
    if suite not in SUITES:
        raise ConfigError(f"suite: invalid value {suite!r} (choose from {', '.join(SUITES)})")
    spec = SUITES[suite]
    if setting not in spec["settings"]:
        raise ConfigError(f"setting: invalid value {setting!r} (choose from {', '.join(spec['settings'])})")
    st = spec["settings"][setting]
    chosen = contenders or list(st["contenders"])
    unknown = [c for c in chosen if c not in spec["all"]]
    if unknown:
        raise ConfigError(f"contenders: invalid value {unknown} (choose from {', '.join(spec['all'])})")
    base_overrides = st["base"] + list(overrides or [])
    out = Path(work_dir).resolve() / suite / setting
    if dry_run:
        for c in chosen:  # a bad override fails here, before hours of runs
            _cfg(base_overrides + spec["all"][c], out / "runs", out / "reports")
        return (f"compare {suite}/{setting}: {len(chosen)} contenders x {seeds} seeds = {len(chosen) * seeds} runs "
                f"({', '.join(chosen)}); base overrides: {' '.join(base_overrides)}; every config valid")
    t0 = time.time()
    prepare_base(base_overrides, out)
    results = []
    from tqdm import tqdm

    jobs = [(c, s) for s in range(seeds) for c in chosen]
    for c, s in tqdm(jobs, desc=f"compare {suite}/{setting}"):
        r = (finished_run(c, base_overrides + spec["all"][c], s, out) if resume else None) \
            or run_contender(c, base_overrides + spec["all"][c], s, out)
        log.info("%s seed %d: %s (%.0fs)", c, s, {a: round(v["eval_accuracy"][-1], 3) for a, v in r["agents"].items()},
                 r.get("seconds", 0.0))
        results.append(r)
    suite_dir = Path(reports_dir).resolve() / suite
    wall = time.time() - t0
    previous = suite_dir / setting / "results.json"
    if contenders and previous.exists():
        old = read_json(previous)
        if old.get("overrides") == base_overrides:
            ran = {(r["contender"], r["seed"]) for r in results}
            results = [r for r in old["runs"] if (r["contender"], r["seed"]) not in ran] + results
            wall += old.get("wall_seconds", 0.0)
            log.info("kept %d runs of the earlier report", len(results) - len(ran))
    report = write_report(results, suite, suite_dir / setting, wall, base_overrides, setting, st["about"])
    write_index(suite_dir, suite)
    return report
