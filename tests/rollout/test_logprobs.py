"""Generation-time log-probs must equal the trainer's own forward (fp32, left padding)."""

import pytest
import torch

from hacrl.agents.scoring import pack, token_logprobs
from hacrl.rollout.engine import SamplingParams
from hacrl.rollout.hf import HFEngine

from conftest import make_agent


@pytest.mark.parametrize("arch, kind", [("gpt2", "bytelevel_bpe"), ("llama", "bytelevel_unigram"),
                                        ("qwen2", "metaspace_bpe")])
@pytest.mark.parametrize("temperature, sampler", [(1.0, "multinomial"), (0.7, "multinomial"), (0.7, "inverse_cdf")])
def test_generation_logprobs_match_training_forward(arch, kind, temperature, sampler, tiny_problems):
    _, agent = make_agent(arch, kind, tiny_problems)
    # prompts of different lengths so the batch is left-padded
    prompts = [agent.render(p["problem"]) for p in tiny_problems["heldout"][:6]] + ["Q: 1?\nA:"]
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=12, seed=1, sampler=sampler)
    comps = HFEngine(agent.model, agent.tokenizer, batch_size=64).generate(prompts, params)
    again = HFEngine(agent.model, agent.tokenizer, batch_size=64).generate(prompts, params)
    assert [c.token_ids for c in again] == [c.token_ids for c in comps]  # reproducible from the seed
    lens = {len(c.prompt_token_ids) for c in comps}
    assert len(lens) > 1, "the batch must mix prompt lengths (left padding)"
    ids, attn, resp = pack([c.prompt_token_ids for c in comps], [c.token_ids for c in comps],
                           agent.tokenizer.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(agent.model, ids, attn, temperature)
    L = resp.shape[1]
    worst = 0.0
    for i, c in enumerate(comps):
        train_lp = lp[i, L - len(c.token_ids):]
        worst = max(worst, (train_lp - torch.tensor(c.logprobs)).abs().max().item())
    assert worst < 1e-4, worst
    assert resp.sum().item() == sum(len(c.token_ids) for c in comps)


def test_without_position_ids_gpt2_would_disagree(tiny_problems):
    """The trap the scoring function avoids: GPT-2 under left padding needs position ids."""
    _, agent = make_agent("gpt2", "bytelevel_bpe", tiny_problems)
    ids, attn, _ = pack([[5, 6, 7], [5]], [[8, 9], [8, 9]], agent.tokenizer.pad_token_id)
    with torch.no_grad():
        good = token_logprobs(agent.model, ids, attn)
        logits = agent.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        naive = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert (good[1, -2:] - naive[1, -2:]).abs().max() > 1e-3


@pytest.mark.parametrize("greedy", [False, True])
def test_step_logprobs_are_the_bits_of_generates_own_logits(greedy, tiny_problems):
    """The engine keeps one step's distribution at a time (a forward hook); its tokens and
    log-probs equal, bit for bit, those of ``output_logits=True`` with the same seed."""
    _, agent = make_agent("llama", "bytelevel_unigram", tiny_problems)
    tok, model = agent.tokenizer, agent.model
    prompts = [agent.render(p["problem"]) for p in tiny_problems["heldout"][:5]] + ["Q: 1?\nA:"]
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=10, seed=4, greedy=greedy)
    comps = HFEngine(model, tok, batch_size=64).generate(prompts, params)
    # the engine's batch, seed and padding, generated again keeping every step's raw logits
    enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    jobs = [(i, s) for i in range(len(prompts)) for s in range(params.n)]
    order = sorted(range(len(jobs)), key=lambda j: len(enc[jobs[j][0]]))
    L = max(map(len, enc))
    ids = torch.tensor([[tok.pad_token_id] * (L - len(enc[jobs[j][0]])) + enc[jobs[j][0]] for j in order])
    attn = (torch.arange(L)[None, :] >= torch.tensor([L - len(enc[jobs[j][0]]) for j in order])[:, None]).long()
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(params.seed))))
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=0.7, top_p=1.0, top_k=0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=10, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, output_logits=True, return_dict_in_generate=True, **kw)
    new = out.sequences[:, L:]
    lp = torch.log_softmax(torch.stack(out.logits, 1).float() / (1.0 if greedy else 0.7), -1)
    lp = lp.gather(-1, new[..., None]).squeeze(-1)
    for r, j in enumerate(order):
        c = comps[j]
        assert c.token_ids == new[r].tolist()[:len(c.token_ids)]
        assert c.logprobs == lp[r, :len(c.token_ids)].tolist()


def test_chunked_logprobs_and_entropies_are_the_whole_expression_bit_for_bit():
    """The vocabulary-wide softmax one chunk of positions at a time gives the bits of
    ``log_softmax(logits / T).gather(...)`` (values and gradients) and of its entropy."""
    from hacrl.agents.scoring import selected_logprobs

    torch.manual_seed(0)
    for B, T, V, temp, chunk in ((3, 17, 400, 1.0, 20), (5, 9, 3000, 0.7, 1), (2, 33, 257, 1.3, 10**6), (2, 40, 300, 0.9, 7)):
        logits = torch.randn(B, T, V) * 3
        idx = torch.randint(0, V, (B, T))
        w = torch.randn(B, T)
        a = logits.clone().requires_grad_(True)
        ls = torch.log_softmax(a.float() / temp, dim=-1)
        ref = ls.gather(-1, idx[..., None]).squeeze(-1)
        ent = -(ls.exp() * ls).sum(-1)
        (ref * w).sum().backward()
        b = logits.clone().requires_grad_(True)
        got = selected_logprobs(b, idx, temp, chunk)
        (got * w).sum().backward()
        assert torch.equal(got, ref) and torch.equal(b.grad, a.grad)
        got2, got_ent = selected_logprobs(logits.clone().requires_grad_(True), idx, temp, chunk, with_entropy=True)
        assert torch.equal(got2, ref) and torch.equal(got_ent, ent.detach()) and not got_ent.requires_grad


@pytest.mark.parametrize("arch, kind", [("gpt2", "bytelevel_bpe"), ("llama", "bytelevel_unigram"),
                                        ("qwen2", "metaspace_bpe")])
@pytest.mark.parametrize("one_token_prompt", [False, True])
def test_shared_prefix_scoring_equals_the_whole_sequence_forward(arch, kind, one_token_prompt, tiny_problems):
    """``trainer.share_prompt_prefix``: each distinct prompt prefilled once, its rows' responses
    scored after its cache, gives the whole-sequence forward's log-probs, entropies and gradients
    to float rounding, laid out as :func:`pack` lays them out (prompts of different lengths, a
    prompt's several samples, responses of different lengths including a one-token one; with a
    one-token prompt, whose rows have no prefix to share)."""
    from hacrl.agents.scoring import response_span, shared_prefix_logprobs

    _, agent = make_agent(arch, kind, tiny_problems)
    tok = agent.tokenizer
    texts = [agent.render(p["problem"]) for p in tiny_problems["heldout"][:3]] + ["Q: 1?\nA:"]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    if one_token_prompt:  # nothing to cache before its last token: the whole-sequence forward
        prompts.append(prompts[0][:1])
    g = torch.Generator().manual_seed(0)
    rows_p, rows_r = [], []
    for k, p in enumerate(prompts):
        for n in (1, 5, 9)[: 1 + k % 3]:
            rows_p.append(p)
            rows_r.append(torch.randint(5, tok.vocab_size, (n,), generator=g).tolist())
    ids, attn, resp = pack(rows_p, rows_r, tok.pad_token_id)

    def run(shared: bool):
        agent.model.zero_grad()
        if shared:
            lp, ent = shared_prefix_logprobs(agent.model, rows_p, rows_r, tok.pad_token_id, ids.shape[1],
                                             0.7, with_entropy=True, chunk=7)
        else:
            lp, ent = token_logprobs(agent.model, ids, attn, 0.7, with_entropy=True, span=response_span(resp), chunk=7)
        (lp * resp).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in agent.model.parameters() if p.grad is not None])
        return lp.detach(), ent, grads

    lp_a, ent_a, g_a = run(False)
    lp_b, ent_b, g_b = run(True)
    assert lp_b.shape == lp_a.shape
    assert ((lp_b != 0) <= (resp > 0)).all(), "a score outside the response positions"
    assert ((lp_a - lp_b) * resp).abs().max() < 1e-4
    assert ((ent_a - ent_b) * resp).abs().max() < 1e-4
    assert (g_a - g_b).norm() / g_a.norm() < 1e-4


def test_inverse_cdf_sampler_draws_the_distribution_that_multinomial_draws():
    """rollout.sampler=inverse_cdf: the token frequencies are softmax(logits / T) (within sampling
    noise, 40,000 draws), and top-p keeps the tokens transformers' TopPLogitsWarper keeps."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from hacrl.rollout.hf import InverseCDFSampler

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g) * 2
    torch.manual_seed(1)
    counts = torch.zeros(3, 40)
    draw = InverseCDFSampler(0.7)
    for _ in range(400):  # 100 rows per call: 40,000 draws per distribution
        out = draw(None, logits.repeat_interleave(100, 0))
        assert ((out == 0).sum(-1) == 1).all() and torch.isinf(out).sum() == out.numel() - out.shape[0]
        counts += (out == 0).float().view(3, 100, 40).sum(1)
    p = torch.softmax(logits / 0.7, -1)
    assert ((counts / 40000 - p).abs() <= 4 * (p * (1 - p) / 40000).sqrt() + 1e-3).all()
    # the nucleus: the same support as transformers' warper
    for top_p in (0.3, 0.8, 0.95):
        kept = torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone()))
        seen = torch.zeros_like(kept)
        nucleus = InverseCDFSampler(1.0, top_p)
        for _ in range(300):
            seen |= nucleus(None, logits) == 0
        assert (seen <= kept).all() and seen.sum() >= kept.sum() - 1
