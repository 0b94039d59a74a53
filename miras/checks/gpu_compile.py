"""Compile-only checks of the Triton kernels for a GPU, on a machine without one.

    rows = compile_report(spec, "sm_90", d=128, shape=(B, T, H))   # the spec's default chunk
    problems = over_limits(rows)          # [] when every kernel fits the target

Triton's front end and the `ptxas` its wheel ships run without a device: every kernel a spec
runs on (`general`, `linear`, the exact `scan`; forward and backward) is compiled for the
target as a launch at that width and shape would compile it. The jobs are recorded, not
rebuilt: the launchers' own code (`triton_backend.ChunkKernels`, `exact_triton.scan`) runs on
meta tensors inside `recording`, which captures each `kernel[grid](*args, **kwargs)`, and each
recorded launch becomes one job per autotune config (`launched_jobs`). The worker specializes
the arguments with Triton's own launch code (`launch_specialization`: ints equal to 1 become
constants, multiples of 16 get `tt.divisibility`). Each row holds what ptxas reports (registers
per thread, spill stores, shared memory per block), the PTX's instruction mix
(`instruction_mix`: tensor-core `mma.sync` / `wgmma.mma_async`, scalar `fma.rn.f32` / `f64`),
ptxas's seconds, and the launch grid for a (B, T, H) shape. benchmarks/kernel_profile.py
records and compiles fla-core's kernels the same way.

The interpreter (TRITON_INTERPRET=1) replaces `triton.jit` when triton is imported, and a
Triton cache hit skips ptxas (whose log holds registers and spills), so the compiles run in a
child process that does not interpret, with a fresh Triton cache (`python -m
miras.checks.gpu_compile`, one per batch of kernels). Results are cached by the kernel's source,
arguments, constexprs, config and target: in this process, and on disk under `cache_dir`
(entries of an older CACHE_VERSION are compiled again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from miras.errors import did_you_mean


@dataclass(frozen=True)
class Target:
    name: str
    capability: int  # GPUTarget("cuda", capability, 32)
    gpu: str
    shared_limit: int  # bytes of shared memory one block may use (with the opt-in)


TARGETS = {
    "sm_80": Target("sm_80", 80, "A100", 166912),  # 163 KiB
    "sm_90": Target("sm_90", 90, "H100/H200", 232448),  # 227 KiB
}
WIDTHS = (64, 128, 256)  # head widths Dk = Dv the checks cover

# Spill stores per thread, in bytes, that a kernel may reach. Spills are not errors (the
# kernel runs, slower: local memory is cached in L1/L2), so the bound is set where it says
# something: the float32 ("ieee") products of these kernels are FMA loops that ptxas cannot
# keep in registers at d = 128 (it reports tens of KB of spills there), so a bound of 0 would
# refuse every float32 kernel at the widths models use. 256 KiB is half of the 512 KiB of local
# memory a thread may address: a kernel past it is one retiling away from not launching.
SPILL_BOUND = 256 * 1024

# Results cached on disk before this version lack the instruction mix and ptxas's time (or were
# compiled without the launch's integer specialization): they are compiled again, not read.
CACHE_VERSION = 2


def check_target(target: str) -> Target:
    if target not in TARGETS:
        raise ValueError(
            f"target: expected one of {', '.join(TARGETS)}, got {target!r}"
            f"{did_you_mean(target, TARGETS)}"
        )
    return TARGETS[target]


def check_width(d: int) -> int:
    if d not in WIDTHS:
        allowed = ", ".join(str(w) for w in WIDTHS)
        raise ValueError(f"dim: expected one of {allowed} (the head width Dk = Dv), got {d}")
    return d


@dataclass(frozen=True)
class Job:
    """One kernel to compile: where its module is, the arguments a launch passes it, its
    config; plain data (a child process compiles it)."""

    form: str  # "general", "linear", "scan" (or, for another library's kernels, its name)
    kernel: str  # the @triton.jit function's name in `module`
    module: str  # a file path (an emitted module) or a dotted module name
    source_hash: str  # of the module's text
    # The launch's keyword arguments as plain data (`_plain`): its constexprs, the heuristics'
    # values and the config's own kwargs; ACC and DOT_PRECISION as text.
    constexprs: tuple[tuple[str, object], ...]
    config: int  # index into the configs a launch tries (the scan: its layout's, `gpu_configs`)
    num_warps: int
    num_stages: int
    grid: tuple[int, ...]  # the launch grid: 2 or 3 dimensions
    variant: str = ""  # the scan's layout: "per head" or "per channel"
    maxnreg: int | None = None  # the config's register cap per thread (None: ptxas chooses)
    # The launch's positional arguments as plain data: ints, floats, bools and None as passed
    # (Triton specializes on an int's value: 1 becomes a constant, a multiple of 16 is marked
    # divisible), a tensor as ("tensor", its dtype name).
    args: tuple = ()
    dtype: str = "fp32"  # the inputs' dtype the launch was built for (`INPUT_DTYPES`)

    def key(self, target: Target) -> str:
        text = json.dumps(
            [
                CACHE_VERSION,
                self.source_hash,
                self.module.rsplit("/", 1)[-1],
                self.kernel,
                self.args,
                self.constexprs,
                self.num_warps,
                self.num_stages,
                self.maxnreg,
                target.capability,
            ],
            default=str,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    @property
    def precision(self) -> str:
        """tl.dot's input precision the kernel was built with ("-" when it takes none)."""
        return str(dict(self.constexprs).get("DOT_PRECISION", "-"))


@dataclass(frozen=True)
class Row:
    """What ptxas reported for one job on one target, and the instruction mix of its PTX
    (error: the compile's message)."""

    form: str
    kernel: str
    variant: str
    config: int
    num_warps: int
    num_stages: int
    grid: tuple[int, ...]
    registers: int
    spills: int  # bytes of spill stores per thread
    stack: int  # bytes of stack frame per thread
    shared: int  # bytes of shared memory per block
    target: str
    error: str = ""
    mma: int = 0  # mma.sync instructions in the PTX (tensor cores, sm_80 and sm_90)
    wgmma: int = 0  # wgmma.mma_async instructions (sm_90's warp-group tensor cores)
    fma_f32: int = 0  # scalar fma.rn.f32 instructions
    fma_f64: int = 0  # scalar fma.rn.f64 instructions
    # ld.local / st.local in the PTX: local arrays Triton itself placed in local memory. ptxas's
    # register spills come later (in the SASS), so they are `spills`, not these.
    local_loads: int = 0
    local_stores: int = 0
    ptxas_s: float = 0.0  # seconds ptxas took (Triton's cubin stage)
    precision: str = "-"  # tl.dot's input precision of the job
    dtype: str = "fp32"  # the inputs' dtype of the job

    @property
    def tensor_core(self) -> int:
        return self.mma + self.wgmma


INPUT_DTYPES = ("fp32", "bf16")  # --dtype: the inputs' dtype a report's launches are built for
_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _torch_dtype(dtype: str):
    import torch

    return getattr(torch, _TORCH_DTYPES[dtype])


def check_dtype(dtype: str) -> str:
    if dtype not in INPUT_DTYPES:
        raise ValueError(
            f"dtype: expected one of {', '.join(INPUT_DTYPES)}, got {dtype!r}"
            f"{did_you_mean(dtype, INPUT_DTYPES)}"
        )
    return dtype


def _sha(text: str) -> str:
    """A module's hash for the cache: its text, the shared blocks it imports and the triton
    version (whose ptxas compiles it)."""
    import triton

    from miras.kernels.common import intra, math, state, tuning
    from miras.kernels.common import io as row_io

    shared = "".join(inspect.getsource(m) for m in (intra, row_io, math, state, tuning))
    return hashlib.sha256((text + shared + triton.__version__).encode()).hexdigest()[:16]


def _plain(value):
    """A launch argument as plain data: a tensor as ("tensor", dtype name), a triton dtype by
    its name; ints, floats, bools, strings and None as they are."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):  # a torch tensor
        return ("tensor", str(value.dtype).removeprefix("torch."))
    return str(value)  # a triton dtype (tl.float32 -> "fp32")


# Recording launches ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Launched:
    """One `kernel[grid](*args, **kwargs)` a launcher made while `recording`."""

    kernel: object  # what was indexed: a jit, interpreted, autotuned or heuristics kernel
    grid: object  # a tuple, or a callable of the launch's named arguments and constexprs
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def recording():
    """Within it, every Triton kernel launch (`kernel[grid](...)`, whatever wraps the kernel)
    is recorded instead of run: yields the list of `Launched`. The job building runs the
    launchers' own code on meta tensors (no memory, no device) inside it, so the jobs are the
    kernels, arguments and grids a launch at that shape passes."""
    from triton.runtime.jit import KernelInterface

    launched: list[Launched] = []

    def index(kernel, grid):
        return lambda *args, **kwargs: launched.append(Launched(kernel, grid, args, kwargs))

    original = KernelInterface.__getitem__
    KernelInterface.__getitem__ = index
    try:
        yield launched
    finally:
        KernelInterface.__getitem__ = original


def _layers(kernel) -> tuple[list, object]:
    """(the autotune / heuristics wrappers of a kernel, outermost first; the jit function)."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    wrappers = []
    while isinstance(kernel, (Autotuner, Heuristics)):
        wrappers.append(kernel)
        kernel = kernel.fn
    return wrappers, kernel


def gpu_configs(tuner, kwargs: dict) -> list:
    """The configs a launch with these keyword arguments tries on a GPU: the exact scan's
    layout's (`tuning.scan_layout`, its prune, also cuts to one under the interpreter, which
    the compile checks must not), every config of any other kernel."""
    from miras.kernels.common.tuning import scan_layout, scan_layout_configs

    if tuner.early_config_prune is scan_layout:
        return scan_layout_configs(
            tuner.configs, kwargs.get("PER_CHANNEL", False), kwargs.get("DK")
        )
    return list(tuner.configs)


_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")
_TRITON_DEFAULTS = dict(num_warps=4, num_stages=3)  # a launch's, where nothing states them


def launched_jobs(
    launched: list[Launched], form: str, variant: str = "", dtype: str = "fp32"
) -> list[Job]:
    """One Job per recorded launch and autotune config of its kernel: the constexprs a launch
    passes, the heuristics' values computed as `triton.heuristics` computes them (from the
    named arguments and the constexprs so far, outermost wrapper first), each config's kwargs
    and options; the grid evaluated as the launch evaluates a callable one."""
    from triton.runtime.autotuner import Autotuner

    out = []
    for launch in launched:
        wrappers, fn = _layers(launch.kernel)
        tuners = [w for w in wrappers if isinstance(w, Autotuner)]
        configs = gpu_configs(tuners[0], launch.kwargs) if tuners else [None]
        raw = fn.fn  # the Python function under the jit (or interpreter) wrapper
        module = sys.modules[raw.__module__]
        # A module of a package is imported by name in the child; an emitted one (no package,
        # a content-hash name) by its file.
        where = raw.__module__ if "." in raw.__module__ else module.__file__
        source_hash = _sha(Path(module.__file__).read_text())
        for index, config in enumerate(configs):
            kwargs = dict(launch.kwargs)
            for wrapper in wrappers:
                if isinstance(wrapper, Autotuner):
                    kwargs.update(config.all_kwargs())
                else:  # triton.heuristics: each value from the named arguments and kwargs
                    named = dict(zip(wrapper.arg_names, launch.args, strict=False))
                    for name, rule in wrapper.values.items():
                        kwargs[name] = rule({**named, **kwargs})
            options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
            options = {**_TRITON_DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
            grid = launch.grid
            if callable(grid):
                grid = grid({**dict(zip(fn.arg_names, launch.args, strict=False)), **kwargs})
            out.append(
                Job(
                    form,
                    raw.__name__,
                    where,
                    source_hash,
                    tuple((name, _plain(value)) for name, value in kwargs.items()),
                    index,
                    options["num_warps"],
                    options["num_stages"],
                    tuple(int(g) for g in grid),
                    variant,
                    maxnreg=options.get("maxnreg"),
                    args=tuple(_plain(a) for a in launch.args),
                    dtype=dtype,
                )
            )
    return out


def _recorded(run, form: str, variant: str, dtype: str) -> list[Job]:
    """The jobs of every launch `run()` makes, on meta tensors; a launcher that refuses the
    inputs' dtype (TypeError) is a ValueError naming the form and the dtype."""
    try:
        with recording() as launched:
            run()
    except TypeError as error:
        raise ValueError(
            f"dtype: the {form} kernels' launcher does not take {dtype} inputs yet ({error}); "
            f"compile them for {INPUT_DTYPES[0]} inputs"
        ) from None
    return launched_jobs(launched, form, variant, dtype)


def _meta(*shape, dtype="float32"):
    """A tensor with a shape and a dtype and no memory (torch's meta device), tracking grads."""
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype), device="meta", requires_grad=True)


def _backward(outputs) -> None:
    import torch

    outputs = [o for o in outputs if o is not None and o.requires_grad]
    torch.autograd.backward(outputs, [torch.empty_like(o) for o in outputs])


def _run_chunk_kernels(launch, dtype: str) -> None:
    """`triton_backend.ChunkKernels` forward and backward at the launch's sizes, with the
    tensors a GPU launch of `triton_backend.forward` hands them for inputs of `dtype`: q and k
    in a half dtype for the linear kernels (their products' operands), everything else
    float32 (the general kernels take the runtime's float32 copy of half inputs)."""
    from miras.runtime import triton_backend

    half = _torch_dtype(dtype) in triton_backend.HALF
    operand = _TORCH_DTYPES[dtype] if launch.linear and half else _TORCH_DTYPES["fp32"]
    bh, length, d_k, d_v = launch.bh, launch.length, launch.d_k, launch.d_v
    rows = launch.past + length
    window = set(launch.window_gates)
    gates = [
        _meta(bh, rows if name in window else length, width)
        for name, width in zip(launch.gate_names, launch.gate_widths, strict=True)
    ]
    q, k, v = (
        _meta(bh, length, d_k, dtype=operand),
        _meta(bh, rows, d_k, dtype=operand),
        _meta(bh, rows, d_v),
    )
    valid = _meta(bh, rows).detach()
    w0, s0 = _meta(bh, d_v, d_k), _meta(bh, d_v, d_k)
    _backward(triton_backend.ChunkKernels.apply(launch, q, k, v, valid, w0, s0, *gates))


def _run_dual(module, spec, d: int, chunk_size: int, shape, precision: str, dtype: str) -> None:
    """`dual_triton.run_kernel` and `run_backward` at Dk = Dv = d on meta tensors, as a GPU
    launch hands them for inputs of `dtype`: q and k in it (the products' operands), everything
    else float32; the forward stores the chunk starts the backward reads."""
    from miras.runtime import dual_triton
    from miras.runtime.triton_launch import HALF, pow2

    batch, length, heads = shape
    bh, n = batch * heads, min(chunk_size, length)
    chunks, bt = -(-length // n), pow2(n)
    operand = _TORCH_DTYPES[dtype] if _torch_dtype(dtype) in HALF else "float32"
    a_shape, b_shape = spec.memory.parameter_shapes(d, d).values()  # input layer first
    momentum = bool(module.MOMENTUM.value)
    state = [_meta(bh, *a_shape), _meta(bh, *b_shape)]
    state += [_meta(bh, *a_shape), _meta(bh, *b_shape)] if momentum else []
    mixing = (
        _meta(bh, length), _meta(bh, length), _meta(bh, chunks, bt, bt), _meta(bh, chunks, bt),
        _meta(bh, chunks, bt), _meta(bh, chunks, 4),
    )  # fmt: skip
    q, k = _meta(bh, length, d, dtype=operand), _meta(bh, length, d, dtype=operand)
    v, gamma = _meta(bh, length, d), _meta(bh, length)
    o, final, starts = dual_triton.run_kernel(
        module, q, k, v, gamma, mixing, state, chunk_size, precision, store_every=1
    )
    dual_triton.run_backward(
        module, q, k, v, gamma, mixing, starts, o, final, chunk_size, precision
    )


def _run_scan(batch, heads, chunks, rows, d, momentum, per_channel, precision, dtype) -> None:
    """`exact_triton.scan` forward and backward at these sizes, every gate per head: the
    prepared tensors in float32 (the state's dtype, as `exact_chunk.prepare` gives them) and
    the inputs' dtype as the scan's `operand_dtype` (it casts the keys and slopes itself)."""
    from miras.runtime import exact_triton

    operand = _torch_dtype(dtype)
    head = (batch, heads, chunks)
    slope = (*head, d, rows, rows) if per_channel else (*head, rows, d)
    base, keys = _meta(*head, rows, d), _meta(*head, rows, d)
    from_w = _meta(*slope)
    from_s = _meta(*slope) if momentum else None
    last_w = _meta(*head, rows, 1)
    last_s = _meta(*head, rows, 1) if momentum else None
    d_end = _meta(*head, 1)
    carry_end, theta_end = (_meta(*head, 1), _meta(*head, 1)) if momentum else (None, None)
    w0 = _meta(batch, heads, d, d)
    s0 = _meta(batch, heads, d, d) if momentum else None
    _backward(
        exact_triton.scan(
            base, keys, from_w, from_s, last_w, last_s, d_end, carry_end, theta_end, w0, s0,
            precision, operand,
        )
    )  # fmt: skip


def _gpu_launch(job: Job) -> Job:
    constexprs = tuple((k, False if k == "UPCAST" else v) for k, v in job.constexprs)
    return dataclasses.replace(job, constexprs=constexprs)


def default_chunk(spec) -> int:
    """The chunk size a layer of `spec` runs its kernels at when none is given
    (`exact_chunk.default_chunk_size`): 64 // window.c where the rule has the exact form (a
    chunk then solves 64 rows, and the scan's tiles are [64, .] whatever c is), 16 otherwise."""
    from miras.compiler.pipeline import compile_ir
    from miras.runtime.exact_chunk import default_chunk_size
    from miras.spec import load_spec

    spec = load_spec(spec)
    form = compile_ir(spec).plan.chunk_form.form
    return default_chunk_size("exact" if form == "exact" else "start", spec.window.c)


def jobs(
    spec,
    d: int,
    chunk_size: int | None = None,
    shape: tuple[int, int, int] = (1, 2048, 8),
    precision: str | None = None,
    dtype: str = "fp32",
):
    """Every kernel `spec` runs on at head width d (Dk = Dv = d) and this chunk size (None: the
    spec's default, `default_chunk`), in every form it covers, with every autotune config, under
    tl.dot's input `precision` (ieee, tf32, tf32x3; None: the launcher's default, tf32), for
    inputs of `dtype` (INPUT_DTYPES): [Job]. The launchers' own code runs on meta tensors
    (`recording`), so each job holds the kernel, arguments, constexprs and grid of a real launch
    at `shape` = (B, T, H). Raises ValueError when the Triton kernels do not cover the spec, or
    a launcher refuses `dtype`."""
    from miras.compiler.pipeline import compile_ir, kernel_source
    from miras.compiler.triton_kernels import gate_plan, load_kernels
    from miras.runtime import exact_triton, triton_backend
    from miras.runtime.inputs import DEFAULT_TRITON_PRECISION
    from miras.spec import load_spec

    precision = precision or DEFAULT_TRITON_PRECISION

    check_dtype(dtype)
    spec = load_spec(spec)
    kernel_source(spec)  # raises when not covered
    compiled = compile_ir(spec)
    if chunk_size is None:
        chunk_size = default_chunk(spec)
    module = load_kernels(compiled)
    batch, length, heads = shape
    if not spec.memory.linear:  # a deep memory: the dual form's kernel alone
        run = lambda: _run_dual(module, spec, d, chunk_size, shape, precision, dtype)  # noqa: E731
        return _recorded(run, "dual", "", dtype)
    plan = gate_plan(spec)
    out: list[Job] = []
    choices = {False: "general"}
    if triton_backend.choose_kernels(compiled, d, d, per_channel_decay=False)[0]:
        choices[True] = "linear"
    general_block = triton_backend.choose_kernels(compiled, d, d, per_channel_decay=True)[1]
    if triton_backend.general_refusal(d, general_block) is not None:  # the launcher refuses it
        del choices[False]
    for linear, form in choices.items():
        _, block_v = triton_backend.choose_kernels(
            compiled, d, d, per_channel_decay=not linear, precision=precision
        )
        launch = triton_backend.Launch(
            module=module,
            linear=linear,
            gate_names=plan.order,
            gate_widths=(1,) * len(plan.order),
            batch=batch,
            heads=heads,
            length=length,
            past=spec.window.c - 1,
            d_k=d,
            d_v=d,
            chunk_size=chunk_size,
            block_v=block_v,
            window_gates=plan.window,
            precision=precision,
        )
        out += _recorded(lambda launch=launch: _run_chunk_kernels(launch, dtype), form, "", dtype)
    if exact_triton.applies(compiled.plan.chunk_form, chunk_size):
        rows = min(chunk_size, length) * spec.window.c
        step = compiled.plan.linear_step
        momentum = step is not None and step.stateful  # the scan carries S beside W
        chunks = -(-length // chunk_size)
        for per_channel in (False, True):
            variant = "per channel" if per_channel else "per head"
            sizes = (batch, heads, chunks, rows, d, momentum, per_channel, precision, dtype)
            scan_jobs = _recorded(lambda sizes=sizes: _run_scan(*sizes), "scan", variant, dtype)
            # UPCAST is the interpreter's bf16 workaround (exact_triton.ScanLaunch.meta), set
            # when job building runs under TRITON_INTERPRET=1; a GPU launch passes False.
            out += [_gpu_launch(job) for job in scan_jobs]
    return out


# Compiling ------------------------------------------------------------------------------------

_DONE: dict[str, Row] = {}


def _row(job: Job, target: Target, found: dict) -> Row:
    return Row(
        job.form,
        job.kernel,
        job.variant,
        job.config,
        job.num_warps,
        job.num_stages,
        job.grid,
        target=target.name,
        precision=job.precision,
        dtype=job.dtype,
        **found,
    )


def compile_jobs(jobs: list[Job], target: Target, cache_dir: Path | None = None) -> list[Row]:
    """Compile every job for `target` (cached in this process and under `cache_dir`)."""
    return start_compiles([(job, target) for job in jobs], cache_dir).rows()


def start_compiles(
    pairs: list[tuple[Job, Target]], cache_dir: Path | None = None, nice: int = 0
) -> Compiles:
    """Start compiling each (job, target) pair not cached yet, in one child process (`nice`
    added to its niceness), and return at once: `rows()` of the result waits for the child. A
    caller may do other work meanwhile (the test suite starts its compile checks at collection,
    so ptxas runs on a core the other tests leave idle)."""
    todo: list[tuple[str, Job, Target]] = []
    for job, target in pairs:
        key = job.key(target)
        if key in _DONE or key in {k for k, _, _ in todo}:
            continue
        found = _cached(cache_dir / f"{key}.json") if cache_dir else None
        if found is not None:
            _DONE[key] = _row(job, target, found)
            continue
        todo.append((key, job, target))
    compiles = Compiles(pairs, todo)
    if not todo:
        return compiles
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    # The worker writes each result to the cache as it finishes (a batch of d = 256 kernels
    # takes many minutes; an interrupted run keeps what it compiled).
    payload = [
        dict(
            asdict(job),
            capability=target.capability,
            cache_file=str(cache_dir / f"{key}.json") if cache_dir is not None else None,
        )
        for key, job, target in todo
    ]
    # Jobs in a file and the child's output to files, not pipes: a pipe nobody reads while
    # the child runs for minutes would fill and stall it.
    compiles.files = Path(tempfile.mkdtemp(prefix="miras-gpu-compile-jobs-"))
    (compiles.files / "jobs.json").write_text(json.dumps(payload, default=str))
    # Always a child process: one that does not interpret, with a fresh Triton cache.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with (
        open(compiles.files / "stdout", "w") as out,
        open(compiles.files / "stderr", "w") as err,
    ):
        compiles.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "miras.checks.gpu_compile",
                str(compiles.files / "jobs.json"),
                str(nice),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env,
        )
    return compiles


def _cached(path: Path) -> dict | None:
    """A compile's result from the disk cache, or None. An entry without ptxas's counts (-1:
    written before the worker forced every compile, from a Triton cache hit), or without a
    field of this version's results (the instruction mix and ptxas's time, CACHE_VERSION 2),
    is compiled again: a missing count is never reported as 0."""
    if not path.exists():
        return None
    found = json.loads(path.read_text())
    if any(field not in found for field in _FOUND):
        return None
    return found if _has_counts(found) else None


def _has_counts(found: dict) -> bool:
    """Whether a compile's result holds ptxas's register, spill and stack counts (-1: its log
    had none)."""
    return min(found["registers"], found["spills"], found["stack"]) >= 0


@dataclass
class Compiles:
    """Compiles under way in a child process (`start_compiles`)."""

    pairs: list[tuple[Job, Target]]
    todo: list[tuple[str, Job, Target]]  # (cache key, job, target) the child compiles
    process: subprocess.Popen | None = None
    files: Path | None = None  # the child's jobs and output

    def rows(self) -> list[Row]:
        """One Row per pair, in order, once the child is done (raises if it failed)."""
        if self.process is not None:
            code = self.process.wait()
            out = (self.files / "stdout").read_text()
            err = (self.files / "stderr").read_text()
            self._clean()
            if code != 0:
                raise RuntimeError(f"gpu_compile worker failed:\n{err[-4000:]}")
            found = json.loads(out.splitlines()[-1])
            for (key, job, target), result in zip(self.todo, found, strict=True):
                _DONE[key] = _row(job, target, result)
        rows = []
        for job, target in self.pairs:
            done = _DONE[job.key(target)]
            # The same compiled kernel, with this job's own grid and config index.
            rows.append(_row(job, target, {f: getattr(done, f) for f in _FOUND}))
        return rows

    def cancel(self) -> None:
        """Stop the child if it still runs (what it compiled stays in the disk cache)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._clean()

    def _clean(self) -> None:
        self.process = None
        if self.files is not None:
            shutil.rmtree(self.files, ignore_errors=True)
            self.files = None


_FOUND = (
    "registers", "spills", "stack", "shared", "error",
    "mma", "wgmma", "fma_f32", "fma_f64", "local_loads", "local_stores", "ptxas_s",
)  # fmt: skip


def _load(module: str):
    import importlib
    import importlib.util

    if not module.endswith(".py"):
        return importlib.import_module(module)
    name = "miras_gpu_compile_" + Path(module).stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, module)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    sys.modules[name] = loaded
    return loaded


def _argument(value):
    """A job's argument back from plain data: a tensor as a `MockTensor` of its dtype (what
    `kernel.warmup` passes: its data_ptr is 0, 16-byte aligned as every torch allocation)."""
    import torch
    from triton.runtime.jit import MockTensor

    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == "tensor":
        return MockTensor(getattr(torch, value[1]))
    return value


def _constexpr(value):
    import triton.language as tl

    names = {"fp32": tl.float32, "fp64": tl.float64, "bf16": tl.bfloat16, "fp16": tl.float16}
    return names.get(value, value) if isinstance(value, str) else value


def launch_specialization(fn, args: list, kwargs: dict, capability: int):
    """(options, signature, constexprs, attrs) of a launch of the jit function `fn` with these
    positional arguments and keyword arguments (constexprs and options) on a CUDA target:
    Triton's own binder and `_pack_args`, the code `JITFunction.run` calls before it compiles.
    So an int equal to 1 becomes a constant, one divisible by 16 gets `tt.divisibility = 16`
    (as an aligned pointer does), and `do_not_specialize` is honoured, as at a launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", capability, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    return fn._pack_args(backend, kwargs, bound, specialization, options)


# Instructions counted in the PTX: tensor-core products, scalar FMAs, local-memory traffic.
_INSTRUCTIONS = {
    "mma": r"\bmma\.sync\.",
    "wgmma": r"\bwgmma\.mma_async\.",
    "fma_f32": r"\bfma\.rn\.f32\b",
    "fma_f64": r"\bfma\.rn\.f64\b",
    "local_loads": r"\bld\.local\.",
    "local_stores": r"\bst\.local\.",
}


def instruction_mix(ptx: str) -> dict[str, int]:
    """How many of each counted instruction the PTX text holds (static counts, not executed)."""
    return {name: len(re.findall(pattern, ptx)) for name, pattern in _INSTRUCTIONS.items()}


def _compile_one(job: dict) -> dict:
    """Compile one job in this (non-interpreting) process; what ptxas said about it."""
    import triton
    from triton.compiler import ASTSource

    _, fn = _layers(getattr(_load(job["module"]), job["kernel"]))
    kwargs = {name: _constexpr(_argument(value)) for name, value in job["constexprs"]}
    kwargs |= dict(num_warps=job["num_warps"], num_stages=job["num_stages"])
    if job.get("maxnreg") is not None:
        kwargs["maxnreg"] = job["maxnreg"]
    args = [_argument(a) for a in job["args"]]
    failed = dict(registers=0, spills=0, stack=0, shared=0, ptxas_s=0.0)
    failed |= {name: 0 for name in _INSTRUCTIONS}
    log, stages = io.StringIO(), {}

    def listen(*, times, **_):  # Triton's compile listener: microseconds per lowering stage
        stages.update(dict(times.lowering_stages))

    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.listener = listen
    try:
        options, signature, constexprs, attrs = launch_specialization(
            fn, args, kwargs, job["capability"]
        )
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                ASTSource(fn, signature, constexprs, attrs),
                target=triton.backends.compiler.GPUTarget("cuda", job["capability"], 32),
                options=options.__dict__,
            )
    except Exception as error:  # a compile error is the finding: report it, do not raise
        return dict(failed, error=f"{type(error).__name__}: {error}"[:2000])
    finally:
        triton.knobs.compilation.listener = None
    text = log.getvalue()

    def number(pattern: str) -> int:
        found = re.search(pattern, text)
        return int(found.group(1)) if found else -1

    found = dict(
        registers=number(r"Used (\d+) registers"),
        spills=number(r"(\d+) bytes spill stores"),
        stack=number(r"(\d+) bytes stack frame"),
        shared=int(compiled.metadata.shared),
        error="",
        ptxas_s=round(stages.get("cubin", 0) / 1e6, 2),
        **instruction_mix(compiled.asm["ptx"]),
    )
    if not _has_counts(found):  # never a silent pass
        found["error"] = f"ptxas printed no register, spill or stack count: {text[-500:]!r}"
    return found


def _worker(jobs_file: str, nice: int = 0) -> None:
    """Read jobs (JSON) from the file, compile each, print the results (JSON) as the last
    line; `nice` is added to this process's niceness first."""
    if nice:
        os.nice(nice)
    payload = json.loads(Path(jobs_file).read_text())
    with tempfile.TemporaryDirectory(prefix="miras-gpu-compile-") as tmp:
        # A fresh Triton cache, and every kernel compiled even so: a cache hit skips ptxas,
        # whose log holds registers and spills, and two specs' modules may hold the same
        # kernel function (one bias, two retentions), which Triton keys by its own source.
        os.environ["TRITON_CACHE_DIR"] = tmp
        os.environ["TRITON_ALWAYS_COMPILE"] = "1"
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        results = []
        for job in payload:
            results.append(_compile_one(job))
            if job["cache_file"] and not results[-1]["error"]:
                Path(job["cache_file"]).write_text(json.dumps(results[-1]))
    sys.stdout.write("\n" + json.dumps(results) + "\n")


# Reports --------------------------------------------------------------------------------------


def compile_report(
    spec,
    target: str,
    d: int = 128,
    chunk_size: int | None = None,
    shape=(1, 2048, 8),
    cache_dir=None,
    precision: str | None = None,
    dtype: str = "fp32",
) -> list[Row]:
    """Every kernel of `spec` compiled for `target` at head width d and chunk size (None: the
    spec's default, `default_chunk`) under tl.dot's input `precision` (None: the launcher's default), for inputs of `dtype`:
    one Row per kernel and autotune config."""
    found = check_target(target)
    check_width(d)
    return compile_jobs(jobs(spec, d, chunk_size, shape, precision, dtype), found, cache_dir)


def over_limits(rows: list[Row]) -> list[str]:
    """What does not fit: compile errors, shared memory over the target's limit, spills over
    SPILL_BOUND; one line each."""
    problems = []
    for r in rows:
        what = f"{r.kernel} {r.variant} (num_warps {r.num_warps}, num_stages {r.num_stages}) on {r.target}".replace(
            "  ", " "
        )
        limit = TARGETS[r.target].shared_limit
        if r.error:
            problems.append(f"{what}: does not compile: {r.error}")
        elif r.shared > limit:
            problems.append(
                f"{what}: {r.shared} bytes of shared memory, over the {limit} a block may use"
            )
        elif r.spills > SPILL_BOUND:
            problems.append(
                f"{what}: {r.spills} bytes of spill stores, over the bound {SPILL_BOUND}"
            )
    return problems


COLUMNS = (
    "kernel", "layout", "dot", "warps", "stages", "grid", "registers", "spills", "shared",
    "mma / wgmma", "fma.f32", "ptxas s", "fits",
)  # fmt: skip


def fits(r: Row) -> str:
    """'yes', or why a row does not fit its target."""
    limit = TARGETS[r.target].shared_limit
    if r.error:
        return "compile error"
    if r.shared > limit:
        return f"no: shared > {limit}"
    if r.spills > SPILL_BOUND:
        return f"no: spills > {SPILL_BOUND}"
    return "yes"


def table(rows: list[Row]) -> list[tuple[str, ...]]:
    """The report as text cells, one tuple per row, in COLUMNS' order: "dot" is tl.dot's input
    precision, the instruction counts are static counts in the PTX."""
    return [
        (
            r.kernel,
            r.variant or "-",
            r.precision,
            str(r.num_warps),
            str(r.num_stages),
            " x ".join(str(g) for g in r.grid),
            str(r.registers),
            f"{r.spills} B",
            f"{r.shared} B",
            f"{r.mma} / {r.wgmma}",
            str(r.fma_f32),
            f"{r.ptxas_s:.1f}",
            fits(r),
        )
        for r in rows
    ]


def parse_shape(text: str) -> tuple[int, int, int]:
    """'B,T,H' -> (B, T, H), each a positive integer."""
    parts = text.split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"shape: expected B,T,H (three positive integers), got {text!r}")
    return shape


if __name__ == "__main__":  # python -m miras.checks.gpu_compile JOBS_FILE [NICE]
    _worker(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
