"""The minimizer analysis: the execution form of an optimizer that solves the whole objective
(`Optimizer.solves_exactly`: exact, MesaNet) instead of stepping on it.

With a matrix memory y = W phi(k), a bias whose dL/dy_j = s y_j + dL/dy_j(0, v) (one curvature
s = d2L/dy^2 >= 0, derived here from the bias gradient), and past terms decayed by the l2
retention's a_t, the objective at t is

    J_t(W) = sum_{i<=t} a_{i+1..t} gamma_i L(W phi(k_i), v_i) + 1/2 sum_j lambda_t,j ||W_{:,j}||^2

and dJ_t/dW = 0 reads W (s H_kk,t + diag(lambda_t)) = H_vk,t with the sufficient statistics

    H_kk,t = a_t H_kk,t-1 + gamma_t phi(k_t) phi(k_t)^T          [Dphi, Dphi]
    H_vk,t = a_t H_vk,t-1 - gamma_t dL/dy(0, v_t) phi(k_t)^T      [Dv, Dphi]  (l2, dot: + v_t)

so o_t = W_t phi(q_t) = H_vk,t x_t with (s H_kk,t + diag(lambda_t)) x_t = phi(q_t).
The spec's validation (`Exact.spec_problems`) refuses what is not of this shape; this pass
derives s from the bias gradient (the affine analysis's `bias_slope`) and records it.
"""

from __future__ import annotations

from miras.derive.affine import bias_slope
from miras.errors import DerivationError
from miras.ir import BiasRule, ChunkForm
from miras.spec import Spec


def minimizer_form(spec: Spec, bias: BiasRule) -> ChunkForm | None:
    """The "minimizer" form of a spec whose optimizer solves exactly, with its curvature s in
    `slope`; None for every other optimizer."""
    if not spec.optimizer.solves_exactly:
        return None
    slope, why = bias_slope(spec, bias)
    if slope is None or not slope.is_number or float(slope) < 0:
        why = why or f"d2L/dy^2 = {slope} is not one number >= 0"
        raise DerivationError(
            f"spec '{spec.name}': optimizer {spec.optimizer.kind} needs an objective quadratic "
            f"in W: {why}"
        )
    s = float(slope)
    decay = "no decay" if not spec.retention.decay_gate else f"retention {spec.retention.kind}"
    reason = (
        f"optimizer {spec.optimizer.kind}: the objective is quadratic in W (d2L/dy^2 = {s:g}, "
        f"{decay}), so the state is H_kk [Dphi, Dphi] and H_vk [Dv, Dphi] and each read solves "
        "(s H_kk + diag(ridge)) x = phi(q) by Cholesky"
    )
    return ChunkForm("minimizer", reason, slope=s)
