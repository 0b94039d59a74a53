"""float32 and bfloat16 runs against float64, on every backend, and one long sequence.

The other backend tests run in float64 (exactness) or compare float32 backends with each other;
these measure what a lower precision costs against the same computation in float64, on the
same inputs: each input is drawn in float64, rounded once to the low dtype, and the float64 run
takes the rounded values (exactly representable), so only the arithmetic differs.

What the runtime promises (docs/kernels.md, docs/models.md): the state and every intermediate
are float32 for float32 and bfloat16 inputs, and the output has the inputs' dtype.
So a bfloat16 run is the float32 computation with its output (and, in the backward, its input
gradients) rounded to bfloat16 once, and its final state is float32.

Tolerances (relative RMS over a tensor):
- F32_TOL = 2e-6. Rounding float32 gives a relative error of at most u32 = 2^-24 = 6e-8 per
  operation; a step touches every entry a few times and the errors of T = 100 tokens add up
  like a random walk, damped by the decays and the delta rule's (I - lr k k^T) products.
  Measured on these inputs (CPU): at most 5.2e-7 (titans' MLP, the momentum gate's gradient),
  at most 3e-7 for the matrix memories on every backend; 2e-6 is about 30 u32. The Triton
  kernels multiply in IEEE float32 (no TF32), so a GPU is held to the same figure.
- BF16_TOL = 2^-8 + F32_TOL. Rounding to bfloat16 (8 significant bits) changes each entry by
  at most u16 = 2^-8 of itself, so it changes a tensor by at most u16 in relative RMS; the
  float32 computation before the rounding adds at most F32_TOL. The upstream weights of the
  backward are bfloat16 numbers, so the gradient of o arrives unrounded.
- The final state of a bfloat16 run is float32 and is held to F32_TOL, not BF16_TOL.
- The long runs (T = 2048) are held to F32_TOL as well; see `test_long_sequence_float32`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import miras
from tests.helpers import random_inputs

SPEC_DIR = Path(__file__).resolve().parents[2] / "specs"
f64, f32, bf16 = torch.float64, torch.float32, torch.bfloat16
F32_TOL = 2e-6
BF16_TOL = 2.0**-8 + F32_TOL

SPECS = ["deltanet", "gated_deltanet", "retnet", "titans"]
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: TRITON_INTERPRET=1
MATRIX_SPECS = ["deltanet", "gated_deltanet", "retnet"]  # the Triton kernels cover these


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def flat(state) -> dict[str, torch.Tensor]:
    return dict(state) if isinstance(state, dict) else {"W": state}


def rounded_inputs(rule, dtype, *, t, d, per_channel=False, seed=0, device="cpu"):
    """q, k, v, gates in `dtype`, drawn in float64 (unit-norm keys, gates in range)."""
    q, k, v, gates = random_inputs(
        rule, b=1, t=t, h=2, dk=d, dv=d, per_channel=per_channel, seed=seed
    )
    qkv = [x.to(dtype).to(device) for x in (q, k, v)]
    return qkv, {n: g.to(dtype).to(device) for n, g in gates.items()}


def run(rule, qkv, gates, dtype, **options):
    """o, the final state and the gradients of sum(o * w) + sum(state * w') with respect to
    q, k, v and every gate, all inputs cast to `dtype` (exact for a widening cast)."""
    leaves = [x.to(dtype).requires_grad_(True) for x in (*qkv, *gates.values())]
    q, k, v, *g = leaves
    o, state = rule(q, k, v, dict(zip(gates, g, strict=True)), output_final_state=True, **options)
    state = flat(state)
    gen = torch.Generator().manual_seed(1)
    # Weights that bfloat16 represents exactly, so the backward starts unrounded.
    weights = [torch.randn(x.shape, generator=gen).to(bf16).to(x) for x in (o, *state.values())]
    loss = sum((x * w).sum() for x, w in zip((o, *state.values()), weights, strict=True))
    grads = torch.autograd.grad(loss, leaves)
    names = ["dq", "dk", "dv", *(f"d {n}" for n in gates)]
    return o, state, dict(zip(names, grads, strict=True))


def compare(rule, dtype, options, *, t, d, reference=None, device="cpu"):
    """The run in `dtype` against the float64 run with the `reference` options (the same
    options by default), on the same inputs."""
    qkv, gates = rounded_inputs(rule, dtype, t=t, d=d, device=device)
    o, state, grads = run(rule, qkv, gates, dtype, **options)
    o_ref, state_ref, grads_ref = run(rule, qkv, gates, f64, **(reference or options))
    assert o.dtype == dtype and all(g.dtype == dtype for g in grads.values())
    assert all(s.dtype == f32 for s in state.values()), {n: s.dtype for n, s in state.items()}
    low_tol = BF16_TOL if dtype == bf16 else F32_TOL
    errors = {"o": (rel_rms(o, o_ref), low_tol)}
    errors |= {f"state {n}": (rel_rms(s, state_ref[n]), F32_TOL) for n, s in state.items()}
    errors |= {n: (rel_rms(g, grads_ref[n]), low_tol) for n, g in grads.items()}
    bad = {n: f"{err:.2e} > {tol:.1e}" for n, (err, tol) in errors.items() if not err <= tol}
    assert not bad, f"{rule.spec.name} {options} {dtype}: {bad}"
    return errors


# Backend and chunk mode: "auto" runs the exact chunk form for the matrix specs here (their
# steps are affine in W); "start" forces the chunk-start form, which titans resolves to anyway.
BACKENDS = {
    "recurrent": dict(backend="recurrent"),
    "chunk-auto": dict(backend="chunk", chunk_size=16),
    "chunk-start": dict(backend="chunk", chunk_size=16, chunk_mode="start"),
}
RUNS = [(n, b) for n in SPECS for b in BACKENDS if (n, b) != ("titans", "chunk-auto")]
SHAPES = {"titans": dict(t=40, d=8)}  # the MLP memory's recurrence is slow on a CPU


@pytest.mark.parametrize("dtype", [f32, bf16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("name", "backend"), RUNS, ids=[f"{n}-{b}" for n, b in RUNS])
def test_low_precision_against_float64(name, backend, dtype):
    """T = 100 over chunks of 16 (a partial last chunk), D = 16, two heads (titans: T = 40,
    D = 8)."""
    rule = miras.compile(SPEC_DIR / f"{name}.yaml")
    compare(rule, dtype, BACKENDS[backend], **SHAPES.get(name, dict(t=100, d=16)))


@pytest.mark.parametrize("dtype", [f32, bf16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", MATRIX_SPECS)
def test_triton_low_precision_against_float64(name, dtype):
    """The Triton kernels (interpreted on a CPU without CUDA), tiny; the float64 reference is
    the chunk backend's chunk-start form, which the kernels compute."""
    rule = miras.compile(SPEC_DIR / f"{name}.yaml")
    options = dict(chunk_size=16, chunk_mode="start")  # the form the kernels compute
    compare(
        rule, dtype, dict(backend="triton", **options), t=20, d=16,
        reference=dict(backend="chunk", **options), device=TRITON_DEVICE,
    )  # fmt: skip


@pytest.mark.parametrize("decays", [(0.5, 1.0), (0.995, 1.0)], ids=["short-memory", "long-memory"])
@pytest.mark.parametrize("name", ["gated_deltanet", "retnet"])
def test_long_sequence_float32(name, decays):
    """T = 2048 in float32, chunk (64-token chunks) and recurrent, against the float64
    recurrence. Decays in [0.5, 1]: a chunk's decay product reaches about 1e-8 and the
    sequence's underflows float32; in [0.995, 1]: products over the whole sequence (about
    e^-5) keep hundreds of tokens in the state, so their rounding errors add up. Measured:
    at most 1.4e-7 (short) and 5.2e-7 (long); held to F32_TOL, the figure for T = 100: the
    error does not grow with T."""
    rule = miras.compile(SPEC_DIR / f"{name}.yaml")
    gen = torch.Generator().manual_seed(11)
    qkv, gates = rounded_inputs(rule, f32, t=2048, d=8)
    low, high = decays
    gates["decay"] = (low + (high - low) * torch.rand(gates["decay"].shape, generator=gen)).to(f32)
    with torch.no_grad():
        o_ref, state_ref = rule(
            *(x.double() for x in qkv), {n: g.double() for n, g in gates.items()},
            backend="recurrent", output_final_state=True,
        )  # fmt: skip
        for backend in ("recurrent", "chunk"):
            o, state = rule(*qkv, gates, backend=backend, chunk_size=64, output_final_state=True)
            assert o.dtype == f32 and state.dtype == f32
            errors = {"o": rel_rms(o, o_ref), "state": rel_rms(state, state_ref)}
            assert all(err <= F32_TOL for err in errors.values()), (backend, errors)
