"""Typed configuration: Hydra composes ``conf/``; these dataclasses validate it.

One source of truth: ``conf/`` is composed (with any Hydra overrides) into ``params.yaml``
by ``hacrl config``; DVC stages read ``params.yaml``; ``tests/test_config.py`` checks that the
committed ``params.yaml`` equals the composition of the defaults. Every field documents what
it does; invalid values fail at start-up with one line naming the key and the value.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hacrl.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
KNOWN_ARCHS = ("gpt2", "llama", "qwen2")
KNOWN_TOKENIZERS = ("bytelevel_bpe", "metaspace_bpe", "bytelevel_unigram")
KNOWN_LEVELS = ("add", "sub", "add3", "mul", "frac")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these makes a directory one AutoTokenizer can load."""


GENERATED_KEYS = ("iterations", "agent_names", "external_inputs")
"""Keys of params.yaml derived from the config for dvc.yaml's templating (foreach, plots)."""


@dataclass
class ExperimentConfig:
    name: str = "embedded-arith"
    seed: int = 0
    """Master seed: task data, warm-up, prompt choice per iteration and sampling derive from it."""
    iterations: int = 8
    """Number of RL iterations; each one is the six stages. Raising it runs only new ones."""
    threads: int = 2
    """torch intra-op threads per stage process (never run two 2-thread torch jobs at once)."""
    runs_dir: str = "runs"
    reports_dir: str = "reports"


@dataclass
class DataConfig:
    source: str = "procedural"
    """``procedural`` (built-in arithmetic task) or ``files`` (local JSONL/Parquet)."""
    levels: dict[str, float] = field(default_factory=lambda: {"add": 0.4, "sub": 0.4, "add3": 0.2})
    """Difficulty levels and their sampling weights (add, sub, add3, mul, frac)."""
    max_operand: int = 99
    train_size: int = 40000
    heldout_size: int = 1200
    dev_size: int = 300
    heldout_fraction: float = 0.2
    """Fraction of the problem space reserved (by hash) for held-out and dev problems."""
    train_path: str | None = None
    heldout_path: str | None = None
    on_bad_row: str = "error"
    """``error``: a malformed row fails with file and line; ``skip``: skipped and counted."""
    completion: str = "answer"
    """What the warm-up targets write after the prompt: the boxed ``answer`` alone, or a short
    ``worked`` solution before it (procedural task only; responses of tens of tokens, so raise
    ``rollout.max_new_tokens`` and ``eval.max_new_tokens`` to match)."""


@dataclass
class TokenizerConfig:
    kind: str = "bytelevel_bpe"
    vocab_size: int = 300
    path: str | None = None
    """For a real model: a local tokenizer directory (defaults to the model path)."""


@dataclass
class WarmupConfig:
    target_accuracy: float = 0.3
    """Stop the supervised warm-up once dev accuracy reaches this (weak/mid/strong pool)."""
    max_steps: int = 0
    """Supervised warm-up budget in steps; 0 (the default, e.g. for a real pretrained model) skips it."""
    min_steps: int = 0
    lr: float = 3e-3
    batch_size: int = 128
    eval_every: int = 100


@dataclass
class AgentConfig:
    name: str = ""
    arch: str = "gpt2"
    """transformers architecture for an embedded model (gpt2, llama, qwen2)."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the transformers config class (hidden size, layers, ...)."""
    path: str | None = None
    """A Hugging Face model directory: when set the agent is a real model and is not built."""
    fetch: str | None = None
    """A pretrained model the project fetches offline (:mod:`hacrl.agents.pretrained`: ``smollm2``):
    prepare-pool writes it to ``path`` when that directory does not exist yet."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    template: str = "Q: {problem}\nA:"
    """The agent's own prompt template; ``{problem}`` is replaced by the problem text."""
    chat: bool = False
    """Instruct models: the filled template becomes the user turn of the tokenizer's chat
    template, followed by the opened assistant turn (``apply_chat_template`` with
    ``add_generation_prompt``)."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)

    @property
    def tokenizer_id(self) -> str:
        """What identifies the agent's tokenizer in records: the trained kind, or the directory."""
        return self.tokenizer.kind if self.path is None else str(self.tokenizer.path or self.path)


@dataclass
class ThlConfig:
    """Tokenizer Heterogeneity Layer (docs/ALGORITHMS.md, "THL"): how a peer's response becomes
    the learner's tokens, and how the peer's log-prob trace is carried onto them."""

    peer_eos: str = "keep_if_stopped"
    """``keep_if_stopped``: a peer response that ended with EOS gets the learner's EOS appended, and
    the peer's EOS log-prob stays in its trace; ``drop``: no EOS on the learner side, and the
    peer's terminal EOS is left out of its trace (sum, mean and count)."""
    segmentation: str = "whitespace"
    """Words of the response text: ``whitespace`` (maximal runs of non-space characters) or
    ``unicode_words`` (runs of word characters, and every other non-space character alone)."""
    refine_shared_boundaries: bool = True
    """Inside a word, also cut at every character position where both tokenizations have a token
    boundary, so identical tokenizations align token for token; False spreads each word's mass
    evenly over the learner tokens of the word."""
    residual_sample: int = 512
    """Records per producer on which exchange-and-align measures THL's residuals for the pairs
    that the subscription does not retokenise (the pairs it does are measured on every record)."""


@dataclass
class StreamConfig:
    """One stream of a learner's subscription (docs/ALGORITHMS.md, "SEE")."""

    record_type: str = "trajectory"
    """``trajectory`` (every verified sample), ``verified_success`` (samples judged correct) or
    ``reward_stats`` (per producer and prompt: n, successes, mean, std)."""
    producers: str = "self"
    """Whose records: ``self`` (the learner's own), ``peers`` (every other agent's) or ``all``."""
    verdicts: list[str] | None = None
    """Keep only records with these verdicts (``[correct]``: verified only); null keeps all."""


@dataclass
class CapabilityConfig:
    """Capability statistics of compute-capability-stats (docs/ALGORITHMS.md, "Capability")."""

    window: int = 5
    """K: P_hat is the mean step accuracy over the last K steps, the current one included."""
    omega_min: float = 0.1
    omega_max: float = 10.0
    """Clamp of the capability ratio omega[a][b] = P_hat[a] / P_hat[b]."""
    warmup_steps: int = 0
    """Steps during which omega is fixed to 1."""


def _default_subscription() -> list[StreamConfig]:
    return [StreamConfig()]


@dataclass
class AlgorithmConfig:
    """An algorithm is its YAML under ``conf/algorithm/``: a label, a registered advantage
    estimator and a registered loss (each with its own options, the fields of the config
    dataclass registered with it in ``hacrl.rl.algorithms``), and a subscription."""

    name: str = "grpo"
    """A label for reports and MLflow (the preset's file name)."""
    advantage: Any = field(default_factory=lambda: {"name": "grpo"})
    """``{name: <registered estimator>, <its options>}``; after validation its options dataclass."""
    loss: Any = field(default_factory=lambda: {"name": "grpo"})
    """``{name: <registered loss>, <its options>}``; after validation its options dataclass."""
    subscription: list[StreamConfig] = field(default_factory=_default_subscription)
    """What the learner takes from the experience stream, in this order; trajectory-shaped records
    become its training rows (within a stream its own first), the other types side tables (e.g.
    pooled reward statistics). Streams may not overlap."""
    kl_coef: float = 0.0
    """beta of the low-variance KL (k3) to the initial model, on the learner's own samples; 0: off."""
    sample_multiplier: int = 1
    """Samples per prompt = rollout.group_size * this (GSPO x2 uses 2)."""
    minibatch_order: str = "prompt_groups"
    """The update layout (docs/ALGORITHMS.md, "Update layout"). ``prompt_groups``: mini-batches of
    ``trainer.mini_batch_prompts`` whole prompt groups in seeded order, reshuffled per epoch;
    ``source_blocks`` (HACPO reference trainer): one block per source, the learner's own first,
    each cut into mini-batches of ``mini_batch_prompts * group_size`` samples (whole prompt
    groups), none mixing sources, no shuffle, so a learner of n sources takes n times the
    updates; ``self_first`` (the earlier layout here): own samples first, then the others', cut
    into ceil(P / mini_batch_prompts) mini-batches that may mix sources."""
    capability: CapabilityConfig = field(default_factory=CapabilityConfig)
    thl: ThlConfig = field(default_factory=ThlConfig)

    @property
    def shares(self) -> bool:
        """Whether a learner takes anything from other agents."""
        return any(s.producers != "self" for s in self.subscription)


@dataclass
class RolloutConfig:
    engine: str = "hf"
    """Rollout engine: ``hf`` (transformers generate in the stage's process) or ``vllm`` (vLLM in
    its own environment and process, ``make setup-vllm``; options under ``engines``)."""
    group_size: int = 8
    prompts_per_iteration: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    batch_size: int = 512
    """Sequences per generate call."""


@dataclass
class TrainerConfig:
    backend: str = "deepspeed"
    zero_stage: int = 0
    lr: float = 1e-3
    lr_warmup_updates: int = 10
    """Linear ramp of the RL learning rate over the first updates (fresh optimizers collapse)."""
    mini_batch_prompts: int = 64
    epochs: int = 1
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    dtype: str = "fp32"
    recompute_old_logprobs: bool = True
    """pi_old from the trainer's own forward before the step's first update (as verl does);
    False uses the generation log-probs recorded with the rollouts."""
    response_logits_only: bool = True
    """Project the language-model head at response positions only (TRL's ``logits_to_keep``): the
    prompt positions' logits, most of an update's memory with a real vocabulary, are never made.
    Log-probs are the same bits; the head's weight gradient sums over fewer rows, so it agrees with
    ``false`` (the earlier behaviour) to float rounding, not bit for bit."""
    measure_kl_to_init: bool = False
    """Also measure KL(pi_old || pi_0), the policy that generated the step's rollouts against the
    initial model (k3 on the learner's own samples, which pi_old drew), when the loss has no KL
    term (``algorithm.kl_coef`` 0); it costs one forward of the initial model per mini-batch.
    Reported as ``kl_init_before_step``; the comparison suites switch it on for every contender."""
    world_size: int = 1
    """Processes per learner update (DeepSpeed data parallelism, gloo on the CPU, NCCL on GPUs):
    each rank takes whole prompt groups of every mini-batch and the gradients are averaged, so
    the update equals the single-process one up to float rounding (docs/SCALING.md). ZeRO 0-2."""


@dataclass
class RewardConfig:
    timeout_s: float = 5.0
    """Per-answer limit; a hung check is killed, its record gets verdict ``timeout``."""
    workers: int = 2
    fast_path: bool = True
    """Settle a canonical integer gold against a response that is exactly ``\\boxed{N}`` by
    comparing the digit strings (math-verify's own verdict on such pairs, tested) instead of
    sending it to math-verify; ``false`` sends every answer to math-verify."""


@dataclass
class EvalConfig:
    batch_size: int = 600
    max_new_tokens: int = 16


@dataclass
class EnginesConfig:
    """How the rollout engines run (no effect on results: the engine itself is ``rollout.engine``)."""

    vllm_python: str = ".venv-vllm/bin/python"
    """The vLLM environment's interpreter (relative to the project root), built by ``make setup-vllm``."""
    vllm_threads: int = 0
    """CPU threads of a vLLM worker on a CPU host (0: ``experiment.threads``)."""
    vllm_kv_cache_gib: int = 1
    """KV cache of a vLLM worker on a CPU host (``VLLM_CPU_KVCACHE_SPACE``)."""
    vllm_max_model_len: int = 0
    """Prompt + response tokens per sequence (0: the model's ``max_position_embeddings``, at most 4096)."""
    vllm_gpu_memory_utilization: float = 0.85
    """Fraction of a GPU's memory vLLM may take (GPU hosts only)."""
    vllm_timeout_s: float = 900.0
    """A vLLM worker that does not answer a request (start-up included) in this time is stopped."""
    logprob_check_samples: int = 0
    """Sequences per agent and iteration on which generate-rollouts compares the engine's sampled
    log-probs with the trainer's forward on the same tokens (logged as ``logprob_gap_mean`` /
    ``logprob_gap_max``); 0: no check at rollout time. Off by default: update-policies measures
    the same gap on every learner's own samples from the forward it runs anyway
    (``gen_vs_train_logprob_maxdiff``), where this check costs a forward of its own (on
    SmolLM2-135M, 64 sequences took a third of the stage's time). Turn it on to vet an engine."""


@dataclass
class OrchestrationConfig:
    """How ``prefect deployment run hacrl/iterate`` drives the DVC stages (no effect on results)."""

    retries: int = 1
    """Retries of a failed stage task (transient failures; config and data errors never retry)."""
    retry_delay_s: float = 5.0
    lock_timeout_s: float = 600.0
    """How long a second iterate run waits for the workspace lock before failing (0: fail at once)."""
    gpu_routing: str = "auto"
    """``auto``: run update-policies on ``gpu_pool`` when a worker is online there, else in the
    flow (CPU pool); ``pool``: always on ``gpu_pool``; ``local``: always in the flow."""
    gpu_pool: str = "gpu"
    gpu_deployment: str = "hacrl-stage/gpu"
    """The deployment (flow/name) that runs one stage on ``gpu_pool``."""
    cpu_pool: str = "cpu"


@dataclass
class TrackingConfig:
    """MLflow lineage. URI: ``uri`` if set, else ``$MLFLOW_TRACKING_URI``, else a project sqlite file."""

    enabled: bool = True
    uri: str | None = None
    artifact_dir: str = "mlartifacts"
    """Where a new experiment keeps its artifacts (relative to the project)."""
    register_models: bool = True
    """Register every agent's checkpoint as a model version (pointing at the DVC-tracked directory)."""
    asynchronous: bool = True
    """A stage process queues its record (``runs/.tracking/queue/``) and a background process logs
    it to MLflow, so importing MLflow and its store (about 3 s per process) is off the critical
    path; ``hacrl track`` (run by ``make run`` and at the end of each Prefect flow run) waits
    until the queue is logged. False: the stage logs before it exits."""


@dataclass
class DeviceConfig:
    """One device of the inventory."""

    id: str = "cpu"
    """``cpu`` (the host), ``cpu:N`` (an equal share of the host's ``experiment.threads`` cores,
    so that jobs on different shares run at once) or ``cuda:N`` (given to the job's processes as
    ``CUDA_VISIBLE_DEVICES``)."""
    memory_gib: float = 0.0
    """Memory a job may use there; 0: not declared (not checked, e.g. the CPU host)."""


@dataclass
class StageResources:
    """What one agent's job of one stage needs."""

    devices: int = 1
    """Devices the job spans: vLLM's tensor-parallel size for a rollout, DeepSpeed's world size
    for an update."""
    memory_gib: float = 0.0
    """Memory per device; 0: not checked."""
    max_batch_tokens: int = 0
    """Token budget per forward batch given to the engine (0: the engine's default)."""
    pin: list[str] | None = None
    """Explicit device ids (else the planner chooses); ``devices`` then counts them."""


@dataclass
class AgentResourcesConfig:
    rollout: StageResources = field(default_factory=StageResources)
    """Rollouts and evaluation (the generation engine)."""
    update: StageResources = field(default_factory=StageResources)


@dataclass
class ResourcesConfig:
    """MWRA (docs/SCALING.md): the device inventory and each agent's needs; ``hacrl resources``
    prints the plan. No effect on results, only on where and when jobs run."""

    devices: list[DeviceConfig] = field(default_factory=lambda: [DeviceConfig()])
    engines_alive: int = 0
    """Rollout engines alive at once (0: as many as the devices allow)."""
    engine_release: str = "sleep"
    """What an engine does when an update needs its devices: ``sleep`` (vLLM sleep mode: weights
    and KV cache leave the device, the process stays) or ``stop``."""
    default: AgentResourcesConfig = field(default_factory=AgentResourcesConfig)
    """The needs of an agent not listed in ``agents``."""
    agents: dict[str, AgentResourcesConfig] = field(default_factory=dict)
    """Per agent name."""


@dataclass
class Config:
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    data: DataConfig = field(default_factory=DataConfig)
    agents: list[AgentConfig] = field(default_factory=list)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)

    def agent(self, name: str) -> AgentConfig:
        for a in self.agents:
            if a.name == name:
                return a
        raise ConfigError(f"agents: no agent named {name!r}")

    @property
    def samples_per_prompt(self) -> int:
        return self.rollout.group_size * self.algorithm.sample_multiplier


_LIST_OF = {"AgentConfig": AgentConfig, "StreamConfig": StreamConfig, "DeviceConfig": DeviceConfig}
_DICT_OF = {"AgentResourcesConfig": AgentResourcesConfig}
_NESTED = {"StageResources": StageResources}


def _build(cls: type, data: Any, key: str) -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys with their full name."""
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k.startswith("_"):
            continue
        if k not in fields:
            raise ConfigError(f"{key}.{k}: unknown key (value {v!r})")
        ftype = fields[k].type
        sub = f"{key}.{k}" if key else k
        if isinstance(ftype, str) and ((ftype.endswith("Config") and ftype in globals()) or ftype in _NESTED):
            kwargs[k] = _build(globals()[ftype], v, sub)
        elif isinstance(ftype, str) and ftype.startswith("dict[str, ") and ftype[10:-1] in _DICT_OF:
            if not isinstance(v, dict):
                raise ConfigError(f"{sub}: expected a mapping, got {v!r}")
            kwargs[k] = {str(n): _build(_DICT_OF[ftype[10:-1]], a, f"{sub}.{n}") for n, a in v.items()}
        elif isinstance(ftype, str) and ftype.startswith("list[") and ftype[5:-1] in _LIST_OF:
            if not isinstance(v, list):
                raise ConfigError(f"{sub}: expected a list, got {v!r}")
            kwargs[k] = [_build(_LIST_OF[ftype[5:-1]], a, f"{sub}[{i}]") for i, a in enumerate(v)]
        else:
            kwargs[k] = _typed(v, ftype if isinstance(ftype, str) else str(ftype), sub)
    return cls(**kwargs)


_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def _expected(t: str) -> str:
    opts = [x.strip() for x in t.split("|")]
    words = []
    for x in opts:
        if x == "None":
            words.append("null")
        elif x.startswith("list["):
            words.append(f"a list of {_WORDS.get(x[5:-1], x[5:-1]).removeprefix('an ').removeprefix('a ')}s")
        elif x.startswith("dict[str, "):
            words.append(f"a mapping to {_WORDS.get(x[10:-1], x[10:-1]).removeprefix('an ').removeprefix('a ')}s")
        else:
            words.append(_WORDS.get(x, x))
    return " or ".join(words)


def _scalar_ok(v: Any, t: str) -> bool:
    if t == "Any":
        return True
    if t == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if t in ("str", "bool"):
        return isinstance(v, {"str": str, "bool": bool}[t])
    return True  # a type this check does not know is left to validate()


def _typed(v: Any, ftype: str, key: str) -> Any:
    """``v`` as field type ``ftype`` (a string annotation) or a one-line ConfigError naming the
    key, the value and the type expected. Nothing is guessed: ``'1.0'`` (a quoted string) is not
    a number, ``'false'`` is not false; an integer where a number is expected becomes a float."""
    opts = [x.strip() for x in ftype.split("|")]
    if v is None:
        if "None" in opts or "Any" in opts:
            return None
        raise ConfigError(f"{key}: invalid value None (expected {_expected(ftype)})")
    base = [x for x in opts if x != "None"]
    if len(base) != 1:
        return v
    t = base[0]
    bad = ConfigError(f"{key}: invalid value {v!r} (expected {_expected(ftype)})")
    if t.startswith("list["):
        if not isinstance(v, list) or not all(_scalar_ok(x, t[5:-1]) for x in v):
            raise bad
        return [float(x) for x in v] if t == "list[float]" else v
    if t.startswith("dict[str, "):
        if not isinstance(v, dict) or not all(_scalar_ok(x, t[10:-1]) for x in v.values()):
            raise bad
        return v
    if not _scalar_ok(v, t):
        raise bad
    return float(v) if t == "float" else v


# Ranges of the numeric fields validate() does not check with a reason of its own:
# key -> (low, high, low included, high included); None: unbounded on that side.
RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "experiment.seed": (0, None, True, True),
    "experiment.iterations": (1, None, True, True),
    "experiment.threads": (1, None, True, True),
    "data.max_operand": (1, None, True, True),
    "data.dev_size": (1, None, True, True),
    "data.heldout_fraction": (0, 1, False, False),
    "rollout.batch_size": (1, None, True, True),
    "trainer.lr_warmup_updates": (0, None, True, True),
    "trainer.epochs": (1, None, True, True),
    "trainer.grad_clip": (0, None, False, True),
    "trainer.weight_decay": (0, None, True, True),
    "reward.timeout_s": (0, None, False, True),
    "reward.workers": (1, None, True, True),
    "eval.batch_size": (1, None, True, True),
    "eval.max_new_tokens": (1, None, True, True),
    "orchestration.retry_delay_s": (0, None, True, True),
}
AGENT_RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "tokenizer.vocab_size": (1, None, True, True),
    "warmup.max_steps": (0, None, True, True),
    "warmup.min_steps": (0, None, True, True),
    "warmup.lr": (0, None, False, True),
    "warmup.batch_size": (1, None, True, True),
    "warmup.eval_every": (1, None, True, True),
}


def _in_range(key: str, value: float, rng: tuple) -> None:
    lo, hi, lo_in, hi_in = rng
    ok = (lo is None or (value >= lo if lo_in else value > lo)) and (hi is None or (value <= hi if hi_in else value < hi))
    if not ok:
        left = "" if lo is None else f"{'>=' if lo_in else '>'} {lo:g}"
        right = "" if hi is None else f"{'<=' if hi_in else '<'} {hi:g}"
        raise ConfigError(f"{key}: invalid value {value!r} (must be {' and '.join(x for x in (left, right) if x)})")


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _typed_options(section: Any, table: dict, key: str) -> None:
    """The options of a registered estimator or loss, typed like every other field (their
    ranges are the options dataclass's own checks)."""
    import typing

    if not isinstance(section, dict) or section.get("name") not in table:
        return  # build_options says what is wrong
    cls = table[section["name"]].options
    hints = typing.get_type_hints(cls)
    for k, v in section.items():
        if k != "name" and k in hints:
            t = hints[k]
            name = t.__name__ if isinstance(t, type) else str(t).replace("typing.", "")
            section[k] = _typed(v, name, f"{key}.{k}")


def _check(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: invalid value {value!r} ({why})")


def validate(cfg: Config) -> Config:
    """Check every value a stage relies on; raise ConfigError naming the first bad key."""
    from hacrl.rl import algorithms# registry lives there

    import re

    # the name becomes an MLflow experiment, registered-model prefix and Prefect artifact key
    _check(bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}", cfg.experiment.name)), "experiment.name",
           cfg.experiment.name, "letters, digits, spaces, '.', '_' and '-', starting with a letter or digit")
    for key, rng in RANGES.items():
        _in_range(key, _get(cfg, key), rng)
    for i, ag in enumerate(cfg.agents):
        for key, rng in AGENT_RANGES.items():
            _in_range(f"agents[{i}].{key}", _get(ag, key), rng)
    t = cfg.trainer
    _check(len(t.adam_betas) == 2 and all(0 <= b < 1 for b in t.adam_betas), "trainer.adam_betas", t.adam_betas,
           "two numbers in [0, 1)")

    a = cfg.algorithm
    _check(isinstance(a.name, str) and bool(a.name.strip()), "algorithm.name", a.name, "a non-empty label")
    for sec, table in (("advantage", algorithms.ADVANTAGES), ("loss", algorithms.LOSSES)):
        _typed_options(getattr(a, sec), table, f"algorithm.{sec}")
    a.advantage = algorithms.build_options(algorithms.ADVANTAGES, a.advantage, "algorithm.advantage")
    a.loss = algorithms.build_options(algorithms.LOSSES, a.loss, "algorithm.loss")
    _check(a.kl_coef >= 0, "algorithm.kl_coef", a.kl_coef, "must be >= 0")
    _check(isinstance(a.sample_multiplier, int) and a.sample_multiplier >= 1,
           "algorithm.sample_multiplier", a.sample_multiplier, "must be an integer >= 1")
    _check(a.minibatch_order in ("prompt_groups", "source_blocks", "self_first"), "algorithm.minibatch_order",
           a.minibatch_order, "prompt_groups, source_blocks or self_first")
    layouts = algorithms.LOSSES[a.loss.name].layouts
    if layouts is not None:
        _check(a.minibatch_order in layouts, "algorithm.minibatch_order", a.minibatch_order,
               f"the {a.loss.name} loss works under {' or '.join(layouts)} only")
    if a.minibatch_order == "source_blocks":  # as the reference trainer validates its sizes
        per_update = cfg.trainer.mini_batch_prompts * cfg.rollout.group_size
        _check(per_update % cfg.samples_per_prompt == 0, "trainer.mini_batch_prompts", cfg.trainer.mini_batch_prompts,
               f"source_blocks: a mini-batch of {per_update} samples is not a whole number of prompt groups "
               f"of {cfg.samples_per_prompt} samples")
        mb = per_update // cfg.samples_per_prompt
        _check(cfg.rollout.prompts_per_iteration % mb == 0, "rollout.prompts_per_iteration",
               cfg.rollout.prompts_per_iteration,
               f"source_blocks: a source block of {cfg.rollout.prompts_per_iteration} prompts is not a whole "
               f"number of mini-batches of {mb} prompts")
    from hacrl.exchange.experience import RECORD_TYPES, TRAJECTORY_TYPES

    _check(bool(a.subscription), "algorithm.subscription", a.subscription, "at least one stream")
    for i, s in enumerate(a.subscription):
        key = f"algorithm.subscription[{i}]"
        _check(s.record_type in RECORD_TYPES, f"{key}.record_type", s.record_type,
               f"choose from {', '.join(RECORD_TYPES)}")
        _check(s.producers in ("self", "peers", "all"), f"{key}.producers", s.producers, "self, peers or all")
        _check(s.verdicts is None or (isinstance(s.verdicts, list) and s.verdicts), f"{key}.verdicts",
               s.verdicts, "null or a non-empty list of verdicts")
        if s.verdicts is not None:
            from hacrl.task.rewards import VERDICTS

            _check(s.record_type in TRAJECTORY_TYPES, f"{key}.verdicts", s.verdicts,
                   f"{s.record_type} records carry no verdict")
            _check(all(v in VERDICTS for v in s.verdicts), f"{key}.verdicts", s.verdicts,
                   f"verdicts are {', '.join(VERDICTS)}")
        for j, o in enumerate(a.subscription[:i]):  # a record must not reach the learner twice
            same_rows = (s.record_type in TRAJECTORY_TYPES) == (o.record_type in TRAJECTORY_TYPES)
            overlap = "all" in (s.producers, o.producers) or s.producers == o.producers
            _check(not (same_rows and overlap), f"{key}", dataclasses.asdict(s),
                   f"overlaps stream {j} ({o.record_type} from {o.producers}): records would count twice")
    kinds = [s.record_type for s in a.subscription]
    _check(any(k in TRAJECTORY_TYPES for k in kinds), "algorithm.subscription", kinds,
           "no stream gives training rows (trajectory or verified_success)")
    for need in algorithms.ADVANTAGES[a.advantage.name].needs:
        _check(need in kinds, "algorithm.subscription", kinds,
               f"the {a.advantage.name} advantage needs a {need} stream")
    if a.shares:
        _check(len(cfg.agents) >= 2, "algorithm.subscription", kinds, "sharing needs at least 2 agents")
    c = a.capability
    _check(isinstance(c.window, int) and c.window >= 1, "algorithm.capability.window", c.window, "must be >= 1")
    _check(0 < c.omega_min <= 1 <= c.omega_max, "algorithm.capability.omega_min", c.omega_min,
           "need 0 < omega_min <= 1 <= omega_max")
    _check(isinstance(c.warmup_steps, int) and c.warmup_steps >= 0, "algorithm.capability.warmup_steps",
           c.warmup_steps, "must be >= 0")
    h = a.thl
    _check(h.peer_eos in ("keep_if_stopped", "drop"), "algorithm.thl.peer_eos", h.peer_eos, "keep_if_stopped or drop")
    _check(h.segmentation in ("whitespace", "unicode_words"), "algorithm.thl.segmentation", h.segmentation,
           "whitespace or unicode_words")
    _check(isinstance(h.residual_sample, int) and h.residual_sample >= 0, "algorithm.thl.residual_sample",
           h.residual_sample, "must be an integer >= 0")
    r = cfg.rollout
    _check(r.engine in ("hf", "vllm"), "rollout.engine", r.engine, "known engines: hf, vllm")
    e = cfg.engines
    _check(isinstance(e.vllm_threads, int) and e.vllm_threads >= 0, "engines.vllm_threads", e.vllm_threads,
           "must be an integer >= 0")
    _check(isinstance(e.vllm_kv_cache_gib, int) and e.vllm_kv_cache_gib >= 1, "engines.vllm_kv_cache_gib",
           e.vllm_kv_cache_gib, "must be an integer >= 1")
    _check(isinstance(e.vllm_max_model_len, int) and e.vllm_max_model_len >= 0, "engines.vllm_max_model_len",
           e.vllm_max_model_len, "must be an integer >= 0")
    _check(0 < e.vllm_gpu_memory_utilization <= 1, "engines.vllm_gpu_memory_utilization",
           e.vllm_gpu_memory_utilization, "must be in (0, 1]")
    _check(e.vllm_timeout_s > 0, "engines.vllm_timeout_s", e.vllm_timeout_s, "must be > 0")
    _check(isinstance(e.logprob_check_samples, int) and e.logprob_check_samples >= 0,
           "engines.logprob_check_samples", e.logprob_check_samples, "must be an integer >= 0")
    _check(isinstance(r.group_size, int) and r.group_size >= 2, "rollout.group_size",
           r.group_size, "group-relative advantages need at least 2 samples per prompt")
    _check(r.prompts_per_iteration >= 1, "rollout.prompts_per_iteration", r.prompts_per_iteration, "must be >= 1")
    _check(r.temperature > 0, "rollout.temperature", r.temperature, "must be > 0")
    _check(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", r.max_new_tokens, "must be >= 1")
    t = cfg.trainer
    _check(t.backend in ("deepspeed", "torch"), "trainer.backend", t.backend, "deepspeed or torch")
    _check(t.zero_stage in (0, 1, 2, 3), "trainer.zero_stage", t.zero_stage, "ZeRO stages are 0-3")
    _check(t.lr > 0, "trainer.lr", t.lr, "must be > 0")
    _check(t.mini_batch_prompts >= 1, "trainer.mini_batch_prompts", t.mini_batch_prompts, "must be >= 1")
    _check(t.dtype in ("fp32", "bf16"), "trainer.dtype", t.dtype, "fp32 or bf16")
    _check(isinstance(t.world_size, int) and t.world_size >= 1, "trainer.world_size", t.world_size,
           "must be an integer >= 1")
    if t.world_size > 1:
        _check(t.backend == "deepspeed", "trainer.backend", t.backend, "world_size > 1 needs the deepspeed backend")
        _check(t.zero_stage <= 2, "trainer.zero_stage", t.zero_stage,
               "ZeRO 3 partitions the weights; the export needs ZeRO 0-2 when world_size > 1")
    o = cfg.orchestration
    _check(o.gpu_routing in ("auto", "pool", "local"), "orchestration.gpu_routing", o.gpu_routing,
           "auto, pool or local")
    _check(isinstance(o.retries, int) and o.retries >= 0, "orchestration.retries", o.retries, "must be >= 0")
    _check(o.lock_timeout_s >= 0, "orchestration.lock_timeout_s", o.lock_timeout_s, "must be >= 0")
    _check("/" in o.gpu_deployment, "orchestration.gpu_deployment", o.gpu_deployment, "flow/deployment")
    rs = cfg.resources
    _check(bool(rs.devices), "resources.devices", rs.devices, "the inventory needs at least one device")
    ids = [x.id for x in rs.devices]
    _check(len(set(ids)) == len(ids), "resources.devices", ids, "duplicate device id")
    for i, x in enumerate(rs.devices):
        _check(isinstance(x.id, str) and (x.id == "cpu" or any(x.id.startswith(k) and x.id[len(k):].isdigit()
                                                                for k in ("cuda:", "cpu:"))),
               f"resources.devices[{i}].id", x.id, "cpu, cpu:N (a share of the host's cores) or cuda:N")
        _check(isinstance(x.memory_gib, (int, float)) and x.memory_gib >= 0, f"resources.devices[{i}].memory_gib",
               x.memory_gib, "must be >= 0")
    _check(not ("cpu" in ids and any(x.startswith("cpu:") for x in ids)), "resources.devices", ids,
           "either the whole host (cpu) or shares of it (cpu:N), not both")
    _check(isinstance(rs.engines_alive, int) and rs.engines_alive >= 0, "resources.engines_alive",
           rs.engines_alive, "must be an integer >= 0")
    _check(rs.engine_release in ("sleep", "stop"), "resources.engine_release", rs.engine_release, "sleep or stop")
    for who, ar in [("default", rs.default), *((f"agents.{n}", v) for n, v in rs.agents.items())]:
        for st in ("rollout", "update"):
            sr = getattr(ar, st)
            key = f"resources.{who}.{st}"
            _check(isinstance(sr.devices, int) and sr.devices >= 0, f"{key}.devices", sr.devices, "must be an integer >= 0")
            _check(isinstance(sr.memory_gib, (int, float)) and sr.memory_gib >= 0, f"{key}.memory_gib",
                   sr.memory_gib, "must be >= 0")
            _check(isinstance(sr.max_batch_tokens, int) and sr.max_batch_tokens >= 0, f"{key}.max_batch_tokens",
                   sr.max_batch_tokens, "must be an integer >= 0")
            _check(sr.pin is None or (isinstance(sr.pin, list) and sr.pin), f"{key}.pin", sr.pin,
                   "null or a non-empty list of device ids")
    from hacrl import resources# the planner: a demand no device meets fails here, before any work

    resources.check(rs, [ag.name for ag in cfg.agents])
    d = cfg.data
    _check(d.source in ("procedural", "files"), "data.source", d.source, "procedural or files")
    _check(d.on_bad_row in ("error", "skip"), "data.on_bad_row", d.on_bad_row, "error or skip")
    _check(d.completion in ("answer", "worked"), "data.completion", d.completion, "answer or worked")
    _check(d.completion == "answer" or d.source == "procedural", "data.completion", d.completion,
           "worked solutions exist for the procedural task only")
    if d.source == "procedural":
        for key in ("train_size", "heldout_size"):  # unused by files (their rows are the data)
            _in_range(f"data.{key}", getattr(d, key), (1, None, True, True))
        for lvl, w in d.levels.items():
            _check(lvl in KNOWN_LEVELS, f"data.levels.{lvl}", w, f"unknown level; choose from {', '.join(KNOWN_LEVELS)}")
            _check(float(w) >= 0, f"data.levels.{lvl}", w, "weight must be >= 0")
        _check(sum(float(w) for w in d.levels.values()) > 0, "data.levels", d.levels, "no level has weight")
    else:
        for k in ("train_path", "heldout_path"):
            p = getattr(d, k)
            _check(bool(p) and Path(p).exists(), f"data.{k}", p, "file does not exist")
    _check(len(cfg.agents) >= 1, "agents", cfg.agents, "the pool needs at least one agent")
    names = set()
    for i, ag in enumerate(cfg.agents):
        key = f"agents[{i}]"
        _check(bool(ag.name) and ag.name.replace("-", "").replace("_", "").replace(".", "").isalnum()
               and not ag.name.startswith("."), f"{key}.name", ag.name, "letters, digits, '-', '_' and '.' only")
        _check(ag.name not in names, f"{key}.name", ag.name, "duplicate agent name")
        names.add(ag.name)
        if ag.fetch is not None:
            from hacrl.agents.pretrained import FETCHERS

            _check(ag.fetch in FETCHERS, f"{key}.fetch", ag.fetch, f"choose from {', '.join(FETCHERS)}")
            _check(ag.path is not None, f"{key}.path", ag.path, "a fetched model needs the directory to write it to")
        elif ag.path is not None:
            _check(Path(ag.path).is_dir(), f"{key}.path", ag.path, "model path does not exist")
            _check((Path(ag.path) / "config.json").is_file(), f"{key}.path", ag.path,
                   "no config.json: not a Hugging Face model directory")
            tok = Path(ag.tokenizer.path or ag.path)
            _check(tok.is_dir() and any((tok / f).is_file() for f in TOKENIZER_FILES),
                   f"{key}.tokenizer.path" if ag.tokenizer.path else f"{key}.path", str(tok),
                   f"no tokenizer files ({', '.join(TOKENIZER_FILES)})")
        else:
            _check(ag.arch in KNOWN_ARCHS, f"{key}.arch", ag.arch, f"choose from {', '.join(KNOWN_ARCHS)}")
            _check(ag.tokenizer.kind in KNOWN_TOKENIZERS, f"{key}.tokenizer.kind", ag.tokenizer.kind,
                   f"unknown tokenizer kind; choose from {', '.join(KNOWN_TOKENIZERS)}")
        _check("{problem}" in ag.template, f"{key}.template", ag.template, "must contain {problem}")
        _check(0 <= ag.warmup.target_accuracy <= 1, f"{key}.warmup.target_accuracy",
               ag.warmup.target_accuracy, "must be in [0, 1]")
    return cfg


def from_dict(data: dict) -> Config:
    """Build and validate a Config from a plain mapping (e.g. loaded params.yaml)."""
    table = data.get("iterations")
    n = (data.get("experiment") or {}).get("iterations") if isinstance(data.get("experiment"), dict) else None
    if isinstance(table, dict) and isinstance(n, int) and len(table) != n:
        raise ConfigError(f"experiment.iterations: invalid value {n} (the iteration table dvc.yaml runs has "
                          f"{len(table)} entries: edit conf/ and run `hacrl config`, not params.yaml)")
    data = {k: v for k, v in data.items() if k not in GENERATED_KEYS}
    return validate(_build(Config, data, ""))


def iteration_table(n: int) -> dict[str, dict[str, int]]:
    """The dict DVC's ``foreach`` walks: stable names with an explicit previous iteration."""
    return {f"it{t}": {"it": t, "prev": t - 1} for t in range(1, n + 1)}


def _agent_overrides(overrides: list[str], conf_dir: Path) -> list[str]:
    """``agents.NAME.key=v`` and ``agents.N.key=v`` as Hydra's ``agents.pool.N.key=v``.

    The agents group holds ``{pool: [...]}`` (so that a pool is swapped whole), which makes
    ``agents.pool.1.warmup.lr`` the only spelling Hydra knows. An agent is named by its name
    (the longest that matches: names may hold dots) or its position in the pool composed from
    the other overrides; an unknown one is a one-line error listing the pool."""
    import re

    mine = [ov for ov in overrides if re.match(r"^[+~]*agents\.(?!pool\.)[^=]+\.[^=]+=", ov)]
    if not mine:
        return overrides
    base = compose([ov for ov in overrides if ov not in mine], conf_dir)
    names = [a["name"] for a in base["agents"]]
    out = []
    for ov in overrides:
        if ov not in mine:
            out.append(ov)
            continue
        sign = ov[:len(ov) - len(ov.lstrip("+~"))]
        key = ov[len(sign) + len("agents."):]
        hits = [n for n in names if key.startswith(n + ".")]
        if hits:
            name = max(hits, key=len)
            idx, rest = names.index(name), key[len(name) + 1:]
        else:
            head, _, rest = key.partition(".")
            if not head.isdigit() or int(head) >= len(names):
                raise ConfigError(f"{ov.partition('=')[0].lstrip('+~')}: no agent {head!r} in the pool "
                                  f"(names: {', '.join(names)}; or a position 0-{len(names) - 1})")
            idx = int(head)
        out.append(f"{sign}agents.pool.{idx}.{rest}")
    return out


def _check_override_key(ov: str, conf_dir: Path) -> None:
    """An override's key must name a config group or a field: else one line naming the key and
    what exists there (Hydra's own message says only that it could not override)."""
    import difflib
    import typing

    key = ov.lstrip("+~").partition("=")[0]
    parts = key.split(".")
    if parts[0] in ("hydra", "agents") or ov.startswith("+"):
        return  # Hydra's own settings; agents (resolved above); an explicit addition
    cls: Any = Config
    for i, part in enumerate(parts):
        if cls is None or not dataclasses.is_dataclass(cls):
            return  # a mapping (model_config, levels...) or an option dataclass chosen by name
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            where = ".".join(parts[:i]) or "the config"
            groups = sorted(p.name for p in conf_dir.iterdir() if p.is_dir()) if i == 0 else []
            close = difflib.get_close_matches(part, names + groups, n=1)
            hint = f"did you mean {'.'.join([*parts[:i], close[0]])!r}? " if close else ""
            raise ConfigError(f"{key}: unknown key ({hint}{where} has: {', '.join(names)})")
        if cls is AlgorithmConfig and part in ("advantage", "loss"):
            return  # options of the registered estimator / loss: checked by their dataclass
        cls = hints.get(part)


NO_EXTERNAL_INPUT = "src/hacrl/no_external_input.txt"
"""The path of the placeholder entry when nothing outside the repository is read: a file kept
for this alone and never edited (dvc.yaml's foreach needs one entry for prepare-data to have
its ``data/external`` dependency)."""


def external_inputs(cfg: Config) -> dict[str, dict[str, str]]:
    """What the experiment reads from outside the repository, for ``dvc.yaml``'s
    ``external-input`` stages (one per entry, the path its dependency): the task files and
    every real agent's model and tokenizer directories. A fetched model is written by
    prepare-pool itself (its fetch spec is in the params), so it is not one."""
    out: dict[str, dict[str, str]] = {}
    d = cfg.data
    if d.source == "files":
        out["data-train"] = {"path": str(d.train_path)}
        out["data-heldout"] = {"path": str(d.heldout_path)}
    for a in cfg.agents:
        if a.path is not None and a.fetch is None:
            out[f"agent-{a.name}"] = {"path": str(a.path)}
            if a.tokenizer.path and str(a.tokenizer.path) != str(a.path):
                out[f"tokenizer-{a.name}"] = {"path": str(a.tokenizer.path)}
    return out or {"none": {"path": NO_EXTERNAL_INPUT}}


def compose(overrides: list[str] | None = None, conf_dir: Path = CONF_DIR) -> dict:
    """Compose ``conf/`` with Hydra overrides into the plain dict written to params.yaml.
    One agent's setting: ``agents.NAME.key=value`` (or ``agents.N.key=value``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    overrides = _agent_overrides(list(overrides or []), conf_dir)
    for ov in overrides:
        _check_override_key(ov, conf_dir)
    for ov in overrides or []:
        key, _, value = ov.lstrip("+~").partition("=")
        group_dir = conf_dir / key
        if "." not in key and group_dir.is_dir() and value and not (group_dir / f"{value}.yaml").exists():
            options = sorted(p.stem for p in group_dir.glob("*.yaml"))
            raise ConfigError(f"{key}: invalid value {value!r} (unknown {key}; choose from {', '.join(options)})")
    # algorithm presets name only what differs from the registered defaults, so a plain
    # `algorithm.loss.alpha=0` may set a key its preset does not spell out: force-add those
    # (a misspelt option is then refused by the typed validation, naming the options it has)
    overrides = [f"++{ov}" if ov.startswith("algorithm.") else ov for ov in overrides or []]
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except HydraException as e:
        raise ConfigError(f"hydra: {str(e).splitlines()[0]}") from None
    data = OmegaConf.to_container(cfg, resolve=True)
    agents = data.get("agents")
    if isinstance(agents, dict):  # the group holds {pool: [...]} so that it can be swapped whole
        data["agents"] = agents.get("pool", [])
    cfg = from_dict(data)  # validate before anything is written
    # presets name only what differs from the registered defaults; params.yaml spells out every
    # value that runs, so that DVC sees a changed default and `dvc params diff` shows it
    data["algorithm"] = dataclasses.asdict(cfg.algorithm)
    data["iterations"] = iteration_table(int(data["experiment"]["iterations"]))
    data["agent_names"] = [a["name"] for a in data["agents"]]
    data["external_inputs"] = external_inputs(cfg)
    return data


def keep_extension(data: dict, overrides: list[str] | None, path: Path) -> int | None:
    """Keep the larger ``experiment.iterations`` of ``data`` and the params file at ``path``.

    ``prefect deployment run hacrl/iterate`` grows the experiment by one iteration once the
    configured ones are done; recomposing ``conf/`` (``make run``, ``hacrl config``) must not
    shrink it back (the extra iterations would leave the pipeline and the report would be rebuilt
    for fewer). Unless ``overrides`` set ``experiment.iterations`` themselves, ``data`` takes the
    file's count when it is larger (same experiment name); returns the count kept, or None.
    """
    if any(o.split("=", 1)[0].lstrip("+~") == "experiment.iterations" for o in overrides or []):
        return None
    try:
        current = yaml.safe_load(path.read_text()) or {}
        n = int(current["experiment"]["iterations"])
        same = current["experiment"].get("name") == data["experiment"].get("name")
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None
    if not same or n <= int(data["experiment"]["iterations"]):
        return None
    data["experiment"]["iterations"] = n
    data["iterations"] = iteration_table(n)
    return n


def write_params(data: dict, path: Path) -> None:
    """Write params.yaml atomically."""
    from hacrl.storage import atomic_write_text

    header = "# Generated by `hacrl config` from conf/ -- edit conf/ (or pass overrides), not this file.\n"
    atomic_write_text(path, header + yaml.dump(data, Dumper=_Yaml12Dumper, sort_keys=False))


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``5e-4`` as the float YAML 1.2 (Hydra, DVC) reads, not as
    a string (YAML 1.1 wants a dot in a float)."""


class _Yaml12Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting every string the YAML 1.2 reader would take for a number
    (``'2e4'``, a commit id such as ``'7e69083'``), so params.yaml reads back as it was written."""


_FLOAT_12 = __import__("re").compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
for _cls in (_Yaml12Loader, _Yaml12Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def read_yaml(path: str | os.PathLike) -> Any:
    """A YAML file as Hydra and DVC read it (``5e-4`` is a number); a syntax error is one line."""
    try:
        with open(path) as f:
            return yaml.load(f, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None


def load(path: str | os.PathLike | None = None) -> Config:
    """Load and validate params.yaml (``HACRL_PARAMS`` or ./params.yaml by default)."""
    p = Path(path or os.environ.get("HACRL_PARAMS", "params.yaml"))
    if not p.exists():
        raise ConfigError(f"params: file {str(p)!r} does not exist (run `hacrl config` first)")
    data = read_yaml(p)
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of settings, got {type(data).__name__}")
    return from_dict(data or {})
