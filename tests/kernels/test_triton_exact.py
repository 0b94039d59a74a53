"""The exact chunk form on the Triton backend (miras/runtime/exact_triton.py, the scan kernels
in kernels/templates/exact.py), under the interpreter on a machine without a GPU.

- The scan Function equals a plain torch loop of its recurrence (`reference_scan`), forward
  and backward (every input), per head and per channel, with and without momentum and a
  slope, at odd sizes (R and Dv not powers of two, Dphi != Dv, several value blocks).
- `backend="triton"` equals `backend="chunk"` in the exact form for the covering set of affine
  specs of tests/runtime/test_exact_chunk.py: outputs, final state and the gradients w.r.t. q, k, v,
  every gate and the initial state, float32, relative RMS 1e-5, at T not a multiple of the
  chunk, chunk 7 and 16, and a single chunk; in float64 to 1e-12.
- CPU tensors without the interpreter raise on the exact path too.
"""

from __future__ import annotations

import pytest
import torch
from test_exact_chunk import CASES, make_inputs, rel_rms, rule_of, run

from miras.runtime import exact_triton, triton_backend

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
                rows=21, dk=5, dv=19):  # fmt: skip
    """Random inputs of a scan, the absent ones None: gates near 1 where they decay, small
    systems; `channel_gates` are [.., Dv], the other gates [.., 1]."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0, shift=0.0):
        x = shift + scale * torch.randn(*shape, generator=gen, dtype=torch.float64)
        return x.to(dtype=dtype, device=DEVICE).requires_grad_(True)

    width = {n: dv if n in channel_gates else 1 for n in GATES}
    x = dict.fromkeys(SCAN_ARGS)
    x |= dict(
        base=rand(b, h, chunks, rows, dv),
        keys=rand(b, h, chunks, rows, dk, scale=0.3),
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


@pytest.mark.parametrize(
    ("name", "dtype", "tol"),
    [pytest.param(name, torch.float32, TOL, id=f"{name}-f32") for name in sorted(SCANS)]
    + [
        pytest.param(name, torch.float64, 1e-12, id=f"{name}-f64")
        for name in ("momentum_per_head", "momentum_per_channel")
    ],
)
def test_scan_equals_reference(name, dtype, tol, monkeypatch):
    """Dv = 19 in blocks of 16 (two programs per head, a partial block), R = 21, Dphi = 5."""
    monkeypatch.setattr(exact_triton, "BLOCK_V", 16)
    momentum, slope, per_channel, channel_gates = SCANS[name]
    inputs = scan_inputs(
        momentum=momentum, slope=slope, per_channel=per_channel, channel_gates=channel_gates,
        dtype=dtype,
    )  # fmt: skip
    got = exact_triton.scan(**inputs)
    want = reference_scan(**inputs)
    outs = [(n, a, e) for n, a, e in zip(OUTPUTS, got, want, strict=True) if e is not None]
    assert all(a is None for a, e in zip(got, want, strict=True) if e is None)
    leaves = {n: x for n, x in inputs.items() if x is not None}
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(e.shape, generator=gen, dtype=dtype).to(DEVICE) for _, _, e in outs]

    def grads(which: int):
        loss = sum((out[which] * w).sum() for out, w in zip(outs, weights, strict=True))
        return torch.autograd.grad(loss, list(leaves.values()))

    named = outs + [(f"d {n}", a, e) for n, a, e in zip(leaves, grads(1), grads(2), strict=True)]
    for label, a, e in named:
        assert a.shape == e.shape, label
        err = rel_rms(a, e)
        assert err <= tol, f"{name}: {label}: relative RMS {err:.3g} > {tol}"


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
