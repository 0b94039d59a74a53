"""The exponential kernel's feature map, truncated at order P (ATLAS section 4, phi*)."""

from __future__ import annotations

import functools
import itertools
import math
from typing import TYPE_CHECKING, Literal

from miras.components.base import FeatureMap, Range, number

if TYPE_CHECKING:
    import torch  # annotations only; imported where used (loading a spec needs no torch)


class ExpKernelMap(FeatureMap):
    """Taylor map of exp(x . y) to order P: <phi(q), phi(k)> = sum_{p<=P} a_p^2 (q . k)^p / p!.

    Equation: phi(x) = concat_{p=0..P} a_p x^(p) / sqrt(p!), x^(p) packed as monomials x^alpha / sqrt(alpha!) (dim C(d+P, P))
    """

    kind: Literal["exp_kernel"] = "exp_kernel"
    order: number(Range(0, 8, lo_closed=True, hi_closed=True), integer=True) = 2
    # ATLAS's input gating: a learned scale a_p per degree block, initialized to 1 (the
    # exponential's own Taylor coefficients); the kernel weighs degree p by a_p^2.
    gating: bool = False
    # The largest feature width Dphi = C(d + P, P) allowed; a matrix memory is [Dv, Dphi].
    max_features: number(Range(1, 1 << 20, lo_closed=True, hi_closed=True), integer=True) = 4096

    def output_dim(self, d: int) -> int:
        return math.comb(d + self.order, self.order)

    def width_problem(self, d: int) -> str | None:
        width = self.output_dim(d)
        if width <= self.max_features:
            return None
        return (
            f"the exp_kernel map of order {self.order} on d = {d} key channels has "
            f"C(d + P, P) = {width} features, over max_features = {self.max_features}; lower "
            "order, use fewer channels per head (more heads or a smaller d_model), or raise "
            "max_features"
        )

    def initial_params(self) -> dict[str, torch.Tensor]:
        """The gating coefficients, learned by the layer: `feature_map` [P + 1], all 1."""
        if not self.gating:
            return {}
        import torch

        return {"feature_map": torch.ones(self.order + 1)}

    def apply(self, x: torch.Tensor, coefficients: torch.Tensor | None = None) -> torch.Tensor:
        """`x`: [..., D] -> [..., C(D + P, P)], degree blocks p = 0..P in order; `coefficients`:
        the gating a_p [P + 1] (1 when None)."""
        import torch

        d = x.shape[-1]
        why = self.width_problem(d)
        if why is not None:
            raise ValueError(f"feature_map: {why}")
        blocks = []
        for p in range(self.order + 1):
            index, weight = _monomials(d, p)
            if p == 0:
                block = torch.ones_like(x[..., :1])
            else:
                idx = torch.tensor(index, device=x.device)  # [n_p, p]
                block = x[..., idx].prod(dim=-1)  # [..., n_p]
                block = block * torch.tensor(weight, dtype=x.dtype, device=x.device)
            if coefficients is not None:
                block = block * coefficients[p].to(x.dtype)
            blocks.append(block)
        return torch.cat(blocks, dim=-1)

    def features(self, x: torch.Tensor, params: dict, functions) -> torch.Tensor:
        return self.apply(x, params["feature_map"] if self.gating else None)


@functools.lru_cache(maxsize=64)
def _monomials(d: int, p: int) -> tuple[tuple[tuple[int, ...], ...], tuple[float, ...]]:
    """The degree-p monomials of d channels as sorted index tuples [n_p, p], n_p = C(d+p-1, p),
    and their weights 1 / sqrt(alpha!): x^(p) . y^(p) = (x . y)^p counts each monomial
    p! / alpha! times (the multinomial), so sqrt(p! / alpha!) / sqrt(p!) keeps the product."""
    index = tuple(itertools.combinations_with_replacement(range(d), p))
    weight = tuple(1 / math.sqrt(math.prod(math.factorial(n) for n in _counts(m))) for m in index)
    return index, weight


def _counts(monomial: tuple[int, ...]) -> list[int]:
    return [len(list(group)) for _, group in itertools.groupby(monomial)]
