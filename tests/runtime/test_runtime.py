"""Backends against each other and against a chunk-start loop written here, in float64.

- chunk with chunk size 1 equals recurrent (outputs, final state, gradients) to 1e-10;
- chunk with b = 16 equals `chunk_reference` below, a plain loop over the chunk-start semantics
  that takes every inner gradient with autograd (no explicit backward, no matmul form);
- running in two pieces with carried state equals one pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import miras
from tests.helpers import random_inputs

TOL = 1e-10

# A covering set: every bias, retention, optimizer, memory and feature map at least once,
# windows c in {1, 3}, per-head and per-channel gates.
COVER = {
    "linear_attention": dict(bias="dot", retention="none", optimizer={"kind": "gd", "lr": 1}),
    "deltanet_channel": dict(bias="l2", retention="none", optimizer="gd"),
    "gdn_retained": dict(bias="l2", retention={"kind": "l2", "grad_at": "retained"}),
    "huber_momentum": dict(bias="huber", retention="l2", optimizer="momentum"),
    "lp_lq": dict(bias={"kind": "lp", "p": 3}, retention={"kind": "lq", "q": 4}),
    "robust_elastic": dict(bias={"kind": "robust", "radius": "gate"}, retention="elastic_net"),
    "l2_kl": dict(bias="l2", retention="kl"),
    "l2_bregman": dict(bias="l2", retention="bregman"),
    "custom_muon": dict(
        bias={"kind": "custom", "loss": "log(cosh(e))"}, retention="l2", optimizer="muon"
    ),
    "poly_window3": dict(
        feature_map={"kind": "polynomial", "degree": 2},
        retention="l2",
        window={"c": 3, "gamma": "gate"},
    ),
    "taylor_dot": dict(feature_map="taylor", bias="dot", retention="l2"),
    "custom_map_window3": dict(
        feature_map={"kind": "custom", "formula": "x + x**3/6"}, window=3, retention="l2"
    ),
    "titans_mlp": dict(
        memory={"kind": "mlp", "depth": 2, "expansion": 2}, retention="l2", optimizer="momentum"
    ),
    "moneta_mlp": dict(
        memory={"kind": "mlp", "depth": 2, "expansion": 2, "residual_norm": True},
        bias={"kind": "lp", "p": 3},
        retention={"kind": "lq", "q": 4},
    ),
    "memora_mlp": dict(memory={"kind": "mlp", "depth": 1}, retention="kl"),
    "gated_mlp_huber": dict(
        memory={"kind": "gated_mlp", "expansion": 2}, bias="huber", retention="l2"
    ),
    "mlp_window3_muon": dict(
        memory={"kind": "mlp", "depth": 2, "expansion": 1},
        optimizer="muon",
        window=3,
        retention="l2",
    ),
}
PER_CHANNEL = {"deltanet_channel", "huber_momentum", "robust_elastic", "gdn_retained", "l2_kl"}


def compiled(name: str):
    return miras.compile({"name": name, **COVER[name]})


def _grad_inputs(rule, per_channel, seed=0, t=13):
    q, k, v, gates = random_inputs(rule, per_channel=per_channel, seed=seed, t=t)
    leaves = [q, k, v, *gates.values()]
    for x in leaves:
        x.requires_grad_(True)
    params = {
        n: p.clone().requires_grad_(True) for n, p in rule.default_params(torch.float64).items()
    }
    return q, k, v, gates, params


def _flat_state(state):
    return list(state.values()) if isinstance(state, dict) else [state]


def _run_with_grads(rule, backend, chunk_size, per_channel):
    q, k, v, gates, params = _grad_inputs(rule, per_channel)
    init = rule.initial_state(2, 2, 4, 4, torch.float64)
    init = (
        {n: s.clone().requires_grad_(True) for n, s in init.items()}
        if isinstance(init, dict)
        else init.clone().requires_grad_(True)
    )
    o, final = rule(
        q,
        k,
        v,
        gates,
        backend=backend,
        chunk_size=chunk_size,
        initial_state=init,
        output_final_state=True,
        params=params,
    )
    weight = torch.randn(o.shape, generator=torch.Generator().manual_seed(9), dtype=o.dtype)
    loss = (o * weight).sum() + sum(s.sum() for s in _flat_state(final))
    leaves = [q, k, v, *gates.values(), *_flat_state(init), *params.values()]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return o, _flat_state(final), grads


@pytest.mark.parametrize("name", sorted(COVER))
def test_chunk_size_one_equals_recurrent(name):
    rule = compiled(name)
    per_channel = name in PER_CHANNEL
    o_r, s_r, g_r = _run_with_grads(rule, "recurrent", 1, per_channel)
    o_c, s_c, g_c = _run_with_grads(rule, "chunk", 1, per_channel)
    torch.testing.assert_close(o_c, o_r, rtol=TOL, atol=TOL)
    for a, b in zip(s_c, s_r, strict=True):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
    for a, b in zip(g_c, g_r, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


# A separate implementation of the chunk-start semantics -------------------------------------

ACT = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "tanh": torch.tanh}


def memory_forward(spec, weights, x):
    """M_W(x) written plainly: weights [B, H, out, in], x [B, H, in]."""

    def mv(w, z):
        return torch.einsum("bhoi,bhi->bho", w, z)

    m = spec.memory
    if m.kind == "matrix":
        return mv(weights["W"], x)
    if m.kind == "gated_mlp":
        return mv(weights["W1"], ACT[m.activation](mv(weights["W2"], x)) * mv(weights["W3"], x))
    h = x
    names = list(weights)
    for i, n in enumerate(names):
        h = mv(weights[n], h)
        if i < len(names) - 1:
            h = ACT[m.activation](h)
    if m.residual_norm:
        h = x + F.layer_norm(h, h.shape[-1:], eps=1e-5)
    return h


def chunk_reference(rule, q, k, v, gates, chunk, params):
    spec = rule.spec
    fn = rule.functions
    rt = rule.runtime
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    gates = {n: (g if g.dim() == 4 else g.unsqueeze(-1)).transpose(1, 2) for n, g in gates.items()}
    phi_q, phi_k = rt.feature(q, params), rt.feature(k, params)
    b, h, t_len, _ = phi_k.shape
    state = rt.initial_state(b, h, phi_k.shape[-1], v.shape[-1], torch.float64, "cpu")
    names = rt.param_names

    def gate(component, name, t):
        value = getattr(component, name)
        return gates[name][:, :, t] if value == "gate" else torch.tensor(value, dtype=torch.float64)

    outputs = []
    for start in range(0, t_len, chunk):
        chunk_start = {n: fn.retention_read(state[n]) for n in names}
        decay = 1.0
        for t in range(start, min(start + chunk, t_len)):
            if getattr(spec.retention, "grad_at", "state") == "retained":
                decay = decay * gate(spec.retention, "decay", t)
            w_e = {
                n: (decay.unsqueeze(-1) if torch.is_tensor(decay) else decay) * w
                for n, w in chunk_start.items()
            }
            leaves = {n: w.detach().requires_grad_(True) for n, w in w_e.items()}
            loss = 0
            for i in range(max(0, t - spec.window.c + 1), t + 1):
                y = memory_forward(spec, leaves, phi_k[:, :, i])
                args = [gates[n][:, :, i] for n in spec.bias.gates()]
                weight = gate(spec.window, "gamma", i)
                loss = loss + (weight * fn.bias_loss(y, v[:, :, i], *args)).sum()
            grads = dict(zip(names, torch.autograd.grad(loss, list(leaves.values())), strict=True))
            lr = gate(spec.optimizer, "lr", t).unsqueeze(-1)
            ret_args = [gates[n][:, :, t].unsqueeze(-1) for n in spec.retention.gates()]
            for n in names:
                muon = spec.optimizer.kind == "muon"
                u = grads[n] if muon else lr * grads[n]  # muon's lr scales NS5(S_t) instead
                if spec.optimizer.kind != "gd":
                    theta = gate(spec.optimizer, "momentum", t).unsqueeze(-1)
                    u = theta * state[f"S.{n}"] + u
                    state[f"S.{n}"] = u
                    if muon:
                        from miras.components.optimizer.muon import newton_schulz

                        u = lr * newton_schulz(u, spec.optimizer.ns_steps)
                state[n] = fn.retention_step(state[n], u, *ret_args)
            read = {n: fn.retention_read(state[n]) for n in names}
            outputs.append(memory_forward(spec, read, phi_q[:, :, t]))
    return torch.stack(outputs, dim=1), state


@pytest.mark.parametrize("t_len", [63, 100])
@pytest.mark.parametrize(
    "name",
    [
        "deltanet_channel",
        "gdn_retained",
        "huber_momentum",
        "lp_lq",
        "l2_kl",
        "poly_window3",
        "titans_mlp",
        "moneta_mlp",
        "gated_mlp_huber",
        "custom_muon",
    ],
)
def test_chunk_matches_chunk_start_loop(name, t_len):
    rule = compiled(name)
    q, k, v, gates = random_inputs(rule, t=t_len, b=1, per_channel=name in PER_CHANNEL, seed=3)
    params = rule.default_params(torch.float64)
    o, state = rule(
        q, k, v, gates, backend="chunk", chunk_size=16, chunk_mode="start", output_final_state=True
    )
    o_ref, state_ref = chunk_reference(rule, q, k, v, gates, 16, params)
    torch.testing.assert_close(o, o_ref, rtol=1e-9, atol=1e-9)
    state = state if isinstance(state, dict) else {"W": state}
    for name, expected in state_ref.items():
        torch.testing.assert_close(state[name], expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend,split", [("recurrent", 7), ("chunk", 32)])
@pytest.mark.parametrize(
    "name", ["gdn_retained", "huber_momentum", "l2_kl", "titans_mlp", "poly_window3", "lp_lq"]
)
def test_two_pieces_equal_one_pass(name, backend, split):
    """The state carries the memory, the momentum and, for a window c > 1, the last c - 1
    tokens' keys, values and window gates."""
    rule = compiled(name)
    q, k, v, gates = random_inputs(rule, t=50, b=1, seed=4)
    full, s_full = rule(q, k, v, gates, backend=backend, chunk_size=16, output_final_state=True)
    first = {n: g[:, :split] for n, g in gates.items()}
    rest = {n: g[:, split:] for n, g in gates.items()}
    o1, s1 = rule(
        q[:, :split],
        k[:, :split],
        v[:, :split],
        first,
        backend=backend,
        chunk_size=16,
        output_final_state=True,
    )
    o2, s2 = rule(
        q[:, split:],
        k[:, split:],
        v[:, split:],
        rest,
        backend=backend,
        chunk_size=16,
        initial_state=s1,
        output_final_state=True,
    )
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), full, rtol=TOL, atol=TOL)
    for a, b in zip(_flat_state(s2), _flat_state(s_full), strict=True):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
