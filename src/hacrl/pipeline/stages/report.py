"""report: the readable report, ``reports/summary.json``, curves for ``dvc plots`` and PNG plots."""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path

from hacrl.config.schema import Config
from hacrl.pipeline.result import StageResult
from hacrl.storage import atomic_path, atomic_write_text, read_json, write_json

log = logging.getLogger(__name__)


def report(cfg: Config) -> StageResult:
    """``reports/summary.json``, per-iteration curves (CSV, for ``dvc plots``) and PNG plots."""
    lay = cfg.layout
    history = read_json(lay.history(cfg.experiment.iterations))
    pool = read_json(lay.it(0) / "pool.json")
    out = write_report(history, pool, Path(cfg.experiment.reports_dir))
    reports = Path(cfg.experiment.reports_dir)
    # what write_report wrote (not the comparison reports, benchmarks and notes beside them)
    files = [reports / "summary.json", reports / "metrics.json", reports / "README.md", *sorted(reports.glob("*.png")),
             *sorted(reports.glob("plots/*.csv"))]
    return StageResult({"summary": str(out)}, artifacts=[str(p) for p in files if p.is_file()])


def summarize(history: dict, pool: dict) -> dict:
    """``{"algorithm", "agents": {NAME: {"eval_accuracy": [a0..aT], ...}}}`` from the history."""
    its = sorted(history["iterations"], key=lambda h: h["iteration"])
    agents: dict = {}
    for name in its[0]["agents"]:
        per = [h["agents"][name] for h in its]
        acc = [m["eval_accuracy"] for m in per]
        agents[name] = {
            "eval_accuracy": acc,
            "eval_stderr": [m["eval_stderr"] for m in per],
            "train_reward": [m.get("train_reward") for m in per],
            "entropy": [m.get("entropy") for m in per],
            "by_level": [m["by_level"] for m in per],
            "gain": acc[-1] - acc[0],
            "gain_stderr": (per[0]["eval_stderr"] ** 2 + per[-1]["eval_stderr"] ** 2) ** 0.5,
            "params": pool.get(name, {}).get("params"),
            "tokenizer": pool.get(name, {}).get("tokenizer"),
            "arch": pool.get(name, {}).get("arch"),
        }
    gains = [a["gain"] for a in agents.values()]
    start = [a["eval_accuracy"][0] for a in agents.values()]
    return {"algorithm": history["algorithm"], "iterations": [h["iteration"] for h in its],
            "heldout_n": its[0]["agents"][next(iter(agents))]["eval_n"],
            "mean_gain": sum(gains) / len(gains), "start_spread": max(start) - min(start),
            "agents": agents}


def headline(summary: dict) -> dict:
    """``reports/metrics.json``, the experiment's DVC metrics: the last iteration's held-out
    accuracy and the gain since iteration 0 per agent (fractions, 4 decimals), and their mean. Small
    and committed with ``dvc.lock``, so that ``dvc metrics diff main`` and ``dvc exp show`` compare
    runs from git alone (the per-iteration figures are in ``runs/itT/eval_metrics.json``)."""
    agents = summary["agents"]
    return {"iteration": summary["iterations"][-1],
            "eval_accuracy": {n: round(a["eval_accuracy"][-1], 4) for n, a in agents.items()},
            "gain": {n: round(a["gain"], 4) for n, a in agents.items()},
            "mean_gain": round(summary["mean_gain"], 4)}


def write_report(history: dict, pool: dict, out: Path) -> Path:
    summary = summarize(history, pool)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "summary.json", summary)
    write_json(out / "metrics.json", headline(summary))
    # wide per-metric tables: one column per agent, which dvc.yaml's top-level plots name
    for key in ("eval_accuracy", "train_reward", "entropy"):
        buf = io.StringIO()
        w = csv.writer(buf)
        names = list(summary["agents"])
        w.writerow(["iteration", *names])
        for i, it in enumerate(summary["iterations"]):
            vals = [summary["agents"][n][key][i] for n in names]
            w.writerow([it, *("" if v is None else f"{v:.4f}" for v in vals)])
        atomic_write_text(out / "plots" / f"{key}.csv", buf.getvalue())
    _plots(summary, out)
    lines = [f"# {summary['algorithm']} on the embedded pool", "",
             f"Held-out problems: {summary['heldout_n']}. Mean gain over agents: "
             f"{100 * summary['mean_gain']:+.1f} points; start spread {100 * summary['start_spread']:.1f} points.", "",
             "| agent | arch | params | tokenizer | start acc | final acc | gain (± s.e.) |",
             "|---|---|---|---|---|---|---|"]
    for name, a in summary["agents"].items():
        lines.append(f"| {name} | {a['arch']} | {a['params']} | {a['tokenizer']} | "
                     f"{100 * a['eval_accuracy'][0]:.1f} | {100 * a['eval_accuracy'][-1]:.1f} | "
                     f"{100 * a['gain']:+.1f} ± {100 * a['gain_stderr']:.1f} |")
    lines += ["", "![accuracy](accuracy.png) ![reward](reward.png) ![entropy](entropy.png)", ""]
    atomic_write_text(out / "README.md", "\n".join(lines))
    log.info("report written to %s", out)
    return out / "summary.json"


def _plots(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = summary["iterations"]
    for key, fname, ylabel in (("eval_accuracy", "accuracy.png", "held-out accuracy (greedy pass@1)"),
                               ("train_reward", "reward.png", "train reward (pass@1, T=1)"),
                               ("entropy", "entropy.png", "policy entropy (nats/token)")):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for name, a in summary["agents"].items():
            pts = [(i, v) for i, v in zip(its, a[key]) if v is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        with atomic_path(out / fname) as tmp:
            fig.savefig(tmp, format="png", dpi=110)
        plt.close(fig)
