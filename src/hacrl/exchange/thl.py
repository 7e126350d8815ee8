"""THL, the Tokenizer Heterogeneity Layer: a peer's response seen through the learner's tokenizer.

A peer ("source") agent produced a response: its token ids, its text
(``source_tokenizer.decode(ids, skip_special_tokens=True)``) and one log-prob per token. A learner
with another tokenizer (a) retokenises the text with its own tokenizer (:func:`retokenize`), and
(b) gets the source's log-prob trace carried onto its own tokens (:func:`align_response`).

Character spans (:func:`token_spans`). Each token of either side is located in the text as a
character span ``[start, end)``; special tokens (EOS, pad, unk, ...) carry no characters and get
``None``. Spans never overlap: when several byte-level tokens share one character (a multi-byte
character split into byte tokens) the first of them gets the character and the others an empty
span just after it.

The alignment rule (:func:`align_trace`), in plain words:

1. Words. The text is cut into words: with ``segmentation="whitespace"`` a word is a maximal run
   of non-space characters; with ``"unicode_words"`` it is a run of word characters (``\\w``), and
   every other non-space character is a word on its own. Either way, every non-space character
   of the text is in exactly one word.
2. Units. Alignment units start as the words. Every token of either side is placed by the
   non-space characters it carries. A token whose characters touch more than one unit merges
   those units into one (the token "straddles"; such tokens are counted): mass is never split
   between words by a guess. A token made only of whitespace goes with the unit that follows it
   (with the last unit when none follows). An empty-span token goes with the character just
   before it (it is the tail of that character's bytes).
3. Refinement (``refine_shared_boundaries``). Inside a unit, cut again wherever both
   tokenizations have a token boundary at the same place. A piece that would then hold tokens of
   only one side stays joined to the piece after it (or before it, at the end of the unit), so
   the refinement never loses mass. Identical tokenizations therefore align token for token, and
   aligning a tokenization with itself gives back the source trace exactly. (Positions are
   counted in characters, plus the rank of an empty-span token at its position, so byte tokens
   of one character are told apart too.)
4. Mass. The mass of a piece is the sum of the source log-probs in it; it is spread evenly over
   the learner tokens of the piece. A unit with source tokens and no learner token (after step 3
   only a whole unit can be one-sided) loses its mass: it shows as a mass error, and its tokens
   are counted in ``lost_source``. A learner token in a unit with no source token gets 0.0
   (counted in ``unmatched_learner``).
5. Special tokens. The source's special tokens are paired one to one with the learner's from
   the end (the trailing EOS with the trailing EOS): a paired learner special gets the source
   special's log-prob; an unpaired source special's log-prob is ``dropped_mass`` (not part of
   ``source_mass``); an unpaired learner special gets 0.0 (and counts in ``unmatched_learner``).
   Every special token counts here, a generated ``<unk>`` in mid-sequence included.

Hence the mass of a sequence is carried exactly whenever every character of the text is covered
by tokens on both sides, and the mass of each unit (of each word that no token straddles) is
carried exactly whenever the unit has learner tokens. Whether a peer's terminal EOS is kept is
the caller's choice (``ThlConfig.peer_eos``): it decides ``append_eos`` for :func:`retokenize`
and whether the source EOS is left out before aligning; the alignment itself never looks at it.
"""

from __future__ import annotations

import difflib
import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from hacrl.config.schema import ThlConfig

Span = tuple[int, int]

_WORDS = {"whitespace": re.compile(r"\S+"), "unicode_words": re.compile(r"\w+|[^\w\s]")}


@dataclass(frozen=True)
class Retokenized:
    """The learner's tokens of a peer's text."""

    ids: list[int]
    """The learner's token ids of the text (+ the learner's EOS id when asked and it has one)."""
    exact: bool
    """``tokenizer.decode(ids, skip_special_tokens=True) == text``."""


def retokenize(tokenizer, text: str, append_eos: bool) -> Retokenized:
    """Encode ``text`` with the learner's ``tokenizer`` (no special tokens added) and say whether
    decoding gives the text back; append the learner's EOS when ``append_eos``."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    exact = tokenizer.decode(ids, skip_special_tokens=True) == text
    eos = tokenizer.eos_token_id
    if append_eos and eos is not None:
        ids.append(eos)
    return Retokenized(ids, exact)


def token_spans(tokenizer, ids: Sequence[int], text: str) -> list[Span | None]:
    """Character span ``[start, end)`` in ``text`` of each token of ``ids``; None for a special token.

    ``ids`` need not be the canonical encoding of ``text``. When encoding the text gives exactly
    the non-special ids, its offsets are used; otherwise the characters each token adds to the
    decoded prefix are matched against the text (see :func:`_decoded_spans`). Spans are
    non-overlapping and increasing; whitespace a token carries is part of its span; a token that
    carries no whole character (the 2nd..4th byte token of one character) gets an empty span
    right after the character its first byte token got.
    """
    special = set(tokenizer.all_special_ids)
    ids = [int(i) for i in ids]
    spans = _offset_spans(tokenizer, ids, special, text)
    return spans if spans is not None else _decoded_spans(tokenizer, ids, special, text)


def _offset_spans(tokenizer, ids: list[int], special: set[int], text: str) -> list[Span | None] | None:
    """Spans from the tokenizer's own offsets, or None when its encoding of the text is not ``ids``
    (special tokens, e.g. an ``<unk>`` the encoder produced, aside)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        if backend is not None:  # the Rust encoder directly: 3-4x cheaper than __call__
            enc = backend.encode(text, add_special_tokens=False)
            got, offsets = enc.ids, enc.offsets
        else:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            got, offsets = enc["input_ids"], enc["offset_mapping"]
    except (NotImplementedError, TypeError, ValueError):  # slow tokenizers have no offsets
        return None
    kept = [(i, o) for i, o in zip(got, offsets) if i not in special]
    if [i for i, _ in kept] != [i for i in ids if i not in special]:
        return None
    it = iter(_clip(o for _, o in kept))
    return [None if i in special else next(it) for i in ids]


def _clip(offsets) -> list[Span]:
    """Make spans non-overlapping: a character shared by several tokens goes to the first."""
    out: list[Span] = []
    prev = 0
    for s, e in offsets:
        s = max(int(s), prev)
        e = max(int(e), s)
        out.append((s, e))
        prev = e
    return out


def _decoded_spans(tokenizer, ids: list[int], special: set[int], text: str) -> list[Span | None]:
    """Spans of a non-canonical token sequence, by incremental decoding.

    Each token owns the characters it adds to the decoded prefix. A character that replaces a
    U+FFFD of the previous prefix (an incomplete multi-byte character now completed) keeps the
    owner of that U+FFFD, i.e. the first token of the character. The decoded characters are then
    matched to the text (``difflib``): what the decoder inserted (spaces) or the text has and no
    token produced is skipped, and a replaced run (a normaliser's change) is matched in order.
    A token left without characters gets an empty span where the previous one ended.
    """
    plain = [i for i in ids if i not in special]
    owners: list[int] = []  # the token owning each character of the decoded prefix
    chars = ""
    for k in range(len(plain)):
        cur = tokenizer.decode(plain[: k + 1], skip_special_tokens=True)
        cp = 0
        limit = min(len(chars), len(cur))
        while cp < limit and chars[cp] == cur[cp]:
            cp += 1
        old_chars, old_owners = chars[cp:], owners[cp:]
        del owners[cp:]
        for j, ch in enumerate(cur[cp:]):
            keep = j < len(old_chars) and old_chars[j] in ("\ufffd", ch)
            owners.append(old_owners[j] if keep else k)
        chars = cur
    first = [-1] * len(plain)
    last = [-1] * len(plain)
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, chars, text, autojunk=False).get_opcodes():
        if tag in ("equal", "replace"):
            for d in range(min(i2 - i1, j2 - j1)):
                o = owners[i1 + d]
                if first[o] < 0:
                    first[o] = j1 + d
                last[o] = j1 + d
    spans: list[Span] = []
    pos = 0
    for k in range(len(plain)):
        if first[k] >= 0:
            spans.append((max(first[k], pos), last[k] + 1))
            pos = last[k] + 1
        else:
            spans.append((pos, pos))
    it = iter(spans)
    return [None if i in special else next(it) for i in ids]


@dataclass(frozen=True)
class Alignment:
    """A source log-prob trace carried onto the learner's tokens, with its residuals."""

    aligned: list[float]
    """One value per learner token (same length as the learner spans)."""
    source_mass: float
    """Sum of the source log-probs that entered the alignment."""
    aligned_mass: float
    """``sum(aligned)``."""
    dropped_mass: float
    """Source mass deliberately left out (an unpaired source special, e.g. a terminal EOS)."""
    units: int
    """Number of alignment units (text pieces after refinement, plus paired specials)."""
    straddling_source: int
    """Source tokens whose characters touch more than one word."""
    straddling_learner: int
    n_source: int
    n_learner: int
    lost_source: int = 0
    """Source tokens whose mass reached no learner token (a piece without learner tokens)."""
    unmatched_learner: int = 0
    """Learner tokens that got 0.0 (no source token in their piece, or an unpaired special)."""


def _placements(spans: Sequence[Span | None], starts: list[int], ends: list[int],
                link: list[bool]) -> tuple[list[int], int]:
    """Word index of each spanned token (-1 for specials); mark merges in ``link``; count straddlers."""
    n_words = len(starts)
    word = []
    straddling = 0
    for sp in spans:
        if sp is None:
            word.append(-1)
            continue
        a, b = sp
        if a == b and a > 0:  # empty span: the tail bytes of the character before it
            a -= 1
        lo = bisect_right(ends, a)
        hi = bisect_left(starts, b) - 1
        if hi > lo:
            straddling += 1
            for w in range(lo, hi):
                link[w] = True
        word.append(min(lo, n_words - 1))
    return word, straddling


def _positions(spans: Sequence[Span | None], scale: int) -> tuple[list[int], set[int]]:
    """Start position of each spanned token and the set of all boundaries of one side.

    A position is ``char * scale + rank``, the rank counting the empty-span tokens already
    at that character, so that the byte tokens of one character have distinct boundaries.
    """
    starts: list[int] = []
    bounds: set[int] = set()
    end = -1
    for sp in spans:
        if sp is None:
            starts.append(-1)
            continue
        s, e = sp
        start = end if s * scale <= end < (s + 1) * scale else s * scale
        end = e * scale if e > s else start + 1
        starts.append(start)
        bounds.add(start)
        bounds.add(end)
    return starts, bounds


def align_trace(text: str, source_spans: Sequence[Span | None], source_logprobs: Sequence[float],
                learner_spans: Sequence[Span | None], cfg: ThlConfig) -> Alignment:
    """Carry the source log-prob trace onto the learner's tokens by the rule of this module."""
    if len(source_spans) != len(source_logprobs):
        raise ValueError(f"{len(source_spans)} source spans but {len(source_logprobs)} log-probs")
    pattern = _WORDS.get(cfg.segmentation)
    if pattern is None:
        raise ValueError(f"segmentation: invalid value {cfg.segmentation!r} (choose from {', '.join(_WORDS)})")
    words = [m.span() for m in pattern.finditer(text)] or [(0, len(text))]
    w_starts = [s for s, _ in words]
    w_ends = [e for _, e in words]
    link = [False] * len(words)
    src_word, strad_s = _placements(source_spans, w_starts, w_ends, link)
    lrn_word, strad_l = _placements(learner_spans, w_starts, w_ends, link)
    unit_of_word = []
    u = 0
    for w in range(len(words)):
        unit_of_word.append(u)
        u += not link[w]

    n_s, n_l = len(source_spans), len(learner_spans)
    if cfg.refine_shared_boundaries:
        scale = n_s + n_l + 1
        src_pos, src_bounds = _positions(source_spans, scale)
        lrn_pos, lrn_bounds = _positions(learner_spans, scale)
        cuts = sorted(src_bounds & lrn_bounds)
    else:
        src_pos, lrn_pos, cuts = [0] * n_s, [0] * n_l, []

    # piece key: (unit, number of shared cuts at or before the token's start)
    pieces: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for side, (word, pos) in enumerate(((src_word, src_pos), (lrn_word, lrn_pos))):
        for t, w in enumerate(word):
            if w >= 0:
                key = (unit_of_word[w], bisect_right(cuts, pos[t]))
                pieces.setdefault(key, ([], []))[side].append(t)

    final: list[tuple[list[int], list[int]]] = []
    final_unit: list[int] = []
    pend_s: list[int] = []
    pend_l: list[int] = []
    cur = -1
    for key in sorted(pieces):
        if key[0] != cur:
            _flush(final, final_unit, pend_s, pend_l, cur)
            pend_s, pend_l, cur = [], [], key[0]
        s, lr = pieces[key]
        pend_s += s
        pend_l += lr
        if pend_s and pend_l:  # a one-sided piece waits to join the next piece of its unit
            final.append((pend_s, pend_l))
            final_unit.append(cur)
            pend_s, pend_l = [], []
    _flush(final, final_unit, pend_s, pend_l, cur)

    aligned = [0.0] * n_l
    source_mass = 0.0
    lost = unmatched = 0
    for s, lr in final:
        mass = float(sum(float(source_logprobs[t]) for t in s))
        source_mass += mass
        if lr:
            share = mass / len(lr)
            for t in lr:
                aligned[t] = share
            unmatched += 0 if s else len(lr)
        else:
            lost += len(s)

    src_special = [t for t, w in enumerate(src_word) if w < 0]
    lrn_special = [t for t, w in enumerate(lrn_word) if w < 0]
    paired = min(len(src_special), len(lrn_special))
    for t_s, t_l in zip(src_special[len(src_special) - paired:], lrn_special[len(lrn_special) - paired:]):
        aligned[t_l] = float(source_logprobs[t_s])
        source_mass += float(source_logprobs[t_s])
    dropped = float(sum(float(source_logprobs[t]) for t in src_special[: len(src_special) - paired]))
    unmatched += len(lrn_special) - paired

    return Alignment(aligned=aligned, source_mass=float(source_mass), aligned_mass=float(sum(aligned)),
                     dropped_mass=dropped, units=len(final) + paired, straddling_source=strad_s,
                     straddling_learner=strad_l, n_source=n_s, n_learner=n_l, lost_source=lost,
                     unmatched_learner=unmatched)


def _flush(final: list[tuple[list[int], list[int]]], final_unit: list[int], pend_s: list[int],
           pend_l: list[int], unit: int) -> None:
    """Close a unit: a one-sided remainder joins the unit's last piece, or stands alone."""
    if not (pend_s or pend_l):
        return
    if final_unit and final_unit[-1] == unit:
        final[-1][0].extend(pend_s)
        final[-1][1].extend(pend_l)
    else:
        final.append((pend_s, pend_l))
        final_unit.append(unit)


def align_response(text: str, source_tokenizer, source_ids: Sequence[int], source_logprobs: Sequence[float],
                   learner_tokenizer, learner_ids: Sequence[int], cfg: ThlConfig) -> Alignment:
    """:func:`token_spans` on both sides, then :func:`align_trace`."""
    return align_trace(text, token_spans(source_tokenizer, source_ids, text), source_logprobs,
                       token_spans(learner_tokenizer, learner_ids, text), cfg)


def residual_summary(alignments: Sequence[Alignment], exact: Sequence[bool]) -> dict[str, float]:
    """Residual metrics of one (producer tokenizer, learner tokenizer) pair.

    ``round_trip_mismatch``: share of responses whose retokenisation was not exact;
    ``straddle_share``: straddling tokens of both sides over all tokens of both sides;
    ``unmatched_share``: lost source tokens plus unmatched learner tokens over all tokens;
    ``mass_error_mean`` / ``mass_error_max``: ``|aligned_mass - source_mass|`` per sequence;
    ``dropped_mass_mean``; ``records``. Empty input gives zeros and ``records`` 0.
    """
    if len(alignments) != len(exact):
        raise ValueError(f"{len(alignments)} alignments but {len(exact)} exactness flags")
    n = len(alignments)
    keys = ("round_trip_mismatch", "straddle_share", "unmatched_share", "mass_error_mean", "mass_error_max",
            "dropped_mass_mean")
    if n == 0:
        return {**dict.fromkeys(keys, 0.0), "records": 0}
    tokens = sum(a.n_source + a.n_learner for a in alignments)
    errors = [abs(a.aligned_mass - a.source_mass) for a in alignments]
    return {
        "round_trip_mismatch": sum(not e for e in exact) / n,
        "straddle_share": sum(a.straddling_source + a.straddling_learner for a in alignments) / tokens if tokens else 0.0,
        "unmatched_share": sum(a.lost_source + a.unmatched_learner for a in alignments) / tokens if tokens else 0.0,
        "mass_error_mean": sum(errors) / n,
        "mass_error_max": max(errors),
        "dropped_mass_mean": sum(a.dropped_mass for a in alignments) / n,
        "records": n,
    }
