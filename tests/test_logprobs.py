"""Generation-time log-probs must equal the trainer's own forward (fp32, left padding)."""

import pytest
import torch

from conftest import make_agent
from hacrl.engines import HFEngine, SamplingParams
from hacrl.scoring import pack, token_logprobs


@pytest.mark.parametrize("arch, kind", [("gpt2", "bytelevel_bpe"), ("llama", "bytelevel_unigram"),
                                        ("qwen2", "metaspace_bpe")])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generation_logprobs_match_training_forward(arch, kind, temperature, tiny_problems):
    _, agent = make_agent(arch, kind, tiny_problems)
    # prompts of different lengths so the batch is left-padded
    prompts = [agent.render(p["problem"]) for p in tiny_problems["heldout"][:6]] + ["Q: 1?\nA:"]
    comps = HFEngine(agent.model, agent.tokenizer, batch_size=64).generate(
        prompts, SamplingParams(n=3, temperature=temperature, max_new_tokens=12, seed=1))
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
