"""The compiled linear step (`miras.ir.LinearStep`) unrolled over a chunk: the decay matrices
and weights every torch fast form reads (the exact form, the chunk-start form's linear path,
the dual form), written once.

Inside a chunk of n tokens from (W_0, S_0) the record's recurrences

    W_t = a_t W_{t-1} - u_t,   u_t = p_t S_t + q_t g_t,   S_t = theta_t S_{t-1} + beta_t g_t

unroll to

    W_t = D_t W_0 - C_t S_0 - sum_{s<=t} M[t, s] g_s,     S_t = Theta_t S_0 + sum_{s<=t} N[t, s] g_s

with D_t = prod_{j<=t} a_j, Theta_t = prod_{j<=t} theta_j, the decay matrices L^a, L^theta
(`decay_matrix`), M = L^a diag(p) L^theta diag(beta) + L^a diag(q), C_t = sum_tau L^a[t, tau]
p_tau Theta_tau and N = L^theta diag(beta). Without a state, M = L^a diag(q) and C, N, Theta
are None.

Layout: a factor is [..., n, X] (tokens on axis -2; X = 1 per head or Dv per channel); a
matrix is [..., X, n, n] (row t, column s).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from miras.ir import Coefficient, LinearStep


def decay_matrix(factors: torch.Tensor) -> torch.Tensor:
    """L[t, s] = prod_{s<j<=t} a_j for s <= t, else 0: `factors` [..., n, X] -> [..., X, n, n].

    Each entry is the product of exactly the factors it spans, accumulated down the columns
    of the factors masked to j > s (a cumulative product; 1 at and above the diagonal, then
    masked to 0 above it): never a ratio of two prefix products nor a difference of two
    cumulative log sums, which carry the rounding of the larger one into every later factor
    (docs/kernels.md, "Decay factors"; the Triton kernels sum the same masked log-decays,
    `kernels/common/intra.py`). A zero factor (momentum theta = 0) gives exact zeros and
    finite gradients (the sum of logs would give log 0 = -inf and 0 * inf in its backward).
    Differentiable by `_DecayMatrix`, whose backward is products too."""
    if torch.is_grad_enabled() and factors.requires_grad:
        return _DecayMatrix.apply(factors)
    return _decay_matrix(factors)


def _decay_matrix(factors: torch.Tensor) -> torch.Tensor:
    """`decay_matrix` with no graph: the cumulative product in place of its temporary."""
    n = factors.shape[-2]
    device = str(factors.device)
    column = factors.movedim(-1, -2).unsqueeze(-1)  # [..., X, n, 1]: [t, s] = a_t
    spans = torch.where(_lower(n, True, device), column, 1.0)  # a_t where s < t, else 1
    return spans.cumprod_(dim=-2).mul_(_lower(n, False, device))


class _DecayMatrix(torch.autograd.Function):
    """L = `decay_matrix`(a) with a backward of one matmul and one product. The span of L[t, s]
    without a_u (s < u <= t) is L[u-1, s] L[t, u], so for dL = G

        da_u = sum_{s<u} L[u-1, s] sum_{t>=u} L[t, u] G[t, s] = sum_s L[u-1, s] (L^T G)[u, s]

    (L[u-1, s] = 0 for s >= u and L[t, u] = 0 for t < u pick the spans that hold a_u). No
    factor is divided out, so a zero factor is exact here as well. autograd's cumprod
    backward, which this replaces, made about ten passes over [..., n, n] (a cumulative sum,
    flips, masks for the zeros): 43 -> 9 ms for [2, 4, 32, 1, 64, 64] on one core. Written in
    differentiable ops on the saved output: a second derivative still works."""

    @staticmethod
    def forward(ctx, factors):
        out = _decay_matrix(factors)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        q = out.mT @ grad  # (L^T G)[u, s]: [..., X, n, n]
        g_rows = grad.new_zeros(out.shape[:-1])  # da_0 = 0: a_0 spans no entry
        g_rows[..., 1:] = (out[..., :-1, :] * q[..., 1:, :]).sum(-1)
        return g_rows.movedim(-1, -2)  # [..., X, n] -> [..., n, X]


@functools.lru_cache(maxsize=64)
def _lower(n: int, strict: bool, device: str) -> torch.Tensor:
    """[n, n]: s < t (strict) or s <= t."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def coefficient(
    c: Coefficient, lookup: Callable[[str, str], torch.Tensor], like: torch.Tensor
) -> torch.Tensor:
    """A coefficient's value per token [..., n, X]: its constant times its gates, each
    `lookup(field, name)` [..., n, X] (fixed or per token); `like` [..., n, .] gives the shape
    of a constant."""
    value = None
    for field, name in c.gates:
        gate = lookup(field, name)
        value = gate if value is None else value * gate
    if value is None:
        return torch.full_like(like[..., :1], c.constant)
    return value if c.constant == 1.0 else c.constant * value


@dataclass
class Unrolled:
    """The unrolled step of one or many chunks (module docstring): `d` D_t and `carry` C_t,
    `state_carry` Theta_t [..., n, X]; `mix` M and `state_mix` N [..., X, n, n]; `a` the decay
    factors [..., n, X]. The state's pieces are None without one."""

    a: torch.Tensor
    d: torch.Tensor
    mix: torch.Tensor
    carry: torch.Tensor | None = None
    state_carry: torch.Tensor | None = None
    state_mix: torch.Tensor | None = None


def rows(z: torch.Tensor) -> torch.Tensor:
    """A factor [..., n, X] as rows of the matrices: [..., X, n]."""
    return z.movedim(-1, -2)


def unroll(
    step: LinearStep, lookup: Callable[[str, str], torch.Tensor], like: torch.Tensor
) -> Unrolled:
    """The chunk's D, C, Theta, M and N from the record's coefficients (`coefficient`)."""
    a = coefficient(step.decay, lookup, like)
    q = coefficient(step.from_gradient, lookup, like)
    d = torch.cumprod(a, dim=-2)
    mix_a = decay_matrix(a)
    if not step.stateful:  # M = L^a diag(q); L^a is read only here: scaled in place
        return Unrolled(a, d, mul_fresh(mix_a, rows(q).unsqueeze(-2)))
    theta = coefficient(step.state_decay, lookup, like)
    beta = rows(coefficient(step.state_input, lookup, like)).unsqueeze(-2)  # [..., X, 1, n]
    mix_theta = decay_matrix(theta)
    big_theta = torch.cumprod(theta, dim=-2)
    through = mix_a
    carried = big_theta
    if not step.from_state.is_one:  # diag(p) between the two recurrences
        p = coefficient(step.from_state, lookup, like)
        through = mix_a * rows(p).unsqueeze(-2)
        carried = p * big_theta
    mix = (through @ mix_theta) * beta
    if not step.from_gradient.is_zero:
        mix = mix + mix_a * rows(q).unsqueeze(-2)
    carry = (mix_a @ rows(carried).unsqueeze(-1)).squeeze(-1).movedim(-1, -2)  # [..., n, X]
    return Unrolled(a, d, mix, carry, big_theta, mix_theta * beta)


def mul_fresh(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x * y, written into x when no graph is being recorded and y broadcasts to x's shape:
    x must be a temporary the caller owns (one pass and no new [.., n, n] tensor)."""
    if torch.is_grad_enabled() or torch.broadcast_shapes(x.shape, y.shape) != x.shape:
        return x * y
    return x.mul_(y)


__all__ = ["Unrolled", "coefficient", "decay_matrix", "mul_fresh", "rows", "unroll"]
