"""How well the agents of a run can share: per learner and peer, THL's residuals (how exactly a
peer's response and its log-prob trace carry over onto the learner's tokens) and the cross
ratio's distribution on the peer's samples (the learner's probability of the peer's response
over the peer's; HACPO clips it to a window), with held-out accuracy before and after.

Read from a run's own files (``runs/itT/exchange/thl_residuals.json``, ``update_stats.json``,
``eval_metrics.json``); the cross ratio exists where the algorithm trained on peers' samples
(HACPO, naive sharing). ``hacrl sharing`` prints it; ``--out`` writes it as Markdown.
"""

from __future__ import annotations

from pathlib import Path

from hacrl.storage import RunLayout, atomic_write_text, read_json


def _fmt(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "–"
    return f"{100 * v:.1f} %" if pct else f"{v:.3f}"


def sharing_report(runs_dir: str | Path, title: str = "") -> str:
    """The run's sharing figures as Markdown (every iteration found under ``runs_dir``)."""
    lay = RunLayout(Path(runs_dir))
    its = sorted(int(p.name[2:]) for p in Path(runs_dir).glob("it*") if p.name[2:].isdigit())
    lines = [f"# Sharing between the agents{': ' + title if title else ''}", ""]
    acc = {t: read_json(lay.eval_metrics(t))["agents"] for t in its if lay.eval_metrics(t).exists()}
    if acc:
        agents = list(next(iter(acc.values())))
        lines += ["Held-out accuracy (greedy pass@1, +- standard error):", "",
                  "| iteration | " + " | ".join(agents) + " |", "|---|" + "---|" * len(agents)]
        for t, a in acc.items():
            lines.append(f"| {t} | " + " | ".join(f"{_fmt(a[n].get('eval_accuracy'), True)} +- "
                                                   f"{_fmt(a[n].get('eval_stderr'), True)}" for n in agents) + " |")
        lines.append("")
    thl_rows, ratio_rows = [], []
    for t in its:
        f = lay.exchange(t) / "thl_residuals.json"
        if f.exists():
            res = read_json(f)
            for producer, row in res["pairs"].items():
                for learner, r in row.items():
                    thl_rows.append(f"| {t} | {producer} | {learner} | {r['records']} | "
                                    f"{_fmt(r['round_trip_mismatch'], True)} | {_fmt(r['straddle_share'], True)} | "
                                    f"{_fmt(r['unmatched_share'], True)} | {r['mass_error_mean']:.2e} | "
                                    f"{r['mass_error_max']:.2e} | {_fmt(r['dropped_mass_mean'])} |")
        if lay.update_stats(t).exists():
            for learner, st in read_json(lay.update_stats(t)).items():
                peers = sorted({k.split("/")[1] for k in st if k.startswith("ratio/")} - {learner})
                for peer in peers:
                    g = {k.split("/")[2]: v for k, v in st.items() if k.startswith(f"ratio/{peer}/")}
                    below, above = g.get("clipped_below"), g.get("clipped_above")
                    inside = None if below is None or above is None else 1.0 - below - above
                    ratio_rows.append(f"| {t} | {learner} | {peer} | {g.get('n', '–')} | {_fmt(g.get('q10'))} | "
                                      f"{_fmt(g.get('q50'))} | {_fmt(g.get('q90'))} | {_fmt(inside, True)} | "
                                      f"{_fmt(below, True)} | {_fmt(above, True)} |")
    lines += [("THL residuals per producer -> learner (docs/ALGORITHMS.md, \"THL\"): round-trip mismatch = "
               "share of responses whose retokenisation for the learner is not exact; straddle = tokens (both "
               "sides) that straddle the other side's token boundaries, over all tokens; unmatched = the "
               "producer's tokens lost plus the learner's tokens without a match, over all tokens; mass error = "
               "|aligned trace sum - producer trace sum| per response, in nats; dropped mass = the producer's "
               "log-prob left out, per response."),
              "", "| iteration | producer | learner | records | round-trip mismatch | straddle | unmatched | "
              "mass error mean | mass error max | dropped mass |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
              *(thl_rows or ["| – | – | – | – | – | – | – | – | – | – |"]), ""]
    lines += [("Cross ratio on the peer's samples as the learner trained on them (quantiles over samples; the "
               "share inside, below and above the clip window):"), "",
              "| iteration | learner | peer | samples | q10 | median | q90 | inside | below | above |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
              *(ratio_rows or ["| – | – | – | – | – | – | – | – | – | – |  (no peer samples trained on: "
                               "not a sharing algorithm)"]), ""]
    return "\n".join(lines)


def write_sharing_report(runs_dir: str | Path, out: str | Path, title: str = "") -> Path:
    out = Path(out)
    atomic_write_text(out, sharing_report(runs_dir, title))
    return out
