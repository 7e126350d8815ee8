"""``pretrained_iteration``: one iteration of the pretrained pair, the landed code against today's.

The work: iteration 1 of the pretrained suite's setting (``agents=pretrained_pair
experiment=pretrained_pair``, HACPO, ``algorithm.kl_coef=0.001``, ``trainer.lr=3e-5``: SmolLM2-135M
and Gemma-3-270M, 16 prompts x 4 samples x up to 48 tokens each, every learner trained on both
agents' samples, 64 held-out problems evaluated greedily) from one iteration-0 pool, prepared once
and untimed. Every contender runs the whole iteration (generate-rollouts ... evaluate, then the
report) in a fresh process through :func:`hacrl.pipeline.in_process.run_in_process`, the path both
revisions share, from a fresh copy of iteration 0 (untimed); MLflow tracking off, the engine host
and stage server off (neither the landed nor today's transformers engine uses them).

Contenders:

- ``landed``: the code of revision ``HACRL_BENCH_BASE_REV`` (default ``5ce48a3``, the commit issue 46
  measured at 629 s here), checked out in a git worktree of this repository and imported from it
  (same virtual environment), composing its own ``params.yaml`` from its own ``conf/``;
- ``defaults``: today's code, the same settings (``algorithm.kl_clamp=null``: the landed code has
  no clamp). Its rollouts, checkpoints and held-out accuracies must equal ``landed``'s bit for bit;
  the table's notes say whether they do;
- ``fast``: today's code with the options that buy time (:data:`FAST`): no gradient
  checkpointing (the budget of this pool does not need it), the engine's log-probs as pi_old
  (the transformers engine scores with the trainer's forward), each prompt prefilled once in
  the update, tokens drawn by inverse CDF instead of ``torch.multinomial``. The same prompts,
  samples and token budgets; other samples of the same distributions (the sampler), so its
  figures differ as another seed's would.

Goal: ``fast`` takes <= 0.5x ``landed``'s time (a ratio of throughputs >= 2.0). Units: iterations,
so compare the seconds. ``smoke``: the tiny pool of the tests and two prompts, seconds per round;
it checks the machinery, its figures mean nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hacrl.study.bench.core import Contender, Goal, SuiteResult, compare
from hacrl.study.bench.workspace import SMOKE

log = logging.getLogger(__name__)
DEFAULT_REPS = 1
BASE_REV = os.environ.get("HACRL_BENCH_BASE_REV", "5ce48a3")

SETTING = {
    "full": ["agents=pretrained_pair", "experiment=pretrained_pair", "algorithm=hacpo", "algorithm.kl_coef=0.001",
             "trainer.lr=3e-5"],
    "smoke": [*SMOKE, "experiment.iterations=1", "algorithm=hacpo", "algorithm.kl_coef=0.001", "rollout.prompts_per_iteration=8",
              "data.heldout_size=16"],
}
FAST = ["trainer.gradient_checkpointing=false", "trainer.recompute_old_logprobs=false",
        "trainer.share_prompt_prefix=true", "rollout.sampler=inverse_cdf"]
"""What ``fast`` adds to today's defaults."""

_ITERATE = """
import json, sys, time
import hacrl.cli  # the process defaults (threads, warnings) each revision's CLI sets
from hacrl.pipeline import params
from hacrl.pipeline.in_process import run_in_process
cfg = params.load("params.yaml")
print("TIMINGS " + json.dumps(run_in_process(cfg, 1, prepare=False)))
"""


def _env(src: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HACRL_") and k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(src), HACRL_ENGINE_HOST="0", HACRL_STAGE_SERVER="0", HACRL_LOG_LEVEL="WARNING")
    return env


def _run(args: list[str], cwd: Path, src: Path) -> str:
    p = subprocess.run(args, cwd=cwd, env=_env(src), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])} failed ({p.returncode}) in {cwd}:\n{(p.stdout + p.stderr)[-3000:]}")
    return p.stdout


def _worktree(project: Path, rev: str, dest: Path) -> Path:
    """A checkout of ``rev`` at ``dest`` (its ``src/`` is what ``landed`` imports)."""
    p = subprocess.run(["git", "-C", str(project), "worktree", "add", "--detach", "-f", str(dest), rev],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"bench pretrained_iteration: cannot check out revision {rev!r} "
                           f"(HACRL_BENCH_BASE_REV; a full clone has it): {p.stderr.strip()[-500:]}")
    return dest


def _md5_of(paths: list[Path]) -> str:
    h = hashlib.md5()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(hashlib.md5(p.read_bytes()).digest())
    return h.hexdigest()[:12]


def digests(runs: Path, t: int = 1) -> dict:
    """What the iteration produced, in a few comparable figures: the rollouts' and checkpoints'
    content hashes, the held-out accuracies."""
    it = runs / f"it{t}"
    hist = json.loads((it / "history.json").read_text())["iterations"][-1]["agents"]
    import pyarrow.parquet as pq

    shards = list((it / "rollouts").glob("*.parquet"))
    tokens = sum(sum(len(r) for r in pq.read_table(f, columns=["response_token_ids"]).column(0).to_pylist())
                 for f in shards)
    return {"rollouts_md5": _md5_of(shards), "response_tokens": tokens,
            "weights_md5": _md5_of(list((it / "checkpoints").glob("*/model.safetensors"))),
            "heldout_accuracy": {k: v["eval_accuracy"] for k, v in sorted(hist.items())}}


def _prepare(size: str, ws: Path, project: Path) -> None:
    """Data, pool and iteration-0 evaluation with today's code, in ``ws`` (untimed, once)."""
    ws.mkdir(parents=True)
    models = project / "models"
    if size == "full" and models.is_dir():  # the project's converted models: no second fetch
        (ws / "models").symlink_to(models.resolve(), target_is_directory=True)
    src = Path(__file__).resolve().parents[3]
    _run([sys.executable, "-m", "hacrl.cli", "config", *SETTING[size], "tracking.enabled=false"], ws, src)
    _run([sys.executable, "-c", "import hacrl.cli\nfrom hacrl.pipeline import params\n"
          "from hacrl.pipeline.in_process import prepare_experiment\n"
          "prepare_experiment(params.load('params.yaml'))"], ws, src)


def run(size: str, reps: int, work_dir: Path, project: Path = Path(".")) -> SuiteResult:
    project = project.resolve()
    prep = work_dir / "prepared"
    log.info("preparing the pool and iteration 0 (untimed)")
    _prepare(size, prep, project)
    today = Path(__file__).resolve().parents[3]
    base = _worktree(project, BASE_REV, work_dir / "landed_code")
    rev = subprocess.run(["git", "-C", str(base), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    plans = {"landed": (base / "src", SETTING[size]),
             "defaults": (today, [*SETTING[size], "algorithm.kl_clamp=null"]),
             "fast": (today, [*SETTING[size], "algorithm.kl_clamp=null", *FAST])}
    out: dict[str, dict] = {}

    def make(name: str) -> Contender:
        src, overrides = plans[name]
        ws = work_dir / name

        def setup() -> None:
            shutil.rmtree(ws, ignore_errors=True)
            ws.mkdir()
            for item in ("data", "models"):
                if (prep / item).exists():
                    (ws / item).symlink_to((prep / item).resolve(), target_is_directory=True)
            shutil.copytree(prep / "runs" / "it0", ws / "runs" / "it0")
            _run([sys.executable, "-m", "hacrl.cli", "config", *overrides, "tracking.enabled=false"], ws, src)

        def fn(_: None) -> dict:
            text = _run([sys.executable, "-c", _ITERATE], ws, src)
            timings = json.loads(text.rsplit("TIMINGS ", 1)[1].splitlines()[0])
            out[name] = digests(ws / "runs")
            shutil.rmtree(ws / "runs")  # 7-8 GB an iteration here (checkpoints, AdamW moments)
            return {"units": 1, "per_stage_s": {k: round(v, 1) for k, v in timings.items()}, **out[name]}

        code = f"revision {rev}" if name == "landed" else "today's code"
        extra = [o for o in overrides if o not in SETTING[size]]
        return Contender(name, fn, f"{code}{', ' + ' '.join(extra) if extra else ''}", setup=setup)

    try:
        measured = compare([make("landed"), make("defaults"), make("fast")], reps, warmup=False)
    finally:
        subprocess.run(["git", "-C", str(project), "worktree", "remove", "--force", str(base)], capture_output=True)
    same = out["landed"] == out["defaults"]
    notes = ["units are iterations (1 per round): compare the seconds, not the rates; no warm-up round "
             "(each round is a fresh process)",
             f"defaults equal landed (rollouts, checkpoints, held-out accuracies): {'yes' if same else 'NO'}",
             "fast samples other tokens of the same distributions (rollout.sampler=inverse_cdf): its "
             "response tokens, accuracies and weights differ as another seed's would"]
    work = {"setting": " ".join(SETTING[size]), "iteration": 1, "base_revision": rev,
            "fast_options": " ".join(FAST), "defaults_equal_landed": same}
    return SuiteResult("pretrained_iteration", "iterations", work, measured,
                       [Goal("fast", "landed", 2.0), Goal("defaults", "landed", 1.0)], notes, baseline="landed")
