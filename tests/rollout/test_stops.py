"""A response's stop strings, a base model's BOS in its plain template, and the sharing report."""

from __future__ import annotations

from hacrl.rollout.engine import Completion, cut_at_stop


def test_completions_are_cut_after_the_token_that_completes_a_stop_string(tiny_problems):
    from conftest import make_agent

    tok = make_agent("gpt2", "bytelevel_bpe", tiny_problems)[1].tokenizer
    text = "7+1=8 so \\boxed{8}.\n\nCompute 3+4.\n3+4=7"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    c = Completion(0, 0, tok.decode(ids, skip_special_tokens=True), [1], ids, [-0.5] * len(ids), "length")
    plain = Completion(0, 1, "no stop here", [1], ids[:3], [-0.1] * 3, "length")
    cut, same = cut_at_stop([c, plain], tok, ["\n\n"])
    assert same is plain
    assert cut.text.startswith("7+1=8 so \\boxed{8}.\n\n") and "Compute" not in cut.text
    assert cut.finish_reason == "stop" and len(cut.logprobs) == len(cut.token_ids) < len(ids)
    assert cut.token_ids == ids[:len(cut.token_ids)]
    # one token fewer would not hold the stop string: the cut is the shortest
    assert "\n\n" not in tok.decode(cut.token_ids[:-1], skip_special_tokens=True)
    assert cut_at_stop([c], tok, []) == [c]


def test_a_plain_template_gets_the_bos_a_tokenizer_adds_by_default(tiny_problems):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from hacrl.agents.pool import bos_prefix, prompt_template
    from hacrl.config.schema import AgentConfig

    from conftest import make_agent

    words = {"<bos>": 0, "<eos>": 1, "[UNK]": 2, "x": 3, "Q": 4, ":": 5}
    raw = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", unk_token="[UNK]")
    assert tok("x")["input_ids"] == [0, 3] and bos_prefix(tok) == "<bos>"
    ac = AgentConfig(name="base", path="unused", template="Q: {problem}")
    assert prompt_template(ac, tok) == "<bos>Q: {problem}"
    # the rendered prompt, encoded as every stage encodes it, starts with BOS once
    assert tok(prompt_template(ac, tok).replace("{problem}", "x"), add_special_tokens=False)["input_ids"] == [0, 4, 5, 3]
    for kind in ("bytelevel_bpe", "metaspace_bpe", "bytelevel_unigram"):  # the embedded tokenizers add none
        assert bos_prefix(make_agent("gpt2", kind, tiny_problems)[1].tokenizer) == ""


def test_the_sharing_report_reads_a_runs_files(tmp_path):
    from hacrl.storage import RunLayout, write_json
    from hacrl.study.sharing import sharing_report

    lay = RunLayout(tmp_path)
    for t in (0, 1):
        write_json(lay.eval_metrics(t), {"agents": {"a": {"eval_accuracy": 0.25 + t / 10, "eval_stderr": 0.05},
                                                     "b": {"eval_accuracy": 0.5, "eval_stderr": 0.05}}})
    lay.exchange(1).mkdir(parents=True)
    pair = {"round_trip_mismatch": 0.125, "straddle_share": 0.02, "unmatched_share": 0.01, "mass_error_mean": 1e-3,
            "mass_error_max": 2e-3, "dropped_mass_mean": 0.0, "records": 8}
    write_json(lay.exchange(1) / "thl_residuals.json", {"pairs": {"a": {"b": pair}, "b": {"a": pair}}})
    write_json(lay.update_stats(1), {"a": {"ratio/a/q50": 1.0, "ratio/b/n": 8, "ratio/b/q10": 0.5, "ratio/b/q50": 0.8,
                                           "ratio/b/q90": 1.1, "ratio/b/clipped_below": 0.25,
                                           "ratio/b/clipped_above": 0.125}, "b": {}})
    md = sharing_report(tmp_path, "t")
    assert "| 0 | 25.0 % +- 5.0 % | 50.0 % +- 5.0 % |" in md and "| 1 | 35.0 % +- 5.0 % |" in md
    assert "| 1 | a | b | 8 | 12.5 % | 2.0 % | 1.0 % | 1.00e-03 | 2.00e-03 | 0.000 |" in md
    # inside = 1 - below - above; a learner's own samples are not a peer's
    assert "| 1 | a | b | 8 | 0.500 | 0.800 | 1.100 | 62.5 % | 25.0 % | 12.5 % |" in md and "| 1 | a | a |" not in md
