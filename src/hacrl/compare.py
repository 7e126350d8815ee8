"""``hacrl compare``: run contenders on the same pool, prompts and seeds; write a comparison report.

The pool and the task data are prepared once (``<out>/base``); every contender x seed starts
from that iteration-0 state and runs its iterations through the same stage functions as
``dvc repro`` (:func:`hacrl.stages.run_in_process`), in this process (the DVC path costs a
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

from hacrl import config as config_mod
from hacrl import stages
from hacrl.storage import RunLayout, read_json, write_json

log = logging.getLogger(__name__)

HACPO_ABLATIONS = {
    "hacpo-adv": ["algorithm.advantage.capability_aware=false"],
    "hacpo-omega": ["algorithm.loss.discrepancy_coef=false"],
    "hacpo-expIS": ["algorithm.loss.alpha=0"],
    "hacpo-clip": ["algorithm.loss.cross_clip=false"],
    "hacpo-stepwise": ["algorithm.loss.cross_clip_delta_step=0"],
}

SUITES: dict[str, dict] = {
    "hacpo": {
        # the paper's step shape (128 prompts, 8 samples per agent, mini-batches of 64 prompts)
        "base": ["rollout.prompts_per_iteration=128", "trainer.mini_batch_prompts=64", "experiment.iterations=6"],
        "contenders": {
            "grpo": ["algorithm=grpo"],
            "gspo": ["algorithm=gspo"],
            "gspo_x2": ["algorithm=gspo_x2"],
            "naive_share": ["algorithm=naive_share"],
            "hacpo": ["algorithm=hacpo"],
            **{k: ["algorithm=hacpo", *v] for k, v in HACPO_ABLATIONS.items()},
        },
    },
}


def _cfg(overrides: list[str], runs_dir: Path, reports_dir: Path) -> config_mod.Config:
    data = config_mod.compose(overrides)
    data["experiment"]["runs_dir"] = str(runs_dir)
    data["experiment"]["reports_dir"] = str(reports_dir)
    return config_mod.from_dict(data)


def prepare_base(base_overrides: list[str], out: Path) -> config_mod.Config:
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
        stages.prepare_data(cfg)
        stages.prepare_pool(cfg)
        stages.evaluate(cfg, 0)
    write_json(stamp, {"key": key, "seconds": round(time.time() - t0, 1)})
    return cfg


def run_contender(name: str, overrides: list[str], seed: int, out: Path) -> dict:
    """One contender with one seed from the prepared iteration 0; returns its curves."""
    base = out / "base"
    run_dir = out / name / f"seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = _cfg(overrides + [f"experiment.seed={seed}"], run_dir / "runs", run_dir / "reports")
    shutil.copytree(base / "runs" / "it0", run_dir / "runs" / "it0")
    t0 = time.time()
    with contextlib.chdir(base):  # data/tasks of the base
        timings = stages.run_in_process(cfg, prepare=False)
    history = read_json(RunLayout(cfg.experiment.runs_dir).history(cfg.experiment.iterations))
    agents = [a.name for a in cfg.agents]
    per_iter = cfg.rollout.prompts_per_iteration * cfg.samples_per_prompt  # rollouts per agent
    res = {"contender": name, "seed": seed, "algorithm": cfg.algorithm.name, "seconds": round(time.time() - t0, 1),
           "stage_seconds": {k: round(v, 1) for k, v in timings.items()},
           "rollouts_per_agent_per_iteration": per_iter, "agents": {}}
    for a in agents:
        acc = [h["agents"][a]["eval_accuracy"] for h in history["iterations"]]
        res["agents"][a] = {"eval_accuracy": acc, "rollouts": [per_iter * t for t in range(len(acc))]}
    shutil.rmtree(run_dir / "runs", ignore_errors=True)  # checkpoints are not kept: only the curves
    return res


def auc(x: list[float], y: list[float], budget: float) -> float:
    """Mean accuracy over rollouts generated in [0, budget] (trapezoid area / budget)."""
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    if budget <= 0:
        return float(ys[0])
    grid_y = np.interp(np.append(xs[xs < budget], budget), xs, ys)
    grid_x = np.append(xs[xs < budget], budget)
    return float(np.trapezoid(grid_y, grid_x) / budget)


def summarize(results: list[dict]) -> dict:
    """Per agent and contender: final accuracy and equal-budget AUC, mean and std over seeds."""
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
            rows[c] = {"final_mean": float(np.mean(final)), "final_std": float(np.std(final, ddof=1)) if len(final) > 1 else 0.0,
                       "auc_mean": float(np.mean(areas)), "auc_std": float(np.std(areas, ddof=1)) if len(areas) > 1 else 0.0,
                       "seeds": len(rs), "mean_curve": curve,
                       "rollouts": rs[0]["agents"][a]["rollouts"]}
        table["agents"][a] = rows
    return table


def findings(table: dict) -> list[dict]:
    """The paper's claims (docs/ALGORITHMS.md, "What the HACPO paper reports"), checked on the final
    accuracy means."""
    out = []
    agents = table["agents"]

    def final(a, c):
        return agents[a][c]["final_mean"] if c in agents[a] else float("nan")

    def se(a, c1, c2):
        r1, r2 = agents[a][c1], agents[a][c2]
        return math.sqrt(r1["final_std"] ** 2 / r1["seeds"] + r2["final_std"] ** 2 / r2["seeds"])

    def claim(text, pairs):
        diffs = [(a, final(a, hi) - final(a, lo), se(a, hi, lo)) for a, hi, lo in pairs
                 if hi in agents[a] and lo in agents[a]]
        if not diffs:
            return
        holds = all(d > 0 for _, d, _ in diffs)
        out.append({"claim": text, "reproduces": holds,
                    "differences": {f"{a}": {"points": round(100 * d, 2), "stderr_points": round(100 * s, 2)}
                                    for a, d, s in diffs}})

    names = list(agents)
    for base in ("gspo", "gspo_x2"):
        claim(f"HACPO above {base.upper().replace('_X2', ' x2')} for every agent",
              [(a, "hacpo", base) for a in names])
    claim("naive sharing below independent training (GSPO) for every agent", [(a, "gspo", "naive_share") for a in names])
    for abl in HACPO_ABLATIONS:
        claim(f"ablation {abl.replace('hacpo', '')} costs accuracy for every agent", [(a, "hacpo", abl) for a in names])
    return out


def write_report(results: list[dict], suite: str, out_dir: Path, wall_s: float, overrides: list[str]) -> Path:
    """``reports/<suite>/``: results.json, table.md, README.md, accuracy plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    table = summarize(results)
    found = findings(table)
    seeds = sorted({r["seed"] for r in results})
    write_json(out_dir / "results.json", {"suite": suite, "seeds": seeds, "overrides": overrides,
                                          "wall_seconds": round(wall_s, 1), "runs": results, "table": table,
                                          "findings": found})
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
    lines = [f"# Comparison suite `{suite}`", "",
             f"Seeds {seeds}; overrides {' '.join(overrides) or '(none)'}; wall time {wall_s / 60:.1f} min "
             f"(pool prepared once). Final = held-out greedy accuracy after the last iteration, mean +- std "
             f"over seeds; AUC = mean accuracy over the first {table['budget_rollouts_per_agent']} rollouts "
             "each agent generated (the budget every contender reached: the equal-cost view).", ""]
    for a in agents:
        lines += [f"## {a}", "", "| contender | final (%) | AUC at equal rollouts (%) |", "|---|---|---|"]
        for c, row in table["agents"][a].items():
            lines.append(f"| {c} | {100 * row['final_mean']:.1f} +- {100 * row['final_std']:.1f} | "
                         f"{100 * row['auc_mean']:.1f} +- {100 * row['auc_std']:.1f} |")
        lines.append("")
    lines += ["## The paper's findings, here", ""]
    for f in found:
        figs = ", ".join(f"{a} {d['points']:+.1f} (se {d['stderr_points']:.1f})" for a, d in f["differences"].items())
        lines.append(f"- {f['claim']}: **{'reproduces' if f['reproduces'] else 'does not reproduce'}** "
                     f"(differences in points: {figs})")
    lines += ["", "Plots: `accuracy_vs_iterations.png`, `accuracy_vs_rollouts.png`. Raw curves: `results.json`.", ""]
    (out_dir / "README.md").write_text("\n".join(lines))
    return out_dir


def run_suite(suite: str, seeds: int, overrides: list[str] | None = None, work_dir: str | os.PathLike = "compare",
              reports_dir: str | os.PathLike = "reports", contenders: list[str] | None = None) -> Path:
    """Run ``suite`` for ``seeds`` seeds (0..seeds-1) and write ``reports/<suite>/``."""
    if suite not in SUITES:
        raise config_mod.ConfigError(f"suite: invalid value {suite!r} (choose from {', '.join(SUITES)})")
    spec = SUITES[suite]
    chosen = contenders or list(spec["contenders"])
    unknown = [c for c in chosen if c not in spec["contenders"]]
    if unknown:
        raise config_mod.ConfigError(f"contenders: invalid value {unknown} (choose from {', '.join(spec['contenders'])})")
    base_overrides = spec["base"] + list(overrides or [])
    out = Path(work_dir).resolve() / suite
    t0 = time.time()
    prepare_base(base_overrides, out)
    results = []
    from tqdm import tqdm

    jobs = [(c, s) for s in range(seeds) for c in chosen]
    for c, s in tqdm(jobs, desc=f"compare {suite}"):
        r = run_contender(c, base_overrides + spec["contenders"][c], s, out)
        log.info("%s seed %d: %s (%.0fs)", c, s, {a: round(v["eval_accuracy"][-1], 3) for a, v in r["agents"].items()},
                 r["seconds"])
        results.append(r)
    return write_report(results, suite, Path(reports_dir).resolve() / suite, time.time() - t0, base_overrides)
