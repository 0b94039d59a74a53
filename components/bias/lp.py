"""l_p bias (Moneta)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from miras.components.base import Bias, Range, number

if TYPE_CHECKING:  # annotations only: sympy and torch are imported where used (components/base.py)
    import sympy as sp
    import torch


class LpBias(Bias):
    """l_p regression: the p-th power of each error's magnitude; p = 3 in Moneta.

    Equation: L(M(k), v) = sum_j |M(k)_j - v_j|^p, p >= 1   (MIRAS eq. 10; |x| ~ sqrt(x^2 + eps) near p = 1, Remark 5)
    """

    kind: Literal["lp"] = "lp"
    # At most 64: the derivation expands |e|^p as a polynomial of degree p (a p of 1e6 runs
    # out of memory), and |e|^(p-1) of an error of 4 is 2^126, the edge of float32, at 64.
    p: number(Range(1, 64, lo_closed=True, hi_closed=True)) = 3.0
    # Smoothing of |x| as sqrt(x^2 + eps). None: exact |x| for p >= 2, eps = 1e-6 below,
    # where |e|^p is not twice differentiable at 0 (MIRAS Remark 5).
    eps: number(Range(0, math.inf, lo_closed=True)) | None = None

    def smoothing(self) -> float:
        if self.eps is not None:
            return self.eps
        return 0.0 if self.p >= 2 else 1e-6

    def expression(self) -> sp.Expr:
        import sympy as sp

        from miras.derive.symbols import ChannelSum, e

        p = sp.nsimplify(self.p)
        eps = self.smoothing()
        if eps == 0:
            return ChannelSum(sp.Abs(e) ** p)
        return ChannelSum((e**2 + sp.nsimplify(eps)) ** (p / 2))

    def reference_loss(self, y, v, **scalars) -> torch.Tensor:
        err = y - v
        eps = self.smoothing()
        if eps == 0:
            return (err.abs() ** self.p).sum(-1)
        return ((err**2 + eps) ** (self.p / 2)).sum(-1)
