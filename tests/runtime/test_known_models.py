"""Known models reproduce their published recurrences exactly at chunk size 1.

Two independent oracles per model, forward (outputs, final state) and backward (gradients of
a random linear functional of both, w.r.t. q, k, v, gates and the initial state):

- fla's pure-torch references (`pip install --no-deps fla-core einops`; the functions in
  `fla/ops/<op>/naive.py`). They compute in float32 whatever the input dtype, so the inputs are
  float32-representable float64 tensors, miras runs in float64, and the tolerance is a relative
  RMS of 1e-5 (fla's float32 rounding; observed ~1e-7). fla's conventions, mapped here:
  state [B, H, Dk, Dv] (miras: [B, H, Dv, Dk], the transpose); `g` is the log of the decay
  (miras: the decay itself, natural space); `scale` defaults to Dk^-0.5 (miras applies none, so
  scale=1.0 is passed, or q is pre-multiplied by Dk^0.5 where the function has no argument).
- The papers' recurrences, written below in float64, in the papers' own form; these are exact
  claims: assert_close with rtol = atol = 1e-10.

Titans' rule on a matrix memory has no fla reference (fla's `titans/naive.py` adds a LayerNorm
and a residual target), so it is checked against the paper's formula alone.

Chunk sizes above 1: here only the dot-product (Hebbian) models, whose gradient does not
depend on the state, so every chunk form equals the recurrence. The delta-rule models at
chunk 64 (the exact chunk form, `chunk_mode="auto"`) against fla's recurrences and chunked
forms, the momentum delta rule included, are tests/runtime/test_exact_fla.py and
tests/runtime/test_exact_chunk.py; the chunk-start form (`chunk_mode="start"`) is a different model
for them (docs/chunking.md).

Nonparametric memory (softmax attention, SWA) is checked against `softmax(q k^T + mask) v`
written out in float64 with an explicit causal band mask (the runtime calls SDPA; the oracle
does not).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import miras

B, T, H, DK, DV = 2, 63, 3, 60, 37  # Dk != Dv so a transposed state cannot pass
FLA_TOL = 1e-5  # relative RMS: fla computes in float32
EXACT = dict(rtol=1e-10, atol=1e-10)  # float64 against the papers' formulas

f64 = torch.float64


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()


def assert_rel_rms(actual, expected, tol, what):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = rel_rms(actual.double(), expected.double())
    assert err <= tol, f"{what}: relative RMS {err:.3g} > {tol:.3g}"


# Inputs ---------------------------------------------------------------------------------------


def f32_exact(x: torch.Tensor) -> torch.Tensor:
    """float64 values that float32 represents exactly, so fla sees the same numbers."""
    return x.float().double()


def unit_interval(gen, shape, lo, hi):
    return f32_exact(lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=f64))


def gates_for(rule, gen, *, per_channel_lr=False) -> dict[str, torch.Tensor]:
    """Natural-space gates in their ranges: decay in [0.8, 1], lr in [0.1, 0.9], momentum
    in [0, 0.9)."""
    ranges = {"decay": (0.8, 1.0), "lr": (0.1, 0.9), "momentum": (0.0, 0.9)}
    out = {}
    for name in rule.gates:
        shape = (B, T, H, DV) if (name == "lr" and per_channel_lr) else (B, T, H)
        out[name] = unit_interval(gen, shape, *ranges[name])
    return out


# Not helpers.random_inputs: fla's references compute in float32, so every leaf is a
# float32-representable float64 tensor (f32_exact), with a non-zero initial state.
def make_inputs(rule, seed, *, per_channel_lr=False, momentum_state=False):
    """q, k unit rows (what keeps the delta rule contractive), v ~ N(0, 1), a non-zero initial
    state; all leaves require grad."""
    gen = torch.Generator().manual_seed(seed)
    q = f32_exact(F.normalize(torch.randn(B, T, H, DK, generator=gen, dtype=f64), dim=-1))
    k = f32_exact(F.normalize(torch.randn(B, T, H, DK, generator=gen, dtype=f64), dim=-1))
    v = f32_exact(torch.randn(B, T, H, DV, generator=gen, dtype=f64))
    gates = gates_for(rule, gen, per_channel_lr=per_channel_lr)
    w0 = f32_exact(0.1 * torch.randn(B, H, DV, DK, generator=gen, dtype=f64))
    init = {"W": w0, "S.W": f32_exact(0.1 * torch.randn_like(w0))} if momentum_state else w0
    leaves = [q, k, v, *gates.values(), *(init.values() if momentum_state else [init])]
    for x in leaves:
        x.requires_grad_(True)
    return q, k, v, gates, init, leaves


def loss_and_grads(o, state, leaves, seed=11):
    """A random linear functional of the output and every final-state tensor, and its gradients."""
    gen = torch.Generator().manual_seed(seed)
    states = [state[n] for n in sorted(state)] if isinstance(state, dict) else [state]
    tensors = [o, *states]
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=f64)).sum() for x in tensors)
    return torch.autograd.grad(loss, leaves)


# The papers' recurrences (float64; state [B, H, Dv, Dk], o_t = S_t q_t) ------------------------


def per_head(g: torch.Tensor, t: int) -> torch.Tensor:
    """A gate [B, T, H] or [B, T, H, Dv] at token t, shaped to scale S [B, H, Dv, Dk] by rows."""
    g = g[:, t]
    return g[..., None, None] if g.dim() == 2 else g[..., None]


def outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.unsqueeze(-1) * b.unsqueeze(-2)


def read(s: torch.Tensor, q_t: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bhvk,bhk->bhv", s, q_t)


def paper_linear_attention(q, k, v, gates, s):
    """Katharopoulos et al. 2020, eq. 4-5 without the normalizer: S_t = S_{t-1} + v_t k_t^T."""
    outs = []
    for t in range(q.shape[1]):
        s = s + outer(v[:, t], k[:, t])
        outs.append(read(s, q[:, t]))
    return torch.stack(outs, 1), s


def paper_retnet(q, k, v, gates, s):
    """RetNet (Sun et al. 2023, eq. 1) with a data-dependent decay (simple GLA):
    S_t = a_t S_{t-1} + v_t k_t^T."""
    outs = []
    for t in range(q.shape[1]):
        s = per_head(gates["decay"], t) * s + outer(v[:, t], k[:, t])
        outs.append(read(s, q[:, t]))
    return torch.stack(outs, 1), s


def paper_deltanet(q, k, v, gates, s):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024, eq. 2):
    S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T.
    Written row by row, S_t = S_{t-1} - beta_t S_{t-1} k_t k_t^T + beta_t v_t k_t^T, so a beta
    per value channel (fla's beta [B, H, T, Dv]) scales the rows of S."""
    outs = []
    for t in range(q.shape[1]):
        beta = per_head(gates["lr"], t)
        k_t = k[:, t]
        s = s - beta * (s @ outer(k_t, k_t)) + beta * outer(v[:, t], k_t)
        outs.append(read(s, q[:, t]))
    return torch.stack(outs, 1), s


def paper_gated_deltanet(q, k, v, gates, s):
    """Gated DeltaNet (Yang et al. 2025, eq. 10):
    S_t = S_{t-1} (a_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T."""
    outs = []
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    for t in range(q.shape[1]):
        a, beta = per_head(gates["decay"], t), per_head(gates["lr"], t)
        k_t = k[:, t]
        s = s @ (a * (eye - beta * outer(k_t, k_t))) + beta * outer(v[:, t], k_t)
        outs.append(read(s, q[:, t]))
    return torch.stack(outs, 1), s


def paper_titans(q, k, v, gates, state):
    """Titans (Behrouz et al. 2025, eq. 13-14) on a matrix memory M, with
    l(M; k, v) = 1/2 ||M k - v||^2 (so grad l = (M k - v) k^T; the paper's loss has no 1/2,
    which only rescales theta):
        S_t = eta_t S_{t-1} - theta_t grad l(M_{t-1}; k_t, v_t)
        M_t = (1 - alpha_t) M_{t-1} + S_t,        o_t = M_t q_t
    miras's gates: theta_t = lr, eta_t = momentum, 1 - alpha_t = decay. miras's momentum
    state is the accumulated gradient (s_t = eta_t s_{t-1} + theta_t g_t, M_t = a_t M_{t-1}
    - s_t), so miras's "S.W" is minus the paper's surprise S_t. `state` here is the paper's
    (M, S)."""
    m, surprise = state
    outs = []
    for t in range(q.shape[1]):
        theta, eta = per_head(gates["lr"], t), per_head(gates["momentum"], t)
        one_minus_alpha = per_head(gates["decay"], t)
        grad = outer(read(m, k[:, t]) - v[:, t], k[:, t])
        surprise = eta * surprise - theta * grad
        m = one_minus_alpha * m + surprise
        outs.append(read(m, q[:, t]))
    return torch.stack(outs, 1), (m, surprise)


# fla's references, mapped to miras's conventions ----------------------------------------------


def fla_naive(op: str, name: str) -> Callable:
    """`fla.ops.<op>.naive.<name>`, imported on first use, so that the tests that do not use
    fla run without it."""
    try:
        with warnings.catch_warnings():
            # fla warns at import that Triton has no GPU here; the naive functions are torch.
            warnings.simplefilter("ignore")
            module = importlib.import_module(f"fla.ops.{op}.naive")
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "fla's references are the oracles here: .venv/bin/pip install --no-deps fla-core "
            "einops (fla-core needs only einops; --no-deps keeps the installed torch)"
        ) from err
    return getattr(module, name)


def t_state(s: torch.Tensor) -> torch.Tensor:
    """[B, H, Dv, Dk] <-> fla's [B, H, Dk, Dv]."""
    return s.transpose(-1, -2)


def fla_linear_attention(q, k, v, gates, s0):
    # [B, T, H, D] layout; float32 inside, so the initial state must be float32 too.
    o, s = fla_naive("linear_attn", "naive_recurrent_linear_attn")(
        q, k, v, scale=1.0, initial_state=t_state(s0).float(), output_final_state=True
    )
    return o, t_state(s)


def fla_retnet(q, k, v, gates, s0):
    # [B, T, H, D] layout; g = log of the decay.
    o, s = fla_naive("simple_gla", "naive_recurrent_simple_gla")(
        q, k, v, gates["decay"].log(), scale=1.0, initial_state=t_state(s0), output_final_state=True
    )
    return o, t_state(s)


def fla_deltanet(q, k, v, gates, s0):
    # [B, H, T, D] layout; no scale argument (q is multiplied by Dk^-0.5 inside), so q is
    # pre-multiplied by Dk^0.5. beta [B, H, T] or per value channel [B, H, T, Dv].
    o, s = fla_naive("delta_rule", "delta_rule_recurrence")(
        q.transpose(1, 2) * q.shape[-1] ** 0.5,
        k.transpose(1, 2),
        v.transpose(1, 2),
        gates["lr"].transpose(1, 2),
        initial_state=t_state(s0),
    )
    return o.transpose(1, 2), t_state(s)


def fla_gated_deltanet(q, k, v, gates, s0):
    # [B, T, H, D] layout; g = log of the decay; the gradient at the decayed state.
    o, s = fla_naive("gated_delta_rule", "naive_recurrent_gated_delta_rule")(
        q,
        k,
        v,
        gates["lr"],
        gates["decay"].log(),
        scale=1.0,
        initial_state=t_state(s0),
        output_final_state=True,
    )
    return o, t_state(s)


# The models -----------------------------------------------------------------------------------

TITANS_MATRIX = {
    "name": "titans_matrix",
    "memory": "matrix",
    "bias": "l2",
    "retention": "l2",
    "optimizer": "momentum",
}


@dataclass(frozen=True)
class Model:
    spec: str | dict
    paper: Callable
    fla: Callable | None = None
    per_channel_lr: bool = False


MODELS = {
    "linear_attention": Model(
        "specs/linear_attention.yaml", paper_linear_attention, fla_linear_attention
    ),
    "retnet": Model("specs/retnet.yaml", paper_retnet, fla_retnet),
    "deltanet": Model("specs/deltanet.yaml", paper_deltanet, fla_deltanet),
    "deltanet_channel_lr": Model(
        "specs/deltanet.yaml", paper_deltanet, fla_deltanet, per_channel_lr=True
    ),
    "gated_deltanet": Model("specs/gated_deltanet.yaml", paper_gated_deltanet, fla_gated_deltanet),
}
BACKENDS = {"recurrent": dict(backend="recurrent"), "chunk1": dict(backend="chunk", chunk_size=1)}


def run_miras(rule, q, k, v, gates, init, options):
    return rule(q, k, v, gates, initial_state=init, output_final_state=True, **options)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", [n for n, m in MODELS.items() if m.fla is not None])
def test_matches_fla_reference(name, backend):
    model = MODELS[name]
    rule = miras.compile(model.spec)
    q, k, v, gates, init, leaves = make_inputs(rule, seed=1, per_channel_lr=model.per_channel_lr)

    o, state = run_miras(rule, q, k, v, gates, init, BACKENDS[backend])
    assert o.dtype == f64 and state.dtype == f64
    grads = loss_and_grads(o, state, leaves)

    o_ref, state_ref = model.fla(q, k, v, gates, init)
    grads_ref = loss_and_grads(o_ref.double(), state_ref.double(), leaves)

    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(state, state_ref, FLA_TOL, "final state")
    names = ["q", "k", "v", *(f"gates[{n!r}]" for n in gates), "initial_state"]
    for what, g, g_ref in zip(names, grads, grads_ref, strict=True):
        assert_rel_rms(g, g_ref, FLA_TOL, f"d/d{what}")


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_matches_paper_recurrence(name, backend):
    model = MODELS[name]
    rule = miras.compile(model.spec)
    q, k, v, gates, init, leaves = make_inputs(rule, seed=2, per_channel_lr=model.per_channel_lr)

    o, state = run_miras(rule, q, k, v, gates, init, BACKENDS[backend])
    grads = loss_and_grads(o, state, leaves)
    o_ref, state_ref = model.paper(q, k, v, gates, init)
    grads_ref = loss_and_grads(o_ref, state_ref, leaves)

    torch.testing.assert_close(o, o_ref, **EXACT)
    torch.testing.assert_close(state, state_ref, **EXACT)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, **EXACT)


@pytest.mark.slow  # 13 s and 24 s on 2 cores: the momentum recurrence with gradients
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_titans_momentum_matrix_matches_paper(backend):
    rule = miras.compile(TITANS_MATRIX)
    assert sorted(rule.gates) == ["decay", "lr", "momentum"]
    q, k, v, gates, init, leaves = make_inputs(rule, seed=3, momentum_state=True)

    o, state = run_miras(rule, q, k, v, gates, init, BACKENDS[backend])
    assert sorted(state) == ["S.W", "W"]
    grads = loss_and_grads(o, state, leaves)

    # The paper's surprise is minus miras's momentum state, both at the start and the end.
    o_ref, (m_ref, surprise_ref) = paper_titans(q, k, v, gates, (init["W"], -init["S.W"]))
    grads_ref = loss_and_grads(o_ref, {"W": m_ref, "S.W": -surprise_ref}, leaves)

    torch.testing.assert_close(o, o_ref, **EXACT)
    torch.testing.assert_close(state["W"], m_ref, **EXACT)
    torch.testing.assert_close(state["S.W"], -surprise_ref, **EXACT)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, **EXACT)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("name", ["linear_attention", "retnet"])
def test_hebbian_models_match_fla_at_any_chunk_size(name, chunk_size):
    """The dot-product bias's gradient -v k^T does not depend on the state, so the chunk-start
    semantics coincide with the recurrence: exact for every chunk size (T = 63 leaves a partial
    chunk). The delta-rule models at b > 1: tests/runtime/test_exact_fla.py."""
    model = MODELS[name]
    rule = miras.compile(model.spec)
    q, k, v, gates, init, leaves = make_inputs(rule, seed=4)
    o, state = run_miras(rule, q, k, v, gates, init, dict(backend="chunk", chunk_size=chunk_size))
    grads = loss_and_grads(o, state, leaves)
    o_ref, state_ref = model.fla(q, k, v, gates, init)
    grads_ref = loss_and_grads(o_ref.double(), state_ref.double(), leaves)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(state, state_ref, FLA_TOL, "final state")
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert_rel_rms(g, g_ref, FLA_TOL, "gradient")


# Nonparametric memory: softmax attention -------------------------------------------------------

T_ATT = 100


def attention_inputs(seed=5):
    gen = torch.Generator().manual_seed(seed)
    q = 0.3 * torch.randn(B, T_ATT, H, DK, generator=gen, dtype=f64)
    k = 0.3 * torch.randn(B, T_ATT, H, DK, generator=gen, dtype=f64)
    v = torch.randn(B, T_ATT, H, DV, generator=gen, dtype=f64)
    return [x.requires_grad_(True) for x in (q, k, v)]


def softmax_band(q, k, v, window: int | None):
    """softmax(q k^T + mask) v written out in float64, independent of the runtime (which calls
    SDPA): token t sees s with t - window < s <= t (all s <= t when window is None); the mask
    is 0 there and -inf elsewhere; scale 1.0, since miras applies no q scaling.
    [B, T, H, D] in and out."""
    t_len = q.shape[1]
    mask = torch.full((t_len, t_len), float("-inf"), dtype=f64)
    for t in range(t_len):
        first = 0 if window is None else max(0, t - window + 1)
        mask[t, first : t + 1] = 0.0
    scores = torch.einsum("bthd,bshd->bhts", q.double(), k.double()) + mask  # [B, H, T, T]
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bhts,bshd->bthd", weights, v.double())


def swa_spec(window: int) -> dict:
    return {
        "name": f"swa_{window}",
        "memory": {"kind": "nonparametric", "window": window},
        "bias": "l2",
    }


def assert_same_attention(rule, window):
    q, k, v = attention_inputs()
    o, state = rule(q, k, v, output_final_state=True)
    assert state is None
    o_ref = softmax_band(q, k, v, window)
    torch.testing.assert_close(o, o_ref, **EXACT)
    weight = torch.randn(o.shape, generator=torch.Generator().manual_seed(6), dtype=f64)
    grads = torch.autograd.grad((o * weight).sum(), [q, k, v])
    grads_ref = torch.autograd.grad((o_ref * weight).sum(), [q, k, v])
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, **EXACT)


def test_attention_equals_causal_softmax():
    assert_same_attention(miras.compile("specs/attention.yaml"), None)


@pytest.mark.parametrize("window", [1, 7, 37])
def test_sliding_window_equals_banded_softmax(window):
    assert_same_attention(miras.compile(swa_spec(window)), window)


@pytest.mark.parametrize("window", [T_ATT, T_ATT + 57])
def test_window_at_least_t_equals_full_causal(window):
    q, k, v = attention_inputs(seed=7)
    o_window, _ = miras.compile(swa_spec(window))(q, k, v)
    o_full, _ = miras.compile("specs/attention.yaml")(q, k, v)
    torch.testing.assert_close(o_window, o_full, **EXACT)
    assert_same_attention(miras.compile(swa_spec(window)), None)
