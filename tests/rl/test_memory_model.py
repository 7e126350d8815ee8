"""The memory model (src/hacrl/rl/memory.py) that docs/SCALING.md extrapolates with: its parameter
count from a config matches the model transformers builds, and each setting moves the component
it should (the figures themselves are checked against measured peaks by `hacrl bench memory`)."""

import pytest

from hacrl.rl.memory import Shape, kv_cache_bytes, update_bytes


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_the_parameter_count_from_a_config_is_the_models(arch):
    import transformers

    cfg = {"llama": lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                                       tie_word_embeddings=True),
           "qwen2": lambda: transformers.Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                                     tie_word_embeddings=False),
           "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=500, n_positions=64)}[arch]()
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    real = sum(p.numel() for p in model.parameters())
    est = Shape.of(cfg).params
    # the estimate leaves out norms and biases (and GPT-2's position table): within 10 % here, far
    # closer at real sizes
    assert abs(est - real) / real < 0.10, (est, real)


def _shape():
    return Shape(params=1_500_000_000, layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151_936)


def test_each_setting_moves_its_component():
    s = _shape()
    base = update_bytes(s, 8192, 4096, 1024)
    assert base["weights"] == base["gradients"] == 4 * s.params and base["optimizer"] == 8 * s.params
    assert base["zero_buffers"] == 0
    ckpt = update_bytes(s, 8192, 4096, 1024, checkpointing=True)
    assert ckpt["activations"] < base["activations"] / 5
    assert update_bytes(s, 16384, 4096, 1024)["activations"] == 2 * base["activations"]  # linear in the budget
    assert update_bytes(s, 8192, 4096, 1024, attention_weights=False)["activations"] < base["activations"]
    bf = update_bytes(s, 8192, 4096, 1024, dtype="bf16")
    assert bf["weights"] == 6 * s.params  # bf16 weights + fp32 master copy
    assert bf["activations"] == base["activations"] / 2
    z2 = update_bytes(s, 8192, 4096, 1024, dtype="bf16", zero_stage=2, world_size=4)
    assert z2["optimizer"] == 2 * s.params and z2["gradients"] < bf["gradients"]
    assert z2["zero_buffers"] > 0
    assert update_bytes(s, 8192, 4096, 1024, zero_stage=3, world_size=4)["weights"] == s.params
    assert update_bytes(s, 8192, 4096, 1024, logprob_chunk=256)["softmax_chunk"] == 3 * 256 * s.vocab * 4
    assert kv_cache_bytes(s, 1000) == 1000 * 2 * 28 * 2 * 128 * 4


def test_the_extrapolation_table_docs_scaling_shows():
    """docs/SCALING.md's table is this function's output, and its conclusions follow from it."""
    from pathlib import Path

    from hacrl.rl.memory import extrapolate

    table = extrapolate()
    rows = {tuple(c.strip() for c in line.split("|")[1:6]): line for line in table.splitlines()[2:]}
    assert rows[("Qwen2.5-1.5B", "1", "0", "on", "32,768")].rstrip(" |").split("| ")[-1].startswith("yes")
    assert rows[("Llama-3.1-8B", "1", "0", "on", "4,096")].rstrip(" |").split("| ")[-1].startswith("no")
    assert rows[("Llama-3.1-8B", "2", "2", "on", "16,384")].rstrip(" |").split("| ")[-1].startswith("yes")
    assert table in Path(__file__).resolve().parents[2].joinpath("docs", "SCALING.md").read_text()
