import dataclasses

import pytest

from hacrl.agents.pool import load_agent, save_agent
from hacrl.errors import ConfigError

from conftest import make_agent

KINDS = ["bytelevel_bpe", "metaspace_bpe", "bytelevel_unigram"]


@pytest.mark.parametrize("kind", KINDS)
def test_tokenizers_round_trip_task_text_and_keep_digits_single(kind, tiny_problems):
    _, agent = make_agent("gpt2", kind, tiny_problems)
    tok = agent.tokenizer
    for p in tiny_problems["heldout"][:50]:
        text = agent.render(p["problem"]) + f" \\boxed{{{p['answer']}}}"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        for t in tok.convert_ids_to_tokens(ids):
            digits = [c for c in t if c.isdigit()]
            assert len(digits) <= 1, f"{kind} merged digits into {t!r}"


def test_tokenizers_differ(tiny_problems):
    toks = [make_agent("gpt2", k, tiny_problems)[1].tokenizer for k in KINDS]
    text = "Q: Compute 37+45.\nA: \\boxed{82}"
    ids = [tuple(t(text)["input_ids"]) for t in toks]
    assert len(set(ids)) == 3
    models = {type(t.backend_tokenizer.model).__name__ for t in toks}
    assert models == {"BPE", "Unigram"}
    assert len({str(t.backend_tokenizer.pre_tokenizer) for t in toks}) == 2  # byte-level vs metaspace


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_agent_saves_and_loads_back_through_auto_classes(arch, tiny_problems, tmp_path):
    import torch

    ac, agent = make_agent(arch, "bytelevel_bpe", tiny_problems)
    save_agent(agent, tmp_path / "a")
    back = load_agent(ac, tmp_path / "a")
    assert type(back.model).__name__ == type(agent.model).__name__
    ids = torch.tensor([agent.tokenizer("Q: Compute 1+2.\nA:")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(agent.model(ids).logits, back.model(ids).logits)
    assert back.tokenizer.decode(ids[0]) == "Q: Compute 1+2.\nA:"
    assert not list(tmp_path.glob(".tmp-*"))


def test_missing_model_dir_is_a_clear_error(tiny_problems, tmp_path):
    ac, _ = make_agent("gpt2", "bytelevel_bpe", tiny_problems)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_agent(ac, tmp_path / "missing")


def test_unigram_ids_are_the_same_in_every_process():
    """The tokenizers Unigram trainer varies across processes; the pool fixes the id order."""
    import subprocess
    import sys

    code = (
        "import hashlib\n"
        "from hacrl.config.schema import TokenizerConfig\n"
        "from hacrl.agents.pool import train_tokenizer\n"
        "from hacrl.task.data import generate_split, completion_text\n"
        "tr = generate_split('train', 1500, {'add': 1, 'sub': 1}, 99, 0.2, 0)\n"
        "c = [p['problem'] + '\\n=>' + completion_text(p['answer']) for p in tr]\n"
        "t = train_tokenizer(TokenizerConfig(kind='bytelevel_unigram', vocab_size=400), c)\n"
        "print(hashlib.md5(str((t(c)['input_ids'], sorted(t.get_vocab().items()))).encode()).hexdigest(),\n"
        "      hashlib.md5(t.backend_tokenizer.to_str().encode()).hexdigest(),\n"
        "      max(len(p) for p in t.get_vocab()))\n"
    )
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            .stdout.strip().splitlines()[-1] for _ in range(3)}
    assert len(outs) == 1, outs
    # the pieces are single characters (plus specials), so the file itself is the same bytes
    # in every process (the scores are set equal: they cannot change a segmentation)
    assert int(outs.pop().split()[-1]) <= len("[EOS]")


def test_the_shared_tokenizer_pool_trains_one_tokenizer_for_both_agents(tiny_problems):
    """agents=embedded_shared_tok: the same tokenizer configuration and template give the
    identical tokenizer (same vocabulary, same ids), so THL is the identity between them."""
    from hacrl.agents.pool import build_model, train_tokenizer
    from hacrl.pipeline import params
    from hacrl.task.data import completion_text

    cfg = params.from_dict(params.compose(["agents=embedded_shared_tok"]))
    small, large = cfg.agents
    assert small.tokenizer == large.tokenizer and small.template == large.template and small.arch == large.arch
    toks = []
    for ac in (small, large):
        corpus = [ac.template.replace("{problem}", p["problem"]) + completion_text(p["answer"])
                  for p in tiny_problems["train"]]
        toks.append(train_tokenizer(ac.tokenizer, corpus))
    assert toks[0].get_vocab() == toks[1].get_vocab()
    text = " 7+8=15, 4+3+1=8, so \\boxed{85}"
    assert toks[0](text)["input_ids"] == toks[1](text)["input_ids"]
    sizes = [build_model(ac, toks[0]).num_parameters() for ac in (small, large)]
    assert sizes[1] > 4 * sizes[0]


CHAT = ("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_agents_get_their_chat_template_once(tiny_problems):
    from hacrl.agents.pool import prompt_template

    ac, agent = make_agent("llama", "bytelevel_bpe", tiny_problems)
    tok = agent.tokenizer
    assert prompt_template(ac, tok) == ac.template  # chat off: the plain template
    chat_ac = dataclasses.replace(ac, chat=True)
    with pytest.raises(ConfigError, match="no chat template"):
        prompt_template(chat_ac, tok)
    tok.chat_template = CHAT
    assert prompt_template(chat_ac, tok) == "<|user|>Q: {problem}\nA:<|end|><|assistant|>"
    tok.chat_template = CHAT.replace("m['content']", "m['content'] | trim | upper")
    with pytest.raises(ConfigError, match="does not copy the message verbatim"):
        prompt_template(chat_ac, tok)
