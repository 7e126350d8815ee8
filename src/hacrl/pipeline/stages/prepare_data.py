"""prepare-data: the train / dev / held-out problem files (procedural, reasoning-gym, or from local files)."""

from __future__ import annotations

import logging
import random

from hacrl.config.schema import Config
from hacrl.errors import DataError
from hacrl.pipeline.result import Input, StageResult, numbers
from hacrl.pipeline.table import output_identity
from hacrl.storage import atomic_path, write_json
from hacrl.task import data as task_data
from hacrl.task import reasoning_gym
from hacrl.task.rewards import VerifierPool

log = logging.getLogger(__name__)


def prepare_data(cfg: Config) -> StageResult:
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
    elif d.source == "reasoning_gym":
        splits = reasoning_gym.generate_splits(
            d.tasks, d.task_settings, {"train": d.train_size, "dev": d.dev_size, "heldout": d.heldout_size},
            d.heldout_fraction, seed)
        skipped = {}
    else:
        how = dict(fmt=d.format, fields=d.fields, answer_format=d.answer_format)
        train, s1 = task_data.load_problems(d.train_path, d.on_bad_row, **how)
        held, s2 = task_data.load_problems(d.heldout_path, d.on_bad_row, **how)
        r = random.Random(f"{seed}/dev")
        r.shuffle(train)
        n_dev = min(d.dev_size, len(train) // 5)
        splits = {"train": train[n_dev:], "dev": train[:n_dev], "heldout": held}
        skipped = {"train": s1, "heldout": s2}
    # held-out accuracy on training problems would look like generalisation: refused, or dropped
    # and counted (the procedural splits are disjoint by construction; checked all the same)
    leaked = task_data.heldout_overlap(splits["heldout"], splits["train"] + splits["dev"])
    if leaked and d.heldout_overlap == "error":
        first = splits["heldout"][leaked[0]]
        raise DataError(f"{d.heldout_path or 'held-out set'}: {len(leaked)} of {len(splits['heldout'])} held-out "
                        f"problems are also training or dev problems (first: id {first['id']!r}, "
                        f"{first['problem'][:80]!r}); use disjoint files, or data.heldout_overlap=drop to remove them")
    if leaked:
        gone = set(leaked)
        splits["heldout"] = [p for i, p in enumerate(splits["heldout"]) if i not in gone]
        log.warning("held-out: dropped %d problems also in train/dev (data.heldout_overlap=drop)", len(leaked))
        if not splits["heldout"]:
            raise DataError(f"{d.heldout_path}: every held-out problem is also a training problem")
    out = cfg.layout.tasks
    with atomic_path(out, is_dir=True, identity=output_identity(cfg, out, "prepare-data")) as tmp:
        for name, probs in splits.items():
            task_data.write_jsonl(tmp / f"{name}.jsonl", probs)
        manifest = {"sizes": {k: len(v) for k, v in splits.items()}, "skipped_rows": skipped,
                    **({"heldout_overlap_dropped": len(leaked)} if leaked else {}),
                    "levels": {k: sorted({p["level"] for p in v}) for k, v in splits.items()}}
        if d.source == "reasoning_gym":  # the generator's own scorer against the reward's verifier
            with VerifierPool.of(cfg.reward) as ver:
                manifest["scorer_agreement"] = {k: reasoning_gym.scorer_agreement(v, d.task_settings, ver)
                                                for k, v in splits.items()}
            log.info("reasoning-gym's score_answer vs math-verify: %s",
                     {k: f"{100 * v['agree']:.1f} % of {v['checks']}" for k, v in manifest["scorer_agreement"].items()})
        write_json(tmp / "manifest.json", manifest)
    log.info("task data: %s", manifest["sizes"])
    read = [(n, getattr(d, f"{n}_path")) for n in ("train", "heldout") if d.source != "procedural"]
    return StageResult(manifest, metrics={**numbers(manifest["sizes"], "tasks/"),
                                          **numbers(skipped, "skipped_rows/")},
                       inputs=[Input(f"source/{n}", str(p), "source") for n, p in read])
