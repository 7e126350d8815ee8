"""The agent pool: tokenizers, models, prompt templates, loading.

An embedded agent is built from a transformers config and a tokenizer trained here with the
``tokenizers`` library, then saved as a Hugging Face directory. From then on every stage loads
it through ``AutoTokenizer`` / ``AutoModelForCausalLM`` exactly as it would load a real model
given by path: there is no code path that only the embedded pool takes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hacrl.config.schema import AgentConfig, TokenizerConfig
from hacrl.errors import ConfigError

log = logging.getLogger(__name__)

ARCHS = ("gpt2", "llama", "qwen2")
"""transformers architectures an embedded agent is built as (:func:`build_model`)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these makes a directory one AutoTokenizer can load."""
SPECIALS = {
    "bytelevel_bpe": {"eos": "<|endoftext|>", "pad": "<|pad|>", "unk": None},
    "metaspace_bpe": {"eos": "</s>", "pad": "<pad>", "unk": "<unk>"},
    "bytelevel_unigram": {"eos": "[EOS]", "pad": "[PAD]", "unk": "[UNK]"},
}


def train_tokenizer(cfg: TokenizerConfig, corpus: Iterable[str]):
    """Train a fast tokenizer of the configured kind; digits are always single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sp = SPECIALS.get(cfg.kind)
    if sp is None:
        raise ConfigError(f"tokenizer.kind: invalid value {cfg.kind!r} (choose from {', '.join(SPECIALS)})")
    specials = [s for s in (sp["unk"], sp["eos"], sp["pad"]) if s]
    digits = pre_tokenizers.Digits(individual_digits=True)
    if cfg.kind == "bytelevel_bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif cfg.kind == "metaspace_bpe":
        tok = Tokenizer(models.BPE(unk_token=sp["unk"]))
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, pre_tokenizers.Metaspace(prepend_scheme="never")])
        tok.decoder = decoders.Metaspace(prepend_scheme="never")
        trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=specials)
    else:  # bytelevel_unigram: almost character level, a very different segmentation
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.UnigramTrainer(vocab_size=max(cfg.vocab_size, 300), special_tokens=specials,
                                          unk_token=sp["unk"],
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus), trainer)
    if cfg.kind == "bytelevel_unigram":
        tok = _canonical_unigram(tok, len(specials))
    kwargs = {"eos_token": sp["eos"], "pad_token": sp["pad"]}
    if sp["unk"]:
        kwargs["unk_token"] = sp["unk"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left", **kwargs)


def _canonical_unigram(tok, n_special: int):
    """Fix the id order of a trained Unigram vocabulary.

    The ``tokenizers`` Unigram trainer is not reproducible across processes (hash-map order):
    the same pieces come out in another order, with scores that differ in late decimals.
    Specials keep their ids; the other pieces are ordered by text, so the ids are stable. When
    every other piece is a single character (the embedded pool's case), the segmentation of any
    text is unique and the scores decide nothing: they are all set to the same value, so the
    file is the same bytes on every run (a fresh clone reproduces the committed ``dvc.lock``).
    Otherwise they are rounded to 4 decimals and may still differ between runs.
    """
    import json
    import math

    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    rest = sorted(([p, round(s, 4)] for p, s in vocab[n_special:]), key=lambda x: x[0])
    if rest and all(len(p) == 1 for p, _ in rest):
        uniform = round(-math.log(len(rest)), 4)
        rest = [[p, uniform] for p, _ in rest]
    data["model"]["vocab"] = vocab[:n_special] + rest
    return Tokenizer.from_str(json.dumps(data))


def build_model(agent: AgentConfig, tokenizer, seed: int = 0):
    """A freshly initialised causal LM from the agent's transformers config (initial weights
    drawn with ``seed``)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
                  # untied: vLLM's in-place weight reload is only exact without tied embeddings
                  tie_word_embeddings=False)
    mc = dict(agent.model_config)
    if agent.arch == "gpt2":
        cfg = GPT2Config(**common, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **mc)
        return GPT2LMHeadModel(cfg)
    if agent.arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, **mc))
    if agent.arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, **mc))
    raise ConfigError(f"agents.{agent.name}.arch: invalid value {agent.arch!r} (choose from {', '.join(ARCHS)})")


@dataclass
class Agent:
    """A loaded agent: its name, tokenizer, model and prompt template, and the strings that end
    its responses (``agents[*].stop``)."""

    name: str
    tokenizer: object
    model: object
    template: str
    stop: tuple[str, ...] = ()

    def render(self, problem: str) -> str:
        return self.template.replace("{problem}", problem)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def load_tokenizer(agent: AgentConfig, model_dir: str | Path):
    """The agent's tokenizer as every stage sees it: ``tokenizer.path`` if set, else the model
    directory, through ``AutoTokenizer``; left padding, pad = EOS when it has no pad token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(agent.tokenizer.path or model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def bos_prefix(tokenizer) -> str:
    """The BOS token's text where the tokenizer puts one before a text by default (Gemma, Llama):
    every stage encodes rendered prompts without special tokens (the template decides what the
    model sees), so a plain template carries it; a chat template writes its own."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    with_special = tokenizer("x")["input_ids"]
    return bos if with_special[:1] == [bos_id] and tokenizer("x", add_special_tokens=False)["input_ids"][:1] != [bos_id] \
        else ""


def prompt_template(agent: AgentConfig, tokenizer) -> str:
    """The agent's prompt template as every stage fills it (``{problem}`` replaced by the text).

    With ``chat`` the template is wrapped once in the tokenizer's chat template (a user turn,
    then the opened assistant turn), so rendering stays a plain substitution everywhere. That is
    exact only when the chat template copies the message verbatim; it is checked on a sample
    problem, and a template that rewrites its content is refused.
    """
    if not agent.chat:
        return bos_prefix(tokenizer) + agent.template
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"agents.{agent.name}.chat: the tokenizer has no chat template")

    def chat(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    wrapped = chat(agent.template)
    probe = "12 + 3 * (4 - 1) = ?"
    if wrapped.count("{problem}") != agent.template.count("{problem}") or \
            wrapped.replace("{problem}", probe) != chat(agent.template.replace("{problem}", probe)):
        raise ConfigError(f"agents.{agent.name}.chat: the chat template does not copy the message verbatim")
    return wrapped


def load_agent(agent: AgentConfig, model_dir: str | Path, dtype: str = "fp32") -> Agent:
    """Load an agent from a Hugging Face directory (embedded or real, the same way)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"agent {agent.name}: model directory {model_dir} does not exist")
    tok = load_tokenizer(agent, model_dir)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    model.eval()
    return Agent(agent.name, tok, model, prompt_template(agent, tok), tuple(agent.stop))


def save_agent(agent: Agent, out_dir: str | Path) -> None:
    """Save model and tokenizer as one HF directory, atomically."""
    from hacrl.storage import atomic_path

    with atomic_path(out_dir, is_dir=True) as tmp:
        agent.model.save_pretrained(tmp)
        agent.tokenizer.save_pretrained(tmp)
