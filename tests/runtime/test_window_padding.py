"""The Omega window's slots before the first token never reach a formula out of range.

Regression tests for the log-cosh bias (dL/dy = tanh(e/a), a gated scale a > 0) with a window
c = 2 or 3: the c - 1 slots before the first token carried a = 0, so tanh(0/0) was NaN on every
backend, and multiplying by valid = 0 kept the NaN. Each backend is compared, forward and
backward, with an oracle written here in which those slots simply do not exist (the first
c - 1 tokens have shorter windows) and whose bias gradient is autograd of the loss formula.
"""

from __future__ import annotations

import pytest
import torch
import yaml

import miras
from miras.models import MirasLayer

SPEC_PATH = "specs/examples/logcosh_deltanet.yaml"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: the interpreter on a CPU
GATES = ("a", "decay", "lr")


def logcosh_spec(c: int) -> dict:
    with open(SPEC_PATH) as f:
        spec = yaml.safe_load(f)
    spec["name"] = f"logcosh_window{c}"
    spec["window"] = c
    return spec


def sample(b, t, h, dk, dv, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, dtype=dtype, generator=gen)

    q, k, v = (torch.randn(b, t, h, d, dtype=dtype, generator=gen) for d in (dk, dk, dv))
    gates = {"a": 0.5 + rand(b, t, h), "decay": 0.6 + 0.4 * rand(b, t, h), "lr": rand(b, t, h)}
    return q, k, v, gates


def oracle(q, k, v, gates, c: int, chunk_size: int) -> torch.Tensor:
    """o [B, T, H, Dv] of W_t = a_t W_{t-1} - lr_t g_t, o_t = W_t q_t from W_0 = 0, where
    g_t = sum over i = t-c+1..t, i >= 0 of grad_W L(W_e,t k_i, v_i), L = sum a_i log cosh(e/a_i).
    Gradient point (grad_at: retained): W_e,t = (prod_{j=s..t} decay_j) W_s with s the first
    token of t's chunk (chunk size 1: decay_t W_{t-1}). dL/dy is autograd of the loss."""
    b, t_len, h, dk = k.shape
    dv = v.shape[-1]
    w = torch.zeros(b, h, dv, dk, dtype=q.dtype, device=q.device)
    w_start, kept = w, None
    outputs = []
    for t in range(t_len):
        decay = gates["decay"][:, t]  # [B, H] per head or [B, H, Dv] per channel
        decay = decay[..., None, None] if decay.dim() == 2 else decay[..., None]  # scales rows
        if t % chunk_size == 0:
            w_start, kept = w, torch.ones_like(decay)
        kept = kept * decay
        w_e = kept * w_start
        grad = torch.zeros_like(w)
        for i in range(max(0, t - c + 1), t + 1):
            ki, vi, ai = k[:, i], v[:, i], gates["a"][:, i, :, None]  # [B, H, D], [B, H, 1]
            y = torch.einsum("bhvd,bhd->bhv", w_e, ki)
            if not y.requires_grad:
                y = y.requires_grad_()
            loss = (ai * torch.log(torch.cosh((y - vi) / ai))).sum()
            (grad_y,) = torch.autograd.grad(loss, y, create_graph=True)
            grad = grad + grad_y[..., None] * ki[..., None, :]
        w = decay * w - gates["lr"][:, t, :, None, None] * grad
        outputs.append(torch.einsum("bhvd,bhd->bhv", w, q[:, t]))
    return torch.stack(outputs, dim=1)


def relative_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).detach().norm() / expected.detach().norm())


def run_and_grad(fn, q, k, v, gates, weight):
    """fn's output and the gradients of <output, weight> for q, k, v and every gate."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *(gates[n] for n in GATES))]
    o = fn(*leaves[:3], dict(zip(GATES, leaves[3:], strict=True)))
    return o, torch.autograd.grad((o * weight).sum(), leaves)


CASES = [
    ("recurrent", 1, 1e-12),
    ("chunk", 1, 1e-12),
    ("chunk", 3, 1e-12),
]


@pytest.mark.parametrize("c", [2, 3])
@pytest.mark.parametrize(
    ("backend", "chunk_size", "tol"), CASES, ids=["recurrent", "chunk-b1", "chunk-b3"]
)
def test_window_matches_oracle_without_padding(c, backend, chunk_size, tol):
    rule = miras.compile(logcosh_spec(c))
    q, k, v, gates = sample(2, 8, 2, 3, 4)
    weight = torch.randn(
        2, 8, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5)
    )

    def ours(q, k, v, g):
        return rule(q, k, v, gates=g, backend=backend, chunk_size=chunk_size)[0]

    def theirs(q, k, v, g):
        return oracle(q, k, v, g, c, chunk_size)

    o, grads = run_and_grad(ours, q, k, v, gates, weight)
    o_ref, grads_ref = run_and_grad(theirs, q, k, v, gates, weight)
    assert torch.isfinite(o).all()
    assert relative_rms(o, o_ref) < tol
    for name, g, g_ref in zip(("q", "k", "v", *GATES), grads, grads_ref, strict=True):
        assert torch.isfinite(g).all(), name
        assert relative_rms(g, g_ref) < 1e-10, name


@pytest.mark.parametrize("c", [2, 3])
@pytest.mark.parametrize("kernel", ["linear", "general"])
def test_triton_window_matches_oracle_without_padding(c, kernel):
    """Tiny sizes (the interpreter on a CPU); T = 5 over chunks of 2 crosses chunk edges and
    reads padding slots in the first chunk. A per-channel decay takes the general kernel."""
    pytest.importorskip("triton")
    rule = miras.compile(logcosh_spec(c))
    q, k, v, gates = sample(1, 5, 1, 4, 4, seed=1)
    if kernel == "general":
        gates["decay"] = gates["decay"][..., None] ** torch.linspace(0.5, 2, 4, dtype=torch.float64)
    weight = torch.randn(
        1, 5, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6)
    ).to(DEVICE)
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    gates = {n: g.to(DEVICE) for n, g in gates.items()}

    def ours(q, k, v, g):
        return rule(q, k, v, gates=g, backend="triton", chunk_size=2)[0]

    def theirs(q, k, v, g):
        return oracle(q, k, v, g, c, chunk_size=2)

    o, grads = run_and_grad(ours, q, k, v, gates, weight)
    o_ref, grads_ref = run_and_grad(theirs, q, k, v, gates, weight)
    assert torch.isfinite(o).all()
    assert relative_rms(o, o_ref) < 1e-10
    for name, g, g_ref in zip(("q", "k", "v", *GATES), grads, grads_ref, strict=True):
        assert torch.isfinite(g).all(), name
        assert relative_rms(g, g_ref) < 1e-9, name


@pytest.mark.parametrize("split", [1, 4])
def test_carried_window_equals_one_pass(split):
    """A first piece shorter than c - 1 = 2 tokens carries padding slots in its state."""
    rule = miras.compile(logcosh_spec(3))
    q, k, v, gates = sample(2, 7, 2, 3, 4, seed=2)
    whole, _ = rule(q, k, v, gates=gates, backend="recurrent")
    first, state = rule(
        q[:, :split],
        k[:, :split],
        v[:, :split],
        gates={n: g[:, :split] for n, g in gates.items()},
        backend="recurrent",
        output_final_state=True,
    )
    rest, _ = rule(
        q[:, split:],
        k[:, split:],
        v[:, split:],
        gates={n: g[:, split:] for n, g in gates.items()},
        backend="chunk",
        chunk_size=1,  # the exact step, as `whole`
        initial_state=state,
    )
    assert torch.isfinite(first).all() and torch.isfinite(rest).all()
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole, rtol=1e-12, atol=1e-14)


def test_user_window_state_slots_without_a_token_are_ignored():
    """valid = 0 slots of a caller's window state hold garbage (a gate of 0, NaN keys): the
    result is that of a fresh start, and no gradient reaches those slots."""
    rule = miras.compile(logcosh_spec(3))
    q, k, v, gates = sample(1, 5, 2, 3, 4, seed=3)
    garbage = {
        "W": torch.zeros(1, 2, 4, 3, dtype=torch.float64),
        "window.k": torch.full((1, 2, 2, 3), float("nan"), dtype=torch.float64),
        "window.v": torch.full((1, 2, 2, 4), float("nan"), dtype=torch.float64),
        "window.valid": torch.zeros(1, 2, 2, 1, dtype=torch.float64),
        "window.a": torch.zeros(1, 2, 2, 1, dtype=torch.float64, requires_grad=True),
    }
    for backend in ("recurrent", "chunk"):
        fresh, _ = rule(q, k, v, gates=gates, backend=backend, chunk_size=2)
        o, _ = rule(q, k, v, gates=gates, backend=backend, chunk_size=2, initial_state=garbage)
        torch.testing.assert_close(o, fresh, rtol=1e-12, atol=1e-14)
        (grad,) = torch.autograd.grad(o.sum(), garbage["window.a"])
        assert torch.equal(grad, torch.zeros_like(grad))


def test_user_window_state_is_checked():
    rule = miras.compile(logcosh_spec(2))
    q, k, v, gates = sample(1, 3, 1, 3, 4, seed=4)
    state = {
        "W": torch.zeros(1, 1, 4, 3, dtype=torch.float64),
        "window.k": torch.zeros(1, 1, 1, 3, dtype=torch.float64),
        "window.v": torch.zeros(1, 1, 1, 4, dtype=torch.float64),
        "window.valid": torch.ones(1, 1, 1, 1, dtype=torch.float64),
        "window.a": torch.zeros(1, 1, 1, 1, dtype=torch.float64),  # a token with a = 0
    }
    with pytest.raises(ValueError, match=r"initial_state\['window.a'\].*\(0, inf\).*found 0"):
        rule(q, k, v, gates=gates, initial_state=state)
    state["window.valid"] = torch.full((1, 1, 1, 1), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"initial_state\['window.valid'\]: expected 0"):
        rule(q, k, v, gates=gates, initial_state=state)


def test_layer_with_window_trains_and_decodes_finite():
    """The model path: a MirasLayer's parallel forward and backward, and token-by-token
    decoding (whose cache carries the window) equal to the recurrent parallel forward."""
    torch.manual_seed(0)
    layer = MirasLayer(logcosh_spec(2), 16, 2, chunk_size=4)
    x = torch.randn(2, 6, 16)
    y, _ = layer(x)
    y.pow(2).mean().backward()
    assert torch.isfinite(y).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
    with torch.no_grad():
        layer.backend = "recurrent"
        whole, _ = layer(x)
        cache, steps = layer.empty_cache(2), []
        for t in range(x.shape[1]):
            y_t, cache = layer(x[:, t : t + 1], cache)
            steps.append(y_t)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-6)
