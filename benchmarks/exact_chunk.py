"""The exact chunk form against fla's pure-torch exact chunk, the chunk-start form and the
recurrence, as ratios taken in one run (issue 12).

    .venv/bin/python benchmarks/exact_chunk.py [--lengths 2048 8192] [--repeats 3]

CPU, float32, B = 2, H = 4, d = Dk = Dv = 64, torch.set_num_threads(2), specs/gated_deltanet.yaml
(l2 bias, l2 retention with the gradient at the retained state, gd: Gated DeltaNet) with
per-head gates. Each time is the median of `repeats` runs after one warmup run; "fwd" runs
under torch.no_grad(), "fwd+bwd" is the forward with q, k, v and the gates requiring grad,
plus the backward of sum(o * w).

Rows:
- exact chunk 64 (`chunk_mode="exact"`) vs fla's `naive_chunk_gated_delta_rule` (fla-core
  0.6.0, chunk 64) on equal inputs: goal >= 1.5x faster;
- exact vs the chunk-start form (`chunk_mode="start"`) on the same spec: goal <= 1.3x its time;
- chunk (exact) vs recurrent, forward, at the first length: goal >= 20x;
- the exact forward's achieved GFLOP/s (`exact_flops`: its matmuls and triangular solves)
  against this machine's fp32 matmul rate measured in the same run (a 1024 x 1024 matmul
  on the same threads): goal >= 35%.
The outputs of the exact form and fla's are compared (relative RMS) before timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import miras

ROOT = Path(__file__).resolve().parent.parent
B, H, D = 2, 4, 64
CHUNK = 64
THREADS = 2


def make_inputs(t: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, t, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, t, H, D, generator=gen), dim=-1)
    v = torch.randn(B, t, H, D, generator=gen)
    beta = 0.1 + 0.4 * torch.rand(B, t, H, generator=gen)
    decay = 0.9 + 0.1 * torch.rand(B, t, H, generator=gen)
    return q, k, v, beta, decay


def fla_chunk():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns at import that Triton has no GPU here
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
    return naive_chunk_gated_delta_rule


def calls(rule, inputs):
    """name -> f(q, k, v, beta, decay) -> o [B, T, H, D]."""
    naive = fla_chunk()

    def miras_call(mode, backend="chunk"):
        def f(q, k, v, beta, decay):
            gates = {"lr": beta, "decay": decay}
            return rule(q, k, v, gates, backend=backend, chunk_size=CHUNK, chunk_mode=mode)[0]

        return f

    def fla(q, k, v, beta, decay):
        return naive(q, k, v, decay.log(), beta, chunk_size=CHUNK, scale=1.0)[0]

    return {
        "exact": miras_call("exact"),
        "start": miras_call("start"),
        "fla": fla,
        "recurrent": miras_call("auto", "recurrent"),
    }


def exact_flops(t: int, n: int = CHUNK, d: int = D) -> float:
    """FLOPs of the exact forward's products for one run at length t (per head, per chunk of
    n tokens, Dk = Dv = d, c = 1, no momentum): the Gram matrix K K^T (2 n^2 d), the unit
    lower-triangular solve for [C | A coef X] (n^2 per right-hand column, 2d columns), the
    scan's F W^T and (r lw)^T K (2 n d^2 each), and the reads Q K^T, (M o QK^T) r and Q W_0^T
    (2 n^2 d, 2 n^2 d, 2 n d^2): 8 n^2 d + 6 n d^2 per chunk. Elementwise work is not
    counted, so this is a lower bound of the work done."""
    chunks = -(-t // n)
    return B * H * chunks * (8 * n * n * d + 6 * n * d * d)


def matmul_rate(size: int = 1024, repeats: int = 10) -> float:
    """This machine's fp32 matmul rate, FLOP/s: the best of `repeats` size^3 products."""
    gen = torch.Generator().manual_seed(2)
    a, b = (torch.randn(size, size, generator=gen) for _ in "ab")
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best


def _seconds(f) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def timed(f, inputs, backward: bool, repeats: int) -> float:
    def once():
        if not backward:
            with torch.no_grad():
                start = time.perf_counter()
                f(*inputs)
                return time.perf_counter() - start
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        start = time.perf_counter()
        o = f(*leaves)
        (o * weight).sum().backward()
        return time.perf_counter() - start

    weight = torch.randn(inputs[2].shape, generator=torch.Generator().manual_seed(1))
    once()
    return statistics.median(once() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}; threads {THREADS}")
    rule = miras.compile(ROOT / "specs" / "gated_deltanet.yaml")

    rows = []
    for t in args.lengths:
        inputs = make_inputs(t)
        fns = calls(rule, inputs)
        with torch.no_grad():
            o_exact, o_fla = fns["exact"](*inputs), fns["fla"](*inputs)
        err = ((o_exact - o_fla).pow(2).mean() / o_fla.pow(2).mean()).sqrt().item()
        print(f"T = {t}: exact vs fla naive chunk, relative RMS of o = {err:.2e}")
        for backward in (False, True):
            times = {
                n: timed(fns[n], inputs, backward, args.repeats) for n in ("exact", "start", "fla")
            }
            what = "fwd+bwd" if backward else "fwd"
            rows.append(
                (t, what, times["exact"], times["fla"], times["start"],
                 times["fla"] / times["exact"], times["exact"] / times["start"])
            )  # fmt: skip

    print()
    print(
        "| T | pass | exact 64 (s) | fla naive chunk 64 (s) | chunk-start 64 (s) | fla / exact | exact / start |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for t, what, e, f, s, speedup, ratio in rows:
        print(f"| {t} | {what} | {e:.3f} | {f:.3f} | {s:.3f} | {speedup:.2f}x | {ratio:.2f} |")

    t = args.lengths[0]
    inputs = make_inputs(t)
    fns = calls(rule, inputs)
    exact = timed(fns["exact"], inputs, False, args.repeats)
    recurrent = timed(fns["recurrent"], inputs, False, 1)
    rate = matmul_rate()
    print()
    print(f"T = {t}, fwd: recurrent {recurrent:.3f} s, chunk (exact, 64) {exact:.3f} s: "
          f"{recurrent / exact:.1f}x")  # fmt: skip
    print(f"fp32 matmul rate (1024^3, {THREADS} threads): {rate / 1e9:.1f} GFLOP/s")
    for t_len, what, e, *_ in rows:
        if what == "fwd":
            achieved = exact_flops(t_len) / e
            print(f"T = {t_len}, exact fwd: {exact_flops(t_len) / 1e9:.2f} GFLOP in {e:.3f} s = "
                  f"{achieved / 1e9:.1f} GFLOP/s, {100 * achieved / rate:.0f}% of the matmul rate")  # fmt: skip
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
