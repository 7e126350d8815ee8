"""``hacrl`` command line: compose the config, run one stage (what dvc.yaml calls)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from hacrl.runtime import apply_defaults

apply_defaults()  # before anything imports torch or transformers

log = logging.getLogger("hacrl")


def _setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_config(args: argparse.Namespace) -> int:
    if args.doc:  # the settings reference (docs/CONFIG.md), from the schema
        from hacrl.config.doc import reference

        print(reference())
        return 0
    from hacrl.pipeline.params import compose, keep_extension, write_params

    data = compose(args.overrides)
    out = Path(args.out)
    if (out.resolve().parent / "dvc.yaml").exists():  # the pipeline's own params: dvc.yaml's paths are fixed
        from hacrl.errors import ConfigError

        for key, fixed in (("runs_dir", "runs"), ("reports_dir", "reports")):
            if data["experiment"][key] != fixed:
                raise ConfigError(f"experiment.{key}: invalid value {data['experiment'][key]!r} (dvc.yaml reads and "
                                  f"writes {fixed}/: a pipeline's params.yaml keeps it; another directory is for "
                                  f"in-process runs, `hacrl run --params FILE` or `hacrl compare`)")
    kept = keep_extension(data, args.overrides, out)
    if kept:
        print(f"hacrl: kept experiment.iterations={kept} from {out} (the experiment was extended; "
              f"pass experiment.iterations=N to set it)", file=sys.stderr)
    if args.check:
        from hacrl.errors import ConfigError
        from hacrl.pipeline.params import read_with_vars, vars_path

        try:
            current = read_with_vars(out) if out.exists() else None
        except ConfigError:
            current = None
        if current != data:
            print(f"hacrl: {out} or {vars_path(out).name} differs from the composition of conf/ (run `hacrl config`)",
                  file=sys.stderr)
            return 1
        return 0
    write_params(data, out)
    print(f"wrote {out} ({data['algorithm']['name']}, {len(data['agents'])} agents, "
          f"{data['experiment']['iterations']} iterations)")
    from hacrl.ops.tracking import foreign_store
    from hacrl.pipeline.params import from_dict

    foreign = foreign_store(from_dict(data), Path("."))
    if foreign:
        print(f"hacrl: warning: {foreign}", file=sys.stderr)
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from hacrl.errors import ConfigError
    from hacrl.pipeline import params, table

    cfg = params.load(args.params)
    table.stage(args.name)  # an unknown name: one line listing the stages
    t = args.iteration
    problem = table.iteration_problem(args.name, t, cfg.experiment.iterations)
    if problem:
        raise ConfigError(problem)
    if "DVC_STAGE" in os.environ:  # DVC runs it: DVC holds the workspace
        from hacrl.ops.dvc_busy import keep_lock_copy

        keep_lock_copy(os.environ.get("DVC_ROOT", "."))  # whole now; DVC rewrites it in place when this ends
        return _stage(args, cfg, t)
    from hacrl.ops.dvc_busy import hold_dvc_lock

    with hold_dvc_lock("."):  # by hand: not under a running dvc repro, nor it under this
        return _stage(args, cfg, t)


def clean_debris(cfg) -> int:
    """Remove what a killed stage left under its temporary names where stages write (runs/,
    data/, reports/: the report stage's plots too); return how many."""
    from hacrl.storage import clean_tmp

    return sum(clean_tmp(d) for d in (cfg.experiment.runs_dir, "data", cfg.experiment.reports_dir))


def _stage(args: argparse.Namespace, cfg, t: int) -> int:
    from hacrl.ops import track_queue
    from hacrl.ops.inputs import verify
    from hacrl.pipeline import table

    removed = clean_debris(cfg)
    if removed:
        log.info("removed %d temporary leftovers of an interrupted run", removed)
    from hacrl.ops import progress

    iteration_stages = table.iteration_stages()
    if args.name == iteration_stages[0]:  # an iteration starts: how long the rest should take
        left = progress.eta(cfg.experiment.runs_dir, t, cfg.experiment.iterations, iteration_stages)
        if left:
            log.info("%s", left)
    t0 = time.time()
    log.info("stage %s (iteration %d) started", args.name, t)
    try:
        _injected_fault(args.name, t)
        # the upstream artifacts it reads are what their stages wrote (dvc.lock), before any work
        verify(os.environ.get("DVC_ROOT", "."), os.environ.get("DVC_STAGE") or table.dvc_stage_id(args.name, t))
        from hacrl.pipeline.stage_engines import serve_from_host

        serve_from_host()  # engine processes and verifier workers outlive this stage process
        result = table.run(args.name, cfg, t)
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt):
            track_queue.log_stage(cfg, args.name, t, None, time.time() - t0, error=e, started=t0)
        raise
    wall = time.time() - t0
    log.info("stage %s (iteration %d) finished in %.1fs", args.name, t, wall)
    progress.record(cfg.experiment.runs_dir, args.name, t, wall)
    track_queue.log_stage(cfg, args.name, t, result, wall, started=t0)
    if args.print_result:
        print(json.dumps(result, indent=2, default=str))
    return 0


class InjectedFault(RuntimeError):
    """Raised on purpose (``HACRL_FAULT=raise:STAGE@itT``) to test failure handling."""


def _injected_fault(stage: str, t: int) -> None:
    spec = os.environ.get("HACRL_FAULT", "")
    if spec == f"raise:{stage}@it{t}":
        raise InjectedFault(f"injected fault in {stage}@it{t} (HACRL_FAULT={spec})")


def cmd_input_stamp(args: argparse.Namespace) -> int:
    """dvc.yaml's external-input stage: the content hash of one input outside the repository."""
    from hacrl.ops.inputs import stamp

    print(stamp(".", args.key, args.params or os.environ.get("HACRL_PARAMS", "params.yaml")))
    return 0


def cmd_unlock(args: argparse.Namespace) -> int:
    from hacrl.ops.dvc_busy import repair_after_kill

    for line in repair_after_kill(args.project):
        print(f"hacrl: {line}", file=sys.stderr)
    return 0


def cmd_track(args: argparse.Namespace) -> int:
    """Log the stage records still queued for MLflow, after any flusher still at work."""
    from hacrl.ops import track_queue
    from hacrl.pipeline import params

    cfg = params.load(args.params)
    if not cfg.tracking.enabled:
        return 0
    project = Path(".").resolve()
    from hacrl.ops.tracking import foreign_store

    foreign = foreign_store(cfg, project)
    if foreign:  # nothing is logged into another workspace's store; the queue stays
        print(f"hacrl: warning: {foreign}", file=sys.stderr)
        return 0
    if args.retry:
        back = track_queue.requeue(project, cfg.experiment.runs_dir)
        if back:
            print(f"MLflow: {back} refused records queued again")
    n = track_queue.flush(project, cfg.experiment.runs_dir, timeout_s=args.timeout)
    left = track_queue.pending(project, cfg.experiment.runs_dir)
    failed = track_queue.refused(project, cfg.experiment.runs_dir)
    print("MLflow: " + ("every stage record is logged" if not left and not failed else "not every stage record is logged")
          + f" ({n} by this command, the rest as the stages ended)" + (f"; {len(left)} still queued" if left else "")
          + (f"; {len(failed)} refused" if failed else ""))
    if failed:  # the reason in the line, and the way back
        reasons = dict.fromkeys(r for _, r in failed)
        for r in list(reasons)[:3]:
            print(f"hacrl: error: MLflow refused {sum(1 for _, x in failed if x == r)} record(s): {r}", file=sys.stderr)
        print(f"hacrl: fix the store ({cfg.tracking.uri or 'mlflow.db'}), then `hacrl track --retry` logs them "
              f"({cfg.experiment.runs_dir}/.tracking/queue/failed/)", file=sys.stderr)
    return 1 if left or failed else 0


def cmd_algorithms(args: argparse.Namespace) -> int:
    """The presets of conf/algorithm/ and every registered estimator and loss with its options."""
    import dataclasses

    import yaml

    from hacrl.pipeline.params import CONF_DIR
    from hacrl.rl import algorithms

    print("presets (conf/algorithm/, select with algorithm=NAME):")
    for f in sorted((CONF_DIR / "algorithm").glob("*.yaml")):
        d = yaml.safe_load(f.read_text())
        subs = ", ".join(f"{s['record_type']}/{s.get('producers', 'self')}" for s in d.get("subscription", []))
        print(f"  {f.stem:<14} advantage={d['advantage']['name']:<8} loss={d['loss']['name']:<8} subscription: {subs}")
    for title, table in (("advantage estimators (algorithm.advantage)", algorithms.ADVANTAGES),
                         ("losses (algorithm.loss)", algorithms.LOSSES)):
        print(f"{title}:")
        for name, reg in table.items():
            opts = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(reg.options) if f.name != "name")
            level = f" [{reg.level}]" if reg.level else ""
            print(f"  {name}{level}: {opts}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from hacrl.pipeline import params
    from hacrl.pipeline.in_process import run_in_process

    cfg = params.load(args.params)
    from hacrl.ops.dvc_busy import hold_dvc_lock

    with hold_dvc_lock("."):  # it writes what dvc repro tracks: never under a running one
        timings = run_in_process(cfg)
    print(json.dumps({k: round(v, 1) for k, v in timings.items()}, indent=2))
    print(f"wrote {cfg.experiment.runs_dir}/ and {cfg.experiment.reports_dir}/ (the outputs `dvc repro` tracks; "
          f"dvc.lock does not record this run: `dvc commit` adopts it)", file=sys.stderr)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from hacrl.study.compare import rewrite_report, run_suite

    if args.report_only:
        print(f"report: {rewrite_report(args.suite, args.setting, args.reports_dir) / 'README.md'}")
        return 0
    contenders = args.contenders.split(",") if args.contenders else None
    out = run_suite(args.suite, args.seeds, args.overrides, args.work_dir, args.reports_dir, contenders, args.setting,
                    resume=args.resume, dry_run=args.dry_run, tune=args.tune, tune_seeds=args.tune_seeds,
                    warmups=args.warmups, tune_per_agent=args.tune_per_agent, no_gate=args.no_gate)
    print(out if args.dry_run else f"report: {out / 'README.md'}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from hacrl.errors import ConfigError
    from hacrl.study.bench.runner import SIZES, SUITES, run_suite

    if args.suite != "all" and args.suite not in SUITES:
        raise ConfigError(f"bench: unknown suite {args.suite!r} (choose from all, {', '.join(SUITES)})")
    if args.size not in SIZES:
        raise ConfigError(f"bench --size: unknown size {args.size!r} (choose from {', '.join(SIZES)})")
    run_suite(args.suite, args.size, args.reps, Path(args.out))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from hacrl.ops.services import ENV_FILE, ServiceError, serve

    try:
        st = serve(args.project, args.prefect_port, args.mlflow_port, args.gpu_workers, not args.no_mlflow_ui)
    except ServiceError as e:
        print(f"hacrl: error: {e}", file=sys.stderr)
        return 1
    env = Path(args.project).resolve() / ENV_FILE
    print(f"Prefect UI   http://127.0.0.1:{st['prefect_port']}  (deployments hacrl/iterate, hacrl-stage/gpu)")
    if not args.no_mlflow_ui:
        from hacrl.ops.tracking import ui_link

        base = f"http://127.0.0.1:{st['mlflow_port']}"
        ui = ui_link(base)  # the machine-learning view: MLflow 3 may open its GenAI view otherwise
        pfile = Path(args.project).resolve() / "params.yaml"
        if pfile.exists():  # straight to the experiment's training runs
            from hacrl.ops.tracking import runs_url
            from hacrl.pipeline import params

            try:
                cfg = params.load(pfile)
                ui = runs_url(base, cfg, Path(args.project)) if cfg.tracking.enabled else ui
            except Exception as e:  # noqa: BLE001 - the UI is up either way
                log.warning("no experiment page: %s", e)
        print(f"MLflow UI    {ui}")
    import shlex

    venv = Path(sys.executable).parent / "activate"
    print(f"In a new shell:  source {shlex.quote(str(venv))} && source {shlex.quote(str(env))}")
    print("Then:           hacrl iterate      (or: prefect deployment run hacrl/iterate --watch; stop: make stop)")
    return 0


def cmd_iterate(args: argparse.Namespace) -> int:
    """One iterate flow run on the services ``hacrl serve`` started, followed to its end."""
    from hacrl.ops.launch import NoPrefect, launch
    from hacrl.ops.services import client_env

    project = Path(args.project).resolve()
    os.environ.update({k: v for k, v in client_env(project).items() if k.startswith(("PREFECT_", "HACRL_MLFLOW"))})
    try:
        return launch(project, args.iteration, args.force, args.overrides, watch=not args.no_watch)
    except NoPrefect as e:
        print(f"hacrl: error: {e}", file=sys.stderr)
        return 1


def cmd_resources(args: argparse.Namespace) -> int:
    from hacrl.pipeline import params
    from hacrl.resources import plan

    cfg = params.from_dict(params.compose(args.overrides)) if args.overrides else params.load(args.params)
    p = plan(cfg.resources, [a.name for a in cfg.agents])
    print(json.dumps(p.to_dict(), indent=2) if args.json else p.describe())
    return 0


def cmd_agreement(args: argparse.Namespace) -> int:
    from hacrl.errors import ConfigError
    from hacrl.pipeline import params
    from hacrl.study import agreement
    from hacrl.study.compare import measure_agreement

    if args.runs_dir:  # a workspace's pool at any iteration (its data/ in the working directory)
        d = params.compose(args.overrides)
        d["experiment"]["runs_dir"] = args.runs_dir
        cfg = params.from_dict(d)
        res = agreement.measure(cfg, args.iteration, args.prompts, args.samples)
    else:
        if args.iteration != 0:
            raise ConfigError("--iteration: a prepared pool holds iteration 0 only; give --runs-dir for a later one")
        cfg = params.from_dict(params.compose(args.overrides))
        res = measure_agreement(list(args.overrides), Path(args.work_dir).resolve(), args.prompts, args.samples)
    out = Path(args.out or Path(args.work_dir) / f"agreement-it{args.iteration}")
    files = agreement.write(res, out)
    print(agreement.table(res))
    run = agreement.log_to_mlflow(cfg, res, files, Path.cwd())
    print(f"\nwrote {', '.join(str(f) for f in files)}" + (f"; MLflow run {run}" if run else ""))
    return 0


def cmd_sharing(args: argparse.Namespace) -> int:
    from hacrl.study.sharing import sharing_report, write_sharing_report

    if args.out:
        print(f"wrote {write_sharing_report(args.runs_dir, args.out, args.title)}")
    else:
        print(sharing_report(args.runs_dir, args.title))
    return 0


def _servers(n: int) -> list[str]:
    return [] if not n else ["stage server" if n == 1 else "stage servers"]


def cmd_stop(args: argparse.Namespace) -> int:
    from hacrl.ops import stage_server
    from hacrl.ops.services import stop
    from hacrl.rollout import engine_host

    stopped = (stop(args.project) + (["engine host"] if engine_host.stop(args.project) else [])
               + _servers(stage_server.stop_checkout(args.project)))
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and "stage" in sys.argv[1:3]:
        # a stage started as a process (by dvc repro, Prefect, a shell): fork it from the warm
        # stage server when there is one (hacrl.ops.stage_server); otherwise run it here, cold
        from hacrl.ops import stage_server

        if stage_server.enabled():
            rc = stage_server.run_remote(sys.argv[1:], entry="hacrl.cli:main")
            if rc is not None:
                return rc
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # bare `hacrl`: what it can do, not an error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    _setup_logging(args.log_level.upper())

    from hacrl.errors import ConfigError, DataError, NonFiniteLossError, StorageFull, UnsafeStateError
    from hacrl.storage import out_of_space

    try:
        return args.fn(args)
    except (ConfigError, DataError, FileNotFoundError, UnsafeStateError) as e:
        print(f"hacrl: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:
        print(f"hacrl: error: {e}; no checkpoint was written", file=sys.stderr)
        return 3
    except (StorageFull, OSError, RuntimeError) as e:
        if not (isinstance(e, StorageFull) or out_of_space(e)):
            raise
        # out of space: one line, and an exit code the orchestrator does not retry into the same disk
        print(f"hacrl: error: {e.strerror if isinstance(e, StorageFull) else e}", file=sys.stderr)
        return 4


DESCRIPTION = """Post-train a pool of heterogeneous LLMs together with RL on verifiable rewards.

Typical use: `make run` (the embedded experiment through dvc repro), `make serve` then
`hacrl iterate` (one iteration as a Prefect flow run), `hacrl config KEY=VALUE...` (change the
experiment), `hacrl compare --suite hacpo` (compare algorithms). `hacrl COMMAND --help` says more."""


class _Sub:
    """``add_subparsers`` whose commands' --help repeats their one-line help as description."""

    def __init__(self, sub):
        self.sub = sub

    def add_parser(self, name: str, **kw):
        kw.setdefault("description", kw.get("help"))
        return self.sub.add_parser(name, **kw)


PARAMS_HELP = "params file (default: $HACRL_PARAMS or params.yaml)"
PROJECT_HELP = "the project's directory (default: the current one)"


def build_parser() -> argparse.ArgumentParser:
    """The ``hacrl`` command line: every command and option with its help text."""
    parser = argparse.ArgumentParser(prog="hacrl", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from hacrl import __version__

    parser.add_argument("--version", action="version", version=f"hacrl {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("HACRL_LOG_LEVEL", "INFO"),
                        help="DEBUG, INFO, WARNING or ERROR (default: $HACRL_LOG_LEVEL or INFO)")
    sub = _Sub(parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND"))
    c = sub.add_parser("config", help="compose conf/ (+ Hydra overrides) into params.yaml")
    c.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. algorithm=gspo rollout.group_size=4")
    c.add_argument("--out", default="params.yaml", help="where to write the composed config (default: params.yaml)")
    c.add_argument("--check", action="store_true", help="only check that --out equals the composition")
    c.add_argument("--doc", action="store_true", help="print every setting (default, type, rule, what it does) "
                                                      "as Markdown: docs/CONFIG.md")
    c.set_defaults(fn=cmd_config)
    from hacrl.pipeline import table  # the stage table: names only, no stage code

    s = sub.add_parser("stage", help="run one pipeline stage (what dvc.yaml calls)",
                       description="Run one pipeline stage for one iteration; dvc.yaml calls this for every stage.")
    s.add_argument("name", metavar="NAME", help="one of: " + ", ".join(table.names()))
    s.add_argument("--iteration", "-t", type=int, default=0, help="the iteration T the stage runs for (default: 0)")
    s.add_argument("--params", default=None, help=PARAMS_HELP)
    s.add_argument("--print-result", action="store_true", help="print the stage's result (JSON) when it ends")
    s.set_defaults(fn=cmd_stage)
    ist = sub.add_parser("input-stamp", help="hash one input from outside the repository (dvc.yaml's "
                                             "external-input stage: task files, real models)")
    ist.add_argument("key", help="the input's config key, e.g. data.train_path")
    ist.add_argument("--params", default=None, help=PARAMS_HELP)
    ist.set_defaults(fn=cmd_input_stamp)
    tr = sub.add_parser("track", help="wait until every finished stage is logged to MLflow "
                                      "(stages queue their records; a background process logs them)")
    tr.add_argument("--params", default=None, help=PARAMS_HELP)
    tr.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a running flusher")
    tr.add_argument("--retry", action="store_true",
                    help="queue the records MLflow refused again (after the store was repaired), then log them")
    tr.set_defaults(fn=cmd_track)
    al = sub.add_parser("algorithms", help="list the algorithm presets, estimators and losses with their options")
    al.set_defaults(fn=cmd_algorithms)
    r = sub.add_parser("run", help="run every stage in one process, without DVC: the same outputs `dvc repro` "
                                   "tracks (runs/, reports/), not recorded in dvc.lock (sweeps, timing)")
    r.add_argument("--params", default=None, help=PARAMS_HELP)
    r.set_defaults(fn=cmd_run)
    cp = sub.add_parser("compare", help="run a comparison suite (e.g. hacpo) and write reports/<suite>/")
    cp.add_argument("--suite", default="hacpo", help="hacpo or mutual (default: hacpo)")
    cp.add_argument("--setting", default="default",
                    help="the suite's setting (hacpo: default, shared_tok, worked; mutual: default, worked); "
                         "reports/<suite>/<setting>/")
    cp.add_argument("--seeds", type=int, default=3, help="reported seeds 0..SEEDS-1 per contender (default: 3)")
    cp.add_argument("--contenders", default=None, help="comma-separated subset (default: the whole suite)")
    cp.add_argument("--work-dir", default="compare", help="scratch directory (pool, per-run state)")
    cp.add_argument("--reports-dir", default="reports", help="where reports/<suite>/<setting>/ goes")
    cp.add_argument("--resume", action="store_true",
                    help="reuse runs an interrupted suite finished (same overrides; the code is assumed unchanged)")
    cp.add_argument("--dry-run", action="store_true", help="validate every contender's config and print the plan")
    cp.add_argument("--report-only", action="store_true",
                    help="write the setting's report again from its results.json (new tables or claims), run nothing")
    cp.add_argument("--tune", action="append", default=None, metavar="KEY=V1,V2",
                    help="choose this setting per contender on the dev split first (repeat for a grid), "
                         "e.g. --tune trainer.lr=1e-4,3e-4,5e-4")
    cp.add_argument("--tune-seeds", type=int, default=2, help="seeds of the dev sweep (1000, 1001, ...)")
    cp.add_argument("--tune-per-agent", action="store_true",
                    help="each agent takes the swept value of its own best dev accuracy, as its own setting "
                         "(agents.<name>.trainer.*; e.g. one lr per model)")
    cp.add_argument("--no-gate", action="store_true",
                    help="run a setting whose pool fails its agreement gate anyway (the report's first line says so)")
    cp.add_argument("--warmups", type=int, default=1,
                    help="warm-up pools: seed s starts from pool s mod WARMUPS (pool w > 0: experiment.pool_seed=w)")
    cp.add_argument("overrides", nargs="*", help="Hydra overrides applied to every contender")
    cp.set_defaults(fn=cmd_compare)
    b = sub.add_parser("bench", help="benchmark a stage against what users would run instead; "
                                     "writes reports/bench/SUITE.json and .md")
    from hacrl.study.bench.runner import SUITES

    b.add_argument("suite", help=f"all (every suite, in this order), {', '.join(SUITES)}")
    b.add_argument("--size", default="full", help="full (minutes per suite) or smoke (seconds, for CI)")
    b.add_argument("--reps", type=int, default=None, help="measured rounds after the warm-up (default: per suite)")
    b.add_argument("--out", default="reports/bench", help="where SUITE.json and SUITE.md go (default: reports/bench)")
    b.set_defaults(fn=cmd_bench)
    sv = sub.add_parser("serve", help="start Prefect (server, pools, deployments, workers) and the MLflow UI")
    sv.add_argument("--project", default=".", help=PROJECT_HELP)
    sv.add_argument("--prefect-port", type=int, default=int(os.environ.get("PREFECT_PORT", 4200)),
                    help="0 picks a free port")
    sv.add_argument("--mlflow-port", type=int, default=int(os.environ.get("MLFLOW_PORT", 5000)),
                    help="the MLflow UI's port (default: $MLFLOW_PORT or 5000)")
    sv.add_argument("--gpu-workers", type=int, default=None, help="workers on the gpu pool (default: 1 if GPUs)")
    sv.add_argument("--no-mlflow-ui", action="store_true", help="start Prefect only")
    sv.set_defaults(fn=cmd_serve)
    it = sub.add_parser("iterate", help="run the next RL iteration as a Prefect flow run named iterate-itT "
                                         "(after `make serve`) and follow its stages")
    it.add_argument("--project", default=".", help=PROJECT_HELP)
    it.add_argument("--iteration", type=int, default=None, help="default: the first one not done, or the next new one")
    it.add_argument("--force", action="store_true", help="re-run the iteration's stages even if up to date")
    it.add_argument("--no-watch", action="store_true", help="create the flow run and return")
    it.add_argument("overrides", nargs="*", help="Hydra overrides; params.yaml is recomposed with them first")
    it.set_defaults(fn=cmd_iterate)
    rs = sub.add_parser("resources", help="print the MWRA plan: which devices each agent's rollout and "
                                          "update use, and what runs at the same time")
    rs.add_argument("overrides", nargs="*", help="Hydra overrides (default: read --params)")
    rs.add_argument("--params", default=None, help=PARAMS_HELP)
    rs.add_argument("--json", action="store_true", help="print the plan as JSON")
    rs.set_defaults(fn=cmd_resources)
    ag = sub.add_parser("agreement", help="how far the pool's agents agree on each other's text, before training: "
                                          "cross ratios, per-token gap, the share inside each sharing window")
    ag.add_argument("--iteration", type=int, default=0, help="the pool's checkpoints at this iteration (default 0)")
    ag.add_argument("--prompts", type=int, default=32, help="dev prompts (never held-out; default 32)")
    ag.add_argument("--samples", type=int, default=None, help="samples per prompt and agent (default: the config's G)")
    ag.add_argument("--runs-dir", default=None,
                    help="an experiment's runs directory to read the pool from (default: prepare it in --work-dir)")
    ag.add_argument("--work-dir", default="agreement", help="where the pool is prepared (once) and the figures go")
    ag.add_argument("--out", default=None, help="where agreement.json, .md and the histograms go")
    ag.add_argument("overrides", nargs="*", help="Hydra overrides (e.g. agents=pretrained_pair experiment=pretrained_pair)")
    ag.set_defaults(fn=cmd_agreement)
    sh = sub.add_parser("sharing", help="how well a run's agents share: THL residuals and cross ratios per pair, "
                                         "held-out accuracy per iteration (Markdown)")
    sh.add_argument("--runs-dir", default="runs", help="the run's runs/ directory (default: runs)")
    sh.add_argument("--title", default="", help="the report's title")
    sh.add_argument("--out", help="write the Markdown here (default: print it)")
    sh.set_defaults(fn=cmd_sharing)
    ul = sub.add_parser("unlock", help="repair what a dvc killed while writing left unreadable: its read/write "
                                       "lock (removed) and dvc.lock (restored from the copy the last stage kept); "
                                       "`make run` does it before `dvc repro`; a live dvc is left alone")
    ul.add_argument("--project", default=".", help=PROJECT_HELP)
    ul.set_defaults(fn=cmd_unlock)
    st = sub.add_parser("stop", help="stop what `hacrl serve` started")
    st.add_argument("--project", default=".", help=PROJECT_HELP)
    st.set_defaults(fn=cmd_stop)
    return parser


if __name__ == "__main__":
    sys.exit(main())
