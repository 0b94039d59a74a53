"""The dual form of the chunk-start form for deep memories (`mlp`, `gated_mlp`, any memory
that writes `network` and `gradient_factors`): no per-token weights (the dual form of TTT,
Sun et al. 2024, "Learning to (Learn at Test Time)").

It applies where the compiler's chunk_form pass recorded `form == "dual"`
(`miras.compiler.dual_form.dual_reason`): a memory written as a network of weight matrices
(`Memory.has_gradient_factors`: the MLP, with or without MIRAS's `x + LN(...)`, and the gated
MLP), a linear step (the compiled `LinearStep`: retention none or l2 with gd, proximal,
momentum or Nesterov), any bias, any finite window.
The semantics are `miras.runtime.chunk`'s, to rounding (tests/runtime/test_dual_form.py): in a
chunk from state (W_S, S_S), every gradient is taken at W_e,t = W_S (or P_t W_S for the retained
gradient point, P_t = prod_{j<=t} a_j), and token t reads its own weights

    W_t = D_t W_S - C_t S_S - sum_{s<=t} K[t, s] lr_s g_s,    g_s = sum_j e_{s,j} x_{s,j}^T

per weight matrix (K[t, s] lr_s = M[t, s] and C the weight of S_S, the record unrolled by
`miras.runtime.unroll`: K = L^a L^theta, C = L^a Theta with momentum; K = L^a, C = 0 for gd:
docs/chunking.md, "The fast path"). Each token's gradient of a weight matrix is an outer product
of the backpropagated error e (at W_e) and that layer's input x, so the layer's read of an input
h_t is

    W_t h_t = D_t W_S h_t - C_t S_S h_t - sum_{s, j} K[t, s] lr_s (x_{s,j} . h_t) e_{s,j}:

two matmuls against the chunk-start weights and one masked [b, b c] product, layer by layer
(h_t is the previous layer's output under W_t). The state at the chunk's end is row b - 1 of
the same sums, as one [out, b c] x [b c, in] matmul. Nothing of size [b, out, in] is built, and
autograd through these ops (the reads and the chunk's end state with backwards of their own,
below) keeps T / b states plus per-token vectors for the backward.

The error and input factors of each weight are the memory component's own
(`Memory.network`, `Memory.gradient_factors`): its `backward` takes the outer products of the
same factors (docs/chunking.md, "The dual form").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miras.runtime.chunk_common import chunk_views, window_gradients
from miras.runtime.core import Runtime, State, Tokens, gate_values
from miras.runtime.unroll import unroll

# linear(name, h [B, H, n, in]) -> the weight `name` applied to h, [B, H, n, out].
Linear = Callable[[str, torch.Tensor], torch.Tensor]


def forward(rt: Runtime, seq: Tokens, state: State, chunk_size: int):
    """Returns o [B, H, T, Dv] and the final memory state, like `chunk.forward`."""
    state = dict(state)
    names = set(rt.param_names)
    keys = [k for k in state if k in names or k.startswith("S.")]
    outputs = []
    parts = chunk_views(seq, chunk_size)
    for part, mixing in zip(parts, _mixings(rt, seq, chunk_size), strict=True):
        o, new = chunk_step(rt, part, {k: state[k] for k in keys}, mixing)
        state.update(new)
        outputs.append(o)
    return torch.cat(outputs, dim=2), state


@dataclass(frozen=True)
class Mixing:
    """How a chunk's updates reach its tokens' weights, from the step gates alone ([B, H, n, .]):
    `d` D_t [n, 1]; `coeff` K[t, s] lr_s [n, n]; with momentum `carry` C_t [n, 1], `theta_prod`
    Theta_t [n, 1] and `to_momentum` L^theta[n-1, s] lr_s [n] (the chunk's last S)."""

    d: torch.Tensor
    coeff: torch.Tensor
    carry: torch.Tensor | None = None
    theta_prod: torch.Tensor | None = None
    to_momentum: torch.Tensor | None = None


def _mixings(rt: Runtime, seq: Tokens, chunk_size: int) -> list[Mixing]:
    """Every chunk's `Mixing` at once (they do not read the state), cut with `unbind` so the
    backward joins the chunks in one stack. The last chunk is padded with factors 1, which
    come after every token they could touch, and cut back."""
    unrolled, n, chunks = unrolled_chunks(rt, seq, chunk_size)
    length = seq.length
    fields = {"d": unrolled.d, "coeff": unrolled.mix[:, :, :, 0]}
    if unrolled.carry is not None:
        fields["carry"] = unrolled.carry
        fields["theta_prod"] = unrolled.state_carry
        fields["to_momentum"] = unrolled.state_mix[:, :, :, 0]  # cut to its last row below
    per_chunk = {name: z.unbind(2) for name, z in fields.items()}
    out = []
    for i in range(chunks):
        m = n if i < chunks - 1 else length - (chunks - 1) * n
        cut = {name: z[i][:, :, :m] for name, z in per_chunk.items()}
        cut["coeff"] = cut["coeff"][..., :m]
        if "to_momentum" in cut:
            cut["to_momentum"] = cut["to_momentum"][:, :, m - 1, :m]
        out.append(Mixing(**cut))
    return out


def unrolled_chunks(rt: Runtime, seq: Tokens, chunk_size: int):
    """(the compiled LinearStep unrolled over every chunk at once, the chunk length n, the
    number of chunks): fields [B, H, N, n, .] (`miras.runtime.unroll.Unrolled`; matrices
    [B, H, N, 1, n, n] for per-head gates), the last chunk padded with factors 1."""
    spec, length = rt.spec, seq.length
    n = min(chunk_size, length)
    chunks = -(-length // n)
    pad = chunks * n - length

    def steps(field: str, name: str) -> torch.Tensor:
        """A step gate [B, H, T, 1] -> [B, H, N, n, 1]."""
        component = getattr(spec, field)
        g = gate_values(component, name, seq.step_gates, slice(0, length), seq.phi_q)
        return F.pad(g, (0, 0, 0, pad), value=1.0).unflatten(2, (chunks, n))

    like = F.pad(seq.phi_q[..., :1], (0, 0, 0, pad)).unflatten(2, (chunks, n))
    # The compiled LinearStep unrolled: matrices [B, H, N, 1, n, n] (per-head gates).
    return unroll(rt.linear_step, steps, like), n, chunks


def chunk_step(
    rt: Runtime, part: Tokens, state: State, mixing: Mixing
) -> tuple[torch.Tensor, State]:
    """One chunk from its start state: o [B, H, n, Dv] and the state after its last token."""
    memory, model, names = rt.spec.memory, rt.memory, rt.param_names
    n, d = part.length, mixing.d
    weights = rt.weights(state)  # W_S: name -> [B, H, out, in]
    momentum = {name: state[f"S.{name}"] for name in weights} if rt.has_momentum else None

    # The window's error signals at the gradient point, and each weight's factors:
    # e [B, H, n c, out] and x [B, H, n c, in], row j n + t for token t's offset j.
    point = d if rt.retained_gradient else None
    caches = []

    def predict(x: torch.Tensor) -> torch.Tensor:
        y, cache = memory.network(names, _at_start(weights, point), x, model.activation)
        caches.append(cache)
        return y

    signals = window_gradients(rt, predict, part, 0, n)
    transposed = _transposed_at_start(weights, point)
    pieces = [
        memory.gradient_factors(
            names, transposed, cache, grad_y, model.activation, model.activation_grad
        )
        for cache, (_, grad_y) in zip(caches, signals, strict=True)
    ]
    errors = {name: _rows([p[name][0] for p in pieces]) for name in weights}
    inputs = {name: _rows([p[name][1] for p in pieces]) for name in weights}
    coeff = _tiled(mixing.coeff, len(pieces))  # [B, H, n, n c]
    carry = mixing.carry

    def read(name: str, h: torch.Tensor) -> torch.Tensor:
        """W_t h_t for the chunk's tokens: h [B, H, n, in] -> [B, H, n, out]."""
        # Fused where one op does two passes' work: the carry's multiply-subtract, and the
        # masked product subtracted by the matmul itself (beta 1, alpha -1).
        z = d * _linear(h, weights[name])
        if carry is not None:
            z = torch.addcmul(z, carry, _linear(h, momentum[name]), value=-1.0)
        scores = _linear(h, inputs[name]) * coeff  # [B, H, n, n c]
        e = errors[name]
        out = torch.baddbmm(z.flatten(0, 1), scores.flatten(0, 1), e.flatten(0, 1), alpha=-1.0)
        return out.unflatten(0, z.shape[:2])

    o, _ = memory.network(names, read, part.phi_q, model.activation)

    # The state after the chunk's last token: row n - 1 of the sums above, each decayed state
    # plus one [out, n c] x [n c, in] matmul (fused, as are the carry's multiply-subtract).
    new = {}
    last = -coeff[:, :, -1].unsqueeze(-1)  # -K[n-1, s] lr_s: [B, H, n c, 1]
    if carry is None:
        for name in weights:
            e = errors[name]
            new[name] = _ChunkEnd.apply(state[name], d[:, :, -1:], e * last, inputs[name])
        return o, new
    last_s = _tiled(mixing.to_momentum, len(pieces)).unsqueeze(-1)
    a, c, theta = d[:, :, -1:], carry[:, :, -1:], mixing.theta_prod[:, :, -1:]
    for name in weights:
        e = errors[name]
        new[name], new[f"S.{name}"] = _MomentumChunkEnd.apply(
            state[name], momentum[name], a, c, theta, e * last, e * last_s, inputs[name]
        )
    return o, new


# The chunk's end state, as two autograd functions. Written with plain ops (`a * W`, then
# `addcmul(.., c, S, value=-1)`, then `baddbmm`), autograd's backward scales the incoming
# gradient once per op and term (the -1 of the carry's term a pass of its own), takes each
# gate's gradient as a product and sum over whatever strides the gradient came with, and
# allocates an output per op; those weight-sized passes were a quarter of a titans layer's
# time. Here the forward scales and adds in place into one fresh tensor per state, and the
# backward makes the fewest weight-sized passes the formulas need: one scaling per state's
# gradient (an addcmul for S's two terms), one `_dot` per gate, the outer products' factors by
# batched matmuls. It is written in differentiable ops, so a double backward through the form
# still works.


class _ChunkEnd(torch.autograd.Function):
    """W' = a W + e^T x (gd): W [B, H, out, in], a [B, H, 1, 1], e [B, H, m, out],
    x [B, H, m, in] -> W' [B, H, out, in]."""

    @staticmethod
    def forward(ctx, w, a, e, x):
        ctx.save_for_backward(w, a, e, x)
        return _add_outer(w * a, e, x)

    @staticmethod
    def backward(ctx, g):
        w, a, e, x = ctx.saved_tensors
        return g * a, _dot(g, w), x @ g.transpose(-1, -2), e @ g


class _MomentumChunkEnd(torch.autograd.Function):
    """W' = a W - c S + e_w^T x and S' = theta S + e_s^T x (momentum): W, S [B, H, out, in];
    a, c, theta [B, H, 1, 1]; e_w, e_s [B, H, m, out]; x [B, H, m, in] -> (W', S')."""

    @staticmethod
    def forward(ctx, w, s, a, c, theta, e_w, e_s, x):
        ctx.save_for_backward(w, s, a, c, theta, e_w, e_s, x)
        w_new = (w * a).addcmul_(c, s, value=-1.0)
        return _add_outer(w_new, e_w, x), _add_outer(s * theta, e_s, x)

    @staticmethod
    def backward(ctx, g_w, g_s):
        w, s, a, c, theta, e_w, e_s, x = ctx.saved_tensors
        grad_s = torch.addcmul(g_s * theta, c, g_w, value=-1.0)
        grad_x = e_w @ g_w + e_s @ g_s
        return (
            g_w * a, grad_s, _dot(g_w, w), -_dot(g_w, s), _dot(g_s, s),
            x @ g_w.transpose(-1, -2), x @ g_s.transpose(-1, -2), grad_x,
        )  # fmt: skip


def _add_outer(base: torch.Tensor, e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """base + e^T x in place: [B, H, out, in] += [B, H, m, out]^T [B, H, m, in], one batched
    matmul (`base` is a fresh tensor of the caller's)."""
    flat = base.view(-1, *base.shape[2:])
    flat.baddbmm_(e.flatten(0, 1).transpose(-1, -2), x.flatten(0, 1))
    return base


class _Linear(torch.autograd.Function):
    """h w^T: h [B, H, n, in], w [B, H, out, in] -> [B, H, n, out]. Autograd's own backward of
    `h @ w.transpose(-1, -2)` gives w's gradient as the transpose of h^T g, a view with the
    strides of [in, out]; every pass over it (the sum of a weight's gradients from its reads,
    the scaling by the chunk's decay) then runs on strided memory, several times slower than
    on contiguous. Here it is g^T h, contiguous in w's own layout."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        return h @ w.transpose(-1, -2)

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        return g @ w, g.transpose(-1, -2) @ h


def _linear(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _Linear.apply(h, w)


def _dot(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum(g * w) over each head's matrix: [B, H, out, in] x 2 -> [B, H, 1, 1]. (A batched
    [1, out in] x [out in, 1] matmul, an 8 x 8 `mm` of all heads' pairs and a loop of
    `torch.dot` were each as fast or slower here.)"""
    return torch.linalg.vecdot(g.flatten(-2), w.flatten(-2))[..., None, None]


def _rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The window's offsets' factors as one [B, H, n c, .]; a window of one (c = 1, most
    specs) is its only part, not a copy of it."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _tiled(z: torch.Tensor, c: int) -> torch.Tensor:
    """z [.., n] repeated c times along its last axis, for the window's c row blocks; itself
    where c = 1."""
    return z if c == 1 else z.repeat(*[1] * (z.dim() - 1), c)


def _at_start(weights, point) -> Linear:
    """The gradient point's layers: W_S h, or P_t (W_S h) for the retained state (P_t scales
    the whole weight, so it scales the product, not a per-token copy)."""

    def linear(name: str, h: torch.Tensor) -> torch.Tensor:
        z = _linear(h, weights[name])
        return z if point is None else point * z

    return linear


def _transposed_at_start(weights, point) -> Linear:
    """W_e^T g at the gradient point: g [B, H, n, out] -> [B, H, n, in]."""

    def linear(name: str, g: torch.Tensor) -> torch.Tensor:
        z = g @ weights[name]
        return z if point is None else point * z

    return linear
