"""The norm-matched control of a sharing loss (``algorithm.norm_match``, contender ``hacpo_normmatch``).

HACPO minus its ``cross_weight=0`` control measures what the peers' samples add, but the peers'
gradient changes both the direction and the size of a step: on the embedded pools HACPO's update
norm is 14-60 % larger than its control's, so a gain could come from a larger step alone. This
control keeps the size and removes the direction: each update's gradient from peers' samples,
``g_cross``, is replaced by a step of the same norm along the learner's own samples' gradient,

    g = g_own(m) + ||g_cross(m)|| * g_own(p) / ||g_own(p)||,

where ``p`` is ``m`` when update m holds own samples, and otherwise (HACPO's reference layout gives
peers' samples updates of their own) the own block's mini-batch at the same place. ``g_cross`` is
the gradient of the loss minus that of the loss without its cross terms (the loss's registered
``own_only`` options); both are measured at the update's weights, before it steps. The update
then trains on ``g_own(m) + c * g_own(p)`` with ``c = ||g_cross|| / ||g_own(p)||`` held fixed, i.e.
the own-only loss of m plus ``c`` times that of p (so clipping, Adam and the lr schedule see it as
any update). It costs an extra forward and two extra backward passes per update, and needs the
whole mini-batch's gradients in one process (``trainer.world_size`` 1).
"""

from __future__ import annotations

import math
import torch


def partner(own_rows: list[int], m: int) -> int:
    """The mini-batch whose own samples give update ``m``'s direction (``own_rows``: each
    mini-batch's own rows): ``m`` itself if it holds own samples, else the own mini-batch at the
    same place among the own ones (cyclically)."""
    if own_rows[m] > 0:
        return m
    own = [i for i, n in enumerate(own_rows) if n > 0]
    if not own:
        return m
    cross = [i for i, n in enumerate(own_rows) if n == 0]
    return own[cross.index(m) % len(own)]


def grads(loss: torch.Tensor, params: list, retain: bool = False) -> list[torch.Tensor]:
    """d loss / d params (zeros where a parameter takes no part), without touching ``.grad``."""
    gs = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, gs)]


def norm(gs: list[torch.Tensor]) -> float:
    """The gradient's global L2 norm."""
    return math.sqrt(sum(float(g.float().pow(2).sum()) for g in gs))


def scale_of(cross: list[torch.Tensor], own: list[torch.Tensor]) -> tuple[float, dict]:
    """``c = ||g_cross|| / ||g_own(p)||`` (0 without an own direction) and the update's figures."""
    n_cross, n_own = norm(cross), norm(own)
    c = n_cross / n_own if n_own > 0 else 0.0
    return c, {"cross_grad_norm": n_cross, "own_direction_norm": n_own, "norm_match_scale": c}
