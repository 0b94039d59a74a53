"""Deep (MLP) memories at training sizes: tokens/s and peak RSS of forward+backward, for each
way the chunk-start form runs (issue 13; docs/chunking.md, "The dual form" and "Bounded memory
for deep rules").

    .venv/bin/python benchmarks/deep_memory.py [--specs titans memora moneta atlas]
        [--lengths 1024 2048] [--paths auto bounded storing] [--titans-pytorch] [--threads 2]
        [--flush-denormal]

A `MirasLayer` from `specs/<name>.yaml` (the spec's own memory: depth 2, expansion 4) at
d_model 256, 4 heads of 64, chunk 16, B = 2, float32; one forward + backward of `sum(y * w)`
with x requiring grad. "auto" is the layer's default (`chunk_mode="auto"`: the dual form where
the compiler recorded it, titans; the bounded per-token path otherwise; the table names the
form), "bounded" the per-token path (`chunk_mode="start"`: only chunk-start states kept, one
chunk recomputed at a time in the backward), "storing" the per-token path before that
(autograd keeps every token's weights: the layer's `recompute=False`).

Each case runs alone in a fresh subprocess (so its peak is its own): `peak` is
the process's high-water RSS (`VmHWM`) after the run, `base` the RSS just before it
(imports, model, inputs), both in MiB. Each case runs with glibc's `MALLOC_MMAP_THRESHOLD_`
fixed (`--mmap-threshold`, default 64 KiB), so large tensors are mmapped and returned to the
system when freed: under glibc's default (a threshold that grows with the frees) the per-token
tensors a chunk frees stay in the heap, fragmented, and the peak reports several times the
memory alive (titans bounded, T = 2048: 2313 MiB peak against 700 MiB with the threshold).
The threshold costs time (every large allocation is a fresh mmap: page faults, 2-3x slower
here), so read tokens/s from a `--mmap-threshold 0` run and peaks from a default one. One timed
run per case; a miras layer is compiled and run once on one chunk without gradients before the
clock starts. "CPU s" is the process's CPU time over the same call (`time.process_time`): on a
machine shared with other jobs, wall time also counts the time the process waited for a core.
With `--titans-pytorch`, titans-pytorch's `NeuralMemory(dim=256, heads=4, dim_head=64,
chunk_size=16, momentum=True, default_model_kwargs={"depth": 2, "expansion_factor": 4})` runs
the same way (the `benchmark` extra of pyproject.toml; not a runtime dependency).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
D_MODEL, HEADS, CHUNK, BATCH = 256, 4, 16, 2


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident set (VmRSS) or its high-water mark (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def build(case: str, path: str):
    import torch

    if case == "titans-pytorch":
        from titans_pytorch import NeuralMemory

        mem = NeuralMemory(
            dim=D_MODEL,
            heads=HEADS,
            dim_head=D_MODEL // HEADS,
            chunk_size=CHUNK,
            momentum=True,
            default_model_kwargs={"depth": 2, "expansion_factor": 4.0},
        )
        return (lambda x: mem(x)[0]), "-"
    from miras.models import MirasLayer

    mode = "auto" if path == "auto" else "start"
    layer = MirasLayer(
        ROOT / "specs" / f"{case}.yaml",
        D_MODEL,
        HEADS,
        chunk_size=CHUNK,
        chunk_mode=mode,
        recompute=False if path == "storing" else None,
    )
    with torch.no_grad():  # compiles the rule and warms the imports outside the clock
        layer(torch.zeros(1, CHUNK, D_MODEL))
    form = layer.rule.plan.chunk_form.form if path == "auto" else "start"
    return (lambda x: layer(x)[0]), form


def one(case: str, path: str, length: int, threads: int, flush_denormal: bool) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.set_flush_denormal(flush_denormal)
    torch.manual_seed(0)
    fn, form = build(case, path)
    x = torch.randn(BATCH, length, D_MODEL, requires_grad=True)
    w = torch.randn(BATCH, length, D_MODEL)
    base = rss_mib()
    start, cpu_start = time.perf_counter(), time.process_time()
    (fn(x) * w).sum().backward()
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    # VmHWM, the high-water mark of this process's own memory map: ru_maxrss would report the
    # parent's resident set at the fork where that was larger (Linux keeps it across exec).
    peak = rss_mib("VmHWM")
    return {
        "case": case,
        "path": path,
        "form": form,
        "T": length,
        "seconds": seconds,
        "tokens_per_s": BATCH * length / seconds,
        "cpu_seconds": cpu_seconds,
        "base_mib": base,
        "peak_mib": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="+", default=["titans", "memora", "moneta", "atlas"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048])
    parser.add_argument("--paths", nargs="+", default=["auto", "bounded"])
    parser.add_argument("--titans-pytorch", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=65536,
        help="MALLOC_MMAP_THRESHOLD_ for each case (bytes; 0: glibc's default)",
    )
    parser.add_argument(
        "--flush-denormal",
        action="store_true",
        help="torch.set_flush_denormal(True) in each case (both sides): denormal floats in the "
        "decayed states otherwise slow the later chunks of a long sequence",
    )
    parser.add_argument("--one", nargs=3, metavar=("CASE", "PATH", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        case, path, length = args.one
        print(json.dumps(one(case, path, int(length), args.threads, args.flush_denormal)))
        return

    cases = [(s, p, t) for t in args.lengths for s in args.specs for p in args.paths]
    if args.titans_pytorch:
        cases += [("titans-pytorch", "-", t) for t in args.lengths]
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.processor()}")
    print(
        f"# load average at start: {os.getloadavg()}; MALLOC_MMAP_THRESHOLD_ {args.mmap_threshold}"
        f"; threads {args.threads}; flush denormals {args.flush_denormal}"
    )
    print("| layer | path (form) | T | s | tokens/s | CPU s | base MiB | peak MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case, path, length in cases:
        cmd = [sys.executable, __file__, "--one", case, path, str(length)]
        cmd += ["--threads", str(args.threads)] + ["--flush-denormal"] * args.flush_denormal
        env = dict(os.environ)
        if args.mmap_threshold:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["(no message)"]
            print(f"| {case} | {path} | {length} | failed: {tail[0]} | | | | |")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"| {case} | {path} ({r['form']}) | {length} | {r['seconds']:.1f} "
            f"| {r['tokens_per_s']:.0f} | {r['cpu_seconds']:.1f} | {r['base_mib']:.0f} "
            f"| {r['peak_mib']:.0f} |",
            flush=True,
        )
    print(f"# load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
