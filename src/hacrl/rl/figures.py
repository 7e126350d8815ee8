"""Figures of an update that add up exactly over the parts a mini-batch is cut into.

One optimizer update trains on one mini-batch. A memory budget cuts it into micro-batches
(:mod:`hacrl.rl.micro`) and data parallelism spreads it over ranks; its loss and gradient are the
same either way. Its figures must be too: a token mean is the mean over the mini-batch's tokens,
not the mean of the micro-batches' means, and a count is their sum. So every figure a loss (or the
update itself) reports is a :class:`Part`: a float, read as the part's own figure, that also
carries how parts combine. :func:`merge` combines the parts of one update:

=========  ===============================================  ==========================================
kind       a part holds                                     merged
=========  ===============================================  ==========================================
``mean``   the sum of the values and of their weights       sum of values / sum of weights
``sum``    a count                                          the sum
``share``  its share of a figure normalised by the whole    the sum (over ranks: the mean, since each
           mini-batch's counts (the loss, its KL term)      rank's share is scaled by the world size)
``min``    its least value (nan: none)                      the least finite value
``max``    its greatest value (nan: none)                   the greatest finite value
``same``   a value every part shares (a bound, a norm)      the first
=========  ===============================================  ==========================================

A mini-batch in one part keeps the part's own float, bit for bit: the figures of a whole update
do not depend on this module. Reading a part as a float is all a caller (or a test) of a loss
needs; only the trainer merges.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hacrl.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:  # the registry imports this module at config validation, which needs no torch
    torch = lazy_module("torch", globals())

KINDS = ("mean", "sum", "share", "min", "max", "same")
NAN = float("nan")


class Part(float):
    """One part's figure (its float value) and what merging it needs (see the module's table)."""

    kind: str
    num: float
    """``mean``: the sum of the values; ``share``: the share, whether or not ``present``."""
    den: float
    """``mean``: the sum of the weights (tokens, rows)."""
    present: bool
    """``share``: whether this part holds anything the figure is about (a rescue, for SGT's NLL)."""
    empty: float
    """The figure when no part holds anything (no weight, nothing present): nan, or 0 for a share
    of a total that is 0."""

    def __new__(cls, value: float, kind: str, num: float = 0.0, den: float = 0.0, present: bool = True,
                empty: float = NAN) -> Part:
        if kind not in KINDS:
            raise ValueError(f"figure kind must be one of {KINDS}, not {kind!r}")
        self = super().__new__(cls, value)
        self.kind, self.num, self.den, self.present, self.empty = kind, float(num), float(den), present, empty
        return self

    def __reduce__(self):  # gathered from the ranks with pickle
        return (Part, (float(self), self.kind, self.num, self.den, self.present, self.empty))


def mean(x: torch.Tensor, where: torch.Tensor | None = None, empty: float = NAN) -> Part:
    """The mean of ``x`` over ``where``: None, every entry; a bool tensor, the entries it selects;
    a float tensor, ``x`` weighted by it (a token mask). ``empty`` when nothing is selected."""
    x = x.detach()
    if where is None:
        return Part(float(x.mean()), "mean", float(x.sum()), x.numel())
    if where.dtype == torch.bool:
        sel = x[where]
        if not sel.numel():
            return Part(empty, "mean", 0.0, 0.0, empty=empty)
        return Part(float(sel.mean()), "mean", float(sel.sum()), sel.numel(), empty=empty)
    num, den = (x * where).sum(), where.sum()
    if not float(den) > 0:
        return Part(empty, "mean", 0.0, 0.0, empty=empty)
    return Part(float(num / den.clamp(min=1)), "mean", float(num), float(den), empty=empty)


def ratio(num: torch.Tensor, den: torch.Tensor, empty: float = NAN) -> Part:
    """``num / den`` of two sums (a share of a total), ``empty`` when ``den`` is 0."""
    n, d = float(num), float(den)
    return Part(float(num / den) if d > 0 else empty, "mean", n, d, empty=empty)


def total(x: torch.Tensor | float) -> Part:
    """A count: the parts' sum."""
    return Part(float(x), "sum")


def share(x: torch.Tensor | float, present: bool = True) -> Part:
    """This part's share of a figure normalised by the whole mini-batch's counts; the figure is
    ``empty`` (nan) unless some part is ``present``."""
    v = x.item() if isinstance(x, torch.Tensor) else float(x)  # a loss, with its graph: no copy of it
    return Part(v if present else NAN, "share", num=v, present=bool(present))


def least(x: torch.Tensor) -> Part:
    """The least entry of ``x`` (nan when it is empty)."""
    return Part(float(x.min()) if x.numel() else NAN, "min")


def most(x: torch.Tensor) -> Part:
    """The greatest entry of ``x`` (nan when it is empty)."""
    return Part(float(x.max()) if x.numel() else NAN, "max")


def same(v: float) -> Part:
    """A value every part of the update shares (a bound, a gradient norm)."""
    return Part(float(v), "same")


def merge(parts: list[Part], ranks: int = 1) -> Part:
    """The parts of one update's figure combined (micro-batches: ``ranks=1``; then the ranks'
    merged parts with ``ranks`` = the world size). One part is returned as it is."""
    if not parts:
        raise ValueError("no parts to merge")
    for p in parts:
        if not isinstance(p, Part):
            raise TypeError(f"a figure was returned as a plain {type(p).__name__} ({p!r}): return a "
                            "hacrl.rl.figures Part (mean, total, share, least, most, same) so that it adds up "
                            "exactly over micro-batches and ranks")
    kind = parts[0].kind
    if any(p.kind != kind for p in parts):
        raise ValueError(f"parts of one figure have different kinds: {sorted({p.kind for p in parts})}")
    if len(parts) == 1 and ranks == 1:
        return parts[0]
    empty = parts[0].empty
    if kind == "mean":
        num, den = sum(p.num for p in parts), sum(p.den for p in parts)
        return Part(num / den if den > 0 else empty, kind, num, den, empty=empty)
    if kind == "sum":
        return Part(sum(float(p) for p in parts), kind)
    if kind == "share":
        v = sum(p.num for p in parts) / ranks
        present = any(p.present for p in parts)
        return Part(v if present else empty, kind, num=v, present=present, empty=empty)
    if kind in ("min", "max"):
        vals = [float(p) for p in parts if math.isfinite(float(p))]
        return Part((min if kind == "min" else max)(vals) if vals else NAN, kind)
    return parts[0]


def merge_all(figures: list[dict[str, Part]], ranks: int = 1) -> dict[str, Part]:
    """Every figure of an update from its parts' mappings (a figure some part lacks merges over
    the parts that have it)."""
    names = dict.fromkeys(k for f in figures for k in f)
    return {k: merge([f[k] for f in figures if k in f], ranks) for k in names}
