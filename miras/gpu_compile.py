"""Compile-only checks of the Triton kernels for a GPU, on a machine without one.

    rows = compile_report(spec, "sm_90", d=128, shape=(B, T, H))   # the spec's default chunk
    problems = over_limits(rows)          # [] when every kernel fits the target

Triton's front end and the `ptxas` its wheel ships run without a device: every kernel a spec
runs on (`general`, `linear`, the exact `scan`; forward and backward) is compiled for the
target with the block sizes and constexprs the launcher would pass at that width
(`triton_backend.choose_kernels`, `Launch.meta`, `exact_triton.ScanLaunch.meta`) and with each
of the kernel's autotune configs (num_warps, num_stages). Each row holds what ptxas reports:
registers per thread, spill stores, shared memory per block, and the launch grid for a
(B, T, H) shape.

The interpreter (TRITON_INTERPRET=1) replaces `triton.jit` when triton is imported, and a
Triton cache hit skips ptxas (whose log holds registers and spills), so the compiles run in a
child process that does not interpret, with a fresh Triton cache (`python -m
miras.gpu_compile`, one per batch of kernels). Results are cached by the kernel's
source, constexprs, config and target: in this process, and on disk under `cache_dir`.
"""

from __future__ import annotations

import contextlib
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

# Arguments of the kernels that are integers (sizes and strides); every other non-constexpr
# argument is a pointer to float32 (`Launch` and `ScanLaunch` pass nothing else).
_SIZES = {"T", "CS", "NC", "DK", "DV", "R", "BH"}
_STRIDE = re.compile(r"^(g_\w+_(rs|sc)|(lw|ls|d|ce|te)_(w|c))$")


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
    """One kernel to compile: where its module is, its constexprs and config, plain data."""

    form: str  # "general", "linear" or "scan"
    kernel: str
    module: str  # a file path (an emitted module) or a dotted module name
    source_hash: str  # of the module's text
    constexprs: tuple[tuple[str, object], ...]  # ACC and DOT_PRECISION as text
    config: int  # index into the kernel's autotune configs
    num_warps: int
    num_stages: int
    grid: tuple[int, ...]  # the launch grid: 2 or 3 dimensions
    variant: str = ""  # the scan's layout: "per head" or "per channel"
    maxnreg: int | None = None  # the config's register cap per thread (None: ptxas chooses)

    def key(self, target: Target) -> str:
        text = json.dumps(
            [
                self.source_hash,
                self.kernel,
                self.constexprs,
                self.num_warps,
                self.num_stages,
                self.maxnreg,
                target.capability,
            ],
            default=str,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Row:
    """What ptxas reported for one job on one target (error: the compile's message)."""

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


def _configs(kernel, meta: dict) -> list[tuple[int, int, int | None]]:
    """(num_warps, num_stages, maxnreg) of each autotune config of a kernel (the launch's own,
    for a kernel without configs)."""
    if hasattr(kernel, "configs"):
        return [(c.num_warps, c.num_stages, c.maxnreg) for c in kernel.configs]
    return [(meta.get("num_warps", 4), meta.get("num_stages", 3), None)]  # triton's defaults


def _sha(text: str) -> str:
    """A module's hash for the cache: its text, the shared blocks it imports and the triton
    version (whose ptxas compiles it)."""
    import triton

    from miras.kernels.common import intra, math, state, tuning
    from miras.kernels.common import io as row_io

    shared = "".join(inspect.getsource(m) for m in (intra, row_io, math, state, tuning))
    return hashlib.sha256((text + shared + triton.__version__).encode()).hexdigest()[:16]


def _text(meta: dict) -> tuple[tuple[str, object], ...]:
    """Constexprs as plain data: triton dtypes by name."""
    out = []
    for name, value in meta.items():
        if name in ("num_warps", "num_stages"):
            continue
        out.append((name, str(value) if not isinstance(value, (bool, int, str)) else value))
    return tuple(out)


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
):
    """Every kernel `spec` runs on at head width d (Dk = Dv = d) and this chunk size (None: the
    spec's default, `default_chunk`), in every form it covers, with every autotune config, under
    tl.dot's input `precision` (ieee, tf32, tf32x3; None: the launcher's default, tf32): [Job].
    Raises ValueError when the Triton kernels do not cover the spec."""
    import torch
    import triton.language as tl

    from miras.runtime.inputs import DEFAULT_TRITON_PRECISION

    precision = precision or DEFAULT_TRITON_PRECISION

    from miras.compiler.pipeline import compile_ir, kernel_source
    from miras.compiler.triton_kernels import gate_plan, load_kernels
    from miras.runtime import exact_triton, triton_backend
    from miras.spec import load_spec

    spec = load_spec(spec)
    source = kernel_source(spec)  # raises when not covered
    compiled = compile_ir(spec)
    if chunk_size is None:
        chunk_size = default_chunk(spec)
    module = load_kernels(compiled)
    batch, length, heads = shape
    plan = gate_plan(spec)
    out: list[Job] = []
    choices = {False: "general"}
    if triton_backend.choose_kernels(compiled, d, d, per_channel_decay=False)[0]:
        choices[True] = "linear"
    if triton_backend.general_refusal(d, d) is not None:  # the launcher refuses these widths
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
        meta = launch.meta(tl.float32)
        grid = (launch.bh, launch.n_value_blocks)
        # The launcher's kernels (triton_backend._forward, _backward) and grids: the linear
        # forward is a sequential state kernel and a chunk-parallel output kernel.
        kernels = {f"{form}_forward": (grid, meta), f"{form}_backward": (grid, meta)}
        if linear:
            kernels = {
                "linear_state": (grid, meta | launch.state_meta),
                "linear_output": (launch.output_grid, meta),
                "linear_backward": (grid, meta),
            }
        for name, (kernel_grid, kernel_meta) in kernels.items():
            kernel = getattr(module, name)
            for i, (warps, stages, maxnreg) in enumerate(_configs(kernel, kernel_meta)):
                out.append(
                    Job(
                        form,
                        name,
                        module.__file__,
                        _sha(source),
                        _text(kernel_meta),
                        i,
                        warps,
                        stages,
                        kernel_grid,
                        maxnreg=maxnreg,
                    )
                )
    form = compiled.plan.chunk_form
    if exact_triton.applies(form, chunk_size):
        from miras.kernels.templates import exact

        scan_source = inspect.getsource(exact)
        rows = min(chunk_size, length) * spec.window.c
        step = compiled.plan.linear_step
        momentum = step is not None and step.stateful  # the scan carries S beside W
        for per_channel in (False, True):
            launch = exact_triton.ScanLaunch(
                batch * heads,
                -(-length // chunk_size),
                rows,
                d,
                d,
                has_f=True,
                momentum=momentum,
                per_channel=per_channel,
                widths=(1,) * 5,
                precision=precision,
            )
            meta = launch.meta(torch.empty(0, dtype=torch.float32))
            grid = (launch.bh, launch.value_blocks)
            variant = "per channel" if per_channel else "per head"
            for direction in ("forward", "backward"):
                name = f"exact_scan_{direction}"
                for i, (warps, stages, maxnreg) in enumerate(_configs(getattr(exact, name), meta)):
                    out.append(
                        Job(
                            "scan",
                            name,
                            exact.__name__,
                            _sha(scan_source),
                            _text(meta),
                            i,
                            warps,
                            stages,
                            grid,
                            variant,
                            maxnreg=maxnreg,
                        )
                    )
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
                "miras.gpu_compile",
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
    written before the worker forced every compile, from a Triton cache hit) is compiled
    again."""
    if not path.exists():
        return None
    found = json.loads(path.read_text())
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


_FOUND = ("registers", "spills", "stack", "shared", "error")


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


_DTYPES = {"fp32": lambda tl: tl.float32, "fp64": lambda tl: tl.float64}


def _compile_one(job: dict) -> dict:
    """Compile one job in this (non-interpreting) process; what ptxas said about it."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(_load(job["module"]), job["kernel"])
    fn = kernel.fn if hasattr(kernel, "configs") else kernel  # under the autotuner
    constexprs = {}
    for name, value in job["constexprs"]:
        constexprs[name] = _DTYPES[value](tl) if value in _DTYPES else value
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _SIZES or _STRIDE.match(name):
            signature[name] = "i32"
        else:  # torch allocations are 16-byte aligned, which the launch specializes on
            signature[name] = "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    target = GPUTarget("cuda", job["capability"], 32)
    options = dict(num_warps=job["num_warps"], num_stages=job["num_stages"])
    if job.get("maxnreg") is not None:
        options["maxnreg"] = job["maxnreg"]
    log = io.StringIO()
    triton.knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                ASTSource(fn, signature, constexprs, attrs), target=target, options=options
            )
    except Exception as error:  # a compile error is the finding: report it, do not raise
        return dict(
            registers=0,
            spills=0,
            stack=0,
            shared=0,
            error=f"{type(error).__name__}: {error}"[:2000],
        )
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
) -> list[Row]:
    """Every kernel of `spec` compiled for `target` at head width d and chunk size (None: the
    spec's default, `default_chunk`) under tl.dot's input `precision` (None: the launcher's
    default): one Row per kernel and autotune config."""
    found = check_target(target)
    check_width(d)
    return compile_jobs(jobs(spec, d, chunk_size, shape, precision), found, cache_dir)


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


COLUMNS = ("kernel", "layout", "warps", "stages", "grid", "registers", "spills", "shared", "fits")


def table(rows: list[Row]) -> list[tuple[str, ...]]:
    """The report as text cells, one tuple per row, in COLUMNS' order."""
    out = []
    for r in rows:
        limit = TARGETS[r.target].shared_limit
        if r.error:
            fits = "compile error"
        elif r.shared > limit:
            fits = f"no: shared > {limit}"
        elif r.spills > SPILL_BOUND:
            fits = f"no: spills > {SPILL_BOUND}"
        else:
            fits = "yes"
        out.append(
            (
                r.kernel,
                r.variant or "-",
                str(r.num_warps),
                str(r.num_stages),
                " x ".join(str(n) for n in r.grid),
                str(r.registers),
                f"{r.spills} B",
                f"{r.shared} B",
                fits,
            )
        )
    return out


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


if __name__ == "__main__":  # python -m miras.gpu_compile JOBS_FILE [NICE]
    _worker(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
