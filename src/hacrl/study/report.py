"""A comparison's report: ``reports/<suite>/<setting>/`` (README.md, results.json, plots) and
the suite's index. Reads the runs' curves and :mod:`hacrl.study.claims`' tests; runs nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hacrl.storage import read_json, write_json
from hacrl.study.claims import ALPHA, MARGIN_POINTS, auc, budget, findings, primary, primary_line
from hacrl.study.runstore import run_refs

MAX_LINES = 6
"""Curves per panel: more cannot be told apart."""
STYLES = [("tab:blue", "-", "o"), ("tab:orange", "--", "s"), ("tab:green", "-.", "^"),
          ("tab:red", ":", "D"), ("tab:purple", (0, (5, 1, 1, 1)), "v"), ("tab:brown", (0, (1, 1)), "P")]
"""Six curves, each with its own colour, line style and marker."""


def summarize(results: list[dict]) -> dict:
    """Per agent and contender: final accuracy and equal-budget AUC, mean and std over seeds; the
    training diagnostics (cross ratios, cross share of the objective, KL) averaged over iterations
    and seeds."""
    agents = list(results[0]["agents"])
    contenders = list(dict.fromkeys(r["contender"] for r in results))
    b = budget(results)
    table: dict = {"budget_rollouts_per_agent": b, "agents": {}}
    for a in agents:
        rows = {}
        for c in contenders:
            rs = [r for r in results if r["contender"] == c]
            final = [r["agents"][a]["eval_accuracy"][-1] for r in rs]
            areas = [auc(r["agents"][a]["rollouts"], r["agents"][a]["eval_accuracy"], b) for r in rs]
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


def _train_figures(row: dict, agent: str) -> str:
    """One table cell: the cross ratio's median and share clipped below per peer, the cross
    share of the objective, the KL to the initial model measured on the learner's own samples
    before each step, and the entropy, as the learner saw them (means over iterations and seeds;
    the step sizes are in :func:`step_lines`' section)."""
    t = row.get("train", {})
    parts = []
    for peer in _peers([t], agent):
        if (v := t.get(f"ratio/{peer}/q50")) is not None:
            below = t.get(f"ratio/{peer}/clipped_below")
            parts.append(f"{peer}: {v:.3f}" + (f" ({100 * below:.0f}% below)" if below is not None else ""))
    if "cross_gradient_share" in t:
        parts.append(f"cross share of the gradient-carrying objective {100 * t['cross_gradient_share']:.0f}%")
    elif "cross_objective_share" in t:
        parts.append(f"cross share of the objective {100 * t['cross_objective_share']:.0f}%")
    # the on-policy measure first: ``kl_to_init`` is the loss's KL term, averaged over a step's
    # mini-batches on samples the old policy drew, under a policy already moved by the step's
    # earlier updates; once a model moves far (Gemma-3 on the pretrained pair) it is heavy-tailed
    # (single iterations of 10 to 7e6 nats where the on-policy KL stays under 2)
    if "kl_init_before_step" in t:
        parts.append(f"KL to init {t['kl_init_before_step']:.4f}")
    elif "kl_to_init" in t:
        parts.append(f"KL term {t['kl_to_init']:.4f}")
    if "entropy" in t:
        parts.append(f"entropy {t['entropy']:.3f}")
    return "; ".join(parts) or "-"


def plot_groups(contenders: list[str], first: list[str] | None) -> list[list[str]]:
    """The contenders in groups of at most :data:`MAX_LINES`, the setting's declared headline
    curves (those that ran) first."""
    head = [c for c in (first or []) if c in contenders][:MAX_LINES]
    rest = [c for c in contenders if c not in head]
    groups = [head] if head else []
    return groups + [rest[i:i + MAX_LINES] for i in range(0, len(rest), MAX_LINES)]


def _band(curves: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard error over seeds, per point (s.e. 0 with one seed)."""
    arr = np.asarray(curves, float)
    mean = arr.mean(axis=0)
    se = arr.std(axis=0, ddof=1) / np.sqrt(len(arr)) if len(arr) > 1 else np.zeros_like(mean)
    return mean, se


def plot_curves(results: list[dict], names: list[str], key: str, xkey: str, path: Path, ylabel: str,
                scale: float = 1.0) -> Path | None:
    """One panel per agent; per contender the mean over seeds with a +-1 s.e. band; x is the
    iteration or the rollouts generated per agent. None when no run has the curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agents = list(results[0]["agents"])
    fig, axes = plt.subplots(1, len(agents), figsize=(5 * len(agents), 4.2), squeeze=False)
    drawn = False
    for ax, a in zip(axes[0], agents):
        for c, (color, ls, marker) in zip(names, STYLES):
            curves = [r["agents"][a].get(key) or [] for r in results if r["contender"] == c]
            if not curves or not curves[0]:
                continue
            pts = [t for t in range(min(map(len, curves))) if all(cv[t] is not None for cv in curves)]
            if not pts:
                continue
            mean, se = _band([[cv[t] for t in pts] for cv in curves])
            rollouts = next(r for r in results if r["contender"] == c)["agents"][a]["rollouts"]
            x = np.asarray([rollouts[t] for t in pts] if xkey == "rollouts" else pts, float)
            ax.plot(x, scale * mean, color=color, linestyle=ls, marker=marker, markersize=4, label=c)
            ax.fill_between(x, scale * (mean - se), scale * (mean + se), color=color, alpha=0.15, linewidth=0)
            drawn = True
        ax.set_title(a)
        ax.set_xlabel("iteration" if xkey == "iterations" else "rollouts generated per agent")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
    if not drawn:
        plt.close(fig)
        return None
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(MAX_LINES, len(labels)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: list[dict], out_dir: Path, first: list[str] | None) -> list[str]:
    """Accuracy (percent) against iterations and against rollouts, then entropy and KL, for each
    group of at most six contenders (``_2``, ``_3``... for the groups after the headline one)."""
    contenders = list(dict.fromkeys(r["contender"] for r in results))
    written = []
    for i, names in enumerate(plot_groups(contenders, first)):
        tag = "" if i == 0 else f"_{i + 1}"
        for key, xkey, stem, ylabel, scale in (
                ("eval_accuracy", "iterations", "accuracy_vs_iterations", "held-out accuracy (%), mean +- s.e. over seeds", 100),
                ("eval_accuracy", "rollouts", "accuracy_vs_rollouts", "held-out accuracy (%), mean +- s.e. over seeds", 100),
                ("entropy", "iterations", "entropy_vs_iterations", "policy entropy on own samples (nats/token)", 1),
                ("kl", "iterations", "kl_vs_iterations", "KL(policy before the step || initial)", 1)):
            p = plot_curves(results, names, key, xkey, out_dir / f"{stem}{tag}.png", ylabel, scale)
            if p is not None:
                written.append(p.name)
    return written


def _cell_text(d: dict, digits: int) -> str:
    if "ci" not in d:  # one seed, or a report written before the protocol (mean +- s.e., 2-s.e. verdicts)
        se = d.get("stderr_points")
        spread = f" +- {se:.{digits}f}" if isinstance(se, (int, float)) and se == se else ""
        return f"{d['points']:+.{digits}f}{spread} ({d['verdict']})"
    p = f"p_Holm {d['p_holm']:.2g}" if "p_holm" in d else ""
    return f"{d['points']:+.{digits}f} [{d['ci'][0]:+.{digits}f}, {d['ci'][1]:+.{digits}f}] {d['verdict']} ({p})"


def claim_table(found: list[dict], agents: list[str]) -> list[str]:
    """The markdown table of the secondary claims: one row per claim, one column per agent (and
    ``all agents`` when a claim is on the mean over agents)."""
    cols = agents + (["all agents"] if any("all agents" in f["differences"] for f in found) else [])
    lines = ["| claim | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for f in found:
        digits = 4 if f.get("kind") in ("entropy", "kl") else 1
        cells = [_cell_text(f["differences"][a], digits) if a in f["differences"] else "-" for a in cols]
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


def _peers(train: list[dict], agent: str) -> list[str]:
    """The peers whose samples ``agent`` learned from: the ``ratio/<peer>/...`` keys of its
    training figures, its own left out (empty for a contender without cross samples)."""
    return sorted({k.split("/")[1] for x in train for k in x if k.startswith("ratio/") and k.split("/")[1] != agent})


def _mean_of(rows: list[dict], key: str) -> float | None:
    """The mean of ``key`` over the rows that have it (None when none has)."""
    vals = [x[key] for x in rows if x.get(key) is not None]
    return float(np.mean(vals)) if vals else None


def step_lines(results: list[dict], agents: list[str]) -> list[str]:
    """A README section on how large each model's steps were and where the cross ratios fell, per
    agent and contender: optimizer updates per iteration; ``||delta theta|| / ||theta||`` per
    update; the KL to the initial model at the last measurement and that KL over the updates taken
    before it; per peer the cross ratio's 10th / 50th / 90th percentile and the shares below and
    above the clip window (means over iterations and seeds). A "small step" is read here, per
    model, not from the lr: the same lr moves a 270M pretrained model and a 60k-weight toy by very
    different amounts."""
    rows = []
    for c in dict.fromkeys(r["contender"] for r in results):
        rs = [r for r in results if r["contender"] == c]
        for a in agents:
            train = [x for r in rs for x in r["agents"][a].get("train", [])]
            if not train:
                continue
            kl_per_update, kl_last = [], []
            for r in rs:  # kl[t]: before iteration t's step, so after the updates of iterations 1..t-1
                kl = r["agents"][a].get("kl") or []
                upd = [x.get("updates", 0) for x in r["agents"][a].get("train", [])]
                last = max((t for t, v in enumerate(kl) if v is not None and t >= 2), default=None)
                if last is not None and sum(upd[:last - 1]) > 0:
                    kl_last.append(kl[last])
                    kl_per_update.append(kl[last] / sum(upd[:last - 1]))
            ratios = []
            for peer in _peers(train, a):
                q = [_mean_of(train, f"ratio/{peer}/{k}") for k in ("q10", "q50", "q90", "clipped_below", "clipped_above")]
                if None not in q:
                    ratios.append(f"{peer}: {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f} ({100 * q[3]:.0f}% below, "
                                  f"{100 * q[4]:.0f}% above)")
            per_iter, utw = _mean_of(train, "updates"), _mean_of(train, "update_to_weight")
            rows.append(f"| {c} | {a} | {f'{per_iter:.1f}' if per_iter is not None else '-'} | "
                        f"{f'{utw:.2e}' if utw is not None else '-'} | "
                        f"{f'{np.mean(kl_last):.4f}' if kl_last else '-'} | "
                        f"{f'{np.mean(kl_per_update):.1e}' if kl_per_update else '-'} | {'; '.join(ratios) or '-'} |")
    if not rows:
        return []
    return ["## Step size per model and the cross ratios", "",
            "How far each update moved each model, whatever its lr: optimizer updates per iteration; the "
            "update-to-weight norm ||delta theta|| / ||theta|| per update; KL(policy || initial) at the last "
            "measurement (before the last step) and that KL divided by the updates taken before it. Then, per "
            "peer, the cross ratio's 10th / 50th / 90th percentile with the shares of cross samples below and "
            "above the clip window (the window passes gradient; means over iterations and seeds).", "",
            "| contender | agent | updates / iteration | update / weight norm | KL to initial | KL per update "
            "| cross ratio q10 / q50 / q90 per peer |", "|---|---|---|---|---|---|---|", *rows, ""]


def _cells(values: list, fmt: str) -> str:
    """Table cells, ``-`` where a value is missing."""
    return " | ".join("-" if v is None else format(v, fmt) for v in values)


def iteration_lines(results: list[dict], agents: list[str]) -> list[str]:
    """A README section with every run's curve, one row per contender and seed: held-out accuracy
    after each iteration (points), the share of the gradient-carrying objective that came from
    peers' samples at each iteration's update, and the KL to the initial model after it (k3 on
    the next iteration's own samples, which that policy drew). For settings with few seeds and
    large jumps between iterations, where a mean curve hides what the runs did (a setting asks for
    it with ``per_iteration: True``)."""
    lines = []
    for a in agents:
        rows = []
        for r in sorted(results, key=lambda r: (r["contender"], r["seed"])):
            ag = r["agents"][a]
            train = ag.get("train", [])
            acc = [100 * v for v in ag["eval_accuracy"]]
            cross = bool(_peers(train, a))
            share = [100 * x["cross_gradient_share"] if cross and x.get("cross_gradient_share") is not None else None
                     for x in train]
            kl = (ag.get("kl") or [])[2:]  # kl[t]: before iteration t's step, i.e. after iteration t-1's
            rows.append(f"| {r['contender']} | {r['seed']} | {_cells(acc, '.1f')} | {_cells(share, '.1f')} | "
                        f"{_cells(kl, '.3f')} |")
        n = max(len(r["agents"][a]["eval_accuracy"]) for r in results)
        n_kl = max(len((r["agents"][a].get("kl") or [])[2:]) for r in results)
        lines += [f"### {a}", "",
                  "| contender | seed | " + " | ".join(f"acc. it{t}" for t in range(n)) + " | "
                  + " | ".join(f"cross share it{t}" for t in range(1, n)) + " | "
                  + " | ".join(f"KL after it{t}" for t in range(1, n_kl + 1)) + " |",
                  "|---|---|" + "---|" * (2 * n - 1 + n_kl), *rows, ""]
    return ["## Every run, iteration by iteration", "",
            "Held-out accuracy (%) before training (it0) and after each iteration; the share (%) of the "
            "gradient-carrying objective that came from peers' samples in that iteration's updates (0 where "
            "every cross sample was clipped; `-` for contenders without cross samples); KL(policy || initial) "
            "after the iteration's updates, in nats (k3 on the next iteration's own samples, which that policy "
            "drew; none after the last iteration).", "", *lines]


def tuning_lines(tuning: dict | None) -> list[str]:
    """What the dev sweep chose per contender, and from which dev scores."""
    if not tuning:
        return ["Settings: as composed (no dev sweep was run for this report).", ""]
    keys = " ".join(tuning["grid"])
    lines = ["## Settings chosen on dev", "",
             f"Swept {keys} on the dev split (held-out never read) with seeds {tuning['seeds']}, disjoint from "
             f"the reported ones; score: mean dev accuracy over iterations 1..T, mean over agents and seeds. "
             "Chosen value per contender in bold.", "",
             "| contender | " + " | ".join(tuning["values"]) + " |", "|---|" + "---|" * len(tuning["values"])]
    for c, scores in tuning["dev_scores"].items():
        cells = [(f"**{100 * scores[v]:.1f}**" if v == tuning["chosen"][c] else f"{100 * scores[v]:.1f}")
                 if v in scores else "-" for v in tuning["values"]]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    if tuning.get("per_agent"):
        agents = list(next(iter(tuning["per_agent"].values())))
        lines += ["", "Per agent (each agent takes the value of its own best dev accuracy, as its own setting "
                  "`agents.<name>.trainer.*`): mean dev accuracy per value, chosen in bold.", "",
                  "| contender | agent | " + " | ".join(tuning["values"]) + " |",
                  "|---|---|" + "---|" * len(tuning["values"])]
        for c, per in tuning["per_agent"].items():
            scores = tuning["agent_dev_scores"].get(tuning.get("tuned_as", {}).get(c, c), {})
            for a in agents:
                cells = [(f"**{100 * scores[a][v]:.1f}**" if v == per[a] else f"{100 * scores[a][v]:.1f}")
                         if v in scores.get(a, {}) else "-" for v in tuning["values"]]
                lines.append(f"| {c} | {a} | " + " | ".join(cells) + " |")
    inherited = tuning.get("tuned_as", {})
    if inherited:
        by_parent: dict[str, list[str]] = {}
        for c, par in inherited.items():
            by_parent.setdefault(par, []).append(c)
        lines += ["", "Not swept (one mechanism of a method changed, everything else held, the setting "
                  "included): " + "; ".join(f"{', '.join(cs)} take {par}'s {tuning['chosen'].get(cs[0], '?')}"
                                            for par, cs in by_parent.items()) + "."]
    return lines + [""]


def gate_lines(gate: dict | None) -> list[str]:
    """The first line of a report whose pool failed its gate and ran anyway (``--no-gate``)."""
    if not gate or gate.get("passed"):
        return []
    return [f"**Run with --no-gate: the pool failed its gate** (under {100 * gate['min_share']:.0f} % of cross samples "
            f"inside HACPO's {gate['window'].replace('hacpo_', '')} cross window at iteration 0 on "
            f"{', '.join(gate['failing'])}): its primary contrast cannot measure learning from peers' samples.", ""]


def agreement_lines(gate: dict | None) -> list[str]:
    """The pool's agreement at iteration 0, as the gate measured it before any run."""
    if not gate or not gate.get("agreement"):
        return []
    a = gate["agreement"]
    unit = a["unit"]
    lines = ["## Agreement at iteration 0 (the gate)", "",
             f"Measured before any run (`hacrl agreement`): {a['prompts']} dev prompts x {a['samples']} samples per "
             f"agent, each scored by every other agent; HACPO's ratio in its configured unit ({unit}). The gate asks "
             f"{100 * gate['min_share']:.0f} % inside the {gate['window'].replace('hacpo_', '')} cross window on "
             f"{'every edge' if gate.get('edges') is None else ', '.join(gate['edges'])}: "
             + ("passed." if gate["passed"] else "failed."), "",
             "| producer -> learner | ratio q10 / q50 / q90 | gap (nats/token) | inside first window | inside last "
             "window | mean effective weight |", "|---|---|---:|---:|---:|---:|"]
    for k, e in a["edges"].items():
        u = e[unit]
        lines.append(f"| {k} | {u['q10']:.2f} / {u['q50']:.2f} / {u['q90']:.2f} | {e['gap_nats_per_token']:+.3f} | "
                     f"{100 * u['inside_hacpo_first']:.0f} % | {100 * u['inside_hacpo_last']:.0f} % | "
                     f"{u['weight_hacpo_first']:.3f} |")
    return lines + [""]


def inside_lines(results: list[dict], agents: list[str]) -> list[str]:
    """The share of cross samples inside the clip window at each iteration's updates, per
    contender, learner and peer (means over seeds): whether sharing happened as training went."""
    rows = []
    for c in dict.fromkeys(r["contender"] for r in results):
        rs = [r for r in results if r["contender"] == c]
        for a in agents:
            trains = [r["agents"][a].get("train", []) for r in rs]
            for peer in _peers([x for t in trains for x in t], a):
                cells = []
                below, above = f"ratio/{peer}/clipped_below", f"ratio/{peer}/clipped_above"
                for it in range(max(len(t) for t in trains)):
                    steps = [t[it] for t in trains if it < len(t) and below in t[it] and above in t[it]]
                    v = [1 - x[below] - x[above] for x in steps]
                    cells.append(f"{100 * float(np.mean(v)):.0f}" if v else "-")
                rows.append((f"| {c} | {a} | {peer} | " + " | ".join(cells) + " |", len(cells)))
    if not rows:
        return []
    n = max(k for _, k in rows)
    rows = [r for r, _ in rows]
    return ["## Share of cross samples inside the window, per iteration", "",
            "Of a peer's samples in a learner's updates, the share (%) whose ratio lay inside the clip window "
            "(the ones that pass a gradient), at each iteration (means over seeds).", "",
            "| contender | learner | peer | " + " | ".join(f"it{t}" for t in range(1, n + 1)) + " |",
            "|---|---|---|" + "---|" * n, *rows, ""]


def write_report(results: list[dict], spec: dict, out_dir: Path, wall_s: float, overrides: list[str],
                 suite: str, setting: str = "", tuning: dict | None = None, warmups: int = 1,
                 gate: dict | None = None) -> Path:
    """``reports/<suite>/<setting>/``: results.json, README.md (primary contrast first, tables,
    Holm-corrected claims), plots. ``spec``: the setting (about, primary, plot) and the suite's claims."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table = summarize(results)
    endpoint = spec["primary"]["endpoint"] if spec.get("primary") else "final"
    found = findings(results, spec.get("claims") or [], endpoint)
    prim = primary(results, spec["primary"]) if spec.get("primary") else None
    seeds = sorted({r["seed"] for r in results})
    plots = write_plots(results, out_dir, spec.get("plot"))
    write_json(out_dir / "results.json", {"suite": suite, "setting": setting, "about": spec.get("about", ""),
                                          "seeds": seeds, "warmups": warmups, "overrides": overrides,
                                          "wall_seconds": round(wall_s, 1), "primary": prim, "tuning": tuning,
                                          **({"gate": gate} if gate else {}),
                                          "runs": run_refs(results, out_dir), "table": table, "findings": found})
    agents = list(table["agents"])
    title = f"# Comparison suite `{suite}`" + (f", setting `{setting}`" if setting else "")
    kl = next((o.split("=", 1)[1] for o in overrides if o.startswith("algorithm.kl_coef=")), None)
    lines = [*gate_lines(gate),
             primary_line(prim) if prim else "Primary contrast: its two contenders did not both run.", "", title, "",
             *([spec["about"], ""] if spec.get("about") else []),
             f"Seeds {seeds} on {warmups} warm-up pool{'s' if warmups > 1 else ''} (seed s uses pool s mod "
             f"{warmups}); overrides {' '.join(overrides) or '(none)'}; compute {wall_s / 60:.0f} min (the runs' own times"
             + (f", the dev sweep's {tuning['seconds'] / 60:.0f} min included" if (tuning or {}).get("seconds") else "")
             + "). "
             + (f"KL: coefficient {kl} (k3 to the initial model, on the learner's own samples) for every "
                "contender alike. " if kl else "KL: off. ")
             + "Final = held-out greedy accuracy after the last iteration, mean +- std over seeds; AUC = mean "
             f"accuracy over the first {table['budget_rollouts_per_agent']} rollouts each agent generated (the "
             "budget every contender reached: the equal-cost view). Training figures: the cross ratio's median per "
             "peer and the share of cross samples below the clip window, the share of the |objective| carried by "
             "cross samples, the KL to the initial model on the learner's own samples before each step (means over "
             "iterations and seeds).", "", *tuning_lines(tuning)]
    for a in agents:
        lines += [f"## {a}", "", "| contender | final (%) | AUC at equal rollouts (%) | training |", "|---|---|---|---|"]
        for c, row in table["agents"][a].items():
            lines.append(f"| {c} | {100 * row['final_mean']:.1f} +- {100 * row['final_std']:.1f} | "
                         f"{100 * row['auc_mean']:.1f} +- {100 * row['auc_std']:.1f} | {_train_figures(row, a)} |")
        lines.append("")
    lines += agreement_lines(gate)
    lines += step_lines(results, agents)
    lines += inside_lines(results, agents)
    if spec.get("per_iteration"):
        lines += iteration_lines(results, agents)
    lines += rescue_lines(results, agents)
    lines += ["## Secondary claims, paired by seed", "",
              f"Difference (better - worse) of the {'AUC' if endpoint == 'auc' else 'final held-out accuracy'} in "
              "points, mean and 95 % t interval over seeds (same pool, prompts and sampling seed per pair). The "
              f"claims are one family: p-values Holm-corrected over every cell; *holds* / *reversed*: adjusted p < "
              f"{ALPHA} with the claimed / opposite sign; *not resolved* otherwise (never read as equality). *all "
              f"agents*: the endpoint averaged over the agents. *Equivalent*: two one-sided tests put the difference "
              f"inside +-{MARGIN_POINTS:g} point. *Every checkpoint*: the accuracy difference at each iteration, the "
              "smallest shown; holds only when every one is above 0. Entropy / KL claims: the mean over iterations, "
              "in nats.", "", *claim_table(found, agents)]
    lines += ["", "Plots: " + ", ".join(f"`{x}`" for x in plots) + ". Raw curves and per-iteration "
              "training figures: one file per run in `runs/` (`results.json` lists them).", ""]
    (out_dir / "README.md").write_text("\n".join(lines))
    return out_dir


def write_index(suite_dir: Path, suite: str) -> Path:
    """``reports/<suite>/README.md``: each setting's primary contrast and claims side by side."""
    lines = [f"# Comparison suite `{suite}`", "", "One directory per setting, each with its own README, plots "
             "and results.json: its declared primary contrast first, then the Holm-corrected secondary claims.", ""]
    if (suite_dir / "ANALYSIS.md").exists():  # written by hand from these reports
        lines += ["What the settings and probes say about the causes: [ANALYSIS.md](ANALYSIS.md).", ""]
    for res_file in sorted(suite_dir.glob("*/results.json")):
        res = read_json(res_file)
        setting = res.get("setting") or res_file.parent.name
        agents = list(res["table"]["agents"])
        lines += [f"## `{setting}`: {res.get('about', '')}", "",
                  *([primary_line(res["primary"]), ""] if res.get("primary") else
                    ["Run before the comparison protocol: no declared primary contrast, verdicts at 2 standard "
                     "errors without correction, the lr not chosen on dev.", ""]),
                  f"{len(res['seeds'])} seeds, {len(res['runs'])} runs, {res['wall_seconds'] / 60:.0f} min. "
                  f"[details]({res_file.parent.name}/README.md)", "",
                  *claim_table(res["findings"], agents), ""]
    (suite_dir / "README.md").write_text("\n".join(lines))
    return suite_dir / "README.md"
