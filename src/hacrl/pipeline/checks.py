"""Start-up checks of a whole config: what one setting's rule cannot see.

A setting's type and its own rule are checked where it is declared (:mod:`hacrl.config.schema`);
here, before any stage does work, the config is checked against the parts of the package its
choices name: the registered advantage estimators and losses (their options built into their
dataclasses), the record types and verdicts of a subscription, the engine table, the
architectures, tokenizers and task levels that exist, the offline fetchers, the resource plan,
and paths on disk. It sits above those modules (each owns its own table of names) and imports
none of torch, transformers or MLflow: ``hacrl config`` stays fast.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hacrl import resources
from hacrl.agents import pool, pretrained
from hacrl.config.build import CONF_DIR, build, read_yaml
from hacrl.config.schema import AlgorithmConfig, Config, require
from hacrl.exchange import experience
from hacrl.rl import algorithms
from hacrl.rollout.table import ENGINES
from hacrl.task import data as task_data
from hacrl.task import rewards



MAX_SAMPLES_PER_ITERATION = 10**7
"""One iteration's rollout table (every agent's samples, their token ids and log-probs) is held in
memory by the stages that read it: beyond this many samples it is a typo, not an experiment."""


def validate(cfg: Config) -> Config:
    """Check what a stage relies on across settings and modules; raise ConfigError naming the
    first bad key. The algorithm's ``advantage`` and ``loss`` sections become their options
    dataclasses. Returns ``cfg``."""
    _algorithm(cfg)
    _label(cfg)
    n = cfg.rollout.prompts_per_iteration * cfg.samples_per_prompt * max(1, len(cfg.agents))
    require(n <= MAX_SAMPLES_PER_ITERATION, "rollout.prompts_per_iteration", cfg.rollout.prompts_per_iteration,
            f"{cfg.rollout.prompts_per_iteration} prompts x {cfg.samples_per_prompt} samples x {len(cfg.agents)} agents "
            f"= {n:,} samples per iteration, held in memory: at most {MAX_SAMPLES_PER_ITERATION:,}")
    require(cfg.rollout.engine in ENGINES, "rollout.engine", cfg.rollout.engine,
            f"known engines: {', '.join(ENGINES)}")
    resources.refuse_impossible(cfg.resources, [ag.name for ag in cfg.agents])  # a demand no device meets fails here
    d = cfg.data
    if d.source == "procedural":
        for lvl, w in d.levels.items():
            require(lvl in task_data.GENERATORS, f"data.levels.{lvl}", w,
                    f"unknown level; choose from {', '.join(task_data.GENERATORS)}")
        require(sum(float(w) for w in d.levels.values()) > 0, "data.levels", d.levels,
                f"no level has weight (levels: {', '.join(task_data.GENERATORS)}; e.g. data=arith)")
    elif d.source == "reasoning_gym":
        from hacrl.task import reasoning_gym

        reasoning_gym.check(d.tasks, d.task_settings)
    else:
        for k in ("train_path", "heldout_path"):
            p = getattr(d, k)
            require(p is not None, f"data.{k}", p, f"required with data.source=files (data.{k}=/path/to/file.jsonl)")
            require(Path(p).exists(), f"data.{k}", p, "file does not exist")
            _task_path_kind(Path(p), d.format, f"data.{k}")
    _agents(cfg)
    return cfg


SAVED_DATASET = ("state.json", "dataset_dict.json", "dataset_info.json")
"""What ``datasets.save_to_disk`` writes into its directory (one of them at least)."""


def _task_path_kind(p: Path, fmt: str, key: str) -> None:
    """A saved dataset is a directory; every other format is one file."""
    if p.is_dir():
        require(fmt in ("auto", "hf_disk"), key, str(p), f"a directory, not a {fmt} file")
        require(any((p / f).exists() for f in SAVED_DATASET), key, str(p),
                "a directory that datasets.save_to_disk did not write (no state.json): give a task file, or the "
                "saved dataset's directory with data=hf_disk")
    else:
        require(fmt != "hf_disk", key, str(p), "a file: data=hf_disk reads a datasets.save_to_disk directory")


def _label(cfg: Config) -> None:
    """A label that names a preset (``algorithm.name=gspo``) must run that preset's algorithm: its
    estimator, loss, subscription and sample multiplier; a variant carries its own label."""
    a = cfg.algorithm
    f = CONF_DIR / "algorithm" / f"{a.name}.yaml"
    if not f.is_file():
        return

    def identity(x: AlgorithmConfig) -> dict:
        name = lambda sec: sec["name"] if isinstance(sec, dict) else sec.name  # noqa: E731 - raw or built options
        return {"advantage": name(x.advantage), "loss": name(x.loss), "sample_multiplier": x.sample_multiplier,
                "subscription": [(s.record_type, s.producers, s.content) for s in x.subscription]}

    runs, wants = identity(a), identity(build(AlgorithmConfig, read_yaml(f) or {}, "algorithm"))
    differ = [k for k in runs if runs[k] != wants[k]]
    require(not differ, "algorithm.name", a.name,
            f"the {a.name} preset runs {', '.join(f'{k} {wants[k]}' for k in differ)}, this config "
            f"{', '.join(f'{k} {runs[k]}' for k in differ)}: select the preset (algorithm={a.name}) or give the "
            f"variant its own label")


def _algorithm(cfg: Config) -> None:
    a = cfg.algorithm
    a.advantage = algorithms.build_options(algorithms.ADVANTAGES, a.advantage, "algorithm.advantage")
    a.loss = algorithms.build_options(algorithms.LOSSES, a.loss, "algorithm.loss")
    if a.norm_match:
        require(algorithms.LOSSES[a.loss.name].own_only is not None, "algorithm.norm_match", a.norm_match,
                f"the {a.loss.name} loss cannot drop its peers' terms (a loss registered with own_only: hacpo)")
        require(cfg.trainer.world_size == 1, "algorithm.norm_match", a.norm_match,
                "the norms are of the whole mini-batch's gradients: trainer.world_size 1")
    layouts = algorithms.LOSSES[a.loss.name].layouts
    if layouts is not None:
        require(a.minibatch_order in layouts, "algorithm.minibatch_order", a.minibatch_order,
                f"the {a.loss.name} loss works under {' or '.join(layouts)} only")
    if a.minibatch_order == "source_blocks":  # as the reference trainer validates its sizes
        per_update = cfg.trainer.mini_batch_prompts * cfg.rollout.group_size
        require(per_update % cfg.samples_per_prompt == 0, "trainer.mini_batch_prompts", cfg.trainer.mini_batch_prompts,
                f"source_blocks: a mini-batch of {per_update} samples is not a whole number of prompt groups "
                f"of {cfg.samples_per_prompt} samples")
        mb = per_update // cfg.samples_per_prompt
        require(cfg.rollout.prompts_per_iteration % mb == 0, "rollout.prompts_per_iteration",
                cfg.rollout.prompts_per_iteration,
                f"source_blocks: a source block of {cfg.rollout.prompts_per_iteration} prompts is not a whole "
                f"number of mini-batches of {mb} prompts")
    kinds = [s.record_type for s in a.subscription]
    for i, s in enumerate(a.subscription):
        key = f"algorithm.subscription[{i}]"
        require(s.record_type in experience.RECORD_TYPES, f"{key}.record_type", s.record_type,
                f"choose from {', '.join(experience.RECORD_TYPES)}")
        if s.verdicts is not None:
            require(s.record_type in experience.TRAJECTORY_TYPES, f"{key}.verdicts", s.verdicts,
                    f"{s.record_type} records carry no verdict")
            require(all(v in rewards.VERDICTS for v in s.verdicts), f"{key}.verdicts", s.verdicts,
                    f"verdicts are {', '.join(rewards.VERDICTS)}")
        for j, o in enumerate(a.subscription[:i]):  # a record must not reach the learner twice
            same_rows = (s.record_type in experience.TRAJECTORY_TYPES) == (o.record_type in experience.TRAJECTORY_TYPES)
            overlap = "all" in (s.producers, o.producers) or s.producers == o.producers
            require(not (same_rows and overlap), key, dataclasses.asdict(s),
                    f"overlaps stream {j} ({o.record_type} from {o.producers}): records would count twice")
    require(any(k in experience.TRAJECTORY_TYPES for k in kinds), "algorithm.subscription", kinds,
            "no stream gives training rows (trajectory or verified_success)")
    for need in algorithms.ADVANTAGES[a.advantage.name].needs:
        require(need in kinds, "algorithm.subscription", kinds, f"the {a.advantage.name} advantage needs a {need} stream")
    if a.shares:
        require(len(cfg.agents) >= 2, "algorithm.subscription", kinds, "sharing needs at least 2 agents")


def _agents(cfg: Config) -> None:
    require(len(cfg.agents) >= 1, "agents", cfg.agents, "the pool needs at least one agent")
    names = set()
    for i, ag in enumerate(cfg.agents):
        key = f"agents[{i}]"
        require(bool(ag.name) and ag.name.replace("-", "").replace("_", "").replace(".", "").isalnum()
                and not ag.name.startswith("."), f"{key}.name", ag.name, "letters, digits, '-', '_' and '.' only")
        require(ag.name not in names, f"{key}.name", ag.name, "duplicate agent name")
        names.add(ag.name)
        if ag.fetch is not None:
            require(ag.fetch in pretrained.FETCHERS, f"{key}.fetch", ag.fetch,
                    f"choose from {', '.join(pretrained.FETCHERS)}")
            require(ag.path is not None, f"{key}.path", ag.path, "a fetched model needs the directory to write it to")
        elif ag.path is not None:
            require(Path(ag.path).is_dir(), f"{key}.path", ag.path, "model path does not exist")
            require((Path(ag.path) / "config.json").is_file(), f"{key}.path", ag.path,
                    "no config.json: not a Hugging Face model directory")
            tok = Path(ag.tokenizer.path or ag.path)
            require(tok.is_dir() and any((tok / f).is_file() for f in pool.TOKENIZER_FILES),
                    f"{key}.tokenizer.path" if ag.tokenizer.path else f"{key}.path", str(tok),
                    f"no tokenizer files ({', '.join(pool.TOKENIZER_FILES)})")
        else:
            require(ag.arch in pool.ARCHS, f"{key}.arch", ag.arch, f"choose from {', '.join(pool.ARCHS)}")
            require(ag.tokenizer.kind in pool.SPECIALS, f"{key}.tokenizer.kind", ag.tokenizer.kind,
                    f"unknown tokenizer kind; choose from {', '.join(pool.SPECIALS)}")
