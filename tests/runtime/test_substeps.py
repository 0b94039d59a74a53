"""Several optimizer steps per token (`optimizer: {kind: gd, steps: n}`, miras.runtime.substeps).

- Same key, n steps: equal to the n-fold composition of the one-step rule (the one-step spec
  run on each token repeated n times, its decay at the first copy only and its read at the
  last), and to a hand-written autograd loop; on the recurrent backend and every chunk form
  (exact at chunk sizes that end inside a token, chunk-start and dual at chunk size 1), forward
  and gradients.
- n keys and values per token (`keys: per_step`, DeltaProduct): the same against an autograd
  loop over each token's own keys, values and learning rates (float64, tight), for gd and for
  momentum (its state advancing at every step); packed sequences equal each sequence alone.
- The boundary: packed inputs of the wrong length are refused naming n and T*n; a one-step
  spec's long form (and digest) has no `steps`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import miras
from miras.spec import load_spec

B, T, H, D = 2, 11, 2, 4
EXACT = dict(rtol=1e-10, atol=1e-10)
f64 = torch.float64

GATED_DELTA = {
    "memory": "matrix",
    "bias": "l2",
    "retention": {"kind": "l2", "grad_at": "retained"},
}


def spec(n: int, keys: str = "same", **over) -> dict:
    return {"name": f"steps_{n}_{keys}", **GATED_DELTA, **over,
            "optimizer": {"kind": "gd", "steps": n, "keys": keys}}  # fmt: skip


def leaves(n: int, *, per_step: bool, seed: int = 0, batch: int = B):
    """q [B, T, H, D]; k, v [B, T(*n), H, D]; lr [B, T(*n), H]; decay [B, T, H]; W0."""
    gen = torch.Generator().manual_seed(seed)
    m = T * n if per_step else T
    q = F.normalize(torch.randn(batch, T, H, D, generator=gen, dtype=f64), dim=-1)
    k = F.normalize(torch.randn(batch, m, H, D, generator=gen, dtype=f64), dim=-1)
    v = torch.randn(batch, m, H, D, generator=gen, dtype=f64)
    lr = 0.1 + 0.8 * torch.rand(batch, m, H, generator=gen, dtype=f64)
    decay = 0.6 + 0.4 * torch.rand(batch, T, H, generator=gen, dtype=f64)
    w0 = 0.3 * torch.randn(batch, H, D, D, generator=gen, dtype=f64)
    return [x.requires_grad_(True) for x in (q, k, v, lr, decay, w0)]


def autograd_loop(
    q, k, v, lr, decay, w0, n: int, per_step: bool, gated: bool = True, momentum=None
):
    """The n steps written out: W <- a_t W; for j < n, W <- W - lr_j grad_W 1/2 ||W k_j -
    v_j||^2 by autograd (k_j = k_t for the same key); o_t = W q_t. [B, T, H, .] -> o. With
    `momentum` theta [B, T, H] (momentum's state starts at 0 and advances at every step):
    s <- theta_t s + lr_j grad, W <- W - s."""
    w, out, s = w0, [], 0.0
    for t in range(T):
        if gated:
            w = decay[:, t, :, None, None] * w
        for j in range(n):
            i = t * n + j if per_step else t
            point = w if w.requires_grad else w.requires_grad_(True)
            loss = 0.5 * ((point @ k[:, i, :, :, None]).squeeze(-1) - v[:, i]).pow(2).sum()
            (grad,) = torch.autograd.grad(loss, point, create_graph=True)
            step = lr[:, i, :, None, None] * grad
            if momentum is not None:
                step = s = momentum[:, t, :, None, None] * s + step
            w = w - step
        out.append((w @ q[:, t, :, :, None]).squeeze(-1))
    return torch.stack(out, dim=1), w


def grads(outputs, inputs, seed=5):
    gen = torch.Generator().manual_seed(seed)
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=f64)).sum() for x in outputs)
    return torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)


def assert_same(ours, theirs, inputs, names):
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **EXACT)
    for a, b, name in zip(grads(ours, inputs), grads(theirs, inputs), names, strict=True):
        torch.testing.assert_close(a, b, **EXACT, msg=lambda m, name=name: f"{name}: {m}")


NAMES = ["dq", "dk", "dv", "dlr", "ddecay", "dW0"]
# (backend, chunk_size, chunk_mode): the exact form at chunk sizes that end inside a token.
EXACT_RUNS = [("recurrent", 1, "auto"), ("chunk", 5, "exact"), ("chunk", 64, "exact")]


@pytest.mark.parametrize("backend, chunk, mode", EXACT_RUNS, ids=lambda x: str(x))
@pytest.mark.parametrize("n", [2, 3])
def test_same_key_steps_equal_the_n_fold_composition(n, backend, chunk, mode):
    q, k, v, lr, decay, w0 = inputs = leaves(n, per_step=False, seed=n)
    run = dict(backend=backend, chunk_size=chunk, chunk_mode=mode, output_final_state=True)
    o, w = miras.compile(spec(n))(q, k, v, {"lr": lr, "decay": decay}, initial_state=w0, **run)
    # The one-step rule on each token repeated n times: decay at the first copy, 1 after it;
    # the read q at the last copy (zeros before, their outputs dropped).
    one = miras.compile(spec(1))
    first = torch.zeros(n, dtype=f64).index_fill(0, torch.tensor(0), 1.0)
    ones = 1 - first

    def rep(x):
        return x.repeat_interleave(n, dim=1)

    decays = (decay[:, :, None] * first[:, None] + ones[:, None]).flatten(1, 2)
    reads = (q[:, :, None] * first.flip(0)[:, None, None]).flatten(1, 2)
    o1, w1 = one(
        reads, rep(k), rep(v), {"lr": rep(lr), "decay": decays}, initial_state=w0,
        backend="recurrent", output_final_state=True,
    )  # fmt: skip
    assert_same([o, w], [o1[:, n - 1 :: n], w1], inputs, NAMES)
    o2, w2 = autograd_loop(q, k, v, lr, decay, w0, n, False)
    assert_same([o, w], [o2, w2], inputs, NAMES)


@pytest.mark.parametrize("backend, chunk, mode", EXACT_RUNS, ids=lambda x: str(x))
@pytest.mark.parametrize("n", [2, 3])
def test_per_step_keys_equal_the_autograd_loop(n, backend, chunk, mode):
    q, k, v, lr, decay, w0 = inputs = leaves(n, per_step=True, seed=10 + n)
    run = dict(backend=backend, chunk_size=chunk, chunk_mode=mode, output_final_state=True)
    rule = miras.compile(spec(n, "per_step"))
    o, w = rule(q, k, v, {"lr": lr, "decay": decay}, initial_state=w0, **run)
    assert o.shape == (B, T, H, D)
    assert_same([o, w], list(autograd_loop(q, k, v, lr, decay, w0, n, True)), inputs, NAMES)


@pytest.mark.parametrize("backend, chunk, mode", EXACT_RUNS, ids=lambda x: str(x))
def test_momentum_takes_its_steps_with_its_state(backend, chunk, mode):
    """optimizer: {kind: momentum, steps: 2, keys: per_step}: the surprise decays and grows at
    every step; the exact chunk form covers it as for gd."""
    n = 2
    q, k, v, lr, decay, w0 = inputs = leaves(n, per_step=True, seed=21)
    theta = 0.9 * torch.rand(B, T, H, generator=torch.Generator().manual_seed(2), dtype=f64)
    theta.requires_grad_(True)
    opt = {"kind": "momentum", "steps": n, "keys": "per_step"}
    rule = miras.compile(spec(n) | {"name": "momentum_steps", "optimizer": opt})
    assert rule.plan.chunk_form.form == "exact"
    gates = {"lr": lr, "momentum": theta, "decay": decay}
    state = {"W": w0, "S.W": torch.zeros_like(w0)}
    run = dict(backend=backend, chunk_size=chunk, chunk_mode=mode, output_final_state=True)
    o, final = rule(q, k, v, gates, initial_state=state, **run)
    o_ref, w_ref = autograd_loop(q, k, v, lr, decay, w0, n, True, momentum=theta)
    assert_same([o, final["W"]], [o_ref, w_ref], [*inputs, theta], [*NAMES, "dtheta"])


def test_no_decay_and_a_fixed_learning_rate():
    """Retention none (DeltaProduct without a gate) and a fixed lr: the constant repeats."""
    n = 2
    q, k, v, _, decay, w0 = leaves(n, per_step=True, seed=3)
    rule = miras.compile(spec(n, "per_step", retention="none") | {"optimizer": {
        "kind": "gd", "steps": n, "keys": "per_step", "lr": 0.5}})  # fmt: skip
    o, w = rule(q, k, v, {}, initial_state=w0, chunk_size=3, output_final_state=True)
    lr = torch.full((B, T * n, H), 0.5, dtype=f64)
    o_ref, w_ref = autograd_loop(q, k, v, lr, decay, w0, n, True, gated=False)
    torch.testing.assert_close(o, o_ref, **EXACT)
    torch.testing.assert_close(w, w_ref, **EXACT)


@pytest.mark.parametrize(
    "extra",
    [
        {"bias": {"kind": "huber", "delta": 0.5}},  # chunk-start form
        {"memory": {"kind": "mlp", "depth": 2, "expansion": 2}},  # dual form
    ],
    ids=["huber-start", "mlp-dual"],
)
def test_chunk_size_one_is_the_recurrence_in_the_start_forms(extra):
    """chunk_size counts steps: at 1 the chunk-start and dual forms take every gradient at
    its own state, as the recurrence does, n per token."""
    n = 2
    rule = miras.compile(spec(n) | extra)
    q, k, v, lr, decay, _ = leaves(n, per_step=False, seed=4)
    gates = {"lr": lr, "decay": decay}
    ref = rule(q, k, v, gates, backend="recurrent")[0]
    o = rule(q, k, v, gates, backend="chunk", chunk_size=1, chunk_mode="auto")[0]
    torch.testing.assert_close(o, ref, **EXACT)
    assert rule.plan.chunk_form.form != "exact"


def test_packed_sequences_equal_each_sequence_alone():
    n = 3
    rule = miras.compile(spec(n, "per_step"))
    q, k, v, lr, decay, _ = leaves(n, per_step=True, seed=6, batch=1)
    w0 = 0.3 * torch.randn(2, H, D, D, dtype=f64)
    bounds = [0, 4, T]
    gates = {"lr": lr, "decay": decay}
    o, w = rule(q, k, v, gates, cu_seqlens=torch.tensor(bounds), initial_state=w0,
                chunk_size=4, output_final_state=True)  # fmt: skip
    for i in range(2):
        a, b = bounds[i], bounds[i + 1]
        alone = {"lr": lr[:, a * n : b * n], "decay": decay[:, a:b]}
        o_i, w_i = rule(q[:, a:b], k[:, a * n : b * n], v[:, a * n : b * n], alone,
                        initial_state=w0[i : i + 1], chunk_size=4, output_final_state=True)  # fmt: skip
        torch.testing.assert_close(o[:, a:b], o_i, **EXACT)
        torch.testing.assert_close(w[i : i + 1], w_i, **EXACT)


def _call(rule_spec, n, **change):
    q, k, v, lr, decay, _ = leaves(n, per_step=True, seed=7)
    args = {"q": q, "k": k, "v": v, "gates": {"lr": lr, "decay": decay}, **change}
    rule = miras.compile(rule_spec)
    return lambda: rule(args["q"], args["k"], args["v"], args["gates"],
                        cu_seqlens=args.get("cu_seqlens"))  # fmt: skip


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(k=torch.zeros(B, T, H, D, dtype=f64)),
         ["k:", "spec 'steps_2_per_step'", "n = 2 per token", "T*n = 22", "T = 11", "[2, 11, 2, 4]"]),
        (dict(v=torch.zeros(B, 3 * T, H, D, dtype=f64)), ["v:", "T*n = 22", "[2, 33, 2, 4]"]),
        (dict(gates={"lr": torch.rand(B, T, H, dtype=f64), "decay": torch.rand(B, T, H, dtype=f64)}),
         ["gates['lr']:", "[B, T*n, H]", "T*n = 22", "[2, 11, 2]"]),
        (dict(gates={"lr": torch.rand(B, 2 * T, H, dtype=f64),
                     "decay": torch.rand(B, 2 * T, H, dtype=f64)}),
         ["gates['decay']:", "one per token", "T = 11", "only k, lr, v carry one per step"]),
        (dict(q=torch.zeros(B, T, H, dtype=f64)), ["q:", "4 axes"]),
        (dict(cu_seqlens=torch.tensor([0, 5, T])), ["cu_seqlens:", "B = 1"]),
    ],
    ids=["k-unpacked", "v-three-per-token", "lr-per-token", "decay-per-step", "q-3d", "cu-batch"],
)  # fmt: skip
def test_inputs_of_the_wrong_length_are_refused_naming_n(change, words):
    with pytest.raises(ValueError) as err:
        _call(spec(2, "per_step"), 2, **change)()
    for word in words:
        assert word in str(err.value), (word, str(err.value))


@pytest.mark.parametrize("keys", ["same", "per_step"])
def test_bad_values_are_named_at_the_callers_token(keys):
    """A per-token gate out of range, or a non-finite q or same-key k, is named at its token
    as given (the expanded run would see token t as step t*n + j)."""
    n, per_step = 3, keys == "per_step"
    rule = miras.compile(spec(n, keys))
    q, k, v, lr, decay, _ = (x.detach() for x in leaves(n, per_step=per_step, seed=9))
    bad_decay = decay.clone()
    bad_decay[1, 4, 0] = 1.5
    with pytest.raises(ValueError, match=r"gates\['decay'\].*found 1.5 at token 4 \(batch row 1"):
        rule(q, k, v, {"lr": lr, "decay": bad_decay})
    bad_q = q.clone()
    bad_q[0, 5, 1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"q: found the non-finite value nan at token 5"):
        rule(bad_q, k, v, {"lr": lr, "decay": decay})
    if not per_step:
        bad_k = k.clone()
        bad_k[0, 2, 0, 0] = float("inf")
        with pytest.raises(ValueError, match=r"k: found the non-finite value inf at token 2"):
            rule(q, bad_k, v, {"lr": lr, "decay": decay})


def test_same_key_steps_take_one_key_per_token():
    n = 2
    q, k, v, lr, decay, _ = leaves(n, per_step=True, seed=8)  # k, v packed: wrong here
    with pytest.raises(ValueError, match=r"k: one per token, \[B, T, H, D\] with T = 11"):
        miras.compile(spec(n))(q, k, v, {"lr": lr[:, :T], "decay": decay})


def test_a_one_step_spec_keeps_its_long_form_and_digest():
    plain = load_spec({"name": "x", **GATED_DELTA, "optimizer": "gd"})
    explicit = load_spec(spec(1) | {"name": "x"})
    assert "steps" not in plain.normalized()["optimizer"]
    assert plain.digest() == explicit.digest()
    two = load_spec(spec(2) | {"name": "x"})
    assert two.normalized()["optimizer"] == {"kind": "gd", "lr": "gate", "steps": 2, "keys": "same"}
    assert two.digest() != plain.digest()
    assert load_spec(two.to_yaml()) == two
