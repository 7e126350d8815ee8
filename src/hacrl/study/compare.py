"""``hacrl compare``: run contenders on the same pool, prompts and seeds; write a comparison report.

The pool and the task data are prepared once per warm-up pool (``<out>/base``, ``<out>/base_w1``...);
every contender x seed starts from its seed's pool (seed s: pool s mod ``warmups``) and runs its
iterations through the same stage functions as ``dvc repro``
(:func:`hacrl.pipeline.in_process.run_in_process`), in this process (the DVC path costs a process
per stage).

The protocol (docs/ALGORITHMS.md, "Comparing contenders"): the setting declares its primary
contrast and endpoint before anything runs (:mod:`hacrl.study.suites`); with ``tune``, every
contender's settings are chosen by a sweep on the **dev** split with seeds disjoint from the
reported ones (held-out accuracy is read only for the final report); the report
(:mod:`hacrl.study.report`) opens with the primary contrast's t interval and verdict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np

from hacrl.config.schema import AgentTrainerConfig, Config
from hacrl.errors import ConfigError
from hacrl.pipeline import params
from hacrl.pipeline.in_process import prepare_experiment, run_in_process
from hacrl.hashes import file_md5
from hacrl.storage import MANIFEST, RunLayout, read_json, write_json
from hacrl.study.report import write_index, write_report
from hacrl.study.runstore import STORE_DIR, load_results, store_file, store_run, stored_run
from hacrl.study.suites import SUITES
from hacrl.task import data as task_data

log = logging.getLogger(__name__)

# the per-update figures kept from each run (the rest of update_stats stays in the run's MLflow)
TRAIN_KEYS = ("cross_objective_share", "cross_gradient_share", "cross_ratio_mean", "cross_clipped_below", "cross_clipped_above",
              "kl_to_init", "kl_init_before_step", "update_to_weight", "entropy", "updates", "reward_mean", "peer_ratio_mean",
              "peer_clip_frac", "rescues", "trigger_rate", "own_all_wrong_prompts")
# per-iteration figures of the evaluation kept from each run (SGT: did the rescues stick)
EVAL_KEYS = ("rescued_now_accuracy", "rescued_now_n", "rescued_before_accuracy", "rescued_before_n")
TUNE_SEED0 = 1000
"""Tuning runs use seeds 1000, 1001, ...: disjoint from the reported seeds 0..S-1."""


def _cfg(overrides: list[str], runs_dir: Path, reports_dir: Path) -> Config:
    data = params.compose(overrides)
    data["experiment"]["runs_dir"] = str(runs_dir)
    data["experiment"]["reports_dir"] = str(reports_dir)
    return params.from_dict(data)


def check_splits(cfg: Config) -> None:
    """Draw a procedural task's three splits as prepare-data will (milliseconds), so a split the
    problem space cannot fill fails before any run, not at the first run's prepare-data hours into
    a suite. Raises :class:`hacrl.errors.DataError`."""
    d = cfg.data
    if d.source != "procedural":
        return  # file splits are checked when prepare-data reads them (their size is the file's)
    for split, size in (("train", d.train_size), ("dev", d.dev_size), ("heldout", d.heldout_size)):
        task_data.generate_split(split, size, d.levels, d.max_operand, d.heldout_fraction, cfg.experiment.seed)


def base_dir(out: Path, warmup: int) -> Path:
    """Where warm-up pool ``warmup`` is prepared (pool 0: ``base``, as before warm-ups varied)."""
    return out / ("base" if warmup == 0 else f"base_w{warmup}")


def pool_overrides(warmup: int) -> list[str]:
    """Pool 0 is the composed pool; pool w > 0 draws its initial weights and warm-up with seed w."""
    return [] if warmup == 0 else [f"experiment.pool_seed={warmup}"]


def prepare_base(base_overrides: list[str], out: Path, warmup: int = 0) -> Config:
    """Task data, pool and the iteration-0 evaluation of one warm-up pool, once; reused while the
    config is the same."""
    base = base_dir(out, warmup)
    cfg = _cfg(base_overrides + pool_overrides(warmup), base / "runs", base / "reports")
    key = json.dumps({"data": dataclasses.asdict(cfg.data), "agents": [dataclasses.asdict(a) for a in cfg.agents],
                      "seed": cfg.experiment.seed, "pool_seed": cfg.experiment.pool_seed,
                      "eval": dataclasses.asdict(cfg.eval)}, sort_keys=True)
    stamp = base / "prepared.json"
    prepared = read_json(stamp) if stamp.exists() else {}
    if prepared.get("key") == key and "pool" in prepared:
        log.info("reusing the prepared pool in %s", base)
        return cfg
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    with contextlib.chdir(base):
        t0 = time.time()
        prepare_experiment(cfg)
    write_json(stamp, {"key": key, "seconds": round(time.time() - t0, 1), "pool": pool_fingerprint(base)})
    return cfg


def measure_agreement(overrides: list[str], out: Path, prompts: int = 32, samples: int | None = None,
                      warmup: int = 0) -> dict:
    """The agreement (:mod:`hacrl.study.agreement`) of warm-up pool ``warmup`` at iteration 0 under
    ``overrides``, the pool prepared first (once, as the suite's runs start from it)."""
    from hacrl.study import agreement

    prepare_base(overrides, out, warmup)
    base = base_dir(out, warmup)
    cfg = _cfg(overrides + pool_overrides(warmup), base / "runs", base / "reports")
    with contextlib.chdir(base):  # the task data of the pool
        return agreement.measure(cfg, 0, prompts, samples)


def check_gate(st: dict, own: list[str], out: Path, suite: str, setting: str, no_gate: bool) -> dict | None:
    """What a setting's primary contrast needs of the pool (``gate``: at least ``min_share`` of
    the cross samples inside ``window`` on every edge it names; None: it needs nothing), measured
    on warm-up pool 0 with the primary's better contender's config before any run. Returns the
    measurement and verdict; a pool that fails stops here in one line with the figures, unless
    ``no_gate``."""
    from hacrl.study import agreement

    g = st.get("gate")
    if g is None:
        return None
    if g.get("edges") is not None and not g["edges"]:
        raise ConfigError(f"{suite}/{setting}: its gate names no edge (gate.edges is empty)")
    res = measure_agreement(own, out, g.get("prompts", 32))
    failing = agreement.gate(res, g.get("window", "hacpo_first"), g.get("min_share", 0.3), g.get("edges"))
    verdict = {"window": g.get("window", "hacpo_first"), "min_share": g.get("min_share", 0.3),
               "edges": g.get("edges"), "passed": not failing, "failing": failing, "no_gate": bool(no_gate),
               "agreement": {k: v for k, v in res.items() if not k.startswith("_")}}
    if failing and not no_gate:
        raise ConfigError(f"{suite}/{setting}: the pool fails its gate: under {100 * verdict['min_share']:.0f} % of "
                          f"cross samples inside HACPO's {verdict['window'].replace('hacpo_', '')} cross window on "
                          f"{', '.join(failing)} (at iteration 0, {res['prompts']} dev prompts x {res['samples']} "
                          "samples): nothing would be shared; --no-gate runs it anyway")
    return verdict


def pool_fingerprint(base: Path) -> str:
    """A digest of what a run starts from: the prepared pool's iteration-0 weights and the task
    data (every file under ``base/data``). A stored run is reused only on the pool and data it
    started from (a pool prepared again on another machine must come out bit for bit the same)."""
    h = hashlib.sha256()
    for root in (RunLayout(base / "runs").checkpoints(0), base / "data"):
        for f in sorted(x for x in root.rglob("*") if x.is_file() and x.name != MANIFEST):
            h.update(f"{root.name}/{f.relative_to(root).as_posix()}\0{file_md5(f)}\n".encode())
    return h.hexdigest()[:16]


NO_EFFECT = ("engines", "orchestration", "tracking")
"""Sections that change how a run runs, never what it computes (their docs say so): left out of
:func:`config_key`, so moving or adding such a setting keeps the kept runs."""

ADDED_NEUTRAL: dict[str, object] = {
    "algorithm.kl_clamp": None,
    "algorithm.norm_match": False,
    "trainer.share_prompt_prefix": False,
    "rollout.sampler": "multinomial",
    "data.tasks": {},
    "data.task_settings": {},
    "trainer.skip_empty_updates": False,
    "agents[].trainer": {f.name: None for f in dataclasses.fields(AgentTrainerConfig)},
}
"""Settings added after runs were kept, with the value that computes what the runs computed
before they existed: at that value a setting is left out of :func:`config_key`, so a kept run
stays reusable (at any other value the key differs: it is another run). A new setting that
changes nothing at one of its values is listed here with that value."""


def config_key(cfg: Config) -> str:
    """A digest of what a run computes: its composed config, defaults of ``conf/`` included (the
    overrides alone do not say them), less its scratch paths, the :data:`NO_EFFECT` sections and
    the :data:`ADDED_NEUTRAL` settings at their neutral value. A stored run is reused only under
    the same digest."""
    data = dataclasses.asdict(cfg)
    data["experiment"] = {k: v for k, v in data["experiment"].items() if k not in ("runs_dir", "reports_dir")}
    for section in NO_EFFECT:
        data.pop(section, None)
    for dotted, neutral in ADDED_NEUTRAL.items():
        *path, leaf = dotted.split(".")
        nodes = [data]
        for part in path:  # "name[]": every item of the list ``name``
            key, many = part.removesuffix("[]"), part.endswith("[]")
            nodes = [x for n in nodes if isinstance(n, dict) for x in ((n.get(key) or []) if many else [n.get(key)])]
        for node in nodes:
            if isinstance(node, dict) and leaf in node and node[leaf] == neutral:
                del node[leaf]
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def pool_of(out: Path, warmup: int) -> str | None:
    """The fingerprint :func:`prepare_base` recorded for warm-up pool ``warmup`` (None before it)."""
    stamp = base_dir(out, warmup) / "prepared.json"
    return read_json(stamp).get("pool") if stamp.exists() else None


RESULT_FILE = "result.json"
"""A finished run's curves, next to its scratch state (``<work>/<suite>/<setting>/<contender>/seed<k>/``)."""


def finished_run(name: str, overrides: list[str], seed: int, out: Path, store: Path | None = None,
                 pool: str | None = None, config: str | None = None) -> dict | None:
    """The curves an earlier (interrupted) suite wrote for this contender and seed -- in the scratch
    directory, else in the report's store -- if its overrides, composed config and warm-up pool
    were the same; None otherwise."""
    f = out / name / f"seed{seed}" / RESULT_FILE
    for res in (read_json(f) if f.exists() else None, stored_run(store, name, seed) if store else None):
        if (res is not None and res.pop("overrides", None) == overrides + [f"experiment.seed={seed}"]
                and (pool is None or res.get("pool") == pool) and (config is None or res.get("config") == config)):
            return res
    return None


def run_contender(name: str, overrides: list[str], seed: int, out: Path, warmup: int = 0) -> dict:
    """One contender with one seed from its warm-up pool's iteration 0; returns its curves."""
    base = base_dir(out, warmup)
    run_dir = out / name / f"seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = _cfg(overrides + [f"experiment.seed={seed}"], run_dir / "runs", run_dir / "reports")
    shutil.copytree(base / "runs" / "it0", run_dir / "runs" / "it0")
    t0 = time.time()
    with contextlib.chdir(base):  # data/tasks of the base
        timings = run_in_process(cfg, prepare=False)
    lay = RunLayout(cfg.experiment.runs_dir)
    history = read_json(lay.history(cfg.experiment.iterations))
    agents = [a.name for a in cfg.agents]
    per_iter = cfg.rollout.prompts_per_iteration * cfg.samples_per_prompt  # rollouts per agent
    res = {"contender": name, "seed": seed, "warmup": warmup, "pool": pool_of(out, warmup),
           "config": config_key(cfg), "algorithm": cfg.algorithm.name,
           "eval_split": cfg.eval.split, "seconds": round(time.time() - t0, 1),
           "stage_seconds": {k: round(v, 1) for k, v in timings.items()},
           "rollouts_per_agent_per_iteration": per_iter, "agents": {}}
    updates = [read_json(lay.update_stats(t)) for t in range(1, cfg.experiment.iterations + 1)]
    for a in agents:
        acc = [h["agents"][a]["eval_accuracy"] for h in history["iterations"]]
        train = [{k: v for k, v in u.get(a, {}).items()
                  if (k in TRAIN_KEYS or k.startswith("ratio/")) and isinstance(v, (int, float))} for u in updates]
        its = history["iterations"]
        res["agents"][a] = {"eval_accuracy": acc, "rollouts": [per_iter * t for t in range(len(acc))],
                            "train": train,
                            # the optimisation signatures per iteration (None at iteration 0): the
                            # policy's entropy on its own samples during the update, and the KL of
                            # the policy that generated the step's rollouts to the initial model
                            "entropy": [h["agents"][a].get("entropy") for h in its],
                            "kl": [h["agents"][a].get("kl_init_before_step", h["agents"][a].get("kl_to_init"))
                                   for h in its],
                            "eval": [{k: h["agents"][a][k] for k in EVAL_KEYS if k in h["agents"][a]} for h in its]}
    shutil.rmtree(run_dir / "runs", ignore_errors=True)  # checkpoints are not kept: only the curves
    write_json(run_dir / RESULT_FILE, {**res, "overrides": overrides + [f"experiment.seed={seed}"]})
    return res


def parse_grid(tune: list[str] | None) -> list[tuple[str, list[str]]]:
    """``["trainer.lr=1e-4,3e-4,5e-4"]`` -> ``[("trainer.lr", ["1e-4", "3e-4", "5e-4"])]``."""
    grid = []
    for item in tune or []:
        key, sep, values = item.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not vals:
            raise ConfigError(f"--tune: invalid value {item!r} (expected KEY=V1,V2,..., e.g. trainer.lr=1e-4,3e-4)")
        grid.append((key.strip(), vals))
    return grid


def grid_points(grid: list[tuple[str, list[str]]]) -> list[list[str]]:
    """Every combination of the grid's values as overrides (one empty point without a grid)."""
    return [[f"{k}={v}" for (k, _), v in zip(grid, combo)] for combo in itertools.product(*[vs for _, vs in grid])]


def dev_score(run: dict, agent: str | None = None) -> float:
    """A tuning run's score: mean dev accuracy over iterations 1..T, mean over agents, or of one
    ``agent`` (iteration 0 is the shared pool's held-out figure, the same for every grid point,
    and left out)."""
    agents = [run["agents"][agent]] if agent is not None else list(run["agents"].values())
    return float(np.mean([np.mean(a["eval_accuracy"][1:]) for a in agents]))


def per_agent_overrides(point: str, agent: str) -> list[str]:
    """A grid point (``trainer.lr=1e-5 ...``) as agent ``agent``'s own settings
    (``agents.<agent>.trainer.lr=1e-5``); a key no agent sets on its own is a one-line error."""
    own = {f.name for f in dataclasses.fields(AgentTrainerConfig)}
    out = []
    for ov in point.split():
        key, _, value = ov.partition("=")
        if not key.startswith("trainer.") or key.split(".", 1)[1] not in own:
            raise ConfigError(f"--tune-per-agent: {key} is not a per-agent setting (agents.<name>.trainer: "
                              f"{', '.join(sorted(own))})")
        out.append(f"agents.{agent}.{key}={value}")
    return out


def resolve(overrides: list[str], n_agents: int) -> list[str]:
    """A contender's overrides with ``{n_agents}`` filled in."""
    return [o.replace("{n_agents}", str(n_agents)) for o in overrides]


def rewrite_report(suite: str, setting: str = "default", reports_dir: str | os.PathLike = "reports") -> Path:
    """Write ``reports/<suite>/<setting>/`` again from its ``results.json``, running nothing: a
    change to the report's tables, claims or plots reaches a finished suite without its hours of
    runs. The runs, their overrides and the dev sweep are the file's; the setting's declared
    primary contrast and the suite's claims are read from :data:`SUITES` as they are now."""
    if suite not in SUITES or setting not in SUITES[suite]["settings"]:
        raise ConfigError(f"suite/setting: invalid value {suite}/{setting} (choose from "
                          + ", ".join(f"{s}/{x}" for s in SUITES for x in SUITES[s]["settings"]) + ")")
    suite_dir = Path(reports_dir).resolve() / suite
    res_file = suite_dir / setting / "results.json"
    if not res_file.exists():
        raise ConfigError(f"--report-only: {res_file} does not exist (run the suite first)")
    old = load_results(res_file.parent)
    spec = SUITES[suite]
    report = write_report(old["runs"], {**spec["settings"][setting], "claims": spec["claims"]}, suite_dir / setting,
                          old.get("wall_seconds", 0.0), old.get("overrides", []), suite, setting, old.get("tuning"),
                          old.get("warmups", 1), old.get("gate"))
    write_index(suite_dir, suite)
    return report


def run_suite(suite: str, seeds: int, overrides: list[str] | None = None, work_dir: str | os.PathLike = "compare",
              reports_dir: str | os.PathLike = "reports", contenders: list[str] | None = None,
              setting: str = "default", resume: bool = False, dry_run: bool = False,
              tune: list[str] | None = None, tune_seeds: int = 2, warmups: int = 1,
              tune_per_agent: bool = False, no_gate: bool = False) -> Path | str:
    """Run ``suite`` in ``setting`` for ``seeds`` seeds (0..seeds-1) on ``warmups`` warm-up pools
    and write ``reports/<suite>/<setting>/`` and the suite's index.

    With ``tune`` (``KEY=V1,V2,...`` items, a grid), each contender first runs every grid point on
    ``tune_seeds`` tuning seeds (1000, 1001, ...) evaluated on the dev split; the point with the
    best mean dev accuracy is the contender's setting for the reported seeds. A contender the
    suite or the setting lists in ``tuned_as`` (a variant of a method that changes one mechanism) is
    not swept: it takes its method's chosen point. With ``tune_per_agent`` (or a setting that says
    ``tune_per_agent``), every agent takes the point of its own best dev accuracy, as its own
    settings (``agents.<name>.trainer.*``): one lr does not suit a 270M model and a 135M one. With ``contenders``
    given, the runs of other contenders already in that setting's report (same overrides) are
    kept, so a probe can be added to a finished suite. With ``resume``, runs an interrupted suite
    finished with the same overrides are reused. With ``dry_run``, every config (tuning points
    included) is composed and validated and the plan returned as text; nothing runs but the
    pool's preparation and its gate. A setting with a ``gate`` (:func:`check_gate`) measures the
    pool's agreement before any run and refuses a pool its primary contrast cannot use, unless
    ``no_gate`` (the report's first line then says so; a dry run with ``no_gate`` measures nothing)."""
    if suite not in SUITES:
        raise ConfigError(f"suite: invalid value {suite!r} (choose from {', '.join(SUITES)})")
    spec = SUITES[suite]
    if setting not in spec["settings"]:
        raise ConfigError(f"setting: invalid value {setting!r} (choose from {', '.join(spec['settings'])})")
    if seeds < 1 or warmups < 1 or tune_seeds < 1:
        raise ConfigError(f"seeds, warmups and tune seeds must be >= 1 (got {seeds}, {warmups}, {tune_seeds})")
    st = spec["settings"][setting]
    chosen = contenders or list(st["contenders"])
    unknown = [c for c in chosen if c not in spec["all"]]
    if unknown:
        raise ConfigError(f"contenders: invalid value {unknown} (choose from {', '.join(spec['all'])})")
    base_overrides = st["base"] + list(overrides or [])
    grid = parse_grid(tune)
    points = grid_points(grid) if grid else []
    tune_per_agent = tune_per_agent or bool(st.get("tune_per_agent"))
    out = Path(work_dir).resolve() / suite / setting
    n_agents = len(_cfg(base_overrides, out / "runs", out / "reports").agents)
    # a setting may add its own pairs (where runs are too dear to sweep every contender)
    tuned_as = {c: p for c, p in {**spec.get("tuned_as", {}), **st.get("tuned_as", {})}.items() if p != c}

    def own_of(c: str) -> list[str]:
        return base_overrides + resolve(spec["all"][c], n_agents)

    own = {c: own_of(c) for c in chosen}
    # a variant that changes one mechanism of a method takes the method's chosen setting (so the
    # comparison changes that mechanism only); the method is swept even when not reported
    parent = {c: tuned_as.get(c, c) for c in chosen}
    swept = list(dict.fromkeys(parent.values()))
    agent_names = [a.name for a in _cfg(base_overrides, out / "runs", out / "reports").agents]
    if tune_per_agent:  # a key no agent sets alone fails here
        for pt in points:
            per_agent_overrides(" ".join(pt), agent_names[0])
    if dry_run:
        for c in dict.fromkeys([*chosen, *swept]):  # a bad override fails here, before hours of runs
            for pt in points or [[]]:
                check_splits(_cfg(own_of(c) + pt + (["eval.split=dev"] if pt else []), out / "runs", out / "reports"))
        # a plan with --no-gate validates the configs only (it prepares and measures nothing)
        gated = None if no_gate else check_gate(st, own_of(st["primary"]["better"]), out, suite, setting, no_gate)
        n_tune = len(swept) * len(points) * tune_seeds
        return (f"compare {suite}/{setting}: {len(chosen)} contenders x {seeds} seeds = {len(chosen) * seeds} runs "
                f"({', '.join(chosen)}) on {warmups} warm-up pool(s)"
                + (f", after {n_tune} dev runs tuning {' '.join(tune or [])}" if points else "")
                + f"; primary: {st['primary']['better']} - {st['primary']['worse']} ({st['primary']['endpoint']}); "
                f"base overrides: {' '.join(base_overrides)}; every config valid"
                + ("; gate not measured (--no-gate)" if no_gate and st.get("gate") else
                   "" if gated is None else "; gate passed"))
    for c in chosen:
        check_splits(_cfg(own[c], out / "runs", out / "reports"))
    gated = check_gate(st, own_of(st["primary"]["better"]), out, suite, setting, no_gate)
    for w in range(warmups):
        prepare_base(base_overrides, out, w)
    from tqdm import tqdm

    store = Path(reports_dir).resolve() / suite / setting / STORE_DIR
    used: set[Path] = set()

    def run(name: str, ovr: list[str], s: int) -> dict:
        w = s % warmups
        ovr = ovr + pool_overrides(w)
        used.add(store_file(store, name, s))
        key = config_key(_cfg(ovr + [f"experiment.seed={s}"], out / "runs", out / "reports")) if resume else None
        res = ((finished_run(name, ovr, s, out, store, pool_of(out, w), key) if resume else None)
               or run_contender(name, ovr, s, out, w))
        # (again, for a run found in the scratch directory: the same bytes when the store had it)
        store_run(store, name, s, {**res, "overrides": ovr + [f"experiment.seed={s}"]})
        return res

    tuning = None
    if points:
        tseeds = [TUNE_SEED0 + i for i in range(tune_seeds)]
        tune_seconds = 0.0
        scores: dict[str, dict[str, float]] = {c: {} for c in swept}
        agent_scores: dict[str, dict[str, dict[str, list]]] = {c: {} for c in swept}
        jobs = [(c, pt, s) for s in tseeds for c in swept for pt in points]
        for c, pt, s in tqdm(jobs, desc=f"tune {suite}/{setting} on dev"):
            label = " ".join(pt)
            r = run(f"tune/{c}/{label.replace(' ', '_')}", own_of(c) + pt + ["eval.split=dev"], s)
            scores[c].setdefault(label, []).append(dev_score(r))
            for a in r["agents"]:
                agent_scores[c].setdefault(a, {}).setdefault(label, []).append(dev_score(r, a))
            tune_seconds += r.get("seconds", 0.0)

        def best_of(sc: dict[str, float]) -> str:  # ties: the earlier grid point
            return max(sc, key=lambda k: (sc[k], -list(sc).index(k)))

        dev = {c: {k: float(np.mean(v)) for k, v in sc.items()} for c, sc in scores.items()}
        best = {c: best_of(sc) for c, sc in dev.items()}
        tuning = {"grid": list(tune or []), "values": [" ".join(p) for p in points], "seeds": tseeds,
                  "seconds": round(tune_seconds, 1),
                  "dev_scores": dev, "chosen": {**best, **{c: best[parent[c]] for c in chosen}},
                  "tuned_as": {c: parent[c] for c in chosen if parent[c] != c}}
        if tune_per_agent:
            agent_dev = {c: {a: {k: float(np.mean(v)) for k, v in sc.items()} for a, sc in per.items()}
                         for c, per in agent_scores.items()}
            per_agent = {c: {a: best_of(agent_dev[parent[c]][a]) for a in agent_names} for c in dict.fromkeys(
                [*swept, *chosen])}
            tuning.update(per_agent=per_agent, agent_dev_scores=agent_dev)
            own = {c: own[c] + [o for a in agent_names for o in per_agent_overrides(per_agent[c][a], a)]
                   for c in chosen}
            log.info("chosen on dev, per agent: %s", per_agent)
        else:
            own = {c: own[c] + best[parent[c]].split() for c in chosen}
            log.info("chosen on dev: %s", tuning["chosen"])
    results = []
    jobs = [(c, s) for s in range(seeds) for c in chosen]
    for c, s in tqdm(jobs, desc=f"compare {suite}/{setting}"):
        r = run(c, own[c], s)
        log.info("%s seed %d: %s (%.0fs)", c, s, {a: round(v["eval_accuracy"][-1], 3) for a, v in r["agents"].items()},
                 r.get("seconds", 0.0))
        results.append(r)
    suite_dir = Path(reports_dir).resolve() / suite
    # the runs' own times (reused runs of an interrupted suite included), not this invocation's
    # wall clock, which a --resume that reruns nothing would report as minutes
    wall = sum(r.get("seconds", 0.0) for r in results) + (tuning or {}).get("seconds", 0.0)
    previous = suite_dir / setting / "results.json"
    if contenders and previous.exists():
        old = load_results(previous.parent)
        if old.get("overrides") == base_overrides and old.get("warmups", 1) == warmups:
            ran = {(r["contender"], r["seed"]) for r in results}
            results = [r for r in old["runs"] if (r["contender"], r["seed"]) not in ran] + results
            wall += old.get("wall_seconds", 0.0)
            if old.get("tuning") and tuning:
                tuning = {**old["tuning"], "dev_scores": {**old["tuning"]["dev_scores"], **tuning["dev_scores"]},
                          "chosen": {**old["tuning"]["chosen"], **tuning["chosen"]},
                          "tuned_as": {**old["tuning"].get("tuned_as", {}), **tuning["tuned_as"]}}
            tuning = tuning or old.get("tuning")
            log.info("kept %d runs of the earlier report", len(results) - len(ran))
            used.update(store_file(store, r["contender"], r["seed"]) for r in results)
            if tuning and old.get("tuning"):  # the earlier report's tuning runs stay its raw data
                used.update(store.glob("tune__*"))
    report = write_report(results, {**st, "claims": spec["claims"]}, suite_dir / setting, wall, base_overrides,
                          suite, setting, tuning, warmups, gated)
    write_index(suite_dir, suite)
    # the store holds this report's runs only (a run of other overrides was rerun or dropped)
    for f in store.glob("*.json.gz"):
        if f not in used:
            f.unlink()
    return report
