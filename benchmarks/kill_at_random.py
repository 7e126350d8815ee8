"""kill -9 at random moments of a `dvc repro` that extends an experiment, then resume: are the
outputs those of an uninterrupted run?

Two copies of one prepared workspace (the miniature config of the tests, iteration 1 done) extend
the experiment to ``--iterations``: the reference without interruption, the other killed
(SIGKILL to the whole process group: DVC, the stage, the stage server's fork, the verifier's
workers) ``--kills`` times, each run living a uniform draw between 1 s and 1 s + twice the reference's
duration over the number of kills (so the kills spread over the whole extension), each time
resumed by the next `dvc repro`, and finally run to the end. Then every output hash of the two
``dvc.lock`` files is compared, and the killed copy must hold no temporary debris and be up to
date. Prints one line per kill (the stage it interrupted) and the verdict; exit 1 on any
difference.

    python benchmarks/kill_at_random.py --kills 12 --seed 0 --work /tmp/kills
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from hacrl.study.bench.pipeline import scratch_workspace
from hacrl.study.bench.workspace import SMOKE

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["HACRL_LOG_LEVEL"] = "WARNING"
    return env


def _run(args: list[str], cwd: Path) -> str:
    p = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{args} failed in {cwd} ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p.stdout


def _config(ws: Path, *extra: str) -> None:
    _run([sys.executable, "-m", "hacrl.cli", "config", *SMOKE, *extra], ws)


def _outs(ws: Path) -> dict[tuple[str, str], str]:
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    return {(st, o["path"]): o["md5"] for st, body in lock.items() for o in body.get("outs", [])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=8, help="extend the experiment from 1 to this many")
    ap.add_argument("--work", type=Path, required=True, help="an empty or missing directory")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = args.work.resolve()
    if work.exists():
        shutil.rmtree(work)
    base = work / "base"
    scratch_workspace("smoke", base, ROOT)  # the benchmarks' miniature workspace, iteration 0 done
    _config(base, "experiment.iterations=1")
    _run(["dvc", "repro"], base)
    _run([sys.executable, "-m", "hacrl.cli", "track"], base)  # MLflow's store at rest before it is copied
    ref, killed = work / "reference", work / "killed"
    for dest in (ref, killed):
        shutil.copytree(base, dest, symlinks=True, ignore=shutil.ignore_patterns("*-journal", "*.sock"))

    _config(ref, f"experiment.iterations={args.iterations}")
    t0 = time.time()
    _run(["dvc", "repro"], ref)
    duration = time.time() - t0
    print(f"reference: iterations 2-{args.iterations} in {duration:.0f} s, uninterrupted")

    _config(killed, f"experiment.iterations={args.iterations}")
    for k in range(args.kills):
        # what `make run` does before `dvc repro`: a dvc killed while writing its rwlock leaves it unreadable
        unlocked = subprocess.run([sys.executable, "-m", "hacrl.cli", "unlock"], cwd=killed, env=_env(),
                                  capture_output=True, text=True).stderr.strip()
        if unlocked:
            print(f"  before run {k + 1}: {unlocked}")
        # each run lives a uniform draw whose mean spreads the kills over the whole extension
        at = rng.uniform(1.0, 1.0 + 2 * duration / args.kills)
        proc = subprocess.Popen(["dvc", "repro"], cwd=killed, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            proc.wait(timeout=at)
            out = proc.stdout.read()
            print(f"kill {k + 1}: the run ended before {at:.1f} s ({proc.returncode}); nothing left to kill")
            break
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out = proc.stdout.read()
        ran = re.findall(r"Running stage '([^']+)'", out)
        print(f"kill {k + 1}: SIGKILL at {at:.1f} s, in {ran[-1] if ran else '(before any stage)'}")
        time.sleep(0.5)  # a stage forked by the warm stage server watches its client and kills its own group
    t0 = time.time()
    unlocked = subprocess.run([sys.executable, "-m", "hacrl.cli", "unlock"], cwd=killed, env=_env(),
                              capture_output=True, text=True).stderr.strip()
    if unlocked:
        print(f"  before the last run: {unlocked}")
    _run(["dvc", "repro"], killed)
    print(f"resumed to the end in {time.time() - t0:.0f} s")

    a, b = _outs(ref), _outs(killed)
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    debris = [str(p.relative_to(killed)) for p in killed.rglob(".tmp-*")]
    stale = _run(["dvc", "status", "--json"], killed).strip()
    print(f"outputs: {len(a)} in the reference's dvc.lock, {len(b)} in the killed run's; "
          f"{len(a) - len(differ)} identical, {len(differ)} differ {differ[:5]}")
    print(f"temporary debris: {debris or 'none'}; dvc status: {stale}")
    ok = not differ and not debris and stale in ("{}", "")
    print("verdict:", "identical" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
