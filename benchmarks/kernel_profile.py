"""fla-core's Triton kernels beside ours for the same rules, compiled for a GPU on a machine
without one: registers, spill stores, shared memory, the PTX's tensor-core and scalar FMA
instructions, and ptxas's seconds, per kernel (docs/kernels.md, "Instruction mix and fla's
kernels"; fla-core 0.6.0's figures are the baseline issue 35's goals are measured against).

    python benchmarks/kernel_profile.py [--rules gated_deltanet,deltanet,retnet,linear_attention]
        [--targets sm_90,sm_80] [--dims 64,128] [--dtypes bf16,fp32] [--precision tf32]
        [--config 0|all] [--kernels NAME,...] [--no-ours] [--no-fla] [--dry-run]

fla's side: each rule's fla op (`chunk_gated_delta_rule`, `chunk_delta_rule`, `chunk_retention`,
`chunk_linear_attn`) runs forward and backward on meta tensors [B, T, H, D] inside
`gpu_compile.recording`, so every kernel it launches is recorded with the constexprs, the
heuristics' values and the grid fla's own wrappers give it; its autotune configs are fla's
(`--config 0`: the first). fla sizes those configs and some block sizes from the device when
it is imported (`check_shared_mem`, `IS_NVIDIA_HOPPER`), so the recording runs in a child
process per target whose Triton driver and torch.cuda answer as that GPU would
(`TargetDevice`). Ours: `gpu_compile.jobs` of specs/<rule>.yaml, what `miras kernel SPEC
--report` compiles, at the same width, dtype and (B, T, H). Both compile in gpu_compile's
worker (one child process without the interpreter, a fresh Triton cache, every compile forced),
cached under $MIRAS_CACHE_DIR/gpu_compile. `--dry-run` lists the jobs without compiling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = ("gated_deltanet", "deltanet", "retnet", "linear_attention")
SHAPE = (1, 2048, 8)  # (B, T, H): the report's default launch grid
COLUMNS = (
    "side", "rule", "d", "dtype", "target", "kernel", "config", "warps", "stages", "registers",
    "spills", "shared", "mma / wgmma", "fma.f32", "ptxas s",
)  # fmt: skip


class TargetDevice:
    """Triton's active driver, answering fla's hardware queries (current target, shared memory
    per block, SM count) as `target`'s GPU would; no launch goes through it (`recording`)."""

    def __init__(self, target):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", target.capability, 32)
        props = dict(max_shared_mem=target.shared_limit, multiprocessor_count=132)
        self.utils = types.SimpleNamespace(get_device_properties=lambda index: props)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def act_as(target) -> None:
    """Make this process's Triton driver and torch.cuda queries answer as `target`'s GPU, before
    fla is imported (it reads them at import)."""
    import torch
    from triton.runtime import driver

    driver.set_active(TargetDevice(target))
    name = {80: "NVIDIA A100", 90: "NVIDIA H100"}[target.capability]
    torch.cuda.get_device_capability = lambda *a: divmod(target.capability, 10)
    torch.cuda.get_device_name = lambda *a: name
    torch.cuda.device_count = lambda: 1


def run_fla(rule: str, d: int, dtype: str, shape=SHAPE) -> None:
    """fla's chunk op for `rule`, forward and backward, on meta tensors [B, T, H, d]: q, k, v
    (and beta) in `dtype`, the log-decay g in float32 as fla's layers pass it."""
    import torch

    batch, length, heads = shape
    operand = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]

    def meta(*size, dtype=operand):
        return torch.empty(size, dtype=dtype, device="meta", requires_grad=True)

    q, k, v = (meta(batch, length, heads, d) for _ in range(3))
    if rule == "gated_deltanet":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        g, beta = meta(batch, length, heads, dtype=torch.float32), meta(batch, length, heads)
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    elif rule == "deltanet":
        from fla.ops.delta_rule import chunk_delta_rule

        o, _ = chunk_delta_rule(q, k, v, meta(batch, length, heads))
    elif rule == "retnet":
        from fla.ops.retention import chunk_retention

        o, _ = chunk_retention(q, k, v)
    elif rule == "linear_attention":
        from fla.ops.linear_attn import chunk_linear_attn

        o, _ = chunk_linear_attn(q, k, v, normalize=False)
    else:
        raise ValueError(f"rule: expected one of {', '.join(RULES)}, got {rule!r}")
    o.backward(torch.empty_like(o))


def record_fla(target_name: str, rules, dims, dtypes, shape=SHAPE) -> list[dict]:
    """fla's jobs for every rule, width and dtype, recorded in this process acting as the
    target's GPU: [{"rule", "d", "dtype", "job": Job as a dict}], each kernel once per cell."""
    from miras.checks import gpu_compile

    act_as(gpu_compile.TARGETS[target_name])
    out = []
    for rule in rules:
        for d in dims:
            for dtype in dtypes:
                with gpu_compile.recording() as launched:
                    run_fla(rule, d, dtype, shape)
                seen = set()
                for job in gpu_compile.launched_jobs(launched, "fla", dtype=dtype):
                    key = job.key(gpu_compile.TARGETS[target_name])
                    if key not in seen:  # the backward recomputes forward kernels
                        seen.add(key)
                        out.append(dict(rule=rule, d=d, dtype=dtype, job=dataclasses.asdict(job)))
    return out


def _job(data: dict):
    from miras.checks import gpu_compile

    def plain(value):  # JSON's lists back to the tuples a Job holds
        return tuple(plain(v) for v in value) if isinstance(value, list) else value

    return gpu_compile.Job(**{k: plain(v) for k, v in data.items()})


def fla_jobs(target_name: str, rules, dims, dtypes, shape=SHAPE) -> list[tuple]:
    """(rule, d, dtype, Job) of fla's kernels for `target`, recorded in a child process (fla
    reads the device when imported, so one process per target)."""
    with tempfile.TemporaryDirectory(prefix="miras-fla-jobs-") as tmp:
        out = Path(tmp) / "jobs.json"
        spec = json.dumps(dict(rules=list(rules), dims=list(dims), dtypes=list(dtypes)))
        command = [sys.executable, __file__, "--record", target_name, spec, str(out)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"recording fla's kernels for {target_name} failed:\n{done.stderr[-3000:]}"
            )
        found = json.loads(out.read_text())
    return [(f["rule"], f["d"], f["dtype"], _job(f["job"])) for f in found]


def our_jobs(rules, dims, dtypes, precision: str, shape=SHAPE) -> list[tuple]:
    """(rule, d, dtype, Job or the launcher's refusal as text) of our kernels."""
    from miras.checks import gpu_compile

    out = []
    for rule in rules:
        for d in dims:
            for dtype in dtypes:
                path = ROOT / "specs" / f"{rule}.yaml"
                try:
                    found = gpu_compile.jobs(path, d, shape=shape, precision=precision, dtype=dtype)
                except ValueError as error:
                    out.append((rule, d, dtype, str(error)))
                    continue
                out += [(rule, d, dtype, job) for job in found]
    return out


def profile_table(entries) -> list[tuple[str, ...]]:
    """Text cells in COLUMNS' order, one per (side, rule, d, dtype, target, Row or refusal
    text): a refusal fills the row with its message."""
    rows = []
    for side, rule, d, dtype, target, row in entries:
        head = (side, rule, str(d), dtype, target)
        if isinstance(row, str):
            rows.append((*head, f"not built: {row}", *("-",) * (len(COLUMNS) - 6)))
            continue
        kernel = f"{row.kernel} ({row.variant})" if row.variant else row.kernel
        if row.error:
            rows.append((*head, kernel, f"compile error: {row.error[:120]}", *("-",) * 8))
            continue
        rows.append(
            (
                *head,
                kernel,
                str(row.config),
                str(row.num_warps),
                str(row.num_stages),
                str(row.registers),
                f"{row.spills} B",
                f"{row.shared} B",
                f"{row.mma} / {row.wgmma}",
                str(row.fma_f32),
                f"{row.ptxas_s:.1f}",
            )
        )
    return rows


def markdown(rows) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--targets", default="sm_90,sm_80")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--precision", default="tf32", help="tl.dot's precision of ours")
    parser.add_argument("--config", default="0", help="an autotune config index, or all")
    parser.add_argument("--kernels", default="", help="only kernels whose name holds one of these")
    parser.add_argument("--no-ours", action="store_true", help="fla's kernels only")
    parser.add_argument("--no-fla", action="store_true", help="our kernels only")
    parser.add_argument("--dry-run", action="store_true", help="list the jobs, compile nothing")
    parser.add_argument("--record", nargs=3, help=argparse.SUPPRESS)  # the child's entry
    args = parser.parse_args(argv)
    if args.record:
        target, spec, out = args.record
        spec = json.loads(spec)
        Path(out).write_text(json.dumps(record_fla(target, **spec), default=str))
        return

    from miras.checks import gpu_compile
    from miras.derive.emit import cache_dir

    rules = [r for r in args.rules.split(",") if r]
    for rule in rules:
        if rule not in RULES:
            parser.error(f"--rules: expected some of {', '.join(RULES)}, got {rule!r}")
    dims = [gpu_compile.check_width(int(d)) for d in args.dims.split(",")]
    dtypes = [gpu_compile.check_dtype(t) for t in args.dtypes.split(",")]
    targets = [gpu_compile.check_target(t) for t in args.targets.split(",")]
    if args.config != "all" and not args.config.isdigit():
        parser.error(f"--config: expected an index or 'all', got {args.config!r}")

    names = [n for n in args.kernels.split(",") if n]

    def chosen(job) -> bool:
        if names and not any(n in job.kernel for n in names):
            return False
        return args.config == "all" or job.config == int(args.config)

    cells = []  # (side, rule, d, dtype, target, Job or refusal)
    ours = [] if args.no_ours else our_jobs(rules, dims, dtypes, args.precision)
    for target in targets:
        found = [] if args.no_fla else fla_jobs(target.name, rules, dims, dtypes)
        for side, entries in (("fla", found), ("miras", ours)):
            for rule, d, dtype, job in entries:
                if isinstance(job, str) or chosen(job):
                    cells.append((side, rule, d, dtype, target, job))
    cells.sort(key=lambda c: (c[1], c[2], c[3], c[4].name, c[0]))
    if args.dry_run:
        for side, rule, d, dtype, target, job in cells:
            what = job if isinstance(job, str) else f"{job.kernel} config {job.config}"
            print(side, rule, d, dtype, target.name, what)
        print(f"{sum(not isinstance(c[5], str) for c in cells)} jobs")
        return
    pairs = [(c[5], c[4]) for c in cells if not isinstance(c[5], str)]
    compiled = iter(gpu_compile.start_compiles(pairs, cache_dir() / "gpu_compile", nice=10).rows())
    entries = [
        (*c[:4], c[4].name, c[5] if isinstance(c[5], str) else next(compiled)) for c in cells
    ]
    print(markdown(profile_table(entries)))


if __name__ == "__main__":
    main()
