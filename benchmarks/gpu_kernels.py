"""GPU kernels: the Triton backend against the chunk backend, then timed against fla.

    .venv/bin/python benchmarks/gpu_kernels.py [--batch 8] [--length 4096] [--heads 16]
                                               [--dim 128] [--chunk 64] [--reps 10]

On a CUDA machine:
1. checks `backend="triton"` against `backend="chunk"` (float32, forward and backward, relative
   RMS of every output and gradient) on each shipped matrix-family spec at a small shape;
2. times forward and forward+backward of specs/deltanet.yaml and specs/gated_deltanet.yaml on
   the Triton backend against fla's `chunk_delta_rule` and `chunk_gated_delta_rule` on equal
   shapes (bf16 inputs; miras keeps an fp32 state, as fla does), printing TFLOP/s and the
   time ratio.

TFLOP/s use one nominal count for both sides: the matmuls of a chunked linear-memory layer with
chunk C and head width D, per chunk and head 2 C D^2 for each of the state read, the predictions
and the state update, and 2 C^2 D for each of the intra-chunk scores and their mixing, i.e.
6 D^2 + 4 C D per token and head forward, and three times that forward plus backward. Equal
counts make the TFLOP/s ratio the inverse time ratio. Both compute the exact delta rule (miras's
default `chunk_mode="auto"` gives these specs the exact form: on triton, torch preparation and
reads around a Triton scan over chunks, docs/kernels.md; fla: fused WY kernels).

Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import miras

ROOT = Path(__file__).resolve().parent.parent
MATRIX_SPECS = [
    "linear_attention",
    "retnet",
    "deltanet",
    "gated_deltanet",
    "omeganet",
    "swla",
    "examples/cauchy_memory",
    "examples/exponentiated_memory",
    "examples/logcosh_deltanet",
]


def gates_for(rule, b, t, h, device, dtype) -> dict[str, torch.Tensor]:
    """In-range gates [B, T, H]: decays in [0.9, 1), rates in [0.1, 0.5)."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    out = {}
    for info in rule.plan.gates:
        r = torch.rand(b, t, h, generator=gen).to(device=device, dtype=dtype)
        out[info.name] = 0.9 + 0.1 * r if info.allowed.hi == 1 else 0.1 + 0.4 * r
    return out


def qkv(b, t, h, d, device, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k = (
        torch.nn.functional.normalize(torch.randn(b, t, h, d, generator=gen), dim=-1)
        for _ in range(2)
    )
    v = torch.randn(b, t, h, d, generator=gen)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


def rel_rms(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(1e-30))


def check(device, chunk: int, shape=(2, 300, 4, 64)) -> bool:
    """Every shipped matrix-family spec: Triton vs chunk, float32, forward and backward."""
    b, t, h, d = shape
    print(f"Triton vs chunk backend, float32, B={b} T={t} H={h} D={d} chunk={chunk}")
    print(f"{'spec':34s} {'worst rel. RMS (outputs and gradients)':>40s}")
    ok = True
    for name in MATRIX_SPECS:
        rule = miras.compile(ROOT / "specs" / f"{name}.yaml")
        inputs = qkv(b, t, h, d, device, torch.float32)
        gates = gates_for(rule, b, t, h, device, torch.float32)
        init = rule.initial_state(b, h, d, d).to(device)
        results = []
        for backend in ("chunk", "triton"):
            leaves = [x.clone().requires_grad_(True) for x in (*inputs, *gates.values())]
            state = init.clone().requires_grad_(True)
            q, k, v, *g = leaves
            o, final = rule(
                q, k, v, dict(zip(gates, g, strict=True)), backend=backend, chunk_size=chunk,
                initial_state=state, output_final_state=True,
            )  # fmt: skip
            final = final if isinstance(final, torch.Tensor) else final["W"]
            gen = torch.Generator(device="cpu").manual_seed(2)
            loss = (o * torch.randn(o.shape, generator=gen).to(device)).sum() + final.sum()
            grads = torch.autograd.grad(loss, [*leaves, state])
            results.append([o, final, *grads])
        worst = max(rel_rms(a, c) for a, c in zip(results[1], results[0], strict=True))
        ok &= worst <= 1e-4
        print(f"{name:34s} {worst:40.2e}")
    return ok


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn() over reps runs, after two warm-up runs."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def nominal_flops(b, t, h, d, chunk) -> float:
    """Forward FLOPs of a chunked linear-memory layer: (6 D^2 + 4 C D) per token and head."""
    return 2.0 * b * t * h * (3 * d * d + 2 * chunk * d)


def bench(args, device) -> None:
    b, t, h, d, chunk = args.batch, args.length, args.heads, args.dim, args.chunk
    try:
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as err:
        print(f"\nfla is not installed ({err}); timing the Triton backend alone.")
        chunk_delta_rule = chunk_gated_delta_rule = None

    flops = nominal_flops(b, t, h, d, chunk)
    print(
        f"\nTiming, B={b} T={t} H={h} D={d} chunk={chunk}, bf16 inputs, fp32 state, median of {args.reps}"
    )
    print(
        f"{'spec':16s} {'pass':9s} {'miras ms':>9s} {'TFLOP/s':>8s} {'fla ms':>9s} {'TFLOP/s':>8s} {'fla/miras time':>15s}"
    )
    for name, fla_fn in (
        ("deltanet", chunk_delta_rule),
        ("gated_deltanet", chunk_gated_delta_rule),
    ):
        rule = miras.compile(ROOT / "specs" / f"{name}.yaml")
        q, k, v = qkv(b, t, h, d, device, torch.bfloat16)
        gates = gates_for(rule, b, t, h, device, torch.bfloat16)
        for x in (q, k, v, *gates.values()):
            x.requires_grad_(True)

        def miras_fwd(q=q, k=k, v=v, gates=gates, rule=rule):
            return rule(q, k, v, gates, backend="triton", chunk_size=chunk)[0]

        def fla_fwd(q=q, k=k, v=v, gates=gates, fla_fn=fla_fn):
            if "decay" in gates:  # fla takes the decay as its log
                return fla_fn(q=q, k=k, v=v, g=gates["decay"].float().log().to(q.dtype),
                              beta=gates["lr"], scale=1.0)[0]  # fmt: skip
            return fla_fn(q=q, k=k, v=v, beta=gates["lr"], scale=1.0)[0]

        for label, factor, make in (
            ("fwd", 1.0, lambda f: lambda: f()),
            ("fwd+bwd", 3.0, lambda f: lambda: f().float().sum().backward()),
        ):
            ms = timed(make(miras_fwd), args.reps)
            row = f"{name:16s} {label:9s} {ms:9.2f} {factor * flops / ms / 1e9:8.2f}"
            if fla_fn is not None:
                ms_fla = timed(make(fla_fwd), args.reps)
                row += f" {ms_fla:9.2f} {factor * flops / ms_fla / 1e9:8.2f} {ms_fla / ms:15.2f}"
            print(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here; this benchmark needs a GPU (nothing to do).")
        return 0
    device = torch.device("cuda")
    ok = check(device, args.chunk)
    bench(args, device)
    if not ok:
        print("\nFAILED: the Triton backend disagrees with the chunk backend (above 1e-4).")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
