"""benchmarks/kernel_profile.py: fla-core's Triton kernels beside ours, compiled for a GPU here.
The table is built from rows without compiling; one fla kernel is recorded from fla's own
wrapper and compiled for sm_90 (slow: fla's import and ptxas, about a minute)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import triton

from miras.checks import gpu_compile

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "kernel_profile", ROOT / "benchmarks" / "kernel_profile.py"
)
profile = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = profile
spec.loader.exec_module(profile)

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _row(**found):
    base = dict(registers=141, spills=0, stack=0, shared=73728, error="", mma=0, wgmma=12)
    base |= dict(fma_f32=32, ptxas_s=2.25, precision="-", dtype="bf16")
    base.update(found)
    return gpu_compile.Row(
        "fla", "chunk_fwd_kernel_o", "", 0, 4, 2, (32, 8), target="sm_90", **base
    )


def test_the_table_has_a_row_per_kernel_refusals_and_errors_named():
    entries = [
        ("fla", "gated_deltanet", 128, "bf16", "sm_90", _row()),
        ("miras", "gated_deltanet", 128, "bf16", "sm_90", "dtype: no bf16 yet"),
        ("fla", "gated_deltanet", 128, "bf16", "sm_90", _row(error="CompilationError: boom")),
    ]
    rows = profile.profile_table(entries)
    assert all(len(r) == len(profile.COLUMNS) for r in rows)
    assert rows[0] == (
        "fla", "gated_deltanet", "128", "bf16", "sm_90", "chunk_fwd_kernel_o", "0", "4", "2",
        "141", "0 B", "73728 B", "0 / 12", "32", "2.2",
    )  # fmt: skip
    assert rows[1][5] == "not built: dtype: no bf16 yet"
    assert rows[2][6].startswith("compile error: CompilationError: boom")
    text = profile.markdown(rows)
    assert text.splitlines()[0].startswith("| side | rule | d |") and len(text.splitlines()) == 5


def test_bad_arguments_name_the_allowed_values(capsys):
    with pytest.raises(SystemExit):
        profile.main(["--rules", "mamba", "--dry-run"])
    assert "--rules: expected some of gated_deltanet" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"dim: expected one of 64, 128, 256"):
        profile.main(["--dims", "96", "--dry-run"])


@pytest.mark.slow  # fla's import in a child process, then one ptxas compile: about a minute
@pytest.mark.extended  # the benchmark's peer, not miras: past make test's budget
@pytest.mark.skipif(not PTXAS.exists(), reason=f"the triton wheel's ptxas is absent ({PTXAS})")
def test_fla_s_output_kernel_compiles_to_fla_s_profile(tmp_path):
    """fla's retention output kernel (chunk_fwd_kernel_o) at K = V = 64, bf16, recorded from
    fla's own chunk_retention and compiled for sm_90 as an H100 would run it: on the tensor
    cores (wgmma), no spills, within the block's shared memory: the profile fla's kernels have,
    which a wrong dtype (float32 FMA loops) or a lost constexpr would not reproduce."""
    found = profile.fla_jobs("sm_90", ["retnet"], [64], ["bf16"])
    jobs = [job for _, _, _, job in found if job.kernel == "chunk_fwd_kernel_o" and job.config == 0]
    assert len(jobs) == 1
    (job,) = jobs
    constexprs = dict(job.constexprs)
    assert (constexprs["K"], constexprs["V"], constexprs["BT"]) == (64, 64, 64)
    assert constexprs["USE_G_GAMMA"] is True and ("tensor", "bfloat16") in constexprs.values()
    (row,) = gpu_compile.compile_jobs(jobs, gpu_compile.TARGETS["sm_90"], tmp_path)
    assert row.error == ""
    assert row.spills == 0 and row.local_stores == 0
    assert row.wgmma > 0 and row.fma_f32 < 100
    assert 0 < row.shared <= gpu_compile.TARGETS["sm_90"].shared_limit
