"""``verify``: the verify-rewards stage against a bare math-verify process pool.

The corpus is deterministic and mixed: integer, fraction, LaTeX (roots, pi, polynomials) and
set / tuple gold answers, each answered in several equivalent renderings (bare ``\\boxed{}``,
plain text, a worked solution that ends boxed), wrong answers, unparseable text, empty answers,
a few unparseable gold answers and a few pathological answers (huge powers, a huge factorial)
that keep math-verify busy until its own alarm ends the check. Samples of one prompt often
agree, as sampled rollouts do, so some (gold, response) pairs repeat. Units: answers.

Contenders, interleaved:

- ``stage``: :func:`hacrl.pipeline.stages.verify_rewards` on rollout shards written here (one per agent
  of the miniature pool): read Parquet, verify in the killable pipelined worker pool, write the
  verdict shards;
- ``pool``: :class:`hacrl.task.rewards.VerifierPool` over all answers in one call (as the stage makes
  it), the pool started and closed in the round: the verifier alone, without the Parquet;
- ``bare_pool``: what a user would write: ``multiprocessing.Pool(workers).starmap(verdict, pairs)``
  (spawned workers, so they start cold as the stage's do; no dedupe, no hard kill), the pool made
  and closed in every round as the stage's is;
- ``serial``: ``verdict`` over every pair in this process (math-verify imported and warmed).

Afterwards, the stage's verdicts are compared with ``serial``'s pair by pair, and two single
timed checks measure how far past its timeout a check can run: a pathological answer (ended by
math-verify's alarm) and a hung worker (ended by the pool's hard kill).
"""

from __future__ import annotations

import logging
import multiprocessing
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from hacrl.study.bench.core import Contender, Goal, SuiteResult, compare

log = logging.getLogger(__name__)
DEFAULT_REPS = 4
TIMEOUT_S = 2.0
"""``reward.timeout_s`` of every contender: short, so the pathological answers cost little."""

PATHOLOGICAL = ("\\boxed{2^{2^{2^{20}}}}", "\\boxed{10^{10^{7}}}", "\\boxed{9^{9^{9}}}", "\\boxed{(10^{6})!}")
"""Answers math-verify works on until its alarm (``timeout_s``) stops it; verdict ``timeout``."""
UNPARSEABLE = ("I am not sure.", "the answer is a cat", "no idea", "Let me think about this step by step...",
               "\\boxed{}", "???")
SIZES = {"smoke": {"prompts": 8, "agents": 2, "samples": 4, "pathological": 1, "bad_gold": 1},
         "full": {"prompts": 150, "agents": 2, "samples": 8, "pathological": 2, "bad_gold": 4}}
"""Per prompt, ``samples`` answers from each of ``agents`` (``rollout.group_size`` is 8 in the
experiments). smoke: 66 answers (seconds); full: 2,406 answers, about 3 s of math-verify in one
process plus ``timeout_s`` per pathological answer: a full run takes about two minutes on 2 cores."""
REPEAT_P = 0.2
"""Chance that a sample repeats one its prompt already has (the rest are drawn afresh)."""
HUNG_WORKER = (
    "import sys, json, time\n"
    "for line in sys.stdin:\n"
    "    time.sleep(3600)\n"
)


@dataclass(frozen=True)
class Item:
    """One rollout to verify: the agent that sampled it (an index), its prompt, gold answer,
    response and what kind of answer it is."""

    agent: int
    prompt_id: str
    gold: str
    response: str
    kind: str


def _worked(rng: random.Random, answer: str) -> str:
    steps = " ".join(f"Step {i + 1}: combine the terms and simplify ({rng.randrange(10, 99)} = "
                     f"{rng.randrange(10, 99)})." for i in range(rng.randrange(2, 6)))
    return f"{steps} Therefore the final answer is $\\boxed{{{answer}}}$."


def _gold_and_renderings(rng: random.Random, category: str) -> tuple[str, list[str], list[str]]:
    """A gold answer of ``category``, equivalent boxed contents and wrong ones."""
    if category == "integer":
        g = rng.randrange(-50, 2000)
        return str(g), [str(g), f"{g}.0"], [str(g + rng.choice([-10, -1, 1, 2, 100]))]
    if category == "fraction":
        b = rng.randrange(2, 40)
        a = rng.choice([x for x in range(1, 3 * b) if _gcd(x, b) == 1])
        k = rng.randrange(2, 6)
        same = [f"\\frac{{{a * k}}}{{{b * k}}}", f"{a}/{b}"]
        if all(p in (2, 5) for p in _factors(b)):
            same.append(repr(a / b))
        return f"\\frac{{{a}}}{{{b}}}", same, [f"\\frac{{{b}}}{{{a}}}", f"\\frac{{{a + 1}}}{{{b}}}"]
    if category == "latex":
        k, m = rng.randrange(2, 9), rng.choice([2, 3, 5, 6, 7])
        form = rng.randrange(3)
        if form == 0:
            return f"{k}\\sqrt{{{m}}}", [f"\\sqrt{{{k * k * m}}}", f"{k} \\sqrt{{{m}}}"], [f"\\sqrt{{{k * m}}}"]
        if form == 1:
            return f"\\frac{{\\pi}}{{{k}}}", [f"\\frac{{{2}\\pi}}{{{2 * k}}}", f"\\pi/{k}"], [f"{k}\\pi"]
        return f"x^2+{k}x", [f"x(x+{k})", f"x^{{2}} + {k} x"], [f"x(x-{k})"]
    a, b, c = rng.sample(range(-9, 20), 3)
    if rng.random() < 0.5:
        return f"\\{{{a},{b},{c}\\}}", [f"\\{{{c},{a},{b}\\}}", f"\\{{{a}, {b}, {c}\\}}"], [f"\\{{{a},{b}\\}}"]
    return f"({a},{b})", [f"({a}, {b})"], [f"({b},{a})"]


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _factors(n: int) -> set[int]:
    out, p = set(), 2
    while n > 1:
        while n % p == 0:
            out.add(p)
            n //= p
        p += 1
    return out


def corpus(size: str, seed: int = 0) -> list[Item]:
    """The deterministic mixed corpus of ``size`` (``smoke`` or ``full``), shard by shard as
    generate-rollouts writes them: every agent answers the same prompts, in the same (random)
    order, each prompt's samples together."""
    s = SIZES[size]
    rng = random.Random(f"{seed}/verify-bench/{size}")
    # half integer answers (this project's arithmetic tasks), the rest what math-verify works harder on
    categories = ("integer", "fraction", "integer", "latex", "integer", "set_tuple", "integer", "fraction",
                  "integer", "latex")
    prompts: list[list[list[Item]]] = []  # per prompt, per agent: its samples
    for i in range(s["prompts"]):
        pid = f"p{i:05d}"
        category = categories[i % len(categories)]
        gold, same, wrong = _gold_and_renderings(rng, category)
        per_agent = []
        for a in range(s["agents"]):
            drawn: list[Item] = []
            for _ in range(s["samples"]):
                if drawn and rng.random() < REPEAT_P:
                    drawn.append(rng.choice(drawn))
                    continue
                u = rng.random()
                if u < 0.55:
                    body = rng.choice(same)
                    text = rng.choice([f"\\boxed{{{body}}}", f" \\boxed{{{body}}}", _worked(rng, body),
                                       f"The answer is ${body}$."])
                    drawn.append(Item(a, pid, gold, text, category))
                elif u < 0.8:
                    body = rng.choice(wrong)
                    text = rng.choice([f"\\boxed{{{body}}}", _worked(rng, body)])
                    drawn.append(Item(a, pid, gold, text, "wrong"))
                elif u < 0.92:
                    drawn.append(Item(a, pid, gold, rng.choice(UNPARSEABLE), "unparseable"))
                else:
                    drawn.append(Item(a, pid, gold, "", "empty"))
            per_agent.append(drawn)
        prompts.append(per_agent)
    # one sample each, of one agent: a gold answer that does not parse, a pathological answer
    for j in range(s["bad_gold"]):
        gold = rng.choice(["}{", "}", ""])
        prompts.append([[Item(a, f"g{j:05d}", gold, f"\\boxed{{{j}}}", "gold_unparseable")] if a == j % s["agents"]
                        else [] for a in range(s["agents"])])
    for j in range(s["pathological"]):
        gold, text = str(rng.randrange(1, 100)), PATHOLOGICAL[j % len(PATHOLOGICAL)]
        prompts.append([[Item(a, f"x{j:05d}", gold, text, "pathological")] if a == j % s["agents"]
                        else [] for a in range(s["agents"])])
    rng.shuffle(prompts)
    return [it for a in range(s["agents"]) for p in prompts for it in p[a]]


def bench_config(work_dir: Path, timeout_s: float = TIMEOUT_S, workers: int | None = None):
    """The miniature pool's config with runs under ``work_dir`` (tracking off)."""
    from hacrl.pipeline import params

    overrides = ["experiment=smoke", "agents=tiny", f"reward.timeout_s={timeout_s}"]
    if workers is not None:
        overrides.append(f"reward.workers={workers}")
    cfg = params.from_dict(params.compose(overrides))
    cfg.tracking.enabled = False
    cfg.experiment.runs_dir = str(work_dir / "runs")
    return cfg


def write_rollouts(cfg, items: list[Item], t: int = 1) -> dict[str, list[Item]]:
    """``items`` as iteration ``t``'s rollout shards (item agent ``i``: ``cfg.agents[i]``)."""
    import pandas as pd

    from hacrl.exchange.experience import SCHEMA_VERSION, SCHEMAS, write_records
    from hacrl.storage import RunLayout

    names = [ac.name for ac in cfg.agents]
    shards: dict[str, list[Item]] = {n: [] for n in names}
    for it in items:
        shards[names[it.agent % len(names)]].append(it)
    out = RunLayout(cfg.experiment.runs_dir).rollouts(t)
    out.mkdir(parents=True, exist_ok=True)
    for name, its in shards.items():
        rows = [{"record_id": f"it{t}/{name}/{it.prompt_id}/{i}", "schema_version": SCHEMA_VERSION, "step": t,
                 "producer": name, "producer_tokenizer": "bench", "prompt_id": it.prompt_id,
                 "problem": "", "gold": it.gold, "level": it.kind, "rendered_prompt": "",
                 "prompt_token_ids": [], "response_text": it.response, "response_token_ids": [],
                 "response_logprobs": [], "finish_reason": "stop", "sample_index": i}
                for i, it in enumerate(its)]
        write_records(out / f"{name}.parquet", pd.DataFrame(rows, columns=SCHEMAS["rollout"].names), "rollout")
    return shards


def _quiet() -> None:
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # pathological answers time out


def _verdict(gold: str, response: str, timeout_s: float) -> str:
    from hacrl.task.rewards import verdict

    return verdict(gold, response, timeout_s)


def bare_pool(pairs: list[tuple[str, str]], workers: int, timeout_s: float, method: str = "spawn") -> list[str]:
    """A plain process pool over every pair (no dedupe, no hard kill).

    ``spawn`` by default: each worker starts cold, as the stage's do. Forked from this process,
    the workers would inherit sympy's and math-verify's caches, which the ``serial`` contender
    filled with these very expressions: a head start no user's script has."""
    with multiprocessing.get_context(method).Pool(workers, initializer=_quiet) as pool:
        return pool.starmap(_verdict, [(g, r, timeout_s) for g, r in pairs])


def overshoot(timeout_s: float = TIMEOUT_S) -> dict:
    """Seconds past ``timeout_s`` of one pathological check (math-verify's alarm ends it) and of
    one hung check (the pool's hard kill ends it), each timed from when its worker was ready."""
    from hacrl.task.rewards import VerifierPool

    out = {}
    with VerifierPool(1, timeout_s) as pool:
        pool.verify([("1", "The answer is 1.")])  # the worker is ready (not a fast-path answer): what follows is the check alone
        t0 = time.monotonic()
        v = pool.verify([("7", PATHOLOGICAL[0])])[0]
        out["pathological_overshoot_s"] = round(time.monotonic() - t0 - timeout_s, 3)
        out["pathological_verdict"] = v
    with VerifierPool(1, timeout_s, worker_code=HUNG_WORKER) as pool:
        t0 = time.monotonic()
        v = pool.verify([("7", "hang")])[0]
        out["hung_overshoot_s"] = round(time.monotonic() - t0 - timeout_s, 3)
        out["hung_verdict"] = v
    return out


def run(size: str, reps: int, work_dir: Path) -> SuiteResult:
    """Compare the stage with a bare pool and a serial loop on the mixed corpus of ``size``."""
    from hacrl.exchange.experience import read_records
    from hacrl.pipeline import table
    from hacrl.storage import RunLayout
    from hacrl.task.rewards import VerifierPool, verdict

    _quiet()
    cfg = bench_config(work_dir)
    workers, timeout_s = cfg.reward.workers, cfg.reward.timeout_s
    items = corpus(size)
    shards = write_rollouts(cfg, items)
    # the stage's order: agent by agent
    pairs = [(it.gold, it.response) for name in shards for it in shards[name]]
    last: dict[str, list[str]] = {}
    stage_stats: dict = {}

    def stage() -> int:
        stage_stats.update(table.run("verify-rewards", cfg, 1))
        return len(pairs)

    def pool() -> int:
        with VerifierPool(workers, timeout_s) as vp:
            last["pool"] = vp.verify(pairs)
        return len(pairs)

    def bare() -> int:
        last["bare_pool"] = bare_pool(pairs, workers, timeout_s)
        return len(pairs)

    def serial() -> int:
        last["serial"] = [verdict(g, r, timeout_s) for g, r in pairs]
        return len(pairs)

    measured = compare([
        Contender("stage", stage, f"verify_rewards: Parquet in and out, {workers} pipelined workers "
                                  "that reuse parsed gold answers, dedupe, hard kill"),
        Contender("pool", pool, f"VerifierPool({workers}).verify over all answers in one call, no Parquet"),
        Contender("bare_pool", bare, f"multiprocessing spawn Pool({workers}).starmap(verdict), no dedupe, "
                                     "no hard kill"),
        Contender("serial", serial, "verdict() in this process, math-verify imported and warm (sympy's "
                                    "cache too, from the earlier rounds)"),
    ], reps)
    lay = RunLayout(cfg.experiment.runs_dir)
    got = [v for name in shards for v in read_records(lay.rewards(1) / f"{name}.parquet", "verdict")["verdict"]]
    diff = sum(a != b for a, b in zip(got, last["serial"]))
    diff_bare = sum(a != b for a, b in zip(last["bare_pool"], last["serial"]))
    diff_pool = sum(a != b for a, b in zip(last["pool"], last["serial"]))
    measured["stage"].extra.update({"verdicts_differing_from_serial": diff,
                                    "killed_workers": stage_stats.get("_killed_workers", 0),
                                    **overshoot(timeout_s)})
    measured["pool"].extra["verdicts_differing_from_serial"] = diff_pool
    measured["bare_pool"].extra["verdicts_differing_from_serial"] = diff_bare
    if diff or diff_pool:
        log.error("the stage's / pool's verdicts differ from serial verdict() on %d / %d of %d answers",
                  diff, diff_pool, len(pairs))
    kinds = Counter(it.kind for it in items)
    work = {"answers": len(pairs), "distinct_pairs": len(set(pairs)), "workers": workers, "timeout_s": timeout_s,
            **{f"kind_{k}": n for k, n in sorted(kinds.items())},
            "verdicts": dict(sorted(Counter(last["serial"]).items()))}
    notes = ["the verdicts of every contender come from the same verdict(); the stage's are compared with "
             "serial's answer by answer (verdicts_differing_from_serial)",
             f"pathological answers end by math-verify's alarm after about timeout_s={timeout_s}s in every "
             "contender; overshoot figures: seconds past timeout_s of a single check, the pool warm"]
    goals = [Goal("stage", "bare_pool", 1.0), Goal("pool", "bare_pool", 1.0)]
    return SuiteResult("verify", "answers", work, measured, goals=goals, notes=notes)
