"""How every hacrl process runs: its environment defaults and its torch threads.

Every entry point (the CLI, the warm stage server, the engine host, a rank of a multi-process
update) calls :func:`apply_defaults` before it imports torch or transformers, so all of them run
offline, quietly and with the same BLAS behaviour; a variable the user set is left as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULTS: dict[str, str] = {
    # offline and quiet: nothing in a stage may reach the network
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # a bar per weight load: hundreds of lines per run
    # the BLAS thread count fixed, not adapted to the machine's load: with MKL's dynamic threads
    # a warm-up run beside another busy process on 2 cores rounded differently and ended elsewhere
    "MKL_DYNAMIC": "FALSE",
    "OMP_DYNAMIC": "FALSE",
    "MLFLOW_DISABLE_TELEMETRY": "true",  # nothing leaves the machine
}
"""The environment every hacrl process starts with (where the user set none of it)."""


def apply_defaults() -> None:
    """Set :data:`DEFAULTS` and DeepSpeed's accelerator (``cuda`` where a GPU device node
    exists, else ``cpu``) in this process's environment, keeping what is already set."""
    for k, v in DEFAULTS.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not Path("/dev/nvidia0").exists() else "cuda")


def set_threads(n: int) -> None:
    """torch's intra-op threads for this process (a stage: ``experiment.threads``)."""
    import torch

    torch.set_num_threads(max(1, int(n)))
