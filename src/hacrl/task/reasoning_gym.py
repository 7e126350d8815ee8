"""reasoning-gym as a data source (``data.source: reasoning_gym``): the field's library of procedural
task generators with verifiable answers.

``data.tasks`` weighs the generators (``{basic_arithmetic: 0.5, chain_sum: 0.5}``) and
``data.task_settings`` gives each its own settings (terms, digits, operators: the fields of its
config class). Problems are drawn from each generator in a seeded order; a problem's split (train,
dev, held-out) is fixed by a hash of its question, as the built-in task's is, so the splits are
disjoint whatever the sizes and seeds. The gold answer is the generator's; the reward stays
math-verify's on the boxed answer. How far reasoning-gym's own ``score_answer`` and math-verify
agree is measured on every split (:func:`scorer_agreement`): on the gold answer and on an answer
off by one, both must say the same.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from hacrl.errors import ConfigError, DataError
from hacrl.task.data import Problem, problem_key, split_of

_LIMIT = 10**7
"""Indices drawn from a generator before a split is declared unfillable."""


def registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's generators: name -> (dataset class, config class)."""
    import reasoning_gym  # noqa: F401 - registers every dataset
    from reasoning_gym.factory import DATASETS

    return dict(DATASETS)


def check(tasks: dict[str, float], settings: dict[str, dict[str, Any]]) -> None:
    """One line naming the key for an unknown task, an unknown setting of a task, a value its
    config refuses, or no task with weight."""
    table = registry()
    if not any(float(w) > 0 for w in tasks.values()):
        raise ConfigError(f"data.tasks: invalid value {dict(tasks)!r} (at least one reasoning-gym task with a "
                          "weight > 0, e.g. data.tasks={basic_arithmetic: 1})")
    for name in [*tasks, *settings]:
        if name not in table:
            import difflib

            close = difflib.get_close_matches(name, table, n=3, cutoff=0.5) or ["basic_arithmetic", "chain_sum"]
            key = "data.tasks" if name in tasks else "data.task_settings"
            raise ConfigError(f"{key}.{name}: unknown reasoning-gym task (did you mean {', '.join(close)}? "
                              f"{len(table)} tasks in reasoning_gym.factory.DATASETS)")
    for name, kw in settings.items():
        _, config_cls = table[name]
        fields = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
        for k in kw:
            if k not in fields:
                raise ConfigError(f"data.task_settings.{name}.{k}: unknown setting of {name} "
                                  f"(it has: {', '.join(sorted(fields))})")
        try:
            config_cls(**kw).validate()
        except (AssertionError, TypeError, ValueError) as e:
            raise ConfigError(f"data.task_settings.{name}: invalid value {dict(kw)!r} ({e or 'refused by its config'})"
                              ) from None


def _dataset(name: str, settings: dict[str, Any], seed: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=_LIMIT, **settings)


def generate_splits(tasks: dict[str, float], settings: dict[str, dict[str, Any]], sizes: dict[str, int],
                    heldout_fraction: float, seed: int) -> dict[str, list[Problem]]:
    """``sizes[split]`` distinct problems per split, the tasks mixed by weight (each task's share
    rounded, the last one filling up), each problem in the split its question's hash gives."""
    names = [n for n, w in tasks.items() if float(w) > 0]
    total = sum(float(tasks[n]) for n in names)
    out: dict[str, list[Problem]] = {s: [] for s in sizes}
    for i, name in enumerate(names):
        ds = _dataset(name, settings.get(name, {}), random.Random(f"{seed}/rg/{name}").randrange(2**31))
        want = {s: (n - sum(int(n * float(tasks[m]) / total) for m in names[:-1]) if i == len(names) - 1
                    else int(n * float(tasks[name]) / total)) for s, n in sizes.items()}
        got = {s: 0 for s in sizes}
        seen: set[str] = set()
        idx = 0
        while any(got[s] < want[s] for s in sizes):
            if idx >= _LIMIT:
                short = {s: (got[s], want[s]) for s in sizes if got[s] < want[s]}
                raise DataError(f"reasoning_gym: task {name} yields too few distinct problems for {short} "
                                "(got, wanted): widen its settings or lower the split sizes")
            entry = ds[idx]
            idx += 1
            key = problem_key(entry["question"])
            split = split_of(key, heldout_fraction)
            if split not in want or got[split] >= want[split] or key in seen:
                continue
            seen.add(key)
            out[split].append({"id": f"{split}-{name}-{got[split]:06d}", "problem": entry["question"],
                               "answer": str(entry["answer"]), "level": name})
            got[split] += 1
    return out


def _off_by_one(answer: str) -> str | None:
    try:
        return str(int(answer) + 1)
    except ValueError:
        try:
            return repr(float(answer) + 1.0)
        except ValueError:
            return None


def scorer_agreement(problems: list[Problem], settings: dict[str, dict[str, Any]], verifier,
                     limit: int = 2000) -> dict[str, float]:
    """On up to ``limit`` problems: reasoning-gym's ``score_answer`` (1 = right) and math-verify's
    verdict on the boxed gold answer and on one off by one; the share of checks where both say the
    same, and of golds each accepts."""
    from hacrl.task.rewards import CORRECT

    table = registry()
    scorers: dict[str, Any] = {}
    checks, rg, gold = [], [], []
    for p in problems[:limit]:
        if p["level"] not in scorers:
            ds_cls, cfg_cls = table[p["level"]]
            scorers[p["level"]] = ds_cls(cfg_cls(**settings.get(p["level"], {})))
        for cand in (p["answer"], _off_by_one(p["answer"])):
            if cand is None:
                continue
            entry = {"answer": p["answer"], "question": p["problem"], "metadata": {}}
            rg.append(scorers[p["level"]].score_answer(cand, entry) >= 1.0)
            checks.append((p["answer"], f"\\boxed{{{cand}}}"))
            gold.append(cand == p["answer"])
    mv = [v == CORRECT for v in verifier.verify(checks, desc="reasoning-gym vs math-verify")]
    n = len(checks)
    on_gold = [i for i, g in enumerate(gold) if g]
    return {"checks": n, "agree": sum(a == b for a, b in zip(rg, mv)) / max(1, n),
            "gold_accepted_rg": sum(rg[i] for i in on_gold) / max(1, len(on_gold)),
            "gold_accepted_mv": sum(mv[i] for i in on_gold) / max(1, len(on_gold))}
