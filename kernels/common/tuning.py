"""Autotune configs of the chunk kernels and of the exact scan, and which of them a launch tries.

Each chunk kernel is `@triton.autotune(configs=configs(CHUNK), key=[...], prune_configs_by=PRUNE)`,
keyed on the chunk and the widths (CS or R, DK, DV; triton adds the dtypes). Their configs vary
num_warps and num_stages only: every block size is fixed by a buffer's layout (BT the chunk,
BK the whole feature width of the state tile, BV the value channels that the launcher sizes
the scratch buffers and the per-block gradient parts by), so none is free to tune. The exact
scan's buffers do not depend on its BV, so its configs (`scan_configs`, below) tune BV too.

num_stages 1 (the chunk kernels): the chunk loop carries the state, and the software
pipeliner's prefetch buffers would double the shared memory (past an H100's 227 KiB at
d = 128). The compile-only checks (`miras.checks.gpu_compile`) compile every config on sm_80 and sm_90.

maxnreg 255 (the most a thread may hold): left unstated, the ptxas that triton 3.9 ships (CUDA
13.4) gave the exact scan of before its rewrite (its state one [BV, Dphi] float32 tile, FMA
products) 32 registers a thread, the count that fills an SM with 2048 threads, and spilled the
state tiles to local memory: at d = 64 for sm_90, 32 registers and 19080 B of spill stores
unstated, 255 registers and 7000 B stated; the rewritten scan's "ieee" forward still gets 32
at BV 32 on 4 warps. One block of 8 warps at 255 registers uses 65280 of an SM's 65536, so
every config still launches.
"""

import triton

# (num_warps, num_stages) of the chunk kernels (general, linear).
CHUNK = ((4, 1), (8, 1))
# The chunk kernels that spill on 4 warps, 8 warps first (the first config is the one the
# interpreter and the compile checks in `make test` run). Compiled at Dphi = Dv = 128, chunk
# 64, BV 32: the linear backward's chunk-parallel kernel spills nothing on 8 warps on sm_90 and
# 124 to 136 B on 4 (its [64, 64] decay, score and gradient matrices stay live across the key
# tiles), the general backward nothing on 8 and 128 to 196 B on 4, `linear_output` nothing on
# 8 and 64 B on 4 (fp32 on sm_80; docs/kernels.md, "The GPU profile").
CHUNK_WIDE = ((8, 1), (4, 1))
MAX_REGISTERS = 255  # per thread: the hardware's limit on sm_80 and sm_90


def configs(choices) -> list:
    return [
        triton.Config({}, num_warps=warps, num_stages=stages, maxnreg=MAX_REGISTERS)
        for warps, stages in choices
    ]


def first_under_interpreter(configs, named_args, **kwargs) -> list:
    """The configs a launch benchmarks: all on a GPU; under TRITON_INTERPRET=1, which ignores
    num_warps and num_stages, the first alone (no benchmarking: the interpreter would run the
    kernel once per config and repeat, multiplying test time for identical results)."""
    if triton.knobs.runtime.interpret:
        return configs[:1]
    return configs


PRUNE = {"early_config_prune": first_under_interpreter}


# The exact scan (kernels/templates/exact.py): (BV, num_warps, num_stages), BV the value
# channels a program owns. Per head the state is NK key tiles [64, BV], as in fla's chunk state
# kernels; per channel a program also holds its channels' systems [BV, BR, BR], so BV is 16.
# Compiled at Dphi = Dv = 128, chunk 64 (docs/kernels.md, "The exact form: a Triton scan"):
# (32, 8, 1) spills nothing on sm_80 and sm_90, with bf16 and with tf32 operands, in 72 KB of
# shared memory or less; two stages prefetch the next chunk's tiles for more shared memory
# (up to 160 KiB at tf32 on sm_90, of the 227 KiB a block may use); BV 64 spills on 4 warps, so it runs
# on 8 (and still spills on sm_80 at d = 128: the autotuner weighs it).
SCAN = ((32, 8, 1), (32, 4, 2), (64, 8, 1))
SCAN_PER_CHANNEL = ((16, 8, 1), (16, 4, 1))  # 8 warps first: the systems spill less
SCAN_KEY = ["R", "DK", "DV", "HAS_F", "MOMENTUM", "PER_CHANNEL"]


def scan_configs() -> list:
    """The scan's configs: the per-head ones, then the per-channel ones, with the register cap
    stated (unstated, ptxas gives the "ieee" scan forward 32 registers at BV 32 on 4 warps,
    d = 64, and 7248 B of spills)."""
    return [
        triton.Config({"BV": bv}, num_warps=warps, num_stages=stages, maxnreg=MAX_REGISTERS)
        for bv, warps, stages in SCAN + SCAN_PER_CHANNEL
    ]


# Two stages prefetch a chunk's tiles into shared memory beside the current ones. Compiled for
# every covered spec (the whole compile matrix, docs/kernels.md), the per-head scan's two-stage
# config needs 246272 B in the backward at Dphi = 128 on sm_90 (of the 232448 B a block may
# use) and 303360 B in the forward at 256 (213504 B on sm_80, of 166912): a launch could never
# run it, so it is tried up to this width only.
TWO_STAGE_MAX_DK = 64


def scan_layout_configs(configs: list, per_channel: bool, dk: int | None = None) -> list:
    """The configs (of `scan_configs()`) for one layout, per head or per channel, at feature
    width `dk` (None: every width's)."""
    chosen = configs[len(SCAN) :] if per_channel else configs[: len(SCAN)]
    if dk is not None and dk > TWO_STAGE_MAX_DK:
        chosen = [c for c in chosen if c.num_stages == 1]
    return chosen


def scan_layout(configs, named_args, **kwargs) -> list:
    """The configs a scan launch tries: its layout's at its width (the first alone under the
    interpreter)."""
    chosen = scan_layout_configs(configs, kwargs.get("PER_CHANNEL", False), kwargs.get("DK"))
    return first_under_interpreter(chosen, named_args, **kwargs)


SCAN_PRUNE = {"early_config_prune": scan_layout}
