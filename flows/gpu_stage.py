"""Prefect flow ``hacrl-stage``, deployment ``gpu``: one stage on the ``gpu`` work pool.

``hacrl/iterate`` calls it for ``update-policies`` when a GPU pool has workers; the pool's
concurrency limit (set by ``hacrl serve`` to the number of GPUs) bounds concurrent updates.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
if str(PROJECT) not in sys.path:
    sys.path.insert(0, str(PROJECT))

from prefect import flow  # noqa: E402

from tasks.stages import dvc_stage  # noqa: E402


@flow(name="hacrl-stage", flow_run_name="{stage}")
def run_stage(stage: str, project_dir: str, force: bool = False) -> str:
    """Run one DVC stage (``name@itT``) in ``project_dir`` on this worker."""
    return dvc_stage.with_options(name=stage.split("@")[0], task_run_name=stage)(project_dir, stage, force)
