"""The compile-only checks that `make test` runs on every covered spec
(tests/kernels/test_gpu_compile.py): every kernel at d = 64 and chunk 16, the first autotune
config, on sm_80 and sm_90. ptxas takes a few seconds a kernel there (5 to 6 minutes of one
core for all 80 from a cold cache), so tests/conftest.py starts them in a child process
when collection ends (`start_early`), at a lower priority, and the test only waits for what is
left: the rest of the suite runs meanwhile on the other core."""

import glob
import sys
from pathlib import Path

import pytest
import triton

from miras.checks import gpu_compile
from miras.compiler.triton_kernels import unsupported_reason
from miras.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
HAS_PTXAS = sys.platform == "linux" and PTXAS.exists()
COVERED = [
    p for p in sorted(glob.glob(str(ROOT / "specs" / "*.yaml"))) if not unsupported_reason(load_spec(p))
]  # fmt: skip
EARLY_TEST = "test_every_kernel_of_every_covered_spec_compiles_small"
EARLY = pytest.StashKey["gpu_compile.Compiles"]()
SMALL_WIDTH, SMALL_CHUNK = 64, 16


def is_early(item) -> bool:
    """Whether a collected test is the one whose compiles `start_early` starts."""
    return getattr(item, "originalname", None) == EARLY_TEST


def cache_dir(config) -> Path:
    """Compile results, under pytest's cache directory (kept between runs)."""
    return config.cache.mkdir("gpu_compile")


def small_pairs() -> list[tuple[gpu_compile.Job, gpu_compile.Target]]:
    """(job, target): every kernel of every covered spec, every form, at SMALL_WIDTH and
    SMALL_CHUNK with the first autotune config, for each target."""
    jobs = [
        job
        for path in COVERED
        for job in gpu_compile.jobs(path, d=SMALL_WIDTH, chunk_size=SMALL_CHUNK)
        if job.config == 0
    ]
    return [(job, target) for target in gpu_compile.TARGETS.values() for job in jobs]


def start_early(config) -> None:
    """Start the small compiles in a child process (niceness +10), kept in config.stash[EARLY]
    and stopped at the end of the run if still going."""
    if not HAS_PTXAS or EARLY in config.stash:
        return
    compiles = gpu_compile.start_compiles(small_pairs(), cache_dir(config), nice=10)
    config.stash[EARLY] = compiles
    config.add_cleanup(compiles.cancel)
