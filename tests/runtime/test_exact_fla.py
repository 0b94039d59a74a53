"""The exact chunk form at chunk 64 against fla's references (issue 12): DeltaNet and Gated
DeltaNet against fla's naive recurrences (outputs, final state, gradients), and the momentum
delta rule against fla's `recurrent_momentum_delta_rule_ref` and `chunk_momentum_delta_rule_ref`.
fla's chunked forms of DeltaNet and Gated DeltaNet are tests/runtime/test_exact_chunk.py.

fla computes in float32 whatever the input dtype, so the inputs are float32-representable
float64 tensors, miras runs in float64, and the tolerance is a relative RMS of 1e-5
(tests/runtime/test_known_models.py). T = 100 at chunk 64: a full chunk and a partial one.

The momentum delta rule in fla (state S [Dk, Dv], p the key that predicts):
    M_t = mu_t M_{t-1} + eta_t k_t (p_t^T S_{t-1} - v_t),   S_t = alpha_t S_{t-1} - beta_t M_t.
miras (matrix memory, l2 bias, l2 retention with the gradient at the state, momentum):
    s_t = theta_t s_{t-1} + lr_t (W_{t-1} k_t - v_t) k_t^T,   W_t = a_t W_{t-1} - s_t.
With p = k, W = S^T and s_t = beta_t M_t^T the two agree for a = alpha, lr = beta eta and
theta_t = mu_t beta_t / beta_{t-1} (beta_{-1} = beta_0: the initial s is beta_0 M_0^T).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import miras
from tests.runtime.test_known_models import (
    FLA_TOL,
    assert_rel_rms,
    f32_exact,
    fla_deltanet,
    fla_gated_deltanet,
    fla_naive,
    loss_and_grads,
)

f64 = torch.float64
B, T, H, DK, DV = 2, 100, 2, 12, 7  # Dk != Dv so a transposed state cannot pass
CHUNK = dict(backend="chunk", chunk_size=64, chunk_mode="exact")

MOMENTUM_DELTA_RULE = "specs/momentum_delta_rule.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")


def uniform(gen, lo, hi, *shape):
    return f32_exact(lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=f64))


def qkv(gen):
    """q, k unit rows [B, T, H, Dk], v ~ N(0, 1) [B, T, H, Dv]."""
    q, k = (
        f32_exact(F.normalize(torch.randn(B, T, H, DK, generator=gen, dtype=f64), dim=-1))
        for _ in "qk"
    )
    return q, k, f32_exact(torch.randn(B, T, H, DV, generator=gen, dtype=f64))


@pytest.mark.parametrize(
    ("spec", "fla"),
    [("deltanet", fla_deltanet), ("gated_deltanet", fla_gated_deltanet)],
)
def test_delta_rules_at_chunk_64_match_fla_recurrence(spec, fla):
    rule = miras.compile(f"specs/{spec}.yaml")
    gen = torch.Generator().manual_seed(5)
    q, k, v = qkv(gen)
    ranges = {"lr": (0.1, 0.9), "decay": (0.8, 1.0)}
    gates = {n: uniform(gen, *ranges[n], B, T, H) for n in rule.gates}
    w0 = f32_exact(0.1 * torch.randn(B, H, DV, DK, generator=gen, dtype=f64))
    leaves = [q, k, v, *gates.values(), w0]
    for x in leaves:
        x.requires_grad_(True)

    o, state = rule(q, k, v, gates, initial_state=w0, output_final_state=True, **CHUNK)
    o_ref, state_ref = fla(q, k, v, gates, w0)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(state, state_ref, FLA_TOL, "final state")
    grads = loss_and_grads(o, state, leaves)
    grads_ref = loss_and_grads(o_ref.double(), state_ref.double(), leaves)
    for what, g, g_ref in zip(["q", "k", "v", *gates, "W0"], grads, grads_ref, strict=True):
        assert_rel_rms(g, g_ref, FLA_TOL, f"d/d{what}")


def momentum_inputs(seed: int):
    """fla's gates in ranges where its float32 chunk reference is accurate: its masks divide by
    prod mu (exp of minus a cumulative log), which at mu in [0.3, 0.8] loses 1e-2 relative by
    the 32nd token of a chunk; at mu >= 0.9 it agrees with fla's recurrence to 6e-6."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = qkv(gen)
    fla_gates = dict(
        alpha=uniform(gen, 0.8, 1.0, B, T, H),
        mu=uniform(gen, 0.9, 0.94, B, T, H),
        beta=uniform(gen, 0.95, 1.0, B, T, H),  # theta = mu beta_t / beta_{t-1} < 1
        eta=uniform(gen, 0.1, 0.5, B, T, H),
    )
    s0, m0 = (f32_exact(0.1 * torch.randn(B, H, DK, DV, generator=gen, dtype=f64)) for _ in "sm")
    return q, k, v, fla_gates, s0, m0


def as_miras(fla_gates, s0, m0):
    """fla's momentum delta rule gates and states -> miras's (the module docstring)."""
    beta = fla_gates["beta"]
    beta_prev = torch.cat([beta[:, :1], beta[:, :-1]], dim=1)
    gates = {
        "decay": fla_gates["alpha"],
        "lr": beta * fla_gates["eta"],
        "momentum": fla_gates["mu"] * beta / beta_prev,
    }
    init = {"W": s0.mT, "S.W": beta[:, 0, :, None, None] * m0.mT}
    return gates, init


@pytest.mark.parametrize("reference", ["recurrent", "chunk"])
def test_momentum_delta_rule_at_chunk_64_matches_fla(reference):
    rule = miras.compile(MOMENTUM_DELTA_RULE)
    assert rule.plan.chunk_form.form == "exact"
    q, k, v, fla_gates, s0, m0 = momentum_inputs(seed=6)
    gates, init = as_miras(fla_gates, s0, m0)
    o, state = rule(q, k, v, gates, initial_state=init, output_final_state=True, **CHUNK)

    log_alpha, log_mu = fla_gates["alpha"].log(), fla_gates["mu"].log()
    beta, eta = fla_gates["beta"], fla_gates["eta"]
    states = dict(scale=1.0, initial_S=s0, initial_M=m0, output_final_state=True)
    if reference == "recurrent":
        fn = fla_naive("momentum_delta_rule", "recurrent_momentum_delta_rule_ref")
        o_ref, (s_ref, m_ref) = fn(q, k, v, log_alpha, log_mu, k, beta, eta, **states)
    else:  # p comes before the gates here; chunk 64
        fn = fla_naive("momentum_delta_rule", "chunk_momentum_delta_rule_ref")
        o_ref, (s_ref, m_ref) = fn(q, k, v, k, log_alpha, log_mu, beta, eta, **states)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(state["W"], s_ref.mT, FLA_TOL, "W")
    assert_rel_rms(state["S.W"], beta[:, -1, :, None, None] * m_ref.mT, FLA_TOL, "S.W")


def test_momentum_delta_rule_gradients_match_fla_recurrence():
    """Gradients through the mapping of the gates, w.r.t. q, k, v, fla's gates and states."""
    rule = miras.compile(MOMENTUM_DELTA_RULE)
    q, k, v, fla_gates, s0, m0 = momentum_inputs(seed=7)
    leaves = [q, k, v, *fla_gates.values(), s0, m0]
    for x in leaves:
        x.requires_grad_(True)
    gates, init = as_miras(fla_gates, s0, m0)
    o, state = rule(q, k, v, gates, initial_state=init, output_final_state=True, **CHUNK)
    beta_end = fla_gates["beta"][:, -1, :, None, None]
    grads = loss_and_grads(o, {"W": state["W"], "S.W": state["S.W"] / beta_end}, leaves)

    fn = fla_naive("momentum_delta_rule", "recurrent_momentum_delta_rule_ref")
    o_ref, (s_ref, m_ref) = fn(
        q, k, v, fla_gates["alpha"].log(), fla_gates["mu"].log(), k, fla_gates["beta"],
        fla_gates["eta"], scale=1.0, initial_S=s0, initial_M=m0, output_final_state=True,
    )  # fmt: skip
    state_ref = {"W": s_ref.mT.double(), "S.W": m_ref.mT.double()}
    grads_ref = loss_and_grads(o_ref.double(), state_ref, leaves)
    names = ["q", "k", "v", *fla_gates, "S0", "M0"]
    for what, g, g_ref in zip(names, grads, grads_ref, strict=True):
        assert_rel_rms(g, g_ref, FLA_TOL, f"d/d{what}")
