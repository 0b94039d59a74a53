"""Roofline of the chunk forms: time, counted FLOPs, elementwise bytes and where the time goes,
for every execution form against fla-core's pure-torch chunk references on the same inputs.

    .venv/bin/python benchmarks/roofline.py [--lengths 2048 8192] [--repeats 5] [--threads 2]
    .venv/bin/python benchmarks/roofline.py --quick        # T = 2048, 3 repeats, forward only
    .venv/bin/python benchmarks/roofline.py --scaling      # time(8192) / time(2048), alternated

CPU, float32, B = 2, H = 4, d = Dk = Dv = 64, chunk 64, `torch.set_num_threads(threads)`.
Forms (docs/chunking.md; `miras.runtime.run` picks one from the compiled `chunk_form` and
`chunk_mode`):
- exact: `specs/gated_deltanet.yaml`, `specs/deltanet.yaml`, `specs/retnet.yaml`
  (`chunk_mode="exact"`, miras/runtime/exact_chunk.py);
- linear chunk-start: gated_deltanet with `chunk_mode="start"` (miras/runtime/linear.py);
- general chunk-start: a matrix memory with elastic-net retention, l2 bias, gd (no linear
  step: miras/runtime/chunk.py's general path);
- dual: `specs/titans.yaml` (MLP depth 2, x4, momentum; miras/runtime/dual.py);
- recurrent: gated_deltanet on `backend="recurrent"`, the exact reference.
Peers, on the same q, k, v and gates: fla-core's `naive_chunk_gated_delta_rule` (Gated
DeltaNet), `delta_rule_chunkwise` (DeltaNet), `naive_chunk_simple_gla` (RetNet's scalar-decay
linear attention), `naive_recurrent_gated_delta_rule` beside the recurrence. Where
titans-pytorch is importable (the `benchmark` extra), the titans layer at training size (d_model
256, 4 heads of 64, depth 2, x4, chunk 16, B 2, T 2048) runs on miras's dual form and as
titans-pytorch's `NeuralMemory`, each run alone in a fresh process (benchmarks/deep_memory.py),
interleaved, with and without flush-to-zero of denormals on both sides: tokens/s of one
forward+backward (median of `--layer-repeats`) and the peak RSS above the process's baseline.

Each time is the median of `repeats` interleaved runs (every call of a row group once per
round, after one warmup round); "fwd" runs under torch.no_grad(), "fwd+bwd" adds the backward of
sum(o * w) with q, k, v and the gates requiring grad. A call whose warmup took longer than
`--budget` seconds is timed by that run alone. The backward of a per-token loop (the recurrences;
the general chunk-start path past T = 2048) is timed but not profiled: its millions of profiler
events outgrow the machine's memory; its counts print as nan. The counts come from one run under torch.profiler
(record_shapes): FLOPs of every matmul (mm, bmm, addmm, baddbmm: 2 m k n per product) and
triangular solve (m^2 k per system), bytes of every other leaf aten op that computes
(inputs plus an output the size of its largest input, at their element size; views and
allocations move nothing), and the shares of the profiled wall time in matmuls, solves,
elementwise ops and the rest (Python, dispatch, autograd bookkeeping). GFLOP/s is the counted
FLOPs over the median time, against a 1024^3 fp32 matmul measured in the same run on the
same threads.

`--scaling` measures only time(8192) / time(2048) of every miras call (the two `--lengths`),
each round running the short call and then the long one, and reports the median of the rounds'
ratios: between two separate runs at the two lengths the machine drifts (fla's unchanged
references moved by up to 2.1x within an hour, docs/benchmarks.md), which a ratio of their
medians carries whole. Beside each ratio it prints the minor page faults a token of each call
(the median over the rounds): pages the kernel mapped in afresh because the allocator had
given them back to the system, a cost that grows with the call's memory, not its work.

The 1-minute load average is printed at the start and the end. Where it exceeds the core
count plus 0.5 the cores were shared with other work, and every ratio is printed as
"not reported: load X" (the times and counts are still printed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import miras
from miras.components.base import HALF_OPEN_UNIT, UNIT

ROOT = Path(__file__).resolve().parent.parent
B, H, D = 2, 4, 64
CHUNK = 64
GENERAL_SPEC = {
    "name": "elastic_net_matrix",
    "description": "matrix memory, l2 bias, elastic-net retention, gd: the general chunk-start path",
    "bias": "l2",
    "retention": "elastic_net",
}
UNPROFILED = ("flops", "bytes", "wall", "matmul", "solve", "elementwise", "overhead")
# In place too (the exact form accumulates into preallocated results with baddbmm_).
MATMULS = {
    "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm",
    "aten::addmm_", "aten::baddbmm_", "aten::addbmm_",
}  # fmt: skip
SOLVES = {"aten::linalg_solve_triangular", "aten::triangular_solve"}
# Ops that only describe memory (views, metadata, allocation): no bytes move.
MOVES_NOTHING = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::transpose",
    "aten::permute", "aten::expand", "aten::expand_as", "aten::unsqueeze", "aten::squeeze",
    "aten::select", "aten::slice", "aten::unflatten", "aten::flatten", "aten::t", "aten::mT",
    "aten::numpy_T", "aten::alias", "aten::detach", "aten::empty", "aten::empty_like",
    "aten::empty_strided", "aten::resize_", "aten::diagonal", "aten::split",
    "aten::split_with_sizes", "aten::unbind", "aten::narrow", "aten::movedim", "aten::lift_fresh",
    "aten::_unsafe_view", "aten::chunk", "aten::unfold", "aten::view_as", "aten::set_",
    "aten::result_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
    "aten::to", "aten::_to_copy", "aten::contiguous", "aten::broadcast_tensors",
}  # fmt: skip


def gate_values(rule, t: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Per-head gates [B, T, H] inside each gate's range: a decay or momentum near 1 (0.9-1
    or 0-0.9), a step size 0.1-0.5."""
    gates = {}
    for info in rule.plan.gates:
        r = torch.rand(B, t, H, generator=gen)
        if info.allowed == UNIT:
            gates[info.name] = 0.9 + 0.1 * r
        elif info.allowed == HALF_OPEN_UNIT:
            gates[info.name] = 0.9 * r
        else:
            gates[info.name] = 0.1 + 0.4 * r
    return gates


def make_inputs(t: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, t, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, t, H, D, generator=gen), dim=-1)
    v = torch.randn(B, t, H, D, generator=gen)
    return q, k, v, gen


@dataclass
class Call:
    """One timed function of (q, k, v, gates) -> o [B, T, H, D], in a row group."""

    name: str
    form: str
    fn: object
    gates: dict[str, torch.Tensor]
    peer: bool = False
    times: dict[str, list[float]] = field(default_factory=dict)
    # A per-token loop's backward under torch.profiler records millions of events: fla's naive
    # recurrence at T = 2048 grew the process past 23 GB. Such a call's backward is timed, and
    # profiled only up to this length.
    profile_backward_to: int = 1 << 30


def miras_call(rule, mode: str, backend: str = "chunk"):
    def f(q, k, v, gates):
        return rule(q, k, v, gates, backend=backend, chunk_size=CHUNK, chunk_mode=mode)[0]

    return f


def fla_functions():
    """fla-core's reference functions, or {} where fla is not importable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fla warns at import that Triton has no GPU here
            from fla.ops.delta_rule.naive import delta_rule_chunkwise
            from fla.ops.gated_delta_rule.naive import (
                naive_chunk_gated_delta_rule,
                naive_recurrent_gated_delta_rule,
            )
            from fla.ops.simple_gla.naive import naive_chunk_simple_gla
    except ImportError:
        return {}
    return {
        "gdn_chunk": naive_chunk_gated_delta_rule,
        "gdn_recurrent": naive_recurrent_gated_delta_rule,
        "delta_chunk": delta_rule_chunkwise,
        "gla_chunk": naive_chunk_simple_gla,
    }


def titans_note() -> str | None:
    try:
        import titans_pytorch  # noqa: F401
    except ImportError:
        return "titans-pytorch is not importable here: the titans layer comparison is skipped"
    return None


def layer_case(case: str, length: int, threads: int, flush: bool, peak: bool) -> dict:
    """One forward+backward of a titans layer at training size, alone in a fresh process
    (benchmarks/deep_memory.py --one): miras's `MirasLayer(specs/titans.yaml)` on its dual form
    ("titans") or titans-pytorch's `NeuralMemory` ("titans-pytorch"), d_model 256, 4 heads of
    64, depth 2, x4, chunk 16, B 2. `peak`: glibc's mmap threshold fixed at 64 KiB, so freed
    tensors go back to the system and the peak is the memory alive (slower: read no speed
    from it); otherwise glibc's default allocator, the speed figure."""
    import subprocess
    import sys

    cmd = [sys.executable, str(ROOT / "benchmarks" / "deep_memory.py"), "--one", case,
           "auto" if case == "titans" else "-", str(length), "--threads", str(threads)]  # fmt: skip
    cmd += ["--flush-denormal"] * flush
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if peak:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RuntimeError(f"{case} at T {length} failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def titans_layers(length: int, repeats: int, threads: int) -> list[dict]:
    """miras's titans layer (dual form) against titans-pytorch: tokens/s, the median of
    `repeats` interleaved runs, with and without flush-to-zero of denormals (both sides alike),
    and the peak RSS above the process's baseline from one run each."""
    rows = []
    for flush in (False, True):
        runs: dict[str, list[dict]] = {"titans": [], "titans-pytorch": []}
        for _ in range(repeats):
            for case in runs:
                runs[case].append(layer_case(case, length, threads, flush, peak=False))
        for case, found in runs.items():
            peak = layer_case(case, length, threads, flush, peak=True)
            rows.append(dict(
                case=case, t=length, flush=flush, runs=len(found),
                tokens_per_s=statistics.median(r["tokens_per_s"] for r in found),
                cpu_seconds=statistics.median(r["cpu_seconds"] for r in found),
                peak_mib=peak["peak_mib"] - peak["base_mib"],
            ))  # fmt: skip
            r = rows[-1]
            print(f"  titans layer T {length} flush {flush}: {case} {r['tokens_per_s']:.0f} "
                  f"tokens/s ({r['runs']} runs), peak {r['peak_mib']:.0f} MiB above its base",
                  flush=True)  # fmt: skip
    return rows


def groups(t: int, quick: bool):
    """(row groups, (q, k, v)): each miras form beside its peers, timed interleaved."""
    q, k, v, gen = make_inputs(t)
    fla = fla_functions()
    gdn, delta, retnet = (
        compile_spec("gated_deltanet"),
        compile_spec("deltanet"),
        compile_spec("retnet"),
    )
    gdn_gates = gate_values(gdn, t, gen)
    lr, decay = gdn_gates["lr"], gdn_gates["decay"]
    out = []

    gdn_calls = [
        Call("miras exact", "exact", miras_call(gdn, "exact"), gdn_gates),
        Call("miras linear chunk-start", "linear chunk-start", miras_call(gdn, "start"), gdn_gates),
    ]
    if "gdn_chunk" in fla:
        naive = fla["gdn_chunk"]

        def fla_gdn(q, k, v, gates):
            g = gates["decay"].log()
            return naive(q, k, v, g, gates["lr"], chunk_size=CHUNK, scale=1.0)[0]

        gdn_calls.append(Call("fla naive_chunk_gated_delta_rule", "peer", fla_gdn, gdn_gates, True))
    out.append(("gated_deltanet", gdn_calls))

    delta_gates = {"lr": lr}
    delta_calls = [Call("miras exact", "exact", miras_call(delta, "exact"), delta_gates)]
    if "delta_chunk" in fla:
        chunkwise = fla["delta_chunk"]

        def fla_delta(q, k, v, gates):
            heads = [x.transpose(1, 2) for x in (q, k, v)]
            o, _ = chunkwise(*heads, gates["lr"].transpose(1, 2), chunk_size=CHUNK)
            return o.transpose(1, 2)

        delta_calls.append(Call("fla delta_rule_chunkwise", "peer", fla_delta, delta_gates, True))
    out.append(("deltanet", delta_calls))

    retnet_gates = {"decay": decay}
    retnet_calls = [Call("miras exact", "exact", miras_call(retnet, "exact"), retnet_gates)]
    if "gla_chunk" in fla:
        gla = fla["gla_chunk"]

        def fla_gla(q, k, v, gates):
            return gla(q, k, v, gates["decay"].log(), chunk_size=CHUNK, scale=1.0)[0]

        retnet_calls.append(Call("fla naive_chunk_simple_gla", "peer", fla_gla, retnet_gates, True))
    out.append(("retnet", retnet_calls))

    general = miras.compile(GENERAL_SPEC)
    out.append(
        ("elastic_net_matrix", [Call("miras general chunk-start", "general chunk-start",
                                     miras_call(general, "start"), gate_values(general, t, gen),
                                     profile_backward_to=2048)])
    )  # fmt: skip
    if not quick:
        titans = compile_spec("titans")
        out.append(
            ("titans", [Call("miras dual", "dual", miras_call(titans, "auto"), gate_values(titans, t, gen))])
        )  # fmt: skip
        rec = [
            Call("miras recurrent", "recurrent", miras_call(gdn, "auto", "recurrent"), gdn_gates,
                 profile_backward_to=0)
        ]  # fmt: skip
        if "gdn_recurrent" in fla:
            naive_rec = fla["gdn_recurrent"]

            def fla_rec(q, k, v, gates):
                g = gates["decay"].log()
                return naive_rec(q, k, v, gates["lr"], g, scale=1.0)[0]

            rec.append(
                Call("fla naive_recurrent_gated_delta_rule", "peer", fla_rec, gdn_gates, True,
                     profile_backward_to=0)
            )  # fmt: skip
        out.append(("gated_deltanet recurrent", rec))
    return out, (q, k, v)


def compile_spec(name: str):
    return miras.compile(ROOT / "specs" / f"{name}.yaml")


def run_once(call: Call, qkv, backward: bool, weight: torch.Tensor) -> float:
    q, k, v = qkv
    if not backward:
        with torch.no_grad():
            start = time.perf_counter()
            call.fn(q, k, v, call.gates)
            return time.perf_counter() - start
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    gates = {n: g.detach().clone().requires_grad_(True) for n, g in call.gates.items()}
    start = time.perf_counter()
    o = call.fn(*leaves, gates)
    (o * weight).sum().backward()
    return time.perf_counter() - start


def counts(call: Call, qkv, backward: bool, weight: torch.Tensor) -> dict[str, float]:
    """FLOPs, elementwise bytes and time shares of one profiled run."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        run_once(call, qkv, backward, weight)
        wall = time.perf_counter() - start
    flops = bytes_moved = 0.0
    share = {"matmul": 0.0, "solve": 0.0, "elementwise": 0.0}
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        self_s = e.self_cpu_time_total / 1e6
        shapes = [s for s in e.input_shapes if isinstance(s, list) and s]
        parent = e.cpu_parent.name if e.cpu_parent is not None else ""
        if e.name in MATMULS:
            if parent not in MATMULS:  # (c,) a, b: [.., m, k] x [.., k, n]
                a, b = shapes[-2], shapes[-1]
                batch = math.prod(a[:-2]) if len(a) > 2 else 1
                flops += 2 * batch * a[-2] * a[-1] * b[-1]
            share["matmul"] += self_s
        elif e.name in SOLVES:
            if parent not in SOLVES:
                a, rhs = shapes[0], shapes[1]
                flops += math.prod(rhs[:-2]) * a[-1] ** 2 * rhs[-1]
            share["solve"] += self_s
        elif e.name not in MOVES_NOTHING and parent not in MATMULS | SOLVES:
            share["elementwise"] += self_s
            computing = [c for c in e.cpu_children if c.name not in MOVES_NOTHING]
            sizes = [math.prod(s) for s in shapes]
            if sizes and not computing:  # a leaf that computes: its bytes, once
                bytes_moved += 4 * (sum(sizes) + max(sizes))
    share["overhead"] = max(0.0, wall - sum(share.values()))
    return {
        "flops": flops,
        "bytes": bytes_moved,
        "wall": wall,
        **{k: v / wall for k, v in share.items()},
    }


def page_faults() -> int:
    """This process's minor page faults so far: fresh pages the kernel mapped in (memory the
    allocator returned to the system and took again)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def scaling_rows(lengths, wanted, passes, repeats: int, budget: float, quick: bool) -> list[dict]:
    """time(long) / time(short) of every miras call, its two lengths alternated in each round
    (short, long, short, long, ...), so the machine's drift between them cancels: the median
    of the rounds' ratios, with each length's page faults a token (median). A call whose long
    warmup took more than `budget` seconds gets 2 rounds."""
    short, long = min(lengths), max(lengths)
    sets = {t: groups(t, quick) for t in (short, long)}
    weights = {
        t: torch.randn(qkv[2].shape, generator=torch.Generator().manual_seed(1))
        for t, (_, qkv) in sets.items()
    }
    rows = []
    for backward in passes:
        what = "fwd+bwd" if backward else "fwd"
        for (group, calls_s), (_, calls_l) in zip(sets[short][0], sets[long][0], strict=True):
            if wanted and group not in wanted:
                continue
            for c_s, c_l in zip(calls_s, calls_l, strict=True):
                if c_s.peer:
                    continue
                run_once(c_s, sets[short][1], backward, weights[short])  # warmups
                first = run_once(c_l, sets[long][1], backward, weights[long])
                ratios, faults = [], {short: [], long: []}
                for _ in range(repeats if first <= budget else 2):
                    f0 = page_faults()
                    a = run_once(c_s, sets[short][1], backward, weights[short])
                    f1 = page_faults()
                    b = run_once(c_l, sets[long][1], backward, weights[long])
                    faults[short].append((f1 - f0) / short)
                    faults[long].append((page_faults() - f1) / long)
                    ratios.append(b / a)
                rows.append(dict(spec=group, name=c_s.name, what=what, short=short, long=long,
                                 ratio=statistics.median(ratios), rounds=len(ratios),
                                 faults_short=statistics.median(faults[short]),
                                 faults_long=statistics.median(faults[long])))  # fmt: skip
                r = rows[-1]
                print(f"  {group} {c_s.name} {what}: time({long}) / time({short}) = "
                      f"{r['ratio']:.2f} (median of {len(ratios)} rounds); page faults a token "
                      f"{r['faults_short']:.1f} at {short}, {r['faults_long']:.1f} at {long}",
                      flush=True)  # fmt: skip
    return rows


def matmul_rate(size: int = 1024, repeats: int = 10, batch: int = 1) -> float:
    """FLOP/s of a [batch, size, size] x [batch, size, size] fp32 product (best of `repeats`)."""
    gen = torch.Generator().manual_seed(2)
    a, b = (torch.randn(batch, size, size, generator=gen) for _ in "ab")
    a @ b
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * batch * size**3 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=float, default=10.0, help="seconds; slower calls run once")
    parser.add_argument("--quick", action="store_true", help="T = 2048, 3 repeats, forward only")
    parser.add_argument(
        "--groups", nargs="+", default=None, metavar="SPEC",
        help="only these row groups (gated_deltanet, deltanet, retnet, elastic_net_matrix, "
        "titans, 'gated_deltanet recurrent')",
    )  # fmt: skip
    parser.add_argument(
        "--layer-repeats", type=int, default=None,
        help="runs of each titans layer (miras dual, titans-pytorch) per flush setting; 0: skip",
    )  # fmt: skip
    parser.add_argument(
        "--scaling", action="store_true",
        help="only time(long) / time(short) of every miras call, the two --lengths alternated "
        "in each round (the scaling goal; drift between the lengths cancels)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write every figure here")
    args = parser.parse_args()
    lengths = args.lengths or ([2048] if args.quick else [2048, 8192])
    repeats = args.repeats or (3 if args.quick else 5)
    passes = [False] if args.quick else [False, True]
    torch.set_num_threads(args.threads)
    cores = os.cpu_count() or 1
    load_start = os.getloadavg()[0]
    print(f"load average (1 min) at start: {load_start:.2f}; {cores} cores; threads {args.threads}")
    note = titans_note()
    if note:
        print(note)
    rate = matmul_rate()
    print(f"fp32 matmul rate (1024^3, {args.threads} threads): {rate / 1e9:.1f} GFLOP/s")
    # The chunk forms' products are [n, n] and [n, d] tiles batched over (B, H, chunks): their
    # own ceiling, in the same run (B H N = 2 * 4 * 32 at T = 2048, chunk 64).
    small = matmul_rate(CHUNK, repeats=20, batch=B * H * 32)
    print(f"fp32 batched {CHUNK}^3 matmul rate (batch {B * H * 32}): {small / 1e9:.1f} GFLOP/s "
          f"({small / rate:.0%} of the 1024^3 rate)")  # fmt: skip

    if args.scaling:
        scaling(args, lengths, passes, repeats, cores, load_start)
        return

    rows = []
    for t in lengths:
        row_groups, qkv = groups(t, args.quick)
        if args.groups:
            row_groups = [(g, calls) for g, calls in row_groups if g in args.groups]
        weight = torch.randn(qkv[2].shape, generator=torch.Generator().manual_seed(1))
        for backward in passes:
            what = "fwd+bwd" if backward else "fwd"
            for group, calls in row_groups:
                live = []
                for call in calls:  # warmup round; a call over budget is timed by it alone
                    first = run_once(call, qkv, backward, weight)
                    if first > args.budget:
                        call.times.setdefault(what, []).append(first)
                    live.append((call, 0 if first > args.budget else repeats))
                for i in range(repeats):
                    for call, n in live:
                        if i < n:
                            call.times.setdefault(what, []).append(
                                run_once(call, qkv, backward, weight)
                            )
                for call, _ in live:
                    if backward and t > call.profile_backward_to:
                        figures = dict.fromkeys(UNPROFILED, math.nan)
                    else:
                        figures = counts(call, qkv, backward, weight)
                    median = statistics.median(call.times[what])
                    rows.append(dict(
                        spec=group, name=call.name, form=call.form, t=t, what=what, peer=call.peer,
                        seconds=median, runs=len(call.times[what]), **figures,
                        gflops=figures["flops"] / median / 1e9,
                    ))  # fmt: skip
                    print(f"  T {t} {what} {group}: {call.name} {median * 1e3:.1f} ms "
                          f"({len(call.times[what])} runs), {figures['flops'] / 1e9:.2f} GFLOP, "
                          f"{figures['bytes'] / 1e6:.0f} MB elementwise; matmul "
                          f"{figures['matmul']:.0%}, solve {figures['solve']:.0%}, elementwise "
                          f"{figures['elementwise']:.0%}, overhead {figures['overhead']:.0%}",
                          flush=True)  # fmt: skip

    layer_repeats = (
        args.layer_repeats if args.layer_repeats is not None else (1 if args.quick else 3)
    )
    wanted = not args.groups or "titans" in args.groups
    layers = []
    if note is None and layer_repeats > 0 and wanted:
        layers = titans_layers(2048, layer_repeats, args.threads)

    load_end = os.getloadavg()[0]
    load = max(load_start, load_end)
    shared = load > cores + 0.5
    print(f"load average (1 min) at end: {load_end:.2f}")

    def ratio(x: float) -> str:
        return f"not reported: load {load:.1f}" if shared else f"{x:.2f}x"

    print()
    print("| spec | T | pass | call | time (ms) | GFLOP | GFLOP/s | % of matmul rate | "
          "elementwise MB | matmul | solve | elementwise | overhead | peer / miras |")  # fmt: skip
    print(
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for r in rows:
        mine = [x for x in rows if x["spec"] == r["spec"] and x["t"] == r["t"]
                and x["what"] == r["what"] and not x["peer"]]  # fmt: skip
        vs = ratio(r["seconds"] / mine[0]["seconds"]) if r["peer"] and mine else ""
        print(f"| {r['spec']} | {r['t']} | {r['what']} | {r['name']} | {r['seconds'] * 1e3:.1f} | "
              f"{r['flops'] / 1e9:.2f} | {r['gflops']:.1f} | {100 * r['gflops'] * 1e9 / rate:.0f}% | "
              f"{r['bytes'] / 1e6:.0f} | {r['matmul']:.0%} | {r['solve']:.0%} | "
              f"{r['elementwise']:.0%} | {r['overhead']:.0%} | {vs} |")  # fmt: skip

    print()
    print("Goals:")
    by = {(r["spec"], r["name"], r["t"], r["what"]): r for r in rows}
    fla_name = "fla naive_chunk_gated_delta_rule"
    for t in lengths:
        for what, goal in (("fwd", 2.0), ("fwd+bwd", 5.0)):
            mine, peer = (
                by.get(("gated_deltanet", "miras exact", t, what)),
                by.get(("gated_deltanet", fla_name, t, what)),
            )
            if mine and peer:
                x = peer["seconds"] / mine["seconds"]
                verdict = "" if shared else (" met" if x >= goal else " MISSED")
                print(f"- exact {what} vs fla at T {t}: {ratio(x)} (goal >= {goal:g}x){verdict}")
    if 8192 in lengths:
        r = by.get(("gated_deltanet", "miras exact", 8192, "fwd"))
        if r:
            pct = r["gflops"] * 1e9 / rate
            verdict = "" if shared else (" met" if pct >= 0.35 else " MISSED")
            shown = f"not reported: load {load:.1f}" if shared else f"{pct:.0%}"
            print(f"- exact fwd at T 8192: {shown} of the fp32 matmul rate (goal >= 35%){verdict}")
    if 2048 in lengths and 8192 in lengths:
        for (spec, name, t, what), r in by.items():
            if t != 8192 or r["peer"]:
                continue
            short = by.get((spec, name, 2048, what))
            if short:
                x = r["seconds"] / short["seconds"]
                verdict = "" if shared else (" met" if x <= 4.4 else " MISSED")
                shown = f"not reported: load {load:.1f}" if shared else f"{x:.2f}"
                print(
                    f"- {spec} {name} {what}: time(8192) / time(2048) = {shown} (goal <= 4.4){verdict}"
                )
    if layers:
        print()
        print("| titans layer, T 2048 | flush denormals | tokens/s | CPU s | peak MiB above base |")
        print("| --- | --- | ---: | ---: | ---: |")
        for r in layers:
            print(f"| {r['case']} | {'yes' if r['flush'] else 'no'} | {r['tokens_per_s']:.0f} | "
                  f"{r['cpu_seconds']:.1f} | {r['peak_mib']:.0f} |")  # fmt: skip
        for flush in (False, True):
            mine, peer = (
                next(r for r in layers if r["case"] == case and r["flush"] == flush)
                for case in ("titans", "titans-pytorch")
            )
            x = mine["tokens_per_s"] / peer["tokens_per_s"]
            verdict = "" if shared else (" met" if x >= 4 else " MISSED")
            memory = "no more" if mine["peak_mib"] <= peer["peak_mib"] else "MORE"
            print(
                f"- dual (titans) vs titans-pytorch tokens/s at T 2048, flush {flush}: "
                f"{ratio(x)} (goal >= 4x){verdict}; peak memory {memory} "
                f"({mine['peak_mib']:.0f} vs {peer['peak_mib']:.0f} MiB)"
            )
    if args.json:
        payload = dict(load_start=load_start, load_end=load_end, cores=cores,
                       threads=args.threads, matmul_rate=rate, small_matmul_rate=small,
                       rows=rows, layers=layers, note=note)  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1))


def scaling(args, lengths, passes, repeats: int, cores: int, load_start: float) -> None:
    """`--scaling`: the alternated ratios (`scaling_rows`), their table and the goal."""
    if len(set(lengths)) != 2:
        raise SystemExit(f"--scaling: give two --lengths, got {lengths}")
    rows = scaling_rows(lengths, args.groups, passes, repeats, args.budget, args.quick)
    load_end = os.getloadavg()[0]
    load = max(load_start, load_end)
    shared = load > cores + 0.5
    print(f"load average (1 min) at end: {load_end:.2f}")
    print()
    short, long = min(lengths), max(lengths)
    print(f"| spec | call | pass | time({long}) / time({short}) | rounds "
          f"| page faults a token, {short} / {long} |")  # fmt: skip
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for r in rows:
        shown = f"not reported: load {load:.1f}" if shared else f"{r['ratio']:.2f}"
        print(f"| {r['spec']} | {r['name']} | {r['what']} | {shown} | {r['rounds']} "
              f"| {r['faults_short']:.1f} / {r['faults_long']:.1f} |")  # fmt: skip
    goal = 1.1 * long / short  # the 4.4 for 2048 -> 8192: linear time, 10% spare
    print()
    print("Goals:")
    for r in rows:
        verdict = "" if shared else (" met" if r["ratio"] <= goal else " MISSED")
        shown = f"not reported: load {load:.1f}" if shared else f"{r['ratio']:.2f}"
        print(f"- {r['spec']} {r['name']} {r['what']}: time({long}) / time({short}) = {shown} "
              f"(goal <= {goal:.2f}){verdict}")  # fmt: skip
    if args.json:
        payload = dict(load_start=load_start, load_end=load_end, cores=cores,
                       threads=args.threads, scaling=rows)  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
