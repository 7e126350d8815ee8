"""Engines that outlive stages, and checkpoint I/O, measured in one run on this host.

The SmolLM2 pool (``agents=smollm2_mix experiment=smollm2``: SmolLM2-135M-Instruct beside an
embedded qwen2) in scratch git + DVC workspaces, the project's DVC cache links:

1. ``dvc repro`` iteration by iteration with ``rollout=hf`` (iterations 1-3) and with
   ``rollout=vllm`` (iterations 1-4; iteration 1 starts the engine host's workers, 2-4 are the
   steady state): wall seconds per iteration, each stage's own seconds (its log), and what is
   left for DVC and process starts;
2. the bare transformers loop on the same work as each vLLM generate-rollouts stage: the same
   prompts, samples, sampling and checkpoints, ``hacrl bench rollout``'s bare loop in this
   process (load, left-pad, ``generate``, decode; imports not timed);
3. the last vLLM iteration forced, in two interleaved rounds: ``dvc repro`` of its six stages
   (one ``--single-item`` call each, as the flow's tasks do), ``prefect deployment run
   hacrl/iterate --watch`` and ``hacrl iterate`` (``hacrl serve`` started once, not timed), with
   each flow run's own duration from Prefect's API;
4. checkpoint I/O against size: ``save_pretrained`` (safetensors), DVC's hash (md5), and
   ``dvc commit`` into the cache with links and with copies, for the embedded agent,
   SmolLM2-135M (fp32 and bf16) and a 270M-parameter llama (fp32), with per-GB rates.

Writes ``reports/bench/engine_host.json`` and ``.md``. Needs ``make setup-vllm``.
Usage: ``.venv/bin/python benchmarks/engine_host.py [--workdir DIR]``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
ITEMS = ("dvc.yaml", "conf", "src", "flows", "tasks", "prefect.yaml", ".gitignore", ".dvcignore", "pyproject.toml")
POOL = ["agents=smollm2_mix", "experiment=smollm2", "tracking.enabled=false"]
GB = 1024 ** 3


def _env(ws: Path) -> dict:
    from hacrl.ops.services import client_env

    env = client_env(ws, {k: v for k, v in os.environ.items() if not k.startswith("HACRL_")})
    env["HACRL_LOG_LEVEL"] = "INFO"
    return env


def _run(ws: Path, *args: str) -> str:
    p = subprocess.run(list(args), cwd=ws, env=_env(ws), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    return p.stdout + p.stderr


def _dvc(ws: Path, *args: str) -> str:
    return _run(ws, sys.executable, "-m", "dvc", *args)


def workspace(ws: Path, engine: str, iterations: int) -> None:
    ws.mkdir(parents=True)
    for item in ITEMS:
        src = PROJECT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, ws / item, **(
            {"ignore": shutil.ignore_patterns("__pycache__", "*.egg-info")} if src.is_dir() else {}))
    os.symlink(PROJECT / ".venv-vllm", ws / ".venv-vllm")
    os.symlink(PROJECT / "models", ws / "models")  # the converted SmolLM2 (an external input)
    _run(ws, "git", "init", "-q")
    _dvc(ws, "init", "-q")
    shutil.copy(PROJECT / ".dvc" / "config", ws / ".dvc" / "config")
    _run(ws, sys.executable, "-m", "hacrl.cli", "config", *POOL, f"rollout.engine={engine}",
         f"experiment.iterations={iterations}")


STAGE_DONE = re.compile(r"stage (\S+) \(iteration (\d+)\) finished in ([0-9.]+)s")
ROLLOUTS = re.compile(r"rollouts (\S+): (\{.*\})")


def iteration(ws: Path, t: int, force: bool = False) -> dict:
    """``dvc repro evaluate@itT`` (iteration t's stages): wall, each stage's own seconds."""
    from hacrl.pipeline.table import iteration_stages, stage_id

    t0 = time.perf_counter()
    if force:
        out = "".join(_dvc(ws, "repro", "--force", "--single-item", stage_id(s, t)) for s in iteration_stages())
    else:
        out = _dvc(ws, "repro", f"evaluate@it{t}")
    wall = time.perf_counter() - t0
    stages = {m.group(1): float(m.group(3)) for m in STAGE_DONE.finditer(out) if int(m.group(2)) == t}
    rollouts = {}
    for m in ROLLOUTS.finditer(out):
        try:
            rollouts[m.group(1)] = ast.literal_eval(m.group(2))
        except (SyntaxError, ValueError):  # a figure literal_eval cannot read (nan): left out
            pass
    return {"wall_s": round(wall, 1), "stages_s": stages, "in_stages_s": round(sum(stages.values()), 1),
            "outside_stages_s": round(wall - sum(stages.values()), 1), "rollouts": rollouts}


def bare_rollouts(ws: Path, t: int) -> dict:
    """The generate-rollouts stage's work at iteration t as a user would write it with
    transformers (``hacrl bench rollout``'s bare loop: load, left-pad, ``generate``, decode)."""
    from hacrl.pipeline import params
    from hacrl.runtime import set_threads
    from hacrl.study.bench.rollout import bare_generate

    here = Path.cwd()
    os.chdir(ws)
    try:
        cfg = params.load(ws / "params.yaml")
        set_threads(cfg.experiment.threads)
        t0 = time.perf_counter()
        tokens = bare_generate(cfg, t)
        return {"generate_s": round(time.perf_counter() - t0, 2), "tokens": tokens}
    finally:
        os.chdir(here)


FLOW_RUN_TIMES = """
from prefect.client.orchestration import get_client
from prefect.client.schemas.sorting import FlowRunSort
with get_client(sync_client=True) as c:
    fr = c.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
    print(repr({"name": fr.name, "state": fr.state_name,
                "created_to_end_s": (fr.end_time - fr.created).total_seconds(),
                "start_to_end_s": (fr.end_time - fr.start_time).total_seconds()}))
"""


def last_flow_run(ws: Path) -> dict:
    """The newest flow run's name, state and durations, from Prefect's API."""
    return ast.literal_eval(_run(ws, sys.executable, "-c", FLOW_RUN_TIMES).strip().splitlines()[-1])


def prefect_rounds(ws: Path, t: int, rounds: int) -> list[dict]:
    """Iteration t forced, interleaved: ``dvc repro`` (the six stages, as the flow runs them),
    ``prefect deployment run hacrl/iterate --watch`` and ``hacrl iterate`` (the same deployment
    run, followed by polling); for the two Prefect paths also the flow run's own duration
    (created -> completed, from Prefect's API: the CLI's start and its wait for straggler logs
    after the end left out)."""
    from hacrl.ops.services import serve, stop

    serve(ws, 0, 0, gpu_workers=0, mlflow_ui=False)
    out = []
    try:
        for r in range(rounds):
            row = {"dvc_repro_s": iteration(ws, t, force=True)["wall_s"]}
            t0 = time.perf_counter()
            _run(ws, "prefect", "deployment", "run", "hacrl/iterate", "--watch", "--watch-interval", "1",
                 "--param", f"iteration={t}", "--param", "force=true")
            row["prefect_cli_s"] = round(time.perf_counter() - t0, 1)
            row["prefect_cli_flow_run"] = last_flow_run(ws)
            t0 = time.perf_counter()
            _run(ws, sys.executable, "-m", "hacrl.cli", "iterate", "--iteration", str(t), "--force")
            row["hacrl_iterate_s"] = round(time.perf_counter() - t0, 1)
            row["hacrl_iterate_flow_run"] = last_flow_run(ws)
            print("prefect round", r + 1, row, flush=True)
            out.append(row)
        return out
    finally:
        stop(ws)


def checkpoint_io(work: Path) -> list[dict]:
    """Save, hash and cache (link vs copy) per checkpoint size."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from hacrl.hashes import dvc_hash
    from hacrl.storage import atomic_path

    smol = PROJECT / "models" / "SmolLM2-135M-Instruct"
    emb = next((PROJECT / "runs" / "it0" / "checkpoints").iterdir(), None)
    cases = []
    if emb is not None:
        cases.append(("embedded (" + emb.name + ")", lambda: AutoModelForCausalLM.from_pretrained(emb, dtype=torch.float32)))
    cases += [("SmolLM2-135M fp32", lambda: AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32)),
              ("SmolLM2-135M bf16", lambda: AutoModelForCausalLM.from_pretrained(smol, dtype=torch.bfloat16)),
              ("llama-270M fp32", lambda: LlamaForCausalLM(LlamaConfig(
                  vocab_size=49152, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True)))]
    rows = []
    for name, make in cases:
        model = make()
        row = {"checkpoint": name, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
        for mode in ("hardlink", "copy"):
            repo = work / f"io-{mode}"
            shutil.rmtree(repo, ignore_errors=True)
            repo.mkdir(parents=True)
            _run(repo, "git", "init", "-q")
            _dvc(repo, "init", "-q")
            _dvc(repo, "config", "cache.type", "hardlink,copy" if mode == "hardlink" else "copy")
            d = repo / "ckpt"
            t0 = time.perf_counter()
            with atomic_path(d, is_dir=True) as tmp:
                model.save_pretrained(tmp)
            save_s = time.perf_counter() - t0
            size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            os.sync()
            t0 = time.perf_counter()
            dvc_hash(d)
            hash_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            _dvc(repo, "add", "-q", "ckpt")
            add_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            AutoModelForCausalLM.from_pretrained(d)
            load_s = time.perf_counter() - t0
            links = os.stat(next(d.glob("*.safetensors"))).st_nlink
            row.update({"bytes": size, "gb": round(size / GB, 3), "save_s": round(save_s, 2),
                        "md5_s": round(hash_s, 2), "load_s": round(load_s, 2),
                        f"dvc_add_{mode}_s": round(add_s, 2), f"nlink_{mode}": links})
            shutil.rmtree(repo, ignore_errors=True)
        rows.append(row)
        print(row, flush=True)
    return rows


def summary(res: dict) -> str:
    """The goals of the engines issue, as a table of this run's figures."""
    import statistics as st

    smol = "smollm2-135m"
    lines = ["## engine_host", "", ("SmolLM2 pool (`agents=smollm2_mix experiment=smollm2`), 2-core CPU; "
                                     "`benchmarks/engine_host.py`."), "",
             "| figure | values | mean |", "|---|---|---|"]

    def row(name: str, vals: list[float], fmt: str = "{:.1f}") -> None:
        mean = st.mean(vals) if vals else float("nan")
        lines.append(f"| {name} | {' / '.join(fmt.format(v) for v in vals)} | {fmt.format(mean)} |")

    steady = [t for t in res["vllm"] if int(t) > 1]
    ratios = []
    for t in steady:
        r = res["vllm"][t]["rollouts"].get(smol)
        b = res["bare_rollouts"].get(t) or res["bare_rollouts"].get(int(t))
        if r and b:
            ratios.append(r["tokens_per_s"] / (b["tokens"] / b["generate_s"]))
    row("vLLM generate-rollouts stage / bare transformers loop, tok/s (steady iterations)", ratios, "{:.2f}x")
    hf = [v["wall_s"] for v in res["hf"].values()]
    vl = [res["vllm"][t]["wall_s"] for t in steady]
    row("iteration through dvc repro, rollout=hf, s", hf)
    row("iteration through dvc repro, rollout=vllm (steady), s", vl)
    row("outside the stages under dvc repro (DVC, process starts), % of the iteration",
        [100 * v["outside_stages_s"] / v["wall_s"] for v in [*res["hf"].values(), *res["vllm"].values()]])
    rounds = res.get("prefect_rounds", [])
    if rounds:
        row("forced iteration, dvc repro of its six stages, s", [r["dvc_repro_s"] for r in rounds])
        row("the same, prefect deployment run --watch (CLI wall), % over dvc repro",
            [100 * (r["prefect_cli_s"] / r["dvc_repro_s"] - 1) for r in rounds])
        row("the same, that flow run created -> completed, % over dvc repro",
            [100 * (r["prefect_cli_flow_run"]["created_to_end_s"] / r["dvc_repro_s"] - 1) for r in rounds])
        row("the same, hacrl iterate (CLI wall), % over dvc repro",
            [100 * (r["hacrl_iterate_s"] / r["dvc_repro_s"] - 1) for r in rounds])
        row("the same, that flow run created -> completed, % over dvc repro",
            [100 * (r["hacrl_iterate_flow_run"]["created_to_end_s"] / r["dvc_repro_s"] - 1) for r in rounds])
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir")
    ap.add_argument("--skip-prefect", action="store_true", help="keep the last run's Prefect figures")
    ap.add_argument("--skip-io", action="store_true", help="keep the last run's checkpoint I/O figures")
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="hacrl-engines-"))
    t_all = time.time()
    out = PROJECT / "reports" / "bench" / "engine_host.json"
    res: dict = {"host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    if a.skip_io or a.skip_prefect:  # the skipped parts keep their figures of the last full run
        from hacrl.storage import read_json

        last = read_json(out) if out.exists() else {}
        for k in ("checkpoint_io",) * a.skip_io + ("prefect_rounds",) * a.skip_prefect:
            if k in last:
                res[k] = last[k]
    if not a.skip_io:
        res["checkpoint_io"] = checkpoint_io(work)

    hf, vl = work / "hf", work / "vllm"
    workspace(hf, "hf", 3)
    prep0 = time.perf_counter()
    _dvc(hf, "repro", "evaluate-warmup")
    res["prepare_s"] = round(time.perf_counter() - prep0, 1)
    # the vLLM workspace starts from the same prepared iteration 0 (DVC's cache and lock copied)
    shutil.copytree(hf, vl, symlinks=True)
    _run(vl, sys.executable, "-m", "hacrl.cli", "config", *POOL, "rollout.engine=vllm", "experiment.iterations=4")
    res["hf"] = {t: iteration(hf, t) for t in (1, 2, 3)}
    print("hf", json.dumps(res["hf"], default=str)[:2000], flush=True)
    res["vllm"] = {t: iteration(vl, t) for t in (1, 2, 3, 4)}
    print("vllm", json.dumps(res["vllm"], default=str)[:2000], flush=True)
    res["bare_rollouts"] = {t: bare_rollouts(vl, t) for t in (2, 3, 4)}
    print("bare", res["bare_rollouts"], flush=True)
    if not a.skip_prefect:
        res["prefect_rounds"] = prefect_rounds(vl, 4, 2)
    from hacrl.rollout import engine_host

    for ws in (hf, vl):
        engine_host.stop(ws)
    res["wall_s"] = round(time.time() - t_all, 1)
    from hacrl.storage import write_json

    write_json(out, res)
    md = summary(json.loads(json.dumps(res)))
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
