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
  token exactly as in the recurrence (docs/chunking.md). With gradients each chunk is a
  `_BoundedChunk` by default: the backward keeps only chunk-start states and recomputes one
  chunk at a time (docs/chunking.md, "Bounded memory for deep rules").

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


def forward(rt: Runtime, seq: Tokens, state: State, chunk_size: int, recompute: bool | None = None):
    """Returns o [B, H, T, Dv] and the final memory state. `recompute`: the general path's
    backward (None: `recomputes(rt)`); the linear path keeps no per-token state either way."""
    if rt.start_path == "linear":
        return linear.forward(rt, seq, state, chunk_size)
    return forward_general(rt, seq, state, chunk_size, recompute)


# The general path ---------------------------------------------------------------------------


def recomputes(rt: Runtime) -> bool:
    """Whether the general path, by default, keeps only chunk-boundary states for the backward
    and recomputes one chunk at a time (`_BoundedChunk`): for every memory. A deep memory's
    per-token weights [B, H, b, out, in] would otherwise be kept for every token of the
    sequence; so would a matrix memory's per-token states [B, H, b, Dv, Dk], Dk times its keys:
    on an elastic-net matrix rule (B 2, H 4, d 64, chunk 64) storing them peaked at 3.6 GiB for
    T = 2048 and 12 GiB for 8192, recomputing at 0.7 and 1.6 GiB, at the same speed at 2048 and
    1.2x the time at 8192 (docs/chunking.md, "Bounded memory for deep rules"). `run(...,
    recompute=False)` keeps them where memory allows."""
    del rt  # every memory alike; the argument stays the hook tests and callers override
    return True


def forward_general(
    rt: Runtime, seq: Tokens, state: State, chunk_size: int, recompute: bool | None = None
):
    state = dict(state)
    bounded = (recomputes(rt) if recompute is None else recompute) and torch.is_grad_enabled()
    # The keys a chunk step reads and writes: the weights and the optimizer's states. The
    # window's entries ("window.*") pass through untouched.
    names = set(rt.param_names)
    keys = [k for k in state if k in names or k.startswith("S.")]
    outputs = []
    for part in chunk_views(seq, chunk_size):
        if bounded:
            flat, layout = _flatten(part, [state[k] for k in keys])
            o, *new = _BoundedChunk.apply(rt, layout, keys, *flat)
            state.update(zip(keys, new, strict=True))
        else:
            o, new = chunk_step(rt, part, {k: state[k] for k in keys})
            state.update(new)
        outputs.append(o)
    return torch.cat(outputs, dim=2), state


def chunk_step(rt: Runtime, part: Tokens, state: State) -> tuple[torch.Tensor, State]:
    """One chunk from its start state: o [B, H, n, Dv] and the state after its last token.
    `state` holds the weights and the optimizer's states; it is not modified."""
    state = dict(state)
    gates = part.step_gates
    n = part.length
    sl = slice(0, n)
    weights = rt.weights(state)  # W_S [B, H, out, in]
    weights_e = {name: w.unsqueeze(2) for name, w in weights.items()}  # [B, H, 1, out, in]
    weights_e = rt.gradient_point(weights_e, gates, sl, like=part.phi_q)

    # g_t for every token of the chunk at once: [B, H, n, out, in] per parameter.
    grads = None

    def predict(x, weights_e=weights_e):
        return rt.memory.forward(weights_e, x)

    for x, grad_y in window_gradients(rt, predict, part, 0, n):
        g = rt.memory.backward(weights_e, x, grad_y)
        grads = g if grads is None else {k: grads[k] + g[k] for k in g}

    retention_args = [as_param_gate(gates[name][:, :, sl]) for name in rt.retention_gates]

    # Per-token views by `unbind`: its backward is one stack, where indexing `g[:, :, t]` would
    # build a zero [B, H, n, out, in] gradient per token (n^2 per chunk).
    grads_by_token = {name: g.unbind(2) for name, g in grads.items()}
    args_by_token = [g.unbind(2) for g in retention_args]
    per_token = {name: [] for name in rt.param_names}
    for t in range(n):
        grads_t = {name: g[t] for name, g in grads_by_token.items()}
        updates = rt.optimizer_step(grads_t, state, gates, t)
        args = [g[t] for g in args_by_token]
        for name, u in updates.items():
            state[name] = rt.functions.retention_step(state[name], u, *args)
            per_token[name].append(state[name])
    read = {
        name: rt.functions.retention_read(torch.stack(ws, dim=2)) for name, ws in per_token.items()
    }
    return rt.memory.forward(read, part.phi_q), state


# A chunk's inputs as one flat tuple of tensors (autograd.Function takes tensors positionally):
# the state's tensors in `keys` order, then q, k, v, valid and the gates in `layout`'s order.
def _flatten(part: Tokens, state_values: list[torch.Tensor]):
    step, win = list(part.step_gates), list(part.window_gates)
    flat = [*state_values, part.phi_q, part.phi_k, part.v, part.valid]
    flat += [part.step_gates[n] for n in step] + [part.window_gates[n] for n in win]
    return flat, (step, win, part.past)


def _unflatten(layout, keys: list[str], flat) -> tuple[Tokens, State]:
    step, win, past = layout
    state = dict(zip(keys, flat[: len(keys)], strict=True))
    q, k, v, valid, *gates = flat[len(keys) :]
    part = Tokens(
        q,
        k,
        v,
        valid,
        dict(zip(step, gates[: len(step)], strict=True)),
        dict(zip(win, gates[len(step) :], strict=True)),
        past,
    )
    return part, state


class _BoundedChunk(torch.autograd.Function):
    """`chunk_step` whose backward recomputes the chunk. The forward runs without a graph and
    saves only the chunk's inputs (its start state and tokens), so a sequence keeps T/b states
    for the backward, and the backward builds one chunk's b per-token states at a time: peak
    about (T/b + b) copies of the weights instead of T."""

    @staticmethod
    def forward(ctx, rt, layout, keys, *flat):
        ctx.rt, ctx.layout, ctx.keys = rt, layout, keys
        ctx.save_for_backward(*flat)
        with torch.no_grad():
            part, state = _unflatten(layout, keys, flat)
            o, new = chunk_step(rt, part, state)
        return (o, *(new[k] for k in keys))

    @staticmethod
    @torch.autograd.function.once_differentiable  # the recompute builds no second-order graph
    def backward(ctx, *grad_out):
        flat = [
            x.detach().requires_grad_(need)
            for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[3:], strict=True)
        ]
        with torch.enable_grad():
            part, state = _unflatten(ctx.layout, ctx.keys, flat)
            o, new = chunk_step(ctx.rt, part, state)
        outs = [o, *(new[k] for k in ctx.keys)]
        pairs = [(y, g) for y, g in zip(outs, grad_out, strict=True) if y.requires_grad]
        wanted = [x for x in flat if x.requires_grad]
        grads = iter(
            torch.autograd.grad(
                [y for y, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            )
            if pairs and wanted
            else [None] * len(wanted)
        )
        return (None, None, None, *(next(grads) if x.requires_grad else None for x in flat))
