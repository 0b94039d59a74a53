"""Preconditioner, verification: the curvature the preconditioned optimizer sums per key channel,
s phi(k)^2 (s = d2L/dy^2, the bias's derived constant slope), against the diagonal of the
token loss's Hessian in W by autograd, on every row of W.
"""

from __future__ import annotations

import torch

from miras.derive.bias_check import sample_gates
from miras.derive.check import CheckResult, max_relative_error
from miras.ir import Plan

# [matrices, heads, Dv, Dphi]: odd sizes on purpose, small for the full Hessian (72 entries).
SHAPE = (2, 3, 3, 4)


def check_precondition(
    spec, plan: Plan, functions, *, dtype=torch.float64, seed: int = 0, tolerance: float = 1e-10
) -> list[CheckResult]:
    """One result where the plan has a preconditioner (`Plan.precondition`), none otherwise:
    at a random W, phi(k) and v (and the bias's gates), the full autograd Hessian of
    sum L(W phi(k), v) in W, its diagonal [.., Dv, Dphi] against s phi(k)_j^2 on every row.
    `functions`: the emitted module (its printed `bias_loss`)."""
    step = plan.precondition
    if step is None:
        return []
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(SHAPE, dtype=dtype, generator=gen)
    x = torch.randn(SHAPE[:2] + SHAPE[3:], dtype=dtype, generator=gen)  # phi(k) [.., Dphi]
    v = torch.randn(SHAPE[:3], dtype=dtype, generator=gen)  # [.., Dv]
    gates = sample_gates(spec.bias, v.shape, dtype, gen)

    def loss(flat: torch.Tensor) -> torch.Tensor:
        y, _ = spec.memory.forward({"W": flat.reshape(SHAPE)}, x)
        return functions.bias_loss(y, v, *gates.values()).sum()

    hessian = torch.autograd.functional.hessian(loss, w.flatten())
    diagonal = hessian.diagonal().reshape(SHAPE)
    derived = (step.slope * x * x).unsqueeze(-2).expand(SHAPE)  # the same on every row
    piece = "preconditioner curvature: s phi(k)^2 per key channel vs autograd's Hessian diagonal"
    return [CheckResult(piece, max_relative_error(derived, diagonal), tolerance)]
