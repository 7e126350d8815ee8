"""What makes the update cheaper must not change what it computes:

- the first mini-batch's pi_old is its first training forward, detached: the same bits as the
  no-grad pass it replaces;
- log-probs projected at response positions only are the same bits as at every position (the
  head's weight gradient agrees to rounding);
- ``recompute_old_logprobs=false`` skips the no-grad pass for own samples of the transformers
  engine, keeps it for cross samples and for vLLM's rollouts, and still reports the gap.
"""

import dataclasses

import pytest
import torch
from conftest import make_agent

from hacrl.agents.scoring import pack, response_span, token_logprobs
from hacrl.exchange.experience import read_records
from hacrl.storage import RunLayout


def _batch(agent, n=24):
    tok = agent.tokenizer
    prompts = [tok(f"Q: {i}+{i}=?\nA:", add_special_tokens=False)["input_ids"] for i in range(n)]
    resps = [tok(" " + str(2 * i) * (1 + i % 3), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
             for i in range(n)]
    return pack(prompts, resps, tok.pad_token_id)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_grad_forward_equals_no_grad_forward_and_response_span_equals_all_positions(tiny_problems, arch):
    _, agent = make_agent(arch, "bytelevel_bpe", tiny_problems)
    model = agent.model.eval()
    ids, attn, resp = _batch(agent)
    with torch.no_grad():
        full = token_logprobs(model, ids, attn, 0.9)
    with_grad = token_logprobs(model, ids, attn, 0.9)
    assert torch.equal(with_grad.detach(), full)
    span = response_span(resp)
    assert span < ids.shape[1] - 1  # the batch has prompt positions to skip
    lp, ent = token_logprobs(model, ids, attn, 0.9, with_entropy=True, span=span)
    _, ent_full = token_logprobs(model, ids, attn, 0.9, with_entropy=True)
    m = resp.bool()
    assert torch.equal(lp.detach()[m], full[m]) and torch.equal(ent.detach()[m], ent_full.detach()[m])
    assert lp.shape == full.shape
    assert float(lp.detach()[:, : ids.shape[1] - 1 - span].abs().sum()) == 0.0  # prompt positions: not scored
    # gradients agree to rounding
    model.zero_grad()
    (lp * resp).sum().backward()
    g_span = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (token_logprobs(model, ids, attn, 0.9) * resp).sum().backward()
    for a, b in zip(g_span, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def iteration1(workspaces):
    cfg = workspaces.iteration("speed-hacpo", "algorithm=hacpo")
    with workspaces.inside():
        yield workspaces.root / "speed-hacpo", cfg


def _update(cfg, tmp, name, **trainer):
    from hacrl.agents.pool import load_agent
    from hacrl.rl.step import train_learner
    from hacrl.storage import read_json

    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **trainer))
    lay = RunLayout(cfg.experiment.runs_dir)
    agent = load_agent(cfg.agent(name), lay.checkpoint(0, name))
    batch = read_records(lay.learner_input(1, name), "learner_input")
    stats = train_learner(agent, batch, cfg, seed=1, prev_state=lay.train_state(0) / name,
                          out_state=tmp / "state" / name, omega=read_json(lay.capability(1))["omega"])
    return stats, batch


def test_recompute_flag_skips_the_pass_only_where_generation_logprobs_are_exact(iteration1, workspaces):
    tmp, cfg = iteration1
    name = cfg.agents[0].name
    on, batch = _update(cfg, tmp, name)
    off, _ = _update(cfg, tmp, name, recompute_old_logprobs=False)
    n_own = int((batch["producer"] == name).sum())
    assert n_own < len(batch) and on["samples"] == len(batch)
    # recompute on: every own mini-batch but the first gets the no-grad pass; HACPO never reads
    # pi_old on peers' rows (a cross ratio's denominator is the producer's), so theirs get none
    assert 0 < on["old_logprobs_recomputed"] < n_own
    # off: the own samples keep their generation log-probs, no pass at all
    assert off["old_logprobs_recomputed"] == 0
    # the gap is measured either way (on the first mini-batch's own samples at least), and small
    assert 0 < off["gen_vs_train_logprob_maxdiff"] < 1e-3
    assert on["gen_vs_train_logprob_maxdiff"] >= off["gen_vs_train_logprob_maxdiff"]
    # same first update: its pi_old is the same forward either way on own samples up to the gap
    assert on["first_ratio_mean"] == 1.0
    assert abs(off["first_ratio_mean"] - 1.0) < 1e-3
    # a loss that reads pi_old on peers' rows (naive sharing: GSPO over every row) has them
    # scored, in another tokenizer's tokens, with the flag off too
    naive = workspaces.iteration("speed-naive", "algorithm=naive_share")
    off, batch = _update(naive, workspaces.root / "speed-naive", name, recompute_old_logprobs=False)
    assert off["old_logprobs_recomputed"] == int((batch["producer"] != name).sum()) > 0


def test_vllm_rollouts_are_recomputed_even_with_the_flag_off(iteration1):
    tmp, cfg = iteration1
    name = cfg.agents[0].name
    vcfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="vllm"))
    st, batch = _update(vcfg, tmp, name, recompute_old_logprobs=False)
    on, _ = _update(cfg, tmp, name)
    assert st["old_logprobs_recomputed"] == on["old_logprobs_recomputed"]


def test_shared_prompt_prefix_gives_the_same_step(iteration1, workspaces):
    """``trainer.share_prompt_prefix``: each distinct prompt of a micro-batch runs once (its G
    samples and the peers' responses rendered in the learner's template share its keys and
    values): the step's figures are the whole-sequence forward's to float rounding, under a
    micro-batch budget that cuts the mini-batches too (a prompt's rows stay together)."""
    tmp, cfg = iteration1
    name = cfg.agents[0].name
    for trainer in ({}, {"micro_batch_tokens": 600}):
        whole, _ = _update(cfg, tmp, name, **trainer)
        shared, _ = _update(cfg, tmp, name, share_prompt_prefix=True, **trainer)
        assert whole.keys() == shared.keys()
        compared = 0
        for key, a in whole.items():
            b = shared[key]
            timing = "seconds" in key or key.endswith("_per_s") or "peak" in key or "rss" in key
            if isinstance(a, float) and not timing:
                assert b == pytest.approx(a, rel=1e-3, abs=1e-5), key
                compared += 1
        assert compared > 10
