"""The exact reference: one token at a time, the step as the components define it, nothing
approximated.

W_e = W_{t-1} (or a_t W_{t-1}: the retention's gradient point)
g_t = sum_{i=t-c+1..t} gamma_i grad_W L(M_{W_e}(phi(k_i)), v_i)    (the memory's backward)
u_t = optimizer.update(g_t)                                        (gd, momentum, Muon, ...)
W_t = retention_step(W_{t-1}, u_t)    (the derived closed-form argmin)
o_t = M_{W_t}(phi(q_t))               (through the retention's read map)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable

import torch

from miras.runtime.core import Runtime, State, Tokens

# record(t, piece, value): what `step` produced, piece by piece (miras check replays with it).
Recorder = Callable[[int, str, object], None]


def gradient(rt: Runtime, weights, seq: Tokens, t: int) -> dict[str, torch.Tensor]:
    """g_t: the windowed, gamma-weighted gradient of the bias at `weights` [B, H, out, in]."""
    total = None
    for j in range(rt.spec.window.c):
        i = t + seq.past - j  # index into the window arrays (the carried tokens first)
        x = seq.phi_k[:, :, i]
        y = rt.memory.forward(weights, x)
        bias_args = [seq.window_gates[n][:, :, i] for n in rt.bias_gates]
        grad_y = rt.functions.bias_grad(y, seq.v[:, :, i], *bias_args)
        grad_y = grad_y * rt.scalar(rt.spec.window, rt.spec.window.weight_gate, seq.window_gates, i)
        # Select, not multiply: a slot before the first token (valid = 0) must not pass a NaN.
        grad_y = torch.where(seq.valid[:, :, i] > 0, grad_y, 0.0)
        grads = rt.memory.backward(weights, x, grad_y)
        total = grads if total is None else {n: total[n] + grads[n] for n in grads}
    return total


def optimizer_step(rt: Runtime, grads, state: State, gates, t: int):
    """u_t for every parameter (the optimizer component's update); its states are updated in
    `state`."""
    return rt.optimizer_step(grads, state, gates, t)


def step(rt: Runtime, seq: Tokens, state: State, t: int, record: Recorder | None = None):
    """Token t: updates `state` in place and returns o_t [B, H, Dv]."""
    gates = seq.step_gates
    weights = rt.gradient_point(rt.weights(state), gates, t)
    grads = gradient(rt, weights, seq, t)
    updates = optimizer_step(rt, grads, state, gates, t)
    retention_args = [rt.param_gate(n, gates[n][:, :, t]) for n in rt.retention_gates]
    for n, u in updates.items():
        state[n] = rt.functions.retention_step(state[n], u, *retention_args)
    o = rt.memory.forward(rt.weights(state), seq.phi_q[:, :, t])
    if record is not None:
        record(t, "bias gradient", grads)
        record(t, "optimizer", updates)
        record(t, "retention step", {n: state[n] for n in rt.param_names})
        record(t, "read", o)
    return o


@contextlib.contextmanager
def collector_paused():
    """Python's cycle collector paused for a token loop; reference counting still frees every
    tensor (the loops make no reference cycles), and the collector's previous state comes
    back on the way out, an exception included. The pause is the process's: other threads'
    cycles wait for the loop to end.

    Used as a decorator, so the loop's locals are freed before the collector resumes. A loop
    over T tokens keeps a few tensor objects a token alive until it returns (the per-token
    views of its inputs, its outputs), and past a few thousand tokens they set off full
    collections, each a walk over every object of the process: the gated_deltanet recurrence
    at T = 8192 spent 140-160 ms of a 1.7-2.2 s forward in them (two threads), and none at
    2048, so its time grew faster than T (benchmarks/recurrent_gc.py, docs/benchmarks.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@collector_paused()
def forward(
    rt: Runtime, seq: Tokens, state: State, record: Recorder | None = None
) -> tuple[torch.Tensor, State]:
    """Returns o [B, H, T, Dv] and the final memory state (the input state is not modified).
    `record`, when given, is called with every piece of every token's step (`step`)."""
    state = dict(state)
    by_token = by_token_views(seq)
    outputs = [step(rt, by_token, state, t, record) for t in range(seq.length)]
    return torch.stack(outputs, dim=2), state


class TokenSlices:
    """A [B, H, L, ...] tensor unbound along its token axis once: `x[:, :, i]` is slice i
    ([B, H, ...]), the only indexing `step` does. The backward of `unbind` is one stack of the
    slices' gradients; indexing the whole tensor at every token instead makes each token's
    backward a zero [B, H, L, ...] gradient added into the input's, quadratic in T: the
    gated_deltanet backward at T = 4096 took 26 s against 3.3 s forward (docs/benchmarks.md)."""

    def __init__(self, x: torch.Tensor):
        self.shape = x.shape
        self.slices = x.unbind(2)

    def __getitem__(self, key) -> torch.Tensor:
        whole = slice(None)
        if not (isinstance(key, tuple) and len(key) == 3 and key[:2] == (whole, whole)):
            raise TypeError(f"TokenSlices: index [:, :, i], got {key!r}")
        if not isinstance(key[2], int):
            raise TypeError(f"TokenSlices: token index must be an int, got {key[2]!r}")
        return self.slices[key[2]]


def by_token_views(seq: Tokens) -> Tokens:
    """`seq` with every tensor as `TokenSlices` (for `step`; `length` reads the shape)."""
    return dataclasses.replace(
        seq,
        phi_q=TokenSlices(seq.phi_q),
        phi_k=TokenSlices(seq.phi_k),
        v=TokenSlices(seq.v),
        valid=TokenSlices(seq.valid),
        step_gates={n: TokenSlices(g) for n, g in seq.step_gates.items()},
        window_gates={n: TokenSlices(g) for n, g in seq.window_gates.items()},
    )
