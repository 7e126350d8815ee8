#!/usr/bin/env bash
# One HACPO iteration of the real-model path on a machine with NVIDIA GPUs, in under 5 minutes:
# a pool of three randomly initialised 136M / 155M / 276M-parameter models (conf/agents/
# gpu_check.yaml), rollouts with vLLM where `.venv-vllm` exists (else transformers on the GPU),
# DeepSpeed updates on CUDA (NCCL), every job placed by the MWRA planner on the GPUs it finds.
# Prints seconds, tokens/s and peak GPU memory (all processes, from nvidia-smi) per stage, and
# writes reports/gpu_check.json.
#
#   scripts/gpu_check.sh [--prompts 64] [--group 8] [--tokens 64] [--engine auto|hf|vllm] [--dtype fp32|bf16]
#                        [--update-samples 64] [--update-tokens 1024] [--micro-batch-tokens 16384]
#
# Then one learner's update at realistic lengths (the pool's largest model, --update-samples rows
# of a 64-token prompt and an --update-tokens response, micro-batched within
# --micro-batch-tokens, activations recomputed): its peak GPU memory against what the memory
# model (src/hacrl/rl/memory.py, docs/SCALING.md "Memory") predicts.
#
# Needs the project environment (`make setup`; on a GPU host its torch must be a CUDA build)
# and, for vLLM, `make setup-vllm` with a CUDA vLLM. Nothing is downloaded: the models are built
# from configs and the tokenizers trained here. The run's workspace is a temp directory.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "gpu_check: no project environment at $PY (run make setup)" >&2; exit 2; }
# HACRL_GPU_CHECK_ON_CPU=1 runs the same script on the CPU (tests/project/test_gpu_check.py: the script
# itself is checked where CI runs; its figures mean nothing there)
ON_CPU=${HACRL_GPU_CHECK_ON_CPU:-0}
[ "$ON_CPU" = 1 ] || command -v nvidia-smi >/dev/null || {
  echo "gpu_check: nvidia-smi not found: this is not a GPU host" >&2; exit 2; }
exec "$PY" - "$@" <<'PYEOF'
import argparse, json, os, subprocess, sys, tempfile, threading, time
from pathlib import Path

import torch

ap = argparse.ArgumentParser(prog="gpu_check")
ap.add_argument("--prompts", type=int, default=64)
ap.add_argument("--group", type=int, default=8)
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--engine", default="auto", choices=["auto", "hf", "vllm"])
ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
ap.add_argument("--agents", default="gpu_check", help="the pool (conf/agents/)")
ap.add_argument("--out", default="reports/gpu_check.json")
ap.add_argument("--update-samples", type=int, default=64)
ap.add_argument("--update-tokens", type=int, default=1024)
ap.add_argument("--micro-batch-tokens", type=int, default=16384)
args = ap.parse_args()
on_cpu = os.environ.get("HACRL_GPU_CHECK_ON_CPU") == "1"
if not on_cpu and not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (is the project's torch a CUDA build?)")

project = Path.cwd()
from hacrl.pipeline import params, table  # noqa: E402
from hacrl.resources import plan_for  # noqa: E402
from hacrl.rollout.vllm_engine import vllm_python  # noqa: E402

n = 0 if on_cpu else torch.cuda.device_count()
gib = [round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1) for i in range(n)]
gpu_name = "none (HACRL_GPU_CHECK_ON_CPU)" if on_cpu else torch.cuda.get_device_name(0)
engine = args.engine
if engine == "auto":
    engine = "vllm" if vllm_python(".venv-vllm/bin/python").exists() else "hf"
devices = "[" + ", ".join(f"{{id: 'cuda:{i}', memory_gib: {gib[i]}}}" for i in range(n)) + "]" if n else "[{id: cpu}]"
overrides = [f"agents={args.agents}", "algorithm=hacpo", "experiment.iterations=1", "tracking.enabled=false",
             f"rollout.engine={engine}", f"rollout.prompts_per_iteration={args.prompts}",
             f"rollout.group_size={args.group}", f"rollout.max_new_tokens={args.tokens}",
             f"trainer.mini_batch_prompts={max(1, args.prompts // 2)}", f"trainer.dtype={args.dtype}",
             "trainer.lr=1e-5", "data.train_size=4000", "data.heldout_size=256", "data.dev_size=64",
             f"eval.max_new_tokens={args.tokens}", "eval.batch_size=256", f"experiment.threads={os.cpu_count()}",
             f"resources.devices={devices}"]
work = Path(tempfile.mkdtemp(prefix="hacrl-gpu-check-"))
data = params.compose(overrides)
data["experiment"]["runs_dir"] = str(work / "runs")
data["experiment"]["reports_dir"] = str(work / "reports")
cfg = params.from_dict(data)
os.chdir(work)
print(f"gpu_check: {n} GPU(s) {gpu_name} ({gib} GiB), torch {torch.__version__}, "
      f"engine {engine}, dtype {args.dtype}, workspace {work}")
print(plan_for(cfg).describe())


class PeakMemory:
    """Peak GPU memory used by every process (nvidia-smi, every 0.2 s) while a stage runs."""

    def __enter__(self):
        self.peak, self.stop = 0, threading.Event()
        self.t = threading.Thread(target=self.poll, daemon=True)
        self.t.start()
        return self

    def poll(self):
        while not on_cpu and not self.stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout
            self.peak = max([self.peak] + [int(x) for x in out.split() if x.strip().isdigit()])
            time.sleep(0.2)

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()


rows, t_all = [], time.time()


def stage(name, fn, *a, tokens=None):
    with PeakMemory() as pm:
        t0 = time.time()
        out = fn(*a)
        secs = time.time() - t0
    tok = tokens(out) if tokens and out else None
    rows.append({"stage": name, "seconds": round(secs, 1), "tokens_per_s": round(tok / secs, 1) if tok else None,
                 "peak_gpu_mib": pm.peak})
    print(f"{name:26s} {secs:7.1f} s  {('%.0f tok/s' % (tok / secs)) if tok else '':>12s}  peak GPU {pm.peak} MiB",
          flush=True)
    return out


# every stage of the table in its order: the preparation (iteration 0), then iteration 1
TOKENS = {"generate-rollouts": lambda s: sum(v["tokens"] for v in s.values()),
          "update-policies": lambda s: sum(v.get("tokens_per_s", 0) * v.get("seconds", 0) for v in s.values())}
for name in table.prepare_stages():
    stage(name, table.run, table.of_dvc_stage(name).name, cfg, 0)
out = {name: stage(name, table.run, name, cfg, 1, tokens=TOKENS.get(name)) for name in table.iteration_stages()}
roll, upd = out["generate-rollouts"], out["update-policies"]
wall = time.time() - t_all
print(f"total {wall:.1f} s (goal: under 300 s)")
for a, s in roll.items():
    print(f"  rollouts {a}: {s['tokens']} tokens, {s['generate_tokens_per_s']} tok/s generating"
          + (f", engine start-up {s['engine_startup_s']} s" if "engine_startup_s" in s else "")
          + (f", log-prob gap max {s['logprob_gap_max']:.2e}" if "logprob_gap_max" in s else ""))
for a, s in upd.items():
    print(f"  update {a}: {s['samples']} samples in {s['seconds']} s, world size {s.get('world_size', 1)}, "
          f"loss {s['loss']:.4g}")
# one learner's update at realistic lengths, micro-batched: its peak memory against the model's
import shutil  # noqa: E402

from hacrl.study.bench.memory import cell  # noqa: E402

pool = json.loads((work / "runs" / "it0" / "pool.json").read_text())
big = max(pool, key=lambda a: pool[a]["params"])
model_dir = work / "update-check" / big
shutil.copytree(work / "runs" / "it1" / "checkpoints" / big, model_dir)
conf = json.loads((model_dir / "config.json").read_text())
for key in ("max_position_embeddings", "n_positions"):  # room for the long rows (rotary or learned)
    if key in conf:
        conf[key] = max(conf[key], 64 + args.update_tokens + 8)
(model_dir / "config.json").write_text(json.dumps(conf))
if "n_positions" in conf:  # learned positions: the table is made anew at the longer size (a memory check: values do not matter)
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, ignore_mismatched_sizes=True)
    m.save_pretrained(model_dir)
upd_check = cell({"overrides": overrides, "agent": big, "model_dir": str(model_dir), "samples": args.update_samples,
                  "response": args.update_tokens, "prompt": 64, "micro_batch_tokens": args.micro_batch_tokens,
                  "checkpointing": True, "dtype": args.dtype, "work": str(work / "update-check" / "run"),
                  "threads": os.cpu_count()})
print(f"update at realistic lengths: {big}, {args.update_samples} x (64 + {args.update_tokens}) tokens, "
      f"micro_batch_tokens {args.micro_batch_tokens}, checkpointing, {args.dtype}: {upd_check['seconds']} s, "
      f"{upd_check['micro_batches']} micro-batches; peak GPU {upd_check.get('cuda_peak_mib')} MiB allocated "
      f"({upd_check.get('cuda_reserved_mib')} MiB reserved); the memory model predicts "
      f"{upd_check['predicted_mib']} MiB", flush=True)
out = project / args.out
out.parent.mkdir(parents=True, exist_ok=True)
tmp = out.with_suffix(".tmp")
tmp.write_text(json.dumps({"gpus": n, "gpu": gpu_name, "gpu_gib": gib, "engine": engine,
                           "dtype": args.dtype, "stages": rows, "wall_s": round(wall, 1),
                           "update_check": upd_check,
                           "rollouts": roll, "updates": {a: {k: v for k, v in s.items() if not isinstance(v, (dict, list))}
                                                         for a, s in upd.items()}}, indent=1))
tmp.replace(out)
sys.exit(0 if wall < 300 or on_cpu else 1)
PYEOF
