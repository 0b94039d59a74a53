"""The preconditioned optimizer's step size, per key channel, for the whole sequence at once.

    rt, seq, final = precondition.prepare(rt, seq, state, step)   # step: `Plan.precondition`

On a matrix memory with a bias of constant curvature s = d2L/dy^2, the Hessian of the token's
loss gamma_t L(W phi(k_t), v_t) in W is gamma_t s phi(k_t) phi(k_t)^T per row, whose diagonal
is c_t = gamma_t s phi(k_t)^2 on every row: one number per key channel (column of W). The
optimizer sums it, A_t = a'_t A_{t-1} + b'_t c_t, and steps with lr_t M(A_t) per column
(`components/optimizer/preconditioned.py`). Neither reads W, so both are computed here once,
before any form runs, and every form then runs gd's step with lr_t M_t as a step size per key
channel: the recurrence and the chunk-start form scale the update's columns
(`Runtime.param_gate`), the exact chunk form writes at lr_t M_t * phi(k_t)
(`miras.runtime.exact_keys`). The backward reaches k and the preconditioner's gates through
lr_t M_t.
"""

from __future__ import annotations

import dataclasses

import torch

from miras.ir import Precondition
from miras.runtime.core import Runtime, State, Tokens, gate_values

# Tokens per block of the scan: a block's decay weights are [B, H, n, n, X].
SCAN_BLOCK = 64


def prepare(
    rt: Runtime, seq: Tokens, state: State, step: Precondition
) -> tuple[Runtime, Tokens, State]:
    """(rt, seq, the final curvature sums): seq's gate `step.gate` replaced by lr_t M_t
    [B, H, T, Dphi] and the optimizer's field set to "gate" (so a fixed lr becomes the per-token,
    per-channel lr_t M_t too). The curvature sums A_0 [B, H, 1, Dphi] are taken out of `state`
    ("P.<name>"), so no form sees them; the final ones, A_T, come back as {"P.<name>": ...}.
    seq.phi_k [B, H, P + T, Dphi]: the window's P carried tokens come first (validation
    holds c = 1, so P = 0)."""
    opt = rt.spec.optimizer
    tokens = slice(seq.past, None)
    keys = seq.phi_k[:, :, tokens]  # [B, H, T, Dphi]
    window = rt.spec.window
    gamma = gate_values(window, window.weight_gate, seq.window_gates, tokens, keys)  # [B, H, T, 1]
    curvature = step.slope * gamma * keys * keys  # [B, H, T, Dphi]

    def gate(name: str) -> torch.Tensor:  # [B, H, T, 1 or Dphi]
        return gate_values(opt, name, seq.step_gates, slice(None), keys)

    increment = gate("precond_lr") * curvature
    finals = {}
    factors = []
    for name in rt.param_names:  # a matrix memory: "W" (validation)
        start = state.pop(f"P.{name}")  # [B, H, 1, Dphi]
        accumulated = scan(gate("precond_decay"), increment, start[:, :, 0])  # [B, H, T, Dphi]
        finals[f"P.{name}"] = accumulated[:, :, -1:]
        factors.append(opt.factor(accumulated, gate("precond_center")))
    (factor,) = factors  # one parameter: W
    gates = {**seq.step_gates, step.gate: gate(step.gate) * factor}  # [B, H, T, Dphi]
    explicit = opt.model_copy(update={step.gate: "gate"})
    spec = rt.spec.model_copy(update={"optimizer": explicit})
    seq = dataclasses.replace(seq, step_gates=gates)
    return dataclasses.replace(rt, spec=spec), seq, finals


def scan(decay: torch.Tensor, increment: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """A_t = decay_t A_{t-1} + increment_t for every t from A_0 = `start`: decay [B, H, T, X]
    (X = 1 or D) in (0, 1], increment [B, H, T, D], start [B, H, D] -> [B, H, T, D].

    In blocks of n tokens from A_s, with G_t the block's running sum of log-decays:
    A_t = exp(G_t) A_s + sum_{j<=t} exp(G_t - G_j) increment_j. Every exponent is a sum of
    log-decays over tokens after j, so <= 0: nothing overflows, also where a decay is the
    1.2e-38 that miras.ops passes for fla's exp(g) = 0 (what came before is then scaled by it,
    below float32's resolution next to any later increment). The exponent is set to 0 above
    the diagonal before exp, so neither an inf nor its gradient enters."""
    length = decay.shape[2]
    a = start
    blocks = []
    for lo in range(0, length, SCAN_BLOCK):
        part = slice(lo, min(lo + SCAN_BLOCK, length))
        g = decay[:, :, part].log().cumsum(2)  # [B, H, n, X]
        n = g.shape[2]
        upto = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()  # j <= t
        expo = g.unsqueeze(3) - g.unsqueeze(2)  # [B, H, t, j, X]
        weights = torch.where(upto[..., None], torch.where(upto[..., None], expo, 0.0).exp(), 0.0)
        inc = increment[:, :, part]
        if weights.shape[-1] == 1:  # one decay per head: a matmul
            block = weights[..., 0] @ inc
        else:  # one per channel
            block = torch.einsum("...tjd,...jd->...td", weights, inc)
        block = block + g.exp() * a.unsqueeze(2)
        blocks.append(block)
        a = block[:, :, -1]
    return torch.cat(blocks, dim=2)
