"""fla-core 0.6's newer delta-family recurrences as shipped specs (issue 39), each against fla's
pure-torch reference: forward, final state and every gradient.

- `kda` (specs/kda.yaml): Kimi Delta Attention, Gated DeltaNet with one decay per key channel,
  against `naive_recurrent_kda` (`fla/ops/kda/naive.py`). fla's state is S [K, V] and
  `S = S * exp(g)[:, None]` scales its key rows; miras's W = S^T [V, K] has the decay per
  column: `retention: {kind: l2, decay_channels: key}`. The decay per key channel runs on the
  recurrent backend; the chunked forms and Triton refuse it, naming the gate.
- `momentum_delta_rule` (specs/momentum_delta_rule.yaml) against
  `recurrent_momentum_delta_rule_ref` on the recurrent backend and packed sequences (the
  chunk form at 64 and the parameterization: tests/runtime/test_exact_fla.py).
- `titans_linear` (specs/titans_linear.yaml, `ops.chunk_titans_linear`): fla's step is not the
  gradient of its loss, so the op is held to an oracle written here (fla's recurrence with
  each gradient by autograd) and to `chunk_titans_linear_ref` where fla's LayerNorm backward
  is exact; the distance elsewhere is measured (docs/ops.md, "Titans-linear").

fla computes in float32 whatever the input dtype, so the inputs are float32-representable
float64 tensors, miras runs in float64 and the tolerance is a relative RMS of 1e-5
(tests/runtime/test_known_models.py). T = 70: a full chunk of 64 and a partial one.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import miras
from miras import ops
from tests.runtime.test_exact_fla import as_miras, momentum_inputs
from tests.runtime.test_known_models import (
    FLA_TOL,
    assert_rel_rms,
    f32_exact,
    fla_naive,
    loss_and_grads,
    rel_rms,
)

f64 = torch.float64
B, T, H, DK, DV = 2, 70, 2, 16, 24  # Dk != Dv so a transposed state cannot pass
KDA = "specs/kda.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")


def kda_inputs(seed: int, batch: int = B, per_key: bool = True):
    """q, k unit rows [B, T, H, Dk], v ~ N(0, 1), log-decays g in [-0.3, 0] per key channel
    [B, T, H, Dk] (or per head), beta in [0.1, 0.9], a non-zero initial state [B, H, Dk, Dv]
    (fla's layout); all leaves require grad."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (
        f32_exact(F.normalize(torch.randn(batch, T, H, DK, generator=gen, dtype=f64), dim=-1))
        for _ in "qk"
    )
    v = f32_exact(torch.randn(batch, T, H, DV, generator=gen, dtype=f64))
    g_shape = (batch, T, H, DK) if per_key else (batch, T, H)
    g = f32_exact(-0.3 * torch.rand(*g_shape, generator=gen, dtype=f64))
    beta = f32_exact(0.1 + 0.8 * torch.rand(batch, T, H, generator=gen, dtype=f64))
    s0 = f32_exact(0.1 * torch.randn(batch, H, DK, DV, generator=gen, dtype=f64))
    leaves = [q, k, v, g, beta, s0]
    for x in leaves:
        x.requires_grad_(True)
    return leaves


def fla_kda(q, k, v, g, beta, s0):
    """fla's naive recurrent KDA, g per key channel (a per-head g broadcast over K)."""
    if g.dim() == 3:
        g = g[..., None].expand(*g.shape, q.shape[-1])
    return fla_naive("kda", "naive_recurrent_kda")(
        q, k, v, g, beta, scale=1.0, initial_state=s0, output_final_state=True
    )


def assert_all_close(o, state, o_ref, state_ref, leaves, names):
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(state, state_ref, FLA_TOL, "final state")
    grads = loss_and_grads(o, state, leaves)
    grads_ref = loss_and_grads(o_ref.double(), state_ref.double(), leaves)
    for what, grad, grad_ref in zip(names, grads, grads_ref, strict=True):
        assert_rel_rms(grad, grad_ref, FLA_TOL, f"d/d{what}")


KDA_NAMES = ["q", "k", "v", "g", "beta", "S0"]


def test_kda_matches_fla_naive_recurrent_kda():
    rule = miras.compile(KDA)
    assert rule.gates == ["decay", "lr"]
    q, k, v, g, beta, s0 = leaves = kda_inputs(seed=1)
    o, state = rule(
        q, k, v, {"decay": g.exp(), "lr": beta}, initial_state=s0.mT, output_final_state=True,
        backend="recurrent",
    )  # fmt: skip
    o_ref, state_ref = fla_kda(q, k, v, g, beta, s0)
    assert_all_close(o, state.mT, o_ref, state_ref, leaves, KDA_NAMES)


def test_kda_packed_sequences_match_fla_per_sequence():
    """cu_seqlens [0, 30, 70] on B = 1 against fla's recurrence run on each sequence alone
    (fla's naive function takes no cu_seqlens), from one initial state each."""
    rule = miras.compile(KDA)
    q, k, v, g, beta, s0 = leaves = kda_inputs(seed=2, batch=1)

    def s0_packed():  # [N = 2, H, Dk, Dv]; built per graph, as each is freed in its backward
        return torch.cat([s0, 0.5 * s0])

    cu = torch.tensor([0, 30, T])
    o, state = rule(
        q, k, v, {"decay": g.exp(), "lr": beta}, initial_state=s0_packed().mT,
        output_final_state=True, backend="recurrent", cu_seqlens=cu,
    )  # fmt: skip
    outs, finals, starts = [], [], s0_packed()
    for i, (lo, hi) in enumerate(itertools.pairwise(cu.tolist())):
        part = [x[:, lo:hi] for x in (q, k, v, g, beta)]
        o_i, s_i = fla_kda(*part, starts[i : i + 1])
        outs.append(o_i)
        finals.append(s_i)
    assert_all_close(o, state.mT, torch.cat(outs, 1), torch.cat(finals), leaves, KDA_NAMES)


@pytest.mark.parametrize("chunk_mode", ["exact", "start"])
def test_kda_per_head_decay_is_gated_deltanet_on_the_chunk_forms(chunk_mode):
    """A decay per head [B, T, H] is the same rule on every form: the exact chunk form at 64
    equals fla's KDA with g broadcast over the key channels (the compiler proves the step
    affine); the chunk-start form at chunk size 1 is the recurrence."""
    rule = miras.compile(KDA)
    assert rule.plan.chunk_form.form == "exact"
    q, k, v, g, beta, s0 = leaves = kda_inputs(seed=3, per_key=False)
    chunk_size = 64 if chunk_mode == "exact" else 1
    o, state = rule(
        q, k, v, {"decay": g.exp(), "lr": beta}, initial_state=s0.mT, output_final_state=True,
        backend="chunk", chunk_size=chunk_size, chunk_mode=chunk_mode,
    )  # fmt: skip
    o_ref, state_ref = fla_kda(q, k, v, g, beta, s0)
    assert_all_close(o, state.mT, o_ref, state_ref, leaves, KDA_NAMES)


@pytest.mark.parametrize("chunk_size", [64, 16])
def test_kda_exact_chunk_form_with_a_decay_per_key_channel_matches_fla(chunk_size):
    """The exact chunk form with the decays inside the keys' products (exact_keys.py), at
    chunk 64 (T = 70: a partial chunk) and 16."""
    rule = miras.compile(KDA)
    q, k, v, g, beta, s0 = leaves = kda_inputs(seed=15)
    o, state = rule(
        q, k, v, {"decay": g.exp(), "lr": beta}, initial_state=s0.mT, output_final_state=True,
        backend="chunk", chunk_size=chunk_size, chunk_mode="exact",
    )  # fmt: skip
    o_ref, state_ref = fla_kda(q, k, v, g, beta, s0)
    assert_all_close(o, state.mT, o_ref, state_ref, leaves, KDA_NAMES)


PER_KEY_STATE = {
    "name": "per_key_state",
    "bias": "l2",
    "retention": {"kind": "l2", "decay_channels": "key"},
    "optimizer": "gd",
}


@pytest.mark.parametrize(
    ("spec", "channel_gate"),
    [(PER_KEY_STATE, None), (KDA, "lr"), ("specs/gdn2.yaml", "erase")],
    ids=["grad_at_state", "kda_lr_per_value_channel", "gdn2_erase_per_value_channel"],
)
def test_exact_keys_form_equals_the_recurrence(spec, channel_gate):
    """float64, against miras's own recurrence at 1e-10: the gradient at the state (G_{t-1}
    in the reads), and a step size or slope per value channel (one system per channel)."""
    rule = miras.compile(spec)
    gen = torch.Generator().manual_seed(16)
    q, k = (F.normalize(torch.randn(B, T, H, DK, generator=gen, dtype=f64), dim=-1) for _ in "qk")
    v = torch.randn(B, T, H, DV, generator=gen, dtype=f64)
    gates = {}
    for name in rule.gates:
        shape = (B, T, H, DK) if name == "decay" else (B, T, H)
        if name in ("write", channel_gate):
            shape = (B, T, H, DV)
        lo, hi = (0.75, 1.0) if name == "decay" else (0.1, 0.9)
        gates[name] = lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=f64)
    w0 = 0.1 * torch.randn(B, H, DV, DK, generator=gen, dtype=f64)
    leaves = [q, k, v, *gates.values(), w0]
    for x in leaves:
        x.requires_grad_(True)
    common = dict(initial_state=w0, output_final_state=True)
    o, state = rule(q, k, v, gates, backend="chunk", chunk_size=64, **common)
    o_ref, state_ref = rule(q, k, v, gates, backend="recurrent", **common)
    exact = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(o, o_ref, **exact)
    torch.testing.assert_close(state, state_ref, **exact)
    for grad, grad_ref in zip(
        loss_and_grads(o, state, leaves), loss_and_grads(o_ref, state_ref, leaves), strict=True
    ):
        torch.testing.assert_close(grad, grad_ref, **exact)


@pytest.mark.parametrize(
    ("spec", "backend", "chunk_mode", "why"),
    [
        (KDA, "chunk", "start", "the 'start' form scales the state by rows"),
        (KDA, "triton", "auto", "the 'exact_triton' form scales the state by rows"),
        (
            {**PER_KEY_STATE, "name": "per_key_momentum", "optimizer": "momentum"},
            "chunk",
            "auto",
            "the exact chunk form with it does not take optimizer 'momentum'",
        ),
    ],
    ids=["chunk_start", "triton", "momentum"],
)
def test_a_decay_per_key_channel_is_refused_where_no_form_takes_it(spec, backend, chunk_mode, why):
    """The chunk-start forms and the Triton kernels scale the state by rows, and the exact
    form with a decay per key channel takes gd at window 1: each refuses it, naming the gate
    and the reason, rather than compute another rule."""
    rule = miras.compile(spec)
    q, k, v, g, beta, _ = (x.detach() for x in kda_inputs(seed=4))
    gates = {"decay": g.exp(), "lr": beta}
    if "momentum" in rule.gates:
        gates["momentum"] = 0.5
    with pytest.raises(ValueError, match=rf"gates\['decay'\]: a decay per key channel .*{why}"):
        rule(q, k, v, gates, backend=backend, chunk_mode=chunk_mode)


def test_a_decay_per_key_channel_needs_the_declaration():
    """Without `decay_channels: key` the decay is per head or per value channel: a [B, T, H, Dk]
    decay (Dk != Dv) is refused by shape; and the KDA spec takes no decay per value channel."""
    q, k, v, g, beta, _ = (x.detach() for x in kda_inputs(seed=5))
    gdn = miras.compile("specs/gated_deltanet.yaml")
    with pytest.raises(ValueError, match=r"gates\['decay'\]: expected \[B, T, H\]"):
        gdn(q, k, v, {"decay": g.exp(), "lr": beta}, backend="recurrent")
    kda = miras.compile(KDA)
    per_value = torch.full((B, T, H, DV), 0.9, dtype=f64)
    with pytest.raises(ValueError, match=r"gates\['decay'\]: expected .* \[B, T, H, Dk\]"):
        kda(q, k, v, {"decay": per_value, "lr": beta}, backend="recurrent")


def test_kda_spec_problems_name_the_field():
    per_key = {"kind": "l2", "decay_channels": "key"}
    with pytest.raises(miras.SpecError, match=r"retention\.decay_channels: .*memory 'mlp'"):
        miras.load_spec({"name": "x", "memory": "mlp", "retention": per_key})
    with pytest.raises(miras.SpecError, match=r"retention\.decay_channels: .*a fixed decay"):
        miras.load_spec({"name": "x", "retention": {**per_key, "decay": 0.9}})


def test_decay_channels_value_keeps_the_digest():
    """`decay_channels: value` (the default) is left out of the long form."""
    plain = miras.load_spec("specs/gated_deltanet.yaml")
    long_form = plain.normalized()
    said = miras.load_spec(
        {**long_form, "retention": {**long_form["retention"], "decay_channels": "value"}}
    )
    assert said.digest() == plain.digest()
    assert "decay_channels" not in plain.normalized()["retention"]


def test_chunk_kda_alias_matches_fla_with_grouped_value_heads():
    """ops.chunk_kda in fla's layout: v [B, T, HV, V] with HV = 2 H, g [B, T, HV, K], beta
    [B, T, HV], states [B, HV, K, V], fla's default scale K^-0.5."""
    gen = torch.Generator().manual_seed(6)
    hv = 2 * H
    q, k = (
        f32_exact(F.normalize(torch.randn(B, T, H, DK, generator=gen, dtype=f64), dim=-1))
        for _ in "qk"
    )
    v = f32_exact(torch.randn(B, T, hv, DV, generator=gen, dtype=f64))
    g = f32_exact(-0.3 * torch.rand(B, T, hv, DK, generator=gen, dtype=f64))
    beta = f32_exact(0.1 + 0.8 * torch.rand(B, T, hv, generator=gen, dtype=f64))
    s0 = f32_exact(0.1 * torch.randn(B, hv, DK, DV, generator=gen, dtype=f64))
    leaves = [q, k, v, g, beta, s0]
    for x in leaves:
        x.requires_grad_(True)
    o, state = ops.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o_ref, state_ref = fla_naive("kda", "naive_recurrent_kda")(
        q, k, v, g, beta, initial_state=s0, output_final_state=True
    )
    assert_all_close(o, state, o_ref, state_ref, leaves, KDA_NAMES)


def test_chunk_kda_refuses_what_it_does_not_implement():
    q, k, v, g, beta, _ = (x.detach() for x in kda_inputs(seed=7))
    with pytest.raises(ValueError, match="chunk_kda: use_gate_in_kernel=True is not supported"):
        ops.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"g: expected \[B, T, H\] = .* or \[B, T, H, K\]"):
        ops.chunk_kda(q, k, v, g[..., :3], beta)


# GDN-2 --------------------------------------------------------------------------------------------

GDN2 = "specs/gdn2.yaml"
GDN2_NAMES = ["q", "k", "v", "g", "b", "w", "S0"]


def gdn2_inputs(seed: int, batch: int = B, per_key: bool = True):
    """As `kda_inputs`, with fla's gdn2 gates: g [B, T, H, Dk] (or per head), the erase
    strength b in [0.1, 0.9] per head [B, T, H] (the spec's `erase`; fla's b [B, T, H, Dk] is
    that broadcast over K), the write gate w in [0.1, 1] per value channel [B, T, H, Dv]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (
        f32_exact(F.normalize(torch.randn(batch, T, H, DK, generator=gen, dtype=f64), dim=-1))
        for _ in "qk"
    )
    v = f32_exact(torch.randn(batch, T, H, DV, generator=gen, dtype=f64))
    g_shape = (batch, T, H, DK) if per_key else (batch, T, H)
    g = f32_exact(-0.3 * torch.rand(*g_shape, generator=gen, dtype=f64))
    b = f32_exact(0.1 + 0.8 * torch.rand(batch, T, H, generator=gen, dtype=f64))
    w = f32_exact(0.1 + 0.9 * torch.rand(batch, T, H, DV, generator=gen, dtype=f64))
    s0 = f32_exact(0.1 * torch.randn(batch, H, DK, DV, generator=gen, dtype=f64))
    leaves = [q, k, v, g, b, w, s0]
    for x in leaves:
        x.requires_grad_(True)
    return leaves


def fla_gdn2(q, k, v, g, b, w, s0):
    """fla's naive recurrent GDN-2; g per head and b per head broadcast over K."""
    d_k = q.shape[-1]
    if g.dim() == 3:
        g = g[..., None].expand(*g.shape, d_k)
    return fla_naive("gdn2", "naive_recurrent_gdn2")(
        q, k, v, g, b[..., None].expand(*b.shape, d_k), w, scale=1.0, initial_state=s0,
        output_final_state=True,
    )  # fmt: skip


def test_gdn2_matches_fla_naive_recurrent_gdn2():
    rule = miras.compile(GDN2)
    assert sorted(rule.gates) == ["decay", "erase", "write"]
    q, k, v, g, b, w, s0 = leaves = gdn2_inputs(seed=10)
    gates = {"decay": g.exp(), "erase": b, "write": w}
    o, state = rule(
        q, k, v, gates, initial_state=s0.mT, output_final_state=True, backend="recurrent"
    )
    o_ref, state_ref = fla_gdn2(q, k, v, g, b, w, s0)
    assert_all_close(o, state.mT, o_ref, state_ref, leaves, GDN2_NAMES)


@pytest.mark.parametrize("chunk_mode", ["exact", "start"])
def test_gdn2_per_head_decay_on_the_chunk_forms(chunk_mode):
    """With the decay per head the exact chunk form at 64 (a slope per token, erase, and a
    write gate per value channel) and the chunk-start form at 1 equal fla's recurrence."""
    rule = miras.compile(GDN2)
    assert rule.plan.chunk_form.form == "exact"
    q, k, v, g, b, w, s0 = leaves = gdn2_inputs(seed=11, per_key=False)
    chunk_size = 64 if chunk_mode == "exact" else 1
    o, state = rule(
        q, k, v, {"decay": g.exp(), "erase": b, "write": w}, initial_state=s0.mT,
        output_final_state=True, backend="chunk", chunk_size=chunk_size, chunk_mode=chunk_mode,
    )  # fmt: skip
    o_ref, state_ref = fla_gdn2(q, k, v, g, b, w, s0)
    assert_all_close(o, state.mT, o_ref, state_ref, leaves, GDN2_NAMES)


def test_chunk_gdn2_alias_matches_fla():
    """ops.chunk_gdn2 in fla's layout and default scale K^-0.5, on packed sequences (B = 1,
    cu_seqlens [0, 30, 70]) against fla's recurrence per sequence; b per head."""
    q, k, v, g, b, w, s0 = leaves = gdn2_inputs(seed=12, batch=1)
    starts = torch.cat([s0, -s0])
    cu = torch.tensor([0, 30, T])
    o, state = ops.chunk_gdn2(
        q, k, v, g, b, w, initial_state=torch.cat([s0, -s0]), output_final_state=True,
        cu_seqlens=cu,
    )  # fmt: skip
    outs, finals = [], []
    for i, (lo, hi) in enumerate(itertools.pairwise(cu.tolist())):
        part = [x[:, lo:hi] for x in (q, k, v, g, b, w)]
        d_k = q.shape[-1]
        part[4] = part[4][..., None].expand(*part[4].shape, d_k)
        o_i, s_i = fla_naive("gdn2", "naive_recurrent_gdn2")(
            *part, initial_state=starts[i : i + 1], output_final_state=True
        )
        outs.append(o_i)
        finals.append(s_i)
    assert_all_close(o, state, torch.cat(outs, 1), torch.cat(finals), leaves, GDN2_NAMES)


def test_chunk_gdn2_refuses_an_erase_strength_per_key_channel():
    q, k, v, g, b, w, _ = (x.detach() for x in gdn2_inputs(seed=13))
    per_key = b[..., None].expand(*b.shape, DK)  # constant over K: refused all the same
    with pytest.raises(ValueError, match=r"b: chunk_gdn2 takes the erase strength per head"):
        ops.chunk_gdn2(q, k, v, g, per_key, w)
    with pytest.raises(ValueError, match=r"w: expected \[2, 70, 2, 24\]"):
        ops.chunk_gdn2(q, k, v, g, b, w[..., :3])
    with pytest.raises(ValueError, match="chunk_gdn2: safe_gate=True is not supported"):
        ops.chunk_gdn2(q, k, v, g, b, w, safe_gate=True)


@pytest.mark.parametrize("spec", ["kda", "gdn2"])
def test_kda_and_gdn2_per_head_decay_on_triton(spec):
    """The Triton backend (the exact form's scan in kernels; Triton's interpreter here), float32
    throughout, T = 20 at chunk 16 (a partial chunk), a decay per head: outputs, final state and
    every gradient against fla's recurrence."""
    rule = miras.compile(f"specs/{spec}.yaml")
    inputs = kda_inputs if spec == "kda" else gdn2_inputs
    leaves = [x.detach()[:1, :20].float() for x in inputs(seed=14, per_key=False)[:-1]]
    leaves.append(inputs(seed=14, per_key=False)[-1].detach()[:1].float())  # S0 [1, H, Dk, Dv]
    for x in leaves:
        x.requires_grad_(True)
    q, k, v, g, *rest, s0 = leaves
    if spec == "kda":
        gates = {"decay": g.exp(), "lr": rest[0]}
        o_ref, state_ref = fla_kda(q, k, v, g, rest[0], s0)
    else:
        gates = {"decay": g.exp(), "erase": rest[0], "write": rest[1]}
        o_ref, state_ref = fla_gdn2(q, k, v, g, *rest, s0)
    o, state = rule(
        q, k, v, gates, initial_state=s0.mT, output_final_state=True, backend="triton",
        chunk_size=16,
    )  # fmt: skip
    names = KDA_NAMES if spec == "kda" else GDN2_NAMES
    assert_all_close(o, state.mT, o_ref, state_ref, leaves, names)


# The momentum delta rule ------------------------------------------------------------------------


def test_momentum_delta_rule_recurrent_and_packed_match_fla():
    """specs/momentum_delta_rule.yaml on the recurrent backend, packed into two sequences,
    against fla's recurrence per sequence: outputs, both final states, every gradient (fla's
    gates mapped as in tests/runtime/test_exact_fla.py)."""
    rule = miras.compile("specs/momentum_delta_rule.yaml")
    q, k, v, fla_gates, s0, m0 = momentum_inputs(seed=8)  # B = 2, T = 100
    # Row 0 of the batch as two packed sequences of 37 and 63 tokens, each from (s0, m0) of
    # rows 0 and 1.
    q, k, v = (x[:1] for x in (q, k, v))
    fla_gates = {n: x[:1] for n, x in fla_gates.items()}
    leaves = [q, k, v, *fla_gates.values(), s0, m0]
    for x in leaves:
        x.requires_grad_(True)
    cu = [0, 37, 100]
    outs, s_ends, m_ends, inits = [], [], [], {"W": [], "S.W": []}
    miras_gates = {n: [] for n in ("decay", "lr", "momentum")}
    fn = fla_naive("momentum_delta_rule", "recurrent_momentum_delta_rule_ref")
    for i, (lo, hi) in enumerate(itertools.pairwise(cu)):
        part = {n: x[:, lo:hi] for n, x in fla_gates.items()}
        gates_i, init_i = as_miras(part, s0[i : i + 1], m0[i : i + 1])
        for n in miras_gates:
            miras_gates[n].append(gates_i[n])
        for n in inits:
            inits[n].append(init_i[n])
        o_i, (s_i, m_i) = fn(
            q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], part["alpha"].log(), part["mu"].log(),
            k[:, lo:hi], part["beta"], part["eta"], scale=1.0, initial_S=s0[i : i + 1],
            initial_M=m0[i : i + 1], output_final_state=True,
        )  # fmt: skip
        outs.append(o_i)
        s_ends.append(s_i)
        m_ends.append(m_i * part["beta"][:, -1, :, None, None])  # miras's S.W = beta M^T
    gates = {n: torch.cat(x, 1) for n, x in miras_gates.items()}
    init = {n: torch.cat(x) for n, x in inits.items()}
    o, state = rule(
        q, k, v, gates, initial_state=init, output_final_state=True, backend="recurrent",
        cu_seqlens=torch.tensor(cu),
    )  # fmt: skip
    o_ref = torch.cat(outs, 1)
    state_ref = {"W": torch.cat(s_ends).mT, "S.W": torch.cat(m_ends).mT}
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    for n in state_ref:
        assert_rel_rms(state[n], state_ref[n], FLA_TOL, n)
    grads = loss_and_grads(o, state, leaves)
    state_ref = {n: x.double() for n, x in state_ref.items()}
    grads_ref = loss_and_grads(o_ref.double(), state_ref, leaves)
    names = ["q", "k", "v", *fla_gates, "S0", "M0"]
    for what, grad, grad_ref in zip(names, grads, grads_ref, strict=True):
        assert_rel_rms(grad, grad_ref, FLA_TOL, f"d/d{what}")


# Titans-linear (docs/ops.md, "Titans-linear") -----------------------------------------------------

TITANS = "specs/titans_linear.yaml"
TITANS_NAMES = ["q", "k", "v", "w", "b", "theta", "alpha", "eta", "M0"]
TITANS_CHUNK = 16  # fla's default chunk_size


def titans_inputs(seed: int, length: int, batch: int = B, dim: int = DK):
    """fla's inputs for chunk_titans_linear_ref: q, k, v ~ N(0, 1) [B, T, H, D] (V = K: the
    target is v - k), the LayerNorm's w ~ 1 + N(0, 0.3^2) and b ~ N(0, 0.3^2) [H, D], theta in
    [0.01, 0.03], alpha in [0, 0.1], eta in [0.5, 0.9] [B, T, H, 1], M_0 ~ N(0, 0.1^2)
    [B, H, D, D]; all leaves require grad."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, lo=0.0, spread=1.0):
        return f32_exact(lo + spread * torch.randn(*shape, generator=gen, dtype=f64))

    def uniform(lo, hi):
        return f32_exact(lo + (hi - lo) * torch.rand(batch, length, H, 1, generator=gen, dtype=f64))

    leaves = [
        *(draw(batch, length, H, dim) for _ in "qkv"),
        draw(H, dim, lo=1.0, spread=0.3),
        draw(H, dim, spread=0.3),
        uniform(0.01, 0.03),
        uniform(0.0, 0.1),
        uniform(0.5, 0.9),
        draw(batch, H, dim, dim, spread=0.1),
    ]
    for x in leaves:
        x.requires_grad_(True)
    return leaves


def fla_titans(q, k, v, w, b, theta, alpha, eta, m0, chunk_size=TITANS_CHUNK):
    return fla_naive("titans", "chunk_titans_linear_ref")(
        *(x.float() for x in (q, k, v, w, b, theta, alpha, eta)), eps=1e-6,
        chunk_size=chunk_size, initial_state=m0.float(), output_final_state=True,
    )  # fmt: skip


def _layer_norm(x, eps=1e-6):
    centered = x - x.mean(-1, keepdim=True)
    return centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)


def titans_gradient_oracle(q, k, v, w, b, theta, alpha, eta, m0, chunk_size):
    """fla's titans_linear recurrence (fla/ops/titans/naive.py) with its LayerNorm backward
    made exact: each token's gradient is torch.autograd.grad of
    1/2 ||LN(k_t M) w + b - (v_t - k_t)||^2 at the chunk's start state M (refreshed every
    `chunk_size` tokens), then S_t = eta_t S_{t-1} - 2 theta_t grad (S_0 = 0),
    M_t = (1 - alpha_t) M_{t-1} + S_t, o_t = z_t + LN(z_t) w + b with z_t = q_t M_t. In the
    inputs' dtype, differentiable (create_graph) in every input. Returns (o [B, T, H, D], M_T)."""
    m, s, outputs = m0, torch.zeros_like(m0), []
    for t in range(q.shape[1]):
        if t % chunk_size == 0:
            m_start = m  # [B, H, K, V]
        k_t, v_t, q_t = (x[:, t, :, None, :] for x in (k, v, q))  # [B, H, 1, D]
        loss = (_layer_norm(k_t @ m_start) * w[:, None] + b[:, None] - (v_t - k_t)).pow(2)
        (grad,) = torch.autograd.grad(loss.sum() / 2, m_start, create_graph=True)
        theta_t, alpha_t, eta_t = (x[:, t, :, :, None] for x in (theta, alpha, eta))  # [B,H,1,1]
        s = eta_t * s - 2 * theta_t * grad
        m = (1 - alpha_t) * m + s
        z = q_t @ m
        outputs.append((z + _layer_norm(z) * w[:, None] + b[:, None])[:, :, 0])
    return torch.stack(outputs, 1), m


def test_titans_linear_spec_runs_the_chunk_start_form():
    rule = miras.compile(TITANS)
    assert rule.plan.chunk_form.form == "start"
    assert "couples the value channels" in rule.plan.chunk_form.reason
    assert sorted(rule.gates) == ["decay", "ln_bias", "ln_weight", "lr", "momentum"]
    assert "channel statistics" in rule.ir.triton_refusal


@pytest.mark.parametrize(
    ("backend", "chunk_size", "dtype", "tol"),
    [
        ("chunk", TITANS_CHUNK, torch.float32, FLA_TOL),
        ("chunk", TITANS_CHUNK, f64, 1e-12),
        ("recurrent", 1, torch.float32, FLA_TOL),
    ],
)
def test_chunk_titans_linear_matches_the_gradient_oracle(backend, chunk_size, dtype, tol):
    """ops.chunk_titans_linear (miras in float64) against `titans_gradient_oracle`, in float32
    as fla computes (and in float64, where the two are the same arithmetic up to rounding):
    T = 40, two chunks of 16 and a partial one of 8 (and chunks of one token on the recurrent
    backend); the output, M_T and the gradients of every input."""
    length = 40
    leaves = titans_inputs(seed=40, length=length)
    *args, m0 = leaves
    o, state = ops.chunk_titans_linear(
        *args, chunk_size=chunk_size, initial_state=m0, output_final_state=True, backend=backend
    )
    o_ref, state_ref = titans_gradient_oracle(*(x.to(dtype) for x in leaves), chunk_size)
    assert_rel_rms(o, o_ref, tol, "o")
    assert_rel_rms(state, state_ref, tol, "final state")
    grads = loss_and_grads(o, state, leaves)
    grads_ref = loss_and_grads(o_ref.double(), state_ref.double(), leaves)
    for what, grad, grad_ref in zip(TITANS_NAMES, grads, grads_ref, strict=True):
        assert_rel_rms(grad, grad_ref, tol, f"d/d{what}")


def rescaled_keys(k, m0, d):
    """k_t scaled so that D sqrt(var(k_t M_0) + eps) = 1 exactly where fla's LayerNorm backward
    is the exact one: its v_new's D * grad term should be grad / rstd (rstd fla's
    sqrt(var + eps)), equal at D rstd = 1. var(c k M_0) = c^2 var(k M_0)."""
    var = torch.einsum("bthk,bhkv->bthv", k, m0).var(-1, unbiased=False, keepdim=True)
    return k * torch.sqrt((d**-2 - 1e-6) / var)


def test_chunk_titans_linear_equals_fla_where_its_layer_norm_backward_is_exact():
    """fla's step is the gradient step wherever D rstd = 1 at the state the gradient is taken
    at. One chunk of T = 32 tokens (every gradient at M_0) with keys rescaled to that
    (`rescaled_keys`): the outputs, M_T and the gradients of q, v, w, b, theta, alpha, eta
    equal fla's chunk_titans_linear_ref, which pins the layouts, the gates' mapping (lr =
    2 theta, decay = 1 - alpha, momentum = eta, S_0 = 0) and the output LayerNorm. Those of k
    and M_0 do not: fla's v_new minus the exact one is grad (D - 1 / rstd), zero here but with
    a derivative in k and M_0 through rstd (measured: 0.47 and 0.68 relative RMS)."""
    length = 32
    q, k, v, w, b, theta, alpha, eta, m0 = (x.detach() for x in titans_inputs(41, length))
    k = f32_exact(rescaled_keys(k, m0, DK))
    leaves = [q, k, v, w, b, theta, alpha, eta, m0]
    for x in leaves:
        x.requires_grad_(True)
    options = dict(chunk_size=length, initial_state=m0, output_final_state=True)
    o, state = ops.chunk_titans_linear(q, k, v, w, b, theta, alpha, eta, **options)
    o_ref, state_ref = fla_titans(*leaves, chunk_size=length)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(state, state_ref, FLA_TOL, "final state")
    assert rel_rms(state.detach(), m0) > 1.0  # the state has moved: the steps are compared
    grads = dict(zip(TITANS_NAMES, loss_and_grads(o, state, leaves), strict=True))
    refs = loss_and_grads(o_ref.double(), state_ref.double(), leaves)
    for what, grad_ref in zip(TITANS_NAMES, refs, strict=True):
        if what in ("k", "M0"):
            assert rel_rms(grads[what], grad_ref) > 0.1, f"d/d{what}"
        else:
            assert_rel_rms(grads[what], grad_ref, FLA_TOL, f"d/d{what}")


def test_chunk_titans_linear_partial_chunk_final_state_differs_from_fla_by_its_padding():
    """T = 20 in one chunk of 32, keys as above: the outputs equal fla's, but fla's final state
    is taken after the 12 zero tokens it pads the chunk with (their theta, alpha, eta 0 but the
    last's, a copy of token T-1's), which drop the momentum and decay M once more:
    fla's M = (1 - alpha_(T-1)) miras's M_T."""
    length = 20
    q, k, v, w, b, theta, alpha, eta, m0 = (x.detach() for x in titans_inputs(42, length))
    k = f32_exact(rescaled_keys(k, m0, DK))
    args = (q, k, v, w, b, theta, alpha, eta)
    o, state = ops.chunk_titans_linear(*args, 1e-6, 32, m0, True)
    o_ref, state_ref = fla_titans(*args, m0, chunk_size=32)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert rel_rms(state, state_ref.double()) > 1e-2  # the extra decay is not miras's
    decayed = (1 - alpha[:, -1, :, :, None]) * state  # [B, H, 1, 1] * [B, H, K, V]
    assert_rel_rms(decayed, state_ref, FLA_TOL, "(1 - alpha_(T-1)) M_T")


def test_fla_titans_linear_step_is_not_the_gradient_of_its_loss():
    """fla's `titans_linear` (fla/ops/titans/naive.py) reads the memory through a LayerNorm,
    y = LN(k M) w + b, against the target v - k, but its step is not the gradient of that loss:
    the LayerNorm backward's D * grad term misses its 1 / (rstd D). This holds docs/ops.md's
    figure to fla 0.6: one token from M_0, no decay, no momentum, fla's M_1 = M_0 - 2 theta k^T
    v_new lies 27.8 steps' sizes from the gradient step M_0 - theta dL/dM of
    L = ||LN(k M_0) w + b - (v - k)||^2 (autograd), which ops.chunk_titans_linear takes (here
    D rstd = 16.3, far from 1)."""
    gen = torch.Generator().manual_seed(9)
    d = 8
    q, k, v = (torch.randn(1, 1, 1, d, generator=gen, dtype=f64) for _ in "qkv")
    w, b = (torch.randn(1, d, generator=gen, dtype=f64) for _ in "wb")
    m0 = torch.randn(1, 1, d, d, generator=gen, dtype=f64, requires_grad=True)
    theta = torch.full((1, 1, 1, 1), 0.1, dtype=f64)
    zero, one = torch.zeros_like(theta), torch.ones_like(theta)
    titans = fla_naive("titans", "titans_linear")  # [B, H, T, D] layout
    _, m1 = titans(q, k, v, w, b, theta, zero, one, 1e-6, 1, m0.detach(), True)
    _, m1_miras = ops.chunk_titans_linear(
        q, k, v, w, b, theta, 0.0, 0.0, chunk_size=1, initial_state=m0.detach(),
        output_final_state=True,
    )  # fmt: skip

    km = k[0, 0] @ m0[0, 0]  # [1, D]
    normed = (km - km.mean(-1, keepdim=True)) * torch.rsqrt(km.var(-1, False, True) + 1e-6)
    loss = (normed * w + b - (v[0, 0] - k[0, 0])).pow(2).sum()
    (grad,) = torch.autograd.grad(loss, m0)
    gradient_step = m0.detach() - theta * grad
    torch.testing.assert_close(m1_miras, gradient_step, rtol=1e-12, atol=1e-12)
    err = ((m1 - gradient_step).norm() / (gradient_step - m0).norm()).item()
    assert err == pytest.approx(27.77, abs=0.01), f"fla's titans step now lies {err:.4g} away"


def test_chunk_titans_linear_refuses_what_it_does_not_run():
    q, k, v, w, b, theta, alpha, eta, m0 = (x.detach() for x in titans_inputs(43, length=8))
    args = (q, k, v, w, b)
    with pytest.raises(ValueError, match=r"alpha: 1 - alpha must lie in \(0, 1\] \(the decay"):
        ops.chunk_titans_linear(*args, theta, 1.0, eta)
    with pytest.raises(ValueError, match=r"eta: values must lie in \[0, 1\) \(the momentum\)"):
        ops.chunk_titans_linear(*args, theta, alpha, torch.ones_like(eta))
    with pytest.raises(ValueError, match=r"theta: values must lie in \[0, inf\)"):
        ops.chunk_titans_linear(*args, -theta, alpha, eta)
    with pytest.raises(ValueError, match=r"theta: expected \[B, T, H, 1\]"):
        ops.chunk_titans_linear(*args, theta[..., 0], alpha, eta)
    with pytest.raises(ValueError, match=r"v: chunk_titans_linear learns the residual target"):
        ops.chunk_titans_linear(q, k, v[..., :3], w, b, theta, alpha, eta)
    with pytest.raises(ValueError, match=r"w: expected the LayerNorm's weight \[H, D\]"):
        ops.chunk_titans_linear(q, k, v, w[0], b, theta, alpha, eta)
    with pytest.raises(ValueError, match=r"initial_state: expected M_0 \[2, 2, 16, 16\]"):
        ops.chunk_titans_linear(*args, theta, alpha, eta, initial_state=m0[:1])
    with pytest.raises(ValueError, match="backend: 'triton' does not cover chunk_titans_linear"):
        ops.chunk_titans_linear(*args, theta, alpha, eta, backend="triton")
    with pytest.raises(ValueError, match="backend: 'recurrent' steps one token at a time"):
        ops.chunk_titans_linear(*args, theta, alpha, eta, backend="recurrent")
    with pytest.raises(ValueError, match=r"unexpected arguments \['cu_seqlens'\]"):
        ops.chunk_titans_linear(*args, theta, alpha, eta, cu_seqlens=torch.tensor([0, 8]))


# The preconditioned gated delta rule -------------------------------------------------------------

PRECOND = "specs/precond_gdn.yaml"
PRECOND_NAMES = ["q", "k", "v", "g_atk", "g", "beta_atk", "beta", "S0", "A0"]


def precond_inputs(seed: int, batch: int = B, value_heads: int = H):
    """fla's inputs for naive_recurrent_precond_gated_delta_rule: q, k ~ N(0, 1) [B, T, H, Dk]
    (fla normalizes them), v [B, T, HV, Dv], log-decays g_atk [B, T, H] and g [B, T, HV] in
    [-0.3, 0], beta_atk [B, T, H] in [0, 1], beta [B, T, HV] in [0.1, 0.9], a non-zero initial
    state S0 [B, HV, Dk, Dv] and curvature sum A0 [B, H, Dk] >= 0; all leaves require grad."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, lo=None, hi=None):
        x = torch.randn(*shape, generator=gen, dtype=f64)
        if lo is not None:
            x = lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=f64)
        return f32_exact(x)

    hv = value_heads
    leaves = [
        draw(batch, T, H, DK),
        draw(batch, T, H, DK),
        draw(batch, T, hv, DV),
        draw(batch, T, H, lo=-0.3, hi=0.0),
        draw(batch, T, hv, lo=-0.3, hi=0.0),
        draw(batch, T, H, lo=0.0, hi=1.0),
        draw(batch, T, hv, lo=0.1, hi=0.9),
        f32_exact(0.1 * torch.randn(batch, hv, DK, DV, generator=gen, dtype=f64)),
        draw(batch, H, DK, lo=0.0, hi=2.0),
    ]
    for x in leaves:
        x.requires_grad_(True)
    return leaves


def fla_precond(*args, initial_state, initial_A_state, **options):
    """fla's naive recurrence; its states start as given (no cast), so they go in as float32."""
    return fla_naive("precond_gated_delta_rule", "naive_recurrent_precond_gated_delta_rule")(
        *args, initial_state=initial_state.float(), initial_A_state=initial_A_state.float(),
        output_final_state=True, **options,
    )  # fmt: skip


def assert_o_and_states_close(outputs, references, leaves, names=PRECOND_NAMES):
    """Outputs (o, S, A) and the gradients of a random linear functional of all three."""
    for what, x, ref in zip(["o", "final state", "final A"], outputs, references, strict=True):
        assert_rel_rms(x, ref, FLA_TOL, what)
    grads = loss_and_grads(outputs[0], dict(zip("SA", outputs[1:], strict=True)), leaves)
    refs = dict(zip("SA", (x.double() for x in references[1:]), strict=True))
    grads_ref = loss_and_grads(references[0].double(), refs, leaves)
    for what, grad, grad_ref in zip(names, grads, grads_ref, strict=True):
        assert_rel_rms(grad, grad_ref, FLA_TOL, f"d/d{what}")


@pytest.mark.parametrize(
    ("backend", "chunk_size"), [("recurrent", 1), ("chunk", 64), ("chunk", 16)]
)
def test_precond_gdn_matches_fla_naive(backend, chunk_size):
    """specs/precond_gdn.yaml in miras's own call against fla's naive recurrence: the
    recurrence and the exact chunk form (exact_keys.py, the step per key channel in the written
    key) at 64 (T = 70: a partial chunk) and 16. fla normalizes q and k and scales q by K^-0.5;
    miras is handed them so. States: W = S^T, the curvature sum A as "P.W" [B, H, 1, Dk]."""
    rule = miras.compile(PRECOND)
    assert rule.gates == ["decay", "lr", "precond_decay", "precond_lr"]
    assert rule.plan.chunk_form.form == "exact"
    q, k, v, g_atk, g, beta_atk, beta, s0, a0 = leaves = precond_inputs(seed=20)
    gates = {"decay": g.exp(), "lr": beta, "precond_decay": g_atk.exp(), "precond_lr": beta_atk}
    o, state = rule(
        F.normalize(q, dim=-1) * DK**-0.5, F.normalize(k, dim=-1), v, gates,
        initial_state={"W": s0.mT, "P.W": a0.unsqueeze(-2)}, output_final_state=True,
        backend=backend, chunk_size=chunk_size,
    )  # fmt: skip
    outputs = (o, state["W"].mT, state["P.W"].squeeze(-2))
    references = fla_precond(
        q, k, v, g_atk, g, beta_atk, beta, initial_state=s0, initial_A_state=a0
    )
    assert_o_and_states_close(outputs, references, leaves)


@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunk_precond_alias_matches_fla_with_grouped_heads_and_packed_sequences(chunk_size):
    """ops.chunk_precond_gated_delta_rule in fla's signature against fla's naive function on the
    same call: grouped value heads (HV = 2 H: a key head's A shared by its two value heads),
    packed sequences (cu_seqlens [0, 30, 70], B = 1) with an initial S and A per sequence, a
    center per key head (log_atk_scale [H], differentiable), fla's default scale and its
    in-kernel l2 normalization of q and k; every gradient."""
    q, k, v, g_atk, g, beta_atk, beta, s0, a0 = precond_inputs(seed=21, batch=2, value_heads=2 * H)
    leaves = [x.detach()[:1].requires_grad_() for x in (q, k, v, g_atk, g, beta_atk, beta)]
    leaves += [s0.detach().requires_grad_(), a0.detach().requires_grad_()]  # N = 2 sequences
    center = f32_exact(torch.tensor([-0.5, 0.1], dtype=f64)).requires_grad_()
    leaves.append(center)
    cu = torch.tensor([0, 30, T])
    *inputs, s0, a0, _ = leaves
    options = dict(initial_state=s0, initial_A_state=a0, log_atk_scale=center, cu_seqlens=cu)
    outputs = ops.chunk_precond_gated_delta_rule(
        *inputs, output_final_state=True, chunk_size=chunk_size, **options
    )
    references = fla_precond(*inputs, **options)
    assert_o_and_states_close(outputs, references, leaves, [*PRECOND_NAMES, "log_atk_scale"])


def test_precond_gdn_chunk_forms_equal_the_recurrence_with_gates_per_key_channel():
    """float64, against miras's own recurrence at 1e-10, with every preconditioner gate and the
    step size per key channel [B, T, H, Dk] (the scan's per-channel decays; lr_t M_t then
    carries the caller's per-key lr) and the decay per head: the exact form at 64 and 5, and
    the chunk-start form's general path at chunk size 1 (the exact step) and 4 (it runs, and
    is the chunk-start approximation, another rule)."""
    rule = miras.compile(PRECOND)
    gen = torch.Generator().manual_seed(22)
    q, k = (F.normalize(torch.randn(B, T, H, DK, generator=gen, dtype=f64), dim=-1) for _ in "qk")
    v = torch.randn(B, T, H, DV, generator=gen, dtype=f64)
    gates = {
        "decay": 0.8 + 0.2 * torch.rand(B, T, H, generator=gen, dtype=f64),
        "lr": 0.1 + 0.8 * torch.rand(B, T, H, DK, generator=gen, dtype=f64),
        "precond_decay": 0.5 + 0.5 * torch.rand(B, T, H, DK, generator=gen, dtype=f64),
        "precond_lr": torch.rand(B, T, H, DK, generator=gen, dtype=f64),
    }
    init = {
        "W": 0.1 * torch.randn(B, H, DV, DK, generator=gen, dtype=f64),
        "P.W": torch.rand(B, H, 1, DK, generator=gen, dtype=f64),
    }
    leaves = [q, k, v, *gates.values(), *init.values()]
    for x in leaves:
        x.requires_grad_(True)
    common = dict(initial_state=init, output_final_state=True)
    o_ref, state_ref = rule(q, k, v, gates, backend="recurrent", **common)
    grads_ref = loss_and_grads(o_ref, state_ref, leaves)
    exact = dict(rtol=1e-10, atol=1e-10)
    for chunk_size, mode in ((64, "auto"), (5, "exact"), (1, "start")):
        o, state = rule(
            q, k, v, gates, backend="chunk", chunk_size=chunk_size, chunk_mode=mode, **common
        )
        torch.testing.assert_close(o, o_ref, **exact)
        for name in state_ref:
            torch.testing.assert_close(state[name], state_ref[name], **exact)
        for grad, grad_ref in zip(loss_and_grads(o, state, leaves), grads_ref, strict=True):
            torch.testing.assert_close(grad, grad_ref, **exact)
    o_start, _ = rule(q, k, v, gates, backend="chunk", chunk_size=4, chunk_mode="start")
    assert bool(torch.isfinite(o_start).all())
    assert not torch.allclose(o_start, o_ref, rtol=1e-3, atol=1e-3)  # the approximation


def test_precond_gdn_is_refused_where_the_step_per_key_channel_is_not_taken():
    """The Triton kernels scale the state by rows: refused at compile time, naming the
    optimizer; the chunk-start form's linear path (matmuls over rows) refuses it at run time
    rather than compute another rule (the compiler sends the preconditioned optimizer to the
    general path, so this is the guard behind that choice)."""
    import dataclasses

    from miras.runtime import run

    rule = miras.compile(PRECOND)
    assert "preconditioned optimizer" in rule.ir.triton_refusal
    assert rule.program.runtime.start_path == "general"
    q, k, v, g_atk, g, beta_atk, beta, _, _ = (x.detach() for x in precond_inputs(seed=23))
    gates = {"decay": g.exp(), "lr": beta, "precond_decay": g_atk.exp(), "precond_lr": beta_atk}
    with pytest.raises(ValueError, match="does not cover spec 'precond_gdn': the preconditioned"):
        rule(q, k, v, gates, backend="triton")
    linear = dataclasses.replace(rule.program.runtime, start_path="linear")
    program = dataclasses.replace(rule.program, runtime=linear)
    with pytest.raises(ValueError, match=r"per key channel .* the 'start' form does not take"):
        run(program, q, k, v, gates, backend="chunk", chunk_mode="start")


def test_preconditioned_spec_problems_name_the_field():
    cases = [
        ({"memory": "mlp"}, r"optimizer\.kind: the preconditioner scales the step per key"),
        ({"bias": "huber"}, r"optimizer\.kind: .*constant d2L/dy\^2"),
        ({"window": 2}, r"window\.c: the preconditioner sums each token's own curvature"),
        ({"optimizer": {"kind": "preconditioned", "precond_range": 1}}, r"precond_range"),
        ({"optimizer": {"kind": "preconditioned", "precond_eps": 0}}, r"precond_eps"),
    ]
    for fields, message in cases:
        spec = {"name": "x", "optimizer": "preconditioned", **fields}
        with pytest.raises(miras.SpecError, match=message):
            miras.load_spec(spec)


def test_chunk_precond_alias_refuses_bad_arguments():
    q, k, v, g_atk, g, beta_atk, beta, _, _ = (x.detach() for x in precond_inputs(seed=24))
    op = ops.chunk_precond_gated_delta_rule
    with pytest.raises(ValueError, match=r"cp_context=.* is not supported"):
        op(q, k, v, g_atk, g, beta_atk, beta, cp_context=object())
    with pytest.raises(ValueError, match=r"g_atk: expected \[B, T, H\] = \[2, 70, 2\]"):
        op(q, k, v, g_atk[..., None], g, beta_atk, beta)
    with pytest.raises(ValueError, match=r"g_atk: expected log-decays g <= 0"):
        op(q, k, v, -g_atk, g, beta_atk, beta)
    with pytest.raises(ValueError, match=r"beta_atk: values must lie in \[0, inf\)"):
        op(q, k, v, g_atk, g, -beta_atk - 0.1, beta)
    with pytest.raises(ValueError, match=r"log_atk_scale: expected a float or a floating tensor"):
        op(q, k, v, g_atk, g, beta_atk, beta, log_atk_scale=torch.zeros(3, dtype=f64))
    with pytest.raises(ValueError, match=r"x: expected a number in \(1, inf\)"):
        op(q, k, v, g_atk, g, beta_atk, beta, x=1.0)
    with pytest.raises(ValueError, match=r"initial_A_state: expected \[N, H, K\] = \[2, 2, 16\]"):
        op(q, k, v, g_atk, g, beta_atk, beta, initial_A_state=torch.zeros(2, 2, 3, dtype=f64))


# TTT-linear --------------------------------------------------------------------------------------

TTT = "specs/ttt_linear.yaml"
TTT_NAMES = ["q", "k", "v", "w", "b", "eta per mini-batch", "h0", "hb0"]
MINI = 16  # fla's default mini-batch (chunk_size)


def ttt_inputs(seed: int, length: int, batch: int = B, dim: int = DK):
    """fla's inputs for chunk_ttt_linear_ref: q, k, v ~ N(0, 1) [B, T, H, D] (V = K: the target
    is v - k), the LayerNorm's w ~ 1 + N(0, 0.3^2) and b ~ N(0, 0.3^2) [H, D], one learning
    rate per mini-batch in [0.05, 0.15] [B, NT, H] (the leaf; `ttt_eta` spreads it over the
    mini-batch's tokens), initial h [B, H, D, D] and hb [B, H, 1, D]; all leaves require grad."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, lo=0.0, spread=1.0):
        return f32_exact(lo + spread * torch.randn(*shape, generator=gen, dtype=f64))

    chunks = -(-length // MINI)
    leaves = [
        *(draw(batch, length, H, dim) for _ in "qkv"),
        draw(H, dim, lo=1.0, spread=0.3),
        draw(H, dim, spread=0.3),
        f32_exact(0.05 + 0.1 * torch.rand(batch, chunks, H, generator=gen, dtype=f64)),
        draw(batch, H, dim, dim, spread=0.1),
        draw(batch, H, 1, dim, spread=0.1),
    ]
    for x in leaves:
        x.requires_grad_(True)
    return leaves


def ttt_eta(eta: torch.Tensor, length: int, starts=(0,)) -> torch.Tensor:
    """[B, NT, H] one rate per mini-batch -> fla's eta [B, T, H, 1]: mini-batch i's rate on each
    of its tokens, the mini-batches counted from each sequence's start in `starts` (packed)."""
    index, first = [], 0
    for lo, hi in itertools.pairwise([*starts, length]):
        index.append(first + torch.arange(hi - lo) // MINI)
        first += -(-(hi - lo) // MINI)  # this sequence's mini-batches
    return eta[:, torch.cat(index), :, None]


def fla_ttt(q, k, v, w, b, eta, h0, hb0):
    return fla_naive("ttt", "chunk_ttt_linear_ref")(
        *(x.float() for x in (q, k, v, w, b, eta)), eps=1e-6, mini_batch_size=MINI,
        initial_state=h0.float(), initial_state_bias=hb0.float(), output_final_state=True,
    )  # fmt: skip


def test_ttt_linear_spec_runs_the_chunk_start_form():
    rule = miras.compile(TTT)
    assert rule.plan.chunk_form.form == "start"
    assert "couples the value channels" in rule.plan.chunk_form.reason
    assert sorted(rule.gates) == ["ln_bias", "ln_weight", "lr"]
    assert "channel statistics" in rule.ir.triton_refusal


def test_chunk_ttt_linear_matches_fla():
    """ops.chunk_ttt_linear against fla's chunk_ttt_linear_ref at its mini-batch 16, T = 48 (three
    mini-batches): outputs, both final states and every gradient, the learning rate one number
    per mini-batch (its gradient compared per mini-batch: below)."""
    length = 48
    q, k, v, w, b, eta, h0, hb0 = leaves = ttt_inputs(seed=30, length=length)
    options = dict(initial_state=h0, initial_state_bias=hb0, output_final_state=True)
    outputs = ops.chunk_ttt_linear(q, k, v, w, b, ttt_eta(eta, length), chunk_size=MINI, **options)
    references = fla_ttt(q, k, v, w, b, ttt_eta(eta, length), h0, hb0)
    assert_o_and_states_close(outputs, references, leaves, TTT_NAMES)


def test_chunk_ttt_linear_packed_sequences_match_fla_per_sequence():
    """cu_seqlens [0, 32, 80] (B = 1; mini-batches from each sequence's start), one initial h
    and hb per sequence, against fla's reference run on each sequence alone."""
    length, cu = 80, [0, 32, 80]
    q, k, v, w, b, eta, h0, hb0 = leaves = ttt_inputs(seed=31, length=length, batch=1)

    def shared():  # built per graph, as each is freed in its backward
        h_starts, hb_starts = (torch.cat([x, -0.5 * x]) for x in (h0, hb0))  # N = 2
        return h_starts, hb_starts, ttt_eta(eta, length, starts=cu[:-1])

    h_starts, hb_starts, eta_tokens = shared()
    outputs = ops.chunk_ttt_linear(
        q, k, v, w, b, eta_tokens, chunk_size=MINI, initial_state=h_starts,
        initial_state_bias=hb_starts, output_final_state=True, cu_seqlens=torch.tensor(cu),
    )  # fmt: skip
    h_starts, hb_starts, eta_tokens = shared()
    parts = []
    for i, (lo, hi) in enumerate(itertools.pairwise(cu)):
        inputs = [x[:, lo:hi] for x in (q, k, v)] + [w, b, eta_tokens[:, lo:hi]]
        parts.append(fla_ttt(*inputs, h_starts[i : i + 1], hb_starts[i : i + 1]))
    o_ref, h_ref, hb_ref = zip(*parts, strict=True)
    references = (torch.cat(o_ref, 1), torch.cat(h_ref), torch.cat(hb_ref))
    assert_o_and_states_close(outputs, references, leaves, TTT_NAMES)


def test_chunk_ttt_linear_partial_mini_batch_differs_from_fla_by_its_padding_only():
    """T = 40 at mini-batch 16: the outputs and h equal fla's, but fla's final hb also holds the
    gradients of the 8 zero tokens it pads the last mini-batch with (k = 0: the prediction hb of
    the last mini-batch's start, against the target 0), which miras's does not: adding them
    gives fla's. This holds docs/ops.md's claim to fla 0.6."""
    length = 40
    q, k, v, w, b, eta, h0, hb0 = (x.detach() for x in ttt_inputs(seed=32, length=length))
    eta_tokens = ttt_eta(eta, length)
    options = dict(chunk_size=MINI, initial_state=h0, initial_state_bias=hb0)
    o, h, hb = ops.chunk_ttt_linear(q, k, v, w, b, eta_tokens, output_final_state=True, **options)
    o_ref, h_ref, hb_ref = fla_ttt(q, k, v, w, b, eta_tokens, h0, hb0)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(h, h_ref, FLA_TOL, "h")
    assert rel_rms(hb, hb_ref.double()) > 1e-2  # the padding's gradients are not miras's
    full = 32
    _, _, hb_start = ops.chunk_ttt_linear(
        *(x[:, :full] for x in (q, k, v)), w, b, eta_tokens[:, :full], output_final_state=True,
        **options,
    )  # fmt: skip
    y = hb_start.clone().requires_grad_()  # the pads' prediction [B, H, 1, D]
    bias = miras.compile(TTT).spec.bias
    loss = bias.reference_loss(y, torch.zeros_like(y), w[:, None], b[:, None]).sum()
    (pad_gradient,) = torch.autograd.grad(loss, y)
    pads = -(-length // MINI) * MINI - length
    with_pads = hb - eta[:, -1, :, None, None] * pads * pad_gradient
    assert_rel_rms(with_pads, hb_ref, FLA_TOL, "hb with the padding's gradients")


def test_chunk_ttt_linear_refuses_what_is_not_a_gradient_step():
    q, k, v, w, b, _, _, _ = (x.detach() for x in ttt_inputs(seed=33, length=32))
    per_token = 0.05 + 0.01 * torch.arange(32, dtype=f64)[None, :, None, None].expand(B, 32, H, 1)
    with pytest.raises(ValueError, match=r"eta: .*varies inside the mini-batch of tokens 0 to 15"):
        ops.chunk_ttt_linear(q, k, v, w, b, per_token)
    with pytest.raises(ValueError, match=r"eta: values must lie in \[0, inf\)"):
        ops.chunk_ttt_linear(q, k, v, w, b, -0.1)
    with pytest.raises(ValueError, match=r"v: chunk_ttt_linear learns the residual target"):
        ops.chunk_ttt_linear(q, k, v[..., :3], w, b, 0.1)
    with pytest.raises(ValueError, match=r"w: expected the LayerNorm's weight \[H, V\]"):
        ops.chunk_ttt_linear(q, k, v, w[0], b, 0.1)
    with pytest.raises(ValueError, match="backend: 'triton' does not cover chunk_ttt_linear"):
        ops.chunk_ttt_linear(q, k, v, w, b, 0.1, backend="triton")
    with pytest.raises(ValueError, match="backend: 'recurrent' steps one token at a time"):
        ops.chunk_ttt_linear(q, k, v, w, b, 0.1, backend="recurrent")
