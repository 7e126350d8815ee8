"""The workspace a benchmark runs in: a scratch directory with task data and iteration-0
checkpoints, so stages run as they do under ``dvc repro`` without touching the project's runs.

``full``: the project's embedded experiment (params.yaml); its prepared ``data/tasks`` (linked)
and ``runs/it0`` (copied) are used when ``make run`` made them, else prepared here (minutes).
``smoke``: the miniature pool the tests use, prepared here in seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from hacrl.config.schema import Config
from hacrl.pipeline import params

log = logging.getLogger(__name__)

SMOKE = ["experiment=smoke", "agents=tiny", "rollout.prompts_per_iteration=16", "rollout.group_size=4",
         "rollout.max_new_tokens=12", "data.train_size=1000", "data.heldout_size=100", "data.dev_size=40",
         "trainer.mini_batch_prompts=8", "eval.max_new_tokens=12"]


@contextlib.contextmanager
def workspace(size: str, work_dir: Path, project: Path = Path("."), overrides: tuple[str, ...] = ()) -> Iterator[Config]:
    """Enter ``work_dir`` prepared for iteration 1 and yield its config (tracking off)."""
    from hacrl.pipeline import table

    project = project.resolve()
    work_dir = work_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    if size == "smoke":
        cfg = params.from_dict(params.compose([*SMOKE, *overrides]))
    elif overrides or not (project / "params.yaml").exists():
        cfg = params.from_dict(params.compose(list(overrides)))
    else:
        cfg = params.load(project / "params.yaml")
    cfg.tracking.enabled = False
    cfg.experiment.runs_dir = str(work_dir / "runs")
    ready = size != "smoke" and not overrides and (project / "data" / "tasks").is_dir() and \
        (project / "runs" / "it0" / "checkpoints").is_dir()
    if ready:  # the project's prepared state: tasks linked (read only), iteration 0 copied (the
        # evaluate stage writes its history there)
        (work_dir / "data").mkdir(exist_ok=True)
        (work_dir / "runs").mkdir(exist_ok=True)
        if not (work_dir / "data" / "tasks").exists():
            (work_dir / "data" / "tasks").symlink_to(project / "data" / "tasks", target_is_directory=True)
        if not (work_dir / "runs" / "it0").exists():
            shutil.copytree(project / "runs" / "it0", work_dir / "runs" / "it0")
    here = Path.cwd()
    os.chdir(work_dir)
    try:
        if not ready:
            log.info("preparing data and pool for the benchmark (%s)", size)
            table.run("prepare-data", cfg)
            table.run("prepare-pool", cfg)
        yield cfg
    finally:
        os.chdir(here)
