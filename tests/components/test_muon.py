"""Muon (components/optimizer/muon.py): the step size b_t (gate `lr`) scales the orthogonalized
update, u_t = b_t NewtonSchulz5(s_t) with s_t = theta_t s_{t-1} + g_t (ATLAS), so it is not
normalized away.

With retention none, W_t = W_{t-1} - u_t. Where every gradient is taken at the same state (one
token on the recurrence, one chunk of the chunk-start form), g_t and s_t do not depend on lr, so
doubling the lr gate, everything else fixed, doubles W_t - W_0 and the read's change, and leaves
the momentum state S unchanged."""

from __future__ import annotations

import pytest
import torch

import miras
from miras.components import Muon
from miras.components.optimizer.muon import newton_schulz
from tests.helpers import random_inputs

f64 = torch.float64
MEMORIES = {"matrix": "matrix", "mlp": {"kind": "mlp", "depth": 2, "expansion": 1}}


def muon_rule(memory):
    return miras.compile(
        {
            "name": "muon_none",
            "memory": memory,
            "bias": "l2",
            "retention": "none",
            "optimizer": "muon",
        }
    )


def test_update_scales_with_lr_after_orthogonalization():
    gen = torch.Generator().manual_seed(0)
    g, s0 = torch.randn(2, 5, 3, 4, generator=gen, dtype=f64).unbind(0)
    lr = torch.full((5, 1, 1), 0.2, dtype=f64)
    theta = torch.full((5, 1, 1), 0.7, dtype=f64)
    u1, s1 = Muon().update(g, s0, lr, theta)
    u2, s2 = Muon().update(g, s0, 2 * lr, theta)
    torch.testing.assert_close(s1, 0.7 * s0 + g, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s2, s1, rtol=0, atol=0)  # the momentum holds no step size
    torch.testing.assert_close(u2, 2 * u1, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(u1, 0.2 * newton_schulz(s1, 5), rtol=1e-12, atol=1e-12)
    # Each singular value of u_t is about b_t (Muon's quintic puts them in about [0.7, 1.2]).
    singular = torch.linalg.svdvals(u1) / 0.2
    assert singular.min() > 0.5 and singular.max() < 1.3


@pytest.mark.parametrize("memory", list(MEMORIES))
@pytest.mark.parametrize(
    "backend, t, options",
    [
        ("recurrent", 1, {}),  # one token: g_1 is taken at W_0
        ("chunk", 7, {"chunk_size": 8, "chunk_mode": "start"}),  # one chunk: every g_t at W_0
    ],
    ids=["recurrent", "chunk"],
)
def test_doubling_the_lr_gate_doubles_the_update(memory, backend, t, options):
    rule = muon_rule(MEMORIES[memory])
    q, k, v, gates = random_inputs(rule, t=t, dk=4, dv=4, seed=1)
    init = rule.initial_state(2, 2, 4, 4, dtype=f64)
    init = {n: (w if n.startswith("S.") else 0.3 * w) for n, w in init.items()}
    runs = []
    for scale in (1, 2, 3):
        scaled = {**gates, "lr": scale * gates["lr"]}
        o, final = rule(
            q, k, v, scaled, backend=backend, initial_state=init, output_final_state=True, **options
        )
        runs.append((o, final))
    (o1, s1), (o2, s2), (o3, _) = runs
    weights = [n for n in s1 if not n.startswith("S.")]
    for n in weights:
        step1, step2 = s1[n] - init[n], s2[n] - init[n]
        assert step1.abs().max() > 1e-3, f"{n}: the update is empty"
        torch.testing.assert_close(step2, 2 * step1, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(s2[f"S.{n}"], s1[f"S.{n}"], rtol=1e-12, atol=1e-12)
    if memory == "matrix":  # o_t = W_t q_t is linear in W: its change doubles too
        # o(b) = W_0 q + b c: o(3b) - o(b) = 2 (o(2b) - o(b))
        torch.testing.assert_close(o3 - o1, 2 * (o2 - o1), rtol=1e-9, atol=1e-12)


def test_lr_changes_the_state_of_a_nonlinear_rule():
    """lp bias and elastic-net retention over several chunks: a 100x smaller step size moves
    the memory less (the old order, NewtonSchulz5(theta s + lr g), gave the same state for
    every lr)."""
    rule = miras.compile(
        {
            "name": "muon_lp_elastic",
            "memory": "matrix",
            "bias": {"kind": "lp", "p": 1.5},
            "retention": "elastic_net",
            "optimizer": "muon",
        }
    )
    q, k, v, gates = random_inputs(rule, t=40, seed=2)
    init = rule.initial_state(2, 2, 4, 4, dtype=f64)
    moved = {}
    for lr in (0.01, 1.0):
        for backend in ("recurrent", "chunk"):
            _, final = rule(
                q, k, v, {**gates, "lr": lr}, backend=backend, chunk_size=8, initial_state=init,
                output_final_state=True,
            )  # fmt: skip
            moved[lr, backend] = torch.linalg.matrix_norm(final["W"] - init["W"]).max().item()
    for backend in ("recurrent", "chunk"):
        assert moved[0.01, backend] < 0.1 * moved[1.0, backend], moved
