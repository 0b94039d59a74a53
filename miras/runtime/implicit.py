"""An implicit optimizer step (proximal) as the explicit step with a transformed step size.

    rt, seq = implicit.prepare(rt, seq, step)     # step: the IR's `Plan.implicit_step`

On a matrix memory with a quadratic bias (d2L/dy^2 = s), the proximal step
W_e - u_t = argmin_W gamma_t l(W; k_t, v_t) + ||W - W_e||^2 / (2 lr_t) is the gradient step
u_t = eta_t g_t (g_t: the gamma-weighted gradient) with
eta_t = lr_t / (1 + lr_t gamma_t s ||phi(k_t)||^2) (Sherman-Morrison: g_t lies in the loss
Hessian's eigenspace of eigenvalue gamma_t s ||phi(k_t)||^2). eta_t reads only the token's key,
never the state, so it is computed here once for the whole sequence, and every form (the
recurrence, the exact and linear chunk forms, the chunk-start form) then runs its gd step with
eta_t as the gate: the exact chunk form stays exact, and the backward reaches k through eta_t.
"""

from __future__ import annotations

import dataclasses

from miras.ir import ImplicitStep
from miras.runtime.core import Runtime, Tokens, gate_values


def prepare(rt: Runtime, seq: Tokens, step: ImplicitStep) -> tuple[Runtime, Tokens]:
    """(rt, seq) with the gate `step.gate` replaced by the optimizer's step size eta_t
    [B, H, T, X] (X = 1 per head, Dv per channel) and the spec's field set to "gate", so a
    fixed lr becomes a per-token eta_t too. seq.phi_k [B, H, P + T, Dphi]: the window's P
    carried tokens come first (P = 0: proximal validates c = 1)."""
    opt = rt.spec.optimizer
    tokens = slice(seq.past, None)
    keys = seq.phi_k[:, :, tokens]  # [B, H, T, Dphi]
    lr = gate_values(opt, step.gate, seq.step_gates, slice(None), keys)  # [B, H, T, X]
    # The token's loss enters the objective weighted by the window's gamma_t (c = 1).
    window = rt.spec.window
    gamma = gate_values(window, window.weight_gate, seq.window_gates, tokens, keys)  # [B, H, T, 1]
    curvature = step.slope * gamma * (keys * keys).sum(-1, keepdim=True)  # [B, H, T, 1]
    eta = opt.step_size(lr, curvature)
    gates = {**seq.step_gates, step.gate: eta}
    explicit = opt.model_copy(update={step.gate: "gate"})
    spec = rt.spec.model_copy(update={"optimizer": explicit})
    return dataclasses.replace(rt, spec=spec), dataclasses.replace(seq, step_gates=gates)
