"""The typed settings: every key of the configuration, its default, what it accepts, and why.

This module is the one home of a setting's default: ``conf/`` holds presets that state only
what they change (a pool, an algorithm, an experiment's budgets), ``hacrl config`` composes
them over these defaults (:mod:`hacrl.pipeline.params`) and writes every value out to
``params.yaml``. What a single setting accepts besides its type (a range, a set of choices, a
pattern) is declared with it through :func:`setting` and checked whenever the dataclass is
built, from YAML or in Python; checks that need other parts of the package (registered
algorithms, engines, record types, the resource plan, paths on disk) are in
:mod:`hacrl.pipeline.checks`. Nothing here imports more than the standard library.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from hacrl.errors import ConfigError
from hacrl.storage import RunLayout

_NO_DEFAULT = dataclasses.MISSING


def _num(x: float) -> str:
    """A bound as people write it: whole numbers in full (4294967295, not 4.29497e+09)."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else f"{x:g}"


@dataclass(frozen=True)
class Rule:
    """What one setting accepts besides its type: a range, a set of choices and/or a pattern."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple | None = None
    pattern: str | None = None
    why: str | None = None
    """Said after the rule when a value breaks it (what the bound protects)."""

    def problem(self, value: Any) -> str | None:
        """Why ``value`` breaks the rule (the text inside the error's parentheses), or None."""
        if value is None:
            return None
        if self.choices is not None and value not in self.choices:
            return self._said(f"choose from {', '.join(map(str, self.choices))}")
        if self.pattern is not None and not (isinstance(value, str) and re.fullmatch(self.pattern, value)):
            return self._said("does not match")
        values = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else [value]
        if (self.lo is not None or self.hi is not None) and any(
                isinstance(v, (int, float)) and not isinstance(v, bool) and not self._in_range(v) for v in values):
            left = "" if self.lo is None else f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
            right = "" if self.hi is None else f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
            return self._said(f"must be {' and '.join(x for x in (left, right) if x)}")
        return None

    def _in_range(self, v: float) -> bool:
        if math.isnan(v):
            return False
        lo_ok = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        hi_ok = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return lo_ok and hi_ok

    def _said(self, text: str) -> str:
        return text if self.why is None else (self.why if text == "does not match" else f"{text}: {self.why}")


def setting(default: Any = _NO_DEFAULT, *, factory: Any = _NO_DEFAULT, ge: float | None = None,
            gt: float | None = None, le: float | None = None, lt: float | None = None,
            choices: tuple | None = None, pattern: str | None = None, why: str | None = None) -> Any:
    """A dataclass field with its rule: ``ge``/``gt``/``le``/``lt`` bound a number (each item of a
    list of numbers), ``choices`` lists the values allowed, ``pattern`` is a regular expression a
    string must match whole, ``why`` is said with a broken rule."""
    rule = Rule(lo=gt if gt is not None else ge, hi=lt if lt is not None else le,
                lo_open=gt is not None, hi_open=lt is not None,
                choices=tuple(choices) if choices is not None else None, pattern=pattern, why=why)
    kw: dict[str, Any] = {"metadata": {"rule": rule}}
    if factory is not _NO_DEFAULT:
        kw["default_factory"] = factory
    elif default is not _NO_DEFAULT:
        kw["default"] = default
    return field(**kw)


def check_rules(obj: Any) -> None:
    """Raise a one-line :class:`ConfigError` (``FIELD: invalid value V (WHY)``) for the first
    field of dataclass instance ``obj`` that breaks its rule; a builder prefixes the key path."""
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("rule")
        if rule is not None:
            value = getattr(obj, f.name)
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for k, v in items:  # a mapping's bad entry is named by its key
                problem = rule.problem(v)
                if problem is not None:
                    raise ConfigError(f"{f.name}{'' if k is None else f'.{k}'}: invalid value {v!r} ({problem})")


def require(cond: bool, key: str, value: Any, why: str) -> None:
    """A check across settings: ``KEY: invalid value V (WHY)`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}: invalid value {value!r} ({why})")


class Settings:
    """Base of every settings dataclass: its fields' rules are checked when it is made, and a
    subclass adds checks across its own fields in ``check``."""

    def __post_init__(self) -> None:
        check_rules(self)
        self.check()

    def check(self) -> None:
        """Checks across this dataclass's fields (none by default)."""


# ----------------------------------------------------------------------------- the experiment

@dataclass
class ExperimentConfig(Settings):
    """The experiment as a whole: its name, seed, length and where its files go."""

    name: str = setting("embedded-arith", pattern=r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}",
                        why="letters, digits, spaces, '.', '_' and '-', starting with a letter or digit")
    """The experiment's name: MLflow experiment, registered-model prefix, Prefect artifact key."""
    seed: int = setting(0, ge=0, le=2**32 - 1)
    """Master seed: task data, warm-up, prompt choice per iteration and sampling derive from it."""
    pool_seed: int | None = setting(None, ge=0, le=2**32 - 1)
    """Seed of the pool alone: an embedded agent's initial weights and every agent's warm-up
    (null: the initial weights' fixed seed 0 and ``experiment.seed`` for the warm-up). The task data
    stay those of ``experiment.seed``: a comparison varies warm-up pools on the same problems."""
    iterations: int = setting(6, ge=1, le=10_000)
    """Number of RL iterations; each one is the six stages. Raising it runs only new ones."""
    threads: int = setting(2, ge=1, le=1024)
    """torch intra-op threads per stage process (never run two 2-thread torch jobs at once)."""
    runs_dir: str = "runs"
    """Where the iterations' artifacts go (``runs/itT/...``, DVC-tracked)."""
    reports_dir: str = "reports"
    """Where the report stage writes the summary, curves and plots."""


@dataclass
class FieldsConfig(Settings):
    """Which field of a task file's rows is what (``data.source=files``). A dotted name reaches
    into nested objects (verl's ``reward_model.ground_truth``); a problem field holding a chat (a
    list of ``{role, content}`` messages, verl's ``prompt``) gives its last user message."""

    id: str | None = "id"
    """The row's id; absent (or null): ``<file stem>-<row number>``. Ids must be unique in a file."""
    problem: str = "problem"
    """The problem text, or a chat whose last user message is the problem."""
    answer: str = "answer"
    """The field holding the gold answer (see ``data.answer_format``)."""
    level: str | None = "level"
    """The row's level (per-level accuracy); absent (or null): ``all``."""


@dataclass
class DataConfig(Settings):
    """The task: the built-in procedural arithmetic, or local problem files."""

    source: str = setting("procedural", choices=("procedural", "files", "reasoning_gym"))
    """``procedural`` (built-in arithmetic task), ``files`` (local JSONL/Parquet) or
    ``reasoning_gym`` (the field's procedural task generators, ``data.tasks``)."""
    tasks: dict[str, float] = setting(factory=dict, ge=0)
    """``reasoning_gym``: its generators and their sampling weights (``{basic_arithmetic: 0.5,
    chain_sum: 0.5}``); a split's problems are mixed by weight."""
    task_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``reasoning_gym``: each generator's own settings (the fields of its config class: terms,
    digits, operators, ...), e.g. ``{chain_sum: {min_terms: 2, max_terms: 3, max_digits: 2}}``."""
    levels: dict[str, float] = setting(factory=dict, ge=0)
    """Difficulty levels of the procedural task and their sampling weights (add, sub, add3, mul,
    frac). A task preset states its mix whole (``conf/data/arith.yaml``: add 0.4, sub 0.4, add3
    0.2); a level is added with ``+data.levels.mul=0.5``, removed with ``~data.levels.add``."""
    max_operand: int = setting(99, ge=1, le=10**9)
    """The largest operand of a procedural problem."""
    train_size: int = setting(15000, ge=0, le=10**8)
    """Procedural (or reasoning-gym) training problems (>= 1 for a generated task)."""
    heldout_size: int = setting(1200, ge=0, le=10**7)
    """Procedural (or reasoning-gym) held-out problems (the evaluation's; >= 1 for a generated task)."""
    dev_size: int = setting(300, ge=1, le=10**7)
    """Dev problems: the warm-up's stopping set (files: drawn from the training file)."""
    heldout_fraction: float = setting(0.2, gt=0, lt=1)
    """Fraction of the problem space reserved (by hash of the problem text) for held-out and dev
    problems (procedural and reasoning-gym tasks)."""
    train_path: str | None = None
    """``files``: the training problems (a JSONL or Parquet file, or a ``datasets.save_to_disk``
    directory; see ``data.format``, ``data.fields``, ``data.answer_format``)."""
    heldout_path: str | None = None
    """``files``: the held-out problems, same format."""
    format: str = setting("auto", choices=("auto", "jsonl", "parquet", "hf_disk"))
    """``files``: how the task files are stored: ``jsonl``, ``parquet``, ``hf_disk`` (a
    ``datasets.save_to_disk`` directory, read with ``datasets.load_from_disk``), or ``auto`` (a
    directory is ``hf_disk``, ``*.parquet`` Parquet, anything else JSONL)."""
    fields: FieldsConfig = field(default_factory=FieldsConfig)
    """``files``: which field of a row is the id, the problem, the answer and the level."""
    answer_format: str = setting("raw", choices=("raw", "boxed", "gsm8k"))
    """``files``: where the gold answer is inside the answer field: ``raw`` (the whole field),
    ``boxed`` (the last ``\\boxed{...}`` of a worked solution, MATH's layout) or ``gsm8k`` (what
    follows ``####``, thousands separators dropped)."""
    on_bad_row: str = setting("error", choices=("error", "skip"))
    """``error``: a malformed row fails with file and line; ``skip``: skipped and counted."""
    heldout_overlap: str = setting("error", choices=("error", "drop"))
    """A held-out problem whose text (case and spacing aside) is also a training or dev problem:
    ``error`` refuses the files (held-out accuracy would be measured on training problems);
    ``drop`` removes it from the held-out set, counted in ``data/tasks/manifest.json``."""
    completion: str = setting("answer", choices=("answer", "worked"))
    """What the warm-up targets write after the prompt: the boxed ``answer`` alone, or a short
    ``worked`` solution before it (procedural task only; responses of tens of tokens, so raise
    ``rollout.max_new_tokens`` and ``eval.max_new_tokens`` to match)."""

    def check(self) -> None:
        require(self.completion == "answer" or self.source == "procedural", "completion", self.completion,
                "worked solutions exist for the procedural task only")
        if self.source in ("procedural", "reasoning_gym"):
            for key in ("train_size", "heldout_size"):  # unused by files (their rows are the data)
                require(getattr(self, key) >= 1, key, getattr(self, key), "must be >= 1")


# ----------------------------------------------------------------------------- the pool

@dataclass
class TokenizerConfig(Settings):
    kind: str = "bytelevel_bpe"
    """An embedded agent's tokenizer, trained on the task's texts (``hacrl.agents.pool``:
    bytelevel_bpe, metaspace_bpe, bytelevel_unigram)."""
    vocab_size: int = setting(300, ge=1, le=10**7)
    """Vocabulary of the trained tokenizer (specials and the byte alphabet included)."""
    path: str | None = None
    """For a real model: a local tokenizer directory (defaults to the model path)."""


@dataclass
class WarmupConfig(Settings):
    target_accuracy: float = setting(0.3, ge=0, le=1)
    """Stop the supervised warm-up once dev accuracy reaches this (weak/mid/strong pool)."""
    max_steps: int = setting(0, ge=0, le=10**8)
    """Supervised warm-up budget in steps; 0 (the default, e.g. for a real pretrained model) skips it."""
    min_steps: int = setting(0, ge=0, le=10**8)
    """Steps before the target may stop the warm-up."""
    lr: float = setting(3e-3, gt=0, le=1.0)
    """AdamW's learning rate of the supervised warm-up."""
    batch_size: int = setting(128, ge=1, le=10**6)
    """Problems per warm-up step."""
    eval_every: int = setting(100, ge=1, le=10**8)
    """Steps between two dev evaluations (each may stop the warm-up)."""


@dataclass
class AgentTrainerConfig(Settings):
    """What a user sets per model (``agents.<name>.trainer.*``), over ``trainer.*``: a 270M model
    and a 135M one rarely want the same step. Unset (null): the pool's ``trainer`` value."""

    lr: float | None = setting(None, gt=0, le=1.0)
    lr_warmup_updates: int | None = setting(None, ge=0, le=10**8)
    weight_decay: float | None = setting(None, ge=0, le=10.0)
    grad_clip: float | None = setting(None, gt=0, le=1e6)
    micro_batch_tokens: int | None = setting(None, ge=0, le=10**9)
    micro_batch_samples: int | None = setting(None, ge=0, le=10**8)

    def given(self) -> dict[str, Any]:
        """The settings this agent sets (the others follow ``trainer``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@dataclass
class AgentConfig(Settings):
    """One agent of the pool: an embedded model built from a transformers config, or a real one
    given by path (or fetched offline)."""

    name: str = ""
    """Letters, digits, '-', '_' and '.'; unique in the pool (checked with the pool)."""
    arch: str = "gpt2"
    """transformers architecture for an embedded model (``hacrl.agents.pool``: gpt2, llama, qwen2)."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the transformers config class (hidden size, layers, ...)."""
    path: str | None = None
    """A Hugging Face model directory: when set the agent is a real model and is not built."""
    fetch: str | None = None
    """A pretrained model the project fetches offline (:mod:`hacrl.agents.pretrained`: ``smollm2``,
    ``gemma3_270m``):
    prepare-pool writes it to ``path`` when that directory does not exist yet."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    template: str = setting("Q: {problem}\nA:", pattern=r"(?s).*\{problem\}.*", why="must contain {problem}")
    """The agent's own prompt template; ``{problem}`` is replaced by the problem text."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a response (a base model's few-shot format: ``["\\n\\n"]``): each
    completion is cut after the token that completes the first of them, by every engine alike,
    and then ends as one stopped by EOS does."""
    chat: bool = False
    """Instruct models: the filled template becomes the user turn of the tokenizer's chat
    template, followed by the opened assistant turn (``apply_chat_template`` with
    ``add_generation_prompt``)."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    trainer: AgentTrainerConfig = field(default_factory=AgentTrainerConfig)
    """This agent's own RL update settings (lr, warm-up, weight decay, grad clip, memory budget)."""

    @property
    def tokenizer_id(self) -> str:
        """What identifies the agent's tokenizer in records: the trained kind, or the directory."""
        return self.tokenizer.kind if self.path is None else str(self.tokenizer.path or self.path)


# ----------------------------------------------------------------------------- the algorithm

@dataclass
class ThlConfig(Settings):
    """Tokenizer Heterogeneity Layer (docs/ALGORITHMS.md, "THL"): how a peer's response becomes
    the learner's tokens, and how the peer's log-prob trace is carried onto them."""

    peer_eos: str = setting("keep_if_stopped", choices=("keep_if_stopped", "drop"))
    """``keep_if_stopped``: a peer response that ended with EOS gets the learner's EOS appended, and
    the peer's EOS log-prob stays in its trace; ``drop``: no EOS on the learner side, and the
    peer's terminal EOS is left out of its trace (sum, mean and count)."""
    segmentation: str = setting("whitespace", choices=("whitespace", "unicode_words"))
    """Words of the response text: ``whitespace`` (maximal runs of non-space characters) or
    ``unicode_words`` (runs of word characters, and every other non-space character alone)."""
    refine_shared_boundaries: bool = True
    """Inside a word, also cut at every character position where both tokenizations have a token
    boundary, so identical tokenizations align token for token; False spreads each word's mass
    evenly over the learner tokens of the word."""
    residual_sample: int = setting(512, ge=0, le=10**7)
    """Records per producer on which exchange-and-align measures THL's residuals for the pairs
    that the subscription does not retokenise (the pairs it does are measured on every record)."""


@dataclass
class StreamConfig(Settings):
    """One stream of a learner's subscription (docs/ALGORITHMS.md, "SEE")."""

    record_type: str = "trajectory"
    """``trajectory`` (every verified sample), ``verified_success`` (samples judged correct) or
    ``reward_stats`` (per producer and prompt: n, successes, mean, std)."""
    producers: str = setting("self", choices=("self", "peers", "all"))
    """Whose records: ``self`` (the learner's own), ``peers`` (every other agent's) or ``all``."""
    verdicts: list[str] | None = None
    """Keep only records with these verdicts (``[correct]``: verified only); null keeps all."""
    content: str = setting("response", choices=("response", "gold"))
    """What a peer row carries: the peer's ``response`` (retokenised and aligned by THL), or the
    task's ``gold`` completion for the row's problem (the text the warm-up teaches, in the
    learner's own tokens; no producer trace) -- the oracle control: the same rows, hence the same
    gates, but the answer injected rather than a peer's text. Own rows are always their own."""

    def check(self) -> None:
        require(self.verdicts is None or bool(self.verdicts), "verdicts", self.verdicts,
                "null or a non-empty list of verdicts")
        require(self.content == "response" or self.record_type in ("trajectory", "verified_success"), "content",
                self.content, "gold only on a trajectory or verified_success stream")


@dataclass
class CapabilityConfig(Settings):
    """Capability statistics of compute-capability-stats (docs/ALGORITHMS.md, "Capability")."""

    window: int = setting(5, ge=1, le=10**6)
    """K: P_hat is the mean step accuracy over the last K steps, the current one included."""
    omega_min: float = setting(0.1, gt=0, le=1)
    """Lower clamp of the capability ratio."""
    omega_max: float = setting(10.0, ge=1, le=10**6)
    """Clamp of the capability ratio omega[a][b] = P_hat[a] / P_hat[b]: 0 < omega_min <= 1 <= omega_max."""
    warmup_steps: int = setting(0, ge=0, le=10**8)
    """Steps during which omega is fixed to 1."""


def _default_subscription() -> list[StreamConfig]:
    return [StreamConfig()]


MINIBATCH_ORDERS = ("prompt_groups", "source_blocks", "self_first")


@dataclass
class AlgorithmConfig(Settings):
    """An algorithm is its YAML under ``conf/algorithm/``: a label, a registered advantage
    estimator and a registered loss (each with its own options, the fields of the config
    dataclass registered with it in ``hacrl.rl.algorithms``), and a subscription."""

    name: str = setting("grpo", pattern=r"(?s).*\S.*", why="a non-empty label")
    """A label for reports and MLflow (the preset's file name)."""
    advantage: Any = field(default_factory=lambda: {"name": "grpo"})
    """``{name: <registered estimator>, <its options>}``; after validation its options dataclass."""
    loss: Any = field(default_factory=lambda: {"name": "grpo"})
    """``{name: <registered loss>, <its options>}``; after validation its options dataclass."""
    subscription: list[StreamConfig] = setting(factory=_default_subscription)
    """What the learner takes from the experience stream, in this order; trajectory-shaped records
    become its training rows (within a stream its own first), the other types side tables (e.g.
    pooled reward statistics). Streams may not overlap."""
    kl_coef: float = setting(0.0, ge=0, le=100.0)
    """beta of the low-variance KL (k3) to the initial model, on the learner's own samples; 0: off."""
    kl_clamp: float | None = setting(10.0, gt=0, le=1e6, why="the clamp of each token's KL value; null turns it off")
    """Clamp of the k3 term as verl's ``low_var_kl``: each token's log-ratio to ``[-2c, 2c]`` and its
    value to ``[-c, c]`` (verl: 20 and 10); null: unclamped (the runs kept before it existed). A
    policy far from the initial model otherwise lets single tokens dominate the term (seen: a
    step's mean of 7e6 nats where the on-policy KL stayed under 2)."""
    norm_match: bool = False
    """The norm-matched control of a sharing loss (``hacpo_normmatch``): each update's gradient from
    peers' samples is replaced by a step of the same norm along the learner's own samples' gradient
    (of the update's own rows, or, in an update of peers' samples only, of the own block's
    mini-batch at the same place). Separates how big a step sharing adds from where it points.
    Needs a loss that can drop its cross terms (HACPO) and ``trainer.world_size`` 1."""
    sample_multiplier: int = setting(1, ge=1, le=64)
    """Samples per prompt = rollout.group_size * this (GSPO x2 uses 2)."""
    minibatch_order: str = setting("prompt_groups", choices=MINIBATCH_ORDERS)
    """The update layout (docs/ALGORITHMS.md, "Update layout"). ``prompt_groups``: mini-batches of
    ``trainer.mini_batch_prompts`` whole prompt groups in seeded order, reshuffled per epoch;
    ``source_blocks`` (HACPO reference trainer): one block per source, the learner's own first,
    each cut into mini-batches of ``mini_batch_prompts * group_size`` samples (whole prompt
    groups), none mixing sources, no shuffle, so a learner of n sources takes n times the
    updates; ``self_first`` (the earlier layout here): own samples first, then the others', cut
    into ceil(P / mini_batch_prompts) mini-batches that may mix sources."""
    capability: CapabilityConfig = field(default_factory=CapabilityConfig)
    thl: ThlConfig = field(default_factory=ThlConfig)

    def check(self) -> None:
        require(bool(self.subscription), "subscription", self.subscription, "at least one stream")

    @property
    def shares(self) -> bool:
        """Whether a learner takes anything from other agents."""
        return any(s.producers != "self" for s in self.subscription)


# ----------------------------------------------------------------------------- rollouts, updates, rewards

@dataclass
class RolloutConfig(Settings):
    """What generate-rollouts samples: the step's prompts, G samples each, per agent."""

    engine: str = "hf"
    """Rollout engine, a name of the engine table (``hacrl.rollout.table``): ``hf`` (transformers
    generate in the stage's process) or ``vllm`` (vLLM in its own environment and process, ``make
    setup-vllm``; options under ``engines``)."""
    group_size: int = setting(8, ge=2, le=4096, why="group-relative advantages need at least 2 samples per prompt")
    """G: samples per prompt per agent."""
    prompts_per_iteration: int = setting(512, ge=1, le=10**7)
    """The same prompts for every agent, chosen from the seed and the iteration."""
    temperature: float = setting(1.0, gt=0, le=100.0)
    """Sampling temperature; the recorded log-probs are at this temperature, as the trainer's."""
    top_p: float = setting(1.0, gt=0, le=1)
    """Nucleus sampling (1: off; the recorded log-probs do not fold it in)."""
    sampler: str = setting("multinomial", choices=("multinomial", "inverse_cdf"))
    """How the transformers engine draws each token (vLLM samples with its own): ``multinomial``,
    transformers' own ``torch.multinomial``, which draws one exponential variate per vocabulary
    entry per row and step (0.2 s a step for 64 rows of Gemma's 262k vocabulary on 2 cores, a fifth
    of its generation); ``inverse_cdf``, one uniform variate per row and step against the cumulative
    distribution. The same distribution (temperature, top-p) and the same log-probs, other tokens
    for a given seed: a run's numbers change, not what they estimate."""
    max_new_tokens: int = setting(20, ge=1, le=1 << 20)
    """Response budget per sample (a response cut here is ``finish_reason: length``)."""
    batch_size: int = setting(512, ge=1, le=10**7)
    """Sequences per generate call (an engine that schedules its own batches, vLLM, ignores it)."""


@dataclass
class TrainerConfig(Settings):
    """How update-policies updates each learner (DeepSpeed or plain torch, AdamW)."""

    backend: str = setting("deepspeed", choices=("deepspeed", "torch"))
    """``deepspeed``: a DeepSpeed engine (the CPU accelerator with gloo here) around a client torch
    AdamW; ``torch``: the same optimizer without DeepSpeed."""
    zero_stage: int = setting(0, choices=(0, 1, 2, 3))
    """DeepSpeed ZeRO stage (0-2 at world size > 1: the export needs whole weights on every rank)."""
    lr: float = setting(5e-4, gt=0, le=1.0)
    """The RL learning rate (AdamW)."""
    lr_warmup_updates: int = setting(10, ge=0, le=10**8)
    """Linear ramp of the RL learning rate over the first updates (fresh optimizers collapse)."""
    mini_batch_prompts: int = setting(128, ge=1, le=10**7)
    """Whole prompt groups per optimizer update (512 prompts / 128: 4 updates of 1,024 samples per
    iteration in the embedded experiment)."""
    epochs: int = setting(1, ge=1, le=1000)
    """Passes over a learner's input per iteration."""
    grad_clip: float = setting(1.0, gt=0, le=1e6)
    """Clip of the gradient norm per optimizer update."""
    weight_decay: float = setting(0.0, ge=0, le=10.0)
    """AdamW's decoupled weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """Adam's (beta1, beta2): two numbers in [0, 1)."""
    dtype: str = setting("fp32", choices=("fp32", "bf16"))
    """Weights' and activations' dtype in the trainer (and vLLM's). ``bf16``: the model computes in
    bf16, DeepSpeed keeps fp32 master weights for the optimizer, and log-probs, ratios and losses
    are computed in fp32; with ZeRO >= 1 micro-batch gradients also accumulate in fp32
    (docs/SCALING.md, "bf16")."""
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
    Reported as ``kl_init_before_step``; the comparison suites switch it on for every contender.
    A measurement, never clamped (``algorithm.kl_clamp`` bounds the loss's term, ``kl_to_init``)."""
    micro_batch_tokens: int = setting(0, ge=0, le=10**9)
    """What one forward (with its backward) holds, in padded tokens (rows x the longest row's prompt +
    response); 0: no limit. A mini-batch (one optimizer update: what the algorithm and the update
    layout define) is cut into micro-batches within this budget, rows of similar length together
    (verl's dynamic batch size); gradients accumulate and the optimizer steps once per mini-batch,
    with every loss normalised over the whole mini-batch (docs/SCALING.md, "Memory"). The same
    budget bounds the no-grad passes (pi_old, the reference model). A row longer than the budget
    is a micro-batch of its own (said once); nothing is truncated."""
    micro_batch_samples: int = setting(0, ge=0, le=10**8)
    """At most this many rows per micro-batch as well (0: no limit)."""
    logprob_chunk: int = setting(1024, ge=1, le=1 << 20)
    """Positions whose vocabulary-wide softmax is computed at once when scoring tokens: no
    full-vocabulary log-prob tensor is kept, only a chunk's (about chunk x vocabulary x 4 bytes)."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward instead of keeping them
    (transformers' ``activation_checkpointing_enable``, non-reentrant): the training forward's
    activation memory drops from every layer's to one layer's plus the layer inputs, for about a
    third more compute. The no-grad passes never keep activations anyway."""
    share_prompt_prefix: bool = False
    """Run each distinct prompt of a micro-batch once in the update's forwards (its rows take its
    keys and values; the gradients flow back through them): a prompt's G samples, and a sharing
    learner's peer responses rendered in its template, share one prefill. The same distributions
    to float rounding (other matrix shapes), so not bit for bit; on a pool whose prompts are
    longer than its responses (a few-shot template) the update's transformer work falls
    several-fold. The language-model head then projects the response tokens only, not the
    padding of shorter responses. Micro-batches then hold whole prompt groups."""
    skip_empty_updates: bool = False
    """Skip the optimizer step of an update whose gradient is exactly zero (every sample clipped
    out of its window, e.g. a block of peers' samples no cross ratio reaches): no AdamW step, so
    neither momentum nor weight decay moves the weights, and the lr warm-up does not advance. Off:
    the reference trainer's behaviour (it steps anyway). Either way the step reports
    ``empty_updates`` (absent: none) and, when on, ``skipped_updates``."""
    world_size: int = setting(1, ge=1, le=4096)
    """Processes per learner update (DeepSpeed data parallelism, gloo on the CPU, NCCL on GPUs):
    each rank takes whole prompt groups of every mini-batch and the gradients are averaged, so
    the update equals the single-process one up to float rounding (docs/SCALING.md). ZeRO 0-2."""

    def check(self) -> None:
        require(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas), "adam_betas", self.adam_betas,
                "two numbers in [0, 1)")
        require(self.dtype != "bf16" or self.backend == "deepspeed", "backend", self.backend,
                "bf16 needs the deepspeed backend (it keeps the fp32 master weights; torch's AdamW would step bf16 weights)")
        if self.world_size > 1:
            require(self.backend == "deepspeed", "backend", self.backend, "world_size > 1 needs the deepspeed backend")
            require(self.zero_stage <= 2, "zero_stage", self.zero_stage,
                    "ZeRO 3 partitions the weights; the export needs ZeRO 0-2 when world_size > 1")


@dataclass
class RewardConfig(Settings):
    """How verify-rewards checks answers (math-verify in killable worker processes)."""

    timeout_s: float = setting(5.0, gt=0, le=3600.0)
    """Per-answer limit; a hung check is killed, its record gets verdict ``timeout``."""
    workers: int = setting(2, ge=1, le=64, why="each worker is a process (about 22 MB measured), and more of them than cores buy no speed")
    """Verifier processes."""
    fast_path: bool = True
    """Settle a canonical integer gold against a response that is exactly ``\\boxed{N}`` by
    comparing the digit strings (math-verify's own verdict on such pairs, tested) instead of
    sending it to math-verify; ``false`` sends every answer to math-verify."""


@dataclass
class EvalConfig(Settings):
    """Greedy pass@1 on the held-out split after every iteration (and of the warm-up)."""

    batch_size: int = setting(600, ge=1, le=10**7)
    """Sequences per generate call."""
    max_new_tokens: int = setting(20, ge=1, le=1 << 20)
    """Response budget of a held-out answer."""
    split: str = setting("heldout", choices=("heldout", "dev"))
    """What is evaluated: the ``heldout`` split, or ``dev`` (carved from train): tuning runs
    (``hacrl compare --tune``) choose their settings on dev, so held-out is read only for the
    final report."""


# ----------------------------------------------------------------------------- how it runs (no effect on results)

@dataclass
class VllmSettings(Settings):
    """``rollout.engine: vllm``: how its worker process runs (the engine table's ``vllm`` row
    reads this section; no effect on results)."""

    python: str = ".venv-vllm/bin/python"
    """The vLLM environment's interpreter (relative to the project root), built by ``make setup-vllm``;
    Python 3.11 or later (the worker starts with ``-P``)."""
    threads: int = setting(0, ge=0, le=4096)
    """CPU threads of a vLLM worker on a CPU host (0: the job's share of ``experiment.threads``)."""
    kv_cache_gib: int = setting(1, ge=1, le=1 << 20)
    """KV cache of a vLLM worker on a CPU host (``VLLM_CPU_KVCACHE_SPACE``)."""
    max_model_len: int = setting(0, ge=0, le=1 << 24)
    """Prompt + response tokens per sequence (0: the model's ``max_position_embeddings``, at most 4096)."""
    gpu_memory_utilization: float = setting(0.85, gt=0, le=1)
    """Fraction of a GPU's memory vLLM may take (GPU hosts only)."""
    timeout_s: float = setting(900.0, gt=0, le=86400.0)
    """A vLLM worker that does not answer a request (start-up included) in this time is stopped."""


@dataclass
class EnginesConfig(Settings):
    """How the rollout engines run (no effect on results: the engine itself is ``rollout.engine``).
    An engine with settings of its own has a section here, named by its row of the engine table."""

    vllm: VllmSettings = field(default_factory=VllmSettings)
    host: bool = True
    """Stages run by ``dvc repro``, Prefect or ``hacrl stage`` get their engine processes (vLLM
    workers) from the workspace's engine host, which keeps them across stages and iterations and
    syncs each to the checkpoint a stage reads (docs/ARCHITECTURE.md, "Engine host"); false:
    every stage starts its own. ``HACRL_ENGINE_HOST=0`` turns it off too. (``hacrl run`` keeps
    its engines in its own process.)"""
    host_idle_s: float = setting(900.0, gt=0, le=86400)
    """The engine host stops an engine no stage used for this long, and exits once it serves none."""
    logprob_check_samples: int = setting(0, ge=0, le=10**7)
    """Sequences per agent and iteration on which generate-rollouts compares the engine's sampled
    log-probs with the trainer's forward on the same tokens (logged as ``logprob_gap_mean`` /
    ``logprob_gap_max``); 0: no check at rollout time. Off by default: update-policies measures
    the same gap on every learner's own samples from the forward it runs anyway
    (``gen_vs_train_logprob_maxdiff``), where this check costs a forward of its own (on
    SmolLM2-135M, 64 sequences took a third of the stage's time). Turn it on to vet an engine."""


@dataclass
class OrchestrationConfig(Settings):
    """How ``prefect deployment run hacrl/iterate`` drives the DVC stages (no effect on results)."""

    retries: int = setting(1, ge=0, le=100)
    """Retries of a failed stage task (transient failures; config and data errors never retry)."""
    retry_delay_s: float = setting(5.0, ge=0, le=86400.0)
    """Seconds between a failed stage task and its retry."""
    lock_timeout_s: float = setting(600.0, ge=0, le=7 * 86400.0)
    """How long a second iterate run waits for the workspace lock before failing (0: fail at once)."""
    gpu_routing: str = setting("auto", choices=("auto", "pool", "local"))
    """``auto``: run update-policies on ``gpu_pool`` when a worker is online there, else in the
    flow (CPU pool); ``pool``: always on ``gpu_pool``; ``local``: always in the flow."""
    gpu_pool: str = "gpu"
    """The Prefect work pool of GPU stages (``hacrl serve`` creates it)."""
    gpu_deployment: str = setting("hacrl-stage/gpu", pattern=r".*/.*", why="flow/deployment")
    """The deployment (flow/name) that runs one stage on ``gpu_pool``."""
    cpu_pool: str = "cpu"
    """The Prefect work pool of the iterate flow."""


@dataclass
class TrackingConfig(Settings):
    """MLflow lineage. URI: ``uri`` if set, else ``$MLFLOW_TRACKING_URI``, else a project sqlite file."""

    enabled: bool = True
    """Log every stage to MLflow (False: no store is touched)."""
    uri: str | None = None
    """The tracking URI (credentials in it are redacted wherever it is logged)."""
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
class DeviceConfig(Settings):
    """One device of the inventory."""

    id: str = setting("cpu", pattern=r"cpu|cpu:\d+|cuda:\d+", why="cpu, cpu:N (a share of the host's cores) or cuda:N")
    """``cpu`` (the host), ``cpu:N`` (an equal share of the host's ``experiment.threads`` cores,
    so that jobs on different shares run at once) or ``cuda:N`` (given to the job's processes as
    ``CUDA_VISIBLE_DEVICES``)."""
    memory_gib: float = setting(0.0, ge=0, le=1 << 20)
    """Memory a job may use there; 0: not declared (not checked, e.g. the CPU host)."""


@dataclass
class StageResources(Settings):
    """What one agent's job of one stage needs."""

    devices: int = setting(1, ge=0, le=1 << 16)
    """Devices the job spans: vLLM's tensor-parallel size for a rollout, DeepSpeed's world size
    for an update."""
    memory_gib: float = setting(0.0, ge=0, le=1 << 20)
    """Memory per device; 0: not checked."""
    max_batch_tokens: int = setting(0, ge=0, le=1 << 32)
    """Token budget per forward batch given to the engine (0: the engine's default)."""
    pin: list[str] | None = None
    """Explicit device ids (else the planner chooses); ``devices`` then counts them."""

    def check(self) -> None:
        require(self.pin is None or bool(self.pin), "pin", self.pin, "null or a non-empty list of device ids")


@dataclass
class AgentResourcesConfig(Settings):
    """One agent's needs, per stage kind."""

    rollout: StageResources = field(default_factory=StageResources)
    """Rollouts and evaluation (the generation engine)."""
    update: StageResources = field(default_factory=StageResources)
    """Its policy updates (the trainer)."""


@dataclass
class ResourcesConfig(Settings):
    """MWRA (docs/SCALING.md): the device inventory and each agent's needs; ``hacrl resources``
    prints the plan. No effect on results, only on where and when jobs run."""

    devices: list[DeviceConfig] = field(default_factory=lambda: [DeviceConfig()])
    """E.g. on a GPU host: ``[{id: "cuda:0", memory_gib: 80}, ...]``; memory 0: not declared."""
    engines_alive: int = setting(0, ge=0, le=1 << 16)
    """Rollout engines alive at once (0: as many as the devices allow)."""
    engine_release: str = setting("sleep", choices=("sleep", "stop"))
    """What an engine does when an update needs its devices: ``sleep`` (vLLM sleep mode: weights
    and KV cache leave the device, the process stays) or ``stop``."""
    default: AgentResourcesConfig = field(default_factory=AgentResourcesConfig)
    """The needs of an agent not listed in ``agents``."""
    agents: dict[str, AgentResourcesConfig] = field(default_factory=dict)
    """Per agent name, e.g. ``{qwen-7b: {update: {devices: 4, memory_gib: 60}}}``."""

    def check(self) -> None:
        ids = [x.id for x in self.devices]
        require(bool(ids), "devices", self.devices, "the inventory needs at least one device")
        require(len(set(ids)) == len(ids), "devices", ids, "duplicate device id")
        require(not ("cpu" in ids and any(x.startswith("cpu:") for x in ids)), "devices", ids,
                "either the whole host (cpu) or shares of it (cpu:N), not both")


# ----------------------------------------------------------------------------- the whole

@dataclass
class Config(Settings):
    """Everything ``params.yaml`` holds (besides the keys derived for DVC's templating)."""

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

    def trainer_of(self, name: str) -> TrainerConfig:
        """The update settings of agent ``name``: ``trainer`` with the agent's own over it."""
        return dataclasses.replace(self.trainer, **self.agent(name).trainer.given())

    def for_learner(self, name: str) -> Config:
        """This config as agent ``name``'s update reads it (its own trainer settings applied)."""
        return dataclasses.replace(self, trainer=self.trainer_of(name))

    @property
    def layout(self) -> RunLayout:
        """Where the experiment's artifacts live (``experiment.runs_dir``; the task data in ``data/``)."""
        return RunLayout(self.experiment.runs_dir)
