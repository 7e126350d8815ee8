"""HACPO's formulas (docs/ALGORITHMS.md, "HACPO") on hand-computed tensors, and the unbiasedness
of the capability-aware baseline by Monte Carlo."""

import math

import numpy as np
import pytest
import torch

from hacrl.rl.algorithms import (ADVANTAGES, LOSSES, AdvantageInputs, ClipOptions, HacpoAdvantageOptions,
                                 HacpoLossOptions, LossInputs, capability_baseline, stepwise_lower_bound)
from hacrl.rl.capability import omega_matrix, update_history, windowed_capability

OMEGA = torch.tensor([[1.0, 0.5], [2.0, 1.0]])  # agent 0 has half agent 1's capability


def test_capability_window_and_clamps():
    hist = [{"a": 0.1, "b": 0.9}, {"a": 0.2, "b": 0.8}, {"a": 0.3, "b": 0.7}]
    assert windowed_capability(hist, ["a", "b"], 2) == pytest.approx({"a": 0.25, "b": 0.75})
    assert windowed_capability(hist, ["a", "b"], 5) == pytest.approx({"a": 0.2, "b": 0.8})
    om = omega_matrix({"a": 0.01, "b": 0.9}, 0.1, 10.0)
    assert om["a"]["b"] == 0.1 and om["b"]["a"] == 10.0 and om["a"]["a"] == 1.0
    assert omega_matrix({"a": 0.01, "b": 0.9}, 0.1, 10.0, warmup=True)["b"]["a"] == 1.0
    assert windowed_capability([{"a": 0.0}], ["a"], 5)["a"] > 0  # floored: ratios never divide by 0
    # warm-up steps: omega is 1 for the first W steps, then the ratio
    import pandas as pd

    rw = {"a": pd.DataFrame({"prompt_id": ["p", "p"], "reward": [1.0, 0.0]}),
          "b": pd.DataFrame({"prompt_id": ["p", "p"], "reward": [1.0, 1.0]})}
    d1 = update_history({"steps": []}, 1, rw, 5, 0.1, 10.0, warmup_steps=1)
    assert d1["omega"]["b"]["a"] == 1.0
    d2 = update_history(d1, 2, rw, 5, 0.1, 10.0, warmup_steps=1)
    assert d2["omega"]["b"]["a"] == pytest.approx(2.0)


def test_baseline_weights_sources_by_learner_over_source_capability():
    # one prompt, learner 0 (weak); 2 own samples, 2 from the strong agent 1
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    g = torch.zeros(4, dtype=torch.long)
    src = torch.tensor([0, 0, 1, 1])
    mu = capability_baseline(r, g, src, 0, OMEGA)
    assert mu[0].item() == pytest.approx((1 + 0 + 0.5 + 0.5) / 4)  # strong successes count half
    mu_plain = capability_baseline(r, g, src, 0, OMEGA, use_capability=False)
    assert mu_plain[0].item() == pytest.approx(0.75)  # the -adv ablation: plain pooled mean


def test_baseline_guards():
    g = torch.zeros(4, dtype=torch.long)
    src = torch.tensor([0, 0, 1, 1])
    # all rewards equal -> their plain mean (advantage 0), not the weighted one (2 * 1 = 2 here)
    ones = torch.ones(4)
    assert capability_baseline(ones, g, src, 1, OMEGA)[0].item() == 1.0
    # weighted mean above 1 -> the learner's own mean. learner 1 (strong) weights agent 0 by 2:
    r = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert capability_baseline(r, g, src, 1, OMEGA, guards=False)[0].item() == pytest.approx(5 / 4)
    assert capability_baseline(r, g, src, 1, OMEGA)[0].item() == pytest.approx(0.5)


def test_advantage_uses_std_of_the_raw_pooled_rewards():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    g = torch.zeros(4, dtype=torch.long)
    src = torch.tensor([0, 0, 1, 1])
    inp = AdvantageInputs(rewards=r, group_ids=g, is_self=src == 0, source_ids=src, learner=0, omega=OMEGA,
                          producer_advantages=torch.tensor([9.0, 9.0, -7.0, -7.0]))
    adv = ADVANTAGES["hacpo"].fn(inp, HacpoAdvantageOptions())
    std = torch.tensor([1.0, 0.0, 1.0, 1.0]).std(unbiased=True).item()  # raw, unweighted
    mu = 0.5
    assert adv.tolist() == pytest.approx([(x - mu) / (std + 1e-6) for x in r.tolist()], rel=1e-5)
    # cross samples use the learner's baseline: the same reward gets the same advantage
    assert adv[0].item() == pytest.approx(adv[2].item())
    # the open choice cross_advantage=source: cross samples keep their producer's own advantage
    adv_src = ADVANTAGES["hacpo"].fn(inp, HacpoAdvantageOptions(cross_advantage="source"))
    assert adv_src[:2].tolist() == pytest.approx(adv[:2].tolist()) and adv_src[2:].tolist() == [-7.0, -7.0]


def _loss(new, old, adv, is_self, om, m=0, **kw):
    """The registered HACPO loss on per-sample log-prob means (one response token each: the mean
    is the value itself), the old side as the producer's mean for cross samples."""
    inp = LossInputs(logp=new[:, None], old_logp=old[:, None], mask=torch.ones(len(new), 1), advantages=adv,
                     is_self=is_self, omega_src=om, behavior_logp=old[:, None], behavior_logp_mean=old,
                     update_index=m)
    return LOSSES["hacpo"].fn(inp, HacpoLossOptions(**kw))


def test_discrepancy_coefficient_amplifies_stronger_sources():
    # two identical cross samples (ratio 0.9 inside [0.8, 1]); one from a stronger source
    # (omega[j, k] = 2), one from a weaker (0.5): the gradient on the stronger one is 4x
    new = torch.tensor([math.log(0.9), math.log(0.9)], requires_grad=True)
    old = torch.zeros(2)
    loss, _ = _loss(new, old, torch.tensor([1.0, 1.0]), torch.tensor([False, False]), torch.tensor([2.0, 0.5]),
                    alpha=0.0)
    loss.backward()
    assert new.grad[0].item() == pytest.approx(4 * new.grad[1].item())
    assert new.grad[0].item() < 0  # positive advantage: raising its likelihood lowers the loss
    new.grad = None
    loss, _ = _loss(new, old, torch.tensor([1.0, 1.0]), torch.tensor([False, False]), torch.tensor([2.0, 0.5]),
                    alpha=0.0, discrepancy_coef=False)
    loss.backward()
    assert new.grad[0].item() == pytest.approx(new.grad[1].item())  # -omega ablation


def test_cross_ratio_with_different_token_counts_on_the_two_sides():
    # the learner saw the response as 4 tokens, the source as 2: each side is its own mean
    # (a padded fifth position must not count); the source's mean is -0.25 over its own 2 tokens
    learner_lp = torch.tensor([[-0.1, -0.2, -0.3, -0.4, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])

    def cross_ratio(logp):
        inp = LossInputs(logp=logp, old_logp=torch.zeros_like(logp), mask=mask, advantages=torch.tensor([1.0]),
                         is_self=torch.tensor([False]), omega_src=torch.ones(1), behavior_logp=torch.zeros_like(logp),
                         behavior_logp_mean=torch.tensor([(-0.05 - 0.45) / 2]))
        return LOSSES["hacpo"].fn(inp, HacpoLossOptions())[1]["cross_ratio_mean"]

    assert cross_ratio(learner_lp) == pytest.approx(1.0)
    assert cross_ratio(learner_lp - 0.1) == pytest.approx(math.exp(-0.1))
    # the log-ratio is clamped to +-10
    _, met = _loss(torch.tensor([-50.0]), torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([False]),
                   torch.tensor([1.0]), cross_clip=False)
    assert met["cross_ratio_mean"] == pytest.approx(math.exp(-10))


def test_alpha_scales_the_cross_term_by_the_detached_ratio():
    s = 0.9
    for alpha in (0.0, 1.0, 3.0):
        new = torch.tensor([math.log(s)], requires_grad=True)
        loss, _ = _loss(new, torch.zeros(1), torch.tensor([1.0]), torch.tensor([False]), torch.tensor([1.0]),
                        alpha=alpha)
        assert loss.item() == pytest.approx(-(s * s ** alpha))
        loss.backward()
        # d/dlog s of -(s * sg[s]^alpha) = -s * s^alpha: the detached factor is not differentiated
        assert new.grad.item() == pytest.approx(-(s ** (1 + alpha)))


def test_zero_gradient_outside_the_cross_clip_range():
    for s in (0.5, 1.3):  # below lower = 0.8, above 1
        new = torch.tensor([math.log(s)], requires_grad=True)
        loss, met = _loss(new, torch.zeros(1), torch.tensor([1.0]), torch.tensor([False]), torch.tensor([1.0]))
        loss.backward()
        assert new.grad.item() == 0.0
        assert (met["cross_clipped_below"], met["cross_clipped_above"]) == ((1.0, 0.0) if s < 1 else (0.0, 1.0))
    new = torch.tensor([math.log(0.5)], requires_grad=True)
    loss, _ = _loss(new, torch.zeros(1), torch.tensor([1.0]), torch.tensor([False]), torch.tensor([1.0]),
                    cross_clip=False)
    loss.backward()
    assert new.grad.item() != 0.0  # -clip ablation: gradient flows


def test_stepwise_lower_bound_per_minibatch():
    assert [stepwise_lower_bound(m, 0.2, 0.025) for m in range(4)] == pytest.approx([0.8, 0.825, 0.85, 0.875])
    assert stepwise_lower_bound(100, 0.2, 0.025) == 1.0
    assert stepwise_lower_bound(3, 0.2, 0.0) == 0.8  # -stepwise ablation
    # a ratio of 0.81 trains at m = 0 and is clipped (no gradient) at m = 1
    for m, flows in ((0, True), (1, False)):
        new = torch.tensor([math.log(0.81)], requires_grad=True)
        loss, met = _loss(new, torch.zeros(1), torch.tensor([1.0]), torch.tensor([False]), torch.tensor([1.0]), m=m)
        loss.backward()
        assert (new.grad.item() != 0.0) == flows and met["cross_lower_bound"] == pytest.approx(0.8 + 0.025 * m)


def test_self_samples_give_exactly_the_gspo_loss():
    torch.manual_seed(0)
    logp = torch.randn(6, 5) * 0.1 - 1
    old = logp + torch.randn(6, 5) * 1e-3
    mask = torch.ones(6, 5)
    mask[2, 3:] = 0
    inp = LossInputs(logp=logp, old_logp=old, mask=mask, advantages=torch.randn(6),
                     is_self=torch.ones(6, dtype=torch.bool), omega_src=torch.ones(6), behavior_logp=old,
                     behavior_logp_mean=torch.zeros(6))
    gspo, _ = LOSSES["gspo"].fn(inp, ClipOptions("gspo", 3e-4, 4e-4))
    hacpo, _ = LOSSES["hacpo"].fn(inp, HacpoLossOptions())
    assert hacpo.item() == pytest.approx(gspo.item(), abs=1e-7)


def test_capability_aware_baseline_is_unbiased_for_the_learners_expected_reward():
    """Synthetic agents with success rates p, omega from the true rates: E[mu^(k)] = p_k.

    Without the guards, mu^(k) = (1/nG) sum_j sum_i (p_k/p_j) R_ji has expectation
    (1/n) sum_j (p_k/p_j) p_j = p_k. Tolerance: 5 Monte Carlo standard errors of the mean over
    the prompts (false alarm probability below 1e-6).
    """
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.15, 0.4, 0.7])
    n, G, prompts = 3, 8, 20000
    omega = p[:, None] / p[None, :]
    src = torch.arange(n).repeat_interleave(G).repeat(prompts)
    g = torch.arange(prompts).repeat_interleave(n * G)
    r = (torch.rand(len(src), generator=gen) < p[src]).float()
    for k in range(n):
        mu = capability_baseline(r, g, src, k, omega, guards=False).view(prompts, n * G)[:, 0]
        se = mu.std(unbiased=True).item() / math.sqrt(prompts)
        assert abs(mu.mean().item() - p[k].item()) < 5 * se, (k, mu.mean().item(), p[k].item(), se)
    # the plain pooled mean is biased towards the pool's mean for the weak and the strong agent
    plain = capability_baseline(r, g, src, 0, omega, use_capability=False, guards=False).view(prompts, -1)[:, 0]
    assert plain.mean().item() - p[0].item() > 0.2


def test_baseline_weight_is_the_inverse_of_the_loss_coefficient_with_non_reciprocal_bounds():
    # P_hat: learner a 0.2, source b 0.8; clamp bounds [0.1, 2] are not reciprocal, so
    # omega[b][a] = min(0.8 / 0.2, 2) = 2 (the loss coefficient of b's samples for a) while
    # omega[a][b] = 0.25: the baseline weights b's rewards by 1 / omega[b][a] = 0.5, not 0.25
    om = omega_matrix({"a": 0.2, "b": 0.8}, 0.1, 2.0)
    assert om["b"]["a"] == 2.0 and om["a"]["b"] == 0.25
    omega = torch.tensor([[om[i][j] for j in "ab"] for i in "ab"])
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    src = torch.tensor([0, 0, 1, 1])
    mu = capability_baseline(r, torch.zeros(4, dtype=torch.long), src, 0, omega)
    assert mu[0].item() == pytest.approx((1 + 0 + 0.5 * 1 + 0.5 * 1) / 4)  # 0.5; omega[a][b] would give 0.375


def test_cross_ratio_unit_learner_tokens_uses_the_aligned_trace_on_the_learners_tokens():
    # the learner cuts the text into 4 tokens, the producer into 2 (mean -0.25 over its tokens);
    # THL spread the producer's mass -0.5 over the learner's 4 tokens
    logp = torch.tensor([[-0.1, -0.2, -0.3, -0.4, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    aligned = torch.tensor([[-0.05, -0.05, -0.2, -0.2, 0.0]])

    def ratio(unit):
        inp = LossInputs(logp=logp, old_logp=torch.zeros_like(logp), mask=mask, advantages=torch.tensor([1.0]),
                         is_self=torch.tensor([False]), omega_src=torch.ones(1), behavior_logp=aligned,
                         behavior_logp_mean=torch.tensor([-0.25]))
        return LOSSES["hacpo"].fn(inp, HacpoLossOptions(cross_ratio_unit=unit))[1]["cross_ratio_mean"]

    assert ratio("source_tokens") == pytest.approx(math.exp(-0.25 - (-0.25)))  # -1.0 / 4 vs -0.5 / 2
    assert ratio("learner_tokens") == pytest.approx(math.exp((-1.0 + 0.5) / 4))


@pytest.mark.parametrize("peer_eos", ["drop", "keep_if_stopped"])
def test_learner_tokens_ratio_is_one_for_a_learner_scoring_its_own_sample_through_thl(peer_eos, tiny_problems):
    """The learner's own response, passed through THL as if a peer had sent it, scored by the
    learner itself: the ``learner_tokens`` ratio is exactly the identity."""
    import pandas as pd

    from hacrl.agents.scoring import pack, token_logprobs
    from hacrl.config.schema import ThlConfig
    from hacrl.exchange.experience import adapt_response

    from conftest import make_agent

    _, agent = make_agent("qwen2", "bytelevel_unigram", tiny_problems)
    tok = agent.tokenizer
    prompt = tok(agent.render("Compute 12+30."), add_special_tokens=False)["input_ids"]
    texts = [" \\boxed{42}", " 2+0=2, 1+3=4, so \\boxed{42}"]
    rows, pids, rids, aligned, means = [], [], [], [], []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            p_ids, attn, resp = pack([prompt], [ids], tok.pad_token_id)
            lp = token_logprobs(agent.model, p_ids, attn)[0, -len(ids):].tolist()  # its generation trace
        rec = pd.Series({"response_text": text, "response_token_ids": ids, "response_logprobs": lp,
                         "finish_reason": "stop"})
        ad = adapt_response(rec, tok, tok, ThlConfig(peer_eos=peer_eos))
        assert ad.ids == (ids if peer_eos == "keep_if_stopped" else ids[:-1])
        pids.append(prompt)
        rids.append(ad.ids)
        aligned.append(ad.alignment.aligned)
        means.append(ad.behavior_mean)
    ids, attn, resp = pack(pids, rids, tok.pad_token_id)
    with torch.no_grad():
        logp = token_logprobs(agent.model, ids, attn)
    beh = torch.zeros_like(resp)
    for i, v in enumerate(aligned):
        beh[i, resp.shape[1] - len(v):] = torch.tensor(v)
    inp = LossInputs(logp=logp, old_logp=logp, mask=resp, advantages=torch.ones(2), is_self=torch.zeros(2, dtype=torch.bool),
                     omega_src=torch.ones(2), behavior_logp=beh, behavior_logp_mean=torch.tensor(means))
    _, met = LOSSES["hacpo"].fn(inp, HacpoLossOptions(cross_ratio_unit="learner_tokens"))
    assert met["samples"]["ratio"].tolist() == pytest.approx([1.0, 1.0], abs=1e-6)


def test_source_block_layout_takes_the_official_updates_in_the_official_order():
    """n sources x P prompts x G samples, mini-batches of B prompts: n x P / B updates, the
    learner's own block first and cut exactly as an independent learner's batch, then each
    peer's block in pool order; no mini-batch mixes sources."""
    import pandas as pd

    from hacrl.rl.layout import minibatches, source_block_minibatches

    P, G, B = 8, 3, 2
    prod = [s for s in ("b", "a", "c") for _ in range(P * G)]  # learner b first, as in learner_input
    pid = [f"p{i // G}" for _ in range(3) for i in range(P * G)]
    df = pd.DataFrame({"prompt_id": pid, "producer": prod})
    mbs = source_block_minibatches(df["prompt_id"], df["producer"], ["b", "a", "c"], B, seed=7)
    assert len(mbs) == 3 * P // B
    assert [set(df["producer"].iloc[i]) for i in mbs] == [{"b"}] * 4 + [{"a"}] * 4 + [{"c"}] * 4
    assert all(len(i) == B * G and df["prompt_id"].iloc[i].nunique() == B for i in mbs)
    own = df[df["producer"] == "b"].reset_index(drop=True)
    assert [list(i) for i in mbs[:4]] == [list(i) for i in minibatches(own["prompt_id"], B, seed=7)]
    assert sorted(np.concatenate(mbs).tolist()) == list(range(len(df)))


def test_source_block_sizes_that_do_not_divide_are_refused():
    from hacrl.errors import ConfigError
    from hacrl.pipeline import params

    with pytest.raises(ConfigError, match=r"^rollout.prompts_per_iteration: .*not a whole number of "
                                                 r"mini-batches of 64 prompts"):
        params.compose(["algorithm=hacpo", "rollout.prompts_per_iteration=100", "trainer.mini_batch_prompts=64"])
    # GSPO x2: 2G samples per prompt, so a GSPO-sized mini-batch holds half the prompts
    with pytest.raises(ConfigError, match=r"^trainer.mini_batch_prompts: .*not a whole number of prompt groups"):
        params.compose(["algorithm=gspo_x2", "rollout.prompts_per_iteration=128", "trainer.mini_batch_prompts=63"])
    cfg = params.from_dict(params.compose(["algorithm=gspo_x2", "rollout.prompts_per_iteration=128",
                                           "trainer.mini_batch_prompts=64"]))
    from hacrl.rl.layout import prompts_per_update

    assert prompts_per_update(cfg) == 32


def test_only_samples_inside_their_window_count_as_carrying_gradient():
    # cross ratios 0.5 (below 0.8), 0.9 (inside), 1.5 (above 1); self ratio 1.1 with A > 0 is
    # clipped by GSPO's window (no gradient), self ratio 0.5 with A > 0 is not (min picks s A)
    new = torch.log(torch.tensor([0.5, 0.9, 1.5, 1.1, 0.5]))
    old = torch.zeros(5)
    is_self = torch.tensor([False, False, False, True, True])
    _, met = _loss(new, old, torch.ones(5), is_self, torch.ones(5))
    assert met["samples"]["active"].tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]
    _, met = _loss(new, old, torch.ones(5), is_self, torch.ones(5), cross_clip=False)
    assert met["samples"]["active"].tolist()[:3] == [1.0, 1.0, 1.0]


def test_cross_weight_removes_only_the_gradient_from_peers_samples():
    """``cross_weight=0`` (the control that isolates learning from peers): the self samples get
    HACPO's gradient, the same pooled mean's count; cross samples pass none. 0.5 halves it."""
    import dataclasses

    torch.manual_seed(1)
    old = torch.randn(6, 4) * 0.1 - 1
    is_self = torch.tensor([True, True, True, False, False, False])

    def grads(weight: float) -> torch.Tensor:
        logp = (old + torch.randn(6, 4, generator=torch.Generator().manual_seed(2)) * 0.02).requires_grad_()
        inp = LossInputs(logp=logp, old_logp=old, mask=torch.ones(6, 4), advantages=torch.tensor([1.0, -1, .5, 1, -1, .5]),
                         is_self=is_self, omega_src=torch.ones(6), behavior_logp=old + 0.01,
                         behavior_logp_mean=(old + 0.01).mean(1))
        opts = dataclasses.replace(HacpoLossOptions(cross_clip=False), cross_weight=weight)
        loss, _ = LOSSES["hacpo"].fn(inp, opts)
        loss.backward()
        return logp.grad

    full, none, half = grads(1.0), grads(0.0), grads(0.5)
    assert torch.equal(none[is_self], full[is_self]) and full[~is_self].abs().sum() > 0
    assert torch.count_nonzero(none[~is_self]) == 0
    assert torch.allclose(half[~is_self], 0.5 * full[~is_self]) and torch.equal(half[is_self], full[is_self])


def test_the_cross_share_of_the_objective_follows_the_aggregation():
    """``pooled_mean`` weighs every sample 1/B; ``split`` (mean(self) + mean(cross)) weighs a
    sample 1 / its side's rows: the cross share of |objective| and the per-sample terms say so."""
    new = torch.tensor([0.0, 0.0, 0.0, math.log(0.9)])  # three own samples (ratio 1), one cross inside the window
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    is_self = torch.tensor([True, True, True, False])
    terms = {"self": 3 * 1.0, "cross": 0.9 * 0.9}  # |s A| per own sample, |c sg[c] A| for the cross one
    _, pooled = _loss(new, old, adv, is_self, torch.ones(4))
    _, split = _loss(new, old, adv, is_self, torch.ones(4), aggregation="split")
    assert float(pooled["cross_objective_share"]) == pytest.approx(terms["cross"] / (terms["self"] + terms["cross"]))
    want = terms["cross"] / 1 / (terms["self"] / 3 + terms["cross"] / 1)
    assert float(split["cross_objective_share"]) == pytest.approx(want)
    # the per-sample terms weighted 1/B by the trainer give the same share
    t = split["samples"]["term"].abs() / 4
    assert float(t[3] / t.sum()) == pytest.approx(want)
