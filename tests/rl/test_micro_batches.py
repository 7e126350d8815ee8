"""Micro-batches: a mini-batch cut to fit a memory budget is the same update as the whole one.

For every registered loss (each through a preset that uses it), both trainer backends and budgets
that do and do not divide the mini-batch: the loss, the gradient norm of every update and the
weights after the step agree with the whole-mini-batch update to 1e-6. A loss registered later
without a preset that uses it fails here until it has one (so no loss escapes the check).
"""

import dataclasses

import numpy as np
import pytest
import yaml
from conftest import ROOT, SMOKE, assert_same_figures, fixed_rewards

from hacrl.exchange.experience import read_records
from hacrl.pipeline import params
from hacrl.rl.algorithms import LOSSES
from hacrl.rl.micro import plan
from hacrl.storage import RunLayout, read_json


def _preset_of(loss: str) -> str:
    """A preset of conf/algorithm/ whose loss is ``loss`` (the first by name)."""
    for f in sorted((ROOT / "conf" / "algorithm").glob("*.yaml")):
        if yaml.safe_load(f.read_text())["loss"]["name"] == loss:
            return f.stem
    raise AssertionError(f"no preset in conf/algorithm/ uses the loss {loss!r}: add one, so that its "
                         f"micro-batched update is checked here")


# ----------------------------------------------------------------------------- the cut

def test_a_budget_packs_rows_of_similar_length_and_never_truncates():
    lengths = np.array([10, 50, 12, 48, 11, 300, 49])
    parts, over = plan(lengths, None, max_tokens=100, max_rows=0)
    assert sorted(np.concatenate(parts).tolist()) == list(range(7))
    assert all(len(p) * lengths[p].max() <= 100 for p in parts if lengths[p].max() <= 100)
    assert over == 1 and [5] in [p.tolist() for p in parts]  # the 300-token row alone, whole
    assert [1, 6] in [p.tolist() for p in parts]             # the two longest ~50-token rows together
    parts, _ = plan(lengths, None, max_tokens=0, max_rows=3)
    assert max(len(p) for p in parts) == 3
    whole, over = plan(lengths, None, 0, 0)
    assert [p.tolist() for p in whole] == [list(range(7))] and over == 0


def test_a_loss_that_reads_groups_is_cut_between_groups_only():
    lengths = np.array([5, 5, 30, 30, 6, 6])
    groups = np.array([0, 0, 1, 1, 2, 2])
    parts, _ = plan(lengths, groups, max_tokens=24, max_rows=0)
    for p in parts:
        for g in set(groups[p]):
            assert set(np.flatnonzero(groups == g)) <= set(p.tolist())


def test_a_budget_that_is_not_a_positive_integer_is_one_line():
    from hacrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^trainer.micro_batch_tokens: invalid value -1 \(must be >= 0"):
        params.from_dict(params.compose([*SMOKE, "trainer.micro_batch_tokens=-1"]))
    with pytest.raises(ConfigError, match=r"^trainer.micro_batch_samples: invalid value 2.5 \(expected an integer\)"):
        params.from_dict(params.compose([*SMOKE, "trainer.micro_batch_samples=2.5"]))


# ----------------------------------------------------------------------------- the same update

@pytest.fixture(scope="module")
def pool(workspaces):
    """The tiny pool's workspaces (each loss then rolls out on its own copy of iteration 0)."""
    return workspaces


def _iteration(pool, algo, rewards=fixed_rewards, tag="", extra=()):
    """Iteration 1 of ``algo`` up to its update, rewards set to a fixed pattern (the barely
    warmed-up tiny pool scores 0, which trains nothing; ``rewards``: verdict rows -> 0/1;
    ``extra``: overrides, e.g. a KL term). Returns the workspace's directory and config."""
    kl = ["algorithm.kl_coef=0.05"] if algo == "grpo" else []
    cfg = pool.iteration(f"micro-{algo}{tag}", f"algorithm={algo}", *kl, *extra, rewards=rewards)
    return pool.root / f"micro-{algo}{tag}", cfg


def _update(root, cfg, name, tag, **trainer):
    import torch

    from hacrl.agents.pool import load_agent
    from hacrl.rl.step import train_learner

    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **trainer))
    lay = RunLayout(cfg.experiment.runs_dir)
    agent = load_agent(cfg.agent(name), lay.checkpoint(0, name), cfg.trainer.dtype)
    ref = load_agent(cfg.agent(name), lay.checkpoint(0, name), cfg.trainer.dtype).model if cfg.algorithm.kl_coef > 0 else None
    batch = read_records(lay.learner_input(1, name), "learner_input")
    side = lay.learner_input(1, name, "reward_stats")
    stats = train_learner(agent, batch, cfg, seed=3, prev_state=lay.train_state(0) / name,
                          out_state=root / "state" / tag / name, ref_model=ref,
                          omega=read_json(lay.capability(1))["omega"],
                          reward_stats=read_records(side, "reward_stats") if side.exists() else None)
    weights = {k: v.detach().clone() for k, v in agent.model.state_dict().items()}
    torch.set_num_threads(2)
    return stats, weights


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_micro_batched_update_is_the_whole_update(pool, loss, backend):
    algo = _preset_of(loss)
    root, cfg = _iteration(pool, algo)
    name = cfg.agents[0].name
    whole, w0 = _update(root, cfg, name, f"whole-{backend}", backend=backend)
    assert whole["updates"] >= 2
    # budgets: rows of about 15-30 tokens, mini-batches of 32-96 rows
    for tag, budget in (("tokens", {"micro_batch_tokens": 200}), ("rows", {"micro_batch_samples": 8}),
                        ("both", {"micro_batch_tokens": 450, "micro_batch_samples": 13})):
        cut, w1 = _update(root, cfg, name, f"{tag}-{backend}", backend=backend, **budget)
        where = f"{loss} ({algo}), {backend}, {budget}"
        assert cut["updates"] == whole["updates"] and cut["micro_batches"] > whole["updates"], where
        assert "micro_batches" not in whole
        assert cut["loss"] == pytest.approx(whole["loss"], abs=1e-6), where
        assert np.allclose(cut["per_update"]["grad_norm"], whole["per_update"]["grad_norm"], rtol=1e-6, atol=1e-7), where
        diff = max(float((w1[k] - w0[k]).abs().max()) for k in w0)
        assert diff <= 1e-6, f"{where}: weights differ by {diff:.2e}"
        assert_same_figures(whole, cut, where)


def test_an_update_without_own_samples_has_no_kl_term_whatever_the_budget(pool):
    """HACPO's reference layout gives the peers' samples updates of their own: those have no KL
    term (None per update, left out of the step's mean), cut or whole, never a KL of 0."""
    root, cfg = _iteration(pool, "hacpo", tag="-kl", extra=("algorithm.kl_coef=0.05",))
    name = cfg.agents[0].name
    whole, _ = _update(root, cfg, name, "kl-whole")
    cut, _ = _update(root, cfg, name, "kl-cut", micro_batch_tokens=200)
    kl = whole["per_update"]["kl"]
    assert None in kl and any(x is not None for x in kl), kl  # own blocks and cross blocks
    assert [x is None for x in cut["per_update"]["kl"]] == [x is None for x in kl]
    assert whole["kl_to_init"] == pytest.approx(np.mean([x for x in kl if x is not None]), rel=1e-9)
    assert_same_figures(whole, cut, "hacpo with a KL term, micro_batch_tokens=200")


def test_activation_checkpointing_is_the_same_update(pool):
    root, cfg = _iteration(pool, "grpo")
    name = cfg.agents[1].name
    plain, w0 = _update(root, cfg, name, "ckpt-off")
    ckpt, w1 = _update(root, cfg, name, "ckpt-on", gradient_checkpointing=True, micro_batch_tokens=300)
    assert ckpt["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    assert max(float((w1[k] - w0[k]).abs().max()) for k in w0) <= 1e-6


def test_old_logprobs_of_a_cut_mini_batch_are_the_whole_ones(pool):
    """pi_old scored per micro-batch (another padding) is pi_old scored whole, to 1e-6."""
    import torch

    from hacrl.agents.pool import load_agent
    from hacrl.agents.scoring import pack, response_span, token_logprobs

    root, cfg = _iteration(pool, "grpo")
    ac = cfg.agents[0]
    lay = RunLayout(cfg.experiment.runs_dir)
    agent = load_agent(ac, lay.checkpoint(0, ac.name))
    rows = read_records(lay.learner_input(1, ac.name), "learner_input")
    prompts, resps = [list(x) for x in rows["input_prompt_ids"]], [list(x) for x in rows["input_response_ids"]]
    pad = agent.tokenizer.pad_token_id

    def scored(sel):
        ids, attn, resp = pack([prompts[i] for i in sel], [resps[i] for i in sel], pad)
        with torch.no_grad():
            lp = token_logprobs(agent.model, ids, attn, 1.0, span=response_span(resp))
        return [lp[k][resp[k].bool()] for k in range(len(sel))]

    whole = scored(range(len(rows)))
    lengths = np.array([len(p) + len(r) for p, r in zip(prompts, resps)])
    parts, _ = plan(lengths, None, max_tokens=160, max_rows=0)
    assert len(parts) > 3
    for part in parts:
        for i, lp in zip(part, scored(part)):
            assert torch.allclose(lp, whole[i], atol=1e-6, rtol=0), i


def test_generation_within_a_kv_budget_gives_the_same_greedy_answers(pool):
    from hacrl.agents.pool import load_agent
    from hacrl.agents.warmup import greedy_answers
    from hacrl.rollout.hf import HFEngine
    from hacrl.task.data import read_jsonl

    root, cfg = _iteration(pool, "grpo")
    ac = cfg.agents[0]
    agent = load_agent(ac, RunLayout(cfg.experiment.runs_dir).checkpoint(0, ac.name))
    held = read_jsonl(pool.root / "data" / "tasks" / "heldout.jsonl")[:60]
    eng = HFEngine(agent.model, agent.tokenizer, batch_size=64, max_batch_tokens=200)
    calls = eng.batches(sorted(len(agent.tokenizer(agent.render(p["problem"]))["input_ids"]) for p in held), 12)
    assert len(calls) > 1 and all(len(c) * 12 < 200 for c in calls)
    assert greedy_answers(agent, held, 12, 64, max_batch_tokens=200) == greedy_answers(agent, held, 12, 64)
    # a row longer than GPT-2's learned positions: refused in one line before generating, not
    # torch's "index out of range in self" halfway through
    assert agent.model.config.n_positions == 64
    with pytest.raises(ValueError, match=r"over the model's 64 \(n_positions"):
        greedy_answers(agent, held, 60, 64)


def test_bf16_accumulates_micro_batches_in_fp32_and_needs_deepspeed(pool):
    """bf16: the model computes in bf16, DeepSpeed keeps fp32 master weights, log-probs and losses
    are fp32; with ZeRO 1 the micro-batches' gradients add up in fp32, so cutting the mini-batch
    changes the gradient norm by bf16 rounding only (with ZeRO 0 they add up in bf16)."""
    from hacrl.errors import ConfigError

    root, cfg = _iteration(pool, "gspo")
    name = cfg.agents[1].name
    fp32, _ = _update(root, cfg, name, "bf-fp32")
    whole, _ = _update(root, cfg, name, "bf-whole", dtype="bf16", zero_stage=1)
    cut, w = _update(root, cfg, name, "bf-cut", dtype="bf16", zero_stage=1, micro_batch_tokens=200)
    assert cut["micro_batches"] > cut["updates"]
    # bf16 matmuls round by shape (a micro-batch pads otherwise): the first update agrees to 1e-4,
    # the next ones, from weights that differ by that, to 1e-3
    g_cut, g_whole = cut["per_update"]["grad_norm"], whole["per_update"]["grad_norm"]
    assert g_cut[0] == pytest.approx(g_whole[0], rel=1e-4) and np.allclose(g_cut, g_whole, rtol=1e-3)
    # from the same weights, bf16 compute moves the first gradient norm by bf16 rounding
    assert whole["per_update"]["grad_norm"][0] == pytest.approx(fp32["per_update"]["grad_norm"][0], rel=1e-3)
    assert all(str(v.dtype) == "torch.bfloat16" for v in w.values() if v.is_floating_point())
    with pytest.raises(ConfigError, match=r"^trainer.backend: invalid value 'torch' \(bf16 needs the deepspeed backend"):
        params.from_dict(params.compose([*SMOKE, "trainer.dtype=bf16", "trainer.backend=torch"]))


def test_the_oracle_rows_train_through_the_update(pool):
    """SGT's oracle (``content: gold``): the learner input holds the gold completion where SGT's
    holds the peers' text, on the same rows; the update injects them under the same gate, with
    finite figures although the rows have no behaviour log-probs."""
    import math

    from hacrl.task.data import completion_text

    def gated(df):  # the first agent wrong on every other prompt, where its peer succeeds once
        first = df["producer"] == "gpt2-a"
        odd = df["prompt_id"].map(lambda p: sum(map(ord, p)) % 2 == 1)
        return (~first & odd & (df["record_id"].str.endswith("/0"))).astype(float) + fixed_rewards(df) * (first & ~odd)

    sgt_root, sgt_cfg = _iteration(pool, "sgt", gated, "-gated")
    root, cfg = _iteration(pool, "sgt_oracle", gated, "-gated")
    name = cfg.agents[0].name
    rows = read_records(RunLayout(cfg.experiment.runs_dir).learner_input(1, name), "learner_input")
    peer = read_records(RunLayout(sgt_cfg.experiment.runs_dir).learner_input(1, name), "learner_input")
    cross, cross_peer = rows[~rows["is_self"]], peer[~peer["is_self"]]
    assert len(cross) > 0 and list(cross["record_id"]) == list(cross_peer["record_id"])
    assert list(cross["response_text"]) == [completion_text(g) for g in cross["gold"]]
    assert (cross["finish_reason"] == "gold").all() and cross["behavior_logprob_mean"].isna().all()
    fired = 0
    for ac in cfg.agents:
        stats, _ = _update(root, cfg, ac.name, "oracle")
        sgt_stats, _ = _update(sgt_root, sgt_cfg, ac.name, "oracle-sgt")
        assert stats["rescues"] == sgt_stats["rescues"]  # the same gate fires
        assert all(math.isfinite(v) for k, v in stats.items() if isinstance(v, float) and k != "rescue_nll"), stats
        if stats["rescues"] > 0:
            fired += 1
            assert stats["loss"] != sgt_stats["loss"]  # other tokens injected
    assert fired, f"no rescue in this batch: the test checks nothing {stats}"
