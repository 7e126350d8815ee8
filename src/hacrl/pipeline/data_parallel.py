"""A learner's update as several processes (DeepSpeed data parallelism), started by the stage.

``update-policies`` calls :func:`launch` for each learner when ``trainer.world_size`` > 1. It
starts ``world_size`` ranks of ``python -m hacrl.pipeline.data_parallel`` on this host. Each rank runs
the same :func:`hacrl.pipeline.learner_step.update_agent` on its share of every mini-batch (whole prompt
groups, :func:`hacrl.rl.step.rank_rows`).

- **Rendezvous:** the ranks meet through a file in the stage's scratch directory, so no store
  listens on a port, and gloo is bound to the loopback interface.
- **Writing:** rank 0 writes the HF checkpoint and the figures; every rank writes its share of
  the ZeRO recovery state.
- **Failure:** if any rank fails, the others are killed. The stage then fails with that rank's
  last lines and its exit code (3 for a non-finite loss). Its temporary outputs are never
  renamed into place.

On a GPU host each rank is given one device (``LOCAL_RANK``); the DeepSpeed launcher or torchrun
can start the same ranks across nodes (docs/SCALING.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hacrl.config.schema import Config
from hacrl.errors import NonFiniteLossError
from hacrl.pipeline.params import from_dict
from hacrl.runtime import apply_defaults

log = logging.getLogger(__name__)

STATS_FILE = "update_stats.rank0.json"


class WorkerFailed(RuntimeError):
    """A rank of a multi-process update failed."""


def _config_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def launch(cfg: Config, t: int, name: str, ckpt_out: Path, state_out: Path, timeout_s: float | None = None,
           env: dict[str, str] | None = None) -> dict:
    """Run learner ``name``'s update of iteration ``t`` as ``cfg.trainer.world_size`` processes;
    return rank 0's figures. ``ckpt_out`` / ``state_out``: the (temporary) output directories;
    ``env``: added to every rank's environment (the job's ``CUDA_VISIBLE_DEVICES``)."""
    ws = cfg.trainer.world_size
    ckpt_out.mkdir(parents=True, exist_ok=True)
    state_out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hacrl-dp-", dir=state_out.parent) as scratch:
        scratch = Path(scratch)
        (scratch / "config.json").write_text(json.dumps(_config_dict(cfg)))
        threads = max(1, cfg.experiment.threads // ws)  # the ranks share the host's cores
        procs, logs = [], []
        for rank in range(ws):
            rank_env = dict(os.environ, **(env or {}), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ws),
                       HACRL_DIST_INIT=f"file://{scratch / 'rendezvous'}", GLOO_SOCKET_IFNAME="lo",
                       OMP_NUM_THREADS=str(threads), HACRL_THREADS=str(threads))
            out = open(scratch / f"rank{rank}.log", "w+")
            logs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "hacrl.pipeline.data_parallel", str(scratch / "config.json"), "--iteration", str(t),
                 "--agent", name, "--ckpt-out", str(ckpt_out), "--state-out", str(state_out),
                 "--stats-out", str(scratch / STATS_FILE)],
                env=rank_env, stdout=out, stderr=subprocess.STDOUT))
        t0 = time.time()
        failed = None
        try:
            while any(p.poll() is None for p in procs):
                bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if bad:
                    failed = bad[0]
                    break
                if timeout_s is not None and time.time() - t0 > timeout_s:
                    failed = -1
                    break
                time.sleep(0.2)
            else:
                bad = [r for r, p in enumerate(procs) if p.returncode != 0]
                failed = bad[0] if bad else None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        tails = []
        for f in logs:
            f.seek(0)
            tails.append(f.read()[-3000:])
            f.close()
        if failed is not None:
            if failed == -1:
                raise WorkerFailed(f"update of {name}: the {ws} ranks did not finish in {timeout_s:.0f}s")
            code = procs[failed].returncode
            tail = tails[failed].strip().splitlines()[-12:]
            msg = f"update of {name}: rank {failed} of {ws} exited with {code}:\n" + "\n".join(tail)
            if code == 3:
                raise NonFiniteLossError(msg)
            raise WorkerFailed(msg)
        stats = json.loads((scratch / STATS_FILE).read_text())
        stats["world_size"] = ws
        return stats


def main(argv: list[str] | None = None) -> int:
    """One rank: ``python -m hacrl.pipeline.data_parallel CONFIG_JSON --iteration T --agent NAME ...``."""
    ap = argparse.ArgumentParser(prog="hacrl.pipeline.data_parallel")
    ap.add_argument("config")
    ap.add_argument("--iteration", type=int, required=True)
    ap.add_argument("--agent", required=True)
    ap.add_argument("--ckpt-out", required=True)
    ap.add_argument("--state-out", required=True)
    ap.add_argument("--stats-out", required=True)
    args = ap.parse_args(argv)
    apply_defaults()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank{os.environ.get('RANK', '?')} %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from hacrl.pipeline.learner_step import update_agent
    from hacrl.rl.trainer import init_distributed, world
    from hacrl.runtime import set_threads
    from hacrl.storage import write_json

    set_threads(int(os.environ.get("HACRL_THREADS", "1")))
    cfg = from_dict(json.loads(Path(args.config).read_text()))
    init_distributed()
    try:
        stats = update_agent(cfg, args.iteration, args.agent, Path(args.ckpt_out), Path(args.state_out))
    except NonFiniteLossError as e:
        print(f"hacrl: error: {e}", file=sys.stderr)
        return 3
    if world()[0] == 0:
        write_json(Path(args.stats_out), stats)
    import torch.distributed as dist

    dist.barrier()  # rank 0's files are complete before any rank reports success
    # an explicit teardown: gloo's threads left to the interpreter's exit can abort a finished
    # rank ("terminate called without an active exception", exit -6; seen here once)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
