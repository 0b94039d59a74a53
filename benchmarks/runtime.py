"""Runtime figures of the torch backends, as ratios taken in one run (issue 3).

    .venv/bin/python benchmarks/runtime.py [--profile] [--repeats N]

CPU, float32, B = 2, H = 4, d = Dk = Dv = 64, torch.set_num_threads(2). Each time is the median
of `repeats` runs after one warmup run (time.perf_counter); "fwd" runs under torch.no_grad(),
"fwd+bwd" is the forward with every input requiring grad plus backward of sum(o * w).

Goals:
- chunk vs recurrent at T = 2048, matrix memory (specs/gated_deltanet.yaml): >= 20x;
- chunk faster than causal SDPA (same B, H, d; scale 1) at T = 8192;
- chunk time at T = 8192 over T = 2048: <= 4.8 (linear in T: 4.0);
- tokens/s and peak memory of an MLP memory (specs/titans.yaml: depth 2, expansion 4) at 2048;
  its fwd+bwd is one cold run in a subprocess that also gives the peak memory (the backward
  keeps every token's weights: about 16 GiB at T = 2048, so the run needs that much free RAM);
- achieved GFLOP/s of the chunk path over the measured fp32 matmul rate (1024 x 1024).

FLOPs of the chunk path (the linear path: matrix memory, l2/none retention, gd), counted
analytically as matmul FLOPs (2 per multiply-add; elementwise work and the [b, b] decay masks
not counted), per chunk of n tokens, per batch and head, window c = 1:
    2 n Dk Dv    predictions y = W_e k for the chunk's errors (W_e = D_t W_S)
    2 n Dk Dv    the inter-chunk read  D_t W_S q
    2 n^2 Dk     scores q k^T
    2 n^2 Dv     the masked mix of the errors, [n, n] x [n, Dv]
    2 n Dk Dv    the state update, [Dv, n] x [n, Dk]
    = 6 n Dk Dv + 2 n^2 (Dk + Dv);  fwd+bwd counted as 3x the forward.

The machine may be shared: the 1-minute load average is printed at the start and the end. With
the cores oversubscribed, torch's two OpenMP threads wait on each other at every op, which slows
the many-small-op paths (the recurrence, the MLP memory) far more than the matmul-bound ones, so
read the figures only from a run whose load stayed near or below 2.

Peak memory: each measurement runs in a fresh subprocess, which resets the kernel's peak RSS
counter (writing 5 to /proc/self/clear_refs, Linux) right before the call and reads VmHWM after
it; the figure is VmHWM minus the RSS before the call (torch's CPU allocator keeps no peak
statistics, and tracemalloc does not see its allocations). Where clear_refs is not writable, it
falls back to the growth of getrusage's ru_maxrss (an underestimate when imports peaked higher).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import miras

ROOT = Path(__file__).resolve().parent.parent
B, H, D = 2, 4, 64
THREADS = 2
DEFAULT_CHUNK = 64
MATRIX_SPEC = ROOT / "specs" / "gated_deltanet.yaml"
MLP_SPEC = ROOT / "specs" / "titans.yaml"


# Inputs and calls ----------------------------------------------------------------------------


def make_inputs(rule, t: int, grad: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, t, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, t, H, D, generator=gen), dim=-1)
    v = torch.randn(B, t, H, D, generator=gen)
    ranges = {"decay": (0.9, 1.0), "lr": (0.1, 0.5), "momentum": (0.0, 0.9)}
    gates = {}
    for name in rule.gates:
        lo, hi = ranges[name]
        gates[name] = lo + (hi - lo) * torch.rand(B, t, H, generator=gen)
    leaves = [q, k, v, *gates.values()]
    for x in leaves:
        x.requires_grad_(grad)
    return q, k, v, gates


def memory_call(rule, t: int, backend: str, chunk_size: int, grad: bool):
    """A closure running the rule once: forward only, or forward and backward."""
    q, k, v, gates = make_inputs(rule, t, grad)
    weight = torch.randn(B, t, H, D, generator=torch.Generator().manual_seed(1))

    def run():
        if not grad:
            with torch.no_grad():
                rule(q, k, v, gates, backend=backend, chunk_size=chunk_size)
            return
        o, _ = rule(q, k, v, gates, backend=backend, chunk_size=chunk_size)
        (o * weight).sum().backward()

    return run


def sdpa_call(t: int, grad: bool):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, t, D, generator=gen) * 0.125 for _ in range(3))
    for x in (q, k, v):
        x.requires_grad_(grad)
    weight = torch.randn(B, H, t, D, generator=gen)

    def run():
        if not grad:
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
            return
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        (o * weight).sum().backward()

    return run


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_gflops(n: int = 1024, repeats: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds = median_time(lambda: torch.matmul(a, b), repeats, warmup=3)
    return 2 * n**3 / seconds / 1e9


def chunk_flops(t: int, chunk: int, dk: int = D, dv: int = D) -> float:
    """Matmul FLOPs of the linear chunk path's forward over B, H, T (module docstring)."""
    total = 0
    for start in range(0, t, chunk):
        n = min(chunk, t - start)
        total += 6 * n * dk * dv + 2 * n * n * (dk + dv)
    return B * H * total


# Peak memory in a subprocess -----------------------------------------------------------------


def measure_cold_call(spec: str, t: int, backend: str, chunk: int, grad: bool) -> dict:
    """In this (fresh) process: one cold call's time and peak RSS growth (MiB)."""
    rule = miras.compile(spec)
    fn = memory_call(rule, t, backend, chunk, grad)

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])  # KiB
        raise KeyError(key)

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (the peak RSS) to the current RSS
        before, method = status("VmRSS"), "VmHWM"
    except OSError:
        before, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    if method == "VmHWM":
        after = status("VmHWM")
    else:
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "peak_mib": (after - before) / 1024, "method": method}


def cold_call(spec: Path, t: int, backend: str, chunk: int, grad: bool) -> dict:
    """`measure_cold_call` in a subprocess running this script."""
    args = json.dumps([str(spec), t, backend, chunk, grad])
    out = subprocess.run(
        [sys.executable, __file__, "--threads", str(torch.get_num_threads()), "--child", args],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# The run --------------------------------------------------------------------------------------


def profile_chunk_forward(t: int = 2048, chunk: int = DEFAULT_CHUNK, rows: int = 15) -> str:
    rule = miras.compile(MATRIX_SPEC)
    fn = memory_call(rule, t, "chunk", chunk, grad=False)
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    threads = torch.get_num_threads()
    return (
        f"{cpu}, {threads} threads, torch {torch.__version__}, Python {platform.python_version()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median)")
    parser.add_argument("--profile", action="store_true", help="also profile the chunk forward")
    parser.add_argument("--threads", type=int, default=THREADS, help="torch threads (default 2)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one cold measurement
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure_cold_call(*json.loads(args.child))))
        return
    reps = args.repeats
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    matrix = miras.compile(MATRIX_SPEC)
    mlp = miras.compile(MLP_SPEC)
    rows: list[tuple[str, float, float, str]] = []  # (what, fwd s, fwd+bwd s, note)

    def both(label, make, repeats=reps, warmup=1, note=""):
        fwd = median_time(make(False), repeats, warmup)
        fwdbwd = median_time(make(True), repeats, warmup)
        rows.append((label, fwd, fwdbwd, note))
        print(f"  {label}: {fwd * 1e3:.1f} / {fwdbwd * 1e3:.1f} ms", file=sys.stderr)
        return fwd, fwdbwd

    peak_matmul = matmul_gflops()
    sweep = {
        chunk: both(
            f"gated_deltanet chunk b={chunk} T=2048",
            lambda g, c=chunk: memory_call(matrix, 2048, "chunk", c, g),
        )
        for chunk in (32, 64, 128)
    }
    chunk_2k = sweep[DEFAULT_CHUNK]
    chunk_8k = both(
        f"gated_deltanet chunk b={DEFAULT_CHUNK} T=8192",
        lambda g: memory_call(matrix, 8192, "chunk", DEFAULT_CHUNK, g),
    )
    # The recurrence takes tens of seconds: 2 timed runs, no warmup (the process is warm).
    rec = both(
        "gated_deltanet recurrent T=2048",
        lambda g: memory_call(matrix, 2048, "recurrent", 1, g),
        repeats=2,
        warmup=0,
        note="median of 2, no warmup",
    )
    sdpa_2k = both("causal SDPA T=2048", lambda g: sdpa_call(2048, g))
    sdpa_8k = both("causal SDPA T=8192", lambda g: sdpa_call(8192, g))
    # The MLP memory's backward holds every token's weights (O(T |W|) memory): one cold run,
    # in a subprocess that also measures its peak memory.
    mlp_fwd = median_time(memory_call(mlp, 2048, "chunk", DEFAULT_CHUNK, False), reps)
    cold = {
        (name, grad): cold_call(spec, 2048, "chunk", DEFAULT_CHUNK, grad)
        for name, spec in (("mlp", MLP_SPEC), ("matrix", MATRIX_SPEC))
        for grad in (False, True)
    }
    mlp_2k = (mlp_fwd, cold["mlp", True]["seconds"])
    rows.append(
        (
            f"titans mlp (depth 2, x4) chunk b={DEFAULT_CHUNK} T=2048",
            *mlp_2k,
            "fwd+bwd: 1 cold run",
        )
    )

    # Report --------------------------------------------------------------------------------
    print(f"\nRuntime benchmark, {datetime.date.today().isoformat()}: {machine()}")
    print(f"B={B} H={H} d={D} float32; median of {reps} runs after a warmup unless noted")
    load = f"{load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    print(f"1-minute load average: {load} (other processes share the cores)\n")
    print("| measurement | fwd (ms) | fwd+bwd (ms) | note |")
    print("| --- | ---: | ---: | --- |")
    for label, fwd, fwdbwd, note in rows:
        print(f"| {label} | {fwd * 1e3:.1f} | {fwdbwd * 1e3:.1f} | {note} |")

    flops = chunk_flops(2048, DEFAULT_CHUNK)
    gflops = (flops / chunk_2k[0] / 1e9, 3 * flops / chunk_2k[1] / 1e9)
    ratios = [
        ("chunk vs recurrent speedup, T=2048", rec[0] / chunk_2k[0], rec[1] / chunk_2k[1],
         ">= 20", lambda r: r >= 20),
        ("SDPA time / chunk time, T=2048", sdpa_2k[0] / chunk_2k[0], sdpa_2k[1] / chunk_2k[1],
         "", None),
        ("SDPA time / chunk time, T=8192", sdpa_8k[0] / chunk_8k[0], sdpa_8k[1] / chunk_8k[1],
         "> 1", lambda r: r > 1),
        ("chunk time T=8192 / T=2048", chunk_8k[0] / chunk_2k[0], chunk_8k[1] / chunk_2k[1],
         "<= 4.8", lambda r: r <= 4.8),
        ("chunk GFLOP/s, T=2048 (analytic count)", *gflops, "", None),
        ("chunk GFLOP/s / fp32 matmul GFLOP/s", gflops[0] / peak_matmul,
         gflops[1] / peak_matmul, "", None),
        ("titans mlp tokens/s, T=2048", B * 2048 / mlp_2k[0], B * 2048 / mlp_2k[1], "", None),
        ("titans mlp peak memory (MiB), T=2048", cold["mlp", False]["peak_mib"],
         cold["mlp", True]["peak_mib"], "", None),
        ("gated_deltanet chunk peak memory (MiB), T=2048", cold["matrix", False]["peak_mib"],
         cold["matrix", True]["peak_mib"], "", None),
    ]  # fmt: skip
    print(f"\nfp32 matmul 1024x1024: {peak_matmul:.1f} GFLOP/s")
    print(f"chunk-path forward at T=2048, b={DEFAULT_CHUNK}: {flops / 1e9:.3f} GFLOP (analytic)\n")
    print("| figure | fwd | fwd+bwd | goal |")
    print("| --- | ---: | ---: | --- |")
    for label, fwd, fwdbwd, target, check in ratios:
        verdict = ""
        if check is not None:
            verdict = f"{target}: fwd {_met(check(fwd))}, fwd+bwd {_met(check(fwdbwd))}"
        print(f"| {label} | {fwd:.3g} | {fwdbwd:.3g} | {verdict} |")
    best_fwd = min(sweep, key=lambda c: sweep[c][0])
    best_bwd = min(sweep, key=lambda c: sweep[c][1])
    print(f"\nchunk-size sweep at T=2048: fastest b={best_fwd} (fwd), b={best_bwd} (fwd+bwd)")
    print(f"peak memory: {cold['mlp', True]['method']} growth over one cold call in a subprocess")
    print(f"total benchmark time: {time.perf_counter() - started:.0f} s")

    if args.profile:
        print(f"\ntorch.profiler, chunk forward, gated_deltanet T=2048 b={DEFAULT_CHUNK}:")
        print(profile_chunk_forward())


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    main()
