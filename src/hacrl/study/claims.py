"""What a comparison's runs support: its primary contrast and its secondary claims, as paired
tests over seeds (:mod:`hacrl.study.stats`).

Every contender of a seed shares the pool, the prompts and the sampling seeds, so differences are
paired by seed. An endpoint is a number per run and agent:

- ``auc``: the mean held-out accuracy over the first B rollouts the agent generated, B the budget
  every contender reached (:func:`auc`): equal cost, and far less noisy than one checkpoint;
- ``final``: the held-out accuracy after the last iteration.

The **primary contrast** (declared by the suite's setting before it runs) is one test on the
endpoint averaged over the agents: a 95 % t interval with its degrees of freedom, its verdict, and
the smallest effect the design detects at 80 % power. The **secondary claims** form one family
per report, Holm-corrected: a directional claim *holds* (or is *reversed*) when its adjusted
p-value is below 0.05 and the difference has the claimed (opposite) sign, else it is *not
resolved*; an *equal* claim holds only when two one-sided tests show the difference inside
+-``margin`` points; *every checkpoint* holds only when each checkpoint's difference is above 0
(an intersection-union test: its p-value is the largest one-sided p over the checkpoints). With a
single seed no test is possible and the verdict says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy import stats as sps

from hacrl.study.stats import detectable_effect, holm, paired_t, seeds_for, tost

ALPHA = 0.05
MARGIN_POINTS = 1.0
"""The equivalence margin of "equal" claims, in points of accuracy."""
ENDPOINTS = ("auc", "final")


def auc(x: list[float], y: list[float], budget: float) -> float:
    """Mean accuracy over rollouts generated in [0, budget] (trapezoid area / budget)."""
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    if budget <= 0:
        return float(ys[0])
    grid_y = np.interp(np.append(xs[xs < budget], budget), xs, ys)
    grid_x = np.append(xs[xs < budget], budget)
    return float(np.trapezoid(grid_y, grid_x) / budget)


def budget(results: list[dict]) -> float:
    """The rollouts per agent every run reached (the equal-cost horizon of ``auc``)."""
    return min(r["agents"][a]["rollouts"][-1] for r in results for a in r["agents"])


def endpoint_fn(endpoint: str, results: list[dict]) -> Callable[[dict, str], float]:
    """``f(run, agent)``: the run's endpoint for that agent."""
    if endpoint == "final":
        return lambda r, a: r["agents"][a]["eval_accuracy"][-1]
    if endpoint == "auc":
        b = budget(results)
        return lambda r, a: auc(r["agents"][a]["rollouts"], r["agents"][a]["eval_accuracy"], b)
    raise ValueError(f"endpoint: invalid value {endpoint!r} (choose from {', '.join(ENDPOINTS)})")


def paired_diffs(results: list[dict], hi: str, lo: str, value: Callable[[dict], float]) -> list[float] | None:
    """``value(run)`` of ``hi`` minus that of ``lo`` per seed both ran (None if none, or any is
    undefined)."""
    runs = {(r["contender"], r["seed"]): r for r in results}
    seeds = sorted({s for c, s in runs if c == hi} & {s for c, s in runs if c == lo})
    d = [value(runs[(hi, s)]) - value(runs[(lo, s)]) for s in seeds]
    if not d or not all(math.isfinite(x) for x in d):
        return None
    return d


def _one_sided_p(d: list[float]) -> float:
    """p of "mean difference <= 0" against "> 0" (paired t)."""
    r = paired_t(d)
    if r.se == 0:
        return 0.0 if r.mean > 0 else 1.0
    return float(sps.t.sf(r.mean / r.se, r.df))


def _cell(d: list[float], scale: float, kind: str, margin: float) -> dict:
    """One tested difference: mean, s.e., 95 % t interval, df, raw p (of the claim's test)."""
    n = len(d)
    digits = 4 if scale == 1 else 2  # raw units (entropy, KL) or points

    def shown(x: float) -> float:
        return round(scale * x, digits)

    cell = {"points": shown(float(np.mean(d))), "seeds": n}
    if n < 2:
        return {**cell, "stderr_points": float("nan"), "p": float("nan"), "verdict": "one seed: not tested"}
    r = paired_t(d)
    cell.update({"stderr_points": shown(r.se), "df": r.df, "ci": [shown(r.lo), shown(r.hi)]})
    if all(x == 0 for x in d):  # the two contenders ran the same numbers: no test says more than that
        cell["identical"] = True
    if kind.startswith("equal"):
        eq = tost(d, margin / scale)
        cell.update({"p": eq.p, "margin_points": margin})
    else:
        cell["p"] = r.p
    return cell


def findings(results: list[dict], claims: list[tuple], endpoint: str = "final",
             margin: float = MARGIN_POINTS) -> list[dict]:
    """The secondary claims per agent, as paired tests over seeds, Holm-corrected together.

    A claim is ``(text, better, worse[, kind])``. Kinds: ``final`` (default: the endpoint per
    agent, in points); ``average``: the endpoint averaged over the agents (one cell, ``all
    agents``); ``equal`` / ``equal_average``: equivalence within +-``margin`` points (TOST);
    ``every_checkpoint``: the accuracy difference at every evaluated iteration after 0 (the cell
    shows the smallest); ``entropy`` / ``kl``: the signature's mean over iterations (raw units)."""
    out = []
    agents = list(results[0]["agents"])
    value = endpoint_fn(endpoint, results)
    for claim in claims:
        text, hi, lo, kind = (*claim, "final")[:4]
        cells: dict = {}
        if kind in ("average", "equal_average"):
            d = paired_diffs(results, hi, lo, lambda r: float(np.mean([value(r, a) for a in agents])))
            if d is not None:
                cells["all agents"] = _cell(d, 100, kind, margin)
        for a in agents if kind not in ("average", "equal_average") else []:
            if kind in ("entropy", "kl"):
                d = paired_diffs(results, hi, lo, lambda r, a=a: _signature(r, a, kind))
                if d is not None:
                    cells[a] = _cell(d, 1, kind, margin)
            elif kind == "every_checkpoint":
                n = min(len(r["agents"][a]["eval_accuracy"]) for r in results)
                per = [paired_diffs(results, hi, lo, lambda r, t=t, a=a: r["agents"][a]["eval_accuracy"][t])
                       for t in range(1, n)]
                per = [x for x in per if x is not None]
                if per:
                    worst = min(per, key=lambda x: float(np.mean(x)))
                    cell = _cell(worst, 100, "final", margin)
                    if len(worst) > 1:
                        cell["p"] = max(_one_sided_p(x) for x in per)
                    cell["checkpoints"] = len(per)
                    cells[a] = cell
            else:
                d = paired_diffs(results, hi, lo, lambda r, a=a: value(r, a))
                if d is not None:
                    cells[a] = _cell(d, 100, kind, margin)
        if cells:
            out.append({"claim": text, "better": hi, "worse": lo, "kind": kind,
                        "endpoint": endpoint if kind in ("final", "average", "equal", "equal_average") else kind,
                        "differences": cells})
    _holm_verdicts(out)
    return out


def _holm_verdicts(found: list[dict]) -> None:
    """Adjust every tested cell's p-value over the whole family (Holm) and give its verdict."""
    tested = [(f, c) for f in found for c in f["differences"].values() if math.isfinite(c.get("p", float("nan")))]
    adjusted = holm([c["p"] for _, c in tested]) if tested else []
    for (f, c), p_adj in zip(tested, adjusted):
        c["p_holm"] = round(p_adj, 4)
        c["p"] = round(c["p"], 4)
        if c.get("identical"):
            c["verdict"] = "identical in every seed"
        elif f["kind"].startswith("equal"):
            c["verdict"] = "equivalent" if p_adj < ALPHA else "not shown equivalent"
        elif f["kind"] == "every_checkpoint":
            c["verdict"] = "holds" if p_adj < ALPHA else "not resolved"
        elif p_adj < ALPHA:
            c["verdict"] = "holds" if c["points"] > 0 else "reversed"
        else:
            c["verdict"] = "not resolved"
    for f in found:
        verdicts = [c["verdict"] for c in f["differences"].values()]
        f["reproduces"] = all(v in ("holds", "equivalent") or (v == "identical in every seed" and
                                                               f["kind"].startswith("equal")) for v in verdicts)


def _signature(run: dict, agent: str, key: str) -> float:
    """A run's mean over iterations of ``entropy`` or ``kl`` (the optimisation signatures)."""
    vals = [v for v in run["agents"][agent].get(key, []) if v is not None]
    return float(np.mean(vals)) if vals else float("nan")


def primary(results: list[dict], spec: dict) -> dict | None:
    """The declared primary contrast (``spec``: text, better, worse, endpoint) on the endpoint
    averaged over the agents: mean difference in points with its 95 % t interval and df, p, the
    verdict, and what the design can detect (80 % power, two-sided 0.05) from the observed spread;
    None when the two contenders share no seed."""
    agents = list(results[0]["agents"])
    value = endpoint_fn(spec["endpoint"], results)
    d = paired_diffs(results, spec["better"], spec["worse"], lambda r: float(np.mean([value(r, a) for a in agents])))
    if d is None:
        return None
    out = {**{k: spec[k] for k in ("text", "better", "worse", "endpoint")}, "seeds": len(d),
           "mean_points": round(100 * float(np.mean(d)), 2)}
    if len(d) < 2:
        return {**out, "verdict": "one seed: not tested"}
    r = paired_t(d)
    sd = r.se * math.sqrt(r.n)
    need = seeds_for(0.01, sd) if sd > 0 else 2
    return {**out, "ci_points": [round(100 * r.lo, 2), round(100 * r.hi, 2)], "df": r.df, "p": round(r.p, 4),
            "stderr_points": round(100 * r.se, 2), "verdict": r.verdict,
            "detectable_points": round(100 * detectable_effect(sd, r.n), 2),
            "seeds_for_1_point": need}


ENDPOINT_WORDS = {"auc": "mean held-out accuracy over the rollouts every contender reached (AUC), mean over agents",
                  "final": "held-out accuracy after the last iteration, mean over agents"}


def primary_line(p: dict) -> str:
    """The report's first line: the contrast, its interval and verdict, the detectable effect."""
    head = f"**Primary contrast** (declared before the runs): {p['text']} -- {ENDPOINT_WORDS[p['endpoint']]}: "
    if "ci_points" not in p:
        return head + f"{p['mean_points']:+.1f} points, {p['verdict']}."
    need = p["seeds_for_1_point"]
    return (head + f"{p['mean_points']:+.1f} points [{p['ci_points'][0]:+.1f}, {p['ci_points'][1]:+.1f}] "
            f"(95 % t interval, df {p['df']}, p = {p['p']:.3g}): **{p['verdict']}**. {p['seeds']} seeds detect a "
            f"true difference of {p['detectable_points']:.1f} points with 80 % power; 1 point would need "
            + (f"{need} seeds." if need is not None else "more than 200 seeds."))
