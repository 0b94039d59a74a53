"""The exact reference: one token at a time, DESIGN.md's step, nothing approximated.

W_e = W_{t-1} (or a_t W_{t-1}, grad_at: retained)
g_t = sum_{i=t-c+1..t} gamma_i grad_W L(M_{W_e}(phi(k_i)), v_i)
u_t = optimizer(g_t)                  (gd, momentum, Muon)
W_t = retention_step(W_{t-1}, u_t)    (the derived closed-form argmin)
o_t = M_{W_t}(phi(q_t))
"""

from __future__ import annotations

import torch

from miras.components.optimizer.muon import newton_schulz
from miras.runtime.core import Runtime, State, Tokens, as_param_gate


def gradient(rt: Runtime, weights, seq: Tokens, t: int) -> dict[str, torch.Tensor]:
    """g_t: the windowed, gamma-weighted gradient of the bias at `weights` [B, H, out, in]."""
    total = None
    for j in range(rt.spec.window.c):
        i = t + seq.past - j  # index into the window arrays (the carried tokens first)
        x = seq.phi_k[:, :, i]
        y = rt.memory.forward(weights, x)
        bias_args = [seq.window_gates[n][:, :, i] for n in rt.bias_gates]
        grad_y = rt.functions.bias_grad(y, seq.v[:, :, i], *bias_args)
        grad_y = grad_y * rt.scalar(rt.spec.window, "gamma", seq.window_gates, i)
        # Select, not multiply: a slot before the first token (valid = 0) must not pass a NaN.
        grad_y = torch.where(seq.valid[:, :, i] > 0, grad_y, 0.0)
        grads = rt.memory.backward(weights, x, grad_y)
        total = grads if total is None else {n: total[n] + grads[n] for n in grads}
    return total


def optimizer_step(rt: Runtime, grads, state: State, gates, t: int):
    """u_t for every parameter; momentum states are updated in `state`."""
    opt = rt.spec.optimizer
    lr = as_param_gate(rt.scalar(opt, "lr", gates, t))
    if opt.kind == "gd":
        return {n: lr * g for n, g in grads.items()}
    theta = as_param_gate(rt.scalar(opt, "momentum", gates, t))
    updates = {}
    for n, g in grads.items():
        s = theta * state[f"S.{n}"] + lr * g
        state[f"S.{n}"] = s
        updates[n] = newton_schulz(s, opt.ns_steps) if opt.kind == "muon" else s
    return updates


def forward(rt: Runtime, seq: Tokens, state: State) -> tuple[torch.Tensor, State]:
    """Returns o [B, H, T, Dv] and the final memory state (the input state is not modified)."""
    state = dict(state)
    retention = rt.spec.retention
    gates = seq.step_gates
    outputs = []
    for t in range(seq.length):
        weights = rt.weights(state)
        retention_args = [as_param_gate(gates[n][:, :, t]) for n in rt.retention_gates]
        if rt.retained_gradient:
            decay = as_param_gate(rt.scalar(retention, "decay", gates, t))
            weights = {n: decay * w for n, w in weights.items()}
        grads = gradient(rt, weights, seq, t)
        updates = optimizer_step(rt, grads, state, gates, t)
        for n, u in updates.items():
            state[n] = rt.functions.retention_step(state[n], u, *retention_args)
        outputs.append(rt.memory.forward(rt.weights(state), seq.phi_q[:, :, t]))
    return torch.stack(outputs, dim=2), state
