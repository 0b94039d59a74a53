"""The memory's explicit backward (`miras.runtime.memory.MemoryModel.backward`, no autograd)
against `torch.func.grad` of L(M_W(x), v), in float64.

M_W and L are written here independently (torch.nn.functional activations and layer norm);
dL/dy comes from the compiled spec (`rule.functions.bias_grad`) and the model is
`rule.runtime.memory`. Three weight layouts, as the backends use them:
- per head: weights [B, H, out, in], x [B, H, in] (the recurrence);
- per head over a chunk: weights [B, H, 1, out, in], x [B, H, N, in] -> per-token gradients;
- per token: weights [B, H, N, out, in], x [B, H, N, in].
Tolerance: relative 1e-10 (assert_close rtol, atol scaled to the gradient's size).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import miras

B, H, N = 2, 3, 5
D_IN, D_OUT = 7, 4  # D_OUT = D_IN for the residual + LN form
f64 = torch.float64
RTOL = 1e-10

ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "tanh": torch.tanh}

# Biases: l2, Huber with a per-token threshold, and a custom formula with a gated parameter.
BIASES = {
    "l2": "l2",
    "huber": {"kind": "huber", "delta": "gate"},
    "custom": {"kind": "custom", "loss": "c*log(cosh(e/c)) + e**4/4", "params": {"c": "gate"}},
}


def reference_loss(bias: str, y, v, gate):
    """L(y, v) for one vector y, v [out]; `gate` a scalar (Huber's delta, the custom c)."""
    e = y - v
    if bias == "l2":
        return 0.5 * (e**2).sum()
    if bias == "huber":
        return torch.where(e.abs() <= gate, 0.5 * e**2, gate * (e.abs() - 0.5 * gate)).sum()
    return (gate * torch.log(torch.cosh(e / gate)) + e**4 / 4).sum()


def reference_memory(memory: dict, weights: dict[str, torch.Tensor], x: torch.Tensor):
    """M_W(x) for one vector x [in]; weights [out, in] each, named as miras names them
    (input side first: W_depth, ..., W_1; gated: W1 (act(W2 x) * W3 x))."""
    act = ACTIVATIONS[memory["activation"]]
    if memory["kind"] == "gated_mlp":
        return weights["W1"] @ (act(weights["W2"] @ x) * (weights["W3"] @ x))
    depth = memory["depth"]
    h = x
    for i in range(depth, 0, -1):
        h = weights[f"W{i}"] @ h
        if i > 1:
            h = act(h)
    if memory.get("residual_norm"):
        h = x + F.layer_norm(h, h.shape, eps=1e-5)
    return h


MEMORIES = {
    **{
        f"mlp{depth}-{act}{'-resnorm' if norm else ''}": {
            "kind": "mlp",
            "depth": depth,
            "expansion": 1.5,
            "activation": act,
            "residual_norm": norm,
        }
        for depth in (1, 2, 3)
        for act in ACTIVATIONS
        for norm in (False, True)
    },
    **{
        f"gated_mlp-{act}": {"kind": "gated_mlp", "expansion": 1.5, "activation": act}
        for act in ACTIVATIONS
    },
}

LAYOUTS = ("per_head", "per_head_chunk", "per_token")


def compiled(memory: dict, bias: str):
    return miras.compile(
        {"name": "memory_test", "memory": memory, "bias": BIASES[bias], "retention": "none"}
    )


def random_case(rule, memory: dict, layout: str, seed: int):
    """Weights in `layout`, inputs x and values v, and the bias's gate (positive) per token."""
    gen = torch.Generator().manual_seed(seed)
    d_out = D_IN if memory.get("residual_norm") else D_OUT
    shapes = rule.runtime.memory.shapes(D_IN, d_out)
    tokens = () if layout == "per_head" else (N,)
    weight_batch = {"per_head": (B, H), "per_head_chunk": (B, H, 1), "per_token": (B, H, N)}
    weights = {
        name: torch.randn(*weight_batch[layout], *shape, generator=gen, dtype=f64) / shape[1] ** 0.5
        for name, shape in shapes.items()
    }
    x = torch.randn(B, H, *tokens, D_IN, generator=gen, dtype=f64)
    v = torch.randn(B, H, *tokens, d_out, generator=gen, dtype=f64)
    gate = 0.3 + torch.rand(B, H, *tokens, 1, generator=gen, dtype=f64)
    return weights, x, v, gate


def reference_grads(memory, bias, weights, x, v, gate):
    """torch.func.grad of L(M_W(x), v) per example, vmapped over every batch axis."""

    def loss(w, x1, v1, g1):
        return reference_loss(bias, reference_memory(memory, w, x1), v1, g1[0])

    batch = x.shape[:-1]
    full = {
        n: w.expand(*batch, *w.shape[-2:]).reshape(-1, *w.shape[-2:]) for n, w in weights.items()
    }
    flat = [t.reshape(-1, t.shape[-1]) for t in (x, v, gate)]
    grads = vmap(grad(loss))(full, *flat)
    return {n: g.reshape(*batch, *g.shape[-2:]) for n, g in grads.items()}


def miras_grads(rule, bias, weights, x, v, gate):
    model = rule.runtime.memory
    y = model.forward(weights, x)
    gates = [] if bias == "l2" else [gate]
    grad_y = rule.functions.bias_grad(y, v, *gates)
    return model.backward(weights, x, grad_y)


def assert_grads_close(actual, expected):
    assert list(actual) == list(expected)
    for name, g in expected.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(actual[name], g, rtol=RTOL, atol=RTOL * scale, msg=name)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("memory_name", sorted(MEMORIES))
def test_backward_matches_torch_func_l2(memory_name, layout):
    memory = MEMORIES[memory_name]
    rule = compiled(memory, "l2")
    weights, x, v, gate = random_case(rule, memory, layout, seed=0)
    expected = reference_grads(memory, "l2", weights, x, v, gate)
    actual = miras_grads(rule, "l2", weights, x, v, gate)
    assert_grads_close(actual, expected)
    y_ref = vmap(lambda w, x1: reference_memory(memory, w, x1))(
        {
            n: w.expand(*x.shape[:-1], *w.shape[-2:]).reshape(-1, *w.shape[-2:])
            for n, w in weights.items()
        },
        x.reshape(-1, D_IN),
    )
    y = rule.runtime.memory.forward(weights, x)
    torch.testing.assert_close(y.reshape(y_ref.shape), y_ref, rtol=RTOL, atol=RTOL)


@pytest.mark.parametrize("layout", ["per_head_chunk", "per_token"])
@pytest.mark.parametrize("bias", ["huber", "custom"])
@pytest.mark.parametrize(
    "memory_name", ["mlp1-tanh", "mlp2-gelu-resnorm", "mlp3-silu", "gated_mlp-relu"]
)
def test_backward_matches_torch_func_other_biases(memory_name, bias, layout):
    memory = MEMORIES[memory_name]
    rule = compiled(memory, bias)
    weights, x, v, gate = random_case(rule, memory, layout, seed=1)
    expected = reference_grads(memory, bias, weights, x, v, gate)
    actual = miras_grads(rule, bias, weights, x, v, gate)
    assert_grads_close(actual, expected)


def test_huber_cases_reach_both_branches():
    """The Huber case above is not silently all-quadratic: errors straddle the threshold."""
    memory = MEMORIES["mlp2-gelu-resnorm"]
    rule = compiled(memory, "huber")
    weights, x, v, gate = random_case(rule, memory, "per_token", seed=1)
    err = (rule.runtime.memory.forward(weights, x) - v).abs()
    assert bool((err <= gate).any()) and bool((err > gate).any())


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_emitted_activation_grad_equals_autograd(activation):
    rule = compiled({"kind": "mlp", "depth": 2, "activation": activation}, "l2")
    fn = rule.functions
    gen = torch.Generator().manual_seed(2)
    # 240 points: the grid skips x = 0, where relu's derivative is a convention (the emitted
    # one gives 0, as torch.relu's autograd does; autograd of the emitted torch.clamp gives 1).
    grid = torch.linspace(-6, 6, 240, dtype=f64)
    x = torch.cat([grid, 3 * torch.randn(200, generator=gen, dtype=f64)])
    torch.testing.assert_close(fn.activation(x), ACTIVATIONS[activation](x), rtol=RTOL, atol=RTOL)
    expected = vmap(grad(fn.activation))(x)
    torch.testing.assert_close(fn.activation_grad(x), expected, rtol=RTOL, atol=RTOL)
