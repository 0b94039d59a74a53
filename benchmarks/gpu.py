"""The prepared GPU run: every check and timing a CUDA machine should make, in one command.

    .venv/bin/python benchmarks/gpu.py [--out gpu_report.json] [--budget 420]
    .venv/bin/python benchmarks/gpu.py --dry-run     # anywhere: what it would run, then exit 0

Three sections, written as one JSON file (`--out`) and printed as one table, a row per item as
it finishes:

1. check: every shipped spec (specs/*.yaml, specs/examples/*.yaml) that the Triton backend
   covers (`miras.compiler.triton_kernels.unsupported_reason`; the others are listed with the
   reason), in each chunk form it runs on triton ("exact" where the spec has the exact form,
   and "start", the chunk-start form, for every covered spec), float32 and bfloat16, T in
   512, 2048, 8192:
   `backend="triton"` against `backend="chunk"` on the same inputs (B = 1, H = 4, K = V = 128,
   the form's default chunk size), forward (the output and every final-state tensor) and
   backward (the gradients of q, k, v, every gate and every initial-state tensor, of one
   random linear functional). Relative RMS, worst over the tensors; it passes at 1e-4 in
   float32 and 1e-2 in bfloat16 (both backends compute in float32 from the same bfloat16
   inputs, so only roundings to bfloat16 differ; a wrong kernel is off by O(1)).
2. timing: miras on triton against fla's Triton ops through the same call on equal shapes
   (`miras.ops` aliases with `backend="triton"`), at fla's benchmark shapes (B, T, H, D) in
   FLA_SHAPES, (8, 1024, 8, 64) to (1, 8192, 16, 128), bfloat16 inputs, fp32 state on both
   sides, each at its default chunk (64): chunk_delta_rule, chunk_gated_delta_rule,
   chunk_simple_gla (retnet's rule), chunk_linear_attn (normalize=False, specs/
   linear_attention.yaml) and chunk_gated_delta_product (2 steps per token) where both
   miras.ops and fla have it; then titans-pytorch's NeuralMemory (an
   optional import) against a MirasLayer of the same sizes (d_model 256, 4 heads of 64, chunk
   16, B = 2, T = 2048, float32): its default MLP memory against specs/titans.yaml on the
   chunk backend (Triton does not cover MLP memories), and its depth-1 (matrix) memory against
   the matrix Titans spec on triton. Forward and forward+backward, each the median of
   `triton.testing.do_bench` (fla's timer: 25 ms warm-up, 100 ms of runs, L2 flushed); the
   linear-memory ops also in nominal TFLOP/s (below). A pair that runs past its cap (its first
   run compiles and autotunes the kernels) skips the later shapes of its op and D.
3. compile: the per-kernel compile report of every covered spec (registers, spills, shared
   memory and the module's own limits; `miras.checks.gpu_compile`, imported by the child
   process that writes it: where it is not there, the output says so and the run goes on) at the device's own target, D = 128,
   the spec's default chunk size and the timing shape's (B, T, H) for the launch grid, each
   passed under whichever name the report function gives it (`compile_item`). Compiling for
   a target is CPU work (Triton's front end and ptxas), so it runs in a child process on the
   CPU's cores from the start, alongside the GPU sections; its log and rows are
   `gpu_report.compile.log` and `.compile.json` beside `--out` (named after it).

The budget (an H200; `--budget`, default 420 s, scales every figure): check 55% (231 s) then
timing 45% (189 s) on the GPU, and the compile reports alongside for the whole 420 s. Items run
in order (check: T = 512 first, each T in float32 then bfloat16), each under a wall-clock cap
(SIGALRM): a check item 60 s (the first item of a spec and form includes its Triton compile;
later ones reuse it), a timing pair 40 s, a compile report 60 s, cut to what is left of the
section. An item that would start with under 3 s left is recorded as skipped, one that runs
past its cap as timed out (a Triton compile is a ptxas subprocess, which the alarm ends; the
spec and form's later items are then skipped, not compiled again), so no section overruns its
budget (by more than one CUDA call the alarm waits for); the compile child is ended at the
budget, the specs it did not reach recorded as skipped. The whole run ends within --budget plus
the start-up (imports, CUDA initialization, compiling the covered specs' rules: under a
minute), under 8 minutes.

Nothing is installed at run time: fla and titans-pytorch are used where importable and named
as absent otherwise. Without CUDA (and without --dry-run) it prints why and exits 0. The exit
status is 1 when a check fails, 0 otherwise (skipped and timed-out items are reported, not
failed).

TFLOP/s use one nominal count for both sides: the matmuls of a chunked linear-memory layer with
chunk C and head width D, per chunk and head 2 C D^2 for each of the state read, the
predictions and the state update, and 2 C^2 D for each of the intra-chunk scores and their
mixing: 6 D^2 + 4 C D per token and head forward, three times that forward plus backward.
Equal counts make the TFLOP/s ratio the inverse time ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import miras
from miras.checks.gpu_compile import default_chunk
from miras.compiler.triton_kernels import unsupported_reason
from miras.runtime.exact_chunk import default_chunk_size
from miras.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = (512, 2048, 8192)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}  # relative RMS, triton against chunk
CHECK_SHAPE = dict(batch=1, heads=4, dim=128)
TIMING_SHAPE = dict(batch=8, length=4096, heads=16, dim=128, chunk=64)  # the compile grid's
# (B, T, H, D) of the fla pairs: fla's own benchmark shapes, about 2^23 to 2^24 tokens x channels.
FLA_SHAPES = ((8, 1024, 8, 64), (4, 2048, 8, 64), (2, 4096, 16, 128), (1, 8192, 16, 128))
TITANS_SHAPE = dict(batch=2, length=2048, d_model=256, heads=4, chunk=16)
REPS = 10
BUDGET_S = 420.0
SHARES = {"check": 0.55, "timing": 0.45}  # the compile reports run alongside, in a child
ITEM_CAP_S = {"check": 60.0, "timing": 40.0, "compile": 60.0}
MIN_START_S = 3.0
TITANS_MATRIX = {
    "name": "titans_matrix",
    "memory": "matrix",
    "bias": "l2",
    "retention": "l2",
    "optimizer": "momentum",
}


# The plan ------------------------------------------------------------------------------------


def shipped_specs() -> list[Path]:
    return sorted((ROOT / "specs").glob("*.yaml")) + sorted(
        (ROOT / "specs" / "examples").glob("*.yaml")
    )


def spec_label(path: Path) -> str:
    return str(path.relative_to(ROOT / "specs").with_suffix(""))


@dataclass
class CheckPlan:
    """The check section: (spec, form) pairs on triton, and the specs it leaves out."""

    forms: list[tuple[str, str]] = field(default_factory=list)  # (spec label, chunk mode)
    left_out: dict[str, str] = field(default_factory=dict)  # spec label -> reason

    def items(self, lengths: tuple[int, ...] = LENGTHS) -> list[tuple[str, str, str, int]]:
        """(spec, form, dtype, T) in run order: T ascending, float32 before bfloat16."""
        return [
            (spec, form, dtype, t) for t in lengths for dtype in DTYPES for spec, form in self.forms
        ]


def check_plan() -> CheckPlan:
    """Covered specs are compiled (the chunk form decides whether "exact" is among their
    forms); the others are only loaded."""
    plan = CheckPlan()
    for path in shipped_specs():
        label = spec_label(path)
        reason = unsupported_reason(load_spec(path))
        if reason is not None:
            plan.left_out[label] = f"Triton does not cover it: {reason}"
            continue
        form = miras.compile(path).plan.chunk_form.form
        for mode in ("exact", "start") if form == "exact" else ("start",):
            plan.forms.append((label, mode))
    return plan


def installed(module: str) -> str | None:
    """None when `module` (dotted) is on the path, else why not; looked for, not imported:
    importing fla takes seconds (its Triton kernels), so the plan only looks for the files."""
    top, *rest = module.split(".")
    found = importlib.util.find_spec(top)
    if found is None:
        return f"{top} is not installed (this run installs nothing)"
    if rest:
        places = [Path(p).joinpath(*rest) for p in found.submodule_search_locations or []]
        if not any(p.is_dir() or p.with_suffix(".py").exists() for p in places):
            return f"{module} is not there (no such module in {top})"
    return None


def quiet_import(name: str):
    """A module, or the reason it is not importable (fla warns at import without a GPU)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name), None
    except Exception as err:  # an optional dependency: any import failure is reported
        return None, f"{name} is not importable ({type(err).__name__}: {err})"


@dataclass
class TimingPair:
    name: str
    miras: str  # what runs on the miras side
    other: str  # what it is timed against
    absent: str | None = None  # why the pair cannot run here, if it cannot
    shape: tuple[int, int, int, int] | None = None  # (B, T, H, D) of a fla pair
    op: str = ""  # the op both sides run (a fla pair), or the titans pair's name

    @property
    def family(self) -> tuple[str, int | None]:
        """(op, D): a pair whose first run compiles the kernels that pairs of the same family
        reuse (the kernels autotune on the chunk and the widths, not B, T, H)."""
        return self.op, self.shape[3] if self.shape else None


def timing_plan() -> list[TimingPair]:
    from miras import ops

    fla_ops = {  # the rules of specs/deltanet, gated_deltanet, retnet, linear_attention
        "chunk_delta_rule": "fla.ops.delta_rule",
        "chunk_gated_delta_rule": "fla.ops.gated_delta_rule",
        "chunk_simple_gla": "fla.ops.simple_gla",
        "chunk_linear_attn": "fla.ops.linear_attn",
        "chunk_gated_delta_product": "fla.ops.gated_delta_product",
    }
    pairs = []
    for op, module_name in fla_ops.items():
        why = f"miras.ops has no {op}" if not hasattr(ops, op) else installed(module_name)
        for shape in FLA_SHAPES:
            name = f"{op} B{shape[0]} T{shape[1]} H{shape[2]} D{shape[3]}"
            miras_side = f"miras.ops.{op}(backend='triton')"
            pairs.append(TimingPair(name, miras_side, f"{module_name}.{op}", why, shape, op))
    why = installed("titans_pytorch")
    pairs.append(
        TimingPair(
            "titans_mlp",
            "MirasLayer(specs/titans.yaml, backend='chunk')",
            "titans_pytorch.NeuralMemory(depth 2, expansion 4)",
            why,
            op="titans_mlp",
        )
    )
    pairs.append(
        TimingPair(
            "titans_matrix",
            "MirasLayer(titans matrix spec, backend='triton')",
            "titans_pytorch.NeuralMemory(depth 1)",
            why,
            op="titans_matrix",
        )
    )
    return pairs


# Running under a budget ----------------------------------------------------------------------


class ItemTimeout(Exception):
    """An item ran past its wall-clock cap."""


TIMEOUT_WORDS = "ran past its cap"


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise ItemTimeout in the main thread after `seconds` (SIGALRM: it also ends a Triton
    compile's ptxas subprocess, which subprocess.run kills when interrupted)."""

    def expire(signum, frame):
        raise ItemTimeout(f"{TIMEOUT_WORDS} of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Section:
    """A section's budget: each item runs under min(its cap, what is left)."""

    def __init__(self, name: str, budget: float, table: Table):
        self.name, self.budget, self.table = name, budget, table
        self.start = time.perf_counter()
        self.rows: list[dict] = []

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def run(self, item: str, fn: Callable[[], dict]) -> dict:
        left = self.left()
        if left < MIN_START_S:
            return self.skip(item, f"section budget spent ({left:.0f} s left)")
        cap = min(ITEM_CAP_S[self.name], left)
        start = time.perf_counter()
        try:
            with time_limit(cap):
                row = {"item": item, **fn()}
        except Exception as err:  # one item's failure is its row, not the run's end
            # The alarm can fire inside a custom autograd Function, which may re-raise it
            # wrapped: its message still names the cap.
            timeout = isinstance(err, ItemTimeout) or TIMEOUT_WORDS in str(err)
            reason = str(err) if timeout else f"{type(err).__name__}: {err}"
            row = {"item": item, "status": "timed out" if timeout else "error", "reason": reason}
        row["seconds"] = round(time.perf_counter() - start, 3)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return self.add(row)

    def skip(self, item: str, reason: str) -> dict:
        return self.add({"item": item, "status": "skipped", "reason": reason})

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.table.row(self.name, row)
        return row


class Table:
    """One table for the whole run, printed a row at a time."""

    WIDTHS = (8, 46, 10)

    def header(self) -> None:
        a, b, c = self.WIDTHS
        print(f"{'section':{a}s} {'item':{b}s} {'status':{c}s} result", flush=True)

    def row(self, section: str, row: dict) -> None:
        a, b, c = self.WIDTHS
        detail = row.get("summary") or row.get("reason", "")
        seconds = f" [{row['seconds']:.1f} s]" if "seconds" in row else ""
        line = f"{section:{a}s} {row['item']:{b}s} {row['status']:{c}s} {detail}{seconds}"
        print(line, flush=True)


# Check: triton against chunk -----------------------------------------------------------------


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(1e-30))


GATE_RANGES = {"decay": (0.9, 1.0), "momentum": (0.5, 0.9), "lr": (0.1, 0.5)}


def gates_for(rule, b, t, h, dtype, device, summed: int, gen) -> dict[str, torch.Tensor]:
    """In-range gates [B, T, H]: decays in [0.9, 1), momentum in [0.5, 0.9), learning rates in
    [0.1, 0.5) / `summed` (the tokens a chunk-start chunk sums at one state, as the layer
    starts it), any other gate in [0.5, 1.5), or [0.5, 0.9) of its bound where it has one."""
    out = {}
    for info in rule.plan.gates:
        top = info.allowed.hi
        default = (0.5, 1.5) if math.isinf(top) else (0.5 * top, 0.9 * top)
        lo, hi = GATE_RANGES.get(info.name, default)
        if info.name == "lr":
            lo, hi = lo / summed, hi / summed
        r = torch.rand(b, t, h, generator=gen, dtype=torch.float64)
        out[info.name] = (lo + (hi - lo) * r).to(device=device, dtype=dtype)
    return out


def state_tensors(state) -> list[torch.Tensor]:
    if state is None:
        return []
    return [state] if isinstance(state, torch.Tensor) else [state[n] for n in sorted(state)]


def random_state(rule, b, h, d, device, gen):
    """The rule's initial state with every tensor drawn at scale 0.1, in float32."""
    default = rule.initial_state(b, h, d, d)
    draw = lambda x: (0.1 * torch.randn(x.shape, generator=gen)).to(device)  # noqa: E731
    if isinstance(default, torch.Tensor):
        return draw(default)
    return {name: draw(x) for name, x in default.items()}


def check_item(spec: str, form: str, dtype_name: str, t: int, device, shape=CHECK_SHAPE) -> dict:
    """Triton against chunk for one spec, form, dtype and length: the worst relative RMS of the
    forward tensors and of the gradients."""
    rule = miras.compile(ROOT / "specs" / f"{spec}.yaml")
    dtype = DTYPES[dtype_name]
    b, h, d = shape["batch"], shape["heads"], shape["dim"]
    chunk = default_chunk_size(form, rule.spec.window.c)
    summed = 1 if form == "exact" else chunk
    gen = torch.Generator().manual_seed(t)
    q, k = (
        torch.nn.functional.normalize(torch.randn(b, t, h, d, generator=gen), dim=-1) for _ in "qk"
    )
    v = torch.randn(b, t, h, d, generator=gen)
    inputs = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    gates = gates_for(rule, b, t, h, dtype, device, summed, gen)
    init = random_state(rule, b, h, d, device, gen)
    results = {}
    for backend in ("chunk", "triton"):
        q, k, v = (x.clone().requires_grad_(True) for x in inputs)
        g = {n: x.clone().requires_grad_(True) for n, x in gates.items()}
        s0 = (
            init.clone().requires_grad_(True)
            if isinstance(init, torch.Tensor)
            else {n: x.clone().requires_grad_(True) for n, x in init.items()}
        )
        o, final = rule(
            q, k, v, g, backend=backend, chunk_size=chunk, chunk_mode=form,
            initial_state=s0, output_final_state=True,
        )  # fmt: skip
        outputs = [o, *state_tensors(final)]
        weights = torch.Generator().manual_seed(1)
        loss = sum(
            (x.float() * torch.randn(x.shape, generator=weights).to(device)).sum() for x in outputs
        )
        leaves = [q, k, v, *g.values(), *state_tensors(s0)]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        results[backend] = (outputs, [x for x in grads if x is not None])
    fwd = max(rel_rms(a, c) for a, c in zip(results["triton"][0], results["chunk"][0], strict=True))
    bwd = max(rel_rms(a, c) for a, c in zip(results["triton"][1], results["chunk"][1], strict=True))
    tol = TOLERANCE[dtype_name]
    ok = fwd <= tol and bwd <= tol  # NaN fails both
    return {
        "status": "ok" if ok else "FAILED",
        "spec": spec,
        "form": form,
        "dtype": dtype_name,
        "T": t,
        "chunk_size": chunk,
        "forward_rel_rms": fwd,
        "backward_rel_rms": bwd,
        "tolerance": tol,
        "summary": f"fwd {fwd:.1e} bwd {bwd:.1e} (tol {tol:.0e})",
    }


# Timing: miras on triton against fla and titans-pytorch ---------------------------------------


def timed(fn: Callable[[], object], reps: int = REPS) -> float:
    """Median milliseconds of fn(): `triton.testing.do_bench` on CUDA (fla's benchmarks' timer:
    a flushed L2 before each run, 25 ms of warm-up, 100 ms of runs), else the wall clock over
    `reps` runs after two warm-ups (the tests, on the CPU)."""
    cuda = torch.cuda.is_available()
    if cuda:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if not cuda:
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
            continue
        torch.cuda.synchronize()
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


def op_inputs(op: str, device, shape=FLA_SHAPES[0]) -> tuple[list[torch.Tensor], dict]:
    """Positional tensors (q, k, v, then the op's gates) and keyword arguments of one call at
    `shape` = (B, T, H, D), bfloat16 on `device`, every tensor a leaf that requires grad."""
    b, t, h, d = shape
    gen = torch.Generator().manual_seed(0)
    steps = 2 if op == "chunk_gated_delta_product" else 1

    def unit(n):
        return torch.nn.functional.normalize(torch.randn(b, n, h, d, generator=gen), dim=-1)

    q, k, v = unit(t), unit(t * steps), torch.randn(b, t * steps, h, d, generator=gen)
    beta = 0.1 + 0.4 * torch.rand(b, t * steps, h, generator=gen)
    g = torch.log(0.9 + 0.1 * torch.rand(b, t, h, generator=gen))
    tensors = {
        "chunk_delta_rule": [q, k, v, beta],
        "chunk_gated_delta_rule": [q, k, v, g, beta],
        "chunk_simple_gla": [q, k, v, g],
        "chunk_linear_attn": [q, k, v],
        "chunk_gated_delta_product": [q, k, v, g, beta],
    }[op]
    leaves = [x.to(device=device, dtype=torch.bfloat16).requires_grad_(True) for x in tensors]
    if op == "chunk_linear_attn":  # specs/linear_attention.yaml: no normalizer
        return leaves, {"normalize": False}
    return leaves, {"num_householder": steps} if steps > 1 else {}


def time_pair(fns: dict[str, Callable[[], torch.Tensor]], flops: float | None) -> dict:
    """Forward and forward+backward of each side: ms, TFLOP/s where `flops` is given, and the
    other side's time over miras's."""
    row: dict = {"status": "ok"}
    parts = []
    for label, factor, make in (
        ("fwd", 1.0, lambda f: f),
        ("fwd+bwd", 3.0, lambda f: lambda: f().float().sum().backward()),
    ):
        ms = {side: timed(make(fn)) for side, fn in fns.items()}
        entry = {f"{side}_ms": value for side, value in ms.items()}
        if flops is not None:
            entry |= {f"{side}_tflops": factor * flops / value / 1e9 for side, value in ms.items()}
        ratio = ms["other"] / ms["miras"]
        entry["other_over_miras_time"] = ratio
        row[label] = entry
        parts.append(
            f"{label} miras {ms['miras']:.2f} ms, other {ms['other']:.2f} ms ({ratio:.2f}x)"
        )
    row["summary"] = "; ".join(parts)
    return row


def fla_pair(op: str, module_name: str, device, shape=FLA_SHAPES[0]) -> dict:
    from miras import ops

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fla_fn = getattr(importlib.import_module(module_name), op)
    miras_fn = getattr(ops, op)
    leaves, kwargs = op_inputs(op, device, shape)
    fns = {  # both at their default chunk: 64 tokens (delta product: 64 // steps per token)
        "miras": lambda: miras_fn(*leaves, backend="triton", **kwargs)[0],
        "other": lambda: fla_fn(*leaves, **kwargs)[0],
    }
    linear = op in ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_simple_gla")
    linear |= op == "chunk_linear_attn"
    flops = nominal_flops(*shape, TIMING_SHAPE["chunk"]) if linear else None
    return dict(time_pair(fns, flops), shape=list(shape))


def miras_titans_layer(depth: int, d_model: int, heads: int, chunk: int):
    """The miras side of a titans-pytorch pair: the matrix Titans spec on triton (depth 1), or
    specs/titans.yaml (an MLP memory of depth 2) on the chunk backend, its exact form
    where the spec has one, else its compiled chunk form ("auto")."""
    from miras.models import MirasLayer

    if depth == 1:
        return MirasLayer(TITANS_MATRIX, d_model, heads, chunk_size=chunk, backend="triton")
    return MirasLayer(ROOT / "specs" / "titans.yaml", d_model, heads, chunk_size=chunk)


def titans_pair(depth: int, device) -> dict:
    from titans_pytorch import NeuralMemory

    s = TITANS_SHAPE
    d_model, heads, chunk = s["d_model"], s["heads"], s["chunk"]
    layer = miras_titans_layer(depth, d_model, heads, chunk)
    mem = NeuralMemory(
        dim=d_model, heads=heads, dim_head=d_model // heads, chunk_size=chunk, momentum=True,
        default_model_kwargs={"depth": depth, "expansion_factor": 4.0},
    )  # fmt: skip
    layer, mem = layer.to(device), mem.to(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(s["batch"], s["length"], d_model, generator=gen).to(device).requires_grad_(True)
    return time_pair({"miras": lambda: layer(x)[0], "other": lambda: mem(x)[0]}, None)


# Compile reports -------------------------------------------------------------------------------


# Where the per-kernel compile report lives (the first of these that is there).
COMPILE_MODULES = ("miras.checks.gpu_compile",)


def compile_module_name() -> tuple[str | None, str | None]:
    """(the compile report's module, None), or (None, why none is there): looked for, not
    imported."""
    reasons = []
    for name in COMPILE_MODULES:
        why = installed(name)
        if why is None:
            return name, None
        reasons.append(why)
    return None, "; ".join(reasons) + ": no compile report"


REPORT_FUNCTIONS = ("report", "compile_report", "kernel_report", "spec_report")
# The report function's parameters, by the names it may give them -> what this run passes.
REPORT_ARGUMENTS = {
    ("spec", "path", "rule", "source"): "spec",
    ("target", "arch", "sm"): "target",
    ("d", "dim", "head_dim", "d_head", "width"): "dim",
    ("chunk_size", "chunk"): "chunk",
    ("shape", "launch_shape"): "shape",
}


def compile_item(module, spec: str, target: str, dim: int) -> dict:
    """The module's per-kernel report of one spec at `target` and head width `dim`: its report
    function called with the arguments it names (the spec's path, the target, the width, the
    spec's default chunk size and the timing shape (B, T, H) for the launch grid), the result
    as plain JSON data."""
    fn = next((getattr(module, n) for n in REPORT_FUNCTIONS if hasattr(module, n)), None)
    if fn is None:
        public = sorted(n for n in dir(module) if not n.startswith("_"))
        return {
            "status": "error",
            "reason": f"{module.__name__} has none of {REPORT_FUNCTIONS} (it has {public})",
        }
    path = ROOT / "specs" / f"{spec}.yaml"
    values = {
        "spec": path,
        "target": target,
        "dim": dim,
        "chunk": default_chunk(path),
        "shape": (TIMING_SHAPE["batch"], TIMING_SHAPE["length"], TIMING_SHAPE["heads"]),
    }
    signature = inspect.signature(fn)
    args, kwargs = [], {}
    for name, param in signature.parameters.items():
        what = next((w for names, w in REPORT_ARGUMENTS.items() if name in names), None)
        if what is None:
            if param.default is inspect.Parameter.empty and param.kind not in (
                param.VAR_POSITIONAL, param.VAR_KEYWORD
            ):  # fmt: skip
                return {
                    "status": "error",
                    "reason": f"{fn.__name__}{signature}: no value for {name}",
                }
            continue
        if param.kind == param.POSITIONAL_ONLY:
            args.append(values[what])
        else:
            kwargs[name] = values[what]
    result = fn(*args, **kwargs)
    data = plain(result)
    kernels = data.get("kernels", data) if isinstance(data, dict) else data
    count = len(kernels) if isinstance(kernels, (list, dict)) else "?"
    # The module's own limits (shared memory per block, spills, compile errors), if it has them.
    problems = list(module.over_limits(result)) if hasattr(module, "over_limits") else []
    summary = f"{count} kernels at {target}, D = {dim}"
    return {
        "status": "over limits" if problems else "ok",
        "spec": spec,
        "target": target,
        "report": data,
        "problems": problems,
        "summary": f"{summary}: {'; '.join(problems)}" if problems else summary,
    }


def plain(x):
    """JSON data of a report: dataclasses and objects as dicts of their fields."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return plain(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return plain(vars(x)) if hasattr(x, "__dict__") else repr(x)


# Main ------------------------------------------------------------------------------------------


def dry_run(plan: CheckPlan, pairs: list[TimingPair], budget: float) -> int:
    items = plan.items()
    print(f"gpu.py --dry-run: what a CUDA run would do (budget {budget:.0f} s)")
    print(f"\ncheck ({SHARES['check'] * budget:.0f} s): {len(items)} items, triton against chunk")
    for spec, form, dtype, t in items:
        print(f"  check  {spec} {form} {dtype} T={t}")
    for spec, reason in plan.left_out.items():
        print(f"  not checked  {spec}: {reason}")
    print(f"\ntiming ({SHARES['timing'] * budget:.0f} s): {len(pairs)} pairs")
    for pair in pairs:
        state = "" if pair.absent is None else f"  [absent here: {pair.absent}]"
        print(f"  time  {pair.name}: {pair.miras} against {pair.other}{state}")
    name, why = compile_module_name()
    specs = len({s for s, _ in plan.forms})
    print(
        f"\ncompile (a child process on the CPU, alongside, {budget:.0f} s): {specs} specs, "
        f"by {name or 'nothing'}"
    )
    for spec in dict.fromkeys(s for s, _ in plan.forms):
        print(f"  compile  {spec}")
    if why is not None:
        print(f"  [absent here: {why}]")
    return 0


def meta(budget: float) -> dict:
    versions = {}
    for dist in ("torch", "triton", "fla-core", "titans-pytorch"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": list(torch.cuda.get_device_capability())
        if torch.cuda.is_available()
        else None,
        "python": platform.python_version(),
        "versions": versions,
        "budget_s": budget,
        "triton_precision": os.environ.get("MIRAS_TRITON_PRECISION"),
        "check_shape": CHECK_SHAPE,
        "timing_shape": TIMING_SHAPE,
        "fla_shapes": FLA_SHAPES,
        "titans_shape": TITANS_SHAPE,
    }


def run_all(
    device, plan: CheckPlan, pairs: list[TimingPair], budget: float, out: Path,
    shape: dict = CHECK_SHAPE, lengths: tuple[int, ...] = LENGTHS,
) -> int:  # fmt: skip
    """The three sections on `device` (CUDA; the CPU under TRITON_INTERPRET=1 in the tests, at
    a smaller `shape` and `lengths`), the report written to `out`. 1 when a check failed."""
    start = time.perf_counter()
    specs = list(dict.fromkeys(s for s, _ in plan.forms))
    # The compile reports run on the CPU's cores in a child process, alongside the GPU work.
    reports = start_compile_reports(specs, device_target(device), shape["dim"], budget, out)
    table = Table()
    table.header()
    check = Section("check", SHARES["check"] * budget, table)
    for spec, reason in plan.left_out.items():
        check.add({"item": spec, "status": "not checked", "reason": reason})
    stalled: dict[tuple[str, str], str] = {}  # (spec, form) -> its item that timed out
    for spec, form, dtype, t in plan.items(lengths):
        name, item = f"{spec} {form} {dtype} T={t}", (spec, form, dtype, t)
        if (spec, form) in stalled:  # its compile or its runs do not fit a cap: not again
            check.skip(name, f"{stalled[spec, form]} timed out")
            continue
        row = check.run(name, lambda a=item: check_item(*a, device, shape))
        if row["status"] == "timed out":
            stalled[spec, form] = name

    timing = Section("timing", SHARES["timing"] * budget, table)
    stalled_pairs: dict[tuple, str] = {}  # (op, D) -> its pair that timed out (its compile)
    for pair in pairs:
        if pair.absent is not None:
            timing.run(pair.name, lambda why=pair.absent: {"status": "absent", "reason": why})
        elif pair.family in stalled_pairs:
            timing.skip(pair.name, f"{stalled_pairs[pair.family]} timed out")
        elif pair.name.startswith("titans"):
            depth = 1 if pair.name == "titans_matrix" else 2
            timing.run(pair.name, lambda d=depth: titans_pair(d, device))
        else:
            module_name = pair.other.rsplit(".", 1)[0]
            row = timing.run(
                pair.name, lambda p=pair, m=module_name: fla_pair(p.op, m, device, p.shape)
            )
            if row["status"] == "timed out":
                stalled_pairs[pair.family] = pair.name

    compiles = Section("compile", budget, table)
    finish_compile_reports(compiles, reports, start + budget)

    sections = (check, timing, compiles)
    statuses = [row["status"] for section in sections for row in section.rows]
    counts = {status: statuses.count(status) for status in dict.fromkeys(statuses)}
    report = {
        "meta": meta(budget),
        "sections": {s.name: {"budget_s": s.budget, "rows": s.rows} for s in sections},
        "summary": counts,
    }
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\n{', '.join(f'{n} {s}' for s, n in counts.items())}; written to {out}")
    return 1 if counts.get("FAILED") else 0


@dataclass
class CompileReports:
    """The child process that writes the compile reports (`compile_only`), or why there is
    none."""

    specs: list[str]
    rows_path: Path
    process: subprocess.Popen | None = None
    absent: str | None = None


def start_compile_reports(specs, target: str, dim: int, budget: float, out: Path):
    name, why = compile_module_name()
    rows_path = out.with_name(out.stem + ".compile.json")
    if name is None:
        return CompileReports(specs, rows_path, absent=why)
    rows_path.unlink(missing_ok=True)
    log = out.with_name(out.stem + ".compile.log").open("w")
    command = [
        sys.executable, str(Path(__file__).resolve()), "--compile-only", name,
        "--target", target, "--dim", str(dim), "--budget", str(budget),
        "--out", str(rows_path), "--specs", *specs,
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    return CompileReports(specs, rows_path, process=process)


def finish_compile_reports(section: Section, reports: CompileReports, deadline: float) -> None:
    """Waits for the child until `deadline` (perf_counter seconds), ends it there, and adds its
    rows to `section`; a spec it did not reach is skipped."""
    if reports.process is None:
        section.add({"item": "compile report", "status": "absent", "reason": reports.absent})
        return
    try:
        reports.process.wait(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        reports.process.kill()
        reports.process.wait()
    rows = json.loads(reports.rows_path.read_text()) if reports.rows_path.exists() else []
    for row in rows:
        section.add(row)
    done = {row["item"] for row in rows}
    for spec in reports.specs:
        if spec not in done:
            why = f"the compile reports ended (exit status {reports.process.returncode})"
            section.skip(spec, f"{why} before it; see {reports.rows_path.stem}.log")


def compile_only(module_name: str, specs, target: str, dim: int, budget: float, out: Path) -> int:
    """The compile section on its own (the child process of a run): each spec's report under
    its cap, the rows rewritten to `out` (JSON) after each one."""
    module, why = quiet_import(module_name)
    section = Section("compile", budget, Table())
    for spec in specs:
        if module is None:
            section.add({"item": spec, "status": "error", "reason": why})
        else:
            section.run(spec, lambda s=spec: compile_item(module, s, target, dim))
        out.write_text(json.dumps(section.rows, default=str) + "\n")
    return 0


def device_target(device) -> str:
    """The compile target of `device`: sm_<major><minor> of a CUDA device, sm_90 otherwise."""
    if torch.device(device).type != "cuda":
        return "sm_90"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_report.json"))
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds, all sections")
    parser.add_argument("--dry-run", action="store_true", help="list the items and exit 0")
    # The compile reports' child process (start_compile_reports): needs no GPU.
    parser.add_argument("--compile-only", metavar="MODULE", help=argparse.SUPPRESS)
    parser.add_argument("--target", default="sm_90", help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, default=CHECK_SHAPE["dim"], help=argparse.SUPPRESS)
    parser.add_argument("--specs", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not math.isfinite(args.budget) or args.budget <= 0:
        parser.error(f"--budget: expected a positive number of seconds, got {args.budget}")
    if args.compile_only:
        return compile_only(
            args.compile_only, args.specs, args.target, args.dim, args.budget, args.out
        )
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu.py: no CUDA device here (torch.cuda.is_available() is False); this run needs "
            "a GPU, so there is nothing to do. --dry-run lists what it would run."
        )
        return 0
    plan, pairs = check_plan(), timing_plan()
    if args.dry_run:
        return dry_run(plan, pairs, args.budget)
    return run_all(torch.device("cuda"), plan, pairs, args.budget, args.out)


if __name__ == "__main__":
    sys.exit(main())
