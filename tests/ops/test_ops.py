"""miras.ops (fla's calling convention), packed sequences (cu_seqlens) and scalar gates.

- Each alias equals fla's pure-torch reference of the same model (`fla/ops/<op>/naive.py`,
  fla-core 0.6) on the same arguments: log-decays, `scale`, fla's [B, H, K, V] initial state;
  forward and gradients. fla computes in float32, so inputs are float32-representable float64
  tensors and the tolerance is a relative RMS of 1e-5, as in tests/runtime/test_known_models.py. The
  aliases run the chunk backend at chunk size 8 on T = 20 (a partial last chunk).
- Packed sequences equal each sequence run alone, with its own copies of the leaves: outputs,
  final states [N, ...], and the gradients of q, k, v, gates and the initial states.
- A Python scalar gate equals the broadcast tensor.
- fla 0.6's conventions: grouped value heads (HV = 3 H) and V-first states against fla's
  reference run per value head on its key head; head_first, use_qk_l2norm_in_kernel's epsilon,
  cu_seqlens_cpu and chunk_indices (built by fla's own prepare_chunk_indices) checked.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import miras
from miras import ops
from tests.runtime.test_known_models import assert_rel_rms, f32_exact, fla_naive

B, T, H, K, V = 2, 20, 2, 8, 5  # K != V so a transposed state cannot pass
FLA_TOL = 1e-5  # relative RMS: fla's references compute in float32
EXACT = dict(rtol=1e-12, atol=1e-12)
CHUNK = 8
f64 = torch.float64


def randn(gen, *shape, scale=1.0):
    return f32_exact(scale * torch.randn(*shape, generator=gen, dtype=f64))


def uniform(gen, shape, lo, hi):
    return f32_exact(lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=f64))


def unit_rows(gen, *shape):
    return f32_exact(F.normalize(torch.randn(*shape, generator=gen, dtype=f64), dim=-1))


def grads_of(outputs, leaves, seed=3):
    """Gradients of a random linear functional of `outputs` (tensors or None) w.r.t. `leaves`."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [x for x in outputs if x is not None]
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=f64)).sum() for x in tensors)
    return torch.autograd.grad(loss, leaves)


def assert_all_close_rms(actual, expected, names):
    for a, e, name in zip(actual, expected, names, strict=True):
        assert_rel_rms(a, e, FLA_TOL, name)


# Each alias against fla's reference -----------------------------------------------------------


def delta_inputs(seed, *, gated):
    gen = torch.Generator().manual_seed(seed)
    q, k = unit_rows(gen, B, T, H, K), unit_rows(gen, B, T, H, K)
    v = randn(gen, B, T, H, V)
    beta = uniform(gen, (B, T, H), 0.1, 0.9)
    g = f32_exact(uniform(gen, (B, T, H), 0.8, 1.0).log())
    h0 = randn(gen, B, H, K, V, scale=0.1)  # fla's layout [B, H, K, V]
    leaves = [q, k, v, beta, g, h0] if gated else [q, k, v, beta, h0]
    return [x.requires_grad_(True) for x in leaves]


@pytest.mark.parametrize("scale", [None, 0.7])
def test_chunk_gated_delta_rule_matches_fla(scale):
    leaves = delta_inputs(1, gated=True)
    q, k, v, beta, g, h0 = leaves
    o, s = ops.chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
        chunk_size=CHUNK,
    )  # fmt: skip
    ref = fla_naive("gated_delta_rule", "naive_recurrent_gated_delta_rule")
    o_ref, s_ref = ref(q, k, v, beta, g, scale=scale, initial_state=h0, output_final_state=True)
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(s, s_ref, FLA_TOL, "final state")
    names = ["dq", "dk", "dv", "dbeta", "dg", "dh0"]
    assert_all_close_rms(
        grads_of([o, s], leaves), grads_of([o_ref.double(), s_ref.double()], leaves), names
    )


@pytest.mark.parametrize("scale", [None, 0.7])
def test_chunk_delta_rule_matches_fla(scale):
    leaves = delta_inputs(2, gated=False)
    q, k, v, beta, h0 = leaves
    o, s = ops.chunk_delta_rule(
        q, k, v, beta, scale=scale, initial_state=h0, output_final_state=True, chunk_size=CHUNK
    )
    # fla's reference takes [B, H, T, D] and always scales q by K^-0.5 itself.
    pre = 1.0 if scale is None else scale * K**0.5
    o_ref, s_ref = fla_naive("delta_rule", "delta_rule_recurrence")(
        (q * pre).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), beta.transpose(1, 2),
        initial_state=h0,
    )  # fmt: skip
    o_ref = o_ref.transpose(1, 2)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(s, s_ref, FLA_TOL, "final state")
    assert_all_close_rms(
        grads_of([o, s], leaves),
        grads_of([o_ref.double(), s_ref.double()], leaves),
        ["dq", "dk", "dv", "dbeta", "dh0"],
    )


def test_chunk_delta_rule_qk_l2norm_equals_normalized_inputs():
    """use_qk_l2norm_in_kernel: q and k normalized as fla's kernel does (`fla_l2norm`)."""
    q, k, v, beta, h0 = [x.detach() for x in delta_inputs(3, gated=False)]
    q, k = 3 * q, 1e-3 * k  # norms 3 and 1e-3, where fla's epsilon shows
    o, s = ops.chunk_delta_rule(
        q, k, v, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o_ref, s_ref = ops.chunk_delta_rule(
        fla_l2norm(q), fla_l2norm(k), v, beta, initial_state=h0, output_final_state=True
    )
    torch.testing.assert_close(o, o_ref, **EXACT)
    torch.testing.assert_close(s, s_ref, **EXACT)


def simple_gla_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = randn(gen, B, T, H, K, scale=0.5), randn(gen, B, T, H, K, scale=0.5)
    v = randn(gen, B, T, H, V)
    g = f32_exact(uniform(gen, (B, T, H), 0.8, 1.0).log())
    h0 = randn(gen, B, H, K, V, scale=0.1)
    return [x.requires_grad_(True) for x in (q, k, v, g, h0)]


@pytest.mark.parametrize("scale", [None, 0.7])
def test_chunk_simple_gla_matches_fla(scale):
    leaves = simple_gla_inputs(4)
    q, k, v, g, h0 = leaves
    o, s = ops.chunk_simple_gla(
        q, k, v, g, scale=scale, initial_state=h0, output_final_state=True, chunk_size=CHUNK
    )
    ref = fla_naive("simple_gla", "naive_recurrent_simple_gla")
    o_ref, s_ref = ref(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(s, s_ref, FLA_TOL, "final state")
    assert_all_close_rms(
        grads_of([o, s], leaves),
        grads_of([o_ref.double(), s_ref.double()], leaves),
        ["dq", "dk", "dv", "dg", "dh0"],
    )


def test_chunk_simple_gla_g_gamma_is_a_per_head_log_decay():
    q, k, v, _, h0 = simple_gla_inputs(5)
    gamma = torch.tensor([math.log(0.9), math.log(0.6)], dtype=f64)
    o, s = ops.chunk_simple_gla(q, k, v, g_gamma=gamma, initial_state=h0, output_final_state=True)
    g = gamma.expand(B, T, H)
    o_ref, s_ref = fla_naive("simple_gla", "naive_recurrent_simple_gla")(
        q, k, v, g, initial_state=h0, output_final_state=True
    )
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(s, s_ref, FLA_TOL, "final state")
    # Neither g nor g_gamma: no decay, linear attention.
    o_none, _ = ops.chunk_simple_gla(q, k, v, initial_state=h0)
    o_lin, _ = ops.chunk_linear_attn(q, k, v, initial_state=h0, normalize=False)
    torch.testing.assert_close(o_none, o_lin, **EXACT)


@pytest.mark.parametrize("normalize", [False, True])
def test_chunk_linear_attn_matches_fla(normalize):
    gen = torch.Generator().manual_seed(6)
    # Positive features, so that the normalizer q . z stays away from 0.
    q, k = uniform(gen, (B, T, H, K), 0.1, 1.0), uniform(gen, (B, T, H, K), 0.1, 1.0)
    v = randn(gen, B, T, H, V)
    h0 = randn(gen, B, H, K, V, scale=0.1)
    z0 = uniform(gen, (B, 1, H, K), 0.1, 1.0)
    leaves = [x.requires_grad_(True) for x in (q, k, v, h0, z0)]
    init = (h0, z0) if normalize else h0
    o, s = ops.chunk_linear_attn(
        q, k, v, scale=0.6, initial_state=init, output_final_state=True, normalize=normalize,
        chunk_size=CHUNK,
    )  # fmt: skip
    # fla's reference adds the initial state to a float32 state: it must be float32 too.
    init32 = (h0.float(), z0.float()) if normalize else h0.float()
    o_ref, s_ref = fla_naive("linear_attn", "naive_recurrent_linear_attn")(
        q, k, v, scale=0.6, initial_state=init32, output_final_state=True, normalize=normalize
    )
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    states = list(s) if normalize else [s]
    states_ref = list(s_ref) if normalize else [s_ref]
    for x, x_ref in zip(states, states_ref, strict=True):
        assert_rel_rms(x, x_ref, FLA_TOL, "final state")
    used = leaves if normalize else leaves[:4]
    assert_all_close_rms(
        grads_of([o, *states], used),
        grads_of([o_ref.double(), *(x.double() for x in states_ref)], used),
        ["dq", "dk", "dv", "dh0", "dz0"][: len(used)],
    )


def test_functional_takes_any_spec_with_fla_layout():
    """`functional` on a spec equals the rule's own call with miras's conventions spelled out."""
    rule = miras.compile("specs/gated_deltanet.yaml")
    op = ops.functional(rule, backend="recurrent")
    q, k, v, beta, g, h0 = [x.detach() for x in delta_inputs(7, gated=True)]
    o, s = op(q, k, v, g=g, beta=beta, scale=0.5, initial_state=h0, output_final_state=True)
    o_ref, s_ref = rule(
        q * 0.5, k, v, {"decay": g.exp(), "lr": beta}, backend="recurrent",
        initial_state=h0.transpose(-1, -2), output_final_state=True,
    )  # fmt: skip
    torch.testing.assert_close(o, o_ref, **EXACT)
    torch.testing.assert_close(s, s_ref.transpose(-1, -2), **EXACT)
    o_vf, s_vf = op(q, k, v, g=g, beta=beta, scale=0.5, initial_state=h0.transpose(-1, -2),
                    output_final_state=True, state_v_first=True)  # fmt: skip
    torch.testing.assert_close(o_vf, o_ref, **EXACT)
    torch.testing.assert_close(s_vf, s_ref, **EXACT)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda a: ops.chunk_delta_rule(*a[:3], a[3], foo=1), ["chunk_delta_rule", "foo"]),
        (lambda a: ops.functional("specs/deltanet.yaml")(*a[:3], g=a[4], beta=a[3]), ["g", "decay"]),
        (lambda a: ops.functional("specs/gated_deltanet.yaml")(*a[:3], beta=a[3]), ["g", "log"]),
        (lambda a: ops.chunk_gated_delta_rule(*a[:5], scale="x"), ["scale"]),
        (lambda a: ops.chunk_gated_delta_rule(*a[:5], allow_neg_eigval=True), ["allow_neg_eigval"]),
        (lambda a: ops.chunk_simple_gla(*a[:3], a[4], g_gamma=a[4]), ["g_gamma", "not both"]),
        (lambda a: ops.chunk_simple_gla(*a[:3], g_gamma=a[4]), ["g_gamma", "[H]"]),
    ],
)  # fmt: skip
def test_bad_arguments_raise_named_value_errors(call, words):
    q, k, v, beta, g, _ = [x.detach() for x in delta_inputs(8, gated=True)]
    with pytest.raises(ValueError) as err:
        call((q, k, v, beta, g))
    for word in words:
        assert word in str(err.value)


# Packed sequences -----------------------------------------------------------------------------

CU = [0, 3, 11, 20]  # three sequences, one shorter than a chunk, one crossing chunk ends
TITANS_MATRIX = {
    "name": "titans_matrix",
    "memory": "matrix",
    "bias": "l2",
    "retention": "l2",
    "optimizer": "momentum",
}
PACKED_CASES = {
    # name: (spec, run options); the state is a tensor, a momentum dict, a window dict, a
    # deep memory's dict.
    "gdn-recurrent": ("specs/gated_deltanet.yaml", dict(backend="recurrent")),
    "gdn-chunk-exact": ("specs/gated_deltanet.yaml", dict(chunk_size=4, chunk_mode="exact")),
    "gdn-chunk-start": ("specs/gated_deltanet.yaml", dict(chunk_size=4, chunk_mode="start")),
    "titans_matrix-chunk": (TITANS_MATRIX, dict(chunk_size=4)),
    "swla-chunk": ("specs/swla.yaml", dict(chunk_size=4)),
    "swla-recurrent": ("specs/swla.yaml", dict(backend="recurrent")),
    "titans-chunk": ("specs/titans.yaml", dict(chunk_size=4)),
}


def packed_inputs(rule, seed, n):
    gen = torch.Generator().manual_seed(seed)
    q, k = unit_rows(gen, 1, T, H, K), unit_rows(gen, 1, T, H, K)
    v = randn(gen, 1, T, H, K)  # Dv = Dk: a deep memory's residual form needs it
    ranges = {"decay": (0.8, 1.0), "lr": (0.1, 0.9), "momentum": (0.0, 0.9), "gamma": (0.5, 1.5)}
    gates = {name: uniform(gen, (1, T, H), *ranges[name]) for name in rule.gates}
    default = rule.initial_state(n, H, K, K, dtype=f64)
    if isinstance(default, torch.Tensor):
        init = randn(gen, *default.shape, scale=0.1)
    else:
        init = {name: randn(gen, *x.shape, scale=0.1) for name, x in default.items()}
    return q, k, v, gates, init


def leaves_of(q, k, v, gates, init):
    states = [init] if isinstance(init, torch.Tensor) else [init[n] for n in sorted(init)]
    return [q, k, v, *gates.values(), *states]


def state_tensors(state):
    return [state] if isinstance(state, torch.Tensor) else [state[n] for n in sorted(state)]


@pytest.mark.parametrize("case", sorted(PACKED_CASES))
def test_packed_sequences_equal_each_sequence_alone(case):
    spec, options = PACKED_CASES[case]
    rule = miras.compile(spec)
    n = len(CU) - 1
    q, k, v, gates, init = packed_inputs(rule, 9, n)
    leaves = [x.requires_grad_(True) for x in leaves_of(q, k, v, gates, init)]
    o, state = rule(
        q, k, v, gates, initial_state=init, output_final_state=True,
        cu_seqlens=torch.tensor(CU), **options,
    )  # fmt: skip
    assert o.shape == (1, T, H, K)
    outputs = [o, *state_tensors(state)]
    grads = grads_of(outputs, leaves)

    # Each sequence alone, on its own copies of the leaves; the pieces joined afterwards.
    outs, finals, alone_grads = [], [], []
    for i in range(n):
        span = slice(CU[i], CU[i + 1])
        qi, ki, vi = (x.detach()[:, span].clone().requires_grad_(True) for x in (q, k, v))
        gi = {name: g.detach()[:, span].clone().requires_grad_(True) for name, g in gates.items()}
        if isinstance(init, torch.Tensor):
            si = init.detach()[i : i + 1].clone().requires_grad_(True)
        else:
            si = {
                name: x.detach()[i : i + 1].clone().requires_grad_(True) for name, x in init.items()
            }
        oi, fi = rule(qi, ki, vi, gi, initial_state=si, output_final_state=True, **options)
        outs.append(oi)
        finals.append(state_tensors(fi))
        alone_grads.append((oi, fi, leaves_of(qi, ki, vi, gi, si)))
    o_alone = torch.cat(outs, dim=1)
    states_alone = [torch.cat(parts) for parts in zip(*finals, strict=True)]
    torch.testing.assert_close(o, o_alone, **EXACT)
    for x, x_alone in zip(state_tensors(state), states_alone, strict=True):
        torch.testing.assert_close(x, x_alone, **EXACT)

    # The same random functional, split by sequence: its gradient per sequence, joined.
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(x.shape, generator=gen, dtype=f64) for x in outputs]
    per_seq = []
    for i, (oi, fi, li) in enumerate(alone_grads):
        span = slice(CU[i], CU[i + 1])
        loss = (oi * weights[0][:, span]).sum() + sum(
            (x * w[i : i + 1]).sum() for x, w in zip(state_tensors(fi), weights[1:], strict=True)
        )
        per_seq.append(torch.autograd.grad(loss, li))
    n_seq_leaves = 3 + len(gates)  # q, k, v and the gates: cut along T; the states: along N
    for j, g in enumerate(grads):
        joined = torch.cat([p[j] for p in per_seq], dim=1 if j < n_seq_leaves else 0)
        torch.testing.assert_close(g, joined, **EXACT)


def test_packed_sequences_through_the_fla_alias():
    """cu_seqlens through `chunk_gated_delta_rule`: per-sequence states in fla's layout,
    each equal to fla's reference on that sequence alone."""
    gen = torch.Generator().manual_seed(10)
    q, k = unit_rows(gen, 1, T, H, K), unit_rows(gen, 1, T, H, K)
    v = randn(gen, 1, T, H, V)
    beta = uniform(gen, (1, T, H), 0.1, 0.9)
    g = f32_exact(uniform(gen, (1, T, H), 0.8, 1.0).log())
    h0 = randn(gen, len(CU) - 1, H, K, V, scale=0.1)
    o, s = ops.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True,
        cu_seqlens=torch.tensor(CU), chunk_size=CHUNK,
    )  # fmt: skip
    assert s.shape == (len(CU) - 1, H, K, V)
    ref = fla_naive("gated_delta_rule", "naive_recurrent_gated_delta_rule")
    for i in range(len(CU) - 1):
        span = slice(CU[i], CU[i + 1])
        o_ref, s_ref = ref(
            q[:, span], k[:, span], v[:, span], beta[:, span], g[:, span],
            initial_state=h0[i : i + 1], output_final_state=True,
        )  # fmt: skip
        assert_rel_rms(o[:, span], o_ref, FLA_TOL, f"o of sequence {i}")
        assert_rel_rms(s[i : i + 1], s_ref, FLA_TOL, f"state of sequence {i}")


def test_packed_sequences_on_triton():
    rule = miras.compile("specs/retnet.yaml")
    cu = [0, 2, 5]
    gen = torch.Generator().manual_seed(11)
    q, k, v = (randn(gen, 1, 5, 1, 4) for _ in range(3))
    gates = {"decay": uniform(gen, (1, 5, 1), 0.8, 1.0)}
    options = dict(backend="triton", chunk_size=2, output_final_state=True)
    o, s = rule(q, k, v, gates, cu_seqlens=torch.tensor(cu), **options)
    for i in range(2):
        span = slice(cu[i], cu[i + 1])
        part = {"decay": gates["decay"][:, span]}
        o_i, s_i = rule(q[:, span], k[:, span], v[:, span], part, **options)
        torch.testing.assert_close(o[:, span], o_i, **EXACT)
        torch.testing.assert_close(s[i : i + 1], s_i, **EXACT)


@pytest.mark.parametrize(
    ("cu", "batch", "init_n", "words"),
    [
        ([0, 5, 20], 2, None, ["cu_seqlens", "B = 1"]),
        ([0, 5, 19], 1, None, ["cu_seqlens", "T = 20"]),
        ([1, 5, 20], 1, None, ["cu_seqlens", "start at 0"]),
        ([0, 5, 5, 20], 1, None, ["cu_seqlens", "increasing"]),
        ([0.0, 20.0], 1, None, ["cu_seqlens", "integer"]),
        ([0, 5, 20], 1, 3, ["initial_state", "N = 2"]),
    ],
)
def test_bad_cu_seqlens_raise_named_value_errors(cu, batch, init_n, words):
    rule = miras.compile("specs/deltanet.yaml")
    gen = torch.Generator().manual_seed(12)
    q, k, v = (randn(gen, batch, T, H, K) for _ in range(3))
    init = None if init_n is None else torch.zeros(init_n, H, K, K, dtype=f64)
    with pytest.raises(ValueError) as err:
        rule(q, k, v, {"lr": 0.5}, cu_seqlens=torch.tensor(cu), initial_state=init)
    for word in words:
        assert word in str(err.value)


# Scalar gates ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_scalar_gates_equal_the_broadcast_tensor(backend):
    rule = miras.compile("specs/gated_deltanet.yaml")
    gen = torch.Generator().manual_seed(13)
    q, k = unit_rows(gen, B, T, H, K), unit_rows(gen, B, T, H, K)
    v = randn(gen, B, T, H, V)
    scalars = {"decay": 0.9, "lr": 1}  # a float and an int
    tensors = {n: torch.full((B, T, H), float(x), dtype=f64) for n, x in scalars.items()}
    options = dict(backend=backend, chunk_size=CHUNK, output_final_state=True)
    o, s = rule(q, k, v, scalars, **options)
    o_ref, s_ref = rule(q, k, v, tensors, **options)
    torch.testing.assert_close(o, o_ref, **EXACT)
    torch.testing.assert_close(s, s_ref, **EXACT)
    # Through the fla convention: a float log-decay g.
    o_ops, _ = ops.functional(rule, backend=backend, chunk_size=CHUNK)(
        q, k, v, g=math.log(0.9), beta=1.0, scale=1.0
    )
    torch.testing.assert_close(o_ops, o_ref, **EXACT)


# Padding masks in MirasLayer ------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("persistent", [0, 2])
def test_padded_batch_equals_the_unpadded_sequences(padding, persistent):
    """A padded batch through MirasLayer with `attention_mask` equals each sequence alone
    (outputs and input gradients); padding outputs 0 and gets no gradient."""
    from miras.models import MirasLayer

    torch.manual_seed(14)
    layer = MirasLayer(
        "specs/gated_deltanet.yaml", 8, 2, chunk_size=4, persistent_tokens=persistent
    ).double()
    lengths, t_max = [5, 9, 1], 9
    seqs = [torch.randn(1, n, 8, dtype=f64, requires_grad=True) for n in lengths]
    rows, mask = [], torch.zeros(len(lengths), t_max, dtype=torch.long)
    for b, s in enumerate(seqs):
        pad = torch.zeros(1, t_max - s.shape[1], 8, dtype=f64)
        rows.append(torch.cat([pad, s] if padding == "left" else [s, pad], dim=1))
        span = slice(t_max - s.shape[1], t_max) if padding == "left" else slice(0, s.shape[1])
        mask[b, span] = 1
    x = torch.cat(rows).detach().requires_grad_(True)
    y, cache = layer(x, attention_mask=mask)
    assert cache is None and y.shape == x.shape
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(15), dtype=f64)
    (dx,) = torch.autograd.grad((y * w).sum(), [x])
    for b, s in enumerate(seqs):
        span = mask[b].bool()
        y_b, _ = layer(s)
        (ds,) = torch.autograd.grad((y_b * w[b : b + 1, span]).sum(), [s])
        torch.testing.assert_close(y[b, span], y_b[0], **EXACT)
        torch.testing.assert_close(dx[b, span], ds[0], **EXACT)
        assert bool((y[b, ~span] == 0).all()) and bool((dx[b, ~span] == 0).all())


@pytest.mark.parametrize(
    ("mask", "words"),
    [
        (torch.tensor([[1, 0, 1]]), ["attention_mask", "contiguous"]),
        (torch.tensor([[1, 2, 1]]), ["attention_mask", "0 (padding) or 1"]),
        (torch.tensor([[1, 1]]), ["attention_mask", "[1, 3]"]),
    ],
)
def test_bad_attention_mask_raises_named_value_error(mask, words):
    from miras.models import MirasLayer

    layer = MirasLayer("specs/deltanet.yaml", 8, 2)
    with pytest.raises(ValueError) as err:
        layer(torch.randn(1, 3, 8), attention_mask=mask)
    for word in words:
        assert word in str(err.value)


# fla 0.6's conventions: grouped value heads, V-first states, head_first, cu_seqlens' companions

GROUP = 3  # HV = 3 H: value head j reads key head j // 3 (a tiled head order cannot pass)
HEAD_FIRST_REMOVED = "head_first has been removed. Inputs must be in `[B, T, H, ...]` format."


def grouped_inputs(seed, batch, n_states, *, gated=True):
    """q, k [batch, T, H, K]; v [batch, T, HV, V]; beta, g [batch, T, HV]; h0 [N, HV, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    hv = GROUP * H
    q, k = unit_rows(gen, batch, T, H, K), unit_rows(gen, batch, T, H, K)
    v = randn(gen, batch, T, hv, V)
    beta = uniform(gen, (batch, T, hv), 0.1, 0.9)
    g = f32_exact(uniform(gen, (batch, T, hv), 0.8, 1.0).log())
    h0 = randn(gen, n_states, hv, K, V, scale=0.1)
    leaves = [q, k, v, beta, g, h0] if gated else [q, k, v, beta, h0]
    return [x.requires_grad_(True) for x in leaves]


def key_head_of_each_value_head(x):
    """[B, T, H, K] -> [B, T, HV, K]: value head j takes key head j // (HV // H), as fla's
    kernels index it (`i_h // (HV // H)`)."""
    return x[:, :, torch.arange(GROUP * H) // GROUP]


def per_sequence(ref, spans, tensors, h0, **kwargs):
    """fla's reference on each sequence alone (spans along T, one initial state each),
    the outputs joined along T and the states along N."""
    outs, states = [], []
    for i, span in enumerate(spans):
        o_i, s_i = ref(*(x[:, span] for x in tensors), initial_state=h0[i : i + 1], **kwargs)
        outs.append(o_i)
        states.append(s_i)
    return torch.cat(outs, dim=1), torch.cat(states)


@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv_state", "vk_state"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "cu_seqlens"])
def test_chunk_gated_delta_rule_grouped_value_heads_match_fla(packed, state_v_first):
    """v with HV = 3 H heads, gates and states per value head, against fla's reference run
    per value head on its key head: outputs, final states and every gradient."""
    batch, spans = (1, [slice(a, b) for a, b in itertools.pairwise(CU)]) if packed else (B, None)
    leaves = grouped_inputs(20, batch, len(CU) - 1 if packed else B)
    q, k, v, beta, g, h0 = leaves
    o, s = ops.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0.transpose(-1, -2) if state_v_first else h0,
        output_final_state=True, state_v_first=state_v_first,
        cu_seqlens=torch.tensor(CU) if packed else None, chunk_size=CHUNK,
    )  # fmt: skip
    assert o.shape == (batch, T, GROUP * H, V)
    s_kv = s.transpose(-1, -2) if state_v_first else s
    ref = fla_naive("gated_delta_rule", "naive_recurrent_gated_delta_rule")
    qg, kg = key_head_of_each_value_head(q), key_head_of_each_value_head(k)
    if packed:
        o_ref, s_ref = per_sequence(ref, spans, [qg, kg, v, beta, g], h0, output_final_state=True)
    else:
        o_ref, s_ref = ref(qg, kg, v, beta, g, initial_state=h0, output_final_state=True)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(s_kv, s_ref, FLA_TOL, "final state")
    assert_all_close_rms(
        grads_of([o, s_kv], leaves),
        grads_of([o_ref.double(), s_ref.double()], leaves),
        ["dq", "dk", "dv", "dbeta", "dg", "dh0"],
    )


def test_chunk_simple_gla_v_first_packed_states_match_fla():
    """state_v_first with cu_seqlens: [N, H, V, K] states in and out, each the transpose of
    fla's reference state on that sequence alone."""
    gen = torch.Generator().manual_seed(21)
    q, k = randn(gen, 1, T, H, K, scale=0.5), randn(gen, 1, T, H, K, scale=0.5)
    v = randn(gen, 1, T, H, V)
    g = f32_exact(uniform(gen, (1, T, H), 0.8, 1.0).log())
    h0 = randn(gen, len(CU) - 1, H, K, V, scale=0.1)
    leaves = [x.requires_grad_(True) for x in (q, k, v, g, h0)]
    o, s = ops.chunk_simple_gla(
        q, k, v, g, initial_state=h0.transpose(-1, -2), output_final_state=True,
        state_v_first=True, cu_seqlens=torch.tensor(CU), chunk_size=CHUNK,
    )  # fmt: skip
    assert s.shape == (len(CU) - 1, H, V, K)
    spans = [slice(a, b) for a, b in itertools.pairwise(CU)]
    ref = fla_naive("simple_gla", "naive_recurrent_simple_gla")
    o_ref, s_ref = per_sequence(ref, spans, [q, k, v, g], h0, output_final_state=True)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(s.transpose(-1, -2), s_ref, FLA_TOL, "final state")
    assert_all_close_rms(
        grads_of([o, s.transpose(-1, -2)], leaves),
        grads_of([o_ref.double(), s_ref.double()], leaves),
        ["dq", "dk", "dv", "dg", "dh0"],
    )


def fla_l2norm(x):
    """fla's l2norm kernel: x / sqrt(sum(x^2) + 1e-6) over the last axis."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def test_chunk_gated_delta_rule_qk_l2norm_in_kernel_matches_fla():
    """use_qk_l2norm_in_kernel with fla's epsilon inside the root: rows of norm 1e-3 come out
    of norm 0.71, not 1 (an L2 normalization without fla's epsilon)."""
    q, k, v, beta, g, h0 = [x.detach() for x in grouped_inputs(22, B, B)]
    q, k = (f32_exact(1e-3 * x).requires_grad_(True) for x in (q, k))
    leaves = [q, k, v.requires_grad_(True), h0.requires_grad_(True)]
    o, s = ops.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, chunk_size=CHUNK,
    )  # fmt: skip
    ref = fla_naive("gated_delta_rule", "naive_recurrent_gated_delta_rule")
    qn, kn = (key_head_of_each_value_head(fla_l2norm(x)) for x in (q, k))
    o_ref, s_ref = ref(qn, kn, v, beta, g, initial_state=h0, output_final_state=True)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(s, s_ref, FLA_TOL, "final state")
    assert_all_close_rms(
        grads_of([o, s], leaves),
        grads_of([o_ref.double(), s_ref.double()], leaves),
        ["dq", "dk", "dv", "dh0"],
    )


ALIAS_CALLS = {
    # name: a call of the alias on delta_inputs' (q, k, v, beta, g), extra keyword arguments
    "chunk_delta_rule": lambda a, **kw: ops.chunk_delta_rule(*a[:4], **kw),
    "chunk_gated_delta_rule": lambda a, **kw: ops.chunk_gated_delta_rule(*a[:3], a[4], a[3], **kw),
    "chunk_simple_gla": lambda a, **kw: ops.chunk_simple_gla(*a[:3], a[4], **kw),
}


@pytest.mark.parametrize("alias", sorted(ALIAS_CALLS))
def test_head_first_is_refused_with_fla_wording(alias):
    args = [x.detach() for x in delta_inputs(23, gated=True)][:5]
    with pytest.raises(ValueError) as err:
        ALIAS_CALLS[alias](args, head_first=True)
    assert alias in str(err.value) and HEAD_FIRST_REMOVED in str(err.value)
    # head_first=False names the layout taken anyway: the same call.
    o, _ = ALIAS_CALLS[alias](args, head_first=False, chunk_size=CHUNK)
    o_ref, _ = ALIAS_CALLS[alias](args, chunk_size=CHUNK)
    torch.testing.assert_close(o, o_ref, **EXACT)


@pytest.mark.parametrize("alias", sorted(ALIAS_CALLS))
def test_cu_seqlens_companions_that_agree_change_nothing(alias):
    """cu_seqlens_cpu (and chunk_indices where fla's op takes it) built by fla's own
    prepare_chunk_indices are accepted, with the same result as cu_seqlens alone."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns at import that Triton has no GPU here
        from fla.ops.utils.index import prepare_chunk_indices

    gen = torch.Generator().manual_seed(24)
    q, k = unit_rows(gen, 1, T, H, K), unit_rows(gen, 1, T, H, K)
    v = randn(gen, 1, T, H, V)
    beta = uniform(gen, (1, T, H), 0.1, 0.9)
    g = f32_exact(uniform(gen, (1, T, H), 0.8, 1.0).log())
    cu = torch.tensor(CU)
    extra = dict(cu_seqlens_cpu=cu.clone())
    if alias == "chunk_gated_delta_rule":
        extra["chunk_indices"] = prepare_chunk_indices(cu, CHUNK)
    call = ALIAS_CALLS[alias]
    o, s = call(
        [q, k, v, beta, g], cu_seqlens=cu, output_final_state=True, chunk_size=CHUNK, **extra
    )
    o_ref, s_ref = call(
        [q, k, v, beta, g], cu_seqlens=cu, output_final_state=True, chunk_size=CHUNK
    )
    torch.testing.assert_close(o, o_ref, **EXACT)
    torch.testing.assert_close(s, s_ref, **EXACT)


def packed_gdn_args():
    gen = torch.Generator().manual_seed(25)
    q, k = unit_rows(gen, 1, T, H, K), unit_rows(gen, 1, T, H, K)
    v = randn(gen, 1, T, H, V)
    beta = uniform(gen, (1, T, H), 0.1, 0.9)
    g = f32_exact(uniform(gen, (1, T, H), 0.8, 1.0).log())
    return q, k, v, g, beta


def fla_chunk_indices(size):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.utils.index import prepare_chunk_indices
    return prepare_chunk_indices(torch.tensor(CU), size)


def wrong_row(indices):
    indices = indices.clone()
    indices[2, 1] += 1
    return indices


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (dict(cu_seqlens_cpu=torch.tensor([0, 3, 12, 20])), ["cu_seqlens_cpu", "[0, 3, 11, 20]"]),
        (dict(cu_seqlens_cpu=torch.tensor(CU, device="meta")), ["cu_seqlens_cpu", "CPU"]),
        (dict(cu_seqlens_cpu=CU), ["cu_seqlens_cpu", "list"]),
        (dict(chunk_indices=fla_chunk_indices(64)), ["chunk_indices", "chunk_size=8", "[4, 2]"]),
        (dict(chunk_indices=wrong_row(fla_chunk_indices(8))), ["chunk_indices", "row 2"]),
        (dict(chunk_indices=fla_chunk_indices(8).float()), ["chunk_indices", "float32"]),
        (dict(cu_seqlens=None, cu_seqlens_cpu=torch.tensor(CU)), ["cu_seqlens_cpu", "without"]),
        (dict(cu_seqlens=None, chunk_indices=fla_chunk_indices(8)), ["chunk_indices", "without"]),
    ],
    ids=[
        "cpu_copy_differs", "cpu_copy_not_on_cpu", "cpu_copy_not_a_tensor", "indices_other_chunk",
        "indices_wrong_row", "indices_float", "cpu_copy_alone", "indices_alone",
    ],
)  # fmt: skip
def test_cu_seqlens_companions_that_disagree_raise_named_value_errors(extra, words):
    options = dict(cu_seqlens=torch.tensor(CU), chunk_size=CHUNK) | extra
    with pytest.raises(ValueError) as err:
        ops.chunk_gated_delta_rule(*packed_gdn_args(), **options)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda q, k, v: ops.chunk_gated_delta_rule(q, k, v[:, :, :3], 0.0, 0.5), ["HV=3", "H=2"]),
        (lambda q, k, v: ops.chunk_gated_delta_rule(q, k[:, :, :1], v, 0.0, 0.5), ["q and k"]),
        (lambda q, k, v: ops.chunk_delta_rule(q, k, v, 0.5), ["chunk_delta_rule", "HV=6"]),
        (lambda q, k, v: ops.chunk_simple_gla(q, k, v), ["chunk_simple_gla", "HV=6"]),
        (lambda q, k, v: ops.chunk_linear_attn(q, k, v), ["chunk_linear_attn", "HV=6"]),
    ],
    ids=["hv_not_a_multiple", "q_k_heads_differ", "delta_rule", "simple_gla", "linear_attn"],
)
def test_bad_value_heads_raise_named_value_errors(call, words):
    q, k, v = [x.detach() for x in grouped_inputs(26, B, B)][:3]
    with pytest.raises(ValueError) as err:
        call(q, k, v)
    for word in words:
        assert word in str(err.value)
