"""The Triton backend against the chunk backend, forward and backward, and the emitted sources
against their golden copies.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py before anything
imports triton), in float32, with every output buffer poisoned with NaN before a launch and
checked written after it (MIRAS_TRITON_CHECK=1). The interpreter is slow, so the cases are a
covering set (each bias, retention, optimizer, feature map, window, length, width, chunk size,
gate layout and kernel at least once), not the cross product; shapes stay small.

Golden files: `MIRAS_UPDATE_GOLDEN=1 pytest tests/kernels/test_triton.py -k golden` rewrites them;
review the diff and commit it with the compiler change that caused it.
"""

import os
from pathlib import Path

import pytest
import torch

import miras
from miras.compiler.pipeline import kernel_source
from miras.runtime import triton_backend
from tests.helpers import random_inputs

TOL = 1e-5  # relative RMS, float32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.fixture(autouse=True)
def _check_every_output_written(monkeypatch):
    """Outputs are NaN-poisoned before each launch; this makes the backend check them after."""
    monkeypatch.setenv(triton_backend.CHECK_ENV, "1")


# name: (spec fields, shapes). Which kernel runs: `linear` for retention none/l2 with a per-head
# decay and gd, `general` for the rest (per-channel decay, momentum, Nesterov, nonlinear
# retentions).
CASES = {
    # linear kernel
    "linear_attention": (
        dict(bias="dot", retention="none", optimizer={"kind": "gd", "lr": 1}),
        dict(t=100, d=32, chunk=32),
    ),
    "deltanet_channel_lr": (
        dict(bias="l2", retention="none"),
        dict(t=63, d=16, chunk=16, per_channel=True),
    ),
    "gated_deltanet": (
        dict(bias="l2", retention={"kind": "l2", "grad_at": "retained"}),
        dict(t=100, d=16, chunk=16),
    ),
    "omeganet_poly_window3": (
        dict(
            feature_map={"kind": "polynomial", "degree": 2},
            retention="l2",
            window={"c": 3, "gamma": "gate"},
        ),
        dict(t=63, d=16, chunk=16),
    ),
    "logcosh_short": (
        dict(
            bias={"kind": "custom", "loss": "a*log(cosh(e/a))", "params": {"a": "gate"}},
            retention={"kind": "l2", "decay": 0.95},
        ),
        dict(t=20, d=32, chunk=32),
    ),
    "huber_retained_window2_blocks": (  # value channels in two blocks of 16
        dict(bias="huber", retention={"kind": "l2", "grad_at": "retained"}, window=2),
        dict(t=50, d=32, chunk=16, block_v=16),
    ),
    "cauchy_linear": (  # a bias with channel sums, on the linear kernel
        dict(bias={"kind": "custom", "loss": "log(1 + sum(e**2))"}, retention="l2"),
        dict(t=50, d=16, chunk=16),
    ),
    # general kernel
    "retnet_channel_decay": (
        dict(bias="dot", retention="l2", optimizer={"kind": "gd", "lr": 1}),
        dict(t=50, d=16, chunk=16, per_channel=True),
    ),
    "huber_momentum_channel": (
        dict(bias="huber", retention="l2", optimizer="momentum"),
        dict(t=50, d=16, chunk=16, per_channel=True),
    ),
    "huber_momentum_window2_blocks": (  # general: value channels in blocks of 16 and 8
        dict(bias="huber", retention="l2", optimizer="momentum", window=2),
        dict(t=40, d=24, chunk=16, per_channel=True, general_block_v=16),
    ),
    "lp_lq": (
        dict(bias={"kind": "lp", "p": 3}, retention={"kind": "lq", "q": 4}),
        dict(t=20, d=16, chunk=32),
    ),
    "robust_elastic_channel": (
        dict(bias={"kind": "robust", "radius": "gate"}, retention="elastic_net"),
        dict(t=50, d=16, chunk=16, per_channel=True),
    ),
    "kl_momentum_window2_channel": (
        dict(bias="l2", retention="kl", optimizer="momentum", window={"c": 2, "gamma": "gate"}),
        dict(t=63, d=32, chunk=32, per_channel=True),
    ),
    "fixed_momentum": (
        dict(
            bias="l2", retention="none", optimizer={"kind": "momentum", "lr": 0.5, "momentum": 0.9}
        ),
        dict(t=30, d=16, chunk=16),
    ),
    "nesterov_channel": (  # an update u_t = theta_t S_t + lr_t g_t, printed from the record
        dict(bias="l2", retention="l2", optimizer="nesterov"),
        dict(t=30, d=16, chunk=16, per_channel=True),
    ),
    "nesterov_fixed_lr": (  # the step size fixed: a literal in the block phase
        dict(bias="l2", retention="none", optimizer={"kind": "nesterov", "lr": 0.5}),
        dict(t=20, d=16, chunk=16),
    ),
    "cauchy_kl": (
        dict(bias={"kind": "custom", "loss": "log(1 + sum(e**2))"}, retention="kl"),
        dict(t=20, d=16, chunk=32),
    ),
    "poly_bregman_window3": (
        dict(
            feature_map={"kind": "polynomial", "degree": 2},
            bias={"kind": "custom", "loss": "log(cosh(e))"},
            retention="bregman",
            window=3,
        ),
        dict(t=20, d=16, chunk=16),
    ),
}


def _flat(state):
    return list(state.values()) if isinstance(state, dict) else [state]


def _run(rule, backend, inputs, chunk, seed=7):
    """o, the final state and the gradients of a random projection of both with respect to
    q, k, v, every gate, the initial state and the feature map's parameters."""
    q, k, v, gates, init, params = inputs
    leaves_qkv = [x.clone().requires_grad_(True) for x in (q, k, v, *gates.values())]
    q_, k_, v_, *g_ = leaves_qkv
    init_ = [s.clone().requires_grad_(True) for s in _flat(init)]
    state = dict(zip(init, init_, strict=True)) if isinstance(init, dict) else init_[0]
    params_ = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    # chunk_mode "start": the emitted kernels' form (the exact form: tests/kernels/test_triton_exact.py).
    o, final = rule(
        q_, k_, v_, dict(zip(gates, g_, strict=True)), backend=backend, chunk_size=chunk,
        chunk_mode="start", initial_state=state, output_final_state=True, params=params_,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    outputs = [o, *_flat(final)]
    weights = [
        torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype) for x in outputs
    ]
    loss = sum((x * w).sum() for x, w in zip(outputs, weights, strict=True))
    leaves = [*leaves_qkv, *init_, *params_.values()]
    grads = torch.autograd.grad(loss, leaves)
    names = ["o", *(f"final {n}" for n in (final if isinstance(final, dict) else ["W"]))]
    names += ["dq", "dk", "dv", *(f"d {n}" for n in gates)]
    names += [f"d init {n}" for n in (init if isinstance(init, dict) else ["W"])]
    names += [f"d {n}" for n in params]
    return dict(zip(names, [*outputs, *grads], strict=True))


def _initial_state(rule, b, h, d):
    """A random start inside the retention's domain (not the default zeros or uniform rows),
    so that the initial state's own terms are exercised and KL's rows are not flat."""
    gen = torch.Generator().manual_seed(3)
    init = rule.initial_state(b, h, d, d, torch.float32)
    domain = rule.spec.retention.domain()

    def draw(s):
        x = torch.randn(s.shape, generator=gen)
        if domain == "positive":
            return getattr(rule.spec.retention, "scale", 1.0) * torch.softmax(x, dim=-1)
        if domain == "unit_interval":
            return torch.sigmoid(x)
        return 0.1 * x

    if isinstance(init, dict):  # momentum: W and S.W
        return {
            n: draw(s) if n == "W" else 0.1 * torch.randn(s.shape, generator=gen)
            for n, s in init.items()
        }
    return draw(init)


def _to_device(tree):
    if isinstance(tree, torch.Tensor):
        return tree.to(DEVICE)
    if isinstance(tree, dict):
        return {n: _to_device(x) for n, x in tree.items()}
    return type(tree)(_to_device(x) for x in tree)


def _rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(1e-30))


def _mismatches(got: dict, want: dict, tol: float) -> dict[str, str]:
    """Every entry of `want` compared, by relative RMS; an all-zero reference has no scale to be
    relative to, so there the largest |got| must be at most `tol` (an absolute tolerance on
    inputs and outputs of order 1). A NaN anywhere fails either comparison."""
    bad = {}
    for n, w in want.items():
        if torch.count_nonzero(w) == 0:
            err, what = float(got[n].detach().abs().max()), "max |got|, reference all zero"
        else:
            err, what = _rel_rms(got[n], w), "relative RMS"
        if not err <= tol:
            bad[n] = f"{what} {err:.2e}"
    return bad


# The slowest under the interpreter (90 s and 26 s on 2 cores): `pytest -m "not slow"` skips them.
SLOW_CASES = {"kl_momentum_window2_channel", "robust_elastic_channel"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES]
)
def test_triton_equals_chunk(name, monkeypatch):
    fields, shape = CASES[name]
    if "block_v" in shape:
        monkeypatch.setattr(triton_backend, "LINEAR_BLOCK_V", shape["block_v"])
    if "general_block_v" in shape:
        monkeypatch.setattr(triton_backend, "GENERAL_BLOCK_V", shape["general_block_v"])
    rule = miras.compile({"name": name.replace("_", "-"), **fields})
    b, h, d = 1, 2, shape["d"]
    q, k, v, gates = random_inputs(
        rule, b=b, t=shape["t"], h=h, dk=d, dv=d, per_channel=shape.get("per_channel", False),
        dtype=torch.float32,
    )  # fmt: skip
    if "gamma" in gates and gates["gamma"].dim() == 4:
        gates["gamma"] = gates["gamma"][..., 0]  # gamma weighs a whole term: per head only
    init = _initial_state(rule, b, h, d)
    params = rule.default_params(torch.float32)
    inputs = _to_device((q, k, v, gates, init, params))
    seen = []
    real = triton_backend.ChunkKernels.apply
    monkeypatch.setattr(
        triton_backend.ChunkKernels,
        "apply",
        lambda launch, *a: seen.append(launch) or real(launch, *a),
    )
    want = _run(rule, "chunk", inputs, shape["chunk"])
    got = _run(rule, "triton", inputs, shape["chunk"])
    if "block_v" in shape or "general_block_v" in shape:  # the split is what the case tests
        assert [s.n_value_blocks for s in seen] == [2]
    assert list(got) == list(want)
    bad = _mismatches(got, want, TOL)
    assert not bad, f"above {TOL}: {bad}"


@pytest.mark.parametrize(
    ("fields", "blocks"),
    [
        (dict(bias="huber", retention="l2", optimizer="momentum"), 4),
        (dict(bias="l2", retention="kl", optimizer="momentum"), 4),  # KL's softmax is per row
        (dict(bias="l2", retention={"kind": "lq", "q": 4}), 1),  # l_q's norm: the whole matrix
        (dict(bias={"kind": "custom", "loss": "log(1 + sum(e**2))"}, retention="kl"), 1),
    ],
    ids=["elementwise", "kl", "lq_read", "channel_sums"],
)
def test_the_general_kernels_split_rows_that_evolve_apart(fields, blocks):
    """At Dv = 128 the general kernels give each program 32 value channels when the rows of W
    evolve apart (an elementwise bias, reads of one row at a time), and all of them otherwise."""
    rule = miras.compile({"name": "general-split", **fields})
    linear, block_v = triton_backend.choose_kernels(rule.program, 128, 128, True)
    assert not linear and 128 // block_v == blocks


@pytest.mark.parametrize("name", ["huber_retained_window2_blocks", "kl_momentum_window2_channel"])
def test_float64_agrees_to_rounding(name):
    """In float64 the kernels run in float64: the two backends agree to rounding, so every
    derivative the kernels use is the exact one."""
    fields, shape = CASES[name]
    rule = miras.compile({"name": name.replace("_", "-"), **fields})
    q, k, v, gates = random_inputs(
        rule, b=1, t=20, h=2, dk=16, dv=16, per_channel=shape.get("per_channel", False),
    )  # fmt: skip
    if "gamma" in gates and gates["gamma"].dim() == 4:
        gates["gamma"] = gates["gamma"][..., 0]
    init = _initial_state(rule, 1, 2, 16)
    init = {n: s.double() for n, s in init.items()} if isinstance(init, dict) else init.double()
    inputs = _to_device((q, k, v, gates, init, rule.default_params(torch.float64)))
    want = _run(rule, "chunk", inputs, 16)
    got = _run(rule, "triton", inputs, 16)
    bad = _mismatches(got, want, 1e-12)
    assert not bad, f"above 1e-12: {bad}"


def test_two_pieces_equal_one_pass():
    """The final state (with the window's carried tokens) continues the sequence."""
    rule = miras.compile(
        {"name": "pieces", "bias": "l2", "retention": "l2", "window": {"c": 3, "gamma": "gate"}}
    )
    q, k, v, gates = _to_device(
        random_inputs(rule, b=1, t=40, h=2, dk=16, dv=16, dtype=torch.float32)
    )
    options = dict(backend="triton", chunk_size=16, chunk_mode="start", output_final_state=True)
    o, final = rule(q, k, v, gates, **options)
    cut = 32  # a chunk boundary

    def part(x, sl):
        return x[:, sl]

    first = slice(0, cut)
    o1, state = rule(
        *(part(x, first) for x in (q, k, v)),
        {n: part(g, first) for n, g in gates.items()},
        **options,
    )
    rest = slice(cut, None)
    o2, final2 = rule(
        *(part(x, rest) for x in (q, k, v)), {n: part(g, rest) for n, g in gates.items()},
        initial_state=state, **options,
    )  # fmt: skip
    assert _rel_rms(torch.cat([o1, o2], dim=1), o) <= TOL
    for name in final:
        assert _rel_rms(final2[name], final[name]) <= TOL, name


@pytest.mark.parametrize("dk", [80, 150], ids=["two_key_tiles", "four_key_tiles"])
def test_wide_keys_run_the_linear_state_kernels_key_tiles(dk, monkeypatch):
    """Above 64 key channels the linear state kernel holds W as [64, BV] key tiles (two at
    Dphi = 80, four at 150: BK 256, the last tiles partly and wholly padding), with a window
    (two passes over the offsets) and an odd value width split into blocks; outputs, final
    state and every gradient equal the chunk backend's."""
    monkeypatch.setattr(triton_backend, "LINEAR_BLOCK_V", 16)
    fields = dict(bias="l2", retention={"kind": "l2", "grad_at": "retained"}, window={"c": 2})
    rule = miras.compile({"name": "wide-keys", **fields})
    b, h, dv = 1, 2, 19
    q, k, v, gates = random_inputs(rule, b=b, t=37, h=h, dk=dk, dv=dv, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    init = 0.1 * torch.randn(rule.initial_state(b, h, dk, dv, torch.float32).shape, generator=gen)
    inputs = _to_device((q, k, v, gates, init, rule.default_params(torch.float32)))
    seen = []
    real = triton_backend.ChunkKernels.apply
    monkeypatch.setattr(
        triton_backend.ChunkKernels,
        "apply",
        lambda launch, *a: seen.append(launch) or real(launch, *a),
    )
    want = _run(rule, "chunk", inputs, 16)
    got = _run(rule, "triton", inputs, 16)
    assert [(s.linear, s.state_meta["KT"], s.n_value_blocks) for s in seen] == [(True, 64, 2)]
    bad = _mismatches(got, want, TOL)
    assert not bad, f"above {TOL}: {bad}"


# What the kernels do not cover ------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (dict(memory={"kind": "mlp", "depth": 3, "expansion": 1}), "memory.depth"),
        (dict(memory={"kind": "gated_mlp", "expansion": 1}), "gated_mlp memory"),
        (dict(optimizer="muon"), "muon"),
        (dict(retention={"kind": "bregman", "solver": "newton"}), "Newton"),
        (dict(bias={"kind": "custom", "loss": "e*atan(e)"}), "atan"),
    ],
    ids=["mlp", "gated_mlp", "muon", "bregman_newton", "atan"],
)
def test_uncovered_spec_raises(fields, reason):
    rule = miras.compile({"name": "outside", **fields}, checked=False)
    q, k, v, gates = _to_device(random_inputs(rule, t=5, dtype=torch.float32))
    with pytest.raises(ValueError, match=reason) as err:
        rule(q, k, v, gates, backend="triton")
    assert "backend='chunk'" in str(err.value)


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU tensors only")
def test_cpu_tensors_without_the_interpreter_raise(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rule = miras.compile({"name": "cpu", "bias": "l2", "retention": "none"})
    q, k, v, gates = random_inputs(rule, t=5, dtype=torch.float32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1") as err:
        rule(q, k, v, gates, backend="triton", chunk_mode="start")
    assert "backend='chunk'" in str(err.value)


def test_unwritten_output_is_caught():
    from miras.runtime.triton_launch import check_written

    x = torch.zeros(3, 4)
    check_written({"x": x})
    x[1, 2] = float("nan")
    with pytest.raises(RuntimeError, match="1 of 12 elements of x"):
        check_written({"x": x})


# Golden sources ----------------------------------------------------------------------------

MATRIX_SPECS = [
    "specs/linear_attention.yaml",
    "specs/retnet.yaml",
    "specs/deltanet.yaml",
    "specs/deltaproduct.yaml",
    "specs/gated_deltanet.yaml",
    "specs/gdn2.yaml",
    "specs/kda.yaml",
    "specs/longhorn.yaml",
    "specs/momentum_delta_rule.yaml",
    "specs/omeganet.yaml",
    "specs/swla.yaml",
    "specs/examples/cauchy_memory.yaml",
    "specs/examples/exponentiated_memory.yaml",
    "specs/examples/linear_deep_omega_transformer.yaml",
    "specs/examples/linear_deep_transformer.yaml",
    "specs/examples/logcosh_deltanet.yaml",
]
# Matrix specs the kernels do not cover, refused with the reason (miras.compiler.triton_kernels).
NO_KERNEL = {
    "specs/mesanet.yaml": "the exact optimizer",
    "specs/precond_gdn.yaml": "the preconditioned optimizer",
    "specs/titans_linear.yaml": "the layer_norm bias",
    "specs/ttt_linear.yaml": "the layer_norm bias",
}


@pytest.mark.parametrize("path", MATRIX_SPECS, ids=lambda p: Path(p).stem)
def test_golden_source(path):
    source = kernel_source(ROOT / path)
    golden = GOLDEN / f"{Path(path).stem}.py.golden"
    if os.environ.get("MIRAS_UPDATE_GOLDEN", "") not in ("", "0"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(source)
    assert golden.exists(), f"no golden copy {golden}; run with MIRAS_UPDATE_GOLDEN=1"
    assert source == golden.read_text(), (
        f"the emitted source of {path} differs from {golden.name}; if the change is intended, "
        "rerun with MIRAS_UPDATE_GOLDEN=1 and commit the reviewed diff"
    )


def test_every_matrix_spec_has_a_golden_copy():
    shipped = sorted(
        str(p.relative_to(ROOT))
        for p in [*ROOT.glob("specs/*.yaml"), *ROOT.glob("specs/examples/*.yaml")]
        if miras.load_spec(p).memory.kind == "matrix"
    )
    assert shipped == sorted([*MATRIX_SPECS, *NO_KERNEL])


@pytest.mark.parametrize("path", sorted(NO_KERNEL), ids=lambda p: Path(p).stem)
def test_a_matrix_spec_without_kernels_is_refused_with_the_reason(path):
    with pytest.raises(ValueError, match=f"do not cover {NO_KERNEL[path]}"):
        kernel_source(ROOT / path)


def test_an_all_zero_reference_is_compared():
    """The comparison helper itself: a zero reference is matched absolutely, and NaN fails."""
    zero, one = torch.zeros(3), torch.ones(3)
    assert _mismatches({"x": zero + 1e-7}, {"x": zero}, 1e-5) == {}
    assert list(_mismatches({"x": zero + 1e-3}, {"x": zero}, 1e-5)) == ["x"]
    assert list(_mismatches({"x": torch.full((3,), float("nan"))}, {"x": zero}, 1e-5)) == ["x"]
    assert list(_mismatches({"x": one}, {"x": torch.full((3,), float("nan"))}, 1e-5)) == ["x"]
    assert list(_mismatches({"x": 1.1 * one}, {"x": one}, 1e-5)) == ["x"]
