"""A memory model of one learner's update: bytes per component, from the model's shape and the
trainer's settings (docs/SCALING.md, "Memory"; checked there against measured peaks).

What an update holds at its peak, per device (one rank; ZeRO stages partition the optimizer,
gradients or weights over ``world_size`` ranks):

- ``weights``: the parameters in the training dtype, plus fp32 master copies with bf16;
- ``gradients``: one per parameter in the training dtype, plus DeepSpeed's fp32 copy with bf16
  (its bf16 optimizer keeps fp32 gradients at every ZeRO stage);
- ``optimizer``: Adam's two fp32 moments;
- ``zero_buffers`` (ZeRO >= 1): DeepSpeed's fp32 copy of this rank's partition of the weights and
  of the gradients where the model is fp32 (a bf16 model's are counted above), and two
  communication buckets (reduce and all-gather: 5e8 elements each by default, no more than the
  parameters) in the model's dtype: at one rank ZeRO costs memory and saves none;
- ``activations``: what the training forward keeps for its backward, per padded token of the
  micro-batch: every layer's tensors (about ``10 h + 5 I`` values, plus ``heads x S`` attention
  weights where the attention kernel keeps them), or with activation checkpointing each layer's
  input plus one layer recomputed;
- ``logits``: the head's output and its gradient at the response positions (the head projects
  those only), 2 values per vocabulary entry;
- ``softmax_chunk``: the chunked log-softmax's work space, about 3 fp32 tensors of
  ``logprob_chunk x vocabulary``.

The CPU allocator keeps some freed memory (measured about 30 % over the model on SmolLM2); a
GPU's caching allocator behaves alike. The model is an estimate to size a budget, not a bound.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """What the memory of a decoder-only transformer depends on."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @classmethod
    def of(cls, config, params: int | None = None) -> "Shape":
        """From a transformers config (GPT-2 names included); ``params`` when known."""
        g = lambda *names, d=None: next((getattr(config, n) for n in names if getattr(config, n, None)), d)  # noqa: E731
        h = int(g("hidden_size", "n_embd"))
        layers = int(g("num_hidden_layers", "n_layer"))
        inter = int(g("intermediate_size", "n_inner", d=4 * h) or 4 * h)
        heads = int(g("num_attention_heads", "n_head"))
        kv = int(g("num_key_value_heads", d=heads) or heads)
        vocab = int(config.vocab_size)
        if params is None:  # embeddings (tied or not) + per layer attention and MLP (3 matrices, or 2 for GPT-2)
            head_dim = h // heads
            attn = h * h * 2 + 2 * h * kv * head_dim
            mlp = (3 if getattr(config, "model_type", "") != "gpt2" else 2) * h * inter
            params = vocab * h * (1 if getattr(config, "tie_word_embeddings", True) else 2) + layers * (attn + mlp)
        return cls(int(params), layers, h, inter, heads, kv, vocab)


def update_bytes(shape: Shape, tokens: int, response_positions: int, seq_len: int, dtype: str = "fp32",
                 checkpointing: bool = False, logprob_chunk: int = 1024, zero_stage: int = 0, world_size: int = 1,
                 attention_weights: bool = True) -> dict[str, float]:
    """Bytes of each component at an update's peak (see the module's docstring). ``tokens``: the
    micro-batch's padded tokens (rows x longest row); ``response_positions``: rows x the longest
    response; ``seq_len``: the longest row; ``attention_weights``: whether the attention kernel
    keeps its (heads x S) weights for the backward (eager and the CPU's math path do; flash and
    memory-efficient attention on a GPU do not)."""
    b = 2 if dtype == "bf16" else 4
    p = shape.params
    shard = max(1, world_size)
    weights = p * b + (4 * p if dtype == "bf16" else 0)
    grads = p * b + (4 * p if dtype == "bf16" else 0)
    optim = 8 * p
    if zero_stage >= 1:
        optim /= shard
        weights -= (4 * p - 4 * p / shard) if dtype == "bf16" else 0
    if zero_stage >= 2:
        grads /= shard
    if zero_stage >= 3:
        weights /= shard
    zero_buffers = 0.0
    if zero_stage >= 1:
        zero_buffers = (8 * p / shard if dtype != "bf16" else 0) + 2 * min(5e8, p) * b
    per_layer = 10 * shape.hidden + 5 * shape.intermediate + (shape.heads * seq_len if attention_weights else 0)
    if checkpointing:
        act = tokens * (shape.layers * shape.hidden + per_layer) * b
    else:
        act = tokens * shape.layers * per_layer * b
    logits = response_positions * shape.vocab * 2 * b
    chunk = 3 * min(logprob_chunk, max(1, response_positions)) * shape.vocab * 4
    return {"weights": weights, "gradients": grads, "optimizer": optim, "zero_buffers": zero_buffers,
            "activations": act, "logits": logits, "softmax_chunk": chunk}


def kv_cache_bytes(shape: Shape, tokens: int, dtype: str = "fp32") -> float:
    """A generate call's KV cache: 2 x layers x kv heads x head dim values per token."""
    b = 2 if dtype == "bf16" else 4
    return tokens * 2 * shape.layers * shape.kv_heads * (shape.hidden // shape.heads) * b


PRESETS = {
    "Qwen2.5-1.5B": Shape(params=1_543_714_304, layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2,
                          vocab=151_936),
    "Llama-3.1-8B": Shape(params=8_030_261_248, layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                          vocab=128_256),
}
"""Shapes of two real models (their published configs), for :func:`extrapolate`."""

LAYOUTS = (  # (model, ranks, ZeRO, checkpointing, micro_batch_tokens)
    ("Qwen2.5-1.5B", 1, 0, False, 8192), ("Qwen2.5-1.5B", 1, 0, False, 16384), ("Qwen2.5-1.5B", 1, 0, True, 32768),
    ("Qwen2.5-1.5B", 1, 0, True, 65536), ("Qwen2.5-1.5B", 1, 1, True, 32768),
    ("Llama-3.1-8B", 1, 0, True, 4096), ("Llama-3.1-8B", 2, 2, True, 16384), ("Llama-3.1-8B", 4, 2, True, 32768),
    ("Llama-3.1-8B", 4, 2, False, 8192),
)


def extrapolate(layouts=LAYOUTS, gpu_gib: float = 141.0, margin: float = 1.25, context_gib: float = 2.0,
                prompt: int = 256, response: int = 1024) -> str:
    """A markdown table: each layout's bytes per component for bf16 rows of ``prompt`` +
    ``response`` tokens (flash attention: no attention weights kept), and whether ``total x
    margin + context_gib`` fits one GPU of ``gpu_gib`` (the margin covers the allocator's
    fragmentation; it is set from the ratio measured on the CPU, docs/SCALING.md)."""
    g = 2**30
    head = ("| model | GPUs | ZeRO | checkpointing | micro_batch_tokens | weights | gradients | Adam | ZeRO buffers "
            "| activations | logits | softmax chunk | total GiB | fits one {:.0f} GiB GPU |".format(gpu_gib))
    lines = [head, "|" + "---|" * 14]
    seq = prompt + response
    for name, ranks, zero, ckpt, budget in layouts:
        rows = max(1, budget // seq)
        p = update_bytes(PRESETS[name], rows * seq, rows * response, seq, "bf16", ckpt, 1024, zero, ranks,
                         attention_weights=False)
        total = sum(p.values()) / g
        fits = total * margin + context_gib <= gpu_gib
        lines.append(f"| {name} | {ranks} | {zero} | {'on' if ckpt else 'off'} | {budget:,} | "
                     + " | ".join(f"{p[k] / g:.1f}" for k in ("weights", "gradients", "optimizer", "zero_buffers",
                                                                   "activations", "logits", "softmax_chunk"))
                     + f" | {total:.1f} | {'yes' if fits else 'no'} ({total * margin + context_gib:.0f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(extrapolate())
