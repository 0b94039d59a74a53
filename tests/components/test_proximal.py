"""The proximal optimizer (components/optimizer/proximal.py, Longhorn's implicit step): its
closed form against numerical minimizers and against fla's delta rule with the transformed
beta, the exact chunk form against the recurrence (forward, backward, carried state), the
refusals, `miras check`'s oracle, and a study that searches it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import miras
from miras.checks.end_to_end import proximal_update
from miras.components.optimizer.proximal import Proximal
from miras.errors import SpecError
from miras.spec import load_spec
from tests.helpers import tiny_mqar_losses
from tests.search_support import search_grid

ROOT = Path(__file__).resolve().parents[2]
LONGHORN = ROOT / "specs/longhorn.yaml"


def prox(**changes) -> dict:
    return {"name": "prox", "bias": "l2", "optimizer": "proximal", **changes}


# Not helpers.random_inputs: the keys are not normalized (the tests vary their norm by
# key_scale) and the learning rate reaches 3.
def inputs(b=2, t=37, h=3, dk=5, dv=7, *, key_scale=1.0, per_channel=False, seed=0):
    """q, k, v [B, T, H, D] float64, keys NOT normalized (||k|| ~ key_scale sqrt(dk)), and a
    learning rate in [0.1, 3] per head [B, T, H] or per channel [B, T, H, Dv]."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = randn(b, t, h, dk), key_scale * randn(b, t, h, dk), randn(b, t, h, dv)
    shape = (b, t, h, dv) if per_channel else (b, t, h)
    lr = 0.1 + 2.9 * torch.rand(*shape, generator=gen, dtype=torch.float64)
    return q, k, v, lr


def one_step(rule, w_e, k, v, lr):
    """W_t after one token from W_e: w_e [B, H, Dv, Dk]; k [B, H, Dk]; v [B, H, Dv]; lr [B, H]
    or [B, H, Dv]."""
    q = torch.zeros_like(k)
    gates = {"lr": lr.unsqueeze(1)}
    _, final = rule(
        q.unsqueeze(1),
        k.unsqueeze(1),
        v.unsqueeze(1),
        gates,
        backend="recurrent",
        initial_state=w_e,
        output_final_state=True,
    )
    return final


# --- the closed form --------------------------------------------------------------------------


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_the_l2_step_is_the_minimizer_of_the_proximal_objective(per_channel):
    """W_t = argmin_W 1/2 ||W k - v||^2 + ||W - W_e||^2 / (2 lr), solved as its normal
    equations with the full d x d matrix: W (k k^T + I / lr) = v k^T + W_e / lr (each row its
    own lr when per channel), at keys of every scale."""
    rule = miras.compile(prox())
    for key_scale in (0.1, 1.0, 30.0):
        _, k, v, lr = inputs(t=1, key_scale=key_scale, per_channel=per_channel)
        k, v, lr = k[:, 0], v[:, 0], lr[:, 0]  # [B, H, D]
        w_e = torch.randn(2, 3, 7, 5, generator=torch.Generator().manual_seed(1), dtype=k.dtype)
        rows = lr.unsqueeze(-1) if per_channel else lr[..., None, None].expand(2, 3, 7, 1)
        gram = k.unsqueeze(-1) * k.unsqueeze(-2)  # [B, H, Dk, Dk]
        eye = torch.eye(5, dtype=k.dtype)
        expected = torch.empty_like(w_e)
        for j in range(7):  # row j of W: w (k k^T + I / lr_j) = v_j k^T + w_e / lr_j
            r = rows[:, :, j]  # [B, H, 1]
            system = gram + eye / r.unsqueeze(-1)
            rhs = v[..., j : j + 1] * k + w_e[:, :, j] / r
            expected[:, :, j] = torch.linalg.solve(system, rhs.unsqueeze(-1)).squeeze(-1)
        got = one_step(rule, w_e, k, v, lr)
        # The solve's condition number is 1 + lr ||k||^2, up to ~1e4 at key_scale 30.
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "bias",
    ["l2", "dot", {"kind": "custom", "loss": "e**2 + 3*e*v"}],
    ids=["l2", "dot", "custom-quadratic"],
)
def test_the_step_equals_a_newton_argmin_on_the_printed_loss(bias):
    """Every bias the proximal step accepts, against `miras check`'s oracle (Newton on the
    autograd gradient and Hessian of the printed loss plus the proximity term)."""
    rule = miras.compile(prox(bias=bias))
    _, k, v, lr = inputs(t=1, key_scale=3.0)
    k, v, lr = k[:, 0], v[:, 0], lr[:, 0]
    w_e = torch.randn(2, 3, 7, 5, generator=torch.Generator().manual_seed(2), dtype=k.dtype)
    u = proximal_update(rule, {"W": w_e}, k, v, [], lr[..., None, None])
    torch.testing.assert_close(one_step(rule, w_e, k, v, lr), w_e - u["W"], rtol=1e-11, atol=1e-11)


def test_dot_bias_proximal_is_gd():
    """s = 0: the loss is linear in W, the proximity term alone curves the objective."""
    q, k, v, lr = inputs(key_scale=4.0)
    o_prox, s_prox = miras.compile(prox(bias="dot"))(q, k, v, {"lr": lr}, output_final_state=True)
    gd = {"name": "gd", "bias": "dot", "optimizer": "gd"}
    o_gd, s_gd = miras.compile(gd)(q, k, v, {"lr": lr}, output_final_state=True)
    torch.testing.assert_close(o_prox, o_gd, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s_prox, s_gd, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_longhorn_is_fla_delta_rule_with_the_transformed_beta(per_channel):
    """fla's naive delta rule (S [Dk, Dv], q scaled by Dk^-1/2 inside) with
    beta / (1 + beta ||k||^2), on keys that are not normalized."""
    from fla.ops.delta_rule.naive import delta_rule_recurrence

    q, k, v, lr = inputs(key_scale=2.0, per_channel=per_channel)
    b, _, h, dk = k.shape
    w0 = torch.randn(b, h, 7, dk, generator=torch.Generator().manual_seed(3), dtype=k.dtype)
    rule = miras.compile(LONGHORN)
    o, final = rule(q, k, v, {"lr": lr}, initial_state=w0, output_final_state=True)
    norm2 = (k * k).sum(-1)  # [B, T, H]
    beta = lr / (1 + lr * (norm2.unsqueeze(-1) if per_channel else norm2))

    def heads_first(x):
        return x.transpose(1, 2).float()

    o_fla, s_fla = delta_rule_recurrence(
        heads_first(q) * dk**0.5, heads_first(k), heads_first(v), heads_first(beta),
        initial_state=w0.mT.float(),
    )  # fmt: skip
    torch.testing.assert_close(o.float(), o_fla.transpose(1, 2), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final.float(), s_fla.mT, rtol=1e-4, atol=1e-4)


def test_a_large_key_never_overshoots_where_gd_does():
    """||k||^2 = 1e4, lr = 10: the proximal write shrinks the residual W k - v by
    1 / (1 + lr ||k||^2), keeping its sign; gd's factor 1 - lr ||k||^2 = -1e5 + 1 overshoots."""
    _, k, v, _ = inputs(t=1)
    k = 100 * torch.nn.functional.normalize(k[:, 0], dim=-1)
    v, lr = v[:, 0], torch.full((2, 3), 10.0, dtype=k.dtype)
    w_e = torch.zeros(2, 3, 7, 5, dtype=k.dtype)

    def residual(w):
        return (w @ k.unsqueeze(-1)).squeeze(-1) - v

    after = residual(one_step(miras.compile(prox()), w_e, k, v, lr))
    before = residual(w_e)
    torch.testing.assert_close(after, before / (1 + 10 * 1e4), rtol=1e-10, atol=1e-14)
    gd = miras.compile({"name": "gd", "bias": "l2", "optimizer": "gd"})
    overshoot = residual(one_step(gd, w_e, k, v, lr))
    assert float((overshoot.abs() / before.abs()).min()) > 1e4


# --- the chunk form ---------------------------------------------------------------------------

CHUNKED = {
    "l2": prox(),
    "l2-decay-retained": prox(retention={"kind": "l2", "grad_at": "retained"}),
    "l2-decay-state-fixed-lr": prox(retention="l2", optimizer={"kind": "proximal", "lr": 2.5}),
    "custom-quadratic": prox(bias={"kind": "custom", "loss": "e**2 + 3*e*v"}),
}


def run_with_grads(rule, q, k, v, gates, w0, **options):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *gates.values(), w0)]
    q_, k_, v_, *gate_leaves, w0_ = leaves
    named = dict(zip(gates, gate_leaves, strict=True))
    o, final = rule(q_, k_, v_, named, initial_state=w0_, output_final_state=True, **options)
    weights = torch.Generator().manual_seed(9)
    loss = (o * torch.randn(o.shape, generator=weights, dtype=o.dtype)).sum()
    loss = loss + (final * torch.randn(final.shape, generator=weights, dtype=o.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return o.detach(), final.detach(), grads


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
@pytest.mark.parametrize("name", list(CHUNKED))
def test_exact_chunks_equal_the_recurrence_forward_and_backward(name, per_channel):
    rule = miras.compile(CHUNKED[name])
    assert rule.plan.chunk_form.form == "exact"
    q, k, v, lr = inputs(key_scale=1.5, per_channel=per_channel)  # T = 37: chunks of 8 leave 5
    gates = {"lr": lr} if "lr" in rule.gates else {}
    if "decay" in rule.gates:
        gates["decay"] = 0.8 + 0.2 * torch.rand(lr.shape, dtype=lr.dtype)
    w0 = torch.randn(2, 3, 7, 5, generator=torch.Generator().manual_seed(4), dtype=q.dtype)
    reference = run_with_grads(rule, q, k, v, gates, w0, backend="recurrent")
    for chunk_size in (8, 16):
        got = run_with_grads(rule, q, k, v, gates, w0, backend="chunk", chunk_size=chunk_size)
        torch.testing.assert_close(got[0], reference[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[1], reference[1], rtol=1e-10, atol=1e-10)
        for g, r in zip(got[2], reference[2], strict=True):
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)


def test_a_carried_state_continues_the_sequence():
    rule = miras.compile(LONGHORN)
    q, k, v, lr = inputs(key_scale=1.5)
    whole, final = rule(q, k, v, {"lr": lr}, chunk_size=8, output_final_state=True)
    first, state = rule(
        q[:, :20], k[:, :20], v[:, :20], {"lr": lr[:, :20]}, chunk_size=8, output_final_state=True
    )
    second, end = rule(
        q[:, 20:], k[:, 20:], v[:, 20:], {"lr": lr[:, 20:]}, chunk_size=8,
        initial_state=state, output_final_state=True,
    )  # fmt: skip
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(end, final, rtol=1e-12, atol=1e-12)


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, field, words",
    [
        ({"memory": "mlp"}, "optimizer.kind", ["matrix memory only", "mlp memory", "Newton"]),
        ({"window": 2}, "window.c", ["c = 1", "c x c solve", "got c = 2"]),
        ({"bias": "huber"}, "optimizer.kind", ["affine in y", "huber bias", "Newton"]),
        ({"bias": {"kind": "lp", "p": 3}}, "optimizer.kind", ["affine in y", "lp bias"]),
        ({"bias": "robust"}, "optimizer.kind", ["constant slope", "robust bias"]),
        ({"bias": {"kind": "custom", "loss": "log(cosh(e))"}}, "optimizer.kind", ["affine"]),
        (
            {"bias": {"kind": "custom", "loss": "a*e**2", "params": {"a": "gate"}}},
            "optimizer.kind",
            ["not one number"],
        ),
    ],
    ids=["mlp", "window", "huber", "lp", "robust", "logcosh", "gated-slope"],
)
def test_what_has_no_closed_form_is_refused_with_the_reason(changes, field, words):
    with pytest.raises(SpecError) as info:
        load_spec(prox(**changes))
    problems = [p for p in info.value.problems if p.path == field]
    assert problems, info.value.problems
    assert all(w in problems[0].message for w in words), problems[0].message
    assert "proximal step" in problems[0].message


def test_the_learning_rate_field_is_validated():
    with pytest.raises(SpecError) as info:
        load_spec(prox(optimizer={"kind": "proximal", "lr": -1.0}))
    (problem,) = info.value.problems
    assert problem.path == "optimizer.lr" and "[0, inf)" in problem.message


# --- miras check ------------------------------------------------------------------------------


def test_miras_check_compares_the_step_with_a_numerical_argmin(monkeypatch):
    """The end-to-end check passes on Longhorn, and fails, naming the optimizer piece, when the
    step size is gd's lr instead of the proximal one (the oracle never reads the closed form)."""
    rule = miras.compile(LONGHORN)
    results = [r for r in rule.check(triton=False) if "end-to-end" in r.piece]
    assert results and all(r.passed for r in results) and "argmin" in results[0].piece
    monkeypatch.setattr(Proximal, "step_size", lambda self, lr, curvature: lr)
    broken = [r for r in rule.check(triton=False) if "end-to-end recurrent" in r.piece]
    assert not broken[0].passed and "optimizer at token 0" in broken[0].piece


# --- search -----------------------------------------------------------------------------------


def test_a_study_searches_the_optimizer_kind(tmp_path):
    """`optimizer.kind: {choices: [gd, proximal]}` through the search API: the grid trains one
    trial of each, and each trial's spec carries its kind."""
    trials = search_grid(
        tmp_path,
        {
            "memory": "matrix",
            "bias": "l2",
            "optimizer": {"kind": {"choices": ["gd", "proximal"]}},
            "model": {"d_model": 16, "n_layers": 1, "n_heads": 1},
        },
        trials=2,
    )
    kinds = sorted(load_spec(t.user_attrs["spec"]).optimizer.kind for t in trials)
    assert kinds == ["gd", "proximal"]
    for t in trials:
        assert math.isfinite(t.user_attrs["metrics"]["loss"])


# --- training ---------------------------------------------------------------------------------


def test_longhorn_trains_on_a_tiny_mqar():
    """A one-layer Longhorn model on MQAR at T = 32 (4 pairs): the loss falls in 40 steps."""
    first, last, final = tiny_mqar_losses(LONGHORN)
    assert math.isfinite(final) and last < first - 0.2, (first, last)


@pytest.mark.parametrize("gamma", ["gate", 0.25], ids=["gated", "fixed"])
def test_the_window_weight_scales_the_loss_inside_the_argmin(gamma):
    """c = 1 with gamma: argmin_W gamma/2 ||W k - v||^2 + ||W - W_e||^2 / (2 lr) is
    W_e - lr gamma / (1 + lr gamma ||k||^2) (W_e k - v) k^T: gamma enters the curvature too.
    Checked against the normal equations and against miras check's oracle."""
    rule = miras.compile(prox(window={"c": 1, "gamma": gamma}))
    _, k, v, lr = inputs(t=1, key_scale=2.0)
    g = 0.2 + 3 * torch.rand(lr.shape, generator=torch.Generator().manual_seed(8), dtype=lr.dtype)
    weight = g if gamma == "gate" else torch.full_like(lr, gamma)
    gates = {"lr": lr, **({"gamma": g} if gamma == "gate" else {})}
    w_e = torch.randn(2, 3, 7, 5, generator=torch.Generator().manual_seed(1), dtype=k.dtype)
    _, final = rule(torch.zeros_like(k), k, v, gates, backend="recurrent", initial_state=w_e,
                    output_final_state=True)  # fmt: skip
    k1, v1, lr1, w1 = k[:, 0], v[:, 0], lr[:, 0, ..., None, None], weight[:, 0, ..., None, None]
    system = w1 * k1.unsqueeze(-1) * k1.unsqueeze(-2) + torch.eye(5, dtype=k.dtype) / lr1
    rhs = w1 * v1.unsqueeze(-1) * k1.unsqueeze(-2) + w_e / lr1  # [B, H, Dv, Dk]
    expected = torch.linalg.solve(system, rhs.mT).mT  # W system = rhs (system symmetric)
    torch.testing.assert_close(final, expected, rtol=1e-10, atol=1e-10)
    assert all(r.passed for r in rule.check(triton=False) if "end-to-end" in r.piece)


# --- probes -----------------------------------------------------------------------------------


def test_a_large_step_recalls_orthogonal_pairs_as_the_projection_does():
    """The capacity probe: with orthogonal unit keys and lr = 1e6, the proximal step size is
    1e6 / (1 + 1e6): the delta rule's exact projection (step 1) to 1e-6."""
    from miras.probes import capacity

    small = {"d_k": 8, "trials": 4, "seeds": 2}
    result = capacity(str(LONGHORN), keys="orthogonal", pair_counts=[4, 8], gates={"lr": 1e6},
                      **small)  # fmt: skip
    assert all(p.mean < 1e-5 for p in result.points), [p.mean for p in result.points]
