"""How often a peer's verified worked solution *is* the gold completion (SGT against its oracle).

SGT injects, for a prompt on which all of the learner's own samples are wrong, a peer's verified
success; its oracle injects the task's gold completion under the same gate. The two can differ
only where a peer's correct text differs from the gold one. This script runs the first
iteration's rollouts and verification of a finished ``hacrl compare --suite mutual`` setting from
its warm-up pools (the same stage functions, seeds and configs as the reported SGT runs), then
counts, per learner, the peers' verified successes on the gated prompts (the texts SGT may
inject) and the share of them equal to the gold completion, character for character, and after
removing whitespace.

    .venv/bin/python scripts/sgt_peer_texts.py [--setting worked] [--seeds 6]

It needs the suite's scratch directory (``compare/mutual/<setting>/base*``, left by the suite's
run) and its kept runs (``reports/mutual/<setting>/runs/``, for the exact overrides). Prints a
Markdown table; writes nothing outside a temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import tempfile
from pathlib import Path

from hacrl.exchange.experience import read_records
from hacrl.pipeline.in_process import run_iteration_until
from hacrl.storage import RunLayout
from hacrl.study import compare
from hacrl.study.runstore import stored_run
from hacrl.task.data import target_text


def peer_texts(setting: str, seed: int, root: Path) -> dict[str, dict[str, int]]:
    """Counts per learner for one seed: gated prompts, peers' verified successes on them, and how
    many of those equal the gold completion (exactly / ignoring whitespace)."""
    out = (root / "compare" / "mutual" / setting).resolve()
    run = stored_run(root / "reports" / "mutual" / setting / compare.STORE_DIR, "sgt", seed)
    if run is None:
        raise SystemExit(f"no kept SGT run for seed {seed} in reports/mutual/{setting}/runs")
    base = compare.base_dir(out, run["warmup"])
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cfg = compare._cfg(run["overrides"], work / "runs", work / "reports")
        shutil.copytree(base / "runs" / "it0", work / "runs" / "it0")
        with contextlib.chdir(base):  # the base's data/tasks
            run_iteration_until(cfg, 1, "exchange-and-align")
        lay = RunLayout(cfg.experiment.runs_dir)
        recs = {a.name: read_records(lay.rollouts(1) / f"{a.name}.parquet", "rollout").merge(
            read_records(lay.rewards(1) / f"{a.name}.parquet", "verdict")[["record_id", "reward"]], on="record_id")
            for a in cfg.agents}
    counts: dict[str, dict[str, int]] = {}
    for learner, own in recs.items():
        solved = own.groupby("prompt_id")["reward"].max()
        gated = set(solved[solved <= 0].index)
        c = {"gated": len(gated), "candidates": 0, "gold_exact": 0, "gold_no_space": 0}
        for peer, df in recs.items():
            if peer == learner:
                continue
            for r in df[df["prompt_id"].isin(gated) & (df["reward"] > 0)].itertuples(index=False):
                gold = target_text({"problem": r.problem, "answer": r.gold, "level": r.level}, cfg.data.completion)
                c["candidates"] += 1
                c["gold_exact"] += r.response_text.strip() == gold.strip()
                c["gold_no_space"] += re.sub(r"\s", "", r.response_text) == re.sub(r"\s", "", gold)
        counts[learner] = c
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", default="worked")
    ap.add_argument("--seeds", type=int, default=6)
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    total: dict[str, dict[str, int]] = {}
    for s in range(args.seeds):
        for learner, c in peer_texts(args.setting, s, root).items():
            t = total.setdefault(learner, dict.fromkeys(c, 0))
            for k, v in c.items():
                t[k] += v
    print(f"mutual/{args.setting}, iteration 1, seeds 0-{args.seeds - 1}: peers' verified successes on the "
          "prompts where all the learner's own samples are wrong")
    print("| learner | gated prompts | peers' verified successes on them | equal to the gold completion | "
          "equal ignoring whitespace |\n|---|---|---|---|---|")
    for learner, t in total.items():
        n = max(t["candidates"], 1)
        print(f"| {learner} | {t['gated']} | {t['candidates']} | {100 * t['gold_exact'] / n:.1f} % | "
              f"{100 * t['gold_no_space'] / n:.1f} % |")


if __name__ == "__main__":
    main()
