"""reasoning-gym as a data source (``data=reasoning_gym``): the generators' problems in disjoint
splits with the generators' gold answers, its scorer checked against math-verify on every split,
and one line for a bad task or setting (real reasoning-gym, real math-verify)."""

from __future__ import annotations

import pytest

from conftest import SMOKE

from hacrl.errors import ConfigError
from hacrl.pipeline import params, table
from hacrl.storage import read_json
from hacrl.task.data import problem_key, read_split

RG = ["data=reasoning_gym", "data.train_size=300", "data.dev_size=30", "data.heldout_size=120"]


def _cfg(tmp_path, *extra):
    d = params.compose([*SMOKE, *RG, *extra])
    d["experiment"]["runs_dir"] = str(tmp_path / "runs")
    return params.from_dict(d)


def test_the_generators_fill_disjoint_splits_by_weight_with_their_gold(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path)
    table.run("prepare-data", cfg)
    tasks = cfg.layout.tasks
    splits = {s: read_split(tasks, s) for s in ("train", "dev", "heldout")}
    assert {s: len(v) for s, v in splits.items()} == {"train": 300, "dev": 30, "heldout": 120}
    keys = {s: {problem_key(p["problem"]) for p in v} for s, v in splits.items()}
    assert all(len(keys[s]) == len(splits[s]) for s in splits)  # no problem twice in a split
    assert not keys["train"] & keys["heldout"] and not keys["dev"] & keys["heldout"] and not keys["train"] & keys["dev"]
    for s, v in splits.items():  # both generators, by weight (0.5 each)
        assert {p["level"] for p in v} == {"basic_arithmetic", "chain_sum"}
        assert sum(p["level"] == "chain_sum" for p in v) == len(v) // 2
    p = next(p for p in splits["train"] if p["level"] == "chain_sum")
    assert p["problem"].startswith("State the final answer") and int(p["answer"]) == eval(
        p["problem"].split(":")[1].rstrip("= "))  # the generator's gold is the expression's value
    agree = read_json(tasks / "manifest.json")["scorer_agreement"]
    for s, a in agree.items():  # reasoning-gym's scorer and math-verify, on the gold and on gold + 1
        assert a["checks"] == 2 * len(splits[s]) and a["agree"] == 1.0 and a["gold_accepted_mv"] == 1.0, (s, a)
    # the same seed, the same problems; another seed, others
    table.run("prepare-data", cfg)
    assert read_split(tasks, "heldout") == splits["heldout"]


@pytest.mark.parametrize("override, message", [
    ("+data.tasks.chain_summ=1", r"^data.tasks.chain_summ: unknown reasoning-gym task \(did you mean chain_sum"),
    ("+data.task_settings.chain_sum.digits=3", r"^data.task_settings.chain_sum.digits: unknown setting of chain_sum"),
    ("data.task_settings.chain_sum.max_terms=1", r"^data.task_settings.chain_sum: invalid value .*max_terms must be"),
    ("data.tasks.chain_sum=0", None),  # one generator left: valid
])
def test_a_bad_task_or_setting_is_one_line_naming_it(override, message):
    if message is None:
        params.from_dict(params.compose([*SMOKE, *RG, override]))
        return
    with pytest.raises(ConfigError, match=message):
        params.from_dict(params.compose([*SMOKE, *RG, override]))


def test_no_task_with_weight_is_refused():
    with pytest.raises(ConfigError, match=r"^data.tasks: invalid value .*at least one reasoning-gym task"):
        params.from_dict(params.compose([*SMOKE, *RG, "data.tasks.chain_sum=0", "data.tasks.basic_arithmetic=0"]))


@pytest.mark.slow
def test_dvc_repro_trains_an_iteration_on_two_reasoning_gym_tasks(tmp_path):
    """`dvc repro` with data=reasoning_gym (two tasks, 1,000 held-out problems) through
    prepare-data, the pool and one iteration: the held-out evaluation reports both tasks."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import dvc_workspace

    repo = dvc_workspace(tmp_path / "repo", ("dvc.yaml", "conf", "src", ".gitignore", ".dvcignore"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HACRL_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"

    def run(*args):
        p = subprocess.run(list(args), cwd=repo, env=env, capture_output=True, text=True)
        assert p.returncode == 0, f"{' '.join(args)}:\n{(p.stdout + p.stderr)[-3000:]}"
        return p

    run(sys.executable, "-m", "hacrl.cli", "config", *SMOKE, "data=reasoning_gym", "data.train_size=1000",
        "data.dev_size=40", "data.heldout_size=1000", "experiment.iterations=1", "tracking.enabled=false")
    run(sys.executable, "-m", "dvc", "repro")
    manifest = read_json(repo / "data" / "tasks" / "manifest.json")
    assert manifest["sizes"]["heldout"] == 1000 and all(a["agree"] == 1.0 for a in manifest["scorer_agreement"].values())
    last = read_json(repo / "runs" / "it1" / "history.json")["iterations"][-1]
    assert last["iteration"] == 1
    for a in last["agents"].values():  # every held-out problem, accuracy per task
        assert a["eval_n"] == 1000 and set(a["by_level"]) == {"basic_arithmetic", "chain_sum"}
    assert "Running stage" not in run(sys.executable, "-m", "dvc", "repro").stdout  # nothing stale
