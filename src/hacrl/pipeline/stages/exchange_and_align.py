"""exchange-and-align: SEE records published; each learner's input from its subscription, THL-aligned."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from hacrl.agents.pool import load_tokenizer, prompt_template
from hacrl.config.schema import Config
from hacrl.exchange import thl
from hacrl.exchange.experience import LearnerView, pair_residuals, publish, read_records, subscribe, write_records
from hacrl.pipeline.result import StageResult, numbers
from hacrl.pipeline.table import output_identity
from hacrl.storage import atomic_path, write_json
from hacrl.task.data import target_text

log = logging.getLogger(__name__)


def exchange_and_align(cfg: Config, t: int) -> StageResult:
    """Publish every agent's typed records (SEE); build each learner's input from its
    subscription, peers' records retokenised and aligned by THL; THL residuals per pair."""
    lay = cfg.layout
    a = cfg.algorithm
    published = {ac.name: publish(read_records(lay.rollouts(t) / f"{ac.name}.parquet", "rollout"),
                                  read_records(lay.rewards(t) / f"{ac.name}.parquet", "verdict"))
                 for ac in cfg.agents}
    # one tokenizer per agent (the one it generated with is the one it learns with)
    tokenizers = {ac.name: load_tokenizer(ac, lay.checkpoint(t - 1, ac.name)) for ac in cfg.agents}
    stats: dict = {"records": {p: {k: len(v) for k, v in shards.items()} for p, shards in published.items()},
                   "subscription": [dataclasses.asdict(s) for s in a.subscription]}
    residuals: dict[str, dict] = {}

    def gold_text(rec) -> str:  # the oracle's completion (a content: gold stream): the warm-up's target
        return target_text({"id": rec.prompt_id, "problem": rec.problem, "answer": rec.gold, "level": rec.level},
                           cfg.data.completion)

    with atomic_path(lay.exchange(t), is_dir=True,
                     identity=output_identity(cfg, lay.exchange(t), "exchange-and-align", t)) as tmp:
        def out_of(final: Path) -> Path:  # the same place under the temporary directory
            out = tmp / final.relative_to(lay.exchange(t))
            out.parent.mkdir(parents=True, exist_ok=True)
            return out

        for producer, shards in published.items():
            for rtype, df in shards.items():
                write_records(out_of(lay.published(t, producer, rtype)), df, rtype)
        for ac in cfg.agents:
            view = LearnerView(ac.name, tokenizers[ac.name], prompt_template(ac, tokenizers[ac.name]))
            inp = subscribe(published, view, a.subscription, tokenizers, a.thl, gold_text)
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
    shared = {ac.name: stats[ac.name]["cross"] > 0 for ac in cfg.agents}
    for producer, row in residuals.items():
        for learner, r in row.items():
            if r["round_trip_mismatch"] > 0:
                # a warning only where the learner trains on the producer's text; a measured pair
                # an algorithm never shares is information (thl_residuals.json, MLflow)
                (log.warning if shared.get(learner) else log.info)(
                    "THL %s -> %s: %.1f%% of responses do not survive decode(encode(text)) in the learner's "
                    "tokenizer%s", producer, learner, 100 * r["round_trip_mismatch"],
                    "" if shared.get(learner) else " (measured only: this algorithm trains on no peer text)")
    stats["thl"] = residuals
    # a learner's figures, and the THL residuals of each producer's records in its tokenizer
    per = {ac.name: {**numbers(stats[ac.name], "learner_"),
                     **{f"thl_from/{p}/{k}": v for p, row in residuals.items() if ac.name in row
                        for k, v in numbers(row[ac.name]).items()}} for ac in cfg.agents}
    return StageResult(stats, agents=per)
