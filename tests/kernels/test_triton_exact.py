"""The exact chunk form on the Triton backend (miras/runtime/exact_triton.py, the scan kernels
in kernels/templates/exact.py), under the interpreter on a machine without a GPU.

- The scan Function equals a plain torch loop of its recurrence (`reference_scan`), forward
  and backward (every input), per head and per channel, with and without momentum and a
  slope, at odd sizes (R and Dv not powers of two, Dphi != Dv, several value blocks, Dphi of
  one, two and four key tiles), float32 to 1e-5 and float64 to 1e-12; with bf16 operands
  (`operand_dtype`) against the float32 loop to fla's half-precision tolerances.
- Triton 3.9's interpreter multiplies bf16 tl.dot operands wrongly (their bit patterns as
  integers), which is why the kernels upcast them there (`UPCAST`).
- A gated_deltanet layer's rule on bf16 inputs (initial and final state, cu_seqlens) against
  the float32 chunk backend, outputs and every gradient.
- `backend="triton"` equals `backend="chunk"` in the exact form for the covering set of affine
  specs of tests/runtime/test_exact_chunk.py: outputs, final state and the gradients w.r.t. q, k, v,
  every gate and the initial state, float32, relative RMS 1e-5, at T not a multiple of the
  chunk, chunk 7 and 16, and a single chunk; in float64 to 1e-12.
- CPU tensors without the interpreter raise on the exact path too.
"""

from __future__ import annotations

import pytest
import torch

import miras
from miras.runtime import exact_triton, triton_backend
from tests.helpers import random_inputs
from tests.runtime.test_exact_chunk import CASES, make_inputs, rel_rms, rule_of, run

TOL = 1e-5  # relative RMS, float32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on a CPU

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _check_every_output_written(monkeypatch):
    """Outputs are NaN-poisoned before each launch; this makes the wrapper check them after."""
    monkeypatch.setenv(triton_backend.CHECK_ENV, "1")


def reference_scan(base, keys, from_w, from_s, last_w, last_s, d_end, carry_end, theta_end, w0, s0):
    """The scan's recurrence as a plain loop over chunks (autograd gives its backward)."""
    f, g, lw, ls, d, ce, te = from_w, from_s, last_w, last_s, d_end, carry_end, theta_end
    w, s = w0, s0
    signals, w_starts, s_starts = [], [], []
    for i in range(base.shape[2]):
        w_starts.append(w)
        s_starts.append(s)
        x = keys[:, :, i]  # [B, H, R, Dphi]
        r = base[:, :, i]
        if f is not None and f.dim() == 6:  # r[a, v] += sum_b F[v, a, b] (K W^T)[b, v]
            r = r + torch.einsum("zhvab,zhbv->zhav", f[:, :, i], x @ w.transpose(-1, -2))
            if s is not None:
                r = r - torch.einsum("zhvab,zhbv->zhav", g[:, :, i], x @ s.transpose(-1, -2))
        elif f is not None:
            r = r + f[:, :, i] @ w.transpose(-1, -2)
            if s is not None:
                r = r - g[:, :, i] @ s.transpose(-1, -2)
        signals.append(r)
        w_new = d[:, :, i, :, None] * w - (r * lw[:, :, i]).transpose(-1, -2) @ x
        if s is not None:
            w_new = w_new - ce[:, :, i, :, None] * s
            s = te[:, :, i, :, None] * s + (r * ls[:, :, i]).transpose(-1, -2) @ x
        w = w_new
    stack = torch.stack
    s_starts = stack(s_starts, dim=2) if s is not None else None
    return stack(signals, dim=2), stack(w_starts, dim=2), s_starts, w, s


SCAN_ARGS = ("base", "keys", "from_w", "from_s", "last_w", "last_s", "d_end", "carry_end",
             "theta_end", "w0", "s0")  # fmt: skip
GATES = ("last_w", "last_s", "d_end", "carry_end", "theta_end")


def scan_inputs(*, momentum, slope, per_channel, channel_gates, dtype, b=1, h=2, chunks=3,
                rows=21, dk=5, dv=19, key_scale=0.67):  # fmt: skip
    """Random inputs of a scan, the absent ones None: gates near 1 where they decay, small
    systems, key rows of norm about `key_scale` at every Dphi (a layer's keys are unit rows);
    `channel_gates` are [.., Dv], the other gates [.., 1]."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0, shift=0.0):
        x = shift + scale * torch.randn(*shape, generator=gen, dtype=torch.float64)
        return x.to(dtype=dtype, device=DEVICE).requires_grad_(True)

    width = {n: dv if n in channel_gates else 1 for n in GATES}
    x = dict.fromkeys(SCAN_ARGS)
    x |= dict(
        base=rand(b, h, chunks, rows, dv),
        keys=rand(b, h, chunks, rows, dk, scale=key_scale / dk**0.5),
        last_w=rand(b, h, chunks, rows, width["last_w"], scale=0.2),
        d_end=rand(b, h, chunks, width["d_end"], scale=0.05, shift=0.9),
        w0=rand(b, h, dv, dk),
    )
    if slope:
        shape = (b, h, chunks, dv, rows, rows) if per_channel else (b, h, chunks, rows, dk)
        x["from_w"] = rand(*shape, scale=0.2)
        if momentum:
            x["from_s"] = rand(*shape, scale=0.2)
    if momentum:
        x["last_s"] = rand(b, h, chunks, rows, width["last_s"], scale=0.2)
        x["carry_end"] = rand(b, h, chunks, width["carry_end"], scale=0.3)
        x["theta_end"] = rand(b, h, chunks, width["theta_end"], scale=0.05, shift=0.8)
        x["s0"] = rand(b, h, dv, dk)
    return x


# name: (momentum, a slope (F, G given), per-channel systems, gates given per channel)
SCANS = {
    "gd_per_head": (False, True, False, ()),
    "momentum_per_head": (True, True, False, ()),
    "momentum_zero_slope": (True, False, False, ("d_end", "carry_end")),
    "gd_per_channel": (False, True, True, ("last_w", "d_end")),
    "momentum_per_channel": (True, True, True, ("last_w", "d_end", "last_s", "theta_end")),
}
OUTPUTS = ("r", "W starts", "S starts", "W", "S")


HALF_OUT_TOL, HALF_GRAD_TOL = 5e-3, 8e-3  # fla's relative RMS tolerances in half precision

# (Dphi, Dv): one key tile [16, BV]; two [64, BV] tiles (the second partial) and two value
# blocks of 32 per head (one of 16 channels: 19 gives two per channel); four key tiles.
WIDTHS = {"dk5-dv19": (5, 19), "dk80-dv40": (80, 40), "dk200-dv19": (200, 19)}


def _compare(inputs, got, want, name, tol, grad_tol=None):
    """Every output and every input's gradient (of a random functional of the outputs)."""
    dtype = inputs["base"].dtype
    outs = [(n, a, e) for n, a, e in zip(OUTPUTS, got, want, strict=True) if e is not None]
    assert all(a is None for a, e in zip(got, want, strict=True) if e is None)
    leaves = {n: x for n, x in inputs.items() if x is not None}
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(e.shape, generator=gen, dtype=dtype).to(DEVICE) for _, _, e in outs]

    def grads(which: int):
        loss = sum((out[which] * w).sum() for out, w in zip(outs, weights, strict=True))
        return torch.autograd.grad(loss, list(leaves.values()))

    named = [(n, a, e, tol) for n, a, e in outs]
    named += [
        (f"d {n}", a, e, grad_tol or tol)
        for n, a, e in zip(leaves, grads(1), grads(2), strict=True)
    ]
    for label, a, e, bound in named:
        assert a.shape == e.shape, label
        err = rel_rms(a, e)
        assert err <= bound, f"{name}: {label}: relative RMS {err:.3g} > {bound}"


@pytest.mark.parametrize("widths", list(WIDTHS))
@pytest.mark.parametrize(
    ("name", "dtype", "tol"),
    [pytest.param(name, torch.float32, TOL, id=f"{name}-f32") for name in sorted(SCANS)]
    + [
        pytest.param(name, torch.float64, 1e-12, id=f"{name}-f64")
        for name in ("momentum_per_head", "momentum_per_channel")
    ],
)
def test_scan_equals_reference(name, dtype, tol, widths):
    """R = 21 (a [32, .] row tile), the widths of WIDTHS."""
    momentum, slope, per_channel, channel_gates = SCANS[name]
    dk, dv = WIDTHS[widths]
    inputs = scan_inputs(
        momentum=momentum, slope=slope, per_channel=per_channel, channel_gates=channel_gates,
        dtype=dtype, dk=dk, dv=dv,
    )  # fmt: skip
    _compare(inputs, exact_triton.scan(**inputs), reference_scan(**inputs), name, tol)


HALF_CASES = [
    (name, torch.bfloat16, w) for name in sorted(SCANS) for w in ("dk5-dv19", "dk80-dv40")
]
HALF_CASES += [
    (name, torch.float16, "dk5-dv19") for name in ("momentum_per_head", "gd_per_channel")
]


@pytest.mark.parametrize(
    ("name", "half", "widths"),
    HALF_CASES,
    ids=[f"{n}-{str(h).split('.')[-1]}-{w}" for n, h, w in HALF_CASES],
)
def test_half_operands_within_half_precision_tolerance(name, half, widths):
    """operand_dtype bf16 (or fp16): the products take half-precision keys, systems, states
    and r * lw, the state stays float32; against the float32 loop, relative RMS 5e-3 for
    outputs and 8e-3 for gradients (fla's tests' bounds)."""
    momentum, slope, per_channel, channel_gates = SCANS[name]
    dk, dv = WIDTHS[widths]
    inputs = scan_inputs(
        momentum=momentum, slope=slope, per_channel=per_channel, channel_gates=channel_gates,
        dtype=torch.float32, dk=dk, dv=dv,
    )  # fmt: skip
    got = exact_triton.scan(**inputs, operand_dtype=half)
    assert all(x is None or x.dtype == torch.float32 for x in got)  # the state stays float32
    want = reference_scan(**inputs)
    _compare(inputs, got, want, name, HALF_OUT_TOL, HALF_GRAD_TOL)
    # and the rounding is there: the final state went through half-precision products
    assert rel_rms(got[3], want[3]) > 1e-5


def test_the_interpreter_multiplies_bf16_dots_wrongly():
    """Why the kernels upcast half operands under the interpreter: triton 3.9's interpreter
    multiplies bf16 tiles' raw bits (its tl.dot on the uint16 storage), off by orders of
    magnitude; the upcast products equal the float64 product of the rounded values."""
    import triton
    import triton.language as tl

    if not triton_backend.runs_on_cpu():
        pytest.skip("the interpreter only")

    @triton.jit
    def product(a, b, out, UPCAST: tl.constexpr):
        i = tl.arange(0, 16)
        x = tl.load(a + i[:, None] * 16 + i[None, :])
        y = tl.load(b + i[:, None] * 16 + i[None, :])
        if UPCAST:
            x, y = x.to(tl.float32), y.to(tl.float32)
        tl.store(out + i[:, None] * 16 + i[None, :], tl.dot(x, y, out_dtype=tl.float32))

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=gen).bfloat16() for _ in range(2))
    exact = a.double() @ b.double()
    for upcast in (False, True):
        out = torch.empty(16, 16)
        product[(1,)](a, b, out, upcast)
        err = rel_rms(out, exact)
        assert (err < 1e-6) if upcast else (err > 1.0), (upcast, err)


def test_scan_launch_tiles_the_keys():
    """(NK, BK): 64-wide key tiles up to four, wider past Dphi = 256, at least 16 (tl.dot)."""
    tiles = {
        d_k: exact_triton.ScanLaunch(1, 1, 16, d_k, 16, True, False, False, (1,) * 5).key_tiles
        for d_k in (5, 64, 80, 130, 256, 257, 512)
    }
    assert tiles == {
        5: (1, 16), 64: (1, 64), 80: (2, 64), 130: (3, 64), 256: (4, 64), 257: (4, 128),
        512: (4, 128),
    }  # fmt: skip


# The backend against the chunk backend's exact form -------------------------------------------


def on_device(inputs):
    """make_inputs' (q, k, v, gates, init, leaves) as fresh leaves on DEVICE."""
    q, k, v, gates, init, leaves = inputs
    moved = [x.detach().to(DEVICE).requires_grad_(True) for x in leaves]
    q, k, v = moved[:3]
    gates = dict(zip(gates, moved[3 : 3 + len(gates)], strict=True))
    init = dict(zip(init, moved[3 + len(gates) :], strict=True))
    return q, k, v, gates, init, moved


RULE_SHAPES = [(20, 7), (37, 16), (5, 7)]  # (T, chunk): a partial last chunk; one chunk only


@pytest.mark.parametrize(("t_len", "chunk_size"), RULE_SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_equals_exact_chunk(name, t_len, chunk_size, monkeypatch):
    scans = []
    original = exact_triton.scan
    monkeypatch.setattr(exact_triton, "scan", lambda *a: scans.append(1) or original(*a))
    inputs = on_device(make_inputs(name, t_len, dtype=torch.float32))
    got_outs, got_grads = run(name, inputs, "triton", chunk_size)
    want_outs, want_grads = run(name, inputs, "chunk", chunk_size, "exact")
    # The dot bias (zero slope) needs no scan of its own: the emitted chunk kernels run it.
    assert len(scans) == (0 if rule_of(name).plan.chunk_form.slope == 0.0 else 1)
    labels = ["o", *(f"final {i}" for i in range(len(got_outs) - 1))]
    labels += [f"d leaf {i}" for i in range(len(got_grads))]
    for label, a, e in zip(labels, got_outs + got_grads, want_outs + want_grads, strict=True):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), label
        err = rel_rms(a, e)
        assert err <= TOL, f"{name}: {label}: relative RMS {err:.3g} > {TOL}"


@pytest.mark.parametrize(
    "name", ["window3_gamma_momentum_retained", "per_channel_momentum_window2"]
)
def test_float64_agrees_to_rounding(name):
    """In float64 the two backends agree to rounding: every derivative of the scan is exact."""
    inputs = on_device(make_inputs(name, 37, dtype=torch.float64))
    got_outs, got_grads = run(name, inputs, "triton", 16)
    want_outs, want_grads = run(name, inputs, "chunk", 16, "exact")
    for a, e in zip(got_outs + got_grads, want_outs + want_grads, strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU tensors only")
def test_cpu_tensors_without_the_interpreter_raise(monkeypatch):
    """The exact path checks the device as the emitted kernels do, before any work."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, gates, _, _ = make_inputs("deltanet", 9, dtype=torch.float32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1") as err:
        rule_of("deltanet")(q, k, v, gates, backend="triton", chunk_size=4)
    assert "backend='chunk'" in str(err.value)


def test_bf16_layer_inputs_with_state_and_packed_sequences():
    """specs/gated_deltanet.yaml's rule on bf16 q, k, v and gates, two packed sequences
    (cu_seqlens, the first ending mid-chunk), a float32 initial state, the final state out:
    outputs and every gradient against the float32 chunk backend's exact form on the same
    (bf16-rounded) values, to fla's half-precision tolerances."""
    rule = miras.compile("specs/gated_deltanet.yaml")
    cu = torch.tensor([0, 11, 30])
    q, k, v, gates = random_inputs(rule, b=1, t=30, h=2, dk=20, dv=19, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    w0 = 0.3 * torch.randn(2, 2, 19, 20, generator=gen)
    half = [x.bfloat16() for x in (q, k, v, *gates.values())]

    def run_rule(leaves, w0, backend, **options):
        q, k, v, *g = leaves
        o, w = rule(
            q, k, v, dict(zip(gates, g, strict=True)), backend=backend, chunk_size=8,
            initial_state=w0, output_final_state=True, cu_seqlens=cu, **options,
        )  # fmt: skip
        weights = [torch.randn(x.shape, generator=torch.Generator().manual_seed(5)) for x in (o, w)]
        loss = sum((x.float() * wt).sum() for x, wt in zip((o, w), weights, strict=True))
        return [o, w], torch.autograd.grad(loss, [*leaves, w0])

    scans = []
    original = exact_triton.scan
    patch = pytest.MonkeyPatch()
    patch.setattr(exact_triton, "scan", lambda *a: scans.append(a[-1]) or original(*a))
    try:
        got = run_rule(
            [x.to(DEVICE).requires_grad_(True) for x in half],
            w0.to(DEVICE).requires_grad_(True),
            "triton",
        )
    finally:
        patch.undo()
    # the exact scan ran (once per packed sequence), told its operands are bf16
    assert scans == [torch.bfloat16] * 2
    want = run_rule(
        [x.float().to(DEVICE).requires_grad_(True) for x in half],
        w0.to(DEVICE).requires_grad_(True), "chunk", chunk_mode="exact",
    )  # fmt: skip
    assert got[0][0].dtype == torch.bfloat16 and got[0][1].dtype == torch.float32
    labels = ["o", "final state", "d q", "d k", "d v", *(f"d {n}" for n in gates), "d w0"]
    for label, a, e in zip(labels, got[0] + list(got[1]), want[0] + list(want[1]), strict=True):
        bound = HALF_OUT_TOL if label in ("o", "final state") else HALF_GRAD_TOL
        err = rel_rms(a, e)
        assert err <= bound, f"{label}: relative RMS {err:.3g} > {bound}"
