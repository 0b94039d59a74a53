"""The chunk-start form: inside a chunk of b tokens every gradient is taken at the chunk-start
state (the parallelization of Titans, MIRAS and ATLAS); b = 1 is the exact recurrence.

Two paths, the same semantics:
- `miras.runtime.linear`, the linear fast path, where the compiler's chunk_form pass found
  the memory, retention step and optimizer update all linear (`ChunkForm.start_path`, read
  here as `rt.start_path`). The chunk collapses into matmuls with decay masks (no per-token
  state).
- `forward_general` (here): any other spec. Gradients, memory backward and reads are batched
  over the chunk; the optimizer's update (the component's) and the (possibly nonlinear)
  retention map run token by token on per-token updates, so each map is applied at every
  token exactly as in the recurrence (docs/chunking.md).

Within a chunk starting at state S (read as W_S), for token t with window c:
    W_e,t = W_S                 (grad_at: state)   or   (prod_{j=s..t} a_j) W_S   (retained)
    g_t   = sum_{i=t-c+1..t} gamma_i grad_W L(M_{W_e,t}(phi(k_i)), v_i)
and the optimizer and retention recurrences of the exact step run over the g_t.
"""

from __future__ import annotations

import torch

from miras.runtime import linear
from miras.runtime.chunk_common import chunk_views, window_gradients
from miras.runtime.core import Runtime, State, Tokens, as_param_gate


def forward(rt: Runtime, seq: Tokens, state: State, chunk_size: int):
    """Returns o [B, H, T, Dv] and the final memory state."""
    if rt.start_path == "linear":
        return linear.forward(rt, seq, state, chunk_size)
    return forward_general(rt, seq, state, chunk_size)


# The general path ---------------------------------------------------------------------------


def forward_general(rt: Runtime, seq: Tokens, state: State, chunk_size: int):
    state = dict(state)
    outputs = []
    for part in chunk_views(seq, chunk_size):
        gates = part.step_gates
        start, end = 0, part.length
        sl = slice(start, end)
        n = end - start
        weights = rt.weights(state)  # W_S [B, H, out, in]
        weights_e = {name: w.unsqueeze(2) for name, w in weights.items()}  # [B, H, 1, out, in]
        weights_e = rt.gradient_point(weights_e, gates, sl, like=part.phi_q)

        # g_t for every token of the chunk at once: [B, H, n, out, in] per parameter.
        grads = None

        def predict(x, weights_e=weights_e):
            return rt.memory.forward(weights_e, x)

        for x, grad_y in window_gradients(rt, predict, part, start, end):
            g = rt.memory.backward(weights_e, x, grad_y)
            grads = g if grads is None else {k: grads[k] + g[k] for k in g}

        retention_args = [as_param_gate(gates[name][:, :, sl]) for name in rt.retention_gates]

        per_token = {name: [] for name in rt.param_names}
        for t in range(n):
            grads_t = {name: g[:, :, t] for name, g in grads.items()}
            updates = rt.optimizer_step(grads_t, state, gates, t)
            args = [g[:, :, t] for g in retention_args]
            for name, u in updates.items():
                state[name] = rt.functions.retention_step(state[name], u, *args)
                per_token[name].append(state[name])
        read = {
            name: rt.functions.retention_read(torch.stack(ws, dim=2))
            for name, ws in per_token.items()
        }
        outputs.append(rt.memory.forward(read, part.phi_q))
    return torch.cat(outputs, dim=2), state
