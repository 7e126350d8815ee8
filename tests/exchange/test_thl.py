"""THL: retokenisation, character spans and the log-prob alignment rule (hacrl.exchange.thl).

The tokenizers are trained here on task texts (plus some LaTeX / unicode lines), saved as Hugging
Face directories and loaded back through ``AutoTokenizer``, as agents are. A BERT-like WordPiece
tokenizer is added because its decode changes the spacing of the text.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hacrl.config.schema import ThlConfig
from hacrl.exchange.thl import Alignment, align_response, align_trace, residual_summary, retokenize, token_spans

SETTINGS = settings(max_examples=60, deadline=None)
NAMES = ["bytelevel_bpe", "metaspace_bpe", "bytelevel_unigram", "wordpiece", "bytelevel_bpe_mem"]
LOSSLESS = {"bytelevel_bpe", "bytelevel_unigram", "bytelevel_bpe_mem"}  # byte-level: decode(encode(t)) == t

EXTRA = ["\\frac{1}{2} + \\frac{3}{4} = \\frac{5}{4}", "café π ∑ 中文 x\n\ty", "Compute \\sqrt{2}*π.",
         "The answer is \\boxed{\\frac{7}{9}}.", "é è ∑_{i=1}^{n} i = 中"]
FRAGMENTS = ["Compute", "Compute ", " ", "  ", "\n", "\t", "\\boxed{", "}", "{", "\\frac{1}{2}", "+", "-", "=",
             "*", "/", ".", "(", ")", "é", "π", "∑", "中", "😀", "Q:", "A:", "boxed", "ab", "x"] + list("0123456789")
ALPHABET = "0123456789+-=*/ .\\{}()abcdexyzC\n\téπ∑中😀"
texts = st.one_of(st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join),
                  st.text(alphabet=ALPHABET, max_size=30))
logprob = st.floats(min_value=-30.0, max_value=0.0)


class Toks(dict):
    def __repr__(self) -> str:  # keep hypothesis' failure reports readable
        return f"Toks({list(self)})"


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> Toks:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from hacrl.agents.pool import train_tokenizer
    from hacrl.config.schema import TokenizerConfig
    from hacrl.task.data import completion_text, generate_split

    levels = {"add": 1.0, "sub": 1.0, "mul": 0.5, "frac": 0.5, "add3": 0.5}
    corpus = [f"Q: {p['problem']}\nA:{completion_text(p['answer'])}"
              for p in generate_split("train", 600, levels, 99, 0.2, 0)] + EXTRA * 10
    built = {kind: train_tokenizer(TokenizerConfig(kind=kind, vocab_size=vs), corpus)
             for kind, vs in (("bytelevel_bpe", 400), ("metaspace_bpe", 200), ("bytelevel_unigram", 300))}
    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.normalizer = normalizers.BertNormalizer(lowercase=False)
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wp.decoder = decoders.WordPiece()
    wp.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]", "[PAD]"]))
    built["wordpiece"] = PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]", eos_token="[SEP]",
                                                 pad_token="[PAD]")
    out = Toks()
    for name, tok in built.items():  # agents load their tokenizer from a HF directory
        d = tmp_path_factory.mktemp(name)
        tok.save_pretrained(d)
        out[name] = AutoTokenizer.from_pretrained(d)
    out["bytelevel_bpe_mem"] = built["bytelevel_bpe"]
    return out


# ---------------------------------------------------------------- oracles (independent of hacrl.exchange.thl)

def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def chunked(tok, text: str, cuts) -> tuple[list[int], list]:
    """Non-canonical ids: the text encoded piece by piece; and each token's true span."""
    bounds = sorted({0, len(text), *cuts})
    ids, spans, prev = [], [], 0
    for a, b in zip(bounds, bounds[1:]):
        enc = tok(text[a:b], add_special_tokens=False, return_offsets_mapping=True)
        for i, (s, e) in zip(enc["input_ids"], enc["offset_mapping"]):
            ids.append(i)
            s = max(s + a, prev)  # byte tokens of one character: the first one gets it
            e = max(e + a, s)
            spans.append(None if i in tok.all_special_ids else (s, e))
            prev = e if spans[-1] else prev
    return ids, spans


def assert_well_formed(spans, text: str) -> None:
    prev = 0
    for sp in spans:
        if sp is not None:
            s, e = sp
            assert prev <= s <= e <= len(text), (spans, text)
            prev = e


def expected_piece(name: str, tok, i: int) -> str | None:
    """What a token's span must hold (whitespace removed for WordPiece), where that is well defined."""
    if name == "wordpiece":
        return tok.convert_ids_to_tokens(i).removeprefix("##")
    d = tok.decode([i])
    return None if "\ufffd" in d else d


def assert_pieces(name: str, tok, ids, spans, text: str) -> None:
    for i, sp in zip(ids, spans):
        want = expected_piece(name, tok, i) if sp else None
        if want is not None:
            got = text[sp[0]:sp[1]]
            assert (re.sub(r"\s", "", got) if name == "wordpiece" else got) == want, (tok.convert_ids_to_tokens(ids), spans)


def covered(spans, text: str) -> bool:
    chars = set()
    for sp in spans:
        if sp:
            chars.update(range(*sp))
    return chars == set(range(len(text)))


def word_sets(text: str, spans, seg: str):
    """Per token: the words its non-space characters touch (a whitespace-only token: the next word)."""
    words = [m.span() for m in re.finditer(r"\S+" if seg == "whitespace" else r"\w+|[^\w\s]", text)]
    char_word = [-1] * len(text)
    for w, (s, e) in enumerate(words):
        char_word[s:e] = [w] * (e - s)
    out = []
    for sp in spans:
        if sp is None:
            out.append(None)
            continue
        s, e = sp
        chars = range(s, e) if e > s else range(s - 1, s) if s > 0 else range(0)
        touched = {char_word[c] for c in chars if not text[c].isspace()}
        if not touched and words:
            nxt = [w for w, (ws, _) in enumerate(words) if ws >= e]
            touched = {nxt[0] if nxt else len(words) - 1}
        out.append(touched)
    return words, out


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


@st.composite
def source_sequence(draw, toks, names=NAMES):
    """A source tokenizer, its (maybe non-canonical) ids, maybe an EOS, the decoded text, log-probs."""
    name = draw(st.sampled_from(names))
    tok = toks[name]
    text = draw(texts)
    if draw(st.booleans()):
        ids = chunked(tok, text, draw(st.sets(st.integers(0, len(text)), max_size=6)))[0]
    else:
        ids = encode(tok, text)
    if draw(st.booleans()):
        ids = ids + [tok.eos_token_id]
    lps = draw(st.lists(logprob, min_size=len(ids), max_size=len(ids)))
    return name, tok, ids, tok.decode(ids, skip_special_tokens=True), lps


# ---------------------------------------------------------------- retokenise

@SETTINGS
@given(text=texts)
def test_retokenize_exact_flag_is_never_wrong(toks, text):
    for name, tok in toks.items():
        r = retokenize(tok, text, append_eos=False)
        assert r.ids == encode(tok, text)
        assert r.exact == (tok.decode(r.ids, skip_special_tokens=True) == text)
        if name in LOSSLESS:
            assert r.exact
        r2 = retokenize(tok, text, append_eos=True)
        assert r2.ids == r.ids + [tok.eos_token_id] and r2.exact == r.exact


def test_retokenize_counts_lossy_round_trips(toks):
    assert not retokenize(toks["metaspace_bpe"], "x 😀", False).exact  # an unseen character becomes <unk>
    assert not retokenize(toks["wordpiece"], "37+45", False).exact  # WordPiece decode respaces
    r = retokenize(toks["bytelevel_bpe"], " \\boxed{82}", True)
    assert r.exact and r.ids[-1] == toks["bytelevel_bpe"].eos_token_id


# ---------------------------------------------------------------- spans

@SETTINGS
@given(text=texts)
def test_spans_of_canonical_ids(toks, text):
    for name, tok in toks.items():
        ids = encode(tok, text) + [tok.eos_token_id]
        spans = token_spans(tok, ids, text)
        assert len(spans) == len(ids) and spans[-1] is None
        assert [sp is None for sp in spans] == [i in tok.all_special_ids for i in ids]
        assert_well_formed(spans, text)
        assert_pieces(name, tok, ids, spans, text)
        if name in LOSSLESS:
            assert "".join(text[s:e] for s, e in spans[:-1]) == text


@SETTINGS
@given(data=st.data())
def test_spans_of_non_canonical_ids(toks, data):
    text = data.draw(texts)
    cuts = data.draw(st.sets(st.integers(0, len(text)), min_size=1, max_size=8))
    for name, tok in toks.items():
        ids, true_spans = chunked(tok, text, cuts)
        decoded = tok.decode(ids, skip_special_tokens=True)
        spans = token_spans(tok, ids, decoded)
        assert_well_formed(spans, decoded)
        assert_pieces(name, tok, ids, spans, decoded)
        if decoded == text and name != "wordpiece":
            assert spans == true_spans


@SETTINGS
@given(data=st.data())
def test_spans_of_split_tokens(toks, data):
    """A sampled response may hold 'bo'+'xed' where encode gives 'boxed'."""
    text = data.draw(texts)
    for name in ("bytelevel_bpe", "metaspace_bpe"):
        tok = toks[name]
        vocab = tok.get_vocab()
        ids = []
        for i in encode(tok, text):
            piece = tok.convert_ids_to_tokens(i)
            splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
            if splits and data.draw(st.booleans()):
                a, b = data.draw(st.sampled_from(splits))
                ids += [vocab[a], vocab[b]]
            else:
                ids.append(i)
        decoded = tok.decode(ids, skip_special_tokens=True)
        spans = token_spans(tok, ids, decoded)
        assert_well_formed(spans, decoded)
        assert_pieces(name, tok, ids, spans, decoded)
        if name == "bytelevel_bpe":
            assert "".join(decoded[s:e] for s, e in spans) == decoded == text


def test_split_token_spans_by_hand(toks):
    tok = toks["bytelevel_bpe"]
    vocab = tok.get_vocab()
    canonical = encode(tok, " \\boxed{82}")
    assert "boxed" in tok.convert_ids_to_tokens(canonical)
    ids = [vocab[p] for p in ("Ġ\\", "bo", "xed", "{", "8", "2", "}")]
    assert tok.decode(ids) == " \\boxed{82}"
    assert token_spans(tok, ids, " \\boxed{82}") == [(0, 2), (2, 4), (4, 7), (7, 8), (8, 9), (9, 10), (10, 11)]
    # an unseen character is four byte tokens: the first gets the character, the others are empty
    text = " \\boxed{😀}"
    ids, true_spans = chunked(tok, text, [4])
    assert ids != encode(tok, text) and tok.decode(ids) == text
    spans = token_spans(tok, ids, text)
    assert spans == true_spans and spans[-5:] == [(8, 9), (9, 9), (9, 9), (9, 9), (9, 10)]


class SlowLowercasing:
    """A tokenizer without offsets whose decode joins pieces with spaces and lowercases."""

    pieces = {0: "ab", 1: "c", 9: "</s>"}
    all_special_ids = [9]

    def __call__(self, text, **kwargs):
        raise NotImplementedError("offsets need a fast tokenizer")

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in self.all_special_ids))


def test_spans_without_offsets_match_through_spacing_and_normalisation():
    assert token_spans(SlowLowercasing(), [0, 1, 9], "AB  c") == [(0, 2), (3, 5), None]


# ---------------------------------------------------------------- alignment properties

@SETTINGS
@given(data=st.data())
def test_mass_is_preserved_per_sequence_and_per_word(toks, data):
    name, src, ids, text, lps = data.draw(source_sequence(toks))
    lrn = toks[data.draw(st.sampled_from(NAMES))]
    cfg = ThlConfig(segmentation=data.draw(st.sampled_from(["whitespace", "unicode_words"])),
                    refine_shared_boundaries=data.draw(st.booleans()))
    stopped = bool(ids) and ids[-1] == src.eos_token_id
    learner = retokenize(lrn, text, append_eos=stopped)
    a = align_response(text, src, ids, lps, lrn, learner.ids, cfg)

    assert (a.n_source, a.n_learner, len(a.aligned)) == (len(ids), len(learner.ids), len(learner.ids))
    assert close(a.aligned_mass, sum(a.aligned)) and close(a.source_mass + a.dropped_mass, sum(lps))
    s_spans, l_spans = token_spans(src, ids, text), token_spans(lrn, learner.ids, text)
    if covered(s_spans, text) and covered(l_spans, text):
        assert close(a.aligned_mass, a.source_mass)
    if stopped:  # trailing EOS pairs with trailing EOS
        assert a.aligned[-1] == lps[-1]

    words, s_sets = word_sets(text, s_spans, cfg.segmentation)
    _, l_sets = word_sets(text, l_spans, cfg.segmentation)
    assert a.straddling_source == sum(1 for w in s_sets if w and len(w) > 1)
    assert a.straddling_learner == sum(1 for w in l_sets if w and len(w) > 1)
    straddled = set().union(*(w for w in s_sets + l_sets if w and len(w) > 1))
    for w in range(len(words)):
        if w in straddled:
            continue
        src_mass = sum(lp for ws, lp in zip(s_sets, lps) if ws == {w})
        mine = [t for t, ws in enumerate(l_sets) if ws == {w}]
        if mine:
            assert close(sum(a.aligned[t] for t in mine), src_mass), (w, words[w])


@SETTINGS
@given(data=st.data())
def test_self_alignment_returns_the_trace(toks, data):
    name, tok, ids, text, lps = data.draw(source_sequence(toks))
    seg = data.draw(st.sampled_from(["whitespace", "unicode_words"]))
    spans = token_spans(tok, ids, text)
    a = align_trace(text, spans, lps, spans, ThlConfig(segmentation=seg, refine_shared_boundaries=True))
    assert a.aligned == [float(x) for x in lps]
    assert a.units == len(ids) and a.dropped_mass == 0 and a.lost_source == a.unmatched_learner == 0


@pytest.mark.parametrize("name", NAMES)
def test_self_alignment_with_multibyte_tails(toks, name):
    tok = toks[name]
    text = "中x 😀é ∑"
    ids = chunked(tok, text, [1, 3, 4])[0] + [tok.eos_token_id]
    decoded = tok.decode(ids, skip_special_tokens=True)
    spans = token_spans(tok, ids, decoded)
    lps = [-0.1 * (k + 1) for k in range(len(ids))]
    assert align_trace(decoded, spans, lps, spans, ThlConfig()).aligned == lps


# ---------------------------------------------------------------- the rule, by hand

CFG = ThlConfig()
RAW = ThlConfig(refine_shared_boundaries=False)


def test_straddling_source_token_merges_words():
    # "ab cd": source a | "b c" | d; learner ab | " " | cd
    a = align_trace("ab cd", [(0, 1), (1, 4), (4, 5)], [-1.0, -2.0, -4.0], [(0, 2), (2, 3), (3, 5)], CFG)
    assert a.aligned == pytest.approx([-7 / 3] * 3)
    assert (a.units, a.straddling_source, a.straddling_learner) == (1, 1, 0)
    assert math.isclose(a.aligned_mass, a.source_mass) and a.source_mass == -7.0


def test_whitespace_only_tokens_join_the_next_word():
    a = align_trace(" ab  c", [(0, 3), (3, 6)], [-1.0, -2.0], [(0, 1), (1, 3), (3, 4), (4, 5), (5, 6)], CFG)
    assert a.aligned == pytest.approx([-0.5, -0.5, -2 / 3, -2 / 3, -2 / 3])
    # a trailing whitespace token joins the last word
    a = align_trace("ab ", [(0, 3)], [-3.0], [(0, 2), (2, 3)], CFG)
    assert a.aligned == [-1.5, -1.5] and a.straddling_source == 0


def test_empty_span_tail_stays_with_its_character():
    # "é b" with é as two byte tokens (the tail has an empty span) against a learner é | " b"
    a = align_trace("é b", [(0, 1), (1, 1), (1, 2), (2, 3)], [-1.0, -2.0, -4.0, -8.0], [(0, 1), (1, 3)], CFG)
    assert a.aligned == [-3.0, -12.0] and a.units == 2


def test_shared_boundaries_refine_a_word():
    # "abcd": source a|bc|d, learner ab|c|d: both have a boundary at 3 only
    a = align_trace("abcd", [(0, 1), (1, 3), (3, 4)], [-1.0, -2.0, -4.0], [(0, 2), (2, 3), (3, 4)], CFG)
    assert a.aligned == [-1.5, -1.5, -4.0] and a.units == 2
    a = align_trace("abcd", [(0, 1), (1, 3), (3, 4)], [-1.0, -2.0, -4.0], [(0, 2), (2, 3), (3, 4)], RAW)
    assert a.aligned == pytest.approx([-7 / 3] * 3) and a.units == 1


def test_refinement_keeps_a_one_sided_piece_joined():
    # a source whitespace token before 'b' would alone form a piece with no learner token
    a = align_trace("a b", [(0, 1), (1, 2), (2, 3)], [-1.0, -2.0, -4.0], [(0, 2), (2, 3)], CFG)
    assert a.aligned == [-1.0, -6.0] and a.aligned_mass == a.source_mass


def test_unit_without_learner_tokens_is_a_mass_error():
    a = align_trace("ab cd", [(0, 2), (2, 5)], [-1.0, -2.0], [(0, 2)], CFG)
    assert a.aligned == [-1.0] and a.source_mass == -3.0 and a.aligned_mass == -1.0
    assert a.lost_source == 1 and a.unmatched_learner == 0
    # and a learner token in a unit without source tokens gets 0.0
    a = align_trace("ab cd", [(0, 2)], [-1.0], [(0, 2), (2, 5)], CFG)
    assert a.aligned == [-1.0, 0.0] and a.unmatched_learner == 1 and a.lost_source == 0
    s = residual_summary([a], [True])
    assert s["unmatched_share"] == pytest.approx(1 / 3) and s["mass_error_max"] == 0.0


def test_unicode_words_versus_whitespace():
    src, lrn, lps = [(0, 2), (2, 5)], [(0, 1), (1, 2), (2, 3), (3, 5)], [-1.0, -2.0]  # ab|+cd vs a|b|+|cd
    a = align_trace("ab+cd", src, lps, lrn, ThlConfig(segmentation="whitespace", refine_shared_boundaries=False))
    assert a.aligned == [-0.75] * 4 and a.straddling_source == 0 and a.units == 1
    a = align_trace("ab+cd", src, lps, lrn, ThlConfig(segmentation="unicode_words", refine_shared_boundaries=False))
    assert a.aligned == [-0.5, -0.5, -1.0, -1.0] and a.straddling_source == 1 and a.units == 2


def test_special_tokens_pair_from_the_end():
    text, two = "ab cd", [(0, 2), (2, 5)]
    a = align_trace(text, two + [None], [-1.0, -2.0, -0.5], two + [None], CFG)
    assert a.aligned == [-1.0, -2.0, -0.5] and a.dropped_mass == 0 and a.source_mass == -3.5 and a.units == 3
    a = align_trace(text, two + [None], [-1.0, -2.0, -0.5], two, CFG)  # learner without EOS
    assert a.aligned == [-1.0, -2.0] and a.dropped_mass == -0.5 and a.source_mass == -3.0
    a = align_trace(text, two, [-1.0, -2.0], two + [None], CFG)  # learner EOS, source did not stop
    assert a.aligned == [-1.0, -2.0, 0.0] and a.unmatched_learner == 1
    # two source specials, one learner special: the trailing ones pair, the earlier one is dropped
    a = align_trace(text, [(0, 2), None, (2, 5), None], [-1.0, -0.25, -2.0, -0.5], two + [None], CFG)
    assert a.aligned == [-1.0, -2.0, -0.5] and a.dropped_mass == -0.25 and a.source_mass == -3.5


def test_align_response_end_to_end(toks):
    src, lrn = toks["bytelevel_bpe"], toks["metaspace_bpe"]
    text = "Compute 37+45. \\boxed{82}"
    ids = encode(src, text) + [src.eos_token_id]
    lps = [-0.5] * len(ids)
    learner = retokenize(lrn, text, append_eos=True)
    a = align_response(text, src, ids, lps, lrn, learner.ids, CFG)
    assert learner.exact and a.aligned[-1] == -0.5
    assert a.aligned_mass == pytest.approx(a.source_mass) == pytest.approx(sum(lps))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="log-probs"):
        align_trace("ab", [(0, 2)], [], [(0, 2)], CFG)
    with pytest.raises(ValueError, match="segmentation"):
        align_trace("ab", [(0, 2)], [-1.0], [(0, 2)], ThlConfig(segmentation="bytes"))


# ---------------------------------------------------------------- residuals

def test_residual_summary():
    assert residual_summary([], []) == {"round_trip_mismatch": 0.0, "straddle_share": 0.0, "unmatched_share": 0.0,
                                        "mass_error_mean": 0.0, "mass_error_max": 0.0, "dropped_mass_mean": 0.0,
                                        "records": 0}
    a = Alignment([-1.0, -1.0], -2.0, -2.0, 0.0, 1, 1, 0, 2, 2)
    b = Alignment([-1.0], -3.0, -1.0, -0.5, 1, 0, 1, 3, 1, lost_source=1)
    s = residual_summary([a, b], [True, False])
    assert s["round_trip_mismatch"] == 0.5 and s["records"] == 2
    assert s["straddle_share"] == pytest.approx(2 / 8) and s["unmatched_share"] == pytest.approx(1 / 8)
    assert s["mass_error_mean"] == 1.0 and s["mass_error_max"] == 2.0 and s["dropped_mass_mean"] == -0.25
    with pytest.raises(ValueError):
        residual_summary([a], [])
